package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// inNS is path as the sandbox's mount namespace shows it, reached from the test's through
// the root of the namespace's thread.
func inNS(s *Sandbox, path string) string {
	return s.mnt.task() + "/root" + path
}

// nsMountLine is mountLine in the sandbox's mount namespace.
func nsMountLine(t testing.TB, s *Sandbox, path string) string {
	t.Helper()
	return mountLineIn(t, s.mnt.task()+"/mountinfo", path)
}

// readServed reads the file at path (names from the share's root) through the front-end c,
// as the guest reads it.
func readServed(ctx context.Context, c *fuseclient.Client, path ...string) (string, error) {
	node := uint64(fuse.RootID)
	for _, name := range path {
		e, err := c.Lookup(ctx, node, name)
		if err != nil {
			return "", fmt.Errorf("lookup %s: %w", name, err)
		}
		node = e.NodeID
	}
	op, err := c.Open(ctx, node, uint32(os.O_RDONLY))
	if err != nil {
		return "", err
	}
	defer c.Release(ctx, node, op.Fh)
	b, err := c.Read(ctx, node, op.Fh, 0, 4096)
	return string(b), err
}

// TestHostRemovesMountInBind is critest's read-only mount case: a tmpfs mounted inside a
// directory, the directory bound recursively into a running sandbox, then the tmpfs unmounted
// and its directory removed on the host. The removal succeeds, as under runc: the bind's copy
// of the tmpfs is the sandbox's, not the host's.
func TestHostRemovesMountInBind(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	src := t.TempDir()
	mustWrite(t, filepath.Join(src, "f"))
	sub := filepath.Join(src, "sub")
	mountTmpfs(t, sub, 0)
	mustWrite(t, filepath.Join(sub, "g"))

	runner := &frontendRunner{}
	s, err := Create(ctx, "rmdir", Options{Config: testConfig(base), Runner: runner})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	if err := s.Bind(src, "vol", BindRecursive|BindReadOnly); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx, s.DefaultVM()); err != nil {
		t.Fatal(err)
	}
	c := runner.last().client
	for _, p := range [][]string{{"vol", "f"}, {"vol", "sub", "g"}} {
		if got, err := readServed(ctx, c, p...); err != nil || got != "x" {
			t.Errorf("%s served: %q, %v", filepath.Join(p...), got, err)
		}
	}

	if err := unix.Unmount(sub, 0); err != nil {
		t.Fatalf("unmounting the host's tmpfs: %v", err)
	}
	if err := os.Remove(sub); err != nil {
		t.Fatalf("removing the host's directory the tmpfs was mounted on: %v", err)
	}
	if got, err := readServed(ctx, c, "vol", "f"); err != nil || got != "x" {
		t.Errorf("vol/f served after the host's removal: %q, %v", got, err)
	}
}

// sameNS says whether the namespace files a and b (/proc/.../ns/mnt) are one namespace.
func sameNS(t *testing.T, a, b string) bool {
	t.Helper()
	fa, err := os.Stat(a)
	if err != nil {
		t.Fatal(err)
	}
	fb, err := os.Stat(b)
	if err != nil {
		t.Fatal(err)
	}
	return os.SameFile(fa, fb)
}

