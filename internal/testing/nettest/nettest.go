// Package nettest makes network namespaces for tests: named ones (a bind mount in /run/netns,
// as `ip netns add` makes them), a veth pair between two of them, and code run inside one.
// Everything it makes is removed at the test's cleanup. It is for tests only.
package nettest

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Dir is where named network namespaces are bound, as iproute2 does.
const Dir = "/run/netns"

var seq atomic.Int64

// NS is a named network namespace made for a test.
type NS struct {
	Name, Path string
	t          testing.TB
}

// New makes a network namespace named after the test's process and a counter, bound at
// Dir/name, and removes it at cleanup. It needs root.
func New(t testing.TB, prefix string) *NS {
	t.Helper()
	name := fmt.Sprintf("%s-%d-%d", prefix, os.Getpid(), seq.Add(1))
	if err := os.MkdirAll(Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(Dir, name)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		t.Fatalf("nettest: %v", err)
	}
	f.Close()
	t.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			t.Errorf("nettest: unmount %s: %v", path, err)
		}
		os.Remove(path)
	})
	err = InThread(func() error {
		self, err := netns.Get()
		if err != nil {
			return err
		}
		defer self.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
		}
		tid := "/proc/self/task/" + strconv.Itoa(unix.Gettid()) + "/ns/net"
		err = unix.Mount(tid, path, "", unix.MS_BIND, "")
		if serr := netns.Set(self); serr != nil {
			return fmt.Errorf("%w: back to the thread's namespace: %v", errStuck, serr)
		}
		return err
	})
	if err != nil {
		t.Fatalf("nettest: making network namespace %s: %v", name, err)
	}
	return &NS{Name: name, Path: path, t: t}
}

// errStuck is returned by f when the thread could not go back to its namespace: InThread
// then leaves it locked, and the runtime ends it.
var errStuck = errors.New("the thread is stuck in another namespace")

// InThread runs f on a locked OS thread, which f leaves in the namespaces it found (or
// returns an error wrapping errStuck).
func InThread(f func() error) error {
	ch := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		err := f()
		if !errors.Is(err, errStuck) {
			runtime.UnlockOSThread()
		}
		ch <- err
	}()
	return <-ch
}

// Do runs f on a thread in ns: the sockets f opens belong to ns and stay there when used
// from other threads later.
func (ns *NS) Do(f func() error) error {
	h, err := netns.GetFromPath(ns.Path)
	if err != nil {
		return err
	}
	defer h.Close()
	return InThread(func() error {
		self, err := netns.Get()
		if err != nil {
			return err
		}
		defer self.Close()
		if err := netns.Set(h); err != nil {
			return fmt.Errorf("setns %s: %w", ns.Path, err)
		}
		ferr := f()
		if err := netns.Set(self); err != nil {
			return fmt.Errorf("%w: %v (f: %v)", errStuck, err, ferr)
		}
		return ferr
	})
}

// Handle is a netlink handle bound to ns, closed at cleanup.
func (ns *NS) Handle() *netlink.Handle {
	ns.t.Helper()
	h, err := netns.GetFromPath(ns.Path)
	if err != nil {
		ns.t.Fatal(err)
	}
	defer h.Close()
	nh, err := netlink.NewHandleAt(h)
	if err != nil {
		ns.t.Fatal(err)
	}
	ns.t.Cleanup(nh.Close)
	return nh
}

// Veth makes a veth pair: name in ns, peer in peerNS, both up, with the given addresses
// (none for an empty list), and lo up in both.
func Veth(t testing.TB, ns *NS, name string, addrs []netip.Prefix, peerNS *NS, peer string, peerAddrs []netip.Prefix) {
	t.Helper()
	h, ph := ns.Handle(), peerNS.Handle()
	pfd, err := netns.GetFromPath(peerNS.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer pfd.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: peer, PeerNamespace: netlink.NsFd(pfd)}
	if err := h.LinkAdd(veth); err != nil {
		t.Fatalf("nettest: veth %s/%s: %v", name, peer, err)
	}
	for _, side := range []struct {
		h     *netlink.Handle
		name  string
		addrs []netip.Prefix
	}{{h, name, addrs}, {ph, peer, peerAddrs}} {
		l, err := side.h.LinkByName(side.name)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range side.addrs {
			if err := side.h.AddrAdd(l, &netlink.Addr{IPNet: IPNet(a), Flags: unix.IFA_F_NODAD}); err != nil {
				t.Fatalf("nettest: address %v on %s: %v", a, side.name, err)
			}
		}
		for _, up := range []string{side.name, "lo"} {
			ul, err := side.h.LinkByName(up)
			if err != nil {
				t.Fatal(err)
			}
			if err := side.h.LinkSetUp(ul); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// IPNet is p as a *net.IPNet (the address, not the masked prefix).
func IPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// NewLoopback is New with the namespace's loopback up, as CNI's loopback plugin leaves a
// pod's.
func NewLoopback(t testing.TB, prefix string) *NS {
	t.Helper()
	ns := New(t, prefix)
	h := ns.Handle()
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	return ns
}

// Serve answers each connection ln accepts with serve, in a goroutine of its own, until ln is
// closed (at the test's cleanup), and closes the connection when serve returns.
func Serve(t testing.TB, ln net.Listener, serve func(net.Conn)) {
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
}
