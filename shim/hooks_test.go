package shim

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"

	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// hookTrace is one file that the agent's calls, the pod's unbinds, the events and the hook
// scripts all append their lines to, in the order they happen.
type hookTrace struct {
	t    *testing.T
	path string
	mu   sync.Mutex
}

func newHookTrace(h *harness) *hookTrace {
	tr := &hookTrace{t: h.t, path: filepath.Join(h.dir, "trace")}
	h.agent.trace = tr.add
	h.rec.onPublish = func(e any) { tr.add(fmt.Sprintf("event:%T", e)) }
	return tr
}

func (tr *hookTrace) add(line string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	f, err := os.OpenFile(tr.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		tr.t.Error(err)
		return
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		tr.t.Error(err)
	}
}

// hook writes a script that appends "name STATE-JSON" to the trace, prints out and exits with
// status code.
func (tr *hookTrace) hook(name, out string, code int) specs.Hook {
	tr.t.Helper()
	p := filepath.Join(filepath.Dir(tr.path), "hook-"+name)
	body := fmt.Sprintf("#!/bin/sh\nstate=$(/bin/cat)\necho \"%s $state\" >>%s\necho %s\nexit %d\n", name, tr.path, out, code)
	if err := os.WriteFile(p, []byte(body), 0o755); err != nil {
		tr.t.Fatal(err)
	}
	return specs.Hook{Path: p}
}

// lines returns the trace: each line's first word, and the states the hooks read.
func (tr *hookTrace) lines() ([]string, map[string]specs.State) {
	tr.t.Helper()
	b, err := os.ReadFile(tr.path)
	if err != nil {
		tr.t.Fatal(err)
	}
	var names []string
	states := map[string]specs.State{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		name, state, _ := strings.Cut(l, " ")
		if strings.HasPrefix(state, "{") {
			var st specs.State
			if err := json.Unmarshal([]byte(state), &st); err != nil {
				tr.t.Fatalf("trace line %q: %v", l, err)
			}
			states[name] = st
		} else if state != "" {
			name += " " + state
		}
		names = append(names, name)
	}
	return names, states
}

// withHooks writes the bundle of container id in pod "pod" with hooks in its spec.
func (h *harness) withHooks(id string, hk *specs.Hooks) string {
	h.t.Helper()
	b := h.bundle(id, inPod("pod"))
	cfg := filepath.Join(b, "config.json")
	data, err := os.ReadFile(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		h.t.Fatal(err)
	}
	spec.Hooks = hk
	data, _ = json.Marshal(&spec)
	if err := os.WriteFile(cfg, data, 0o644); err != nil {
		h.t.Fatal(err)
	}
	return b
}

// TestHooksAroundAgentCalls: prestart and createRuntime run after the agent created the
// container and before TaskCreate, poststart after the agent started it and before Start
// returns, poststop after the agent deleted it and its binds are gone; each once, in order,
// with the container's state. The container-namespace phases go to the guest, not run here.
func TestHooksAroundAgentCalls(t *testing.T) {
	h := newHarness(t)
	tr := newHookTrace(h)
	hk := &specs.Hooks{
		Prestart:        []specs.Hook{tr.hook("prestart0", "", 0), tr.hook("prestart1", "", 0)},
		CreateRuntime:   []specs.Hook{tr.hook("createRuntime", "", 0)},
		CreateContainer: []specs.Hook{tr.hook("createContainer-on-the-host", "", 0)},
		StartContainer:  []specs.Hook{tr.hook("startContainer-on-the-host", "", 0)},
		Poststart:       []specs.Hook{tr.hook("poststart", "", 0)},
		Poststop:        []specs.Hook{tr.hook("poststop", "", 0)},
	}
	bundle := h.withHooks("c1", hk)
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: bundle})
	tr.add("test:created")
	h.start("c1", "")
	tr.add("test:started")
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	h.delete("c1", "")
	tr.add("test:deleted")

	names, states := tr.lines()
	want := []string{
		"agent:create c1", "prestart0", "prestart1", "createRuntime", "event:*events.TaskCreate", "test:created",
		"agent:start c1", "event:*events.TaskStart", "poststart", "test:started",
		"event:*events.TaskExit",
		// The pod's last container: not deleted in the guest, which the VM's stop ends.
		"pod:unbind c1", "poststop", "event:*events.TaskDelete", "agent:shutdown", "test:deleted",
	}
	if !reflect.DeepEqual(names, want) {
		t.Errorf("trace\n got %q\nwant %q", names, want)
	}
	ann := inPod("pod")
	for name, status := range map[string]specs.ContainerState{
		"prestart0": specs.StateCreating, "prestart1": specs.StateCreating, "createRuntime": specs.StateCreating,
		"poststart": specs.StateRunning, "poststop": specs.StateStopped,
	} {
		want := specs.State{Version: specs.Version, ID: "c1", Status: status, Pid: fakeVMPid, Bundle: bundle, Annotations: ann}
		if got := states[name]; !reflect.DeepEqual(got, want) {
			t.Errorf("%s's state\n got %+v\nwant %+v", name, got, want)
		}
	}

	var guest specs.Spec
	h.agent.mu.Lock()
	err := json.Unmarshal(h.agent.specs["c1"], &guest)
	h.agent.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	wantGuest := &specs.Hooks{CreateContainer: hk.CreateContainer, StartContainer: hk.StartContainer}
	if !reflect.DeepEqual(guest.Hooks, wantGuest) {
		t.Errorf("the guest's hooks %+v, want %+v", guest.Hooks, wantGuest)
	}
}

