package guestbench

import (
	"fmt"
	"regexp"
)

// Unit says what a result measures and which way is better.
type Unit int

const (
	IOPS      Unit = iota // operations per second, higher is better
	MiBPerSec             // MiB per second, higher is better
	Seconds               // time taken, lower is better
)

func (u Unit) String() string {
	switch u {
	case IOPS:
		return "IOPS"
	case MiBPerSec:
		return "MiB/s"
	case Seconds:
		return "s"
	}
	return fmt.Sprintf("Unit(%d)", int(u))
}

// HigherIsBetter reports whether a larger value of u is a better result.
func (u Unit) HigherIsBetter() bool { return u != Seconds }

// Test is one result the guest script reports per mount and run.
type Test struct {
	Name  string // as in the GB lines of guest.sh
	Label string // for the report
	Unit  Unit
}

// Tests are the compared workloads, in the order of the report; guest.sh reports them on every
// mount of MOUNTS.
var Tests = fioTests()

// KillprivTest is the workload guest.sh runs on the killpriv_v2 pair only.
var KillprivTest = Test{"killpriv-randwrite-psync-4k", "randwrite 4 KiB psync (buffered)", IOPS}

func fioTests() []Test {
	var ts []Test
	rws := []struct{ rw, label string }{
		{"read", "seqread"}, {"randread", "randread"}, {"write", "seqwrite"}, {"randwrite", "randwrite"},
	}
	for _, rw := range rws {
		for _, e := range []struct{ engine, label string }{
			{"psync", "psync, O_DIRECT"}, {"libaio", "libaio QD16, O_DIRECT"}, {"mmap", "mmap"},
		} {
			ts = append(ts, Test{rw.rw + "-" + e.engine + "-4k", rw.label + " 4 KiB " + e.label, IOPS})
		}
	}
	return append(ts,
		Test{"read-psync-1m", "seqread 1 MiB psync, O_DIRECT", MiBPerSec},
		Test{"create", "create files", Seconds},
		Test{"stat", "stat files, cold", Seconds},
		Test{"list", "list the directory, cold", Seconds},
		Test{"delete", "delete files", Seconds},
		Test{"dd-write", "dd bs=1M write + fsync", Seconds},
		Test{"dd-read", "dd bs=1M cold read", Seconds},
		Test{"cbuild", "C build with tcc, cold", Seconds},
		Test{"luabuild", "Lua 5.4.4 make -j with tcc, cold", Seconds},
	)
}

// Selected are the tests whose names re matches (all for nil), in the order of Tests, and
// whether the KILLPRIV_V2 workload is among them.
func Selected(re *regexp.Regexp) (tests []Test, killpriv bool) {
	for _, t := range Tests {
		if re == nil || re.MatchString(t.Name) {
			tests = append(tests, t)
		}
	}
	return tests, re == nil || re.MatchString(KillprivTest.Name)
}
