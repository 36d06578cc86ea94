package virtq

import (
	"encoding/binary"
	"errors"
	"fmt"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

func mustAdd(t testing.TB, d *Driver, r, w []Buf, ind *Buf) uint16 {
	t.Helper()
	h, err := d.Add(r, w, ind)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func mustNext(t testing.TB, q *Queue, c *Chain) {
	t.Helper()
	ok, err := q.Next(c)
	if err != nil || !ok {
		t.Fatalf("Next = %v, %v; want a chain", ok, err)
	}
}

func mustBeEmpty(t testing.TB, q *Queue) {
	t.Helper()
	var c Chain
	if ok, err := q.Next(&c); ok || err != nil {
		t.Fatalf("Next = %v, %v; want empty queue", ok, err)
	}
}

// checkChain verifies that c's buffers are exactly the guest memory of want, in order.
func (r *rig) checkChain(t testing.TB, bufs [][]byte, want []Buf) {
	t.Helper()
	var wantSlices [][]byte
	var total uint64
	for _, b := range want {
		if b.Len == 0 {
			continue
		}
		s, err := r.mem.AppendIovecs(nil, b.Addr, uint64(b.Len))
		if err != nil {
			t.Fatal(err)
		}
		wantSlices = append(wantSlices, s...)
		total += uint64(b.Len)
	}
	if len(bufs) != len(wantSlices) {
		t.Fatalf("%d buffers, want %d", len(bufs), len(wantSlices))
	}
	for i := range bufs {
		if !sameMem(bufs[i], wantSlices[i]) || cap(bufs[i]) != len(bufs[i]) {
			t.Fatalf("buffer %d: wrong memory (len %d cap %d, want len %d)", i, len(bufs[i]), cap(bufs[i]), len(wantSlices[i]))
		}
	}
}

func TestRoundTripDirect(t *testing.T) {
	r := newRig(t, rigOpts{})
	rd := []Buf{{dataGPA, 40}, {dataGPA + 0x100, 8}}
	wr := []Buf{{dataGPA + 0x200, 100}, {dataGPA + 0x400, 4096}}
	copy(r.bytes(t, dataGPA, 40), "hello from the guest")
	head := mustAdd(t, r.d, rd, wr, nil)
	if r.d.NumFree() != 4 {
		t.Fatalf("NumFree = %d", r.d.NumFree())
	}

	var c Chain
	mustNext(t, r.q, &c)
	if c.Head != head || c.InLen != 48 || c.OutLen != 4196 {
		t.Fatalf("chain head %d in %d out %d", c.Head, c.InLen, c.OutLen)
	}
	r.checkChain(t, c.In, rd)
	r.checkChain(t, c.Out, wr)
	if string(c.In[0][:20]) != "hello from the guest" {
		t.Fatalf("In[0] = %q", c.In[0][:20])
	}
	copy(c.Out[0], "reply")
	mustBeEmpty(t, r.q)

	r.q.Complete(c.Head, 5)
	if !r.q.NeedsNotify() {
		t.Fatal("no interrupt without NO_INTERRUPT")
	}
	if r.q.NeedsNotify() {
		t.Fatal("interrupt with nothing completed")
	}
	h, n, ok := r.d.PopUsed()
	if !ok || h != head || n != 5 || string(r.bytes(t, dataGPA+0x200, 5)) != "reply" {
		t.Fatalf("PopUsed = %d, %d, %v", h, n, ok)
	}
	if _, _, ok := r.d.PopUsed(); ok {
		t.Fatal("second PopUsed")
	}
	if r.d.NumFree() != 8 || r.q.LastAvail() != 1 {
		t.Fatalf("NumFree %d LastAvail %d", r.d.NumFree(), r.q.LastAvail())
	}
}

func TestRoundTripIndirect(t *testing.T) {
	r := newRig(t, rigOpts{indirect: true})
	rd := []Buf{{dataGPA, 16}, {dataGPA + 0x100, 32}}
	wr := []Buf{{dataGPA + 0x200, 64}, {dataGPA + 0x300, 128}, {dataGPA + 0x400, 0}}
	ind := Buf{0x6000, 0x100}
	head := mustAdd(t, r.d, rd, wr, &ind)
	if r.d.NumFree() != 7 {
		t.Fatalf("indirect chain took %d descriptors", 8-r.d.NumFree())
	}
	var c Chain
	mustNext(t, r.q, &c)
	if c.Head != head || c.InLen != 48 || c.OutLen != 192 {
		t.Fatalf("chain head %d in %d out %d", c.Head, c.InLen, c.OutLen)
	}
	r.checkChain(t, c.In, rd)
	r.checkChain(t, c.Out, wr)
	r.q.Complete(head, 192)
	if h, n, ok := r.d.PopUsed(); !ok || h != head || n != 192 || r.d.NumFree() != 8 {
		t.Fatalf("PopUsed = %d, %d, %v", h, n, ok)
	}

	// An indirect table too small for the chain is refused by the driver.
	if _, err := r.d.Add(rd, wr, &Buf{0x6000, 16*5 - 1}); err == nil {
		t.Fatal("Add accepted a too-small indirect table")
	}
}

// Direct descriptors followed by one INDIRECT (spec: the device must handle it), with the WRITE
// flag on the indirect descriptor, which the device must ignore.
func TestDirectThenIndirect(t *testing.T) {
	r := newRig(t, rigOpts{indirect: true})
	if err := r.d.WriteIndirect(0x6000, []RawDesc{
		{dataGPA + 0x100, 10, DescFNext, 1},
		{dataGPA + 0x200, 20, DescFWrite | DescFNext, 2},
		{dataGPA + 0x300, 30, DescFWrite, 0},
	}); err != nil {
		t.Fatal(err)
	}
	r.d.WriteDesc(3, dataGPA, 5, DescFNext, 6)
	r.d.WriteDesc(6, 0x6000, 48, DescFIndirect|DescFWrite, 0)
	r.d.Publish(3)
	var c Chain
	mustNext(t, r.q, &c)
	r.checkChain(t, c.In, []Buf{{dataGPA, 5}, {dataGPA + 0x100, 10}})
	r.checkChain(t, c.Out, []Buf{{dataGPA + 0x200, 20}, {dataGPA + 0x300, 30}})
	if c.Head != 3 || c.InLen != 15 || c.OutLen != 50 {
		t.Fatalf("head %d in %d out %d", c.Head, c.InLen, c.OutLen)
	}
}

func TestZeroLengthDescriptorsSkipped(t *testing.T) {
	r := newRig(t, rigOpts{})
	// A zero-length writable before a readable is not an ordering violation: it is no buffer.
	// A zero-length descriptor's address is never used, so it may be anything.
	r.d.WriteDesc(0, 0xdead_beef_0000_0000, 0, DescFWrite|DescFNext, 1)
	r.d.WriteDesc(1, dataGPA, 8, DescFNext, 2)
	r.d.WriteDesc(2, dataGPA+8, 8, DescFWrite, 0)
	r.d.Publish(0)
	var c Chain
	mustNext(t, r.q, &c)
	r.checkChain(t, c.In, []Buf{{dataGPA, 8}})
	r.checkChain(t, c.Out, []Buf{{dataGPA + 8, 8}})
}

func TestChainOfQueueSizeIsNotALoop(t *testing.T) {
	r := newRig(t, rigOpts{size: 4})
	for i := range uint16(4) {
		flags := uint16(DescFNext)
		if i == 3 {
			flags = 0
		}
		r.d.WriteDesc(i, dataGPA+uint64(i)*16, 16, flags, i+1)
	}
	r.d.Publish(0)
	var c Chain
	mustNext(t, r.q, &c)
	if c.InLen != 64 || len(c.In) != 4 {
		t.Fatalf("in %d bytes in %d buffers", c.InLen, len(c.In))
	}
}

func TestChainSpanningRegions(t *testing.T) {
	r := newRig(t, rigOpts{indirect: true})
	// A readable buffer crossing from A into B, and a writable one crossing too.
	rd := []Buf{{gpaB - 0x10, 0x30}}
	wr := []Buf{{gpaB - 0x1, 2}}
	mustAdd(t, r.d, rd, wr, nil)
	var c Chain
	mustNext(t, r.q, &c)
	if len(c.In) != 2 || len(c.In[0]) != 0x10 || len(c.In[1]) != 0x20 || len(c.Out) != 2 {
		t.Fatalf("In split as %d buffers, Out as %d", len(c.In), len(c.Out))
	}
	r.checkChain(t, c.In, rd)
	r.checkChain(t, c.Out, wr)
	if !sameMem(c.In[1], r.backing[1][:0x20]) {
		t.Fatal("second part is not the start of region B")
	}

	// The same through an indirect table.
	mustAdd(t, r.d, rd, wr, &Buf{0x6000, 32})
	mustNext(t, r.q, &c)
	r.checkChain(t, c.In, rd)
	r.checkChain(t, c.Out, wr)
}

func TestIndexWrapAround(t *testing.T) {
	for _, start := range []uint16{65535 - 20, 65535, 65530} {
		for _, ev := range []bool{false, true} {
			r := newRig(t, rigOpts{size: 4, lastAvail: start, eventIdx: ev})
			var c Chain
			seq := 0
			for round := range 20 {
				// Fill the queue, pop everything, complete in reverse order.
				for k := range 4 {
					b := Buf{dataGPA + uint64(k)*0x100, 8}
					binary.LittleEndian.PutUint64(r.bytes(t, b.Addr, 8), uint64(seq+k))
					mustAdd(t, r.d, []Buf{b}, nil, nil)
				}
				var got []uint16
				for k := range 4 {
					mustNext(t, r.q, &c)
					if v := binary.LittleEndian.Uint64(c.In[0]); v != uint64(seq+k) {
						t.Fatalf("start %d round %d: chain %d carries %d", start, round, k, v)
					}
					got = append(got, c.Head)
				}
				mustBeEmpty(t, r.q)
				for k := 3; k >= 0; k-- {
					r.q.Complete(got[k], uint32(k))
				}
				if !r.q.NeedsNotify() && !ev {
					t.Fatal("no notification")
				}
				for k := 3; k >= 0; k-- {
					h, n, ok := r.d.PopUsed()
					if !ok || h != got[k] || n != uint32(k) {
						t.Fatalf("PopUsed = %d, %d, %v; want %d", h, n, ok, got[k])
					}
				}
				seq += 4
			}
			if want := start + 80; r.q.LastAvail() != want || r.q.usedIdx != want {
				t.Fatalf("start %d: LastAvail %d used %d, want %d", start, r.q.LastAvail(), r.q.usedIdx, want)
			}
		}
	}
}

func TestManyInFlight(t *testing.T) {
	const size = 64
	r := newRig(t, rigOpts{size: size, indirect: true})
	heads := map[uint16]int{}
	// Half direct 2-descriptor chains, half indirect ones taking a single descriptor.
	for i := range 40 {
		var ind *Buf
		if i%2 == 1 {
			ind = &Buf{0x6000 + uint64(i)*0x40, 0x40}
		}
		rd := []Buf{{dataGPA + uint64(i)*0x100, 8}}
		wr := []Buf{{dataGPA + uint64(i)*0x100 + 8, 8}}
		binary.LittleEndian.PutUint64(r.bytes(t, rd[0].Addr, 8), uint64(i))
		h, err := r.d.Add(rd, wr, ind)
		if err != nil {
			t.Fatalf("Add #%d: %v", i, err)
		}
		heads[h] = i
	}
	if r.d.NumFree() != size-60 {
		t.Fatalf("NumFree = %d", r.d.NumFree())
	}
	if _, err := r.d.Add(make([]Buf, 5), nil, nil); err == nil {
		t.Fatal("Add succeeded without enough free descriptors")
	}
	var c Chain
	var chains []Chain
	for range 40 {
		mustNext(t, r.q, &c)
		i, ok := heads[c.Head]
		if !ok || binary.LittleEndian.Uint64(c.In[0]) != uint64(i) {
			t.Fatalf("unexpected chain at head %d", c.Head)
		}
		chains = append(chains, Chain{Head: c.Head, Out: [][]byte{c.Out[0]}})
	}
	mustBeEmpty(t, r.q)
	// Complete in a scrambled order.
	for k := range chains {
		ch := chains[(k*7)%40]
		binary.LittleEndian.PutUint64(ch.Out[0], uint64(heads[ch.Head])*3)
		r.q.Complete(ch.Head, 8)
	}
	for range 40 {
		h, n, ok := r.d.PopUsed()
		i := heads[h]
		if !ok || n != 8 || binary.LittleEndian.Uint64(r.bytes(t, dataGPA+uint64(i)*0x100+8, 8)) != uint64(i)*3 {
			t.Fatalf("PopUsed = %d, %d, %v", h, n, ok)
		}
	}
	if r.d.NumFree() != size {
		t.Fatalf("NumFree = %d after all completed", r.d.NumFree())
	}
}

func TestEventIdxNotifications(t *testing.T) {
	r := newRig(t, rigOpts{eventIdx: true})
	var c Chain
	add := func() { mustAdd(t, r.d, []Buf{{dataGPA, 1}}, nil, nil) }
	complete := func(n int) {
		for range n {
			mustNext(t, r.q, &c)
			r.q.Complete(c.Head, 0)
			r.d.PopUsed()
		}
	}

	if r.q.NeedsNotify() {
		t.Fatal("notify with nothing completed")
	}
	add()
	complete(1)
	if !r.q.NeedsNotify() {
		t.Fatal("first batch after New must notify")
	}
	// used idx is 1. The guest wants an interrupt once entry 3 is used (used_event = 3).
	r.d.SetUsedEvent(3)
	add()
	add()
	complete(2) // used idx 1 -> 3: 3 not in [1,3)
	if r.q.NeedsNotify() {
		t.Fatal("notified before used_event was passed")
	}
	add()
	complete(1) // 3 -> 4: 3 in [3,4)
	if !r.q.NeedsNotify() {
		t.Fatal("no notification when passing used_event")
	}
	add()
	complete(1) // 4 -> 5, used_event still 3: stale, no interrupt
	if r.q.NeedsNotify() {
		t.Fatal("notified for a stale used_event")
	}
	// EnableInterrupts sets used_event = next used (5); a batch 5 -> 7 crosses it.
	if r.d.EnableInterrupts() {
		t.Fatal("pending completions reported")
	}
	add()
	add()
	complete(2)
	if !r.q.NeedsNotify() {
		t.Fatal("no notification after EnableInterrupts")
	}
	r.q.Complete(0, 0) // a completion the driver has not popped
	if !r.d.EnableInterrupts() {
		t.Fatal("EnableInterrupts missed a pending completion")
	}
	r.d.PopUsed()

	// Kicks: avail_event is written by EnableNotify only.
	if r.q.EnableNotify() {
		t.Fatal("EnableNotify reports work on an empty queue")
	}
	add()
	if !r.d.NeedsKick() {
		t.Fatal("no kick after EnableNotify")
	}
	add()
	if r.d.NeedsKick() {
		t.Fatal("kick while the device has not re-enabled")
	}
	r.q.DisableNotify()
	add()
	if r.d.NeedsKick() {
		t.Fatal("kick after DisableNotify")
	}
	if !r.q.EnableNotify() {
		t.Fatal("EnableNotify missed pending chains")
	}
	add() // avail_event is the device's last avail, behind what is published: no kick needed
	if r.d.NeedsKick() {
		t.Fatal("kick although the device has pending chains")
	}
	complete(4)
	if r.q.EnableNotify() {
		t.Fatal("EnableNotify reports work after draining")
	}
	add()
	if !r.d.NeedsKick() {
		t.Fatal("no kick after draining and re-enabling")
	}
	if r.d.NeedsKick() {
		t.Fatal("kick with nothing published")
	}
}

func TestFlagNotifications(t *testing.T) {
	r := newRig(t, rigOpts{})
	var c Chain
	mustAdd(t, r.d, []Buf{{dataGPA, 1}}, nil, nil)
	if !r.d.NeedsKick() {
		t.Fatal("no kick with notifications enabled")
	}
	r.q.DisableNotify()
	mustAdd(t, r.d, []Buf{{dataGPA, 1}}, nil, nil)
	if r.d.NeedsKick() {
		t.Fatal("kick with NO_NOTIFY")
	}
	if !r.q.EnableNotify() {
		t.Fatal("EnableNotify missed pending chains")
	}
	mustAdd(t, r.d, []Buf{{dataGPA, 1}}, nil, nil)
	if !r.d.NeedsKick() {
		t.Fatal("no kick after EnableNotify")
	}

	r.d.DisableInterrupts()
	mustNext(t, r.q, &c)
	r.q.Complete(c.Head, 0)
	if r.q.NeedsNotify() {
		t.Fatal("interrupt with NO_INTERRUPT")
	}
	if !r.d.EnableInterrupts() {
		t.Fatal("EnableInterrupts missed a completion")
	}
	mustNext(t, r.q, &c)
	r.q.Complete(c.Head, 0)
	if !r.q.NeedsNotify() {
		t.Fatal("no interrupt after EnableInterrupts")
	}
}

// The spec only requires the avail ring to be 2-aligned; then avail.idx shares its aligned word
// with ring[0] and avail.flags cannot be loaded atomically.
func TestAvailRingOnly2Aligned(t *testing.T) {
	tm := newTestMem(t)
	const size = 4
	const descAt, availAt, usedAt = 0x1000, 0x1042, 0x1100
	q, err := New(tm.mem, Config{Size: size, DescAddr: user(descAt), AvailAddr: user(availAt), UsedAddr: user(usedAt)})
	if err != nil {
		t.Fatal(err)
	}
	if q.availWord != 2 {
		t.Fatalf("availWord = %d", q.availWord)
	}
	desc := tm.bytes(t, descAt, 16*size)
	avail := tm.bytes(t, availAt, availLen(size))
	putDesc(desc, 2, dataGPA, 7, 0, 0)
	binary.LittleEndian.PutUint16(avail[4:], 2) // ring[0] = 2
	binary.LittleEndian.PutUint16(avail[2:], 1) // idx = 1
	var c Chain
	mustNext(t, q, &c)
	if c.Head != 2 || c.InLen != 7 {
		t.Fatalf("head %d len %d", c.Head, c.InLen)
	}
	q.Complete(2, 0)
	binary.LittleEndian.PutUint16(avail[0:], availFNoInterrupt)
	if q.NeedsNotify() {
		t.Fatal("NO_INTERRUPT ignored")
	}
	used := tm.bytes(t, usedAt, usedLen(size))
	if binary.LittleEndian.Uint16(used[2:]) != 1 || binary.LittleEndian.Uint32(used[4:]) != 2 {
		t.Fatal("used ring not updated")
	}
}

func TestNewValidatesConfig(t *testing.T) {
	tm := newTestMem(t)
	good := Config{Size: 8, DescAddr: user(0x1000), AvailAddr: user(0x1080), UsedAddr: user(0x10a0)}
	if _, err := New(tm.mem, good); err != nil {
		t.Fatal(err)
	}
	for name, mod := range map[string]func(*Config){
		"size 0":             func(c *Config) { c.Size = 0 },
		"size 3":             func(c *Config) { c.Size = 3 },
		"size 65535":         func(c *Config) { c.Size = 65535 },
		"desc unaligned":     func(c *Config) { c.DescAddr += 8 },
		"avail unaligned":    func(c *Config) { c.AvailAddr++ },
		"used unaligned":     func(c *Config) { c.UsedAddr += 2 },
		"desc is a GPA":      func(c *Config) { c.DescAddr = 0x1000 },
		"avail at the end":   func(c *Config) { c.AvailAddr = user(sizeA - 20) },
		"used across A/B":    func(c *Config) { c.UsedAddr = user(sizeA - 0x20) }, // contiguous in GPA only
		"desc past 2^64":     func(c *Config) { c.DescAddr = 1<<64 - 16 },
		"huge size unmapped": func(c *Config) { c.Size = 32768 },
	} {
		c := good
		mod(&c)
		if _, err := New(tm.mem, c); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: New = %v, want ErrInvalidConfig", name, err)
		}
	}
}

func TestRemap(t *testing.T) {
	r := newRig(t, rigOpts{})
	mustAdd(t, r.d, []Buf{{dataGPA, 4}}, nil, nil)
	var c Chain
	mustNext(t, r.q, &c)

	// A region is added: rings unchanged, indices kept.
	extra := make([]byte, 0x1000)
	m2, err := r.mem.With(guestmem.FromBytes(0x100000, 0x7c00_0000_0000, extra))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.q.Remap(m2); err != nil {
		t.Fatal(err)
	}
	r.q.Complete(c.Head, 0)
	r.d.mem = m2
	mustAdd(t, r.d, []Buf{{0x100000, 16}}, nil, nil)
	mustNext(t, r.q, &c)
	if !sameMem(c.In[0], extra[:16]) || r.q.LastAvail() != 2 {
		t.Fatal("buffer in the new region not translated")
	}

	// The region holding the rings goes away: the queue is broken.
	m3, _, err := m2.Without(gpaA, sizeA, userA)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.q.Remap(m3); !errors.Is(err, ErrInvalidConfig) {
		t.Fatalf("Remap without the rings = %v", err)
	}
	if ok, err := r.q.Next(&c); ok || err == nil || r.q.Err() == nil {
		t.Fatal("broken queue still pops chains")
	}
	r.q.Complete(0, 0) // must not touch the old rings or panic
	if r.q.NeedsNotify() || r.q.EnableNotify() {
		t.Fatal("broken queue asks for notifications")
	}
	r.q.DisableNotify()
}

func TestDriverRejects(t *testing.T) {
	tm := newTestMem(t)
	for name, f := range map[string]func() error{
		"size 0":         func() error { _, err := NewDriver(tm.mem, ringGPA, 0, false); return err },
		"size 6":         func() error { _, err := NewDriver(tm.mem, ringGPA, 6, false); return err },
		"unaligned base": func() error { _, err := NewDriver(tm.mem, ringGPA+8, 8, false); return err },
		"unmapped":       func() error { _, err := NewDriver(tm.mem, 0x30000, 8, false); return err },
		"too big":        func() error { _, err := NewDriver(tm.mem, ringGPA, 32768, false); return err },
	} {
		if err := f(); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if got := DriverLayoutSize(256); got != 4096+518+2+2054 {
		t.Errorf("DriverLayoutSize(256) = %d", got)
	}
	d, err := NewDriver(tm.mem, ringGPA, 4, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Add(nil, nil, nil); err == nil {
		t.Error("empty chain accepted")
	}
	if _, err := d.Add(make([]Buf, 5), nil, nil); err == nil {
		t.Error("chain longer than the table accepted")
	}
	if _, err := d.Add(make([]Buf, 2), nil, &Buf{0x30000, 32}); err == nil {
		t.Error("unmapped indirect table accepted")
	}
	// A device completing a head that is not in flight does not corrupt the free list.
	atomicStoreLE32(d.used, 4, 3)
	atomicStoreLE32(d.used, 0, 1<<16)
	if h, _, ok := d.PopUsed(); !ok || h != 3 || d.NumFree() != 4 {
		t.Fatalf("bogus used element: %d %v free %d", h, ok, d.NumFree())
	}
}

func TestNextCompleteDoNotAllocate(t *testing.T) {
	r, _ := benchRig(t)
	var c Chain
	allocs := testing.AllocsPerRun(1000, func() { cycle(t, r, &c) })
	if allocs != 0 {
		t.Fatalf("%v allocations per request", allocs)
	}
}

// benchRig publishes one chain: a single INDIRECT descriptor pointing at a table of 4 buffers,
// 2 readable, 2 writable.
func benchRig(t testing.TB) (*rig, *Chain) {
	r := newRig(t, rigOpts{size: 128, indirect: true, eventIdx: true})
	if err := r.d.WriteIndirect(0x6000, []RawDesc{
		{dataGPA, 40, DescFNext, 1},
		{dataGPA + 0x100, 512, DescFNext, 2},
		{dataGPA + 0x1000, 16, DescFWrite | DescFNext, 3},
		{dataGPA + 0x2000, 4096, DescFWrite, 0},
	}); err != nil {
		t.Fatal(err)
	}
	r.d.WriteDesc(0, 0x6000, 64, DescFIndirect, 0)
	return r, &Chain{}
}

func cycle(t testing.TB, r *rig, c *Chain) {
	r.d.Publish(0)
	if ok, err := r.q.Next(c); !ok || err != nil || len(c.In) != 2 || len(c.Out) != 2 {
		t.Fatalf("Next = %v, %v", ok, err)
	}
	r.q.Complete(c.Head, 16)
	r.q.NeedsNotify()
	if _, _, ok := r.d.PopUsed(); !ok {
		t.Fatal("nothing used")
	}
}

func BenchmarkNextComplete(b *testing.B) {
	r, c := benchRig(b)
	b.ReportAllocs()
	for b.Loop() {
		cycle(b, r, c)
	}
}

// SuppressNotify keeps the driver from kicking for every chain it adds while the device polls
// with Available, in both notification modes (with EVENT_IDX, the first chain after a plain
// EnableNotify would still kick), and EnableNotify ends the poll by reporting what the driver
// published meanwhile.
func TestSuppressNotifyForPolling(t *testing.T) {
	for _, eventIdx := range []bool{false, true} {
		t.Run(fmt.Sprintf("eventIdx=%v", eventIdx), func(t *testing.T) {
			r := newRig(t, rigOpts{eventIdx: eventIdx})
			var c Chain
			add := func() { mustAdd(t, r.d, []Buf{{dataGPA, 1}}, nil, nil) }
			drain := func(n int) {
				t.Helper()
				for range n {
					mustNext(t, r.q, &c)
					r.q.Complete(c.Head, 0)
					r.d.PopUsed()
				}
			}
			if r.q.Available() || r.q.EnableNotify() {
				t.Fatal("work reported on an empty queue")
			}
			for round := range 3 { // the index moves on: avail_event is behind it each time
				r.q.SuppressNotify()
				for i := range 3 {
					add()
					if r.d.NeedsKick() {
						t.Fatalf("round %d, chain %d: kick while the device polls", round, i)
					}
					if !r.q.Available() {
						t.Fatalf("round %d, chain %d: Available misses a published chain", round, i)
					}
				}
				drain(2)
				if !r.q.Available() {
					t.Fatal("Available misses the third chain")
				}
				// The end of a poll: kicks back on, and the chain published meanwhile reported.
				if !r.q.EnableNotify() {
					t.Fatal("EnableNotify misses a chain published while kicks were suppressed")
				}
				drain(1)
				if r.q.Available() || r.q.EnableNotify() {
					t.Fatal("work reported after draining")
				}
				add()
				if !r.d.NeedsKick() {
					t.Fatal("no kick after EnableNotify ended the poll")
				}
				drain(1)
				if r.q.EnableNotify() {
					t.Fatal("EnableNotify reports work after draining")
				}
			}
		})
	}
}
