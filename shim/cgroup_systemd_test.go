package shim

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kvfs/kvfs/sandbox"
)

func TestExpandSlice(t *testing.T) {
	for _, tt := range [][2]string{
		{"system.slice", "/system.slice"},
		{"-.slice", "/"},
		{"kubepods.slice", "/kubepods.slice"},
		{"kubepods-besteffort-pod1.slice", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice"},
		{"kubepods-pod0f1e_2d3c.slice", "/kubepods.slice/kubepods-pod0f1e_2d3c.slice"},
	} {
		if got, err := expandSlice(tt[0]); err != nil || got != tt[1] {
			t.Errorf("expandSlice(%q) = %q, %v; want %q", tt[0], got, err, tt[1])
		}
	}
	for _, s := range []string{"", ".slice", "kubepods", "kubepods.scope", "a--b.slice", "-a.slice", "a-.slice",
		"a/b.slice", "../a.slice", "a b.slice"} {
		if got, err := expandSlice(s); err == nil {
			t.Errorf("expandSlice(%q) = %q, want an error", s, got)
		}
	}
}

func TestParseSystemdCgroup(t *testing.T) {
	for _, tt := range []struct {
		path string
		want systemdScope
	}{
		{"kubepods-besteffort-pod1.slice:cri-containerd:abc", systemdScope{slice: "kubepods-besteffort-pod1.slice",
			unit: "cri-containerd-abc.scope", fs: "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-abc.scope"}},
		{"kubepods.slice:cri-containerd:abc", systemdScope{slice: "kubepods.slice", unit: "cri-containerd-abc.scope",
			fs: "/kubepods.slice/cri-containerd-abc.scope"}},
		{":cri-containerd:abc", systemdScope{slice: "system.slice", unit: "cri-containerd-abc.scope", fs: "/system.slice/cri-containerd-abc.scope"}},
		{"machine.slice::vm1", systemdScope{slice: "machine.slice", unit: "vm1.scope", fs: "/machine.slice/vm1.scope"}},
		{"-.slice:p:n", systemdScope{slice: "-.slice", unit: "p-n.scope", fs: "/p-n.scope"}},
	} {
		if got, err := parseSystemdCgroup(tt.path); err != nil || got != tt.want {
			t.Errorf("parseSystemdCgroup(%q) = %+v, %v; want %+v", tt.path, got, err, tt.want)
		}
		if fs, scope, err := resolvePodCgroup(tt.path); err != nil || scope == nil || *scope != tt.want || fs != tt.want.fs {
			t.Errorf("resolvePodCgroup(%q) = %q, %+v, %v; want the scope %+v", tt.path, fs, scope, err, tt.want)
		}
	}
	for _, p := range []string{"a.slice:b", "a.slice:b:c:d", "a:p:n", "a--b.slice:p:n", "a.slice:p:", "a.slice:p:b.slice",
		"a.slice:p:../x", "a.slice:p:n/x", "a.slice:../p:n", "a/b.slice:p:n", "a.slice:p:n\x00", "a.slice:" + strings.Repeat("p", 250) + ":n"} {
		if got, err := parseSystemdCgroup(p); err == nil || !strings.Contains(err.Error(), strconv.Quote(p)) {
			t.Errorf("parseSystemdCgroup(%q) = %+v, %v; want an error that names it", p, got, err)
		}
	}
	// A cgroupfs path is itself, without a scope.
	if fs, scope, err := resolvePodCgroup("/kubepods/pod1/abc"); err != nil || scope != nil || fs != "/kubepods/pod1/abc" {
		t.Errorf("resolvePodCgroup of a cgroupfs path: %q, %+v, %v", fs, scope, err)
	}
}

// TestPodCgroupParent: the parent the pod's stats are read from is the cgroupfs parent, or
// the slice's expanded path for the systemd path sandboxCgroupPath derives from a pod slice,
// whichever form the slice came in.
func TestPodCgroupParent(t *testing.T) {
	for _, tt := range [][2]string{
		{"/kubepods/burstable/pod1", "/kubepods/burstable/pod1"},
		{"kubepods-besteffort-pod2.slice", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice"},
		{"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice"},
	} {
		if got, err := podCgroupParent(sandboxCgroupPath(tt[0], "sb1")); err != nil || got != tt[1] {
			t.Errorf("podCgroupParent of the sandbox cgroup under %q = %q, %v; want %q", tt[0], got, err, tt[1])
		}
	}
}

// noSystemd makes the test's host one without systemd as its init, as this machine is.
func noSystemd(t *testing.T) {
	old := systemdBooted
	systemdBooted = filepath.Join(t.TempDir(), "no-systemd")
	t.Cleanup(func() { systemdBooted = old })
}

// testSlice is a pod slice of the test's, kvfstest<random>-pod1.slice, and its expanded
// path; the cgroups at and under that path, in every hierarchy, are removed at cleanup.
func testSlice(t *testing.T) (slice, fs string) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to make cgroups")
	}
	var b [4]byte
	rand.Read(b[:])
	top := "kvfstest" + hex.EncodeToString(b[:])
	slice = top + "-pod1.slice"
	fs = "/" + top + ".slice/" + slice
	t.Cleanup(func() {
		roots, _ := filepath.Glob("/sys/fs/cgroup/*")
		for _, r := range append(roots, "/sys/fs/cgroup") {
			dirs, _ := filepath.Glob(filepath.Join(r, fs, "*.scope"))
			for _, d := range append(dirs, filepath.Join(r, fs), filepath.Join(r, "/"+top+".slice")) {
				os.Remove(d)
			}
		}
	})
	return slice, fs
}

