package cmdline

import (
	"bufio"
	"errors"
	"io/fs"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// Listen changes the process umask: none of these tests runs in parallel.

func socketOpts(path string) *Options { return &Options{SocketPath: path, FD: -1} }

// roundTrip checks that a connection to path is accepted on l.
func roundTrip(t *testing.T, l *net.UnixListener, path string) {
	t.Helper()
	accepted := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			_, err = c.Write([]byte("ok\n"))
			c.Close()
		}
		accepted <- err
	}()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	defer c.Close()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || line != "ok\n" {
		t.Fatalf("read from %s: %q, %v", path, line, err)
	}
	if err := <-accepted; err != nil {
		t.Fatalf("accept: %v", err)
	}
}

func currentUmask() int {
	m := unix.Umask(0o22)
	unix.Umask(m)
	return m
}

func TestListenSocketPath(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	umask := currentUmask()
	l, release, err := Listen(socketOpts(path))
	if err != nil {
		t.Fatal(err)
	}
	if got := currentUmask(); got != umask {
		t.Errorf("umask after Listen = %#o, want %#o", got, umask)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %v, want a socket with mode 0600", fi.Mode())
	}
	pid, err := os.ReadFile(path + ".pid")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(pid), strconv.Itoa(os.Getpid())+"\n"; got != want {
		t.Errorf("pidfile holds %q, want %q", got, want)
	}
	roundTrip(t, l, path)

	release()
	for _, p := range []string{path, path + ".pid"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after release: %v, want it removed", p, err)
		}
	}
	// A second call must not remove a pidfile that is no longer ours.
	other, err := os.Create(path + ".pid")
	if err != nil {
		t.Fatal(err)
	}
	other.Close()
	release()
	if _, err := os.Lstat(path + ".pid"); err != nil {
		t.Errorf("a second release removed another pidfile: %v", err)
	}
}

func TestListenReplacesStaleSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	stale.Close()
	// A pidfile left by a killed kvfsd is not locked and is taken over.
	if err := os.WriteFile(path+".pid", []byte("99999999\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	l, release, err := Listen(socketOpts(path))
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer release()
	roundTrip(t, l, path)
}

func TestListenRefusesNonSockets(t *testing.T) {
	tests := []struct {
		name   string
		create func(path string) error
		want   string
	}{
		{"regular file", func(p string) error { return os.WriteFile(p, []byte("precious"), 0o644) }, "it is a regular file, not a socket"},
		{"directory", func(p string) error { return os.Mkdir(p, 0o755) }, "it is a directory, not a socket"},
		{"named pipe", func(p string) error { return unix.Mkfifo(p, 0o600) }, "it is a named pipe, not a socket"},
		{"symlink to a socket", func(p string) error {
			target := p + ".target"
			l, err := net.ListenUnix("unix", &net.UnixAddr{Name: target, Net: "unix"})
			if err != nil {
				return err
			}
			l.SetUnlinkOnClose(false)
			l.Close()
			return os.Symlink(target, p)
		}, "it is a symbolic link, not a socket"},
		{"dangling symlink", func(p string) error { return os.Symlink("/nonexistent", p) }, "it is a symbolic link, not a socket"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "vhost-fs.sock")
			if err := tt.create(path); err != nil {
				t.Fatal(err)
			}
			before, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			l, _, err := Listen(socketOpts(path))
			if err == nil {
				l.Close()
				t.Fatal("Listen succeeded")
			}
			if !strings.Contains(err.Error(), "refusing to replace "+path) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not say %q", err, tt.want)
			}
			after, err := os.Lstat(path)
			if err != nil || !os.SameFile(before, after) {
				t.Errorf("%s was touched: %v", path, err)
			}
			if _, err := os.Lstat(path + ".pid"); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("pidfile left behind after a failure: %v", err)
			}
		})
	}
}

func TestListenPidfileLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	l, release, err := Listen(socketOpts(path))
	if err != nil {
		t.Fatal(err)
	}

	_, _, err = Listen(socketOpts(path))
	if err == nil {
		t.Fatal("a second Listen on the same socket succeeded")
	}
	want := "socket " + path + " is in use: process " + strconv.Itoa(os.Getpid()) + " holds the lock on " + path + ".pid"
	if err.Error() != want {
		t.Errorf("second Listen: %q, want %q", err, want)
	}
	// The first listener is untouched.
	roundTrip(t, l, path)

	release()
	l, release, err = Listen(socketOpts(path))
	if err != nil {
		t.Fatalf("Listen after release: %v", err)
	}
	defer release()
	roundTrip(t, l, path)
}

func TestListenPidfileMustBeAFile(t *testing.T) {
	for name, create := range map[string]func(p string) error{
		"symlink":   func(p string) error { return os.Symlink(filepath.Join(filepath.Dir(p), "elsewhere"), p) },
		"directory": func(p string) error { return os.Mkdir(p, 0o700) },
		"fifo":      func(p string) error { return unix.Mkfifo(p, 0o600) },
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "vhost-fs.sock")
			if err := create(path + ".pid"); err != nil {
				t.Fatal(err)
			}
			if l, _, err := Listen(socketOpts(path)); err == nil {
				l.Close()
				t.Fatalf("Listen succeeded with a %s as pidfile", name)
			} else if !strings.Contains(err.Error(), "pidfile") {
				t.Errorf("error %q does not mention the pidfile", err)
			}
			if _, err := os.Lstat(filepath.Join(filepath.Dir(path), "elsewhere")); !errors.Is(err, fs.ErrNotExist) {
				t.Error("Listen followed the pidfile symlink")
			}
			if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Error("socket created despite the pidfile error")
			}
		})
	}
}

func TestListenSocketGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another group needs root")
	}
	g, err := user.LookupGroup("daemon")
	if err != nil {
		t.Skipf("no group to test with: %v", err)
	}
	gid, _ := strconv.Atoi(g.Gid)
	for _, name := range []string{g.Name, g.Gid} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "vhost-fs.sock")
			o := socketOpts(path)
			o.SocketGroup = name
			l, release, err := Listen(o)
			if err != nil {
				t.Fatal(err)
			}
			defer release()
			fi, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o660 {
				t.Errorf("socket mode = %v, want a socket with mode 0660", fi.Mode())
			}
			if got := int(fi.Sys().(*syscall.Stat_t).Gid); got != gid {
				t.Errorf("socket group = %d, want %d", got, gid)
			}
			roundTrip(t, l, path)
		})
	}
}

func TestListenUnknownGroup(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	o := socketOpts(path)
	o.SocketGroup = "no-such-group-kvfs"
	if l, _, err := Listen(o); err == nil {
		l.Close()
		t.Fatal("Listen succeeded with an unknown group")
	} else if !strings.Contains(err.Error(), "no-such-group-kvfs") {
		t.Errorf("error %q does not name the group", err)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 0 {
		t.Errorf("Listen left %v behind", entries)
	}
}

func TestListenPathTooLong(t *testing.T) {
	path := filepath.Join(t.TempDir(), strings.Repeat("x", 120))
	if l, _, err := Listen(socketOpts(path)); err == nil {
		l.Close()
		t.Fatal("Listen succeeded with a 120-byte name")
	} else if !strings.Contains(err.Error(), "too long") {
		t.Errorf("error %q does not say the path is too long", err)
	}
}

func TestListenAtSignIsAFile(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	l, release, err := Listen(socketOpts("@vhost-fs.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if fi, err := os.Lstat(filepath.Join(dir, "@vhost-fs.sock")); err != nil || fi.Mode().Type() != fs.ModeSocket {
		t.Fatalf("no socket file @vhost-fs.sock: %v", err)
	}
	roundTrip(t, l, filepath.Join(dir, "@vhost-fs.sock"))
}

// dupListenerFD returns a raw duplicate of l's descriptor, as a parent would pass one.
func dupListenerFD(t *testing.T, l syscall.Conn) int {
	t.Helper()
	rc, err := l.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	var dupErr error
	if err := rc.Control(func(s uintptr) { fd, dupErr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		t.Fatal(err)
	}
	if dupErr != nil {
		t.Fatal(dupErr)
	}
	return fd
}

func isOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

func TestListenFD(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	parent, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	parent.SetUnlinkOnClose(false)
	fd := dupListenerFD(t, parent)
	parent.Close()

	l, release, err := Listen(&Options{FD: fd})
	if err != nil {
		t.Fatal(err)
	}
	if isOpen(fd) {
		t.Errorf("fd %d is still open after Listen took it over", fd)
	}
	if got := l.Addr().String(); got != path {
		t.Errorf("listener address = %q, want %q", got, path)
	}
	roundTrip(t, l, path)
	release()
	// The socket's path belongs to whoever created it (the Kata runtime removes it).
	if _, err := os.Lstat(path); err != nil {
		t.Errorf("release removed %s: %v", path, err)
	}
	if _, err := net.Dial("unix", path); err == nil {
		t.Error("the socket still accepts connections after release")
	}
}

func TestListenFDRefused(t *testing.T) {
	dir := t.TempDir()
	socket := func(domain, typ int, bind, listen bool) func(t *testing.T) int {
		return func(t *testing.T) int {
			fd, err := unix.Socket(domain, typ|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			if bind {
				if err := unix.Bind(fd, &unix.SockaddrUnix{Name: filepath.Join(dir, t.Name()[len("TestListenFDRefused/"):])}); err != nil {
					t.Fatal(err)
				}
			}
			if listen {
				if err := unix.Listen(fd, 1); err != nil {
					t.Fatal(err)
				}
			}
			return fd
		}
	}
	tests := []struct {
		name string
		fd   func(t *testing.T) int
		want string
	}{
		{"closed", func(*testing.T) int { return 1 << 20 }, "not an open file descriptor"},
		{"pipe", func(t *testing.T) int {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(p[1]) })
			return p[0]
		}, "not a socket but a named pipe"},
		{"regular file", func(t *testing.T) int {
			fd, err := unix.Open(filepath.Join(dir, "file"), unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			return fd
		}, "not a socket but a regular file"},
		{"directory", func(t *testing.T) int {
			fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			return fd
		}, "not a socket but a directory"},
		{"connected socket pair", func(t *testing.T) int {
			p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(p[1]) })
			return p[0]
		}, "a Unix socket that is not listening"},
		{"bound stream socket", socket(unix.AF_UNIX, unix.SOCK_STREAM, true, false), "a Unix socket that is not listening"},
		{"datagram socket", socket(unix.AF_UNIX, unix.SOCK_DGRAM, true, false), "a SOCK_DGRAM socket, not SOCK_STREAM"},
		{"listening seqpacket socket", socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, true, true), "a SOCK_SEQPACKET socket, not SOCK_STREAM"},
		{"listening TCP socket", func(t *testing.T) int {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Skipf("no loopback TCP: %v", err)
			}
			defer l.Close()
			return dupListenerFD(t, l.(*net.TCPListener))
		}, "an AF_INET socket, not AF_UNIX"},
		{"UDP socket", socket(unix.AF_INET, unix.SOCK_DGRAM, false, false), "an AF_INET socket, not AF_UNIX"},
		{"netlink socket", socket(unix.AF_NETLINK, unix.SOCK_RAW, false, false), "not an AF_UNIX socket"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fd := tt.fd(t)
			l, _, err := Listen(&Options{FD: fd})
			if err == nil {
				l.Close()
				t.Fatal("Listen succeeded")
			}
			want := "--fd=" + strconv.Itoa(fd) + ": " + tt.want
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not contain %q", err, want)
			}
			if fd < 1<<20 {
				if !isOpen(fd) {
					t.Errorf("Listen closed fd %d although it refused it", fd)
				}
				unix.Close(fd)
			}
		})
	}
}

