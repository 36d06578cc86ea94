package agent

import (
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// TestSubmountsPinRelease plays the guest's submounts with bind mounts on the host: pin holds
// every mount point a container's root and bind sources cross below the share, and those the
// host names below them (and nothing else), counts the containers sharing one, and release unmounts a mount point when its last
// container lets go. That the pin keeps a guest kernel standing is TestAgentSubmountExits's.
func TestSubmountsPinRelease(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (bind mounts)")
	}
	share := t.TempDir()
	mkdir := func(rel string) string {
		p := filepath.Join(share, rel)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	bind := func(p string) {
		if err := unix.Mount(t.TempDir(), p, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind mount on %s: %v", p, err)
		}
		t.Cleanup(func() { unix.Unmount(p, unix.MNT_DETACH) })
	}
	isMount := func(p string) bool {
		id, err := mountID(p)
		if os.IsNotExist(err) {
			return false // under a mount point now gone
		}
		up, err2 := mountID(filepath.Dir(p))
		if err != nil || err2 != nil {
			t.Fatalf("mount ids of %s: %v, %v", p, err, err2)
		}
		return id != up
	}
	root1, root2 := mkdir("c1/rootfs"), mkdir("c2/rootfs")
	mounts, plain := mkdir("mounts"), mkdir("plain")
	bind(root1)
	bind(root2)
	bind(mounts)
	vol := mkdir("mounts/vol") // on the new mount
	bind(vol)
	inVol := filepath.Join(vol, "tmp") // a mount inside the volume, named by the host
	if err := os.Mkdir(inVol, 0o755); err != nil {
		t.Fatal(err)
	}
	bind(inVol)
	if err := os.WriteFile(filepath.Join(vol, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(vol, filepath.Join(share, "link")); err != nil {
		t.Fatal(err)
	}

	log := logrus.New()
	log.SetOutput(io.Discard)
	m := newSubmounts(share, logrus.NewEntry(log))
	spec := func(root string, sources ...string) *specs.Spec {
		s := &specs.Spec{Root: &specs.Root{Path: root}}
		for _, src := range sources {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/x", Type: "bind", Source: src, Options: []string{"rbind"}})
		}
		// Not binds, or not in the share: never walked.
		s.Mounts = append(s.Mounts, specs.Mount{Destination: "/proc", Type: "proc", Source: mounts},
			specs.Mount{Destination: "/etc/hosts", Type: "bind", Source: "/etc/hosts"})
		return s
	}
	// c1: its root, a volume's file (the volume's directory is walked), a plain directory
	// and a symlink (not walked).
	p1 := m.pin(spec(root1, filepath.Join(vol, "file"), plain, filepath.Join(share, "link")), nil)
	if want := []string{root1, vol, mounts}; !slices.Equal(p1, want) {
		t.Errorf("c1 pinned %q, want %q", p1, want)
	}
	// c2: its root, the volume, and the mount inside it.
	p2 := m.pin(spec(root2, vol), []string{inVol})
	if want := []string{root2, inVol, vol, mounts}; !slices.Equal(p2, want) {
		t.Errorf("c2 pinned %q, want %q", p2, want)
	}
	if m.held[vol] != 2 || m.held[mounts] != 2 || m.held[root1] != 1 {
		t.Errorf("held %v", m.held)
	}

	m.release(p1)
	if isMount(root1) {
		t.Errorf("%s is still mounted after its container's release", root1)
	}
	if !isMount(vol) || !isMount(mounts) || !isMount(root2) || !isMount(inVol) {
		t.Errorf("c1's release unmounted what c2 holds")
	}
	m.release(p2)
	for _, p := range []string{root2, inVol, vol, mounts} {
		if isMount(p) {
			t.Errorf("%s is still mounted after the last release", p)
		}
	}
	if len(m.held) != 0 {
		t.Errorf("held after every release: %v", m.held)
	}
}
