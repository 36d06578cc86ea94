package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// The guard is the filter on the tap's ingress, where the frames the guest sends arrive: an
// eBPF program of type sched_cls, attached with cls_bpf in direct-action mode, that redirects
// a frame to the pod interface's egress (bpf_redirect) if the guest may send it and drops it
// (TC_ACT_SHOT) otherwise. It runs in the kernel for each frame, a few dozen instructions,
// with the pod's MAC and addresses compiled in as constants: no map, no userspace on the path.
//
// A frame passes if, and only if:
//   - it carries no VLAN tag (the kernel strips one tag into the skb before tc runs; a frame
//     that had one is dropped, and a second, inner tag leaves an ethertype no rule accepts);
//   - its source MAC is the pod interface's (the MAC the guest's NIC is given);
//   - it is IPv4 from one of the pod's IPv4 addresses;
//   - or ARP for IPv4 over Ethernet whose sender hardware address is the MAC and whose sender
//     protocol address is one of the pod's IPv4 addresses;
//   - or IPv6 from one of the pod's IPv6 addresses or from the link-local address the MAC
//     gives (EUI-64, what the guest's kernel makes), with no routing or destination-options
//     header first and, if a hop-by-hop header comes first, ICMPv6 multicast listener
//     messages (MLD) behind it; ICMPv6 router advertisements and redirects are dropped (a pod
//     is no router), and a neighbour advertisement must be for one of those addresses;
//   - or IPv6 from the unspecified address (::) carrying what a stack sends before it has an
//     address: a neighbour solicitation for duplicate address detection of one of those
//     addresses, or MLD (directly or behind a hop-by-hop header).
//
// Anything else — other ethertypes (RARP, LLDP, 802.3 frames), DHCP's 0.0.0.0 (addresses are
// configured by the agent) — is dropped. Fragmented ICMPv6 is let through: receivers ignore
// fragmented neighbour discovery (RFC 6980; Linux's suppress_frag_ndisc).
//
// What it needs of the host kernel: the bpf system call (CONFIG_BPF_SYSCALL, and CAP_BPF or
// CAP_SYS_ADMIN, which the shim has as root), the cls_bpf classifier (CONFIG_NET_CLS_BPF,
// built in or loadable) and the ingress qdisc (CONFIG_NET_SCH_INGRESS), as the redirect the
// other way needs; no tc action module (act_gact, act_mirred) is used for it. Where one is
// missing, loading the program or adding the filter fails and so does Attach, with the
// kernel's error: the pod does not start with an unfiltered NIC.

// Offsets in an Ethernet frame (untagged) and in struct __sk_buff.
const (
	ethSrc  = 6
	ethType = 12
	ethLen  = 14

	ip4Src = ethLen + 12
	ip4Len = ethLen + 20

	arpFixed = ethLen + 0 // htype, ptype
	arpSizes = ethLen + 4 // hlen, plen
	arpSHA   = ethLen + 8
	arpSPA   = ethLen + 14
	arpLen   = ethLen + 28

	ip6Next = ethLen + 6
	ip6Src  = ethLen + 8
	ip6Len  = ethLen + 40

	icmp6Target = ip6Len + 8 // of a neighbour solicitation or advertisement
	icmp6NDLen  = ip6Len + 24

	skbVLANPresent = 20
	skbData        = 76
	skbDataEnd     = 80

	tcActShot = 2
)

// ICMPv6 types and IPv6 next headers the guard looks at.
const (
	icmp6MLDQuery    = 130
	icmp6MLDReport   = 131
	icmp6MLDDone     = 132
	icmp6RouterAdv   = 134
	icmp6NeighSol    = 135
	icmp6NeighAdv    = 136
	icmp6Redirect    = 137
	icmp6MLDv2Report = 143

	nextHopByHop  = 0
	nextRouting   = 43
	nextICMPv6    = 58
	nextDestOpts  = 60
	ip6ExtLenUnit = 8
)

// Registers of the guard's program: R6 the context, R7 the frame's start, R8 its end, R9 1
// for an IPv6 frame from ::, R2–R5 scratch (R1–R5 are lost only at the final call).
const (
	rCtx   = asm.R6
	rData  = asm.R7
	rEnd   = asm.R8
	rUnspc = asm.R9
)

