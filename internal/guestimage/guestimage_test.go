package guestimage

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
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

// TestKernelVersion reads the release from an ELF kernel's banner, wherever it falls (a
// chunk's end included), and from an older image's bzImage header.
func TestKernelVersion(t *testing.T) {
	dir := t.TempDir()
	banner := "Linux version 6.12.117-kvfs (builder@host) #1 SMP PREEMPT_DYNAMIC\n\x00"
	for _, at := range []int{0x100, 1<<20 - 20, 3<<20 + 5} {
		k := make([]byte, at+len(banner)+100)
		copy(k, "\x7fELF")
		copy(k[at-40:], "Linux version %s\x00") // a format string first, as in printk's
		copy(k[at:], banner)
		p := filepath.Join(dir, fmt.Sprint(at))
		os.WriteFile(p, k, 0o644)
		if v, err := KernelVersion(p); v != "6.12.117-kvfs" || err != nil {
			t.Errorf("banner at %#x: %q, %v", at, v, err)
		}
	}
	k := make([]byte, 0x1000)
	copy(k[0x202:], "HdrS")
	k[0x20e], k[0x20f] = 0x00, 0x02 // the string at 0x200 + 0x200
	copy(k[0x400:], "6.1.0-57-amd64 (debian-kernel@lists.debian.org) #1 SMP\x00")
	p := filepath.Join(dir, "bzImage")
	os.WriteFile(p, k, 0o644)
	if v, err := KernelVersion(p); v != "6.1.0-57-amd64" || err != nil {
		t.Errorf("bzImage: %q, %v", v, err)
	}
}

func TestKernelVersionBad(t *testing.T) {
	p := filepath.Join(t.TempDir(), "k")
	os.WriteFile(p, bytes.Repeat([]byte{0}, 0x400), 0o644)
	if _, err := KernelVersion(p); err == nil || !strings.Contains(err.Error(), "HdrS") {
		t.Errorf("no header: %v", err)
	}
	os.WriteFile(p, []byte("short"), 0o644)
	if _, err := KernelVersion(p); err == nil || !strings.Contains(err.Error(), "neither") {
		t.Errorf("short file: %v", err)
	}
	os.WriteFile(p, append([]byte("\x7fELF"), bytes.Repeat([]byte("Linux version x "), 1<<17)...), 0o644)
	if _, err := KernelVersion(p); err == nil || !strings.Contains(err.Error(), "banner") {
		t.Errorf("ELF without a banner: %v", err)
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

// TestRootIn: a directory's root is its erofs image, or an initramfs where it has only that;
// with neither, the erofs image build.sh --agent makes.
func TestRootIn(t *testing.T) {
	dir := t.TempDir()
	if rootfs, initrd := RootIn(dir); rootfs != filepath.Join(dir, RootfsFile) || initrd != "" {
		t.Errorf("empty directory: %q, %q", rootfs, initrd)
	}
	os.WriteFile(filepath.Join(dir, InitrdFile), nil, 0o644)
	if rootfs, initrd := RootIn(dir); rootfs != "" || initrd != filepath.Join(dir, InitrdFile) {
		t.Errorf("an initramfs only: %q, %q", rootfs, initrd)
	}
	os.WriteFile(filepath.Join(dir, RootfsFile), nil, 0o644)
	if rootfs, initrd := RootIn(dir); rootfs != filepath.Join(dir, RootfsFile) || initrd != "" {
		t.Errorf("both: %q, %q", rootfs, initrd)
	}
}

// TestReadDescriptionImage: a root that is no initramfs (an erofs image, whatever its name)
// without an image.json beside it has no description (os.ErrNotExist), not a broken one; with
// one beside it, that one.
func TestReadDescriptionImage(t *testing.T) {
	dir := t.TempDir()
	root := filepath.Join(dir, "my-root.img")
	if err := os.WriteFile(root, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if d, err := ReadDescription(root); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("without image.json: %+v, %v; want os.ErrNotExist", d, err)
	}
	os.WriteFile(filepath.Join(dir, DescriptionFile), []byte(`{"kvfs_version": "1.2"}`), 0o644)
	if d, err := ReadDescription(root); err != nil || d.KVFSVersion != "1.2" {
		t.Errorf("with image.json beside it: %+v, %v", d, err)
	}
}
