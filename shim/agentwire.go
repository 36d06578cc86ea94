package shim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// The agent connection below ttrpc. ttrpc's client trusts its server: a frame on a stream it
// is not waiting on costs one error line in the log ("received message on inactive stream"),
// a second answer on a stream another ("failed to handle message", after holding its receive
// loop up to a second), so a guest that writes 10-byte frames floods the shim's stderr, which
// is containerd's (20,000 frames made 20,000 lines, 1.96 MB, in 0.4 s). agentWire sits between ttrpc's client and the
// connection to the agent and passes ttrpc only what it waits for:
//
//   - it reads the frames the client writes, and learns from each request which stream is
//     open: the agent's API is unary (no call streams), so a stream is one request and one
//     response;
//   - it reads the guest's frames itself and passes on only a response, with no flags, of no
//     more than maxAnswerFrame bytes, that decodes as ttrpc's Response, on a stream whose
//     request is outstanding; that response closes the stream;
//   - anything else is dropped whole, its payload skipped by its length, and reported as a
//     wireViolation to the run's door (agentDoor.broke), which counts it as a broken answer
//     and logs it through the pod's rate-limited guest logger. The filter itself logs nothing.
//     A call whose stream carried the dropped frame fails with an answer the filter writes in
//     its place, so that no call waits for an answer that will not come;
//   - a frame longer than maxAnswerFrame ends the connection (see maxAnswerFrame);
//   - a call its caller abandons (its deadline, or its cancellation) is answered by the filter
//     at once, in the order of the frames ttrpc reads, and the agent's late answer is dropped
//     without a word: ttrpc's client forgets an abandoned stream when its caller gives up, so
//     passing it a late answer would log it. A late answer is no violation (an honest agent
//     can be slow; the door counts the missed deadline).
//
// For the last point the filter runs every call through its unary interceptor (intercept):
// the call waits for ttrpc without its caller's cancellation, which the interceptor turns into
// the filter's answer; and the interceptor holds the connection's one turn (agentWire.turn)
// from the call's start to its request frame, so that the filter knows which call a stream is.

const (
	// readMax is the most bytes the shim asks of the agent per read of a stream: a process's
	// output (ReadStdout, ReadStderr) or a forwarded connection (ReadPort).
	readMax = 32 << 10
	// frameHeaderLen is a ttrpc frame's header: length (uint32, big-endian), stream id
	// (uint32), type (uint8), flags (uint8).
	frameHeaderLen = 10
	frameRequest   = 1
	frameResponse  = 2
	// maxAnswerFrame bounds the agent's answers. The largest an honest agent gives the shim
	// are ReadStdout's and ReadStderr's, readMax (32 KiB) of data; Stats' cgroup metrics are a
	// few KiB (the door refuses more than maxStatsBytes), and an error's text, which may quote
	// the container runtime's, is cut to guestTextMax at the door. 256 KiB leaves an honest
	// error eight times readMax; ttrpc's own bound is 4 MiB.
	//
	// A longer frame ends the connection rather than being skipped: until its claimed length
	// (up to 4 GiB) has been read, no answer can pass, so the connection is lost either way,
	// and only a guest that breaks the protocol claims it. The door cuts it off at once.
	maxAnswerFrame = 256 << 10
	// wireOutMax is how many bytes of passed frames wait for ttrpc's read before the filter
	// reads no more from the guest.
	wireOutMax = 2 * maxAnswerFrame
	// abandonedMax is how many abandoned streams the filter remembers to drop their late
	// answers quietly; the oldest is forgotten first (its late answer then counts as a frame on
	// an inactive stream: an agent that leaves that many calls unanswered has failed anyway).
	abandonedMax = 1024
	// heldMax is how many violations the filter keeps before the door hears of them (the
	// agent's boot): more than the door's limit.
	heldMax = 2 * violationLimit
)

// The kinds of wireViolation, also the guest logger's kinds.
const (
	wireInactive  = "frame-inactive-stream" // a frame on a stream with no request outstanding
	wireType      = "frame-type"            // a frame not a response, or with flags
	wireMalformed = "frame-malformed"       // a response that is not ttrpc's Response
	wireOversized = "frame-oversized"       // a frame longer than maxAnswerFrame: fatal
)

// frameHeader is a ttrpc frame's header.
type frameHeader struct {
	length, stream uint32
	typ, flags     uint8
}

func parseFrameHeader(b []byte) frameHeader {
	return frameHeader{length: binary.BigEndian.Uint32(b), stream: binary.BigEndian.Uint32(b[4:]), typ: b[8], flags: b[9]}
}

func (h frameHeader) append(b []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, h.length)
	b = binary.BigEndian.AppendUint32(b, h.stream)
	return append(b, h.typ, h.flags)
}

// wireViolation is a frame the filter dropped. Its text is the shim's: the guest's part is the
// header's numbers.
type wireViolation struct {
	kind   string // one of the wire* kinds
	header frameHeader
	fatal  bool // the connection carries nothing after it
}

func (v wireViolation) Error() string {
	h := v.header
	return fmt.Sprintf("a dropped frame: %s (stream %d, type %d, flags %#x, %d bytes)", v.kind, h.stream, h.typ, h.flags, h.length)
}

