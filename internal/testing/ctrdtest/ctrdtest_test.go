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
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

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
	c := Start(t, ctrd.Options{})
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
	c := Start(t, ctrd.Options{})
	image := ImportBusybox(t, c)
	before := c.Snapshot(t)
	c.Ctr(t, "run", "--detach", image, "sleeper", "sleep", "600")

	// runc start returns once the container's init is told to exec; it may still be
	// "runc init" for a moment.
	var leaks string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		leaks = strings.Join(ctrd.Diff(before, c.Snapshot(t)), "\n")
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
	host, err := ctrd.OwnMounts(c.Dir())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range host {
		t.Errorf("%s is mounted in the test's mount namespace", m)
	}

	// A sandbox directory left in SandboxBaseDir is a leak too.
	pod := filepath.Join(c.SandboxBaseDir(), "pod")
	if err := os.Mkdir(pod, 0o700); err != nil {
		t.Fatal(err)
	}
	if l := ctrd.Diff(before, c.Snapshot(t)); !slices.Contains(l, "entry "+pod) {
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
		left []ctrd.Process
	)
	t.Run("leave a container", func(t *testing.T) {
		c := Start(t, ctrd.Options{})
		image := ImportBusybox(t, c)
		c.Ctr(t, "run", "--detach", image, "left", "sleep", "600")
		dir = c.Dir()
		sleeping := func(p ctrd.Process) bool { return p.Cmdline == "sleep 600" }
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
		if p.Alive() {
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
	c := Start(r, ctrd.Options{LeakDirs: []string{leakDir}})

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
	ms, err := ctrd.OwnMounts(mnt)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) > 0 {
		t.Errorf("%s is mounted in the test's namespace", mnt)
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
	c := Start(r, ctrd.Options{ShimDirs: []string{dir}})
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
	var orphan ctrd.Process
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
		if !orphan.Alive() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s outlived the cleanup", orphan)
		}
	}
	if _, err := os.Stat(filepath.Dir(c.Cgroup())); !os.IsNotExist(err) {
		t.Errorf("the containerd's cgroup %s: %v after the cleanup", filepath.Dir(c.Cgroup()), err)
	}
}

// TestClientCloseIO: through the Go client, a container's cat reads what is written to its
// stdin and exits only when CloseIO closes it.
func TestClientCloseIO(t *testing.T) {
	requireContainerd(t)
	c := Start(t, ctrd.Options{})
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
	a, b := Start(t, ctrd.Options{}), Start(t, ctrd.Options{})
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
	if l := ctrd.Diff(b.Snapshot(t), before); len(l) != 0 {
		t.Errorf("b lost: %q", l)
	}
	b.Ctr(t, "tasks", "delete", "--force", "same")
	b.Ctr(t, "containers", "delete", "same")
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
	c := Start(t, ctrd.Options{ShimDirs: []string{dir}, Env: []string{"KVFS_TEST_MARK=marked"}})
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
	c := Start(t, ctrd.Options{CRI: true})
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
		t.Fatalf("no address from %s in the log: %q", ctrd.PodSubnet, logs)
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
	c := Start(t, ctrd.Options{})
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
