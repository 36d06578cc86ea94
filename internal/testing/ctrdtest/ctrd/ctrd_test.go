package ctrd

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// TestDepsVersion: scripts/deps.sh installs the containerd the tests want.
func TestDepsVersion(t *testing.T) {
	b, err := os.ReadFile("../../../../scripts/deps.sh")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^containerd_version=(\S+)$`).FindSubmatch(b)
	if m == nil || string(m[1]) != ContainerdVersion {
		t.Fatalf("scripts/deps.sh installs containerd %q; ContainerdVersion is %s", m, ContainerdVersion)
	}
	m = regexp.MustCompile(`(?m)^crictl_version=(\S+)$`).FindSubmatch(b)
	if m == nil || string(m[1]) != CrictlVersion {
		t.Fatalf("scripts/deps.sh installs crictl %q; CrictlVersion is %s", m, CrictlVersion)
	}
}

// TestSweepDeadOwners: what the containerd of a test binary that died before its cleanup left
// in its cgroups is killed by the next Start, and the cgroups removed.
func TestSweepDeadOwners(t *testing.T) {
	root, err := cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	// A dead owner: a process that has exited, with its pid and start time.
	dead := exec.Command("true")
	if err := dead.Start(); err != nil {
		t.Fatal(err)
	}
	owner, err := readProcess(dead.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	dead.Wait()
	ns, err := newNamespace()
	if err != nil {
		t.Fatal(err)
	}
	cg := filepath.Join(root, ns, fmt.Sprintf("%s%d-%d", cgroupPrefix, owner.PID, owner.Start))
	if err := os.MkdirAll(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	defer removeCgroupTree(filepath.Join(root, ns))
	fd, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	left := exec.Command("sleep", "608")
	left.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	err = left.Start()
	fd.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer left.Process.Kill()
	// A live owner's (this test binary's) is left alone.
	self, err := readProcess(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	liveNS, err := newNamespace()
	if err != nil {
		t.Fatal(err)
	}
	live := filepath.Join(root, liveNS, fmt.Sprintf("%s%d-%d", cgroupPrefix, self.PID, self.Start))
	if err := os.MkdirAll(live, 0o755); err != nil {
		t.Fatal(err)
	}
	defer removeCgroupTree(filepath.Join(root, liveNS))

	sweepDeadOwners(t.Logf)
	if err := left.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("the dead owner's process: %v, want killed", err)
	}
	if _, err := os.Stat(filepath.Join(root, ns)); !os.IsNotExist(err) {
		t.Errorf("the dead owner's cgroup: %v, want it removed", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("the live owner's cgroup: %v, want it kept", err)
	}
}

func TestDiff(t *testing.T) {
	before := Snapshot{
		Processes: []Process{{PID: 10, Start: 100, Cmdline: "shim a"}},
		Mounts:    []string{"/tmp/ctrd-1/m"},
		Cgroups:   []string{"/sys/fs/cgroup/memory/ns/a"},
		Entries:   []string{"/tmp/sb/a"},
		FDs:       map[string]int{"socket": 3, "/tmp/ctrd-1/root": 1},
	}
	if l := Diff(before, before); len(l) != 0 {
		t.Errorf("a snapshot differs from itself: %q", l)
	}
	now := Snapshot{
		Processes: []Process{
			{PID: 10, Start: 100, Cmdline: "shim a"},
			{PID: 10, Start: 200, Cmdline: "qemu reused pid"}, // the pid names another process now
			{PID: 11, Start: 300, Cmdline: "qemu"},
		},
		Mounts:  []string{"/tmp/ctrd-1/m", "/tmp/sb/b/mounts"},
		Cgroups: []string{"/sys/fs/cgroup/memory/ns/b"},
		Entries: []string{"/tmp/sb/a", "/tmp/sb/b"},
		FDs:     map[string]int{"socket": 4, "/tmp/ctrd-1/root": 1, "pipe": 1},
	}
	want := []string{
		"process pid 10 (qemu reused pid)",
		"process pid 11 (qemu)",
		"mount /tmp/sb/b/mounts",
		"cgroup or runc state /sys/fs/cgroup/memory/ns/b",
		"entry /tmp/sb/b",
		"containerd's descriptors to pipe: 1, were 0",
		"containerd's descriptors to socket: 4, were 3",
	}
	if got := Diff(before, now); !slices.Equal(got, want) {
		t.Errorf("diff:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// What went away is no leak; descriptors are not compared once containerd has exited.
	if l := Diff(now, Snapshot{}); len(l) != 0 {
		t.Errorf("fewer things held: %q", l)
	}
}

func TestUnescapeMount(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:            "/plain",
		`/with\040space`:    "/with space",
		`/tab\011and\012nl`: "/tab\tand\nnl",
		`/back\134slash`:    `/back\slash`,
		`/short\04`:         `/short\04`,
		`/not\999octal`:     `/not\999octal`,
	} {
		if got := unescapeMount(in); got != want {
			t.Errorf("unescapeMount(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestNames(t *testing.T) {
	for _, tc := range []struct {
		cmdline string
		want    bool
	}{
		{"shim -address /tmp/ctrd-12/containerd.sock", true},
		{"kvfs --base-dir /tmp/ctrd-12", true},
		{"qemu -chardev socket,path=/tmp/ctrd-12/sb/x.sock,id=c", true},
		{"shim -address /tmp/ctrd-123/containerd.sock", false},
		{"cp /tmp/ctrd-12.bak /tmp/ctrd-12_x", false},
		{"/tmp/ctrd-123 /tmp/ctrd-12:x", true},
		{"sleep 600", false},
	} {
		if got := names(tc.cmdline, "/tmp/ctrd-12"); got != tc.want {
			t.Errorf("names(%q) = %v, want %v", tc.cmdline, got, tc.want)
		}
	}
}
