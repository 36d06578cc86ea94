package virtq

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

// Descriptor flags (virtq_desc.flags).
const (
	DescFNext     = 1 // the chain continues at next
	DescFWrite    = 2 // device-writable buffer
	DescFIndirect = 4 // the buffer is a table of descriptors
)

// Ring flags.
const (
	availFNoInterrupt = 1 // avail.flags: driver does not want interrupts
	usedFNoNotify     = 1 // used.flags: device does not want kicks
)

const (
	// MaxSize is the largest queue size virtio allows.
	MaxSize = 32768
	// MaxIndirectDescs is the indirect table length accepted even when it exceeds the queue size.
	// The spec bounds a chain by the queue size, but older Linux guests build indirect tables
	// longer than small queues (one entry per page of a large FUSE read); libvhost-user accepts up
	// to 1024 entries, and so do we. The limit is max(Size, MaxIndirectDescs).
	MaxIndirectDescs = 1024
)

var (
	// ErrInvalidConfig is wrapped by errors about the queue configuration given by the
	// front-end: size, alignment, rings outside memory.
	ErrInvalidConfig = errors.New("invalid virtqueue configuration")
	// ErrInvalidRing is wrapped by errors about what the guest put in the rings. A queue that
	// returned it is broken: the device must be reset.
	ErrInvalidRing = errors.New("guest violated the virtqueue protocol")
)

const descSize = 16

// Config is where a queue lives and what was negotiated for it.
type Config struct {
	Size                          uint16 // power of two, 1..32768
	DescAddr, AvailAddr, UsedAddr uint64 // front-end virtual addresses (SET_VRING_ADDR)
	LastAvail                     uint16 // from SET_VRING_BASE
	EventIdx                      bool   // VIRTIO_RING_F_EVENT_IDX negotiated
	Indirect                      bool   // VIRTIO_RING_F_INDIRECT_DESC negotiated
}

func availLen(size uint16) uint64 { return 6 + 2*uint64(size) }
func usedLen(size uint16) uint64  { return 6 + 8*uint64(size) }

// Chain is one descriptor chain popped by [Queue.Next]. In and Out are slices of guest memory;
// see the package documentation about reading them.
type Chain struct {
	Head   uint16
	In     [][]byte // device-readable buffers, in order
	Out    [][]byte // device-writable buffers, in order
	InLen  uint64   // total bytes in In
	OutLen uint64   // total bytes in Out
}

func (c *Chain) reset() {
	c.Head, c.In, c.Out, c.InLen, c.OutLen = 0, c.In[:0], c.Out[:0], 0, 0
}

// Queue is the device side of a split virtqueue. Its methods must be called from one goroutine
// at a time.
type Queue struct {
	mem         *guestmem.Memory
	cfg         Config
	mask        uint16
	maxIndirect uint32

	desc  []byte // 16*Size bytes
	avail []byte // 6+2*Size bytes
	used  []byte // 6+8*Size bytes

	// availWord is the offset in avail of the 4-aligned word holding avail.idx, 0 ({flags, idx})
	// or 2 ({idx, ring[0]}); availShift is where idx sits in it.
	availWord  int
	availShift uint

	lastAvail   uint16 // next avail entry to pop
	shadowAvail uint16 // avail.idx as last read; entries below it are published
	usedIdx     uint16 // next used entry to fill
	usedFlags   uint16 // our copy of used.flags (device-owned)

	notifiedUsed  uint16 // usedIdx when NeedsNotify last ran
	notifiedValid bool   // notifiedUsed is meaningful to the guest (EVENT_IDX)
	startUsed     uint16 // used.idx found in the ring by New (see Resumes)

	err       error  // sticky: set once the guest broke the protocol
	fenceWord uint32 // private word for fence
}

