package passthrough

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

func newTable() *nodeTable {
	var fds atomic.Int64
	tab := &nodeTable{}
	tab.init(&inode{key: nodeKey{ino: 1}}, &fds)
	return tab
}

// keysOfShard returns n distinct keys of shard si.
func keysOfShard(si uint64, n int) []nodeKey {
	var ks []nodeKey
	for ino := uint64(100); len(ks) < n; ino++ {
		if k := (nodeKey{dev: 2049, ino: ino, mnt: 27}); shardOf(k) == si {
			ks = append(ks, k)
		}
	}
	return ks
}

func mustInsert(t *testing.T, tab *nodeTable, k nodeKey) uint64 {
	t.Helper()
	id, n, took, e := tab.insert(k, -1, nil, unix.S_IFREG)
	if e != 0 || n == nil || n.key != k || id == 0 || id == rootID {
		t.Fatalf("insert %+v: id %d, node %v, took %v, %v", k, id, n, took, e)
	}
	return id
}

// TestNodeTableSlotReuse: a forgotten node's slot goes to the next new node of its shard, under
// another id; the old id then names nothing, for get, refs and forget alike.
func TestNodeTableSlotReuse(t *testing.T) {
	tab := newTable()
	ks := keysOfShard(3, 3)
	a := mustInsert(t, tab, ks[0])
	tab.forget(a, 1)
	b := mustInsert(t, tab, ks[1])
	if uint32(b) != uint32(a) || b == a {
		t.Fatalf("ids %#x, %#x: want the same slot and shard, another generation", a, b)
	}
	if n, ok := tab.get(a); ok {
		t.Errorf("stale id %#x found node %+v", a, n.key)
	}
	tab.forget(a, 1)
	if tab.refs(a) != 0 || tab.refs(b) != 1 {
		t.Errorf("refs: stale %d, new %d, want 0 and 1", tab.refs(a), tab.refs(b))
	}
	n, ok := tab.get(b)
	if !ok || n.key != ks[1] {
		t.Fatalf("get %#x: %v, %v", b, n, ok)
	}
	tab.put(n)
	// Ids of slots never handed out, of a free slot's next generation, of another shard.
	c := mustInsert(t, tab, ks[2])
	for _, id := range []uint64{0, c + 1<<shardBits, c + 1<<genShift, c ^ 1, b - 1<<genShift, math.MaxUint64} {
		if n, ok := tab.get(id); ok {
			t.Errorf("id %#x found node %+v", id, n.key)
		}
	}
	tab.forget(c, 1)
	if n, ok := tab.get(c + 1<<genShift); ok {
		t.Errorf("next id of a free slot found node %+v", n.key)
	}
}

// TestNodeTableIDs: ids are never 0 or the root's, and unique over insertions and forgets.
func TestNodeTableIDs(t *testing.T) {
	tab := newTable()
	seen := map[uint64]bool{}
	var live []uint64
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		if len(live) > 0 && rng.IntN(3) == 0 {
			j := rng.IntN(len(live))
			tab.forget(live[j], 1)
			live[j] = live[len(live)-1]
			live = live[:len(live)-1]
			continue
		}
		id := mustInsert(t, tab, nodeKey{dev: 7, ino: uint64(i)})
		if seen[id] {
			t.Fatalf("id %#x handed out twice", id)
		}
		seen[id] = true
		live = append(live, id)
	}
	if got := tab.count.Load(); got != int64(len(live)) {
		t.Errorf("count %d, want %d", got, len(live))
	}
}

// TestNodeTableRetiredSlot: a slot whose generation is exhausted is not reused.
func TestNodeTableRetiredSlot(t *testing.T) {
	tab := newTable()
	ks := keysOfShard(5, 2)
	a := mustInsert(t, tab, ks[0])
	s := &tab.shards[5]
	s.slotAt(uint32(a) >> shardBits).gen = math.MaxUint32 // as if handed out 2^32-1 times
	a = a&(1<<genShift-1) | math.MaxUint32<<genShift
	if n, ok := tab.get(a); !ok || n.key != ks[0] {
		t.Fatalf("get %#x: %v", a, ok)
	} else {
		tab.put(n)
	}
	tab.forget(a, 1)
	b := mustInsert(t, tab, ks[1])
	if uint32(b) == uint32(a) {
		t.Errorf("retired slot reused: %#x after %#x", b, a)
	}
	if s.free != 0 {
		t.Errorf("free list %d, want empty", s.free)
	}
}

// TestNodeTableFull: a new node beyond maxSlots in its shard answers ENFILE and takes nothing;
// a forgotten one makes room again.
func TestNodeTableFull(t *testing.T) {
	tab := newTable()
	ks := keysOfShard(9, 3)
	a := mustInsert(t, tab, ks[0])
	s := &tab.shards[9]
	top := s.top
	s.top = maxSlots // as if every other slot were in use
	defer func() { s.top = top }()
	if id, n, took, e := tab.insert(ks[1], 5, nil, unix.S_IFREG); e != unix.ENFILE || id != 0 || n != nil || took {
		t.Fatalf("insert into a full shard: %d, %v, %v, %v; want ENFILE", id, n, took, e)
	}
	if tab.count.Load() != 1 || tab.fds.Load() != 0 || s.indexed != 1 {
		t.Errorf("full insert left count %d, fds %d, %d keys", tab.count.Load(), tab.fds.Load(), s.indexed)
	}
	// A node already there still takes references.
	if id, _, _, e := tab.insert(ks[0], -1, nil, unix.S_IFREG); e != 0 || id != a {
		t.Errorf("existing node in a full shard: %#x, %v", id, e)
	}
	// Other shards are not full.
	mustInsert(t, tab, keysOfShard(10, 1)[0])
	tab.forget(a, 2)
	if b := mustInsert(t, tab, ks[2]); uint32(b) != uint32(a) {
		t.Errorf("new node %#x, want slot of %#x", b, a)
	}
}

