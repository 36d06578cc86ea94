package vhostuser

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// ErrInvalid is wrapped by every error caused by a malformed message: bad header, size, fd count
// or field value.
var ErrInvalid = errors.New("invalid vhost-user message")

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}

// Header is the 12-byte message header. All fields are host byte order (little-endian on every
// platform this package supports).
type Header struct {
	Request Request
	Flags   uint32
	Size    uint32
}

// Append appends the wire form of h to b.
func (h Header) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(h.Request))
	b = binary.LittleEndian.AppendUint32(b, h.Flags)
	return binary.LittleEndian.AppendUint32(b, h.Size)
}

// ParseHeader decodes a header without judging it.
func ParseHeader(b []byte) (Header, error) {
	if len(b) != HeaderSize {
		return Header{}, invalidf("header is %d bytes, want %d", len(b), HeaderSize)
	}
	return Header{
		Request: Request(binary.LittleEndian.Uint32(b[0:])),
		Flags:   binary.LittleEndian.Uint32(b[4:]),
		Size:    binary.LittleEndian.Uint32(b[8:]),
	}, nil
}

// NeedReply reports whether the sender asked for a REPLY_ACK acknowledgement.
func (h Header) NeedReply() bool { return h.Flags&FlagNeedReply != 0 }

// CheckRequest validates the header of a request (front-end → back-end or back-end → front-end):
// version 1, no reply bit, no unknown flag bits, payload size within MaxPayload.
func (h Header) CheckRequest() error {
	if h.Flags&FlagVersionMask != Version {
		return invalidf("%v: version %d, want %d", h.Request, h.Flags&FlagVersionMask, Version)
	}
	if h.Flags&^(FlagVersionMask|FlagNeedReply) != 0 {
		return invalidf("%v: unexpected flags %#x in a request", h.Request, h.Flags)
	}
	if h.Size > MaxPayload {
		return invalidf("%v: payload size %d exceeds %d", h.Request, h.Size, MaxPayload)
	}
	return nil
}

// CheckReply validates a reply header the way QEMU 7.2 does: flags exactly ReplyFlags, the request
// id of the request it answers, and a payload size within MaxPayload.
func (h Header) CheckReply(req uint32) error {
	if h.Flags != ReplyFlags {
		return invalidf("reply to %v: flags %#x instead of %#x", Request(req), h.Flags, ReplyFlags)
	}
	if uint32(h.Request) != req {
		return invalidf("reply to %v: received reply to %v", Request(req), h.Request)
	}
	if h.Size > MaxPayload {
		return invalidf("reply to %v: payload size %d exceeds %d", Request(req), h.Size, MaxPayload)
	}
	return nil
}

// Payload is a decoded request payload.
type Payload interface {
	// Append appends the wire form of the payload to b.
	Append(b []byte) []byte
}

// Empty is the payload of requests that carry none.
type Empty struct{}

func (Empty) Append(b []byte) []byte { return b }

// U64 is a single u64 payload (features, counts, acknowledgements).
type U64 uint64

func (v U64) Append(b []byte) []byte { return binary.LittleEndian.AppendUint64(b, uint64(v)) }

// VringState is vhost_vring_state: SET_VRING_NUM/BASE/ENABLE, GET_VRING_BASE.
type VringState struct {
	Index uint32
	Num   uint32
}

func (s VringState) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, s.Index)
	return binary.LittleEndian.AppendUint32(b, s.Num)
}

// VringAddr is vhost_vring_addr (SET_VRING_ADDR). The ring addresses are front-end user virtual
// addresses; Log is guest-physical. Note the wire order: desc, used, avail, log.
type VringAddr struct {
	Index uint32
	Flags uint32
	Desc  uint64
	Used  uint64
	Avail uint64
	Log   uint64
}

func (a VringAddr) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, a.Index)
	b = binary.LittleEndian.AppendUint32(b, a.Flags)
	b = binary.LittleEndian.AppendUint64(b, a.Desc)
	b = binary.LittleEndian.AppendUint64(b, a.Used)
	b = binary.LittleEndian.AppendUint64(b, a.Avail)
	return binary.LittleEndian.AppendUint64(b, a.Log)
}

