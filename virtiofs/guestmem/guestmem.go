// Package guestmem maps guest RAM into the back-end and translates guest addresses into Go
// slices of that memory.
//
// # Address spaces
//
// The vhost-user front-end (QEMU) describes guest RAM as a table of regions (SET_MEM_TABLE,
// ADD_MEM_REG). Each region is known under two addresses:
//
//   - its guest-physical address (GPA), used by the guest driver in descriptor addr fields;
//   - its "user" address, the front-end's own virtual address of the region, used by the
//     front-end for the ring addresses of SET_VRING_ADDR.
//
// [Memory.Slice] and [Memory.AppendIovecs] translate GPAs; [Memory.UserSlice] translates user
// addresses.
//
// # Threat model
//
// The region table comes from the front-end, which is trusted to describe memory it really owns
// and not to shrink the backing files afterwards. The table is still validated (no zero or
// absurd sizes, no address ranges that wrap around 2^64, no overlapping ranges), because a
// broken table would otherwise make every later check meaningless.
//
// Addresses and lengths passed to the translation methods come from the guest and are hostile:
// any value is accepted as input, every range check is written so that it cannot overflow, and
// a range that is not entirely inside mapped memory is refused with an error wrapping
// [ErrOutOfBounds]. No method panics on any address or length. Every slice handed out has its
// capacity cut to its length, so appending to it can never reach memory beyond the checked
// range.
//
// The contents of the memory are shared with the guest, which may change them at any moment.
// Slices returned here alias that memory: callers must copy a value out before validating and
// using it, and must not assume two reads of the same byte give the same answer.
//
// # Performance and concurrency
//
// A Memory is immutable: [Memory.With] and [Memory.Without] return a new Memory and leave the
// receiver untouched, so lookups need no locking. Lookups are on the request hot path; they
// binary-search a slice of regions sorted by start address (one sorted by GPA, one by user
// address). At most [MaxRegions] regions exist, so a lookup costs at most six comparisons and
// touches no shared mutable state (a last-hit cache would be a write on every lookup, shared
// between the queue goroutines). Lookups do not allocate.
//
// Unmapping is not synchronised with lookups: the caller must make sure no goroutine uses a
// Memory, or a slice obtained from it, once its regions are closed (the vhost-user layer holds a
// read lock while processing a queue and the write lock while replacing the memory table).
package guestmem

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// MaxRegions is the largest number of regions a Memory may hold. It is the slot count the
// back-end reports to GET_MAX_MEM_SLOTS.
const MaxRegions = 32

// MaxMapSize bounds the length of one mapping (region size plus mmap offset): 16 TiB, far beyond
// any guest this back-end serves and far below the 128 TiB user address space of amd64, so an
// absurd size in the table is refused instead of exhausting the address space.
const MaxMapSize = 1 << 44

var (
	// ErrOutOfBounds is wrapped by every error reporting an access outside mapped guest memory.
	ErrOutOfBounds = errors.New("guest memory access out of bounds")
	// ErrInvalidRegion is wrapped by every error reporting an unusable region or region table:
	// zero or absurd size, a range wrapping around 2^64, overlap, too many regions, no match.
	ErrInvalidRegion = errors.New("invalid guest memory region")
)

// Region is one range of guest RAM mapped into the back-end's address space. The exported fields
// describe it and must not be changed once the region is part of a Memory.
type Region struct {
	GuestPhysAddr uint64 // where the guest sees it
	Size          uint64
	UserAddr      uint64 // the front-end's (QEMU's) virtual address of the region
	MmapOffset    uint64 // offset of the region inside the fd it came from

	data    []byte      // exactly Size bytes, capacity Size
	mapping []byte      // the whole mmap'd range (nil for FromBytes regions)
	closed  atomic.Bool // set by Close of a mapped region
}

