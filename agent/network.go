package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/containerd/errdefs"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Bounds of a ConfigureNetwork request.
const (
	maxInterfaces     = 16
	maxAddresses      = 64
	maxRoutes         = 256
	minMTU, maxMTU    = 68, 65535
	dumpRetries       = 5
	defaultRouteAlias = "default"
)

// NetworkConfig is a checked ConfigureNetwork request.
type NetworkConfig struct {
	Interfaces []NetInterface
	// Routes are in the order to add them: those without a gateway first, so that every
	// gateway is reachable when its route is added.
	Routes []NetRoute
}

// NetInterface is one NIC to configure.
type NetInterface struct {
	MAC       net.HardwareAddr
	Name      string
	MTU       int // 0: leave it
	Addresses []netip.Prefix
}

// NetRoute is one route; Dst is 0.0.0.0/0 or ::/0 for a default route.
type NetRoute struct {
	Dst       netip.Prefix
	Gateway   netip.Addr // the zero Addr: none
	Interface string
	Scope     netlink.Scope
}

// Network applies a NetworkConfig: [Netlink] in the guest, a fake in the service's tests.
type Network interface {
	Configure(cfg *NetworkConfig) error
}

// ConfigureNetwork implements the RPC: the request is checked whole (ParseNetworkRequest)
// before anything is changed, then applied by Config.Network, one request at a time.
func (s *Service) ConfigureNetwork(ctx context.Context, req *apiv1.ConfigureNetworkRequest) (*apiv1.ConfigureNetworkResponse, error) {
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	cfg, err := ParseNetworkRequest(req)
	if err != nil {
		return nil, err
	}
	s.netMu.Lock()
	defer s.netMu.Unlock()
	if err := s.cfg.Network.Configure(cfg); err != nil {
		return nil, runtimeErr("configuring the network", err)
	}
	for _, in := range cfg.Interfaces {
		s.log.WithField("mac", in.MAC.String()).WithField("name", in.Name).WithField("mtu", in.MTU).
			WithField("addresses", in.Addresses).Info("interface configured")
	}
	s.log.WithField("routes", len(cfg.Routes)).Info("routes added")
	return &apiv1.ConfigureNetworkResponse{}, nil
}

