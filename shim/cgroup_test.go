package shim

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	cgroup1stats "github.com/containerd/cgroups/v3/cgroup1/stats"
	"github.com/containerd/cgroups/v3/cgroup2"
	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

func TestCheckCgroupPath(t *testing.T) {
	for _, p := range []string{"", "/", "kubepods/pod1", "/kubepods/../etc", "/kubepods//pod1", "/kubepods/pod1/",
		"kubepods-burstable-pod1.slice:cri-containerd:abc"} {
		if err := checkCgroupPath(p); err == nil || !strings.Contains(err.Error(), strconv.Quote(p)) {
			t.Errorf("checkCgroupPath(%q): %v, want an error that names it", p, err)
		}
	}
	if err := checkCgroupPath("/kubepods/burstable/pod1/abc"); err != nil {
		t.Errorf("a cgroupfs path: %v", err)
	}
}

func TestSandboxCgroupPath(t *testing.T) {
	for _, tt := range [][3]string{
		{"", "sb1", ""},
		{"/kubepods/burstable/pod1", "sb1", "/kubepods/burstable/pod1/sb1"},
		{"/kubepods/pod1/", "sb1", "/kubepods/pod1/sb1"},
		{"kubepods-burstable-pod1.slice", "sb1", "kubepods-burstable-pod1.slice:cri-containerd:sb1"},
		{"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod2.slice", "sb2", "kubepods-besteffort-pod2.slice:cri-containerd:sb2"},
	} {
		if got := sandboxCgroupPath(tt[0], tt[1]); got != tt[2] {
			t.Errorf("sandboxCgroupPath(%q, %q) = %q, want %q", tt[0], tt[1], got, tt[2])
		}
	}
}

// testCgroup makes a cgroup of the test's (in every v1 hierarchy, or the unified one) and
// removes it at cleanup; it needs root.
func testCgroup(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to make cgroups")
	}
	var b [4]byte
	rand.Read(b[:])
	path := "/kvfs-shimtest-" + hex.EncodeToString(b[:])
	if cgroups.Mode() == cgroups.Unified {
		m, err := cgroup2.NewManager("/sys/fs/cgroup", path, &cgroup2.Resources{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Delete() })
		return path
	}
	cg, err := cgroup1.New(cgroup1.StaticPath(path), &specs.LinuxResources{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cg.Delete() })
	return path
}

// TestPodCgroupMetrics: a pod's cgroup parent is read as containerd's podsandbox reads it,
// a cgroup v1 Metrics on a host with v1 hierarchies (hybrid too), a cgroup2 one with v2 only,
// and counts what runs below it; a systemd path is refused, naming it.
func TestPodCgroupMetrics(t *testing.T) {
	parent := testCgroup(t)
	cg, err := joinPodCgroup(t.Context(), parent+"/pod")
	if err != nil {
		t.Fatal(err)
	}
	if err := exec.Command("sh", "-c", "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done").Run(); err != nil {
		t.Error(err)
	}
	if err := cg.leave(t.Context()); err != nil {
		t.Fatal(err)
	}
	a, err := podCgroupMetrics(parent)
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(a)
	if err != nil {
		t.Fatal(err)
	}
	var cpu uint64
	switch m := v.(type) {
	case *cgroup1stats.Metrics:
		if cgroups.Mode() == cgroups.Unified {
			t.Errorf("a cgroup v1 Metrics on a host with cgroup v2 only")
		}
		cpu = m.GetCPU().GetUsage().GetTotal()
	case *cgroupstats.Metrics:
		if cgroups.Mode() != cgroups.Unified {
			t.Errorf("a cgroup2 Metrics on a host with cgroup v1 hierarchies (%v)", cgroups.Mode())
		}
		cpu = m.GetCPU().GetUsageUsec() * 1000
	default:
		t.Fatalf("podCgroupMetrics: %T", v)
	}
	if cpu == 0 {
		t.Errorf("the parent's CPU use is 0 after a shell counted to 20000 in its child cgroup: %v", v)
	}
	const systemd = "kubepods-burstable-pod1.slice"
	if _, err := podCgroupMetrics(systemd); err == nil || !strings.Contains(err.Error(), systemd) {
		t.Errorf("podCgroupMetrics of a systemd slice: %v, want an error naming it", err)
	}
}