// cgroupDirsUnder are the directories of fs and its parent in the memory hierarchy (v1) or
// the unified one.
func cgroupDirsUnder(fs string) []string {
	return append(podCgroupDirs(fs), podCgroupDirs(path.Dir(fs))...)
}

// TestSystemdCgroupNoSystemd: where systemd is not running, a systemd cgroup path is an error
// that names it and says why, nothing is made and the shim stays where it was; the delete
// action has nothing to remove; a VM pod with it does not start, and leaves no sandbox.
func TestSystemdCgroupNoSystemd(t *testing.T) {
	noSystemd(t)
	slice, fs := testSlice(t)
	p := slice + ":cri-containerd:abc"
	before := cgroupsOf(t, os.Getpid())
	check := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), strconv.Quote(p)) || !strings.Contains(err.Error(), "systemd is not running") {
			t.Errorf("%s: %v; want an error naming %q and that systemd is not running", what, err, p)
		}
	}
	_, err := joinPodCgroup(t.Context(), p)
	check("joinPodCgroup", err)
	check("checkPodCgroup", checkPodCgroup(p))
	if after := cgroupsOf(t, os.Getpid()); !slices.Equal(after, before) {
		t.Errorf("the shim's cgroups are %q, were %q", after, before)
	}
	if d := cgroupDirsUnder(fs + "/cri-containerd-abc.scope"); len(d) > 0 {
		t.Errorf("cgroups made: %q", d)
	}
	if err := removePodCgroup(t.Context(), p); err != nil {
		t.Errorf("removePodCgroup without systemd: %v", err)
	}

	base := t.TempDir()
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir = base
	_, err = startQEMUVM(t.Context(), PodRequest{ID: "sbx", Config: cfg, Cgroup: p}, DialAgent)
	check("startVMPod", err)
	if ents, err := os.ReadDir(base); err != nil || len(ents) > 0 {
		t.Errorf("the sandboxes' directory after the failed start: %v, %v; want it empty", ents, err)
	}
}

// fakeSystemd is the tests' org.freedesktop.systemd1 on a private D-Bus daemon: what
// systemd's Manager does for a transient scope, enough for the shim's calls. A started scope
// is made at its slice's expanded path with the given PIDs in it (in every v1 hierarchy, or
// the unified one), a stopped one removed; each job's end is signalled with JobRemoved. A
// scope in fail is made too, but its start job fails.
type fakeSystemd struct {
	conn *dbus.Conn

	mu    sync.Mutex
	calls []fakeSystemdCall
	units map[string]string // a started scope's cgroupfs path
	fail  map[string]bool   // scopes whose start job fails (after the PIDs moved)
	job   uint32
}

// fakeSystemdCall is a call the fake answered.
type fakeSystemdCall struct {
	method, unit string
	props        map[string]any
}

