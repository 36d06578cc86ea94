package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types"
	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

type harness struct {
	t     *testing.T
	ctx   context.Context
	svc   services
	agent *fakeAgent
	rec   *recorder
	sd    *fakeShutdown
	dir   string

	// remote, if set, is the agent the pods answer with (Pod.Agent), in place of agent; wire,
	// if set, is its connection's filter.
	remote agent.AgentService
	wire   *agentWire

	mu       sync.Mutex
	pods     []*fakePod
	startErr error
	mountsIn map[string][]string // the pods' fakePod.mountsIn
}

// services are a pod's owner and both its services, as the shim's plugins make them.
type services struct {
	*Pod
	*TaskService
	*SandboxService
}

func newServices(o *Pod) services {
	return services{o, NewTaskService(o), NewSandboxService(o)}
}

func newHarness(t *testing.T) *harness { return newHarnessWith(t, GuestLimits{}, nil) }

// newHarnessWith is a harness whose service has limits, and whose pods' agent is remote if it
// is not nil.
func newHarnessWith(t *testing.T, limits GuestLimits, remote agent.AgentService) *harness {
	h := &harness{t: t, agent: newFakeAgent(), rec: newRecorder(), sd: &fakeShutdown{done: make(chan struct{})}, dir: t.TempDir(), remote: remote}
	h.ctx = namespaces.WithNamespace(context.Background(), "kvfs-test")
	h.svc = newServices(NewPod(h.ctx, Options{Publisher: h.rec, Shutdown: h.sd, StartVM: h.startPod,
		DefaultConfigPath: filepath.Join(h.dir, "no-such-config.toml"), Limits: limits}))
	t.Cleanup(func() {
		if err := h.svc.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return h
}

func (h *harness) startPod(_ context.Context, req PodRequest) (VM, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.startErr != nil {
		return nil, h.startErr
	}
	p := &fakePod{agent: h.agent, remote: h.remote, wire: h.wire, req: req, binds: map[string]HostBind{}, mountsIn: h.mountsIn, done: make(chan struct{})}
	h.pods = append(h.pods, p)
	return p, nil
}

func (h *harness) pod() *fakePod {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pods) == 0 {
		h.t.Fatal("no pod was started")
	}
	return h.pods[len(h.pods)-1]
}

// bundle writes a bundle for container id.
func (h *harness) bundle(id string, ann map[string]string, mounts ...specs.Mount) string {
	h.t.Helper()
	b := filepath.Join(h.dir, "bundles", id)
	if err := os.MkdirAll(filepath.Join(b, "rootfs"), 0o755); err != nil {
		h.t.Fatal(err)
	}
	spec := specs.Spec{Version: "1.2.0", Root: &specs.Root{Path: "rootfs"}, Annotations: ann, Mounts: mounts,
		Process: &specs.Process{Args: []string{"sh"}, Cwd: "/"},
		Linux:   &specs.Linux{Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.NetworkNamespace}}}}
	data, _ := json.Marshal(&spec)
	if err := os.WriteFile(filepath.Join(b, "config.json"), data, 0o644); err != nil {
		h.t.Fatal(err)
	}
	return b
}

// fifo makes a fifo and opens its reading end without blocking, as containerd does.
func (h *harness) fifo(name string) (string, int) {
	h.t.Helper()
	p := filepath.Join(h.dir, name)
	if err := unix.Mkfifo(p, 0o600); err != nil {
		h.t.Fatal(err)
	}
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { unix.Close(fd) })
	return p, fd
}

// drain reads what the fifo holds now, without blocking; eof says its writer closed.
func drain(fd int) (data []byte, eof bool) {
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(fd, buf)
		switch {
		case n > 0:
			data = append(data, buf[:n]...)
		case err == unix.EAGAIN:
			return data, false
		default:
			return data, true
		}
	}
}

func (h *harness) create(r *taskAPI.CreateTaskRequest) *taskAPI.CreateTaskResponse {
	h.t.Helper()
	resp, err := h.svc.Create(h.ctx, r)
	if err != nil {
		h.t.Fatalf("Create %s: %v", r.ID, err)
	}
	return resp
}

// createSimple creates container id in pod "pod".
func (h *harness) createSimple(id string) {
	h.t.Helper()
	h.create(&taskAPI.CreateTaskRequest{ID: id, Bundle: h.bundle(id, inPod("pod"))})
}

func inPod(id string) map[string]string { return map[string]string{AnnotationSandboxID: id} }

func (h *harness) start(id, exec string) {
	h.t.Helper()
	if _, err := h.svc.Start(h.ctx, &taskAPI.StartRequest{ID: id, ExecID: exec}); err != nil {
		h.t.Fatalf("Start %s/%s: %v", id, exec, err)
	}
}

func (h *harness) wait(id, exec string) *taskAPI.WaitResponse {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(h.ctx, 10*time.Second)
	defer cancel()
	resp, err := h.svc.Wait(ctx, &taskAPI.WaitRequest{ID: id, ExecID: exec})
	if err != nil {
		h.t.Fatalf("Wait %s/%s: %v", id, exec, err)
	}
	return resp
}

func (h *harness) status(id, exec string) task.Status {
	h.t.Helper()
	st, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: id, ExecID: exec})
	if err != nil {
		h.t.Fatalf("State %s/%s: %v", id, exec, err)
	}
	return st.Status
}

func (h *harness) delete(id, exec string) *taskAPI.DeleteResponse {
	h.t.Helper()
	resp, err := h.svc.Delete(h.ctx, &taskAPI.DeleteRequest{ID: id, ExecID: exec})
	if err != nil {
		h.t.Fatalf("Delete %s/%s: %v", id, exec, err)
	}
	return resp
}

func wantKind(t *testing.T, what string, err, kind error) {
	t.Helper()
	if !errors.Is(err, kind) {
		t.Errorf("%s: %v, want %v", what, err, kind)
	}
}

