package agent

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// The port tests stand a real TCP server on the test's loopback for the guest's: the agent
// dials its own network namespace's localhost, which in the guest is the pod's.

// listenLoopback listens on addr ("127.0.0.1" or "::1", port 0) and answers each connection
// with serve, in a goroutine of its own; the port is returned.
func listenLoopback(t *testing.T, network, addr string, serve func(net.Conn)) uint32 {
	t.Helper()
	ln, err := net.Listen(network, net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Skipf("no %s loopback here: %v", network, err)
	}
	nettest.Serve(t, ln, serve)
	return uint32(ln.Addr().(*net.TCPAddr).Port)
}

// replyAtEOF reads the request to end of file, then answers "got: " and the request and
// closes: a protocol that needs the client's half-close.
func replyAtEOF(c net.Conn) {
	req, err := io.ReadAll(c)
	if err != nil {
		return
	}
	c.Write(append([]byte("got: "), req...))
}

// freePort is a loopback port nothing listens on (listened on and closed).
func freePort(t *testing.T) uint32 {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return uint32(ln.Addr().(*net.TCPAddr).Port)
}

func (fx *fixture) openPort(t *testing.T, port uint32) uint64 {
	t.Helper()
	resp, err := fx.svc.OpenPort(fx.ctx, &apiv1.OpenPortRequest{Port: port})
	if err != nil {
		t.Fatalf("OpenPort %d: %v", port, err)
	}
	return resp.Id
}

// readPortAll reads the connection to eof.
func (fx *fixture) readPortAll(t *testing.T, id uint64) string {
	t.Helper()
	var b bytes.Buffer
	for {
		r, err := fx.svc.ReadPort(fx.ctx, &apiv1.ReadPortRequest{Id: id, Max: 4})
		if err != nil {
			t.Fatalf("ReadPort %d: %v", id, err)
		}
		if len(r.Data) > 4 {
			t.Fatalf("ReadPort answered %d bytes, more than max 4", len(r.Data))
		}
		b.Write(r.Data)
		if r.Eof {
			return b.String()
		}
	}
}

// TestPortHalfClose carries a request whose end the server waits for: the host's write side
// shut, the server answers and closes, and the host reads the answer to eof.
func TestPortHalfClose(t *testing.T) {
	fx := newFixture(t)
	port := listenLoopback(t, "tcp4", "127.0.0.1", replyAtEOF)
	id := fx.openPort(t, port)
	if _, err := fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: id, Data: []byte("hello")}); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.svc.ClosePort(fx.ctx, &apiv1.ClosePortRequest{Id: id, WriteOnly: true}); err != nil {
		t.Fatal(err)
	}
	if got := fx.readPortAll(t, id); got != "got: hello" {
		t.Errorf("the server answered %q, want %q", got, "got: hello")
	}
	_, err := fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: id, Data: []byte("more")})
	wantCode(t, "WritePort after the write side was shut", err, codes.FailedPrecondition, "shut")
	if _, err := fx.svc.ClosePort(fx.ctx, &apiv1.ClosePortRequest{Id: id}); err != nil {
		t.Fatal(err)
	}
	_, err = fx.svc.ReadPort(fx.ctx, &apiv1.ReadPortRequest{Id: id, Max: 4})
	wantCode(t, "ReadPort of a closed connection", err, codes.NotFound, "not open")
}

// TestPortIPv6 reaches a server that listens on [::1] only, as containerd's second dial does.
func TestPortIPv6(t *testing.T) {
	fx := newFixture(t)
	port := listenLoopback(t, "tcp6", "::1", func(c net.Conn) { c.Write([]byte("six")) })
	id := fx.openPort(t, port)
	if got := fx.readPortAll(t, id); got != "six" {
		t.Errorf("read %q, want %q", got, "six")
	}
}

func TestPortRefused(t *testing.T) {
	fx := newFixture(t)
	port := freePort(t)
	_, err := fx.svc.OpenPort(fx.ctx, &apiv1.OpenPortRequest{Port: port})
	wantCode(t, "OpenPort of a port nothing listens on", err, codes.Unavailable, "127.0.0.1")
	if err != nil && !strings.Contains(err.Error(), "[::1]") {
		t.Errorf("%v does not say why the IPv6 dial failed", err)
	}
}