// startFakeSystemd runs a private dbus-daemon with a fakeSystemd on it as the host's system
// bus (DBUS_SYSTEM_BUS_ADDRESS), and makes systemd look running (systemdBooted).
func startFakeSystemd(t *testing.T) *fakeSystemd {
	t.Helper()
	daemon, err := exec.LookPath("dbus-daemon")
	if err != nil {
		t.Skip("no dbus-daemon (Debian's dbus-daemon, scripts/deps.sh)")
	}
	dir := t.TempDir()
	sock := filepath.Join(dir, "bus")
	conf := filepath.Join(dir, "bus.conf")
	if err := os.WriteFile(conf, fmt.Appendf(nil, `<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path=%s</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
`, sock), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(daemon, "--config-file="+conf, "--nofork", "--nopidfile")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	addr := "unix:path=" + sock
	var conn *dbus.Conn
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if conn, err = dbus.Dial(addr); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the private dbus-daemon: %v", err)
		}
	}
	t.Cleanup(func() { conn.Close() })
	if err := conn.Auth(nil); err != nil {
		t.Fatal(err)
	}
	if err := conn.Hello(); err != nil {
		t.Fatal(err)
	}
	f := &fakeSystemd{conn: conn, units: map[string]string{}, fail: map[string]bool{}}
	if err := conn.Export(f, "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager"); err != nil {
		t.Fatal(err)
	}
	if r, err := conn.RequestName("org.freedesktop.systemd1", dbus.NameFlagDoNotQueue); err != nil || r != dbus.RequestNameReplyPrimaryOwner {
		t.Fatalf("own org.freedesktop.systemd1: %v, %v", r, err)
	}
	t.Setenv("DBUS_SYSTEM_BUS_ADDRESS", addr)
	old := systemdBooted
	systemdBooted = t.TempDir()
	t.Cleanup(func() { systemdBooted = old })
	return f
}

// jobDone signals the end of a job for unit with result, as systemd does after answering.
func (f *fakeSystemd) jobDone(unit, result string) dbus.ObjectPath {
	f.job++
	id := f.job
	job := dbus.ObjectPath("/org/freedesktop/systemd1/job/" + strconv.Itoa(int(id)))
	go f.conn.Emit("/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager.JobRemoved", id, job, unit, result)
	return job
}

func (f *fakeSystemd) StartTransientUnit(name, mode string, props []sdbus.Property, aux []sdbus.PropertyCollection) (dbus.ObjectPath, *dbus.Error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	call := fakeSystemdCall{method: "StartTransientUnit", unit: name, props: map[string]any{}}
	for _, p := range props {
		call.props[p.Name] = p.Value.Value()
	}
	f.calls = append(f.calls, call)
	if _, ok := f.units[name]; ok {
		return "", &dbus.Error{Name: "org.freedesktop.systemd1.UnitExists", Body: []any{"Unit " + name + " already exists."}}
	}
	slice, _ := call.props["Slice"].(string)
	dir, err := expandSlice(slice)
	if err != nil {
		return "", dbus.MakeFailedError(err)
	}
	fs := path.Join(dir, name)
	pids, _ := call.props["PIDs"].([]uint32)
	if cgroups.Mode() == cgroups.Unified {
		m, err := cgroup2.NewManager("/sys/fs/cgroup", fs, &cgroup2.Resources{})
		if err != nil {
			return "", dbus.MakeFailedError(err)
		}
		for _, pid := range pids {
			if err := m.AddProc(uint64(pid)); err != nil {
				return "", dbus.MakeFailedError(err)
			}
		}
	} else {
		cg, err := cgroup1.New(cgroup1.StaticPath(fs), &specs.LinuxResources{})
		if err != nil {
			return "", dbus.MakeFailedError(err)
		}
		for _, pid := range pids {
			if err := cg.Add(cgroup1.Process{Pid: int(pid)}); err != nil {
				return "", dbus.MakeFailedError(err)
			}
		}
	}
	f.units[name] = fs
	if f.fail[name] {
		return f.jobDone(name, "failed"), nil // the PIDs moved, the job failed after
	}
	return f.jobDone(name, "done"), nil
}