// New validates cfg and returns the device side of the queue it describes. It reads the used ring's
// current idx (non-zero after a back-end reconnect) and clears used.flags, so the driver kicks.
// After New the caller should process the queue and call [Queue.EnableNotify] before it first
// waits for a kick.
func New(mem *guestmem.Memory, cfg Config) (*Queue, error) {
	s := cfg.Size
	if s == 0 || s > MaxSize || s&(s-1) != 0 {
		return nil, fmt.Errorf("queue size %d is not a power of two in 1..%d: %w", s, MaxSize, ErrInvalidConfig)
	}
	if cfg.DescAddr%16 != 0 || cfg.AvailAddr%2 != 0 || cfg.UsedAddr%4 != 0 {
		return nil, fmt.Errorf("ring addresses desc %#x avail %#x used %#x not aligned to 16, 2, 4: %w",
			cfg.DescAddr, cfg.AvailAddr, cfg.UsedAddr, ErrInvalidConfig)
	}
	q := &Queue{
		cfg:         cfg,
		mask:        s - 1,
		maxIndirect: max(uint32(s), MaxIndirectDescs),
		lastAvail:   cfg.LastAvail,
		shadowAvail: cfg.LastAvail,
	}
	if err := q.mapRings(mem); err != nil {
		return nil, err
	}
	w := atomicLoadLE32(q.used, 0)
	q.usedIdx = uint16(w >> 16)
	q.startUsed = q.usedIdx
	q.notifiedUsed = q.usedIdx
	q.storeUsedWord()
	return q, nil
}

// mapRings translates the ring addresses in mem and checks the host alignment the atomic
// accesses need (it matches the front-end's alignment unless the memory table is odd).
func (q *Queue) mapRings(mem *guestmem.Memory) error {
	s := q.cfg.Size
	desc, err := mem.UserSlice(q.cfg.DescAddr, descSize*uint64(s))
	if err != nil {
		return fmt.Errorf("descriptor table: %w: %w", ErrInvalidConfig, err)
	}
	avail, err := mem.UserSlice(q.cfg.AvailAddr, availLen(s))
	if err != nil {
		return fmt.Errorf("avail ring: %w: %w", ErrInvalidConfig, err)
	}
	used, err := mem.UserSlice(q.cfg.UsedAddr, usedLen(s))
	if err != nil {
		return fmt.Errorf("used ring: %w: %w", ErrInvalidConfig, err)
	}
	if hostAddr(avail)%2 != 0 || hostAddr(used)%4 != 0 {
		return fmt.Errorf("rings mapped at misaligned host addresses: %w", ErrInvalidConfig)
	}
	q.mem, q.desc, q.avail, q.used = mem, desc, avail, used
	if hostAddr(avail)%4 == 0 {
		q.availWord, q.availShift = 0, 16
	} else {
		q.availWord, q.availShift = 2, 0
	}
	return nil
}

// Remap re-translates the ring addresses after a memory table change, keeping the indices. If
// the rings are no longer mapped the queue is broken and must not be used again.
func (q *Queue) Remap(mem *guestmem.Memory) error {
	if err := q.mapRings(mem); err != nil {
		q.desc, q.avail, q.used, q.mem = nil, nil, nil, nil
		if q.err == nil {
			q.err = err
		}
		return err
	}
	return nil
}

// Size returns the queue size.
func (q *Queue) Size() uint16 { return q.cfg.Size }

// LastAvail returns the index of the next avail entry the device will pop (GET_VRING_BASE).
func (q *Queue) LastAvail() uint16 { return q.lastAvail }

// Err returns the error that broke the queue, or nil.
func (q *Queue) Err() error { return q.err }

func (q *Queue) loadAvailIdx() uint16 {
	return uint16(atomicLoadLE32(q.avail, q.availWord) >> q.availShift)
}

func (q *Queue) storeUsedWord() {
	atomicStoreLE32(q.used, 0, uint32(q.usedFlags)|uint32(q.usedIdx)<<16)
}

