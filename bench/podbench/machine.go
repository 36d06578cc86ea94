package podbench

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/kvfs/kvfs/bench/report"
)

// Machine describes where the benchmark ran and with what.
type Machine struct {
	report.Host
	LoadBefore, LoadAfter  string
	QEMU, Containerd, Runc string
	Crictl                 string // the CRI benchmark's
	GuestKernel            string
}

func describeMachine(cfg Config, kernel string) Machine {
	m := Machine{Host: report.DescribeHost(), LoadBefore: report.LoadAvg()}
	m.QEMU = report.FirstLine(cfg.QEMU, "--version")
	m.Containerd = report.FirstLine(filepath.Join(cfg.BinDir, "containerd"), "--version")
	m.Runc = report.FirstLine("runc", "--version")
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(kernel), "kernel-version")); err == nil {
		m.GuestKernel = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}
