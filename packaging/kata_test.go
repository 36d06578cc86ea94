package packaging_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/installtest"
	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// kataFragment is the [hypervisor.qemu] table of the installed Kata fragment.
type kataFragment struct {
	Hypervisor struct {
		QEMU struct {
			Daemon     string   `toml:"virtio_fs_daemon"`
			ValidPaths []string `toml:"valid_virtio_fs_daemon_paths"`
			ExtraArgs  []string `toml:"virtio_fs_extra_args"`
			Cache      string   `toml:"virtio_fs_cache"`
		} `toml:"qemu"`
	} `toml:"hypervisor"`
}

// TestKataDaemonArgs installs into a scratch root and starts the kvfsd the installed Kata
// fragment names with every command line Kata 3.x builds for its virtio-fs daemon:
//
//   - the Go runtime (src/runtime virtcontainers): `--syslog --cache=MODE --shared-dir=DIR
//     --fd=3` and the extra args, the listening vhost-user socket made by the runtime and
//     passed as fd 3, connected at once (QEMU does not wait for a log line);
//   - runtime-rs (share_virtio_fs_standalone.rs): `--socket-path PATH --shared-dir DIR --cache
//     MODE --sandbox none --seccomp none`, in later versions with `--inode-file-handles MODE`,
//     then the extra args; kvfsd makes the socket, and runtime-rs connects once stderr says
//     "Waiting for vhost-user socket connection".
//
// for every cache mode the runtime accepts, with the fragment's extra args and with the
// runtime's own default ones (`--thread-pool-size=1 --announce-submounts`, runtime-rs's
// `--thread-pool-size=1 -o announce_submounts`). Each time the in-repo front-end connects as
// QEMU does, negotiates, looks a file up and reads its attributes: the entry's validity must be
// the cache mode's, a mount point in the share must be announced as a submount, extended
// attributes must be served when Kata adds --xattr (the guest's SELinux on), and the
// serving process must be confined (seccomp on, its own mount namespace) unless runtime-rs's
// `--sandbox none --seccomp none` went unanswered (its default extra args).
func TestKataDaemonArgs(t *testing.T) {
	root, err := os.MkdirTemp("/tmp", "kvfs-kata-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	installtest.Run(t, "install", "--bin", bins, "--guest", fakeGuest(t, "1"),
		"--prefix", root+"/usr", "--sysconfdir", root+"/etc", "--localstatedir", root+"/var")

	data, err := os.ReadFile(filepath.Join(root, "usr/share/kvfs/kata/kvfsd.toml"))
	if err != nil {
		t.Fatal(err)
	}
	var frag kataFragment
	if err := toml.Unmarshal(data, &frag); err != nil {
		t.Fatalf("the Kata fragment: %v\n%s", err, data)
	}
	q := frag.Hypervisor.QEMU
	if q.Daemon != filepath.Join(root, "usr/bin/kvfsd") || !slices.Equal(q.ValidPaths, []string{q.Daemon}) || q.Cache != "auto" {
		t.Fatalf("the Kata fragment's [hypervisor.qemu]: %+v\n%s", q, data)
	}

	// The shared directory: a file, and a mount point to be announced.
	share := filepath.Join(root, "shared")
	sub := filepath.Join(share, "sub")
	if err := os.MkdirAll(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(share, "hello"), []byte("kata\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(filepath.Join(share, "hello"), "user.kvfs", []byte("yes"), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(sub, unix.MNT_DETACH) })

	goDefault := []string{"--thread-pool-size=1", "--announce-submounts"}
	rsDefault := []string{"--thread-pool-size=1", "-o", "announce_submounts"}
	for _, c := range []struct {
		runtime string
		caches  []string
		extras  map[string][]string
	}{
		// The Go runtime's valid(): auto, always, metadata, never.
		{"go", []string{"auto", "always", "metadata", "never"}, map[string][]string{"fragment": q.ExtraArgs, "default": goDefault}},
		// runtime-rs's kata-types: never, auto, always.
		{"rs", []string{"never", "auto", "always"}, map[string][]string{"fragment": q.ExtraArgs, "default": rsDefault}},
		{"rs-handles", []string{"never", "auto", "always"}, map[string][]string{"fragment": q.ExtraArgs, "default": rsDefault}},
	} {
		for _, cache := range c.caches {
			for _, which := range []string{"fragment", "default"} {
				t.Run(c.runtime+"/"+cache+"/"+which, func(t *testing.T) {
					confined := c.runtime == "go" || which == "fragment"
					kataStart(t, q.Daemon, c.runtime, share, cache, c.extras[which], confined)
				})
			}
		}
		// With the guest's SELinux on (disable_guest_selinux = false) both runtimes add
		// --xattr after the extra args.
		t.Run(c.runtime+"/auto/fragment+selinux", func(t *testing.T) {
			kataStart(t, q.Daemon, c.runtime, share, "auto", append(slices.Clone(q.ExtraArgs), "--xattr"), true)
		})
	}
}

// kataStart starts daemon as Kata's runtime (go, rs, or rs-handles: runtime-rs with
// --inode-file-handles) would with the cache mode and extra args, and checks that it serves.
func kataStart(t *testing.T, daemon, runtime, share, cache string, extra []string, confined bool) {
	sock := filepath.Join(t.TempDir(), "vhost-fs.sock")
	cmd := exec.Command(daemon)
	var stderr *os.File
	log := &syncbuf.Buffer{}
	switch runtime {
	case "go":
		// As virtiofsd.go: the runtime listens, passes the listener, and QEMU connects.
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		l.SetUnlinkOnClose(false)
		f, err := l.File()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		cmd.ExtraFiles = []*os.File{f}
		cmd.Args = append(cmd.Args, "--syslog", "--cache="+cache, "--shared-dir="+share, "--fd="+strconv.Itoa(2+len(cmd.ExtraFiles)))
		cmd.Stdout, cmd.Stderr = log, log
	default:
		cmd.Args = append(cmd.Args, "--socket-path", sock, "--shared-dir", share, "--cache", cache, "--sandbox", "none", "--seccomp", "none")
		if runtime == "rs-handles" {
			cmd.Args = append(cmd.Args, "--inode-file-handles", "never")
		}
		cmd.Stdout = log
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		stderr = r
		cmd.Stderr = w
	}
	cmd.Args = append(cmd.Args, extra...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	var ready chan struct{}
	if stderr != nil {
		if f, ok := cmd.Stderr.(*os.File); ok {
			f.Close()
		}
		// runtime-rs reads stderr line by line until the ready line.
		ready = make(chan struct{})
		go func() {
			defer stderr.Close()
			seen := false
			s := bufio.NewScanner(stderr)
			for s.Scan() {
				fmt.Fprintln(log, s.Text())
				if !seen && strings.Contains(s.Text(), "Waiting for vhost-user socket connection") {
					seen = true
					close(ready)
				}
			}
		}()
	}
	go func() { cmd.Wait(); close(done) }()
	defer func() {
		select {
		case <-done:
		default:
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%q:\n%s", cmd.Args, log.String())
		}
	}()
	if ready != nil {
		select {
		case <-ready:
		case <-done:
			t.Fatalf("kvfsd exited (%v) before the ready line", cmd.ProcessState)
		case <-time.After(30 * time.Second):
			t.Fatal("no ready line on stderr after 30 s")
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, sock, frontend.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer fe.Close()
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT: %v", err)
	}
	mode, err := virtiofs.ParseCacheMode(cache)
	if err != nil {
		t.Fatal(err)
	}
	e, err := c.Lookup(ctx, fuse.RootID, "hello")
	if err != nil {
		t.Fatalf("LOOKUP hello: %v", err)
	}
	if e.Attr.Size != 5 || time.Duration(e.EntryValid)*time.Second != mode.Timeout() {
		t.Errorf("LOOKUP hello: size %d, entry valid %d s; want 5 and %v (cache %s)", e.Attr.Size, e.EntryValid, mode.Timeout(), cache)
	}
	a, err := c.Getattr(ctx, e.NodeID, 0)
	if err != nil || a.Attr.Ino != e.Attr.Ino || a.Attr.Size != 5 {
		t.Errorf("GETATTR hello: %+v, %v", a, err)
	}
	if slices.Contains(extra, "--xattr") {
		if v, _, err := c.Getxattr(ctx, e.NodeID, "user.kvfs", 64); err != nil || string(v) != "yes" {
			t.Errorf("GETXATTR user.kvfs of hello with --xattr: %q, %v", v, err)
		}
	}
	s, err := c.Lookup(ctx, fuse.RootID, "sub")
	if err != nil || s.Attr.Flags&fuse.AttrSubmount == 0 {
		t.Errorf("LOOKUP sub, a mount point: %+v, %v; want it announced as a submount", s, err)
	}

	server := servingProcess(t, cmd.Process.Pid)
	status, err := procstatus.ReadPID(server)
	if err != nil {
		t.Fatal(err)
	}
	ns, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", server))
	ours, _ := os.Readlink("/proc/self/ns/mnt")
	if got := status["Seccomp"] == "2" && ns != ours; got != confined {
		t.Errorf("the serving process %d: seccomp %s, mount namespace %s (ours %s): confined %v, want %v",
			server, status["Seccomp"], ns, ours, got, confined)
	}

	// QEMU going away ends the daemon, as Kata expects.
	fe.Close()
	select {
	case <-done:
		if !cmd.ProcessState.Success() {
			t.Errorf("kvfsd after the front-end hung up: %v", cmd.ProcessState)
		}
	case <-time.After(30 * time.Second):
		t.Error("kvfsd still runs 30 s after the front-end hung up")
	}
}

// servingProcess is the process that serves for kvfsd pid: pid itself, or with
// --sandbox=namespace the only child of its only child (pid supervises PID 1 of the
// namespaces, which starts the server).
func servingProcess(t *testing.T, pid int) int {
	t.Helper()
	for {
		files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
		var kids []string
		for _, name := range files {
			b, _ := os.ReadFile(name)
			kids = append(kids, strings.Fields(string(b))...)
		}
		switch len(kids) {
		case 0:
			return pid
		case 1:
			pid, _ = strconv.Atoi(kids[0])
			continue
		}
		t.Fatalf("kvfsd %d has children %v", pid, kids)
		return 0
	}
}
