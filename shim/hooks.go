package shim

import (
	"fmt"

	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kvfs/kvfs/hooks"
)

// runHooks runs c's hooks of a host phase with the shim's context, the state saying status.
// The state's pid is the VM's of run, c's pod (as Kata gives its hypervisor's), 0 once the
// pod is gone (run nil): a host hook that looks a pid up in /proc must find a process of the
// pod, which the guest's pid of the container's init is not. No lock may be held: a hook may
// run as long as its timeout.
func (c *Container) runHooks(phase hooks.Phase, run *podRun, status specs.ContainerState) error {
	hs := phase.Of(c.hooks.hooks)
	if len(hs) == 0 {
		return nil
	}
	var pid uint32
	if run != nil {
		pid = run.vm.Pid()
	}
	return hooks.Run(c.env.ctx, phase, hs, &specs.State{
		Version: specs.Version, ID: c.id, Status: status, Pid: int(pid), Bundle: c.bundle,
		Annotations: c.hooks.annotations,
	})
}

// createHooks runs c's prestart then createRuntime hooks, once the agent has created it in
// run's pod (the state is "creating", as runc has it: the create is not done). A failure
// fails the Create.
func (c *Container) createHooks(run *podRun) error {
	for _, phase := range []hooks.Phase{hooks.Prestart, hooks.CreateRuntime} {
		if err := c.runHooks(phase, run, specs.StateCreating); err != nil {
			return fmt.Errorf("container %s: %w", c.id, err)
		}
	}
	return nil
}

// postHooks runs c's poststart or poststop hooks (c in run's pod, nil once it is gone); as the
// runtime spec says, their failures are logged and do not fail the call.
func (c *Container) postHooks(phase hooks.Phase, run *podRun, status specs.ContainerState) {
	if err := c.runHooks(phase, run, status); err != nil {
		log.G(c.env.ctx).WithError(err).WithField("container", c.id).Warnf("%s hooks failed (logged only, as the runtime spec says)", phase)
	}
}
