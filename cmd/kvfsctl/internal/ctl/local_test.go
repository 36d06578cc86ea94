package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/shim"
)

func runLocal(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = Run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestDefaultConfigPathIsTheShims(t *testing.T) {
	if DefaultConfigPath != shim.DefaultConfigPath {
		t.Errorf("kvfsctl's %s, the shim's %s", DefaultConfigPath, shim.DefaultConfigPath)
	}
}

func TestConfigDefault(t *testing.T) {
	code, out, errOut := runLocal("config", "default")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if out != string(sandbox.RenderConfig(sandbox.DefaultConfig())) {
		t.Errorf("config default is not RenderConfig(DefaultConfig()):\n%s", out)
	}
	code, out, errOut = runLocal("config", "default", "--guest", "/opt/kvfs/share/kvfs/guest/")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	c, err := sandbox.ParseConfig([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if c.VM.Kernel != "/opt/kvfs/share/kvfs/guest/vmlinux" || c.VM.Rootfs != "/opt/kvfs/share/kvfs/guest/rootfs.erofs" || c.VM.Initrd != "" {
		t.Errorf("--guest: kernel %s rootfs %s initrd %s", c.VM.Kernel, c.VM.Rootfs, c.VM.Initrd)
	}
	// An image built with Debian's kernel: its root is an initramfs.
	debian := t.TempDir()
	os.WriteFile(filepath.Join(debian, guestimage.InitrdFile), nil, 0o644)
	code, out, errOut = runLocal("config", "default", "--guest", debian)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if c, err = sandbox.ParseConfig([]byte(out)); err != nil {
		t.Fatal(err)
	}
	if c.VM.Rootfs != "" || c.VM.Initrd != filepath.Join(debian, guestimage.InitrdFile) {
		t.Errorf("--guest %s: rootfs %s initrd %s", debian, c.VM.Rootfs, c.VM.Initrd)
	}
	for _, args := range [][]string{
		{"config"}, {"config", "show"}, {"config", "default", "extra"},
		{"config", "default", "--guest", "relative/dir"}, {"config", "default", "--nope"},
	} {
		if code, _, errOut := runLocal(args...); code != exitUsage || !strings.Contains(errOut, "config") {
			t.Errorf("%q: exit %d, %s", args, code, errOut)
		}
	}
}

// fakeImage writes an ELF kernel whose banner names version and an initramfs holding
// image.json, with a SHA256SUMS beside them that lists the kernel right and the initramfs
// wrong.
func fakeImage(t *testing.T, version string) (kernel, initrd string) {
	t.Helper()
	dir := t.TempDir()
	k := make([]byte, 0x1000)
	copy(k, "\x7fELF")
	copy(k[0x400:], "Linux version "+version+" (someone@example) #1 SMP\n\x00")
	kernel = filepath.Join(dir, guestimage.KernelFile)
	if err := os.WriteFile(kernel, k, 0o644); err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "root")
	os.MkdirAll(filepath.Join(root, "etc/kvfs"), 0o755)
	os.WriteFile(filepath.Join(root, guestimage.DescriptionPath), []byte(`{"kvfs_version": "9.9", "modules": ["fuse"]}`), 0o644)
	initrd = filepath.Join(dir, "initramfs.gz")
	cmd := exec.Command("sh", "-c", `find . | cpio --create --format=newc --quiet | gzip -n >"$1"`, "sh", initrd)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Skipf("cannot make a cpio archive (scripts/deps.sh installs cpio): %v\n%s", err, out)
	}
	sums := exec.Command("sh", "-c", `sha256sum `+guestimage.KernelFile+` >SHA256SUMS && echo "`+strings.Repeat("0", 64)+`  initramfs.gz" >>SHA256SUMS`)
	sums.Dir = dir
	if out, err := sums.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return kernel, initrd
}

func TestImageInfo(t *testing.T) {
	kernel, initrd := fakeImage(t, "6.1.0-99-amd64")
	code, out, errOut := runLocal("image", "info", "--kernel", kernel, "--initrd", initrd)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	for _, want := range []string{"6.1.0-99-amd64", "(matches SHA256SUMS)", "MISMATCH", "kvfs version  9.9", "modules       fuse"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in\n%s", want, out)
		}
	}
	// Through a configuration, as JSON.
	cfg := filepath.Join(t.TempDir(), "c.toml")
	os.WriteFile(cfg, []byte("[vm]\nkernel = \""+kernel+"\"\nrootfs = \"\"\ninitrd = \""+initrd+"\"\n"), 0o644)
	code, out, errOut = runLocal("--json", "image", "info", "--config", cfg)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	var info guestimage.Info
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if info.KernelVersion != "6.1.0-99-amd64" || !info.Kernel.Matches() || info.Root.Matches() ||
		info.Description == nil || info.Description.KVFSVersion != "9.9" {
		t.Errorf("JSON %s", out)
	}
	code, _, errOut = runLocal("image", "info", "--kernel", kernel, "--initrd", initrd+".none")
	if code != exitError || !strings.Contains(errOut, "initramfs.gz.none") {
		t.Errorf("missing initrd: exit %d, %s", code, errOut)
	}
	// An erofs root: its description is the image.json beside it.
	rootfs := filepath.Join(filepath.Dir(kernel), guestimage.RootfsFile)
	os.WriteFile(rootfs, make([]byte, 2<<20), 0o644)
	os.WriteFile(filepath.Join(filepath.Dir(kernel), guestimage.DescriptionFile), []byte(`{"kvfs_version": "9.8"}`), 0o644)
	code, out, errOut = runLocal("image", "info", "--kernel", kernel, "--rootfs", rootfs)
	if code != 0 || !strings.Contains(out, "root          "+rootfs) || !strings.Contains(out, "kvfs version  9.8") {
		t.Errorf("--rootfs: exit %d, %s\n%s", code, errOut, out)
	}
	for _, args := range [][]string{
		{"image"}, {"image", "info", "x"}, {"image", "info", "--kernel", kernel},
		{"image", "info", "--config", cfg, "--kernel", kernel, "--initrd", initrd},
		{"image", "info", "--kernel", kernel, "--initrd", initrd, "--rootfs", initrd},
	} {
		if code, _, errOut := runLocal(args...); code != exitUsage {
			t.Errorf("%q: exit %d, %s", args, code, errOut)
		}
	}
}
