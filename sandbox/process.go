package sandbox

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Process is a host process a sandbox runs or adopted: the VM's hypervisor, or an external
// virtio-fs server.
type Process interface {
	// Pid is the process ID, or 0 if the process is not a local one (a runner may start the
	// VM elsewhere); such a VM cannot be adopted after a restart of the owner.
	Pid() int
	// Signal sends sig. It is an error wrapping os.ErrProcessDone once the process exited.
	Signal(sig os.Signal) error
	// Exited is closed when the process has exited.
	Exited() <-chan struct{}
	// ExitErr says how it exited, once Exited is closed: nil for status 0.
	ExitErr() error
}

// procID identifies a process across restarts of the owner: a pid can be reused, the pair
// (pid, start time) within one boot cannot.
type procID struct {
	PID int `json:"pid"`
	// StartTime is field 22 of /proc/PID/stat: clock ticks from boot to the process's start.
	StartTime uint64 `json:"start_time"`
	BootID    string `json:"boot_id"`
}

// identify returns the identity of the running process pid.
func identify(pid int) (procID, error) {
	st, err := readProcStat(pid)
	if err != nil {
		return procID{}, err
	}
	return procID{PID: pid, StartTime: st.startTime, BootID: bootID()}, nil
}

type procStat struct {
	state     byte
	startTime uint64
}

// readProcStat reads the state and start time of pid from /proc/PID/stat.
func readProcStat(pid int) (procStat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	// The command name (field 2) is in parentheses and may contain anything, ')' included:
	// the fields after it start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); field 22 (starttime) is f[19].
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("/proc/%d/stat: start time %q", pid, f[19])
	}
	return procStat{state: f[0][0], startTime: start}, nil
}

var (
	bootIDOnce sync.Once
	bootIDVal  string
)

func bootID() string {
	bootIDOnce.Do(func() {
		b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
		if err == nil {
			bootIDVal = strings.TrimSpace(string(b))
		}
	})
	return bootIDVal
}

// errNotRunning is the reason a recorded process cannot be adopted: it exited, or its pid now
// belongs to another process.
var errNotRunning = errors.New("not running")

// childProcess is a process this process started.
type childProcess struct {
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // written before exited is closed
}

// startChild starts cmd and reaps it in the background.
func startChild(cmd *exec.Cmd) (*childProcess, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &childProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

func (p *childProcess) Pid() int                   { return p.cmd.Process.Pid }
func (p *childProcess) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }
func (p *childProcess) Exited() <-chan struct{}    { return p.exited }
func (p *childProcess) ExitErr() error             { <-p.exited; return p.err }

// adoptedProcess is a process found through its recorded identity after a restart of the
// owner. It is held by a pidfd, so a signal can never reach a process that reused its pid. It
// is usually not our child; when it is (the owner is a child subreaper), it is reaped here.
type adoptedProcess struct {
	pid    int
	exited chan struct{}
	err    error // written before exited is closed

	mu     sync.Mutex
	pidfd  int  // guarded by mu; closed once the process exited
	closed bool // guarded by mu
}

// adoptPollInterval bounds how late an adopted process's exit is noticed.
const adoptPollInterval = 200 * time.Millisecond

// adopt takes hold of the process id names, or returns an error wrapping errNotRunning if that
// process is gone (exited, a zombie, or its pid reused).
func adopt(id procID) (*adoptedProcess, error) {
	if id.PID <= 0 {
		return nil, fmt.Errorf("pid %d: %w", id.PID, errNotRunning)
	}
	if id.BootID != "" && id.BootID != bootID() {
		return nil, fmt.Errorf("pid %d was recorded during another boot: %w", id.PID, errNotRunning)
	}
	// Open the pidfd first, then check that the process it refers to is the recorded one: a
	// pid reused in between shows another start time.
	fd, err := unix.PidfdOpen(id.PID, 0)
	if err != nil {
		return nil, fmt.Errorf("pid %d: %v: %w", id.PID, err, errNotRunning)
	}
	st, err := readProcStat(id.PID)
	switch {
	case err != nil:
		reapPidfd(fd)
		unix.Close(fd)
		return nil, fmt.Errorf("pid %d: %v: %w", id.PID, err, errNotRunning)
	case st.startTime != id.StartTime:
		unix.Close(fd)
		return nil, fmt.Errorf("pid %d belongs to another process now (start time %d, recorded %d): %w",
			id.PID, st.startTime, id.StartTime, errNotRunning)
	case st.state == 'Z' || st.state == 'X':
		reapPidfd(fd)
		unix.Close(fd)
		return nil, fmt.Errorf("pid %d has exited: %w", id.PID, errNotRunning)
	}
	p := &adoptedProcess{pid: id.PID, pidfd: fd, exited: make(chan struct{})}
	go p.watch()
	return p, nil
}

