package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroup1stats "github.com/containerd/cgroups/v3/cgroup1/stats"
	"github.com/containerd/cgroups/v3/cgroup2"
	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// sandboxBundle is the bundle containerd's shim sandbox controller makes for sandbox id (no
// config.json), with the runtime options the start action kept: ConfigPath, a configuration
// with base_dir and a 512M, one-vCPU VM. The pod files' tmpfs is unmounted when the test
// ends.
func (h *harness) sandboxBundle(id string) string {
	h.t.Helper()
	b := filepath.Join(h.dir, "bundles", id)
	if err := os.MkdirAll(b, 0o711); err != nil {
		h.t.Fatal(err)
	}
	// A test that ends before ShutdownSandbox leaves the pod files' tmpfs, which containerd's
	// delete action would unmount.
	h.t.Cleanup(func() {
		if err := unmountPodFiles(filepath.Join(b, podFilesDir)); err != nil {
			h.t.Error(err)
		}
	})
	cfg := filepath.Join(h.dir, "kvfs-"+id+".toml")
	if err := os.WriteFile(cfg, []byte("base_dir = \"/tmp/kvfs-sbx\"\n[vm]\nvcpus = 1\nmemory = \"512M\"\n"), 0o644); err != nil {
		h.t.Fatal(err)
	}
	params := &bootapi.BootstrapParams{InstanceID: id}
	if err := params.AddExtension(&runtimeoptions.Options{ConfigPath: cfg}); err != nil {
		h.t.Fatal(err)
	}
	if err := keepRuntimeOptions(b, params); err != nil {
		h.t.Fatal(err)
	}
	return b
}

// podConfig is CRI's PodSandboxConfig (or, to be refused, another message) as
// CreateSandbox's options carry it.
func podConfig(t *testing.T, pc proto.Message) *anypb.Any {
	t.Helper()
	a, err := typeurl.MarshalAnyToProto(pc)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// netNS is a network namespace for a pod (the tests run as root to make one).
func netNS(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("making a network namespace needs root")
	}
	return nettest.New(t, "kvfs-sbx").Path
}

func (h *harness) createSandbox(id, netns string, pc *criapi.PodSandboxConfig) {
	h.t.Helper()
	if _, err := h.svc.CreateSandbox(h.ctx, &sandboxAPI.CreateSandboxRequest{SandboxID: id, BundlePath: h.sandboxBundle(id),
		NetnsPath: netns, Options: podConfig(h.t, pc)}); err != nil {
		h.t.Fatalf("CreateSandbox %s: %v", id, err)
	}
}

func (h *harness) sandboxStatus(id string) *sandboxAPI.SandboxStatusResponse {
	h.t.Helper()
	st, err := h.svc.SandboxStatus(h.ctx, &sandboxAPI.SandboxStatusRequest{SandboxID: id})
	if err != nil {
		h.t.Fatalf("SandboxStatus %s: %v", id, err)
	}
	return st
}

// waitSandbox starts a WaitSandbox of id; its answer comes on the channel.
func (h *harness) waitSandbox(id string) <-chan *sandboxAPI.WaitSandboxResponse {
	ch := make(chan *sandboxAPI.WaitSandboxResponse, 1)
	go func() {
		resp, err := h.svc.WaitSandbox(h.ctx, &sandboxAPI.WaitSandboxRequest{SandboxID: id})
		if err != nil {
			h.t.Errorf("WaitSandbox %s: %v", id, err)
		}
		ch <- resp
	}()
	return ch
}

func gotWait(t *testing.T, ch <-chan *sandboxAPI.WaitSandboxResponse) *sandboxAPI.WaitSandboxResponse {
	t.Helper()
	select {
	case w := <-ch:
		if w == nil {
			t.Fatal("WaitSandbox failed")
		}
		return w
	case <-time.After(10 * time.Second):
		t.Fatal("WaitSandbox did not return")
		return nil
	}
}

func notYet(t *testing.T, what string, ch <-chan *sandboxAPI.WaitSandboxResponse) {
	t.Helper()
	select {
	case w := <-ch:
		t.Fatalf("WaitSandbox returned %v %s", w, what)
	case <-time.After(50 * time.Millisecond):
	}
}

