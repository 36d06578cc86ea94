package shim

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kvfs/kvfs/internal/testing/nettest"
	"github.com/kvfs/kvfs/sandbox/network"
)

func TestPodNetNS(t *testing.T) {
	withNS := func(ns ...specs.LinuxNamespace) *specs.Spec {
		return &specs.Spec{Linux: &specs.Linux{Namespaces: ns}}
	}
	for _, tt := range []struct {
		name string
		spec *specs.Spec
	}{
		{"no linux section", &specs.Spec{}},
		{"no network namespace (hostNetwork)", withNS(specs.LinuxNamespace{Type: specs.PIDNamespace})},
		{"the host's namespace by path", withNS(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: "/proc/self/ns/net"})},
	} {
		if got, err := podNetNS(tt.spec); !errors.Is(err, network.ErrHostNetwork) {
			t.Errorf("%s: %q, %v; want ErrHostNetwork", tt.name, got, err)
		}
	}
	got, err := podNetNS(withNS(specs.LinuxNamespace{Type: specs.PIDNamespace}, specs.LinuxNamespace{Type: specs.NetworkNamespace}))
	if err != nil || got != "" {
		t.Errorf("a new namespace (no path): %q, %v; want no NIC", got, err)
	}
	if _, err := podNetNS(withNS(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: "/run/netns/kvfs-none"})); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a namespace path that does not exist: %v", err)
	}
	if os.Geteuid() == 0 {
		ns := nettest.New(t, "kvfs-shim")
		if got, err := podNetNS(withNS(specs.LinuxNamespace{Type: specs.NetworkNamespace, Path: ns.Path})); err != nil || got != ns.Path {
			t.Errorf("the pod's namespace: %q, %v; want %s", got, err, ns.Path)
		}
	}
}

// TestPodNetworkConfigure: the agent is asked for what Attach found.
func TestPodNetworkConfigure(t *testing.T) {
	mac, _ := net.ParseMAC("02:42:0a:58:00:07")
	ep := &network.Endpoint{Tap: network.TapName("p"), Interface: network.Interface{
		Name: "eth0", MAC: mac, MTU: 1450, Addresses: []netip.Prefix{netip.MustParsePrefix("10.88.0.7/16")},
	}, Routes: []network.Route{{Dst: netip.MustParsePrefix("0.0.0.0/0"), Gateway: netip.MustParseAddr("10.88.0.1")}}}
	a := newFakeAgent()
	n := &podNetwork{netns: "/run/netns/p", ep: ep}
	if err := n.configure(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	if len(a.networks) != 1 {
		t.Fatalf("ConfigureNetwork calls: %d", len(a.networks))
	}
	r := a.networks[0]
	if len(r.Interfaces) != 1 || r.Interfaces[0].Mac != "02:42:0a:58:00:07" || r.Interfaces[0].Mtu != 1450 ||
		len(r.Routes) != 1 || r.Routes[0].Gateway != "10.88.0.1" || r.Routes[0].Destination != "0.0.0.0/0" {
		t.Errorf("ConfigureNetwork %v", r)
	}
	if nics := n.nics(); len(nics) != 1 || nics[0].MAC.String() != mac.String() || nics[0].MTU != 1450 {
		t.Errorf("nics %+v", nics)
	}
}
