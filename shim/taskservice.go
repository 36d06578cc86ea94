package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/hooks"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/shim/stdio"
)

// TaskService is containerd's task API (v3) for the pod's containers: each call checked
// against its process's state, then done on the pod its owner runs.
type TaskService struct{ *Pod }

var _ taskAPI.TTRPCTaskService = (*TaskService)(nil)

// NewTaskService returns the task API of o's pod.
func NewTaskService(o *Pod) *TaskService { return &TaskService{o} }

// RegisterTTRPC registers the task service (its errors translated by ErrorEdge).
func (s *TaskService) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, s)
	return nil
}

// Create makes the container: the pod first if it is the first one.
func (s *TaskService) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	if r.Checkpoint != "" || r.ParentCheckpoint != "" {
		return nil, fmt.Errorf("%w: %w", errRestore, errdefs.ErrNotImplemented)
	}
	cfg, err := s.loadConfig(r.Options)
	if err != nil {
		return nil, err
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, err
	}
	sandboxID, err := SandboxID(r.ID, spec.Annotations)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	// CRI's pod sandbox container runs nothing: the VM is the pod (sandboxtask.go).
	isSandbox := spec.Annotations[AnnotationContainerType] == containerTypeSandbox
	_, raiseOOM := podOOMScoreAdj(spec)
	if raiseOOM != nil {
		if err := sandbox.CheckOOMScoreAdj(*raiseOOM); err != nil {
			return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
	}
	var guestSpec *specs.Spec
	var submounts []string
	var hostBinds []HostBind
	if !isSandbox {
		// The Sandbox API leaves a container's /etc/hosts, /etc/resolv.conf and
		// /etc/hostname to the sandbox, and its /dev/shm (the pod's, in the guest).
		dir, apiSandbox := s.podFilesOf(sandboxID)
		if apiSandbox {
			withPodFiles(spec, dir)
		}
		if guestSpec, hostBinds, err = AdaptSpec(spec, r.ID); err != nil {
			return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
		if apiSandbox {
			withPodShm(guestSpec)
		}
	}
	ask, err := podAskOfSpec(sandboxID, spec, guestSpec)
	if err != nil {
		return nil, err
	}
	podReq, err := newPodRequest(cfg, ask)
	if err != nil {
		return nil, err
	}
	ns, _ := namespaces.Namespace(ctx)
	sc := stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}
	c := &Container{id: r.ID, bundle: r.Bundle, init: newProcess(r.ID, "", sc), execs: map[string]*process{},
		hooks: containerHooks{hooks: spec.Hooks, annotations: spec.Annotations}}

	s.mu.Lock()
	if _, ok := s.containers[r.ID]; ok {
		s.mu.Unlock()
		return nil, fmt.Errorf("container %s: %w", r.ID, errdefs.ErrAlreadyExists)
	}
	s.containers[r.ID] = c
	s.mu.Unlock()

	var undo []func()
	defer func() {
		if retErr == nil {
			return
		}
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		s.mu.Lock()
		delete(s.containers, r.ID)
		s.mu.Unlock()
		s.stopPodIfEmpty()
	}()

	// The record comes first: if this shim dies while booting the pod, the delete action
	// still finds the sandbox to clean up.
	if err := writeBundleRecord(r.Bundle, bundleRecord{SandboxID: sandboxID, BaseDir: cfg.BaseDir, Cgroup: podReq.Cgroup}); err != nil {
		return nil, err
	}
	undo = append(undo, func() { os.Remove(filepath.Join(r.Bundle, bundleRecordName)) })
	run, err := s.acquirePod(ctx, podReq, false)
	if err != nil {
		return nil, err
	}
	if raiseOOM != nil {
		if err := run.vm.RaiseOOMScoreAdj(*raiseOOM); err != nil {
			return nil, fmt.Errorf("container %s: %w", r.ID, err)
		}
	}
	if !isSandbox {
		if submounts, err = c.bind(s.ctx, run.vm, r, spec, hostBinds, &undo); err != nil {
			return nil, err
		}
	}

	pio, err := stdio.Open(s.ctx, sc)
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", r.ID, err)
	}
	c.init.io = pio
	undo = append(undo, func() { pio.Close() })

	specJSON, err := json.Marshal(guestSpec)
	if err != nil {
		return nil, err
	}
	in, out, errw := sc.Wants()
	_, err = run.agent.CreateContainer(ctx, &agent.CreateContainerRequest{
		ContainerId: r.ID, Spec: specJSON, Submounts: submounts,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	if err != nil {
		return nil, fmt.Errorf("the agent creating container %s: %w", r.ID, err)
	}
	pid := run.vm.Pid()
	c.init.pid = pid
	undo = append(undo, func() {
		if err := run.forget(s.ctx, c.init); err != nil {
			log.G(s.ctx).WithError(err).Warnf("deleting container %s in the guest after its failed create", r.ID)
		}
	})
	if err := c.createHooks(s.ctx, run); err != nil {
		// The runtime spec goes on from a failed hook to the destroy, then the poststop
		// hooks: first in the undo chain, they run once everything else is undone.
		undo = slices.Insert(undo, 0, func() { c.postHooks(s.ctx, hooks.Poststop, run, specs.StateStopped) })
		return nil, err
	}

	c.mu.Lock()
	c.ready = true
	c.mu.Unlock()
	s.publish(&eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: pid,
		IO: &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
	})
	s.watch(run, c, c.init)
	return &taskAPI.CreateTaskResponse{Pid: pid}, nil
}