func eventTypes(evs []any) []string {
	var names []string
	for _, e := range evs {
		switch v := e.(type) {
		case *eventstypes.TaskExit:
			names = append(names, "exit:"+v.ID)
		case *eventstypes.TaskExecAdded:
			names = append(names, "exec-added:"+v.ExecID)
		case *eventstypes.TaskExecStarted:
			names = append(names, "exec-started:"+v.ExecID)
		default:
			names = append(names, typeName(e))
		}
	}
	return names
}

func typeName(e any) string {
	switch e.(type) {
	case *eventstypes.TaskCreate:
		return "Create"
	case *eventstypes.TaskStart:
		return "Start"
	case *eventstypes.TaskDelete:
		return "Delete"
	case *eventstypes.TaskPaused:
		return "Paused"
	case *eventstypes.TaskResumed:
		return "Resumed"
	case *eventstypes.TaskOOM:
		return "OOM"
	}
	return "?"
}

// TestLifecycle runs one container through its life with fifos: its output reaches them,
// the last bytes (which come after the agent reported the exit) before TaskExit, TaskExit
// before Wait returns, and the events in order.
func TestLifecycle(t *testing.T) {
	h := newHarness(t)
	h.agent.drainDelay = 200 * time.Millisecond
	outPath, outFd := h.fifo("out")
	errPath, errFd := h.fifo("err")
	var atExit struct {
		out, err []byte
		outEOF   bool
	}
	h.rec.onPublish = func(e any) {
		if _, ok := e.(*eventstypes.TaskExit); ok {
			atExit.out, atExit.outEOF = drain(outFd)
			atExit.err, _ = drain(errFd)
		}
	}
	b := h.bundle("c1", nil)
	resp := h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: b, Stdout: outPath, Stderr: errPath})
	if resp.Pid == 0 {
		t.Errorf("Create answered pid 0")
	}
	if h.status("c1", "") != task.Status_CREATED {
		t.Errorf("status after Create: %v", h.status("c1", ""))
	}
	pod := h.pod()
	if pod.req.ID != "c1" || pod.req.Config == nil || pod.req.Config.BaseDir != sandbox.DefaultConfig().BaseDir {
		t.Errorf("pod request %+v", pod.req)
	}
	if got := pod.bound()["c1"]; got.Source != filepath.Join(b, "rootfs") || got.Flags != sandbox.BindRecursive {
		t.Errorf("rootfs bind %+v", got)
	}
	var gs specs.Spec
	if err := json.Unmarshal(h.agent.specs["c1"], &gs); err != nil || gs.Root.Path != "/run/kvfs/shared/c1" {
		t.Errorf("guest spec root %+v, %v", gs.Root, err)
	}
	fp, _ := h.agent.proc("c1", "")
	if !fp.stdio.Stdout || !fp.stdio.Stderr || fp.stdio.Stdin || fp.stdio.Terminal {
		t.Errorf("agent stdio %+v", fp.stdio)
	}

	h.start("c1", "")
	if h.status("c1", "") != task.Status_RUNNING {
		t.Errorf("status after Start: %v", h.status("c1", ""))
	}
	fp.stdout.write([]byte("hello\n"), false)
	fp.stderr.write([]byte("oops\n"), false)
	fp.tail = []byte("last bytes\n")

	waited := make(chan *taskAPI.WaitResponse, 1)
	go func() {
		r, err := h.svc.Wait(h.ctx, &taskAPI.WaitRequest{ID: "c1"})
		if err != nil {
			t.Errorf("Wait: %v", err)
		}
		for _, e := range h.rec.all() {
			if _, ok := e.(*eventstypes.TaskExit); ok {
				waited <- r
				return
			}
		}
		t.Errorf("Wait returned before TaskExit was published")
		waited <- r
	}()
	time.Sleep(50 * time.Millisecond)
	h.agent.exit("c1", "", 3)
	var w *taskAPI.WaitResponse
	select {
	case w = <-waited:
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return")
	}
	if w.ExitStatus != 3 {
		t.Errorf("Wait: status %d", w.ExitStatus)
	}
	if string(atExit.out) != "hello\nlast bytes\n" || !atExit.outEOF || string(atExit.err) != "oops\n" {
		t.Errorf("at TaskExit the fifos held stdout %q (closed %v), stderr %q", atExit.out, atExit.outEOF, atExit.err)
	}
	st, _ := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1"})
	if st.Status != task.Status_STOPPED || st.ExitStatus != 3 || st.Stdout != outPath {
		t.Errorf("state after exit %+v", st)
	}
	d := h.delete("c1", "")
	if d.ExitStatus != 3 || d.Pid != resp.Pid {
		t.Errorf("Delete answered %+v", d)
	}
	if _, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State after Delete: %v", err)
	}
	if len(pod.bound()) != 0 || pod.stopped != 1 || h.agent.shutdowns != 1 {
		t.Errorf("after the last Delete: binds %v, pod stopped %d times, agent shut down %d times", pod.bound(), pod.stopped, h.agent.shutdowns)
	}
	if got, want := strings.Join(eventTypes(h.rec.all()), " "), "Create Start exit:c1 Delete"; got != want {
		t.Errorf("events %q, want %q", got, want)
	}
	if _, err := h.svc.Shutdown(h.ctx, &taskAPI.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.sd.Done():
	default:
		t.Errorf("Shutdown with no container left did not shut the shim down")
	}
}

