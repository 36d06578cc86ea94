package virtq

import (
	"encoding/binary"
	"fmt"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

// Buf is a guest-physical buffer.
type Buf struct {
	Addr uint64
	Len  uint32
}

// Driver is the driver (guest) side of a split virtqueue, laid out by NewDriver in one
// contiguous, 16-aligned block of guest memory:
//
//	desc at base, 16*size bytes
//	avail right after it (16-aligned), 6+2*size bytes
//	used at the next 4-aligned offset, 6+8*size bytes
//
// It trusts the device only as far as memory safety goes: a bogus used element cannot make it
// touch memory outside its rings or corrupt its free list. Its methods must be called from one
// goroutine at a time.
type Driver struct {
	mem      *guestmem.Memory
	base     uint64
	size     uint16
	mask     uint16
	eventIdx bool

	desc, avail, used []byte

	next     []uint16 // free list and chain links, our own copy (the device may scribble on desc)
	chainLen []uint16 // descriptors in the table used by the chain headed here; 0: not in flight
	freeHead uint16
	numFree  uint16

	availIdx    uint16 // next avail entry to publish
	availFlags  uint16 // our copy of avail.flags
	kickedAvail uint16 // availIdx at the last NeedsKick
	lastUsed    uint16 // next used entry to pop

	fenceWord uint32
}

func usedOffset(size uint16) uint64 {
	return (descSize*uint64(size) + availLen(size) + 3) &^ 3
}

// DriverLayoutSize returns the bytes NewDriver needs for a queue of the given size.
func DriverLayoutSize(size uint16) uint64 { return usedOffset(size) + usedLen(size) }

// NewDriver lays out and zeroes a queue of the given size in mem at guest-physical base, which
// must be 16-aligned and have DriverLayoutSize(size) bytes in one region.
func NewDriver(mem *guestmem.Memory, base uint64, size uint16, eventIdx bool) (*Driver, error) {
	if size == 0 || size > MaxSize || size&(size-1) != 0 {
		return nil, fmt.Errorf("queue size %d is not a power of two in 1..%d: %w", size, MaxSize, ErrInvalidConfig)
	}
	if base%16 != 0 {
		return nil, fmt.Errorf("ring base %#x not 16-aligned: %w", base, ErrInvalidConfig)
	}
	b, err := mem.Slice(base, DriverLayoutSize(size))
	if err != nil {
		return nil, fmt.Errorf("ring memory: %w: %w", ErrInvalidConfig, err)
	}
	if hostAddr(b)%16 != 0 {
		return nil, fmt.Errorf("ring memory at misaligned host address: %w", ErrInvalidConfig)
	}
	clear(b)
	ao, uo := descSize*uint64(size), usedOffset(size)
	d := &Driver{
		mem:      mem,
		base:     base,
		size:     size,
		mask:     size - 1,
		eventIdx: eventIdx,
		desc:     b[:ao:ao],
		avail:    b[ao : ao+availLen(size) : ao+availLen(size)],
		used:     b[uo:],
		next:     make([]uint16, size),
		chainLen: make([]uint16, size),
		numFree:  size,
	}
	for i := range d.next {
		d.next[i] = uint16(i + 1) // the last link is never followed: numFree guards the list
	}
	return d, nil
}

// DescAddr returns the guest-physical address of the descriptor table.
func (d *Driver) DescAddr() uint64 { return d.base }

// AvailAddr returns the guest-physical address of the avail ring.
func (d *Driver) AvailAddr() uint64 { return d.base + descSize*uint64(d.size) }

// UsedAddr returns the guest-physical address of the used ring.
func (d *Driver) UsedAddr() uint64 { return d.base + usedOffset(d.size) }

// Size returns the queue size.
func (d *Driver) Size() uint16 { return d.size }

// NumFree returns how many descriptors of the table are free.
func (d *Driver) NumFree() uint16 { return d.numFree }

// Add publishes a chain of the readable buffers followed by the writable ones. Without
// indirectAt it takes one table descriptor per buffer; with it, it writes an indirect table of
// 16*n bytes at indirectAt.Addr (indirectAt.Len must be at least that) and takes a single
// INDIRECT descriptor. Zero-length buffers are passed through as zero-length descriptors.
func (d *Driver) Add(readable, writable []Buf, indirectAt *Buf) (head uint16, err error) {
	n := uint64(len(readable)) + uint64(len(writable))
	if n == 0 {
		return 0, fmt.Errorf("empty chain: %w", ErrInvalidConfig)
	}
	need := n
	var table []byte
	if indirectAt != nil {
		if n > MaxSize || descSize*n > uint64(indirectAt.Len) {
			return 0, fmt.Errorf("indirect table of %d descriptors does not fit %d bytes: %w",
				n, indirectAt.Len, ErrInvalidConfig)
		}
		if table, err = d.mem.Slice(indirectAt.Addr, descSize*n); err != nil {
			return 0, fmt.Errorf("indirect table: %w: %w", ErrInvalidConfig, err)
		}
		need = 1
	}
	if need > uint64(d.numFree) {
		return 0, fmt.Errorf("%d descriptors needed, %d free: %w", need, d.numFree, ErrInvalidConfig)
	}

	if table != nil {
		for k := range n {
			b, flags := bufAt(readable, writable, k)
			if k+1 < n {
				flags |= DescFNext
			}
			putDesc(table, uint32(k), b.Addr, b.Len, flags, uint16(k+1))
		}
	}

	head = d.freeHead
	cur := head
	for k := range need {
		var b Buf
		var flags uint16
		if table != nil {
			b, flags = Buf{indirectAt.Addr, uint32(descSize * n)}, DescFIndirect
		} else {
			b, flags = bufAt(readable, writable, k)
		}
		nxt := d.next[cur]
		if k+1 < need {
			flags |= DescFNext
		}
		putDesc(d.desc, uint32(cur), b.Addr, b.Len, flags, nxt)
		cur = nxt
	}
	d.freeHead = cur
	d.numFree -= uint16(need)
	d.chainLen[head] = uint16(need)
	d.Publish(head)
	return head, nil
}

func bufAt(readable, writable []Buf, k uint64) (Buf, uint16) {
	if k < uint64(len(readable)) {
		return readable[k], 0
	}
	return writable[k-uint64(len(readable))], DescFWrite
}

func putDesc(table []byte, i uint32, addr uint64, length uint32, flags, next uint16) {
	b := table[i*descSize : i*descSize+descSize]
	binary.LittleEndian.PutUint64(b[0:], addr)
	binary.LittleEndian.PutUint32(b[8:], length)
	binary.LittleEndian.PutUint16(b[12:], flags)
	binary.LittleEndian.PutUint16(b[14:], next)
}

// PopUsed returns the next used element: the head and byte count the device reported. A head the
// device made up (not in flight) is returned as is, truncated to 16 bits, and frees nothing.
func (d *Driver) PopUsed() (head uint16, written uint32, ok bool) {
	idx := uint16(atomicLoadLE32(d.used, 0) >> 16) // acquire: elements below idx are readable
	if idx == d.lastUsed {
		return 0, 0, false
	}
	off := 4 + 8*int(d.lastUsed&d.mask)
	id := binary.LittleEndian.Uint32(d.used[off:])
	written = binary.LittleEndian.Uint32(d.used[off+4:])
	d.lastUsed++
	if id < uint32(d.size) && d.chainLen[id] != 0 {
		d.free(uint16(id))
	}
	return uint16(id), written, true
}

func (d *Driver) free(head uint16) {
	last := head
	for range d.chainLen[head] - 1 {
		last = d.next[last]
	}
	d.numFree += d.chainLen[head]
	d.chainLen[head] = 0
	d.next[last] = d.freeHead
	d.freeHead = head
}

// NeedsKick reports whether the device wants a kick for what was published since the previous
// call: with EVENT_IDX, whether avail_event lies in that window; otherwise whether used.flags lacks
// NO_NOTIFY. False if nothing was published.
func (d *Driver) NeedsKick() bool {
	old, cur := d.kickedAvail, d.availIdx
	if old == cur {
		return false
	}
	d.kickedAvail = cur
	fence(&d.fenceWord) // the avail idx store must be visible before we read the device's wish
	if d.eventIdx {
		return vringNeedEvent(loadLE16(d.used, 4+8*int(d.size)), cur, old)
	}
	return atomicLoadLE32(d.used, 0)&usedFNoNotify == 0
}

// SetUsedEvent writes used_event (EVENT_IDX): the device interrupts when it moves the used idx
// past idx.
func (d *Driver) SetUsedEvent(idx uint16) {
	storeLE16(d.avail, 4+2*int(d.size), idx)
}

// EnableInterrupts asks for an interrupt on the next completion (EVENT_IDX: used_event = next
// used entry; otherwise clear NO_INTERRUPT), then, after a full barrier, reports whether
// completions are already waiting, for which no interrupt may come.
func (d *Driver) EnableInterrupts() (pending bool) {
	if d.eventIdx {
		d.SetUsedEvent(d.lastUsed)
	} else if d.availFlags&availFNoInterrupt != 0 {
		d.availFlags &^= availFNoInterrupt
		d.storeAvailWord()
	}
	fence(&d.fenceWord)
	return uint16(atomicLoadLE32(d.used, 0)>>16) != d.lastUsed
}

// DisableInterrupts tells the device no interrupts are wanted (avail.flags NO_INTERRUPT). With
// EVENT_IDX it does nothing: used_event stays behind.
func (d *Driver) DisableInterrupts() {
	if d.eventIdx || d.availFlags&availFNoInterrupt != 0 {
		return
	}
	d.availFlags |= availFNoInterrupt
	d.storeAvailWord()
}

func (d *Driver) storeAvailWord() {
	atomicStoreLE32(d.avail, 0, uint32(d.availFlags)|uint32(d.availIdx)<<16)
}

// Raw access, for tests that play a hostile guest. These bypass the free list: do not mix them
// with Add on the same descriptors.

// WriteDesc writes descriptor i of the table verbatim. i >= Size is ignored.
func (d *Driver) WriteDesc(i uint16, addr uint64, length uint32, flags, next uint16) {
	if i < d.size {
		putDesc(d.desc, uint32(i), addr, length, flags, next)
	}
}

// Publish puts head (any value) in the next avail entry and bumps avail idx (release).
func (d *Driver) Publish(head uint16) {
	binary.LittleEndian.PutUint16(d.avail[4+2*int(d.availIdx&d.mask):], head)
	d.availIdx++
	d.storeAvailWord()
}

// SetAvailIdx stores avail idx verbatim (release).
func (d *Driver) SetAvailIdx(idx uint16) {
	d.availIdx = idx
	d.storeAvailWord()
}

// AvailIdx returns the avail idx the driver last published.
func (d *Driver) AvailIdx() uint16 { return d.availIdx }

// WriteIndirect writes descs as an indirect table at guest-physical addr, verbatim.
func (d *Driver) WriteIndirect(addr uint64, descs []RawDesc) error {
	if len(descs) > 1<<20 {
		return fmt.Errorf("indirect table of %d descriptors too large: %w", len(descs), ErrInvalidConfig)
	}
	t, err := d.mem.Slice(addr, descSize*uint64(len(descs)))
	if err != nil {
		return err
	}
	for k, r := range descs {
		putDesc(t, uint32(k), r.Addr, r.Len, r.Flags, r.Next)
	}
	return nil
}

// RawDesc is a descriptor as written by WriteIndirect.
type RawDesc struct {
	Addr  uint64
	Len   uint32
	Flags uint16
	Next  uint16
}
