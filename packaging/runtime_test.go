package packaging_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/fstree"
	"github.com/kvfs/kvfs/internal/testing/installtest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// TestInstalledRuntime installs into a scratch root (PREFIX, SYSCONFDIR and LOCALSTATEDIR
// under it, no DESTDIR: the paths in the installed files are real) and starts a containerd
// v2 whose config imports the installed drop-in, as a host's imports conf.d/*.toml: its CRI
// must show the runtime handler kvfs with the installed shim and configuration, and `ctr run`
// through the installed shim must boot the installed guest image with the installed
// configuration (one VM). Then uninstall must leave the root as it was.
func TestInstalledRuntime(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM under QEMU (-short)")
	}
	g := vmtest.AgentImage(t)
	root, err := os.MkdirTemp("/tmp", "kvfs-root-") // short: the sandbox sockets are under it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	before := fstree.List(t, root)
	layout := installtest.Layout(root)
	installtest.Run(t, append([]string{"install", "--bin", bins, "--guest", filepath.Dir(g.Kernel)}, layout...)...)

	config := filepath.Join(root, "etc/kvfs/configuration.toml")
	c := ctrdtest.Start(t, ctrd.Options{
		ShimDirs: []string{filepath.Join(root, "usr/bin")},
		Imports:  []string{filepath.Join(root, "etc/containerd/conf.d/*.toml")},
		CRI:      true,
	})
	installtest.EditConfig(t, config, c.SandboxBaseDir())

	// The CRI loaded the drop-in.
	var info struct {
		Config struct {
			Containerd struct {
				Runtimes map[string]struct {
					RuntimeType string         `json:"runtimeType"`
					RuntimePath string         `json:"runtimePath"`
					Sandboxer   string         `json:"sandboxer"`
					Options     map[string]any `json:"options"`
				} `json:"runtimes"`
			} `json:"containerd"`
		} `json:"config"`
	}
	out := c.Crictl(t, "info")
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		t.Fatalf("crictl info: %v\n%s", err, out)
	}
	rt, ok := info.Config.Containerd.Runtimes["kvfs"]
	if !ok || rt.RuntimeType != "io.containerd.kvfs.v2" || rt.RuntimePath != filepath.Join(root, "usr/bin/containerd-shim-kvfs-v2") ||
		rt.Sandboxer != "podsandbox" || rt.Options["ConfigPath"] != config {
		t.Errorf("the CRI's runtime kvfs: %+v (found %v)\n%s", rt, ok, out)
	}

	// ctr run through the installed shim, on the installed configuration: the guest is the
	// installed image.
	want, err := guestimage.Read(filepath.Join(root, "usr/share/kvfs/guest/vmlinux"), filepath.Join(root, "usr/share/kvfs/guest/rootfs.erofs"))
	if err != nil {
		t.Fatal(err)
	}
	image := ctrdtest.ImportBusybox(t, c)
	r := c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.kvfs.v2", "--runtime-config-path", config,
		image, "installed", "uname", "-r")
	if r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != want.KernelVersion {
		t.Errorf("ctr run: exit %d, stdout %q (want the installed guest's kernel %s), stderr %s", r.ExitCode, r.Stdout, want.KernelVersion, r.Stderr)
	}

	// The edited configuration is kept by uninstall and removed by --purge.
	out = installtest.Run(t, append([]string{"uninstall"}, layout...)...)
	if !strings.Contains(out, "kept "+config) {
		t.Errorf("uninstall did not keep the edited %s", config)
	}
	installtest.Run(t, append([]string{"uninstall", "--purge"}, layout...)...)
	fstree.Same(t, "after uninstall --purge, compared with before install", fstree.List(t, root), before)
}