// wireCall is one call through the filter. Its fields are guarded by agentWire.mu.
type wireCall struct {
	stream    uint32 // its request's stream id, once the request was written
	sent      bool   // its request frame was written
	abandoned error  // why its caller gave up on it; nil while it waits
}

// wireFiltered is a Pod whose agent connection runs through an agentWire (QEMUVM's): its run's
// door hears of the frames it drops.
type wireFiltered interface {
	agentWire() *agentWire
}

// agentWire is the agent connection's filter (see above). Read, Write and Close are its own;
// the rest of net.Conn is the connection's.
type agentWire struct {
	net.Conn

	// turn is held by a call from its start to its request frame (intercept, learn).
	turn chan struct{}

	// The write side's parse state: the frame header being written and how much of the
	// current frame's payload is left. Only ttrpc's sends touch it, one at a time.
	whdr  [frameHeaderLen]byte
	whave int
	wskip uint32

	mu        sync.Mutex
	wake      *sync.Cond           // on mu: out grew or shrank, or the read side ended
	out       bytes.Buffer         // guarded by mu: frames for ttrpc, not yet read
	rerr      error                // guarded by mu: why the read side ended
	sending   *wireCall            // guarded by mu: the call that holds turn
	calls     map[uint32]*wireCall // guarded by mu: outstanding requests, by stream
	abandoned map[uint32]struct{}  // guarded by mu: abandoned streams, their answers to come
	report    func(wireViolation)  // guarded by mu: the door's; nil before watch
	held      []wireViolation      // guarded by mu: violations before watch, up to heldMax
}

// newAgentWire filters conn, and starts reading it. The ttrpc client over it must use
// intercept as its unary interceptor.
func newAgentWire(conn net.Conn) *agentWire {
	w := &agentWire{Conn: conn, turn: make(chan struct{}, 1), calls: map[uint32]*wireCall{}, abandoned: map[uint32]struct{}{}}
	w.wake = sync.NewCond(&w.mu)
	go w.pump()
	return w
}

// watch gives the filter's violations to report, from now on and those held since the start.
// report is called from the filter's reader, with no lock held.
func (w *agentWire) watch(report func(wireViolation)) {
	w.mu.Lock()
	held := w.held
	w.report, w.held = report, nil
	w.mu.Unlock()
	for _, v := range held {
		report(v)
	}
}

// intercept is the ttrpc client's unary interceptor (see above): the call's request frame is
// written in its turn, and the call is answered by the filter if its caller gives up.
func (w *agentWire) intercept(ctx context.Context, req *ttrpc.Request, resp *ttrpc.Response, _ *ttrpc.UnaryClientInfo, invoke ttrpc.Invoker) error {
	select {
	case w.turn <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	c := &wireCall{}
	w.mu.Lock()
	w.sending = c
	w.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		err := invoke(context.WithoutCancel(ctx), req, resp)
		w.finish(c)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		w.abandon(c, ctx.Err())
		return ctx.Err()
	}
}

// finish forgets c, whose invoke returned: its turn, if its request never went out, and its
// stream, if no answer closed it (the connection's end).
func (w *agentWire) finish(c *wireCall) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.sending == c {
		w.sending = nil
		<-w.turn
	}
	if c.sent && w.calls[c.stream] == c {
		delete(w.calls, c.stream)
	}
}

// abandon answers c for its caller, who gave up for why; the agent's answer, if it comes, is
// dropped. A call not yet sent is answered as its request goes (opened).
func (w *agentWire) abandon(c *wireCall, why error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c.abandoned = why
	if c.sent && w.calls[c.stream] == c {
		w.closeAbandonedLocked(c)
	}
}

// closeAbandonedLocked answers c's stream for ttrpc and remembers it as abandoned. w.mu is
// held.
func (w *agentWire) closeAbandonedLocked(c *wireCall) {
	delete(w.calls, c.stream)
	if len(w.abandoned) >= abandonedMax {
		oldest := c.stream
		for s := range w.abandoned {
			oldest = min(oldest, s)
		}
		delete(w.abandoned, oldest)
	}
	w.abandoned[c.stream] = struct{}{}
	w.answerLocked(c.stream, status.New(codes.Canceled, "the call was abandoned: "+c.abandoned.Error()))
}

// answerLocked gives ttrpc an answer of the filter's on stream: st. w.mu is held.
func (w *agentWire) answerLocked(stream uint32, st *status.Status) {
	p, err := proto.Marshal(&ttrpc.Response{Status: st.Proto()})
	if err != nil {
		// A Response of a code and the shim's text always marshals; should it not, the
		// connection can no longer answer its calls.
		w.endReadLocked(fmt.Errorf("the agent connection's filter: %w", err))
		return
	}
	w.out.Write(frameHeader{length: uint32(len(p)), stream: stream, typ: frameResponse}.append(nil))
	w.out.Write(p)
	w.wake.Broadcast()
}

// Write learns the streams ttrpc's requests open, then writes p.
func (w *agentWire) Write(p []byte) (int, error) {
	w.learn(p)
	return w.Conn.Write(p)
}

