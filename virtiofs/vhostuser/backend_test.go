package vhostuser

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/virtq"
)

const (
	wantFeatures = FeatureVersion1 | FeatureIndirectDesc | FeatureEventIdx | FeatureProtocolFeatures | 1<<1
	// Protocol features QEMU 7.2 acks of our offer.
	qemuProtocol = OfferedProtocolFeatures & QEMU72ProtocolMask &^ ProtocolConfig
	guestAcked   = FeatureVersion1 | FeatureIndirectDesc | FeatureEventIdx | FeatureProtocolFeatures
)

// TestBackendQEMUSequence runs QEMU 7.2's exact realize, start, stop and restart (guest reboot)
// sequences, with SET_MEM_TABLE and with CONFIGURE_MEM_SLOTS.
func TestBackendQEMUSequence(t *testing.T) {
	for _, memSlots := range []bool{false, true} {
		name := "SET_MEM_TABLE"
		if memSlots {
			name = "ADD_MEM_REG"
		}
		t.Run(name, func(t *testing.T) {
			checkNoLeak(t)
			r := newRig(t)
			c := r.c

			// Realize.
			f, err := c.GetFeatures()
			must(t, err)
			if f != wantFeatures {
				t.Fatalf("GET_FEATURES = %#x, want %#x", f, wantFeatures)
			}
			pf, err := c.GetProtocolFeatures()
			must(t, err)
			if pf != 0x8429 || pf&ProtocolConfig != 0 {
				t.Fatalf("GET_PROTOCOL_FEATURES = %#x, want 0x8429 without CONFIG", pf)
			}
			ack := pf & QEMU72ProtocolMask &^ ProtocolConfig
			if !memSlots {
				ack &^= ProtocolConfigureMemSlots
			}
			must(t, c.SetProtocolFeatures(ack))
			if n, err := c.GetQueueNum(); err != nil || n != 2 {
				t.Fatalf("GET_QUEUE_NUM = %d, %v", n, err)
			}
			if memSlots {
				if n, err := c.GetMaxMemSlots(); err != nil || n != 32 {
					t.Fatalf("GET_MAX_MEM_SLOTS = %d, %v", n, err)
				}
			}
			sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			must(t, err)
			must(t, c.SetBackendReqFD(sp[1]))
			unix.Close(sp[1])
			defer unix.Close(sp[0])
			if r.b.BackendChannel() == nil {
				t.Fatal("no backend channel after SET_BACKEND_REQ_FD")
			}
			must(t, c.SetOwner())
			if _, err := c.GetFeatures(); err != nil {
				t.Fatal(err)
			}
			masked := eventfds(t, 2)
			errfds := eventfds(t, 2)
			for i := uint8(0); i < 2; i++ {
				must(t, c.SetVringCall(i, masked[i]))
				must(t, c.SetVringErr(i, errfds[i]))
			}

			// Start.
			rings := []*testRing{r.newRing(0, true), r.newRing(1, true)}
			start := func(reboot bool) {
				must(t, c.SetFeatures(guestAcked))
				switch {
				case memSlots && !reboot:
					must(t, c.AddMemReg(r.region(), r.memfd))
				case memSlots && reboot:
					// QEMU diffs against its shadow table: nothing changed, nothing sent.
				default:
					must(t, c.SetMemTable([]MemoryRegion{r.region()}, []int{r.memfd}))
				}
				for _, tr := range rings {
					i := uint32(tr.idx)
					must(t, c.SetVringNum(i, rigRingSz))
					must(t, c.SetVringBase(i, 0))
					must(t, c.SetVringAddr(VringAddr{Index: i, Desc: r.base + tr.drv.DescAddr(),
						Used: r.base + tr.drv.UsedAddr(), Avail: r.base + tr.drv.AvailAddr()}))
					must(t, c.SetVringKick(tr.idx, tr.kick))
				}
				for _, tr := range rings {
					must(t, c.SetVringEnable(uint32(tr.idx), true))
				}
				for _, tr := range rings {
					must(t, c.SetVringCall(tr.idx, tr.call))
					waitEvent(t, tr.call, true)
				}
			}
			start(false)
			r.roundTrip(rings[1])
			r.roundTrip(rings[1])
			// hiprio: FORGET-like, readable only; the device still returns it (0 bytes).
			copy(r.mapping[1<<20:], "forget")
			rings[0].drv.Add([]virtq.Buf{{Addr: 1 << 20, Len: 48}}, nil, nil)
			if rings[0].drv.NeedsKick() {
				kick(t, rings[0].kick)
			}
			waitEvent(t, rings[0].call, true)
			if _, n, ok := rings[0].drv.PopUsed(); !ok || n != 0 {
				t.Fatalf("hiprio: used %v, %d bytes", ok, n)
			}
			if r.dev.calls[1].Load() == 0 || r.dev.calls[0].Load() == 0 {
				t.Fatal("HandleQueue not called on both rings")
			}

			// Stop: ENABLE(0) for all, then GET_VRING_BASE for all.
			for _, tr := range rings {
				must(t, c.SetVringEnable(uint32(tr.idx), false))
			}
			for i, want := range []uint32{1, 2} {
				base, err := c.GetVringBase(uint32(i))
				if err != nil || base != want {
					t.Fatalf("GET_VRING_BASE(%d) = %d, %v; want %d", i, base, err, want)
				}
			}
			// A stopped ring is not served: its goroutine is gone, so nothing can run after
			// GET_VRING_BASE returned.
			before := r.dev.calls[1].Load()
			r.publishEcho(rings[1], 100, false, 1<<20, 2<<20)
			kick(t, rings[1].kick)
			r.sync()
			if r.dev.calls[1].Load() != before {
				t.Fatal("HandleQueue called on a stopped ring")
			}
			if r.dev.resets.Load() != 0 {
				t.Fatal("Reset called by a stop")
			}

			// Guest reboot: fresh rings, base 0, the start sequence again.
			rings = []*testRing{r.newRing(0, true), r.newRing(1, true)}
			start(true)
			r.roundTrip(rings[1])

			c.Close()
			if err := r.wait(); err != nil {
				t.Fatalf("Serve after disconnect = %v, want nil", err)
			}
			if r.dev.resets.Load() != 1 {
				t.Fatalf("Reset called %d times, want 1 (at disconnect)", r.dev.resets.Load())
			}
			if r.b.BackendChannel() != nil {
				t.Fatal("backend channel kept after Serve returned")
			}
		})
	}
}