func (f *fakeSystemd) StopUnit(name, mode string) (dbus.ObjectPath, *dbus.Error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fakeSystemdCall{method: "StopUnit", unit: name})
	fs, ok := f.units[name]
	if !ok {
		return "", &dbus.Error{Name: "org.freedesktop.systemd1.NoSuchUnit", Body: []any{"Unit " + name + " not loaded."}}
	}
	delete(f.units, name)
	if err := removePodCgroupFS(fs); err != nil {
		return f.jobDone(name, "failed"), nil
	}
	return f.jobDone(name, "done"), nil
}

func (f *fakeSystemd) ResetFailedUnit(name string) *dbus.Error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, fakeSystemdCall{method: "ResetFailedUnit", unit: name})
	return nil
}

// takeCalls returns the calls answered since the last takeCalls.
func (f *fakeSystemd) takeCalls() []fakeSystemdCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := f.calls
	f.calls = nil
	return c
}

// removePodCgroupFS removes the cgroupfs path fs in every hierarchy, as systemd removes a
// stopped scope's cgroup.
func removePodCgroupFS(fs string) error {
	if cgroups.Mode() == cgroups.Unified {
		m, err := cgroup2.Load(fs)
		if err != nil {
			return err
		}
		return m.Delete()
	}
	cg, err := cgroup1.Load(cgroup1.StaticPath(fs))
	if err != nil {
		return err
	}
	return cg.Delete()
}

// TestSystemdScope: with systemd (the fake, over real D-Bus), the pod's systemd cgroup path
// becomes a scope in the pod's slice, asked for as runc's systemd driver asks for a
// container's (prefix-name.scope, Slice= the slice, PIDs= the shim, Delegate=yes); what the
// shim starts then is born in it at the slice's expanded path, whose stats are read; leave
// puts the shim back and stops the scope, which leaves nothing; a dead shim's scope is
// stopped by the delete action, and one already gone is no error; a failed start is an error,
// and leaves the shim where it was and nothing made.
func TestSystemdScope(t *testing.T) {
	f := startFakeSystemd(t)
	slice, sliceFS := testSlice(t)
	p := slice + ":cri-containerd:abc"
	const unit = "cri-containerd-abc.scope"
	fs := sliceFS + "/" + unit
	self := os.Getpid()
	before := cgroupsOf(t, self)

	cg, err := joinPodCgroup(t.Context(), p)
	if err != nil {
		t.Fatal(err)
	}
	calls := f.takeCalls()
	if len(calls) != 1 || calls[0].method != "StartTransientUnit" || calls[0].unit != unit {
		t.Fatalf("calls to systemd: %+v; want one StartTransientUnit of %s", calls, unit)
	}
	props := calls[0].props
	if props["Slice"] != slice || !slices.Equal(props["PIDs"].([]uint32), []uint32{uint32(self)}) || props["Delegate"] != true ||
		props["DefaultDependencies"] != false || props["MemoryAccounting"] != true || props["CPUAccounting"] != true {
		t.Errorf("the scope's properties %v: want Slice=%s, PIDs=[%d], Delegate, no default dependencies, CPU and memory accounting",
			props, slice, self)
	}
	child := exec.Command("sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; exec sleep 600")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		child.Process.Kill()
		child.Wait()
	})
	in := 0
	for _, l := range cgroupsOf(t, child.Process.Pid) {
		if strings.HasSuffix(l, ":"+fs) {
			in++
		}
	}
	if in == 0 {
		t.Errorf("a child started after the join is not in %s: %q", fs, cgroupsOf(t, child.Process.Pid))
	}
	parent, err := podCgroupParent(p)
	if err != nil || parent != sliceFS {
		t.Errorf("podCgroupParent(%q) = %q, %v; want %q", p, parent, err, sliceFS)
	}
	if _, err := podCgroupMetrics(parent); err != nil {
		t.Errorf("the pod slice's metrics: %v", err)
	}
	child.Process.Kill()
	child.Wait()
	// The pod's end may come with its request's context cancelled: the scope still goes.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := cg.leave(ctx); err != nil {
		t.Fatal(err)
	}
	if calls := f.takeCalls(); len(calls) == 0 || calls[0].method != "StopUnit" || calls[0].unit != unit {
		t.Errorf("calls to systemd at leave: %+v; want a StopUnit of %s", calls, unit)
	}
	if after := cgroupsOf(t, self); !slices.Equal(after, before) {
		t.Errorf("after leave the shim's cgroups are %q, want %q", after, before)
	}
	if d := podCgroupDirs(fs); len(d) > 0 {
		t.Errorf("leave left the pod's scope: %q", d)
	}

	// A dead shim's scope, stopped by the delete action; then one already gone.
	if cg, err = joinPodCgroup(t.Context(), p); err != nil {
		t.Fatal(err)
	}
	if cg.v2 != nil {
		err = cg.v2From.AddProc(uint64(self))
	} else {
		err = cg.v1From.Add(cgroup1.Process{Pid: self})
	}
	if err != nil {
		t.Fatal(err)
	}
	f.takeCalls()
	if err := removePodCgroup(t.Context(), p); err != nil {
		t.Fatal(err)
	}
	if calls := f.takeCalls(); len(calls) == 0 || calls[0].method != "StopUnit" || calls[0].unit != unit {
		t.Errorf("calls to systemd by removePodCgroup: %+v; want a StopUnit of %s", calls, unit)
	}
	if d := podCgroupDirs(fs); len(d) > 0 {
		t.Errorf("removePodCgroup left %q", d)
	}
	if err := removePodCgroup(t.Context(), p); err != nil {
		t.Errorf("removePodCgroup of a scope already gone: %v", err)
	}

	// A start systemd fails after moving the shim: the shim leaves, the scope is stopped.
	f.mu.Lock()
	f.fail[unit] = true
	f.mu.Unlock()
	_, err = joinPodCgroup(t.Context(), p)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), `"failed"`) {
		t.Errorf("joinPodCgroup with a failed scope: %v; want an error naming %s and the job's result", err, p)
	}
	if after := cgroupsOf(t, self); !slices.Equal(after, before) {
		t.Errorf("after a failed join the shim's cgroups are %q, want %q", after, before)
	}
	if d := podCgroupDirs(fs); len(d) > 0 {
		t.Errorf("a failed join left %q", d)
	}
}