// TestWrongState checks that each call in a state that does not allow it is refused with
// FailedPrecondition (NotFound for a kill of a finished process, as runc's shim) and
// changes nothing.
func TestWrongState(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	ctx := h.ctx
	_, err := h.svc.Pause(ctx, &taskAPI.PauseRequest{ID: "c1"})
	wantKind(t, "Pause created", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Exec(ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "e1", Spec: procAny(t)})
	wantKind(t, "Exec in a created container", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Delete(ctx, &taskAPI.DeleteRequest{ID: "c1", ExecID: "nope"})
	wantKind(t, "Delete of an unknown exec", err, errdefs.ErrNotFound)
	_, err = h.svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil)})
	wantKind(t, "Create twice", err, errdefs.ErrAlreadyExists)

	h.start("c1", "")
	_, err = h.svc.Start(ctx, &taskAPI.StartRequest{ID: "c1"})
	wantKind(t, "Start twice", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Resume(ctx, &taskAPI.ResumeRequest{ID: "c1"})
	wantKind(t, "Resume running", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Delete(ctx, &taskAPI.DeleteRequest{ID: "c1"})
	wantKind(t, "Delete running", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.ResizePty(ctx, &taskAPI.ResizePtyRequest{ID: "c1", Width: 80, Height: 24})
	wantKind(t, "ResizePty without a terminal", err, errdefs.ErrFailedPrecondition)
	if h.status("c1", "") != task.Status_RUNNING {
		t.Errorf("a refused call changed the state: %v", h.status("c1", ""))
	}

	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	_, err = h.svc.Kill(ctx, &taskAPI.KillRequest{ID: "c1", Signal: 9})
	wantKind(t, "Kill stopped", err, errdefs.ErrNotFound)
	_, err = h.svc.Start(ctx, &taskAPI.StartRequest{ID: "c1"})
	wantKind(t, "Start stopped", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Pause(ctx, &taskAPI.PauseRequest{ID: "c1"})
	wantKind(t, "Pause stopped", err, errdefs.ErrFailedPrecondition)
	// As runc's: a stopped container's cgroup is there until its Delete.
	if _, err = h.svc.Stats(ctx, &taskAPI.StatsRequest{ID: "c1"}); err != nil {
		t.Errorf("Stats stopped: %v", err)
	}
	_, err = h.svc.CloseIO(ctx, &taskAPI.CloseIORequest{ID: "c1", Stdin: true})
	wantKind(t, "CloseIO stopped", err, errdefs.ErrFailedPrecondition)
	h.delete("c1", "")
	_, err = h.svc.Delete(ctx, &taskAPI.DeleteRequest{ID: "c1"})
	wantKind(t, "Delete twice", err, errdefs.ErrNotFound)
}

// TestStatsWhileDeleting: Stats of a container whose Delete is under way (here, its poststop
// hook running) is NotFound, which containerd's Metrics passes over without a word, as for a
// runc container whose Delete took its cgroup.
func TestStatsWhileDeleting(t *testing.T) {
	h := newHarness(t)
	b := h.bundle("c1", inPod("pod"))
	var spec specs.Spec
	data, err := os.ReadFile(filepath.Join(b, "config.json"))
	if err == nil {
		err = json.Unmarshal(data, &spec)
	}
	if err != nil {
		t.Fatal(err)
	}
	spec.Hooks = &specs.Hooks{Poststop: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "sleep 1"}}}}
	data, _ = json.Marshal(&spec)
	if err := os.WriteFile(filepath.Join(b, "config.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: b})
	h.createSimple("c2")
	h.start("c1", "")
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	deleted := make(chan struct{})
	go func() {
		defer close(deleted)
		h.delete("c1", "")
	}()
	err = statsWhile(t, h, "c1", "it is deleted", deleted)
	wantKind(t, "Stats of a container being deleted", err, errdefs.ErrNotFound)
	<-deleted
}

// statsWhile asks Stats of container id until its error has want, which it returns; it fails
// the test if done is closed first (the state Stats was to see is over).
func statsWhile(t *testing.T, h *harness, id, want string, done <-chan struct{}) error {
	t.Helper()
	for {
		_, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: id})
		if strings.Contains(fmt.Sprint(err), want) {
			return err
		}
		select {
		case <-done:
			t.Fatalf("Stats of %s never answered %q (last: %v)", id, want, err)
		case <-time.After(time.Millisecond):
		}
	}
}

// TestDeleteLastContainer: the Delete of a pod's last container stops the pod without asking
// the agent to delete the container first (its Shutdown ends everything in the guest, and
// the runtime's delete there would only delay the VM's end); any other container's Delete
// deletes it in the guest, and the pod goes on.
func TestDeleteLastContainer(t *testing.T) {
	h := newHarness(t)
	for _, id := range []string{"c1", "c2"} {
		h.createSimple(id)
		h.start(id, "")
		h.agent.exit(id, "", 0)
		h.wait(id, "")
	}
	pod := h.pod()
	h.delete("c1", "")
	if len(h.agent.deleted) != 1 || h.agent.deleted[0] != [2]string{"c1", ""} || pod.stopped != 0 || h.agent.shutdowns != 0 {
		t.Errorf("after c1's Delete: the agent deleted %v, shut down %d times; the pod stopped %d times", h.agent.deleted, h.agent.shutdowns, pod.stopped)
	}
	if d := h.delete("c2", ""); d.ExitStatus != 0 {
		t.Errorf("c2's Delete answered %+v", d)
	}
	if len(h.agent.deleted) != 1 || pod.stopped != 1 || h.agent.shutdowns != 1 {
		t.Errorf("after the last Delete: the agent deleted %v, shut down %d times; the pod stopped %d times", h.agent.deleted, h.agent.shutdowns, pod.stopped)
	}
	if _, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c2"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State after the last Delete: %v", err)
	}
}

// TestKillWhileDeleting: a kill that comes while the container's Delete is still cleaning up
// (its process deleted, the container not yet gone) is answered NotFound, as for a finished
// process: containerd's CRI stops a container whose process just exited that way, and takes
// any other answer as a failed stop.
func TestKillWhileDeleting(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	h.start("c1", "")
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	_, p, err := h.svc.getProcess("c1", "")
	if err != nil {
		t.Fatal(err)
	}
	// What Delete does first; the rest of it (unbinding, hooks) has not happened yet.
	if err := p.transition(opDelete, stateDeleted); err != nil {
		t.Fatal(err)
	}
	_, err = h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: 9})
	wantKind(t, "Kill during Delete", err, errdefs.ErrNotFound)
}