// rawReply reads one reply from the client's connection without the Client's checks.
func rawReply(t *testing.T, c *Client) *Message {
	t.Helper()
	m, err := c.Conn().ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.FDs) != 0 {
		t.Fatalf("reply carries %d fds", len(m.FDs))
	}
	return m
}

func TestBackendReplyFlags(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	must(t, r.c.SetProtocolFeatures(qemuProtocol))
	for _, req := range []struct {
		req     Request
		flags   uint32
		payload Payload
	}{
		{GetFeatures, Version, Empty{}},
		{GetProtocolFeatures, Version, Empty{}},
		{GetQueueNum, Version, Empty{}},
		{GetMaxMemSlots, Version, Empty{}},
		{GetVringBase, Version, VringState{Index: 1}},
		{SetVringNum, Version | FlagNeedReply, VringState{Index: 1, Num: 8}}, // REPLY_ACK
		{SetVringNum, Version | FlagNeedReply, VringState{Index: 1, Num: 7}}, // REPLY_ACK, failing
		{GetFeatures, Version | FlagNeedReply, Empty{}},                      // own reply only
	} {
		must(t, r.c.Conn().WriteMessage(Header{Request: req.req, Flags: req.flags}, req.payload.Append(nil), nil))
		m := rawReply(t, r.c)
		if m.Flags != 0x5 || m.Request != req.req || m.Size != 8 || len(m.Payload) != 8 {
			t.Errorf("%v: reply header %+v", req.req, m.Header)
		}
	}
	r.sync() // exactly one reply each: the next reply is GET_FEATURES'
}

