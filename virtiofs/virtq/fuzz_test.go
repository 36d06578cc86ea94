package virtq

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"math"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/fuzzseed"
)

// Fuzz input layout (missing bytes are zero):
//
//	[0]        options: bit 0 EVENT_IDX, bit 1 INDIRECT_DESC, bits 2-3 log2 of the queue size (1..8)
//	[1:3]      LastAvail, little-endian
//	[3:131]    descriptor table (8 descriptors) at GPA 0x1000
//	[131:153]  avail ring at GPA 0x1080 (flags, idx, ring, used_event)
//	[153:]     up to 4 KiB at GPA 0x2000, for indirect tables
//
// The used ring is at GPA 0x1100; guest memory is the three test regions, A and B adjacent.
const (
	fuzzDescGPA    = 0x1000
	fuzzAvailGPA   = 0x1080
	fuzzUsedGPA    = 0x1100
	fuzzScratchGPA = 0x2000
	fuzzHeader     = 3 + 8*descSize + 22
)

func FuzzChainWalk(f *testing.F) {
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, fuzzHeader+64))
	f.Add(fuzzSeeds()["direct"].encode())
	f.Add(fuzzSeeds()["indirect"].encode())
	f.Fuzz(func(t *testing.T, data []byte) { chainWalk(t, data) })
}

// chainWalk runs the device over the fuzz input and checks every invariant; it returns how many
// chains were popped and the error that ended the walk, if any.
func chainWalk(t *testing.T, data []byte) (popped int, walkErr error) {
	in := make([]byte, fuzzHeader)
	copy(in, data)
	size := uint16(1) << (in[0] >> 2 & 3)
	tm := newTestMem(t)
	copy(tm.bytes(t, fuzzDescGPA, 8*descSize), in[3:131])
	copy(tm.bytes(t, fuzzAvailGPA, 22), in[131:fuzzHeader])
	if len(data) > fuzzHeader {
		copy(tm.bytes(t, fuzzScratchGPA, 0x1000), data[fuzzHeader:])
	}
	q, err := New(tm.mem, Config{
		Size:      size,
		DescAddr:  user(fuzzDescGPA),
		AvailAddr: user(fuzzAvailGPA),
		UsedAddr:  user(fuzzUsedGPA),
		LastAvail: binary.LittleEndian.Uint16(in[1:]),
		EventIdx:  in[0]&1 != 0,
		Indirect:  in[0]&2 != 0,
	})
	if err != nil {
		t.Fatal(err)
	}
	before := make([][]byte, len(tm.backing))
	for i, b := range tm.backing {
		before[i] = bytes.Clone(b)
	}

	var c Chain
	for {
		ok, err := q.Next(&c)
		if err != nil {
			walkErr = err
			if !errors.Is(err, ErrInvalidRing) {
				t.Fatalf("error does not wrap ErrInvalidRing: %v", err)
			}
			if len(c.In)+len(c.Out) != 0 || c.InLen+c.OutLen != 0 {
				t.Fatal("partial chain left after an error")
			}
			break
		}
		if !ok {
			break
		}
		if popped++; popped > int(size) {
			t.Fatalf("popped %d chains from a queue of %d", popped, size)
		}
		if c.Head >= size {
			t.Fatalf("head %d >= size %d", c.Head, size)
		}
		for _, part := range []struct {
			bufs [][]byte
			n    uint64
		}{{c.In, c.InLen}, {c.Out, c.OutLen}} {
			var sum uint64
			for _, b := range part.bufs {
				if len(b) == 0 || cap(b) != len(b) || !tm.inside(b) {
					t.Fatalf("buffer of len %d cap %d outside guest memory or empty", len(b), cap(b))
				}
				sum += uint64(len(b))
			}
			if sum != part.n {
				t.Fatalf("buffers hold %d bytes, chain says %d", sum, part.n)
			}
		}
		q.Complete(c.Head, uint32(min(c.OutLen, math.MaxUint32)))
	}
	q.NeedsNotify()
	q.EnableNotify()
	q.DisableNotify()

	// The device wrote nothing but the used ring.
	usedOff := int(fuzzUsedGPA - gpaA)
	usedEnd := usedOff + int(usedLen(size))
	for i, b := range tm.backing {
		if i == 0 {
			if !bytes.Equal(b[:usedOff], before[i][:usedOff]) || !bytes.Equal(b[usedEnd:], before[i][usedEnd:]) {
				t.Fatal("device wrote outside the used ring")
			}
		} else if !bytes.Equal(b, before[i]) {
			t.Fatalf("device wrote into region %d", i)
		}
	}
	return popped, walkErr
}

// fuzzCase builds a fuzz input; see the layout above.
type fuzzCase struct {
	eventIdx, indirect bool
	log2Size           byte
	lastAvail          uint16
	desc               [8]RawDesc
	availFlags         uint16
	availIdx           uint16
	ring               [8]uint16
	usedEvent          uint16
	scratch            []RawDesc // indirect tables at GPA 0x2000
}