// Start starts a created process.
func (s *TaskService) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if p.execID != "" {
		if err := c.init.check(opExec); err != nil {
			return nil, err
		}
	}
	if err := p.transition(opStart, stateStarting); err != nil {
		return nil, err
	}
	_, err = run.agent.StartProcess(ctx, &agent.StartProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	if err != nil {
		p.mu.Lock()
		p.state = stateCreated
		pending := p.pending
		p.pending = nil
		p.mu.Unlock()
		if pending != nil {
			go s.exited(c, p, *pending)
		}
		return nil, fmt.Errorf("the agent starting %s: %w", p.name(), err)
	}
	pid := run.vm.Pid()
	p.mu.Lock()
	p.pid = pid
	p.mu.Unlock()
	if p.execID == "" {
		s.publish(&eventstypes.TaskStart{ContainerID: p.cid, Pid: pid})
	} else {
		s.publish(&eventstypes.TaskExecStarted{ContainerID: p.cid, ExecID: p.execID, Pid: pid})
	}
	p.mu.Lock()
	p.state = stateRunning
	pending := p.pending
	p.pending = nil
	p.mu.Unlock()
	if pending != nil {
		go s.exited(c, p, *pending)
	}
	s.copyStdin(run, p)
	if p.execID == "" {
		c.postHooks(s.ctx, hooks.Poststart, run, specs.StateRunning)
	}
	return &taskAPI.StartResponse{Pid: pid}, nil
}

