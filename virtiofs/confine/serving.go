package confine

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// A server confined in namespaces drops its capabilities before its program starts, from the
// thread that starts it (StartWithCapabilities), so that every thread has only what serving
// needs in any build of the binary. Pivoting into the shared directory needs CAP_SYS_ADMIN,
// though, so the process that pivots is not the server: PID 1 of the namespaces (the setup
// process) starts the server while the host's tree is still its root (the server's dynamic
// loader, in a binary built with cgo, finds its libraries there), waits until the server holds
// the namespace's /proc/self/fd as its working directory, pivots (pivot_root moves the root of
// every process of the mount namespace, the server's too) and tells the server, which checks
// that its root is the shared directory before it serves. StartServing is the setup process's
// half of that handshake, EnterRoot the server's.

// handoffEnv carries to the server StartServing starts the descriptors of its two handshake
// pipes: "MOVED,DETACHED". The server writes a byte to MOVED once its working directory is in
// /proc/self/fd; the setup process writes one to DETACHED once it has pivoted.
const handoffEnv = "KVFS_CONFINE_HANDOFF"

// ErrServerEnded is StartServing's error when the server exited before the handshake ended:
// the channel StartServing returned then delivers how (cmd.Wait's error).
var ErrServerEnded = errors.New("the server exited before it was confined")

// StartServing is the setup process's half of a confined server's start, in a process started
// in Namespaces that has run PrepareMounts: it starts cmd, the server, with only the
// capabilities keep, waits until the server has called EnterRoot, pivots into dir and tells it.
// It appends the handshake's pipes to cmd.ExtraFiles and its descriptors to cmd.Env (nil
// cmd.Env is taken as this process's environment). It returns once the server may serve, with a
// channel that delivers cmd.Wait's error when the server ends. On ErrServerEnded the channel
// delivers it at once; on any other error the server, if it started, has been killed and
// waited for.
func StartServing(cmd *exec.Cmd, dir string, keep []Capability) (<-chan error, error) {
	movedR, movedW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer movedR.Close()
	detachedR, detachedW, err := os.Pipe()
	if err != nil {
		movedW.Close()
		return nil, err
	}
	defer detachedW.Close()
	first := 3 + len(cmd.ExtraFiles)
	cmd.ExtraFiles = append(cmd.ExtraFiles, movedW, detachedR)
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, fmt.Sprintf("%s=%d,%d", handoffEnv, first, first+1))
	err = StartWithCapabilities(cmd, keep)
	movedW.Close()
	detachedR.Close()
	if err != nil {
		return nil, fmt.Errorf("start the server: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	if _, err := movedR.Read(make([]byte, 1)); err != nil {
		return done, ErrServerEnded
	}
	if err := PivotRoot(dir); err != nil {
		_ = cmd.Process.Kill()
		<-done
		return nil, err
	}
	if _, err := detachedW.Write([]byte{1}); err != nil {
		return done, ErrServerEnded
	}
	return done, nil
}

// EnterRoot is the server's half of StartServing, called before it opens anything of the shared
// directory: it moves its working directory into the namespace's /proc/self/fd (ProcSelfFd then
// reaches it), tells the setup process, waits until that has pivoted into dir, and checks that
// its root is now dir. It removes the handshake's variable from the environment.
func EnterRoot(dir string) error {
	v, ok := os.LookupEnv(handoffEnv)
	if !ok {
		return fmt.Errorf("confined server: no %s in the environment: not started by StartServing", handoffEnv)
	}
	os.Unsetenv(handoffEnv)
	movedFD, detachedFD, err := parseHandoff(v)
	if err != nil {
		return err
	}
	moved, detached := os.NewFile(uintptr(movedFD), "moved"), os.NewFile(uintptr(detachedFD), "detached")
	defer moved.Close()
	defer detached.Close()
	var want unix.Stat_t
	if err := unix.Stat(dir, &want); err != nil {
		return fmt.Errorf("shared directory %s: %w", dir, err)
	}
	if err := os.Chdir("/proc/self/fd"); err != nil {
		return fmt.Errorf("move to /proc/self/fd: %w", err)
	}
	if _, err := moved.Write([]byte{1}); err != nil {
		return fmt.Errorf("handshake with the setup process: %w", err)
	}
	if _, err := detached.Read(make([]byte, 1)); err != nil {
		return fmt.Errorf("the setup process did not pivot into the shared directory: %w", err)
	}
	return checkRoot(&want)
}

func parseHandoff(v string) (moved, detached int, err error) {
	a, b, ok := strings.Cut(v, ",")
	moved, err1 := strconv.Atoi(a)
	detached, err2 := strconv.Atoi(b)
	if !ok || err1 != nil || err2 != nil || moved < 3 || detached < 3 || moved == detached {
		return 0, 0, fmt.Errorf("confined server: %s=%q is not two descriptors", handoffEnv, v)
	}
	return moved, detached, nil
}

// serverEnv marks the server Setup starts; its value is the descriptor of the listening socket
// it inherits.
const serverEnv = "KVFSD_SANDBOX_SERVER"

// ServingChild reports whether this process is the server of Setup and, if so, the descriptor
// of the listening socket it inherited; the server must call EnterRoot before it serves. It
// removes the marker from the environment. As with Child, the marker alone is not trusted: the
// process must also be the child of PID 1 of its own PID namespace.
func ServingChild() (listenFD int, ok bool) {
	v, set := os.LookupEnv(serverEnv)
	if !set {
		return -1, false
	}
	os.Unsetenv(serverEnv)
	if v != strconv.Itoa(childListenFD) || os.Getppid() != 1 || os.Getpid() == 1 {
		return -1, false
	}
	return childListenFD, true
}

// Setup is PID 1 of a --sandbox=namespace kvfsd (the child of Supervise): it prepares the
// namespace's mounts, starts the executable again with args as the server (ServingChild) with
// the listening socket at listenFD as its descriptor 3 and only the capabilities keep, pivots
// into dir once the server is ready for it (StartServing), forwards SIGTERM, SIGINT and SIGHUP
// to the server and returns its exit status, as Supervise does. It runs none of the server's
// code and keeps its own capabilities; as PID 1 it ends the namespace, the server with it,
// when it dies.
func Setup(dir string, args []string, listenFD int, stdout, stderr io.Writer, keep []Capability) (int, error) {
	if err := PrepareMounts(); err != nil {
		return 1, err
	}
	exe, err := os.Executable()
	if err != nil {
		return 1, fmt.Errorf("--sandbox=namespace: %w", err)
	}
	l := os.NewFile(uintptr(listenFD), "listener")
	defer l.Close()
	cmd := exec.Command(exe, args...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), serverEnv+"="+strconv.Itoa(childListenFD))
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.ExtraFiles = []*os.File{l}

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)
	done, err := StartServing(cmd, dir, keep)
	if errors.Is(err, ErrServerEnded) {
		werr := <-done
		return exitStatus(cmd.ProcessState, werr)
	}
	if err != nil {
		return 1, err
	}
	l.Close()
	err = ForwardUntilExit(cmd, sigs, done)
	return exitStatus(cmd.ProcessState, err)
}
