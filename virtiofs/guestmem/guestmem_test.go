package guestmem

import (
	"bytes"
	"errors"
	"math"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// threeRegions: A [0x0000,0x1000) and B [0x1000,0x3000) are adjacent in GPA; C [0x10000,0x11000)
// is separate. User addresses are laid out differently (and non-adjacent) on purpose.
func threeRegions(t *testing.T) (*Memory, [][]byte) {
	t.Helper()
	bufs := [][]byte{make([]byte, 0x1000), make([]byte, 0x2000), make([]byte, 0x1000)}
	for i, b := range bufs {
		for j := range b {
			b[j] = byte(i*64 + j%61)
		}
	}
	m, err := New(
		FromBytes(0x10000, 0x7f00_0000_0000, bufs[2]),
		FromBytes(0x0000, 0x7f00_1000_0000, bufs[0]),
		FromBytes(0x1000, 0x7f00_2000_0000, bufs[1]),
	)
	if err != nil {
		t.Fatal(err)
	}
	return m, bufs
}

func sameMem(a, b []byte) bool {
	return len(a) == len(b) && (len(a) == 0 || unsafe.SliceData(a) == unsafe.SliceData(b))
}

func TestSliceTranslation(t *testing.T) {
	m, bufs := threeRegions(t)
	for _, tc := range []struct {
		gpa, n uint64
		want   []byte // nil: error
	}{
		{0, 1, bufs[0][:1]},
		{0, 0x1000, bufs[0]},
		{0xfff, 1, bufs[0][0xfff:]},       // last byte of A
		{0xfff, 2, nil},                   // crosses A/B: Slice needs one region
		{0x1000, 0x2000, bufs[1]},         // all of B
		{0x2fff, 1, bufs[1][0x1fff:]},     // last byte of B
		{0x3000, 1, nil},                  // one past B
		{0x3000, 0, nil},                  // empty access at unmapped address
		{0x1234, 0, bufs[1][0x234:0x234]}, // empty access at mapped address
		{0x10000, 0x1000, bufs[2]},        // all of C
		{0x10000, 0x1001, nil},            // one byte too many
		{0x10fff, 1, bufs[2][0xfff:]},     // last byte of C
		{0x11000, 1, nil},                 // one past C
		{0xffff, 1, nil},                  // just before C
		{0x10800, math.MaxUint64, nil},    // huge length
		{math.MaxUint64, 1, nil},          // top of address space
		{0x10001, math.MaxUint64 - 0x10000, nil},
	} {
		got, err := m.Slice(tc.gpa, tc.n)
		if tc.want == nil {
			if err == nil || !errors.Is(err, ErrOutOfBounds) {
				t.Errorf("Slice(%#x, %#x) = %d bytes, %v; want ErrOutOfBounds", tc.gpa, tc.n, len(got), err)
			}
			continue
		}
		if err != nil {
			t.Errorf("Slice(%#x, %#x): %v", tc.gpa, tc.n, err)
			continue
		}
		if len(got) != len(tc.want) || cap(got) != len(got) ||
			(len(got) > 0 && !sameMem(got, tc.want)) {
			t.Errorf("Slice(%#x, %#x): wrong slice (len %d cap %d)", tc.gpa, tc.n, len(got), cap(got))
		}
	}
}

func TestUserSlice(t *testing.T) {
	m, bufs := threeRegions(t)
	got, err := m.UserSlice(0x7f00_2000_0000+0x1ffe, 2)
	if err != nil || !sameMem(got, bufs[1][0x1ffe:]) {
		t.Fatalf("UserSlice end of B: %v", err)
	}
	got, err = m.UserSlice(0x7f00_0000_0000, 0x1000)
	if err != nil || !sameMem(got, bufs[2]) {
		t.Fatalf("UserSlice all of C: %v", err)
	}
	for _, tc := range []struct{ ua, n uint64 }{
		{0x7f00_2000_0000 + 0x1fff, 2},
		{0x7f00_0000_0000 - 1, 1},
		{0x1000, 1}, // a GPA, not a user address
		{math.MaxUint64, 2},
	} {
		if _, err := m.UserSlice(tc.ua, tc.n); !errors.Is(err, ErrOutOfBounds) {
			t.Errorf("UserSlice(%#x, %d) = %v, want ErrOutOfBounds", tc.ua, tc.n, err)
		}
	}
}

func TestAppendIovecs(t *testing.T) {
	m, bufs := threeRegions(t)
	pre := [][]byte{[]byte("keep")}

	got, err := m.AppendIovecs(pre, 0xff0, 0x20) // A's last 16 bytes + B's first 16
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || !bytes.Equal(got[0], []byte("keep")) ||
		!sameMem(got[1], bufs[0][0xff0:]) || !sameMem(got[2], bufs[1][:0x10]) || cap(got[2]) != 0x10 {
		t.Fatalf("spanning A/B: got %d iovecs", len(got))
	}

	got, err = m.AppendIovecs(nil, 0, 0x3000) // exactly A and B
	if err != nil || len(got) != 2 || len(got[0]) != 0x1000 || len(got[1]) != 0x2000 {
		t.Fatalf("all of A+B: %d iovecs, %v", len(got), err)
	}

	got, err = m.AppendIovecs(nil, 0x2000, 0x1000) // within B only
	if err != nil || len(got) != 1 || !sameMem(got[0], bufs[1][0x1000:]) {
		t.Fatalf("within B: %v", err)
	}

	got, err = m.AppendIovecs(nil, 0x1000, 0) // empty, mapped
	if err != nil || len(got) != 0 {
		t.Fatalf("empty: %v", err)
	}

	for _, tc := range []struct{ gpa, n uint64 }{
		{0, 0x3001},             // one past B
		{0x2fff, 2},             // B to unmapped gap
		{0x3000, 0},             // empty at unmapped
		{0x10fff, 2},            // past C
		{0xfff, math.MaxUint64}, // wraps
		{math.MaxUint64, 1},     // unmapped top
	} {
		got, err := m.AppendIovecs(pre, tc.gpa, tc.n)
		if !errors.Is(err, ErrOutOfBounds) || len(got) != 1 {
			t.Errorf("AppendIovecs(%#x, %#x) = %d iovecs, %v; want original dst and ErrOutOfBounds",
				tc.gpa, tc.n, len(got), err)
		}
	}
}

func TestTopOfAddressSpace(t *testing.T) {
	// Two adjacent regions ending exactly at 2^64.
	lo := make([]byte, 0x1000)
	hi := make([]byte, 0x1000)
	m, err := New(FromBytes(math.MaxUint64-0x1fff, 0x1000, lo), FromBytes(math.MaxUint64-0xfff, 0x2000, hi))
	if err != nil {
		t.Fatal(err)
	}
	if b, err := m.Slice(math.MaxUint64, 1); err != nil || !sameMem(b, hi[0xfff:]) {
		t.Fatalf("last byte of address space: %v", err)
	}
	if b, err := m.Slice(math.MaxUint64-0xfff, 0x1000); err != nil || !sameMem(b, hi) {
		t.Fatalf("top region: %v", err)
	}
	for _, n := range []uint64{2, 0x1001, math.MaxUint64} {
		if _, err := m.Slice(math.MaxUint64, n); !errors.Is(err, ErrOutOfBounds) {
			t.Errorf("Slice(2^64-1, %#x) = %v", n, err)
		}
		if _, err := m.AppendIovecs(nil, math.MaxUint64, n); !errors.Is(err, ErrOutOfBounds) {
			t.Errorf("AppendIovecs(2^64-1, %#x) = %v", n, err)
		}
	}
	got, err := m.AppendIovecs(nil, math.MaxUint64-0x1fff, 0x2000)
	if err != nil || len(got) != 2 {
		t.Fatalf("both top regions: %d, %v", len(got), err)
	}
	if _, err := m.AppendIovecs(nil, math.MaxUint64-0x1fff, 0x2001); !errors.Is(err, ErrOutOfBounds) {
		t.Fatalf("past 2^64: %v", err)
	}
}

func TestNewRejects(t *testing.T) {
	b := func(n int) []byte { return make([]byte, n) }
	for name, rs := range map[string][]*Region{
		"gpa overlap":       {FromBytes(0, 0x10000, b(0x1000)), FromBytes(0xfff, 0x20000, b(0x10))},
		"gpa contained":     {FromBytes(0, 0x10000, b(0x1000)), FromBytes(0x10, 0x20000, b(0x10))},
		"user overlap":      {FromBytes(0, 0x10000, b(0x1000)), FromBytes(0x8000, 0x10fff, b(0x10))},
		"identical":         {FromBytes(0, 0, b(0x10)), FromBytes(0, 0, b(0x10))},
		"zero size":         {FromBytes(0, 0, nil)},
		"gpa wraps":         {FromBytes(math.MaxUint64, 0, b(2))},
		"user wraps":        {FromBytes(0, math.MaxUint64-2, b(4))},
		"nil region":        {nil},
		"size mismatch":     {{GuestPhysAddr: 0, Size: 10, UserAddr: 0}},
		"same region twice": func() []*Region { r := FromBytes(0, 0, b(8)); return []*Region{r, r} }(),
	} {
		if _, err := New(rs...); !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("%s: New = %v, want ErrInvalidRegion", name, err)
		}
	}
	var many []*Region
	for i := range MaxRegions + 1 {
		many = append(many, FromBytes(uint64(i)*0x100, uint64(i)*0x100, b(0x100)))
	}
	if _, err := New(many...); !errors.Is(err, ErrInvalidRegion) {
		t.Errorf("too many regions: %v", err)
	}
	if _, err := New(many[:MaxRegions]...); err != nil {
		t.Errorf("MaxRegions regions: %v", err)
	}
}

