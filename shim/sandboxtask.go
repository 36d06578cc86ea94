package shim

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// The pod sandbox's task. containerd's CRI (sandboxer "podsandbox") runs a pod as its sandbox
// container, the pause container, first: its task's life is the pod's, and the pod's other
// containers join its namespaces. Here the VM is the pod: the sandbox container runs nothing,
// not even in the guest, and nothing of its image is mounted. Its task is answered by the shim:
// sandboxAgent stands in front of the guest agent and answers every call about the sandbox
// container itself, so the task service runs it through the same state machine and exit
// sequence as any container. Its task's Delete ends the pod (Pod.takeEndingRun): CRI
// deletes it once StopPodSandbox has killed it, and a container left then (its stop or its
// Delete failed) must not keep the VM running; it is ended by the host, and deleted after.

// newSandboxAgent is ag fronted for the sandbox container id, whose pid is the VM's.
func newSandboxAgent(ag agent.AgentService, id string, pid uint32) *sandboxAgent {
	return &sandboxAgent{AgentService: ag, id: id, pid: pid, exited: make(chan struct{})}
}

// sandboxAgent answers for the sandbox container id and passes every other call to the
// guest's agent, through its door. The task's pid is the VM's (Pod.Pid); it exits when
// signalled as the pause process would (SIGTERM and SIGINT: status 0; SIGKILL and the other
// signals whose default action ends a process: 128+signal), and with the pod's death (the
// waiter's context ends: the task service gives exitVMDied, or exitKilled).
type sandboxAgent struct {
	agent.AgentService
	id  string
	pid uint32

	mu       sync.Mutex
	status   uint32    // guarded by mu; valid once exited is closed
	at       time.Time // guarded by mu
	exited   chan struct{}
	exitOnce sync.Once
}

// errNoProcesses refuses what would need a process in the sandbox container.
func (a *sandboxAgent) errNoProcesses(what string) error {
	return fmt.Errorf("%s: the pod sandbox %s runs no processes (its VM is the pod): %w", what, a.id, errdefs.ErrNotImplemented)
}

func (a *sandboxAgent) exit(status uint32) {
	a.exitOnce.Do(func() {
		a.mu.Lock()
		a.status, a.at = status, time.Now()
		a.mu.Unlock()
		close(a.exited)
	})
}

// pauseExit is the exit status of the pause process for sig, and whether sig ends it.
func pauseExit(sig syscall.Signal) (uint32, bool) {
	switch sig {
	case syscall.SIGTERM, syscall.SIGINT:
		return 0, true // the pause process exits cleanly on these
	case 0, syscall.SIGCHLD, syscall.SIGCONT, syscall.SIGURG, syscall.SIGWINCH,
		syscall.SIGSTOP, syscall.SIGTSTP, syscall.SIGTTIN, syscall.SIGTTOU:
		return 0, false // ignored, or a stop a process without a body cannot serve
	}
	return 128 + uint32(sig), true
}

func (a *sandboxAgent) CreateContainer(ctx context.Context, r *agent.CreateContainerRequest) (*agent.CreateContainerResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.CreateContainer(ctx, r)
	}
	return &agent.CreateContainerResponse{Pid: a.pid}, nil
}

func (a *sandboxAgent) ExecProcess(ctx context.Context, r *agent.ExecProcessRequest) (*agent.ExecProcessResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.ExecProcess(ctx, r)
	}
	return nil, a.errNoProcesses("exec " + r.ExecId)
}

func (a *sandboxAgent) StartProcess(ctx context.Context, r *agent.StartProcessRequest) (*agent.StartProcessResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.StartProcess(ctx, r)
	}
	return &agent.StartProcessResponse{Pid: a.pid}, nil
}

func (a *sandboxAgent) SignalProcess(ctx context.Context, r *agent.SignalProcessRequest) (*agent.SignalProcessResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.SignalProcess(ctx, r)
	}
	if r.Signal > 64 {
		return nil, fmt.Errorf("signal %d: %w", r.Signal, errdefs.ErrInvalidArgument)
	}
	if status, ends := pauseExit(syscall.Signal(r.Signal)); ends {
		a.exit(status)
	}
	return &agent.SignalProcessResponse{}, nil
}

func (a *sandboxAgent) WaitProcess(ctx context.Context, r *agent.WaitProcessRequest) (*agent.WaitProcessResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.WaitProcess(ctx, r)
	}
	select {
	case <-a.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return &agent.WaitProcessResponse{ExitStatus: a.status, ExitedAt: timestamppb.New(a.at)}, nil
}

func (a *sandboxAgent) DeleteProcess(ctx context.Context, r *agent.DeleteProcessRequest) (*agent.DeleteProcessResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.DeleteProcess(ctx, r)
	}
	return &agent.DeleteProcessResponse{}, nil
}

func (a *sandboxAgent) ReadStdout(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.ReadStdout(ctx, r)
	}
	return &agent.ReadStreamResponse{Eof: true}, nil
}

func (a *sandboxAgent) ReadStderr(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.ReadStderr(ctx, r)
	}
	return &agent.ReadStreamResponse{Eof: true}, nil
}

func (a *sandboxAgent) WriteStdin(ctx context.Context, r *agent.WriteStdinRequest) (*agent.WriteStdinResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.WriteStdin(ctx, r)
	}
	return nil, a.errNoProcesses("stdin")
}

func (a *sandboxAgent) CloseStdin(ctx context.Context, r *agent.CloseStdinRequest) (*agent.CloseStdinResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.CloseStdin(ctx, r)
	}
	return &agent.CloseStdinResponse{}, nil
}

func (a *sandboxAgent) ResizePty(ctx context.Context, r *agent.ResizePtyRequest) (*agent.ResizePtyResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.ResizePty(ctx, r)
	}
	return nil, a.errNoProcesses("resize the terminal")
}

// Stats of the sandbox are the pod's: every container of the guest (the agent's answer for
// no container id).
func (a *sandboxAgent) Stats(ctx context.Context, r *agent.StatsRequest) (*agent.StatsResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.Stats(ctx, r)
	}
	return a.AgentService.Stats(ctx, &agent.StatsRequest{})
}

func (a *sandboxAgent) UpdateContainer(ctx context.Context, r *agent.UpdateContainerRequest) (*agent.UpdateContainerResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.UpdateContainer(ctx, r)
	}
	return nil, fmt.Errorf("update the resources of pod sandbox %s: a VM's size is set when it boots: %w", a.id, errdefs.ErrNotImplemented)
}

func (a *sandboxAgent) PauseContainer(ctx context.Context, r *agent.PauseContainerRequest) (*agent.PauseContainerResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.PauseContainer(ctx, r)
	}
	return nil, a.errNoProcesses("pause")
}

func (a *sandboxAgent) ResumeContainer(ctx context.Context, r *agent.ResumeContainerRequest) (*agent.ResumeContainerResponse, error) {
	if r.ContainerId != a.id {
		return a.AgentService.ResumeContainer(ctx, r)
	}
	return nil, a.errNoProcesses("resume")
}