func (q *Queue) fail(err error) error {
	if q.err == nil {
		q.err = err
	}
	return q.err
}

// Next pops the next available chain into c, reusing c's slices: in steady state it does not
// allocate. It reports false if no chain is available. An error means the guest broke the
// protocol: the queue is broken and every later call returns the same error (and Complete,
// NeedsNotify and EnableNotify do nothing).
func (q *Queue) Next(c *Chain) (bool, error) {
	c.reset()
	if q.err != nil {
		return false, q.err
	}
	if q.lastAvail == q.shadowAvail {
		idx := q.loadAvailIdx() // acquire: entries below idx are readable after this
		if n := idx - q.lastAvail; n > q.cfg.Size {
			return false, q.fail(fmt.Errorf("%w: avail idx %d is %d entries past last avail %d, queue size %d",
				ErrInvalidRing, idx, n, q.lastAvail, q.cfg.Size))
		}
		q.shadowAvail = idx
		if idx == q.lastAvail {
			return false, nil
		}
	}
	off := 4 + 2*int(q.lastAvail&q.mask)
	head := binary.LittleEndian.Uint16(q.avail[off:])
	if head >= q.cfg.Size {
		return false, q.fail(fmt.Errorf("%w: avail entry %d: head %d >= queue size %d",
			ErrInvalidRing, q.lastAvail, head, q.cfg.Size))
	}
	if err := q.walk(c, head); err != nil {
		c.reset()
		return false, q.fail(fmt.Errorf("%w: chain at head %d: %w", ErrInvalidRing, head, err))
	}
	c.Head = head
	q.lastAvail++
	return true, nil
}

// Rewalk reads the chain at head, popped by Next earlier and not completed yet, into c again,
// translating its buffers through the queue's current memory. It is for completing a chain
// long after Next returned it (the reply of a request that had to wait): the slices Next
// returned are only valid as long as the memory table that produced them, and the caller cannot
// know whether that table has been replaced since. The chain is checked exactly as Next checks
// it; a chain the guest has rewritten into something invalid meanwhile is reported as an error
// wrapping [ErrInvalidRing], without breaking the queue (the chain was valid when popped, and
// the caller can still complete it with nothing written).
func (q *Queue) Rewalk(c *Chain, head uint16) error {
	c.reset()
	if q.err != nil {
		return q.err
	}
	if head >= q.cfg.Size {
		return fmt.Errorf("%w: head %d >= queue size %d", ErrInvalidRing, head, q.cfg.Size)
	}
	if err := q.walk(c, head); err != nil {
		c.reset()
		return fmt.Errorf("%w: chain at head %d: %w", ErrInvalidRing, head, err)
	}
	c.Head = head
	return nil
}

// Resumes reports whether q, fresh from New, takes over exactly where prev stopped: the same
// rings at the same addresses with the same features, q's first avail entry the one prev would
// have popped next, and the used ring's index where prev left it. That is how a front-end
// restarts a ring after pausing it (GET_VRING_BASE, then SET_VRING_BASE with the base it was
// given); the chains prev popped and did not complete are then still in flight and may be
// completed on q. A driver that reset and set its rings up afresh starts at avail and used
// index 0, which cannot match while prev has a chain in flight (prev's last avail and used
// indices then differ). prev must no longer be in use.
func (q *Queue) Resumes(prev *Queue) bool {
	if prev == nil || prev == q {
		return false
	}
	a, b := q.cfg, prev.cfg
	a.LastAvail, b.LastAvail = 0, 0
	return a == b && q.cfg.LastAvail == prev.lastAvail && q.startUsed == prev.usedIdx
}

// desc is one descriptor copied out of guest memory.
type desc struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func readDesc(table []byte, i uint32) desc {
	b := table[i*descSize : i*descSize+descSize]
	return desc{
		addr:  binary.LittleEndian.Uint64(b[0:]),
		len:   binary.LittleEndian.Uint32(b[8:]),
		flags: binary.LittleEndian.Uint16(b[12:]),
		next:  binary.LittleEndian.Uint16(b[14:]),
	}
}

