package shim

import (
	"context"
	"errors"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorEdge is where the shim's errors leave it: a ttrpc server interceptor (containerd's
// pkg/shim chains the interceptor of every plugin that has one) that turns the errdefs kinds
// the services return into the gRPC status codes containerd reads, once, for the task API
// and the Sandbox API alike. At debug level (containerd's, which it passes to its shims) it
// also logs every call with its duration and result: where a pod's time goes, call by call.
type ErrorEdge struct{}

// createMethod is the task API's Create, as ttrpc names it.
const createMethod = "/containerd.task.v3.Task/Create"

// errRestore is Create's error for a checkpoint to restore, which the shim does not
// implement.
var errRestore = errors.New("restoring a checkpoint")

// UnaryServerInterceptor translates each call's error. Create's errors are never
// Unimplemented: containerd takes that answer to Create as a shim that does not speak task
// API v3, and retries with v2 (which this shim does not serve), hiding the real error. The
// only Unimplemented a Create can meet here is a guest agent older than the shim (a call its
// image does not have), which is a precondition of the pod; a restore is refused as what it
// is, a request this shim does not implement.
func (ErrorEdge) UnaryServerInterceptor() ttrpc.UnaryServerInterceptor {
	return func(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, method ttrpc.Method) (any, error) {
		start := time.Now()
		resp, err := method(ctx, unmarshal)
		if l := log.G(ctx); l.Logger.IsLevelEnabled(log.DebugLevel) {
			l = l.WithFields(log.Fields{"method": info.FullMethod, "took": time.Since(start).Round(time.Microsecond)})
			if err != nil {
				l = l.WithError(err)
			}
			l.Debug("request")
		}
		if err == nil {
			return resp, nil
		}
		g := errgrpc.ToGRPC(err)
		if info.FullMethod == createMethod && errdefs.IsNotImplemented(errgrpc.ToNative(g)) && !errors.Is(err, errRestore) {
			return nil, status.Errorf(codes.FailedPrecondition, "%s (is the guest image older than the shim?)", err)
		}
		return nil, g
	}
}
