package shim

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"google.golang.org/grpc/codes"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// The pod's life as the services see it: booted by the first Create (or StartSandbox), owned
// by a podRun until it is stopped, failed by the host when its guest misbehaves.

const (
	// oomPace is the least time between two of the guest's OOM answers the shim takes.
	oomPace = 10 * time.Millisecond
	// guestLogInterval is the least time between two log lines of one kind that the guest can
	// cause at will.
	guestLogInterval = 10 * time.Second
	// oomKept is how many containers' last TaskOOM times the OOM loop keeps before it drops
	// those older than GuestLimits.OOMInterval.
	oomKept = 64
)

// podRun is the pod from its boot to its stop: its VM (a Pod), the door to its agent, the
// agent the services call (the door, fronted by the pod sandbox's task when CRI's podsandbox
// runs the pod), and the context of the calls that must end with the pod.
type podRun struct {
	id     string
	pod    Pod
	door   *agentDoor
	agent  agent.AgentService
	ctx    context.Context // ends when the pod dies or is stopped
	cancel context.CancelFunc
}

// newPodRun is the run of pod, booted for req. The door's failure policy kills the VM: the
// pod's death then ends every process (watch).
func (s *Service) newPodRun(pod Pod, req PodRequest) *podRun {
	ctx, cancel := context.WithCancel(context.WithoutCancel(s.ctx))
	r := &podRun{id: req.ID, pod: pod, ctx: ctx, cancel: cancel}
	r.door = newAgentDoor(s.ctx, pod.Agent(), s.opts.Limits, func(why error) {
		log.G(s.ctx).WithError(why).Error("the pod's guest is cut off: killing its VM")
		pod.Kill(why)
	})
	r.agent = r.door
	if req.SandboxTask {
		r.agent = newSandboxAgent(r.door, req.ID, pod.Pid())
	}
	return r
}

// call is ctx for one call to the agent, ended also by the pod's end. The caller calls cancel
// when the call is done.
func (r *podRun) call(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(r.ctx, cancel)
	return c, func() { stop(); cancel() }
}

// live says the pod's agent can still be asked.
func (r *podRun) live() bool { return r.ctx.Err() == nil }

// currentRun returns the pod's run.
func (s *Service) currentRun() (*podRun, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.run == nil {
		return nil, fmt.Errorf("the pod is not running: %w", errdefs.ErrFailedPrecondition)
	}
	return s.run, nil
}

// acquirePod returns the pod, booting it if this is the first container (or, bySandbox, for
// StartSandbox). A pod of the Sandbox API is booted only by StartSandbox: a container
// joins it while it is ready. No lock is held while it boots; concurrent Creates wait for
// the boot.
func (s *Service) acquirePod(ctx context.Context, req PodRequest, bySandbox bool) (*podRun, error) {
	for {
		s.mu.Lock()
		if sb := s.sandbox; sb != nil && !bySandbox && sb.phase != sandboxReady {
			s.mu.Unlock()
			return nil, fmt.Errorf("sandbox %s is %s, not ready: %w", sb.id, sb.phase, errdefs.ErrFailedPrecondition)
		}
		if run := s.run; run != nil {
			s.mu.Unlock()
			if run.id != req.ID {
				return nil, fmt.Errorf("this shim serves sandbox %s, not %s: %w", run.id, req.ID, errdefs.ErrInvalidArgument)
			}
			select {
			case <-run.pod.Done():
				return nil, fmt.Errorf("the pod's VM is gone (%v): %w", run.pod.Err(), errdefs.ErrFailedPrecondition)
			default:
			}
			return run, nil
		}
		if ch := s.booting; ch != nil {
			s.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		ch := make(chan struct{})
		s.booting = ch
		s.mu.Unlock()

		pod, err := s.opts.StartPod(ctx, req)
		var run *podRun
		if err == nil {
			run = s.newPodRun(pod, req)
		}
		s.mu.Lock()
		s.booting = nil
		s.run = run
		s.mu.Unlock()
		close(ch)
		if err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", req.ID, err)
		}
		go s.watchPod(run)
		go s.oomLoop(run)
		return run, nil
	}
}

// watchPod ends every process when the pod dies: their agent calls are cancelled, and each
// exit watcher then runs the exit sequence (status exitVMDied, or exitKilled for one the host
// was asked to kill).
func (s *Service) watchPod(run *podRun) {
	<-run.pod.Done()
	s.mu.Lock()
	if s.run != run {
		s.mu.Unlock()
		return // stopped by us
	}
	run.cancel()
	s.mu.Unlock()
	log.G(s.ctx).WithError(run.pod.Err()).Errorf("the pod's VM or virtio-fs server died: every process ends (exit status %d, %d if it was killed)", exitVMDied, exitKilled)
}

// takeRunLocked takes the pod's run from the service, so that nothing new uses it: the caller
// stops it (stopRun). s.mu is held.
func (s *Service) takeRunLocked() *podRun {
	run := s.run
	s.run = nil
	return run
}

// stopRun stops the pod's VM: the agent's Shutdown answers the pending GetOOMEvent
// (Unavailable), which ends the OOM loop; the run's context goes after, and with it the
// calls left.
func (s *Service) stopRun(ctx context.Context, run *podRun) error {
	err := run.pod.Stop(ctx)
	run.cancel()
	return err
}

