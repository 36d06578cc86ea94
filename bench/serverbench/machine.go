package serverbench

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Machine describes where the benchmark ran.
type Machine struct {
	CPUs       int
	CPUModel   string
	Kernel     string
	MemTotal   string
	Go         string
	Virtiofsd  string // first line of --version
	Kvfsd      string
	FSType     string
	LoadBefore string
	LoadAfter  string
}

func describeMachine(cfg *Config, sh *share) Machine {
	m := Machine{CPUModel: "unknown", Go: runtime.Version(), FSType: sh.fsType, LoadBefore: loadAvg()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
				m.CPUModel = strings.TrimSpace(v)
				break
			}
		}
	}
	m.CPUs = runtime.NumCPU()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Sysname[:]) + " " + unix.ByteSliceToString(u.Release[:]) +
			" " + unix.ByteSliceToString(u.Machine[:])
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
	m.Virtiofsd = firstLine(cfg.Virtiofsd, "--version")
	m.Kvfsd = firstLine(cfg.Kvfsd, "--version")
	if cfg.Rev != "" {
		m.Kvfsd += " (source " + cfg.Rev + ")"
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
