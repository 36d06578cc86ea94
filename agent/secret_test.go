package agent

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"github.com/mdlayher/vsock"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// testSecret is the secret the tests' listeners serve.
var testSecret = []byte("0123456789abcdef0123456789abcdef")

// smbiosStruct is an SMBIOS structure: its type, a formatted part of n bytes (header
// included) and its strings.
func smbiosStruct(typ byte, n int, strs ...string) []byte {
	b := make([]byte, n)
	b[0], b[1] = typ, byte(n)
	if len(strs) == 0 {
		return append(b, 0, 0)
	}
	for _, s := range strs {
		b = append(b, s...)
		b = append(b, 0)
	}
	return append(b, 0)
}

// TestSecretOfSMBIOS: the secret is the one OEM string with the prefix, in hex, wherever
// it is among the structures; anything else is refused with a reason.
func TestSecretOfSMBIOS(t *testing.T) {
	oem := apiv1.SecretOEMString(testSecret)
	bios := smbiosStruct(0, 24, "SeaBIOS", "1.16.2", "04/01/2014")
	sys := smbiosStruct(1, 27, "QEMU", "Standard PC")
	end := smbiosStruct(127, 4)
	for _, tc := range []struct {
		name  string
		table []byte
		want  string // "" the secret, else a part of the error
	}{
		{"alone", slicesConcat(bios, smbiosStruct(11, 5, oem), end), ""},
		{"among other OEM strings", slicesConcat(bios, sys, smbiosStruct(11, 5, "io.systemd.credential:x=y", oem, "other"), end), ""},
		{"no end structure", slicesConcat(bios, smbiosStruct(11, 5, oem)), ""},
		{"a structure without strings before it", slicesConcat(smbiosStruct(32, 11), smbiosStruct(11, 5, oem), end), ""},
		{"none", slicesConcat(bios, sys, smbiosStruct(11, 5, "other"), end), "no OEM string io.kvfs.agent.secret="},
		{"after the end structure", slicesConcat(bios, end, smbiosStruct(11, 5, oem)), "no OEM string"},
		{"in another type", slicesConcat(smbiosStruct(1, 27, oem), end), "no OEM string"},
		{"empty table", nil, "no OEM string"},
		{"two", slicesConcat(smbiosStruct(11, 5, oem), smbiosStruct(11, 5, oem), end), "2 OEM strings"},
		{"not hex", slicesConcat(smbiosStruct(11, 5, apiv1.SecretOEMPrefix+strings.Repeat("zz", apiv1.SecretLen)), end), "is not 32 bytes in hex"},
		{"short", slicesConcat(smbiosStruct(11, 5, apiv1.SecretOEMString(testSecret[:16])), end), "is not 32 bytes in hex"},
		{"long", slicesConcat(smbiosStruct(11, 5, apiv1.SecretOEMString(append(testSecret, 'x'))), end), "is not 32 bytes in hex"},
		{"truncated header", slicesConcat(bios, []byte{11, 5}), "truncated header"},
		{"formatted length below the header's", slicesConcat([]byte{11, 3, 0, 0, 0, 0}, end), "formatted length 3"},
		{"formatted length beyond the table", []byte{11, 40, 0, 0, 0, 0}, "formatted length 40"},
		{"strings without their end", slicesConcat(bios, []byte{11, 5, 0, 0, 1}, []byte(oem)), "strings without their end"},
	} {
		got, err := secretOfSMBIOS(tc.table)
		switch {
		case tc.want == "" && (err != nil || !bytes.Equal(got, testSecret)):
			t.Errorf("%s: %x, %v; want the secret", tc.name, got, err)
		case tc.want != "" && err == nil:
			t.Errorf("%s: %x, want an error with %q", tc.name, got, tc.want)
		case tc.want != "" && !strings.Contains(err.Error(), tc.want):
			t.Errorf("%s: %v, want %q in it", tc.name, err, tc.want)
		}
	}
}

