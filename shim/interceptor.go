package shim

import (
	"errors"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvfs/kvfs/internal/rpcedge"
)

// ErrorEdge is where the shim's errors leave it: a ttrpc server interceptor (containerd's
// pkg/shim chains the interceptor of every plugin that has one) with the policy of every kvfs
// ttrpc server (internal/rpcedge: a panic an Internal error, errdefs kinds the gRPC status
// codes containerd reads, every call logged with its duration at debug level, containerd's
// level, which it passes to its shims: where a pod's time goes, call by call), once, for the
// task API and the Sandbox API alike.
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
	return rpcedge.Interceptor(log.G, func(method string, err, st error) error {
		if method == createMethod && errdefs.IsNotImplemented(errgrpc.ToNative(st)) && !errors.Is(err, errRestore) {
			return status.Errorf(codes.FailedPrecondition, "%s (is the guest image older than the shim?)", err)
		}
		return st
	})
}
