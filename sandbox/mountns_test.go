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
	return "/proc/self/task/" + strconv.Itoa(s.mnt.tid) + "/root" + path
}

// nsMountLine is mountLine in the sandbox's mount namespace.
func nsMountLine(t testing.TB, s *Sandbox, path string) string {
	t.Helper()
	return mountLineIn(t, "/proc/self/task/"+strconv.Itoa(s.mnt.tid)+"/mountinfo", path)
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
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("kvfs-test", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(sub, unix.MNT_DETACH) })
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
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// TestMountNS checks where a sandbox's mounts are, on a base directory that is a shared mount
// (as /run is on a systemd host): in the owner's namespace only the pin, in the sandbox's the
// share and its binds, a bind that follows the host still following it; an external server's
// process in the sandbox's namespace, an in-process server serving a bind made after it
// started; and after Stop, no mount and no pin.
func TestMountNS(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	if err := unix.Mount(base, base, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	// Unmounted after the sandboxes' teardown (cleanups run last-in first-out).
	t.Cleanup(func() { _ = unix.Unmount(base, unix.MNT_DETACH) })
	if err := unix.Mount("", base, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	src := t.TempDir()
	if err := unix.Mount(src, src, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(src, unix.MNT_DETACH) })
	if err := unix.Mount("", src, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
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
	if err := os.Mkdir(later, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("kvfs-test", later, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(later, unix.MNT_DETACH) })
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
