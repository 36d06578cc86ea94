package cmdline

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/user"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// maxSocketPath is the longest path bind(2) takes: sun_path holds 108 bytes with the final NUL.
const maxSocketPath = len(unix.RawSockaddrUnix{}.Path) - 1

// umaskMu serializes Listen's umask changes, which apply to the whole process.
var umaskMu sync.Mutex

// Listen returns the vhost-user listener o asks for, and a function that releases it.
//
// With o.SocketPath, Listen first takes the pidfile lock SocketPath+".pid" (flock; the file holds
// kvfsd's pid), so a second kvfsd on the same socket fails instead of stealing it. It then
// removes what is at SocketPath if, and only if, it is a socket, and creates the socket with mode
// 0600, or 0660 and group o.SocketGroup. Listen changes the process umask while it binds the
// socket: call it before other goroutines create files. The release function closes the
// listener, removes the socket and the pidfile, and drops the lock.
//
// With o.FD, the descriptor must be a listening AF_UNIX SOCK_STREAM socket. On success Listen
// takes it over (it is closed; the listener holds a close-on-exec duplicate) and the release
// function closes the listener, leaving the socket's path, if any, to whoever created it. On
// failure the descriptor is left open.
//
// The release function may be called more than once; only the first call does anything.
func Listen(o *Options) (*net.UnixListener, func(), error) {
	switch {
	case o.SocketPath != "" && o.FD >= 0:
		return nil, nil, errors.New("--socket-path and --fd are mutually exclusive")
	case o.SocketPath != "":
		return listenPath(o.SocketPath, o.SocketGroup)
	case o.FD >= 0:
		return listenFD(o.FD)
	}
	return nil, nil, errors.New("no vhost-user socket: give --socket-path=PATH or --fd=FD")
}

func listenPath(path, group string) (_ *net.UnixListener, _ func(), err error) {
	if strings.HasPrefix(path, "@") {
		// Go would take a leading @ to mean the abstract namespace; the option names a file.
		path = "./" + path
	}
	if len(path) > maxSocketPath {
		return nil, nil, fmt.Errorf("socket path %s is too long: %d bytes, at most %d", path, len(path), maxSocketPath)
	}
	gid := -1
	if group != "" {
		if gid, err = lookupGroup(group); err != nil {
			return nil, nil, err
		}
	}

	unlock, err := lockPidfile(path + ".pid")
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			unlock()
		}
	}()

	if err := removeStaleSocket(path); err != nil {
		return nil, nil, err
	}
	mode := os.FileMode(0o600)
	if gid >= 0 {
		mode = 0o660
	}
	l, err := listenUnixMode(path, mode)
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	// The umask already gave the socket its mode, unless a default ACL on the directory
	// widened it.
	if err := os.Chmod(path, mode); err != nil {
		return nil, nil, fmt.Errorf("set the mode of socket %s: %w", path, err)
	}
	if gid >= 0 {
		if err := os.Lchown(path, -1, gid); err != nil {
			return nil, nil, fmt.Errorf("give socket %s to group %s: %w", path, group, err)
		}
	}
	release := sync.OnceFunc(func() {
		l.Close() // removes the socket
		unlock()
	})
	return l, release, nil
}

// listenUnixMode creates a listening socket at path whose mode is at most mode.
func listenUnixMode(path string, mode os.FileMode) (*net.UnixListener, error) {
	umaskMu.Lock()
	defer umaskMu.Unlock()
	// Keep this goroutine on one thread: a thread that unshared its file system attributes
	// (CLONE_FS) would have its own umask.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	old := unix.Umask(int(0o777 &^ mode))
	defer unix.Umask(old)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	return l, nil
}

// removeStaleSocket removes the socket at path, left by an earlier kvfsd or virtiofsd. Anything
// but a socket is left alone and is an error.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("refusing to replace %s: it is a %s, not a socket", path, describeType(fi.Mode()))
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	return nil
}

func describeType(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "regular file"
	case fs.ModeDir:
		return "directory"
	case fs.ModeSymlink:
		return "symbolic link"
	case fs.ModeNamedPipe:
		return "named pipe"
	case fs.ModeDevice:
		return "block device"
	case fs.ModeDevice | fs.ModeCharDevice:
		return "character device"
	}
	return "file of mode " + m.String()
}

// lookupGroup returns the ID of a group given by name, or by number.
func lookupGroup(name string) (int, error) {
	g, err := user.LookupGroup(name)
	if err != nil {
		var errID error
		if g, errID = user.LookupGroupId(name); errID != nil {
			return -1, fmt.Errorf("socket group: %w", err)
		}
	}
	return strconv.Atoi(g.Gid)
}

