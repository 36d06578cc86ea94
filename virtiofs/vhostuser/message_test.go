package vhostuser

import (
	"encoding/binary"
	"errors"
	"reflect"
	"testing"
)

func TestRequestTable(t *testing.T) {
	seen := map[string]Request{}
	for r := Request(0); r < Request(len(requests)); r++ {
		info, ok := r.info()
		if !ok {
			if r != 0 {
				t.Errorf("request %d missing from the table", r)
			}
			continue
		}
		if prev, dup := seen[info.name]; dup {
			t.Errorf("name %s used by %d and %d", info.name, prev, r)
		}
		seen[info.name] = r
		if r.String() != info.name {
			t.Errorf("String(%d) = %q", r, r.String())
		}
	}
	if got := Request(41).String(); got != "REQUEST_41" {
		t.Errorf("unknown request name %q", got)
	}
	for _, r := range []Request{GetFeatures, GetProtocolFeatures, GetQueueNum, GetVringBase, GetMaxMemSlots} {
		if !r.HasReply() {
			t.Errorf("%v should have a reply of its own", r)
		}
	}
	for _, r := range []Request{SetFeatures, SetMemTable, AddMemReg, SetBackendReqFD, SetVringKick, Request(99)} {
		if r.HasReply() {
			t.Errorf("%v should not have a reply of its own", r)
		}
	}
	if OfferedProtocolFeatures&ProtocolConfig != 0 {
		t.Fatal("CONFIG must never be offered")
	}
}

func TestHeader(t *testing.T) {
	h := Header{Request: SetVringNum, Flags: Version | FlagNeedReply, Size: 8}
	b := h.Append(nil)
	if len(b) != HeaderSize {
		t.Fatalf("header is %d bytes", len(b))
	}
	if want := []byte{8, 0, 0, 0, 9, 0, 0, 0, 8, 0, 0, 0}; !reflect.DeepEqual(b, want) {
		t.Fatalf("header bytes %v, want %v", b, want)
	}
	got, err := ParseHeader(b)
	if err != nil || got != h {
		t.Fatalf("ParseHeader = %+v, %v", got, err)
	}
	if _, err := ParseHeader(b[:11]); !errors.Is(err, ErrInvalid) {
		t.Errorf("short header: %v", err)
	}
	if err := h.CheckRequest(); err != nil {
		t.Errorf("valid request header: %v", err)
	}
	for _, bad := range []Header{
		{Request: SetOwner, Flags: 0},
		{Request: SetOwner, Flags: 2},
		{Request: SetOwner, Flags: ReplyFlags},
		{Request: SetOwner, Flags: Version | 0x10},
		{Request: SetOwner, Flags: Version, Size: MaxPayload + 1},
	} {
		if err := bad.CheckRequest(); !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckRequest(%+v) = %v", bad, err)
		}
	}
	reply := Header{Request: GetFeatures, Flags: ReplyFlags, Size: 8}
	if err := reply.CheckReply(uint32(GetFeatures)); err != nil {
		t.Errorf("valid reply: %v", err)
	}
	for _, bad := range []Header{
		{Request: GetFeatures, Flags: Version},
		{Request: GetFeatures, Flags: ReplyFlags | FlagNeedReply},
		{Request: GetProtocolFeatures, Flags: ReplyFlags},
		{Request: GetFeatures, Flags: ReplyFlags, Size: MaxPayload + 1},
	} {
		if err := bad.CheckReply(uint32(GetFeatures)); !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckReply(%+v) = %v", bad, err)
		}
	}
}

func TestPayloadLayouts(t *testing.T) {
	// Byte offsets from the vhost-user spec (reference §1.3).
	a := VringAddr{Index: 1, Flags: 2, Desc: 3, Used: 4, Avail: 5, Log: 6}.Append(nil)
	if len(a) != 40 || binary.LittleEndian.Uint64(a[16:]) != 4 || binary.LittleEndian.Uint64(a[24:]) != 5 {
		t.Errorf("vring addr layout: % x", a)
	}
	r := SingleRegion{Region: MemoryRegion{1, 2, 3, 4}}.Append(nil)
	if len(r) != 40 || binary.LittleEndian.Uint64(r[0:]) != 0 || binary.LittleEndian.Uint64(r[8:]) != 1 ||
		binary.LittleEndian.Uint64(r[32:]) != 4 {
		t.Errorf("single region layout: % x", r)
	}
	m := MemoryTable{Regions: make([]MemoryRegion, 8)}.Append(nil)
	if len(m) != 8+32*8 || binary.LittleEndian.Uint32(m) != 8 {
		t.Errorf("memory table layout: %d bytes", len(m))
	}
	f := VringFile{Index: 3, NoFD: true}.Append(nil)
	if binary.LittleEndian.Uint64(f) != 0x103 {
		t.Errorf("vring file: % x", f)
	}
}