// guardSpec is the guard's program for a NIC with mac and addrs, redirecting to the
// interface with index to.
func guardSpec(mac net.HardwareAddr, addrs []netip.Prefix, to int) (*ebpf.ProgramSpec, error) {
	if len(mac) != 6 {
		return nil, fmt.Errorf("MAC %v: not 6 bytes", mac)
	}
	var v4, v6 []netip.Addr
	for _, p := range addrs {
		if a := p.Addr().Unmap(); a.Is4() {
			v4 = append(v4, a)
		} else {
			v6 = append(v6, a)
		}
	}
	v6 = append(v6, linkLocal(mac))

	g := &guard{}
	g.emit(
		asm.Mov.Reg(rCtx, asm.R1),
		asm.LoadMem(asm.R2, rCtx, skbVLANPresent, asm.Word),
		asm.JNE.Imm32(asm.R2, 0, "drop"),
		asm.LoadMem(rData, rCtx, skbData, asm.Word),
		asm.LoadMem(rEnd, rCtx, skbDataEnd, asm.Word),
	)
	g.need(ethLen)
	g.eqBytes(ethSrc, mac, "drop")
	g.emit(
		asm.LoadMem(asm.R2, rData, ethType, asm.Half),
		asm.JEq.Imm32(asm.R2, int32(be16(unix.ETH_P_IP)), "ipv4"),
		asm.JEq.Imm32(asm.R2, int32(be16(unix.ETH_P_ARP)), "arp"),
		asm.JEq.Imm32(asm.R2, int32(be16(unix.ETH_P_IPV6)), "ipv6"),
		asm.Ja.Label("drop"),
	)

	g.label("ipv4")
	g.need(ip4Len)
	g.oneOf(ip4Src, v4, "pass")
	g.emit(asm.Ja.Label("drop"))

	g.label("arp")
	g.need(arpLen)
	g.eqBytes(arpFixed, []byte{0, 1, 0x08, 0x00}, "drop") // Ethernet, IPv4
	g.eqBytes(arpSizes, []byte{6, 4}, "drop")
	g.eqBytes(arpSHA, mac, "drop")
	g.oneOf(arpSPA, v4, "pass")
	g.emit(asm.Ja.Label("drop"))

	g.label("ipv6")
	g.need(ip6Len)
	g.emit(asm.Mov.Imm(rUnspc, 0))
	g.oneOf(ip6Src, v6, "ip6next")
	g.eqBytes(ip6Src, make([]byte, 16), "drop")
	g.emit(asm.Mov.Imm(rUnspc, 1))

	g.label("ip6next")
	g.emit(
		asm.LoadMem(asm.R2, rData, ip6Next, asm.Byte),
		asm.JEq.Imm32(asm.R2, nextICMPv6, "icmp6"),
		asm.JEq.Imm32(asm.R2, nextHopByHop, "hbh"),
		asm.JNE.Imm32(rUnspc, 0, "drop"),
		asm.JEq.Imm32(asm.R2, nextRouting, "drop"),
		asm.JEq.Imm32(asm.R2, nextDestOpts, "drop"),
		asm.Ja.Label("pass"),
	)

	// A hop-by-hop header first: only MLD behind it. R4 becomes a pointer to the ICMPv6
	// header, the options' length being variable.
	g.label("hbh")
	g.need(ip6Len + 2)
	g.emit(
		asm.LoadMem(asm.R2, rData, ip6Len, asm.Byte),
		asm.JNE.Imm32(asm.R2, nextICMPv6, "drop"),
		asm.LoadMem(asm.R3, rData, ip6Len+1, asm.Byte),
		asm.Add.Imm(asm.R3, 1),
		asm.LSh.Imm(asm.R3, 3), // (length+1) units of 8 bytes: at most 2048
		asm.Mov.Reg(asm.R4, rData),
		asm.Add.Imm(asm.R4, ip6Len),
		asm.Add.Reg(asm.R4, asm.R3),
		asm.Mov.Reg(asm.R5, asm.R4),
		asm.Add.Imm(asm.R5, 1),
		asm.JGT.Reg(asm.R5, rEnd, "drop"),
		asm.LoadMem(asm.R2, asm.R4, 0, asm.Byte),
		asm.Ja.Label("mld"),
	)

	// ICMPv6 right after the IPv6 header.
	g.label("icmp6")
	g.need(ip6Len + 1)
	g.emit(
		asm.LoadMem(asm.R2, rData, ip6Len, asm.Byte),
		asm.JEq.Imm32(asm.R2, icmp6RouterAdv, "drop"),
		asm.JEq.Imm32(asm.R2, icmp6Redirect, "drop"),
		asm.JEq.Imm32(asm.R2, icmp6NeighAdv, "ndtarget"),
		asm.JEq.Imm32(rUnspc, 0, "pass"),
		asm.JEq.Imm32(asm.R2, icmp6NeighSol, "ndtarget"),
	)
	g.label("mld") // R2: the ICMPv6 type
	g.emit(
		asm.JEq.Imm32(asm.R2, icmp6MLDQuery, "pass"),
		asm.JEq.Imm32(asm.R2, icmp6MLDReport, "pass"),
		asm.JEq.Imm32(asm.R2, icmp6MLDDone, "pass"),
		asm.JEq.Imm32(asm.R2, icmp6MLDv2Report, "pass"),
		asm.Ja.Label("drop"),
	)

	// A neighbour advertisement, or a solicitation from :: (duplicate address detection),
	// is about its target address: one of the NIC's.
	g.label("ndtarget")
	g.need(icmp6NDLen)
	g.oneOf(icmp6Target, v6, "pass")
	g.emit(asm.Ja.Label("drop"))

	g.label("pass")
	g.emit(
		asm.Mov.Imm(asm.R1, int32(to)),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
	)
	g.label("drop")
	g.emit(asm.Mov.Imm(asm.R0, tcActShot), asm.Return())

	return &ebpf.ProgramSpec{
		Name:         "kvfs_tap_guard",
		Type:         ebpf.SchedCLS,
		Instructions: g.insns,
		License:      "Apache-2.0",
	}, nil
}