func TestBackendReplyAck(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	u64 := func(b []byte) uint64 {
		if len(b) != 8 {
			t.Fatalf("ack of %d bytes", len(b))
		}
		return binary.LittleEndian.Uint64(b)
	}

	// Before REPLY_ACK is negotiated NEED_REPLY is ignored: the next reply is GET_FEATURES'.
	must(t, c.Conn().WriteMessage(Header{Request: SetVringNum, Flags: Version | FlagNeedReply},
		VringState{Index: 0, Num: 8}.Append(nil), nil))
	r.sync()

	must(t, c.SetProtocolFeatures(qemuProtocol))
	ack := func(req Request, p []byte, fds []int) uint64 {
		t.Helper()
		b, err := c.Raw(uint32(req), Version|FlagNeedReply, p, fds)
		if err != nil {
			t.Fatalf("%v: %v", req, err)
		}
		return u64(b)
	}
	if v := ack(SetVringNum, VringState{Index: 0, Num: 8}.Append(nil), nil); v != 0 {
		t.Errorf("valid SET_VRING_NUM acked %d", v)
	}
	efd := eventfds(t, 9)
	memfds := make([]int, 9)
	for i := range memfds {
		memfds[i] = r.memfd
	}
	nine := make([]MemoryRegion, 9)
	for i := range nine {
		nine[i] = MemoryRegion{GuestPhysAddr: uint64(i) << 12, Size: 4096, UserAddr: r.base + uint64(i)<<12, MmapOffset: uint64(i) << 12}
	}
	bad := []struct {
		name string
		req  Request
		p    []byte
		fds  []int
	}{
		{"bad num", SetVringNum, VringState{Index: 0, Num: 3}.Append(nil), nil},
		{"num 0", SetVringNum, VringState{Index: 0, Num: 0}.Append(nil), nil},
		{"num 65536", SetVringNum, VringState{Index: 0, Num: 65536}.Append(nil), nil},
		{"index out of range", SetVringNum, VringState{Index: 2, Num: 8}.Append(nil), nil},
		{"unknown id", Request(99), []byte{1, 2, 3}, efd[:2]},
		{"unsupported id", SetConfig, make([]byte, 12), nil},
		{"wrong size", SetFeatures, []byte{1}, nil},
		{"features not offered", SetFeatures, U64(FeatureLogAll | FeatureVersion1).Append(nil), nil},
		{"protocol CONFIG", SetProtocolFeatures, U64(qemuProtocol | ProtocolConfig).Append(nil), nil},
		{"9 regions, 8 fds", SetMemTable, MemoryTable{Regions: nine}.Append(nil), memfds[:8]},
		{"9 regions, no fds", SetMemTable, MemoryTable{Regions: nine}.Append(nil), nil},
		{"fd on SET_OWNER", SetOwner, nil, efd[:1]},
		{"log base", SetLogBase, LogBase{MmapSize: 4096}.Append(nil), efd[:1]},
		{"kick before num/addr", SetVringKick, VringFile{Index: 1}.Append(nil), efd[:1]},
		{"misaligned addr", SetVringAddr, VringAddr{Index: 0, Desc: 8}.Append(nil), nil},
		{"logged addr", SetVringAddr, VringAddr{Index: 0, Flags: VringFlagLog}.Append(nil), nil},
		{"enable 2", SetVringEnable, VringState{Index: 0, Num: 2}.Append(nil), nil},
		{"base > 16 bits", SetVringBase, VringState{Index: 0, Num: 1 << 16}.Append(nil), nil},
		{"region past file end", AddMemReg, SingleRegion{Region: MemoryRegion{Size: 2 * rigMemSize, UserAddr: r.base}}.Append(nil), []int{r.memfd}},
		{"remove unknown region", RemMemReg, SingleRegion{Region: MemoryRegion{Size: 4096}}.Append(nil), nil},
		{"backend fd not a socket", SetBackendReqFD, nil, efd[:1]},
		{"overlapping mem table", SetMemTable, MemoryTable{Regions: []MemoryRegion{r.region(), r.region()}}.Append(nil), []int{r.memfd, r.memfd}},
	}
	must(t, c.SetOwner())
	bad = append(bad, struct {
		name string
		req  Request
		p    []byte
		fds  []int
	}{"second SET_OWNER", SetOwner, nil, nil})
	for _, b := range bad {
		if v := ack(b.req, b.p, b.fds); v == 0 {
			t.Errorf("%s: acked 0, want failure", b.name)
		}
	}
	// The typed Client reports a non-zero ack as ErrNack.
	if err := c.SetMemTable([]MemoryRegion{{Size: 2 * rigMemSize, UserAddr: r.base}}, memfds[:1]); !errors.Is(err, ErrNack) {
		t.Errorf("SetMemTable with a region past the file end: %v, want ErrNack", err)
	}
	r.sync()
	if r.dev.resets.Load() != 0 {
		t.Error("device reset by failed requests")
	}
	// More fds than any message may carry is a framing violation, not a failed request: the
	// connection is closed even though an ack was asked for.
	if err := c.SetMemTable(nine, memfds); err == nil {
		t.Error("SetMemTable with 9 regions and 9 fds succeeded")
	}
	if err := r.wait(); err == nil {
		t.Error("Serve returned nil after 9 fds")
	}
}

