package agent

import (
	"context"
	"os"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// A container's processes: execs added and started, signals, waits and deletes, and the exits
// the reaper reports (ProcessExited), matched to the processes they end.

// exitCollector keeps the exits of pids nobody knows yet while a process is being started:
// a process can exit before runc has told its pid.
type exitCollector struct {
	exits map[int]exitEvent
}

type exitEvent struct {
	status int
	at     time.Time
}

// ProcessExited records that pid exited with status (128+signal for a killed process). An
// exit of a pid the service does not know is kept while a process start is in flight, and
// otherwise dropped (an orphan reparented to the agent).
func (s *Service) ProcessExited(pid, status int, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.byPid[pid]; ok {
		delete(s.byPid, pid)
		s.exitLocked(p, status, at)
		return
	}
	for c := range s.collectors {
		c.exits[pid] = exitEvent{status, at}
	}
}

func (s *Service) exitLocked(p *process, status int, at time.Time) {
	if p.state == stateStopped {
		return
	}
	p.state, p.exitStatus, p.exitedAt = stateStopped, status, at
	close(p.exited)
	// What the process wrote is in its pipes now; a background child that inherited them
	// must not hold the host's wait for the end of the output for ever.
	time.AfterFunc(s.cfg.OutputGrace, func() {
		p.stdout.closeWhenDrained()
		p.stderr.closeWhenDrained()
	})
	s.log.WithFields(logrus.Fields{"container": p.c.id, "exec": p.execID, "pid": p.pid, "status": status}).Debug("process exited")
}

// startCollecting begins keeping unknown exits; registerLocked ends it.
func (s *Service) startCollecting() *exitCollector {
	c := &exitCollector{exits: make(map[int]exitEvent)}
	s.mu.Lock()
	s.collectors[c] = struct{}{}
	s.mu.Unlock()
	return c
}

func (s *Service) stopCollecting(c *exitCollector) {
	s.mu.Lock()
	delete(s.collectors, c)
	s.mu.Unlock()
}

// registerLocked gives p its pid and applies an exit that came before.
func (s *Service) registerLocked(p *process, col *exitCollector, pid int) {
	delete(s.collectors, col)
	p.pid = pid
	if e, ok := col.exits[pid]; ok {
		s.exitLocked(p, e.status, e.at)
		return
	}
	s.byPid[pid] = p
}

// ExecProcess records an exec; StartProcess runs it.
func (s *Service) ExecProcess(ctx context.Context, req *apiv1.ExecProcessRequest) (*apiv1.ExecProcessResponse, error) {
	if err := checkID("exec_id", req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	var ps specs.Process
	if err := decodeJSON("process", req.Process, &ps); err != nil {
		return nil, err
	}
	if len(ps.Args) == 0 {
		return nil, errf(errdefs.ErrInvalidArgument, "process: args is empty")
	}
	ps.Terminal = req.Stdio != nil && req.Stdio.Terminal
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.gone {
		return nil, errf(errdefs.ErrNotFound, "container %q not found", c.id)
	}
	if _, ok := c.execs[req.ExecId]; ok {
		return nil, errf(errdefs.ErrAlreadyExists, "process %q of container %q already exists", req.ExecId, c.id)
	}
	if st := c.init.state; st != stateRunning {
		return nil, errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", c.id, st)
	}
	p, err := newProcess(c, req.ExecId, req.Stdio)
	if err != nil {
		return nil, err
	}
	p.spec = &ps
	c.execs[req.ExecId] = p
	return &apiv1.ExecProcessResponse{}, nil
}

// StartProcess starts a container's init or an exec.
func (s *Service) StartProcess(ctx context.Context, req *apiv1.StartProcessRequest) (*apiv1.StartProcessResponse, error) {
	if err := checkExecID(req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	p, pid, err := s.startableLocked(c, req.ExecId)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}

	if p == c.init {
		if err := s.cfg.Runtime.Start(context.WithoutCancel(ctx), c.id); err != nil {
			return nil, runtimeErr("runc start", err)
		}
		s.mu.Lock()
		if p.state == stateCreated {
			p.state = stateRunning
		}
		s.mu.Unlock()
		return &apiv1.StartProcessResponse{Pid: uint32(pid)}, nil
	}

	col := s.startCollecting()
	cr, err := s.cfg.Runtime.Exec(context.WithoutCancel(ctx), c.id, p.execID, p.spec, p.childIO)
	p.closeChildIO()
	if err != nil {
		s.stopCollecting(col)
		s.mu.Lock()
		// The exec never ran: it is stopped with status 255 (what containerd's runc shim
		// answers for a process that failed to start), its streams at their end (its pipes'
		// ends were closed above; a terminal never had one).
		if p.terminal {
			p.stdout.attach(nil)
		}
		s.exitLocked(p, 255, time.Now())
		s.mu.Unlock()
		return nil, runtimeErr("runc exec", err)
	}
	p.started(cr)
	s.mu.Lock()
	p.console = cr.Console
	p.spec = nil
	if p.state == stateCreated {
		p.state = stateRunning
	}
	s.registerLocked(p, col, cr.Pid)
	s.mu.Unlock()
	return &apiv1.StartProcessResponse{Pid: uint32(cr.Pid)}, nil
}

// startableLocked finds a process that StartProcess may start, and its pid (the init's, known
// since create).
func (s *Service) startableLocked(c *container, eid string) (*process, int, error) {
	p, err := s.processLocked(c, eid)
	switch {
	case err != nil:
		return nil, 0, err
	case p.state != stateCreated:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is %s, not created", eid, c.id, p.state)
	case c.paused:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "container %q is paused", c.id)
	case p != c.init && c.init.state != stateRunning:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", c.id, c.init.state)
	}
	return p, p.pid, nil
}

// SignalProcess signals a process, or with all every process of the container.
func (s *Service) SignalProcess(ctx context.Context, req *apiv1.SignalProcessRequest) (*apiv1.SignalProcessResponse, error) {
	if req.Signal == 0 || req.Signal > 64 {
		return nil, errf(errdefs.ErrInvalidArgument, "signal %d is not a signal (1 to 64)", req.Signal)
	}
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	sig := syscall.Signal(req.Signal)
	s.mu.Lock()
	state, pid := p.state, p.pid
	s.mu.Unlock()
	if p == p.c.init {
		if state == stateStopped && !req.All {
			return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
		}
		if err := s.cfg.Runtime.Kill(ctx, p.c.id, sig, req.All); err != nil {
			// runc refuses ("container not running") an init that has exited and that the
			// reaper has not reported yet: once it has, the signal was for an exited process.
			select {
			case <-p.exited:
				return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
			case <-time.After(exitReportWait):
			}
			return nil, runtimeErr("runc kill", err)
		}
		return &apiv1.SignalProcessResponse{}, nil
	}
	switch state {
	case stateCreated:
		return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is not started", req.ExecId, p.c.id)
	case stateStopped:
		return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
	}
	if err := s.cfg.Runtime.Signal(pid, sig); err != nil {
		return nil, runtimeErr("kill", err)
	}
	return &apiv1.SignalProcessResponse{}, nil
}

// WaitProcess waits for a process's exit.
func (s *Service) WaitProcess(ctx context.Context, req *apiv1.WaitProcessRequest) (*apiv1.WaitProcessResponse, error) {
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, errShuttingDown
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return &apiv1.WaitProcessResponse{
		Pid:        uint32(p.pid),
		ExitStatus: uint32(p.exitStatus),
		ExitedAt:   timestamppb.New(p.exitedAt),
	}, nil
}

// DeleteProcess forgets an exited process; for the init, deletes the container.
func (s *Service) DeleteProcess(ctx context.Context, req *apiv1.DeleteProcessRequest) (*apiv1.DeleteProcessResponse, error) {
	if err := checkExecID(req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	if req.ExecId != "" {
		s.mu.Lock()
		defer s.mu.Unlock()
		p, err := s.processLocked(c, req.ExecId)
		if err != nil {
			return nil, err
		}
		if p.state == stateRunning {
			return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is running", req.ExecId, c.id)
		}
		delete(c.execs, req.ExecId)
		// An exec deleted before it started never runs: whoever waits for it hears 255.
		s.exitLocked(p, 255, time.Now())
		s.releaseLocked(p)
		return &apiv1.DeleteProcessResponse{}, nil
	}

	s.mu.Lock()
	if c.gone {
		s.mu.Unlock()
		return nil, errf(errdefs.ErrNotFound, "container %q not found", c.id)
	}
	initState := c.init.state
	if initState == stateRunning {
		s.mu.Unlock()
		return nil, errf(errdefs.ErrFailedPrecondition, "container %q is running", c.id)
	}
	for eid, p := range c.execs {
		if p.state == stateRunning {
			s.mu.Unlock()
			return nil, errf(errdefs.ErrFailedPrecondition, "container %q still runs its process %q", c.id, eid)
		}
	}
	s.mu.Unlock()
	// A container that never started still has its init waiting in runc: force kills it.
	if err := s.cfg.Runtime.Delete(context.WithoutCancel(ctx), c.id, initState == stateCreated); err != nil {
		return nil, runtimeErr("runc delete", err)
	}
	s.forget(c)
	return &apiv1.DeleteProcessResponse{}, nil
}

// forget removes a deleted container and its bundle.
func (s *Service) forget(c *container) {
	s.mu.Lock()
	c.gone = true
	delete(s.containers, c.id)
	if c.stopOOM != nil {
		c.stopOOM()
	}
	s.releaseLocked(c.init)
	for _, p := range c.execs {
		s.releaseLocked(p)
	}
	s.mu.Unlock()
	s.mounts.release(c.pins)
	s.endMirrors(c)
	if err := os.RemoveAll(c.bundle); err != nil {
		s.log.WithError(err).WithField("container", c.id).Warn("removing the bundle")
	}
	s.log.WithField("container", c.id).Info("container deleted")
}
