// Package packaging_test tests packaging/install.sh, the installer that make install, the
// Debian package's maintainer scripts and a node-install image all run: into a DESTDIR, into a
// scratch root that a real containerd then runs a container from, and over an earlier install.
package packaging_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pelletier/go-toml/v2"

	"github.com/kvfs/kvfs/internal/testing/fstree"
	"github.com/kvfs/kvfs/internal/testing/installtest"
	"github.com/kvfs/kvfs/sandbox"
)

// bins holds the binaries install.sh installs, built once by TestMain.
var bins string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvfs-pkg-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins = dir
	out, err := exec.Command("go", "build", "-o", dir+"/", "../cmd/containerd-shim-kvfs-v2", "../cmd/kvfsd", "../cmd/kvfsctl").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// fakeGuest is a guest image directory as build.sh writes it, with made-up contents: the
// installer checks only its SHA256SUMS.
func fakeGuest(t *testing.T, version string) string {
	t.Helper()
	dir := t.TempDir()
	for _, f := range []string{"vmlinux", "rootfs.erofs", "image.json"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(f+" "+version), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("sh", "-c", "sha256sum vmlinux rootfs.erofs image.json >SHA256SUMS")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	return dir
}

// userFiles puts files into root that an install must leave alone: a host's own /etc and
// /usr/local/bin contents.
func userFiles(t *testing.T, root string) {
	t.Helper()
	for p, data := range map[string]string{
		"etc/hostname":         "node1\n",
		"usr/local/bin/other":  "#!/bin/sh\n",
		"var/lib/other/state":  "x",
		"etc/containerd/.keep": "",
	} {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestInstallDestdir(t *testing.T) {
	t.Parallel()
	dest := t.TempDir()
	userFiles(t, dest)
	guest := fakeGuest(t, "1")
	before := fstree.List(t, dest)
	layout := []string{"--destdir", dest, "--prefix", "/opt/kvfs"}
	out := installtest.Run(t, append([]string{"install", "--bin", bins, "--guest", guest}, layout...)...)
	installed := fstree.List(t, dest)

	for _, p := range []string{
		"opt/kvfs/bin/containerd-shim-kvfs-v2", "opt/kvfs/bin/kvfsd", "opt/kvfs/bin/kvfsctl",
		"opt/kvfs/share/kvfs/guest/vmlinux", "opt/kvfs/share/kvfs/guest/rootfs.erofs",
		"opt/kvfs/share/kvfs/guest/image.json", "opt/kvfs/share/kvfs/guest/SHA256SUMS",
		"opt/kvfs/share/kvfs/install.sh", "opt/kvfs/share/kvfs/kata/kvfsd.toml", "etc/kvfs/configuration.toml",
		"etc/containerd/conf.d/kvfs.toml", "etc/containerd/config.toml",
		"var/lib/kvfs/install.manifest", "var/lib/kvfs/install.sh",
	} {
		if _, ok := installed[p]; !ok {
			t.Errorf("%s not installed", p)
		}
		if !strings.Contains(out, filepath.Join(dest, p)) {
			t.Errorf("install did not say it installed %s", p)
		}
	}
	if !strings.HasPrefix(installed["opt/kvfs/bin/kvfsd"], "-rwxr-xr-x ") {
		t.Errorf("kvfsd: %s", installed["opt/kvfs/bin/kvfsd"])
	}

	// The configuration: DefaultConfig with the installed image, every key documented; its
	// paths are the installed ones, without DESTDIR.
	cfgPath := filepath.Join(dest, "etc/kvfs/configuration.toml")
	cfgData, _ := os.ReadFile(cfgPath)
	want := sandbox.DefaultConfig()
	want.VM.Kernel = "/opt/kvfs/share/kvfs/guest/vmlinux"
	want.VM.Rootfs = "/opt/kvfs/share/kvfs/guest/rootfs.erofs"
	if string(cfgData) != string(sandbox.RenderConfig(want)) {
		t.Errorf("configuration.toml is not RenderConfig(DefaultConfig with the installed image):\n%s", cfgData)
	}
	if _, err := sandbox.LoadConfig(cfgPath); err != nil {
		t.Error(err)
	}

	// The drop-in registers the CRI runtime kvfs, without options: the installed
	// configuration is the shim's default.
	var dropin map[string]any
	data, _ := os.ReadFile(filepath.Join(dest, "etc/containerd/conf.d/kvfs.toml"))
	if err := toml.Unmarshal(data, &dropin); err != nil {
		t.Fatalf("drop-in: %v\n%s", err, data)
	}
	rt, _ := dig(dropin, "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes", "kvfs").(map[string]any)
	if rt["runtime_type"] != "io.containerd.kvfs.v2" || rt["sandboxer"] != "podsandbox" ||
		rt["runtime_path"] != "/opt/kvfs/bin/containerd-shim-kvfs-v2" ||
		rt["options"] != nil || dropin["version"] != int64(3) {
		t.Errorf("drop-in:\n%s", data)
	}
	// There was no config.toml: the one written imports the drop-ins.
	data, _ = os.ReadFile(filepath.Join(dest, "etc/containerd/config.toml"))
	var main map[string]any
	if err := toml.Unmarshal(data, &main); err != nil || fmt.Sprint(main["imports"]) != "[/etc/containerd/conf.d/*.toml]" {
		t.Errorf("config.toml (%v):\n%s", err, data)
	}

	// A second install changes nothing and says so.
	out = installtest.Run(t, append([]string{"install", "--bin", bins, "--guest", guest}, layout...)...)
	fstree.Same(t, "a second install changed", fstree.List(t, dest), installed)
	for _, word := range []string{"installed", "updated", "created", "kept"} {
		if strings.Contains(out, ": "+word+" ") {
			t.Errorf("a second install said %q:\n%s", word, out)
		}
	}

	installtest.Run(t, append([]string{"uninstall"}, layout...)...)
	fstree.Same(t, "after uninstall, compared with before install", fstree.List(t, dest), before)
}

// TestInstallNewDestdir: install and stage create a DESTDIR that does not exist yet (GNU's
// convention, which dh_auto_install and CMake follow), parents too, and uninstall takes out
// what install put there.
func TestInstallNewDestdir(t *testing.T) {
	t.Parallel()
	for _, action := range []string{"install", "stage"} {
		dest := filepath.Join(t.TempDir(), "new", "root")
		out := installtest.Run(t, action, "--bin", bins, "--guest", fakeGuest(t, "1"), "--destdir", dest)
		if !strings.Contains(out, "created "+dest+"/") {
			t.Errorf("%s into a new DESTDIR did not say it created it:\n%s", action, out)
		}
		if _, err := os.Stat(filepath.Join(dest, "usr/local/bin/kvfsd")); err != nil {
			t.Errorf("%s into a new DESTDIR: %v", action, err)
		}
		if action == "install" {
			installtest.Run(t, "uninstall", "--destdir", dest)
			left := fstree.List(t, dest)
			delete(left, ".")
			if len(left) != 0 {
				t.Errorf("left after uninstall: %v", left)
			}
		}
	}
}

func dig(m map[string]any, path ...string) any {
	var v any = m
	for _, k := range path {
		t, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = t[k]
	}
	return v
}

// TestInstallUpgrade installs over an install whose configuration the user edited: the edit
// survives, the new configuration goes beside it, the rest is updated; uninstall keeps the
// edited file and --purge removes it.
func TestInstallUpgrade(t *testing.T) {
	t.Parallel()
	dest := t.TempDir()
	userFiles(t, dest)
	before := fstree.List(t, dest)
	layout := []string{"--destdir", dest}
	installtest.Run(t, append([]string{"install", "--bin", bins, "--guest", fakeGuest(t, "1")}, layout...)...)

	cfg := filepath.Join(dest, "etc/kvfs/configuration.toml")
	f, err := os.OpenFile(cfg, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(f, "\n# edited by the operator")
	f.Close()
	edited := fstree.List(t, dest)[("etc/kvfs/configuration.toml")]

	// Version 2: a new guest image and a new kvfsd.
	bins2 := t.TempDir()
	for _, b := range []string{"containerd-shim-kvfs-v2", "kvfsd", "kvfsctl"} {
		data, err := os.ReadFile(filepath.Join(bins, b))
		if err != nil {
			t.Fatal(err)
		}
		if b == "kvfsd" {
			data = append(data, "v2"...)
		}
		if err := os.WriteFile(filepath.Join(bins2, b), data, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	guest2 := fakeGuest(t, "2")
	out := installtest.Run(t, append([]string{"install", "--bin", bins2, "--guest", guest2}, layout...)...)
	after := fstree.List(t, dest)
	if after["etc/kvfs/configuration.toml"] != edited {
		t.Error("the edited configuration was overwritten")
	}
	if _, ok := after["etc/kvfs/configuration.toml.new"]; !ok || !strings.Contains(out, "kept "+cfg+": edited") ||
		!strings.Contains(out, cfg+".new") {
		t.Errorf("no configuration.toml.new, or not said:\n%s", out)
	}
	for _, p := range []string{"usr/local/bin/kvfsd", "usr/local/share/kvfs/guest/vmlinux"} {
		if !strings.Contains(out, "updated "+filepath.Join(dest, p)) {
			t.Errorf("%s not updated:\n%s", p, out)
		}
	}
	v, _ := os.ReadFile(filepath.Join(dest, "usr/local/share/kvfs/guest/vmlinux"))
	if string(v) != "vmlinux 2" {
		t.Errorf("vmlinux is %q after the upgrade", v)
	}

	out = installtest.Run(t, append([]string{"uninstall"}, layout...)...)
	left := fstree.List(t, dest)
	if left["etc/kvfs/configuration.toml"] != edited || !strings.Contains(out, "kept "+cfg) {
		t.Errorf("uninstall did not keep the edited configuration:\n%s", out)
	}
	if _, ok := left["etc/kvfs/configuration.toml.new"]; ok {
		t.Error("uninstall left configuration.toml.new")
	}
	installtest.Run(t, append([]string{"uninstall", "--purge"}, layout...)...)
	fstree.Same(t, "after uninstall --purge, compared with before install", fstree.List(t, dest), before)
}

// TestInstallContainerdConfig: a host's own config.toml is never rewritten; when its imports
// miss the drop-in, the installer says what to add.
func TestInstallContainerdConfig(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		config string
		note   bool
	}{
		"no imports":    {"version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n  enable_selinux = false\n", true},
		"other imports": {"version = 3\nimports = ['/etc/containerd/mine.toml']\n", true},
		"conf.d":        {"version = 2\nimports = [\n  \"/etc/containerd/mine.toml\",\n  \"/etc/containerd/conf.d/*.toml\",\n]\n", false},
		"the drop-in":   {"imports = ['/etc/containerd/conf.d/kvfs.toml']\n", false},
		"imports later": {"[plugins.x]\nimports = ['/etc/containerd/conf.d/*.toml']\n", true},
	} {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			t.Parallel()
			dest := t.TempDir()
			p := filepath.Join(dest, "etc/containerd/config.toml")
			os.MkdirAll(filepath.Dir(p), 0o755)
			if err := os.WriteFile(p, []byte(tc.config), 0o600); err != nil {
				t.Fatal(err)
			}
			before := fstree.List(t, dest)
			out := installtest.Run(t, "install", "--bin", bins, "--guest", fakeGuest(t, "1"), "--destdir", dest)
			if got, _ := os.ReadFile(p); string(got) != tc.config {
				t.Errorf("config.toml rewritten:\n%s", got)
			}
			if _, err := os.Stat(p + ".new"); err == nil {
				t.Error("config.toml.new written")
			}
			if note := strings.Contains(out, "does not import /etc/containerd/conf.d/kvfs.toml"); note != tc.note {
				t.Errorf("note %v, want %v:\n%s", note, tc.note, out)
			}
			if tc.note && !strings.Contains(out, `imports = ["/etc/containerd/conf.d/*.toml"]`) {
				t.Errorf("the note does not say what to add:\n%s", out)
			}
			installtest.Run(t, "uninstall", "--destdir", dest)
			fstree.Same(t, "after uninstall", fstree.List(t, dest), before)
		})
	}
}

func TestInstallBadArguments(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "usage"},
		{[]string{"install", "--guest", "/x"}, "install needs --bin"},
		{[]string{"install", "--bin", bins, "--guest", t.TempDir()}, "no "},
		{[]string{"install", "--prefix", "usr"}, "not an absolute path"},
		{[]string{"uninstall", "--destdir", t.TempDir()}, "nothing installed here"},
		{[]string{"configure", "--purge"}, "--purge is for uninstall"},
		{[]string{"install", "--packaged"}, "--packaged is for configure"},
		{[]string{"install", "--nope"}, "unknown option --nope"},
		{[]string{"uninstall", "--destdir", "/nonexistent/kvfs"}, "--destdir /nonexistent/kvfs: no such directory"},
	} {
		out, err := installtest.Command(t, tc.args...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("install.sh %q: %v, want an error with %q:\n%s", tc.args, err, tc.want, out)
		}
	}
	// A guest image that does not match its checksums is refused.
	g := fakeGuest(t, "1")
	os.WriteFile(filepath.Join(g, "vmlinux"), []byte("tampered"), 0o644)
	if out, err := installtest.Command(t, "install", "--bin", bins, "--guest", g, "--destdir", t.TempDir()).CombinedOutput(); err == nil || !strings.Contains(string(out), "does not match its SHA256SUMS") {
		t.Errorf("tampered image: %v\n%s", err, out)
	}
}
