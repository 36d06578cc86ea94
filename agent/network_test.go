package agent

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/sirupsen/logrus"
	"github.com/vishvananda/netlink"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/rpcedge"
	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// validNetRequest is a good request the cases below break one field of.
func validNetRequest() *apiv1.ConfigureNetworkRequest {
	return &apiv1.ConfigureNetworkRequest{
		Interfaces: []*apiv1.Interface{{
			Mac: "02:42:0a:58:00:02", Name: "eth0", Mtu: 1400,
			Addresses: []string{"10.88.0.2/24", "fd88::2/64"},
		}},
		Routes: []*apiv1.Route{
			{Destination: "default", Gateway: "10.88.0.1", Interface: "eth0"},
			{Destination: "10.89.0.0/16", Interface: "eth0", Scope: apiv1.RouteScope_ROUTE_SCOPE_LINK},
			{Gateway: "fd88::1", Interface: "eth0"},
		},
	}
}

func TestParseNetworkRequest(t *testing.T) {
	cfg, err := ParseNetworkRequest(validNetRequest())
	if err != nil {
		t.Fatal(err)
	}
	in := cfg.Interfaces[0]
	if in.MAC.String() != "02:42:0a:58:00:02" || in.Name != "eth0" || in.MTU != 1400 ||
		!slices.Equal(in.Addresses, []netip.Prefix{netip.MustParsePrefix("10.88.0.2/24"), netip.MustParsePrefix("fd88::2/64")}) {
		t.Errorf("interface %+v", in)
	}
	want := []NetRoute{
		{Dst: netip.MustParsePrefix("10.89.0.0/16"), Interface: "eth0", Scope: netlink.SCOPE_LINK},
		{Dst: netip.MustParsePrefix("0.0.0.0/0"), Gateway: netip.MustParseAddr("10.88.0.1"), Interface: "eth0"},
		{Dst: netip.MustParsePrefix("::/0"), Gateway: netip.MustParseAddr("fd88::1"), Interface: "eth0"},
	}
	if !slices.Equal(cfg.Routes, want) {
		t.Errorf("routes %+v,\nwant %+v (those without a gateway first)", cfg.Routes, want)
	}

	tests := []struct {
		name   string
		modify func(r *apiv1.ConfigureNetworkRequest)
		want   string
	}{
		{"bad MAC", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mac = "02:42" }, `interfaces[0].mac "02:42"`},
		{"long MAC", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mac = "02:00:00:00:00:00:00:01" }, "not a 6-byte Ethernet address"},
		{"multicast MAC", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mac = "01:00:5e:00:00:01" }, "interfaces[0].mac \"01:00:5e:00:00:01\": a multicast address"},
		{"zero MAC", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mac = "00:00:00:00:00:00" }, "all zeros"},
		{"same MAC twice", func(r *apiv1.ConfigureNetworkRequest) {
			r.Interfaces = append(r.Interfaces, &apiv1.Interface{Mac: "02:42:0A:58:00:02", Name: "eth1"})
		}, `interfaces[1].mac "02:42:0A:58:00:02": another interface's`},
		{"same name twice", func(r *apiv1.ConfigureNetworkRequest) {
			r.Interfaces = append(r.Interfaces, &apiv1.Interface{Mac: "02:42:0a:58:00:03", Name: "eth0"})
		}, `interfaces[1].name "eth0": another interface's`},
		{"empty name", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Name = "" }, `interfaces[0].name "": want 1 to 15 bytes`},
		{"long name", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Name = strings.Repeat("e", 16) }, "want 1 to 15 bytes, not 16"},
		{"name with a slash", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Name = "a/b" }, `interfaces[0].name "a/b": contains '/'`},
		{"name with a space", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Name = "a b" }, `interfaces[0].name "a b"`},
		{"name lo", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Name = "lo" }, "the loopback interface's name"},
		{"MTU too small", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mtu = 67 }, "interfaces[0].mtu 67: want 68 to 65535"},
		{"MTU too large", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Mtu = 65536 }, "interfaces[0].mtu 65536"},
		{"address without a length", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Addresses[1] = "fd88::2" }, `interfaces[0].addresses[1] "fd88::2": want an address and a prefix length`},
		{"unspecified address", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Addresses[0] = "0.0.0.0/0" }, "unspecified, multicast or loopback"},
		{"multicast address", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Addresses[0] = "224.0.0.1/4" }, "unspecified, multicast or loopback"},
		{"mapped address", func(r *apiv1.ConfigureNetworkRequest) { r.Interfaces[0].Addresses[0] = "::ffff:10.0.0.1/120" }, "IPv4-mapped"},
		{"address twice", func(r *apiv1.ConfigureNetworkRequest) {
			r.Interfaces[0].Addresses = append(r.Interfaces[0].Addresses, "10.88.0.2/24")
		}, `interfaces[0].addresses[2] "10.88.0.2/24": given twice`},
		{"too many interfaces", func(r *apiv1.ConfigureNetworkRequest) {
			r.Interfaces = make([]*apiv1.Interface, 17)
		}, "interfaces: 17, more than 16"},
		{"too many routes", func(r *apiv1.ConfigureNetworkRequest) { r.Routes = make([]*apiv1.Route, 257) }, "routes: 257, more than 256"},
		{"bad destination", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[1].Destination = "10.89.0.0" }, `routes[1].destination "10.89.0.0": want a prefix`},
		{"destination with host bits", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[1].Destination = "10.89.1.0/16" }, "has bits set past the prefix length (want 10.89.0.0/16)"},
		{"default without gateway", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[0].Gateway = "" }, `routes[0].destination "default": a default route without a gateway has no family`},
		{"bad gateway", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[0].Gateway = "10.88.0" }, `routes[0].gateway "10.88.0": not an IP address`},
		{"gateway of the other family", func(r *apiv1.ConfigureNetworkRequest) {
			r.Routes[1] = &apiv1.Route{Destination: "10.89.0.0/16", Gateway: "fd88::1", Interface: "eth0"}
		}, `routes[1].gateway "fd88::1": not of the destination's family`},
		{"unknown interface", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[2].Interface = "eth1" }, `routes[2].interface "eth1": not one of the request's interfaces`},
		{"unknown scope", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[1].Scope = 7 }, "routes[1].scope 7: not a RouteScope"},
		{"gateway with link scope", func(r *apiv1.ConfigureNetworkRequest) { r.Routes[0].Scope = apiv1.RouteScope_ROUTE_SCOPE_LINK }, "a route through a gateway has universe scope"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := validNetRequest()
			tt.modify(r)
			_, err := ParseNetworkRequest(r)
			if status.Code(rpcedge.Status(err)) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want InvalidArgument containing %q", err, tt.want)
			}
		})
	}
}

