package sandbox

import (
	"context"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/procstatus"
)

// sleepRunner is a VMRunner whose "VM" is a real process (sleep), not QEMU: what the sandbox
// does to the process it runs, it does to this one.
type sleepRunner struct{}

func (sleepRunner) Run(context.Context, VMCommand) (Process, error) {
	return startChild(exec.Command("sleep", "600"))
}

// mustOOMScoreAdj reads pid's oom_score_adj.
func mustOOMScoreAdj(t *testing.T, pid int) int {
	t.Helper()
	v, err := readOOMScoreAdj(pid)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// hasCapSysResource says whether this process may set any oom_score_adj.
func hasCapSysResource(t *testing.T) bool {
	t.Helper()
	st, err := procstatus.ReadPID(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	eff, err := strconv.ParseUint(st["CapEff"], 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	return eff&(1<<24) != 0 // CAP_SYS_RESOURCE
}

// TestOOMScoreAdj checks that the pod's oom_score_adj reaches the confined server's two
// processes at Create and the VM's at Start, that RaiseOOMScoreAdj raises all three (and
// records the value in the state file) and never lowers them, and that the owner keeps its
// own. Without CAP_SYS_RESOURCE, -1000 fails Create with an error naming it and leaves nothing
// behind.
func TestOOMScoreAdj(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	own := mustOOMScoreAdj(t, os.Getpid())
	if own > 900 {
		t.Skipf("the test's oom_score_adj is %d: no room above it", own)
	}
	pod := own + 50
	s, err := Create(ctx, "oom", Options{Config: testConfig(base), Runner: sleepRunner{}, OOMScoreAdj: &pod})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	sup := s.srv.process().Pid()
	serving := confinedChild(t, sup)
	if err := s.Start(ctx, s.DefaultVM()); err != nil {
		t.Fatal(err)
	}
	vm := s.vm.Pid()
	check := func(when string, want int) {
		t.Helper()
		for name, pid := range map[string]int{"the supervisor": sup, "the serving process": serving, "the VM": vm} {
			if got := mustOOMScoreAdj(t, pid); got != want {
				t.Errorf("%s: %s has oom_score_adj %d, want %d", when, name, got, want)
			}
		}
		if got := mustOOMScoreAdj(t, os.Getpid()); got != own {
			t.Errorf("%s: the owner's oom_score_adj is %d, want its own %d", when, got, own)
		}
	}
	check("after Start", pod)
	if err := s.RaiseOOMScoreAdj(pod + 30); err != nil {
		t.Fatal(err)
	}
	check("raised", pod+30)
	if st, err := readState(s.Dir()); err != nil || st.OOMScoreAdj == nil || *st.OOMScoreAdj != pod+30 {
		t.Errorf("the state file after the raise: %+v, %v; want oom_score_adj %d recorded for a restarted owner", st, err, pod+30)
	}
	if err := s.RaiseOOMScoreAdj(pod); err != nil {
		t.Fatal(err)
	}
	check("asked to lower", pod+30)
	if err := s.RaiseOOMScoreAdj(1001); err == nil {
		t.Error("RaiseOOMScoreAdj(1001) succeeded")
	}

	if hasCapSysResource(t) {
		return
	}
	// -1000 is below what this process may go down to without CAP_SYS_RESOURCE (the least
	// value a privileged process gave it or an ancestor), unless that is -1000 itself.
	low := MinOOMScoreAdj
	if own == low {
		return
	}
	_, err = Create(ctx, "oomlow", Options{Config: testConfig(base), OOMScoreAdj: &low})
	if err == nil || !strings.Contains(err.Error(), "oom_score_adj "+strconv.Itoa(low)+" ") {
		t.Errorf("Create with %d, below the owner's %d without CAP_SYS_RESOURCE: %v, want an error naming it", low, own, err)
	}
	if _, err := os.Lstat(base + "/oomlow"); !os.IsNotExist(err) {
		t.Errorf("a failed Create left its directory: %v", err)
	}
}
