package shim

import (
	"context"

	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/log"
)

// podEnv is what the pod and each of its containers share for the shim's life: the shim's
// context (its logger and namespace; it outlives requests), the task events' publisher, the
// logger of the lines the guest can cause, and the limits on the guest.
type podEnv struct {
	ctx      context.Context
	pub      events.Publisher
	guestLog guestLogger
	limits   GuestLimits
}

// publish sends a task event; events go out in the order they are published.
func (e *podEnv) publish(evt any) {
	if err := e.pub.Publish(e.ctx, runtime.GetTopic(evt), evt); err != nil {
		log.G(e.ctx).WithError(err).Error("publish event")
	}
}
