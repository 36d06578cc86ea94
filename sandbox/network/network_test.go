package network

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/nettest"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
}

var (
	podAddr4  = netip.MustParsePrefix("10.77.0.2/24")
	peerAddr4 = netip.MustParsePrefix("10.77.0.1/24")
	podAddr6  = netip.MustParsePrefix("fd77::2/64")
	peerAddr6 = netip.MustParsePrefix("fd77::1/64")
)

// podNetNS makes a pod's namespace as CNI would: eth0, one end of a veth pair whose peer is
// in a second namespace, with an IPv4 and an IPv6 address, a default route through the peer
// and one more route.
func podNetNS(t *testing.T) (pod, peer *nettest.NS) {
	pod, peer = nettest.New(t, "kvfs-pod"), nettest.New(t, "kvfs-peer")
	nettest.Veth(t, pod, "eth0", []netip.Prefix{podAddr4, podAddr6}, peer, "veth-pod", []netip.Prefix{peerAddr4, peerAddr6})
	h := pod.Handle()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetMTU(eth0, 1400); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*netlink.Route{
		{LinkIndex: eth0.Attrs().Index, Gw: peerAddr4.Addr().AsSlice()},
		{LinkIndex: eth0.Attrs().Index, Dst: nettest.IPNet(netip.MustParsePrefix("192.168.77.0/24")), Gw: peerAddr4.Addr().AsSlice()},
		{LinkIndex: eth0.Attrs().Index, Dst: nettest.IPNet(netip.MustParsePrefix("10.78.0.0/16")), Scope: netlink.SCOPE_LINK},
		{LinkIndex: eth0.Attrs().Index, Gw: peerAddr6.Addr().AsSlice()},
	} {
		if err := h.RouteAdd(r); err != nil {
			t.Fatalf("route %v: %v", r, err)
		}
	}
	return pod, peer
}

