package shim

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// The relay's tests: a real network namespace stands for the pod's (its loopback up, as CNI
// leaves it), the test dials its localhost as containerd's CRI does, and the fake agent dials
// the test process's own loopback, where the test's servers stand for the guest's.

// podLoopbackNS is a pod's network namespace with its loopback up.
func podLoopbackNS(t *testing.T) *nettest.NS {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("making a network namespace needs root")
	}
	return nettest.NewLoopback(t, "kvfs-pf")
}

// guestServer listens on the test's 127.0.0.1 and answers each connection with serve; it
// returns the port.
func guestServer(t *testing.T, serve func(net.Conn)) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nettest.Serve(t, ln, serve)
	return ln.Addr().(*net.TCPAddr).Port
}

// dialPod dials addr in ns, as containerd's CRI does for port-forward.
func dialPod(t *testing.T, ns *nettest.NS, network, addr string) (*net.TCPConn, error) {
	t.Helper()
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout(network, addr, 5*time.Second)
		return err
	})
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c.(*net.TCPConn), nil
}

func hostPort(host string, port int) string { return net.JoinHostPort(host, strconv.Itoa(port)) }

// startTestRelay starts a relay in ns over a door to a, with the test's context.
func startTestRelay(t *testing.T, ns *nettest.NS, a *fakeAgent) *portRelay {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	env := &podEnv{ctx: ctx, limits: DefaultGuestLimits}
	door := newAgentDoor(ctx, ctx, a, env.limits, &env.guestLog, func(why error) { t.Errorf("the door failed the pod: %v", why) })
	r, err := startPortRelay(ctx, env, ns.Path, door)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestPortRelay carries connections made to the pod namespace's localhost, on both families,
// to the guest's server on the same port: a request answered at its end of file (the client's
// half-close reaches the guest), a server that speaks first and closes (its end reaches the
// client, which still writes after), and a port nothing listens on (the client's connection
// reset). The relay's close leaves no connection in the guest, no rule and no listener.
func TestPortRelay(t *testing.T) {
	ns := podLoopbackNS(t)
	a := newFakeAgent()
	r := startTestRelay(t, ns, a)

	replier := guestServer(t, func(c net.Conn) {
		req, err := io.ReadAll(c)
		if err == nil {
			c.Write(append([]byte("got: "), req...))
		}
	})
	for _, addr := range []string{hostPort("127.0.0.1", replier), hostPort("::1", replier)} {
		c, err := dialPod(t, ns, "tcp", addr)
		if err != nil {
			t.Fatalf("dial %s in the pod: %v", addr, err)
		}
		if _, err := c.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if got, err := io.ReadAll(c); err != nil || string(got) != "got: hello" {
			t.Errorf("%s: read %q, %v; want %q", addr, got, err, "got: hello")
		}
	}

	written := make(chan string, 1)
	banner := guestServer(t, func(c net.Conn) {
		c.Write([]byte("banner"))
		c.(*net.TCPConn).CloseWrite()
		b, _ := io.ReadAll(c)
		written <- string(b)
	})
	c, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", banner))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(c); err != nil || string(got) != "banner" {
		t.Errorf("read %q, %v; want the banner, then end of file", got, err)
	}
	c.Write([]byte("after"))
	c.CloseWrite()
	if got := <-written; got != "after" {
		t.Errorf("the guest's server read %q after its close, want %q", got, "after")
	}

	nothing := freeTCPPort(t)
	wantReset(t, ns, hostPort("127.0.0.1", nothing), "a port nothing listens on in the guest")

	// A connection still open is reset by the relay's close.
	open, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", replier))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the open connection in the guest", func() bool { return a.openPorts() == 1 })
	if err := r.close(); err != nil {
		t.Fatal(err)
	}
	if _, err := open.Read(make([]byte, 1)); !errors.Is(err, unix.ECONNRESET) {
		t.Errorf("a connection open at the relay's close: read %v, want a reset", err)
	}
	if n := a.openPorts(); n != 0 {
		t.Errorf("%d connections left open in the guest", n)
	}
	if c, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", replier)); err == nil {
		c.Close()
		t.Error("the pod's localhost is still redirected after the relay's close")
	}
	a.ports.mu.Lock()
	defer a.ports.mu.Unlock()
	want := []uint32{uint32(replier), uint32(replier), uint32(banner), uint32(nothing), uint32(replier)}
	if !slices.Equal(a.ports.opened, want) {
		t.Errorf("the guest was asked for ports %v, want %v", a.ports.opened, want)
	}
}

// TestPortRelayLimit: past agent.MaxPortStreams connections relayed at once, one more is
// reset, and the guest is not asked.
func TestPortRelayLimit(t *testing.T) {
	ns := podLoopbackNS(t)
	a := newFakeAgent()
	startTestRelay(t, ns, a)
	hold := make(chan struct{})
	defer close(hold)
	port := guestServer(t, func(net.Conn) { <-hold })
	for range agent.MaxPortStreams {
		if _, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", port)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "64 connections open in the guest", func() bool { return a.openPorts() == agent.MaxPortStreams })
	wantReset(t, ns, hostPort("127.0.0.1", port), "one connection more")
	if n := a.openPorts(); n != agent.MaxPortStreams {
		t.Errorf("%d connections open in the guest, want 64", n)
	}
}

// TestPortForwardSandbox: a Sandbox API pod with a network namespace gets the relay when it
// starts, and StopSandbox removes it.
func TestPortForwardSandbox(t *testing.T) {
	ns := podLoopbackNS(t)
	h := newHarness(t)
	h.createSandbox("sbx", ns.Path, nil)
	if _, err := h.svc.StartSandbox(h.ctx, &sandboxAPI.StartSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Fatal(err)
	}
	port := guestServer(t, func(c net.Conn) { c.Write([]byte("from the guest")) })
	c, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", port))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(c); err != nil || string(got) != "from the guest" {
		t.Errorf("read %q, %v", got, err)
	}
	if _, err := h.svc.StopSandbox(h.ctx, &sandboxAPI.StopSandboxRequest{SandboxID: "sbx"}); err != nil {
		t.Fatal(err)
	}
	if c, err := dialPod(t, ns, "tcp4", hostPort("127.0.0.1", port)); err == nil {
		c.Close()
		t.Error("the pod's localhost is still redirected after StopSandbox")
	}
}

// wantReset dials addr in ns and wants the connection reset: at once (the dial's connect
// then fails), or at its first read.
func wantReset(t *testing.T, ns *nettest.NS, addr, what string) {
	t.Helper()
	c, err := dialPod(t, ns, "tcp4", addr)
	if err == nil {
		_, err = c.Read(make([]byte, 1))
	}
	if !errors.Is(err, unix.ECONNRESET) {
		t.Errorf("%s: %v, want a reset", what, err)
	}
}

// freeTCPPort is a port of 127.0.0.1 nothing listens on.
func freeTCPPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("no %s after 10 s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