// TestPortBadRequests checks what the agent refuses before doing anything: ports, sizes,
// unknown ids.
func TestPortBadRequests(t *testing.T) {
	fx := newFixture(t)
	for _, p := range []uint32{0, 65536} {
		_, err := fx.svc.OpenPort(fx.ctx, &apiv1.OpenPortRequest{Port: p})
		wantCode(t, "OpenPort", err, codes.InvalidArgument, "not 1 to 65535")
	}
	for _, m := range []uint32{0, MaxRead + 1} {
		_, err := fx.svc.ReadPort(fx.ctx, &apiv1.ReadPortRequest{Id: 1, Max: m})
		wantCode(t, "ReadPort", err, codes.InvalidArgument, "max")
	}
	_, err := fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: 1, Data: make([]byte, apiv1.MaxPortWrite+1)})
	wantCode(t, "WritePort of too much", err, codes.InvalidArgument, "more than")
	_, err = fx.svc.ReadPort(fx.ctx, &apiv1.ReadPortRequest{Id: 42, Max: 1})
	wantCode(t, "ReadPort of an unknown id", err, codes.NotFound, "42")
	_, err = fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: 42, Data: []byte("x")})
	wantCode(t, "WritePort of an unknown id", err, codes.NotFound, "42")
	for _, wo := range []bool{false, true} {
		_, err = fx.svc.ClosePort(fx.ctx, &apiv1.ClosePortRequest{Id: 42, WriteOnly: wo})
		wantCode(t, "ClosePort of an unknown id", err, codes.NotFound, "42")
	}
}

// TestPortLimit opens MaxPortStreams connections: one more is refused until one closes.
func TestPortLimit(t *testing.T) {
	fx := newFixture(t)
	port := listenLoopback(t, "tcp4", "127.0.0.1", func(c net.Conn) { io.Copy(io.Discard, c) })
	var ids []uint64
	for range apiv1.MaxPortStreams {
		ids = append(ids, fx.openPort(t, port))
	}
	_, err := fx.svc.OpenPort(fx.ctx, &apiv1.OpenPortRequest{Port: port})
	wantCode(t, "OpenPort past the limit", err, codes.ResourceExhausted, "64")
	if _, err := fx.svc.ClosePort(fx.ctx, &apiv1.ClosePortRequest{Id: ids[0]}); err != nil {
		t.Fatal(err)
	}
	fx.openPort(t, port)
}

// TestPortSlowReader writes to a server that never reads: once the buffers are full, a write
// answers within PortWriteWait with what was taken, less than it carried.
func TestPortSlowReader(t *testing.T) {
	fx := newFixture(t)
	hold := make(chan struct{})
	defer close(hold)
	port := listenLoopback(t, "tcp4", "127.0.0.1", func(net.Conn) { <-hold })
	id := fx.openPort(t, port)
	data := make([]byte, apiv1.MaxPortWrite)
	for i := range 64 {
		start := time.Now()
		r, err := fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: id, Data: data})
		if err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if took := time.Since(start); took > apiv1.PortWriteWait+time.Second {
			t.Fatalf("write %d took %v, more than PortWriteWait %v", i, took, apiv1.PortWriteWait)
		}
		if int(r.Written) < len(data) {
			return
		}
	}
	t.Fatal("64 MiB written to a server that reads nothing")
}

// TestPortReadCancel ends a read that waits when its context ends, and the connection stays
// usable.
func TestPortReadCancel(t *testing.T) {
	fx := newFixture(t)
	port := listenLoopback(t, "tcp4", "127.0.0.1", func(c net.Conn) { io.Copy(c, c) })
	id := fx.openPort(t, port)
	ctx, cancel := context.WithTimeout(fx.ctx, 100*time.Millisecond)
	defer cancel()
	if _, err := fx.svc.ReadPort(ctx, &apiv1.ReadPortRequest{Id: id, Max: 8}); err == nil {
		t.Fatal("a read with nothing to read answered")
	}
	if _, err := fx.svc.WritePort(fx.ctx, &apiv1.WritePortRequest{Id: id, Data: []byte("echo")}); err != nil {
		t.Fatal(err)
	}
	r, err := fx.svc.ReadPort(fx.ctx, &apiv1.ReadPortRequest{Id: id, Max: 8})
	if err != nil || string(r.Data) != "echo" {
		t.Fatalf("read after a cancelled one: %q, %v; want echo", r.GetData(), err)
	}
}

// TestPortShutdown closes every connection at Shutdown (the server reads end of file) and
// refuses new ones.
func TestPortShutdown(t *testing.T) {
	fx := newFixture(t)
	eof := make(chan struct{})
	port := listenLoopback(t, "tcp4", "127.0.0.1", func(c net.Conn) {
		io.Copy(io.Discard, c)
		close(eof)
	})
	fx.openPort(t, port)
	fx.shutdown(t)
	select {
	case <-eof:
	case <-time.After(5 * time.Second):
		t.Fatal("the connection is still open after Shutdown")
	}
	_, err := fx.svc.OpenPort(fx.ctx, &apiv1.OpenPortRequest{Port: port})
	wantCode(t, "OpenPort after Shutdown", err, codes.Unavailable, "shutting down")
}
