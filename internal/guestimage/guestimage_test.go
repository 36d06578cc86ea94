package guestimage

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// mkInitramfs packs files (name → contents) into a gzip-compressed newc archive with the
// cpio tool, as build.sh does, with every time set to mtime.
func mkInitramfs(t *testing.T, files map[string]string, mtime string) string {
	t.Helper()
	root := t.TempDir()
	for name, data := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(t.TempDir(), "initramfs.gz")
	script := `find . -exec touch -h -d "@$2" {} + && find . -print0 | LC_ALL=C sort -z | cpio --null --create --format=newc --owner=0:0 --reproducible --quiet | gzip -n >"$1"`
	cmd := exec.Command("sh", "-c", script, "sh", out, mtime)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Skipf("cannot make a cpio archive (cpio installed? scripts/deps.sh installs it): %v\n%s", err, b)
	}
	return out
}

func TestWalkInitramfs(t *testing.T) {
	files := map[string]string{
		"init":                "#!/bin/sh\n",
		"a":                   "",
		"etc/kvfs/image.json": `{"kvfs_version": "1.2"}`,
		"odd/sizes/xyz":       strings.Repeat("x", 4097),
	}
	p := mkInitramfs(t, files, "1700000000")
	seen := map[string]bool{}
	err := WalkInitramfs(p, func(e Entry, body io.Reader) error {
		if e.Mtime != 1700000000 {
			t.Errorf("%s: mtime %d", e.Name, e.Mtime)
		}
		seen[e.Name] = true
		if want, ok := files[e.Name]; ok {
			// Read only part of some: the walk skips the rest.
			if e.Name == "odd/sizes/xyz" {
				b := make([]byte, 10)
				if _, err := io.ReadFull(body, b); err != nil {
					return err
				}
				return nil
			}
			b, err := io.ReadAll(body)
			if err != nil || string(b) != want || e.Size != int64(len(want)) {
				t.Errorf("%s: %q (size %d) %v, want %q", e.Name, b, e.Size, err, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{".", "init", "a", "etc", "etc/kvfs", "etc/kvfs/image.json", "odd/sizes/xyz"} {
		if !seen[n] {
			t.Errorf("member %q not walked (saw %v)", n, seen)
		}
	}
	b, err := ReadInitramfsFile(p, DescriptionPath)
	if err != nil || string(b) != files[DescriptionPath] {
		t.Errorf("ReadInitramfsFile = %q, %v", b, err)
	}
	if _, err := ReadInitramfsFile(p, "no/such"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing member: %v, want ErrNotExist", err)
	}
}

func TestWalkInitramfsBad(t *testing.T) {
	dir := t.TempDir()
	gz := func(data []byte) string {
		var b bytes.Buffer
		w := gzip.NewWriter(&b)
		w.Write(data)
		w.Close()
		p := filepath.Join(dir, "x.gz")
		if err := os.WriteFile(p, b.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	hdr := func(nameSize, size string) []byte {
		h := "070701" + strings.Repeat("00000000", 6) + size + strings.Repeat("00000000", 4) + nameSize + "00000000"
		return []byte(h)
	}
	for name, data := range map[string][]byte{
		"not cpio":       []byte("hello world, this is not an archive"),
		"old magic":      append([]byte("070707"), bytes.Repeat([]byte("0"), 200)...),
		"no trailer":     {},
		"huge name":      hdr("00100000", "00000000"),
		"zero name":      hdr("00000000", "00000000"),
		"bad hex":        append([]byte("070701ZZZZZZZZ"), bytes.Repeat([]byte("0"), 96)...),
		"truncated body": append(append(hdr("00000002", "00001000"), "a\x00"...), "short"...),
	} {
		if err := WalkInitramfs(gz(data), func(Entry, io.Reader) error { return nil }); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if err := WalkInitramfs(filepath.Join(dir, "none"), nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	plain := filepath.Join(dir, "plain")
	os.WriteFile(plain, []byte("not gzip"), 0o644)
	if err := WalkInitramfs(plain, nil); err == nil || !strings.Contains(err.Error(), "gzip") {
		t.Errorf("not gzip: %v", err)
	}
}

func TestKernelVersionBad(t *testing.T) {
	p := filepath.Join(t.TempDir(), "k")
	os.WriteFile(p, bytes.Repeat([]byte{0}, 0x400), 0o644)
	if _, err := KernelVersion(p); err == nil || !strings.Contains(err.Error(), "HdrS") {
		t.Errorf("no header: %v", err)
	}
	os.WriteFile(p, []byte("short"), 0o644)
	if _, err := KernelVersion(p); err == nil {
		t.Error("short file: no error")
	}
}

func TestReadSums(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, SumsFile)
	sum := strings.Repeat("ab", 32)
	os.WriteFile(p, []byte(sum+"  vmlinuz\n"+sum+"  initramfs.gz\n"), 0o644)
	m, err := ReadSums(p)
	if err != nil || m["vmlinuz"] != sum || len(m) != 2 {
		t.Errorf("ReadSums = %v, %v", m, err)
	}
	os.WriteFile(p, []byte("xyz vmlinuz\n"), 0o644)
	if _, err := ReadSums(p); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("bad line: %v", err)
	}
}

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
	for _, name := range []string{"vmlinuz", "initramfs.gz", DescriptionFile, SumsFile} {
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
	err := WalkInitramfs(a.Initrd, func(e Entry, _ io.Reader) error {
		n++
		if e.Mtime != 1700000000 {
			t.Errorf("%s: mtime %d, want SOURCE_DATE_EPOCH %s", e.Name, e.Mtime, epoch)
		}
		return nil
	})
	if err != nil || n < 100 {
		t.Fatalf("walked %d members: %v", n, err)
	}
	info, err := Read(a.Kernel, a.Initrd)
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
		t.Errorf("kernel %+v, header says %s", d.Kernel, info.KernelVersion)
	case d.Kernel.SHA256 != info.Kernel.SHA256:
		t.Errorf("image.json's kernel checksum %s, the kernel's %s", d.Kernel.SHA256, info.Kernel.SHA256)
	case d.Agent.SHA256 == "" || d.Runtime.Name != "crun" || d.Runtime.PackageVersion == "" || d.Busybox.PackageVersion == "":
		t.Errorf("description %+v", d)
	case len(d.Modules) != 0:
		t.Errorf("modules %v: the kvfs kernel has everything built in", d.Modules)
	case d.Runtime.Features == nil || !slices.Contains(d.Runtime.Features.MountOptions, "rro"):
		t.Errorf("crun's features %+v: want its mount options, rro among them", d.Runtime.Features)
	}
	if rd, err := ReadDescription(a.Initrd); err != nil || !reflect.DeepEqual(rd, d) {
		t.Errorf("ReadDescription: %+v, %v; want the initramfs's %+v", rd, err, d)
	}
	beside, err := os.ReadFile(filepath.Join(filepath.Dir(a.Kernel), DescriptionFile))
	if err != nil {
		t.Fatal(err)
	}
	inside, _ := ReadInitramfsFile(a.Initrd, DescriptionPath)
	if !bytes.Equal(beside, inside) {
		t.Errorf("image.json beside the image differs from the one inside")
	}
	sum := exec.Command("sha256sum", "-c", SumsFile)
	sum.Dir = filepath.Dir(a.Kernel)
	if out, err := sum.CombinedOutput(); err != nil {
		t.Errorf("sha256sum -c: %v\n%s", err, out)
	}
}
