package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/containers"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// markers is a trace file that host hook scripts and the test append lines to.
type markers struct {
	t    *testing.T
	dir  string
	mu   sync.Mutex
	path string
}

func newMarkers(t *testing.T) *markers {
	dir := t.TempDir()
	return &markers{t: t, dir: dir, path: filepath.Join(dir, "trace")}
}

// hook is a host hook script that appends "name STATE-JSON" to the trace, prints out and
// exits with code.
func (m *markers) hook(name, out string, code int) specs.Hook {
	m.t.Helper()
	p := filepath.Join(m.dir, name)
	body := fmt.Sprintf("#!/bin/sh\nstate=$(/bin/cat)\necho \"%s $state\" >>%s\necho %s\nexit %d\n", name, m.path, out, code)
	if err := os.WriteFile(p, []byte(body), 0o755); err != nil {
		m.t.Fatal(err)
	}
	return specs.Hook{Path: p}
}

func (m *markers) add(line string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f, err := os.OpenFile(m.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		m.t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		m.t.Fatal(err)
	}
}

// lines is the trace: each line's name, and the state each hook read on its stdin.
func (m *markers) lines() ([]string, map[string]specs.State) {
	m.t.Helper()
	b, err := os.ReadFile(m.path)
	if err != nil {
		m.t.Fatal(err)
	}
	var names []string
	states := map[string]specs.State{}
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		name, state, _ := strings.Cut(l, " ")
		if state != "" {
			var st specs.State
			if err := json.Unmarshal([]byte(state), &st); err != nil {
				m.t.Fatalf("trace line %q: %v", l, err)
			}
			states[name] = st
		}
		names = append(names, name)
	}
	return names, states
}

func withHooks(h *specs.Hooks) oci.SpecOpts {
	return func(_ context.Context, _ oci.Client, _ *containers.Container, s *specs.Spec) error {
		s.Hooks = h
		return nil
	}
}

// newHookedContainer makes container id of the busybox image, running args, with hooks.
func newHookedContainer(t *testing.T, e *shimtest.Env, ctx context.Context, cl *client.Client, id string, h *specs.Hooks, args ...string) client.Container {
	t.Helper()
	img, err := cl.GetImage(ctx, e.Image)
	if err != nil {
		t.Fatal(err)
	}
	ctn, err := cl.NewContainer(ctx, id,
		client.WithImage(img),
		client.WithNewSnapshot(id+"-snapshot", img),
		client.WithRuntime(shimtest.RuntimeType, &runtimeoptions.Options{ConfigPath: e.Config}),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs(args...), withHooks(h)),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ctn.Delete(context.Background(), client.WithSnapshotCleanup) })
	return ctn
}

