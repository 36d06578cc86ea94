package fuse

import "unsafe"

// AsBytes views a wire struct (any of this package's, which hold no pointers) as its bytes in
// host order, without copying.
func AsBytes[T any](p *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), unsafe.Sizeof(*p))
}

// gather copies bytes of the scatter list iov, starting at byte off, into dst and returns how
// many it copied.
func gather(dst []byte, iov [][]byte, off int) int {
	n := 0
	for _, b := range iov {
		if off >= len(b) {
			off -= len(b)
			continue
		}
		n += copy(dst[n:], b[off:])
		off = 0
		if n == len(dst) {
			break
		}
	}
	return n
}

// scatter copies src into the scatter list iov starting at byte off and returns how many bytes
// it copied.
func scatter(iov [][]byte, off int, src []byte) int {
	n := 0
	for _, b := range iov {
		if off >= len(b) {
			off -= len(b)
			continue
		}
		n += copy(b[off:], src[n:])
		off = 0
		if n == len(src) {
			break
		}
	}
	return n
}

// subIovecs appends to dst the part of iov that covers bytes [off, off+n) and returns it, with
// fewer bytes when iov ends first.
func subIovecs(dst [][]byte, iov [][]byte, off, n int) [][]byte {
	for _, b := range iov {
		if n == 0 {
			break
		}
		if off >= len(b) {
			off -= len(b)
			continue
		}
		b = b[off:]
		off = 0
		if len(b) > n {
			b = b[:n]
		}
		dst = append(dst, b)
		n -= len(b)
	}
	return dst
}

// iovLen is the total length of a scatter list.
func iovLen(iov [][]byte) int {
	n := 0
	for _, b := range iov {
		n += len(b)
	}
	return n
}