type fakeNetwork struct {
	got []*NetworkConfig
	err error
}

func (f *fakeNetwork) Configure(cfg *NetworkConfig) error {
	f.got = append(f.got, cfg)
	return f.err
}

func TestServiceConfigureNetwork(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	fn := &fakeNetwork{}
	svc, err := NewService(Config{Runtime: newFakeRuntime(), Cgroups: &fakeCgroups{onOOM: map[string]func(){}},
		StateDir: t.TempDir(), Log: logrus.NewEntry(log), Network: fn})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	bad := validNetRequest()
	bad.Routes[0].Interface = "eth9"
	if _, err := svc.ConfigureNetwork(ctx, bad); status.Code(rpcedge.Status(err)) != codes.InvalidArgument {
		t.Errorf("a bad request: %v, want InvalidArgument", err)
	}
	if len(fn.got) != 0 {
		t.Errorf("a bad request reached the network: %+v", fn.got)
	}
	if _, err := svc.ConfigureNetwork(ctx, validNetRequest()); err != nil {
		t.Fatal(err)
	}
	if len(fn.got) != 1 || fn.got[0].Interfaces[0].Name != "eth0" || len(fn.got[0].Routes) != 3 {
		t.Errorf("the network was given %+v", fn.got)
	}
	fn.err = errf(errdefs.ErrNotFound, "no interface has MAC 02:42:0a:58:00:02")
	if _, err := svc.ConfigureNetwork(ctx, validNetRequest()); status.Code(rpcedge.Status(err)) != codes.NotFound {
		t.Errorf("a MAC no NIC has: %v, want NotFound", err)
	}
	if _, err := svc.Shutdown(ctx, &apiv1.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.ConfigureNetwork(ctx, validNetRequest()); status.Code(rpcedge.Status(err)) != codes.Unavailable {
		t.Errorf("after Shutdown: %v, want Unavailable", err)
	}
}

// TestNetlinkConfigure applies a request in a test network namespace, to a veth whose MAC
// it names, and reads the result back: the guest's own configuration, without a guest.
func TestNetlinkConfigure(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	guest, peer := nettest.New(t, "kvfs-guest"), nettest.New(t, "kvfs-gpeer")
	nettest.Veth(t, guest, "ens3", nil, peer, "peer0", nil)
	h := guest.Handle()
	nic, err := h.LinkByName("ens3")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetDown(nic); err != nil {
		t.Fatal(err)
	}
	req := validNetRequest()
	req.Interfaces[0].Mac = nic.Attrs().HardwareAddr.String()
	cfg, err := ParseNetworkRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	n := Netlink{Handle: h}
	if err := n.Configure(cfg); err != nil {
		t.Fatal(err)
	}
	// Again: addresses and routes are replaced, not refused.
	if err := n.Configure(cfg); err != nil {
		t.Fatalf("the same configuration again: %v", err)
	}
	l, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatalf("the NIC was not renamed eth0: %v", err)
	}
	if l.Attrs().Index != nic.Attrs().Index || l.Attrs().MTU != 1400 || l.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("eth0: index %d (want %d), MTU %d, flags %v", l.Attrs().Index, nic.Attrs().Index, l.Attrs().MTU, l.Attrs().Flags)
	}
	addrs, err := h.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, a := range addrs {
		got = append(got, a.IPNet.String())
	}
	for _, want := range []string{"10.88.0.2/24", "fd88::2/64"} {
		if !slices.Contains(got, want) {
			t.Errorf("eth0 has addresses %v, not %s", got, want)
		}
	}
	routes, err := h.RouteList(l, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	var rs []string
	for _, r := range routes {
		rs = append(rs, r.String())
	}
	all := strings.Join(rs, "\n")
	for _, want := range []string{"Dst: 10.89.0.0/16", "Gw: 10.88.0.1", "Gw: fd88::1"} {
		if !strings.Contains(all, want) {
			t.Errorf("routes of eth0 lack %q:\n%s", want, all)
		}
	}

	req.Interfaces[0].Mac = "02:99:99:99:99:99"
	cfg, _ = ParseNetworkRequest(req)
	if err := n.Configure(cfg); status.Code(rpcedge.Status(err)) != codes.NotFound {
		t.Errorf("a MAC no NIC has: %v, want NotFound", err)
	}
}
