package shim

import (
	"bufio"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	"golang.org/x/sys/unix"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// mountFSType returns the file system type of the mount at path, or "" if none is there.
func mountFSType(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var fstype string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent major:minor root mount-point options [optional...] - fstype source super
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || fields[4] != path {
			continue
		}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) {
				fstype = fields[i+1] // the last mount at path is the one on top
			}
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return fstype
}

// TestSandboxPodFilesCapped: a Sandbox-API pod's files are on a tmpfs of their own, so what
// the guest writes to them (through kvfsd, the host's writes to the files its containers'
// binds come from) stops with ENOSPC within podFilesSize rather than grow in /run; the tmpfs
// goes with ShutdownSandbox, and its directory is left empty for containerd to remove.
func TestSandboxPodFilesCapped(t *testing.T) {
	ns := netNS(t)
	h := newHarness(t)
	h.createSandbox("pf", ns, &criapi.PodSandboxConfig{Hostname: "pf"})
	files := filepath.Join(h.dir, "bundles", "pf", podFilesDir)
	if got := mountFSType(t, files); got != "tmpfs" {
		t.Errorf("the pod files' directory has a mount of %q, want a tmpfs of its own", got)
	}
	for _, name := range []string{"hostname", "hosts", "resolv.conf"} {
		if _, err := os.Stat(filepath.Join(files, name)); err != nil {
			t.Error(err)
		}
	}
	f, err := os.OpenFile(filepath.Join(files, "hosts"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	chunk := []byte(strings.Repeat("10.0.0.1 grown-by-the-guest\n", 1<<10))
	var written int
	for written < 16*podFilesSize {
		n, err := f.Write(chunk)
		written += n
		if err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Errorf("a write past the cap: %v, want ENOSPC", err)
			}
			break
		}
	}
	f.Close()
	if written > podFilesSize {
		t.Errorf("%d bytes written to the pod's hosts file, more than the cap of %d", written, podFilesSize)
	}

	if _, err := h.svc.ShutdownSandbox(h.ctx, &sandboxAPI.ShutdownSandboxRequest{SandboxID: "pf"}); err != nil {
		t.Fatal(err)
	}
	if got := mountFSType(t, files); got != "" {
		t.Errorf("after ShutdownSandbox the pod files' directory still has a mount of %q", got)
	}
	if err := os.Remove(files); err != nil {
		t.Errorf("the pod files' directory after ShutdownSandbox: %v, want it empty", err)
	}
}

// TestCleanupPodFiles: the delete action of a dead shim's sandbox unmounts the pod files'
// tmpfs that its CreateSandbox mounted in the bundle, so containerd can remove the bundle.
func TestCleanupPodFiles(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	bundle := filepath.Join(shortTempDir(t), "bundles", "sbx")
	files := filepath.Join(bundle, podFilesDir)
	if err := mountPodFiles(files); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(files, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(files, "hosts"), []byte("127.0.0.1 localhost\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Cleanup(context.Background(), bundle); err != nil {
		t.Fatal(err)
	}
	if got := mountFSType(t, files); got != "" {
		t.Errorf("after the delete action the pod files' directory still has a mount of %q", got)
	}
	if err := os.RemoveAll(bundle); err != nil {
		t.Errorf("the bundle after the delete action: %v", err)
	}
}