// TestListenFDChild runs Kata's command line in a child that inherits the listening socket as
// fd 3, as the Kata Go runtime starts virtiofsd.
func TestListenFDChild(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "vhost-fs.sock")
	parent, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer parent.Close()
	f, err := parent.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	c := startChild(t, "listen", []*os.File{f},
		"--syslog", "--cache=auto", "--shared-dir="+dir, "--fd=3", "--thread-pool-size=1", "--announce-submounts")
	if line := c.line(t); line != "ready" {
		t.Fatalf("child: %q", line)
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	greeting, err := bufio.NewReader(conn).ReadString('\n')
	if want := "hello from pid " + strconv.Itoa(c.cmd.Process.Pid) + "\n"; err != nil || greeting != want {
		t.Fatalf("greeting %q, %v; want %q", greeting, err, want)
	}
	if code := c.wait(t); code != 0 {
		t.Errorf("child exited with %d", code)
	}
}

// TestListenFDChildNotASocket: the child inherits a pipe as fd 3 and refuses it.
func TestListenFDChildNotASocket(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	c := startChild(t, "listen", []*os.File{r}, "--shared-dir=/", "--fd=3")
	if line, want := c.line(t), "listen: --fd=3: not a socket but a named pipe"; line != want {
		t.Errorf("child said %q, want %q", line, want)
	}
	if code := c.wait(t); code != 1 {
		t.Errorf("child exited with %d, want 1", code)
	}
}

// TestListenSocketPathChildren: two processes on one socket path, as two kvfsd would be.
func TestListenSocketPathChildren(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vhost-fs.sock")
	first := startChild(t, "listen", nil, "--shared-dir=/", "--socket-path", path)
	if line := first.line(t); line != "ready" {
		t.Fatalf("first child: %q", line)
	}
	second := startChild(t, "listen", nil, "--shared-dir=/", "--socket-path", path)
	want := "listen: socket " + path + " is in use: process " + strconv.Itoa(first.cmd.Process.Pid) + " holds the lock on " + path + ".pid"
	if line := second.line(t); line != want {
		t.Errorf("second child: %q, want %q", line, want)
	}
	if code := second.wait(t); code != 1 {
		t.Errorf("second child exited with %d, want 1", code)
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if greeting, _ := bufio.NewReader(conn).ReadString('\n'); !strings.HasPrefix(greeting, "hello from pid "+strconv.Itoa(first.cmd.Process.Pid)) {
		t.Errorf("greeting %q", greeting)
	}
	if code := first.wait(t); code != 0 {
		t.Errorf("first child exited with %d", code)
	}
	for _, p := range []string{path, path + ".pid"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after the child exited: %v", p, err)
		}
	}
}

// TestLockedPidfileReplaced: a lock won on a pidfile that an exiting kvfsd unlinked, or that
// was replaced since we opened it, does not count.
func TestLockedPidfileReplaced(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "vhost-fs.sock.pid")
	for name, replace := range map[string]func() error{
		"unlinked": func() error { return os.Remove(path) },
		"replaced": func() error {
			if err := os.WriteFile(path+".new", nil, 0o600); err != nil {
				return err
			}
			return os.Rename(path+".new", path)
		},
	} {
		t.Run(name, func(t *testing.T) {
			f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if err := replace(); err != nil {
				t.Fatal(err)
			}
			if err := lockedPidfile(f, path); !errors.Is(err, errPidfileReplaced) {
				t.Errorf("lockedPidfile = %v, want errPidfileReplaced", err)
			}
		})
	}
}
