package network

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// loopbackNetNS is a namespace with its loopback up, as CNI's loopback plugin leaves a pod's.
func loopbackNetNS(t *testing.T) *nettest.NS {
	t.Helper()
	needRoot(t)
	return nettest.NewLoopback(t, "kvfs-lo")
}

// dialIn dials addr from inside ns, as containerd's CRI does for port-forward.
func dialIn(ns *nettest.NS, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout(network, addr, 5*time.Second)
		return err
	})
	return c, err
}

// TestLoopbackRedirect dials ports of 127.0.0.1 and ::1 in a namespace: each connection
// reaches the listener of its family, which tells the port dialled; after Close, nothing of
// it is left and the dial is refused.
func TestLoopbackRedirect(t *testing.T) {
	ns := loopbackNetNS(t)
	r, err := RedirectLoopback(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Listeners) != 2 {
		t.Fatalf("%d listeners, want 127.0.0.1's and ::1's", len(r.Listeners))
	}
	for i, tc := range []struct {
		network, addr string
		port          uint16
	}{{"tcp4", "127.0.0.1:8080", 8080}, {"tcp6", "[::1]:22", 22}, {"tcp4", "127.0.0.1:65535", 65535}} {
		ln := r.Listeners[0]
		if tc.network == "tcp6" {
			ln = r.Listeners[1]
		}
		accepted := make(chan *net.TCPConn, 1)
		go func() {
			c, err := ln.AcceptTCP()
			if err != nil {
				t.Error(err)
			}
			accepted <- c
		}()
		c, err := dialIn(ns, tc.network, tc.addr)
		if err != nil {
			t.Fatalf("dial %s: %v", tc.addr, err)
		}
		defer c.Close()
		a := <-accepted
		if a == nil {
			t.FailNow()
		}
		defer a.Close()
		port, err := OriginalPort(a)
		if err != nil || port != tc.port {
			t.Errorf("case %d: original port %d, %v; want %d", i, port, err, tc.port)
		}
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	for _, addr := range []string{"127.0.0.1:8080", "[::1]:22"} {
		if c, err := dialIn(ns, "tcp", addr); err == nil || !errors.Is(err, unix.ECONNREFUSED) {
			if c != nil {
				c.Close()
			}
			t.Errorf("dial %s after Close: %v, want refused", addr, err)
		}
	}
	checkNoTables(t, ns)
	if err := r.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
}

// TestLoopbackRedirectIPv4Only: a namespace without IPv6 gets 127.0.0.1's listener alone.
func TestLoopbackRedirectIPv4Only(t *testing.T) {
	ns := loopbackNetNS(t)
	if err := ns.Do(func() error {
		return writeSysctl("/proc/sys/net/ipv6/conf/all/disable_ipv6", "1")
	}); err != nil {
		t.Fatal(err)
	}
	r, err := RedirectLoopback(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if len(r.Listeners) != 1 || r.Listeners[0].Addr().(*net.TCPAddr).IP.To4() == nil {
		t.Fatalf("listeners %v, want 127.0.0.1's alone", r.Listeners)
	}
}

// TestLoopbackRedirectNamespaceGone: Close after the namespace went is not an error, and a
// table an earlier owner left is replaced.
func TestLoopbackRedirectNamespaceGone(t *testing.T) {
	ns := loopbackNetNS(t)
	old, err := RedirectLoopback(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	old.closeListeners() // its tables stay, as a dead owner's would
	r, err := RedirectLoopback(ns.Path)
	if err != nil {
		t.Fatalf("over an earlier owner's tables: %v", err)
	}
	if err := unix.Unmount(ns.Path, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Errorf("Close after the namespace went: %v", err)
	}
}

func writeSysctl(path, v string) error {
	fd, err := unix.Open(path, unix.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(v))
	return err
}

// checkNoTables fails unless ns has no table of RedirectLoopback's.
func checkNoTables(t *testing.T, ns *nettest.NS) {
	t.Helper()
	h, err := openNetNS(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		t.Fatal(err)
	}
	tables, err := c.ListTables()
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range tables {
		if tb.Name == redirectTable {
			t.Errorf("table %s (family %d) is left", tb.Name, tb.Family)
		}
	}
}
