package packaging_test

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/fstree"
	"github.com/kvfs/kvfs/internal/testing/installtest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// overlaid are the host's directories a Debian package test sees through an overlay: what
// dpkg and the maintainer scripts write goes to the overlay's upper directory, not the host.
var overlaid = []string{"usr", "etc", "var"}

// hidden are where kvfs's installs put files under the overlaid directories, as globs: make
// install's (PREFIX /usr/local), the package's (PREFIX /usr) and dpkg's record of it, and
// what every install writes (the node installer's too): the configuration, install.sh's
// manifest, and containerd's drop-in. containerd's whole configuration directory is hidden,
// not only the drop-in: postinst writes a config.toml there when there is none, as the test
// expects. The namespace's overlays do not show these, nor the package's entry in dpkg's
// status file, so that the test starts from a host without kvfs whatever the host has
// installed (a conffile already in /etc/kvfs, say, would make dpkg -i prompt).
var hidden = []string{
	"etc/kvfs", "etc/containerd", "var/lib/kvfs", "var/lib/dpkg/info/kvfs.*",
	"usr/local/bin/containerd-shim-kvfs-v2", "usr/local/bin/kvfsd", "usr/local/bin/kvfsctl", "usr/local/share/kvfs",
	"usr/bin/containerd-shim-kvfs-v2", "usr/bin/kvfsd", "usr/bin/kvfsctl", "usr/share/kvfs",
}