// VringFile is the u64 payload of SET_VRING_KICK/CALL/ERR.
type VringFile struct {
	Index uint8
	// NoFD: no fd is attached (kick: the ring must be polled; call/err: no notification).
	NoFD bool
}

func (f VringFile) Append(b []byte) []byte {
	v := uint64(f.Index)
	if f.NoFD {
		v |= VringNoFD
	}
	return binary.LittleEndian.AppendUint64(b, v)
}

// MemoryRegion is VhostUserMemoryRegion.
type MemoryRegion struct {
	GuestPhysAddr uint64
	Size          uint64
	UserAddr      uint64 // the front-end's virtual address of the region
	MmapOffset    uint64 // offset of the region inside the fd
}

func (r MemoryRegion) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, r.GuestPhysAddr)
	b = binary.LittleEndian.AppendUint64(b, r.Size)
	b = binary.LittleEndian.AppendUint64(b, r.UserAddr)
	return binary.LittleEndian.AppendUint64(b, r.MmapOffset)
}

func (r MemoryRegion) check() error {
	if r.Size == 0 {
		return invalidf("memory region at gpa %#x has size 0", r.GuestPhysAddr)
	}
	for _, base := range [...]uint64{r.GuestPhysAddr, r.UserAddr, r.MmapOffset} {
		if base > math.MaxUint64-r.Size {
			return invalidf("memory region {gpa %#x size %#x uaddr %#x offset %#x} overflows",
				r.GuestPhysAddr, r.Size, r.UserAddr, r.MmapOffset)
		}
	}
	return nil
}

func parseRegion(b []byte) MemoryRegion {
	return MemoryRegion{
		GuestPhysAddr: binary.LittleEndian.Uint64(b[0:]),
		Size:          binary.LittleEndian.Uint64(b[8:]),
		UserAddr:      binary.LittleEndian.Uint64(b[16:]),
		MmapOffset:    binary.LittleEndian.Uint64(b[24:]),
	}
}

const regionSize = 32

// MemoryTable is the SET_MEM_TABLE payload; the i-th region is backed by the i-th fd.
type MemoryTable struct {
	Regions []MemoryRegion
}

func (t MemoryTable) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(t.Regions)))
	b = binary.LittleEndian.AppendUint32(b, 0)
	for _, r := range t.Regions {
		b = r.Append(b)
	}
	return b
}

// SingleRegion is the ADD_MEM_REG / REM_MEM_REG payload (8 bytes padding, then one region).
type SingleRegion struct {
	Region MemoryRegion
}

func (s SingleRegion) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, 0)
	return s.Region.Append(b)
}

// LogBase is the SET_LOG_BASE payload. Decoded only to be refused: logging is not offered.
type LogBase struct {
	MmapSize   uint64
	MmapOffset uint64
}

func (l LogBase) Append(b []byte) []byte {
	b = binary.LittleEndian.AppendUint64(b, l.MmapSize)
	return binary.LittleEndian.AppendUint64(b, l.MmapOffset)
}

// Opaque is the undecoded payload of a request whose layout this package does not interpret.
type Opaque []byte

func (o Opaque) Append(b []byte) []byte { return append(b, o...) }

// Encode returns header+payload for a request with the given flags.
func Encode(req Request, flags uint32, p Payload) []byte {
	body := p.Append(nil)
	b := Header{Request: req, Flags: flags, Size: uint32(len(body))}.Append(make([]byte, 0, HeaderSize+len(body)))
	return append(b, body...)
}

