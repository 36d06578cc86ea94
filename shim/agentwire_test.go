package shim

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// frame is a ttrpc frame.
func frame(stream uint32, typ, flags uint8, payload []byte) []byte {
	return append(frameHeader{length: uint32(len(payload)), stream: stream, typ: typ, flags: flags}.append(nil), payload...)
}

// answer is a response frame on stream whose Response carries msg.
func answer(t *testing.T, stream uint32, msg proto.Message) []byte {
	t.Helper()
	p, err := proto.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	r, err := proto.Marshal(&ttrpc.Response{Payload: p})
	if err != nil {
		t.Fatal(err)
	}
	return frame(stream, frameResponse, 0, r)
}

// connPair is two connected Unix stream sockets: the shim's end and the guest's.
func connPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		conns[i] = c
	}
	return conns[0], conns[1]
}

// trickle is a connection whose reads return one byte at a time: every frame is split across
// reads.
type trickle struct{ net.Conn }

func (c trickle) Read(p []byte) (int, error) { return c.Conn.Read(p[:min(1, len(p))]) }

// reported collects a filter's violations.
type reported struct {
	mu  sync.Mutex
	got []wireViolation
}

func (r *reported) add(v wireViolation) {
	r.mu.Lock()
	r.got = append(r.got, v)
	r.mu.Unlock()
}

func (r *reported) kinds() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var k []string
	for _, v := range r.got {
		k = append(k, v.kind)
	}
	return k
}

// captureLog sends the shim's log, and ttrpc's (both log.L's), to a buffer until the test
// ends.
func captureLog(t *testing.T) *syncbuf.Buffer {
	logs := &syncbuf.Buffer{}
	l := log.L.Logger
	out := l.Out
	l.SetOutput(logs)
	t.Cleanup(func() { l.SetOutput(out) })
	return logs
}

func lines(logs *syncbuf.Buffer) int { return strings.Count(logs.String(), "\n") }

// TestAgentWireSorts: on plain bytes, each byte read on its own, the filter passes ttrpc the
// answers to its requests, in the guest's order, and nothing else: a frame on a stream with no
// request outstanding (one never opened, one the host opens never, one answered already) is
// dropped and reported; a frame longer than maxAnswerFrame ends the read side with the
// violation, reported as fatal, and nothing after it passes.
func TestAgentWireSorts(t *testing.T) {
	shimEnd, guest := connPair(t)
	w := newAgentWire(trickle{shimEnd})
	var r reported
	w.watch(r.add)
	go io.Copy(io.Discard, guest)
	// ttrpc's requests on streams 1 and 3, the first with its header split across writes.
	req1 := frame(1, frameRequest, 0, []byte("request one"))
	for _, p := range [][]byte{req1[:4], req1[4:12], req1[12:], frame(3, frameRequest, 0, []byte("request three"))} {
		if _, err := w.Write(p); err != nil {
			t.Fatal(err)
		}
	}
	one, three := answer(t, 1, &agent.PingResponse{Version: "one"}), answer(t, 3, &agent.PingResponse{Version: "three"})
	var sent []byte
	for _, f := range [][]byte{
		answer(t, 5, &agent.PingResponse{}), // never opened
		three,
		frame(2, 9, 0, []byte("?")), // an even stream: the host's never
		one,
		answer(t, 3, &agent.PingResponse{Version: "again"}), // answered already
		frameHeader{length: maxAnswerFrame + 1, stream: 7, typ: frameResponse}.append(nil),
		answer(t, 7, &agent.PingResponse{}),
	} {
		sent = append(sent, f...)
	}
	if _, err := guest.Write(sent); err != nil {
		t.Fatal(err)
	}
	want := append(slices.Clone(three), one...)
	got := make([]byte, len(want))
	if _, err := io.ReadFull(w, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("passed %x, want %x", got, want)
	}
	n, err := w.Read(make([]byte, 64))
	var v wireViolation
	if n != 0 || !errors.As(err, &v) || v.kind != wireOversized {
		t.Errorf("after the oversized frame: %d bytes, %v; want its violation", n, err)
	}
	waitUntil(t, "the oversized frame is reported", func() bool { return len(r.kinds()) == 4 })
	if k, want := r.kinds(), []string{wireInactive, wireInactive, wireInactive, wireOversized}; !slices.Equal(k, want) {
		t.Errorf("reported %v, want %v", k, want)
	}
	r.mu.Lock()
	if !r.got[3].fatal || r.got[0].fatal {
		t.Errorf("fatal: %v", r.got)
	}
	r.mu.Unlock()
}