func procAny(t *testing.T) *anypb.Any {
	t.Helper()
	b, _ := json.Marshal(&specs.Process{Args: []string{"true"}, Cwd: "/", ApparmorProfile: "host-profile"})
	return &anypb.Any{TypeUrl: "types.containerd.io/opencontainers/runtime-spec/1/Process", Value: b}
}

// TestExecAndKillAll runs two execs, kills everything with all, and checks the exits: each
// exec's TaskExit before the init's.
func TestExecAndKillAll(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	h.start("c1", "")
	for _, e := range []string{"e1", "e2"} {
		if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: e, Spec: procAny(t)}); err != nil {
			t.Fatal(err)
		}
		if h.status("c1", e) != task.Status_CREATED {
			t.Errorf("exec %s: %v", e, h.status("c1", e))
		}
		h.start("c1", e)
	}
	_, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "e1", Spec: procAny(t)})
	wantKind(t, "Exec with an id in use", err, errdefs.ErrAlreadyExists)
	// A never-started exec is deleted without a signal: the agent forgets it.
	if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "never", Spec: procAny(t)}); err != nil {
		t.Fatal(err)
	}
	nsig := len(h.agent.signals)
	if d := h.delete("c1", "never"); d.ExitStatus != 137 {
		t.Errorf("Delete of a created exec: %+v", d)
	}
	if len(h.agent.signals) != nsig || h.agent.deleted[len(h.agent.deleted)-1] != [2]string{"c1", "never"} {
		t.Errorf("the agent got signals %v, deleted %v", h.agent.signals[nsig:], h.agent.deleted)
	}
	if _, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1", ExecID: "never"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State of the deleted exec: %v", err)
	}
	// The pod outlives c1 (the last container's Delete stops the VM instead: TestDeleteLastContainer).
	h.createSimple("c2")
	if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL), All: true}); err != nil {
		t.Fatal(err)
	}
	if sig := h.agent.signals[len(h.agent.signals)-1]; !sig.All || sig.Signal != 9 || sig.ContainerId != "c1" {
		t.Errorf("the agent got %+v", sig)
	}
	for _, e := range []string{"e1", "e2", ""} {
		if w := h.wait("c1", e); w.ExitStatus != 137 {
			t.Errorf("%q exit %d", e, w.ExitStatus)
		}
	}
	h.delete("c1", "e1")
	// An init's Delete takes its exited execs with it (the agent deletes the container).
	h.delete("c1", "")
	if len(h.agent.procs) != 2 {
		t.Errorf("the agent still has %d processes, want e2's and c2's", len(h.agent.procs))
	}
	got := strings.Join(eventTypes(h.rec.all()), " ")
	want := "Create Start exec-added:e1 exec-started:e1 exec-added:e2 exec-started:e2 exec-added:never exit:never"
	if !strings.HasPrefix(got, want) || !strings.HasSuffix(got, "exit:c1 Delete") || strings.Count(got, "exit:") != 4 {
		t.Errorf("events %q", got)
	}
}

// TestPauseResumeOOMStatsUpdate checks the container-wide calls and their events.
func TestPauseResumeOOMStatsUpdate(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	h.start("c1", "")
	if _, err := h.svc.Pause(h.ctx, &taskAPI.PauseRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	if h.status("c1", "") != task.Status_PAUSED {
		t.Errorf("status %v", h.status("c1", ""))
	}
	if _, err := h.svc.Resume(h.ctx, &taskAPI.ResumeRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	if h.status("c1", "") != task.Status_RUNNING || len(h.agent.paused) != 1 || len(h.agent.resumed) != 1 {
		t.Errorf("status %v, agent paused %v resumed %v", h.status("c1", ""), h.agent.paused, h.agent.resumed)
	}
	h.agent.oom <- "c1"
	h.rec.waitFor(t, "TaskOOM", func(e any) bool { o, ok := e.(*eventstypes.TaskOOM); return ok && o.ContainerID == "c1" })

	// A guest's answer of another type, or one that does not decode, does not reach
	// containerd. (Asked before any good one: that would be served for a second, stats.go.)
	for _, bad := range []*anypb.Any{
		{TypeUrl: "io.containerd.cgroups.v1.Metrics", Value: nil},
		{TypeUrl: "io.containerd.cgroups.v2.Metrics", Value: []byte{0xff, 0xff, 0xff}},
	} {
		h.agent.mu.Lock()
		h.agent.badStats = bad
		h.agent.mu.Unlock()
		_, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "c1"})
		wantKind(t, "Stats of a bad answer "+bad.TypeUrl, err, errdefs.ErrUnknown)
	}
	h.agent.mu.Lock()
	h.agent.badStats = nil
	h.agent.mu.Unlock()
	st, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := typeurl.UnmarshalAny(st.Stats); err != nil || v.(*cgroupstats.Metrics).GetPids().GetCurrent() != 2 {
		t.Errorf("Stats passed %v, %v", v, err)
	}
	limit := int64(1 << 20)
	res, _ := json.Marshal(&specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}})
	if _, err := h.svc.Update(h.ctx, &taskAPI.UpdateTaskRequest{ID: "c1", Resources: &anypb.Any{TypeUrl: "x/LinuxResources", Value: res}}); err != nil {
		t.Fatal(err)
	}
	var got specs.LinuxResources
	if err := json.Unmarshal(h.agent.updates[0], &got); err != nil || got.Memory == nil || *got.Memory.Limit != limit {
		t.Errorf("the agent got resources %s", h.agent.updates[0])
	}
	_, err = h.svc.Update(h.ctx, &taskAPI.UpdateTaskRequest{ID: "c1", Resources: &anypb.Any{Value: []byte("{")}})
	wantKind(t, "Update with bad JSON", err, errdefs.ErrInvalidArgument)
	if _, err := h.svc.Checkpoint(h.ctx, &taskAPI.CheckpointTaskRequest{ID: "c1"}); !errors.Is(err, errdefs.ErrNotImplemented) {
		t.Errorf("Checkpoint: %v", err)
	}
	task := taskOverTTRPC(t, h.svc.TaskService)
	if _, err := task.Checkpoint(h.ctx, &taskAPI.CheckpointTaskRequest{ID: "c1"}); status.Code(err) != codes.Unimplemented {
		t.Errorf("Checkpoint at the ttrpc edge: %v (%v)", err, status.Code(err))
	}
	if _, err := task.Start(h.ctx, &taskAPI.StartRequest{ID: "c1"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("Start twice at the ttrpc edge: %v", err)
	}
	c, err := h.svc.Connect(h.ctx, &taskAPI.ConnectRequest{ID: "c1"})
	if err != nil || c.ShimPid != uint32(os.Getpid()) || c.TaskPid == 0 {
		t.Errorf("Connect %+v, %v", c, err)
	}
	got2 := strings.Join(eventTypes(h.rec.all()), " ")
	if got2 != "Create Start Paused Resumed OOM" {
		t.Errorf("events %q", got2)
	}
}