// Decode checks a request's payload size and fd count against the request table and decodes the
// payload. Padding must be zero (QEMU zeroes it): Decode accepts only what the decoded value
// encodes back to exactly. nfds is the number of fds that arrived with the message. Requests missing from the table
// are rejected; table entries whose layout is not interpreted decode to Opaque.
func Decode(req Request, payload []byte, nfds int) (Payload, error) {
	info, ok := req.info()
	if !ok {
		return nil, invalidf("unknown request %d", uint32(req))
	}
	if len(payload) > MaxPayload {
		return nil, invalidf("%v: payload size %d exceeds %d", req, len(payload), MaxPayload)
	}
	if nfds < 0 || nfds > MaxFDs {
		return nil, invalidf("%v: %d fds, at most %d allowed", req, nfds, MaxFDs)
	}
	wantSize := func(n int) error {
		if len(payload) != n {
			return invalidf("%v: payload is %d bytes, want %d", req, len(payload), n)
		}
		return nil
	}

	var p Payload
	wantFDs := 0
	switch info.payload {
	case payloadNone:
		if err := wantSize(0); err != nil {
			return nil, err
		}
		p = Empty{}
	case payloadU64:
		if err := wantSize(8); err != nil {
			return nil, err
		}
		p = U64(binary.LittleEndian.Uint64(payload))
	case payloadVringState:
		if err := wantSize(8); err != nil {
			return nil, err
		}
		p = VringState{
			Index: binary.LittleEndian.Uint32(payload[0:]),
			Num:   binary.LittleEndian.Uint32(payload[4:]),
		}
	case payloadVringAddr:
		if err := wantSize(40); err != nil {
			return nil, err
		}
		p = VringAddr{
			Index: binary.LittleEndian.Uint32(payload[0:]),
			Flags: binary.LittleEndian.Uint32(payload[4:]),
			Desc:  binary.LittleEndian.Uint64(payload[8:]),
			Used:  binary.LittleEndian.Uint64(payload[16:]),
			Avail: binary.LittleEndian.Uint64(payload[24:]),
			Log:   binary.LittleEndian.Uint64(payload[32:]),
		}
	case payloadVringFile:
		if err := wantSize(8); err != nil {
			return nil, err
		}
		v := binary.LittleEndian.Uint64(payload)
		if v&^(VringIndexMask|VringNoFD) != 0 {
			return nil, invalidf("%v: reserved bits set in %#x", req, v)
		}
		f := VringFile{Index: uint8(v & VringIndexMask), NoFD: v&VringNoFD != 0}
		if !f.NoFD {
			wantFDs = 1
		}
		p = f
	case payloadMemTable:
		if len(payload) < 8 {
			return nil, invalidf("%v: payload is %d bytes, want at least 8", req, len(payload))
		}
		n := binary.LittleEndian.Uint32(payload)
		if pad := binary.LittleEndian.Uint32(payload[4:]); pad != 0 {
			return nil, invalidf("%v: padding is %#x, want 0", req, pad)
		}
		if n > MaxMemTableRegions {
			return nil, invalidf("%v: %d regions, at most %d allowed", req, n, MaxMemTableRegions)
		}
		if err := wantSize(8 + regionSize*int(n)); err != nil {
			return nil, err
		}
		t := MemoryTable{Regions: make([]MemoryRegion, n)}
		for i := range t.Regions {
			t.Regions[i] = parseRegion(payload[8+regionSize*i:])
			if err := t.Regions[i].check(); err != nil {
				return nil, fmt.Errorf("%v: region %d: %w", req, i, err)
			}
		}
		wantFDs = int(n)
		p = t
	case payloadSingleRegion:
		if err := wantSize(8 + regionSize); err != nil {
			return nil, err
		}
		if pad := binary.LittleEndian.Uint64(payload); pad != 0 {
			return nil, invalidf("%v: padding is %#x, want 0", req, pad)
		}
		s := SingleRegion{Region: parseRegion(payload[8:])}
		if err := s.Region.check(); err != nil {
			return nil, fmt.Errorf("%v: %w", req, err)
		}
		p = s
	case payloadLog:
		if err := wantSize(16); err != nil {
			return nil, err
		}
		p = LogBase{
			MmapSize:   binary.LittleEndian.Uint64(payload[0:]),
			MmapOffset: binary.LittleEndian.Uint64(payload[8:]),
		}
	case payloadOpaque:
		p = Opaque(append([]byte(nil), payload...))
	}

	switch info.fds {
	case fdsNone:
		wantFDs = 0
	case fdsOne:
		wantFDs = 1
	case fdsOptional:
		if nfds <= 1 {
			wantFDs = nfds
		} else {
			wantFDs = 1
		}
	case fdsPerRegion, fdsVringFile:
		// wantFDs was set from the payload.
	case fdsAny:
		wantFDs = nfds
	}
	if nfds != wantFDs {
		return nil, invalidf("%v: %d fds attached, want %d", req, nfds, wantFDs)
	}
	return p, nil
}
