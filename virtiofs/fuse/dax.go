package fuse

import (
	"math"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DAX: the guest maps ranges of files into the device's DAX window (a shared-memory region the
// front-end provides) with SETUPMAPPING and drops them with REMOVEMAPPING. The FUSE side only
// decodes and checks; a DAXFileSystem does the mapping.
//
// Negotiation. A Linux guest asks for FUSE_MAP_ALIGNMENT only when its device has a DAX window
// (fc->dax is set only then), and for FUSE_HAS_INODE_DAX in its dax=inode modes (the default
// mode included, window or not). Both are granted only when the guest asked for
// FUSE_MAP_ALIGNMENT and the file system's DAXMapAlignment says DAX is available (virtiofs asks
// the front-end whether it has a window); otherwise neither is, nothing DAX is negotiated, and
// SETUPMAPPING and REMOVEMAPPING answer ENOSYS as every unknown opcode does. So a guest whose
// front-end has no window (upstream QEMU 7.2) never gets FUSE_ATTR_DAX, even if it asked for
// HAS_INODE_DAX or, being hostile, for MAP_ALIGNMENT.

// SetupmappingIn is struct fuse_setupmapping_in.
type SetupmappingIn struct {
	Fh      uint64 // an open file handle, or SetupmappingNoFh (what Linux sends)
	Foffset uint64 // offset in the file
	Len     uint64
	Flags   uint64 // SetupmappingFlagWrite, SetupmappingFlagRead
	Moffset uint64 // offset in the DAX window
}

// SetupmappingIn.Flags bits.
const (
	SetupmappingFlagWrite = 1 << 0
	SetupmappingFlagRead  = 1 << 1
)

// SetupmappingNoFh is the Fh of a mapping not tied to an open file: Linux maps per inode and
// always sends it.
const SetupmappingNoFh = math.MaxUint64

// RemovemappingIn is struct fuse_removemapping_in; Count RemovemappingOne entries follow.
type RemovemappingIn struct {
	Count uint32
}

// RemovemappingOne is struct fuse_removemapping_one.
type RemovemappingOne struct {
	Moffset uint64
	Len     uint64
}

// MaxRemovemapping is the most ranges one REMOVEMAPPING may carry: Linux's
// FUSE_REMOVEMAPPING_MAX_ENTRY, a page of entries.
const MaxRemovemapping = 4096 / int(unsafe.Sizeof(RemovemappingOne{}))

// MaxMapAlignment is the largest map alignment a Linux guest accepts (FUSE_DAX_SHIFT: it maps
// in 2 MiB ranges and refuses an INIT reply asking for more).
const MaxMapAlignment = 21

// DAXFileSystem is an optional interface of a FileSystem that can serve SETUPMAPPING and
// REMOVEMAPPING.
type DAXFileSystem interface {
	// DAXMapAlignment is asked at each INIT whose guest requested FUSE_MAP_ALIGNMENT: whether
	// mappings can be served (a window is reachable, the policy allows DAX) and, if so, the log2
	// of the alignment every mapping's file offset, window offset and length must have (at most
	// MaxMapAlignment).
	DAXMapAlignment() (shift uint16, ok bool)
	// SetupMapping maps in.Len bytes of node's file at in.Foffset to in.Moffset of the window.
	// The server has checked flags, alignment and overflow.
	SetupMapping(ctx *Context, nodeID uint64, in *SetupmappingIn) Errno
	// RemoveMapping drops the ranges (checked like SetupMapping's) from the window.
	RemoveMapping(ctx *Context, ranges []RemovemappingOne) Errno
}

// daxInit returns the DAX flags to grant and the map alignment, given the flags the guest sent.
func (s *Server) daxInit(kernel uint64) (flags uint64, shift uint16) {
	dfs, ok := s.fs.(DAXFileSystem)
	if !ok || kernel&InitMapAlignment == 0 {
		return 0, 0
	}
	shift, ok = dfs.DAXMapAlignment()
	if !ok || shift > MaxMapAlignment {
		return 0, 0
	}
	return (InitMapAlignment | InitHasInodeDAX) & kernel, shift
}

// daxFS returns the file system's DAX side when DAX was negotiated.
func (s *Server) daxFS() (DAXFileSystem, uint64, bool) {
	if s.granted.Load()&InitMapAlignment == 0 {
		return nil, 0, false
	}
	dfs, ok := s.fs.(DAXFileSystem)
	return dfs, 1 << s.mapAlign.Load(), ok
}

// checkRange checks one mapping range: non-empty, aligned, and off+len representable as a file
// offset (off_t) — which also rules out wrapping.
func checkRange(off, length, align uint64) bool {
	return length != 0 && off%align == 0 && length%align == 0 &&
		off <= math.MaxInt64 && length <= math.MaxInt64-off
}

func doSetupmapping(s *Server, r *request) Errno {
	dfs, align, ok := s.daxFS()
	if !ok {
		return unix.ENOSYS
	}
	var in SetupmappingIn
	if !arg(r, &in) || len(r.args) != 0 {
		return unix.EINVAL
	}
	if in.Flags == 0 || in.Flags&^(SetupmappingFlagWrite|SetupmappingFlagRead) != 0 {
		return unix.EINVAL
	}
	if !checkRange(in.Foffset, in.Len, align) || !checkRange(in.Moffset, in.Len, align) {
		return unix.EINVAL
	}
	return dfs.SetupMapping(&r.Context, r.NodeID, &in)
}

func doRemovemapping(s *Server, r *request) Errno {
	dfs, align, ok := s.daxFS()
	if !ok {
		return unix.ENOSYS
	}
	var in RemovemappingIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	// The count is the guest's word: it must be in range and match the entries actually sent.
	one := int(unsafe.Sizeof(RemovemappingOne{}))
	if in.Count == 0 || in.Count > uint32(MaxRemovemapping) || len(r.args) != int(in.Count)*one {
		return unix.EINVAL
	}
	ranges := make([]RemovemappingOne, in.Count)
	for i := range ranges {
		arg(r, &ranges[i])
		if !checkRange(ranges[i].Moffset, ranges[i].Len, align) {
			return unix.EINVAL
		}
	}
	return dfs.RemoveMapping(&r.Context, ranges)
}
