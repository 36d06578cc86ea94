package agent

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// pipeConn is the host's end of a port made of two pipes. Close interrupts its reads and
// waits for them to return (the pipes stay open for the next host, which must not lose a byte
// to this one's reader).
type pipeConn struct {
	r, w    *os.File
	reading atomic.Int32
}

func (c *pipeConn) Read(b []byte) (int, error) {
	c.reading.Add(1)
	defer c.reading.Add(-1)
	return c.r.Read(b)
}
func (c *pipeConn) Write(b []byte) (int, error) { return c.w.Write(b) }
func (c *pipeConn) Close() error {
	err := c.r.SetReadDeadline(time.Now())
	for c.reading.Load() > 0 {
		time.Sleep(time.Millisecond)
	}
	return err
}
func (c *pipeConn) LocalAddr() net.Addr                { return serialAddr("host") }
func (c *pipeConn) RemoteAddr() net.Addr               { return serialAddr("guest") }
func (c *pipeConn) SetDeadline(t time.Time) error      { return os.ErrNoDeadline }
func (c *pipeConn) SetReadDeadline(t time.Time) error  { return os.ErrNoDeadline }
func (c *pipeConn) SetWriteDeadline(t time.Time) error { return os.ErrNoDeadline }

// TestSerialListenerSessions plays a port with two pipes and a host that comes and goes: the
// listener waits for the host, serves it, notices it left (the port reports POLLHUP: here the
// host's end of the pipe closes), and serves the next host (a new pipe on the port's
// descriptor) on the same files with a fresh ttrpc connection.
func TestSerialListenerSessions(t *testing.T) {
	toGuestR, toGuestW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	toHostR, toHostW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toGuestW.Close(); toHostR.Close() })
	var connected atomic.Bool
	l := newSerialListener(pipePort(t, toGuestR, toHostW), func() (bool, error) { return connected.Load(), nil }, discardLog())
	portFd := fdOfFile(t, toGuestR)

	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			t.Error(err)
		}
		accepted <- c
	}()
	select {
	case <-accepted:
		t.Fatal("Accept returned while the host is away")
	case <-time.After(100 * time.Millisecond):
	}
	connected.Store(true)
	var first net.Conn
	select {
	case first = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not return once the host came")
	}
	// A second Accept waits for the first connection to end.
	go func() {
		c, err := l.Accept()
		if err != nil {
			t.Error(err)
		}
		accepted <- c
	}()
	select {
	case <-accepted:
		t.Fatal("a second connection while the first is open")
	case <-time.After(100 * time.Millisecond):
	}
	// A read blocked on the port ends when the host goes away; the port stays open.
	readDone := make(chan error, 1)
	go func() {
		_, err := first.Read(make([]byte, 1))
		readDone <- err
	}()
	connected.Store(false)
	toGuestW.Close()
	select {
	case err := <-readDone:
		if err == nil {
			t.Error("read succeeded after the host left")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a read still blocks after the host left")
	}
	if _, err := first.Write([]byte("x")); err == nil {
		t.Error("write on a closed connection succeeded")
	}
	select {
	case <-accepted:
		t.Fatal("Accept returned while the host is away")
	case <-time.After(100 * time.Millisecond):
	}

	// The next host gets a connection on the same files, and ttrpc works on it.
	nextR, nextW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Dup3(fdOfFile(t, nextR), portFd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	nextR.Close()
	toGuestW = nextW
	fx := newFixture(t)
	srv, err := ttrpc.NewServer(ttrpc.WithUnaryServerInterceptor(Interceptor(fx.svc.log)))
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	connected.Store(true)
	var second net.Conn
	select {
	case second = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("no connection for the second host")
	}
	// The session begins with the host's hello, handed out whole.
	if _, err := toGuestW.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	hello := make([]byte, apiv1.HelloLen)
	if _, err := io.ReadFull(second, hello); err != nil || !bytes.Equal(hello, apiv1.Hello(testSecret)) {
		t.Fatalf("the second session begins with %x, %v; want the hello", hello, err)
	}
	one := &oneConn{c: second, done: make(chan struct{})}
	go srv.Serve(context.Background(), one)
	defer srv.Close()
	client := ttrpc.NewClient(&pipeConn{r: toHostR, w: toGuestW})
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := apiv1.NewAgentClient(client).Ping(ctx, &apiv1.PingRequest{})
	if err != nil || r.Version != "test" {
		t.Fatalf("ping over the second session: %v, %v", r, err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Accept(); err != net.ErrClosed {
		t.Errorf("Accept after Close: %v", err)
	}
}

// oneConn is a listener that hands out one connection, then waits.
type oneConn struct {
	c    net.Conn
	done chan struct{}
	used bool
	once sync.Once
}

func (o *oneConn) Accept() (net.Conn, error) {
	if !o.used {
		o.used = true
		return o.c, nil
	}
	<-o.done
	return nil, net.ErrClosed
}
func (o *oneConn) Close() error   { o.once.Do(func() { close(o.done) }); return nil }
func (o *oneConn) Addr() net.Addr { return serialAddr("test") }

// TestInterceptorRecovers: a panicking request answers Internal and the server goes on.
func TestInterceptorRecovers(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	log.SetLevel(logrus.DebugLevel)
	ic := Interceptor(logrus.NewEntry(log))
	info := &ttrpc.UnaryServerInfo{FullMethod: "/kvfs.agent.v1.Agent/Ping"}
	_, err := ic(context.Background(), nil, info, func(context.Context, func(any) error) (any, error) {
		var m map[string]int
		m["x"] = 1
		return nil, nil
	})
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "assignment to entry in nil map") {
		t.Errorf("a panic answered %v", err)
	}
	resp, err := ic(context.Background(), nil, info, func(context.Context, func(any) error) (any, error) {
		return "ok", nil
	})
	if resp != "ok" || err != nil {
		t.Errorf("a normal request answered %v, %v", resp, err)
	}
}

// TestSerialListenerNewHostAtOnce: a second host that starts talking before the first one's
// departure could be seen (the port never reports it) gets a connection of its own: its
// hello's stream id (0) tells.
func TestSerialListenerNewHostAtOnce(t *testing.T) {
	toGuestR, toGuestW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	toHostR, toHostW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toGuestW.Close(); toHostR.Close() })
	l := newSecretListener(newSerialListener(pipePort(t, toGuestR, toHostW), func() (bool, error) { return true, nil }, discardLog()),
		testSecret, discardLog())
	fx := newFixture(t)
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	go srv.Serve(context.Background(), l)
	defer srv.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := 0; i < 3; i++ {
		if err := toHostR.SetReadDeadline(time.Time{}); err != nil {
			t.Fatal(err)
		}
		if _, err := toGuestW.Write(apiv1.Hello(testSecret)); err != nil {
			t.Fatal(err)
		}
		client := ttrpc.NewClient(&pipeConn{r: toHostR, w: toGuestW})
		ag := apiv1.NewAgentClient(client)
		for j := 0; j < 2; j++ {
			if _, err := ag.Ping(ctx, &apiv1.PingRequest{}); err != nil {
				t.Fatalf("host %d, ping %d: %v", i, j, err)
			}
		}
		client.Close()
	}
}