func (fc fuzzCase) encode() []byte {
	b := make([]byte, fuzzHeader, fuzzHeader+descSize*len(fc.scratch))
	if fc.eventIdx {
		b[0] |= 1
	}
	if fc.indirect {
		b[0] |= 2
	}
	b[0] |= fc.log2Size << 2
	binary.LittleEndian.PutUint16(b[1:], fc.lastAvail)
	for i, d := range fc.desc {
		putDesc(b[3:131], uint32(i), d.Addr, d.Len, d.Flags, d.Next)
	}
	a := b[131:]
	binary.LittleEndian.PutUint16(a[0:], fc.availFlags)
	binary.LittleEndian.PutUint16(a[2:], fc.availIdx)
	for i, h := range fc.ring {
		binary.LittleEndian.PutUint16(a[4+2*i:], h)
	}
	binary.LittleEndian.PutUint16(a[20:], fc.usedEvent)
	for _, d := range fc.scratch {
		var e [descSize]byte
		putDesc(e[:], 0, d.Addr, d.Len, d.Flags, d.Next)
		b = append(b, e[:]...)
	}
	return b
}

// fuzzSeeds are the seed corpus in testdata/fuzz/FuzzChainWalk, by file name.
func fuzzSeeds() map[string]fuzzCase {
	const data = 0x3000
	return map[string]fuzzCase{
		"direct": {log2Size: 3, availIdx: 1, desc: [8]RawDesc{
			{data, 16, DescFNext, 1}, {data + 0x100, 32, DescFWrite, 0}}},
		"indirect": {log2Size: 3, indirect: true, availIdx: 1,
			desc:    [8]RawDesc{{fuzzScratchGPA, 48, DescFIndirect, 0}},
			scratch: []RawDesc{{data, 8, DescFNext, 1}, {gpaB - 8, 16, DescFNext, 2}, {data + 0x200, 8, DescFWrite, 0}}},
		"direct-then-indirect": {log2Size: 3, indirect: true, availIdx: 1,
			desc:    [8]RawDesc{{data, 8, DescFNext, 4}, {}, {}, {}, {fuzzScratchGPA, 32, DescFIndirect | DescFWrite, 0}},
			scratch: []RawDesc{{data + 8, 8, DescFNext, 1}, {data + 0x100, 8, DescFWrite, 0}}},
		"loop": {log2Size: 3, availIdx: 1, desc: [8]RawDesc{
			{data, 16, DescFNext, 1}, {data, 16, DescFNext, 0}}},
		"indirect-loop": {log2Size: 3, indirect: true, availIdx: 1,
			desc:    [8]RawDesc{{fuzzScratchGPA, 32, DescFIndirect, 0}},
			scratch: []RawDesc{{data, 8, DescFNext, 1}, {data, 8, DescFNext, 0}}},
		"nested-indirect": {log2Size: 3, indirect: true, availIdx: 1,
			desc:    [8]RawDesc{{fuzzScratchGPA, 16, DescFIndirect, 0}},
			scratch: []RawDesc{{fuzzScratchGPA, 16, DescFIndirect, 0}}},
		"indirect-next": {log2Size: 3, indirect: true, availIdx: 1,
			desc:    [8]RawDesc{{fuzzScratchGPA, 16, DescFIndirect | DescFNext, 1}, {data, 8, 0, 0}},
			scratch: []RawDesc{{data, 8, 0, 0}}},
		"readable-after-writable": {log2Size: 3, availIdx: 1, desc: [8]RawDesc{
			{data, 8, DescFWrite | DescFNext, 1}, {data, 8, 0, 0}}},
		"wrap": {log2Size: 2, eventIdx: true, lastAvail: 65534, availIdx: 2,
			ring: [8]uint16{2, 3, 0, 0, 0, 0, 0, 1},
			desc: [8]RawDesc{{data, 1, 0, 0}, {data + 1, 1, 0, 0}, {data + 2, 1, DescFWrite, 0}, {data + 3, 1, 0, 0}}},
		"avail-jump": {log2Size: 3, availIdx: 9},
		"near-top": {log2Size: 3, availIdx: 1, desc: [8]RawDesc{
			{math.MaxUint64 - 7, 16, 0, 0}}},
		"span-regions": {log2Size: 0, availIdx: 1, desc: [8]RawDesc{
			{gpaB - 0x10, 0x20, DescFWrite, 0}}},
	}
}

// TestFuzzSeeds checks that the seeds reach what they are named after.
func TestFuzzSeeds(t *testing.T) {
	valid := map[string]int{"direct": 1, "indirect": 1, "direct-then-indirect": 1, "wrap": 4, "span-regions": 1}
	for name, fc := range fuzzSeeds() {
		popped, err := chainWalk(t, fc.encode())
		if want, ok := valid[name]; ok {
			if popped != want || err != nil {
				t.Errorf("%s: %d chains, %v; want %d chains", name, popped, err, want)
			}
		} else if err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

var updateSeeds = flag.Bool("update-fuzz-seeds", false, "rewrite testdata/fuzz/FuzzChainWalk from fuzzSeeds")

// TestFuzzSeedCorpus keeps the seed files in testdata in sync with fuzzSeeds; run with
// -update-fuzz-seeds to rewrite them.
func TestFuzzSeedCorpus(t *testing.T) {
	files := map[string]string{}
	for name, fc := range fuzzSeeds() {
		files[name] = fuzzseed.Bytes(fc.encode())
	}
	fuzzseed.Check(t, "FuzzChainWalk", files, *updateSeeds, "go test -run TestFuzzSeedCorpus -update-fuzz-seeds")
}