// TestBackendBadMessages sends each malformed message without REPLY_ACK: the back-end must close
// the connection with an error, without leaking an fd or panicking.
func TestBackendBadMessages(t *testing.T) {
	region := func(r *rig) []byte { return SingleRegion{Region: r.region()}.Append(nil) }
	tests := []struct {
		name string
		send func(t *testing.T, r *rig)
	}{
		{"wrong size", func(t *testing.T, r *rig) { r.c.Raw(uint32(SetFeatures), Version, []byte{1, 2, 3, 4}, nil) }},
		{"unknown id", func(t *testing.T, r *rig) { r.c.Raw(99, Version, []byte{1}, eventfds(t, 3)) }},
		{"unknown id with NEED_REPLY but no REPLY_ACK", func(t *testing.T, r *rig) {
			r.c.Conn().WriteMessage(Header{Request: 99, Flags: Version | FlagNeedReply}, nil, nil)
		}},
		{"vring index out of range", func(t *testing.T, r *rig) { r.c.SetVringNum(2, 8) }},
		{"kick index out of range", func(t *testing.T, r *rig) { r.c.SetVringKick(200, eventfds(t, 1)[0]) }},
		{"bad num", func(t *testing.T, r *rig) { r.c.SetVringNum(0, 100) }},
		{"9 regions", func(t *testing.T, r *rig) {
			rs := make([]MemoryRegion, 9)
			fds := make([]int, 9)
			for i := range rs {
				rs[i] = MemoryRegion{GuestPhysAddr: uint64(i) << 12, Size: 4096, UserAddr: uint64(i) << 12}
				fds[i] = r.memfd
			}
			r.c.SetMemTable(rs, fds)
		}},
		{"mem table fd count", func(t *testing.T, r *rig) {
			r.c.Raw(uint32(SetMemTable), Version, MemoryTable{Regions: []MemoryRegion{r.region()}}.Append(nil), []int{r.memfd, r.memfd})
		}},
		{"features not offered", func(t *testing.T, r *rig) { r.c.SetFeatures(FeatureVersion1 | FeatureRingPacked) }},
		{"protocol features not offered", func(t *testing.T, r *rig) { r.c.SetProtocolFeatures(ProtocolConfig) }},
		{"fds on SET_OWNER", func(t *testing.T, r *rig) { r.c.Raw(uint32(SetOwner), Version, nil, eventfds(t, 2)) }},
		{"reply flag in request", func(t *testing.T, r *rig) { r.c.Raw(uint32(SetOwner), ReplyFlags, nil, nil) }},
		{"version 0", func(t *testing.T, r *rig) { r.c.Raw(uint32(SetOwner), 0, nil, nil) }},
		{"GET_FEATURES with payload", func(t *testing.T, r *rig) { r.c.Raw(uint32(GetFeatures), Version, []byte{0, 0, 0, 0, 0, 0, 0, 0}, nil) }},
		{"GET_VRING_BASE out of range", func(t *testing.T, r *rig) { r.c.GetVringBase(5) }},
		{"set log base", func(t *testing.T, r *rig) {
			r.c.Raw(uint32(SetLogBase), Version, LogBase{MmapSize: 4096}.Append(nil), []int{r.memfd})
		}},
		{"set log fd", func(t *testing.T, r *rig) { r.c.Raw(uint32(SetLogFD), Version, nil, eventfds(t, 1)) }},
		{"add region without fd", func(t *testing.T, r *rig) { r.c.Raw(uint32(AddMemReg), Version, region(r), nil) }},
		{"kick NOFD with fd", func(t *testing.T, r *rig) {
			r.c.Raw(uint32(SetVringKick), Version, VringFile{Index: 0, NoFD: true}.Append(nil), eventfds(t, 1))
		}},
		{"backend req fd not negotiated", func(t *testing.T, r *rig) { r.c.SetBackendReqFD(eventfds(t, 1)[0]) }},
		{"oversize payload", func(t *testing.T, r *rig) {
			r.c.Conn().write(Header{Request: SetConfig, Flags: Version, Size: MaxPayload + 1}.Append(nil), eventfds(t, 2))
		}},
		{"too many fds", func(t *testing.T, r *rig) {
			r.c.Conn().write(Header{Request: SetConfig, Flags: Version, Size: 1}.Append(nil), nil)
			r.c.Conn().write([]byte{0}, eventfds(t, 12))
		}},
		{"truncated then EOF", func(t *testing.T, r *rig) {
			r.c.Conn().write(Header{Request: SetMemTable, Flags: Version, Size: 40}.Append(nil), []int{r.memfd})
			r.c.Close()
		}},
		{"ring start with unmapped addresses", func(t *testing.T, r *rig) {
			must(t, r.c.SetVringNum(0, 8))
			must(t, r.c.SetVringAddr(VringAddr{Index: 0, Desc: 0x1000, Used: 0x2000, Avail: 0x3000}))
			r.c.SetVringKick(0, eventfds(t, 1)[0])
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkNoLeak(t)
			r := newRig(t)
			tt.send(t, r)
			err := r.wait()
			if err == nil || errors.Is(err, context.Canceled) {
				t.Fatalf("Serve = %v, want a protocol error", err)
			}
			t.Logf("Serve: %v", err)
		})
	}
}