// learn parses the frames ttrpc writes (across writes): each request opens its stream. A
// stream is open before its request goes out, so that no answer can come before it.
func (w *agentWire) learn(p []byte) {
	for len(p) > 0 {
		if w.wskip > 0 {
			n := uint32(min(uint64(w.wskip), uint64(len(p))))
			p, w.wskip = p[n:], w.wskip-n
			continue
		}
		n := copy(w.whdr[w.whave:], p)
		p, w.whave = p[n:], w.whave+n
		if w.whave < frameHeaderLen {
			return
		}
		h := parseFrameHeader(w.whdr[:])
		w.whave, w.wskip = 0, h.length
		if h.typ == frameRequest {
			w.opened(h.stream)
		}
	}
}

// opened records the request of the call that holds the turn on stream, and ends its turn.
func (w *agentWire) opened(stream uint32) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.sending
	if c == nil {
		c = &wireCall{} // a request not from intercept: it can only be answered
	} else {
		w.sending = nil
		<-w.turn
	}
	c.stream, c.sent = stream, true
	w.calls[stream] = c
	if c.abandoned != nil {
		w.closeAbandonedLocked(c)
	}
}

// Read gives ttrpc the frames the filter passed, and then why the read side ended.
func (w *agentWire) Read(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.out.Len() == 0 && w.rerr == nil {
		w.wake.Wait()
	}
	if w.out.Len() == 0 {
		return 0, w.rerr
	}
	n, _ := w.out.Read(p)
	w.wake.Broadcast()
	return n, nil
}

// Close closes the connection; Read then ends.
func (w *agentWire) Close() error {
	err := w.Conn.Close()
	w.mu.Lock()
	w.endReadLocked(net.ErrClosed)
	w.mu.Unlock()
	return err
}

// SetDeadline and SetReadDeadline are refused: the filter reads the connection on its own.
func (w *agentWire) SetDeadline(time.Time) error { return errors.ErrUnsupported }

func (w *agentWire) SetReadDeadline(time.Time) error { return errors.ErrUnsupported }

func (w *agentWire) endReadLocked(err error) {
	if w.rerr == nil {
		w.rerr = err
	}
	w.wake.Broadcast()
}

// pump reads the guest's frames and sorts them (take) until the connection ends or a frame is
// longer than maxAnswerFrame.
func (w *agentWire) pump() {
	br := bufio.NewReaderSize(w.Conn, 64<<10)
	var hdr [frameHeaderLen]byte
	buf := make([]byte, 0, 4096)
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			w.mu.Lock()
			w.endReadLocked(err)
			w.mu.Unlock()
			return
		}
		h := parseFrameHeader(hdr[:])
		if h.length > maxAnswerFrame {
			v := wireViolation{kind: wireOversized, header: h, fatal: true}
			w.mu.Lock()
			w.endReadLocked(v)
			report := w.reportLocked(v)
			w.mu.Unlock()
			report()
			return
		}
		if cap(buf) < int(h.length) {
			buf = make([]byte, h.length)
		}
		payload := buf[:h.length]
		if _, err := io.ReadFull(br, payload); err != nil {
			w.mu.Lock()
			w.endReadLocked(err)
			w.mu.Unlock()
			return
		}
		if !w.take(h, payload) {
			return
		}
	}
}

// take passes the frame h with its payload to ttrpc, or drops it as a violation or a late
// answer. It says whether the read side goes on.
func (w *agentWire) take(h frameHeader, payload []byte) bool {
	w.mu.Lock()
	for w.out.Len() >= wireOutMax && w.rerr == nil {
		w.wake.Wait()
	}
	if w.rerr != nil {
		w.mu.Unlock()
		return false
	}
	_, open := w.calls[h.stream]
	_, abandoned := w.abandoned[h.stream]
	isAnswer := h.typ == frameResponse && h.flags == 0
	var kind string
	switch {
	case !open && abandoned && isAnswer:
		delete(w.abandoned, h.stream)
		w.mu.Unlock()
		return true
	case !open:
		kind = wireInactive
	case !isAnswer:
		kind = wireType
	case proto.Unmarshal(payload, &ttrpc.Response{}) != nil:
		kind = wireMalformed
	default:
		delete(w.calls, h.stream)
		w.out.Write(h.append(nil))
		w.out.Write(payload)
		w.wake.Broadcast()
		w.mu.Unlock()
		return true
	}
	v := wireViolation{kind: kind, header: h}
	if open {
		// Its call gets the filter's answer in place of the one dropped.
		delete(w.calls, h.stream)
		w.answerLocked(h.stream, status.New(codes.Unknown, "the guest agent broke the protocol: "+v.Error()))
	}
	report := w.reportLocked(v)
	w.mu.Unlock()
	report()
	return true
}

// reportLocked holds v for the door to come (up to heldMax), or returns the door's report of
// it, to be called once w.mu is released. w.mu is held.
func (w *agentWire) reportLocked(v wireViolation) func() {
	if w.report == nil {
		if len(w.held) < heldMax {
			w.held = append(w.held, v)
		}
		return func() {}
	}
	report := w.report
	return func() { report(v) }
}
