package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
)

// ErrNack is returned when the back-end acknowledges a request with a non-zero REPLY_ACK value.
var ErrNack = errors.New("vhost-user back-end reported failure")

// Client is the front-end side of the protocol: the role QEMU plays. It validates replies as QEMU
// 7.2 does (flags exactly 0x5, the request id of the request, the expected size) and, like QEMU,
// asks for REPLY_ACK acknowledgements on SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG and
// SET_BACKEND_REQ_FD once REPLY_ACK has been negotiated with SetProtocolFeatures.
//
// A Client is safe for concurrent use; each request/reply exchange is atomic.
type Client struct {
	mu       sync.Mutex
	c        *Conn
	protocol uint64 // guarded by mu: protocol features acked with SetProtocolFeatures
}

// NewClient returns a Client speaking on uc. The Client owns uc: Close closes it.
func NewClient(uc *net.UnixConn) *Client {
	return &Client{c: NewConn(uc)}
}

// Conn returns the underlying connection.
func (c *Client) Conn() *Conn { return c.c }

// Close closes the connection.
func (c *Client) Close() error { return c.c.Close() }

// exchange sends a request and, if reply is true, reads and validates its reply header, returning
// the reply payload. It must be called with c.mu held.
func (c *Client) exchange(req Request, flags uint32, payload []byte, fds []int, reply bool) ([]byte, error) {
	// No bounds on payload or fds here: Raw and the typed methods double as tools for sending
	// malformed messages.
	b := Header{Request: req, Flags: flags, Size: uint32(len(payload))}.Append(nil)
	if err := c.c.write(append(b, payload...), fds); err != nil {
		return nil, fmt.Errorf("sending %v: %w", req, err)
	}
	if !reply {
		return nil, nil
	}
	m, err := c.c.ReadMessage()
	if err != nil {
		return nil, fmt.Errorf("reading reply to %v: %w", req, err)
	}
	defer m.Close()
	if err := m.CheckReply(uint32(req)); err != nil {
		return nil, err
	}
	if len(m.FDs) != 0 {
		return nil, invalidf("reply to %v carries %d fds", req, len(m.FDs))
	}
	return m.Payload, nil
}

func (c *Client) replyAck() bool { return c.protocol&ProtocolReplyAck != 0 }

// send sends a request without a reply body of its own; with ack it sets NEED_REPLY and checks the
// acknowledgement.
func (c *Client) send(req Request, p Payload, fds []int, ack bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sendLocked(req, p, fds, ack && c.replyAck())
}

func (c *Client) sendLocked(req Request, p Payload, fds []int, ack bool) error {
	flags := Version
	if ack {
		flags |= FlagNeedReply
	}
	b, err := c.exchange(req, flags, p.Append(nil), fds, ack)
	if err != nil || !ack {
		return err
	}
	if len(b) != 8 {
		return invalidf("reply to %v: size %d, want 8", req, len(b))
	}
	if v := binary.LittleEndian.Uint64(b); v != 0 {
		return fmt.Errorf("%v: %w (ack %d)", req, ErrNack, v)
	}
	return nil
}

// getU64 sends a request that is answered with a u64.
func (c *Client) getU64(req Request, p Payload) (uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b, err := c.exchange(req, Version, p.Append(nil), nil, true)
	if err != nil {
		return 0, err
	}
	if len(b) != 8 {
		return 0, invalidf("reply to %v: size %d, want 8", req, len(b))
	}
	return binary.LittleEndian.Uint64(b), nil
}

// GetFeatures asks for the back-end's virtio feature bits.
func (c *Client) GetFeatures() (uint64, error) { return c.getU64(GetFeatures, Empty{}) }

// SetFeatures acks virtio feature bits.
func (c *Client) SetFeatures(f uint64) error { return c.send(SetFeatures, U64(f), nil, false) }

// GetProtocolFeatures asks for the back-end's protocol feature bits.
func (c *Client) GetProtocolFeatures() (uint64, error) {
	return c.getU64(GetProtocolFeatures, Empty{})
}

// SetProtocolFeatures acks protocol feature bits. Once REPLY_ACK is acked the Client asks for
// acknowledgements where QEMU does.
func (c *Client) SetProtocolFeatures(f uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.sendLocked(SetProtocolFeatures, U64(f), nil, false); err != nil {
		return err
	}
	c.protocol = f
	return nil
}

// SetOwner claims the back-end.
func (c *Client) SetOwner() error { return c.send(SetOwner, Empty{}, nil, false) }

// ResetOwner sends the deprecated RESET_OWNER.
func (c *Client) ResetOwner() error { return c.send(ResetOwner, Empty{}, nil, false) }