// TestBackendMemTableWhileRunning replaces the memory table under a running ring: split into two
// regions (the ring survives, a buffer may span both), then without the ring's memory (the ring
// breaks and its error fd fires).
func TestBackendMemTableWhileRunning(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol &^ ProtocolConfigureMemSlots)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.SetMemTable([]MemoryRegion{r.region()}, []int{r.memfd}))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, true)
	must(t, c.SetVringErr(1, tr.errf))
	r.sync() // SET_VRING_ERR has no reply: make sure it is applied
	r.roundTrip(tr)

	half := uint64(rigMemSize / 2)
	split := []MemoryRegion{
		{GuestPhysAddr: 0, Size: half, UserAddr: r.base},
		{GuestPhysAddr: half, Size: half, UserAddr: r.base + half, MmapOffset: half},
	}
	must(t, c.SetMemTable(split, []int{r.memfd, r.memfd}))
	r.roundTrip(tr)
	// Request and response straddle the region boundary.
	want := r.publishEcho(tr, 3000, true, half-1000, half+4096-1000)
	kick(t, tr.kick)
	r.expectEcho(tr, want, half+4096-1000)

	// Memory without the rings: remapping fails, the back-end nacks and breaks the ring.
	if err := c.SetMemTable(split[1:], []int{r.memfd}); !errors.Is(err, ErrNack) {
		t.Fatalf("SET_MEM_TABLE dropping the ring: %v, want ErrNack", err)
	}
	waitEvent(t, tr.errf, true)
	before := r.dev.calls[1].Load()
	kick(t, tr.kick)
	r.sync()
	if base, err := c.GetVringBase(1); err != nil || base != 3 {
		t.Fatalf("GET_VRING_BASE of a broken ring = %d, %v", base, err)
	}
	if r.dev.calls[1].Load() != before {
		t.Fatal("broken ring served")
	}
	c.Close()
	if err := r.wait(); err != nil {
		t.Fatal(err)
	}
}