// Exec adds a process to a running container.
func (s *TaskService) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (_ *emptypb.Empty, retErr error) {
	c, err := s.getContainer(r.ID)
	if err != nil {
		return nil, err
	}
	if r.ExecID == "" {
		return nil, fmt.Errorf("exec without an id: %w", errdefs.ErrInvalidArgument)
	}
	if err := c.init.check(opExec); err != nil {
		return nil, err
	}
	procJSON, err := execProcess(r.Spec)
	if err != nil {
		return nil, fmt.Errorf("exec %s: %v: %w", r.ExecID, err, errdefs.ErrInvalidArgument)
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	ns, _ := namespaces.Namespace(ctx)
	sc := stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}
	p := newProcess(r.ID, r.ExecID, sc)
	c.mu.Lock()
	if _, ok := c.execs[r.ExecID]; ok {
		c.mu.Unlock()
		return nil, fmt.Errorf("exec %s of container %s: %w", r.ExecID, r.ID, errdefs.ErrAlreadyExists)
	}
	c.execs[r.ExecID] = p // reserved; started only once Exec returns
	c.mu.Unlock()
	defer func() {
		if retErr != nil {
			c.mu.Lock()
			delete(c.execs, r.ExecID)
			c.mu.Unlock()
			if p.io != nil {
				p.io.Close()
			}
		}
	}()
	if p.io, err = stdio.Open(s.ctx, sc); err != nil {
		return nil, fmt.Errorf("exec %s: %w", r.ExecID, err)
	}
	in, out, errw := sc.Wants()
	_, err = run.agent.ExecProcess(ctx, &agent.ExecProcessRequest{
		ContainerId: r.ID, ExecId: r.ExecID, Process: procJSON,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	if err != nil {
		return nil, fmt.Errorf("the agent adding exec %s to %s: %w", r.ExecID, r.ID, err)
	}
	s.publish(&eventstypes.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	s.watch(run, c, p)
	return &emptypb.Empty{}, nil
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

// Kill signals a process; with All, every process of the container. A SIGKILL is finished by
// the host if the guest does not (Pod.kill).
func (s *TaskService) Kill(ctx context.Context, r *taskAPI.KillRequest) (*emptypb.Empty, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opKill); err != nil {
		if st, _, _ := p.snapshot(); st == stateStopped || st == stateDeleted {
			// As runc's shim: a finished process is not found, which containerd's
			// callers (CRI's StopContainer, ctr kill) take as "already dead". A deleted one
			// is still found while its Delete cleans up (binds, hooks): it is as dead.
			return nil, fmt.Errorf("%s: process already finished: %w", p.name(), errdefs.ErrNotFound)
		}
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if err := s.kill(ctx, run, c, p, r.Signal, r.All); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Wait blocks until the process has exited, its output drained and TaskExit published.
func (s *TaskService) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	_, _, e := p.snapshot()
	return &taskAPI.WaitResponse{ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}, nil
}

// Delete deletes an exited (or created: it is killed first) process; the init's Delete
// removes the container, and the last container's the pod, as does CRI's pod sandbox
// container's (takeEndingRun).
func (s *TaskService) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opDelete); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		// The pod was stopped with the container in it (StopSandbox): its processes have
		// exited, and its binds went with the sandbox. What is left is on the host.
		if st, _, _ := p.snapshot(); st != stateStopped {
			return nil, err
		}
		run = nil
	}
	// live says the pod's agent can still be asked.
	live := func() bool { return run != nil && run.live() }
	forgotten := false // the agent has forgotten p already
	if st, _, _ := p.snapshot(); st == stateCreated && p.execID != "" {
		// A never-started exec has no process in the guest to kill: the agent forgets it,
		// and its waiters are released as if it had been killed.
		if live() {
			if err := run.forget(ctx, p); err != nil {
				return nil, err
			}
		}
		forgotten = true
		s.exited(c, p, exit{status: exitKilled, at: time.Now()})
	} else if st == stateCreated {
		// A created init is runc's created container: killing it ends it, the host
		// finishing the kill if the guest does not.
		if err := s.kill(ctx, run, c, p, uint32(syscall.SIGKILL), false); err != nil {
			return nil, err
		}
		select {
		case <-p.exited:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if p.execID == "" {
		c.mu.Lock()
		var running []string
		for id, e := range c.execs {
			if st, _, _ := e.snapshot(); st != stateStopped && st != stateDeleted {
				running = append(running, id)
			}
		}
		c.mu.Unlock()
		if len(running) > 0 && live() {
			return nil, fmt.Errorf("container %s still has execs %q: %w", c.id, running, errdefs.ErrFailedPrecondition)
		}
	}
	// The pod's last container, or CRI's pod sandbox container: the VM stops with it, and the
	// agent's Shutdown ends it with everything else in the guest. Deleting it in the guest
	// first would only run the container runtime there once more (50–90 ms under TCG here)
	// before the VM's end. The pod's other containers left (after a pod sandbox's) are
	// ended by the host: their processes exit with exitKilled, and their Deletes follow.
	var ending *podRun
	var others []*Container
	if p.execID == "" && run != nil {
		ending, others = s.takeEndingRun(c)
	}
	end := func() {
		markKilled(others)
		s.endRun(ending, others)
	}
	if live() && !forgotten && ending == nil {
		if err := run.forget(ctx, p); err != nil {
			// A process the host declared exited may still run in the guest, which then
			// refuses to delete it (or its container): it stays in the VM until the pod ends,
			// and containerd's Delete is done.
			if !p.endedByHost() && (p.execID != "" || !c.hasStrays()) {
				return nil, err
			}
			s.guestLog.warn("stray-delete", log.G(s.ctx).WithError(err).WithField("process", p.name()),
				"the guest did not delete a process (or the container of one) whose exit the host declared")
		}
	}
	if err := p.transition(opDelete, stateDeleted); err != nil {
		if ending != nil {
			// The concurrent Delete that won finds no run to stop: this one stops it.
			end()
		}
		return nil, err // a concurrent Delete won
	}
	_, pid, e := p.snapshot()
	resp := &taskAPI.DeleteResponse{Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}
	if p.execID != "" {
		c.mu.Lock()
		delete(c.execs, p.execID)
		c.mu.Unlock()
		return resp, nil
	}
	if run != nil {
		c.unbind(s.ctx, run.vm)
	}
	if c.rootfsMounted {
		unmountRootfs(s.ctx, filepath.Join(c.bundle, "rootfs"))
	}
	c.postHooks(s.ctx, hooks.Poststop, run, specs.StateStopped)
	s.mu.Lock()
	delete(s.containers, c.id)
	s.mu.Unlock()
	s.publish(&eventstypes.TaskDelete{ContainerID: c.id, Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)})
	if ending != nil {
		end()
	} else {
		s.stopPodIfEmpty()
	}
	return resp, nil
}

// State reports a process's state.
func (s *TaskService) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st, pid, e := p.snapshot()
	resp := &taskAPI.StateResponse{
		ID: c.id, ExecID: p.execID, Bundle: c.bundle, Pid: pid, Status: st.status(),
		Stdin: p.stdio.Stdin, Stdout: p.stdio.Stdout, Stderr: p.stdio.Stderr, Terminal: p.stdio.Terminal,
	}
	if st == stateStopped || st == stateDeleted {
		resp.ExitStatus, resp.ExitedAt = e.status, timestamppb.New(e.at)
	}
	return resp, nil
}

// Pause freezes the container.
func (s *TaskService) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*emptypb.Empty, error) {
	return s.pauseResume(ctx, r.ID, opPause, statePaused)
}

