package podbench

import (
	"os"
	"path/filepath"
	"strings"

	sb "github.com/kvfs/kvfs/bench/serverbench"
)

// Machine describes where the benchmark ran and with what.
type Machine struct {
	sb.Host
	LoadBefore, LoadAfter  string
	QEMU, Containerd, Runc string
	Crictl                 string // the CRI benchmark's
	GuestKernel            string
}

func loadAvg() string { return sb.LoadAvg() }

func describeMachine(cfg Config, kernel string) Machine {
	m := Machine{Host: sb.DescribeHost(), LoadBefore: sb.LoadAvg()}
	m.QEMU = sb.FirstLine("qemu-system-x86_64", "--version")
	m.Containerd = sb.FirstLine(filepath.Join(cfg.BinDir, "containerd"), "--version")
	m.Runc = sb.FirstLine("runc", "--version")
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(kernel), "kernel-version")); err == nil {
		m.GuestKernel = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}
