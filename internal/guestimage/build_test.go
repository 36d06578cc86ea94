package guestimage_test

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// TestBuildReproducible builds the agent's guest image twice, in two directories, with the
// same SOURCE_DATE_EPOCH: the files must be the same bytes, every file's time in the root
// that epoch (erofs-utils' fsck.erofs extracts it), and the image must describe itself
// (Read) with checksums that SHA256SUMS confirms.
func TestBuildReproducible(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the guest image twice (-short)")
	}
	const epoch = "1700000000"
	env := []string{"SOURCE_DATE_EPOCH=" + epoch, "KVFS_VERSION=0.0.0-test"}
	a := vmtest.BuildAgentImage(t, t.TempDir(), env...)
	b := vmtest.BuildAgentImage(t, t.TempDir(), env...)
	if a.Root == "" {
		t.Fatalf("the agent image %+v has no %s", a, guestimage.RootfsFile)
	}
	for _, name := range []string{guestimage.KernelFile, guestimage.RootfsFile, guestimage.DescriptionFile, guestimage.SumsFile} {
		da, err := os.ReadFile(filepath.Join(filepath.Dir(a.Kernel), name))
		if err != nil {
			t.Fatal(err)
		}
		db, err := os.ReadFile(filepath.Join(filepath.Dir(b.Kernel), name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(da, db) {
			t.Errorf("%s differs between two builds (%d and %d bytes)", name, len(da), len(db))
		}
	}
	tree := filepath.Join(t.TempDir(), "root")
	if out, err := exec.Command("fsck.erofs", "--extract="+tree, a.Root).CombinedOutput(); err != nil {
		t.Fatalf("fsck.erofs --extract: %v\n%s", err, out)
	}
	if st, err := os.Stat(a.Root); err != nil || st.Size()%(2<<20) != 0 {
		t.Errorf("%s: %v, %d bytes: want a multiple of 2 MiB", a.Root, err, st.Size())
	}
	n := 0
	err := filepath.WalkDir(tree, func(path string, e fs.DirEntry, err error) error {
		if err != nil || path == tree {
			return err
		}
		st, err := os.Lstat(path)
		if err != nil {
			return err
		}
		n++
		if st.ModTime().Unix() != 1700000000 {
			t.Errorf("%s: mtime %d, want SOURCE_DATE_EPOCH %s", path, st.ModTime().Unix(), epoch)
		}
		return nil
	})
	if err != nil || n < 100 {
		t.Fatalf("walked %d files: %v", n, err)
	}
	info, err := guestimage.Read(a.Kernel, a.Root)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Kernel.Matches() || !info.Root.Matches() {
		t.Errorf("checksums do not match SHA256SUMS: %+v %+v", info.Kernel, info.Root)
	}
	d := info.Description
	switch {
	case d == nil:
		t.Fatal("no image.json beside the image")
	case d.KVFSVersion != "0.0.0-test" || d.SourceDateEpoch != 1700000000:
		t.Errorf("description %+v", d)
	case d.Kernel.Version != info.KernelVersion || d.Kernel.Package != "linux-source-6.12":
		t.Errorf("kernel %+v, the kernel says %s", d.Kernel, info.KernelVersion)
	case d.Kernel.SHA256 != info.Kernel.SHA256:
		t.Errorf("image.json's kernel checksum %s, the kernel's %s", d.Kernel.SHA256, info.Kernel.SHA256)
	case d.Agent.SHA256 == "" || d.Runtime.Name != "crun" || d.Runtime.PackageVersion == "" || d.Busybox.PackageVersion == "":
		t.Errorf("description %+v", d)
	case len(d.Modules) != 0:
		t.Errorf("modules %v: the kvfs kernel has everything built in", d.Modules)
	case d.Runtime.Features == nil || !slices.Contains(d.Runtime.Features.MountOptions, "rro"):
		t.Errorf("crun's features %+v: want its mount options, rro among them", d.Runtime.Features)
	}
	if rd, err := guestimage.ReadDescription(a.Root); err != nil || !reflect.DeepEqual(rd, d) {
		t.Errorf("ReadDescription: %+v, %v; want Read's %+v", rd, err, d)
	}
	beside, err := os.ReadFile(filepath.Join(filepath.Dir(a.Kernel), guestimage.DescriptionFile))
	if err != nil {
		t.Fatal(err)
	}
	inside, _ := os.ReadFile(filepath.Join(tree, guestimage.DescriptionPath))
	if !bytes.Equal(beside, inside) {
		t.Errorf("image.json beside the image differs from the one inside")
	}
	sum := exec.Command("sha256sum", "-c", guestimage.SumsFile)
	sum.Dir = filepath.Dir(a.Kernel)
	if out, err := sum.CombinedOutput(); err != nil {
		t.Errorf("sha256sum -c: %v\n%s", err, out)
	}
}
