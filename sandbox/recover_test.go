package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestRecover leaves sandboxes behind with helper processes that exit without stopping them
// (a crash of the owner) and checks what Recover does with each kind, and with entries that
// are not sandboxes.
func TestRecover(t *testing.T) {
	requireRoot(t)
	becomeSubreaper(t)
	base := testBase(t)
	ctx := context.Background()
	src := t.TempDir()

	// An in-process server dies with its owner: cleaned up.
	inproc := testConfig(base)
	inproc.Server.Daemon = InProcessUnconfined
	runHelperProcess(t, helperSpec{Config: inproc, ID: "inproc",
		Binds: []helperBind{{Src: src, Name: "vol", Flags: BindReadOnly}}})
	// A confined server (the default) outlives it: adopted, its channel too.
	conf := runHelperProcess(t, helperSpec{Config: testConfig(base), ID: "confined",
		Binds: []helperBind{{Src: src, Name: "vol"}}})
	// An external server outlives it: adopted.
	ext := runHelperProcess(t, helperSpec{Config: externalConfig(t, base), ID: "ext",
		Binds: []helperBind{{Src: src, Name: "vol"}}})
	// An external server whose pid now belongs to another process: never signalled, cleaned up.
	runHelperProcess(t, helperSpec{Config: externalConfig(t, base), ID: "recycled"})
	recycledDir := filepath.Join(base, "recycled")
	st, err := readState(recycledDir)
	if err != nil {
		t.Fatal(err)
	}
	p, err := adopt(*st.Server.Process)
	if err != nil {
		t.Fatal(err)
	}
	if err := kill(p); err != nil {
		t.Fatal(err)
	}
	sleeper := exec.Command("sleep", "60")
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	sleeperID, err := identify(sleeper.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	st.Server.Process = &procID{PID: sleeperID.PID, StartTime: sleeperID.StartTime + 1, BootID: sleeperID.BootID}
	if err := writeState(recycledDir, st); err != nil {
		t.Fatal(err)
	}
	// A sandbox this process owns: its lock is held, so it is skipped.
	live, err := Create(ctx, "live", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, live)
	// A half-created sandbox (no state), and entries that are not sandboxes.
	if err := os.MkdirAll(filepath.Join(base, "half", mountsName), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/", filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(base, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(base, ".hidden"), 0o700); err != nil {
		t.Fatal(err)
	}

	start := time.Now()
	rep, err := Recover(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Recover took %v", time.Since(start).Round(time.Millisecond))
	for _, c := range rep.Cleaned {
		t.Logf("cleaned %s: %s (%v)", c.ID, c.Reason, c.Err)
	}
	for _, s := range rep.Skipped {
		t.Logf("skipped %s: %s", s.Name, s.Reason)
	}

	for _, a := range rep.Adopted {
		stopOnCleanup(t, a)
	}
	if len(rep.Adopted) != 2 || rep.Adopted[0].ID() != "confined" || rep.Adopted[1].ID() != "ext" {
		t.Fatalf("adopted %d sandboxes, want confined and ext", len(rep.Adopted))
	}
	cs, s := rep.Adopted[0], rep.Adopted[1]
	wantCleaned := map[string]string{
		"inproc":   "ran in-process",
		"recycled": "belongs to another process",
		"half":     "no usable state",
	}
	for _, c := range rep.Cleaned {
		want, ok := wantCleaned[c.ID]
		if !ok || !strings.Contains(c.Reason, want) || c.Err != nil {
			t.Errorf("cleaned %s: %q, %v", c.ID, c.Reason, c.Err)
		}
		delete(wantCleaned, c.ID)
		if _, err := os.Lstat(filepath.Join(base, c.ID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: directory left: %v", c.ID, err)
		}
	}
	if len(wantCleaned) > 0 {
		t.Errorf("not cleaned: %v", wantCleaned)
	}
	wantSkipped := map[string]string{"live": "in use", "link": "symlink", "file": "not a directory", ".hidden": "not a sandbox id"}
	for _, sk := range rep.Skipped {
		if want := wantSkipped[sk.Name]; want == "" || !strings.Contains(sk.Reason, want) {
			t.Errorf("skipped %s: %q", sk.Name, sk.Reason)
		}
		delete(wantSkipped, sk.Name)
	}
	if len(wantSkipped) > 0 {
		t.Errorf("not skipped: %v", wantSkipped)
	}
	if processGone(sleeperID) {
		t.Errorf("the process that reused the recorded pid was killed")
	}
	if under, _ := mountsUnder(base); slices.ContainsFunc(under, func(p string) bool {
		return !strings.HasPrefix(p, filepath.Join(base, "live")) && !strings.HasPrefix(p, filepath.Join(base, "ext")) &&
			!strings.HasPrefix(p, filepath.Join(base, "confined"))
	}) {
		t.Errorf("mounts left: %q", under)
	}

	// The adopted confined server: the same process, its counters over its channel.
	cstats := cs.Stats()
	if cstats.Server.PID != conf.Stats.Server.PID || !cstats.Server.Running || cstats.Server.FS == nil {
		t.Errorf("adopted confined server %+v, helper's %+v", cstats.Server, conf.Stats.Server)
	}
	// Its log's pipe lost its reader with the first owner: a line it logs now fails with EPIPE
	// and is dropped, and the server goes on (it ignores SIGPIPE).
	if err := cs.SetServerLogLevel(ctx, "info"); err != nil {
		t.Errorf("a log line of the adopted confined server: %v", err)
	}
	if st := cs.Stats(); !st.Server.Running || st.Server.FS == nil {
		t.Errorf("the adopted confined server after a log line nobody reads: %+v", st.Server)
	}
	if err := syscall.Kill(cstats.Server.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cs.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the adopted sandbox did not notice its confined server's death")
	}
	if err := cs.Err(); err == nil || !strings.Contains(err.Error(), "confined kvfsd") || !strings.Contains(err.Error(), "signal: killed") {
		t.Errorf("Err() = %v", err)
	}
	if err := cs.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	// The adopted sandbox: same server, still serving its layout, monitored again.
	stats := s.Stats()
	if stats.Phase != PhaseCreated || stats.Server.PID != ext.Stats.Server.PID || !stats.Server.Running {
		t.Errorf("adopted stats %+v, helper's %+v", stats, ext.Stats)
	}
	if _, err := os.Stat(inNS(s, filepath.Join(s.SharedDir(), "vol"))); err != nil {
		t.Errorf("adopted layout: %v", err)
	}
	// Its namespace, joined from the pin, takes new binds; its server sees them.
	mustWrite(t, filepath.Join(src, "after"))
	if err := s.Bind(src, "later", BindReadOnly); err != nil {
		t.Fatalf("Bind into the adopted sandbox: %v", err)
	}
	srvRoot := fmt.Sprintf("/proc/%d/root", stats.Server.PID)
	if _, err := os.Stat(filepath.Join(srvRoot, s.SharedDir(), "later", "after")); err != nil {
		t.Errorf("a bind into the adopted sandbox, seen by its server: %v", err)
	}
	if err := s.Unbind("later"); err != nil {
		t.Errorf("Unbind in the adopted sandbox: %v", err)
	}
	if st, err := readState(s.Dir()); err != nil || st.Owner.PID != os.Getpid() {
		t.Errorf("state after adoption: %+v, %v", st, err)
	}
	// Its server dies: the stop policy applies (no VM to stop).
	if err := syscall.Kill(stats.Server.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the adopted sandbox did not notice its server's death")
	}
	if err := s.Err(); err == nil || !strings.Contains(err.Error(), "signal: killed") || !strings.Contains(err.Error(), "no VM was running") {
		t.Errorf("Err() = %v", err)
	}
	dir := s.Dir()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("adopted sandbox left its directory: %v", err)
	}
	reapSandboxedServers(t)
	want := []int{sleeper.Process.Pid, live.Stats().Server.PID} // the live sandbox's confined server
	slices.Sort(want)
	if kids := childPids(t); !slices.Equal(kids, want) {
		t.Errorf("children %v, want only the sleeper and the live sandbox's server %v (no zombie servers)", kids, want)
	}
}

// TestCleanup leaves a sandbox behind (an external server still running, a bind) as a dead
// shim would, and checks that Cleanup stops the server, detaches the mounts and removes the
// directory; that it leaves a live owner's sandbox alone; and that a missing one is no error.
func TestCleanup(t *testing.T) {
	requireRoot(t)
	becomeSubreaper(t)
	base := testBase(t)
	ctx := context.Background()
	src := t.TempDir()

	left := runHelperProcess(t, helperSpec{Config: externalConfig(t, base), ID: "left",
		Binds: []helperBind{{Src: src, Name: "rootfs"}, {Src: src, Name: "vol", Flags: BindReadOnly}}})
	st, err := readState(filepath.Join(base, "left"))
	if err != nil || st.Server == nil || st.Server.Process == nil {
		t.Fatalf("state %+v, %v", st, err)
	}
	live, err := Create(ctx, "live", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, live)

	if err := Cleanup(ctx, base, "left"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(base, "left")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory left: %v", err)
	}
	if under, _ := mountsUnder(filepath.Join(base, "left")); len(under) > 0 {
		t.Errorf("mounts left: %q", under)
	}
	reapSandboxedServers(t)
	if !processGone(*st.Server.Process) {
		t.Errorf("the server (pid %d) still runs", left.Stats.Server.PID)
	}
	if err := Cleanup(ctx, base, "live"); !errors.Is(err, ErrInUse) {
		t.Errorf("Cleanup of a live sandbox: %v, want ErrInUse", err)
	}
	if _, err := os.Stat(live.SharedDir()); err != nil {
		t.Errorf("the live sandbox was touched: %v", err)
	}
	if err := Cleanup(ctx, base, "never"); err != nil {
		t.Errorf("Cleanup of a missing sandbox: %v", err)
	}
	if err := Cleanup(ctx, base, "../x"); err == nil || !strings.Contains(err.Error(), "invalid sandbox id") {
		t.Errorf("Cleanup of a bad id: %v", err)
	}
}
