package guestbench

import (
	"os"
	"path/filepath"
	"strings"

	sb "github.com/kvfs/kvfs/bench/serverbench"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// Machine describes where the benchmark ran and with what.
type Machine struct {
	sb.Host
	LoadBefore, LoadAfter  string
	QEMU, Kvfsd, Virtiofsd string
	Fio, Tcc, Make         string
	GuestKernel            string
}

func describeMachine(cfg Config, g vmtest.Guest) Machine {
	m := Machine{Host: sb.DescribeHost(), LoadBefore: sb.LoadAvg()}
	qemu := cfg.QEMU
	if qemu == "" {
		qemu = vmtest.DefaultQEMU
	}
	m.QEMU = sb.FirstLine(qemu, "--version")
	m.Kvfsd = sb.FirstLine(cfg.Kvfsd, "--version")
	if cfg.Rev != "" {
		m.Kvfsd += " (source " + cfg.Rev + ")"
	}
	m.Virtiofsd = sb.FirstLine(cfg.Virtiofsd, "--version")
	m.Fio = sb.FirstLine("fio", "--version")
	m.Tcc = sb.FirstLine("tcc", "-v")
	m.Make = sb.FirstLine("make", "--version")
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(g.Kernel), "kernel-version")); err == nil {
		m.GuestKernel = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}