// TestStdin copies stdin to the agent: what is written arrives, and the process's stdin is
// closed once CloseIO has been called and the client has closed its end of the fifo, in either
// order: the fifo's EOF alone does not close it, nor CloseIO alone, as with containerd's runc
// shim.
func TestStdin(t *testing.T) {
	h := newHarness(t)
	in := filepath.Join(h.dir, "in")
	if err := unix.Mkfifo(in, 0o600); err != nil {
		t.Fatal(err)
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Stdin: in})
	h.start("c1", "")
	w, err := os.OpenFile(in, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.Write([]byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	fp, _ := h.agent.proc("c1", "")
	if !fp.stdio.Stdin {
		t.Errorf("the agent was not asked for stdin")
	}
	waitUntil(t, "stdin reaches the agent", func() bool {
		h.agent.mu.Lock()
		defer h.agent.mu.Unlock()
		return string(fp.stdin) == "hello\n"
	})
	if _, err := h.svc.CloseIO(h.ctx, &taskAPI.CloseIORequest{ID: "c1", Stdin: true}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-fp.stdinEOF:
		t.Fatal("CloseIO closed the process's stdin while the client's end is open")
	case <-time.After(500 * time.Millisecond):
	}
	w.Close()
	select {
	case <-fp.stdinEOF:
	case <-time.After(5 * time.Second):
		t.Fatal("CloseIO and the client's close did not close the process's stdin")
	}

	ein := filepath.Join(h.dir, "ein")
	if err := unix.Mkfifo(ein, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "e1", Stdin: ein, Spec: procAny(t)}); err != nil {
		t.Fatal(err)
	}
	h.start("c1", "e1")
	ew, err := os.OpenFile(ein, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	ew.Write([]byte("x"))
	ew.Close()
	ep, _ := h.agent.proc("c1", "e1")
	waitUntil(t, "the exec's stdin reaches the agent", func() bool {
		h.agent.mu.Lock()
		defer h.agent.mu.Unlock()
		return string(ep.stdin) == "x"
	})
	select {
	case <-ep.stdinEOF:
		t.Fatal("the fifo's EOF closed the exec's stdin")
	case <-time.After(500 * time.Millisecond):
	}
	if _, err := h.svc.CloseIO(h.ctx, &taskAPI.CloseIORequest{ID: "c1", ExecID: "e1", Stdin: true}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ep.stdinEOF:
	case <-time.After(5 * time.Second):
		t.Fatal("CloseIO did not close the exec's stdin")
	}
}

// TestStdinWhole: every byte a client writes to stdin reaches the process before its end of
// file, though the client closes its end and calls CloseIO at once, while megabytes still wait
// in the fifo for a guest that takes them slowly (kubectl exec -i and kubectl cp: the kubelet's
// CRI closes the fifo, then CloseIO).
func TestStdinWhole(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	ha.stdinDelay = time.Millisecond
	h.createSimple("c1")
	h.start("c1", "")
	in := filepath.Join(h.dir, "ein")
	if err := unix.Mkfifo(in, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "e1", Stdin: in, Spec: procAny(t)}); err != nil {
		t.Fatal(err)
	}
	h.start("c1", "e1")
	data := make([]byte, 4<<20)
	for i := range data {
		data[i] = byte(i * 7 / 5)
	}
	w, err := os.OpenFile(in, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data); err != nil {
		t.Fatal(err)
	}
	w.Close()
	if _, err := h.svc.CloseIO(h.ctx, &taskAPI.CloseIORequest{ID: "c1", ExecID: "e1", Stdin: true}); err != nil {
		t.Fatal(err)
	}
	ep, _ := h.agent.proc("c1", "e1")
	select {
	case <-ep.stdinEOF:
	case <-time.After(30 * time.Second):
		t.Fatal("the exec's stdin was not closed")
	}
	h.agent.mu.Lock()
	got := ep.stdin
	h.agent.mu.Unlock()
	if !bytes.Equal(got, data) {
		t.Errorf("the exec's stdin: %d bytes, want the %d written", len(got), len(data))
	}
	h.agent.exit("c1", "e1", 0)
	h.wait("c1", "e1")
	h.kill("c1", syscall.SIGKILL)
	h.wait("c1", "")
	h.delete("c1", "")
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestTerminal: a terminal process has stdout only, and ResizePty reaches the agent.
func TestTerminal(t *testing.T) {
	h := newHarness(t)
	outPath, outFd := h.fifo("out")
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Terminal: true, Stdout: outPath, Stderr: filepath.Join(h.dir, "unused")})
	fp, _ := h.agent.proc("c1", "")
	if !fp.stdio.Terminal || !fp.stdio.Stdout || fp.stdio.Stderr {
		t.Errorf("agent stdio %+v", fp.stdio)
	}
	h.start("c1", "")
	if _, err := h.svc.ResizePty(h.ctx, &taskAPI.ResizePtyRequest{ID: "c1", Width: 120, Height: 40}); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-resizes:
		if r.Width != 120 || r.Height != 40 || r.ContainerId != "c1" {
			t.Errorf("resize %+v", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no resize")
	}
	fp.stdout.write([]byte("$ "), false)
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	if out, eof := drain(outFd); string(out) != "$ " || !eof {
		t.Errorf("terminal output %q eof %v", out, eof)
	}
}

