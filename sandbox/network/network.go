package network

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// ErrHostNetwork is what CheckPodNetNS answers, wrapped, for a pod on the host's network.
var ErrHostNetwork = errors.New("host networking is not supported: the pod's VM needs a network namespace of its own")

// podIfName is the interface chosen among several: the name containerd's CRI gives CNI.
const podIfName = "eth0"

// dumpRetries bounds the retries of a netlink dump that the kernel interrupted (the
// namespace changed during it).
const dumpRetries = 5

// Endpoint is a pod's network namespace joined to a tap, as Attach made it.
type Endpoint struct {
	// Tap is the name of the tap device in the pod's namespace.
	Tap string
	// TapFile is the tap's queue (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR): QEMU's -netdev tap,fd=.
	// The tap lives while it or a copy is open.
	TapFile *os.File
	// Interface is the pod's interface and what the guest's NIC is to be given.
	Interface Interface
	// Routes are the namespace's routes through the interface, link-scope ones first; the
	// kernel's own (made for an address, proto kernel) are left out, since the guest's kernel
	// makes them too.
	Routes []Route
}

// Interface describes the pod's interface.
type Interface struct {
	Name string
	MAC  net.HardwareAddr
	MTU  int
	// Addresses are its IPv4 and IPv6 addresses with their prefix lengths; IPv6 link-local
	// addresses are left out (the guest makes its own, from the same MAC).
	Addresses []netip.Prefix
}

// Scope is a route's scope.
type Scope int

// Scopes of the routes Attach returns.
const (
	ScopeUniverse Scope = iota
	ScopeLink
	ScopeHost
)

func (s Scope) String() string {
	switch s {
	case ScopeUniverse:
		return "universe"
	case ScopeLink:
		return "link"
	case ScopeHost:
		return "host"
	}
	return fmt.Sprintf("scope(%d)", int(s))
}

// Route is one route through the pod's interface.
type Route struct {
	// Dst is the destination; 0.0.0.0/0 or ::/0 for a default route.
	Dst netip.Prefix
	// Gateway is the next hop; the zero Addr for none.
	Gateway netip.Addr
	Scope   Scope
}

// TapName is the name of sandbox id's tap: "kvfs" and 11 hex digits of the id's SHA-256,
// 15 bytes, the longest name the kernel takes.
func TapName(id string) string {
	sum := sha256.Sum256([]byte(id))
	return "kvfs" + hex.EncodeToString(sum[:])[:agent.MaxInterfaceName-len("kvfs")]
}

// Close closes the Endpoint's descriptor of the tap.
func (e *Endpoint) Close() error {
	if e.TapFile == nil {
		return nil
	}
	return e.TapFile.Close()
}

// CheckPodNetNS refuses what a pod's VM cannot be given: no namespace path (the pod is on
// the host's network, Kubernetes' hostNetwork) or the path of the host's namespace (the
// calling process's, or init's where it may be looked at). Either is ErrHostNetwork, wrapped with the path. A path that
// is not a network namespace is an error too.
func CheckPodNetNS(path string) error {
	if path == "" {
		return fmt.Errorf("no network namespace path: %w", ErrHostNetwork)
	}
	ns, err := openNetNS(path)
	if err != nil {
		return err
	}
	defer ns.Close()
	return checkNotHost(path, ns)
}

// checkNotHost refuses ns, opened from path, if it is this process's namespace or init's.
// Init's is skipped where this process may not look at it (a container's /proc).
func checkNotHost(path string, ns netns.NsHandle) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(ns), &st); err != nil {
		return fmt.Errorf("network namespace %s: %w", path, err)
	}
	for _, host := range []string{"/proc/self/ns/net", "/proc/1/ns/net"} {
		var h unix.Stat_t
		err := unix.Stat(host, &h)
		if host != "/proc/self/ns/net" && (errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM)) {
			continue
		}
		if err != nil {
			return fmt.Errorf("network namespace %s: comparing with the host's (%s): %w", path, host, err)
		}
		if st.Dev == h.Dev && st.Ino == h.Ino {
			return fmt.Errorf("network namespace %s is the host's (%s): %w", path, host, ErrHostNetwork)
		}
	}
	return nil
}

// errNotNetNS is openNetNS's error for a file that is no network namespace (any more).
var errNotNetNS = errors.New("not a network namespace")

// openNetNS opens the network namespace at path and checks that it is one.
func openNetNS(path string) (netns.NsHandle, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return netns.None(), fmt.Errorf("network namespace %s: %w", path, &os.PathError{Op: "open", Path: path, Err: err})
	}
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		unix.Close(fd)
		return netns.None(), fmt.Errorf("network namespace %s: %w", path, err)
	}
	if fs.Type != unix.NSFS_MAGIC {
		unix.Close(fd)
		return netns.None(), fmt.Errorf("%s: %w (not on nsfs)", path, errNotNetNS)
	}
	if t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE); err != nil || t != unix.CLONE_NEWNET {
		unix.Close(fd)
		return netns.None(), fmt.Errorf("%s: %w (NS_GET_NSTYPE: %d, %v)", path, errNotNetNS, t, err)
	}
	return netns.NsHandle(fd), nil
}

