package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
	"github.com/kvfs/kvfs/virtiofs/confine"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/conformance"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// kvfsdBin is ./cmd/kvfsd, built once by TestMain.
var kvfsdBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvfsd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Crossable by others: a kvfsd with --uid-map runs itself again as the root of its user
	// namespace, an unprivileged host id.
	if err := os.Chmod(dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvfsdBin = filepath.Join(dir, "kvfsd")
	if out, err := exec.Command("go", "build", "-o", kvfsdBin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build kvfsd: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// daemon is a running kvfsd.
type daemon struct {
	cmd    *exec.Cmd
	sock   string
	log    *syncbuf.Buffer
	done   chan struct{} // closed when cmd.Wait returned
	server int           // the serving process: the sandboxed server with --sandbox=namespace
	args   []string
}

// startKvfsd starts kvfsd on share with args; with viaFD the test creates the listening socket
// and passes it as --fd=3, as Kata does, else kvfsd creates it (--socket-path). It returns
// once the server process announced its socket and carries its seccomp filter (or, with
// --seccomp=none, once it announced).
func startKvfsd(t *testing.T, share string, viaFD bool, args ...string) *daemon {
	t.Helper()
	d := &daemon{sock: filepath.Join(t.TempDir(), "vhost-fs.sock"), log: &syncbuf.Buffer{}, done: make(chan struct{})}
	args = append([]string{"--shared-dir=" + share}, args...)
	d.cmd = exec.Command(kvfsdBin)
	if viaFD {
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: d.sock, Net: "unix"})
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
		d.cmd.ExtraFiles = []*os.File{f}
		args = append(args, "--fd=3")
		t.Cleanup(func() { os.Remove(d.sock) })
	} else {
		args = append(args, "--socket-path="+d.sock)
	}
	d.cmd.Args = append(d.cmd.Args, args...)
	d.args = args
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			d.cmd.Process.Kill()
			<-d.done
		}
		if t.Failed() {
			t.Logf("kvfsd %q:\n%s", args, d.log.String())
		}
	})

	d.waitFor(t, "the socket announced", func() bool {
		return strings.Contains(d.log.String(), "Waiting for vhost-user socket connection")
	})
	d.server = d.cmd.Process.Pid
	if slices.Contains(args, "--sandbox=namespace") || !slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--sandbox") }) {
		// The supervisor's child is PID 1 of the namespaces, and the server its child.
		for _, who := range []string{"the namespaces' PID 1", "the sandboxed server"} {
			d.waitFor(t, who, func() bool {
				child, ok := onlyChild(d.server)
				if ok {
					d.server = child
				}
				return ok
			})
		}
	}
	if !slices.Contains(args, "--seccomp=none") {
		d.waitFor(t, "the seccomp filter", func() bool { return d.status(t)["Seccomp"] == "2" })
	}
	return d
}

// onlyChild returns the child of pid if it has exactly one. A task's children file lists the
// children that thread forked: Go forks from whichever thread runs the goroutine, so every
// thread is read.
func onlyChild(pid int) (int, bool) {
	files, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	var f []string
	for _, name := range files {
		b, _ := os.ReadFile(name)
		f = append(f, strings.Fields(string(b))...)
	}
	if len(f) != 1 {
		return 0, false
	}
	child, err := strconv.Atoi(f[0])
	return child, err == nil
}

// waitFor polls cond until it holds, failing if kvfsd exits first or it takes very long.
func (d *daemon) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		select {
		case <-d.done:
			t.Fatalf("kvfsd exited (%v) while waiting for %s", d.cmd.ProcessState, what)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 30 s", what)
		}
	}
}

// status returns the fields of /proc/PID/status of the serving process.
func (d *daemon) status(t *testing.T) map[string]string {
	return statusOf(t, strconv.Itoa(d.server))
}

// wait waits for kvfsd to exit and checks it exited with status 0.
func (d *daemon) wait(t *testing.T) {
	t.Helper()
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		t.Fatal("kvfsd did not exit")
	}
	if !d.cmd.ProcessState.Success() {
		t.Fatalf("kvfsd: %v, want exit status 0", d.cmd.ProcessState)
	}
}

