package agent

import (
	"context"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"time"

	runc "github.com/containerd/go-runc"
	"golang.org/x/sys/unix"
)

// Reaper reaps every child of the agent: as PID 1 (or a child subreaper) the agent inherits
// every orphan, so one SIGCHLD handler collects all exits with wait4(-1) and nobody else may
// wait. It is also go-runc's ProcessMonitor: a runc command started through it gets its own
// exit back; every other exit goes to the handler given to Run (the service's ProcessExited).
//
// Lock order: Reaper.mu is a leaf; it is held across fork in Start (so that an exit is never
// looked up before its waiter is registered) and never while the handler runs.
type Reaper struct {
	mu      sync.Mutex
	waiters map[int]chan runc.Exit // guarded by mu: commands started by Start, by pid
}

// NewReaper returns a reaper; Run makes it reap.
func NewReaper() *Reaper {
	return &Reaper{waiters: make(map[int]chan runc.Exit)}
}

// Run reaps children until ctx ends, handing the exits of processes it did not start to
// handler.
func (r *Reaper) Run(ctx context.Context, handler func(pid, status int, at time.Time)) {
	sigs := make(chan os.Signal, 32)
	signal.Notify(sigs, unix.SIGCHLD)
	defer signal.Stop(sigs)
	for {
		r.reap(handler)
		select {
		case <-sigs:
		case <-ctx.Done():
			return
		}
	}
}

// reap collects every child that has exited.
func (r *Reaper) reap(handler func(pid, status int, at time.Time)) {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		e := runc.Exit{Timestamp: time.Now(), Pid: pid, Status: ExitStatus(ws)}
		r.mu.Lock()
		ch, ok := r.waiters[pid]
		delete(r.waiters, pid)
		r.mu.Unlock()
		if ok {
			ch <- e
			continue
		}
		handler(e.Pid, e.Status, e.Timestamp)
	}
}

// ExitStatus is a wait status as a shell reports it: the exit code, or 128 + the signal.
func ExitStatus(ws unix.WaitStatus) int {
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

// Start starts c and registers it, so that its exit comes back to Wait.
func (r *Reaper) Start(c *exec.Cmd) (chan runc.Exit, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := c.Start(); err != nil {
		return nil, err
	}
	ch := make(chan runc.Exit, 1)
	r.waiters[c.Process.Pid] = ch
	return ch, nil
}

// StartLocked is Start from a goroutine locked to its thread, as go-runc asks when a
// parent-death signal is set. The agent sets none: the thread is only held for the fork.
func (r *Reaper) StartLocked(c *exec.Cmd) (chan runc.Exit, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	return r.Start(c)
}

// Wait waits for the exit of c, started by Start, and for its output to be copied.
func (r *Reaper) Wait(c *exec.Cmd, ch chan runc.Exit) (int, error) {
	e := <-ch
	// The process is reaped already; Wait still collects os/exec's copying goroutines and
	// closes its pipes. Its error (no child) says nothing.
	_ = c.Wait()
	return e.Status, nil
}