func TestAttachDetach(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	h := pod.Handle()
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	tap := TapName("pod-1")

	ep, err := Attach(pod.Path, tap)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()

	// The description.
	if ep.Tap != tap || ep.Interface.Name != "eth0" || ep.Interface.MTU != 1400 ||
		ep.Interface.MAC.String() != eth0.Attrs().HardwareAddr.String() {
		t.Errorf("endpoint %+v, want tap %s, eth0 with MTU 1400 and MAC %s", ep, tap, eth0.Attrs().HardwareAddr)
	}
	if want := []netip.Prefix{podAddr4, podAddr6}; !sameSet(ep.Interface.Addresses, want) {
		t.Errorf("addresses %v, want %v (no link-local)", ep.Interface.Addresses, want)
	}
	wantRoutes := []Route{
		{Dst: netip.MustParsePrefix("10.78.0.0/16"), Scope: ScopeLink},
		{Dst: netip.MustParsePrefix("0.0.0.0/0"), Gateway: peerAddr4.Addr()},
		{Dst: netip.MustParsePrefix("192.168.77.0/24"), Gateway: peerAddr4.Addr()},
		{Dst: netip.MustParsePrefix("::/0"), Gateway: peerAddr6.Addr()},
	}
	if !sameSet(ep.Routes, wantRoutes) || ep.Routes[0] != wantRoutes[0] {
		t.Errorf("routes %v, want %v with the link-scope one first", ep.Routes, wantRoutes)
	}

	// What the guest agent is asked: the same, as strings.
	req := ep.AgentRequest()
	if len(req.Interfaces) != 1 {
		t.Fatalf("AgentRequest: %v", req)
	}
	in := req.Interfaces[0]
	if in.Mac != eth0.Attrs().HardwareAddr.String() || in.Name != "eth0" || in.Mtu != 1400 ||
		!sameSet(in.Addresses, []string{"10.77.0.2/24", "fd77::2/64"}) {
		t.Errorf("AgentRequest interface %v", in)
	}
	var rs []string
	for _, r := range req.Routes {
		rs = append(rs, r.Destination+" via "+r.Gateway+" dev "+r.Interface+" "+r.Scope.String())
	}
	if want := []string{
		"10.78.0.0/16 via  dev eth0 ROUTE_SCOPE_LINK",
		"0.0.0.0/0 via 10.77.0.1 dev eth0 ROUTE_SCOPE_UNIVERSE",
		"192.168.77.0/24 via 10.77.0.1 dev eth0 ROUTE_SCOPE_UNIVERSE",
		"::/0 via fd77::1 dev eth0 ROUTE_SCOPE_UNIVERSE",
	}; !sameSet(rs, want) {
		t.Errorf("AgentRequest routes %q, want %q", rs, want)
	}

	// The tap: up, the pod interface's MTU, its queue is the returned descriptor.
	tl, err := h.LinkByName(tap)
	if err != nil {
		t.Fatalf("the tap: %v", err)
	}
	if tl.Type() != "tuntap" || tl.Attrs().Flags&net.FlagUp == 0 || tl.Attrs().MTU != 1400 {
		t.Errorf("tap %s: type %s flags %v MTU %d", tap, tl.Type(), tl.Attrs().Flags, tl.Attrs().MTU)
	}
	ifr, err := unix.NewIfreq("")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlIfreq(int(ep.TapFile.Fd()), unix.TUNGETIFF, ifr); err != nil {
		t.Fatalf("TUNGETIFF on the endpoint's descriptor: %v", err)
	}
	if ifr.Name() != tap || ifr.Uint16()&(unix.IFF_TAP|unix.IFF_VNET_HDR|unix.IFF_NO_PI) != unix.IFF_TAP|unix.IFF_VNET_HDR|unix.IFF_NO_PI {
		t.Errorf("the descriptor is attached to %q with flags %#x", ifr.Name(), ifr.Uint16())
	}
	// The filters: eth0's ingress redirects to the tap's egress; the tap's holds the guard
	// (TestGuardFilter, TestTapGuard).
	checkRedirect(t, h, eth0, tl.Attrs().Index)

	// A second Attach to the same namespace is refused, and changes nothing.
	if _, err := Attach(pod.Path, tap); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("a second Attach: %v, want an error saying the tap exists", err)
	}
	checkRedirect(t, h, eth0, tl.Attrs().Index)

	if err := Detach(pod.Path, tap, "eth0"); err != nil {
		t.Fatal(err)
	}
	if _, err := h.LinkByName(tap); err == nil {
		t.Errorf("the tap is left after Detach")
	}
	if qs := ingressQdiscs(t, h, eth0); len(qs) != 0 {
		t.Errorf("eth0 keeps ingress qdiscs after Detach: %v", qs)
	}
	if l, err := h.LinkByName("eth0"); err != nil || l.Attrs().Flags&net.FlagUp == 0 {
		t.Errorf("eth0 after Detach: %v, %v", l, err)
	}
	// Idempotent, even with the descriptor still open and the namespace gone.
	if err := Detach(pod.Path, tap, "eth0"); err != nil {
		t.Errorf("a second Detach: %v", err)
	}
	if err := Detach("/run/netns/kvfs-no-such-namespace", tap, "eth0"); err != nil {
		t.Errorf("Detach of a namespace that is gone: %v", err)
	}
}

func TestDetachWithoutDescriptor(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	h := pod.Handle()
	tap := TapName("pod-2")
	ep, err := Attach(pod.Path, tap)
	if err != nil {
		t.Fatal(err)
	}
	// The tap is not persistent: closing the last descriptor (QEMU's end) removes it.
	ep.Close()
	if _, err := h.LinkByName(tap); err == nil {
		t.Errorf("the tap outlived its last descriptor")
	}
	eth0, _ := h.LinkByName("eth0")
	if len(ingressQdiscs(t, h, eth0)) != 1 {
		t.Fatalf("eth0 should still have its ingress qdisc")
	}
	if err := Detach(pod.Path, tap, "eth0"); err != nil {
		t.Fatal(err)
	}
	if qs := ingressQdiscs(t, h, eth0); len(qs) != 0 {
		t.Errorf("eth0 keeps ingress qdiscs after Detach: %v", qs)
	}
}