// TestDebianPackage builds the .deb (deb/build.sh) and installs it with the host's own dpkg,
// in a private mount namespace where /usr, /etc and /var are overlays on the host's with
// kvfs's files hidden (a kvfs the host has installed is not seen): dpkg sees the real package
// database (qemu-system-x86 is a real dependency) and writes only to the overlays' upper
// directories, which go away with the test. There:
//
//   - dpkg -i installs the package; postinst's install.sh adds containerd's drop-in and a
//     config.toml importing it, and leaves the conffile /etc/kvfs/configuration.toml to dpkg;
//   - the operator edits the conffile, and installing the package again keeps the edit;
//   - a private containerd, run in that namespace and importing the drop-in, runs `ctr run`
//     through the installed shim, which boots the installed guest image;
//   - dpkg -r leaves only the edited conffile; dpkg --purge removes it too: /etc, /usr/bin
//     and the entries of /usr/share and /var/lib list as before the install, and the
//     overlays' upper directories hold nothing but dpkg's database and log (no file of the
//     host's was changed or removed, and none added stays).
func TestDebianPackage(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM under QEMU (-short)")
	}
	g := vmtest.AgentImage(t)
	start := time.Now()
	out, err := exec.Command("bash", "deb/build.sh", "--bin", bins, "--guest", filepath.Dir(g.Kernel),
		"--version", "1.0~test", "--out", t.TempDir()).Output()
	if err != nil {
		t.Fatalf("deb/build.sh: %v\n%s", err, exitStderr(err))
	}
	deb := strings.TrimSpace(string(out))
	st, err := os.Stat(deb)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("built %s in %v: %d bytes", filepath.Base(deb), time.Since(start).Round(time.Millisecond), st.Size())
	packaged := debFiles(t, deb)

	ns := newOverlayNS(t)
	root := ns.root()
	for _, h := range hidden {
		if m, _ := filepath.Glob(filepath.Join(root, h)); len(m) > 0 {
			t.Fatalf("the namespace shows the host's %v", m)
		}
	}
	if s, err := ns.output("dpkg-query", "-W", "-f=${Status}", "kvfs"); err == nil {
		t.Fatalf("before dpkg -i, the namespace's dpkg has kvfs %q", s)
	}
	before := hostTree(t, root)

	start = time.Now()
	out1 := ns.run(t, "dpkg", "-i", deb)
	t.Logf("dpkg -i took %v", time.Since(start).Round(time.Millisecond))
	if s := ns.run(t, "dpkg-query", "-W", "-f=${Status}", "kvfs"); s != "install ok installed" {
		t.Errorf("after dpkg -i, kvfs is %q", s)
	}
	for _, p := range packaged {
		if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
			t.Errorf("packaged %s: %v", p, err)
		}
	}
	for _, said := range []string{"installed /etc/containerd/conf.d/kvfs.toml", "installed /etc/containerd/config.toml", "entries in /var/lib/kvfs/install.manifest"} {
		if !strings.Contains(out1, said) {
			t.Errorf("postinst did not say %q:\n%s", said, out1)
		}
	}
	data, _ := os.ReadFile(filepath.Join(root, "etc/containerd/config.toml"))
	var main map[string]any
	if err := toml.Unmarshal(data, &main); err != nil || fmt.Sprint(main["imports"]) != "[/etc/containerd/conf.d/*.toml]" {
		t.Errorf("containerd's config.toml (%v):\n%s", err, data)
	}
	manifest, _ := os.ReadFile(filepath.Join(root, "var/lib/kvfs/install.manifest"))
	if strings.Contains(string(manifest), "/etc/kvfs/configuration.toml") || strings.Contains(string(manifest), "/usr/bin/") {
		t.Errorf("install.sh's manifest lists the package's own files:\n%s", manifest)
	}

	// containerd and its shims run in the namespace, where the package is installed.
	c := ctrdtest.Start(t, ctrd.Options{
		ShimDirs: []string{"/usr/bin"},
		Imports:  []string{"/etc/containerd/conf.d/*.toml"},
		Wrapper:  []string{"nsenter", "-t", strconv.Itoa(ns.pid()), "-m", "--"},
	})
	config := filepath.Join(root, "etc/kvfs/configuration.toml")
	installtest.EditConfig(t, config, c.SandboxBaseDir())
	edited, _ := os.ReadFile(config)

	// The same package again: dpkg keeps the edited conffile, install.sh changes nothing.
	out2 := ns.run(t, "dpkg", "-i", deb)
	if now, _ := os.ReadFile(config); string(now) != string(edited) {
		t.Errorf("installing again lost the edit of the conffile:\n%s", out2)
	}
	for _, word := range []string{"installed /", "updated /", "kept /"} {
		if strings.Contains(out2, word) {
			t.Errorf("postinst, the second time, said %q:\n%s", word, out2)
		}
	}
	if m, _ := filepath.Glob(filepath.Join(root, "etc/kvfs/*.dpkg-*")); len(m) > 0 {
		t.Errorf("dpkg left %v", m)
	}

	want, err := guestimage.Read(filepath.Join(root, "usr/share/kvfs/guest/vmlinux"), filepath.Join(root, "usr/share/kvfs/guest/rootfs.erofs"))
	if err != nil {
		t.Fatal(err)
	}
	image := ctrdtest.ImportBusybox(t, c)
	r := c.RunCtr(t, "run", "--rm", "--runtime", "io.containerd.kvfs.v2", "--runtime-config-path", "/etc/kvfs/configuration.toml",
		image, "packaged", "uname", "-r")
	if r.ExitCode != 0 || strings.TrimSpace(r.Stdout) != want.KernelVersion {
		t.Errorf("ctr run: exit %d, stdout %q (want the packaged guest's kernel %s), stderr %s", r.ExitCode, r.Stdout, want.KernelVersion, r.Stderr)
	}

	// Remove: the package's files and what postinst added go; the edited conffile stays.
	ns.run(t, "dpkg", "-r", "kvfs")
	if s := ns.run(t, "dpkg-query", "-W", "-f=${Status}", "kvfs"); s != "deinstall ok config-files" {
		t.Errorf("after dpkg -r, kvfs is %q", s)
	}
	for _, p := range packaged {
		_, err := os.Lstat(filepath.Join(root, p))
		if p == "etc/kvfs/configuration.toml" {
			if err != nil {
				t.Errorf("dpkg -r removed the conffile: %v", err)
			}
		} else if !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("dpkg -r left %s (%v)", p, err)
		}
	}
	for _, p := range []string{"etc/containerd", "var/lib/kvfs"} {
		if _, err := os.Lstat(filepath.Join(root, p)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("dpkg -r left /%s (%v)", p, err)
		}
	}

	ns.run(t, "dpkg", "--purge", "kvfs")
	if s, err := ns.output("dpkg-query", "-W", "-f=${Status}", "kvfs"); err == nil {
		t.Errorf("after dpkg --purge, kvfs is %q", s)
	}
	fstree.Same(t, "after dpkg --purge, compared with before dpkg -i", hostTree(t, root), before)
	ns.checkUpper(t)
}

