package shim

import (
	"context"

	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// errorEdge is the task service as ttrpc serves it: errdefs kinds become gRPC status codes
// here, once.
type errorEdge struct{ s *Service }

func grpcErr(err error) error {
	if err == nil {
		return nil
	}
	return errgrpc.ToGRPC(err)
}

func edge[Req, Resp any](f func(context.Context, Req) (Resp, error)) func(context.Context, Req) (Resp, error) {
	return func(ctx context.Context, r Req) (Resp, error) {
		resp, err := f(ctx, r)
		return resp, grpcErr(err)
	}
}

func (e errorEdge) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	return edge(e.s.State)(ctx, r)
}

// Create's errors are never Unimplemented: containerd takes that answer to Create as a shim
// that does not speak task API v3, and retries with v2 (which this shim does not serve),
// hiding the real error. The only Unimplemented a Create can meet here is a guest agent older
// than the shim (a call its image does not have), which is a precondition of the pod; a
// restore is refused as what it is, a request this shim does not implement.
func (e errorEdge) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (*taskAPI.CreateTaskResponse, error) {
	resp, err := e.s.Create(ctx, r)
	if err != nil && r.Checkpoint == "" && r.ParentCheckpoint == "" && errdefs.IsNotImplemented(errgrpc.ToNative(grpcErr(err))) {
		return nil, status.Errorf(codes.FailedPrecondition, "%s (is the guest image older than the shim?)", err)
	}
	return resp, grpcErr(err)
}
func (e errorEdge) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	return edge(e.s.Start)(ctx, r)
}
func (e errorEdge) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	return edge(e.s.Delete)(ctx, r)
}
func (e errorEdge) Pids(ctx context.Context, r *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	return edge(e.s.Pids)(ctx, r)
}
func (e errorEdge) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*emptypb.Empty, error) {
	return edge(e.s.Pause)(ctx, r)
}
func (e errorEdge) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*emptypb.Empty, error) {
	return edge(e.s.Resume)(ctx, r)
}
func (e errorEdge) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*emptypb.Empty, error) {
	return edge(e.s.Checkpoint)(ctx, r)
}
func (e errorEdge) Kill(ctx context.Context, r *taskAPI.KillRequest) (*emptypb.Empty, error) {
	return edge(e.s.Kill)(ctx, r)
}
func (e errorEdge) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*emptypb.Empty, error) {
	return edge(e.s.Exec)(ctx, r)
}
func (e errorEdge) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*emptypb.Empty, error) {
	return edge(e.s.ResizePty)(ctx, r)
}
func (e errorEdge) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*emptypb.Empty, error) {
	return edge(e.s.CloseIO)(ctx, r)
}
func (e errorEdge) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*emptypb.Empty, error) {
	return edge(e.s.Update)(ctx, r)
}
func (e errorEdge) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	return edge(e.s.Wait)(ctx, r)
}
func (e errorEdge) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	return edge(e.s.Stats)(ctx, r)
}
func (e errorEdge) Connect(ctx context.Context, r *taskAPI.ConnectRequest) (*taskAPI.ConnectResponse, error) {
	return edge(e.s.Connect)(ctx, r)
}
func (e errorEdge) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*emptypb.Empty, error) {
	return edge(e.s.Shutdown)(ctx, r)
}

// sandboxEdge is the Sandbox API as ttrpc serves it, with errdefs kinds translated as the
// task API's are.
type sandboxEdge struct{ s *Service }

func (e sandboxEdge) CreateSandbox(ctx context.Context, r *sandboxAPI.CreateSandboxRequest) (*sandboxAPI.CreateSandboxResponse, error) {
	return edge(e.s.CreateSandbox)(ctx, r)
}
func (e sandboxEdge) StartSandbox(ctx context.Context, r *sandboxAPI.StartSandboxRequest) (*sandboxAPI.StartSandboxResponse, error) {
	return edge(e.s.StartSandbox)(ctx, r)
}
func (e sandboxEdge) Platform(ctx context.Context, r *sandboxAPI.PlatformRequest) (*sandboxAPI.PlatformResponse, error) {
	return edge(e.s.Platform)(ctx, r)
}
func (e sandboxEdge) StopSandbox(ctx context.Context, r *sandboxAPI.StopSandboxRequest) (*sandboxAPI.StopSandboxResponse, error) {
	return edge(e.s.StopSandbox)(ctx, r)
}
func (e sandboxEdge) WaitSandbox(ctx context.Context, r *sandboxAPI.WaitSandboxRequest) (*sandboxAPI.WaitSandboxResponse, error) {
	return edge(e.s.WaitSandbox)(ctx, r)
}
func (e sandboxEdge) SandboxStatus(ctx context.Context, r *sandboxAPI.SandboxStatusRequest) (*sandboxAPI.SandboxStatusResponse, error) {
	return edge(e.s.SandboxStatus)(ctx, r)
}
func (e sandboxEdge) PingSandbox(ctx context.Context, r *sandboxAPI.PingRequest) (*sandboxAPI.PingResponse, error) {
	return edge(e.s.PingSandbox)(ctx, r)
}
func (e sandboxEdge) ShutdownSandbox(ctx context.Context, r *sandboxAPI.ShutdownSandboxRequest) (*sandboxAPI.ShutdownSandboxResponse, error) {
	return edge(e.s.ShutdownSandbox)(ctx, r)
}
func (e sandboxEdge) SandboxMetrics(ctx context.Context, r *sandboxAPI.SandboxMetricsRequest) (*sandboxAPI.SandboxMetricsResponse, error) {
	return edge(e.s.SandboxMetrics)(ctx, r)
}
func (e sandboxEdge) UpdateSandbox(ctx context.Context, r *sandboxAPI.UpdateSandboxRequest) (*sandboxAPI.UpdateSandboxResponse, error) {
	return edge(e.s.UpdateSandbox)(ctx, r)
}
