package passthrough

import (
	"math"
	"strconv"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Lookup finds name in directory parent and takes a lookup reference on it.
//
// "." and ".." are refused with EINVAL, where the host would resolve them: the guest's VFS
// resolves them itself (EXPORT_SUPPORT, which would have it look up "..", is not offered), and
// ".." of the root is outside the share.
func (fs *FS) Lookup(ctx *fuse.Context, parent uint64, name string, out *fuse.EntryOut) fuse.Errno {
	if e := checkName(name, unix.EINVAL, unix.EINVAL); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	return fs.lookupName(p, pfd, name, out)
}

// Forget drops nlookup references to node id; unknown ids and the root are ignored.
func (fs *FS) Forget(nodeID, nlookup uint64) { fs.nodes.forget(nodeID, nlookup) }

// GetAttr answers the attributes of node id. A handle given with GetattrFh must be one of the
// node's; the attributes are then read through it (an open file's inode is there even when
// a node's file handle can no longer be opened: an unlinked file on ext4).
func (fs *FS) GetAttr(ctx *fuse.Context, nodeID uint64, in *fuse.GetattrIn, out *fuse.AttrOut) fuse.Errno {
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	if in != nil && in.Flags&fuse.GetattrFh != 0 {
		h, e := fs.anyHandle(in.Fh, nodeID)
		if e != fuse.OK {
			return e
		}
		defer fs.handles.put(h)
		return fs.attrOf(n, int(h.fd), out)
	}
	fd, e := fs.pathFd(n)
	if e != fuse.OK {
		return e
	}
	defer fs.doneFd(n, fd)
	return fs.attrOf(n, fd, out)
}

// anyHandle returns fh pinned if it is an open handle (file or directory) of node, else EBADF.
func (fs *FS) anyHandle(fh, node uint64) (*handle, fuse.Errno) {
	h, ok := fs.handles.get(fh, node, false)
	if !ok {
		if h, ok = fs.handles.get(fh, node, true); !ok {
			return nil, unix.EBADF
		}
	}
	return h, fuse.OK
}

// attrOf answers the attributes of node n through fd, a descriptor of it.
func (fs *FS) attrOf(n *inode, fd int, out *fuse.AttrOut) fuse.Errno {
	var st unix.Statx_t
	if err := statxFd(fd, &st); err != nil {
		return errno(err)
	}
	fs.fillAttrOut(out, n, fd, &st)
	return fuse.OK
}

// SetAttr changes, in this order, mode, owner, size and times, then answers the new attributes.
// A failing step stops there. With a handle (FattrFh), everything goes through its descriptor.
func (fs *FS) SetAttr(ctx *fuse.Context, nodeID uint64, in *fuse.SetattrIn, out *fuse.AttrOut) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	// The new owner is the guest's: its host ids (Options.UIDs and GIDs), or EPERM before
	// anything changes if one is forbidden.
	uid, gid := -1, -1
	if in.Valid&fuse.FattrUID != 0 {
		id, ok := fs.opts.UIDs.ToHost(in.UID)
		if !ok {
			return unix.EPERM
		}
		uid = int(id)
	}
	if in.Valid&fuse.FattrGID != 0 {
		id, ok := fs.opts.GIDs.ToHost(in.GID)
		if !ok {
			return unix.EPERM
		}
		gid = int(id)
	}
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)

	var h *handle
	var nfd int
	if in.Valid&fuse.FattrFh != 0 {
		h, e = fs.handle(in.Fh, nodeID, false)
		if e != fuse.OK {
			return e
		}
		defer fs.handles.put(h)
		nfd = int(h.fd) // a regular file's: /proc leads to its inode as from an O_PATH one
	} else {
		if nfd, e = fs.pathFd(n); e != fuse.OK {
			return e
		}
		defer fs.doneFd(n, nfd)
	}
	fd32 := int32(nfd)

	if in.Valid&fuse.FattrMode != 0 {
		if n.isSymlink() {
			return unix.EOPNOTSUPP // Linux cannot chmod a symlink
		}
		var name procName
		if err := fchmodat(fs.procfd, name.of(fd32), in.Mode&07777); err != nil {
			return errno(err)
		}
	}

	if in.Valid&(fuse.FattrUID|fuse.FattrGID) != 0 {
		if err := unix.Fchownat(nfd, "", uid, gid, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return errno(err)
		}
	}

	if in.Valid&fuse.FattrSize != 0 {
		if e := fs.truncate(n, nfd, h, in.Size); e != fuse.OK {
			return e
		}
	}

	// The guest asks for this with a truncate or a chown (without a mode, which would already
	// carry the cleared bits). The host kernel removes security.capability on both itself, and
	// on chown the set-id bits too (Linux 6.x), but on truncate it keeps them: we hold
	// CAP_FSETID.
	if in.Valid&(fuse.FattrKillSuidgid|fuse.FattrMode) == fuse.FattrKillSuidgid &&
		in.Valid&(fuse.FattrSize|fuse.FattrUID|fuse.FattrGID) != 0 {
		var name procName
		if err := killSuidgid(nfd, func(mode uint32) error {
			return fchmodat(fs.procfd, name.of(fd32), mode)
		}); err != nil {
			return errno(err)
		}
	}

	if in.Valid&(fuse.FattrAtime|fuse.FattrMtime) != 0 {
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		if in.Valid&fuse.FattrAtime != 0 {
			ts[0] = timespec(in.Atime, in.Atimensec, in.Valid&fuse.FattrAtimeNow != 0)
		}
		if in.Valid&fuse.FattrMtime != 0 {
			ts[1] = timespec(in.Mtime, in.Mtimensec, in.Valid&fuse.FattrMtimeNow != 0)
		}
		var err error
		if n.isSymlink() {
			// The link itself: utimensat accepts AT_EMPTY_PATH on an O_PATH fd (Linux 5.8+).
			err = unix.UtimesNanoAt(nfd, "", ts, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
		} else {
			err = unix.UtimesNanoAt(fs.procfd, strconv.Itoa(nfd), ts, 0)
		}
		if err != nil {
			return errno(err)
		}
	}
	return fs.attrOf(n, nfd, out)
}

