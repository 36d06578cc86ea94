package frontend

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/vhostuser"
)

// The DAX window, as the DAX-capable QEMU Kata ships provides it (vhost-user-fs-pci
// cache-size=N): an anonymous PROT_NONE reservation of N bytes, exposed to the guest as a
// shared-memory region, into which the back-end has files mapped with FS_MAP and unmapped with
// FS_UNMAP on its back-end channel. Upstream QEMU 7.2 has no window and answers those requests
// with failure, which is what a Frontend without Options.DAXWindow does too.

// newDAXWindow reserves the window.
func newDAXWindow(size uint64) ([]byte, error) {
	if size < pageSize || size&(size-1) != 0 || size > 1<<40 {
		return nil, fmt.Errorf("frontend: DAX window of %d bytes: want a power of two from %d to 1 TiB", size, pageSize)
	}
	w, err := unix.Mmap(-1, 0, int(size), unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("frontend: reserving the DAX window: %w", err)
	}
	return w, nil
}

// DAXWindow returns the DAX window (nil without Options.DAXWindow). Ranges the back-end has
// not mapped are PROT_NONE: touching them faults. It is unusable after Close.
func (f *Frontend) DAXWindow() []byte { return f.window }

// serveBackendRequest answers one request of the back-end channel: FS_MAP and FS_UNMAP when
// there is a window, failure (1) for anything else, as QEMU does. It returns the reply value and
// whether the request wants one.
func (f *Frontend) serveBackendRequest(m *vhostuser.Message) uint64 {
	if f.window == nil || m.CheckRequest() != nil {
		return 1
	}
	req := vhostuser.BackendRequest(m.Request)
	switch req {
	case vhostuser.BackendFSMap:
		if len(m.FDs) != 1 {
			return negErrno(unix.EINVAL)
		}
	case vhostuser.BackendFSUnmap:
		if len(m.FDs) != 0 {
			return negErrno(unix.EINVAL)
		}
	default:
		return 1
	}
	msg, err := vhostuser.ParseFSMapMsg(m.Payload)
	if err != nil {
		return negErrno(unix.EINVAL)
	}
	if req == vhostuser.BackendFSUnmap {
		return f.fsUnmap(msg)
	}
	if res := f.fsMap(msg, m.FDs[0]); res != 0 {
		f.fsUnmap(msg) // like QEMU: a failed map drops all of its ranges
		return res
	}
	return 0
}

// windowRange checks a range against the window as QEMU does (no wrap, inside the window) and
// returns its address.
func (f *Frontend) windowRange(off, length uint64) (unsafe.Pointer, bool) {
	size := uint64(len(f.window))
	if off+length < length || off+length > size {
		return nil, false
	}
	return unsafe.Pointer(unsafe.SliceData(f.window[off:])), true
}

// fsMap maps every range with a length into the window.
func (f *Frontend) fsMap(msg *vhostuser.FSMapMsg, fd int) uint64 {
	for i := range msg.Len {
		if msg.Len[i] == 0 {
			continue
		}
		addr, ok := f.windowRange(msg.CacheOffset[i], msg.Len[i])
		if !ok || msg.FDOffset[i] > 1<<62 {
			return negErrno(unix.EINVAL)
		}
		prot := 0
		if msg.Flags[i]&vhostuser.FSMapRead != 0 {
			prot |= unix.PROT_READ
		}
		if msg.Flags[i]&vhostuser.FSMapWrite != 0 {
			prot |= unix.PROT_WRITE
		}
		if _, err := unix.MmapPtr(fd, int64(msg.FDOffset[i]), addr, uintptr(msg.Len[i]), prot,
			unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
			return negErrno(errnoOf(err))
		}
	}
	return 0
}

// fsUnmap turns every range with a length back into PROT_NONE reservation; a length of 2^64-1
// means the whole window (QEMU's special case).
func (f *Frontend) fsUnmap(msg *vhostuser.FSMapMsg) uint64 {
	var res uint64
	for i := range msg.Len {
		off, length := msg.CacheOffset[i], msg.Len[i]
		if length == 0 {
			continue
		}
		if length == ^uint64(0) {
			off, length = 0, uint64(len(f.window))
		}
		addr, ok := f.windowRange(off, length)
		if !ok {
			res = negErrno(unix.EINVAL)
			continue
		}
		if _, err := unix.MmapPtr(-1, 0, addr, uintptr(length), unix.PROT_NONE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE); err != nil {
			res = negErrno(errnoOf(err))
		}
	}
	return res
}

// negErrno is the reply value of a failed request: the negated errno, as the DAX-capable QEMU
// sends it.
func negErrno(e unix.Errno) uint64 { return uint64(-int64(e)) }

func errnoOf(err error) unix.Errno {
	var e unix.Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	return unix.EIO
}