// ResetDevice sends RESET_DEVICE.
func (c *Client) ResetDevice() error { return c.send(ResetDevice, Empty{}, nil, false) }

// GetQueueNum asks how many queues the back-end supports.
func (c *Client) GetQueueNum() (uint64, error) { return c.getU64(GetQueueNum, Empty{}) }

// GetMaxMemSlots asks how many memory regions ADD_MEM_REG may install.
func (c *Client) GetMaxMemSlots() (uint64, error) { return c.getU64(GetMaxMemSlots, Empty{}) }

// SetMemTable replaces the back-end's memory table; fds[i] backs regions[i] (the caller keeps
// ownership of fds).
func (c *Client) SetMemTable(regions []MemoryRegion, fds []int) error {
	if len(regions) != len(fds) {
		return fmt.Errorf("SetMemTable: %d regions but %d fds", len(regions), len(fds))
	}
	return c.send(SetMemTable, MemoryTable{Regions: regions}, fds, true)
}

// AddMemReg adds one memory region backed by fd (the caller keeps ownership of fd).
func (c *Client) AddMemReg(r MemoryRegion, fd int) error {
	return c.send(AddMemReg, SingleRegion{Region: r}, []int{fd}, true)
}

// RemMemReg removes the region matching r's guest address, user address and size.
func (c *Client) RemMemReg(r MemoryRegion) error {
	return c.send(RemMemReg, SingleRegion{Region: r}, nil, true)
}

// SetVringNum sets the size of vring idx.
func (c *Client) SetVringNum(idx, num uint32) error {
	return c.send(SetVringNum, VringState{Index: idx, Num: num}, nil, false)
}

// SetVringAddr sets the ring addresses (front-end virtual addresses) of a vring.
func (c *Client) SetVringAddr(a VringAddr) error { return c.send(SetVringAddr, a, nil, false) }

// SetVringBase sets the next available index of vring idx.
func (c *Client) SetVringBase(idx, base uint32) error {
	return c.send(SetVringBase, VringState{Index: idx, Num: base}, nil, false)
}

// GetVringBase stops vring idx and returns its next available index.
func (c *Client) GetVringBase(idx uint32) (uint32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b, err := c.exchange(GetVringBase, Version, VringState{Index: idx}.Append(nil), nil, true)
	if err != nil {
		return 0, err
	}
	if len(b) != 8 {
		return 0, invalidf("reply to %v: size %d, want 8", GetVringBase, len(b))
	}
	if got := binary.LittleEndian.Uint32(b); got != idx {
		return 0, invalidf("reply to %v: vring %d, asked for %d", GetVringBase, got, idx)
	}
	return binary.LittleEndian.Uint32(b[4:]), nil
}

func (c *Client) vringFile(req Request, idx uint8, fd int) error {
	if fd < 0 {
		return c.send(req, VringFile{Index: idx, NoFD: true}, nil, false)
	}
	return c.send(req, VringFile{Index: idx}, []int{fd}, false)
}

// SetVringKick sets the kick eventfd of vring idx (fd < 0: NOFD, the back-end polls); it starts the
// ring.
func (c *Client) SetVringKick(idx uint8, fd int) error { return c.vringFile(SetVringKick, idx, fd) }

// SetVringCall sets the call eventfd of vring idx (fd < 0: no notifications).
func (c *Client) SetVringCall(idx uint8, fd int) error { return c.vringFile(SetVringCall, idx, fd) }

// SetVringErr sets the error eventfd of vring idx (fd < 0: none).
func (c *Client) SetVringErr(idx uint8, fd int) error { return c.vringFile(SetVringErr, idx, fd) }

// SetVringEnable enables or disables vring idx.
func (c *Client) SetVringEnable(idx uint32, enable bool) error {
	var n uint32
	if enable {
		n = 1
	}
	return c.send(SetVringEnable, VringState{Index: idx, Num: n}, nil, false)
}

// SetBackendReqFD hands the back-end its end of the back-end → front-end channel (the caller keeps
// ownership of fd).
func (c *Client) SetBackendReqFD(fd int) error {
	return c.send(SetBackendReqFD, Empty{}, []int{fd}, true)
}

// Raw sends an arbitrary message (for hostile tests): the header gets request, flags and
// len(payload). A reply is read when flags has NEED_REPLY or the request has a reply body of its
// own; it must pass the same checks as any reply, and its payload is returned.
func (c *Client) Raw(request, flags uint32, payload []byte, fds []int) ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	req := Request(request)
	return c.exchange(req, flags, payload, fds, flags&FlagNeedReply != 0 || req.HasReply())
}
