package virtq

import (
	"encoding/binary"
	"math/bits"
	"sync/atomic"
	"unsafe"
)

// Accessors for ring fields that the other side reads or writes concurrently. See "Memory
// ordering" in the package documentation for why each exists. All offsets are relative to a ring
// slice that was checked to be large enough; the explicit bounds checks below turn a logic error
// into a panic instead of an access outside the slice.

// hostLE is whether the host stores integers little-endian, as the rings do. Atomic loads and
// stores see native byte order, so big-endian hosts swap.
var hostLE = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// wordPtr points at b[off:off+4]. The slice expression bounds-checks without reading memory
// (a "_ = b[off+3]" would count as a plain read for the race detector).
func wordPtr(b []byte, off int) *uint32 {
	return (*uint32)(unsafe.Pointer(unsafe.SliceData(b[off : off+4])))
}

// atomicLoadLE32 is an acquire load of the 4-aligned little-endian word at b[off:].
func atomicLoadLE32(b []byte, off int) uint32 {
	v := atomic.LoadUint32(wordPtr(b, off))
	if !hostLE {
		v = bits.ReverseBytes32(v)
	}
	return v
}

// atomicStoreLE32 is a release store of the 4-aligned little-endian word at b[off:].
func atomicStoreLE32(b []byte, off int, v uint32) {
	if !hostLE {
		v = bits.ReverseBytes32(v)
	}
	atomic.StoreUint32(wordPtr(b, off), v)
}

// loadLE16 reads the 2-aligned little-endian u16 at b[off:] with a single 16-bit load, so it
// cannot tear. It is not an atomic in the Go memory model: ordering comes from the fence the
// caller issues before it. go:norace because the other side of the ring writes the field without
// any happens-before edge by design (event indices are hints); the race detector would otherwise
// report this intended race in tests where the driver runs on another goroutine.
//
//go:norace
func loadLE16(b []byte, off int) uint16 {
	v := *(*uint16)(unsafe.Pointer(unsafe.SliceData(b[off : off+2])))
	if !hostLE {
		v = bits.ReverseBytes16(v)
	}
	return v
}

// storeLE16 writes the 2-aligned little-endian u16 at b[off:] with a single 16-bit store. See
// loadLE16.
//
//go:norace
func storeLE16(b []byte, off int, v uint16) {
	if !hostLE {
		v = bits.ReverseBytes16(v)
	}
	*(*uint16)(unsafe.Pointer(unsafe.SliceData(b[off : off+2]))) = v
}

// fence is a full memory barrier between the plain and atomic guest-memory accesses before it and
// those after it (Linux's virtio_mb). Go has no fence primitive; an atomic store followed by an
// atomic load of a private word is one on the architectures we run on:
//   - amd64: the store is XCHG, a locked instruction, which is a full barrier.
//   - arm64: the store is STLR (release: every earlier access is ordered before it), the load is
//     LDAR (acquire: every later access is ordered after it), and an LDAR is never reordered
//     before an earlier STLR (release/acquire are RCsc), so earlier accesses are ordered before
//     later ones, including earlier stores before later loads.
//
// Other architectures Go supports implement seq-cst atomics with full barriers around them.
func fence(w *uint32) {
	atomic.StoreUint32(w, 0)
	atomic.LoadUint32(w)
}

func hostAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// vringNeedEvent is the spec's vring_need_event: whether moving the index from old to new passed
// event, i.e. event is in [old, new) modulo 2^16.
func vringNeedEvent(event, new, old uint16) bool {
	return new-event-1 < new-old
}