// ParseNetworkRequest checks a ConfigureNetwork request; what is wrong is InvalidArgument
// naming the field ("interfaces[0].mac").
func ParseNetworkRequest(req *apiv1.ConfigureNetworkRequest) (*NetworkConfig, error) {
	ifs, rs := req.GetInterfaces(), req.GetRoutes()
	if len(ifs) > maxInterfaces {
		return nil, errf(errdefs.ErrInvalidArgument, "interfaces: %d, more than %d", len(ifs), maxInterfaces)
	}
	if len(rs) > maxRoutes {
		return nil, errf(errdefs.ErrInvalidArgument, "routes: %d, more than %d", len(rs), maxRoutes)
	}
	cfg := &NetworkConfig{}
	names := map[string]bool{}
	macs := map[string]bool{}
	for i, in := range ifs {
		field := fmt.Sprintf("interfaces[%d]", i)
		mac, err := net.ParseMAC(in.GetMac())
		switch {
		case err != nil:
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mac %q: %v", field, in.GetMac(), err)
		case len(mac) != 6:
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mac %q: not a 6-byte Ethernet address", field, in.GetMac())
		case mac[0]&1 != 0:
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mac %q: a multicast address", field, in.GetMac())
		case bytes.Equal(mac, make(net.HardwareAddr, 6)):
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mac %q: all zeros", field, in.GetMac())
		case macs[mac.String()]:
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mac %q: another interface's", field, in.GetMac())
		}
		macs[mac.String()] = true
		if err := checkIfName(in.GetName()); err != nil {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.name %q: %v", field, in.GetName(), err)
		}
		if names[in.GetName()] {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.name %q: another interface's", field, in.GetName())
		}
		names[in.GetName()] = true
		if m := in.GetMtu(); m != 0 && (m < minMTU || m > maxMTU) {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.mtu %d: want %d to %d, or 0 to leave it", field, m, minMTU, maxMTU)
		}
		if len(in.GetAddresses()) > maxAddresses {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.addresses: %d, more than %d", field, len(in.GetAddresses()), maxAddresses)
		}
		ni := NetInterface{MAC: mac, Name: in.GetName(), MTU: int(in.GetMtu())}
		for j, a := range in.GetAddresses() {
			p, err := netip.ParsePrefix(a)
			switch {
			case err != nil:
				return nil, errf(errdefs.ErrInvalidArgument, "%s.addresses[%d] %q: want an address and a prefix length, \"10.0.0.2/24\"", field, j, a)
			case p.Addr().Is4In6() || p.Addr().Zone() != "":
				return nil, errf(errdefs.ErrInvalidArgument, "%s.addresses[%d] %q: an IPv4-mapped or zoned address", field, j, a)
			case p.Addr().IsUnspecified() || p.Addr().IsMulticast() || p.Addr().IsLoopback():
				return nil, errf(errdefs.ErrInvalidArgument, "%s.addresses[%d] %q: unspecified, multicast or loopback", field, j, a)
			case slices.Contains(ni.Addresses, p):
				return nil, errf(errdefs.ErrInvalidArgument, "%s.addresses[%d] %q: given twice", field, j, a)
			}
			ni.Addresses = append(ni.Addresses, p)
		}
		cfg.Interfaces = append(cfg.Interfaces, ni)
	}
	var direct, viaGateway []NetRoute
	for i, r := range rs {
		field := fmt.Sprintf("routes[%d]", i)
		var out NetRoute
		if r.GetGateway() != "" {
			gw, err := netip.ParseAddr(r.GetGateway())
			switch {
			case err != nil:
				return nil, errf(errdefs.ErrInvalidArgument, "%s.gateway %q: not an IP address", field, r.GetGateway())
			case gw.Is4In6() || gw.Zone() != "" || gw.IsUnspecified() || gw.IsMulticast():
				return nil, errf(errdefs.ErrInvalidArgument, "%s.gateway %q: IPv4-mapped, zoned, unspecified or multicast", field, r.GetGateway())
			}
			out.Gateway = gw
		}
		switch d := r.GetDestination(); d {
		case "", defaultRouteAlias:
			switch {
			case out.Gateway.Is4():
				out.Dst = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
			case out.Gateway.Is6():
				out.Dst = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
			default:
				return nil, errf(errdefs.ErrInvalidArgument, "%s.destination %q: a default route without a gateway has no family: write 0.0.0.0/0 or ::/0", field, d)
			}
		default:
			p, err := netip.ParsePrefix(d)
			switch {
			case err != nil:
				return nil, errf(errdefs.ErrInvalidArgument, "%s.destination %q: want a prefix, \"10.1.0.0/16\", or \"default\"", field, d)
			case p.Addr().Is4In6() || p.Addr().Zone() != "":
				return nil, errf(errdefs.ErrInvalidArgument, "%s.destination %q: an IPv4-mapped or zoned prefix", field, d)
			case p != p.Masked():
				return nil, errf(errdefs.ErrInvalidArgument, "%s.destination %q: has bits set past the prefix length (want %v)", field, d, p.Masked())
			case out.Gateway.IsValid() && out.Gateway.Is4() != p.Addr().Is4():
				return nil, errf(errdefs.ErrInvalidArgument, "%s.gateway %q: not of the destination's family", field, r.GetGateway())
			}
			out.Dst = p
		}
		if !names[r.GetInterface()] {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.interface %q: not one of the request's interfaces", field, r.GetInterface())
		}
		out.Interface = r.GetInterface()
		switch r.GetScope() {
		case apiv1.RouteScope_ROUTE_SCOPE_UNIVERSE:
			out.Scope = netlink.SCOPE_UNIVERSE
		case apiv1.RouteScope_ROUTE_SCOPE_LINK:
			out.Scope = netlink.SCOPE_LINK
		case apiv1.RouteScope_ROUTE_SCOPE_HOST:
			out.Scope = netlink.SCOPE_HOST
		default:
			return nil, errf(errdefs.ErrInvalidArgument, "%s.scope %d: not a RouteScope", field, r.GetScope())
		}
		if out.Gateway.IsValid() && out.Scope != netlink.SCOPE_UNIVERSE {
			return nil, errf(errdefs.ErrInvalidArgument, "%s.scope %s: a route through a gateway has universe scope", field, r.GetScope())
		}
		if out.Gateway.IsValid() {
			viaGateway = append(viaGateway, out)
		} else {
			direct = append(direct, out)
		}
	}
	cfg.Routes = append(direct, viaGateway...)
	return cfg, nil
}