// fdOfFile is f's descriptor, without Fd(), which would make the file blocking.
func fdOfFile(t *testing.T, f *os.File) (fd int) {
	t.Helper()
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		t.Fatal(err)
	}
	return fd
}

// pipePort is a port made of two pipes' ends: r, what the host sends, and w, what it reads;
// closing it closes both.
func pipePort(t *testing.T, r, w *os.File) serialPort {
	return serialPort{name: "test-port", r: fdOfFile(t, r), w: fdOfFile(t, w), close: func() { r.Close(); w.Close() }}
}

func discardLog() *logrus.Entry {
	log := logrus.New()
	log.SetOutput(io.Discard)
	return logrus.NewEntry(log)
}

// TestSerialConnReadWithoutWakeup: a read of the port sees the host's bytes even when the
// kernel never reports the port ready to Go's (edge-triggered) poller. On virtio-serial that
// happens: a poll of the port moves a buffer the host has just filled out of the virtqueue
// before its interrupt is handled, and the handler then wakes nobody; a reader parked in the
// poller slept with the shim's request in the port, and the shim waited for ever. Here the
// port's descriptor is swapped under the listener for a pipe Go's poller does not watch (its
// epoll registration went with the old file): only a reader that polls the port itself sees
// what arrives.
func TestSerialConnReadWithoutWakeup(t *testing.T) {
	port, unused, err := os.Pipe() // registered with Go's poller
	if err != nil {
		t.Fatal(err)
	}
	wireR, wire, err := os.Pipe() // the bytes the host sends
	if err != nil {
		t.Fatal(err)
	}
	toHostR, toHostW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unused.Close(); wire.Close(); wireR.Close(); toHostR.Close(); toHostW.Close() })
	if err := unix.Dup3(fdOfFile(t, wireR), fdOfFile(t, port), unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	l := newSerialListener(pipePort(t, port, toHostW), func() (bool, error) { return true, nil }, discardLog())
	defer l.Close()
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		b := make([]byte, 64)
		n, err := c.Read(b)
		if err != nil {
			t.Errorf("read: %v", err)
		}
		got <- string(b[:n])
	}()
	time.Sleep(100 * time.Millisecond) // the reader waits on the port
	// The host's hello, then a request (ttrpc header: length 2, stream 1, type request, no
	// flags) and its body.
	msg := append(apiv1.Hello(testSecret), 0, 0, 0, 2, 0, 0, 0, 1, ttrpcTypeRequest, 0, 'h', 'i')
	if _, err := wire.Write(msg); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if s != string(msg[:len(s)]) || s == "" {
			t.Errorf("read %q, want a prefix of %q", s, msg)
		}
	case <-time.After(3 * time.Second):
		c.Close() // its deadline ends the read
		<-got
		t.Fatal("the read did not see the host's request in 3 s: it waits for a wake-up that never comes")
	}
	if _, err := c.Write([]byte("answer")); err != nil {
		t.Fatalf("write: %v", err)
	}
	c.Close()
}