// TestBackendAddRemMemReg puts the rings in one region and the buffers in another, removes the
// buffer region and checks the next request breaks the ring instead of touching unmapped memory.
func TestBackendAddRemMemReg(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	low := MemoryRegion{GuestPhysAddr: 0, Size: 1 << 20, UserAddr: r.base}
	high := MemoryRegion{GuestPhysAddr: 1 << 20, Size: 3 << 20, UserAddr: r.base + 1<<20, MmapOffset: 1 << 20}
	must(t, c.AddMemReg(low, r.memfd))
	tr := r.newRing(1, false)
	r.startRing(tr, 0, true)
	must(t, c.SetVringErr(1, tr.errf))
	r.sync() // SET_VRING_ERR has no reply: make sure it is applied
	// Buffers in a region added while the ring runs.
	must(t, c.AddMemReg(high, r.memfd))
	r.roundTrip(tr)
	if err := c.AddMemReg(high, r.memfd); !errors.Is(err, ErrNack) {
		t.Fatalf("adding an overlapping region: %v, want ErrNack", err)
	}
	// mmap_offset is ignored when matching.
	h2 := high
	h2.MmapOffset = 12345
	must(t, c.RemMemReg(h2))
	if err := c.RemMemReg(high); !errors.Is(err, ErrNack) {
		t.Fatalf("removing a removed region: %v, want ErrNack", err)
	}
	r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	kick(t, tr.kick)
	waitEvent(t, tr.errf, true)
	if _, _, ok := tr.drv.PopUsed(); ok {
		t.Fatal("request on unmapped memory completed")
	}
	// The ring can be restarted after the guest resets it.
	_, err := c.GetVringBase(1)
	must(t, err)
	must(t, c.AddMemReg(high, r.memfd))
	tr = r.newRing(1, false)
	r.startRing(tr, 0, true)
	r.roundTrip(tr)
}

func TestBackendCallSwap(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, true)
	r.roundTrip(tr)

	old := tr.call
	tr.call = eventfds(t, 1)[0]
	unix.SetNonblock(tr.call, true)
	must(t, c.SetVringCall(1, tr.call))
	waitEvent(t, tr.call, true) // signalled once on installation, like libvhost-user
	for range 3 {
		r.roundTrip(tr)
	}
	waitEvent(t, old, false)

	// NOFD: no notifications.
	must(t, c.SetVringCall(1, -1))
	r.sync()
	r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	kick(t, tr.kick)
	waitEvent(t, tr.call, false)
	r.sync()
}

func TestBackendPolledRing(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t, WithPollInterval(time.Millisecond))
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked&^FeatureEventIdx))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, false)
	must(t, c.SetVringNum(1, rigRingSz))
	must(t, c.SetVringBase(1, 0))
	must(t, c.SetVringAddr(VringAddr{Index: 1, Desc: r.base + tr.drv.DescAddr(),
		Used: r.base + tr.drv.UsedAddr(), Avail: r.base + tr.drv.AvailAddr()}))
	must(t, c.SetVringKick(1, -1)) // NOFD: polled
	must(t, c.SetVringEnable(1, true))
	must(t, c.SetVringCall(1, tr.call))
	waitEvent(t, tr.call, true)
	for range 3 {
		want := r.publishEcho(tr, 500, false, 1<<20, 2<<20)
		r.expectEcho(tr, want, 2<<20) // no kick
	}
}

func TestBackendEnable(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, false) // started, not enabled
	want := r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	kick(t, tr.kick)
	waitEvent(t, tr.call, false)
	must(t, c.SetVringEnable(1, true)) // processes what arrived while disabled
	r.expectEcho(tr, want, 2<<20)

	// Without PROTOCOL_FEATURES rings are enabled as soon as they start.
	r2 := newRig(t)
	r2.realize(qemuProtocol)
	must(t, r2.c.SetFeatures(guestAcked&^FeatureProtocolFeatures))
	must(t, r2.c.AddMemReg(r2.region(), r2.memfd))
	tr2 := r2.newRing(0, true)
	r2.startRing(tr2, 0, false)
	r2.roundTrip(tr2)
}