// TestMountNS checks where a sandbox's mounts are, on a base directory that is a shared mount
// (as /run is on a systemd host): in the owner's namespace only the pin, in the sandbox's the
// share and its binds, a bind that follows the host still following it; an external server's
// process in the sandbox's namespace, an in-process server serving a bind made after it
// started; and after Stop, no mount and no pin.
func TestMountNS(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	sharedMount(t, base) // unmounted after the sandboxes' teardown
	ctx := context.Background()
	src := t.TempDir()
	sharedMount(t, src)
	mustWrite(t, filepath.Join(src, "f"))

	ext, err := Create(ctx, "ext", Options{Config: externalConfig(t, base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, ext)
	runner := &frontendRunner{}
	inproc := testConfig(base)
	inproc.Server.Daemon = InProcessUnconfined
	in, err := Create(ctx, "inproc", Options{Config: inproc, Runner: runner})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, in)

	// The external daemon was forked by the namespace's thread.
	if pid := ext.Stats().Server.PID; !sameNS(t, fmt.Sprintf("/proc/%d/ns/mnt", pid), ext.mnt.path()) {
		t.Errorf("the external server (pid %d) is not in the sandbox's mount namespace", pid)
	}
	if sameNS(t, "/proc/self/ns/mnt", ext.mnt.path()) || sameNS(t, ext.mnt.path(), in.mnt.path()) {
		t.Error("a sandbox's mount namespace is the owner's or another sandbox's")
	}

	if err := in.Start(ctx, in.DefaultVM()); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Sandbox{ext, in} {
		if err := s.Bind(src, "vol", BindRecursive); err != nil {
			t.Fatal(err)
		}
		if err := s.Bind(src, "follows", BindRecursive|BindFollowHost); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := readServed(ctx, runner.last().client, "vol", "f"); err != nil || got != "x" {
		t.Errorf("a bind made after the in-process server started, served: %q, %v", got, err)
	}

	// A mount the host makes under the source later reaches the bind that follows it.
	later := filepath.Join(src, "later")
	mountTmpfs(t, later, 0)
	mustWrite(t, filepath.Join(later, "g"))
	for _, s := range []*Sandbox{ext, in} {
		if _, err := os.Stat(inNS(s, filepath.Join(s.SharedDir(), "follows", "later", "g"))); err != nil {
			t.Errorf("%s: the host's later mount in the bind that follows it: %v", s.ID(), err)
		}
		if l := nsMountLine(t, s, filepath.Join(s.SharedDir(), "vol", "later")); l != "" {
			t.Errorf("%s: the host's later mount reached a bind that does not follow it: %q", s.ID(), l)
		}
		if below, err := s.Submounts("follows"); err != nil || len(below) != 1 || below[0] != "later" {
			t.Errorf("%s: Submounts(follows) = %q, %v", s.ID(), below, err)
		}
	}

	// The owner's namespace holds the pins and nothing else of the sandboxes.
	under, err := mountsUnder(base)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range under {
		if p != base && filepath.Base(p) != pinName {
			t.Errorf("in the owner's mount namespace: %s", p)
		}
	}
	// A pin holds its sandbox's namespace.
	if !sameNS(t, filepath.Join(ext.Dir(), pinName), ext.mnt.path()) {
		t.Errorf("%s does not hold the sandbox's mount namespace", filepath.Join(ext.Dir(), pinName))
	}

	for _, s := range []*Sandbox{ext, in} {
		if err := s.Stop(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Submounts("vol"); err == nil {
			t.Errorf("%s: Submounts after Stop succeeded", s.ID())
		}
	}
	if under, _ := mountsUnder(base); len(under) != 1 || under[0] != base {
		t.Errorf("mounts left after Stop: %q", under)
	}
	if entries, _ := os.ReadDir(base); len(entries) != 0 {
		t.Errorf("left in the base directory: %v", entries)
	}
}

// TestPinNewerNamespace: the kernel binds a mount namespace's file only into a namespace with
// a lower id, and Linux 6.18 numbers namespaces from per-CPU batches of ids, so a sandbox's
// namespace made after its owner's, on another CPU, can have the lower id (TestCRIPod's shim,
// in containerd's namespace, failed to pin one in a pod creation out of a few). For every pair
// of CPUs, an owner's namespace is made on the one, as containerd's is (a private copy of the
// test's), and a sandbox's from it, first on the other; the owner binds it onto a pin every time.
func TestPinNewerNamespace(t *testing.T) {
	requireRoot(t)
	var all unix.CPUSet
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		t.Fatal(err)
	}
	var cpus []int
	for c := range len(all) * 64 {
		if all.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	if len(cpus) < 2 {
		t.Skip("one CPU: its namespaces are numbered in order")
	}
	dir := t.TempDir()
	for _, owner := range cpus {
		for _, first := range cpus {
			if err := pinAcrossCPUs(dir, owner, first, &all); err != nil {
				t.Errorf("owner's namespace made on CPU %d, the sandbox's first on CPU %d: %v", owner, first, err)
			}
		}
	}
}

// pinAcrossCPUs makes an owner's mount namespace on CPU owner and a sandbox's from it with
// unshareNewer (cpus), its thread bound to CPU first, and pins the sandbox's in the owner's.
func pinAcrossCPUs(dir string, owner, first int, cpus *unix.CPUSet) error {
	onCPU := func(c int) error {
		var one unix.CPUSet
		one.Set(c)
		return unix.SchedSetaffinity(0, &one)
	}
	own, err := startMountNS(func() error {
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return err
		}
		if err := onCPU(owner); err != nil {
			return err
		}
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return err
		}
		return unix.Mount("", "/", "", unix.MS_PRIVATE|unix.MS_REC, "")
	})
	if err != nil {
		return fmt.Errorf("the owner's namespace: %w", err)
	}
	defer own.close()
	sbx, err := startMountNS(func() error {
		f, err := os.Open(own.path())
		if err != nil {
			return err
		}
		defer f.Close()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return err
		}
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNS); err != nil {
			return err
		}
		if err := onCPU(first); err != nil {
			return err
		}
		return unshareNewer(cpus)
	})
	if err != nil {
		return fmt.Errorf("the sandbox's namespace: %w", err)
	}
	defer sbx.close()
	p := filepath.Join(dir, fmt.Sprintf("pin-%d-%d", owner, first))
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		return err
	}
	ownID, sbxID := nsID(own), nsID(sbx)
	return own.do(func() error {
		if err := unix.Mount(p, p, "", unix.MS_BIND, ""); err != nil {
			return err
		}
		if err := unix.Mount("", p, "", unix.MS_PRIVATE, ""); err != nil {
			return err
		}
		if err := unix.Mount(sbx.path(), p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind the namespace onto the pin: %w (ids: owner's %s, sandbox's %s)", err, ownID, sbxID)
		}
		return nil
	})
}

// nsID is the id of ns, for a failure's message.
func nsID(ns *mountNS) string {
	var id uint64
	err := ns.do(func() error {
		var err error
		id, err = mountNSID()
		return err
	})
	if err != nil {
		return err.Error()
	}
	return strconv.FormatUint(id, 10)
}
