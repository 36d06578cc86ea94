package passthrough

import (
	"math"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// passedOpenFlags are the open flags taken from the guest. Everything else is dropped: O_CREAT,
// O_EXCL, O_TMPFILE, O_PATH, O_DIRECTORY and O_NOFOLLOW are ours to decide, O_DIRECT would
// require aligned guest buffers, O_ASYNC would signal us.
const passedOpenFlags = unix.O_ACCMODE | unix.O_APPEND | unix.O_TRUNC | unix.O_NONBLOCK |
	unix.O_DSYNC | unix.O_SYNC | unix.O_NOATIME

// openFlags turns the guest's open flags into the host's. O_NOATIME passes only with
// Options.PreserveNoatime.
func (fs *FS) openFlags(guest uint32) int {
	f := int(guest) & passedOpenFlags
	if !fs.opts.PreserveNoatime {
		f &^= unix.O_NOATIME
	}
	if fs.flags.Load()&fuse.InitWritebackCache != 0 {
		// The guest's page cache reads to fill pages of write-only files and writes at offsets
		// of its choosing.
		if f&unix.O_ACCMODE == unix.O_WRONLY {
			f = f&^unix.O_ACCMODE | unix.O_RDWR
		}
		f &^= unix.O_APPEND
	}
	return f | unix.O_NOCTTY
}

// fileOpenFlags are the FOPEN_* flags of every opened file.
func (fs *FS) fileOpenFlags() uint32 {
	var f uint32
	if fs.opts.DirectIO {
		f |= fuse.FopenDirectIO
	}
	if fs.opts.KeepCache {
		f |= fuse.FopenKeepCache
	}
	return f
}

// notRegular is the answer to opening node type typ for I/O when it is not a regular file:
// directories are opened by OPENDIR, symlinks are never followed, and special files are never
// opened on the host (the guest kernel serves FIFOs, sockets and devices itself).
func notRegular(typ uint32) fuse.Errno {
	switch typ {
	case unix.S_IFDIR:
		return unix.EISDIR
	case unix.S_IFLNK:
		return unix.ELOOP
	}
	return unix.ENXIO
}

// Open opens regular file node id for I/O.
func (fs *FS) Open(ctx *fuse.Context, nodeID uint64, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Errno {
	if writes(in.Flags) {
		if e := fs.readOnly(); e != fuse.OK {
			return e
		}
	}
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	if !n.isRegular() {
		return notRegular(n.typ())
	}
	nfd, e := fs.pathFd(n)
	if e != fuse.OK {
		return e
	}
	defer fs.doneFd(n, nfd)
	flags := fs.openFlags(in.Flags)
	fd, err := fs.openProc(int32(nfd), flags)
	if err != nil {
		return errno(err)
	}
	if in.OpenFlags&fuse.OpenKillSuidgid != 0 && flags&unix.O_TRUNC != 0 {
		if err := killSuidgid(fd, func(mode uint32) error { return unix.Fchmod(fd, mode) }); err != nil {
			unix.Close(fd)
			return errno(err)
		}
	}
	out.Fh = fs.handles.add(nodeID, fd, false)
	out.OpenFlags = fs.fileOpenFlags()
	return fuse.OK
}

// Create creates and opens regular file name in parent, with the caller's credentials and the
// guest's umask.
func (fs *FS) Create(ctx *fuse.Context, parent uint64, name string, in *fuse.CreateIn,
	entry *fuse.EntryOut, open *fuse.OpenOut) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	dots := fuse.Errno(unix.EISDIR) // open(2) of a directory with O_CREAT
	if in.Flags&unix.O_EXCL != 0 {
		dots = unix.EEXIST
	}
	if e := checkName(name, dots, dots); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	flags := fs.openFlags(in.Flags)
	mode := fs.createMode(int32(pfd), in.Mode, in.Umask)

	switched, e := fs.asCaller(ctx)
	if e != fuse.OK {
		return e
	}
	fd, err := openat(pfd, name, flags|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	created := err == nil
	if err == unix.EEXIST && in.Flags&unix.O_EXCL == 0 {
		// The guest believed name absent. Open what is there only if it is a regular file:
		// never a device, FIFO or symlink by name.
		fd, err = fs.openExisting(pfd, name, flags)
	}
	if switched {
		fs.restoreCreds()
	}
	if err != nil {
		return errno(err)
	}
	if created {
		if e := fs.labelNew(ctx, pfd, name); e != fuse.OK {
			unix.Close(fd)
			return e
		}
	}
	return fs.addOpenNode(p, pfd, fd, entry, open)
}

// openExisting opens regular file name in dirfd with flags, through an O_PATH descriptor so
// that its type is checked on the inode that is then opened.
func (fs *FS) openExisting(dirfd int, name string, flags int) (int, error) {
	opath, err := openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(opath)
	var st unix.Statx_t
	if err := statxFd(opath, &st); err != nil {
		return -1, err
	}
	if typ := uint32(st.Mode) & unix.S_IFMT; typ != unix.S_IFREG {
		return -1, notRegular(typ)
	}
	return fs.openProc(int32(opath), flags)
}

// addOpenNode makes a node of the open regular file fd (in directory p, whose descriptor is
// dirfd) and a handle of fd.
func (fs *FS) addOpenNode(p *inode, dirfd, fd int, entry *fuse.EntryOut, open *fuse.OpenOut) fuse.Errno {
	opath, err := fs.openProc(int32(fd), unix.O_PATH)
	if err != nil {
		unix.Close(fd)
		return errno(err)
	}
	id, _, e := fs.addNode(p, dirfd, opath, entry)
	if e != fuse.OK {
		unix.Close(fd)
		return e
	}
	open.Fh = fs.handles.add(id, fd, false)
	open.OpenFlags = fs.fileOpenFlags()
	return fuse.OK
}

// Tmpfile creates and opens an unnamed regular file in directory parent (O_TMPFILE).
func (fs *FS) Tmpfile(ctx *fuse.Context, parent uint64, in *fuse.CreateIn, entry *fuse.EntryOut,
	open *fuse.OpenOut) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	if !p.isDir() {
		return unix.ENOTDIR
	}
	flags := fs.openFlags(in.Flags) | int(in.Flags)&unix.O_EXCL // O_EXCL: may never be linked
	mode := fs.createMode(int32(pfd), in.Mode, in.Umask)
	switched, e := fs.asCaller(ctx)
	if e != fuse.OK {
		return e
	}
	// "." of the directory's own descriptor: the directory itself, not a guest name.
	fd, err := unix.Openat(pfd, ".", flags|unix.O_TMPFILE|unix.O_CLOEXEC, mode)
	if switched {
		fs.restoreCreds()
	}
	if err != nil {
		return errno(err)
	}
	return fs.addOpenNode(p, pfd, fd, entry, open)
}

// iovMax is IOV_MAX: preadv and pwritev take at most this many buffers at once.
const iovMax = 1024

func iovLen(iov [][]byte) int {
	n := 0
	for _, b := range iov {
		n += len(b)
	}
	return n
}

// limitIov returns the first size bytes of iov, copying the list only when it must cut a
// buffer.
func limitIov(iov [][]byte, size int) [][]byte {
	if size <= 0 {
		return nil
	}
	for i, b := range iov {
		if len(b) < size {
			size -= len(b)
			continue
		}
		if len(b) == size {
			return iov[:i+1]
		}
		out := make([][]byte, i+1)
		copy(out, iov[:i])
		out[i] = b[:size]
		return out
	}
	return iov
}

// fileOffset checks an offset from the guest.
func fileOffset(off uint64) (int64, fuse.Errno) {
	if off > math.MaxInt64 {
		return 0, unix.EINVAL
	}
	return int64(off), fuse.OK
}

// Read reads up to in.Size bytes, bounded by the room in dst, straight into dst. It stops
// short at the end of the file.
func (fs *FS) Read(ctx *fuse.Context, nodeID uint64, in *fuse.ReadIn, dst [][]byte) (int, fuse.Errno) {
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.handles.put(h)
	off, e := fileOffset(in.Offset)
	if e != fuse.OK {
		return 0, e
	}
	iov := limitIov(dst, int(in.Size))
	total := 0
	for len(iov) > 0 {
		chunk := iov[:min(len(iov), iovMax)]
		want := iovLen(chunk)
		n, err := unix.Preadv(int(h.fd), chunk, off)
		if err != nil {
			if total > 0 {
				break
			}
			return 0, errno(err)
		}
		total += n
		off += int64(n)
		if n < want {
			break
		}
		iov = iov[len(chunk):]
	}
	return total, fuse.OK
}

// Write writes all of src (in.Size bytes) at in.Offset, retrying short writes. After a partial
// write it answers the bytes written.
func (fs *FS) Write(ctx *fuse.Context, nodeID uint64, in *fuse.WriteIn, src [][]byte) (int, fuse.Errno) {
	if e := fs.readOnly(); e != fuse.OK {
		return 0, e
	}
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.handles.put(h)
	off, e := fileOffset(in.Offset)
	if e != fuse.OK {
		return 0, e
	}
	fd := int(h.fd)
	if in.WriteFlags&fuse.WriteKillSuidgid != 0 {
		if err := killSuidgid(fd, func(mode uint32) error { return unix.Fchmod(fd, mode) }); err != nil {
			return 0, errno(err)
		}
	}
	iov := limitIov(src, int(in.Size))
	left := iovLen(iov)
	total := 0
	owned := false // whether iov is our copy, which advancing may change
	for left > 0 {
		n, err := unix.Pwritev(fd, iov[:min(len(iov), iovMax)], off)
		if err == nil && n == 0 {
			err = unix.EIO
		}
		if err != nil {
			if total > 0 {
				return total, fuse.OK
			}
			return 0, errno(err)
		}
		total += n
		off += int64(n)
		left -= n
		if left == 0 {
			break
		}
		// Drop what was written.
		for n > 0 && n >= len(iov[0]) {
			n -= len(iov[0])
			iov = iov[1:]
		}
		for len(iov) > 0 && len(iov[0]) == 0 {
			iov = iov[1:]
		}
		if n > 0 {
			if !owned {
				iov = append([][]byte(nil), iov...)
				owned = true
			}
			iov[0] = iov[0][n:]
		}
	}
	return total, fuse.OK
}

// Flush is sent on every close(2) in the guest. It checks the handle and, with remote POSIX
// locks, releases the locks of the closing process (in.LockOwner) on the file, as close does.
func (fs *FS) Flush(ctx *fuse.Context, nodeID uint64, in *fuse.FlushIn) fuse.Errno {
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return e
	}
	fs.handles.put(h)
	if fs.flags.Load()&fuse.InitPosixLocks != 0 {
		if n, e := fs.node(nodeID); e == fuse.OK {
			fs.releaseOwner(n, in.LockOwner)
			fs.nodes.put(n)
		}
	}
	return fuse.OK
}

