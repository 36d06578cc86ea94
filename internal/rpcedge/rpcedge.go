// Package rpcedge is the one policy at the edge of every ttrpc server kvfs runs: the shim's
// task and Sandbox APIs (containerd's pkg/shim serves them), a sandbox's control API
// (kvfsctl's) and the guest agent. At that edge
//   - a request's panic becomes an Internal error and a logged stack: the process serves
//     every other request of its pod, and the agent is the guest's PID 1, whose end would be
//     the VM's;
//   - an error's errdefs kind becomes its gRPC status code (Status: errgrpc.ToGRPC, the form
//     containerd's clients and kvfsctl read kinds back from; an error that is a status already
//     keeps it), and an error of no kind is Internal, a failure of the server's own;
//   - at debug level every request is logged with its method, its duration and its error.
//
// What the services below the edge return is theirs to decide; what leaves is decided here,
// once.
package rpcedge

import (
	"context"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Logger gives the log entry of a request (containerd's log.G, or a fixed entry).
type Logger func(ctx context.Context) *logrus.Entry

// Adjust may replace the status error a method's error became (err is the method's own); nil
// leaves every status as it is.
type Adjust func(method string, err, status error) error

// Interceptor is the policy above, logging through logger, with adjust (if not nil) applied
// to each error's status.
func Interceptor(logger Logger, adjust Adjust) ttrpc.UnaryServerInterceptor {
	return func(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, method ttrpc.Method) (resp any, err error) {
		start := time.Now()
		var merr error // the method's own error, which the debug line shows
		defer func() {
			if p := recover(); p != nil {
				logger(ctx).WithField("method", info.FullMethod).Errorf("panic: %v\n%s", p, debug.Stack())
				merr = fmt.Errorf("panic: %v", p)
				resp, err = nil, status.Error(codes.Internal, fmt.Sprintf("%s: internal error: %v", info.FullMethod, p))
			}
			if l := logger(ctx); l.Logger.IsLevelEnabled(logrus.DebugLevel) {
				l = l.WithFields(logrus.Fields{"method": info.FullMethod, "took": time.Since(start).Round(time.Microsecond)})
				if merr != nil {
					l = l.WithError(merr)
				}
				l.Debug("request")
			}
		}()
		resp, merr = method(ctx, unmarshal)
		if merr == nil {
			return resp, nil
		}
		st := Status(merr)
		if adjust != nil {
			st = adjust(info.FullMethod, merr, st)
		}
		return nil, st
	}
}

// Status is the status error err leaves the edge as: its errdefs kind's code, its own if it is
// a status already, Internal if it has no kind.
func Status(err error) error {
	st := errgrpc.ToGRPC(err)
	if status.Code(st) == codes.Unknown && !errdefs.IsUnknown(err) {
		return status.Error(codes.Internal, err.Error())
	}
	return st
}