// checkIfName accepts a name for a guest interface: one the kernel takes, and not "lo".
func checkIfName(name string) error {
	if name == "lo" {
		return errors.New("the loopback interface's name")
	}
	return apiv1.CheckInterfaceName(name)
}

// Netlink configures the network namespace its handle is bound to (the zero value: the
// calling thread's, which in the guest is the VM's only one).
type Netlink struct {
	Handle *netlink.Handle
}

func (n Netlink) handle() *netlink.Handle {
	if n.Handle != nil {
		return n.Handle
	}
	return &netlink.Handle{}
}

// Configure implements Network: each interface, found by MAC, is taken down, renamed, given
// its MTU and addresses (replaced if there: the request may come again; IPv6 ones without
// duplicate address detection, which the host's namespace already did) and brought up; then
// the routes are replaced in order. A MAC no NIC has is NotFound.
func (n Netlink) Configure(cfg *NetworkConfig) error {
	h := n.handle()
	links, err := linkList(h)
	if err != nil {
		return fmt.Errorf("listing the interfaces: %w", err)
	}
	byName := map[string]netlink.Link{}
	for _, in := range cfg.Interfaces {
		i := slices.IndexFunc(links, func(l netlink.Link) bool { return bytes.Equal(l.Attrs().HardwareAddr, in.MAC) })
		if i < 0 {
			return errf(errdefs.ErrNotFound, "no interface has MAC %s", in.MAC)
		}
		l := links[i]
		if err := configureLink(h, l, in); err != nil {
			return fmt.Errorf("interface %s (MAC %s, was %s): %w", in.Name, in.MAC, l.Attrs().Name, err)
		}
		byName[in.Name] = l
	}
	for _, r := range cfg.Routes {
		route := &netlink.Route{
			LinkIndex: byName[r.Interface].Attrs().Index,
			Dst:       ipNet(r.Dst),
			Scope:     r.Scope,
		}
		if r.Gateway.IsValid() {
			route.Gw = r.Gateway.AsSlice()
		}
		if err := h.RouteReplace(route); err != nil {
			return fmt.Errorf("route to %v via %v dev %s scope %v: %w", r.Dst, r.Gateway, r.Interface, r.Scope, err)
		}
	}
	return nil
}

func configureLink(h *netlink.Handle, l netlink.Link, in NetInterface) error {
	if l.Attrs().Name != in.Name {
		if other, err := h.LinkByName(in.Name); err == nil && other.Attrs().Index != l.Attrs().Index {
			return errf(errdefs.ErrFailedPrecondition, "another interface is named %s", in.Name)
		}
		if err := h.LinkSetDown(l); err != nil {
			return fmt.Errorf("down: %w", err)
		}
		if err := h.LinkSetName(l, in.Name); err != nil {
			return fmt.Errorf("rename: %w", err)
		}
	}
	if in.MTU != 0 {
		if err := h.LinkSetMTU(l, in.MTU); err != nil {
			return fmt.Errorf("MTU %d: %w", in.MTU, err)
		}
	}
	for _, a := range in.Addresses {
		addr := &netlink.Addr{IPNet: ipNet(a)}
		if a.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrReplace(l, addr); err != nil {
			return fmt.Errorf("address %v: %w", a, err)
		}
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	return nil
}

func linkList(h *netlink.Handle) ([]netlink.Link, error) {
	var err error
	for range dumpRetries {
		var links []netlink.Link
		links, err = h.LinkList()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return links, err
		}
	}
	return nil, err
}

// ipNet is p as a *net.IPNet holding the address itself (not the masked prefix).
func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