// TestHooks: through the containerd Go client, each host hook (prestart, createRuntime,
// poststart, poststop) runs once, in order, around the task's create, start and delete, with
// the container's state on its stdin; the createContainer and startContainer hooks run in the
// guest, in the container's namespaces: one before pivot_root, with the guest's /bin/sh,
// writes into the container's root by its guest path, the other in the container's root,
// and the container reads what both wrote.
func TestHooks(t *testing.T) {
	e := newEnv(t, "")
	cl := e.C.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m := newMarkers(t)
	const id = "hooked"
	guestRoot := path.Join(agent.SharedDir, id)
	h := &specs.Hooks{
		Prestart:        []specs.Hook{m.hook("prestart", "", 0)},
		CreateRuntime:   []specs.Hook{m.hook("createRuntime", "", 0)},
		CreateContainer: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "echo created in the guest >" + guestRoot + "/created-marker"}}},
		StartContainer:  []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "echo started in the container >/started-marker"}}},
		Poststart:       []specs.Hook{m.hook("poststart", "", 0)},
		Poststop:        []specs.Hook{m.hook("poststop", "", 0)},
	}
	ctn := newHookedContainer(t, e, ctx, cl, id, h, "cat", "/created-marker", "/started-marker")

	var stdout, stderr strings.Builder
	task, err := ctn.NewTask(ctx, cio.NewCreator(cio.WithStreams(nil, &stdout, &stderr), cio.WithFIFODir(e.C.FIFODir())))
	if err != nil {
		t.Fatal(err)
	}
	m.add("test:created")
	// The state's pid is the pod's VM's: the pod's one QEMU process.
	pid := 0
	for _, p := range e.C.Snapshot(t).Processes {
		if strings.Contains(p.Cmdline, "qemu-system") {
			pid = p.PID
		}
	}
	exited, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}
	m.add("test:started")
	select {
	case st := <-exited:
		if st.ExitCode() != 0 {
			t.Errorf("the container exited %d, stderr %q", st.ExitCode(), stderr.String())
		}
	case <-ctx.Done():
		t.Fatal("the container did not exit")
	}
	if _, err := task.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	m.add("test:deleted")

	names, states := m.lines()
	want := []string{"prestart", "createRuntime", "test:created", "poststart", "test:started", "poststop", "test:deleted"}
	if !reflect.DeepEqual(names, want) {
		t.Errorf("trace %q, want %q", names, want)
	}
	for name, status := range map[string]specs.ContainerState{
		"prestart": specs.StateCreating, "createRuntime": specs.StateCreating, "poststart": specs.StateRunning, "poststop": specs.StateStopped,
	} {
		st := states[name]
		if st.ID != id || st.Status != status || st.Pid != pid || filepath.Base(st.Bundle) != id {
			t.Errorf("%s's state %+v, want id %s, status %s, pid %d (the VM's), the task's bundle", name, st, id, status, pid)
		}
	}
	if want := "created in the guest\nstarted in the container\n"; stdout.String() != want {
		t.Errorf("the container's stdout %q (stderr %q), want %q: the guest hooks did not run", stdout.String(), stderr.String(), want)
	}
}

// TestHookPrestartFails: a failing prestart hook fails the task's creation with an error that
// names it and its output; nothing is left of the task (no shim, VM, mount, sandbox
// directory or task bundle) and the poststop hooks ran.
func TestHookPrestartFails(t *testing.T) {
	e := newEnv(t, "")
	cl := e.C.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m := newMarkers(t)
	const id = "refused"
	h := &specs.Hooks{
		Prestart:      []specs.Hook{m.hook("prestart", "prestart-refused-this-one", 7)},
		CreateRuntime: []specs.Hook{m.hook("createRuntime", "", 0)},
		Poststop:      []specs.Hook{m.hook("poststop", "", 0)},
	}
	ctn := newHookedContainer(t, e, ctx, cl, id, h, "true")
	before := e.C.Snapshot(t)

	task, err := ctn.NewTask(ctx, cio.NullIO)
	if err == nil {
		task.Delete(context.Background(), client.WithProcessKill)
		t.Fatal("the task was created")
	}
	for _, want := range []string{"prestart hook 0 (" + h.Prestart[0].Path + ")", "exit status 7", "prestart-refused-this-one"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("NewTask's error %q does not say %q", err, want)
		}
	}
	e.C.CheckNoLeaks(t, before)
	if _, err := ctn.Task(ctx, nil); !errdefs.IsNotFound(err) {
		t.Errorf("the container's task after the failed create: %v, want not found", err)
	}
	bundle := filepath.Join(e.C.Dir(), "state", "io.containerd.runtime.v2.task", e.C.Namespace(), id)
	if _, err := os.Stat(bundle); !os.IsNotExist(err) {
		t.Errorf("the task's bundle %s: %v, want it gone", bundle, err)
	}
	if names, _ := m.lines(); !reflect.DeepEqual(names, []string{"prestart", "poststop"}) {
		t.Errorf("hooks that ran: %q, want prestart then poststop", names)
	}
}