func TestDecodeRoundTrip(t *testing.T) {
	region := MemoryRegion{GuestPhysAddr: 0x1000, Size: 0x10000, UserAddr: 0x7f0000000000, MmapOffset: 0x1000}
	tests := []struct {
		req  Request
		p    Payload
		nfds int
	}{
		{GetFeatures, Empty{}, 0},
		{SetFeatures, U64(0x1_7000_0000), 0},
		{SetOwner, Empty{}, 0},
		{SetProtocolFeatures, U64(0x842b), 0},
		{SetVringNum, VringState{Index: 1, Num: 1024}, 0},
		{SetVringBase, VringState{Index: 0, Num: 7}, 0},
		{GetVringBase, VringState{Index: 1}, 0},
		{SetVringEnable, VringState{Index: 1, Num: 1}, 0},
		{SetVringAddr, VringAddr{Index: 1, Desc: 0x1000, Used: 0x3000, Avail: 0x2000}, 0},
		{SetVringKick, VringFile{Index: 1}, 1},
		{SetVringCall, VringFile{Index: 0, NoFD: true}, 0},
		{SetVringErr, VringFile{Index: 255}, 1},
		{SetMemTable, MemoryTable{Regions: []MemoryRegion{region, {GuestPhysAddr: 0x100000, Size: 1, UserAddr: 1}}}, 2},
		{SetMemTable, MemoryTable{Regions: []MemoryRegion{}}, 0},
		{AddMemReg, SingleRegion{Region: region}, 1},
		{RemMemReg, SingleRegion{Region: region}, 0},
		{RemMemReg, SingleRegion{Region: region}, 1},
		{SetBackendReqFD, Empty{}, 1},
		{SetLogBase, LogBase{MmapSize: 4096, MmapOffset: 0}, 1},
		{GetConfig, Opaque{1, 2, 3}, 0},
		{ResetDevice, Empty{}, 0},
		{GetMaxMemSlots, Empty{}, 0},
	}
	for _, tt := range tests {
		b := Encode(tt.req, Version, tt.p)
		h, err := ParseHeader(b[:HeaderSize])
		if err != nil || h.Request != tt.req || int(h.Size) != len(b)-HeaderSize {
			t.Fatalf("%v: header %+v, %v", tt.req, h, err)
		}
		got, err := Decode(tt.req, b[HeaderSize:], tt.nfds)
		if err != nil {
			t.Errorf("%v: Decode: %v", tt.req, err)
			continue
		}
		if !reflect.DeepEqual(got, tt.p) {
			t.Errorf("%v: round trip %#v, want %#v", tt.req, got, tt.p)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	u64 := func(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
	table := func(n uint32, size int) []byte {
		b := binary.LittleEndian.AppendUint32(nil, n)
		b = append(b, 0, 0, 0, 0)
		for i := 0; i < int(n); i++ {
			b = MemoryRegion{GuestPhysAddr: uint64(i) << 20, Size: 4096, UserAddr: uint64(i) << 20}.Append(b)
		}
		return b[:size]
	}
	tests := []struct {
		name    string
		req     Request
		payload []byte
		nfds    int
	}{
		{"unknown id", Request(99), nil, 0},
		{"id 0", Request(0), nil, 0},
		{"GET_FEATURES with payload", GetFeatures, u64(0), 0},
		{"SET_FEATURES short", SetFeatures, []byte{1, 2, 3, 4}, 0},
		{"SET_FEATURES long", SetFeatures, make([]byte, 16), 0},
		{"SET_OWNER with fd", SetOwner, nil, 1},
		{"SET_FEATURES with fd", SetFeatures, u64(0), 1},
		{"vring state short", SetVringNum, make([]byte, 4), 0},
		{"vring addr short", SetVringAddr, make([]byte, 32), 0},
		{"kick without fd", SetVringKick, u64(1), 0},
		{"kick NOFD with fd", SetVringKick, u64(0x101), 1},
		{"kick two fds", SetVringKick, u64(1), 2},
		{"kick reserved bits", SetVringKick, u64(1 << 9), 1},
		{"call reserved bits", SetVringCall, u64(1<<63 | 0x100), 0},
		{"mem table 9 regions", SetMemTable, table(9, 8+32*9), 9},
		{"mem table huge count", SetMemTable, binary.LittleEndian.AppendUint32(nil, 0xffffffff), 0},
		{"mem table truncated", SetMemTable, table(2, 8+32+16), 2},
		{"mem table too few fds", SetMemTable, table(2, 8+64), 1},
		{"mem table too many fds", SetMemTable, table(2, 8+64), 3},
		{"mem table shorter than header", SetMemTable, []byte{1, 0}, 0},
		{"mem table zero-size region", SetMemTable, MemoryTable{Regions: []MemoryRegion{{Size: 0}}}.Append(nil), 1},
		{"mem table wrapping region", SetMemTable, MemoryTable{Regions: []MemoryRegion{{GuestPhysAddr: 1 << 63, Size: 1 << 63}}}.Append(nil), 1},
		{"mem table non-zero padding", SetMemTable, func() []byte { b := table(1, 8+32); b[5] = 1; return b }(), 1},
		{"add region non-zero padding", AddMemReg, func() []byte {
			b := SingleRegion{Region: MemoryRegion{Size: 4096}}.Append(nil)
			b[7] = 0x80
			return b
		}(), 1},
		{"rem region non-zero padding", RemMemReg, append(u64(1), MemoryRegion{Size: 4096}.Append(nil)...), 0},
		{"add region without fd", AddMemReg, SingleRegion{Region: MemoryRegion{Size: 1}}.Append(nil), 0},
		{"add region short", AddMemReg, make([]byte, 32), 1},
		{"add region wrapping uaddr", AddMemReg, SingleRegion{Region: MemoryRegion{Size: 2, UserAddr: ^uint64(0)}}.Append(nil), 1},
		{"add region wrapping offset", AddMemReg, SingleRegion{Region: MemoryRegion{Size: 2, MmapOffset: ^uint64(0)}}.Append(nil), 1},
		{"rem region two fds", RemMemReg, SingleRegion{Region: MemoryRegion{Size: 1}}.Append(nil), 2},
		{"backend fd missing", SetBackendReqFD, nil, 0},
		{"too many fds", SetConfig, nil, MaxFDs + 1},
		{"negative fds", SetOwner, nil, -1},
		{"oversize opaque", GetConfig, make([]byte, MaxPayload+1), 0},
	}
	for _, tt := range tests {
		if p, err := Decode(tt.req, tt.payload, tt.nfds); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: Decode = %#v, %v; want ErrInvalid", tt.name, p, err)
		}
	}
}
