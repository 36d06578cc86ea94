package shim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// podRun is the pod from its boot to its stop: its VM, the door to its agent, the
// agent the services call (the door, fronted by the pod sandbox's task when CRI's podsandbox
// runs the pod), and the pod's life: its context, with which the door ends every call to the
// agent and the processes' own calls end.
type podRun struct {
	id string
	// sandboxTask says the pod was booted for CRI's pod sandbox container (its id is id),
	// whose task is the pod's life: its Delete ends the pod.
	sandboxTask bool
	vm          VM
	door        *agentDoor
	agent       agent.AgentService
	ctx         context.Context // ends when the pod dies or is stopped
	cancel      context.CancelFunc
	// netns is the pod's network namespace ("": none), where ports relays port-forward to
	// the guest (portforward.go); ports is nil until configure, and without a namespace.
	netns string
	ports *portRelay
}

// newPodRun is the run of vm, booted for req. The door's failure policy kills the VM: the
// pod's death then ends every process (Container.watch). The frames the VM's agent
// connection drops, if it is filtered (agentwire.go), count at the door.
func newPodRun(env *podEnv, vm VM, req PodRequest) *podRun {
	ctx, cancel := context.WithCancel(context.WithoutCancel(env.ctx))
	r := &podRun{id: req.ID, sandboxTask: req.SandboxTask, vm: vm, ctx: ctx, cancel: cancel, netns: req.NetNS}
	r.door = newAgentDoor(env.ctx, ctx, vm.Agent(), env.limits, &env.guestLog, func(why error) {
		log.G(env.ctx).WithError(why).Error("the pod's guest is cut off: killing its VM")
		vm.Kill(why)
	})
	if w, ok := vm.(wireFiltered); ok && w.agentWire() != nil {
		w.agentWire().watch(func(v wireViolation) {
			r.door.broke(v.kind, fmt.Errorf("the guest agent broke the protocol: %w", v), v.fatal)
		})
	}
	r.agent = r.door
	if req.SandboxTask {
		r.agent = newSandboxAgent(r.door, req.ID, vm.Pid())
	}
	return r
}

// live says the pod's agent can still be asked: the pod has not died (its context ends just
// after) nor been stopped.
func (r *podRun) live() bool {
	select {
	case <-r.vm.Done():
		return false
	default:
		return r.ctx.Err() == nil
	}
}

// setSysctlsTimeout bounds the agent's SetSysctls (a few writes into /proc/sys).
const setSysctlsTimeout = 30 * time.Second

// configure gives the booted guest, through the door, what its pod was asked: the network of
// its NIC (the VM's) and the pod's sysctls; then port-forward's relay is set up in the pod's
// network namespace. A relay that cannot be set up (a host kernel without nftables' NAT, a
// namespace whose loopback is down) is logged, not fatal: the pod runs, and port-forward
// to it fails as it did before there was a relay, refused.
func (run *podRun) configure(ctx context.Context, env *podEnv, sysctls map[string]string) error {
	if err := run.vm.ConfigureNetwork(ctx, run.door); err != nil {
		return err
	}
	if len(sysctls) > 0 {
		sctx, cancel := context.WithTimeout(ctx, setSysctlsTimeout)
		defer cancel()
		if _, err := run.door.SetSysctls(sctx, &agent.SetSysctlsRequest{Sysctls: sysctls}); err != nil {
			return fmt.Errorf("pod %s: its sysctls in the guest: %w", run.id, err)
		}
	}
	if run.netns != "" {
		ports, err := startPortRelay(run.ctx, env, run.netns, run.door)
		if err != nil {
			log.G(ctx).WithError(err).Warn("no port-forward to the pod")
		}
		run.ports = ports
	}
	return nil
}

// stop stops the pod's VM, its guest shut down through the door first (shutdownGuest): the
// agent's Shutdown answers the pending GetOOMEvent (Unavailable), which ends the OOM loop;
// the run's context goes after, and with it the calls left. Port-forward's relay goes first,
// its connections reset and its rules removed from the pod's namespace, which may outlive
// the pod.
func (run *podRun) stop(ctx context.Context) error {
	var errs []error
	if run.ports != nil {
		errs = append(errs, run.ports.close())
	}
	errs = append(errs, run.vm.Stop(ctx, run.shutdownGuest))
	run.cancel()
	return errors.Join(errs...)
}

// shutdownGuest asks the agent to end every process of the guest and power it off.
func (run *podRun) shutdownGuest(ctx context.Context) error {
	_, err := run.door.Shutdown(ctx, &agent.ShutdownRequest{})
	return err
}

// closeStdin closes p's stdin in the guest (for a terminal, the agent sends its end-of-file
// character).
func (run *podRun) closeStdin(ctx context.Context, p *process) error {
	if _, err := run.agent.CloseStdin(ctx, &agent.CloseStdinRequest{ContainerId: p.cid, ExecId: p.execID}); err != nil {
		return fmt.Errorf("the agent closing the stdin of %s: %w", p.name(), err)
	}
	return nil
}

// forget asks the agent to forget p; a process it does not know is already forgotten.
func (run *podRun) forget(ctx context.Context, p *process) error {
	_, err := run.agent.DeleteProcess(ctx, &agent.DeleteProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	if err != nil && run.live() && !errdefs.IsNotFound(err) {
		return fmt.Errorf("the agent deleting %s: %w", p.name(), err)
	}
	return nil
}
