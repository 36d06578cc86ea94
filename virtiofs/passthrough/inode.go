package passthrough

import (
	"bytes"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// nodeKey identifies a host inode: a file reached by two names (hard links, a second lookup)
// has one key and so one node.
type nodeKey struct {
	dev, ino, mnt uint64
}

// modeSubmount, in inode.mode next to the S_IFMT bits, marks a directory on another mount than
// its parent.
const modeSubmount = 1 << 31

// inode is one node of the table. It is kept small: there is one per file the guest caches.
type inode struct {
	key  nodeKey
	refs uint64       // guest lookup count; guarded by the shard's mu
	fh   encHandle    // file handle (see nameToHandle), or nil when fd is held; immutable
	fd   atomic.Int32 // O_PATH|O_NOFOLLOW; -1 with fh until hold sets it; closed by the last unpin
	mode uint32       // S_IFMT bits | modeSubmount; immutable
	pins atomic.Int32 // 1 while in the table, +1 per request using fd

	locks atomic.Pointer[nodeLocks] // remote POSIX lock owners; nil until the first lock request
}

func (n *inode) typ() uint32     { return n.mode & unix.S_IFMT }
func (n *inode) isDir() bool     { return n.typ() == unix.S_IFDIR }
func (n *inode) isSymlink() bool { return n.typ() == unix.S_IFLNK }
func (n *inode) isRegular() bool { return n.typ() == unix.S_IFREG }

const (
	shardBits = 4
	numShards = 1 << shardBits
	shardMask = numShards - 1

	// A node id is gen<<32 | slot<<shardBits | shard: the shard, the node's slot in it, and
	// the slot's generation, which starts at 1 (so no id is 0 or the root's 1) and grows each
	// time the slot is freed, so an id is never handed out twice.
	genShift = 32
	// maxSlots bounds the slots of one shard, so the table holds at most
	// numShards*maxSlots (2^26, 67 108 864) nodes besides the root; a new node beyond that
	// answers ENFILE. The bound leaves room in the id (slot < 2^(genShift-shardBits)) and in
	// an index entry (1 + slot < 2^entrySlotBits).
	maxSlots = 1 << 22
	// Slots come in chunks that never move: growing the table allocates a chunk, it copies
	// none, and a full table costs no more than a partial chunk per shard above its slots.
	chunkBits = 8
	chunkSize = 1 << chunkBits
	chunkMask = chunkSize - 1

	// An index entry is tag | 1 + slot; see shard.
	entrySlotBits = 23
	entrySlotMask = 1<<entrySlotBits - 1
	minIndex      = 64 // entries of the first index
)

// slot holds one node of a shard, or none; slots are reused through the shard's free list.
type slot struct {
	n    *inode // nil when free
	gen  uint32 // generation of n's id; when free, that of the next id from this slot
	next uint32 // when free: 1 + the next free slot, 0 for none
}

// shard is one part of the inode table. Node ids carry their shard in the low bits, and a key
// always hashes to the shard of its node, so both lookups stay within one shard.
//
// Nodes are found by id through their slot: an index and a generation check. A freed slot
// goes to the head of the free list with its generation one higher; a slot whose generation
// has reached its maximum is not freed again but retired, so ids stay unique for the FS's
// life. Slot memory is kept once allocated (16 bytes a slot, at the most slots the shard ever
// held), as the C virtiofsd keeps its id map.
//
// Nodes are found by key through index, an open-addressing hash table (linear probing, at
// most half full, deletion by moving entries back) of 4-byte entries: 1 + the node's slot,
// and above it 9 bits of the key's hash as a tag, so that a probe reads a node's key only
// when the tag matches. Every entry names a slot in use. A node whose key moved on to a new
// node (see insert) has no entry. Growing rehashes the whole index under mu, reading each
// node's key: about 140 ns an entry here (35 ms for 250 000 in one shard, 4 million nodes in
// the table), once per doubling, where Go's map grew by parts.
type shard struct {
	mu      sync.RWMutex
	num     uint64             // this shard's number: the low bits of its ids; immutable
	chunks  []*[chunkSize]slot // guarded by mu
	top     uint32             // slots ever handed out (free, in use or retired); guarded by mu
	free    uint32             // 1 + the first free slot, 0 for none; guarded by mu
	index   []uint32           // 0 for no entry; a power of two long, or nil; guarded by mu
	indexed int                // entries in index; guarded by mu
	_       [32]byte           // keep shards on separate cache lines (128 bytes each)
}

// slotAt returns slot i, which exists. Called with mu held.
func (s *shard) slotAt(i uint32) *slot { return &s.chunks[i>>chunkBits][i&chunkMask] }

func (s *shard) id(i uint32, gen uint32) uint64 {
	return uint64(gen)<<genShift | uint64(i)<<shardBits | s.num
}

// lookup returns the node of id, or nil when id is not one in use: never handed out,
// forgotten, or of a slot reused since. The caller has checked id's shard bits. Called with
// mu held.
func (s *shard) lookup(id uint64) *inode {
	i := uint32(id) >> shardBits
	if i < s.top {
		if sl := s.slotAt(i); sl.gen == uint32(id>>genShift) {
			return sl.n // nil if free: its generation is that of an id not handed out yet
		}
	}
	return nil
}

// alloc puts n in a free slot and returns the slot, or false when the shard is full. Called
// with mu held for writing.
func (s *shard) alloc(n *inode) (uint32, bool) {
	var i uint32
	switch {
	case s.free != 0:
		i = s.free - 1
		sl := s.slotAt(i)
		s.free, sl.next = sl.next, 0
	case s.top < maxSlots:
		i = s.top
		if i&chunkMask == 0 {
			s.chunks = append(s.chunks, new([chunkSize]slot))
		}
		s.top++
		s.slotAt(i).gen = 1
	default:
		return 0, false
	}
	s.slotAt(i).n = n
	return i, true
}

// release frees slot i, which is in use. Called with mu held for writing.
func (s *shard) release(i uint32) {
	sl := s.slotAt(i)
	sl.n = nil
	if sl.gen == math.MaxUint32 {
		return // retired: its every id was handed out
	}
	sl.gen++
	sl.next = s.free
	s.free = i + 1
}

// keyHash folds a key into 64 bits; the index places a key by its high bits and tags its
// entry with bits 23-31. For one device and mount it is one-to-one on inode numbers.
func keyHash(k nodeKey) uint64 {
	return (k.ino ^ (k.dev*0x9e3779b97f4a7c15 + k.mnt*0xc2b2ae3d27d4eb4f)) * 0x9e3779b97f4a7c15
}

func entryTag(h uint64) uint32 { return uint32(h) &^ entrySlotMask }

// home is where the entry of a key with hash h belongs in an index of n entries.
func home(h uint64, n int) int { return int(h >> (64 - bits.TrailingZeros(uint(n)))) }

// find returns the slot of the node with key k, and where its entry is in index; for a key
// not there, nil and where its entry would go (-1 with no index). Called with mu held.
func (s *shard) find(k nodeKey) (i uint32, sl *slot, at int) {
	if s.index == nil {
		return 0, nil, -1
	}
	h := keyHash(k)
	tag, mask := entryTag(h), len(s.index)-1
	for at = home(h, len(s.index)); ; at = (at + 1) & mask {
		e := s.index[at]
		if e == 0 {
			return 0, nil, at
		}
		if e&^entrySlotMask == tag {
			i = e&entrySlotMask - 1
			if sl = s.slotAt(i); sl.n.key == k {
				return i, sl, at
			}
		}
	}
}

// addKey gives key k, which has no entry, the entry tag | 1 + slot i, at at if the index has
// room. Called with mu held for writing.
func (s *shard) addKey(k nodeKey, i uint32, at int) {
	h := keyHash(k)
	if 2*(s.indexed+1) > len(s.index) {
		s.grow()
		at = s.vacancy(h)
	}
	s.index[at] = entryTag(h) | (i + 1)
	s.indexed++
}

// vacancy returns the first empty entry from the home of hash h. Called with mu held.
func (s *shard) vacancy(h uint64) int {
	mask := len(s.index) - 1
	at := home(h, len(s.index))
	for s.index[at] != 0 {
		at = (at + 1) & mask
	}
	return at
}

// grow doubles the index. Called with mu held for writing.
func (s *shard) grow() {
	old := s.index
	s.index = make([]uint32, max(2*len(old), minIndex))
	for _, e := range old {
		if e != 0 {
			s.index[s.vacancy(keyHash(s.slotAt(e&entrySlotMask-1).n.key))] = e
		}
	}
}

// deleteKey removes the entry of slot i, whose node has key k, if it has one (not when k has
// moved on to another node): the entries after it in its run move back where their probes
// would find them. Called with mu held for writing.
func (s *shard) deleteKey(k nodeKey, i uint32) {
	if s.index == nil {
		return
	}
	mask := len(s.index) - 1
	at := home(keyHash(k), len(s.index))
	for s.index[at]&entrySlotMask != i+1 {
		if s.index[at] == 0 {
			return
		}
		at = (at + 1) & mask
	}
	for next := (at + 1) & mask; s.index[next] != 0; next = (next + 1) & mask {
		e := s.index[next]
		// e may move to the hole at at if its home is not in (at, next].
		if h := home(keyHash(s.slotAt(e&entrySlotMask-1).n.key), len(s.index)); (next-h)&mask >= (next-at)&mask {
			s.index[at] = e
			at = next
		}
	}
	s.index[at] = 0
	s.indexed--
}

// nodeTable maps node ids to inodes. The root (id 1) lives outside the shards and is never
// counted or dropped.
type nodeTable struct {
	root   *inode
	shards [numShards]shard
	count  atomic.Int64 // nodes in the shards
	fds    *atomic.Int64
}

func (t *nodeTable) init(root *inode, fds *atomic.Int64) {
	t.root = root
	t.fds = fds
	for i := range t.shards {
		t.shards[i].num = uint64(i)
	}
}

func shardOf(k nodeKey) uint64 {
	h := k.ino*0x9e3779b97f4a7c15 ^ k.dev*0xc2b2ae3d27d4eb4f ^ k.mnt
	h ^= h >> 29
	return h & shardMask
}

// get returns the node with the given id, pinned; the caller unpins it with put.
func (t *nodeTable) get(id uint64) (*inode, bool) {
	if id == rootID {
		n := t.root
		n.pins.Add(1)
		return n, true
	}
	s := &t.shards[id&shardMask]
	s.mu.RLock()
	n := s.lookup(id)
	if n != nil {
		n.pins.Add(1) // at least 1 (the table's) while we hold the lock
	}
	s.mu.RUnlock()
	return n, n != nil
}

// put unpins n, closing its fd if it was the last pin, and with it the descriptors of its lock
// owners (see nodeLocks).
func (t *nodeTable) put(n *inode) {
	if n.pins.Add(-1) == 0 {
		if l := n.locks.Load(); l != nil {
			l.closeAll(t.fds)
		}
		if fd := n.fd.Load(); fd >= 0 {
			unix.Close(int(fd))
			t.fds.Add(-1)
		}
	}
}

// insert adds one lookup reference to the node with key k, creating it with fd (or file handle
// fh, then fd is -1) and mode when it does not exist. It reports whether fd was taken; if not,
// the caller closes it. The node returned is not pinned: only its immutable fields other than
// fd may be read. A new node that does not fit in the table (see maxSlots) answers ENFILE.
//
// A node that keeps a file handle does not keep its inode alive, so the inode number may have
// been reused by another file since (same key, another generation: another handle). Then the
// key moves to a new node; the old one stays, answering ESTALE, until the guest forgets it.
func (t *nodeTable) insert(k nodeKey, fd int, fh encHandle, mode uint32) (id uint64, n *inode, took bool, e unix.Errno) {
	if k == t.root.key {
		// The root reached again (a bind mount of it inside itself): it is not counted.
		return rootID, t.root, false, 0
	}
	s := &t.shards[shardOf(k)]
	s.mu.Lock()
	i, sl, at := s.find(k)
	if sl != nil && (sl.n.fh == nil || fh == nil || bytes.Equal(handleBytes(sl.n.fh), handleBytes(fh))) {
		sl.n.refs++
		id, n = s.id(i, sl.gen), sl.n
		s.mu.Unlock()
		return id, n, false, 0
	}
	n = &inode{key: k, refs: 1, fh: fh, mode: mode}
	n.fd.Store(int32(fd))
	n.pins.Store(1)
	j, ok := s.alloc(n)
	if !ok {
		s.mu.Unlock()
		return 0, nil, false, unix.ENFILE
	}
	if sl != nil {
		s.index[at] = entryTag(keyHash(k)) | (j + 1) // the key moves on
	} else {
		s.addKey(k, j, at)
	}
	id = s.id(j, s.slotAt(j).gen)
	s.mu.Unlock()
	t.count.Add(1)
	if fd >= 0 {
		t.fds.Add(1)
	}
	return id, n, true, 0
}

// held reports whether the node of key k, if there is one, keeps its inode's descriptor: then
// the key names that inode and no other (see ref). The root counts.
func (t *nodeTable) held(k nodeKey) bool {
	if k == t.root.key {
		return true
	}
	s := &t.shards[shardOf(k)]
	s.mu.RLock()
	_, sl, _ := s.find(k)
	ok := sl != nil && sl.n.fh == nil
	s.mu.RUnlock()
	return ok
}

// ref adds one lookup reference to the node with key k and returns it, as insert does for a
// node that exists, but only a node that keeps its descriptor: that descriptor keeps the inode
// alive, so its number cannot have passed to another file, and a key found by stat names the
// node's own inode. A node that keeps a file handle does not (see insert), and is not found
// here. The node returned is not pinned, as with insert.
func (t *nodeTable) ref(k nodeKey) (id uint64, n *inode, ok bool) {
	if k == t.root.key {
		return rootID, t.root, true
	}
	s := &t.shards[shardOf(k)]
	s.mu.Lock()
	defer s.mu.Unlock()
	i, sl, _ := s.find(k)
	if sl == nil || sl.n.fh != nil {
		return 0, nil, false
	}
	sl.n.refs++ // at least 1: a node whose count reached 0 has left the index
	return s.id(i, sl.gen), sl.n, true
}

// hold gives fd to the node with key k if it keeps a file handle and no descriptor yet, and
// reports whether it took fd.
func (t *nodeTable) hold(k nodeKey, fd int) bool {
	s := &t.shards[shardOf(k)]
	s.mu.RLock()
	defer s.mu.RUnlock() // the node stays in the table, pinned by it, while the lock is held
	_, sl, _ := s.find(k)
	if sl == nil || sl.n.fh == nil || !sl.n.fd.CompareAndSwap(-1, int32(fd)) {
		return false
	}
	t.fds.Add(1)
	return true
}

// forget drops nlookup references to node id; at zero the node leaves the table. Unknown ids
// and the root are ignored, and the count never goes below zero.
func (t *nodeTable) forget(id, nlookup uint64) {
	if id == rootID || nlookup == 0 {
		return
	}
	s := &t.shards[id&shardMask]
	s.mu.Lock()
	n := s.lookup(id)
	if n == nil {
		s.mu.Unlock()
		return
	}
	if nlookup < n.refs {
		n.refs -= nlookup
		s.mu.Unlock()
		return
	}
	n.refs = 0
	i := uint32(id) >> shardBits
	s.deleteKey(n.key, i)
	s.release(i)
	s.mu.Unlock()
	t.count.Add(-1)
	t.put(n)
}

// dropAll removes every node but the root. Their slots are freed as by forget, so their ids
// stay unknown from then on.
func (t *nodeTable) dropAll() {
	var old []*inode
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for j := range s.top {
			if n := s.slotAt(j).n; n != nil {
				old = append(old, n)
				s.release(j)
			}
		}
		s.index, s.indexed = nil, 0
		s.mu.Unlock()
		for _, n := range old {
			t.count.Add(-1)
			t.put(n)
		}
		old = old[:0]
	}
}

// refs reports the lookup count of node id (0 if unknown); for tests.
func (t *nodeTable) refs(id uint64) uint64 {
	if id == rootID {
		return 0
	}
	s := &t.shards[id&shardMask]
	s.mu.RLock()
	defer s.mu.RUnlock()
	if n := s.lookup(id); n != nil {
		return n.refs
	}
	return 0
}

const inodeSize = unsafe.Sizeof(inode{})