// MapFD maps size bytes at offset mmapOffset of fd as the region the guest sees at gpa and the
// front-end at uaddr. Like libvhost-user it maps the file from offset 0 (mmap offsets must be
// page or huge-page aligned, mmapOffset need not be) and skips the first mmapOffset bytes.
// MapFD does not close fd; the mapping stays valid after the caller closes it.
//
// If fd is a regular file (memfd, tmpfs, hugetlbfs) it must be at least size+mmapOffset bytes
// long: touching a mapped page beyond the end of the file would raise SIGBUS.
func MapFD(fd int, gpa, size, uaddr, mmapOffset uint64) (*Region, error) {
	if err := checkRanges(gpa, size, uaddr); err != nil {
		return nil, err
	}
	mapLen, carry := bits.Add64(size, mmapOffset, 0)
	if carry != 0 || mapLen > MaxMapSize || mapLen > math.MaxInt {
		return nil, fmt.Errorf("region size %#x + mmap offset %#x exceeds %#x: %w",
			size, mmapOffset, uint64(MaxMapSize), ErrInvalidRegion)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat memory fd: %w", err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFREG && (st.Size < 0 || uint64(st.Size) < mapLen) {
		return nil, fmt.Errorf("memory fd has %d bytes, region needs %d: %w",
			st.Size, mapLen, ErrInvalidRegion)
	}
	m, err := unix.Mmap(fd, 0, int(mapLen), unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_SHARED|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mmap guest memory (%d bytes): %w", mapLen, err)
	}
	return &Region{
		GuestPhysAddr: gpa,
		Size:          size,
		UserAddr:      uaddr,
		MmapOffset:    mmapOffset,
		data:          m[mmapOffset:mapLen:mapLen],
		mapping:       m,
	}, nil
}

// FromBytes makes a region of b, seen by the guest at gpa and by the front-end at uaddr. It is the
// memory of the in-repo front-end and of tests. Close is a no-op: the region stays usable. Whether the addresses
// and size are usable is checked when the region is added to a Memory.
func FromBytes(gpa, uaddr uint64, b []byte) *Region {
	return &Region{
		GuestPhysAddr: gpa,
		Size:          uint64(len(b)),
		UserAddr:      uaddr,
		data:          b[:len(b):len(b)],
	}
}

// Close unmaps the region. Closing twice is harmless. No slice of the region may be used after
// Close.
func (r *Region) Close() error {
	if r.mapping == nil || !r.closed.CompareAndSwap(false, true) {
		return nil // FromBytes region, or already closed
	}
	if err := unix.Munmap(r.mapping); err != nil {
		return fmt.Errorf("munmap guest memory at GPA %#x: %w", r.GuestPhysAddr, err)
	}
	return nil
}

// Bytes returns the region's contents, for the front-end side, which owns the memory.
func (r *Region) Bytes() []byte { return r.data }

func (r *Region) String() string {
	return fmt.Sprintf("region{gpa %#x size %#x uaddr %#x offset %#x}",
		r.GuestPhysAddr, r.Size, r.UserAddr, r.MmapOffset)
}

// checkRanges rejects a zero or absurd size and ranges whose last byte is beyond 2^64-1. A
// region may end exactly at 2^64.
func checkRanges(gpa, size, uaddr uint64) error {
	if size == 0 || size > MaxMapSize {
		return fmt.Errorf("region size %#x not in 1..%#x: %w", size, uint64(MaxMapSize), ErrInvalidRegion)
	}
	if _, c := bits.Add64(gpa, size-1, 0); c != 0 {
		return fmt.Errorf("region at GPA %#x size %#x wraps around: %w", gpa, size, ErrInvalidRegion)
	}
	if _, c := bits.Add64(uaddr, size-1, 0); c != 0 {
		return fmt.Errorf("region at user address %#x size %#x wraps around: %w", uaddr, size, ErrInvalidRegion)
	}
	return nil
}