// TestShutdownAnswerArrives runs the agent's service behind its ttrpc server as run does:
// Shutdown's answer reaches a host that hangs up once it has it, every time, although the
// handler ends the service before the answer is sent; and the server stops once the host has
// hung up, without waiting for hostHangup.
func TestShutdownAnswerArrives(t *testing.T) {
	log := logrus.New()
	log.SetOutput(io.Discard)
	for i := range 40 {
		fx := newFixture(t)
		l, err := net.Listen("unix", filepath.Join(t.TempDir(), "agent.sock"))
		if err != nil {
			t.Fatal(err)
		}
		srv, err := ttrpc.NewServer()
		if err != nil {
			t.Fatal(err)
		}
		apiv1.RegisterAgentService(srv, fx.svc)
		tl := trackConns(l)
		go srv.Serve(fx.ctx, tl)
		stopped := make(chan time.Duration, 1)
		go func() {
			<-fx.svc.Done()
			start := time.Now()
			stopServing(fx.ctx, srv, tl, logrus.NewEntry(log))
			stopped <- time.Since(start)
		}()

		conn, err := net.Dial("unix", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		client := ttrpc.NewClient(conn)
		_, err = apiv1.NewAgentClient(client).Shutdown(fx.ctx, &apiv1.ShutdownRequest{})
		client.Close()
		if err != nil {
			t.Fatalf("round %d: Shutdown's answer did not arrive: %v", i, err)
		}
		if took := <-stopped; took >= hostHangup {
			t.Fatalf("round %d: the server stopped %v after Shutdown: it waited out hostHangup", i, took)
		}
	}
}

func TestConnTrackerWaitsForOpenConns(t *testing.T) {
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	tl := trackConns(l)
	defer tl.Close()
	var accepted []net.Conn
	for range 2 {
		c, err := net.Dial("unix", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		a, err := tl.Accept()
		if err != nil {
			t.Fatal(err)
		}
		accepted = append(accepted, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if tl.waitClosed(ctx) {
		t.Fatal("waitClosed with two connections open")
	}
	accepted[0].Close()
	accepted[0].Close() // counted once
	done := make(chan bool, 1)
	go func() { done <- tl.waitClosed(context.Background()) }()
	select {
	case <-done:
		t.Fatal("waitClosed with one connection open")
	case <-time.After(50 * time.Millisecond):
	}
	accepted[1].Close()
	if !<-done {
		t.Fatal("waitClosed: false once both closed")
	}
}
