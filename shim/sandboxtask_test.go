package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvfs/kvfs/sandbox"
)

// criSandbox is the annotations CRI gives its pod sandbox container id.
func criSandbox(id string, extra map[string]string) map[string]string {
	m := map[string]string{AnnotationContainerType: containerTypeSandbox, AnnotationSandboxID: id}
	for k, v := range extra {
		m[k] = v
	}
	return m
}

// criContainer is the annotations CRI gives a container of pod sandbox.
func criContainer(sandbox string) map[string]string {
	return map[string]string{AnnotationContainerType: containerTypeContainer, AnnotationSandboxID: sandbox}
}

// TestSandboxTaskHostNamespaces: a pod sandbox container without a PID or IPC namespace of
// its own (Kubernetes' hostPID, hostIPC) is refused, and no pod is started.
func TestSandboxTaskHostNamespaces(t *testing.T) {
	h := newHarness(t)
	for name, keep := range map[string]specs.LinuxNamespaceType{"hostPID": specs.IPCNamespace, "hostIPC": specs.PIDNamespace} {
		b := h.bundle("pod", criSandbox("pod", nil))
		spec, err := readSpec(b)
		if err != nil {
			t.Fatal(err)
		}
		spec.Linux.Namespaces = []specs.LinuxNamespace{{Type: keep}, {Type: specs.NetworkNamespace}}
		data, _ := json.Marshal(spec)
		if err := os.WriteFile(filepath.Join(b, "config.json"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "pod", Bundle: b})
		wantKind(t, name, err, errdefs.ErrInvalidArgument)
		if err == nil || !strings.Contains(err.Error(), "("+name+") namespace: not supported") {
			t.Errorf("%s: %v, want a refusal that names it", name, err)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pods) != 0 {
		t.Errorf("%d pods started for refused sandboxes", len(h.pods))
	}
}

// TestSandboxTaskSystemdCgroup: where systemd is not running, a pod sandbox container whose
// cgroup is a systemd path (containerd's SystemdCgroup) is refused, naming it and why: no pod
// is started, no record left for the delete action.
func TestSandboxTaskSystemdCgroup(t *testing.T) {
	noSystemd(t)
	h := newHarness(t)
	b := h.bundle("pod", criSandbox("pod", nil))
	spec, err := readSpec(b)
	if err != nil {
		t.Fatal(err)
	}
	const cg = "kubepods-besteffort-pod1.slice:cri-containerd:pod"
	spec.Linux.CgroupsPath = cg
	data, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(b, "config.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "pod", Bundle: b})
	wantKind(t, "systemd cgroup", err, errdefs.ErrFailedPrecondition)
	if err == nil || !strings.Contains(err.Error(), `"`+cg+`"`) || !strings.Contains(err.Error(), "systemd is not running") {
		t.Errorf("Create: %v; want a refusal naming %s and that systemd is not running", err, cg)
	}
	if _, err := readBundleRecord(b); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the bundle's record after the refused Create: %v; want none", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.pods) != 0 {
		t.Errorf("%d pods started for a refused sandbox", len(h.pods))
	}
}

// TestSandboxTask: CRI's pod sandbox container boots the pod and runs nothing: no rootfs is
// mounted or bound, the agent never hears of it, its pid is the VM's; it exits as the pause
// process would; the pod's containers run beside it in its VM; its stats are the pod's.
func TestSandboxTask(t *testing.T) {
	h := newHarness(t)
	b := h.bundle("pod", criSandbox("pod", nil))
	// The snapshot CRI mounts for the pause image: the shim must not mount it.
	resp := h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: b,
		Rootfs: []*types.Mount{{Type: "bogus-never-mounted", Source: "none"}}})
	if resp.Pid != fakeVMPid {
		t.Errorf("the sandbox's pid %d, want the VM's %d", resp.Pid, fakeVMPid)
	}
	if !h.pod().req.SandboxTask {
		t.Error("the pod was not started for a sandbox task")
	}
	if got := h.pod().bound(); len(got) != 0 {
		t.Errorf("binds for the sandbox: %v", got)
	}
	h.agent.mu.Lock()
	_, told := h.agent.specs["pod"]
	h.agent.mu.Unlock()
	if told {
		t.Error("the agent was asked to create the sandbox container")
	}
	if _, err := os.Stat(filepath.Join(b, "rootfs", "x")); err == nil {
		t.Error("the rootfs was mounted")
	}
	h.start("pod", "")
	if st, _ := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "pod"}); st.GetPid() != fakeVMPid {
		t.Errorf("State's pid %d", st.GetPid())
	}

	// A container of the pod joins its VM.
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", criContainer("pod"))})
	h.start("c1", "")
	if n := len(h.pods); n != 1 {
		t.Errorf("%d pods started, want 1", n)
	}
	if _, ok := h.pod().bound()["c1"]; !ok {
		t.Errorf("c1's rootfs is not bound: %v", h.pod().bound())
	}

	_, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "pod", ExecID: "e1", Spec: procAny(t)})
	wantKind(t, "exec in the sandbox", err, errdefs.ErrNotImplemented)
	_, err = h.svc.Pause(h.ctx, &taskAPI.PauseRequest{ID: "pod"})
	wantKind(t, "pause the sandbox", err, errdefs.ErrNotImplemented)

	st, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "pod"})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := typeurl.UnmarshalAny(st.Stats); err != nil || v.(*cgroupstats.Metrics).GetPids().GetCurrent() != 0 {
		t.Errorf("the sandbox's stats %v, %v: want the pod's", v, err)
	}
	h.agent.mu.Lock()
	asked := strings.Join(h.agent.statsAsked, ",")
	h.agent.mu.Unlock()
	if asked != "" {
		t.Errorf("the agent was asked for stats of %q, want the pod's (no id)", asked)
	}

	// Signals that do not end the pause process leave it running.
	for _, sig := range []syscall.Signal{syscall.SIGCHLD, syscall.SIGWINCH, 0} {
		if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "pod", Signal: uint32(sig)}); err != nil {
			t.Fatalf("kill -%d: %v", sig, err)
		}
	}
	if s := h.status("pod", ""); s.String() != "RUNNING" {
		t.Errorf("after ignored signals the sandbox is %v", s)
	}
	// CRI's StopPodSandbox: the containers first, then the sandbox with SIGKILL.
	h.kill("c1", syscall.SIGKILL)
	h.wait("c1", "")
	h.kill("pod", syscall.SIGKILL)
	if w := h.wait("pod", ""); w.ExitStatus != 137 {
		t.Errorf("the sandbox exited %d after SIGKILL, want 137", w.ExitStatus)
	}
	h.delete("c1", "")
	if h.pod().stopped != 0 {
		t.Error("the pod stopped while its sandbox task was still there")
	}
	h.delete("pod", "")
	if h.pod().stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once", h.pod().stopped)
	}
	if got := strings.Join(eventTypes(h.rec.all()), " "); got != "Create Start Create Start exit:c1 exit:pod Delete Delete" {
		t.Errorf("events %q", got)
	}
}

