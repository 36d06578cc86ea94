package passthrough

import (
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Extended attributes have no *at() calls before Linux 6.13 and none take an O_PATH
// descriptor, so they go through the path /proc/self/fd/N with the variants that follow the
// last component: that is the magic link, which leads to the node's own inode (a symlink's
// too, not its target). The l-variants would act on the /proc link itself.

// xattrNode returns node id pinned, or ENOSYS when xattrs are off.
func (fs *FS) xattrNode(id uint64) (*inode, fuse.Errno) {
	if !fs.opts.Xattr {
		return nil, unix.ENOSYS
	}
	return fs.node(id)
}

// SetXattr sets attribute name of node id; flags are XATTR_CREATE or XATTR_REPLACE.
func (fs *FS) SetXattr(ctx *fuse.Context, nodeID uint64, name string, value []byte, flags uint32) fuse.Errno {
	n, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	return errno(unix.Setxattr(fs.procPathOf(n.fd), name, value, int(flags)))
}

// GetXattr copies the value of attribute name into dst, or reports its size when dst is empty.
func (fs *FS) GetXattr(ctx *fuse.Context, nodeID uint64, name string, dst []byte) (int, fuse.Errno) {
	n, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.nodes.put(n)
	sz, err := unix.Getxattr(fs.procPathOf(n.fd), name, dst)
	if err != nil {
		return 0, errno(err)
	}
	return sz, fuse.OK
}

// ListXattr copies the NUL-separated attribute names of node id into dst, or reports their
// size when dst is empty.
func (fs *FS) ListXattr(ctx *fuse.Context, nodeID uint64, dst []byte) (int, fuse.Errno) {
	n, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return 0, e
	}
	defer fs.nodes.put(n)
	sz, err := unix.Listxattr(fs.procPathOf(n.fd), dst)
	if err != nil {
		return 0, errno(err)
	}
	return sz, fuse.OK
}

// RemoveXattr removes attribute name of node id.
func (fs *FS) RemoveXattr(ctx *fuse.Context, nodeID uint64, name string) fuse.Errno {
	n, e := fs.xattrNode(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	return errno(unix.Removexattr(fs.procPathOf(n.fd), name))
}