func timespec(sec uint64, nsec uint32, now bool) unix.Timespec {
	if now {
		return unix.Timespec{Nsec: unix.UTIME_NOW}
	}
	return unix.Timespec{Sec: int64(sec), Nsec: int64(nsec)}
}

// fchmodat is fchmodat(2) on a NUL-terminated name, following the last component (here a
// /proc/self/fd magic link, which leads to the inode itself).
func fchmodat(dirfd int, name *byte, mode uint32) error {
	_, _, e := unix.Syscall(unix.SYS_FCHMODAT, uintptr(dirfd), uintptr(unsafe.Pointer(name)), uintptr(mode))
	if e != 0 {
		return e
	}
	return nil
}

// killSuidgid clears the set-user-ID bit of regular file fd, and its set-group-ID bit if it is
// group-executable, with chmod, as the kernel does when a user without CAP_FSETID writes or
// truncates. The guest asks for it (FATTR_KILL_SUIDGID, FUSE_WRITE_KILL_SUIDGID,
// FUSE_OPEN_KILL_SUIDGID) when it negotiated HANDLE_KILLPRIV_V2 and so leaves that to us: we
// run with CAP_FSETID, so the host kernel would not do it.
func killSuidgid(fd int, chmod func(mode uint32) error) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	mode := st.Mode & 0o7777
	kill := mode & unix.S_ISUID
	if mode&(unix.S_ISGID|unix.S_IXGRP) == unix.S_ISGID|unix.S_IXGRP {
		kill |= unix.S_ISGID
	}
	if kill == 0 || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil
	}
	return chmod(mode &^ kill)
}

// truncate sets the size of regular file n (whose descriptor is fd), through h when the guest
// gave a handle.
func (fs *FS) truncate(n *inode, fd int, h *handle, size uint64) fuse.Errno {
	switch {
	case n.isDir():
		return unix.EISDIR
	case !n.isRegular():
		return unix.EINVAL
	case size > math.MaxInt64:
		return unix.EINVAL // a negative length to truncate(2)
	}
	if h != nil {
		return errno(unix.Ftruncate(int(h.fd), int64(size)))
	}
	wfd, err := fs.openProc(int32(fd), unix.O_WRONLY|unix.O_NONBLOCK)
	if err != nil {
		return errno(err)
	}
	defer unix.Close(wfd)
	return errno(unix.Ftruncate(wfd, int64(size)))
}

