package sandbox

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/kvfs/kvfs/sandbox/serverproc"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// The sandbox's virtio-fs server under supervision: started (confined, or in this process),
// watched, restarted once if it fails, and told its DAX policy and log level.

// startServer creates the socket and starts a server on it, with the sandbox's
// oom_score_adj. s.opMu is held, or s is not shared yet.
func (s *Sandbox) startServer() (fsServer, error) {
	srv, err := s.launchServer()
	if err != nil || s.oomAdj == nil {
		return srv, err
	}
	if p := srv.process(); p != nil {
		if err := setOOMScoreAdj(p.Pid(), *s.oomAdj); err != nil {
			_ = srv.stop()
			return nil, fmt.Errorf("%s: %w", srv.describe(), err)
		}
	}
	return srv, nil
}

// launchServer creates the socket and starts a server on it, in the sandbox's mount namespace,
// where the share is.
func (s *Sandbox) launchServer() (fsServer, error) {
	l, err := listen(s.SocketPath())
	if err != nil {
		return nil, err
	}
	if !isKvfsd(s.cfg.Server.Daemon) {
		return startExternal(s.ctx, s.mnt, s.cfg.Server.Daemon, s.cfg.daemonArgs(s.SharedDir()), l, filepath.Join(s.dir, serverLogName))
	}
	vcfg, err := s.cfg.serverConfig(s.SharedDir())
	if err != nil {
		l.Close()
		return nil, err
	}
	if s.dax != nil {
		vcfg.DAX = *s.dax
	}
	if s.cfg.Server.Daemon == InProcessUnconfined {
		log.G(s.ctx).Warn(unconfinedWarning)
		return startInProcess(s.ctx, s.mnt, vcfg, l)
	}
	channel, err := listen(s.channelPath())
	if err != nil {
		l.Close()
		return nil, err
	}
	spec := serverproc.Spec{Sandbox: s.id, Server: vcfg, LogLevel: levelName(log.GetLevel())}
	return startConfined(s.ctx, s.mnt, spec, l, channel, s.channelPath(), filepath.Join(s.dir, serverLogName))
}

// channelPath is the socket of the confined server's channel.
func (s *Sandbox) channelPath() string { return filepath.Join(s.dir, channelName) }

// SetDAXPolicy replaces the DAX policy of the sandbox's kvfsd (confined or in-process) at run
// time and records it in the state file, so a restarted server keeps it. A sandbox served by an
// external daemon refuses (errdefs.ErrFailedPrecondition): kvfs cannot reach into that process.
func (s *Sandbox) SetDAXPolicy(ctx context.Context, p passthrough.DAXPolicy) error {
	if err := p.Validate(); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	// opMu: a server restart in progress must not start its new server with the old policy
	// while this one goes to the old server.
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	phase, srv := s.phase, s.srv
	s.mu.Unlock()
	d, ok := srv.(daxSetter)
	switch {
	case !isKvfsd(s.cfg.Server.Daemon):
		return fmt.Errorf("sandbox %s: its server is the external daemon %s, whose DAX policy is set on its command line (--dax, --dax-rules): %w",
			s.id, s.cfg.Server.Daemon, errdefs.ErrFailedPrecondition)
	case phase != PhaseCreated && phase != PhaseRunning || !ok:
		return fmt.Errorf("sandbox %s is %s: %w", s.id, phase, errdefs.ErrFailedPrecondition)
	}
	if err := d.setDAXPolicy(ctx, p); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dax = &passthrough.DAXPolicy{Mode: p.Mode, Rules: slices.Clone(p.Rules)}
	return s.persistLocked()
}

// SetServerLogLevel sets the log level of the sandbox's confined server (trace, debug, info,
// warn or error). An in-process server shares this process's logger, and an external daemon's
// level is set on its command line: for those there is nothing to do.
func (s *Sandbox) SetServerLogLevel(ctx context.Context, level string) error {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	c, ok := srv.(*confinedServer)
	if !ok || isClosed(c.exited()) {
		return nil
	}
	if err := c.setLogLevel(ctx, level); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	return nil
}

