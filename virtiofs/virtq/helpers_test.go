package virtq

import (
	"testing"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

// Test memory: regions A and B are adjacent in guest-physical space, C is separate. Their user
// (front-end virtual) addresses are unrelated to their GPAs, as with QEMU.
const (
	gpaA, sizeA, userA = 0x00000, 0x10000, 0x7f00_0000_0000
	gpaB, sizeB, userB = 0x10000, 0x10000, 0x7e00_0000_0000
	gpaC, sizeC, userC = 0x40000, 0x01000, 0x7d00_0000_0000

	ringGPA = 0x1000 // in A
	dataGPA = 0x8000 // buffers, in A
)

type testMem struct {
	mem     *guestmem.Memory
	backing [][]byte
}

func newTestMem(t testing.TB) *testMem {
	t.Helper()
	tm := &testMem{backing: [][]byte{make([]byte, sizeA), make([]byte, sizeB), make([]byte, sizeC)}}
	var err error
	tm.mem, err = guestmem.New(
		guestmem.FromBytes(gpaA, userA, tm.backing[0]),
		guestmem.FromBytes(gpaB, userB, tm.backing[1]),
		guestmem.FromBytes(gpaC, userC, tm.backing[2]),
	)
	if err != nil {
		t.Fatal(err)
	}
	return tm
}

// user translates a GPA into the front-end address the device is configured with.
func user(gpa uint64) uint64 {
	switch {
	case gpa >= gpaC:
		return userC + gpa - gpaC
	case gpa >= gpaB:
		return userB + gpa - gpaB
	}
	return userA + gpa - gpaA
}

// inside reports whether s lies entirely inside one of the backing arrays, capacity included.
func (tm *testMem) inside(s []byte) bool {
	if cap(s) == 0 {
		return true
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(s)))
	for _, b := range tm.backing {
		lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
		if p >= lo && p+uintptr(cap(s)) <= lo+uintptr(len(b)) {
			return true
		}
	}
	return false
}

func (tm *testMem) bytes(t testing.TB, gpa, n uint64) []byte {
	t.Helper()
	b, err := tm.mem.Slice(gpa, n)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type rig struct {
	*testMem
	d *Driver
	q *Queue
}

type rigOpts struct {
	size      uint16
	eventIdx  bool
	indirect  bool
	lastAvail uint16 // both sides start at this index (avail and used)
}

func newRig(t testing.TB, o rigOpts) *rig {
	t.Helper()
	if o.size == 0 {
		o.size = 8
	}
	tm := newTestMem(t)
	d, err := NewDriver(tm.mem, ringGPA, o.size, o.eventIdx)
	if err != nil {
		t.Fatal(err)
	}
	if o.lastAvail != 0 {
		// Resume as after a reconnect: the driver's indices and the used idx already moved.
		d.availIdx, d.kickedAvail, d.lastUsed = o.lastAvail, o.lastAvail, o.lastAvail
		d.storeAvailWord()
		atomicStoreLE32(d.used, 0, uint32(o.lastAvail)<<16)
	}
	q, err := New(tm.mem, Config{
		Size:      o.size,
		DescAddr:  user(d.DescAddr()),
		AvailAddr: user(d.AvailAddr()),
		UsedAddr:  user(d.UsedAddr()),
		LastAvail: o.lastAvail,
		EventIdx:  o.eventIdx,
		Indirect:  o.indirect,
	})
	if err != nil {
		t.Fatal(err)
	}
	return &rig{testMem: tm, d: d, q: q}
}

func sameMem(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || unsafe.SliceData(a) == unsafe.SliceData(b))
}