// TestLogURIs sends output to file:// and binary:// destinations.
func TestLogURIs(t *testing.T) {
	h := newHarness(t)
	logFile := filepath.Join(h.dir, "logs", "c1.log")
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Stdout: "file://" + logFile, Stderr: "file://" + logFile})
	h.start("c1", "")
	fp, _ := h.agent.proc("c1", "")
	fp.stdout.write([]byte("out\n"), false)
	waitUntil(t, "stdout is in the file", func() bool { b, _ := os.ReadFile(logFile); return string(b) == "out\n" })
	fp.stderr.write([]byte("err\n"), false)
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	if b, _ := os.ReadFile(logFile); string(b) != "out\nerr\n" {
		t.Errorf("log file %q", b)
	}

	// A logging binary: stdout on fd 3, stderr on fd 4, ready when fd 5 closes.
	logDir := filepath.Join(h.dir, "binlog")
	os.Mkdir(logDir, 0o755)
	script := filepath.Join(h.dir, "logger.sh")
	os.WriteFile(script, []byte(`#!/bin/sh
echo "$CONTAINER_ID $CONTAINER_NAMESPACE $1 $2" > "$2/env"
exec 5>&-
cat <&3 > "$2/out" &
cat <&4 > "$2/err" &
wait
`), 0o755)
	h.create(&taskAPI.CreateTaskRequest{ID: "c2", Bundle: h.bundle("c2", inPod("c1")),
		Stdout: "binary://" + script + "?dir=" + logDir, Stderr: "binary://" + script + "?dir=" + logDir})
	h.start("c2", "")
	fp2, _ := h.agent.proc("c2", "")
	fp2.stdout.write([]byte("to the logger\n"), false)
	fp2.stderr.write([]byte("errors too\n"), false)
	h.agent.exit("c2", "", 0)
	h.wait("c2", "")
	// The logger writes on its own time: the bytes were handed to it before TaskExit.
	for name, want := range map[string]string{"env": "c2 kvfs-test dir " + logDir + "\n", "out": "to the logger\n", "err": "errors too\n"} {
		waitUntil(t, "the logger's "+name+" is "+want, func() bool {
			b, _ := os.ReadFile(filepath.Join(logDir, name))
			return string(b) == want
		})
	}
}

// TestPodDeath: the VM dies; every process — running init, running exec, created exec, a
// created container — ends with 255 and a TaskExit, and Delete still cleans up.
func TestPodDeath(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	h.start("c1", "")
	for _, e := range []string{"run", "idle"} {
		if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: e, Spec: procAny(t)}); err != nil {
			t.Fatal(err)
		}
	}
	h.start("c1", "run")
	h.createSimple("c2")
	pod := h.pod()
	pod.die(errors.New("QEMU exited (signal: killed)"))
	for _, p := range [][2]string{{"c1", ""}, {"c1", "run"}, {"c1", "idle"}, {"c2", ""}} {
		if w := h.wait(p[0], p[1]); w.ExitStatus != 255 {
			t.Errorf("%v: exit %d", p, w.ExitStatus)
		}
	}
	exits := 0
	for _, e := range h.rec.all() {
		if x, ok := e.(*eventstypes.TaskExit); ok {
			exits++
			if x.ExitStatus != 255 {
				t.Errorf("TaskExit %+v", x)
			}
		}
	}
	if exits != 4 {
		t.Errorf("%d TaskExit events, want 4: %s", exits, describe(h.rec.all()))
	}
	_, err := h.svc.Start(h.ctx, &taskAPI.StartRequest{ID: "c1", ExecID: "idle"})
	wantKind(t, "Start after the VM died", err, errdefs.ErrFailedPrecondition)
	h.delete("c1", "run")
	h.delete("c1", "idle")
	h.delete("c1", "")
	h.delete("c2", "")
	if len(pod.bound()) != 0 || pod.stopped != 1 {
		t.Errorf("after the deletes: binds %v, stopped %d", pod.bound(), pod.stopped)
	}
	// A new container boots a new pod.
	h.createSimple("c3")
	if h.pod() == pod {
		t.Errorf("the dead pod was reused")
	}
}

// TestCreateRuncIOOptions: runc's options with nothing but IoUid and IoGid, what containerd's
// CRI gives a user-namespaced container's task, are taken as no options: the pod boots with
// the node's configuration.
func TestCreateRuncIOOptions(t *testing.T) {
	h := newHarness(t)
	a, err := typeurl.MarshalAnyToProto(&runcopts.Options{IoUid: 100000, IoGid: 100000})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Options: a}); err != nil {
		t.Fatal(err)
	}
	if len(h.pods) != 1 {
		t.Errorf("%d pods started, want 1", len(h.pods))
	}
	h.delete("c1", "")
}

