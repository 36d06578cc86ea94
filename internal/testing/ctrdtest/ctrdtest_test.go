package ctrdtest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// TestDepsVersion: scripts/deps.sh installs the containerd the tests want.
func TestDepsVersion(t *testing.T) {
	b, err := os.ReadFile("../../../scripts/deps.sh")
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

// requireContainerd skips the tests that run a containerd where they cannot or should not
// run: as another user than root, and with -short (make test-unit, which does not run
// scripts/deps.sh).
func requireContainerd(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: containerd, runc and mounts")
	}
	if testing.Short() {
		t.Skip("runs containerd (skipped with -short)")
	}
}

// TestRuncShim runs busybox through containerd's own runc shim: the harness's end-to-end proof.
func TestRuncShim(t *testing.T) {
	requireContainerd(t)
	c := Start(t, Options{})
	image := ImportBusybox(t, c)

	// The CRI and NRI are off.
	plugins := c.Ctr(t, "plugins", "list")
	for _, p := range append([]string{ctrdconf.NRIPlugin}, ctrdconf.CRIPlugins()...) {
		typ, id, _ := strings.Cut(strings.TrimPrefix(p, "io.containerd."), ".v1.")
		if regexp.MustCompile(`(?m)^io\.containerd\.` + regexp.QuoteMeta(typ) + `\.v1\s+` + regexp.QuoteMeta(id) + `\s`).MatchString(plugins) {
			t.Errorf("plugin %s is loaded:\n%s", p, plugins)
		}
	}
	if !regexp.MustCompile(`(?m)^io\.containerd\.snapshotter\.v1\s+overlayfs\s+\S+\s+ok\s*$`).MatchString(plugins) {
		t.Errorf("no overlayfs snapshotter:\n%s", plugins)
	}

	before := c.Snapshot(t)
	r := c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.runc.v2", image, "t1", "echo", "hello")
	if r.ExitCode != 0 || r.Stdout != "hello\n" {
		t.Errorf("echo hello: exit %d, stdout %q, stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	r = c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.runc.v2", image, "t2", "sh", "-c", "echo out; echo err >&2; exit 3")
	if r.ExitCode != 3 || r.Stdout != "out\n" || !strings.Contains(r.Stderr, "err\n") {
		t.Errorf("exit 3: exit %d, stdout %q, stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	// The image's files, as a process in it sees them.
	out := c.Ctr(t, "run", "--rm", image, "t3", "sh", "-c", "id -u; readlink /bin/ls; cat /etc/passwd | head -1; ls -d /proc/1")
	if want := "0\nbusybox\nroot:x:0:0:root:/root:/bin/sh\n/proc/1\n"; out != want {
		t.Errorf("in the container: %q, want %q", out, want)
	}
	c.CheckNoLeaks(t, before)
	if s := c.Snapshot(t); len(s.Processes) != 0 || len(s.Cgroups) != 0 {
		t.Errorf("after the runs: %+v", s)
	}
}

// TestLeakCheck: a container left running shows as leaks (its shim, its process, its root
// file system's mount, its cgroups, runc's state), and once it is deleted none remain.
func TestLeakCheck(t *testing.T) {
	requireContainerd(t)
	c := Start(t, Options{})
	image := ImportBusybox(t, c)
	before := c.Snapshot(t)
	c.Ctr(t, "run", "--detach", image, "sleeper", "sleep", "600")

	// runc start returns once the container's init is told to exec; it may still be
	// "runc init" for a moment.
	var leaks string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		leaks = strings.Join(diff(before, c.Snapshot(t)), "\n")
		if strings.Contains(leaks, "(sleep 600)") || time.Now().After(deadline) {
			break
		}
	}
	for _, re := range []string{
		`(?m)^process pid \d+ \(\S*containerd-shim-runc-v2 -namespace ` + c.Namespace() + ` -id sleeper -address ` + regexp.QuoteMeta(c.Address()) + `\)$`,
		`(?m)^process pid \d+ \(sleep 600\)$`,
		`(?m)^mount ` + regexp.QuoteMeta(c.Dir()) + `/state/\S+/sleeper/rootfs$`,
		`(?m)^cgroup or runc state /sys/fs/cgroup/memory/` + c.Namespace() + `/sleeper$`,
		`(?m)^cgroup or runc state /run/containerd/runc/` + c.Namespace() + `/sleeper$`,
	} {
		if !regexp.MustCompile(re).MatchString(leaks) {
			t.Errorf("leaks: no match for %s in:\n%s", re, leaks)
		}
	}

	// The root file system is mounted in containerd's mount namespace, not the test's.
	host, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range host {
		if under(m.point, c.Dir()) {
			t.Errorf("%s is mounted in the test's mount namespace", m.point)
		}
	}

	// A sandbox directory left in SandboxBaseDir is a leak too.
	pod := filepath.Join(c.SandboxBaseDir(), "pod")
	if err := os.Mkdir(pod, 0o700); err != nil {
		t.Fatal(err)
	}
	if l := diff(before, c.Snapshot(t)); !slices.Contains(l, "entry "+pod) {
		t.Errorf("leaks %q: no entry %s", l, pod)
	}
	if err := os.Remove(pod); err != nil {
		t.Fatal(err)
	}

	killTask(t, c, "sleeper")
	c.Ctr(t, "tasks", "delete", "sleeper")
	c.Ctr(t, "containers", "delete", "sleeper")
	c.CheckNoLeaks(t, before)
}

// TestCleanupRemovesLeftovers: what a test leaves running is deleted through containerd at
// cleanup, without failing the test, and nothing of it survives.
func TestCleanupRemovesLeftovers(t *testing.T) {
	requireContainerd(t)
	var (
		dir  string
		left []Process
	)
	t.Run("leave a container", func(t *testing.T) {
		c := Start(t, Options{})
		image := ImportBusybox(t, c)
		c.Ctr(t, "run", "--detach", image, "left", "sleep", "600")
		dir = c.Dir()
		sleeping := func(p Process) bool { return p.Cmdline == "sleep 600" }
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			left = c.Snapshot(t).Processes
			if len(left) == 2 && slices.ContainsFunc(left, sleeping) || time.Now().After(deadline) {
				break
			}
		}
		if len(left) != 2 || !slices.ContainsFunc(left, sleeping) {
			t.Errorf("want the shim and sleep, got %v", left)
		}
	})
	for _, p := range left {
		if q, err := readProcess(p.PID); err == nil && q.Start == p.Start && q.State != 'Z' {
			t.Errorf("%s outlived the cleanup", p)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s: %v after the cleanup", dir, err)
	}
}

// recorder is a testing.TB that keeps its errors and cleanups instead of acting on them, so
// that the cleanup's failure reports can be checked.
type recorder struct {
	testing.TB
	mu       sync.Mutex
	errors   []string
	cleanups []func()
}

func (r *recorder) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}

func (r *recorder) Failed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.errors) > 0 || r.TB.Failed()
}