// TestCleanupSystemdScope: the delete action after a shim's death stops the pod's scope the
// bundle's record names, as well as removing its sandbox and the record.
func TestCleanupSystemdScope(t *testing.T) {
	f := startFakeSystemd(t)
	slice, sliceFS := testSlice(t)
	p := slice + ":cri-containerd:pod1"
	fs := sliceFS + "/cri-containerd-pod1.scope"
	dir := shortTempDir(t)
	base := filepath.Join(dir, "sandboxes")
	if err := os.MkdirAll(filepath.Join(base, "pod1"), 0o700); err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, "bundles", "pod1")
	if err := os.MkdirAll(filepath.Join(bundle, "rootfs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := writeBundleRecord(bundle, bundleRecord{SandboxID: "pod1", BaseDir: base, Cgroup: p}); err != nil {
		t.Fatal(err)
	}
	// The shim joined the pod's scope and died: its processes left the scope, which stays.
	cg, err := joinPodCgroup(t.Context(), p)
	if err != nil {
		t.Fatal(err)
	}
	if cg.v2 != nil {
		err = cg.v2From.AddProc(uint64(os.Getpid()))
	} else {
		err = cg.v1From.Add(cgroup1.Process{Pid: os.Getpid()})
	}
	if err != nil {
		t.Fatal(err)
	}
	f.takeCalls()
	if err := Cleanup(t.Context(), bundle); err != nil {
		t.Fatal(err)
	}
	if calls := f.takeCalls(); len(calls) == 0 || calls[0].method != "StopUnit" || calls[0].unit != "cri-containerd-pod1.scope" {
		t.Errorf("calls to systemd by the delete action: %+v; want a StopUnit of the pod's scope", calls)
	}
	if d := podCgroupDirs(fs); len(d) > 0 {
		t.Errorf("the delete action left the pod's scope: %q", d)
	}
	if _, err := os.Lstat(filepath.Join(base, "pod1")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the sandbox directory is left: %v", err)
	}
	if _, err := os.Stat(filepath.Join(bundle, bundleRecordName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the record is left: %v", err)
	}
}
