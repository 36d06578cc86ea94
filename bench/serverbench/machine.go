package serverbench

import (
	"runtime"

	"github.com/kvfs/kvfs/bench/report"
)

// Machine describes where the benchmark ran.
type Machine struct {
	report.Host
	Go         string
	Virtiofsd  string // first line of --version
	Kvfsd      string
	FSType     string
	LoadBefore string
	LoadAfter  string
}

func describeMachine(cfg *Config, sh *share) Machine {
	m := Machine{Host: report.DescribeHost(), Go: runtime.Version(), FSType: sh.fsType, LoadBefore: report.LoadAvg()}
	m.Virtiofsd = report.FirstLine(cfg.Virtiofsd, "--version")
	m.Kvfsd = report.FirstLine(cfg.Kvfsd, "--version")
	if cfg.Rev != "" {
		m.Kvfsd += " (source " + cfg.Rev + ")"
	}
	return m
}