// walk collects the buffers of the chain starting at head (< Size) into c.
func (q *Queue) walk(c *Chain, head uint16) error {
	table := q.desc
	n := uint32(q.cfg.Size) // entries in table
	i := uint32(head)
	steps := uint32(0)
	inIndirect := false
	sawWritable := false
	for {
		// i < n holds here; steps bounds the walk of a table to its length, which catches loops.
		if steps++; steps > n {
			return fmt.Errorf("more than %d descriptors (loop?)", n)
		}
		d := readDesc(table, i) // the only read of this descriptor
		if d.flags&DescFIndirect != 0 {
			switch {
			case !q.cfg.Indirect:
				return fmt.Errorf("%s: INDIRECT not negotiated", descName(inIndirect, i))
			case inIndirect:
				return fmt.Errorf("%s: nested indirect table", descName(inIndirect, i))
			case d.flags&DescFNext != 0:
				return fmt.Errorf("%s: INDIRECT with NEXT", descName(inIndirect, i))
			case d.len == 0 || d.len%descSize != 0 || d.len/descSize > q.maxIndirect:
				return fmt.Errorf("%s: indirect table of %d bytes (want a multiple of %d, at most %d entries)",
					descName(inIndirect, i), d.len, descSize, q.maxIndirect)
			}
			t, err := q.mem.Slice(d.addr, uint64(d.len))
			if err != nil {
				return fmt.Errorf("%s: indirect table: %w", descName(inIndirect, i), err)
			}
			// The WRITE flag of the descriptor pointing to the table is ignored (spec).
			table, n, i, steps, inIndirect = t, d.len/descSize, 0, 0, true
			continue
		}
		if d.len != 0 {
			var err error
			if d.flags&DescFWrite != 0 {
				sawWritable = true
				c.Out, err = q.mem.AppendIovecs(c.Out, d.addr, uint64(d.len))
				var carry uint64
				c.OutLen, carry = bits.Add64(c.OutLen, uint64(d.len), 0)
				if carry != 0 {
					return errors.New("writable length overflows")
				}
			} else {
				if sawWritable {
					return fmt.Errorf("%s: readable after writable", descName(inIndirect, i))
				}
				c.In, err = q.mem.AppendIovecs(c.In, d.addr, uint64(d.len))
				var carry uint64
				c.InLen, carry = bits.Add64(c.InLen, uint64(d.len), 0)
				if carry != 0 {
					return errors.New("readable length overflows")
				}
			}
			if err != nil {
				return fmt.Errorf("%s: %w", descName(inIndirect, i), err)
			}
		}
		if d.flags&DescFNext == 0 {
			return nil
		}
		next := uint32(d.next)
		if next >= n {
			return fmt.Errorf("%s: next %d >= table size %d", descName(inIndirect, i), next, n)
		}
		i = next
	}
}

func descName(inIndirect bool, i uint32) string {
	if inIndirect {
		return fmt.Sprintf("indirect descriptor %d", i)
	}
	return fmt.Sprintf("descriptor %d", i)
}

// Complete returns the chain at head to the driver, reporting written bytes written into its
// writable buffers (not more: the spec requires the exact count). The element is written before
// the used idx is published with a release store. Complete does nothing on a broken queue.
func (q *Queue) Complete(head uint16, written uint32) {
	if q.err != nil {
		return
	}
	off := 4 + 8*int(q.usedIdx&q.mask)
	e := q.used[off : off+8]
	binary.LittleEndian.PutUint32(e[0:], uint32(head))
	binary.LittleEndian.PutUint32(e[4:], written)
	q.usedIdx++
	q.storeUsedWord()
}