// TestSandboxAPI: the Sandbox API's calls in containerd's order. CreateSandbox boots nothing
// and takes the configuration from the runtime options the shim was started with, sized by
// the pod's resources; StartSandbox boots the pod with the pod's network namespace and no
// pause container; containers join it through the task API, and the last one's Delete
// neither stops it nor ends the shim; status, ping, metrics (the pod's, from the guest) and
// platform answer while it runs; StopSandbox kills what still runs, stops the pod once, and
// WaitSandbox answers 0; the stopped containers are deleted after; ShutdownSandbox ends the
// shim.
func TestSandboxAPI(t *testing.T) {
	ns := netNS(t)
	h := newHarness(t)
	const id = "sbx"
	_, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: id})
	wantKind(t, "StartSandbox before CreateSandbox", err, errdefs.ErrNotFound)

	h.createSandbox(id, ns, &criapi.PodSandboxConfig{
		Hostname:    "p1",
		DnsConfig:   &criapi.DNSConfig{Servers: []string{"10.0.0.53", "10.0.0.54"}, Searches: []string{"kvfs.test"}},
		Annotations: map[string]string{"example.com/pod": "x"},
		Linux: &criapi.LinuxPodSandboxConfig{Resources: &criapi.LinuxContainerResources{
			CpuPeriod: 100000, CpuQuota: 200000, MemoryLimitInBytes: 256 << 20},
			Sysctls: map[string]string{"kernel.shm_rmid_forced": "1", "net.ipv4.ip_forward": "1"}},
	})
	if n := len(h.pods); n != 0 {
		t.Fatalf("CreateSandbox started %d pods, want none before StartSandbox", n)
	}
	if st := h.sandboxStatus(id); st.State != "SANDBOX_NOTREADY" || st.Pid != 0 {
		t.Errorf("a created sandbox: %s, pid %d; want SANDBOX_NOTREADY, 0", st.State, st.Pid)
	}
	rec, err := readBundleRecord(filepath.Join(h.dir, "bundles", id))
	if err != nil || rec.SandboxID != id || rec.BaseDir != "/tmp/kvfs-sbx" {
		t.Errorf("the sandbox bundle's record %+v, %v", rec, err)
	}
	_, err = h.svc.CreateSandbox(h.ctx, &sandboxAPI.CreateSandboxRequest{SandboxID: id, BundlePath: h.sandboxBundle(id), NetnsPath: ns})
	wantKind(t, "CreateSandbox twice", err, errdefs.ErrAlreadyExists)
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "early", Bundle: h.bundle("early", criContainer(id))})
	wantKind(t, "a container before StartSandbox", err, errdefs.ErrFailedPrecondition)
	if n := len(h.pods); n != 0 {
		t.Fatalf("a container's Create started %d pods before StartSandbox", n)
	}

	wait := h.waitSandbox(id)
	resp, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: id})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Pid != fakeVMPid || !resp.CreatedAt.IsValid() || resp.CreatedAt.AsTime().After(time.Now()) {
		t.Errorf("StartSandbox: pid %d, created %v; want the VM's %d and a past time", resp.Pid, resp.CreatedAt, fakeVMPid)
	}
	req := h.pod().req
	wantCPUs := min(1+2, runtime.NumCPU())
	if req.ID != id || req.SandboxTask || req.NetNS != ns || req.Config.VM.Memory != "768M" || req.Config.VM.VCPUs != wantCPUs ||
		req.Config.BaseDir != "/tmp/kvfs-sbx" || req.Annotations["example.com/pod"] != "x" || req.Hostname != "p1" ||
		len(req.Sysctls) != 2 || req.Sysctls["kernel.shm_rmid_forced"] != "1" || req.Sysctls["net.ipv4.ip_forward"] != "1" {
		t.Errorf("the pod's request: id %s, sandbox task %v, netns %s, %s %d vCPUs, base %s, annotations %v, hostname %q, sysctls %v; want %s, false, %s, 768M %d, /tmp/kvfs-sbx, the pod's, p1, the pod's",
			req.ID, req.SandboxTask, req.NetNS, req.Config.VM.Memory, req.Config.VM.VCPUs, req.Config.BaseDir, req.Annotations, req.Hostname, req.Sysctls, id, ns, wantCPUs)
	}
	_, err = h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: id})
	wantKind(t, "StartSandbox twice", err, errdefs.ErrFailedPrecondition)
	if st := h.sandboxStatus(id); st.State != "SANDBOX_READY" || st.Pid != fakeVMPid || st.ExitedAt != nil {
		t.Errorf("a started sandbox: %+v", st)
	}
	if _, err := h.svc.PingSandbox(h.ctx, &sandboxAPI.PingRequest{SandboxID: id}); err != nil {
		t.Errorf("PingSandbox: %v", err)
	}
	m, err := h.svc.SandboxMetrics(h.ctx, &sandboxAPI.SandboxMetricsRequest{SandboxID: id})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := typeurl.UnmarshalAny(m.Metrics.GetData()); err != nil || m.Metrics.ID != id || v.(*cgroupstats.Metrics).GetPids() == nil {
		t.Errorf("SandboxMetrics %v (%v): want the pod's cgroup2 metrics", m, err)
	}
	h.agent.mu.Lock()
	asked := fmt.Sprintf("%q", h.agent.statsAsked)
	h.agent.mu.Unlock()
	if asked != `[""]` {
		t.Errorf("the agent was asked for stats of %s, want the pod's (no container id)", asked)
	}
	if p, err := h.svc.Platform(h.ctx, &sandboxAPI.PlatformRequest{SandboxID: id}); err != nil || p.Platform.OS != "linux" || p.Platform.Architecture != runtime.GOARCH {
		t.Errorf("Platform %v, %v", p, err)
	}
	_, err = h.svc.UpdateSandbox(h.ctx, &sandboxAPI.UpdateSandboxRequest{SandboxID: id})
	wantKind(t, "UpdateSandbox", err, errdefs.ErrNotImplemented)
	_, err = h.svc.SandboxStatus(h.ctx, &sandboxAPI.SandboxStatusRequest{SandboxID: "other"})
	wantKind(t, "another sandbox's status", err, errdefs.ErrNotFound)

	// The pod's containers join its VM, with the pod files the sandbox wrote unless their
	// spec mounts its own; the last one's Delete leaves the pod.
	files := filepath.Join(h.dir, "bundles", id, podFilesDir)
	for name, want := range map[string]string{"hostname": "p1\n", "resolv.conf": "search kvfs.test\nnameserver 10.0.0.53\nnameserver 10.0.0.54\n"} {
		if got, err := os.ReadFile(filepath.Join(files, name)); err != nil || string(got) != want {
			t.Errorf("the pod's %s: %q, %v; want %q", name, got, err, want)
		}
	}
	// c1's own /dev/shm tmpfs (containerd's default spec has one per container) becomes a
	// bind of the guest's, the pod's.
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", criContainer(id),
		specs.Mount{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}})})
	h.start("c1", "")
	var guest specs.Spec
	h.agent.mu.Lock()
	err = json.Unmarshal(h.agent.specs["c1"], &guest)
	h.agent.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(guest.Mounts, func(m specs.Mount) bool { return m.Destination == "/dev/shm" }); i < 0 ||
		!reflect.DeepEqual(guest.Mounts[i], specs.Mount{Destination: "/dev/shm", Type: "bind", Source: "/dev/shm", Options: []string{"rbind", "rprivate", "nosuid", "nodev", "noexec"}}) {
		t.Errorf("c1's guest /dev/shm: %+v, want a bind of the guest's", guest.Mounts)
	}
	ownHosts := filepath.Join(h.dir, "own-hosts")
	os.WriteFile(ownHosts, []byte("own\n"), 0o644)
	h.create(&taskAPI.CreateTaskRequest{ID: "c2", Bundle: h.bundle("c2", criContainer(id),
		specs.Mount{Destination: "/etc/hosts", Type: "bind", Source: ownHosts, Options: []string{"rbind", "ro"}})})
	h.start("c2", "")
	if n := len(h.pods); n != 1 {
		t.Errorf("%d pods, want the sandbox's one", n)
	}
	sources := map[string]string{}
	for name, b := range h.pod().bound() {
		sources[name] = b.Source
	}
	for _, want := range []string{"c1-0-hostname", "c1-1-hosts", "c1-2-resolv.conf", "c2-0-own-hosts", "c2-1-hostname", "c2-2-resolv.conf"} {
		if _, ok := sources[want]; !ok {
			t.Errorf("no bind %s in the pod's share: %v", want, sources)
		}
	}
	if len(sources) != 8 || sources["c1-1-hosts"] != filepath.Join(files, "hosts") || sources["c2-0-own-hosts"] != ownHosts {
		t.Errorf("binds %v: want the rootfs and the three files of c1 and c2, c2's /etc/hosts its own", sources)
	}
	h.kill("c2", syscall.SIGKILL)
	h.wait("c2", "")
	h.delete("c2", "")
	h.kill("c1", syscall.SIGTERM)
	h.wait("c1", "")
	h.delete("c1", "")
	if _, err := h.svc.Shutdown(h.ctx, &taskAPI.ShutdownRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	if h.pod().stopped != 0 || isClosed(h.sd.done) {
		t.Fatalf("with no container left the pod was stopped (%d) or the shim ended (%v): the sandbox owns them", h.pod().stopped, isClosed(h.sd.done))
	}
	notYet(t, "while the sandbox runs", wait)

	// A container still running when the sandbox stops is killed, and deleted after.
	h.create(&taskAPI.CreateTaskRequest{ID: "c3", Bundle: h.bundle("c3", criContainer(id))})
	h.start("c3", "")
	if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: id}); err != nil {
		t.Fatal(err)
	}
	if w := gotWait(t, wait); w.ExitStatus != 0 || !w.ExitedAt.IsValid() {
		t.Errorf("WaitSandbox after StopSandbox: %v, want exit status 0", w)
	}
	h.agent.mu.Lock()
	var killed bool
	for _, s := range h.agent.signals {
		killed = killed || (s.ContainerId == "c3" && s.All && s.Signal == uint32(syscall.SIGKILL))
	}
	h.agent.mu.Unlock()
	if !killed {
		t.Error("StopSandbox did not SIGKILL the running container's processes")
	}
	if st := h.status("c3", ""); st.String() != "STOPPED" {
		t.Errorf("c3 is %v after StopSandbox, want STOPPED", st)
	}
	if h.pod().stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once", h.pod().stopped)
	}
	if st := h.sandboxStatus(id); st.State != "SANDBOX_NOTREADY" || st.Pid != 0 || !st.ExitedAt.IsValid() {
		t.Errorf("a stopped sandbox: %+v", st)
	}
	_, err = h.svc.PingSandbox(h.ctx, &sandboxAPI.PingRequest{SandboxID: id})
	wantKind(t, "PingSandbox after the stop", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.SandboxMetrics(h.ctx, &sandboxAPI.SandboxMetricsRequest{SandboxID: id})
	wantKind(t, "SandboxMetrics after the stop", err, errdefs.ErrFailedPrecondition)
	_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "late", Bundle: h.bundle("late", criContainer(id))})
	wantKind(t, "a container after StopSandbox", err, errdefs.ErrFailedPrecondition)
	if n := len(h.pods); n != 1 {
		t.Errorf("%d pods after a late Create, want the stopped one only", n)
	}
	if d := h.delete("c3", ""); d.ExitStatus != 128+uint32(syscall.SIGKILL) {
		t.Errorf("c3's Delete after the stop: exit %d, want 137", d.ExitStatus)
	}
	if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: id}); err != nil {
		t.Errorf("StopSandbox of a stopped sandbox: %v", err)
	}
	if got := strings.Join(eventTypes(h.rec.all()), " "); got != "Create Start Create Start exit:c2 Delete exit:c1 Delete Create Start exit:c3 Delete" {
		t.Errorf("events %q", got)
	}

	if _, err := h.svc.ShutdownSandbox(h.ctx, &sandboxAPI.ShutdownSandboxRequest{SandboxID: id}); err != nil {
		t.Fatal(err)
	}
	if isClosed(h.sd.done) {
		t.Error("ShutdownSandbox ended the shim before it answered")
	}
	select {
	case <-h.sd.done:
	case <-time.After(10 * shutdownGrace):
		t.Error("ShutdownSandbox did not end the shim")
	}
	if h.pod().stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once", h.pod().stopped)
	}
}