// TestAgentWireBrokenAnswer: a frame on an outstanding stream that is not its answer (data, or
// a response that is no ttrpc Response) is dropped and reported, and the call gets the
// filter's answer in its place, an error saying so; an answer of exactly maxAnswerFrame
// passes. Violations before the door watches are held for it.
func TestAgentWireBrokenAnswer(t *testing.T) {
	shimEnd, guest := connPair(t)
	w := newAgentWire(shimEnd)
	go io.Copy(io.Discard, guest)
	for _, s := range []uint32{1, 3, 5} {
		if _, err := w.Write(frame(s, frameRequest, 0, nil)); err != nil {
			t.Fatal(err)
		}
	}
	big, err := proto.Marshal(&ttrpc.Response{Payload: make([]byte, maxAnswerFrame-4)})
	if err != nil {
		t.Fatal(err)
	}
	if len(big) != maxAnswerFrame {
		t.Fatalf("the big answer is %d bytes", len(big))
	}
	var sent []byte
	for _, f := range [][]byte{
		frame(1, 3, 0, []byte("data on a unary stream")),
		frame(3, frameResponse, 0, []byte{0xff, 0xff, 0xff}),
		frame(5, frameResponse, 0, big),
	} {
		sent = append(sent, f...)
	}
	if _, err := guest.Write(sent); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(w)
	for _, want := range []struct {
		stream uint32
		code   codes.Code
	}{{1, codes.Unknown}, {3, codes.Unknown}, {5, codes.OK}} {
		var hdr [frameHeaderLen]byte
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			t.Fatal(err)
		}
		h := parseFrameHeader(hdr[:])
		p := make([]byte, h.length)
		if _, err := io.ReadFull(br, p); err != nil {
			t.Fatal(err)
		}
		var resp ttrpc.Response
		if err := proto.Unmarshal(p, &resp); err != nil {
			t.Fatal(err)
		}
		if h.stream != want.stream || h.typ != frameResponse || codes.Code(resp.GetStatus().GetCode()) != want.code {
			t.Errorf("passed %+v with status %v, want stream %d with %v", h, resp.GetStatus(), want.stream, want.code)
		}
		if want.code != codes.OK && !strings.Contains(resp.GetStatus().GetMessage(), "broke the protocol") {
			t.Errorf("the filter's answer: %q", resp.GetStatus().GetMessage())
		}
	}
	var r reported
	w.watch(r.add)
	if k, want := r.kinds(), []string{wireType, wireMalformed}; !slices.Equal(k, want) {
		t.Errorf("reported %v, want %v", k, want)
	}
}

// TestAgentWireLateAnswer: through ttrpc's client, a call whose deadline passes is answered by
// the filter, and the agent's late answer is dropped: no violation, and nothing in the log
// (ttrpc's client would log "received message on inactive stream"). Two calls answered in the
// reverse order each get their own answer, on the same connection after the late one.
func TestAgentWireLateAnswer(t *testing.T) {
	logs := captureLog(t)
	shimEnd, guest := connPair(t)
	w := newAgentWire(shimEnd)
	var r reported
	w.watch(r.add)
	client := ttrpc.NewClient(w, ttrpc.WithUnaryClientInterceptor(w.intercept))
	t.Cleanup(func() { client.Close() })
	ag := agent.NewAgentClient(client)
	requests := make(chan uint32, 4)
	go func() {
		br := bufio.NewReader(guest)
		var hdr [frameHeaderLen]byte
		for {
			if _, err := io.ReadFull(br, hdr[:]); err != nil {
				return
			}
			h := parseFrameHeader(hdr[:])
			if _, err := br.Discard(int(h.length)); err != nil {
				return
			}
			requests <- h.stream
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err := ag.Ping(ctx, &agent.PingRequest{})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Ping past its deadline: %v", err)
	}
	late := <-requests

	type result struct {
		version string
		err     error
	}
	ping := func() (chan result, uint32) {
		c := make(chan result, 1)
		go func() {
			resp, err := ag.Ping(context.Background(), &agent.PingRequest{})
			c <- result{resp.GetVersion(), err}
		}()
		return c, <-requests
	}
	a, sa := ping()
	b, sb := ping()
	var sent []byte
	for _, f := range [][]byte{
		answer(t, late, &agent.PingResponse{Version: "late"}),
		answer(t, sb, &agent.PingResponse{Version: "b"}),
		answer(t, sa, &agent.PingResponse{Version: "a"}),
	} {
		sent = append(sent, f...)
	}
	if _, err := guest.Write(sent); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		ch   chan result
		want string
	}{{a, "a"}, {b, "b"}} {
		if got := <-c.ch; got.err != nil || got.version != c.want {
			t.Errorf("Ping: %q, %v; want %q", got.version, got.err, c.want)
		}
	}
	if k := r.kinds(); len(k) != 0 {
		t.Errorf("a late answer reported: %v", k)
	}
	if s := logs.String(); s != "" {
		t.Errorf("logged: %s", s)
	}
}