// cgroupsOf is pid's /proc/PID/cgroup lines.
func cgroupsOf(t *testing.T, pid int) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSpace(string(b)), "\n")
}

// podCgroupDirs are the directories of path in the memory hierarchy (v1) or the unified one.
func podCgroupDirs(path string) []string {
	var out []string
	for _, d := range []string{filepath.Join("/sys/fs/cgroup/memory", path), filepath.Join("/sys/fs/cgroup", path)} {
		if _, err := os.Stat(d); err == nil {
			out = append(out, d)
		}
	}
	return out
}

// TestPodCgroup: the shim joins the pod's cgroup (made in every hierarchy), a process it then
// starts is born there, and leave puts the shim back where it was and removes the cgroup;
// removePodCgroup removes one left by a dead shim, and a missing one is no error.
func TestPodCgroup(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to make cgroups")
	}
	var b [4]byte
	rand.Read(b[:])
	parent := "/kvfs-shimtest-" + hex.EncodeToString(b[:])
	path := parent + "/pod"
	t.Cleanup(func() {
		for _, d := range podCgroupDirs(path) {
			os.Remove(d)
		}
		roots, _ := filepath.Glob("/sys/fs/cgroup/*")
		for _, r := range append(roots, "/sys/fs/cgroup") {
			os.Remove(filepath.Join(r, path))
			os.Remove(filepath.Join(r, parent))
		}
	})
	before := cgroupsOf(t, os.Getpid())

	cg, err := joinPodCgroup(t.Context(), path)
	if err != nil {
		t.Fatal(err)
	}
	if len(podCgroupDirs(path)) == 0 {
		t.Fatalf("joinPodCgroup(%s) made no cgroup in the memory or unified hierarchy", path)
	}
	child := exec.Command("sleep", "600")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	mine := cgroupsOf(t, os.Getpid())
	in := 0
	for _, l := range cgroupsOf(t, child.Process.Pid) {
		if strings.HasSuffix(l, ":"+path) {
			in++
		}
	}
	if in == 0 {
		t.Errorf("a child started after the join is not in %s: %q", path, cgroupsOf(t, child.Process.Pid))
	}
	if err := cg.leave(t.Context()); err == nil {
		t.Error("leave with a process left in the pod's cgroup: no error")
	}
	child.Process.Kill()
	child.Wait()
	if err := cg.leave(t.Context()); err != nil {
		t.Fatal(err)
	}
	if after := cgroupsOf(t, os.Getpid()); strings.Join(after, "\n") != strings.Join(before, "\n") {
		t.Errorf("after leave the shim's cgroups are %q, want %q (in the pod's: %q)", after, before, mine)
	}
	if d := podCgroupDirs(path); len(d) > 0 {
		t.Errorf("leave left the pod's cgroup: %q", d)
	}

	// A dead shim's cgroup, removed by the delete action; then one already gone.
	cg, err = joinPodCgroup(t.Context(), path)
	if err != nil {
		t.Fatal(err)
	}
	// The shim leaves it without removing it, as its death would.
	if cg.v2 != nil {
		err = cg.v2From.AddProc(uint64(os.Getpid()))
	} else {
		err = cg.v1From.Add(cgroup1.Process{Pid: os.Getpid()})
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := removePodCgroup(t.Context(), path); err != nil {
		t.Fatal(err)
	}
	if d := podCgroupDirs(path); len(d) > 0 {
		t.Errorf("removePodCgroup left %q", d)
	}
	if err := removePodCgroup(t.Context(), path); err != nil {
		t.Errorf("removePodCgroup of a cgroup already gone: %v", err)
	}
}
