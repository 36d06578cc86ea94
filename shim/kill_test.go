package shim

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Kills that end: a SIGKILL, and a container's end, are the host's to finish for execs too,
// and a pod's end (its sandbox task's Delete, StopSandbox) leaves every Delete working, with a
// guest that ignores SIGKILL for execs, never reports their exits, and refuses to delete what
// it still runs.

// killBound is what a kill may take, to every Wait and Delete of what it ended.
const killBound = 30 * time.Second

// exec adds exec id to container cid, with its stdout on the fifo at stdout if that is set, and
// starts it.
func (h *harness) exec(cid, id, stdout string) {
	h.t.Helper()
	if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: cid, ExecID: id, Spec: procAny(h.t), Stdout: stdout}); err != nil {
		h.t.Fatalf("Exec %s/%s: %v", cid, id, err)
	}
	h.start(cid, id)
}

// waitWithin waits up to killBound for process cid/id and returns its exit status.
func (h *harness) waitWithin(cid, id string) uint32 {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(h.ctx, killBound)
	defer cancel()
	w, err := h.svc.Wait(ctx, &taskAPI.WaitRequest{ID: cid, ExecID: id})
	if err != nil {
		h.t.Fatalf("Wait %s/%s: %v", cid, id, err)
	}
	return w.ExitStatus
}

// exitOrder is the ids of the TaskExit events published so far, in order.
func exitOrder(h *harness) []string {
	var ids []string
	for _, e := range h.rec.all() {
		if x, ok := e.(*eventstypes.TaskExit); ok {
			ids = append(ids, x.ID)
		}
	}
	return ids
}

// checkExitsBefore checks that the TaskExit of each of execs came before the init's.
func checkExitsBefore(t *testing.T, h *harness, init string, execs ...string) {
	t.Helper()
	order := exitOrder(h)
	i := slices.Index(order, init)
	for _, e := range execs {
		if j := slices.Index(order, e); j < 0 || i < 0 || j > i {
			t.Errorf("TaskExit order %q: want %s's before %s's", order, e, init)
		}
	}
}

// TestHostileExecKillIgnored: a guest that acknowledges an exec's SIGKILL, never ends it nor
// reports its exit, and refuses to delete it while it runs. With the shipped limits the host
// declares it exited within KillGrace: Wait answers 137 within 30 s, after its output was cut
// and its stream closed; its Delete works; the pod goes on (the VM is not killed, the container
// still runs); the container's Delete works later although the guest still runs the exec.
func TestHostileExecKillIgnored(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	ha.execKillIgnored, ha.execExitsHidden, ha.refuseRunningDeletes = true, true, true
	h.createSimple("c1")
	h.start("c1", "")
	h.createSimple("c2") // the pod outlives c1: c1's Delete asks the guest
	h.start("c2", "")
	outPath, outFd := h.fifo("e1-out")
	h.exec("c1", "e1", outPath)
	fe, err := h.agent.proc("c1", "e1")
	if err != nil {
		t.Fatal(err)
	}
	fe.stdout.write([]byte("probe\n"), false)

	start := time.Now()
	if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", ExecID: "e1", Signal: uint32(syscall.SIGKILL)}); err != nil {
		t.Fatalf("Kill of the exec: %v", err)
	}
	if st := h.waitWithin("c1", "e1"); st != exitKilled {
		t.Errorf("the SIGKILLed exec exited %d, want %d", st, exitKilled)
	}
	took := time.Since(start)
	t.Logf("SIGKILL of an exec the guest ignores, to its exit: %v", took.Round(time.Millisecond))
	if took < DefaultGuestLimits.KillGrace {
		t.Errorf("the exec was declared exited after %v, before the guest's grace %v", took, DefaultGuestLimits.KillGrace)
	}
	if out, eof := drain(outFd); string(out) != "probe\n" || !eof {
		t.Errorf("the exec's stdout at its exit: %q (closed %v), want what it wrote, closed", out, eof)
	}
	h.delete("c1", "e1")
	if k := h.pod().kills(); len(k) != 0 {
		t.Errorf("the VM was killed for an exec: %v", k)
	}
	if st := h.status("c1", ""); st != task.Status_RUNNING {
		t.Errorf("the exec's container is %v, want still RUNNING", st)
	}

	// The container's end: the guest reports its init's exit, and refuses to delete it while
	// it runs the exec.
	h.kill("c1", syscall.SIGKILL)
	if st := h.waitWithin("c1", ""); st != exitKilled {
		t.Errorf("the container exited %d, want %d", st, exitKilled)
	}
	h.delete("c1", "")
	h.kill("c2", syscall.SIGKILL)
	h.wait("c2", "")
	h.delete("c2", "")
	if got := exitOrder(h); !slices.Equal(got, []string{"e1", "c1", "c2"}) {
		t.Errorf("TaskExit of %q, want e1, c1, c2", got)
	}
	if k := h.pod().kills(); len(k) != 0 || h.pod().stopped != 1 {
		t.Errorf("the VM was killed (%v) or stopped %d times, want stopped once", k, h.pod().stopped)
	}
}