// TestBackendDisableWaitsForBatch: SET_VRING_ENABLE(0) is handled only once a batch the device
// is in has ended, and no chain is taken from the ring after it, not even by that batch: the
// front-end may count on a disabled ring from the moment it sees the message handled.
func TestBackendDisableWaitsForBatch(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, true)
	release := sync.OnceFunc(func() { close(r.dev.hold) })
	t.Cleanup(release) // before the rig's: Serve cannot return while the device holds

	const holdGPA, holdResp = 3 << 20, 3<<20 + 4096
	copy(r.mapping[holdGPA:], "HOLD")
	if _, err := tr.drv.Add([]virtq.Buf{{Addr: holdGPA, Len: 4}}, []virtq.Buf{{Addr: holdResp, Len: 4}}, nil); err != nil {
		t.Fatal(err)
	}
	kick(t, tr.kick)
	select {
	case <-r.dev.holding:
	case <-time.After(5 * time.Second):
		t.Fatal("the device never took the HOLD chain")
	}
	must(t, c.SetVringEnable(1, false))
	handled := make(chan error, 1)
	go func() { _, err := c.GetFeatures(); handled <- err }() // answered after SET_VRING_ENABLE
	select {
	case err := <-handled:
		t.Fatalf("SET_VRING_ENABLE(0) handled (GET_FEATURES after it: %v) while the device is in a batch", err)
	case <-time.After(100 * time.Millisecond):
	}
	release()
	select {
	case err := <-handled:
		must(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("SET_VRING_ENABLE(0) not handled after the batch ended")
	}
	waitEvent(t, tr.call, true) // the HOLD chain, published before the disable, is answered
	if _, written, ok := tr.drv.PopUsed(); !ok || written != 4 {
		t.Fatalf("HOLD chain: used %v, written %d", ok, written)
	}
	tr.drv.EnableInterrupts()

	want := r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	kick(t, tr.kick)
	waitEvent(t, tr.call, false)
	if _, _, ok := tr.drv.PopUsed(); ok {
		t.Fatal("a chain published after SET_VRING_ENABLE(0) was handled was taken from the disabled ring")
	}
	must(t, c.SetVringEnable(1, true))
	r.expectEcho(tr, want, 2<<20)
}

func TestBackendDeviceFailure(t *testing.T) {
	for _, mode := range []string{"FAIL", "PANIC"} {
		checkNoLeak(t)
		r := newRig(t)
		c := r.c
		r.realize(qemuProtocol)
		must(t, c.SetFeatures(guestAcked))
		must(t, c.AddMemReg(r.region(), r.memfd))
		tr := r.newRing(1, true)
		r.startRing(tr, 0, true)
		must(t, c.SetVringErr(1, tr.errf))
		r.sync() // SET_VRING_ERR has no reply: make sure it is applied
		r.roundTrip(tr)
		copy(r.mapping[1<<20:], mode)
		tr.drv.Add([]virtq.Buf{{Addr: 1 << 20, Len: 16}}, []virtq.Buf{{Addr: 2 << 20, Len: 16}}, nil)
		kick(t, tr.kick)
		waitEvent(t, tr.errf, true)
		// Further kicks are ignored; the process is alive.
		r.publishEcho(tr, 100, false, 1<<20, 2<<20)
		kick(t, tr.kick)
		r.sync()
		// Stopped and restarted (the guest resets the device), the ring works again.
		base, err := c.GetVringBase(1)
		must(t, err)
		if base != 2 {
			t.Fatalf("%s: base %d, want 2 (the failing chain was popped)", mode, base)
		}
		tr = r.newRing(1, true)
		r.startRing(tr, 0, true)
		r.roundTrip(tr)
	}
}

func TestBackendResetDevice(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, true)
	r.roundTrip(tr)
	must(t, c.ResetDevice())
	r.sync()
	if r.dev.resets.Load() != 1 {
		t.Fatal("Reset not called")
	}
	before := r.dev.calls[1].Load()
	r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	kick(t, tr.kick)
	r.sync()
	if r.dev.calls[1].Load() != before {
		t.Fatal("ring served after RESET_DEVICE")
	}
	// Reconfigured from scratch it works again.
	must(t, c.SetFeatures(guestAcked))
	tr = r.newRing(1, true)
	r.startRing(tr, 0, true)
	r.roundTrip(tr)
}