// Readlink appends the target of symlink node id to buf.
func (fs *FS) Readlink(ctx *fuse.Context, nodeID uint64, buf []byte) ([]byte, fuse.Errno) {
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return buf, e
	}
	defer fs.nodes.put(n)
	if !n.isSymlink() {
		return buf, unix.EINVAL
	}
	fd, e := fs.pathFd(n)
	if e != fuse.OK {
		return buf, e
	}
	defer fs.doneFd(n, fd)
	const room = unix.PathMax // a target is at most PATH_MAX-1 bytes
	if cap(buf)-len(buf) < room {
		nb := make([]byte, len(buf), len(buf)+room)
		copy(nb, buf)
		buf = nb
	}
	k, err := unix.Readlinkat(fd, "", buf[len(buf):len(buf)+room])
	if err != nil {
		return buf, errno(err)
	}
	return buf[:len(buf)+k], fuse.OK
}

// create runs op (a creating *at() call in directory p) with the caller's credentials, then
// looks the new entry up.
func (fs *FS) create(ctx *fuse.Context, parent uint64, name string, out *fuse.EntryOut,
	op func(dirfd int) error) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	if e := checkName(name, unix.EEXIST, unix.EEXIST); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	switched, e := fs.asCaller(ctx)
	if e != fuse.OK {
		return e
	}
	err := op(pfd)
	if switched {
		fs.restoreCreds()
	}
	if err != nil {
		return errno(err)
	}
	if e := fs.labelNew(ctx, pfd, name); e != fuse.OK {
		return e
	}
	_, _, e = fs.lookupAt(p, pfd, name, out)
	return e
}

// Symlink creates name -> target in parent. The target is stored, never followed.
func (fs *FS) Symlink(ctx *fuse.Context, parent uint64, name, target string, out *fuse.EntryOut) fuse.Errno {
	return fs.create(ctx, parent, name, out, func(dirfd int) error {
		return unix.Symlinkat(target, dirfd, name)
	})
}

// Mknod creates a file, FIFO, socket or device node; the guest's umask applies.
func (fs *FS) Mknod(ctx *fuse.Context, parent uint64, name string, in *fuse.MknodIn, out *fuse.EntryOut) fuse.Errno {
	return fs.create(ctx, parent, name, out, func(dirfd int) error {
		mode := in.Mode&unix.S_IFMT | fs.createMode(int32(dirfd), in.Mode, in.Umask)
		return mknodat(dirfd, name, mode, int(in.Rdev))
	})
}

// Mkdir creates a directory; the guest's umask applies.
func (fs *FS) Mkdir(ctx *fuse.Context, parent uint64, name string, in *fuse.MkdirIn, out *fuse.EntryOut) fuse.Errno {
	return fs.create(ctx, parent, name, out, func(dirfd int) error {
		return mkdirat(dirfd, name, fs.createMode(int32(dirfd), in.Mode, in.Umask))
	})
}

// Unlink removes a non-directory entry.
func (fs *FS) Unlink(ctx *fuse.Context, parent uint64, name string) fuse.Errno {
	return fs.remove(parent, name, 0)
}

// Rmdir removes an empty directory.
func (fs *FS) Rmdir(ctx *fuse.Context, parent uint64, name string) fuse.Errno {
	return fs.remove(parent, name, unix.AT_REMOVEDIR)
}

func (fs *FS) remove(parent uint64, name string, flags int) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	dot, dotdot := fuse.Errno(unix.EISDIR), fuse.Errno(unix.EISDIR) // unlinkat(2)
	if flags&unix.AT_REMOVEDIR != 0 {
		dot, dotdot = unix.EINVAL, unix.ENOTEMPTY // rmdir(2)
	}
	if e := checkName(name, dot, dotdot); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	fs.holdIfLast(pfd, name)
	return errno(unlinkat(pfd, name, flags))
}

const renameFlags = unix.RENAME_NOREPLACE | unix.RENAME_EXCHANGE | unix.RENAME_WHITEOUT