// TestCreateFailures: bad configuration, a pod that cannot boot, a bad spec: Create fails
// with an error naming the cause, and leaves nothing behind.
func TestCreateFailures(t *testing.T) {
	h := newHarness(t)
	bad := filepath.Join(h.dir, "bad.toml")
	os.WriteFile(bad, []byte("[vm]\nmemroy = \"1G\"\n[agent]\nboot_timeout = \"0s\"\n"), 0o644)
	opts := func(o any) *anypb.Any {
		a, err := typeurl.MarshalAnyToProto(o)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	b := h.bundle("c1", nil)
	for _, tt := range []struct {
		name string
		opts *anypb.Any
		want []string
	}{
		{"unknown key", opts(&runtimeoptions.Options{ConfigPath: bad}), []string{"vm.memroy", "unknown key", bad}},
		{"bad body", opts(&runtimeoptions.Options{ConfigBody: []byte("[agent]\ntransport = \"tcp\"\n")}), []string{"agent.transport", `"tcp"`}},
		{"missing file", opts(&runtimeoptions.Options{ConfigPath: bad + ".none"}), []string{bad + ".none", "no such file"}},
		{"relative path", opts(&runtimeoptions.Options{ConfigPath: "kvfs.toml"}), []string{"ConfigPath", "not an absolute path"}},
		{"runc's options", opts(&runcopts.Options{BinaryName: "runc", IoUid: 100000}), []string{"runc's runtime options", "only IoUid and IoGid"}},
		{"other options", opts(&runcopts.CheckpointOptions{Exit: true}), []string{"runtime options", "runtimeoptions"}},
		{"$KVFS_CONFIG_FILE", nil, []string{"vm.memroy", "unknown key", bad}},
		{"relative $KVFS_CONFIG_FILE", nil, []string{"KVFS_CONFIG_FILE", "not an absolute path"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			switch tt.name {
			case "$KVFS_CONFIG_FILE":
				t.Setenv(ConfigFileEnv, bad)
			case "relative $KVFS_CONFIG_FILE":
				t.Setenv(ConfigFileEnv, "kvfs.toml")
			}
			_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: b, Options: tt.opts})
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("error %v, want InvalidArgument", err)
			}
			for _, w := range tt.want {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("error %v does not contain %q", err, w)
				}
			}
			checkNothingLeft(t, h, b)
		})
	}

	h.startErr = errors.New("QEMU cannot start")
	_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: b})
	if err == nil || !strings.Contains(err.Error(), "QEMU cannot start") {
		t.Errorf("Create with a failing pod: %v", err)
	}
	checkNothingLeft(t, h, b)
	h.startErr = nil

	// A bind mount with a relative source: refused before the pod boots.
	b2 := h.bundle("c2", nil, specs.Mount{Destination: "/data", Type: "bind", Source: "rel/dir", Options: []string{"rbind"}})
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c2", Bundle: b2})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "rel/dir") {
		t.Errorf("Create with a relative bind source: %v", err)
	}
	checkNothingLeft(t, h, b2)
	if len(h.pods) != 0 {
		t.Errorf("a pod was started for a Create that failed before it")
	}

	// A CRI container naming no sandbox.
	b3 := h.bundle("c3", map[string]string{AnnotationContainerType: "container"})
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c3", Bundle: b3})
	wantKind(t, "Create of a CRI container without a sandbox id", err, errdefs.ErrInvalidArgument)

	// A later failure (the agent refuses the container's stdio) after the pod booted: the
	// pod is stopped again and the binds undone.
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c4", Bundle: h.bundle("c4", nil), Stdout: "tcp://x"})
	if err == nil || !strings.Contains(err.Error(), "unknown scheme") {
		t.Errorf("Create with a bad stdout URI: %v", err)
	}
	if p := h.pod(); len(p.bound()) != 0 || p.stopped != 1 {
		t.Errorf("after a failed Create: binds %v, stopped %d", p.bound(), p.stopped)
	}
}

func checkNothingLeft(t *testing.T, h *harness, bundle string) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(bundle, bundleRecordName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the bundle record is left: %v", err)
	}
	h.svc.mu.Lock()
	n := len(h.svc.containers)
	h.svc.mu.Unlock()
	if n != 0 {
		t.Errorf("%d containers listed after a failed Create", n)
	}
	if _, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("State after a failed Create: %v", err)
	}
}

// TestConfigFromOptions: the ConfigPath of the options is the pod's configuration; without
// options, DefaultConfigPath if it exists.
func TestConfigFromOptions(t *testing.T) {
	h := newHarness(t)
	cfgPath := filepath.Join(h.dir, "kvfs.toml")
	os.WriteFile(cfgPath, []byte("base_dir = \"/tmp/kvfs-x\"\n[agent]\nboot_timeout = \"30s\"\n"), 0o644)
	a, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: cfgPath})
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Options: a})
	if c := h.pod().req.Config; c.BaseDir != "/tmp/kvfs-x" || c.Agent.BootTimeoutDuration() != 30*time.Second {
		t.Errorf("pod config %+v", c)
	}
	rec, err := readBundleRecord(filepath.Join(h.dir, "bundles", "c1"))
	if err != nil || rec.SandboxID != "c1" || rec.BaseDir != "/tmp/kvfs-x" {
		t.Errorf("bundle record %+v, %v", rec, err)
	}

	h2 := newHarness(t)
	h2.svc.opts.DefaultConfigPath = cfgPath
	h2.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h2.bundle("c1", nil)})
	if c := h2.pod().req.Config; c.BaseDir != "/tmp/kvfs-x" {
		t.Errorf("pod config without options %+v", c)
	}
}

// TestPodGrouping: containers naming a sandbox join its pod; Shutdown waits for the last.
func TestPodGrouping(t *testing.T) {
	h := newHarness(t)
	sbAnn := map[string]string{AnnotationContainerType: "sandbox", AnnotationSandboxID: "pod1"}
	h.create(&taskAPI.CreateTaskRequest{ID: "pod1", Bundle: h.bundle("pod1", sbAnn)})
	h.create(&taskAPI.CreateTaskRequest{ID: "app", Bundle: h.bundle("app", map[string]string{AnnotationContainerType: "container", AnnotationSandboxID: "pod1"})})
	if len(h.pods) != 1 || h.pod().req.ID != "pod1" || h.pod().req.Annotations[AnnotationSandboxID] != "pod1" {
		t.Fatalf("pods %d, request %+v", len(h.pods), h.pod().req)
	}
	_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "other", Bundle: h.bundle("other", map[string]string{AnnotationSandboxID: "pod2"})})
	wantKind(t, "Create for another sandbox", err, errdefs.ErrInvalidArgument)
	h.delete("app", "")
	if _, err := h.svc.Shutdown(h.ctx, &taskAPI.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.sd.Done():
		t.Fatal("Shutdown with a container left shut the shim down")
	default:
	}
	if h.pod().stopped != 0 {
		t.Errorf("the pod stopped with a container left")
	}
	h.delete("pod1", "")
	if h.pod().stopped != 1 {
		t.Errorf("the last Delete did not stop the pod")
	}
}

