package shim

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/errdefs"

	"github.com/kvfs/kvfs/shim/stdio"
)

const (
	// exitVMDied is the exit status of every process of a pod whose VM or server died.
	exitVMDied = 255
	// exitKilled is the exit status of a process the host was asked to SIGKILL and whose exit
	// came with its VM's end, and of an exec the host declared exited (process.endByHost).
	exitKilled = 128 + uint32(syscall.SIGKILL)
)

// state is where a process is in its life. The table below is the whole state machine: an
// operation is allowed only in the states listed for it, and anything else is an
// errdefs.ErrFailedPrecondition before anything is done.
//
//	created  --start-->  starting  --(agent answered)-->  running  --pause-->  paused
//	created/running/paused  --(exit, VM's death, host's word)-->  stopped  --delete-->  deleted
//	created  --delete-->  (killed, then as above)
//
// The host's word is an exec's exit declared without the guest's report (endByHost): a
// SIGKILLed exec the guest did not end within GuestLimits.KillGrace, or an exec the guest has
// not reported execsTimeout after its container's init exited (a never-started one at once).
type state int

const (
	stateCreated state = iota
	stateStarting
	stateRunning
	statePaused
	stateStopped
	stateDeleted
)

var stateNames = [...]string{"created", "starting", "running", "paused", "stopped", "deleted"}

func (s state) String() string { return stateNames[s] }

// status is the task API's name of s.
func (s state) status() task.Status {
	switch s {
	case stateCreated, stateStarting:
		return task.Status_CREATED
	case stateRunning:
		return task.Status_RUNNING
	case statePaused:
		return task.Status_PAUSED
	default:
		return task.Status_STOPPED
	}
}

type op string

const (
	opStart  op = "start"
	opKill   op = "kill"
	opPause  op = "pause"
	opResume op = "resume"
	opDelete op = "delete"
	opIO     op = "resize or close the stdio of"
	opExec   op = "exec in"
	opQuery  op = "update or list"
	opStats  op = "measure"
)

var allowed = map[op][]state{
	opStart:  {stateCreated},
	opKill:   {stateCreated, stateStarting, stateRunning, statePaused},
	opPause:  {stateRunning},
	opResume: {statePaused},
	opDelete: {stateCreated, stateStopped},
	opIO:     {stateCreated, stateStarting, stateRunning, statePaused},
	opExec:   {stateRunning},
	opQuery:  {stateCreated, stateStarting, stateRunning, statePaused},
	// A stopped container's cgroup stays in the guest until its Delete, as runc's does.
	opStats: {stateCreated, stateStarting, stateRunning, statePaused, stateStopped},
}

// exit is how a process ended.
type exit struct {
	status uint32
	at     time.Time
}

// process is a container's init (execID "") or one of its execs.
type process struct {
	cid, execID string
	stdio       stdio.Config
	io          *stdio.IO

	// exited is closed once the exit is recorded and TaskExit published: Wait returns then.
	exited chan struct{}
	// reported is closed when the agent has answered the wait for the exit (or the wait
	// ended with the pod): what the guest owes a kill. The exit sequence follows.
	reported chan struct{}
	// outputDone is closed when the stdout and stderr copies have ended.
	outputDone chan struct{}

	mu      sync.Mutex
	state   state // guarded by mu
	pid     uint32
	exit    exit  // guarded by mu; valid in stateStopped and stateDeleted
	pending *exit // guarded by mu; an exit that came while the process was starting
	// finishing is set once the exit sequence has begun (guarded by mu): it runs once.
	finishing bool
	// killed says the host was asked to SIGKILL the process (guarded by mu): if its exit comes
	// with its VM's end, it is exitKilled, not exitVMDied.
	killed bool
	// hostEnded says the host declared the process exited without the guest's report
	// (endByHost; guarded by mu): it may still run in the guest, which may then refuse to
	// delete it.
	hostEnded bool
	// endCalls ends the process's own calls to the agent (its wait, its output and input
	// copies); set by watch (guarded by mu). calls is their context, from the pod's run's.
	endCalls context.CancelFunc
	calls    context.Context
}

func newProcess(cid, execID string, cfg stdio.Config) *process {
	return &process{
		cid: cid, execID: execID, stdio: cfg,
		exited: make(chan struct{}), reported: make(chan struct{}), outputDone: make(chan struct{}),
	}
}

func (p *process) name() string {
	if p.execID == "" {
		return "container " + p.cid
	}
	return fmt.Sprintf("exec %s of container %s", p.execID, p.cid)
}

// check reports whether o is allowed now.
func (p *process) check(o op) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.checkLocked(o)
}

func (p *process) checkLocked(o op) error {
	if slices.Contains(allowed[o], p.state) {
		return nil
	}
	return fmt.Errorf("cannot %s %s: it is %s: %w", o, p.name(), p.state, errdefs.ErrFailedPrecondition)
}

// transition moves the process from one of the states o allows to next.
func (p *process) transition(o op, next state) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.checkLocked(o); err != nil {
		return err
	}
	p.state = next
	return nil
}

func (p *process) markKilled() {
	p.mu.Lock()
	p.killed = true
	p.mu.Unlock()
}

// endByHost declares p exited without the guest's report, and says whether it did: not once
// the guest has reported the exit. The declaration takes effect when the caller runs the
// endCalls it returns (nil if watch has not started: it ends the calls as it starts them):
// p's calls to the agent end, and its exit watcher runs the exit sequence with exitKilled
// (output cut, stdio closed, TaskExit, Wait released).
func (p *process) endByHost() (endCalls context.CancelFunc, ok bool) {
	select {
	case <-p.reported:
		return nil, false
	default:
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.hostEnded = true
	return p.endCalls, true
}

// endedByHost says whether the host declared p's exit (endByHost).
func (p *process) endedByHost() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hostEnded
}

// callContext is the context of p's own calls to the agent, which watch sets before Start can
// run.
func (p *process) callContext() context.Context {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

// vmEndStatus is p's exit status when its VM ended under it.
func (p *process) vmEndStatus() uint32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.killed {
		return exitKilled
	}
	return exitVMDied
}

func (p *process) snapshot() (state, uint32, exit) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.state, p.pid, p.exit
}

// checkKill reports whether p may be signalled. As runc's shim, a finished process is not
// found, which containerd's callers (CRI's StopContainer, ctr kill) take as "already dead"; a
// deleted one is still found while its Delete cleans up (binds, hooks): it is as dead.
func (p *process) checkKill() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.state == stateStopped || p.state == stateDeleted {
		return fmt.Errorf("%s: process already finished: %w", p.name(), errdefs.ErrNotFound)
	}
	return p.checkLocked(opKill)
}