// NeedsNotify reports whether the driver wants an interrupt (a write to the call eventfd) for
// the chains completed since the previous call, and starts a new batch. With EVENT_IDX that is
// vring_need_event(used_event, new, old) — always true for the first batch after New, since the
// guest may be waiting on entries completed before a reconnect; otherwise it is whether
// avail.flags lacks NO_INTERRUPT. False if nothing was completed.
func (q *Queue) NeedsNotify() bool {
	if q.err != nil {
		return false
	}
	old, valid, cur := q.notifiedUsed, q.notifiedValid, q.usedIdx
	if old == cur {
		return false
	}
	q.notifiedUsed, q.notifiedValid = cur, true
	fence(&q.fenceWord) // the used idx store must be visible before we read the driver's wish
	if q.cfg.EventIdx {
		if !valid {
			return true
		}
		return vringNeedEvent(loadLE16(q.avail, 4+2*int(q.cfg.Size)), cur, old)
	}
	var flags uint16
	if q.availWord == 0 {
		flags = uint16(atomicLoadLE32(q.avail, 0))
	} else {
		flags = loadLE16(q.avail, 0)
	}
	return flags&availFNoInterrupt == 0
}

// DisableNotify tells the driver it need not kick. Without EVENT_IDX it sets used.flags
// NO_NOTIFY; with EVENT_IDX it does nothing: avail_event stays where EnableNotify left it, behind
// the entries the driver adds meanwhile, so the driver does not kick for them.
func (q *Queue) DisableNotify() {
	if q.err != nil || q.cfg.EventIdx || q.usedFlags&usedFNoNotify != 0 {
		return
	}
	q.usedFlags |= usedFNoNotify
	q.storeUsedWord()
}

// SuppressNotify tells the driver it need not kick for any chain it publishes from now on, until
// EnableNotify: for a device that polls the avail ring ([Queue.Available]) instead of waiting
// for kicks. Without EVENT_IDX it sets used.flags NO_NOTIFY, as DisableNotify does. With
// EVENT_IDX, DisableNotify would leave avail_event at the last avail entry, so the driver would
// still kick for the next chain it adds; SuppressNotify puts avail_event one entry behind
// instead. The driver kicks when its avail idx moves past avail_event, and its idx can never be
// more than Size (at most 32768) ahead of the entries the device has popped, so it does not pass
// an index 65535 entries ahead of where it is: no kick until EnableNotify moves avail_event
// again (a driver that checks late for entries the device has popped already may still kick
// once, which costs a wake-up and loses nothing). Like DisableNotify it has no fence: kicks
// that arrive anyway are harmless.
func (q *Queue) SuppressNotify() {
	if q.err != nil {
		return
	}
	if q.cfg.EventIdx {
		storeLE16(q.used, 4+8*int(q.cfg.Size), q.lastAvail-1)
		return
	}
	q.DisableNotify()
}

// Available reports whether the driver has published chains that Next has not popped yet. It
// is one acquire load of avail idx, validated by nothing: the Next that follows checks it. A
// broken queue reports false.
func (q *Queue) Available() bool {
	return q.err == nil && q.loadAvailIdx() != q.lastAvail
}

// EnableNotify asks the driver to kick for the next chain (EVENT_IDX: avail_event = last avail;
// otherwise clear NO_NOTIFY), then, after a full barrier, reports whether chains arrived that
// Next has not popped yet. If so the driver may not kick for them: the caller must process the
// queue again instead of waiting. A broken queue reports false.
func (q *Queue) EnableNotify() bool {
	if q.err != nil {
		return false
	}
	if q.cfg.EventIdx {
		storeLE16(q.used, 4+8*int(q.cfg.Size), q.lastAvail)
	} else if q.usedFlags&usedFNoNotify != 0 {
		q.usedFlags &^= usedFNoNotify
		q.storeUsedWord()
	}
	fence(&q.fenceWord) // our wish must be visible before we look for new entries
	return q.loadAvailIdx() != q.lastAvail
}