// TestSandboxCgroup: the pod's cgroup parent (CRI's linux.cgroup_parent) gives the pod the
// cgroup podsandbox gives a pause container: parent/id under a cgroupfs parent,
// slice:cri-containerd:id under a systemd slice (the kubelet's expanded path of it), passed to
// the pod's start and kept in the bundle's record for the delete action; the pod's stats
// (SandboxMetrics) are then the parent's on the host (a slice's at its expanded path), the
// agent not asked. Where systemd is not running, a systemd slice fails CreateSandbox, naming
// the cgroup and why, and leaves no record.
func TestSandboxCgroup(t *testing.T) {
	ns := netNS(t)
	parent := testCgroup(t)
	slice, sliceFS := testSlice(t)
	if cgroups.Mode() == cgroups.Unified {
		if _, err := cgroup2.NewManager("/sys/fs/cgroup", sliceFS, &cgroup2.Resources{}); err != nil {
			t.Fatal(err)
		}
	} else if _, err := cgroup1.New(cgroup1.StaticPath(sliceFS), &specs.LinuxResources{}); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		parent, want string
		systemd      bool // systemd runs
	}{
		{parent + "/", parent + "/sbx", false},
		{sliceFS, slice + ":cri-containerd:sbx", true},
	} {
		h := newHarness(t)
		old := systemdBooted
		if tt.systemd {
			systemdBooted = t.TempDir()
		}
		h.createSandbox("sbx", ns, &criapi.PodSandboxConfig{Linux: &criapi.LinuxPodSandboxConfig{CgroupParent: tt.parent}})
		systemdBooted = old
		if rec, err := readBundleRecord(filepath.Join(h.dir, "bundles", "sbx")); err != nil || rec.Cgroup != tt.want {
			t.Errorf("cgroup parent %s: the bundle's record %+v, %v; want the cgroup %s", tt.parent, rec, err, tt.want)
		}
		if _, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"}); err != nil {
			t.Fatal(err)
		}
		if got := h.pod().req.Cgroup; got != tt.want {
			t.Errorf("cgroup parent %s: the pod's cgroup %q, want %q", tt.parent, got, tt.want)
		}
		m, err := h.svc.SandboxMetrics(h.ctx, &sandboxAPI.SandboxMetricsRequest{SandboxID: "sbx"})
		if err != nil {
			t.Fatalf("cgroup parent %s: SandboxMetrics: %v", tt.parent, err)
		}
		v, err := typeurl.UnmarshalAny(m.Metrics.GetData())
		if err != nil {
			t.Fatal(err)
		}
		h.agent.mu.Lock()
		asked := len(h.agent.statsAsked)
		h.agent.mu.Unlock()
		var host bool
		switch v := v.(type) {
		case *cgroup1stats.Metrics:
			host = v.GetMemory() != nil && cgroups.Mode() != cgroups.Unified
		case *cgroupstats.Metrics:
			host = v.GetMemory() != nil && cgroups.Mode() == cgroups.Unified
		}
		if !host || asked != 0 {
			t.Errorf("cgroup parent %s: SandboxMetrics %T (the host's cgroup: %v), the agent asked %d times; want the host's",
				tt.parent, v, host, asked)
		}
		if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: "sbx"}); err != nil {
			t.Fatal(err)
		}
	}

	noSystemd(t)
	h := newHarness(t)
	want := slice + ":cri-containerd:sbx"
	_, err := h.svc.CreateSandbox(h.ctx, &sandboxAPI.CreateSandboxRequest{SandboxID: "sbx", BundlePath: h.sandboxBundle("sbx"),
		NetnsPath: ns, Options: podConfig(t, &criapi.PodSandboxConfig{Linux: &criapi.LinuxPodSandboxConfig{CgroupParent: sliceFS}})})
	if !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), strconv.Quote(want)) || !strings.Contains(err.Error(), "systemd is not running") {
		t.Errorf("CreateSandbox under a systemd slice without systemd: %v; want a failed precondition naming %q and that systemd is not running", err, want)
	}
	if _, err := readBundleRecord(filepath.Join(h.dir, "bundles", "sbx")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the bundle's record after the failed CreateSandbox: %v; want none", err)
	}
}

