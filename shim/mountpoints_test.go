package shim

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/sandbox"
)

// TestMakeMountPoints checks that the mount points runc would create in a read-only root are
// made inside it, following the image's symlinks as the container sees them, and that a
// hostile image makes nothing outside it.
func TestMakeMountPoints(t *testing.T) {
	outside := t.TempDir() // a host directory the image points at
	rootfs := t.TempDir()
	hostFile := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(hostFile, []byte("nameserver 10.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, target := range map[string]string{
		"etc":    outside,          // absolute: the host's directory by host path
		"up":     "../../../../..", // relative, above the root
		"hosts":  "/run/hosts",     // into a mount made earlier
		"config": "../" + filepath.Base(rootfs) + "/../" + filepath.Base(outside),
	} {
		if err := os.Symlink(target, filepath.Join(rootfs, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(rootfs, "kept"), []byte("image"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := &specs.Spec{
		Process: &specs.Process{Cwd: "/work/dir"},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts"},
			{Destination: "/run", Type: "tmpfs", Source: "tmpfs"},
			{Destination: "/etc/resolv.conf", Type: "bind", Source: hostFile, Options: []string{"rbind", "ro"}},
			{Destination: "/up/data", Type: "bind", Source: outside, Options: []string{"rbind"}},
			{Destination: "/hosts", Type: "bind", Source: hostFile, Options: []string{"rbind"}},
			{Destination: "/config/x", Type: "tmpfs", Source: "tmpfs"},
			{Destination: "/kept", Type: "bind", Source: hostFile, Options: []string{"rbind"}},
		},
	}
	if err := makeMountPoints(rootfs, s); err != nil {
		t.Fatal(err)
	}
	if entries, err := os.ReadDir(outside); err != nil || len(entries) != 0 {
		t.Fatalf("made outside the root: %v, %v", entries, err)
	}
	// The absolute symlink resolves to the same path inside the root.
	in := filepath.Join(rootfs, outside)
	for p, dir := range map[string]bool{
		"proc": true, "dev": true, "run": true, "data": true, "work/dir": true,
		strings.TrimPrefix(in, rootfs+"/") + "/resolv.conf": false,
		filepath.Base(outside) + "/x":                       true, // config: .. stops at the root
	} {
		fi, err := os.Lstat(filepath.Join(rootfs, p))
		if err != nil || fi.IsDir() != dir || fi.Mode().Type()&os.ModeSymlink != 0 {
			t.Errorf("/%s: %v, %v; want a directory: %v", p, fi, err, dir)
		}
	}
	// Inside earlier mounts (/dev's, and /run's through the symlink): runc's job in the guest.
	for _, p := range []string{"dev/pts", "run/hosts"} {
		if _, err := os.Lstat(filepath.Join(rootfs, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("/%s made in the root: %v", p, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(rootfs, "kept")); err != nil || string(b) != "image" {
		t.Errorf("an existing mount point changed: %q, %v", b, err)
	}

	// Bad images: a symlink loop, a file where a directory is needed.
	if err := os.Symlink("loop", filepath.Join(rootfs, "loop")); err != nil {
		t.Fatal(err)
	}
	for dest, want := range map[string]error{"/loop/x": unix.ELOOP, "/kept/x": unix.ENOTDIR} {
		s := &specs.Spec{Mounts: []specs.Mount{{Destination: dest, Type: "tmpfs", Source: "tmpfs"}}}
		err := makeMountPoints(rootfs, s)
		if !errors.Is(err, want) || !strings.Contains(err.Error(), dest) {
			t.Errorf("%s: %v, want %v naming it", dest, err, want)
		}
	}
	if entries, err := os.ReadDir(outside); err != nil || len(entries) != 0 {
		t.Fatalf("made outside the root: %v, %v", entries, err)
	}
}

// TestBindRootfs checks the rootfs bind: recursive, read-only with root.readonly, and then
// only once the mount points are made.
func TestBindRootfs(t *testing.T) {
	for _, readonly := range []bool{false, true} {
		rootfs := t.TempDir()
		pod := &fakePod{binds: map[string]HostBind{}}
		s := &specs.Spec{
			Root:    &specs.Root{Path: rootfs, Readonly: readonly},
			Process: &specs.Process{Cwd: "/"},
			Mounts:  []specs.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}},
		}
		if err := bindRootfs(pod, rootfs, "c1", s); err != nil {
			t.Fatal(err)
		}
		want := HostBind{Source: rootfs, Name: "c1", Flags: sandbox.BindRecursive}
		if readonly {
			want.Flags |= sandbox.BindReadOnly
		}
		if got := pod.binds["c1"]; !reflect.DeepEqual(got, want) {
			t.Errorf("readonly %v: bind %+v, want %+v", readonly, got, want)
		}
		// crun in the guest makes the mount points of a read-write root itself.
		if _, err := os.Stat(filepath.Join(rootfs, "proc")); (err == nil) != readonly {
			t.Errorf("readonly %v: /proc made: %v", readonly, err)
		}
	}
	// A mount point that cannot be made fails the bind, before anything is bound.
	rootfs := t.TempDir()
	if err := os.Symlink("loop", filepath.Join(rootfs, "loop")); err != nil {
		t.Fatal(err)
	}
	pod := &fakePod{binds: map[string]HostBind{}}
	s := &specs.Spec{Root: &specs.Root{Readonly: true}, Mounts: []specs.Mount{{Destination: "/loop/x", Type: "tmpfs"}}}
	if err := bindRootfs(pod, rootfs, "c1", s); err == nil || !strings.Contains(err.Error(), "read-only root: the mount point of /loop/x") {
		t.Errorf("bindRootfs: %v", err)
	}
	if len(pod.binds) != 0 {
		t.Errorf("bound %+v", pod.binds)
	}
}