// Rename moves parent/name to newParent/newName with renameat2; the host kernel checks the
// flag combinations.
func (fs *FS) Rename(ctx *fuse.Context, parent uint64, name string, newParent uint64, newName string, flags uint32) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	if flags&^renameFlags != 0 {
		return unix.EINVAL
	}
	if e := checkName(name, unix.EBUSY, unix.EBUSY); e != fuse.OK {
		return e
	}
	taken := fuse.Errno(unix.EBUSY)
	if flags&unix.RENAME_NOREPLACE != 0 {
		taken = unix.EEXIST
	}
	if e := checkName(newName, taken, taken); e != fuse.OK {
		return e
	}
	p, pfd, e := fs.nodeFd(parent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	np, npfd, e := fs.nodeFd(newParent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(np, npfd)
	if flags&unix.RENAME_EXCHANGE == 0 {
		fs.holdIfLast(npfd, newName) // the entry renamed over, if any
	}
	return errno(renameat2(pfd, name, npfd, newName, uint(flags)))
}

// Link makes newParent/newName another name of node id, which must not be a directory. The
// link keeps the file's owner, so it runs with our own credentials.
func (fs *FS) Link(ctx *fuse.Context, nodeID, newParent uint64, newName string, out *fuse.EntryOut) fuse.Errno {
	if e := fs.readOnly(); e != fuse.OK {
		return e
	}
	if e := checkName(newName, unix.EEXIST, unix.EEXIST); e != fuse.OK {
		return e
	}
	n, nfd, e := fs.nodeFd(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(n, nfd)
	if n.isDir() {
		return unix.EPERM
	}
	p, pfd, e := fs.nodeFd(newParent)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(p, pfd)
	// linkat with AT_EMPTY_PATH would need CAP_DAC_READ_SEARCH; following the /proc magic link
	// reaches the inode itself (a symlink's own inode, a file without a name from TMPFILE).
	err := unix.Linkat(fs.procfd, strconv.Itoa(nfd), pfd, newName, unix.AT_SYMLINK_FOLLOW)
	if err != nil {
		return errno(err)
	}
	_, _, e = fs.lookupAt(p, pfd, newName, out)
	return e
}

// StatFs answers statfs of the file system holding node id.
func (fs *FS) StatFs(ctx *fuse.Context, nodeID uint64, out *fuse.StatfsOut) fuse.Errno {
	n, fd, e := fs.nodeFd(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(n, fd)
	var s unix.Statfs_t
	if err := unix.Fstatfs(fd, &s); err != nil {
		return errno(err)
	}
	*out = fuse.StatfsOut{
		Blocks:  s.Blocks,
		Bfree:   s.Bfree,
		Bavail:  s.Bavail,
		Files:   s.Files,
		Ffree:   s.Ffree,
		Bsize:   uint32(s.Bsize),
		Namelen: uint32(s.Namelen),
		Frsize:  uint32(s.Frsize),
	}
	return fuse.OK
}

// SyncFs syncs the file system holding node id, a directory or regular file (the guest sends
// the root of its superblock).
func (fs *FS) SyncFs(ctx *fuse.Context, nodeID uint64) fuse.Errno {
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	var flags int
	switch {
	case n.isDir():
		flags = unix.O_RDONLY | unix.O_DIRECTORY
	case n.isRegular():
		flags = unix.O_RDONLY | unix.O_NONBLOCK
	default:
		return unix.EINVAL
	}
	nfd, e := fs.pathFd(n)
	if e != fuse.OK {
		return e
	}
	defer fs.doneFd(n, nfd)
	fd, err := fs.openProc(int32(nfd), flags) // syncfs refuses O_PATH descriptors
	if err != nil {
		return errno(err)
	}
	defer unix.Close(fd)
	return errno(unix.Syncfs(fd))
}

// Access checks mask (F_OK, or R_OK|W_OK|X_OK) for the caller by the host's own rules:
// faccessat2 with AT_EACCESS, so the check uses the caller's fsuid/fsgid set by asCaller, on the
// node's descriptor (AT_EMPTY_PATH: never through a name, never following a symlink). The
// Linux guest mounts with default_permissions and checks permissions itself, so it rarely asks.
func (fs *FS) Access(ctx *fuse.Context, nodeID uint64, mask uint32) fuse.Errno {
	if mask&^uint32(unix.R_OK|unix.W_OK|unix.X_OK) != 0 {
		return unix.EINVAL
	}
	if mask&unix.W_OK != 0 {
		if e := fs.readOnly(); e != fuse.OK {
			return e
		}
	}
	n, fd, e := fs.nodeFd(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(n, fd)
	switched, e := fs.asCaller(ctx)
	if e != fuse.OK {
		return e
	}
	if switched {
		defer fs.restoreCreds()
	}
	return errno(unix.Faccessat2(fd, "", mask, unix.AT_EMPTY_PATH|unix.AT_EACCESS))
}