// TestSandboxAPIPodDeath: the VM's death ends the sandbox: its containers' processes exit
// with exitVMDied, the pod is stopped, WaitSandbox answers exitVMDied; the containers are
// deleted after, and StopSandbox then has nothing to do. (And the pod's annotations do not
// size its VM.)
func TestSandboxAPIPodDeath(t *testing.T) {
	ns := netNS(t)
	h := newHarness(t)
	h.createSandbox("sbx", ns, &criapi.PodSandboxConfig{Annotations: map[string]string{
		AnnotationSandboxMemory: "8589934592", AnnotationSandboxCPUQuota: "800000", AnnotationSandboxCPUPeriod: "100000"}})
	wait := h.waitSandbox("sbx")
	if _, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Fatal(err)
	}
	if c := h.pod().req.Config; c.VM.Memory != "512M" || c.VM.VCPUs != 1 {
		t.Errorf("the pod's annotations sized its VM: %s, %d vCPUs; want the configured 512M, 1", c.VM.Memory, c.VM.VCPUs)
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", criContainer("sbx"))})
	h.start("c1", "")
	h.pod().die(errors.New("QEMU exited (test)"))
	if w := gotWait(t, wait); w.ExitStatus != exitVMDied {
		t.Errorf("WaitSandbox after the VM died: exit %d, want %d", w.ExitStatus, exitVMDied)
	}
	if w := h.wait("c1", ""); w.ExitStatus != exitVMDied {
		t.Errorf("c1 exited %d, want %d", w.ExitStatus, exitVMDied)
	}
	if h.pod().stopped != 1 {
		t.Errorf("the dead pod was stopped %d times, want once", h.pod().stopped)
	}
	if st := h.sandboxStatus("sbx"); st.State != "SANDBOX_NOTREADY" {
		t.Errorf("a dead sandbox is %s", st.State)
	}
	h.delete("c1", "")
	if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Errorf("StopSandbox after the death: %v", err)
	}
	if h.pod().stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once", h.pod().stopped)
	}
}