// shareDir makes an empty shared directory with the sibling "outside" the suite watches.
func shareDir(t *testing.T) string {
	dir := filepath.Join(t.TempDir(), "share")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func dial(t *testing.T, sock string) (*frontend.Frontend, *fuseclient.Client) {
	t.Helper()
	return dialQueues(t, sock, 2)
}

// dialQueues is dial with n request queues (the Rust virtiofsd 1.13 serves one).
func dialQueues(t *testing.T, sock string, n int) (*frontend.Frontend, *fuseclient.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, sock, frontend.Options{RequestQueues: n})
	if err != nil {
		t.Fatal(err)
	}
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		fe.Close()
		t.Fatalf("INIT: %v", err)
	}
	return fe, c
}

func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(b, &sb); err != nil {
		t.Fatal(err)
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// TestConfinedConformance runs the whole FUSE suite through the in-repo front-end against a
// confined kvfsd with seccomp kill: a system call the allowlist lacks would kill it and fail the
// steps and its exit status. The sandbox itself is checked from outside.
func TestConfinedConformance(t *testing.T) {
	for _, v := range []struct {
		name    string
		viaFD   bool
		args    []string
		sandbox string
		sigterm bool // end with SIGTERM to the process started, not a disconnect
	}{
		{"namespace pool 0", false, []string{"--sandbox=namespace", "--seccomp=kill", "--thread-pool-size=0"}, "namespace", false},
		{"namespace pool 4 fd", true, []string{"--sandbox=namespace", "--seccomp=kill", "--thread-pool-size=4"}, "namespace", true},
		// Kata's own command line (runtime-go, default extra args): the defaults apply.
		{"kata argv defaults", true, []string{"--syslog", "--cache=auto", "--thread-pool-size=1", "--announce-submounts"}, "namespace", true},
		{"chroot pool 4", false, []string{"--sandbox=chroot", "--seccomp=kill", "--thread-pool-size=4"}, "chroot", false},
		// The request queue polls its ring between requests under the filter.
		{"namespace polling", false, []string{"--sandbox=namespace", "--seccomp=kill", "--poll-max-ns=50000"}, "namespace", false},
		// Nodes keep file handles: name_to_handle_at and open_by_handle_at under the filter.
		{"namespace file handles", false, []string{"--sandbox=namespace", "--seccomp=kill", "--inode-file-handles=mandatory"}, "namespace", false},
	} {
		t.Run(v.name, func(t *testing.T) {
			share := shareDir(t)
			d := startKvfsd(t, share, v.viaFD, v.args...)
			checkConfined(t, d, share, v.sandbox)

			fe, c := dial(t, d.sock)
			ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
			defer cancel()
			for _, r := range conformance.Run(ctx, c, share) {
				if !r.OK() {
					t.Errorf("%s: got %q, want %q; host: %v", r.Step, r.Outcome, r.Want, r.HostErr)
				}
			}
			if st := d.status(t); st["Seccomp"] != "2" {
				t.Errorf("after the suite: Seccomp %q", st["Seccomp"])
			}
			if v.sigterm {
				d.cmd.Process.Signal(syscall.SIGTERM)
				d.wait(t)
				fe.Close()
			} else {
				fe.Close()
				d.wait(t)
			}
			if _, err := os.Stat(d.sock + ".pid"); v.sandbox == "namespace" && !v.viaFD && !errors.Is(err, os.ErrNotExist) {
				t.Errorf("pidfile left behind: %v", err)
			}
		})
	}
}

// TestReadOnlyConformance runs the read-only suite against kvfsd --readonly, confined with
// seccomp kill: reading works, every request that would change the share answers EROFS and
// changes nothing on the host.
func TestReadOnlyConformance(t *testing.T) {
	share := shareDir(t)
	d := startKvfsd(t, share, false, "--sandbox=namespace", "--seccomp=kill", "--readonly")
	fe, c := dial(t, d.sock)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, r := range conformance.RunReadOnly(ctx, c, share) {
		if !r.OK() {
			t.Errorf("%s: got %q, want %q; host: %v", r.Step, r.Outcome, r.Want, r.HostErr)
		}
	}
	fe.Close()
	d.wait(t)
}

// rustTranslateDifferences are the steps of the id translation suite the Rust virtiofsd 1.13
// answers otherwise, with its answer and why.
var rustTranslateDifferences = map[string][2]string{
	"chown to a forbidden uid": {"errno EIO", "its forbid-guest error carries no errno (an io::Error of kind " +
		"PermissionDenied), so the guest gets EIO; kvfsd answers EPERM, the errno of an operation the caller may not do"},
	"create as a forbidden caller": {"errno EIO", "as for the chown"},
}

// TestTranslateConformance runs the id translation suite against kvfsd with virtiofsd's
// --translate-uid and --translate-gid rules (conformance.TranslateArgs), confined with seccomp
// kill, and the same suite against the Rust virtiofsd 1.13 given the same options: kvfsd
// passes every step, the Rust one every step but those rustTranslateDifferences lists (whose
// host checks it passes).
func TestTranslateConformance(t *testing.T) {
	run := func(t *testing.T, sock, share string, known map[string][2]string) {
		fe, c := dialQueues(t, sock, 1)
		defer fe.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		differ := map[string]bool{}
		for _, r := range conformance.RunTranslate(ctx, c, share) {
			if k, ok := known[r.Step]; ok && r.Outcome == k[0] && r.HostErr == nil {
				differ[r.Step] = true
				t.Logf("known difference %s: %q, not %q (%s)", r.Step, r.Outcome, r.Want, k[1])
				continue
			}
			if !r.OK() {
				t.Errorf("%s: got %q, want %q; host: %v", r.Step, r.Outcome, r.Want, r.HostErr)
			}
		}
		for step := range known {
			if !differ[step] {
				t.Errorf("%s is listed as a known difference but now answers as kvfsd: remove it", step)
			}
		}
	}
	t.Run("kvfsd", func(t *testing.T) {
		share := shareDir(t)
		d := startKvfsd(t, share, false, append([]string{"--sandbox=namespace", "--seccomp=kill"}, conformance.TranslateArgs...)...)
		run(t, d.sock, share, nil)
		d.wait(t)
	})
	t.Run("rust-virtiofsd", func(t *testing.T) {
		if _, err := os.Stat(conformance.RustVirtiofsd); err != nil {
			t.Skipf("the Rust virtiofsd is not installed (%v); scripts/deps.sh installs it", err)
		}
		share := shareDir(t)
		sock := filepath.Join(t.TempDir(), "rust.sock")
		cmd := exec.Command(conformance.RustVirtiofsd, append([]string{"--socket-path=" + sock, "--shared-dir=" + share}, conformance.TranslateArgs...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		defer func() {
			cmd.Process.Kill()
			cmd.Wait()
			if t.Failed() {
				t.Logf("the Rust virtiofsd's stderr:\n%s", stderr.String())
			}
		}()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if _, err := os.Stat(sock); err == nil {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("the Rust virtiofsd's socket: %v", err)
			}
		}
		run(t, sock, share, rustTranslateDifferences)
	})
}

// TestUserNamespaceMap: kvfsd --uid-map=:0:100000:65536: --gid-map=:0:200000:65536: serves
// from a user namespace of those mappings, confined with seccomp kill: its server's uid_map
// and gid_map say so; what guest root creates is the host's 100000:200000; a host file of
// 100005:200005 is the guest's 5:5, one of host root's the overflow id 65534 (the namespace
// does not map it, so nothing in it may chown it); a guest caller the namespace does not map
// cannot create; a file of host root's cannot be given away, since the server's capabilities
// reach only the ids the namespace maps.
func TestUserNamespaceMap(t *testing.T) {
	share := shareDir(t)
	// The namespace's root, host uid 100000, crosses the directories above the share.
	for d := share; d != "/"; d = filepath.Dir(d) {
		if fi, err := os.Stat(d); err == nil && fi.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(d, fi.Mode().Perm()|0o001); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.Chmod(share, 0o777); err != nil {
		t.Fatal(err)
	}
	for name, owner := range map[string][2]int{"mapped": {100005, 200005}, "hostroot": {0, 0}} {
		if err := os.WriteFile(filepath.Join(share, name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(filepath.Join(share, name), owner[0], owner[1]); err != nil {
			t.Fatal(err)
		}
	}
	d := startKvfsd(t, share, false, "--sandbox=namespace", "--seccomp=kill", "--uid-map=:0:100000:65536:", "--gid-map=:0:200000:65536:")
	for file, want := range map[string]string{"uid_map": "0 100000 65536", "gid_map": "0 200000 65536"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", d.server, file))
		if got := strings.Join(strings.Fields(string(b)), " "); err != nil || got != want {
			t.Errorf("the server's %s: %q (%v), want %q", file, got, err, want)
		}
	}
	fe, c := dial(t, d.sock)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	made, err := c.Create(ctx, fuse.RootID, "made", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o644)
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(share, "made"), &st); err != nil || st.Uid != 100000 || st.Gid != 200000 || made.Entry.Attr.UID != 0 {
		t.Errorf("guest root's file: host %d:%d (%v), guest %d; want 100000:200000, 0", st.Uid, st.Gid, err, made.Entry.Attr.UID)
	}
	for name, want := range map[string][2]uint32{"mapped": {5, 5}, "hostroot": {65534, 65534}} {
		e, err := c.Lookup(ctx, fuse.RootID, name)
		if err != nil || e.Attr.UID != want[0] || e.Attr.GID != want[1] {
			t.Errorf("%s: %+v, %v; want %d:%d", name, e, err, want[0], want[1])
			continue
		}
		if name == "hostroot" {
			if _, err := c.Setattr(ctx, e.NodeID, &fuse.SetattrIn{Valid: fuse.FattrUID, UID: 5}); !errors.Is(err, unix.EPERM) {
				t.Errorf("chown of host root's file: %v, want EPERM", err)
			}
		}
	}
	c.UID, c.GID = 70000, 70000
	if _, err := c.Create(ctx, fuse.RootID, "unmapped", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o644); err == nil {
		t.Error("a caller the namespace does not map created a file")
	}
	if _, err := os.Lstat(filepath.Join(share, "unmapped")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the unmapped caller's file: %v", err)
	}
	fe.Close()
	d.wait(t)
}

// checkConfined checks the serving process's filter and sandbox from outside.
func checkConfined(t *testing.T, d *daemon, share, sandbox string) {
	t.Helper()
	st := d.status(t)
	if st["Seccomp"] != "2" || st["Seccomp_filters"] != "1" || st["NoNewPrivs"] != "1" {
		t.Errorf("status: Seccomp %q, Seccomp_filters %q, NoNewPrivs %q; want 2, 1, 1", st["Seccomp"], st["Seccomp_filters"], st["NoNewPrivs"])
	}
	proc := fmt.Sprintf("/proc/%d", d.server)
	if !sameFile(t, proc+"/root", share) {
		t.Errorf("%s/root is not the shared directory", proc)
	}
	ns := func(pid, kind string) string {
		l, err := os.Readlink("/proc/" + pid + "/ns/" + kind)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	pid := strconv.Itoa(d.server)
	switch sandbox {
	case "chroot":
		if l, _ := os.Readlink(proc + "/root"); l != share {
			t.Errorf("%s/root -> %q, want %q", proc, l, share)
		}
		return
	case "namespace":
	default:
		t.Fatalf("sandbox %q", sandbox)
	}
	for _, kind := range []string{"mnt", "pid", "net", "ipc"} {
		if ns(pid, kind) == ns("self", kind) {
			t.Errorf("the server shares our %s namespace", kind)
		}
	}
	keep := slices.Clone(confine.ServerCapabilities)
	if slices.Contains(d.args, "--inode-file-handles=mandatory") {
		keep = append(keep, unix.CAP_DAC_READ_SEARCH)
	}
	if slices.Contains(d.args, "--modcaps=+sys_admin") {
		keep = append(keep, unix.CAP_SYS_ADMIN)
	}
	checkCapabilities(t, d.server, keep)
	if l, _ := os.Readlink(proc + "/root"); l != "/" {
		t.Errorf("%s/root -> %q, want / (the root of its own mount namespace)", proc, l)
	}
	// Its whole mount tree is the shared directory: one mount, on /.
	mi, err := os.ReadFile(proc + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(strings.TrimSpace(string(mi)), "\n"); len(lines) != 1 || len(strings.Fields(lines[0])) < 5 || strings.Fields(lines[0])[4] != "/" {
		t.Errorf("mount table of the server:\n%s\nwant the shared directory on / alone", mi)
	}
	// ".." from its root stays there.
	if !sameFile(t, proc+"/root/..", share) || !sameFile(t, proc+"/root/../..", share) {
		t.Errorf("%s/root/.. leaves the shared directory", proc)
	}
	// Its working directory is its /proc/self/fd, in a proc detached from any tree: walking
	// up stays in that proc.
	var fs unix.Statfs_t
	if err := unix.Statfs(proc+"/cwd/../../../..", &fs); err != nil || fs.Type != unix.PROC_SUPER_MAGIC {
		t.Errorf("%s/cwd/../../../..: %v, type %#x; want the proc file system", proc, err, fs.Type)
	}
	// That proc is read-only and holds no /proc/sys: no host sysctl can be reached through it.
	if fs.Flags&unix.ST_RDONLY == 0 {
		t.Errorf("%s/cwd/../..: the server's proc is writable (flags %#x)", proc, fs.Flags)
	}
	if _, err := os.Stat(proc + "/cwd/../../sys"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s/cwd/../../sys: %v, want it missing (proc subset=pid)", proc, err)
	}
	checkUnreachable(t, d.server, share)
}

// checkCapabilities checks that every thread of pid has exactly keep (those of them this
// process has) in its permitted, effective and bounding sets, and none inheritable or ambient.
func checkCapabilities(t *testing.T, pid int, keep []confine.Capability) {
	t.Helper()
	own, err := strconv.ParseUint(statusOf(t, "self")["CapBnd"], 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	var want uint64
	for _, c := range keep {
		want |= 1 << c
	}
	want &= own
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*", pid))
	if len(tasks) < 2 {
		t.Fatalf("%d threads of the server", len(tasks))
	}
	for _, task := range tasks {
		st := statusOf(t, strings.TrimPrefix(task, "/proc/"))
		for set, w := range map[string]uint64{"CapPrm": want, "CapEff": want, "CapBnd": want, "CapInh": 0, "CapAmb": 0} {
			got, err := strconv.ParseUint(st[set], 16, 64)
			if err != nil {
				t.Fatalf("%s %s: %q", task, set, st[set])
			}
			if got != w {
				t.Errorf("%s: %s = %016x, want %016x", task, set, got, w)
			}
		}
	}
}

// statusOf returns the fields of /proc/WHO/status.
func statusOf(t *testing.T, who string) procstatus.Status {
	t.Helper()
	s, err := procstatus.Read(who)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// checkUnreachable enters the server's mount namespace on a thread of its own and tries to
// reach, by every kind of path, a file outside the shared directory.
func checkUnreachable(t *testing.T, pid int, share string) {
	t.Helper()
	outside := filepath.Join(filepath.Dir(share), "outside-probe")
	if err := os.WriteFile(outside, []byte("secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(share, "inside-probe"), []byte("inside"), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(filepath.Join(share, "inside-probe"))
	errc := make(chan error, 1)
	go func() {
		// The thread's file system attributes are its own after unshare, and it dies with the
		// goroutine (no UnlockOSThread): nothing else ever runs in the server's namespace.
		runtime.LockOSThread()
		errc <- func() error {
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				return err
			}
			fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			if err := unix.Setns(fd, unix.CLONE_NEWNS); err != nil {
				return fmt.Errorf("setns: %w", err)
			}
			b := make([]byte, 16)
			readFile := func(p string) (string, error) {
				f, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
				if err != nil {
					return "", err
				}
				defer unix.Close(f)
				n, err := unix.Read(f, b)
				return string(b[:max(n, 0)]), err
			}
			if got, err := readFile("/inside-probe"); got != "inside" {
				return fmt.Errorf("/inside-probe in the server's namespace: %q, %v", got, err)
			}
			rel, _ := filepath.Rel("/", outside)
			for _, p := range []string{
				outside,
				"/../outside-probe",
				"/../../../../" + rel,
				"/" + rel,
				"/proc/1/root" + outside,
				"/proc/self/cwd/../../../" + rel,
			} {
				if got, err := readFile(p); err == nil || got == "secret" {
					return fmt.Errorf("%s in the server's namespace reads %q", p, got)
				}
			}
			return nil
		}()
	}()
	if err := <-errc; err != nil {
		t.Error(err)
	}
}

// TestConfinedLocksXattrs drives remote POSIX and flock locks, extended attributes and POSIX
// ACLs through a sandboxed kvfsd with seccomp kill and a thread pool, and checks each on the
// host.
func TestConfinedLocksXattrs(t *testing.T) {
	share := shareDir(t)
	d := startKvfsd(t, share, false, "--sandbox=namespace", "--seccomp=kill", "--thread-pool-size=4",
		"-o", "posix_lock,flock", "--xattr", "--posix-acl")
	checkConfined(t, d, share, "namespace")
	fe, c := dial(t, d.sock)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	host := filepath.Join(share, "f")

	cr, err := c.Create(ctx, fuse.RootID, "f", unix.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	node, fh := cr.Entry.NodeID, cr.Open.Fh

	// Extended attributes.
	if err := setxattr(ctx, c, node, "user.kvfs", []byte("v1"), 0); err != nil {
		t.Fatalf("setxattr: %v", err)
	}
	if v, _, err := c.Getxattr(ctx, node, "user.kvfs", 64); err != nil || string(v) != "v1" {
		t.Errorf("getxattr: %q, %v", v, err)
	}
	if l, _, err := c.Listxattr(ctx, node, 256); err != nil || !bytes.Contains(l, []byte("user.kvfs\x00")) {
		t.Errorf("listxattr: %q, %v", l, err)
	}
	hb := make([]byte, 64)
	if n, err := unix.Getxattr(host, "user.kvfs", hb); err != nil || string(hb[:n]) != "v1" {
		t.Errorf("host getxattr: %q, %v", hb[:max(n, 0)], err)
	}
	if err := c.Removexattr(ctx, node, "user.kvfs"); err != nil {
		t.Errorf("removexattr: %v", err)
	}
	if _, err := unix.Getxattr(host, "user.kvfs", hb); !errors.Is(err, unix.ENODATA) {
		t.Errorf("host getxattr after removexattr: %v, want ENODATA", err)
	}

	// A POSIX ACL: user 1000 gets rwx, which the mask (the group bits) allows.
	acl := aclXattr([][3]uint32{{0x01, 6, ^uint32(0)}, {0x02, 7, 1000}, {0x04, 4, ^uint32(0)}, {0x10, 7, ^uint32(0)}, {0x20, 4, ^uint32(0)}})
	if err := setxattr(ctx, c, node, "system.posix_acl_access", acl, 0); err != nil {
		t.Fatalf("set ACL: %v", err)
	}
	if n, err := unix.Getxattr(host, "system.posix_acl_access", hb); err != nil || !bytes.Equal(hb[:n], acl) {
		t.Errorf("host ACL: %x, %v; want %x", hb[:max(n, 0)], err, acl)
	}
	var st unix.Stat_t
	if err := unix.Stat(host, &st); err != nil || st.Mode&0o777 != 0o674 {
		t.Errorf("host mode after the ACL: %o, %v; want 674", st.Mode&0o777, err)
	}
	// A default ACL on a directory decides the mode of what is created in it.
	dir, err := c.Mkdir(ctx, fuse.RootID, "d", 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if err := setxattr(ctx, c, dir.NodeID, "system.posix_acl_default", acl, 0); err != nil {
		t.Fatalf("set default ACL: %v", err)
	}
	if g, err := c.Create(ctx, dir.NodeID, "g", unix.O_RDWR, 0o666); err != nil {
		t.Errorf("create under a default ACL: %v", err)
	} else {
		c.Release(ctx, g.Entry.NodeID, g.Open.Fh)
		if n, err := unix.Getxattr(filepath.Join(share, "d", "g"), "system.posix_acl_access", hb); err != nil || n == 0 {
			t.Errorf("host: d/g did not inherit the default ACL: %v", err)
		}
	}

	// POSIX locks are OFD locks on the host.
	whole := fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax, PID: 1}
	if err := c.Setlk(ctx, node, fh, 1, whole, 0, false); err != nil {
		t.Fatalf("setlk: %v", err)
	}
	hf, err := os.OpenFile(host, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer hf.Close()
	fl := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0}
	if err := unix.FcntlFlock(hf.Fd(), unix.F_OFD_GETLK, &fl); err != nil || fl.Type != unix.F_WRLCK {
		t.Errorf("host F_OFD_GETLK: type %d, %v; want the guest's write lock", fl.Type, err)
	}
	if lk, err := c.Getlk(ctx, node, fh, 2, whole); err != nil || lk.Type != unix.F_WRLCK {
		t.Errorf("getlk by another owner: %+v, %v", lk, err)
	}
	unlock := whole
	unlock.Type = unix.F_UNLCK
	if err := c.Setlk(ctx, node, fh, 1, unlock, 0, false); err != nil {
		t.Errorf("unlock: %v", err)
	}
	if err := c.Setlk(ctx, node, fh, 2, whole, 0, true); err != nil {
		t.Errorf("setlkw on a free file: %v", err)
	}
	if err := c.Setlk(ctx, node, fh, 2, unlock, 0, false); err != nil {
		t.Errorf("unlock: %v", err)
	}
	// flock locks are flock locks on the host.
	if err := c.Setlk(ctx, node, fh, 3, whole, fuse.LkFlock, false); err != nil {
		t.Fatalf("flock: %v", err)
	}
	if err := unix.Flock(int(hf.Fd()), unix.LOCK_EX|unix.LOCK_NB); !errors.Is(err, unix.EWOULDBLOCK) {
		t.Errorf("host flock while the guest holds one: %v, want EWOULDBLOCK", err)
	}
	if err := c.Setlk(ctx, node, fh, 3, unlock, fuse.LkFlock, false); err != nil {
		t.Errorf("flock unlock: %v", err)
	}
	if err := unix.Flock(int(hf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Errorf("host flock after the guest's unlock: %v", err)
	}
	unix.Flock(int(hf.Fd()), unix.LOCK_UN)
	if err := c.Release(ctx, node, fh); err != nil {
		t.Errorf("release: %v", err)
	}

	if st := d.status(t); st["Seccomp"] != "2" {
		t.Errorf("Seccomp %q at the end", st["Seccomp"])
	}
	fe.Close()
	d.wait(t)
}

// setxattr sends SETXATTR as a guest does once FUSE_SETXATTR_EXT is negotiated (--posix-acl):
// with the whole fuse_setxattr_in.
func setxattr(ctx context.Context, c *fuseclient.Client, node uint64, name string, value []byte, flags uint32) error {
	in := fuse.SetxattrIn{Size: uint32(len(value)), Flags: flags}
	_, err := c.Do(ctx, c.Encode(fuse.OpSetxattr, node, fuse.AsBytes(&in), append([]byte(name), 0), value), 4096)
	return err
}

// aclXattr encodes POSIX ACL entries (tag, perm, id) as the system.posix_acl_* value.
func aclXattr(entries [][3]uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 2)
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint16(b, uint16(e[0]))
		b = binary.LittleEndian.AppendUint16(b, uint16(e[1]))
		b = binary.LittleEndian.AppendUint32(b, e[2])
	}
	return b
}

// TestSupervisorDeath checks that the sandboxed server dies with its supervisor.
func TestSupervisorDeath(t *testing.T) {
	share := shareDir(t)
	d := startKvfsd(t, share, true, "--sandbox=namespace", "--seccomp=kill")
	if d.server == d.cmd.Process.Pid {
		t.Fatal("no sandboxed child")
	}
	d.cmd.Process.Kill()
	<-d.done
	d.waitGone(t)
}

// waitGone waits until the serving process no longer exists (or is a zombie).
func (d *daemon) waitGone(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", d.server))
		if err != nil {
			return
		}
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sandboxed server %d outlived its supervisor", d.server)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSandboxErrors checks that a sandbox that cannot be set up is a clear error, not an
// unconfined server.
func TestSandboxErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	for _, mode := range []string{"namespace", "chroot"} {
		cmd := exec.Command(kvfsdBin, "--sandbox="+mode, "--shared-dir="+missing, "--socket-path="+filepath.Join(t.TempDir(), "s"))
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), missing) {
			t.Errorf("--sandbox=%s on a missing directory: %v\n%s", mode, err, out)
		}
	}
}

// TestConfinedDAX maps files into a DAX window (the in-repo front-end plays Kata's DAX-capable
// QEMU) through a confined kvfsd: the back-end channel, the policy's xattr and FS_XFLAG_DAX
// checks (the one ioctl the filter allows) all run under seccomp kill. The policy's attribute,
// trusted.kvfs.dax, needs CAP_SYS_ADMIN, which the namespace sandbox drops unless --modcaps
// gives it back: without it, the file is not DAX.
func TestConfinedDAX(t *testing.T) {
	share := shareDir(t)
	content := bytes.Repeat([]byte("confined-dax "), 100)
	for _, name := range []string{"data", "plain"} {
		if err := os.WriteFile(filepath.Join(share, name), content, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Setxattr(filepath.Join(share, "data"), "trusted.kvfs.dax", []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	const window, mapLen = 8 << 20, 2 << 20
	t.Run("without sys_admin", func(t *testing.T) {
		d := startKvfsd(t, share, false, "--sandbox=namespace", "--seccomp=kill")
		checkConfined(t, d, share, "namespace")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		fe, err := frontend.Dial(ctx, d.sock, frontend.Options{DAXWindow: window})
		if err != nil {
			t.Fatal(err)
		}
		defer fe.Close()
		c := fuseclient.New(fe)
		if _, err := c.Init(ctx, fuseclient.LinuxInitFlags|fuseclient.DAXInitFlags); err != nil {
			t.Fatalf("INIT: %v", err)
		}
		data, err := c.Lookup(ctx, fuse.RootID, "data")
		if err != nil {
			t.Fatal(err)
		}
		if data.Attr.Flags&fuse.AttrDAX != 0 {
			t.Error("ATTR_DAX from trusted.kvfs.dax, which a server without CAP_SYS_ADMIN cannot read")
		}
	})

	d := startKvfsd(t, share, false, "--sandbox=namespace", "--seccomp=kill", "--inode-file-handles=mandatory", "--modcaps=+sys_admin")
	checkConfined(t, d, share, "namespace")

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, d.sock, frontend.Options{DAXWindow: window})
	if err != nil {
		t.Fatal(err)
	}
	c := fuseclient.New(fe)
	out, err := c.Init(ctx, fuseclient.LinuxInitFlags|fuseclient.DAXInitFlags)
	if err != nil {
		t.Fatalf("INIT: %v", err)
	}
	if f := uint64(out.Flags) | uint64(out.Flags2)<<32; f&fuseclient.DAXInitFlags != fuseclient.DAXInitFlags {
		t.Fatalf("INIT flags %#x: no DAX negotiated", f)
	}
	data, err := c.Lookup(ctx, fuse.RootID, "data")
	if err != nil {
		t.Fatal(err)
	}
	// Neither the xattr nor a rule decides for plain: kvfsd asks the host for FS_XFLAG_DAX.
	plain, err := c.Lookup(ctx, fuse.RootID, "plain")
	if err != nil {
		t.Fatal(err)
	}
	if data.Attr.Flags&fuse.AttrDAX == 0 || plain.Attr.Flags&fuse.AttrDAX != 0 {
		t.Errorf("ATTR_DAX: data %v, plain %v; want data only", data.Attr.Flags, plain.Attr.Flags)
	}
	if err := c.SetupMapping(ctx, data.NodeID, fuse.SetupmappingNoFh, 0, mapLen, fuse.SetupmappingFlagRead, mapLen); err != nil {
		t.Fatalf("SETUPMAPPING: %v", err)
	}
	if w := fe.DAXWindow(); !bytes.Equal(w[mapLen:mapLen+len(content)], content) {
		t.Error("the window does not show the file's bytes")
	}
	if err := c.RemoveMapping(ctx, data.NodeID, []fuse.RemovemappingOne{{Moffset: mapLen, Len: mapLen}}); err != nil {
		t.Fatalf("REMOVEMAPPING: %v", err)
	}
	if st := d.status(t); st["Seccomp"] != "2" {
		t.Errorf("after DAX: Seccomp %q", st["Seccomp"])
	}
	fe.Close()
	d.wait(t)
}