func slicesConcat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// TestReadSecret reads the table from a file, as the agent reads the kernel's; no table, or
// none with the secret, is an error that says so.
func TestReadSecret(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "DMI")
	if err := os.WriteFile(path, slicesConcat(smbiosStruct(11, 5, apiv1.SecretOEMString(testSecret)), smbiosStruct(127, 4)), 0o400); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadSecret(path); err != nil || !bytes.Equal(got, testSecret) {
		t.Errorf("ReadSecret: %x, %v", got, err)
	}
	if _, err := ReadSecret(filepath.Join(dir, "none")); err == nil || !strings.Contains(err.Error(), "the host's secret") {
		t.Errorf("ReadSecret of no file: %v", err)
	}
	if err := os.WriteFile(path, smbiosStruct(127, 4), 0o400); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadSecret(path); err == nil || !strings.Contains(err.Error(), "no OEM string") {
		t.Errorf("ReadSecret of a table without it: %v", err)
	}
}

// secretServer serves the agent API over a secretListener on a fake listener and counts the
// requests that reach the server.
type secretServer struct {
	fake   *fakeVsockListener
	l      *secretListener
	served atomic.Int32
	logs   *syncbuf.Buffer
}

func newSecretServer(t *testing.T, wait time.Duration) *secretServer {
	t.Helper()
	s := &secretServer{fake: newFakeVsockListener(), logs: &syncbuf.Buffer{}}
	logger := logrus.New()
	logger.SetOutput(s.logs)
	s.l = newSecretListener(s.fake, testSecret, logrus.NewEntry(logger))
	s.l.wait = wait
	s.l.logEvery = 0
	fx := newFixture(t)
	srv, err := ttrpc.NewServer(ttrpc.WithUnaryServerInterceptor(
		func(ctx context.Context, um ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
			s.served.Add(1)
			return m(ctx, um)
		}))
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	go srv.Serve(context.Background(), s.l)
	t.Cleanup(func() { srv.Close() })
	return s
}

// connect hands the listener a new connection and answers the host's end and the guest's.
func (s *secretServer) connect(t *testing.T) (net.Conn, *peerConn) {
	t.Helper()
	return connect(t, s.fake, &vsock.Addr{ContextID: 2, Port: 1023})
}

// ping asks Ping over a ttrpc client on conn, within 5 s.
func ping(conn net.Conn) error {
	client := ttrpc.NewClient(conn)
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := apiv1.NewAgentClient(client).Ping(ctx, &apiv1.PingRequest{})
	return err
}

// waitClosed reports whether the guest's end of a connection is closed within 5 s, as the
// host sees it: a read answers end of file.
func waitClosed(host net.Conn) bool {
	host.SetReadDeadline(time.Now().Add(5 * time.Second))
	for {
		_, err := host.Read(make([]byte, 64))
		if err == io.EOF || err == io.ErrClosedPipe {
			return true
		}
		if err != nil {
			return false
		}
	}
}

// TestSecretListenerRefuses: a connection whose hello is wrong, short, late or missing is
// closed before ttrpc has a byte of it (no request reaches the server), and each refusal is
// logged with its reason and counted; a host with the secret is served after them.
func TestSecretListenerRefuses(t *testing.T) {
	s := newSecretServer(t, 300*time.Millisecond)
	wrong := bytes.Clone(testSecret)
	wrong[31] ^= 0x80
	for i, tc := range []struct {
		name string
		send func(host net.Conn)
		why  string
	}{
		{"a wrong secret", func(h net.Conn) { h.Write(apiv1.Hello(wrong)); ping(h) }, "a hello with the wrong secret"},
		{"a secret of another length", func(h net.Conn) { h.Write(apiv1.Hello(testSecret[:16])); ping(h) }, "its first bytes are not a hello"},
		{"no hello: ttrpc at once", func(h net.Conn) { ping(h) }, "its first bytes are not a hello"},
		{"a short hello, then the end", func(h net.Conn) { h.Write(apiv1.Hello(testSecret)[:20]); h.Close() }, "it ended before its hello"},
		{"a short hello, then nothing", func(h net.Conn) { h.Write(apiv1.Hello(testSecret)[:apiv1.HelloLen-1]) }, "no hello within 300ms"},
		{"nothing", func(h net.Conn) {}, "no hello within 300ms"},
		{"the hello after the wait", func(h net.Conn) {
			time.Sleep(time.Second)
			h.Write(apiv1.Hello(testSecret))
			ping(h)
		}, "no hello within 300ms"},
	} {
		host, guest := s.connect(t)
		go tc.send(host)
		if !waitClosed(host) {
			t.Errorf("%s: the connection is still open", tc.name)
		}
		for deadline := time.Now().Add(5 * time.Second); !guest.closed.Load() && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		if !guest.closed.Load() {
			t.Errorf("%s: the guest's end is not closed", tc.name)
		}
		// Each refusal is logged (logEvery is 0 here) with its reason and the count so far.
		count := fmt.Sprintf("refused=%d", i+1)
		for deadline := time.Now().Add(5 * time.Second); !strings.Contains(s.logs.String(), count) && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		lines := strings.Split(strings.TrimSpace(s.logs.String()), "\n")
		if last := lines[len(lines)-1]; !strings.Contains(last, tc.why) || !strings.Contains(last, count) {
			t.Errorf("%s: the last log line is not the refusal %q with %s:\n%s", tc.name, tc.why, count, s.logs.String())
		}
		if n := s.served.Load(); n != 0 {
			t.Fatalf("%s: %d requests reached the server", tc.name, n)
		}
	}

	host, _ := s.connect(t)
	if _, err := host.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	if err := ping(host); err != nil {
		t.Fatalf("Ping with the secret: %v", err)
	}
	if n := s.served.Load(); n != 1 {
		t.Errorf("%d requests reached the server, want 1", n)
	}
}

