package guestbench

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/vmtest"
)

// Machine describes where the benchmark ran and with what.
type Machine struct {
	CPUs                           int
	CPUModel, Kernel, MemTotal     string
	LoadBefore, LoadAfter          string
	QEMU, Kvfsd, Virtiofsd         string
	Fio, Tcc, GuestKernel, TmpfsFS string
}

func describeMachine(cfg Config, g vmtest.Guest) Machine {
	m := Machine{CPUs: runtime.NumCPU(), CPUModel: "unknown", LoadBefore: loadAvg(), TmpfsFS: "tmpfs"}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
				if kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64); err == nil {
					m.MemTotal = fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20))
				}
			}
		}
	}
	qemu := cfg.QEMU
	if qemu == "" {
		qemu = vmtest.DefaultQEMU
	}
	m.QEMU = firstLine(qemu, "--version")
	m.Kvfsd = firstLine(cfg.Kvfsd, "--version")
	if cfg.Rev != "" {
		m.Kvfsd += " (source " + cfg.Rev + ")"
	}
	m.Virtiofsd = firstLine(cfg.Virtiofsd, "--version")
	m.Fio = firstLine("fio", "--version")
	m.Tcc = firstLine("tcc", "-v")
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(g.Kernel), "kernel-version")); err == nil {
		m.GuestKernel = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}

func firstLine(bin string, args ...string) string {
	out, err := exec.Command(bin, args...).CombinedOutput()
	if err != nil && len(out) == 0 {
		return "unknown (" + err.Error() + ")"
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}
