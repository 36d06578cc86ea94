package confine

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Mode is a --sandbox mode.
type Mode string

// The --sandbox modes.
const (
	SandboxNamespace Mode = "namespace"
	SandboxChroot    Mode = "chroot"
	SandboxNone      Mode = "none"
)

// ParseMode accepts namespace, chroot and none.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case SandboxNamespace, SandboxChroot, SandboxNone:
		return m, nil
	}
	return "", fmt.Errorf("invalid sandbox mode %q: want namespace, chroot or none", s)
}

// ProcSelfFd is what a confined server passes as virtiofs.Config.ProcSelfFd: after
// EnterRoot or Chroot the working directory is /proc/self/fd.
const ProcSelfFd = "."

// childEnv marks the child Supervise starts; its value is the descriptor of the listening
// socket the child inherits.
const childEnv = "KVFSD_SANDBOX_CHILD"

// childListenFD is the descriptor number of the listening socket in the child: the first of
// exec.Cmd.ExtraFiles.
const childListenFD = 3

// Namespaces are the namespaces of the sandbox, as clone flags: its own mount tree, process
// IDs, (empty) network and System V IPC. A process started in them is the PID 1 Setup and
// StartServing expect.
const Namespaces = unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWNET | unix.CLONE_NEWIPC

// Child reports whether this process is the child of Supervise (PID 1 of the namespaces) and,
// if so, the descriptor of the listening socket it inherited. It removes the marker from the
// environment.
// The marker alone is not trusted: the process must also be PID 1 of its own PID namespace,
// which no kvfsd started by anyone else is.
func Child() (listenFD int, ok bool) {
	v, set := os.LookupEnv(childEnv)
	if !set {
		return -1, false
	}
	os.Unsetenv(childEnv)
	if v != strconv.Itoa(childListenFD) || os.Getpid() != 1 {
		return -1, false
	}
	return childListenFD, true
}

// UserNamespace is a user namespace for the sandbox (virtiofsd's --uid-map and --gid-map):
// its uid and gid mappings, each a line of /proc/PID/uid_map (ids inside, ids outside, count),
// which must map the ids 0 inside: the sandbox runs as the namespace's root.
type UserNamespace struct {
	UIDs, GIDs []syscall.SysProcIDMap
}

// Supervise runs the current executable again with args in new namespaces (Namespaces, and a
// user namespace with userns's mappings if it is not nil: the others are then that user
// namespace's, and the server's capabilities reach only the files of ids it maps), the
// listening socket l as its descriptor 3 and the given stdio, and waits for it. It forwards
// SIGTERM, SIGINT and SIGHUP to the child, and returns the child's exit status, or 128 plus
// the number of the signal that killed it, with an error saying so. The child gets SIGKILL
// should the calling thread die (Pdeathsig): Supervise keeps its goroutine on that thread.
//
// The child must call Child first, then Setup, which starts the server.
func Supervise(args []string, l *os.File, userns *UserNamespace, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	// Pdeathsig follows the thread that forked, not the process: keep to it until the end.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	// The executable's path rather than /proc/self/exe, so that the child's name (comm) is
	// the binary's, as ps and the audit log show it.
	exe, err := os.Executable()
	if err != nil {
		return 1, fmt.Errorf("--sandbox=namespace: %w", err)
	}
	cmd := exec.Command(exe, args...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), childEnv+"="+strconv.Itoa(childListenFD))
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, stdout, stderr
	cmd.ExtraFiles = []*os.File{l}
	// A process group of its own: a terminal's ^C reaches the supervisor alone, which forwards
	// it once.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: Namespaces, Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if userns != nil {
		// The maps are written by this process, which needs CAP_SETUID and CAP_SETGID for
		// ids other than its own; setgroups stays denied in the namespace (kvfsd never
		// calls it).
		cmd.SysProcAttr.Cloneflags |= unix.CLONE_NEWUSER
		cmd.SysProcAttr.UidMappings, cmd.SysProcAttr.GidMappings = userns.UIDs, userns.GIDs
		// Root of the namespace (which the maps must give an id), so that it keeps its
		// capabilities there across the exec.
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: 0, Gid: 0, NoSetGroups: true}
	}

	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		if errors.Is(err, unix.EPERM) {
			return 1, fmt.Errorf("--sandbox=namespace: cannot create namespaces (%w): it needs CAP_SYS_ADMIN; use --sandbox=chroot or --sandbox=none", err)
		}
		return 1, fmt.Errorf("--sandbox=namespace: start the sandboxed process: %w", err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	err = ForwardUntilExit(cmd, sigs, done)
	return exitStatus(cmd.ProcessState, err)
}

// ForwardUntilExit passes each signal that arrives on sigs on to cmd until cmd has exited,
// which done (cmd.Wait's result) tells, and returns cmd.Wait's error: the wait of a process
// that supervises another.
func ForwardUntilExit(cmd *exec.Cmd, sigs <-chan os.Signal, done <-chan error) error {
	for {
		select {
		case s := <-sigs:
			_ = cmd.Process.Signal(s)
		case err := <-done:
			return err
		}
	}
}