func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }

func (r *recorder) runCleanups() {
	for _, f := range slices.Backward(r.cleanups) {
		f()
	}
}

// TestCleanupReclaimsLeaks: a process and a mount that outlive the test fail it and are taken
// back — the process killed, the mount gone with containerd's mount namespace — and the
// directory is removed.
func TestCleanupReclaimsLeaks(t *testing.T) {
	requireContainerd(t)
	leakDir, err := os.MkdirTemp("", "ctrd-leak-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(leakDir)
	r := &recorder{TB: t}
	c := Start(r, Options{LeakDirs: []string{leakDir}})

	// A process naming the directory, with a child, as a VM of a sandbox there would be.
	marker := filepath.Join(leakDir, "vm")
	proc := exec.Command("/bin/sh", "-c", "sleep 600; :", marker)
	if err := proc.Start(); err != nil {
		t.Fatal(err)
	}
	defer proc.Wait()
	mnt := filepath.Join(leakDir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	// A mount in containerd's mount namespace, as a shim's would be.
	if out, err := exec.Command("nsenter", "--target", fmt.Sprint(c.PID()), "--mount",
		"mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Fatalf("mounting in containerd's namespace: %v: %s", err, out)
	}
	if !slices.Contains(c.Snapshot(t).Mounts, mnt) {
		t.Errorf("the snapshot does not see %s", mnt)
	}

	r.runCleanups()
	errs := strings.Join(r.errors, "\n")
	for _, re := range []string{
		`leak after the test: process pid ` + fmt.Sprint(proc.Process.Pid) + ` \(/bin/sh -c sleep 600; : ` + regexp.QuoteMeta(marker) + `\)`,
		`leak after the test: process pid \d+ \(sleep 600\)`,
		`leak after the test: mount ` + regexp.QuoteMeta(mnt) + `\n`,
		`leak after the test: entry ` + regexp.QuoteMeta(mnt) + `\n`,
	} {
		if !regexp.MustCompile(re).MatchString(errs + "\n") {
			t.Errorf("cleanup's errors: no match for %s in:\n%s", re, errs)
		}
	}
	if len(r.errors) != 4 {
		t.Errorf("cleanup reported %d errors, want 4:\n%s", len(r.errors), errs)
	}
	if err := proc.Wait(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("the leaked process: %v, want killed", err)
	}
	// The mount went with containerd's namespace: it never was in the test's.
	ms, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.point == mnt {
			t.Errorf("%s is mounted in the test's namespace", mnt)
		}
	}
	if _, err := os.Stat(c.Dir()); !os.IsNotExist(err) {
		t.Errorf("%s: %v after the cleanup", c.Dir(), err)
	}
}

// TestCleanupCatchesOrphans: a process a containerd started that left it — in a session of
// its own, reparented away from containerd, its command line naming nothing of the test, as
// a shim's daemon can — is still the containerd's: the snapshot has it, the cleanup fails the
// test for it and kills it. (Here the shim of a runtime that leaves a daemon and fails its
// start, so that containerd forgets it.)
func TestCleanupCatchesOrphans(t *testing.T) {
	requireContainerd(t)
	dir := t.TempDir()
	shim := "#!/bin/sh\nfor a; do last=$a; done\nif [ \"$last\" = start ]; then setsid sleep 607 </dev/null >/dev/null 2>&1 & fi\necho 'the orphaning shim fails' >&2\nexit 1\n"
	if err := os.WriteFile(filepath.Join(dir, "containerd-shim-orphan-v2"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	r := &recorder{TB: t}
	c := Start(r, Options{ShimDirs: []string{dir}})
	cleaned := false
	defer func() {
		if !cleaned { // the test failed before it checked the cleanup
			r.runCleanups()
		}
	}()
	image := ImportBusybox(t, c)
	if res := c.RunCtr(t, "run", "--runtime", "io.containerd.orphan.v2", image, "o1", "true"); res.ExitCode == 0 {
		t.Fatalf("ctr run with the orphaning shim succeeded: %+v", res)
	}
	var orphan Process
	for deadline := time.Now().Add(10 * time.Second); orphan.PID == 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		for _, p := range c.Snapshot(t).Processes {
			if p.Cmdline == "sleep 607" {
				orphan = p
			}
		}
	}
	if orphan.PID == 0 {
		t.Fatal("the snapshot does not have the orphaned sleep 607")
	}
	if orphan.PPID == c.PID() {
		t.Errorf("%s is containerd's child: the test wants an orphan", orphan)
	}

	cleaned = true
	r.runCleanups()
	errs := strings.Join(r.errors, "\n")
	if !regexp.MustCompile(`leak after the test: process pid ` + fmt.Sprint(orphan.PID) + ` \(sleep 607\)`).MatchString(errs) {
		t.Errorf("the cleanup did not report the orphan %s:\n%s", orphan, errs)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		q, err := readProcess(orphan.PID)
		if err != nil || q.Start != orphan.Start || q.State == 'Z' {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s outlived the cleanup", orphan)
		}
	}
	if _, err := os.Stat(filepath.Dir(c.cgroup)); !os.IsNotExist(err) {
		t.Errorf("the containerd's cgroup %s: %v after the cleanup", filepath.Dir(c.cgroup), err)
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
	ns := namespaceFor(t)
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
	liveNS := namespaceFor(t)
	live := filepath.Join(root, liveNS, fmt.Sprintf("%s%d-%d", cgroupPrefix, self.PID, self.Start))
	if err := os.MkdirAll(live, 0o755); err != nil {
		t.Fatal(err)
	}
	defer removeCgroupTree(filepath.Join(root, liveNS))

	r := &recorder{TB: t}
	sweepDeadOwners(r)
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

// TestClientCloseIO: through the Go client, a container's cat reads what is written to its
// stdin and exits only when CloseIO closes it.
func TestClientCloseIO(t *testing.T) {
	requireContainerd(t)
	c := Start(t, Options{})
	name := ImportBusybox(t, c)
	cl := c.Client(t)
	ctx := context.Background()
	img, err := cl.GetImage(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	ctr, err := cl.NewContainer(ctx, "cat",
		client.WithNewSnapshot("cat", img),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("cat")))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := ctr.Delete(ctx, client.WithSnapshotCleanup); err != nil {
			t.Errorf("deleting the container: %v", err)
		}
	}()
	stdinR, stdinW := io.Pipe()
	var stdout, stderr syncbuf.Buffer
	task, err := ctr.NewTask(ctx, cio.NewCreator(cio.WithStreams(stdinR, &stdout, &stderr), cio.WithFIFODir(c.FIFODir())))
	if err != nil {
		t.Fatal(err)
	}
	exited, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdinW, "hello from stdin\n"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); stdout.String() != "hello from stdin\n"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("cat's output %q, stderr %q", stdout.String(), stderr.String())
		}
	}
	select {
	case st := <-exited:
		t.Fatalf("cat exited before its stdin was closed: %v", st.Error())
	case <-time.After(300 * time.Millisecond):
	}
	stdinW.Close()
	if err := task.CloseIO(ctx, client.WithStdinCloser); err != nil {
		t.Fatal(err)
	}
	select {
	case st := <-exited:
		if code, _, err := st.Result(); code != 0 || err != nil {
			t.Errorf("cat: exit %d, %v", code, err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("cat did not exit after CloseIO")
	}
	if _, err := task.Delete(ctx); err != nil {
		t.Errorf("deleting the task: %v", err)
	}
}

// TestTwoContainerds: two test containerds at once (as tests of several packages run) keep
// apart, even with the same container ID: runc's state and the cgroups are per namespace.
func TestTwoContainerds(t *testing.T) {
	requireContainerd(t)
	a, b := Start(t, Options{}), Start(t, Options{})
	if a.Namespace() == b.Namespace() || a.Dir() == b.Dir() {
		t.Fatalf("both in %s, %s", a.Namespace(), a.Dir())
	}
	for _, c := range []*Containerd{a, b} {
		image := ImportBusybox(t, c)
		c.Ctr(t, "run", "--detach", image, "same", "sleep", "600")
	}
	for _, c := range []*Containerd{a, b} {
		out := c.Ctr(t, "tasks", "list")
		if !regexp.MustCompile(`(?m)^same\s+\d+\s+RUNNING$`).MatchString(out) {
			t.Errorf("%s: tasks:\n%s", c.Namespace(), out)
		}
		var shims int
		for _, p := range c.Snapshot(t).Processes {
			if strings.Contains(p.Cmdline, "containerd-shim-runc-v2") {
				shims++
				if !strings.Contains(p.Cmdline, "-namespace "+c.Namespace()+" ") {
					t.Errorf("%s: another's shim: %s", c.Namespace(), p)
				}
			}
		}
		if shims != 1 {
			t.Errorf("%s: %d shims", c.Namespace(), shims)
		}
	}
	before := b.Snapshot(t)
	killTask(t, a, "same")
	a.Ctr(t, "tasks", "delete", "same")
	a.Ctr(t, "containers", "delete", "same")
	// b's container is untouched by a's deletion of the same ID.
	b.CheckNoLeaks(t, before)
	if l := diff(b.Snapshot(t), before); len(l) != 0 {
		t.Errorf("b lost: %q", l)
	}
	b.Ctr(t, "tasks", "delete", "--force", "same")
	b.Ctr(t, "containers", "delete", "same")
}

func TestDiff(t *testing.T) {
	before := Snapshot{
		Processes: []Process{{PID: 10, Start: 100, Cmdline: "shim a"}},
		Mounts:    []string{"/tmp/ctrd-1/m"},
		Cgroups:   []string{"/sys/fs/cgroup/memory/ns/a"},
		Entries:   []string{"/tmp/sb/a"},
		FDs:       map[string]int{"socket": 3, "/tmp/ctrd-1/root": 1},
	}
	if l := diff(before, before); len(l) != 0 {
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
	if got := diff(before, now); !slices.Equal(got, want) {
		t.Errorf("diff:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// What went away is no leak; descriptors are not compared once containerd has exited.
	if l := diff(now, Snapshot{}); len(l) != 0 {
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

// TestShimDirs: a shim in Options.ShimDirs is found before the installed one, and the
// environment of Options.Env reaches it.
func TestShimDirs(t *testing.T) {
	requireContainerd(t)
	dir := t.TempDir()
	calls := filepath.Join(dir, "calls")
	wrapper := "#!/bin/sh\necho \"$KVFS_TEST_MARK $*\" >>" + calls + "\nexec " + Binaries(t).RuncShim + " \"$@\"\n"
	if err := os.WriteFile(filepath.Join(dir, "containerd-shim-runc-v2"), []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	c := Start(t, Options{ShimDirs: []string{dir}, Env: []string{"KVFS_TEST_MARK=marked"}})
	image := ImportBusybox(t, c)
	if out := c.Ctr(t, "run", "--rm", image, "t1", "echo", "hello"); out != "hello\n" {
		t.Errorf("echo hello: %q", out)
	}
	b, err := os.ReadFile(calls)
	if err != nil {
		t.Fatalf("the shim in ShimDirs was not run: %v", err)
	}
	if !regexp.MustCompile(`(?m)^marked .*-id t1 .*start$`).Match(b) {
		t.Errorf("the shim's invocations:\n%s", b)
	}
}

// TestCRIRunc runs a pod through the CRI with containerd's runc runtime: the CRI harness's
// end-to-end proof (crictl, CNI, the pause image, the network namespace), and the peer the
// kvfs pods are measured against.
func TestCRIRunc(t *testing.T) {
	requireContainerd(t)
	c := Start(t, Options{CRI: true})
	image := ImportImage(t, c, "localhost/busybox:cri")
	before := c.Snapshot(t)

	dir := t.TempDir()
	pod := filepath.Join(dir, "pod.json")
	ctr := filepath.Join(dir, "ctr.json")
	writeJSON(t, pod, map[string]any{
		"metadata":      map[string]any{"name": "p1", "namespace": "default", "uid": "u1"},
		"log_directory": filepath.Join(dir, "logs"),
		"dns_config":    map[string]any{"servers": []string{"10.99.0.53"}, "searches": []string{"kvfs.test"}},
	})
	writeJSON(t, ctr, map[string]any{
		"metadata": map[string]any{"name": "c1"},
		"image":    map[string]any{"image": image},
		"command":  []string{"sh", "-c", "echo started; cat /etc/resolv.conf; ip -4 -o addr show eth0; sleep 600"},
		"log_path": "c1.log",
	})
	podID := strings.TrimSpace(c.Crictl(t, "runp", "--runtime", "runc", pod))
	ctrID := strings.TrimSpace(c.Crictl(t, "create", podID, ctr, pod))
	c.Crictl(t, "start", ctrID)

	var logs string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if logs = c.Crictl(t, "logs", ctrID); strings.Contains(logs, "inet ") {
			break
		}
	}
	if !strings.Contains(logs, "started\n") || !strings.Contains(logs, "nameserver 10.99.0.53") || !strings.Contains(logs, "search kvfs.test") {
		t.Errorf("the container's log: %q", logs)
	}
	m := regexp.MustCompile(`inet (10\.99\.0\.\d+)/24`).FindStringSubmatch(logs)
	if m == nil {
		t.Fatalf("no address from %s in the log: %q", PodSubnet, logs)
	}
	// The pod answers from the containerd's network namespace, beside its veth.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if out, err := c.InNetNS(ctx, "busybox", "ping", "-c", "1", "-W", "5", m[1]).CombinedOutput(); err != nil {
		t.Errorf("ping %s from NetNS: %v\n%s", m[1], err, out)
	}
	// crictl prints the exec's stdout and stderr, each followed by a newline.
	if out := c.Crictl(t, "exec", "--sync", ctrID, "echo", "from exec"); strings.TrimSpace(out) != "from exec" {
		t.Errorf("exec: %q", out)
	}
	c.Crictl(t, "stopp", podID)
	c.Crictl(t, "rmp", podID)
	c.CheckNoLeaks(t, before)
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestRestart: Restart under a running runc task, the reference runtime: containerd comes
// back in the same mount namespace (the task's rootfs mount is still seen), reconnects to the
// shim, the task runs on and takes an exec, a kill and a delete, and nothing is left.
func TestRestart(t *testing.T) {
	requireContainerd(t)
	c := Start(t, Options{})
	image := ImportBusybox(t, c)
	before := c.Snapshot(t)
	c.Ctr(t, "run", "-d", "--runtime", "io.containerd.runc.v2", image, "r1", "sleep", "600")
	mounts := c.Snapshot(t).Mounts
	pid := c.PID()

	c.Restart(t)
	if c.PID() == pid {
		t.Fatalf("containerd's pid is %d after the restart, as before", pid)
	}
	if now := c.Snapshot(t).Mounts; !slices.Equal(now, mounts) {
		t.Errorf("mounts after the restart: %q, were %q", now, mounts)
	}
	if out := c.Ctr(t, "task", "ls"); !regexp.MustCompile(`(?m)^r1\s+\d+\s+RUNNING$`).MatchString(out) {
		t.Errorf("ctr task ls after the restart:\n%s", out)
	}
	if out := c.Ctr(t, "task", "exec", "--exec-id", "e1", "r1", "echo", "after"); out != "after\n" {
		t.Errorf("exec after the restart: %q", out)
	}
	c.Ctr(t, "task", "kill", "-s", "SIGKILL", "r1")
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if out := c.Ctr(t, "task", "ls"); strings.Contains(out, "STOPPED") {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("r1 not stopped 30 s after SIGKILL:\n%s", out)
		}
	}
	c.Ctr(t, "task", "rm", "r1")
	c.Ctr(t, "container", "rm", "r1")
	c.CheckNoLeaks(t, before)
}

// killTask SIGKILLs the task id and waits until it has stopped: ctr's kill returns before the
// task has (a loaded machine takes a while), and a running task cannot be deleted.
func killTask(t *testing.T, c *Containerd, id string) {
	t.Helper()
	c.Ctr(t, "tasks", "kill", "--signal", "SIGKILL", id)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		for _, line := range strings.Split(c.Ctr(t, "tasks", "list"), "\n") {
			if f := strings.Fields(line); len(f) >= 3 && f[0] == id && f[2] == "STOPPED" {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("task %s not stopped 30 s after SIGKILL:\n%s", id, c.Ctr(t, "tasks", "list"))
		}
	}
}