// TestHookCreateRuntimeFails: a failing createRuntime hook fails Create with an error that
// names it and its output, stops the phase, and leaves nothing: the agent deleted the
// container, the binds are gone, the pod stopped; then the poststop hooks run, as the runtime
// spec says.
func TestHookCreateRuntimeFails(t *testing.T) {
	h := newHarness(t)
	tr := newHookTrace(h)
	hk := &specs.Hooks{
		Prestart:      []specs.Hook{tr.hook("prestart", "", 0)},
		CreateRuntime: []specs.Hook{tr.hook("createRuntime", "no-such-device", 3), tr.hook("createRuntime-after", "", 0)},
		Poststart:     []specs.Hook{tr.hook("poststart", "", 0)},
		Poststop:      []specs.Hook{tr.hook("poststop", "", 0)},
	}
	bundle := h.withHooks("c1", hk)
	_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: bundle})
	if err == nil {
		t.Fatal("Create succeeded")
	}
	for _, want := range []string{"container c1", "createRuntime hook 0 (" + hk.CreateRuntime[0].Path + ")", "exit status 3", "no-such-device"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Create's error %q does not say %q", err, want)
		}
	}
	names, states := tr.lines()
	want := []string{"agent:create c1", "prestart", "createRuntime", "agent:delete c1", "pod:unbind c1", "poststop", "agent:shutdown"}
	if !reflect.DeepEqual(names, want) {
		t.Errorf("trace\n got %q\nwant %q", names, want)
	}
	if st := states["poststop"]; st.ID != "c1" || st.Status != specs.StateStopped {
		t.Errorf("poststop's state %+v", st)
	}
	if b := h.pod().bound(); len(b) != 0 {
		t.Errorf("still bound: %v", b)
	}
	if h.pod().stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once: its only container failed", h.pod().stopped)
	}
	if _, err := os.Stat(filepath.Join(bundle, bundleRecordName)); !os.IsNotExist(err) {
		t.Errorf("the bundle record is left: %v", err)
	}
	_, err = h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1"})
	wantKind(t, "State after the failed Create", err, errdefs.ErrNotFound)
	if evs := h.rec.all(); len(evs) != 0 {
		t.Errorf("events %s, want none", describe(evs))
	}
}

// TestHookPostFailuresLogged: failing poststart and poststop hooks are logged with their
// output and fail neither Start nor Delete; the hooks after them still run.
func TestHookPostFailuresLogged(t *testing.T) {
	h := newHarness(t)
	logs := &syncbuf.Buffer{}
	logger := logrus.New()
	logger.SetOutput(logs)
	h.svc.ctx = log.WithLogger(h.svc.ctx, logrus.NewEntry(logger))
	tr := newHookTrace(h)
	hk := &specs.Hooks{
		Poststart: []specs.Hook{tr.hook("poststart", "poststart-said-no", 1), tr.hook("poststart-after", "", 0)},
		Poststop:  []specs.Hook{tr.hook("poststop", "poststop-said-no", 2), tr.hook("poststop-after", "", 0)},
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.withHooks("c1", hk)})
	h.start("c1", "")
	h.agent.exit("c1", "", 0)
	h.wait("c1", "")
	h.delete("c1", "")
	names, _ := tr.lines()
	want := []string{
		"agent:create c1", "event:*events.TaskCreate", "agent:start c1", "event:*events.TaskStart",
		"poststart", "poststart-after", "event:*events.TaskExit",
		"pod:unbind c1", "poststop", "poststop-after", "event:*events.TaskDelete", "agent:shutdown",
	}
	if !reflect.DeepEqual(names, want) {
		t.Errorf("trace\n got %q\nwant %q", names, want)
	}
	h.rec.waitFor(t, "TaskDelete", func(e any) bool { _, ok := e.(*eventstypes.TaskDelete); return ok })
	for _, want := range []string{"poststart hook 0 (" + hk.Poststart[0].Path + "): exit status 1", "poststart-said-no",
		"poststop hook 0 (" + hk.Poststop[0].Path + "): exit status 2", "poststop-said-no"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, logs.String())
		}
	}
}
