package agent

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// TestPodTmpfs: a pod tmpfs is mounted at its first ensure, of its size, with its root's mode
// and owner, nosuid and nodev; asked again alike it is the same mount (what was written there
// stays); asked with another size it is an error that names it, and nothing is mounted again.
func TestPodTmpfs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (tmpfs mounts)")
	}
	dir := t.TempDir()
	pt := newPodTmpfs(dir)
	cache := filepath.Join(dir, "cache")
	t.Cleanup(func() { unix.Unmount(cache, unix.MNT_DETACH) })
	v := &apiv1.PodTmpfs{Name: "cache", Size: 8 << 20, Mode: 0o2775, Uid: 1000, Gid: 2000}
	if err := pt.ensure([]*apiv1.PodTmpfs{v}); err != nil {
		t.Fatal(err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(cache, &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type != unix.TMPFS_MAGIC || uint64(fs.Blocks)*uint64(fs.Bsize) != v.Size {
		t.Errorf("at %s: fs type %#x of %d bytes, want a tmpfs of %d", cache, fs.Type, uint64(fs.Blocks)*uint64(fs.Bsize), v.Size)
	}
	if fs.Flags&unix.ST_NOSUID == 0 || fs.Flags&unix.ST_NODEV == 0 {
		t.Errorf("mount flags %#x: not nosuid and nodev", fs.Flags)
	}
	var st unix.Stat_t
	if err := unix.Stat(cache, &st); err != nil {
		t.Fatal(err)
	}
	if st.Mode&0o7777 != v.Mode || st.Uid != v.Uid || st.Gid != v.Gid {
		t.Errorf("root %#o %d:%d, want %#o %d:%d", st.Mode&0o7777, st.Uid, st.Gid, v.Mode, v.Uid, v.Gid)
	}
	if err := os.WriteFile(filepath.Join(cache, "kept"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	again := &apiv1.PodTmpfs{Name: "cache", Size: 8 << 20, Mode: 0o2775, Uid: 1000, Gid: 2000}
	if err := pt.ensure([]*apiv1.PodTmpfs{again}); err != nil {
		t.Errorf("the same volume again: %v", err)
	}
	if _, err := os.Stat(filepath.Join(cache, "kept")); err != nil {
		t.Errorf("asked again, the volume lost its file: %v", err)
	}
	other := &apiv1.PodTmpfs{Name: "cache", Size: 16 << 20, Mode: 0o2775, Uid: 1000, Gid: 2000}
	err := pt.ensure([]*apiv1.PodTmpfs{other})
	if !errdefs.IsInvalidArgument(err) || !strings.Contains(err.Error(), `"cache"`) {
		t.Errorf("the volume with another size: %v, want an InvalidArgument that names it", err)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(mounts), " "+cache+" "); n != 1 {
		t.Errorf("%d mounts at %s, want 1", n, cache)
	}
}