func TestWithWithout(t *testing.T) {
	m, bufs := threeRegions(t)
	d := make([]byte, 0x1000)
	m2, err := m.With(FromBytes(0x3000, 0x7f00_3000_0000, d))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Slice(0x3000, 1); err == nil {
		t.Fatal("With modified the receiver")
	}
	if got, err := m2.AppendIovecs(nil, 0x2ff0, 0x20); err != nil || len(got) != 2 || !sameMem(got[1], d[:0x10]) {
		t.Fatalf("B+D span: %v", err)
	}
	if len(m2.Regions()) != 4 || m2.Regions()[3].GuestPhysAddr != 0x10000 {
		t.Fatalf("Regions not sorted: %v", m2.Regions())
	}
	if _, err := m2.With(FromBytes(0x3800, 0x9000_0000_0000, make([]byte, 0x10))); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("overlapping With: %v", err)
	}
	if _, err := m2.With(FromBytes(0x9000_0000, 0x7f00_3000_0800, make([]byte, 0x10))); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("user-overlapping With: %v", err)
	}

	// Without matches gpa+size+uaddr exactly.
	for _, bad := range [][3]uint64{
		{0x1000, 0x2000, 0x7f00_2000_0001},
		{0x1000, 0x1000, 0x7f00_2000_0000},
		{0x1001, 0x2000, 0x7f00_2000_0000},
	} {
		if _, _, err := m2.Without(bad[0], bad[1], bad[2]); !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("Without(%#x) = %v", bad, err)
		}
	}
	m3, r, err := m2.Without(0x1000, 0x2000, 0x7f00_2000_0000)
	if err != nil || !sameMem(r.Bytes(), bufs[1]) {
		t.Fatalf("Without B: %v", err)
	}
	if _, err := m3.Slice(0x1000, 1); !errors.Is(err, ErrOutOfBounds) {
		t.Fatal("B still mapped after Without")
	}
	if _, err := m3.AppendIovecs(nil, 0xff0, 0x20); !errors.Is(err, ErrOutOfBounds) {
		t.Fatal("A/B span still works after Without")
	}
	if _, err := m2.Slice(0x1000, 1); err != nil {
		t.Fatal("Without modified the receiver")
	}

	// Filling up to MaxRegions via With, then one more fails.
	var cur *Memory
	for i := range MaxRegions {
		if cur, err = cur.With(FromBytes(uint64(i)<<20, uint64(i)<<20, make([]byte, 16))); err != nil {
			t.Fatalf("With #%d: %v", i, err)
		}
	}
	if _, err := cur.With(FromBytes(1<<40, 1<<40, make([]byte, 16))); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("With beyond MaxRegions: %v", err)
	}
}