func TestBackendCancel(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	r.realize(qemuProtocol)
	must(t, r.c.SetFeatures(guestAcked))
	must(t, r.c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	r.startRing(tr, 0, true)
	r.roundTrip(tr)
	r.cancel()
	if err := r.wait(); !errors.Is(err, context.Canceled) {
		t.Fatalf("Serve = %v, want context.Canceled", err)
	}
	if _, err := r.c.GetFeatures(); err == nil {
		t.Fatal("connection still open after Serve returned")
	}
}

func TestBackendChannel(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	must(t, r.c.SetProtocolFeatures(qemuProtocol))
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	must(t, err)
	defer unix.Close(sp[0])
	must(t, r.c.SetBackendReqFD(sp[1]))
	unix.Close(sp[1])
	ch := r.b.BackendChannel()
	if ch == nil {
		t.Fatal("no backend channel")
	}
	must(t, ch.WriteMessage(Header{Request: Request(BackendVringHostNotifier), Flags: Version}, make([]byte, 24), nil))
	var b [HeaderSize + 24]byte
	if n, err := unix.Read(sp[0], b[:]); err != nil || n != len(b) || binary.LittleEndian.Uint32(b[:]) != 3 {
		t.Fatalf("read %d bytes, %v: % x", n, err, b[:n])
	}
	if BackendVringHostNotifier.String() != "BACKEND_VRING_HOST_NOTIFIER_MSG" {
		t.Error(BackendVringHostNotifier.String())
	}
	r.c.Close()
	if err := r.wait(); err != nil {
		t.Fatal(err)
	}
	// The channel is closed with the connection.
	if n, err := unix.Read(sp[0], b[:]); n != 0 || err != nil {
		t.Fatalf("backend channel still open: %d, %v", n, err)
	}
}

func TestBackendServeTwice(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	r.sync()
	a, b := socketPair(t)
	defer b.Close()
	if err := r.b.Serve(context.Background(), a); err == nil {
		t.Fatal("second concurrent Serve accepted")
	}
	r.c.Close()
	if err := r.wait(); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
}

// TestBackendHostileKickFD hands the back-end a pipe whose writer is gone and a regular file as
// kick fds: the ring breaks (error fd signalled) instead of spinning.
func TestBackendHostileKickFD(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, true)
	must(t, c.SetVringErr(1, tr.errf))

	var p [2]int
	must(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
	unix.Close(p[1])
	tr.kick = p[0]
	r.startRing(tr, 0, true)
	unix.Close(p[0])
	waitEvent(t, tr.errf, true)
	_, err := c.GetVringBase(1)
	must(t, err)

	fd, err := unix.MemfdCreate("kick", unix.MFD_CLOEXEC)
	must(t, err)
	unix.Write(fd, []byte("0123456789abcdef"))
	tr.kick = fd
	r.startRing(tr, 0, true)
	unix.Close(fd)
	waitEvent(t, tr.errf, true)
	r.sync()
}

func TestBackendRingProcs(t *testing.T) {
	checkNoLeak(t)
	base := runtime.GOMAXPROCS(0)
	procs := func(want int, when string) {
		t.Helper()
		if got := runtime.GOMAXPROCS(0); got != want {
			t.Fatalf("%s: GOMAXPROCS %d, want %d (%d found, one more per running ring)", when, got, want, base)
		}
	}
	r := newRig(t, WithRingProcs())
	c := r.c
	r.realize(qemuProtocol)
	must(t, c.SetFeatures(guestAcked))
	must(t, c.AddMemReg(r.region(), r.memfd))
	tr0, tr1 := r.newRing(0, true), r.newRing(1, true)
	r.startRing(tr0, 0, true)
	procs(base+1, "one ring started")
	r.startRing(tr1, 0, true)
	procs(base+2, "two rings started")
	r.roundTrip(tr1)
	if _, err := c.GetVringBase(1); err != nil { // stops ring 1
		t.Fatal(err)
	}
	procs(base+1, "ring 1 stopped")
	r.roundTrip(tr0)
	c.Close()
	if err := r.wait(); err != nil {
		t.Fatal(err)
	}
	procs(base, "front-end gone")

	// Without the option nothing changes.
	r2 := newRig(t)
	r2.realize(qemuProtocol)
	must(t, r2.c.SetFeatures(guestAcked))
	must(t, r2.c.AddMemReg(r2.region(), r2.memfd))
	tr := r2.newRing(1, true)
	r2.startRing(tr, 0, true)
	r2.roundTrip(tr)
	procs(base, "a ring of a Backend without WithRingProcs")
}