// frameRelay carries ttrpc between the shim's end of the agent connection and a served agent,
// frame by frame towards the shim, so that a test can put frames of its own between the
// agent's: the hostile guest's raw socket.
type frameRelay struct {
	mu     sync.Mutex
	toShim net.Conn
}

// inject writes frames to the shim, between two of the agent's.
func (r *frameRelay) inject(frames []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, err := r.toShim.Write(frames)
	return err
}

func (r *frameRelay) carry(from net.Conn) {
	br := bufio.NewReader(from)
	for {
		hdr := make([]byte, frameHeaderLen)
		if _, err := io.ReadFull(br, hdr); err != nil {
			return
		}
		f := append(hdr, make([]byte, parseFrameHeader(hdr).length)...)
		if _, err := io.ReadFull(br, f[frameHeaderLen:]); err != nil {
			return
		}
		if r.inject(f) != nil {
			return
		}
	}
}

// wiredHarness is a hostile harness whose pods' agent connection is filtered, as QEMUVM's is,
// and runs through a frameRelay.
func wiredHarness(t *testing.T, limits GuestLimits) (*harness, *hostileAgent, *frameRelay) {
	h := newHarnessWith(t, limits, nil)
	ha := newHostileAgent(t, h.agent)
	sock := filepath.Join(shortTempDir(t), "agent.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer()
	if err != nil {
		t.Fatal(err)
	}
	agent.RegisterAgentService(srv, ha)
	go srv.Serve(context.Background(), l)
	toAgent, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	shimEnd, relayEnd := connPair(t)
	r := &frameRelay{toShim: relayEnd}
	go io.Copy(toAgent, relayEnd)
	go r.carry(toAgent)
	h.wire = newAgentWire(shimEnd)
	client := ttrpc.NewClient(h.wire, ttrpc.WithUnaryClientInterceptor(h.wire.intercept))
	h.remote = agent.NewAgentClient(client)
	t.Cleanup(func() {
		client.Close()
		toAgent.Close()
		srv.Close()
	})
	return h, ha, r
}

// TestHostileFrameFlood: a guest that writes 20,000 frames on streams the shim never opened,
// and frames of types the shim never takes, between its answers. The shim's log (ttrpc's
// included) gets at most 10 lines per second of it, the door counts every frame as a broken
// answer, and at the third the guest is cut off: its VM killed, the container exits 255 and
// is deleted with nothing left.
func TestHostileFrameFlood(t *testing.T) {
	logs := captureLog(t)
	h, _, relay := wiredHarness(t, GuestLimits{})
	h.createSimple("c1")
	h.start("c1", "")
	run, err := h.svc.currentRun()
	if err != nil {
		t.Fatal(err)
	}
	const inactive = 20000
	var flood []byte
	for i := range uint32(inactive) {
		flood = append(flood, frame(2*i+2, frameResponse, 0, nil)...) // even: the host's, never opened
	}
	odd := [][]byte{
		frame(1<<31+1, 7, 0, []byte("an unknown type")),
		frame(1<<31+3, 3, 1, nil),
		frame(1<<31+5, frameRequest, 0, []byte("a request to the host")),
		frame(1<<31+7, frameResponse, 0xff, nil),
	}
	for _, f := range odd {
		flood = append(flood, f...)
	}
	before := lines(logs)
	start := time.Now()
	if err := relay.inject(flood); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the door counted every dropped frame", func() bool {
		run.door.mu.Lock()
		defer run.door.mu.Unlock()
		return run.door.violations == inactive+len(odd)
	})
	took := time.Since(start)
	n := lines(logs) - before
	bound := 10 * max(1, int(math.Ceil(took.Seconds())))
	t.Logf("%d frames dropped in %v: %d log lines", inactive+len(odd), took.Round(time.Millisecond), n)
	if n > bound {
		t.Errorf("%d log lines in %v, more than %d", n, took, bound)
	}
	if strings.Contains(logs.String(), "inactive stream") {
		t.Error("ttrpc's client logged a frame")
	}
	if w := h.wait("c1", ""); w.ExitStatus != exitVMDied {
		t.Errorf("exit %d after the guest was cut off, want %d", w.ExitStatus, exitVMDied)
	}
	h.delete("c1", "")
	checkPodGone(t, h, "3 answers that break the protocol")
	if k := h.pod().kills(); len(k) == 1 && !strings.Contains(k[0].Error(), wireInactive) {
		t.Errorf("cut off for %v, want the frames on inactive streams", k[0])
	}
}