func TestNilAndEmptyMemory(t *testing.T) {
	var m *Memory
	if _, err := m.Slice(0, 0); !errors.Is(err, ErrOutOfBounds) {
		t.Error(err)
	}
	if _, err := m.UserSlice(0, 1); !errors.Is(err, ErrOutOfBounds) {
		t.Error(err)
	}
	if _, err := m.AppendIovecs(nil, 0, 1); !errors.Is(err, ErrOutOfBounds) {
		t.Error(err)
	}
	if _, _, err := m.Without(0, 1, 0); !errors.Is(err, ErrInvalidRegion) {
		t.Error(err)
	}
	if err := m.Close(); err != nil {
		t.Error(err)
	}
	e, err := New()
	if err != nil || len(e.Regions()) != 0 {
		t.Fatal(err)
	}
	if _, err := e.Slice(0, 1); !errors.Is(err, ErrOutOfBounds) {
		t.Error(err)
	}
}

func TestLookupsDoNotAllocate(t *testing.T) {
	m, _ := threeRegions(t)
	dst := make([][]byte, 0, 4)
	allocs := testing.AllocsPerRun(100, func() {
		_, _ = m.Slice(0x1800, 16)
		_, _ = m.UserSlice(0x7f00_0000_0010, 16)
		dst, _ = m.AppendIovecs(dst[:0], 0xff0, 0x20)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per lookup", allocs)
	}
}

func memfd(t *testing.T, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate("guestmem-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skipf("memfd_create: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	return fd
}

func TestMapFD(t *testing.T) {
	page := uint64(unix.Getpagesize())
	fd := memfd(t, int64(4*page))
	pattern := make([]byte, 4*page)
	for i := range pattern {
		pattern[i] = byte(i * 7)
	}
	if _, err := unix.Pwrite(fd, pattern, 0); err != nil {
		t.Fatal(err)
	}

	// A region starting 1.5 pages into the file: the offset need not be page aligned.
	off := page + page/2
	size := 2 * page
	r, err := MapFD(fd, 0x4000_0000, size, 0x7f12_0000_0000, off)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if uint64(len(r.Bytes())) != size || uint64(cap(r.Bytes())) != size {
		t.Fatalf("Bytes: len %d cap %d", len(r.Bytes()), cap(r.Bytes()))
	}
	if !bytes.Equal(r.Bytes(), pattern[off:off+size]) {
		t.Fatal("mapped contents differ from the file at the mmap offset")
	}

	m, err := New(r)
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.Slice(0x4000_0000+size-4, 4)
	if err != nil {
		t.Fatal(err)
	}
	copy(b, "WXYZ")
	got := make([]byte, 4)
	if _, err := unix.Pread(fd, got, int64(off+size-4)); err != nil || string(got) != "WXYZ" {
		t.Fatalf("write through the mapping not visible in the file: %q, %v", got, err)
	}
	if _, err := m.Slice(0x4000_0000+size-4, 5); !errors.Is(err, ErrOutOfBounds) {
		t.Fatal("read past the region end allowed")
	}
	if ub, err := m.UserSlice(0x7f12_0000_0000, 4); err != nil || !bytes.Equal(ub, pattern[off:off+4]) {
		t.Fatalf("UserSlice: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil { // second close is harmless
		t.Fatal(err)
	}
	if _, err := New(r); !errors.Is(err, ErrInvalidRegion) {
		t.Fatalf("closed region accepted: %v", err)
	}
}

func TestMapFDRejects(t *testing.T) {
	page := uint64(unix.Getpagesize())
	fd := memfd(t, int64(2*page))
	for name, a := range map[string][4]uint64{ // gpa, size, uaddr, offset
		"zero size":          {0, 0, 0, 0},
		"size+offset wraps":  {0, page, 0, math.MaxUint64 - 10},
		"absurd size":        {0, MaxMapSize + 1, 0, 0},
		"absurd with offset": {0, MaxMapSize, 0, page},
		"gpa wraps":          {math.MaxUint64 - 10, page, 0, 0},
		"uaddr wraps":        {0, page, math.MaxUint64 - 10, 0},
		"file too small":     {0, 2 * page, 0, 1},
	} {
		if r, err := MapFD(fd, a[0], a[1], a[2], a[3]); !errors.Is(err, ErrInvalidRegion) {
			if r != nil {
				r.Close()
			}
			t.Errorf("%s: MapFD = %v, want ErrInvalidRegion", name, err)
		}
	}
	if _, err := MapFD(-1, 0, page, 0, 0); err == nil {
		t.Error("MapFD(-1) succeeded")
	}
}

func BenchmarkSlice(b *testing.B) {
	var rs []*Region
	for i := range 8 {
		rs = append(rs, FromBytes(uint64(i)<<30, uint64(i)<<32, make([]byte, 1<<16)))
	}
	m, err := New(rs...)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if _, err := m.Slice(uint64(i&7)<<30+0x100, 0x1000); err != nil {
			b.Fatal(err)
		}
	}
}
