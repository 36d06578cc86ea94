package guestimage_test

import (
	"bytes"
	"io"
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
// same SOURCE_DATE_EPOCH: the files must be the same bytes, every member's time that epoch,
// and the image must describe itself (Read) with checksums that SHA256SUMS confirms.
func TestBuildReproducible(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the guest image twice (-short)")
	}
	const epoch = "1700000000"
	env := []string{"SOURCE_DATE_EPOCH=" + epoch, "KVFS_VERSION=0.0.0-test"}
	a := vmtest.BuildAgentImage(t, t.TempDir(), env...)
	b := vmtest.BuildAgentImage(t, t.TempDir(), env...)
	for _, name := range []string{guestimage.KernelFile, guestimage.InitrdFile, guestimage.DescriptionFile, guestimage.SumsFile} {
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
	n := 0
	err := guestimage.WalkInitramfs(a.Initrd, func(e guestimage.Entry, _ io.Reader) error {
		n++
		if e.Mtime != 1700000000 {
			t.Errorf("%s: mtime %d, want SOURCE_DATE_EPOCH %s", e.Name, e.Mtime, epoch)
		}
		return nil
	})
	if err != nil || n < 100 {
		t.Fatalf("walked %d members: %v", n, err)
	}
	info, err := guestimage.Read(a.Kernel, a.Initrd)
	if err != nil {
		t.Fatal(err)
	}
	if !info.Kernel.Matches() || !info.Initrd.Matches() {
		t.Errorf("checksums do not match SHA256SUMS: %+v %+v", info.Kernel, info.Initrd)
	}
	d := info.Description
	switch {
	case d == nil:
		t.Fatal("no image.json in the initramfs")
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
	if rd, err := guestimage.ReadDescription(a.Initrd); err != nil || !reflect.DeepEqual(rd, d) {
		t.Errorf("ReadDescription: %+v, %v; want the initramfs's %+v", rd, err, d)
	}
	beside, err := os.ReadFile(filepath.Join(filepath.Dir(a.Kernel), guestimage.DescriptionFile))
	if err != nil {
		t.Fatal(err)
	}
	inside, _ := guestimage.ReadInitramfsFile(a.Initrd, guestimage.DescriptionPath)
	if !bytes.Equal(beside, inside) {
		t.Errorf("image.json beside the image differs from the one inside")
	}
	sum := exec.Command("sha256sum", "-c", guestimage.SumsFile)
	sum.Dir = filepath.Dir(a.Kernel)
	if out, err := sum.CombinedOutput(); err != nil {
		t.Errorf("sha256sum -c: %v\n%s", err, out)
	}
}
