package passthrough

import (
	"bytes"
	"encoding/binary"
	"math"
	"sync"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// OpenDir opens directory node id for READDIR.
func (fs *FS) OpenDir(ctx *fuse.Context, nodeID uint64, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Errno {
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	if !n.isDir() {
		return unix.ENOTDIR
	}
	nfd, e := fs.pathFd(n)
	if e != fuse.OK {
		return e
	}
	defer fs.doneFd(n, nfd)
	fd, err := fs.openProc(int32(nfd), unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return errno(err)
	}
	out.Fh = fs.handles.add(nodeID, fd, true)
	out.OpenFlags = 0
	if fs.opts.CacheDir {
		out.OpenFlags = fuse.FopenCacheDir | fuse.FopenKeepCache
	}
	return fuse.OK
}

// ReleaseDir closes a directory handle.
func (fs *FS) ReleaseDir(ctx *fuse.Context, nodeID uint64, in *fuse.ReleaseIn) fuse.Errno {
	if !fs.handles.remove(in.Fh, nodeID, true) {
		return unix.EBADF
	}
	return fuse.OK
}

// FsyncDir flushes a directory to disk.
func (fs *FS) FsyncDir(ctx *fuse.Context, nodeID uint64, in *fuse.FsyncIn) fuse.Errno {
	return fs.fsync(nodeID, in, true)
}

// direntBufSize is the getdents64 read-ahead of a directory handle.
const direntBufSize = 8 << 10

var direntBufs = sync.Pool{New: func() any { return new([direntBufSize]byte) }}

// Layout of struct linux_dirent64.
const (
	direntInoOff    = 0
	direntOffOff    = 8
	direntReclenOff = 16
	direntTypeOff   = 18
	direntNameOff   = 19
)

// ReadDir lists directory handle in.Fh from cookie in.Offset, a d_off of getdents64 (0 is the
// start). "." and ".." are listed too, ".." of the root as the root itself. With plus, every
// other entry is looked up, and takes a lookup reference, only once it is known to fit.
func (fs *FS) ReadDir(ctx *fuse.Context, nodeID uint64, in *fuse.ReadIn, plus bool, out *fuse.DirList) fuse.Errno {
	h, e := fs.handle(in.Fh, nodeID, true)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(h)
	var p *inode
	if plus {
		if p, e = fs.node(nodeID); e != fuse.OK {
			return e
		}
		defer fs.nodes.put(p)
	}
	fd := int(h.fd)
	ds := h.dir
	ds.mu.Lock()
	defer ds.mu.Unlock()

	if in.Offset != ds.pos {
		if in.Offset > math.MaxInt64 {
			return unix.EINVAL
		}
		if _, err := unix.Seek(fd, int64(in.Offset), unix.SEEK_SET); err != nil {
			return errno(err)
		}
		ds.pos = in.Offset
		ds.off, ds.end = 0, 0
	}
	defer ds.releaseBuf()

	// Once an entry is listed the answer is OK: with plus it holds references the guest must
	// get. A later error ends the listing early and shows again on the next call.
	listed := false
	for {
		if ds.off >= ds.end {
			if ds.buf == nil {
				ds.buf = direntBufs.Get().(*[direntBufSize]byte)[:]
			}
			k, err := unix.Getdents(fd, ds.buf)
			if err != nil || k <= 0 {
				return unlessListed(listed, errno(err)) // errno(nil) is OK: the end
			}
			ds.off, ds.end = 0, k
		}
		rec := ds.buf[ds.off:ds.end]
		reclen := 0
		if len(rec) > direntNameOff {
			reclen = int(binary.NativeEndian.Uint16(rec[direntReclenOff:]))
		}
		if reclen <= direntNameOff || reclen > len(rec) {
			ds.off, ds.end = 0, 0 // not what getdents64 writes: drop the rest
			return unlessListed(listed, unix.EIO)
		}
		ino := binary.NativeEndian.Uint64(rec[direntInoOff:])
		next := binary.NativeEndian.Uint64(rec[direntOffOff:])
		typ := uint32(rec[direntTypeOff])
		nameb := rec[direntNameOff:reclen]
		if i := bytes.IndexByte(nameb, 0); i >= 0 {
			nameb = nameb[:i]
		}
		if len(nameb) == 0 {
			ds.off += reclen
			ds.pos = next
			continue
		}
		if !out.Fits(len(nameb)) {
			return fuse.OK
		}
		// Neither Add nor the lookup keeps the name, so it may alias the buffer.
		name := unsafe.String(&nameb[0], len(nameb))
		switch {
		case name == "." || name == "..":
			if name == ".." && nodeID == rootID {
				ino = fs.nodes.root.key.ino // the root's parent stays hidden
			}
			if !out.Add(name, ino, typ, next, nil) {
				return fuse.OK
			}
		case plus:
			var ent fuse.EntryOut
			id, e := fs.lookupEntry(p, fd, name, ino, &ent)
			if e == unix.ENOENT {
				// Removed since getdents: skip it.
				ds.off += reclen
				ds.pos = next
				continue
			}
			if e != fuse.OK {
				return unlessListed(listed, e)
			}
			if !out.Add(name, ent.Attr.Ino, ent.Attr.Mode&unix.S_IFMT>>12, next, &ent) {
				fs.nodes.forget(id, 1) // cannot happen after Fits; keep the count right anyway
				return fuse.OK
			}
		default:
			if !out.Add(name, ino, typ, next, nil) {
				return fuse.OK
			}
		}
		listed = true
		ds.off += reclen
		ds.pos = next
	}
}

// unlessListed answers e when nothing was listed yet, else OK: the entries listed must reach
// the guest, and the error shows again on the next call.
func unlessListed(listed bool, e fuse.Errno) fuse.Errno {
	if listed {
		return fuse.OK
	}
	return e
}

// releaseBuf gives the read-ahead buffer back once everything in it was listed. Called with mu
// held.
func (ds *dirStream) releaseBuf() {
	if ds.buf != nil && ds.off >= ds.end {
		direntBufs.Put((*[direntBufSize]byte)(ds.buf))
		ds.buf = nil
		ds.off, ds.end = 0, 0
	}
}