// ServerError is why a sandbox's server stopped serving while its VM was running, and what
// the failure policy did about it.
type ServerError struct {
	// Server names the server: "confined kvfsd (pid N)", "in-process kvfsd" or "PATH (pid N)".
	Server string
	// Err is how it ended: an error from Serve, an exit status or signal, or errServerClean.
	Err error
	// Policy is the configured policy; Action says what was done.
	Policy string
	Action string
	At     time.Time
}

func (e *ServerError) Error() string {
	msg := fmt.Sprintf("virtio-fs server %s stopped serving: %v", e.Server, e.Err)
	if e.Action != "" {
		msg += "; " + e.Action
	}
	return msg
}

func (e *ServerError) Unwrap() error { return e.Err }

// watchServer waits for srv to end and applies the failure policy if that happened while the
// VM was running.
func (s *Sandbox) watchServer(srv fsServer) {
	defer s.wg.Done()
	<-srv.exited()
	exitErr := srv.exitErr()

	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	if vm != nil && !srv.killed() {
		select {
		case <-vm.Exited():
		case <-time.After(serverExitGrace):
		}
	}

	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	if s.srv != srv || (s.phase != PhaseCreated && s.phase != PhaseRunning) {
		s.mu.Unlock()
		return // stopping, or already replaced
	}
	vm = s.vm
	if vm != nil && isClosed(vm.Exited()) {
		s.mu.Unlock()
		log.G(s.ctx).WithField("server", srv.describe()).Info("the virtio-fs server ended after the VM")
		return
	}
	if exitErr == nil {
		exitErr = errServerClean
	}
	// failure is published (lastFailure, failure) only once its Action is final.
	failure := &ServerError{Server: srv.describe(), Err: exitErr, Policy: s.cfg.Server.OnFailure, At: time.Now()}
	restarts := s.restarts
	s.mu.Unlock()

	if s.cfg.Server.OnFailure == PolicyRestart {
		if restarts >= s.cfg.Server.MaxRestarts {
			failure.Action = fmt.Sprintf("restart limit (%d) reached", s.cfg.Server.MaxRestarts)
		} else if err := s.restartServerLocked(srv, failure); err != nil {
			failure.Action = "restarting it failed: " + err.Error()
		} else {
			return
		}
	}
	s.failLocked(srv, failure)
}

// restartServerLocked replaces the dead server old with a new one on a new socket at the same
// path. s.opMu is held.
func (s *Sandbox) restartServerLocked(old fsServer, failure *ServerError) error {
	_ = old.stop() // it has exited; this releases what it held
	srv, err := s.startServer()
	if err != nil {
		return err
	}
	failure.Action = "restarted it as " + srv.describe()
	s.mu.Lock()
	s.srv = srv
	s.restarts++
	s.lastFailure = failure
	err = s.persistLocked()
	s.mu.Unlock()
	if err != nil {
		log.G(s.ctx).WithError(err).Warn("recording the server restart")
	}
	s.wg.Add(1)
	go s.watchServer(srv)
	log.G(s.ctx).WithError(failure).Warn("virtio-fs server restarted; QEMU does not reconnect a vhost-user-fs device, " +
		"so the guest's share stays unusable until the VM restarts")
	return nil
}

// failLocked applies the stop policy: the VM is killed and the sandbox fails with failure.
// s.opMu is held.
func (s *Sandbox) failLocked(srv fsServer, failure *ServerError) {
	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	action := "no VM was running"
	if vm != nil {
		action = fmt.Sprintf("stopped the VM (pid %d)", vm.Pid())
		if err := terminate(vm, vmStopGrace); err != nil {
			action = fmt.Sprintf("stopping the VM (pid %d) failed: %v", vm.Pid(), err)
		}
	}
	if failure.Action != "" {
		failure.Action += "; " + action
	} else {
		failure.Action = action
	}
	_ = srv.stop()
	s.mu.Lock()
	s.phase = PhaseFailed
	s.failure = failure
	s.lastFailure = failure
	if err := s.persistLocked(); err != nil {
		log.G(s.ctx).WithError(err).Warn("recording the failure")
	}
	s.closeDoneLocked()
	s.mu.Unlock()
	log.G(s.ctx).WithError(failure).Error("sandbox failed")
}