func TestAttachErrors(t *testing.T) {
	needRoot(t)
	empty := nettest.New(t, "kvfs-empty")
	if _, err := Attach(empty.Path, TapName("x")); err == nil || !strings.Contains(err.Error(), "no Ethernet interface besides loopback") {
		t.Errorf("Attach to a namespace with only lo: %v", err)
	}
	if l, err := empty.Handle().LinkList(); err != nil || len(l) != 1 {
		t.Errorf("the empty namespace has %v after the failed Attach (%v)", l, err)
	}

	// Two veths, neither named eth0: no choice.
	two, other := nettest.New(t, "kvfs-two"), nettest.New(t, "kvfs-other")
	nettest.Veth(t, two, "net1", nil, other, "p1", nil)
	nettest.Veth(t, two, "net2", nil, other, "p2", nil)
	_, err := Attach(two.Path, TapName("x"))
	if err == nil || !strings.Contains(err.Error(), "2 Ethernet interfaces (net1, net2) and none named eth0") {
		t.Errorf("Attach with two candidates: %v", err)
	}
	// With eth0 among them, eth0 is the pod's.
	nettest.Veth(t, two, "eth0", nil, other, "p3", nil)
	ep, err := Attach(two.Path, TapName("x"))
	if err != nil {
		t.Fatal(err)
	}
	if ep.Interface.Name != "eth0" {
		t.Errorf("chose %s among net1, net2 and eth0", ep.Interface.Name)
	}
	ep.Close()
	if err := Detach(two.Path, TapName("x"), "eth0"); err != nil {
		t.Fatal(err)
	}

	if _, err := Attach("/run/netns/kvfs-no-such-namespace", TapName("x")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Attach to a missing namespace: %v", err)
	}
	notNS := t.TempDir()
	if _, err := Attach(notNS, TapName("x")); !errors.Is(err, errNotNetNS) {
		t.Errorf("Attach to a directory: %v", err)
	}
	if _, err := Attach(empty.Path, "a/b"); err == nil || !strings.Contains(err.Error(), `tap name "a/b"`) {
		t.Errorf("Attach with a bad tap name: %v", err)
	}
	if _, err := Attach(empty.Path, strings.Repeat("t", 16)); err == nil {
		t.Errorf("Attach with a 16-byte tap name succeeded")
	}
}

func TestCheckPodNetNS(t *testing.T) {
	needRoot(t)
	host := []string{"", "/proc/self/ns/net"}
	if _, err := os.Stat("/proc/1/ns/net"); err == nil {
		host = append(host, "/proc/1/ns/net")
	}
	for _, p := range host {
		if err := CheckPodNetNS(p); !errors.Is(err, ErrHostNetwork) {
			t.Errorf("CheckPodNetNS(%q) = %v, want ErrHostNetwork", p, err)
		}
		if _, err := Attach(p, TapName("x")); !errors.Is(err, ErrHostNetwork) {
			t.Errorf("Attach(%q) = %v, want ErrHostNetwork", p, err)
		}
	}
	ns := nettest.New(t, "kvfs-check")
	if err := CheckPodNetNS(ns.Path); err != nil {
		t.Errorf("CheckPodNetNS of a namespace of its own: %v", err)
	}
	if err := CheckPodNetNS("/proc/self/ns/pid"); !errors.Is(err, errNotNetNS) {
		t.Errorf("CheckPodNetNS of a PID namespace: %v", err)
	}
}