// stopPodIfEmpty stops the pod once no container is left (and none is being created), unless
// it is the Sandbox API's, which StopSandbox stops.
func (s *Service) stopPodIfEmpty() {
	s.mu.Lock()
	if len(s.containers) > 0 || s.run == nil || s.booting != nil || s.sandbox != nil {
		s.mu.Unlock()
		return
	}
	run := s.takeRunLocked()
	s.mu.Unlock()
	if err := s.stopRun(s.ctx, run); err != nil {
		log.G(s.ctx).WithError(err).Error("stopping the pod")
	}
}

// oomLoop publishes TaskOOM for the OOM kills the agent reports, until the pod ends: at most
// one per container per GuestLimits.OOMInterval, and no more than one of the agent's answers taken per
// oomPace, so that a guest that answers at once, for ever, costs the host little.
func (s *Service) oomLoop(run *podRun) {
	last := map[string]time.Time{} // when each container's last TaskOOM went
	for {
		resp, err := run.agent.GetOOMEvent(run.ctx, &agent.GetOOMEventRequest{})
		if err != nil {
			if run.ctx.Err() != nil {
				return
			}
			if agentErrIs(err, codes.Unimplemented, errdefs.ErrNotImplemented) {
				log.G(s.ctx).WithError(err).Warn("the agent reports no OOM events")
				return
			}
			if agentErrIs(err, codes.Unavailable, errdefs.ErrUnavailable) {
				return // the agent is shutting down, or was cut off
			}
			s.guestLog.warn("oom-wait", log.G(s.ctx).WithError(err), "waiting for OOM events")
			if !sleepCtx(run.ctx, time.Second) {
				return
			}
			continue
		}
		id := resp.ContainerId
		s.mu.Lock()
		_, known := s.containers[id]
		s.mu.Unlock()
		switch {
		case !known:
			s.guestLog.warn("oom-unknown", log.G(s.ctx).WithField("container", guestText(id)), "the agent reported an OOM kill in an unknown container")
		case time.Since(last[id]) >= s.opts.Limits.OOMInterval:
			last[id] = time.Now()
			s.publish(&eventstypes.TaskOOM{ContainerID: id})
		}
		if len(last) > oomKept {
			for id, t := range last {
				if time.Since(t) >= s.opts.Limits.OOMInterval { // as good as absent
					delete(last, id)
				}
			}
		}
		if !sleepCtx(run.ctx, oomPace) {
			return
		}
	}
}

// sleepCtx sleeps for d, or until ctx ends; it says whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// kill sends sig to p (with all, to every process of p's container). A SIGKILL of a
// container (its init, or all) is the host's to finish: p and, with all, its container's execs
// are marked killed (exitKilled if the VM has to go), and unless the guest confirms the exit
// within GuestLimits.KillGrace, the VM is killed. So a SIGKILL succeeds whatever the agent answers.
func (s *Service) kill(ctx context.Context, run *podRun, c *container, p *process, sig uint32, all bool) error {
	enforce := sig == uint32(syscall.SIGKILL) && p.execID == ""
	if enforce {
		p.markKilled()
		if all {
			c.mu.Lock()
			for _, e := range c.execs {
				e.markKilled()
			}
			c.mu.Unlock()
		}
		go s.enforceKill(run, p)
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	_, err := run.agent.SignalProcess(actx, &agent.SignalProcessRequest{ContainerId: p.cid, ExecId: p.execID, Signal: sig, All: all})
	switch {
	case err == nil:
		return nil
	case enforce:
		log.G(s.ctx).WithError(err).WithField("process", p.name()).Warnf("the agent's answer to SIGKILL (the host ends the process within %v)", s.opts.Limits.KillGrace)
		return nil
	}
	return fmt.Errorf("the agent signalling %s: %w", p.name(), err)
}

// enforceKill kills the pod's VM unless p has exited within GuestLimits.KillGrace.
func (s *Service) enforceKill(run *podRun, p *process) {
	grace := s.opts.Limits.KillGrace
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.exited:
	case <-run.ctx.Done(): // the pod ended: p's exit comes with it
	case <-t.C:
		run.door.cutOff(fmt.Errorf("the guest did not end %s within %v of SIGKILL", p.name(), grace))
	}
}

// guestLogger lets through at most one log line of each kind per guestLogInterval, saying how
// many it held back: what the guest can cause to be logged must not flood containerd's log.
type guestLogger struct {
	mu   sync.Mutex
	last map[string]time.Time // guarded by mu; kinds are the shim's constants, a few
	held map[string]int       // guarded by mu
}

func (g *guestLogger) warn(kind string, e *log.Entry, msg string) {
	g.mu.Lock()
	if g.last == nil {
		g.last, g.held = map[string]time.Time{}, map[string]int{}
	}
	if time.Since(g.last[kind]) < guestLogInterval {
		g.held[kind]++
		g.mu.Unlock()
		return
	}
	held := g.held[kind]
	g.last[kind], g.held[kind] = time.Now(), 0
	g.mu.Unlock()
	if held > 0 {
		e = e.WithField("held_back", held)
	}
	e.Warn(msg)
}
