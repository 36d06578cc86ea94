package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// TaskService is containerd's task API (v3) for the pod's containers: each call finds its
// container or process, checked against its state, and asks it of the Pod.
type TaskService struct{ pod *Pod }

var _ taskAPI.TTRPCTaskService = (*TaskService)(nil)

// NewTaskService returns the task API of pod.
func NewTaskService(pod *Pod) *TaskService { return &TaskService{pod} }

// RegisterTTRPC registers the task service (its errors translated by ErrorEdge).
func (s *TaskService) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, s)
	return nil
}

// Create makes the container: the pod first if it is the first one.
func (s *TaskService) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	if r.Checkpoint != "" || r.ParentCheckpoint != "" {
		return nil, fmt.Errorf("%w: %w", errRestore, errdefs.ErrNotImplemented)
	}
	cfg, err := s.pod.loadConfig(r.Options)
	if err != nil {
		return nil, err
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, err
	}
	ns, _ := namespaces.Namespace(ctx)
	req, err := newContainerRequest(cfg, r, spec, ns, s.pod.podFilesOf)
	if err != nil {
		return nil, err
	}
	c, err := s.pod.createContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	return &taskAPI.CreateTaskResponse{Pid: c.init.pid}, nil
}

// Start starts a created process.
func (s *TaskService) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	c, p, err := s.pod.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, err
	}
	pid, err := c.start(ctx, run, p)
	if err != nil {
		return nil, err
	}
	return &taskAPI.StartResponse{Pid: pid}, nil
}

// Exec adds a process to a running container.
func (s *TaskService) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*emptypb.Empty, error) {
	c, err := s.pod.getContainer(r.ID)
	if err != nil {
		return nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, err
	}
	ns, _ := namespaces.Namespace(ctx)
	if err := c.exec(ctx, run, r, ns); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Kill signals a process; with All, every process of the container. A SIGKILL is finished by
// the host if the guest does not (Container.kill).
func (s *TaskService) Kill(ctx context.Context, r *taskAPI.KillRequest) (*emptypb.Empty, error) {
	c, p, err := s.pod.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.checkKill(); err != nil {
		return nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, err
	}
	if err := c.kill(ctx, run, p, r.Signal, r.All); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Wait blocks until the process has exited, its output drained and TaskExit published.
func (s *TaskService) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	_, p, err := s.pod.getProcess(r.ID, r.ExecID)
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

// Delete deletes an exited (or created: it is killed first) process (Pod.deleteProcess).
func (s *TaskService) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	c, p, err := s.pod.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	pid, e, err := s.pod.deleteProcess(ctx, c, p)
	if err != nil {
		return nil, err
	}
	return &taskAPI.DeleteResponse{Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}, nil
}

// State reports a process's state.
func (s *TaskService) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	c, p, err := s.pod.getProcess(r.ID, r.ExecID)
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
	c, err := s.pod.getContainer(id)
	if err != nil {
		return nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, err
	}
	if err := c.pauseResume(ctx, run, o, next); err != nil {
		return nil, err
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
	c, err := s.pod.getContainer(id)
	if err != nil {
		return nil, nil, err
	}
	if err := c.init.check(opQuery); err != nil {
		return nil, nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, nil, err
	}
	return c, run, nil
}

// Stats answers the agent's cgroup metrics of the container (the pod's, for the pod sandbox),
// as the door checked them (a cgroup2 Metrics of a bounded size, which containerd's CRI
// decodes by its type), served from the guest's last answer when the guest is slow (stats.go).
// As runc's shim, it answers for a created or stopped container, and NotFound, which
// containerd's Metrics passes over quietly, for one still being created or being deleted.
func (s *TaskService) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	c, err := s.pod.getContainer(r.ID)
	if errdefs.IsFailedPrecondition(err) {
		return nil, fmt.Errorf("container %s is being created: %w", r.ID, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if err := c.init.check(opStats); err != nil {
		// Being deleted: as gone as a runc container whose Delete took its cgroup.
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrNotFound)
	}
	run, err := s.pod.currentRun()
	if err == nil && !run.live() {
		err = fmt.Errorf("the pod's VM is gone (%v)", run.vm.Err())
	}
	if err != nil {
		// Stopped with its pod: its cgroup went with the VM.
		return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrNotFound)
	}
	v, err := c.stats(ctx, run)
	if err != nil {
		return nil, err
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
	if err := c.update(ctx, run, b); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// ResizePty resizes a terminal process's pty.
func (s *TaskService) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*emptypb.Empty, error) {
	c, p, err := s.pod.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	run, err := s.pod.currentRun()
	if err != nil {
		return nil, err
	}
	if err := c.resizePty(ctx, run, p, r.Width, r.Height); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// CloseIO closes a process's stdin: it reads EOF once what was written before has arrived.
// With a stdin stream that is the stdin copy's to do, at the stream's end (copyStdin); as
// runc's shim, CloseIO does not wait for it: the process may not be reading.
func (s *TaskService) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*emptypb.Empty, error) {
	_, p, err := s.pod.getProcess(r.ID, r.ExecID)
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
	run, err := s.pod.currentRun()
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
	if c, err := s.pod.getContainer(r.ID); err == nil {
		_, pid, _ := c.init.snapshot()
		resp.TaskPid = pid
	}
	return resp, nil
}

// Shutdown ends the shim once it serves no container, and no sandbox of the Sandbox API
// (ShutdownSandbox ends that).
func (s *TaskService) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*emptypb.Empty, error) {
	s.pod.shutdownIfIdle()
	return &emptypb.Empty{}, nil
}
