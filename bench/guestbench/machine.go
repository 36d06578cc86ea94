package guestbench

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// Machine describes where the benchmark ran and with what.
type Machine struct {
	report.Host
	LoadBefore, LoadAfter  string
	QEMU, Kvfsd, Virtiofsd string
	Fio, Tcc, Make         string
	GuestKernel            string
}

func describeMachine(cfg Config, g vmtest.Guest) Machine {
	m := Machine{Host: report.DescribeHost(), LoadBefore: report.LoadAvg()}
	qemu := cfg.QEMU
	if qemu == "" {
		qemu = vmtest.DefaultQEMU
	}
	m.QEMU = report.FirstLine(qemu, "--version")
	m.Kvfsd = report.FirstLine(cfg.Kvfsd, "--version")
	if cfg.Rev != "" {
		m.Kvfsd += " (source " + cfg.Rev + ")"
	}
	m.Virtiofsd = report.FirstLine(cfg.Virtiofsd, "--version")
	m.Fio = report.FirstLine("fio", "--version")
	m.Tcc = report.FirstLine("tcc", "-v")
	m.Make = report.FirstLine("make", "--version")
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(g.Kernel), "kernel-version")); err == nil {
		m.GuestKernel = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}