// Attach joins the pod's network namespace at netnsPath to a new tap named tap (TapName):
// it finds the pod's interface (see the package documentation), reads its MAC, MTU,
// addresses and routes, makes the tap with the interface's MTU, adds an ingress qdisc to
// both, the filter redirecting the interface's ingress to the tap and the guard on the tap's
// (filter.go), and brings the tap up. A failure undoes what was
// made. The caller owns the Endpoint's TapFile and calls Detach when the VM is gone.
func Attach(netnsPath, tap string) (_ *Endpoint, retErr error) {
	if err := agent.CheckInterfaceName(tap); err != nil {
		return nil, fmt.Errorf("tap name %q: %w", tap, err)
	}
	if netnsPath == "" {
		return nil, fmt.Errorf("no network namespace path: %w", ErrHostNetwork)
	}
	ns, err := openNetNS(netnsPath)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	if err := checkNotHost(netnsPath, ns); err != nil {
		return nil, err
	}
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("network namespace %s: netlink: %w", netnsPath, err)
	}
	defer h.Close()
	fail := func(format string, args ...any) error {
		return fmt.Errorf("network namespace %s: "+format, append([]any{netnsPath}, args...)...)
	}

	pod, err := podInterface(h)
	if err != nil {
		return nil, fail("%w", err)
	}
	attrs := pod.Attrs()
	if _, err := h.LinkByName(tap); err == nil {
		return nil, fail("an interface named %s (the tap) already exists", tap)
	}
	ep := &Endpoint{Tap: tap, Interface: Interface{Name: attrs.Name, MAC: slices.Clone(attrs.HardwareAddr), MTU: attrs.MTU}}
	if ep.Interface.Addresses, err = addresses(h, pod); err != nil {
		return nil, fail("the addresses of %s: %w", attrs.Name, err)
	}
	if ep.Routes, err = routes(h, pod); err != nil {
		return nil, fail("the routes through %s: %w", attrs.Name, err)
	}

	if ep.TapFile, err = openTap(ns, tap); err != nil {
		return nil, fail("%w", err)
	}
	podQdisc := false // added to the pod's interface, to be removed on failure
	defer func() {
		if retErr != nil {
			ep.Close() // the tap goes with its last descriptor, its qdisc with it
			if podQdisc {
				delIngress(h, pod)
			}
		}
	}()
	tapLink, err := h.LinkByName(tap)
	if err != nil {
		return nil, fail("the new tap %s: %w", tap, err)
	}
	if err := h.LinkSetMTU(tapLink, attrs.MTU); err != nil {
		return nil, fail("setting the MTU of %s to %d: %w", tap, attrs.MTU, err)
	}
	if err := h.QdiscAdd(ingress(pod)); err != nil {
		return nil, fail("adding an ingress qdisc to %s: %w", attrs.Name, err)
	}
	podQdisc = true
	if err := h.QdiscAdd(ingress(tapLink)); err != nil {
		return nil, fail("adding an ingress qdisc to %s: %w", tap, err)
	}
	if err := h.FilterAdd(redirect(pod, tapLink)); err != nil {
		return nil, fail("redirecting %s's ingress to %s: %w", attrs.Name, tap, err)
	}
	if err := addGuard(h, tapLink, pod, ep.Interface.Addresses); err != nil {
		return nil, fail("redirecting %s's ingress to %s: %w", tap, attrs.Name, err)
	}
	if err := h.LinkSetUp(tapLink); err != nil {
		return nil, fail("bringing %s up: %w", tap, err)
	}
	return ep, nil
}

// Detach undoes Attach: it deletes the tap named tap and the ingress qdisc (and so the
// filter) of the interface named iface in the namespace at netnsPath. What is already gone —
// the tap, the qdisc, the interface, the namespace itself — is not an error.
func Detach(netnsPath, tap, iface string) error {
	if err := agent.CheckInterfaceName(tap); err != nil {
		return fmt.Errorf("tap name %q: %w", tap, err)
	}
	ns, err := openNetNS(netnsPath)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, errNotNetNS) {
		return nil // the namespace was removed (its bind mount too), and all in it
	}
	if err != nil {
		return err
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("network namespace %s: netlink: %w", netnsPath, err)
	}
	defer h.Close()
	var errs []error
	if l, err := h.LinkByName(tap); err == nil {
		if err := h.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("network namespace %s: deleting the tap %s: %w", netnsPath, tap, err))
		}
	} else if !isNotFound(err) {
		errs = append(errs, fmt.Errorf("network namespace %s: the tap %s: %w", netnsPath, tap, err))
	}
	if l, err := h.LinkByName(iface); err == nil {
		if err := delIngress(h, l); err != nil {
			errs = append(errs, fmt.Errorf("network namespace %s: removing the ingress qdisc of %s: %w", netnsPath, iface, err))
		}
	} else if !isNotFound(err) {
		errs = append(errs, fmt.Errorf("network namespace %s: the interface %s: %w", netnsPath, iface, err))
	}
	return errors.Join(errs...)
}

func isNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

// podInterface chooses the pod's interface: see the package documentation.
func podInterface(h *netlink.Handle) (netlink.Link, error) {
	links, err := retryDump(h.LinkList)
	if err != nil {
		return nil, fmt.Errorf("listing the interfaces: %w", err)
	}
	var all []string
	var cands []netlink.Link
	for _, l := range links {
		a := l.Attrs()
		all = append(all, a.Name)
		if a.Flags&net.FlagLoopback != 0 || a.EncapType != "ether" || l.Type() == "tuntap" || len(a.HardwareAddr) != 6 {
			continue
		}
		cands = append(cands, l)
	}
	switch {
	case len(cands) == 1:
		return cands[0], nil
	case len(cands) == 0:
		return nil, fmt.Errorf("no Ethernet interface besides loopback and taps for the pod (interfaces: %s)", strings.Join(all, ", "))
	}
	var names []string
	for _, l := range cands {
		if l.Attrs().Name == podIfName {
			return l, nil
		}
		names = append(names, l.Attrs().Name)
	}
	return nil, fmt.Errorf("%d Ethernet interfaces (%s) and none named %s: cannot tell which is the pod's", len(cands), strings.Join(names, ", "), podIfName)
}

func addresses(h *netlink.Handle, l netlink.Link) ([]netip.Prefix, error) {
	list, err := retryDump(func() ([]netlink.Addr, error) { return h.AddrList(l, netlink.FAMILY_ALL) })
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, a := range list {
		p, ok := prefixOf(a.IPNet)
		if !ok {
			return nil, fmt.Errorf("address %v cannot be read", a.IPNet)
		}
		if p.Addr().Is6() && p.Addr().IsLinkLocalUnicast() {
			continue
		}
		out = append(out, p)
	}
	return out, nil
}

// prefixOf is n as a netip.Prefix: the address (IPv4 as IPv4, not IPv4-in-IPv6) and its
// prefix length.
func prefixOf(n *net.IPNet) (netip.Prefix, bool) {
	if n == nil {
		return netip.Prefix{}, false
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	a = a.Unmap()
	ones, bits := n.Mask.Size()
	if bits != a.BitLen() {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(a, ones), true
}

func routes(h *netlink.Handle, l netlink.Link) ([]Route, error) {
	filter := &netlink.Route{LinkIndex: l.Attrs().Index, Table: unix.RT_TABLE_MAIN}
	list, err := retryDump(func() ([]netlink.Route, error) {
		return h.RouteListFiltered(netlink.FAMILY_ALL, filter, netlink.RT_FILTER_OIF|netlink.RT_FILTER_TABLE)
	})
	if err != nil {
		return nil, err
	}
	var link, other []Route
	for _, r := range list {
		if r.Protocol == unix.RTPROT_KERNEL || r.Type != unix.RTN_UNICAST {
			continue
		}
		var out Route
		switch r.Scope {
		case netlink.SCOPE_UNIVERSE:
			out.Scope = ScopeUniverse
		case netlink.SCOPE_LINK:
			out.Scope = ScopeLink
		case netlink.SCOPE_HOST:
			out.Scope = ScopeHost
		default:
			return nil, fmt.Errorf("route %v: scope %d is none of universe, link and host", r, r.Scope)
		}
		if r.Dst != nil {
			p, ok := prefixOf(r.Dst)
			if !ok {
				return nil, fmt.Errorf("route %v: the destination cannot be read", r)
			}
			out.Dst = p
		} else if r.Family == unix.AF_INET6 {
			out.Dst = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
		} else {
			out.Dst = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
		}
		if r.Gw != nil {
			gw, ok := netip.AddrFromSlice(r.Gw)
			if !ok {
				return nil, fmt.Errorf("route %v: the gateway cannot be read", r)
			}
			out.Gateway = gw.Unmap()
		}
		if out.Scope == ScopeLink {
			link = append(link, out)
		} else {
			other = append(other, out)
		}
	}
	return append(link, other...), nil
}

// retryDump calls dump again while the kernel reports the dump was interrupted.
func retryDump[T any](dump func() ([]T, error)) ([]T, error) {
	var err error
	for range dumpRetries {
		var list []T
		list, err = dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return list, err
		}
	}
	return nil, err
}

// openTap makes the tap in ns and returns its queue. A tun descriptor makes its device in
// the namespace it was opened in, so /dev/net/tun is opened in ns (inNetNS).
func openTap(ns netns.NsHandle, name string) (*os.File, error) {
	fd := -1
	err := inNetNS(ns, func() error {
		var err error
		if fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		return nil
	})
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return nil, err
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+name), nil
}