// Resume thaws the container.
func (s *TaskService) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*emptypb.Empty, error) {
	return s.pauseResume(ctx, r.ID, opResume, stateRunning)
}

func (s *TaskService) pauseResume(ctx context.Context, id string, o op, next state) (*emptypb.Empty, error) {
	c, err := s.getContainer(id)
	if err != nil {
		return nil, err
	}
	if err := c.init.check(o); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if o == opPause {
		_, err = run.agent.PauseContainer(ctx, &agent.PauseContainerRequest{ContainerId: id})
	} else {
		_, err = run.agent.ResumeContainer(ctx, &agent.ResumeContainerRequest{ContainerId: id})
	}
	if err != nil {
		return nil, fmt.Errorf("the agent: %s container %s: %w", o, id, err)
	}
	// The process may have exited meanwhile: then it stays stopped.
	if err := c.init.transition(o, next); err != nil {
		return nil, err
	}
	if o == opPause {
		s.publish(&eventstypes.TaskPaused{ContainerID: id})
	} else {
		s.publish(&eventstypes.TaskResumed{ContainerID: id})
	}
	return &emptypb.Empty{}, nil
}

// Pids is the VM's pid, the one host process that runs the container, as every task pid the
// shim reports is. containerd reads Pids' numbers as host pids: CRI's pod sandbox metrics
// count the open files and sockets of each under /proc, and a restarted containerd keeps a
// shim only if it lists some. A number the guest chose would name another host process there,
// so the guest is not asked.
func (s *TaskService) Pids(ctx context.Context, r *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	_, run, err := s.query(r.ID)
	if err != nil {
		return nil, err
	}
	out := &taskAPI.PidsResponse{}
	if pid := run.vm.Pid(); pid != 0 {
		out.Processes = []*task.ProcessInfo{{Pid: pid}}
	}
	return out, nil
}

// query is the common start of the container-wide queries: the container, which must not
// have exited, and the pod's run.
func (s *TaskService) query(id string) (*Container, *podRun, error) {
	c, err := s.getContainer(id)
	if err != nil {
		return nil, nil, err
	}
	if err := c.init.check(opQuery); err != nil {
		return nil, nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, nil, err
	}
	return c, run, nil
}

