package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/typeurl/v2"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// The bounds the shim keeps with a hostile guest agent, under TCG (issue 20).
const (
	// queryBound: a query (Stats, Pids, State: ctr task metrics, ps, ls) answers or fails
	// within it.
	queryBound = 10 * time.Second
	// killBound: a task killed with SIGKILL is stopped, deleted and its container removed
	// within it, with nothing of its pod left.
	killBound = 30 * time.Second
	// createBound: a create whose agent goes silent after its boot fails within it, leaving
	// nothing, its shim included.
	createBound = 90 * time.Second
	// oomWindow is how long OOM events are counted; at most oomMax of one container may reach
	// containerd in it (one a second).
	oomWindow = 10 * time.Second
	oomMax    = 11
	// overrun is how long past a bound a ctr is left to run before it is killed, so that a
	// missed bound is measured rather than cut off at the bound.
	overrun = 5 * time.Second
	// bootLimit bounds a pod's boot and its task's start under TCG.
	bootLimit = 3 * time.Minute
)

// TestHostileAgent runs pods whose guest agent misbehaves on purpose (the agent built with the
// kvfsfaults tag, its fault mode chosen with kvfs.fault= in the pod configuration's
// vm.kernel_params; see agent/fault.go) next to well-behaved ones, in one containerd, and
// checks that the host keeps its bounds: containerd and the other pods keep answering, and a
// misbehaving pod is stopped and removed leaving nothing. Each part measures and logs what it
// bounds. A part that fails kills what its pod left, so that the next one starts clean.
func TestHostileAgent(t *testing.T) {
	e := newEnv(t, "")
	h := &hostile{Env: e, faults: vmtest.FaultsAgentImage(t), shipped: vmtest.AgentImage(t)}
	t.Run("ShippedRefuses", h.shippedRefuses)
	t.Run("StatsSilent", h.statsSilent)
	t.Run("KillNoExit", h.killNoExit)
	t.Run("OOMFlood", h.oomFlood)
	t.Run("CreateSilent", h.createSilent)
}

type hostile struct {
	*shimtest.Env
	faults  vmtest.Guest // the agent built with the kvfsfaults tag
	shipped vmtest.Guest // the agent as images ship it, without
}

// config writes a kvfs configuration whose pods boot the faults image with kvfs.fault=mode,
// their sandboxes in the environment's base directory, and returns its path.
func (h *hostile) config(t *testing.T, mode string) string {
	t.Helper()
	return h.configFor(t, h.faults, mode, mode+".toml")
}

// configFor writes the configuration name booting g with kvfs.fault=mode. Without
// kvfs.debug=1: the agent would log every request on the console, thousands a second with
// oom-flood.
func (h *hostile) configFor(t *testing.T, g vmtest.Guest, mode, name string) string {
	t.Helper()
	accel, _ := vmtest.Accel(context.Background(), vmtest.Image(t))
	cfg := fmt.Sprintf("base_dir = %q\n[vm]\nkernel = %q\nrootfs = %q\ninitrd = %q\naccel = %q\nmemory = \"512M\"\nkernel_params = %q\n",
		h.BaseDir, g.Kernel, g.Root, g.Initrd, accel, apiv1.CmdlineFault+"="+mode)
	path := filepath.Join(filepath.Dir(h.Config), name)
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// start begins a part of the test: a snapshot of what containerd holds, and a cleanup that,
// if the part failed, kills what it left and removes its tasks and containers.
func (h *hostile) start(t *testing.T, ids ...string) ctrd.Snapshot {
	t.Helper()
	before := h.C.Snapshot(t)
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		shimtest.PrintConsoles(t, h.BaseDir)
		// The pods' shims first, as a crash would end them: containerd then runs its cleanup
		// of a dead shim (the shim binary's delete action), which is let finish before
		// whatever remains is killed.
		h.C.KillSince(t, before, func(p ctrd.Process) bool {
			f := strings.Fields(p.Cmdline)
			i := slices.Index(f, "-id")
			return len(f) > 0 && filepath.Base(f[0]) == "containerd-shim-kvfs-v2" && f[len(f)-1] != "delete" &&
				i >= 0 && i+1 < len(f) && slices.Contains(ids, f[i+1])
		})
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if procs, _ := h.since(t, before); len(procs) == 0 {
				break
			}
		}
		h.C.KillSince(t, before, nil)
		for _, kind := range []string{"task", "container"} {
			listed, _, err := h.ctr(queryBound, kind, "ls", "--quiet")
			if err != nil {
				t.Errorf("cleanup: %v", err)
				continue
			}
			for _, id := range ids {
				if !slices.Contains(strings.Fields(listed.Stdout), id) {
					continue
				}
				args := []string{kind, "rm", id}
				if kind == "task" {
					args = []string{kind, "rm", "--force", id}
				}
				if r, _, err := h.ctr(30*time.Second, args...); err != nil || r.ExitCode != 0 {
					t.Errorf("cleanup: ctr %s: %v, exit %d: %s", strings.Join(args, " "), err, r.ExitCode, withoutCtrLog(r.Stderr))
				}
			}
		}
	})
	return before
}

