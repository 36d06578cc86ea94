package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"github.com/mdlayher/vsock"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
	"github.com/kvfs/kvfs/internal/testing/threadcred"
)

// TestCheckVsockPeer: only the host from a port up to 1023 passes.
func TestCheckVsockPeer(t *testing.T) {
	for _, tc := range []struct {
		peer net.Addr
		want string // "" accepted, else a part of the refusal
	}{
		{&vsock.Addr{ContextID: 2, Port: 1023}, ""},
		{&vsock.Addr{ContextID: 2, Port: 1}, ""},
		{&vsock.Addr{ContextID: 2, Port: 0}, ""},
		{&vsock.Addr{ContextID: 2, Port: 1024}, "port above 1023"},
		{&vsock.Addr{ContextID: 2, Port: 49152}, "port above 1023"},
		{&vsock.Addr{ContextID: 2, Port: unix.VMADDR_PORT_ANY}, "port above 1023"},
		{&vsock.Addr{ContextID: 3, Port: 1023}, "not the host (CID 2)"},
		{&vsock.Addr{ContextID: 1, Port: 1023}, "not the host (CID 2)"},
		{&vsock.Addr{ContextID: 0, Port: 1023}, "not the host (CID 2)"},
		{&vsock.Addr{ContextID: unix.VMADDR_CID_ANY, Port: 1023}, "not the host (CID 2)"},
		{serialAddr("host"), "not a vsock address"},
		{&net.UnixAddr{Name: "@x", Net: "unix"}, "not a vsock address"},
		{nil, "not a vsock address"},
	} {
		err := checkVsockPeer(tc.peer, unix.VMADDR_CID_HOST)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%v: refused: %v", tc.peer, err)
		case tc.want != "" && err == nil:
			t.Errorf("%v: accepted, want refused (%s)", tc.peer, tc.want)
		case tc.want != "" && !strings.Contains(err.Error(), tc.want):
			t.Errorf("%v: %v, want %q in it", tc.peer, err, tc.want)
		}
	}
}

// fakeVsockListener hands out the connections sent on conns.
type fakeVsockListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newFakeVsockListener() *fakeVsockListener {
	return &fakeVsockListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *fakeVsockListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *fakeVsockListener) Close() error { l.once.Do(func() { close(l.done) }); return nil }
func (l *fakeVsockListener) Addr() net.Addr {
	return &vsock.Addr{ContextID: 5, Port: apiv1.DefaultVsockPort}
}

// peerConn is the guest's end of a pipe, seen as a connection from peer.
type peerConn struct {
	net.Conn
	peer   *vsock.Addr
	closed atomic.Bool
}

func (c *peerConn) RemoteAddr() net.Addr { return c.peer }
func (c *peerConn) Close() error         { c.closed.Store(true); return c.Conn.Close() }

// connect hands l a connection from peer and answers the peer's end and the guest's.
func connect(t *testing.T, l *fakeVsockListener, peer *vsock.Addr) (net.Conn, *peerConn) {
	t.Helper()
	host, guest := net.Pipe()
	t.Cleanup(func() { host.Close(); guest.Close() })
	c := &peerConn{Conn: guest, peer: peer}
	select {
	case l.conns <- c:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: the listener does not accept", peer)
	}
	return host, c
}

// TestHostOnlyListener serves the agent API over the listener and connects peers of every
// kind: those refused are closed at once, their requests never answered (ttrpc never had
// them), and the host's privileged connections after them are served.
func TestHostOnlyListener(t *testing.T) {
	fake := newFakeVsockListener()
	l := newHostOnlyListener(fake, unix.VMADDR_CID_HOST, discardLog())
	fx := newFixture(t)
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()

	// ping asks Ping over conn, then calls whileOpen (if any) before it closes its client: the
	// server closes its end once the client has closed.
	ping := func(conn net.Conn, whileOpen func()) error {
		client := ttrpc.NewClient(conn)
		defer client.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := apiv1.NewAgentClient(client).Ping(ctx, &apiv1.PingRequest{})
		if whileOpen != nil {
			whileOpen()
		}
		return err
	}
	refused := []*vsock.Addr{
		{ContextID: 2, Port: 1024},
		{ContextID: 3, Port: 1023},
		{ContextID: 1, Port: 1023},
		{ContextID: 2, Port: 40000},
	}
	for round := range 2 {
		for _, peer := range refused {
			host, guest := connect(t, fake, peer)
			host.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := host.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Errorf("round %d, %s: read %d, %v; want the connection closed (EOF)", round, peer, n, err)
			}
			if !guest.closed.Load() {
				t.Errorf("round %d, %s: the guest's end is not closed", round, peer)
			}
			if err := ping(host, nil); err == nil {
				t.Errorf("round %d, %s: Ping answered", round, peer)
			}
		}
		host, guest := connect(t, fake, &vsock.Addr{ContextID: 2, Port: 1023})
		err := ping(host, func() {
			if guest.closed.Load() {
				t.Errorf("round %d: the host's connection was closed", round)
			}
		})
		if err != nil {
			t.Errorf("round %d: Ping from the host's port 1023: %v", round, err)
		}
	}

	srv.Close()
	select {
	case err := <-served:
		if !errors.Is(err, ttrpc.ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve goes on after Close")
	}
}