// TestHostileOversizedAnswer: an answer longer than maxAnswerFrame (the agent's own ttrpc
// server sends it: ReadStdout with twice that) cuts the guest off at once; the process still exits,
// 255, and is deleted with nothing left.
func TestHostileOversizedAnswer(t *testing.T) {
	h, _, _ := wiredHarness(t, GuestLimits{})
	h.agent.oversize = 2 * maxAnswerFrame
	outPath, _ := h.fifo("out")
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", nil), Stdout: outPath})
	// The output copy reads from Create on: the guest may be cut off before Start is asked.
	if _, err := h.svc.Start(h.ctx, &taskAPI.StartRequest{ID: "c1"}); err != nil && !errors.Is(err, ttrpc.ErrClosed) && !errdefs.IsUnavailable(err) {
		t.Fatalf("Start c1: %v, want nothing, or the guest cut off", err)
	}
	if w := h.wait("c1", ""); w.ExitStatus != exitVMDied {
		t.Errorf("exit %d after the guest was cut off, want %d", w.ExitStatus, exitVMDied)
	}
	h.delete("c1", "")
	checkPodGone(t, h, wireOversized)
}

// TestGuestText: the guest's text is escaped where it is not printable and cut to
// guestTextMax bytes.
func TestGuestText(t *testing.T) {
	for in, want := range map[string]string{
		"plain text, ünïcode":          "plain text, ünïcode",
		"two\nlines\r\x1b[31m\x00":     `two\nlines\r\x1b[31m\x00`,
		"bad \xff utf-8 \u2028 \u202e": `bad \xff utf-8 \u2028 \u202e`,
	} {
		if got := guestText(in); got != want {
			t.Errorf("guestText(%q) = %q, want %q", in, got, want)
		}
	}
	for _, in := range []string{strings.Repeat("x", 10*guestTextMax), strings.Repeat("\x01", guestTextMax)} {
		got := guestText(in)
		if len(got) > guestTextMax+len("…") || !strings.HasSuffix(got, "…") {
			t.Errorf("guestText of %d bytes: %d bytes, %q at its end", len(in), len(got), got[len(got)-8:])
		}
	}
}

// TestAgentWireAbandonedUnsent: a call whose caller gives up before its request went out (it
// waited for ttrpc's send, the guest not reading) returns at once; its request, once written,
// is answered by the filter, and the agent's answer to it is dropped without a word, while the
// call before it gets its own answer.
func TestAgentWireAbandonedUnsent(t *testing.T) {
	logs := captureLog(t)
	shimEnd, guest := net.Pipe()
	t.Cleanup(func() { guest.Close() })
	w := newAgentWire(shimEnd)
	var r reported
	w.watch(r.add)
	client := ttrpc.NewClient(w, ttrpc.WithUnaryClientInterceptor(w.intercept))
	t.Cleanup(func() { client.Close() })
	ag := agent.NewAgentClient(client)

	a := make(chan string, 1)
	go func() {
		resp, err := ag.Ping(context.Background(), &agent.PingRequest{})
		if err != nil {
			t.Errorf("the first Ping: %v", err)
		}
		a <- resp.GetVersion()
	}()
	pending := func(calls int, sending bool) func() bool {
		return func() bool {
			w.mu.Lock()
			defer w.mu.Unlock()
			return len(w.calls) == calls && (w.sending != nil) == sending
		}
	}
	waitUntil(t, "the first request is being written", pending(1, false))
	ctx, cancel := context.WithCancel(context.Background())
	b := make(chan error, 1)
	go func() {
		_, err := ag.Ping(ctx, &agent.PingRequest{})
		b <- err
	}()
	waitUntil(t, "the second call waits for its send", pending(1, true))
	cancel()
	if err := <-b; !errors.Is(err, context.Canceled) {
		t.Errorf("the abandoned Ping: %v", err)
	}

	br := bufio.NewReader(guest)
	var streams []uint32
	for range 2 {
		var hdr [frameHeaderLen]byte
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			t.Fatal(err)
		}
		h := parseFrameHeader(hdr[:])
		if _, err := br.Discard(int(h.length)); err != nil {
			t.Fatal(err)
		}
		streams = append(streams, h.stream)
	}
	waitUntil(t, "the abandoned call's stream is closed", pending(1, false))
	var sent []byte
	for _, f := range [][]byte{
		answer(t, streams[1], &agent.PingResponse{Version: "late"}),
		answer(t, streams[0], &agent.PingResponse{Version: "a"}),
	} {
		sent = append(sent, f...)
	}
	if _, err := guest.Write(sent); err != nil {
		t.Fatal(err)
	}
	if v := <-a; v != "a" {
		t.Errorf("the first Ping: %q, want \"a\"", v)
	}
	if k := r.kinds(); len(k) != 0 {
		t.Errorf("a late answer reported: %v", k)
	}
	if s := logs.String(); s != "" {
		t.Errorf("logged: %s", s)
	}
}
