package network

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// frame builds a test frame: an Ethernet header and the given parts, and a marker naming it
// at the end, by which the receiver tells the frames apart.
func frame(name string, src net.HardwareAddr, etherType uint16, parts ...[]byte) []byte {
	b := append([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, src...)
	b = binary.BigEndian.AppendUint16(b, etherType)
	for _, p := range parts {
		b = append(b, p...)
	}
	return append(b, marker(name)...)
}

func marker(name string) []byte { return []byte("<kvfs:" + name + ">") }

// ip4 is an IPv4 header from src (UDP, no options; lengths and checksum are not checked
// before the filter).
func ip4(src netip.Addr) []byte {
	h := make([]byte, 20)
	h[0], h[8], h[9] = 0x45, 64, unix.IPPROTO_UDP
	copy(h[12:16], src.AsSlice())
	copy(h[16:20], peerAddr4.Addr().AsSlice())
	return h
}

// arp is an ARP reply from sha and spa.
func arp(sha net.HardwareAddr, spa netip.Addr) []byte {
	b := []byte{0, 1, 8, 0, 6, 4, 0, 2}
	b = append(b, sha...)
	b = append(b, spa.AsSlice()...)
	b = append(b, make([]byte, 6)...)
	return append(b, peerAddr4.Addr().AsSlice()...)
}

// ip6 is an IPv6 header from src to ff02::1 with the next header next.
func ip6(src netip.Addr, next byte) []byte {
	h := make([]byte, 40)
	h[0], h[6], h[7] = 0x60, next, 255
	copy(h[8:24], src.AsSlice())
	dst := netip.MustParseAddr("ff02::1").As16()
	copy(h[24:40], dst[:])
	return h
}

// icmp6 is an ICMPv6 message of type typ; for neighbour discovery, with target.
func icmp6(typ byte, target netip.Addr) []byte {
	b := make([]byte, 8)
	b[0] = typ
	if target.IsValid() {
		b = append(b, target.AsSlice()...)
	}
	return b
}

// hbh is a hop-by-hop header of 8 bytes (a router alert and padding) before next.
func hbh(next byte) []byte { return []byte{next, 0, 5, 2, 0, 0, 1, 0} }

// TestTapGuard sends frames into the tap as the guest would (its queue, with a virtio-net
// header) and checks, from the veth's peer, that exactly the legitimate ones arrive: the
// NIC's MAC, and the pod's addresses or what a stack sends before it has one.
func TestTapGuard(t *testing.T) {
	needRoot(t)
	pod, peer := podNetNS(t)
	tap := TapName("guard")
	ep, err := Attach(pod.Path, tap)
	if err != nil {
		t.Fatal(err)
	}
	defer Detach(pod.Path, tap, "eth0")
	defer ep.Close()
	mac := ep.Interface.MAC
	other := net.HardwareAddr{0x02, 0, 0, 0, 0, 0x99}
	v4, v6, ll := podAddr4.Addr(), podAddr6.Addr(), linkLocal(mac)
	forged4, forged6 := netip.MustParseAddr("10.77.0.99"), netip.MustParseAddr("fd77::99")
	unspec := netip.IPv6Unspecified()
	noTarget := netip.Addr{}

	pass := [][]byte{
		frame("ipv4", mac, unix.ETH_P_IP, ip4(v4)),
		frame("arp", mac, unix.ETH_P_ARP, arp(mac, v4)),
		frame("ipv6", mac, unix.ETH_P_IPV6, ip6(v6, unix.IPPROTO_UDP)),
		frame("ipv6-link-local", mac, unix.ETH_P_IPV6, ip6(ll, unix.IPPROTO_UDP)),
		frame("ipv6-fragment", mac, unix.ETH_P_IPV6, ip6(v6, unix.IPPROTO_FRAGMENT)),
		frame("ns", mac, unix.ETH_P_IPV6, ip6(ll, nextICMPv6), icmp6(icmp6NeighSol, peerAddr6.Addr())),
		frame("na", mac, unix.ETH_P_IPV6, ip6(v6, nextICMPv6), icmp6(icmp6NeighAdv, v6)),
		frame("na-link-local", mac, unix.ETH_P_IPV6, ip6(ll, nextICMPv6), icmp6(icmp6NeighAdv, ll)),
		frame("dad", mac, unix.ETH_P_IPV6, ip6(unspec, nextICMPv6), icmp6(icmp6NeighSol, ll)),
		frame("mld-unspecified", mac, unix.ETH_P_IPV6, ip6(unspec, nextHopByHop), hbh(nextICMPv6), icmp6(icmp6MLDv2Report, noTarget)),
		frame("mld", mac, unix.ETH_P_IPV6, ip6(ll, nextHopByHop), hbh(nextICMPv6), icmp6(icmp6MLDv2Report, noTarget)),
	}
	drop := [][]byte{
		frame("forged-mac", other, unix.ETH_P_IP, ip4(v4)),
		frame("forged-ipv4", mac, unix.ETH_P_IP, ip4(forged4)),
		frame("dhcp-unspecified", mac, unix.ETH_P_IP, ip4(netip.IPv4Unspecified())),
		frame("short-ipv4", mac, unix.ETH_P_IP),
		frame("arp-forged-sha", mac, unix.ETH_P_ARP, arp(other, v4)),
		frame("arp-forged-spa", mac, unix.ETH_P_ARP, arp(mac, forged4)),
		frame("arp-forged-mac", other, unix.ETH_P_ARP, arp(other, v4)),
		frame("forged-ipv6", mac, unix.ETH_P_IPV6, ip6(forged6, unix.IPPROTO_UDP)),
		frame("forged-ipv6-mac", other, unix.ETH_P_IPV6, ip6(v6, unix.IPPROTO_UDP)),
		frame("forged-link-local", mac, unix.ETH_P_IPV6, ip6(linkLocal(other), unix.IPPROTO_UDP)),
		frame("udp-unspecified", mac, unix.ETH_P_IPV6, ip6(unspec, unix.IPPROTO_UDP)),
		frame("na-forged-target", mac, unix.ETH_P_IPV6, ip6(v6, nextICMPv6), icmp6(icmp6NeighAdv, peerAddr6.Addr())),
		frame("dad-forged-target", mac, unix.ETH_P_IPV6, ip6(unspec, nextICMPv6), icmp6(icmp6NeighSol, peerAddr6.Addr())),
		frame("ra", mac, unix.ETH_P_IPV6, ip6(ll, nextICMPv6), icmp6(icmp6RouterAdv, noTarget)),
		frame("redirect", mac, unix.ETH_P_IPV6, ip6(ll, nextICMPv6), icmp6(icmp6Redirect, noTarget)),
		frame("ra-behind-hbh", mac, unix.ETH_P_IPV6, ip6(ll, nextHopByHop), hbh(nextICMPv6), icmp6(icmp6RouterAdv, noTarget)),
		frame("udp-behind-hbh", mac, unix.ETH_P_IPV6, ip6(v6, nextHopByHop), hbh(unix.IPPROTO_UDP)),
		frame("dest-options", mac, unix.ETH_P_IPV6, ip6(v6, nextDestOpts), hbh(nextICMPv6), icmp6(icmp6RouterAdv, noTarget)),
		frame("routing-header", mac, unix.ETH_P_IPV6, ip6(v6, nextRouting), hbh(nextICMPv6), icmp6(icmp6RouterAdv, noTarget)),
		frame("vlan", mac, unix.ETH_P_8021Q, []byte{0, 7, 0x08, 0}, ip4(v4)),
		frame("lldp", mac, 0x88cc),
		frame("rarp", mac, unix.ETH_P_RARP, arp(mac, v4)),
	}
	last := frame("last", mac, unix.ETH_P_IP, ip4(v4))

	// The receiver: a packet socket on the peer's end of the veth.
	var sock int
	err = peer.Do(func() error {
		l, err := net.InterfaceByName("veth-pod")
		if err != nil {
			return err
		}
		sock, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(be16(unix.ETH_P_ALL)))
		if err != nil {
			return err
		}
		return unix.Bind(sock, &unix.SockaddrLinklayer{Protocol: be16(unix.ETH_P_ALL), Ifindex: l.Index})
	})
	if err != nil {
		t.Fatalf("a packet socket on the peer's veth: %v", err)
	}
	defer unix.Close(sock)
	if err := unix.SetsockoptTimeval(sock, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1}); err != nil {
		t.Fatal(err)
	}

	// The guest's side: all frames written from one thread kept on one CPU, so that they
	// reach the veth in order and "last" comes after every other.
	err = func() error {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var cpus unix.CPUSet
		cpus.Set(unix.Gettid() % runtime.NumCPU())
		if err := unix.SchedSetaffinity(0, &cpus); err != nil {
			return err
		}
		defer func() {
			cpus.Zero()
			for i := range runtime.NumCPU() {
				cpus.Set(i)
			}
			unix.SchedSetaffinity(0, &cpus)
		}()
		for _, f := range slices.Concat(pass, drop, [][]byte{last}) {
			if _, err := ep.TapFile.Write(append(make([]byte, 10), f...)); err != nil { // virtio_net_hdr, zero
				return fmt.Errorf("writing %q to the tap: %w", f[len(f)-20:], err)
			}
		}
		return nil
	}()
	if err != nil {
		t.Fatal(err)
	}

	got := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	buf := make([]byte, 4096)
	for !got["last"] && time.Now().Before(deadline) {
		n, from, err := unix.Recvfrom(sock, buf, 0)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if ll, ok := from.(*unix.SockaddrLinklayer); ok && ll.Pkttype == unix.PACKET_OUTGOING {
			continue
		}
		b := string(buf[:n])
		if i := strings.LastIndex(b, "<kvfs:"); i >= 0 && strings.HasSuffix(b, ">") {
			got[b[i+len("<kvfs:"):len(b)-1]] = true
		}
	}
	if !got["last"] {
		t.Fatalf("the last frame did not reach the peer within 30 s; got %v", got)
	}
	for _, f := range pass {
		if name := frameName(f); !got[name] {
			t.Errorf("the legitimate frame %q did not reach the peer", name)
		}
	}
	for _, f := range drop {
		if name := frameName(f); got[name] {
			t.Errorf("the forged frame %q reached the peer", name)
		}
	}
}

