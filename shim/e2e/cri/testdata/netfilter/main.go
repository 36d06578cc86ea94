// Command netfilter uses, in the network namespace it runs in, the two interfaces of the
// kernel's packet filter that container network tools use, and says for each "NAME ok" or
// "NAME failed: WHY" (exiting 1 if one failed):
//
//   - nft-nat: what a masquerading CNI plugin or Docker makes first, an nftables table with a
//     NAT chain on the postrouting hook, through nfnetlink (one batch, each message
//     acknowledged); the kernel loads nfnetlink, nf_tables and the NAT chain type on demand;
//   - iptables-legacy: what legacy iptables asks first, the filter table's info
//     (IPT_SO_GET_INFO); ip_tables must be loaded, the kernel loads iptable_filter.
package main

import (
	"encoding/binary"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

func main() {
	failed := false
	for _, probe := range []struct {
		name string
		run  func() error
	}{{"nft-nat", nftNAT}, {"iptables-legacy", iptablesLegacy}} {
		if err := probe.run(); err != nil {
			fmt.Printf("%s failed: %v\n", probe.name, err)
			failed = true
			continue
		}
		fmt.Printf("%s ok\n", probe.name)
	}
	if failed {
		os.Exit(1)
	}
}

// iptGetinfo is struct ipt_getinfo.
type iptGetinfo struct {
	Name       [32]byte
	ValidHooks uint32
	HookEntry  [5]uint32
	Underflow  [5]uint32
	NumEntries uint32
	Size       uint32
}

func iptablesLegacy() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return fmt.Errorf("raw socket: %w", err)
	}
	defer unix.Close(fd)
	var info iptGetinfo
	copy(info.Name[:], "filter")
	size := uint32(unsafe.Sizeof(info))
	const iptSoGetInfo = 64 // IPT_SO_GET_INFO
	if _, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_IP, iptSoGetInfo,
		uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0); e != 0 {
		return fmt.Errorf("IPT_SO_GET_INFO filter: %w", e)
	}
	if info.ValidHooks == 0 {
		return fmt.Errorf("the filter table has no hooks")
	}
	return nil
}

func nftNAT() error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netfilter netlink socket: %w", err)
	}
	defer unix.Close(fd)
	tv := unix.Timeval{Sec: 10}
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return err
	}
	const table, chain = "kvfs", "postrouting"
	hook := append(attr(unix.NFTA_HOOK_HOOKNUM, be32(unix.NF_INET_POST_ROUTING)), attr(unix.NFTA_HOOK_PRIORITY, be32(100))...)
	newTable := concat(attr(unix.NFTA_TABLE_NAME, cstr(table)))
	newChain := concat(attr(unix.NFTA_CHAIN_TABLE, cstr(table)), attr(unix.NFTA_CHAIN_NAME, cstr(chain)),
		attr(unix.NFTA_CHAIN_HOOK|unix.NLA_F_NESTED, hook), attr(unix.NFTA_CHAIN_TYPE, cstr("nat")))
	const create = unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE
	batch := concat(
		msg(unix.NFNL_MSG_BATCH_BEGIN, unix.NLM_F_REQUEST, 1, unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES, nil),
		msg(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWTABLE, create, 2, unix.NFPROTO_IPV4, 0, newTable),
		msg(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_NEWCHAIN, create, 3, unix.NFPROTO_IPV4, 0, newChain),
		msg(unix.NFNL_MSG_BATCH_END, unix.NLM_F_REQUEST, 4, unix.AF_UNSPEC, unix.NFNL_SUBSYS_NFTABLES, nil),
	)
	if err := unix.Sendto(fd, batch, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	acked := map[uint32]bool{}
	buf := make([]byte, 1<<16)
	for !acked[2] || !acked[3] {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return fmt.Errorf("receive: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return err
		}
		for _, m := range msgs {
			if m.Header.Type != unix.NLMSG_ERROR || len(m.Data) < 4 {
				continue
			}
			if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
				return fmt.Errorf("message %d: %w", m.Header.Seq, unix.Errno(-e))
			}
			acked[m.Header.Seq] = true
		}
	}
	return nil
}

// msg is a netlink message with nfgenmsg's header: family, version 0, resource id.
func msg(typ, flags uint16, seq uint32, family uint8, resID uint16, attrs []byte) []byte {
	b := make([]byte, unix.NLMSG_HDRLEN+4, unix.NLMSG_HDRLEN+4+len(attrs))
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)+len(attrs)))
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	b[16] = family
	binary.BigEndian.PutUint16(b[18:], resID)
	return append(b, attrs...)
}

// attr is a netlink attribute, padded to 4 bytes.
func attr(typ uint16, data []byte) []byte {
	b := make([]byte, 4, 4+len(data)+3)
	binary.NativeEndian.PutUint16(b[0:], uint16(4+len(data)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

func cstr(s string) []byte { return append([]byte(s), 0) }

func concat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}