// TestSandboxAPIRefusals: what CreateSandbox and StartSandbox refuse, and how a sandbox that
// never ran ends.
func TestSandboxAPIRefusals(t *testing.T) {
	ns := netNS(t)
	h := newHarness(t)
	create := func(netns string, opts *anypb.Any) error {
		_, err := h.svc.CreateSandbox(h.ctx, &sandboxAPI.CreateSandboxRequest{SandboxID: "sbx", BundlePath: h.sandboxBundle("sbx"), NetnsPath: netns, Options: opts})
		return err
	}
	nodeNS := func(o *criapi.NamespaceOption) *anypb.Any {
		return podConfig(t, &criapi.PodSandboxConfig{Linux: &criapi.LinuxPodSandboxConfig{SecurityContext: &criapi.LinuxSandboxSecurityContext{NamespaceOptions: o}}})
	}
	nodeNet := nodeNS(&criapi.NamespaceOption{Network: criapi.NamespaceMode_NODE})
	for _, tc := range []struct {
		name  string
		netns string
		opts  *anypb.Any
		want  string
	}{
		{"hostNetwork", ns, nodeNet, "host networking is not supported"},
		{"no network namespace", "", nil, "host networking is not supported"},
		{"the host's network namespace", "/proc/self/ns/net", nil, "host networking is not supported"},
		{"hostPID", ns, nodeNS(&criapi.NamespaceOption{Pid: criapi.NamespaceMode_NODE}), "the node's PID (hostPID) namespace: not supported"},
		{"hostIPC and hostPID", ns, nodeNS(&criapi.NamespaceOption{Pid: criapi.NamespaceMode_NODE, Ipc: criapi.NamespaceMode_NODE}), "the node's PID (hostPID) and IPC (hostIPC) namespace"},
		{"options that are not a PodSandboxConfig", ns, podConfig(t, &criapi.PodSandboxStatus{}), "want runtime.v1.PodSandboxConfig"},
		{"a bad memory limit", ns, podConfig(t, &criapi.PodSandboxConfig{Linux: &criapi.LinuxPodSandboxConfig{
			Resources: &criapi.LinuxContainerResources{MemoryLimitInBytes: -1}}}), "linux.resources.memory_limit_in_bytes -1"},
		{"a sysctl that is no name", ns, podConfig(t, &criapi.PodSandboxConfig{Linux: &criapi.LinuxPodSandboxConfig{
			Sysctls: map[string]string{"kernel.shm_rmid_forced": "1", "net/../../x": "1"}}}), `sysctl "net/../../x"`},
	} {
		err := create(tc.netns, tc.opts)
		wantKind(t, tc.name, err, errdefs.ErrInvalidArgument)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
	if _, err := h.svc.SandboxStatus(h.ctx, &sandboxAPI.SandboxStatusRequest{SandboxID: "sbx"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a refused sandbox has a status: %v", err)
	}

	// A sandbox stopped before it started ends with status 0; one whose VM does not boot ends
	// with exitVMDied, and StartSandbox's error says why.
	h.createSandbox("sbx", ns, nil)
	wait := h.waitSandbox("sbx")
	if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Fatal(err)
	}
	if w := gotWait(t, wait); w.ExitStatus != 0 {
		t.Errorf("a sandbox stopped before it started: exit %d", w.ExitStatus)
	}
	_, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"})
	wantKind(t, "StartSandbox of a stopped sandbox", err, errdefs.ErrFailedPrecondition)

	h2 := newHarness(t)
	h2.startErr = errors.New("no kernel (test)")
	h2.createSandbox("sbx", ns, nil)
	_, err = h2.svc.StartSandbox(h2.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"})
	if err == nil || !strings.Contains(err.Error(), "no kernel (test)") {
		t.Errorf("StartSandbox with a VM that does not boot: %v", err)
	}
	if w := gotWait(t, h2.waitSandbox("sbx")); w.ExitStatus != exitVMDied {
		t.Errorf("a sandbox that failed to start: exit %d, want %d", w.ExitStatus, exitVMDied)
	}
	if _, err := h2.svc.ShutdownSandbox(h2.ctx, &sandboxAPI.ShutdownSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Errorf("ShutdownSandbox of a failed sandbox: %v", err)
	}
	select {
	case <-h2.sd.done:
	case <-time.After(10 * shutdownGrace):
		t.Error("ShutdownSandbox of a failed sandbox did not end the shim")
	}
}

// TestSandboxAPIStopWhileStarting: a stop or shutdown that comes while the sandbox's VM boots
// is not refused (containerd's controller never deletes a shim whose shutdown failed, and the
// shim would outlive its pod): the boot is cancelled, StartSandbox fails, and the shim ends.
// A boot that ends with a pod just as the stop comes has that pod stopped.
func TestSandboxAPIStopWhileStarting(t *testing.T) {
	ns := netNS(t)
	for _, tc := range []struct {
		name       string
		honoursCtx bool // the boot gives up when its context ends; else it finishes its pod
	}{{"boot cancelled", true}, {"boot finished", false}} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			booting := make(chan struct{})
			release := make(chan struct{})
			inner := h.svc.opts.StartVM
			h.svc.opts.StartVM = func(ctx context.Context, req PodRequest) (VM, error) {
				close(booting)
				if tc.honoursCtx {
					<-ctx.Done()
					return nil, ctx.Err()
				}
				<-release
				return inner(ctx, req)
			}
			h.createSandbox("sbx", ns, &criapi.PodSandboxConfig{})
			wait := h.waitSandbox("sbx")
			// WaitSandbox must have found the sandbox before the shutdown below can end it and
			// forget it (a later one answers NotFound): give its goroutine that moment.
			time.Sleep(50 * time.Millisecond)
			startErr := make(chan error, 1)
			go func() {
				_, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"})
				startErr <- err
			}()
			<-booting
			shutdown := make(chan error, 1)
			go func() {
				_, err := h.svc.ShutdownSandbox(h.ctx, &sandboxAPI.ShutdownSandboxRequest{SandboxID: "sbx"})
				shutdown <- err
			}()
			if !tc.honoursCtx {
				// The shutdown waits for the boot: it has cancelled its context already.
				time.Sleep(100 * time.Millisecond)
				close(release)
			}
			for what, ch := range map[string]chan error{"StartSandbox": startErr, "ShutdownSandbox": shutdown} {
				select {
				case err := <-ch:
					if what == "StartSandbox" && (err == nil || !strings.Contains(err.Error(), "sbx")) {
						t.Errorf("StartSandbox stopped during its boot: %v, want an error naming the sandbox", err)
					}
					if what == "ShutdownSandbox" && err != nil {
						t.Errorf("ShutdownSandbox during the boot: %v", err)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("%s did not return", what)
				}
			}
			if w := gotWait(t, wait); w.ExitStatus != exitVMDied {
				t.Errorf("WaitSandbox: exit %d, want %d (a failed start)", w.ExitStatus, exitVMDied)
			}
			select {
			case <-h.sd.Done():
			case <-time.After(5 * time.Second):
				t.Error("the shim did not end after ShutdownSandbox")
			}
			if !tc.honoursCtx {
				if n := h.pod().stopped; n != 1 {
					t.Errorf("the pod booted as the stop came was stopped %d times, want once", n)
				}
			}
			h.svc.mu.Lock()
			run := h.svc.run
			h.svc.mu.Unlock()
			if run != nil {
				t.Error("the shim still has a pod")
			}
		})
	}
}