// TestHostOnlyListenerLogBounded: a peer that connects in a loop gets one log line per
// interval, and the next line counts the refusals not logged.
func TestHostOnlyListenerLogBounded(t *testing.T) {
	var out syncbuf.Buffer
	logger := logrus.New()
	logger.SetOutput(&out)
	fake := newFakeVsockListener()
	l := newHostOnlyListener(fake, unix.VMADDR_CID_HOST, logrus.NewEntry(logger))
	l.logEvery = time.Hour
	accepted := make(chan net.Conn)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	defer func() {
		fake.Close()
		for range accepted {
		}
	}()

	peer := &vsock.Addr{ContextID: 2, Port: 50000}
	for range 50 {
		connect(t, fake, peer)
	}
	connect(t, fake, &vsock.Addr{ContextID: 2, Port: 1023})
	<-accepted // every refusal before it is done
	if got := strings.Count(out.String(), "refused a vsock connection"); got != 1 {
		t.Fatalf("%d log lines for 50 refusals within the interval, want 1:\n%s", got, out.String())
	}
	if !strings.Contains(out.String(), "host(2):50000") {
		t.Errorf("the line does not name the peer:\n%s", out.String())
	}

	// The interval passes: the next refusal is logged with the 49 before it.
	l.mu.Lock()
	l.lastLog = l.lastLog.Add(-2 * time.Hour)
	l.mu.Unlock()
	connect(t, fake, peer)
	connect(t, fake, &vsock.Addr{ContextID: 2, Port: 1023})
	<-accepted
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[1], "unlogged=49") {
		t.Errorf("after the interval, want a second line with unlogged=49:\n%s", out.String())
	}
}

// TestListenVsockServesOnlyTheHost: the agent's real vsock listener takes the host for
// VMADDR_CID_HOST (2), whatever tests pass to the check.
func TestListenVsockServesOnlyTheHost(t *testing.T) {
	l, err := ListenVsock(0, testSecret, discardLog())
	if errors.Is(err, unix.EAFNOSUPPORT) {
		t.Skip("the kernel has no vsock")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	sl, ok := l.(*secretListener)
	if !ok {
		t.Fatalf("ListenVsock answers a %T, want the secret's listener", l)
	}
	if !bytes.Equal(sl.hello, apiv1.Hello(testSecret)) {
		t.Errorf("the listener waits for the hello %x, want %x", sl.hello, apiv1.Hello(testSecret))
	}
	h, ok := sl.inner.(*hostOnlyListener)
	if !ok {
		t.Fatalf("the secret's listener is over a %T, want the host-only listener", sl.inner)
	}
	if h.host != 2 {
		t.Errorf("the listener takes CID %d for the host, want 2", h.host)
	}
	if _, ok := l.Addr().(*vsock.Addr); !ok {
		t.Errorf("Addr is a %T, want *vsock.Addr", l.Addr())
	}
}

// TestVsockUnprivilegedPortRefused checks, on this kernel, what the accept rule rests on: a
// host user without CAP_NET_BIND_SERVICE cannot bind a vsock port up to 1023, and the port a
// connect would bind for it is above 1023, which the agent refuses; root binds one that
// passes. Only binds: nothing is sent.
func TestVsockUnprivilegedPortRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to compare with an unprivileged user")
	}
	// As root: the highest free privileged port binds and passes the check.
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if errors.Is(err, unix.EAFNOSUPPORT) {
		t.Skip("the kernel has no vsock")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	port := uint32(vsockMaxPrivilegedPort)
	for ; port >= 1; port-- {
		if err = unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); !errors.Is(err, unix.EADDRINUSE) {
			break
		}
	}
	if err != nil {
		t.Fatalf("root binding vsock port %d: %v", port, err)
	}
	if err := checkVsockPeer(&vsock.Addr{ContextID: unix.VMADDR_CID_HOST, Port: port}, unix.VMADDR_CID_HOST); err != nil {
		t.Errorf("root's port %d: %v", port, err)
	}

	var privErr, anyErr error
	var anyPort uint32
	if err := threadcred.Run(threadcred.Nobody, threadcred.Nobody, func() {
		fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			privErr = err
			return
		}
		defer unix.Close(fd)
		privErr = unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: vsockMaxPrivilegedPort - 1})

		fd2, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			anyErr = err
			return
		}
		defer unix.Close(fd2)
		if anyErr = unix.Bind(fd2, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: unix.VMADDR_PORT_ANY}); anyErr != nil {
			return
		}
		sa, err := unix.Getsockname(fd2)
		if err != nil {
			anyErr = err
			return
		}
		anyPort = sa.(*unix.SockaddrVM).Port
	}); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(privErr, unix.EACCES) {
		t.Errorf("an unprivileged user binding vsock port %d: %v, want EACCES", vsockMaxPrivilegedPort-1, privErr)
	}
	if anyErr != nil {
		t.Fatalf("an unprivileged user binding any vsock port: %v", anyErr)
	}
	if err := checkVsockPeer(&vsock.Addr{ContextID: unix.VMADDR_CID_HOST, Port: anyPort}, unix.VMADDR_CID_HOST); err == nil {
		t.Errorf("an unprivileged user's port %d passes the check", anyPort)
	}
}