// TestSecretListenerOneHost: one host connection is served at a time; a second one that
// proves the secret replaces the first, which is closed (the host reconnected), and a silent
// peer holds up neither.
func TestSecretListenerOneHost(t *testing.T) {
	s := newSecretServer(t, time.Hour)
	// A peer that says nothing waits for its hello on its own.
	silent, silentGuest := s.connect(t)
	defer silent.Close()

	first, firstGuest := s.connect(t)
	if _, err := first.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	c1 := ttrpc.NewClient(first)
	defer c1.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := apiv1.NewAgentClient(c1).Ping(ctx, &apiv1.PingRequest{}); err != nil {
		t.Fatalf("the first host's Ping: %v", err)
	}

	second, _ := s.connect(t)
	if _, err := second.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	c2 := ttrpc.NewClient(second)
	defer c2.Close()
	if _, err := apiv1.NewAgentClient(c2).Ping(ctx, &apiv1.PingRequest{}); err != nil {
		t.Fatalf("the second host's Ping: %v", err)
	}
	if !firstGuest.closed.Load() {
		t.Error("the first host's connection is still open once the second is served")
	}
	if _, err := apiv1.NewAgentClient(c1).Ping(ctx, &apiv1.PingRequest{}); err == nil {
		t.Error("the first host's connection still answers")
	}
	if silentGuest.closed.Load() {
		t.Error("the silent peer's connection was closed before its wait ended")
	}
	if !strings.Contains(s.logs.String(), "a new host connection replaces the one served") {
		t.Errorf("the log does not tell the replacement:\n%s", s.logs.String())
	}
}

// TestSecretListenerBoundsWaits: at most maxHelloChecks connections wait for their hello;
// one beyond is closed at once.
func TestSecretListenerBoundsWaits(t *testing.T) {
	s := newSecretServer(t, time.Hour)
	for range maxHelloChecks {
		s.connect(t)
	}
	host, guest := s.connect(t)
	if !waitClosed(host) || !guest.closed.Load() {
		t.Errorf("connection %d was not closed at once", maxHelloChecks+1)
	}
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(s.logs.String(), "refused=1") && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(s.logs.String(), "8 connections already wait for their hello") {
		t.Errorf("the log does not say why:\n%s", s.logs.String())
	}
}

