package vhostuser

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"golang.org/x/sys/unix"
)

// Message is one message as read from a Conn: header, payload and the fds that came with it.
// The Message owns its fds until they are taken with TakeFD; Close closes the rest.
type Message struct {
	Header
	Payload []byte
	FDs     []int
}

// TakeFD transfers ownership of the i-th fd to the caller. It returns -1 if there is no such fd or
// it was already taken.
func (m *Message) TakeFD(i int) int {
	if i < 0 || i >= len(m.FDs) {
		return -1
	}
	fd := m.FDs[i]
	m.FDs[i] = -1
	return fd
}

// Close closes every fd not taken with TakeFD.
func (m *Message) Close() {
	closeFDs(m.FDs)
}

func closeFDs(fds []int) {
	for i, fd := range fds {
		if fd >= 0 {
			unix.Close(fd)
			fds[i] = -1
		}
	}
}

// Conn reads and writes vhost-user messages with their SCM_RIGHTS fds over a unix stream socket.
// One goroutine may read while others write; writes are serialised.
type Conn struct {
	uc  *net.UnixConn
	oob []byte // read side only

	wmu sync.Mutex
}

// NewConn wraps uc. The Conn owns uc from now on: Close closes it.
func NewConn(uc *net.UnixConn) *Conn {
	// Room for one fd more than allowed, so that "too many" is seen as such rather than as a
	// truncated control message (the kernel closes what does not fit either way).
	return &Conn{uc: uc, oob: make([]byte, unix.CmsgSpace(4*(MaxFDs+1)))}
}

// UnixConn returns the underlying socket (for deadlines).
func (c *Conn) UnixConn() *net.UnixConn { return c.uc }

// Close closes the socket.
func (c *Conn) Close() error { return c.uc.Close() }

// ReadMessage reads one message: its header, its payload and every fd attached to any of its
// bytes. The header is not judged beyond its size bound (see Header.CheckRequest/CheckReply).
// It returns io.EOF if the peer closed the connection between messages and io.ErrUnexpectedEOF if
// it closed it inside one. On error no fd is left open.
func (c *Conn) ReadMessage() (*Message, error) {
	var hb [HeaderSize]byte
	fds, n, err := c.readFull(hb[:], nil)
	if err != nil {
		closeFDs(fds)
		if errors.Is(err, io.EOF) { // net wraps it in an *OpError
			if n > 0 {
				return nil, io.ErrUnexpectedEOF
			}
			return nil, io.EOF
		}
		return nil, err
	}
	h, _ := ParseHeader(hb[:])
	if h.Size > MaxPayload {
		closeFDs(fds)
		return nil, invalidf("%v: payload size %d exceeds %d", h.Request, h.Size, MaxPayload)
	}
	payload := make([]byte, h.Size)
	fds, _, err = c.readFull(payload, fds)
	if err != nil {
		closeFDs(fds)
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	if len(fds) > MaxFDs {
		closeFDs(fds)
		return nil, invalidf("%v: %d fds attached, at most %d allowed", h.Request, len(fds), MaxFDs)
	}
	return &Message{Header: h, Payload: payload, FDs: fds}, nil
}

// readFull fills b with recvmsg calls, appending received fds to fds. A unix stream socket never
// merges data carrying fds with later data, so fds can arrive on any of the reads.
func (c *Conn) readFull(b []byte, fds []int) ([]int, int, error) {
	n := 0
	for n < len(b) {
		m, oobn, flags, _, err := c.uc.ReadMsgUnix(b[n:], c.oob)
		n += m
		if oobn > 0 {
			got, perr := parseRights(c.oob[:oobn])
			fds = append(fds, got...)
			if perr != nil && err == nil {
				err = perr
			}
		}
		if err == nil && flags&unix.MSG_CTRUNC != 0 {
			err = invalidf("control message truncated (more than %d fds sent)", MaxFDs)
		}
		if err != nil {
			return fds, n, err
		}
		if m == 0 {
			return fds, n, io.EOF
		}
	}
	return fds, n, nil
}

// parseRights returns every fd in the SCM_RIGHTS messages of oob. It returns as many fds as it
// could parse even on error so the caller can close them.
func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("parsing control message: %w", err)
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			return fds, fmt.Errorf("parsing SCM_RIGHTS: %w", err)
		}
		fds = append(fds, got...)
	}
	return fds, nil
}

// WriteMessage sends header+payload in one sendmsg with fds attached (the caller keeps ownership
// of fds). h.Size is set from payload.
func (c *Conn) WriteMessage(h Header, payload []byte, fds []int) error {
	if len(payload) > MaxPayload {
		return invalidf("%v: payload size %d exceeds %d", h.Request, len(payload), MaxPayload)
	}
	if len(fds) > MaxFDs {
		return invalidf("%v: %d fds, at most %d allowed", h.Request, len(fds), MaxFDs)
	}
	h.Size = uint32(len(payload))
	b := h.Append(make([]byte, 0, HeaderSize+len(payload)))
	b = append(b, payload...)
	return c.write(b, fds)
}

// write sends b (with fds on its first sendmsg) completely.
func (c *Conn) write(b []byte, fds []int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n, _, err := c.uc.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return err
	}
	for n < len(b) {
		m, err := c.uc.Write(b[n:])
		if err != nil {
			return err
		}
		n += m
	}
	return nil
}

// WriteReply sends a reply (flags exactly ReplyFlags) to req.
func (c *Conn) WriteReply(req Request, p Payload) error {
	return c.WriteMessage(Header{Request: req, Flags: ReplyFlags}, p.Append(nil), nil)
}
