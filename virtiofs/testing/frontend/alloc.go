package frontend

import (
	"slices"
	"sync"
)

// allocAlign is the granularity of Alloc: enough for descriptor tables (16) and cache lines.
const allocAlign = 64

type extent struct{ addr, size uint64 }

// allocator is a first-fit free-list allocator over a range of guest-physical addresses.
type allocator struct {
	mu   sync.Mutex
	free []extent          // guarded by mu; sorted by addr, never adjacent
	used map[uint64]uint64 // guarded by mu; addr → size of live blocks
}

func newAllocator(start, end uint64) *allocator {
	a := &allocator{used: map[uint64]uint64{}}
	if end > start {
		a.free = []extent{{start, end - start}}
	}
	return a
}

func (a *allocator) alloc(n uint64) (uint64, bool) {
	size := (max(n, 1) + allocAlign - 1) &^ (allocAlign - 1)
	if size < n { // overflow
		return 0, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, e := range a.free {
		if e.size < size {
			continue
		}
		if e.size == size {
			a.free = slices.Delete(a.free, i, i+1)
		} else {
			a.free[i] = extent{e.addr + size, e.size - size}
		}
		a.used[e.addr] = size
		return e.addr, true
	}
	return 0, false
}

func (a *allocator) release(addr uint64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	size, ok := a.used[addr]
	if !ok {
		return false
	}
	delete(a.used, addr)
	i, _ := slices.BinarySearchFunc(a.free, addr, func(e extent, t uint64) int {
		switch {
		case e.addr < t:
			return -1
		case e.addr > t:
			return 1
		}
		return 0
	})
	a.free = slices.Insert(a.free, i, extent{addr, size})
	// Merge with the following and the preceding extent.
	if i+1 < len(a.free) && a.free[i].addr+a.free[i].size == a.free[i+1].addr {
		a.free[i].size += a.free[i+1].size
		a.free = slices.Delete(a.free, i+1, i+2)
	}
	if i > 0 && a.free[i-1].addr+a.free[i-1].size == a.free[i].addr {
		a.free[i-1].size += a.free[i].size
		a.free = slices.Delete(a.free, i, i+1)
	}
	return true
}

// freeBytes returns the total free size (for tests).
func (a *allocator) freeBytes() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	var n uint64
	for _, e := range a.free {
		n += e.size
	}
	return n
}