// TestSerialRefusedHostLeavesNoTrace: over a serial port, a host with a wrong secret that
// sent requests after its hello, and a host with the secret that follows at once (the port
// does not report the change), is served: what the first left before the second's hello is
// dropped.
func TestSerialRefusedHostLeavesNoTrace(t *testing.T) {
	toGuestR, toGuestW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	toHostR, toHostW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toGuestW.Close(); toHostR.Close() })
	var out syncbuf.Buffer
	logger := logrus.New()
	logger.SetOutput(&out)
	sl := newSerialListener(pipePort(t, toGuestR, toHostW), func() (bool, error) { return true, nil }, logrus.NewEntry(logger))
	l := newSecretListener(sl, testSecret, logrus.NewEntry(logger))
	var served atomic.Int32
	fx := newFixture(t)
	srv, err := ttrpc.NewServer(ttrpc.WithUnaryServerInterceptor(
		func(ctx context.Context, um ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
			served.Add(1)
			return m(ctx, um)
		}))
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	go srv.Serve(context.Background(), l)
	defer srv.Close()

	wrong := bytes.Clone(testSecret)
	wrong[0] ^= 1
	if _, err := toGuestW.Write(apiv1.Hello(wrong)); err != nil {
		t.Fatal(err)
	}
	intruder := ttrpc.NewClient(&pipeConn{r: toHostR, w: toGuestW})
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	_, err = apiv1.NewAgentClient(intruder).Shutdown(ctx, &apiv1.ShutdownRequest{})
	cancel()
	intruder.Close()
	if err == nil {
		t.Fatal("a host with a wrong secret was served")
	}
	if err := toHostR.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if _, err := toGuestW.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	host := ttrpc.NewClient(&pipeConn{r: toHostR, w: toGuestW})
	defer host.Close()
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := apiv1.NewAgentClient(host).Ping(ctx, &apiv1.PingRequest{})
		cancel()
		if err != nil {
			t.Fatalf("the host with the secret, ping %d: %v\n%s", i, err, out.String())
		}
	}
	if n := served.Load(); n != 2 {
		t.Errorf("%d requests reached the server, want the host's two Pings", n)
	}
	for _, want := range []string{"a hello with the wrong secret", "dropped what came before the host's hello"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, out.String())
		}
	}
}

// TestSerialHelloBeforeDepartureKept: a host that connects and sends its hello and a request
// before the guest has seen the previous host leave is served: its bytes, read before the
// departure, are kept for the next connection (only what the departed host left goes).
func TestSerialHelloBeforeDepartureKept(t *testing.T) {
	toGuestR, toGuestW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	toHostR, toHostW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { toHostR.Close() })
	var connected atomic.Bool
	connected.Store(true)
	sl := newSerialListener(pipePort(t, toGuestR, toHostW), func() (bool, error) { return connected.Load(), nil }, discardLog())
	l := newSecretListener(sl, testSecret, discardLog())
	fx := newFixture(t)
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	go srv.Serve(context.Background(), l)
	defer srv.Close()

	// The first host, served.
	if _, err := toGuestW.Write(apiv1.Hello(testSecret)); err != nil {
		t.Fatal(err)
	}
	first := ttrpc.NewClient(&pipeConn{r: toHostR, w: toGuestW})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := apiv1.NewAgentClient(first).Ping(ctx, &apiv1.PingRequest{}); err != nil {
		t.Fatalf("the first host: %v", err)
	}
	first.Close()
	if err := toHostR.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}

	// The second host's hello and Ping reach the guest, then the first one's departure (the
	// pipe's end of file); then the port has the second host.
	stageR, stageW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stageR.Close()
	defer stageW.Close()
	second := ttrpc.NewClient(&pipeConn{r: toHostR, w: stageW})
	answered := make(chan error, 1)
	go func() {
		_, err := apiv1.NewAgentClient(second).Ping(ctx, &apiv1.PingRequest{})
		answered <- err
	}()
	next := make([]byte, ttrpcHeaderLen)
	if _, err := io.ReadFull(stageR, next); err != nil {
		t.Fatal(err)
	}
	next = append(next, make([]byte, binary.BigEndian.Uint32(next[:4]))...)
	if _, err := io.ReadFull(stageR, next[ttrpcHeaderLen:]); err != nil {
		t.Fatal(err)
	}
	next = append(apiv1.Hello(testSecret), next...)
	connected.Store(false)
	if _, err := toGuestW.Write(next); err != nil {
		t.Fatal(err)
	}
	toGuestW.Close()
	time.Sleep(200 * time.Millisecond) // the pump reads the bytes and the end of file
	nextR, nextW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer nextW.Close()
	if err := unix.Dup3(fdOfFile(t, nextR), fdOfFile(t, toGuestR), unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	nextR.Close()
	connected.Store(true)
	if err := <-answered; err != nil {
		t.Errorf("the second host's Ping: %v", err)
	}
	second.Close()
}