// ctr runs ctr, killed if it has not returned within limit (err says so), and answers how long
// it took.
func (h *hostile) ctr(limit time.Duration, args ...string) (ctrd.Result, time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := h.C.CtrCmd(ctx, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	took := time.Since(start)
	r := ctrd.Result{Stdout: stdout.String(), Stderr: stderr.String(), ExitCode: -1}
	if cmd.ProcessState != nil {
		r.ExitCode = cmd.ProcessState.ExitCode()
	}
	if ctx.Err() != nil {
		return r, took, fmt.Errorf("ctr %s: no answer within %v", strings.Join(args, " "), limit)
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return r, took, fmt.Errorf("ctr %s: %w", strings.Join(args, " "), err)
	}
	return r, took, nil
}

// ctrResult is what h.ctr answered, for a ctr run in the background.
type ctrResult struct {
	r    ctrd.Result
	took time.Duration
	err  error
}

func (h *hostile) ctrResult(limit time.Duration, args ...string) ctrResult {
	r, took, err := h.ctr(limit, args...)
	return ctrResult{r, took, err}
}

// mustCtr is ctr that must exit 0 within limit.
func (h *hostile) mustCtr(t *testing.T, limit time.Duration, args ...string) (string, time.Duration) {
	t.Helper()
	r, took, err := h.ctr(limit, args...)
	if err != nil {
		t.Fatal(err)
	}
	if r.ExitCode != 0 {
		t.Fatalf("ctr %s: exit %d after %v: %s", strings.Join(args, " "), r.ExitCode, took.Round(time.Millisecond), r.Stderr)
	}
	return r.Stdout, took
}

// runDetached starts `sleep 600` as task id in a pod of its own, with the configuration
// config, and returns once it runs.
func (h *hostile) runDetached(t *testing.T, config, id string) {
	t.Helper()
	_, took := h.mustCtr(t, bootLimit, "run", "-d", "--runtime", shimtest.RuntimeType, "--runtime-config-path", config, h.Image, id, "sleep", "600")
	t.Logf("pod %s up in %v", id, took.Round(time.Millisecond))
}

// console opens the guest console of pod id as soon as its sandbox has one, waiting up to
// limit. The file is held open: what the guest wrote stays readable after the sandbox is gone.
func (h *hostile) console(t *testing.T, id string, limit time.Duration) *os.File {
	t.Helper()
	path := filepath.Join(h.BaseDir, id, "console.log")
	deadline := time.Now().Add(limit)
	for {
		f, err := os.Open(path)
		if err == nil {
			t.Cleanup(func() { f.Close() })
			return f
		}
		if time.Now().After(deadline) {
			t.Fatalf("no guest console for pod %s within %v: %v", id, limit, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// consoleSays waits up to limit for the console to hold text.
func consoleSays(f *os.File, text string, limit time.Duration) bool {
	deadline := time.Now().Add(limit)
	for {
		b, _ := io.ReadAll(io.NewSectionReader(f, 0, 64<<20))
		if bytes.Contains(b, []byte(text)) {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// wantFault checks that the pod's agent did misbehave: its console says the fault is armed and
// what it did.
func wantFault(t *testing.T, console *os.File, mode string, did ...string) {
	t.Helper()
	for _, want := range append([]string{"fault injection armed: this agent misbehaves on purpose fault=" + mode}, did...) {
		if !consoleSays(console, want, 5*time.Second) {
			t.Errorf("the guest console does not say %q: the fault %s did not happen, and this test measured nothing", want, mode)
		}
	}
}

// status is `ctr task ls`'s status of task id ("" when it is not listed).
func (h *hostile) status(t *testing.T, limit time.Duration, id string) string {
	t.Helper()
	out, _ := h.mustCtr(t, limit, "task", "ls")
	for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
		if f := strings.Fields(line); len(f) == 3 && f[0] == id {
			return f[2]
		}
	}
	return ""
}

// remove kills task id with SIGKILL, waits for it to stop, deletes it and removes its
// container, all within killBound; it fails the test with the step that missed the bound.
func (h *hostile) remove(t *testing.T, id string) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(killBound)
	step := func(args ...string) (ctrd.Result, time.Duration) {
		t.Helper()
		r, took, err := h.ctr(max(time.Until(deadline), 0), args...)
		if err != nil {
			t.Fatalf("task %s, %v after its SIGKILL (bound %v): %v", id, time.Since(start).Round(time.Millisecond), killBound, err)
		}
		return r, took
	}
	must := func(args ...string) {
		t.Helper()
		if r, took := step(args...); r.ExitCode != 0 {
			t.Fatalf("task %s: ctr %s: exit %d after %v: %s", id, strings.Join(args, " "), r.ExitCode, took.Round(time.Millisecond), withoutCtrLog(r.Stderr))
		}
	}
	// The shim may have stopped the task already (a pod it found broken): the kill then fails.
	if r, took := step("task", "kill", "-s", "SIGKILL", id); r.ExitCode != 0 {
		if st := h.status(t, queryBound, id); st != "STOPPED" {
			t.Fatalf("task %s is %s: ctr task kill -s SIGKILL: exit %d after %v: %s", id, st, r.ExitCode, took.Round(time.Millisecond), withoutCtrLog(r.Stderr))
		}
		t.Logf("task %s was stopped before its SIGKILL: %s", id, strings.TrimSpace(withoutCtrLog(r.Stderr)))
	}
	for st := h.status(t, queryBound, id); st != "STOPPED"; st = h.status(t, queryBound, id) {
		if time.Now().After(deadline) {
			t.Fatalf("task %s is %s %v after its SIGKILL (bound %v)", id, st, time.Since(start).Round(time.Millisecond), killBound)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stopped := time.Since(start)
	must("task", "rm", id)
	must("container", "rm", id)
	t.Logf("task %s: stopped %v after its SIGKILL, deleted and its container removed after %v",
		id, stopped.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// removeContainer removes container id if containerd still lists it: a ctr run --rm whose
// task could not be created removes it or not, depending on where the create failed.
func (h *hostile) removeContainer(t *testing.T, id string) {
	t.Helper()
	listed, _ := h.mustCtr(t, queryBound, "container", "ls", "--quiet")
	if slices.Contains(strings.Fields(listed), id) {
		h.mustCtr(t, queryBound, "container", "rm", id)
	}
}

// waitGone waits until every process containerd holds now and before did not hold has gone,
// and every sandbox directory made since, until deadline; it fails the test with what is
// left then.
func (h *hostile) waitGone(t *testing.T, before ctrd.Snapshot, deadline time.Time, what string) {
	t.Helper()
	for {
		procs, entries := h.since(t, before)
		if len(procs) == 0 && len(entries) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still there: processes %v, sandboxes %q", what, procs, entries)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// since answers the processes containerd holds that before did not, and the sandbox
// directories made since.
func (h *hostile) since(t *testing.T, before ctrd.Snapshot) (procs []ctrd.Process, entries []string) {
	t.Helper()
	now := h.C.Snapshot(t)
	for _, p := range shimtest.Alive(now.Processes) {
		if !slices.ContainsFunc(before.Processes, func(q ctrd.Process) bool { return q.PID == p.PID && q.Start == p.Start }) {
			procs = append(procs, p)
		}
	}
	for _, e := range now.Entries {
		if !slices.Contains(before.Entries, e) {
			entries = append(entries, e)
		}
	}
	return procs, entries
}

// ShippedRefuses: the agent images ship, built without the kvfsfaults tag, refuses to boot
// with a kvfs.fault=: the pod fails, its console says why, and nothing is left. (A test
// configuration that met a shipped image would otherwise measure a well-behaved agent.)
func (h *hostile) shippedRefuses(t *testing.T) {
	before := h.start(t, "plain")
	config := h.configFor(t, h.shipped, "stats-silent", "shipped.toml")
	ran := make(chan ctrResult, 1)
	go func() {
		ran <- h.ctrResult(bootLimit, "run", "--rm", "--runtime", shimtest.RuntimeType, "--runtime-config-path", config, h.Image, "plain", "true")
	}()
	console := h.console(t, "plain", bootLimit)
	got := <-ran
	if got.err != nil || got.r.ExitCode == 0 {
		t.Fatalf("ctr run of the shipped image with kvfs.fault=stats-silent: %v, exit %d; want a failure", got.err, got.r.ExitCode)
	}
	t.Logf("ctr run failed after %v: %s", got.took.Round(time.Millisecond), strings.TrimSpace(withoutCtrLog(got.r.Stderr)))
	const refusal = "kvfs.fault=stats-silent: this agent is built without fault injection"
	if !consoleSays(console, refusal, 5*time.Second) {
		t.Errorf("the guest console does not say %q", refusal)
	}
	h.removeContainer(t, "plain")
	h.C.CheckNoLeaks(t, before)
}

// StatsSilent: the agent never answers Stats. ctr task metrics of its pod answers or fails
// within queryBound; meanwhile another pod's metrics and containerd's task list answer each
// within it too; both pods are then removed as usual.
func (h *hostile) statsSilent(t *testing.T) {
	before := h.start(t, "calm", "mute")
	config := h.config(t, "stats-silent")
	h.runDetached(t, h.Config, "calm")
	h.runDetached(t, config, "mute")
	console := h.console(t, "mute", queryBound)

	hung := make(chan ctrResult, 1)
	go func() { hung <- h.ctrResult(queryBound+overrun, "task", "metrics", "mute") }()
	var calls int
	var slowest time.Duration
	var got ctrResult
	for done := false; !done; {
		for _, args := range [][]string{{"task", "metrics", "calm"}, {"task", "ls"}} {
			_, took := h.mustCtr(t, queryBound, args...)
			calls++
			slowest = max(slowest, took)
		}
		select {
		case got = <-hung:
			done = true
		case <-time.After(250 * time.Millisecond):
		}
	}
	t.Logf("while the silent pod's metrics were pending: %d calls to the other pod's metrics and ctr task ls answered, the slowest in %v",
		calls, slowest.Round(time.Millisecond))
	switch {
	case got.err != nil:
		t.Errorf("ctr task metrics of the pod whose agent never answers Stats: %v (bound %v)", got.err, queryBound)
	case got.took > queryBound:
		t.Errorf("ctr task metrics of the pod whose agent never answers Stats took %v, exit %d (bound %v)", got.took, got.r.ExitCode, queryBound)
	default:
		t.Logf("ctr task metrics of the silent pod: exit %d in %v: %s", got.r.ExitCode, got.took.Round(time.Millisecond), strings.TrimSpace(withoutCtrLog(got.r.Stderr)))
	}
	wantFault(t, console, "stats-silent", "not answering fault=stats-silent method=Stats")
	h.remove(t, "mute")
	h.remove(t, "calm")
	h.C.CheckNoLeaks(t, before)
}

// KillNoExit: the agent acknowledges SIGKILL without delivering it and never reports the
// exit. The task is still stopped, deleted and its container removed within killBound, with
// nothing of its pod left.
func (h *hostile) killNoExit(t *testing.T) {
	before := h.start(t, "deaf")
	h.runDetached(t, h.config(t, "kill-noexit"), "deaf")
	console := h.console(t, "deaf", queryBound)
	start := time.Now()
	h.remove(t, "deaf")
	h.waitGone(t, before, start.Add(killBound), fmt.Sprintf("%v after the SIGKILL of a task whose agent ignores it", killBound))
	t.Logf("nothing of pod deaf left %v after its SIGKILL", time.Since(start).Round(time.Millisecond))
	wantFault(t, console, "kill-noexit", "signal acknowledged, not delivered")
	h.C.CheckNoLeaks(t, before)
}

// OOMFlood: the agent reports an OOM kill of the pod's container as fast as it is asked.
// containerd gets at most one TaskOOM of it a second, and still answers meanwhile.
func (h *hostile) oomFlood(t *testing.T) {
	before := h.start(t, "flood")
	h.runDetached(t, h.config(t, "oom-flood"), "flood")
	console := h.console(t, "flood", queryBound)
	n, slowest := h.countOOM(t, "flood", oomWindow)
	t.Logf("%d TaskOOM events of container flood reached containerd in %v; ctr task ls answered meanwhile, the slowest in %v",
		n, oomWindow, slowest.Round(time.Millisecond))
	switch {
	case n > oomMax:
		t.Errorf("%d TaskOOM events of one container in %v: want at most %d (one a second)", n, oomWindow, oomMax)
	case n == 0:
		t.Errorf("no TaskOOM event of container flood in %v: its OOM kills must still be reported, at most one a second", oomWindow)
	}
	wantFault(t, console, "oom-flood")
	h.remove(t, "flood")
	h.C.CheckNoLeaks(t, before)
}

// countOOM counts the TaskOOM events of container id that reach containerd in window, and
// runs ctr task ls once a second meanwhile: it answers the count and the slowest ctr task ls.
// Its client of containerd is closed when it returns.
func (h *hostile) countOOM(t *testing.T, id string, window time.Duration) (int, time.Duration) {
	t.Helper()
	cl, err := client.New(h.C.Address(), client.WithDefaultNamespace(h.C.Namespace()), client.WithTimeout(queryBound))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	// The subscription ends by our cancel, not by a deadline: containerd would see a deadline
	// first (it is sent along) and end the stream with an error a moment before ctx says so.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(window, cancel)
	events, errs := cl.Subscribe(ctx, fmt.Sprintf(`namespace==%s,topic=="/tasks/oom"`, h.C.Namespace()))
	counted := make(chan int, 1)
	go func() {
		n := 0
		defer func() { counted <- n }()
		for {
			select {
			case env := <-events:
				ev, err := typeurl.UnmarshalAny(env.Event)
				if err != nil {
					t.Errorf("a /tasks/oom event: %v", err)
					continue
				}
				if oom, ok := ev.(*eventstypes.TaskOOM); ok && oom.ContainerID == id {
					n++
				}
			case err := <-errs:
				if err != nil && ctx.Err() == nil {
					t.Errorf("containerd's events: %v", err)
				}
				return
			}
		}
	}()
	var slowest time.Duration
	for ctx.Err() == nil {
		_, took := h.mustCtr(t, queryBound, "task", "ls")
		slowest = max(slowest, took)
		time.Sleep(time.Second)
	}
	return <-counted, slowest
}

// CreateSilent: the agent answers Ping after its boot, then never answers CreateContainer.
// ctr run fails within createBound and leaves nothing, its shim included.
func (h *hostile) createSilent(t *testing.T) {
	before := h.start(t, "hush")
	config := h.config(t, "create-silent")
	ran := make(chan ctrResult, 1)
	go func() {
		ran <- h.ctrResult(createBound+overrun, "run", "--rm", "--runtime", shimtest.RuntimeType, "--runtime-config-path", config, h.Image, "hush", "true")
	}()
	console := h.console(t, "hush", createBound)
	got := <-ran
	switch {
	case got.err != nil:
		t.Errorf("ctr run of a pod whose agent never answers CreateContainer: %v (bound %v)", got.err, createBound)
	case got.r.ExitCode == 0:
		t.Errorf("ctr run of a pod whose agent never answers CreateContainer succeeded after %v", got.took)
	case got.took > createBound:
		t.Errorf("ctr run of a pod whose agent never answers CreateContainer failed after %v (bound %v): %s", got.took, createBound, withoutCtrLog(got.r.Stderr))
	default:
		t.Logf("ctr run failed after %v: %s", got.took.Round(time.Millisecond), strings.TrimSpace(withoutCtrLog(got.r.Stderr)))
	}
	wantFault(t, console, "create-silent", "not answering fault=create-silent method=CreateContainer")
	if got.err == nil {
		h.removeContainer(t, "hush")
		h.C.CheckNoLeaks(t, before)
	}
}
