package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"syscall"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/anypb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/hooks"
	"github.com/kvfs/kvfs/shim/stdio"
)

// A container's life, its own to run once the pod has it: created in the pod's VM (its
// files bound into the share, the agent's container, its hooks), its processes started,
// execs added, signals sent (a SIGKILL finished by the host), paused and resumed, measured,
// updated, and what its Create did on the host undone at its Delete. Each call takes the
// pod's run it is made in: the agent through its door, the VM.

// newContainer is the container req asks for, not yet created: the pod lists it from here,
// and it is ready once create has finished.
func newContainer(env *podEnv, req *containerRequest) *Container {
	r := req.task
	return &Container{id: r.ID, bundle: r.Bundle, env: env, init: newProcess(r.ID, "", req.stdio), execs: map[string]*process{},
		hooks: containerHooks{hooks: req.spec.Hooks, annotations: req.spec.Annotations}}
}

// create makes c in run's pod: the pod's oom_score_adj raised to c's if it bounds it, c's
// files bound into the share, its stdio opened, the agent's container created, then its
// prestart and createRuntime hooks run. What it did is undone by the functions it appends to
// undo, last first. Once it returns, c is ready, TaskCreate published and its init watched.
func (c *Container) create(ctx context.Context, run *podRun, req *containerRequest, undo *[]func()) error {
	r := req.task
	if req.raiseOOM != nil {
		if err := run.vm.RaiseOOMScoreAdj(*req.raiseOOM); err != nil {
			return fmt.Errorf("container %s: %w", r.ID, err)
		}
	}
	var submounts []string
	if req.guestSpec != nil {
		var err error
		if submounts, err = c.bind(run.vm, r, req.spec, req.hostBinds, undo); err != nil {
			return err
		}
	}
	pio, err := stdio.Open(c.env.ctx, req.stdio)
	if err != nil {
		return fmt.Errorf("container %s: %w", r.ID, err)
	}
	c.init.io = pio
	*undo = append(*undo, func() { pio.Close() })
	specJSON, err := json.Marshal(req.guestSpec)
	if err != nil {
		return err
	}
	in, out, errw := req.stdio.Wants()
	_, err = run.agent.CreateContainer(ctx, &agent.CreateContainerRequest{
		ContainerId: r.ID, Spec: specJSON, Submounts: submounts, PodTmpfs: req.podTmpfs, Mirrored: req.mirrored,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	if err != nil {
		return fmt.Errorf("the agent creating container %s: %w", r.ID, err)
	}
	pid := run.vm.Pid()
	c.init.pid = pid
	*undo = append(*undo, func() {
		if err := run.forget(c.env.ctx, c.init); err != nil {
			log.G(c.env.ctx).WithError(err).Warnf("deleting container %s in the guest after its failed create", r.ID)
		}
	})
	if err := c.createHooks(run); err != nil {
		// The runtime spec goes on from a failed hook to the destroy, then the poststop
		// hooks: first in the undo chain, they run once everything else is undone.
		*undo = slices.Insert(*undo, 0, func() { c.postHooks(hooks.Poststop, run, specs.StateStopped) })
		return err
	}
	c.mu.Lock()
	c.ready = true
	c.mu.Unlock()
	c.env.publish(&eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: pid,
		IO: &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
	})
	c.watch(run, c.init)
	return nil
}

// start starts c's created process p (an exec only while the init runs) and returns its pid:
// TaskStart (or TaskExecStarted) is published before an exit that came meanwhile runs its
// exit sequence. Then its stdin is copied, and an init's poststart hooks run.
func (c *Container) start(ctx context.Context, run *podRun, p *process) (uint32, error) {
	if p.execID != "" {
		if err := c.init.check(opExec); err != nil {
			return 0, err
		}
	}
	if err := p.transition(opStart, stateStarting); err != nil {
		return 0, err
	}
	if _, err := run.agent.StartProcess(ctx, &agent.StartProcessRequest{ContainerId: p.cid, ExecId: p.execID}); err != nil {
		c.startEnded(p, stateCreated)
		return 0, fmt.Errorf("the agent starting %s: %w", p.name(), err)
	}
	pid := run.vm.Pid()
	p.mu.Lock()
	p.pid = pid
	p.mu.Unlock()
	if p.execID == "" {
		c.env.publish(&eventstypes.TaskStart{ContainerID: p.cid, Pid: pid})
	} else {
		c.env.publish(&eventstypes.TaskExecStarted{ContainerID: p.cid, ExecID: p.execID, Pid: pid})
	}
	c.startEnded(p, stateRunning)
	c.copyStdin(run, p)
	if p.execID == "" {
		c.postHooks(hooks.Poststart, run, specs.StateRunning)
	}
	return pid, nil
}

// startEnded moves p, starting, to next, and runs the exit sequence of an exit that came
// while it was starting.
func (c *Container) startEnded(p *process, next state) {
	p.mu.Lock()
	p.state = next
	pending := p.pending
	p.pending = nil
	p.mu.Unlock()
	if pending != nil {
		go c.exited(p, *pending)
	}
}

// exec adds exec r.ExecID to c, which must be running; it is started by Start, once exec has
// returned. ns is the containerd namespace of its stdio.
func (c *Container) exec(ctx context.Context, run *podRun, r *taskAPI.ExecProcessRequest, ns string) (retErr error) {
	if r.ExecID == "" {
		return fmt.Errorf("exec without an id: %w", errdefs.ErrInvalidArgument)
	}
	if err := c.init.check(opExec); err != nil {
		return err
	}
	procJSON, err := execProcess(r.Spec)
	if err != nil {
		return fmt.Errorf("exec %s: %v: %w", r.ExecID, err, errdefs.ErrInvalidArgument)
	}
	sc := stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}
	p := newProcess(r.ID, r.ExecID, sc)
	c.mu.Lock()
	if _, ok := c.execs[r.ExecID]; ok {
		c.mu.Unlock()
		return fmt.Errorf("exec %s of container %s: %w", r.ExecID, r.ID, errdefs.ErrAlreadyExists)
	}
	c.execs[r.ExecID] = p // reserved; started only once Exec returns
	c.mu.Unlock()
	defer func() {
		if retErr != nil {
			c.forgetExec(p)
			if p.io != nil {
				p.io.Close()
			}
		}
	}()
	if p.io, err = stdio.Open(c.env.ctx, sc); err != nil {
		return fmt.Errorf("exec %s: %w", r.ExecID, err)
	}
	in, out, errw := sc.Wants()
	_, err = run.agent.ExecProcess(ctx, &agent.ExecProcessRequest{
		ContainerId: r.ID, ExecId: r.ExecID, Process: procJSON,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	if err != nil {
		return fmt.Errorf("the agent adding exec %s to %s: %w", r.ExecID, r.ID, err)
	}
	c.env.publish(&eventstypes.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	c.watch(run, p)
	return nil
}

// execProcess checks an exec's process spec (JSON in an Any, as containerd sends
// specs.Process) and returns it adapted for the guest, as JSON.
func execProcess(a interface {
	GetTypeUrl() string
	GetValue() []byte
}) ([]byte, error) {
	if a == nil || len(a.GetValue()) == 0 {
		return nil, errors.New("no process spec")
	}
	var proc specs.Process
	if err := json.Unmarshal(a.GetValue(), &proc); err != nil {
		return nil, fmt.Errorf("process spec (%s): %v", a.GetTypeUrl(), err)
	}
	return json.Marshal(adaptProcess(&proc))
}

// remove undoes on the host what c's Create did, once its init is deleted: its binds taken out
// of run's share (none once the pod is gone: run nil), its rootfs unmounted, then its poststop
// hooks run.
func (c *Container) remove(run *podRun) {
	if run != nil {
		c.unbind(run.vm)
	}
	if c.rootfsMounted {
		unmountRootfs(c.env.ctx, filepath.Join(c.bundle, "rootfs"))
	}
	c.postHooks(hooks.Poststop, run, specs.StateStopped)
}

// kill sends sig to p (with all, to every process of p's container). A SIGKILL is the host's
// to finish, whatever the agent answers: the processes it is for are marked killed (exitKilled
// if the VM has to go), and unless the guest reports each one's exit within
// GuestLimits.KillGrace, the host ends it (enforceKill). Without an answer the SIGKILL succeeds
// for containerd all the same; an answer that refuses it (the guest says the process has
// exited: NotFound) goes to containerd as it is.
func (c *Container) kill(ctx context.Context, run *podRun, p *process, sig uint32, all bool) error {
	enforce := sig == uint32(syscall.SIGKILL)
	var execs []*process // with all, the init's execs the SIGKILL is for too
	if enforce {
		p.markKilled()
		if all && p.execID == "" {
			c.mu.Lock()
			for _, e := range c.execs {
				e.markKilled()
				execs = append(execs, e)
			}
			c.mu.Unlock()
		}
	}
	_, err := run.agent.SignalProcess(ctx, &agent.SignalProcessRequest{ContainerId: p.cid, ExecId: p.execID, Signal: sig, All: all})
	if enforce {
		// A refusal is the guest's word too: an exited process's report follows at once.
		go c.enforceKill(run, p)
		for _, e := range execs {
			go c.enforceKill(run, e)
		}
		if errors.Is(err, context.DeadlineExceeded) || errdefs.IsUnavailable(err) {
			log.G(c.env.ctx).WithError(err).WithField("process", p.name()).Warnf("no answer to SIGKILL: the host ends the process within %v", c.env.limits.KillGrace)
			return nil
		}
	}
	switch {
	case errdefs.IsNotFound(err):
		// Exited in the guest, its report on the way: as runc's shim, "already dead".
		return fmt.Errorf("%s: process already finished: %w", p.name(), errdefs.ErrNotFound)
	case err != nil:
		return fmt.Errorf("the agent signalling %s: %w", p.name(), err)
	}
	return nil
}

// pauseResume freezes (opPause) or thaws (opResume) c in the guest, then moves its init to
// next unless it exited meanwhile.
func (c *Container) pauseResume(ctx context.Context, run *podRun, o op, next state) error {
	if err := c.init.check(o); err != nil {
		return err
	}
	var err error
	if o == opPause {
		_, err = run.agent.PauseContainer(ctx, &agent.PauseContainerRequest{ContainerId: c.id})
	} else {
		_, err = run.agent.ResumeContainer(ctx, &agent.ResumeContainerRequest{ContainerId: c.id})
	}
	if err != nil {
		return fmt.Errorf("the agent: %s container %s: %w", o, c.id, err)
	}
	// The process may have exited meanwhile: then it stays stopped.
	if err := c.init.transition(o, next); err != nil {
		return err
	}
	if o == opPause {
		c.env.publish(&eventstypes.TaskPaused{ContainerID: c.id})
	} else {
		c.env.publish(&eventstypes.TaskResumed{ContainerID: c.id})
	}
	return nil
}

// stats is the agent's cgroup metrics of c (the pod's, for the pod sandbox), as the door
// checked them, served from the guest's last answer when the guest is slow (stats.go).
func (c *Container) stats(ctx context.Context, run *podRun) (*anypb.Any, error) {
	v, err := c.lastStats.get(ctx, run.ctx, c.env.limits.StatsWait, func(ctx context.Context) (*anypb.Any, error) {
		resp, err := run.agent.Stats(ctx, &agent.StatsRequest{ContainerId: c.id})
		return resp.GetStats(), err
	})
	if err != nil {
		return nil, fmt.Errorf("the agent's stats of %s: %w", c.id, err)
	}
	return v, nil
}

// update gives c new resource limits (linux.resources JSON).
func (c *Container) update(ctx context.Context, run *podRun, resources []byte) error {
	if _, err := run.agent.UpdateContainer(ctx, &agent.UpdateContainerRequest{ContainerId: c.id, Resources: resources}); err != nil {
		return fmt.Errorf("the agent updating %s: %w", c.id, err)
	}
	return nil
}

// resizePty resizes the pty of p, a process of c with a terminal.
func (c *Container) resizePty(ctx context.Context, run *podRun, p *process, width, height uint32) error {
	if err := p.check(opIO); err != nil {
		return err
	}
	if !p.stdio.Terminal {
		return fmt.Errorf("%s has no terminal: %w", p.name(), errdefs.ErrFailedPrecondition)
	}
	if _, err := run.agent.ResizePty(ctx, &agent.ResizePtyRequest{ContainerId: p.cid, ExecId: p.execID, Width: width, Height: height}); err != nil {
		return fmt.Errorf("the agent resizing the pty of %s: %w", p.name(), err)
	}
	return nil
}