// lockPidfile takes an exclusive flock on the pidfile at path, creating it if needed, and writes
// the process ID into it. unlock removes the file and drops the lock.
func lockPidfile(path string) (unlock func(), err error) {
	// A kvfsd that is shutting down unlinks its pidfile while still holding the lock. If we
	// opened that file just before, our lock, once we get it, is on a file nobody else will
	// look at: check that the locked file is still the one at path, and start over if not.
	for range 10 {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, fmt.Errorf("open pidfile: %w", err)
		}
		if err := lockedPidfile(f, path); err != nil {
			f.Close()
			if errors.Is(err, errPidfileReplaced) {
				continue
			}
			return nil, err
		}
		unlock := func() {
			os.Remove(path)
			f.Close()
		}
		if err := f.Truncate(0); err != nil {
			unlock()
			return nil, fmt.Errorf("write pidfile %s: %w", path, err)
		}
		if _, err := f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0); err != nil {
			unlock()
			return nil, fmt.Errorf("write pidfile %s: %w", path, err)
		}
		return unlock, nil
	}
	return nil, fmt.Errorf("pidfile %s keeps being replaced", path)
}

var errPidfileReplaced = errors.New("pidfile replaced")

// lockedPidfile locks f, opened at path.
func lockedPidfile(f *os.File, path string) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("pidfile %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return fmt.Errorf("pidfile %s is not a regular file", path)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder := "another process"
			if b, err := os.ReadFile(path); err == nil {
				if pid := string(bytes.TrimSpace(b)); pid != "" {
					holder = "process " + pid
				}
			}
			return fmt.Errorf("socket %s is in use: %s holds the lock on %s", strings.TrimSuffix(path, ".pid"), holder, path)
		}
		return fmt.Errorf("lock pidfile %s: %w", path, err)
	}
	var now unix.Stat_t
	if err := unix.Stat(path, &now); err != nil || now.Dev != st.Dev || now.Ino != st.Ino {
		return errPidfileReplaced
	}
	return nil
}

func listenFD(fd int) (*net.UnixListener, func(), error) {
	if err := checkListeningUnixSocket(fd); err != nil {
		return nil, nil, fmt.Errorf("--fd=%d: %w", fd, err)
	}
	// Wrap a duplicate so that, on failure, fd is as it was; net.FileListener duplicates again.
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("--fd=%d: %w", fd, err)
	}
	f := os.NewFile(uintptr(dup), "fd "+strconv.Itoa(fd))
	ln, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return nil, nil, fmt.Errorf("--fd=%d: %w", fd, err)
	}
	ul, ok := ln.(*net.UnixListener)
	if !ok {
		ln.Close()
		return nil, nil, fmt.Errorf("--fd=%d: not a Unix socket listener (%T)", fd, ln)
	}
	// Whoever created the socket removes its path.
	ul.SetUnlinkOnClose(false)
	unix.Close(fd)
	return ul, sync.OnceFunc(func() { ul.Close() }), nil
}

// checkListeningUnixSocket says what, if anything, makes fd unfit to accept vhost-user
// connections on.
func checkListeningUnixSocket(fd int) error {
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	switch {
	case errors.Is(err, unix.EBADF):
		return errors.New("not an open file descriptor")
	case errors.Is(err, unix.ENOTSOCK):
		var st unix.Stat_t
		if unix.Fstat(fd, &st) == nil {
			return fmt.Errorf("not a socket but a %s", describeType(fileModeType(st.Mode)))
		}
		return errors.New("not a socket")
	case err != nil:
		return fmt.Errorf("getsockopt SO_TYPE: %w", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil && !errors.Is(err, unix.EAFNOSUPPORT) {
		return fmt.Errorf("getsockname: %w", err)
	}
	switch sa.(type) {
	case *unix.SockaddrUnix:
	case *unix.SockaddrInet4:
		return errors.New("an AF_INET socket, not AF_UNIX")
	case *unix.SockaddrInet6:
		return errors.New("an AF_INET6 socket, not AF_UNIX")
	default:
		return errors.New("not an AF_UNIX socket")
	}
	if typ != unix.SOCK_STREAM {
		return fmt.Errorf("a %s socket, not SOCK_STREAM", socketTypeName(typ))
	}
	listening, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	if err != nil {
		return fmt.Errorf("getsockopt SO_ACCEPTCONN: %w", err)
	}
	if listening == 0 {
		return errors.New("a Unix socket that is not listening (the parent must bind and listen before passing it)")
	}
	return nil
}

func socketTypeName(typ int) string {
	switch typ {
	case unix.SOCK_DGRAM:
		return "SOCK_DGRAM"
	case unix.SOCK_SEQPACKET:
		return "SOCK_SEQPACKET"
	case unix.SOCK_RAW:
		return "SOCK_RAW"
	}
	return "type " + strconv.Itoa(typ)
}

// fileModeType converts the S_IFMT bits of a stat mode to an fs.FileMode type.
func fileModeType(m uint32) fs.FileMode {
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		return fs.ModeDir
	case unix.S_IFLNK:
		return fs.ModeSymlink
	case unix.S_IFIFO:
		return fs.ModeNamedPipe
	case unix.S_IFBLK:
		return fs.ModeDevice
	case unix.S_IFCHR:
		return fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFSOCK:
		return fs.ModeSocket
	}
	return 0
}