// Release closes a file handle (once no request uses it any more). The flock(2) locks of the
// guest's open file are on the handle's descriptor; they are released right away when the guest
// says the file held some (ReleaseFlockUnlock), not only once the descriptor closes.
func (fs *FS) Release(ctx *fuse.Context, nodeID uint64, in *fuse.ReleaseIn) fuse.Errno {
	if in.ReleaseFlags&fuse.ReleaseFlockUnlock != 0 && fs.flags.Load()&fuse.InitFlockLocks != 0 {
		if h, e := fs.handle(in.Fh, nodeID, false); e == fuse.OK {
			unix.Flock(int(h.fd), unix.LOCK_UN)
			fs.handles.put(h)
		}
	}
	if !fs.handles.remove(in.Fh, nodeID, false) {
		return unix.EBADF
	}
	return fuse.OK
}

// Fsync flushes a file to disk, only its data with FsyncFdatasync.
func (fs *FS) Fsync(ctx *fuse.Context, nodeID uint64, in *fuse.FsyncIn) fuse.Errno {
	return fs.fsync(nodeID, in, false)
}

func (fs *FS) fsync(nodeID uint64, in *fuse.FsyncIn, dir bool) fuse.Errno {
	h, e := fs.handle(in.Fh, nodeID, dir)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(h)
	if in.FsyncFlags&fuse.FsyncFdatasync != 0 {
		return errno(unix.Fdatasync(int(h.fd)))
	}
	return errno(unix.Fsync(int(h.fd)))
}

