package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// The virtio-fs DAX messages (BackendFSMap, BackendFSUnmap) of the DAX-capable QEMU that Kata
// ships: the back-end asks the front-end to mmap ranges of a file it passes into the device's
// DAX window (the "cache" shared-memory region the guest sees as a PCI BAR), or to drop such
// ranges again.

// FSMsgEntries is the number of ranges one FSMapMsg carries.
const FSMsgEntries = 8

// FSMapMsgSize is the wire size of an FSMapMsg (VhostUserFSSlaveMsg).
const FSMapMsgSize = 4 * 8 * FSMsgEntries

// FSMapMsg flags of one range.
const (
	FSMapRead  uint64 = 1 << 0
	FSMapWrite uint64 = 1 << 1
)

// FSMapMsg is VhostUserFSSlaveMsg: up to FSMsgEntries ranges; a range with Len 0 is unused. For
// FS_MAP, range i maps Len[i] bytes of the passed file at FDOffset[i] to CacheOffset[i] of the
// window with the access of Flags[i]; for FS_UNMAP only CacheOffset and Len count.
type FSMapMsg struct {
	FDOffset    [FSMsgEntries]uint64
	CacheOffset [FSMsgEntries]uint64
	Len         [FSMsgEntries]uint64
	Flags       [FSMsgEntries]uint64
}

// Append appends the wire form of m.
func (m *FSMapMsg) Append(b []byte) []byte {
	for _, a := range [...]*[FSMsgEntries]uint64{&m.FDOffset, &m.CacheOffset, &m.Len, &m.Flags} {
		for _, v := range a {
			b = binary.LittleEndian.AppendUint64(b, v)
		}
	}
	return b
}

// ParseFSMapMsg decodes an FSMapMsg; the payload must be exactly FSMapMsgSize bytes.
func ParseFSMapMsg(b []byte) (*FSMapMsg, error) {
	if len(b) != FSMapMsgSize {
		return nil, invalidf("FS map message of %d bytes, want %d", len(b), FSMapMsgSize)
	}
	m := &FSMapMsg{}
	for _, a := range [...]*[FSMsgEntries]uint64{&m.FDOffset, &m.CacheOffset, &m.Len, &m.Flags} {
		for i := range a {
			a[i] = binary.LittleEndian.Uint64(b)
			b = b[8:]
		}
	}
	return m, nil
}

// ErrNoBackendChannel is returned for a back-end request when the front-end gave no usable
// back-end channel: none was set up, it hung up or broke, or REPLY_ACK and BACKEND_SEND_FD were
// not both negotiated.
var ErrNoBackendChannel = errors.New("no usable vhost-user back-end channel")

// ErrBackendNack wraps the error of a back-end request the front-end answered with failure.
var ErrBackendNack = errors.New("front-end refused back-end request")

// DefaultBackendTimeout bounds one back-end request and its reply (WithBackendTimeout).
const DefaultBackendTimeout = 5 * time.Second

// WithBackendTimeout sets how long a back-end request may wait for its reply before the channel
// is declared broken (default DefaultBackendTimeout).
func WithBackendTimeout(d time.Duration) Option {
	return func(b *Backend) {
		if d > 0 {
			b.backendTimeout = d
		}
	}
}

// backendChannel is the back-end → front-end channel of the current connection.
type backendChannel struct {
	c *Conn
	// usable: REPLY_ACK and BACKEND_SEND_FD were negotiated when it was set, so requests can
	// carry an fd and be acknowledged.
	usable bool
}

// FSMapAvailable reports whether FSMap and FSUnmap can be sent now: a back-end channel exists,
// is not known broken, and REPLY_ACK and BACKEND_SEND_FD were negotiated. It says nothing about
// whether the front-end has a DAX window: an upstream QEMU answers both requests with failure.
func (b *Backend) FSMapAvailable() bool {
	b.chMu.Lock()
	defer b.chMu.Unlock()
	return b.backendCh != nil && b.backendCh.usable
}

// FSMap asks the front-end to map the ranges of m from file fd into its DAX window and waits
// for its answer. The caller keeps fd. See FSUnmap for the rules both follow.
func (b *Backend) FSMap(m *FSMapMsg, fd int) error {
	if fd < 0 {
		return fmt.Errorf("%v: no file descriptor", BackendFSMap)
	}
	return b.backendRequest(BackendFSMap, m.Append(nil), []int{fd})
}

// FSUnmap asks the front-end to drop the ranges of m from its DAX window and waits for its
// answer.
//
// Back-end requests are meant for the device's queue goroutines, never the message loop: the
// front-end may not serve its back-end channel while it waits for an answer on the main
// connection (QEMU 7.2.3 and later), so the message loop must never wait for the front-end here.
// Requests are serialised (one request and its reply at a time). A request whose reply does not
// arrive within the back-end timeout, a hang-up or any malformed reply breaks the channel: it is
// closed and every later request fails at once with ErrNoBackendChannel, since a late reply could
// otherwise be taken for the answer to the next request. A refusal (non-zero reply) wraps
// ErrBackendNack and, when the value is a negated errno as the DAX-capable QEMU sends, that
// unix.Errno too.
func (b *Backend) FSUnmap(m *FSMapMsg) error {
	return b.backendRequest(BackendFSUnmap, m.Append(nil), nil)
}

func (b *Backend) backendRequest(req BackendRequest, payload []byte, fds []int) error {
	b.reqMu.Lock()
	defer b.reqMu.Unlock()
	b.chMu.Lock()
	ch := b.backendCh
	b.chMu.Unlock()
	if ch == nil || !ch.usable {
		return fmt.Errorf("%v: %w", req, ErrNoBackendChannel)
	}
	v, err := ch.exchange(req, payload, fds, b.backendTimeout)
	if err != nil {
		b.dropBackendChannel(ch)
		return fmt.Errorf("%v: back-end channel broken: %w", req, err)
	}
	if v != 0 {
		err := fmt.Errorf("%v: %w (reply %#x)", req, ErrBackendNack, v)
		if e := int64(v); e < 0 && e >= -4095 {
			err = fmt.Errorf("%w: %w", err, unix.Errno(-e))
		}
		return err
	}
	return nil
}

// exchange sends one request with NEED_REPLY and reads its u64 reply within timeout.
func (ch *backendChannel) exchange(req BackendRequest, payload []byte, fds []int, timeout time.Duration) (uint64, error) {
	uc := ch.c.UnixConn()
	if err := uc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return 0, err
	}
	defer uc.SetDeadline(time.Time{})
	h := Header{Request: Request(req), Flags: Version | FlagNeedReply}
	if err := ch.c.WriteMessage(h, payload, fds); err != nil {
		return 0, fmt.Errorf("sending: %w", err)
	}
	m, err := ch.c.ReadMessage()
	if err != nil {
		return 0, fmt.Errorf("reading the reply: %w", err)
	}
	defer m.Close()
	switch {
	case m.Flags != ReplyFlags:
		return 0, invalidf("reply to %v: flags %#x instead of %#x", req, m.Flags, ReplyFlags)
	case BackendRequest(m.Request) != req:
		return 0, invalidf("reply to %v: received reply to %v", req, BackendRequest(m.Request))
	case len(m.Payload) != 8:
		return 0, invalidf("reply to %v: size %d, want 8", req, len(m.Payload))
	case len(m.FDs) != 0:
		return 0, invalidf("reply to %v carries %d fds", req, len(m.FDs))
	}
	return binary.LittleEndian.Uint64(m.Payload), nil
}
