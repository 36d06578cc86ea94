package network

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"unsafe"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Port-forward: containerd's CRI serves it itself, dialling localhost:PORT (tcp4, then tcp6)
// in the pod's network namespace on the host, where nothing of the VM's listens. So that the
// guest's servers answer there, RedirectLoopback has the namespace's TCP connections to
// 127.0.0.1 and ::1 redirected, whatever their port, to listeners of the caller's (the shim's
// relay) bound in that namespace: an nftables nat chain on the output hook of a table of its
// own per family (table ip and table ip6 redirectTable), one rule each,
//
//	meta l4proto tcp ip daddr 127.0.0.1 redirect to :LISTENER-PORT
//
// made over netlink in the namespace (google/nftables, a socket opened there). The conntrack
// entry the redirect makes keeps the port dialled, which OriginalPort reads off an accepted
// connection (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST). The namespace's own stack carries these
// connections on its loopback; nothing else in it dials its loopback (QEMU's sockets are Unix
// ones), and the pod's traffic never enters its stack (the tc redirects, network.go).
//
// What it needs of the host kernel: nf_tables with its nat chains, the redir expression and
// conntrack (CONFIG_NF_TABLES, CONFIG_NFT_NAT, CONFIG_NFT_REDIR, CONFIG_NF_CONNTRACK, for both
// families), built in or loaded on demand; where one is missing, RedirectLoopback fails with
// the kernel's error.

// redirectTable names the tables RedirectLoopback makes, one per family.
const redirectTable = "kvfs-portforward"

// LoopbackRedirect is a namespace's loopback TCP redirected to Listeners.
type LoopbackRedirect struct {
	netns string
	// Listeners accept the redirected connections: the one on 127.0.0.1 first, then, where
	// the namespace has ::1, the one on ::1. They are the caller's to accept from.
	Listeners []*net.TCPListener
}

// RedirectLoopback listens on a port of 127.0.0.1 (and of ::1, if the namespace has IPv6) in
// the network namespace at netnsPath, and redirects there every TCP connection the namespace
// makes to those addresses. The namespace's loopback must be up (CNI's loopback plugin, run
// by containerd's CRI, brings it up). Close undoes it.
func RedirectLoopback(netnsPath string) (_ *LoopbackRedirect, retErr error) {
	r := &LoopbackRedirect{netns: netnsPath}
	defer func() {
		if retErr != nil {
			r.closeListeners()
		}
	}()
	err := Do(netnsPath, func() error {
		ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			return fmt.Errorf("listening on 127.0.0.1: %w", err)
		}
		r.Listeners = append(r.Listeners, ln)
		// A namespace without IPv6 (disabled, or ::1 not on lo) has no ::1 to dial.
		if ln, err := net.ListenTCP("tcp6", &net.TCPAddr{IP: net.IPv6loopback}); err == nil {
			r.Listeners = append(r.Listeners, ln)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("port-forward's listener in %s: %w", netnsPath, err)
	}
	ns, err := openNetNS(netnsPath)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, fmt.Errorf("nftables in %s: %w", netnsPath, err)
	}
	for _, ln := range r.Listeners {
		addr := ln.Addr().(*net.TCPAddr)
		loopback, _ := netip.AddrFromSlice(addr.IP)
		addRedirect(c, loopback.Unmap(), uint16(addr.Port))
	}
	if err := c.Flush(); err != nil {
		return nil, fmt.Errorf("port-forward's nftables rules in %s: %w", netnsPath, err)
	}
	return r, nil
}

// addRedirect adds to c's batch the table of loopback's family, made anew (a table left by
// an earlier owner is replaced), with the rule that redirects TCP to loopback to port.
func addRedirect(c *nftables.Conn, loopback netip.Addr, port uint16) {
	family, daddr := nftables.TableFamilyIPv4, uint32(16) // offsetof(struct iphdr, daddr)
	if loopback.Is6() {
		family, daddr = nftables.TableFamilyIPv6, 24 // offsetof(struct ipv6hdr, daddr)
	}
	t := &nftables.Table{Family: family, Name: redirectTable}
	// Adding first makes the delete succeed whether or not the table was there.
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: daddr, Len: uint32(loopback.BitLen() / 8)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: loopback.AsSlice()},
		&expr.Immediate{Register: 1, Data: binary.BigEndian.AppendUint16(nil, port)},
		&expr.Redir{RegisterProtoMin: 1, Flags: unix.NF_NAT_RANGE_PROTO_SPECIFIED},
	}})
}

// Close closes the listeners and deletes the tables. A namespace already gone, or a table
// already deleted, is not an error: the namespace usually goes with the pod, at about the
// same time.
func (r *LoopbackRedirect) Close() error {
	r.closeListeners()
	ns, err := openNetNS(r.netns)
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, errNotNetNS) {
		return nil // the namespace was removed (its bind mount too), and all in it
	}
	if err != nil {
		return err
	}
	defer ns.Close()
	return deleteRedirect(ns, r.netns)
}

func (r *LoopbackRedirect) closeListeners() {
	for _, ln := range r.Listeners {
		ln.Close()
	}
}

// deleteRedirect deletes both families' tables, each in a batch of its own: a missing one
// fails only its own.
func deleteRedirect(ns netns.NsHandle, path string) error {
	var errs []error
	for _, family := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
		if err != nil {
			return fmt.Errorf("nftables in %s: %w", path, err)
		}
		c.DelTable(&nftables.Table{Family: family, Name: redirectTable})
		if err := c.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("deleting port-forward's nftables table in %s: %w", path, err))
		}
	}
	return errors.Join(errs...)
}

// OriginalPort is the port a connection accepted from a LoopbackRedirect's listener was made
// to, before the redirect: SO_ORIGINAL_DST (IPv4) or IP6T_SO_ORIGINAL_DST (IPv6), from the
// connection's conntrack entry.
func OriginalPort(c *net.TCPConn) (uint16, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, err
	}
	v4 := c.LocalAddr().(*net.TCPAddr).IP.To4() != nil
	var port uint16
	var serr error
	err = raw.Control(func(fd uintptr) {
		if v4 {
			var sa unix.RawSockaddrInet4
			serr = getsockopt(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST, unsafe.Pointer(&sa), unsafe.Sizeof(sa))
			port = portOf(sa.Port)
		} else {
			var sa unix.RawSockaddrInet6
			serr = getsockopt(fd, unix.SOL_IPV6, ip6tSOOriginalDst, unsafe.Pointer(&sa), unsafe.Sizeof(sa))
			port = portOf(sa.Port)
		}
	})
	if err == nil {
		err = serr
	}
	if err != nil {
		return 0, fmt.Errorf("the original destination of %v: %w", c.RemoteAddr(), err)
	}
	return port, nil
}

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h), which
// x/sys/unix does not name.
const ip6tSOOriginalDst = 80

// getsockopt reads an option of exactly size bytes into p: the kernel answers
// SO_ORIGINAL_DST only into a struct sockaddr_in's room.
func getsockopt(fd uintptr, level, opt int, p unsafe.Pointer, size uintptr) error {
	l := uint32(size)
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt), uintptr(p), uintptr(unsafe.Pointer(&l)), 0)
	if e != 0 {
		return e
	}
	return nil
}

// portOf is a sockaddr's port, which is in network byte order.
func portOf(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return binary.BigEndian.Uint16(b[:])
}