// TestSandboxTaskTerm: SIGTERM ends the sandbox task with status 0, as the pause process; the
// pod's death ends it with exitVMDied.
func TestSandboxTaskTerm(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(h *harness)
		want uint32
	}{
		{"SIGTERM", func(h *harness) { h.kill("pod", syscall.SIGTERM) }, 0},
		{"SIGHUP", func(h *harness) { h.kill("pod", syscall.SIGHUP) }, 128 + 1},
		{"the VM dies", func(h *harness) { h.pod().die(errors.New("QEMU exited (test)")) }, exitVMDied},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: h.bundle("pod", criSandbox("pod", nil))})
			h.start("pod", "")
			tc.end(h)
			if w := h.wait("pod", ""); w.ExitStatus != tc.want {
				t.Errorf("exit status %d, want %d", w.ExitStatus, tc.want)
			}
			h.delete("pod", "")
		})
	}
}

// TestSandboxSizing: the pod's CPU quota and memory limit from CRI's annotations are added
// to the configured VM size; bad values are named.
func TestSandboxSizing(t *testing.T) {
	cfg := sandbox.DefaultConfig()
	cfg.VM.VCPUs, cfg.VM.Memory = 1, "512M"
	sizeOf := func(annotations map[string]string) (*sandbox.Config, error) {
		r, err := resourcesOfAnnotations(annotations)
		if err != nil {
			return nil, err
		}
		return sizePod(cfg, r)
	}
	got, err := sizeOf(map[string]string{
		AnnotationSandboxCPUPeriod: "100000", AnnotationSandboxCPUQuota: "150000",
		AnnotationSandboxMemory: "268435457"})
	if err != nil {
		t.Fatal(err)
	}
	wantCPUs := min(1+2, runtime.NumCPU())
	if got.VM.VCPUs != wantCPUs || got.VM.Memory != "769M" {
		t.Errorf("sized %d vCPUs, %s; want %d, 769M", got.VM.VCPUs, got.VM.Memory, wantCPUs)
	}
	if cfg.VM.VCPUs != 1 || cfg.VM.Memory != "512M" {
		t.Error("sizePod changed its argument")
	}
	same, err := sizeOf(map[string]string{AnnotationSandboxCPUQuota: "0", AnnotationSandboxCPUPeriod: "100000"})
	if err != nil || same.VM.VCPUs != 1 || same.VM.Memory != "512M" {
		t.Errorf("without limits: %v %v %v", same.VM.VCPUs, same.VM.Memory, err)
	}
	huge, err := sizeOf(map[string]string{AnnotationSandboxCPUQuota: "100000000", AnnotationSandboxCPUPeriod: "1000"})
	if err != nil || huge.VM.VCPUs != runtime.NumCPU() {
		t.Errorf("a quota beyond the host: %d vCPUs, %v; want the host's %d", huge.VM.VCPUs, err, runtime.NumCPU())
	}
	for _, bad := range []map[string]string{
		{AnnotationSandboxMemory: "-1"},
		{AnnotationSandboxCPUQuota: "lots"},
		{AnnotationSandboxMemory: "9223372036854775807"},
	} {
		if _, err := sizeOf(bad); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}

	// Through Create: the pod is started with the sized configuration, and a bad annotation
	// fails the sandbox's Create with its name.
	h := newHarness(t)
	h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: h.bundle("pod", criSandbox("pod", map[string]string{
		AnnotationSandboxMemory: "1073741824"}))})
	base, _ := sandbox.ParseMemorySize(sandbox.DefaultConfig().VM.Memory)
	if want := fmt.Sprintf("%dM", base>>20+1024); h.pod().req.Config.VM.Memory != want {
		t.Errorf("the pod's memory %s, want %s", h.pod().req.Config.VM.Memory, want)
	}
	h2 := newHarness(t)
	_, err = h2.svc.Create(h2.ctx, &taskAPI.CreateTaskRequest{ID: "pod", Bundle: h2.bundle("pod", criSandbox("pod", map[string]string{
		AnnotationSandboxMemory: "1G"}))})
	wantKind(t, "a bad sandbox-memory", err, errdefs.ErrInvalidArgument)
	if err == nil || !strings.Contains(err.Error(), AnnotationSandboxMemory) {
		t.Errorf("the error does not name the annotation: %v", err)
	}
}