// watch waits for the process to exit: a pidfd becomes readable then.
func (p *adoptedProcess) watch() {
	p.mu.Lock()
	fd := p.pidfd
	p.mu.Unlock()
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, int(adoptPollInterval/time.Millisecond))
		if err != nil && !errors.Is(err, unix.EINTR) {
			p.err = fmt.Errorf("watching pid %d: %w", p.pid, err)
			break
		}
		if n > 0 {
			p.err = reapPidfd(fd)
			break
		}
	}
	p.mu.Lock()
	p.closed = true
	unix.Close(p.pidfd)
	p.mu.Unlock()
	close(p.exited)
}

func (p *adoptedProcess) Pid() int                { return p.pid }
func (p *adoptedProcess) Exited() <-chan struct{} { return p.exited }
func (p *adoptedProcess) ExitErr() error          { <-p.exited; return p.err }

func (p *adoptedProcess) Signal(sig os.Signal) error {
	s, ok := sig.(syscall.Signal)
	if !ok {
		return fmt.Errorf("unsupported signal %v", sig)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return os.ErrProcessDone
	}
	err := unix.PidfdSendSignal(p.pidfd, s, nil, 0)
	if errors.Is(err, unix.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}

// reapPidfd reaps the exited process behind a pidfd if it is our child, and says how it exited.
// For a process that is not our child the status is unknown.
func reapPidfd(fd int) error {
	var info unix.Siginfo
	err := unix.Waitid(unix.P_PIDFD, fd, &info, unix.WEXITED|unix.WNOHANG, nil)
	if err != nil {
		// ECHILD: not our child; its parent reaps it.
		return errors.New("exited (status unknown: not a child of this process)")
	}
	// siginfo_t for SIGCHLD: si_pid at offset 16, si_uid at 20, si_status at 24.
	status := *(*int32)(unsafe.Add(unsafe.Pointer(&info), 24))
	switch info.Code {
	case 1: // CLD_EXITED
		if status == 0 {
			return nil
		}
		return fmt.Errorf("exit status %d", status)
	case 2, 3: // CLD_KILLED, CLD_DUMPED
		return fmt.Errorf("signal: %v", syscall.Signal(status))
	}
	return errors.New("exited")
}

// terminate asks p to stop (SIGTERM), kills it (SIGKILL) if it has not exited after grace, and
// waits for it. An error means p may still be running.
func terminate(p Process, grace time.Duration) error {
	select {
	case <-p.Exited():
		return nil
	default:
	}
	if err := p.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("SIGTERM to pid %d: %w", p.Pid(), err)
	}
	select {
	case <-p.Exited():
		return nil
	case <-time.After(grace):
	}
	return kill(p)
}

// kill kills p (SIGKILL) and waits for it.
func kill(p Process) error {
	if err := p.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("SIGKILL to pid %d: %w", p.Pid(), err)
	}
	select {
	case <-p.Exited():
		return nil
	case <-time.After(killTimeout):
		return fmt.Errorf("pid %d still running %v after SIGKILL", p.Pid(), killTimeout)
	}
}

// killTimeout bounds the wait for a killed process (one in uninterruptible sleep may take a
// while).
const killTimeout = 10 * time.Second