// Fallocate allocates or punches space in a file.
func (fs *FS) Fallocate(ctx *fuse.Context, nodeID uint64, in *fuse.FallocateIn) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(h)
	if in.Offset > math.MaxInt64 || in.Length > math.MaxInt64 {
		return unix.EINVAL
	}
	return errno(unix.Fallocate(int(h.fd), in.Mode, int64(in.Offset), int64(in.Length)))
}

// Lseek answers SEEK_DATA and SEEK_HOLE (and SEEK_SET, SEEK_CUR, SEEK_END) on a file handle.
func (fs *FS) Lseek(ctx *fuse.Context, nodeID uint64, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Errno {
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(h)
	switch in.Whence {
	case unix.SEEK_SET, unix.SEEK_CUR, unix.SEEK_END, unix.SEEK_DATA, unix.SEEK_HOLE:
	default:
		return unix.EINVAL
	}
	off, err := unix.Seek(int(h.fd), int64(in.Offset), int(in.Whence))
	if err != nil {
		return errno(err)
	}
	out.Offset = uint64(off)
	return fuse.OK
}

// maxCopy bounds one COPY_FILE_RANGE, whose answer is 32 bits wide.
const maxCopy = 1 << 30

// CopyFileRange copies between two file handles, each checked against its node.
func (fs *FS) CopyFileRange(ctx *fuse.Context, nodeID uint64, in *fuse.CopyFileRangeIn, out *fuse.WriteOut) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	hin, e := fs.handle(in.FhIn, nodeID, false)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(hin)
	hout, e := fs.handle(in.FhOut, in.NodeIDOut, false)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(hout)
	offIn, e := fileOffset(in.OffIn)
	if e != fuse.OK {
		return e
	}
	offOut, e := fileOffset(in.OffOut)
	if e != fuse.OK {
		return e
	}
	if in.Flags != 0 {
		return unix.EINVAL
	}
	n, err := unix.CopyFileRange(int(hin.fd), &offIn, int(hout.fd), &offOut, int(min(in.Len, maxCopy)), 0)
	if err != nil {
		return errno(err)
	}
	out.Size = uint32(n)
	return fuse.OK
}