// Do calls f on an OS thread in the network namespace at path (checked to be one), and
// returns f's error: what f makes there, a socket or tun device it opens or a process it
// starts (a child is born in its parent thread's namespaces), belongs to that namespace. See
// inNetNS for the thread.
func Do(path string, f func() error) error {
	ns, err := openNetNS(path)
	if err != nil {
		return err
	}
	defer ns.Close()
	return inNetNS(ns, f)
}

// errThreadStuck is wrapped in inNetNS's error when the thread could not go back to its own
// network namespace after f (which may have succeeded).
var errThreadStuck = errors.New("the thread could not return to its network namespace")

// inNetNS calls f on a goroutine of its own, locked to its OS thread, while that thread is in
// ns, then takes the thread back to its own namespace and unlocks it. A thread that cannot go
// back is never unlocked: the runtime ends it with the goroutine, so no other goroutine ever
// runs in ns. No other thread joins ns (the runtime starts new threads from a template
// thread, never from a locked one), and the caller's thread is untouched.
func inNetNS(ns netns.NsHandle, f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err := joinAndCall(ns, f)
		if !errors.Is(err, errThreadStuck) {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

// joinAndCall is inNetNS on its locked thread.
func joinAndCall(ns netns.NsHandle, f func() error) error {
	self, err := netns.Get() // this thread's
	if err != nil {
		return fmt.Errorf("this thread's network namespace: %w", err)
	}
	defer self.Close()
	if err := netns.Set(ns); err != nil {
		return fmt.Errorf("joining the network namespace: %w", err)
	}
	ferr := f()
	if err := netns.Set(self); err != nil {
		return errors.Join(ferr, fmt.Errorf("%w: %v", errThreadStuck, err))
	}
	return ferr
}

func ingress(l netlink.Link) *netlink.Ingress {
	return &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: l.Attrs().Index,
		Handle:    netlink.MakeHandle(0xffff, 0),
		Parent:    netlink.HANDLE_INGRESS,
	}}
}

// redirect is a filter on from's ingress that matches every frame (u32, one key with mask
// 0) and redirects it to to's egress: what reaches the pod's interface goes to the guest
// unexamined. It needs cls_u32 and act_mirred of the host kernel.
func redirect(from, to netlink.Link) *netlink.U32 {
	return &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: from.Attrs().Index,
			Parent:    netlink.MakeHandle(0xffff, 0),
			Priority:  1,
			Protocol:  unix.ETH_P_ALL,
		},
		Sel: &netlink.TcU32Sel{
			Flags: netlink.TC_U32_TERMINAL,
			Nkeys: 1,
			Keys:  []netlink.TcU32Key{{Mask: 0, Val: 0}},
		},
		Actions: []netlink.Action{netlink.NewMirredAction(to.Attrs().Index)},
	}
}

// delIngress removes l's ingress qdisc, if it has one.
func delIngress(h *netlink.Handle, l netlink.Link) error {
	qs, err := h.QdiscList(l)
	if err != nil {
		return err
	}
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_INGRESS {
			if err := h.QdiscDel(q); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
				return err
			}
		}
	}
	return nil
}

// AgentRequest is the guest agent's ConfigureNetwork request that gives the guest's NIC (the
// one with the interface's MAC) the interface's name, MTU, addresses and routes.
func (e *Endpoint) AgentRequest() *agent.ConfigureNetworkRequest {
	in := &agent.Interface{Mac: e.Interface.MAC.String(), Name: e.Interface.Name, Mtu: uint32(e.Interface.MTU)}
	for _, a := range e.Interface.Addresses {
		in.Addresses = append(in.Addresses, a.String())
	}
	req := &agent.ConfigureNetworkRequest{Interfaces: []*agent.Interface{in}}
	for _, r := range e.Routes {
		ar := &agent.Route{Destination: r.Dst.String(), Interface: e.Interface.Name}
		if r.Gateway.IsValid() {
			ar.Gateway = r.Gateway.String()
		}
		switch r.Scope {
		case ScopeLink:
			ar.Scope = agent.RouteScope_ROUTE_SCOPE_LINK
		case ScopeHost:
			ar.Scope = agent.RouteScope_ROUTE_SCOPE_HOST
		default:
			ar.Scope = agent.RouteScope_ROUTE_SCOPE_UNIVERSE
		}
		req.Routes = append(req.Routes, ar)
	}
	return req
}
