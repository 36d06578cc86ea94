package passthrough

import (
	"bytes"
	"math"
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
	// answers ENFILE. The bound leaves room in the id (slot < 2^(genShift-shardBits)).
	maxSlots = 1 << 22
	// Slots come in chunks that never move: growing the table allocates a chunk, it copies
	// none, and a full table costs no more than a partial chunk per shard above its slots.
	chunkBits = 8
	chunkSize = 1 << chunkBits
	chunkMask = chunkSize - 1
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
// Nodes are found by key through byHash, keyed by keyHash of the key (8 bytes, not the key's
// 24: a map entry per cached inode is most of what the table costs). The node found is the
// one only if its key is the key; a key whose hash another node's key has already goes to
// byKey. See find and setKey.
type shard struct {
	mu     sync.RWMutex
	chunks []*[chunkSize]slot // guarded by mu
	top    uint32             // slots ever handed out (free, in use or retired); guarded by mu
	free   uint32             // 1 + the first free slot, 0 for none; guarded by mu
	byHash map[uint64]uint64  // node id by keyHash; guarded by mu
	byKey  map[nodeKey]uint64 // node id by key, for colliding keys; nil until one; guarded by mu
	_      [8]byte            // keep shards on separate cache lines
}

// slotOf returns the slot that id names in s (whose shard bits are the caller's to check),
// or nil when no such slot was ever handed out. Called with mu held.
func (s *shard) slotOf(id uint64) *slot {
	i := uint32(id) >> shardBits
	if c := i >> chunkBits; c < uint32(len(s.chunks)) {
		return &s.chunks[c][i&chunkMask]
	}
	return nil
}

// lookup returns the node of id, or nil when id is not one in use: never handed out,
// forgotten, or of a slot reused since. Called with mu held.
func (s *shard) lookup(id uint64) *inode {
	if sl := s.slotOf(id); sl != nil && sl.gen == uint32(id>>genShift) {
		return sl.n // nil if free: its generation is that of an id not handed out yet
	}
	return nil
}

// alloc puts n in a free slot and returns its id, or 0 when the shard is full. Called with mu
// held for writing.
func (s *shard) alloc(si uint64, n *inode) uint64 {
	var i uint32
	var sl *slot
	switch {
	case s.free != 0:
		i = s.free - 1
		sl = &s.chunks[i>>chunkBits][i&chunkMask]
		s.free, sl.next = sl.next, 0
	case s.top < maxSlots:
		i = s.top
		if i&chunkMask == 0 {
			s.chunks = append(s.chunks, new([chunkSize]slot))
		}
		s.top++
		sl = &s.chunks[i>>chunkBits][i&chunkMask]
		sl.gen = 1
	default:
		return 0
	}
	sl.n = n
	return uint64(sl.gen)<<genShift | uint64(i)<<shardBits | si
}

// release frees the slot of id, which is in use. Called with mu held for writing.
func (s *shard) release(id uint64) {
	sl := s.slotOf(id)
	sl.n = nil
	if sl.gen == math.MaxUint32 {
		return // retired: its every id was handed out
	}
	sl.gen++
	sl.next = s.free
	s.free = uint32(id)>>shardBits + 1
}

// keyHash folds a key into 64 bits. For one device and mount it is one-to-one on inode
// numbers, so keys of one file system never collide; keys of different ones rarely do.
func keyHash(k nodeKey) uint64 {
	return k.ino ^ (k.dev*0x9e3779b97f4a7c15 + k.mnt*0xc2b2ae3d27d4eb4f)
}

// find returns the id and node of key k. Called with mu held.
func (s *shard) find(k nodeKey) (uint64, *inode) {
	if id, ok := s.byHash[keyHash(k)]; ok {
		if n := s.lookup(id); n.key == k {
			return id, n
		}
	}
	if id, ok := s.byKey[k]; ok {
		return id, s.lookup(id)
	}
	return 0, nil
}

// setKey makes id the node of key k. Called with mu held for writing.
func (s *shard) setKey(k nodeKey, id uint64) {
	h := keyHash(k)
	if other, ok := s.byHash[h]; ok && s.lookup(other).key != k {
		if s.byKey == nil {
			s.byKey = make(map[nodeKey]uint64)
		}
		s.byKey[k] = id
		return
	}
	s.byHash[h] = id
}

// deleteKey forgets that id is the node of key k, unless the key has moved on to another node
// (see insert). Called with mu held for writing. (Ids are never 0, a missing entry's value.)
func (s *shard) deleteKey(k nodeKey, id uint64) {
	if h := keyHash(k); s.byHash[h] == id {
		delete(s.byHash, h)
	} else if s.byKey[k] == id {
		delete(s.byKey, k)
	}
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
		t.shards[i].byHash = make(map[uint64]uint64)
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
	si := shardOf(k)
	s := &t.shards[si]
	s.mu.Lock()
	if id, n := s.find(k); n != nil {
		if n.fh == nil || fh == nil || bytes.Equal(handleBytes(n.fh), handleBytes(fh)) {
			n.refs++
			s.mu.Unlock()
			return id, n, false, 0
		}
	}
	n = &inode{key: k, refs: 1, fh: fh, mode: mode}
	n.fd.Store(int32(fd))
	n.pins.Store(1)
	if id = s.alloc(si, n); id == 0 {
		s.mu.Unlock()
		return 0, nil, false, unix.ENFILE
	}
	s.setKey(k, id)
	s.mu.Unlock()
	t.count.Add(1)
	if fd >= 0 {
		t.fds.Add(1)
	}
	return id, n, true, 0
}

// hold gives fd to the node with key k if it keeps a file handle and no descriptor yet, and
// reports whether it took fd.
func (t *nodeTable) hold(k nodeKey, fd int) bool {
	s := &t.shards[shardOf(k)]
	s.mu.RLock()
	defer s.mu.RUnlock() // n stays in the table, pinned by it, while the lock is held
	_, n := s.find(k)
	if n == nil || n.fh == nil || !n.fd.CompareAndSwap(-1, int32(fd)) {
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
	s.deleteKey(n.key, id)
	s.release(id)
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
			sl := &s.chunks[j>>chunkBits][j&chunkMask]
			if sl.n != nil {
				old = append(old, sl.n)
				s.release(uint64(sl.gen)<<genShift | uint64(j)<<shardBits | uint64(i))
			}
		}
		s.byHash = make(map[uint64]uint64)
		s.byKey = nil
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
