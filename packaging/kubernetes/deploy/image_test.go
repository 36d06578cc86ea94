package deploy_test

import (
	"bufio"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/ociimage"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/fstree"
	"github.com/kvfs/kvfs/packaging/kubernetes/deploy"
)

// TestImageCtr builds the install image, imports its archive into a private containerd with
// ctr image import, and runs its entrypoint as a container (runc) with a scratch host root
// bind-mounted at /host, as the DaemonSet's pod does: the installer runs in the image's
// bash and busybox, the files land in the host root with the host's paths; at SIGTERM with
// KVFS_CLEANUP_ON_EXIT the container uninstalls, exits 0, and the root is as it was.
func TestImageCtr(t *testing.T) {
	if testing.Short() {
		t.Skip("starts containerd (-short)")
	}
	c := ctrdtest.Start(t, ctrd.Options{})
	const name = "localhost/kvfs-deploy:test"
	// Written by the built kvfs-deploy's image command, as make deploy-image does (outside the
	// race detector, which makes gzip of its 45 MiB slow).
	archive := filepath.Join(c.Dir(), "kvfs-deploy.tar")
	start := time.Now()
	if out, err := deployCmd("image", "-o", archive, "-name", name, "-bin", bins,
		"-guest", filepath.Join(payload(t), "guest"), "-installer", "../../install.sh").CombinedOutput(); err != nil {
		t.Fatalf("kvfs-deploy image: %v\n%s", err, out)
	}
	t.Logf("kvfs-deploy image: %v", time.Since(start))
	start = time.Now()
	c.Ctr(t, "images", "import", archive)
	if out := c.Ctr(t, "images", "ls", "-q"); !strings.Contains(out, name) {
		t.Fatalf("ctr images ls: %q has no %s", out, name)
	}
	t.Logf("ctr images import: %v", time.Since(start))

	root, err := os.MkdirTemp("/tmp", "kvfs-host-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("node-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := fstree.List(t, root)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start = time.Now()
	const id = "kvfs-deploy"
	cmd := c.CtrCmd(ctx, "run", "--rm", "--mount", "type=bind,src="+root+",dst=/host,options=rbind:rw",
		"--env", "KVFS_CLEANUP_ON_EXIT=true", name, id)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(stdout)
	var out []string
	for sc.Scan() {
		out = append(out, sc.Text())
		if sc.Text() == "kvfs-deploy: waiting for SIGTERM" {
			break
		}
	}
	if len(out) == 0 || out[len(out)-1] != "kvfs-deploy: waiting for SIGTERM" {
		cmd.Wait()
		t.Fatalf("the container did not install and wait:\n%s", strings.Join(out, "\n"))
	}
	t.Logf("the container:\n%s", strings.Join(out, "\n"))
	for _, f := range []string{"opt/kvfs/bin/containerd-shim-kvfs-v2", "opt/kvfs/bin/kvfsd", "opt/kvfs/bin/kvfsctl",
		"opt/kvfs/share/kvfs/guest/rootfs.erofs", "etc/kvfs/configuration.toml", "var/lib/kvfs/install.manifest"} {
		if _, err := os.Stat(filepath.Join(root, f)); err != nil {
			t.Errorf("not installed: %v", err)
		}
	}
	if dropin, err := os.ReadFile(filepath.Join(root, "etc/containerd/conf.d/kvfs.toml")); err != nil ||
		!strings.Contains(string(dropin), "runtime_path = '/opt/kvfs/bin/containerd-shim-kvfs-v2'") {
		t.Errorf("the drop-in: %v\n%s", err, dropin)
	}

	t.Logf("the container installed in %v", time.Since(start))
	c.Ctr(t, "task", "kill", "--signal", "SIGTERM", id)
	for sc.Scan() {
		out = append(out, sc.Text())
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("ctr run, after SIGTERM: %v", err)
	}
	t.Logf("the container:\n%s", strings.Join(out, "\n"))
	if !strings.Contains(strings.Join(out, "\n"), "kvfs-deploy: uninstalled") {
		t.Errorf("the container did not say it uninstalled")
	}
	fstree.Same(t, "after the container's SIGTERM cleanup, compared with before", fstree.List(t, root), before)
}

// TestImageRefusesDynamic: a binary linked against a C library would not run in the image
// (it has only bash's libraries, for bash): Image refuses it, naming it.
func TestImageRefusesDynamic(t *testing.T) {
	dir := t.TempDir()
	for _, b := range append(append([]string{}, deploy.Binaries...), deploy.Command) {
		src := filepath.Join(bins, b)
		if b == "kvfsd" {
			src = "/bin/true" // Debian's: dynamically linked
		}
		data, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, b), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, err := deploy.Image("localhost/kvfs-deploy:test", deploy.Sources{
		Bin: dir, Guest: filepath.Join(payload(t), "guest"), Installer: "../../install.sh",
		Busybox: ociimage.BusyboxPath, Bash: "/bin/bash",
	})
	if err == nil || !strings.Contains(err.Error(), filepath.Join(dir, "kvfsd")+" is dynamically linked") {
		t.Errorf("Image with a dynamically linked kvfsd: %v", err)
	}
}