// TestLookupTableFull: LOOKUP answers ENFILE when the table is full, and closes the descriptor
// it opened.
func TestLookupTableFull(t *testing.T) {
	e := newEnv(t, Options{})
	makeFiles(t, e, 1)
	tops := make([]uint32, numShards)
	for i := range e.fs.nodes.shards {
		tops[i] = e.fs.nodes.shards[i].top
		e.fs.nodes.shards[i].top = maxSlots
	}
	before := e.fs.Stats()
	var out fuse.EntryOut
	wantErrno(t, "Lookup with a full table", e.fs.Lookup(rootCtx, 1, "f0", &out), unix.ENFILE)
	if s := e.fs.Stats(); s != before {
		t.Errorf("stats %+v, want %+v", s, before)
	}
	for i := range e.fs.nodes.shards {
		e.fs.nodes.shards[i].top = tops[i]
	}
	e.lookup(t, 1, "f0")
}

// TestDropAllForgetsIDs: after dropAll (DESTROY) no old id names a node, descriptors are closed,
// and the same files get new ids.
func TestDropAllForgetsIDs(t *testing.T) {
	e := newEnv(t, Options{})
	names := makeFiles(t, e, 100)
	old := map[uint64]bool{}
	for _, name := range names {
		old[e.lookup(t, 1, name).NodeID] = true
	}
	e.fs.Destroy()
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.Fds != 2 {
		t.Errorf("stats after Destroy %+v, want the root only", s)
	}
	var out fuse.AttrOut
	for id := range old {
		wantErrno(t, "GetAttr after Destroy", e.fs.GetAttr(rootCtx, id, &fuse.GetattrIn{}, &out), unix.EBADF)
	}
	for _, name := range names {
		if id := e.lookup(t, 1, name).NodeID; old[id] {
			t.Errorf("%s: id %#x handed out again", name, id)
		}
	}
}

// TestStaleIDSlotReused: the id of a forgotten file answers EBADF after its slot went to
// another file, and FORGET of it leaves the new node alone.
func TestStaleIDSlotReused(t *testing.T) {
	e := newEnv(t, Options{})
	names := makeFiles(t, e, 400)
	a := e.lookup(t, 1, names[0]).NodeID
	e.fs.Forget(a, 1)
	var b uint64
	var bName string
	for _, name := range names[1:] {
		if id := e.lookup(t, 1, name).NodeID; uint32(id) == uint32(a) {
			b, bName = id, name
			break
		}
	}
	if b == 0 {
		t.Fatal("no lookup reused the slot")
	}
	if b == a {
		t.Fatalf("id %#x handed out again", a)
	}
	var out fuse.AttrOut
	wantErrno(t, "GetAttr of the stale id", e.fs.GetAttr(rootCtx, a, &fuse.GetattrIn{}, &out), unix.EBADF)
	e.fs.Forget(a, 1)
	if got := e.getattr(t, b); got.Ino != lstat(t, e.path(bName)).Ino {
		t.Errorf("node %#x: ino %d, want %s's", b, got.Ino, bName)
	}
}

// TestNodeTableConcurrent: inserts, gets and forgets from many goroutines on shared keys; an id
// only ever names the node of its key, and everything leaves the table at the end.
func TestNodeTableConcurrent(t *testing.T) {
	tab := newTable()
	const keys, workers, rounds = 64, 8, 3000
	var stale sync.Map // id -> key, ids whose reference was dropped
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range rounds {
				k := nodeKey{dev: 3, ino: uint64(rng.IntN(keys))}
				id, _, _, e := tab.insert(k, -1, nil, unix.S_IFREG)
				if e != 0 {
					t.Errorf("insert: %v", e)
					return
				}
				if n, ok := tab.get(id); !ok || n.key != k {
					t.Errorf("get %#x of key %v: %v", id, k, ok)
					return
				} else {
					tab.put(n)
				}
				tab.forget(id, 1)
				stale.Store(id, k)
				// A dropped id may still name its node (another worker holds it), never another.
				stale.Range(func(v, kv any) bool {
					if n, ok := tab.get(v.(uint64)); ok {
						if n.key != kv.(nodeKey) {
							t.Errorf("id %#x of key %v names key %v", v, kv, n.key)
						}
						tab.put(n)
					}
					return rng.IntN(8) != 0
				})
			}
		}()
	}
	wg.Wait()
	if c := tab.count.Load(); c != 0 {
		t.Errorf("count %d after every forget", c)
	}
	for i := range tab.shards {
		if s := &tab.shards[i]; s.indexed != 0 || !slices.Equal(s.index, make([]uint32, len(s.index))) {
			t.Errorf("shard %d: %d keys left: %x", i, s.indexed, s.index)
		}
	}
}
