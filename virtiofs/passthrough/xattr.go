package passthrough

import (
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Extended attributes have no *at() calls before Linux 6.13 and none take an O_PATH
// descriptor, so they go through the path /proc/self/fd/N with the variants that follow the
// last component: that is the magic link, which leads to the node's own inode (a symlink's
// too, not its target). The l-variants would act on the /proc link itself.

// xattrNode returns node id pinned with a descriptor of it (see nodeFd), or ENOSYS when xattrs
// are off.
func (fs *FS) xattrNode(id uint64) (*inode, int, fuse.Errno) {
	if !fs.opts.Xattr {
		return nil, -1, unix.ENOSYS
	}
	return fs.nodeFd(id)
}

// SetXattr sets attribute name of node id; flags are XATTR_CREATE or XATTR_REPLACE.
func (fs *FS) SetXattr(ctx *fuse.Context, nodeID uint64, name string, value []byte, flags uint32) fuse.Errno {
	n, fd, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return e
	}
	if e := fs.readOnly(); e != fuse.OK {
		fs.putFd(n, fd)
		return e
	}
	defer fs.putFd(n, fd)
	name, e = fs.opts.XattrMap.toHost(name)
	if e != fuse.OK {
		return e
	}
	return errno(unix.Setxattr(fs.procPathOf(int32(fd)), name, value, int(flags)))
}

// GetXattr copies the value of attribute name into dst, or reports its size when dst is empty.
func (fs *FS) GetXattr(ctx *fuse.Context, nodeID uint64, name string, dst []byte) (int, fuse.Errno) {
	n, fd, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.putFd(n, fd)
	name, e = fs.opts.XattrMap.toHost(name)
	if e != fuse.OK {
		return 0, e
	}
	sz, err := unix.Getxattr(fs.procPathOf(int32(fd)), name, dst)
	if err != nil {
		return 0, errno(err)
	}
	return sz, fuse.OK
}

// ListXattr copies the NUL-separated attribute names of node id into dst, or reports their
// size when dst is empty.
func (fs *FS) ListXattr(ctx *fuse.Context, nodeID uint64, dst []byte) (int, fuse.Errno) {
	n, fd, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.putFd(n, fd)
	// Always through the filter: DAXXattr must not be listed, even without a map.
	return fs.listMapped(fd, dst)
}

// RemoveXattr removes attribute name of node id.
func (fs *FS) RemoveXattr(ctx *fuse.Context, nodeID uint64, name string) fuse.Errno {
	n, fd, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return e
	}
	if e := fs.readOnly(); e != fuse.OK {
		fs.putFd(n, fd)
		return e
	}
	defer fs.putFd(n, fd)
	name, e = fs.opts.XattrMap.toHost(name)
	if e != fuse.OK {
		return e
	}
	return errno(unix.Removexattr(fs.procPathOf(int32(fd)), name))
}

// SetXattrExt is SetXattr with SETXATTR_EXT's flags: with fuse.SetxattrACLKillSgid, setting
// system.posix_acl_access also clears the set-group-ID bit. The guest decided the caller may
// not keep it; the host kernel would not clear it for us, since we hold CAP_FSETID.
func (fs *FS) SetXattrExt(ctx *fuse.Context, nodeID uint64, name string, value []byte, flags, setxattrFlags uint32) fuse.Errno {
	if e := fs.SetXattr(ctx, nodeID, name, value, flags); e != fuse.OK {
		return e
	}
	if setxattrFlags&fuse.SetxattrACLKillSgid == 0 || !fs.opts.PosixACL || name != aclAccess {
		return fuse.OK
	}
	n, fd, e := fs.nodeFd(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(n, fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return errno(err)
	}
	if st.Mode&unix.S_ISGID == 0 || st.Mode&unix.S_IFMT == unix.S_IFLNK {
		return fuse.OK
	}
	var pn procName
	return errno(fchmodat(fs.procfd, pn.of(int32(fd)), st.Mode&07777&^unix.S_ISGID))
}

// The POSIX ACL attributes.
const (
	aclAccess  = "system.posix_acl_access"
	aclDefault = "system.posix_acl_default"
)

// createMode is the permission bits of a new file in directory dirfd: mode less the guest's
// umask, except with PosixACL when the directory has a default ACL. The host kernel then
// derives the mode from that ACL, ignoring the umask, as a local file system does (the guest
// left the umask to us: DONT_MASK). Our own umask is 0.
func (fs *FS) createMode(dirfd int32, mode, umask uint32) uint32 {
	mode &= 07777
	if fs.opts.PosixACL {
		if sz, err := unix.Getxattr(fs.procPathOf(dirfd), aclDefault, nil); err == nil && sz > 0 {
			return mode
		}
	}
	return mode &^ umask
}

// listMapped is ListXattr of fd through Options.XattrMap (nil: names unchanged) and the
// DAXXattr filter: the host's whole list is read, so that the size of the guest's view is known
// even when the guest only asks for it.
func (fs *FS) listMapped(fd int, dst []byte) (int, fuse.Errno) {
	path := fs.procPathOf(int32(fd))
	var list []byte
	for range 8 { // the list may grow between the two calls
		sz, err := unix.Listxattr(path, nil)
		if err != nil {
			return 0, errno(err)
		}
		list = make([]byte, max(sz, 1))
		sz, err = unix.Listxattr(path, list)
		if err == unix.ERANGE {
			continue
		}
		if err != nil {
			return 0, errno(err)
		}
		list = fs.opts.XattrMap.listToGuest(list[:sz])
		switch {
		case len(dst) == 0:
			return len(list), fuse.OK
		case len(dst) < len(list):
			return 0, unix.ERANGE
		}
		return copy(dst, list), fuse.OK
	}
	return 0, unix.ERANGE
}

// labelNew gives the file name just created in dirfd the security context the guest sent
// with the request (Options.SecurityLabel). The context is set after the create, as an
// attribute (its name mapped by Options.XattrMap), so a host process may see the file without
// it for a moment. Should that fail, the file is removed again: the guest must not get a file
// without the label it asked for.
func (fs *FS) labelNew(ctx *fuse.Context, dirfd int, name string) fuse.Errno {
	if !fs.opts.SecurityLabel || ctx.SecCtx == nil {
		return fuse.OK
	}
	e := fs.setLabel(ctx, dirfd, name)
	if e != fuse.OK {
		var st unix.Stat_t
		flags := 0
		if unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR {
			flags = unix.AT_REMOVEDIR
		}
		unlinkat(dirfd, name, flags)
	}
	return e
}

func (fs *FS) setLabel(ctx *fuse.Context, dirfd int, name string) fuse.Errno {
	attr, e := fs.opts.XattrMap.toHost(ctx.SecCtx.Name)
	if e != fuse.OK {
		return e
	}
	fd, err := openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return errno(err)
	}
	defer unix.Close(fd)
	return errno(unix.Setxattr(fs.procPathOf(int32(fd)), attr, ctx.SecCtx.Value, 0))
}