func (h *harness) kill(id string, sig syscall.Signal) {
	h.t.Helper()
	if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: id, Signal: uint32(sig)}); err != nil {
		h.t.Fatalf("Kill %s -%d: %v", id, sig, err)
	}
}

// TestSandboxHostname: the sandbox container's hostname is the pod's, for the guest; one that
// could not be the kernel's hostname (or a word of its command line) fails Create, named.
func TestSandboxHostname(t *testing.T) {
	withHostname := func(h *harness, id, name string) string {
		b := h.bundle(id, criSandbox(id, nil))
		p := filepath.Join(b, "config.json")
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		var spec specs.Spec
		if err := json.Unmarshal(data, &spec); err != nil {
			t.Fatal(err)
		}
		spec.Hostname = name
		data, _ = json.Marshal(&spec)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return b
	}
	h := newHarness(t)
	h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: withHostname(h, "pod", "web-0")})
	if got := h.pod().req.Hostname; got != "web-0" {
		t.Errorf("the pod's hostname %q, want web-0", got)
	}
	for _, bad := range []string{"a b", "x kvfs.tag=evil", "-lead", strings.Repeat("h", 65)} {
		h := newHarness(t)
		_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "pod", Bundle: withHostname(h, "pod", bad)})
		wantKind(t, "hostname "+bad, err, errdefs.ErrInvalidArgument)
		if err == nil || !strings.Contains(err.Error(), "hostname") {
			t.Errorf("hostname %q: the error does not name it: %v", bad, err)
		}
	}
}

// TestCreateNeverUnimplemented: an agent older than the shim (Unimplemented from the guest)
// fails Create as FailedPrecondition, naming the call: containerd would take Unimplemented
// from Create as a shim without task API v3. A restore is still Unimplemented. Through ttrpc
// and the shim's error edge, as containerd meets it.
func TestCreateNeverUnimplemented(t *testing.T) {
	h := newHarness(t)
	task := taskOverTTRPC(t, h.svc.TaskService)
	h.startErr = status.Error(codes.Unimplemented, "method ConfigureNetwork")
	_, err := task.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", inPod("pod"))})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "ConfigureNetwork") {
		t.Errorf("Create with an old agent: %v, want FailedPrecondition naming the call", err)
	}
	_, err = task.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c2", Bundle: h.bundle("c2", inPod("pod")), Checkpoint: "/x"})
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("a restore: %v, want Unimplemented", err)
	}
	// Any other call's errdefs kind becomes its gRPC code.
	_, err = task.State(h.ctx, &taskAPI.StateRequest{ID: "none"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("State of no container: %v, want NotFound", err)
	}
}