// TestDo: f runs in the namespace and its error comes back; the caller's thread is in its own
// namespace afterwards; a path that is no network namespace is refused before f runs.
func TestDo(t *testing.T) {
	needRoot(t)
	ns := nettest.New(t, "kvfs-do")
	var want, in, caller unix.Stat_t
	if err := unix.Stat(ns.Path, &want); err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Stat("/proc/thread-self/ns/net", &caller); err != nil {
		t.Fatal(err)
	}
	errF := errors.New("f's error")
	err := Do(ns.Path, func() error {
		if err := unix.Stat("/proc/thread-self/ns/net", &in); err != nil {
			return err
		}
		return errF
	})
	if !errors.Is(err, errF) {
		t.Errorf("Do = %v, want f's error", err)
	}
	if in.Dev != want.Dev || in.Ino != want.Ino {
		t.Errorf("f ran in network namespace %d:%d, want %s's %d:%d", in.Dev, in.Ino, ns.Path, want.Dev, want.Ino)
	}
	var after unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &after); err != nil {
		t.Fatal(err)
	}
	if after.Dev != caller.Dev || after.Ino != caller.Ino {
		t.Errorf("the caller's thread is in network namespace %d:%d after Do, want its own %d:%d", after.Dev, after.Ino, caller.Dev, caller.Ino)
	}
	called := false
	if err := Do("/proc/self/ns/pid", func() error { called = true; return nil }); !errors.Is(err, errNotNetNS) || called {
		t.Errorf("Do of a PID namespace: %v, f called %v; want errNotNetNS and no call", err, called)
	}
}

// TestTapNameIsPerNamespace shows why Attach opens /dev/net/tun inside the pod's namespace: a
// descriptor opened in another namespace, given the tap's name, does not reach the pod's tap
// but makes a new one in its own namespace.
func TestTapNameIsPerNamespace(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	tap := TapName("pod-3")
	ep, err := Attach(pod.Path, tap)
	if err != nil {
		t.Fatal(err)
	}
	defer Detach(pod.Path, tap, "eth0")
	defer ep.Close()
	elsewhere := nettest.New(t, "kvfs-elsewhere")
	var fd int
	err = elsewhere.Do(func() error {
		var err error
		fd, err = unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	ifr, _ := unix.NewIfreq(tap)
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		t.Fatalf("TUNSETIFF %s from another namespace: %v", tap, err)
	}
	if _, err := elsewhere.Handle().LinkByName(tap); err != nil {
		t.Errorf("no new tap %s in the other namespace: %v", tap, err)
	}
	// The pod's tap takes one queue (no IFF_MULTI_QUEUE): a descriptor that reached it would
	// have failed with EBUSY.
	if _, err := pod.Handle().LinkByName(tap); err != nil {
		t.Errorf("the pod's tap: %v", err)
	}
}

func TestTapName(t *testing.T) {
	a, b := TapName("sandbox-a"), TapName("sandbox-b")
	if len(a) != 15 || !strings.HasPrefix(a, "kvfs") || a == b || TapName("sandbox-a") != a {
		t.Errorf("TapName: %q, %q", a, b)
	}
	if err := agent.CheckInterfaceName(a); err != nil {
		t.Errorf("TapName %q: %v", a, err)
	}
}

func checkRedirect(t *testing.T, h *netlink.Handle, from netlink.Link, to int) {
	t.Helper()
	fs, err := h.FilterList(from, netlink.MakeHandle(0xffff, 0))
	if err != nil {
		t.Fatalf("filters of %s: %v", from.Attrs().Name, err)
	}
	var found bool
	for _, f := range fs {
		u, ok := f.(*netlink.U32)
		if !ok || u.Sel == nil || len(u.Sel.Keys) != 1 || u.Sel.Keys[0].Mask != 0 {
			continue
		}
		for _, a := range u.Actions {
			if m, ok := a.(*netlink.MirredAction); ok && m.MirredAction == netlink.TCA_EGRESS_REDIR && m.Ifindex == to {
				found = true
			}
		}
	}
	if !found {
		t.Errorf("%s's ingress has no match-all filter redirecting to the egress of interface %d: %v", from.Attrs().Name, to, fs)
	}
}

func ingressQdiscs(t *testing.T, h *netlink.Handle, l netlink.Link) []netlink.Qdisc {
	t.Helper()
	qs, err := h.QdiscList(l)
	if err != nil {
		t.Fatal(err)
	}
	var out []netlink.Qdisc
	for _, q := range qs {
		if q.Attrs().Parent == netlink.HANDLE_INGRESS {
			out = append(out, q)
		}
	}
	return out
}

func sameSet[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}