func (r *Region) validate() error {
	if r == nil {
		return fmt.Errorf("nil region: %w", ErrInvalidRegion)
	}
	if err := checkRanges(r.GuestPhysAddr, r.Size, r.UserAddr); err != nil {
		return err
	}
	if r.closed.Load() || uint64(len(r.data)) != r.Size {
		return fmt.Errorf("%v: closed or size does not match its memory: %w", r, ErrInvalidRegion)
	}
	return nil
}

// span is one region as seen in one address space. last (not end) avoids overflow for a region
// ending at 2^64.
type span struct {
	start, last uint64
	data        []byte
}

// Memory is an immutable set of regions whose guest-physical ranges do not overlap and whose
// user-address ranges do not overlap. The zero value and nil are empty memories.
type Memory struct {
	regions []*Region // sorted by GuestPhysAddr
	byGPA   []span    // sorted by start
	byUser  []span    // sorted by start
}

// New builds a Memory from regions (in any order). It fails on invalid regions, on overlapping
// ranges in either address space and on more than MaxRegions regions.
func New(regions ...*Region) (*Memory, error) {
	if len(regions) > MaxRegions {
		return nil, fmt.Errorf("%d regions, at most %d allowed: %w", len(regions), MaxRegions, ErrInvalidRegion)
	}
	for _, r := range regions {
		if err := r.validate(); err != nil {
			return nil, err
		}
	}
	m := &Memory{
		regions: slices.Clone(regions),
		byGPA:   make([]span, len(regions)),
		byUser:  make([]span, len(regions)),
	}
	slices.SortFunc(m.regions, func(a, b *Region) int {
		return cmpU64(a.GuestPhysAddr, b.GuestPhysAddr)
	})
	for i, r := range m.regions {
		m.byGPA[i] = span{r.GuestPhysAddr, r.GuestPhysAddr + (r.Size - 1), r.data}
		m.byUser[i] = span{r.UserAddr, r.UserAddr + (r.Size - 1), r.data}
	}
	slices.SortFunc(m.byUser, func(a, b span) int { return cmpU64(a.start, b.start) })
	for i := 1; i < len(regions); i++ {
		if m.byGPA[i].start <= m.byGPA[i-1].last {
			return nil, fmt.Errorf("%v overlaps %v in guest-physical space: %w",
				m.regions[i], m.regions[i-1], ErrInvalidRegion)
		}
		if m.byUser[i].start <= m.byUser[i-1].last {
			return nil, fmt.Errorf("regions at user addresses %#x and %#x overlap: %w",
				m.byUser[i-1].start, m.byUser[i].start, ErrInvalidRegion)
		}
	}
	return m, nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Regions returns the regions sorted by guest-physical address. The slice is a copy.
func (m *Memory) Regions() []*Region {
	if m == nil {
		return nil
	}
	return slices.Clone(m.regions)
}

// With returns a new Memory holding m's regions and r (ADD_MEM_REG).
func (m *Memory) With(r *Region) (*Memory, error) {
	var rs []*Region
	if m != nil {
		rs = m.regions
	}
	if len(rs) >= MaxRegions {
		return nil, fmt.Errorf("cannot add %v: already %d regions: %w", r, MaxRegions, ErrInvalidRegion)
	}
	return New(append(slices.Clip(rs), r)...)
}

// Without returns a new Memory lacking the region with exactly this guest-physical address, size
// and user address (REM_MEM_REG), and that region, which the caller closes once nothing uses it.
func (m *Memory) Without(gpa, size, uaddr uint64) (*Memory, *Region, error) {
	if m != nil {
		for i, r := range m.regions {
			if r.GuestPhysAddr == gpa && r.Size == size && r.UserAddr == uaddr {
				rest := slices.Concat(m.regions[:i], m.regions[i+1:])
				nm, err := New(rest...)
				if err != nil { // cannot happen: a subset of a valid table is valid
					return nil, nil, err
				}
				return nm, r, nil
			}
		}
	}
	return nil, nil, fmt.Errorf("no region at GPA %#x size %#x user address %#x: %w",
		gpa, size, uaddr, ErrInvalidRegion)
}

// find returns the index of the span containing addr, or -1.
func find(spans []span, addr uint64) int {
	// Largest i with spans[i].start <= addr.
	lo, hi := 0, len(spans)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if spans[mid].start <= addr {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	i := lo - 1
	if i < 0 || addr > spans[i].last {
		return -1
	}
	return i
}

// slice returns n bytes at addr, which must lie inside one span. n == 0 is allowed, but addr must
// still be a mapped address: an empty access at an arbitrary address is as suspect as a
// non-empty one, and refusing it keeps the rule simple.
func slice(spans []span, addr, n uint64) ([]byte, bool) {
	i := find(spans, addr)
	if i < 0 {
		return nil, false
	}
	s := &spans[i]
	off := addr - s.start
	if n > s.last-addr+1 { // s.last-addr+1 >= 1 and cannot overflow: size <= MaxMapSize
		return nil, false
	}
	return s.data[off : off+n : off+n], true
}

// Slice returns the n bytes at guest-physical address gpa. They must lie inside one region.
// n == 0 returns an empty slice, but gpa must still be mapped.
func (m *Memory) Slice(gpa, n uint64) ([]byte, error) {
	if m != nil {
		if b, ok := slice(m.byGPA, gpa, n); ok {
			return b, nil
		}
	}
	return nil, fmt.Errorf("%d bytes at GPA %#x: %w", n, gpa, ErrOutOfBounds)
}

// UserSlice returns the n bytes at front-end virtual address uaddr, which must lie inside one
// region. n == 0 returns an empty slice, but uaddr must still be mapped.
func (m *Memory) UserSlice(uaddr, n uint64) ([]byte, error) {
	if m != nil {
		if b, ok := slice(m.byUser, uaddr, n); ok {
			return b, nil
		}
	}
	return nil, fmt.Errorf("%d bytes at user address %#x: %w", n, uaddr, ErrOutOfBounds)
}

// AppendIovecs appends to dst the n bytes at guest-physical address gpa as one slice per region
// they touch; a range may span regions that are adjacent in guest-physical space. On error dst
// is returned with its original length. n == 0 appends nothing, but gpa must still be mapped.
// The loop is bounded by the number of regions.
func (m *Memory) AppendIovecs(dst [][]byte, gpa, n uint64) ([][]byte, error) {
	var spans []span
	if m != nil {
		spans = m.byGPA
	}
	orig := len(dst)
	i := find(spans, gpa)
	if i < 0 {
		return dst, fmt.Errorf("%d bytes at GPA %#x: %w", n, gpa, ErrOutOfBounds)
	}
	if n == 0 {
		return dst, nil
	}
	if _, c := bits.Add64(gpa, n-1, 0); c != 0 {
		return dst, fmt.Errorf("%d bytes at GPA %#x wrap around: %w", n, gpa, ErrOutOfBounds)
	}
	start, addr := gpa, gpa
	for {
		s := &spans[i]
		off := addr - s.start
		room := s.last - addr + 1 // >= 1
		if n <= room {
			return append(dst, s.data[off:off+n:off+n]), nil
		}
		dst = append(dst, s.data[off:])
		n -= room
		// The range does not wrap and n > 0 bytes remain, so s.last < 2^64-1.
		addr = s.last + 1
		i++
		if i == len(spans) || spans[i].start != addr {
			return dst[:orig], fmt.Errorf("range at GPA %#x: GPA %#x not mapped: %w", start, addr, ErrOutOfBounds)
		}
	}
}

// Close closes all regions. The Memory and every Memory sharing a region with it become
// unusable.
func (m *Memory) Close() error {
	if m == nil {
		return nil
	}
	var errs []error
	for _, r := range m.regions {
		if err := r.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
