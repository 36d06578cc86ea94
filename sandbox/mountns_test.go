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