// TestRootfsMount mounts containerd's rootfs mounts at <bundle>/rootfs and binds host
// mounts into the share; Delete undoes both.
func TestRootfsMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	h := newHarness(t)
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "marker"), []byte("x"), 0o644)
	vol := t.TempDir()
	b := h.bundle("c1", nil,
		specs.Mount{Destination: "/data", Type: "bind", Source: vol, Options: []string{"rbind", "ro"}},
		specs.Mount{Destination: "/proc", Type: "proc", Source: "proc"})
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: b, Rootfs: []*types.Mount{{Type: "bind", Source: src, Options: []string{"rbind"}}}})
	if _, err := os.Stat(filepath.Join(b, "rootfs", "marker")); err != nil {
		t.Fatalf("the rootfs is not mounted: %v", err)
	}
	binds := h.pod().bound()
	name := "c1-0-" + filepath.Base(vol)
	if binds["c1"].Source != filepath.Join(b, "rootfs") || !reflect.DeepEqual(binds[name], HostBind{Source: vol, Name: name, Flags: sandbox.BindRecursive | sandbox.BindReadOnly}) {
		t.Errorf("binds %+v", binds)
	}
	h.start("c1", "")
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	h.delete("c1", "")
	if _, err := os.Stat(filepath.Join(b, "rootfs", "marker")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the rootfs is still mounted: %v", err)
	}
	if out, _ := exec.Command("findmnt", "-rn", filepath.Join(b, "rootfs")).Output(); len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("mount left: %s", out)
	}
}

// TestDeleteCreated: a created container's Delete kills it first, then deletes it.
// TestSubmountsToAgent: the agent is told where the host's mounts below the container's root
// and recursive binds are in the share, and not of those below a bind that does not carry
// them.
func TestSubmountsToAgent(t *testing.T) {
	h := newHarness(t)
	b := h.bundle("c1", nil,
		specs.Mount{Destination: "/vol", Type: "bind", Source: "/host/vol", Options: []string{"rbind", "ro"}},
		specs.Mount{Destination: "/flat", Type: "bind", Source: "/host/flat", Options: []string{"bind"}})
	h.mountsIn = map[string][]string{
		filepath.Join(b, "rootfs"): {"proc-like"},
		"/host/vol":                {"tmp", "tmp/deeper"},
		"/host/flat":               {"not-carried"},
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: b})
	want := []string{"/run/kvfs/shared/c1/proc-like", "/run/kvfs/shared/c1-0-vol/tmp", "/run/kvfs/shared/c1-0-vol/tmp/deeper"}
	if got := h.agent.submounts["c1"]; !slices.Equal(got, want) {
		t.Errorf("the agent was told of the submounts %q, want %q", got, want)
	}
}

func TestDeleteCreated(t *testing.T) {
	h := newHarness(t)
	h.createSimple("c1")
	d := h.delete("c1", "")
	if d.ExitStatus != 137 {
		t.Errorf("Delete answered %+v", d)
	}
	if s := h.agent.signals; len(s) != 1 || s[0].Signal != 9 || s[0].ContainerId != "c1" {
		t.Errorf("signals %v", s)
	}
	if got := strings.Join(eventTypes(h.rec.all()), " "); got != "Create exit:c1 Delete" {
		t.Errorf("events %q", got)
	}
}

// TestConcurrentCreates: while the first Create boots the pod, a second one for the same pod
// waits for the boot, and calls about other things are answered at once: no service lock is
// held across the boot.
func TestConcurrentCreates(t *testing.T) {
	h := newHarness(t)
	release := make(chan struct{})
	booting := make(chan struct{})
	inner := h.svc.opts.StartVM
	h.svc.opts.StartVM = func(ctx context.Context, req PodRequest) (VM, error) {
		close(booting)
		<-release
		return inner(ctx, req)
	}
	errs := make(chan error, 2)
	create := func(id string) {
		b := h.bundle(id, inPod("pod"))
		go func() {
			_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: id, Bundle: b})
			errs <- err
		}()
	}
	// c1 boots the pod; c2 comes while it boots.
	create("c1")
	<-booting
	create("c2")
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "other"})
		h.svc.Connect(h.ctx, &taskAPI.ConnectRequest{ID: "c1"})
		_, err := h.svc.Start(h.ctx, &taskAPI.StartRequest{ID: "c1"})
		wantKind(t, "Start while its Create boots the pod", err, errdefs.ErrFailedPrecondition)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("calls were blocked by the pod's boot")
	}
	close(release)
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if len(h.pods) != 1 {
		t.Errorf("%d pods booted, want 1", len(h.pods))
	}
}

// TestHostileOutput: an agent that answers more output than asked is cut off; the process's
// exit still completes.
func TestHostileOutput(t *testing.T) {
	h := newHarness(t)
	h.agent.oversize = readMax + 1
	outPath, outFd := h.fifo("out")
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Stdout: outPath})
	h.start("c1", "")
	h.agent.exit("c1", "", 0)
	if w := h.wait("c1", ""); w.ExitStatus != 0 {
		t.Errorf("exit %d", w.ExitStatus)
	}
	if out, eof := drain(outFd); len(out) != 0 || !eof {
		t.Errorf("%d bytes of the oversized answer reached the fifo (closed %v)", len(out), eof)
	}
}