// exitStatus turns the end of the child into the supervisor's exit status.
func exitStatus(ps *os.ProcessState, err error) (int, error) {
	if ps == nil {
		return 1, fmt.Errorf("sandboxed process: %w", err)
	}
	ws, ok := ps.Sys().(syscall.WaitStatus)
	switch {
	case !ok:
		return 1, fmt.Errorf("sandboxed process: %v", ps)
	case ws.Signaled() && ws.Signal() == syscall.SIGSYS:
		return 128 + int(ws.Signal()), errors.New("sandboxed process killed by SIGSYS: it made a system call outside the seccomp allowlist (run with --seccomp=log and read the kernel log, dmesg, for type=1326 records)")
	case ws.Signaled():
		return 128 + int(ws.Signal()), fmt.Errorf("sandboxed process killed by %v", ws.Signal())
	}
	return ws.ExitStatus(), nil
}

// PrepareMounts is the first half of entering the namespaces, for a process started in
// Namespaces: it makes the mount tree a recursive slave of the host's and mounts a proc for its
// PID namespace over /proc. A process that opens /proc/self/fd afterwards, and keeps it as its
// working directory, reaches it once PivotRoot has taken the host's tree away.
func PrepareMounts() error {
	// Slave, not private: mounts the host adds under the shared directory later must still
	// reach us, and nothing we mount may reach the host.
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("--sandbox=namespace: make / a recursive slave mount: %w", err)
	}
	// The proc the server keeps (its working directory) is read-only and, where the kernel has
	// subset=pid (Linux 5.8), holds only process directories: code running in kvfsd can walk
	// up from its working directory to this proc's root, and a writable proc with /proc/sys
	// there would let it, as root, change the host's sysctls (kernel.core_pattern). Reopening
	// files through /proc/self/fd/N still writes: the link leads to the file's own mount.
	const procFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_RDONLY
	if err := unix.Mount("proc", "/proc", "proc", procFlags, "subset=pid"); err == unix.EINVAL {
		err = unix.Mount("proc", "/proc", "proc", procFlags, "")
		if err != nil {
			return fmt.Errorf("--sandbox=namespace: mount proc: %w", err)
		}
	} else if err != nil {
		return fmt.Errorf("--sandbox=namespace: mount proc (subset=pid): %w", err)
	}
	return nil
}

// PivotRoot is the second half: it bind-mounts dir onto itself, pivot_roots into it and
// detaches the old root, then checks that "/" is dir. pivot_root(2) moves the root (and a
// working directory that was the old root) of every process of the mount namespace, so a
// process started before, in the host's tree (whose dynamic loader found its libraries there),
// is confined to dir as well. The working directory of the caller is "/" afterwards.
func PivotRoot(dir string) error {
	if err := pivotRoot(dir); err != nil {
		return fmt.Errorf("--sandbox=namespace: %w", err)
	}
	return nil
}

func pivotRoot(dir string) error {
	var want unix.Stat_t
	if err := unix.Stat(dir, &want); err != nil {
		return fmt.Errorf("shared directory %s: %w", dir, err)
	}
	// pivot_root needs the new root to be a mount point.
	if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind-mount the shared directory onto itself: %w", err)
	}
	if err := unix.Chdir(dir); err != nil {
		return fmt.Errorf("enter the shared directory: %w", err)
	}
	// With new_root and put_old both ".", the old root ends up mounted over the new one, and
	// detaching "." takes it away.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root into the shared directory: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	return checkRoot(&want)
}

// Chroot confines the process to dir, its shared directory, with chroot(2), its working
// directory left in /proc/self/fd; ProcSelfFd then reaches it. See the package documentation
// for what chroot does not confine.
func Chroot(dir string) error {
	var want unix.Stat_t
	if err := unix.Stat(dir, &want); err != nil {
		return fmt.Errorf("--sandbox=chroot: shared directory %s: %w", dir, err)
	}
	if err := unix.Chdir("/proc/self/fd"); err != nil {
		return fmt.Errorf("--sandbox=chroot: move to /proc/self/fd: %w", err)
	}
	if err := unix.Chroot(dir); err != nil {
		return fmt.Errorf("--sandbox=chroot: %w", err)
	}
	if err := checkRoot(&want); err != nil {
		return fmt.Errorf("--sandbox=chroot: %w", err)
	}
	return nil
}

// checkRoot checks that "/" is now the shared directory.
func checkRoot(want *unix.Stat_t) error {
	var got unix.Stat_t
	if err := unix.Stat("/", &got); err != nil {
		return err
	}
	if got.Dev != want.Dev || got.Ino != want.Ino {
		return fmt.Errorf("the new root is not the shared directory (dev %d ino %d, want dev %d ino %d)", got.Dev, got.Ino, want.Dev, want.Ino)
	}
	return nil
}
