//go:build !kvfsfaults

package agent

import (
	"fmt"

	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// faultInterceptor refuses a fault mode: this agent is built without fault injection. A
// kvfs.fault= on its command line means a test configuration met a shipped image; booting as
// if nothing were asked would let a test of a hostile guest pass against a well-behaved one,
// so the agent stops (and the VM powers off) with an error naming the parameter instead.
func faultInterceptor(mode string, _ *Service, _ *logrus.Entry) (ttrpc.UnaryServerInterceptor, error) {
	if mode == "" {
		return nil, nil
	}
	return nil, fmt.Errorf("%s=%s: this agent is built without fault injection (the kvfsfaults build tag, for test images only)",
		apiv1.CmdlineFault, mode)
}