// TestHostileKillAllExecsUnreported: `kill --all` of a container whose guest ends its init but
// neither ends its execs nor reports their exits. The init exits 137 within 30 s, each exec
// 137 before it; the container's Delete works without the execs' Deletes, and the pod goes on.
func TestHostileKillAllExecsUnreported(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{KillGrace: 500 * time.Millisecond})
	ha.execKillIgnored, ha.execExitsHidden, ha.refuseRunningDeletes = true, true, true
	h.createSimple("c1")
	h.start("c1", "")
	h.createSimple("c2")
	h.start("c2", "")
	h.exec("c1", "e1", "")
	h.exec("c1", "e2", "")
	if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL), All: true}); err != nil {
		t.Fatalf("Kill --all: %v", err)
	}
	for _, id := range []string{"", "e1", "e2"} {
		if st := h.waitWithin("c1", id); st != exitKilled {
			t.Errorf("c1/%s exited %d, want %d", id, st, exitKilled)
		}
	}
	checkExitsBefore(t, h, "c1", "e1", "e2")
	h.delete("c1", "")
	if k := h.pod().kills(); len(k) != 0 {
		t.Errorf("the VM was killed: %v", k)
	}
	if st := h.status("c2", ""); st != task.Status_RUNNING {
		t.Errorf("the pod's other container is %v, want RUNNING", st)
	}
}

// TestHostilePodSandboxStop: CRI's podsandbox sandboxer stopping a pod whose guest ignores
// SIGKILL for execs, never reports their exits and refuses to delete what it still runs.
// StopContainer kills c1's init only (not --all): the guest reports it, and its running
// exec (a probe) is declared exited; c1's Delete works. c2's stop never came (a failed
// StopContainer). StopPodSandbox kills the sandbox task, whose Delete ends the pod: its VM
// stopped, c2 killed (137), and c2's Delete after works. Nothing is left.
func TestHostilePodSandboxStop(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{KillGrace: 500 * time.Millisecond})
	ha.execKillIgnored, ha.execExitsHidden, ha.refuseRunningDeletes = true, true, true
	h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: h.bundle("pod", criSandbox("pod", nil))})
	h.start("pod", "")
	for _, id := range []string{"c1", "c2"} {
		h.create(&taskAPI.CreateTaskRequest{ID: id, Bundle: h.bundle(id, criContainer("pod"))})
		h.start(id, "")
	}
	h.exec("c1", "probe", "")
	h.exec("c2", "probe", "")

	// StopContainer c1, then its exit's handling: Delete.
	h.kill("c1", syscall.SIGKILL)
	if st := h.waitWithin("c1", ""); st != exitKilled {
		t.Errorf("c1 exited %d, want %d", st, exitKilled)
	}
	if st := h.waitWithin("c1", "probe"); st != exitKilled {
		t.Errorf("c1's exec exited %d, want %d", st, exitKilled)
	}
	checkExitsBefore(t, h, "c1", "probe")
	h.delete("c1", "")

	// StopPodSandbox: the sandbox container killed, its exit handled (Delete).
	h.kill("pod", syscall.SIGKILL)
	if st := h.waitWithin("pod", ""); st != exitKilled {
		t.Errorf("the sandbox exited %d, want %d", st, exitKilled)
	}
	h.delete("pod", "")
	pod := h.pod()
	if pod.stopped != 1 {
		t.Errorf("after the sandbox's Delete the pod was stopped %d times, want once", pod.stopped)
	}
	// What CRI's Remove of c2 does: its task's Delete.
	if st := h.waitWithin("c2", ""); st != exitKilled {
		t.Errorf("c2, left running, exited %d, want %d", st, exitKilled)
	}
	h.delete("c2", "")
	h.svc.mu.Lock()
	n, run := len(h.svc.containers), h.svc.run
	h.svc.mu.Unlock()
	// (c2's binds went with the pod's Stop, which the fake pod does not model.)
	if n != 0 || run != nil || pod.stopped != 1 || len(pod.kills()) != 0 {
		t.Errorf("left: %d containers, a run (%v); the pod stopped %d times, killed %v", n, run != nil, pod.stopped, pod.kills())
	}
}

// TestHostileSandboxAPIStop: the Sandbox API's StopSandbox, then the tasks' Deletes, then
// ShutdownSandbox, with a guest that ignores SIGKILL for execs and never reports their exits
// (the container's init ends, and its exec's TaskExit comes first), and with a guest that
// reports no exit at all (the host kills the VM). StopSandbox answers within 30 s, the pod is
// stopped once, every Delete works, and the shim ends.
func TestHostileSandboxAPIStop(t *testing.T) {
	for _, tc := range []struct {
		name  string
		guest func(*hostileAgent)
	}{
		{"exec exits unreported", func(ha *hostileAgent) {
			ha.execKillIgnored, ha.execExitsHidden, ha.refuseRunningDeletes = true, true, true
		}},
		{"no exit reported", func(ha *hostileAgent) { ha.killIgnored, ha.exitsHidden = true, true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := netNS(t)
			h, ha := hostileHarness(t, GuestLimits{KillGrace: 500 * time.Millisecond})
			tc.guest(ha)
			h.createSandbox("sbx", ns, &criapi.PodSandboxConfig{})
			if _, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"}); err != nil {
				t.Fatal(err)
			}
			h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", criContainer("sbx"))})
			h.start("c1", "")
			h.exec("c1", "e1", "")
			within(t, "StopSandbox", killBound, func() {
				if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: "sbx"}); err != nil {
					t.Errorf("StopSandbox: %v", err)
				}
			})
			for _, id := range []string{"e1", ""} {
				if st := h.waitWithin("c1", id); st != exitKilled {
					t.Errorf("c1/%s exited %d, want %d", id, st, exitKilled)
				}
			}
			checkExitsBefore(t, h, "c1", "e1")
			h.delete("c1", "e1")
			h.delete("c1", "")
			if _, err := h.svc.ShutdownSandbox(h.ctx, &sandboxAPI.ShutdownSandboxRequest{SandboxID: "sbx"}); err != nil {
				t.Fatal(err)
			}
			select {
			case <-h.sd.Done():
			case <-time.After(10 * shutdownGrace):
				t.Error("ShutdownSandbox did not end the shim")
			}
			if h.pod().stopped != 1 {
				t.Errorf("the pod was stopped %d times, want once", h.pod().stopped)
			}
		})
	}
}
