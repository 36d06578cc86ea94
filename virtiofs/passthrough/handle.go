package passthrough

import (
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// handle is an open file or directory: what OPEN, CREATE, TMPFILE and OPENDIR hand out.
type handle struct {
	node uint64       // the node it was opened on; immutable
	fd   int32        // immutable; closed by the last unpin
	pins atomic.Int32 // 1 while in the table, +1 per request using fd
	dir  *dirStream   // nil for files; immutable
}

// dirStream is the READDIR position of a directory handle.
type dirStream struct {
	mu  sync.Mutex
	pos uint64 // cookie of the next entry to list; guarded by mu
	buf []byte // getdents64 records read ahead of pos; guarded by mu
	off int    // start of the first unlisted record in buf; guarded by mu
	end int    // end of the valid records in buf; guarded by mu
}

type handleShard struct {
	mu sync.RWMutex
	m  map[uint64]*handle // guarded by mu
	_  [32]byte
}

// handleTable maps file handles to open descriptors. Handles are never reused while the FS
// lives; their low bits pick the shard.
type handleTable struct {
	shards [numShards]handleShard
	last   atomic.Uint64
	count  atomic.Int64
	fds    *atomic.Int64
}

func (t *handleTable) init(fds *atomic.Int64) {
	t.fds = fds
	for i := range t.shards {
		t.shards[i].m = make(map[uint64]*handle)
	}
}

// add registers fd, opened on node, and returns its handle. The table owns fd from now on.
func (t *handleTable) add(node uint64, fd int, dir bool) uint64 {
	h := &handle{node: node, fd: int32(fd)}
	if dir {
		h.dir = &dirStream{}
	}
	h.pins.Store(1)
	fh := t.last.Add(1)
	s := &t.shards[fh&shardMask]
	s.mu.Lock()
	s.m[fh] = h
	s.mu.Unlock()
	t.count.Add(1)
	t.fds.Add(1)
	return fh
}

// get returns handle fh, pinned, if it exists, was opened on node and is of the right kind
// (directory or file). The caller unpins it with put.
func (t *handleTable) get(fh, node uint64, dir bool) (*handle, bool) {
	s := &t.shards[fh&shardMask]
	s.mu.RLock()
	h := s.m[fh]
	ok := h != nil && h.node == node && (h.dir != nil) == dir
	if ok {
		h.pins.Add(1)
	}
	s.mu.RUnlock()
	return h, ok
}

// put unpins h, closing its fd if it was the last pin.
func (t *handleTable) put(h *handle) {
	if h.pins.Add(-1) == 0 {
		unix.Close(int(h.fd))
		t.fds.Add(-1)
	}
}

// remove takes handle fh out of the table, with the same checks as get.
func (t *handleTable) remove(fh, node uint64, dir bool) bool {
	s := &t.shards[fh&shardMask]
	s.mu.Lock()
	h := s.m[fh]
	ok := h != nil && h.node == node && (h.dir != nil) == dir
	if ok {
		delete(s.m, fh)
	}
	s.mu.Unlock()
	if ok {
		t.count.Add(-1)
		t.put(h)
	}
	return ok
}

// dropAll closes every handle (once requests still using them finish).
func (t *handleTable) dropAll() {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		old := s.m
		s.m = make(map[uint64]*handle)
		s.mu.Unlock()
		for _, h := range old {
			t.count.Add(-1)
			t.put(h)
		}
	}
}
