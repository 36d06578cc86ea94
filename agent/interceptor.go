package agent

import (
	"context"

	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"

	"github.com/kvfs/kvfs/internal/rpcedge"
)

// Interceptor is the agent's edge, the policy of every kvfs ttrpc server (internal/rpcedge),
// logging through log: a panic in a request becomes an Internal error and a logged stack (the
// agent is PID 1: a panic would end the VM), an error leaves with its code, and every request
// is logged at debug level with its duration and result.
func Interceptor(log *logrus.Entry) ttrpc.UnaryServerInterceptor {
	return rpcedge.Interceptor(func(context.Context) *logrus.Entry { return log }, nil)
}