// Stats answers the agent's cgroup metrics of the container (the pod's, for the pod sandbox),
// as the door checked them (a cgroup2 Metrics of a bounded size, which containerd's CRI
// decodes by its type), served from the guest's last answer when the guest is slow (stats.go).
// As runc's shim, it answers for a created or stopped container, and NotFound, which
// containerd's Metrics passes over quietly, for one still being created.
func (s *TaskService) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	c, err := s.getContainer(r.ID)
	if errdefs.IsFailedPrecondition(err) {
		return nil, fmt.Errorf("container %s is being created: %w", r.ID, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if err := c.init.check(opStats); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err == nil && !run.live() {
		err = fmt.Errorf("the pod's VM is gone (%v)", run.vm.Err())
	}
	if err != nil {
		// Stopped with its pod: its cgroup went with the VM.
		return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrNotFound)
	}
	v, err := c.stats.get(ctx, run.ctx, s.opts.Limits.StatsWait, func(ctx context.Context) (*anypb.Any, error) {
		resp, err := run.agent.Stats(ctx, &agent.StatsRequest{ContainerId: c.id})
		return resp.GetStats(), err
	})
	if err != nil {
		return nil, fmt.Errorf("the agent's stats of %s: %w", c.id, err)
	}
	return &taskAPI.StatsResponse{Stats: v}, nil
}

// Update sends new resource limits (linux.resources JSON) to the agent.
func (s *TaskService) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*emptypb.Empty, error) {
	if r.Resources == nil || len(r.Resources.GetValue()) == 0 {
		return nil, fmt.Errorf("update of %s without resources: %w", r.ID, errdefs.ErrInvalidArgument)
	}
	var res specs.LinuxResources
	if err := json.Unmarshal(r.Resources.GetValue(), &res); err != nil {
		return nil, fmt.Errorf("update of %s: resources (%s): %v: %w", r.ID, r.Resources.GetTypeUrl(), err, errdefs.ErrInvalidArgument)
	}
	b, err := json.Marshal(&res)
	if err != nil {
		return nil, err
	}
	c, run, err := s.query(r.ID)
	if err != nil {
		return nil, err
	}
	if _, err := run.agent.UpdateContainer(ctx, &agent.UpdateContainerRequest{ContainerId: c.id, Resources: b}); err != nil {
		return nil, fmt.Errorf("the agent updating %s: %w", c.id, err)
	}
	return &emptypb.Empty{}, nil
}

// ResizePty resizes a terminal process's pty.
func (s *TaskService) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*emptypb.Empty, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opIO); err != nil {
		return nil, err
	}
	if !p.stdio.Terminal {
		return nil, fmt.Errorf("%s has no terminal: %w", p.name(), errdefs.ErrFailedPrecondition)
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if _, err := run.agent.ResizePty(ctx, &agent.ResizePtyRequest{ContainerId: p.cid, ExecId: p.execID, Width: r.Width, Height: r.Height}); err != nil {
		return nil, fmt.Errorf("the agent resizing the pty of %s: %w", p.name(), err)
	}
	return &emptypb.Empty{}, nil
}

// CloseIO closes a process's stdin: it reads EOF once what was written before has arrived.
// With a stdin stream that is the stdin copy's to do, at the stream's end (copyStdin); as
// runc's shim, CloseIO does not wait for it: the process may not be reading.
func (s *TaskService) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*emptypb.Empty, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if !r.Stdin {
		return &emptypb.Empty{}, nil
	}
	if err := p.check(opIO); err != nil {
		return nil, err
	}
	if p.io != nil && p.io.Stdin != nil {
		if err := p.io.CloseStdin(); err != nil {
			return nil, fmt.Errorf("the stdin of %s: %w", p.name(), err)
		}
		return &emptypb.Empty{}, nil
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if err := run.closeStdin(ctx, p); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Checkpoint is not supported: the process runs in a VM.
func (s *TaskService) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*emptypb.Empty, error) {
	return nil, fmt.Errorf("checkpoint of %s: %w", r.ID, errdefs.ErrNotImplemented)
}

// Connect answers the shim's pid and the task's.
func (s *TaskService) Connect(ctx context.Context, r *taskAPI.ConnectRequest) (*taskAPI.ConnectResponse, error) {
	resp := &taskAPI.ConnectResponse{ShimPid: uint32(os.Getpid()), Version: Version}
	if c, err := s.getContainer(r.ID); err == nil {
		_, pid, _ := c.init.snapshot()
		resp.TaskPid = pid
	}
	return resp, nil
}

// Shutdown ends the shim once it serves no container, and no sandbox of the Sandbox API
// (ShutdownSandbox ends that).
func (s *TaskService) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	n := len(s.containers)
	busy := s.booting != nil || s.sandbox != nil
	s.mu.Unlock()
	if n > 0 || busy {
		return &emptypb.Empty{}, nil
	}
	s.stopPodIfEmpty()
	s.opts.Shutdown.Shutdown()
	return &emptypb.Empty{}, nil
}
