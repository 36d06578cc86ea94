package agent

import (
	"context"
	"runtime/debug"
	"time"

	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Interceptor is the agent's one ttrpc interceptor: a panic in a request becomes an Internal
// error and a logged stack (the agent is PID 1: a panic would end the VM), and every request
// is logged at debug level with its duration and result.
func Interceptor(log *logrus.Entry) ttrpc.UnaryServerInterceptor {
	return func(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (resp any, err error) {
		start := time.Now()
		defer func() {
			if r := recover(); r != nil {
				log.WithField("method", info.FullMethod).Errorf("panic: %v\n%s", r, debug.Stack())
				resp, err = nil, status.Errorf(codes.Internal, "%s: the agent failed: %v", info.FullMethod, r)
			}
			if log.Logger.IsLevelEnabled(logrus.DebugLevel) {
				log.WithFields(logrus.Fields{"method": info.FullMethod, "took": time.Since(start).Round(time.Microsecond),
					"code": status.Code(err)}).Debug("request")
			}
		}()
		return m(ctx, unmarshal)
	}
}