// debFiles lists the files (not directories) in the package deb, relative to /.
func debFiles(t *testing.T, deb string) []string {
	t.Helper()
	out, err := exec.Command("dpkg-deb", "--fsys-tarfile", deb).Output()
	if err != nil {
		t.Fatalf("dpkg-deb --fsys-tarfile: %v", err)
	}
	cmd := exec.Command("tar", "-t")
	cmd.Stdin = strings.NewReader(string(out))
	list, err := cmd.Output()
	if err != nil {
		t.Fatalf("tar -t: %v", err)
	}
	var files []string
	for _, l := range strings.Split(string(list), "\n") {
		if l != "" && !strings.HasSuffix(l, "/") {
			files = append(files, strings.TrimPrefix(l, "./"))
		}
	}
	if len(files) < 10 {
		t.Fatalf("the package holds only %v", files)
	}
	return files
}

// hostTree lists what is in /etc and /usr/bin under root, and the entries of /usr/share and
// /var/lib (not what is in them: other tests on the machine write to the host's /var/lib/cni,
// say, and the lower layer shows that; and walking all of /usr takes long): path → type and
// mode, a symlink's target, a regular file's size. Contents are not read: the overlays'
// upper directories show any change (checkUpper).
func hostTree(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for top, all := range map[string]bool{"etc": true, "usr/bin": true, "usr/share": false, "var/lib": false} {
		err := filepath.WalkDir(filepath.Join(root, top), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			if !all && rel != top && d.IsDir() {
				out[rel] = "dir"
				return filepath.SkipDir
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			switch {
			case d.IsDir():
				out[rel] = "dir " + info.Mode().Perm().String()
			case d.Type()&fs.ModeSymlink != 0:
				target, _ := os.Readlink(p)
				out[rel] = "-> " + target
			default:
				out[rel] = info.Mode().String() + " " + strconv.FormatInt(info.Size(), 10)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// overlayNS is a process holding a private mount namespace in which the overlaid directories
// are overlays: the host's as the lower layer, a layer hiding kvfs's files above it, an upper
// directory of the test's.
type overlayNS struct {
	cmd   *exec.Cmd
	stdin *os.File
	// dir holds, for each overlaid DIR, DIR.up and DIR.work, the test's upper layer; DIR.hide,
	// the layer with a whiteout for each of the host's hidden paths; and lower/DIR, where the
	// namespace shows the lower layers (the host without kvfs) read-only.
	dir string
}

// overlayScript makes the namespace's mounts and holds the namespace until its stdin closes:
// sh -c overlayScript sh DIR OVERLAID HIDDEN..., with the test's directory, the overlaid
// directories in one argument and the hidden globs. The hiding layer is made by the kernel:
// an overlay with DIR.hide as its upper directory is mounted on lower/DIR, the hidden paths
// are removed there (each leaves a whiteout; its parent directories are copied up with the
// host's mode and owner) and the package's entry is cut from dpkg's status file; then that
// overlay gives way to the read-only view of the lower layers, and /DIR is the test's overlay.
const overlayScript = `set -e
dir=$1 overlaid=$2
shift 2
for d in $overlaid; do
	mkdir -p "$dir/$d.hide" "$dir/$d.hidework" "$dir/$d.up" "$dir/$d.work" "$dir/lower/$d"
	mount -t overlay overlay -o "lowerdir=/$d,upperdir=$dir/$d.hide,workdir=$dir/$d.hidework" "$dir/lower/$d"
done
cd "$dir/lower"
for h; do
	rm -rf -- $h
done
if grep -qx 'Package: kvfs' var/lib/dpkg/status; then
	awk -v RS= -v ORS='\n\n' '$1 != "Package:" || $2 != "kvfs"' var/lib/dpkg/status >"$dir/status"
	cat "$dir/status" >var/lib/dpkg/status
fi
cd /
for d in $overlaid; do
	umount "$dir/lower/$d"
	mount -t overlay overlay -o "ro,lowerdir=$dir/$d.hide:/$d" "$dir/lower/$d"
	mount -t overlay overlay -o "lowerdir=$dir/$d.hide:/$d,upperdir=$dir/$d.up,workdir=$dir/$d.work" "/$d"
done
echo ready
exec cat >/dev/null
`

// newOverlayNS starts the namespace (overlayScript), saying which of the host's files it hides.
func newOverlayNS(t *testing.T) *overlayNS {
	t.Helper()
	var found []string
	for _, h := range hidden {
		m, _ := filepath.Glob("/" + h)
		found = append(found, m...)
	}
	if len(found) > 0 {
		t.Logf("hiding the host's %s", strings.Join(found, " "))
	}
	dir := t.TempDir()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	ns := &overlayNS{dir: dir, stdin: w}
	args := append([]string{"--mount", "--propagation", "private", "sh", "-c", overlayScript, "sh", dir, strings.Join(overlaid, " ")}, hidden...)
	ns.cmd = exec.Command("unshare", args...)
	ns.cmd.Stdin = r
	ns.cmd.Stderr = os.Stderr
	ns.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := ns.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := ns.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r.Close()
	t.Cleanup(func() {
		w.Close()
		done := make(chan struct{})
		go func() { ns.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			ns.cmd.Process.Kill()
			<-done
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		t.Fatalf("mounting the overlays: %q, %v", line, err)
	}
	return ns
}

// pid is the process holding the namespace.
func (ns *overlayNS) pid() int { return ns.cmd.Process.Pid }

// root is the namespace's root as this process reaches it.
func (ns *overlayNS) root() string { return fmt.Sprintf("/proc/%d/root", ns.pid()) }

// output runs a command in the namespace and returns its stdout.
func (ns *overlayNS) output(args ...string) (string, error) {
	cmd := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(ns.pid()), "-m", "--"}, args...)...)
	out, err := cmd.Output()
	return string(out), err
}

// run runs a command in the namespace, fails the test unless it exits 0, and returns its
// output (stdout and stderr).
func (ns *overlayNS) run(t *testing.T, args ...string) string {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"-t", strconv.Itoa(ns.pid()), "-m", "--"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("%s:\n%s", strings.Join(args, " "), out)
	return strings.TrimSpace(string(out))
}

// checkUpper fails the test for anything in the overlays' upper directories but dpkg's
// database and log: a whiteout (a host file removed), an opaque or new directory, a file.
// Directories that are there only because something was made and removed in them are the
// host's, with the mode and owner the lower layers show (the host's).
func (ns *overlayNS) checkUpper(t *testing.T) {
	t.Helper()
	for _, d := range overlaid {
		up := filepath.Join(ns.dir, d+".up")
		err := filepath.WalkDir(up, func(p string, e fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(up, p)
			host := filepath.Join("/", d, rel)
			if host == "/var/lib/dpkg" {
				return filepath.SkipDir
			}
			if host == "/var/log/dpkg.log" {
				return nil
			}
			lower := filepath.Join(ns.root(), ns.dir, "lower", d, rel)
			var st, lst unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return err
			}
			switch {
			case st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0:
				t.Errorf("%s was removed from the host", host)
			case st.Mode&unix.S_IFMT != unix.S_IFDIR:
				t.Errorf("%s was left or changed", host)
			case unix.Lstat(lower, &lst) != nil || lst.Mode&unix.S_IFMT != unix.S_IFDIR:
				t.Errorf("directory %s was left", host)
			case st.Mode != lst.Mode || st.Uid != lst.Uid || st.Gid != lst.Gid:
				t.Errorf("directory %s: mode %o owner %d:%d, the host's %o %d:%d", host, st.Mode, st.Uid, st.Gid, lst.Mode, lst.Uid, lst.Gid)
			default:
				if v, err := unix.Lgetxattr(p, "trusted.overlay.opaque", make([]byte, 8)); err == nil && v > 0 {
					t.Errorf("directory %s was replaced (opaque)", host)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}

// exitStderr is the stderr an exec.ExitError kept.
func exitStderr(err error) string {
	var e *exec.ExitError
	if errors.As(err, &e) {
		return string(e.Stderr)
	}
	return ""
}
