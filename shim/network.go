package shim

import (
	"context"
	"fmt"
	"time"

	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/sandbox/network"
)

// configureNetworkTimeout bounds the agent's ConfigureNetwork (a few netlink calls in the
// guest).
const configureNetworkTimeout = 30 * time.Second

// podNetNS is the network namespace path of a pod whose (first) container has spec s: the
// path of its network namespace entry. An entry without a path (a new, empty namespace, as
// ctr run makes) gives "": the VM gets no NIC. No entry at all is the host's network
// (Kubernetes' hostNetwork, ctr run --net-host), which a VM cannot join: refused, as is a path
// that is the host's namespace (network.CheckPodNetNS).
func podNetNS(s *specs.Spec) (string, error) {
	if s.Linux != nil {
		for _, ns := range s.Linux.Namespaces {
			if ns.Type != specs.NetworkNamespace {
				continue
			}
			if ns.Path == "" {
				return "", nil
			}
			if err := network.CheckPodNetNS(ns.Path); err != nil {
				return "", err
			}
			return ns.Path, nil
		}
	}
	return "", fmt.Errorf("the spec has no network namespace, so the pod would share the host's: %w", network.ErrHostNetwork)
}

// podNetwork is a pod's network namespace joined to its VM (network.Attach).
type podNetwork struct {
	netns string
	ep    *network.Endpoint
}

// attachNetwork joins netns to a tap for sandbox id.
func attachNetwork(netns, id string) (*podNetwork, error) {
	ep, err := network.Attach(netns, network.TapName(id))
	if err != nil {
		return nil, fmt.Errorf("the pod's network: %w", err)
	}
	return &podNetwork{netns: netns, ep: ep}, nil
}

// nics is the VM's NIC on the tap, with the pod interface's MAC and MTU.
func (n *podNetwork) nics() []sandbox.NIC {
	return []sandbox.NIC{{Tap: n.ep.TapFile, MAC: n.ep.Interface.MAC, MTU: n.ep.Interface.MTU}}
}

// configure has the agent give the guest's NIC the pod interface's name, addresses and routes.
func (n *podNetwork) configure(ctx context.Context, a agent.AgentService) error {
	ctx, cancel := context.WithTimeout(ctx, configureNetworkTimeout)
	defer cancel()
	if _, err := a.ConfigureNetwork(ctx, n.ep.AgentRequest()); err != nil {
		return fmt.Errorf("the guest agent's ConfigureNetwork (%s, %v): %w", n.ep.Interface.Name, n.ep.Interface.Addresses, err)
	}
	log.G(ctx).WithFields(log.Fields{"interface": n.ep.Interface.Name, "mac": n.ep.Interface.MAC.String(),
		"addresses": n.ep.Interface.Addresses, "tap": n.ep.Tap}).Info("the pod's network reaches the guest")
	return nil
}

// detach closes the shim's descriptor of the tap and removes the tap and the filters; the
// VM must be gone (or going: the tap ends with QEMU's descriptor too).
func (n *podNetwork) detach() error {
	n.ep.Close()
	if err := network.Detach(n.netns, n.ep.Tap, n.ep.Interface.Name); err != nil {
		return fmt.Errorf("the pod's network: %w", err)
	}
	return nil
}