// guard assembles the guard's program.
type guard struct {
	insns   asm.Instructions
	pending string // the symbol for the next instruction emitted
	seq     int
}

func (g *guard) emit(insns ...asm.Instruction) {
	for _, ins := range insns {
		if g.pending != "" {
			ins = ins.WithSymbol(g.pending)
			g.pending = ""
		}
		g.insns = append(g.insns, ins)
	}
}

// label names the next instruction. A label without an instruction between it and the next
// is joined to it by a jump.
func (g *guard) label(name string) {
	if g.pending != "" {
		g.emit(asm.Ja.Label(name))
	}
	g.pending = name
}

// need drops a frame shorter than n bytes; it also proves to the verifier that the first n
// bytes may be read.
func (g *guard) need(n int32) {
	g.emit(
		asm.Mov.Reg(asm.R3, rData),
		asm.Add.Imm(asm.R3, n),
		asm.JGT.Reg(asm.R3, rEnd, "drop"),
	)
}

// eqBytes jumps to otherwise unless the frame's bytes at off are want (a multiple of 2 bytes
// long; read 4 at a time, then 2).
func (g *guard) eqBytes(off int16, want []byte, otherwise string) {
	for len(want) > 0 {
		if len(want) >= 4 {
			g.emit(
				asm.LoadMem(asm.R2, rData, off, asm.Word),
				asm.JNE.Imm32(asm.R2, int32(binary.NativeEndian.Uint32(want)), otherwise),
			)
			off, want = off+4, want[4:]
			continue
		}
		g.emit(
			asm.LoadMem(asm.R2, rData, off, asm.Half),
			asm.JNE.Imm32(asm.R2, int32(binary.NativeEndian.Uint16(want)), otherwise),
		)
		off, want = off+2, want[2:]
	}
}

// oneOf jumps to match if the frame's address at off is one of addrs (all of one family),
// and goes on otherwise.
func (g *guard) oneOf(off int16, addrs []netip.Addr, match string) {
	for _, a := range addrs {
		g.seq++
		next := fmt.Sprintf("next%d", g.seq)
		g.eqBytes(off, a.AsSlice(), next)
		g.emit(asm.Ja.Label(match))
		g.label(next)
	}
}

// be16 is v as the kernel reads its network-order bytes into a register.
func be16(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}

// linkLocal is the IPv6 link-local address a kernel makes from mac (modified EUI-64).
func linkLocal(mac net.HardwareAddr) netip.Addr {
	var a [16]byte
	a[0], a[1] = 0xfe, 0x80
	a[8], a[9], a[10] = mac[0]^2, mac[1], mac[2]
	a[11], a[12] = 0xff, 0xfe
	a[13], a[14], a[15] = mac[3], mac[4], mac[5]
	return netip.AddrFrom16(a)
}

// errGuard wraps the guard's load or attach failure.
var errGuard = errors.New("the filter on the tap (eBPF, cls_bpf) cannot be set up")

// addGuard loads the guard for pod's MAC and addrs and attaches it to tap's ingress, whose
// qdisc exists. The kernel keeps the program while the filter holds it.
func addGuard(h *netlink.Handle, tap, pod netlink.Link, addrs []netip.Prefix) error {
	spec, err := guardSpec(pod.Attrs().HardwareAddr, addrs, pod.Attrs().Index)
	if err != nil {
		return fmt.Errorf("%w: %v", errGuard, err)
	}
	prog, err := ebpf.NewProgram(spec)
	if err != nil {
		return fmt.Errorf("%w: loading the program: %v", errGuard, err)
	}
	defer prog.Close()
	f := &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: tap.Attrs().Index,
			Parent:    netlink.MakeHandle(0xffff, 0),
			Priority:  1,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           prog.FD(),
		Name:         spec.Name,
		DirectAction: true,
	}
	if err := h.FilterAdd(f); err != nil {
		return fmt.Errorf("%w: adding it to %s's ingress: %v", errGuard, tap.Attrs().Name, err)
	}
	return nil
}