// frameName is the name in f's marker.
func frameName(f []byte) string {
	s := string(f)
	return s[strings.LastIndex(s, "<kvfs:")+len("<kvfs:") : len(s)-1]
}

// TestGuardFilter: the tap's ingress holds the guard, a cls_bpf filter in direct-action mode.
func TestGuardFilter(t *testing.T) {
	needRoot(t)
	pod, _ := podNetNS(t)
	tap := TapName("guard-filter")
	ep, err := Attach(pod.Path, tap)
	if err != nil {
		t.Fatal(err)
	}
	defer Detach(pod.Path, tap, "eth0")
	defer ep.Close()
	h := pod.Handle()
	tl, err := h.LinkByName(tap)
	if err != nil {
		t.Fatal(err)
	}
	fs, err := h.FilterList(tl, netlink.MakeHandle(0xffff, 0))
	if err != nil {
		t.Fatal(err)
	}
	if len(fs) != 1 {
		t.Fatalf("the tap's ingress has %d filters, want the guard alone: %v", len(fs), fs)
	}
	b, ok := fs[0].(*netlink.BpfFilter)
	if !ok || !b.DirectAction || !strings.HasPrefix(b.Name, "kvfs_tap_guard") {
		t.Errorf("the tap's ingress filter is %#v, want the guard (bpf, direct action)", fs[0])
	}
}
