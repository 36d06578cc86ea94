package fuse

import "golang.org/x/sys/unix"

// Errno is the result of a file-system operation: 0 for success or a positive errno.
type Errno = unix.Errno

// OK is the zero Errno.
const OK = Errno(0)

// Context describes the guest process a request comes from.
type Context struct {
	Opcode Opcode
	Unique uint64
	NodeID uint64
	UID    uint32
	GID    uint32
	PID    uint32
	// SecCtx is the security context the guest wants a new file created with (CREATE, MKNOD,
	// MKDIR, SYMLINK once SECURITY_CTX is negotiated); nil when it sent none. Its Name and
	// Value are valid only during the call.
	SecCtx *SecurityContext
}

// SecurityContext is an extended attribute, typically security.selinux, to set on a file as
// it is created.
type SecurityContext struct {
	Name  string
	Value []byte
}

// FileSystem is what the FUSE server dispatches decoded requests to. Node ids and file handles
// come from the guest and may be anything: an implementation validates each one and answers
// EBADF/ENOENT-style errors for ids it never handed out. Names have been checked by the server:
// non-empty, at most 255 bytes, no '/' and no NUL. "." and ".." are passed through and must be
// refused or handled by the implementation.
//
// Methods run concurrently (one goroutine per queue, or a worker pool); implementations do their
// own locking. A method must not keep the dst or src slices it is given: they are guest memory
// valid only for the duration of the call. Nor may it keep a name, symlink target or extended
// attribute name it is given (copy it, strings.Clone): these strings are the server's request
// buffer, reused once the request is answered, so that no request allocates for its names.
type FileSystem interface {
	// Init is called when the guest (re)initialises the session, with the feature flags both
	// sides agreed on. A second INIT (guest reboot) first calls Destroy.
	Init(flags uint64)
	// Destroy drops all state of the session: every node but the root, every open handle.
	Destroy()

	Lookup(ctx *Context, parent uint64, name string, out *EntryOut) Errno
	// Forget drops nlookup references to a node; unknown nodes are ignored.
	Forget(nodeID, nlookup uint64)
	GetAttr(ctx *Context, nodeID uint64, in *GetattrIn, out *AttrOut) Errno
	SetAttr(ctx *Context, nodeID uint64, in *SetattrIn, out *AttrOut) Errno
	// Readlink appends the link target to buf and returns it.
	Readlink(ctx *Context, nodeID uint64, buf []byte) ([]byte, Errno)
	Symlink(ctx *Context, parent uint64, name, target string, out *EntryOut) Errno
	Mknod(ctx *Context, parent uint64, name string, in *MknodIn, out *EntryOut) Errno
	Mkdir(ctx *Context, parent uint64, name string, in *MkdirIn, out *EntryOut) Errno
	Unlink(ctx *Context, parent uint64, name string) Errno
	Rmdir(ctx *Context, parent uint64, name string) Errno
	// Rename moves parent/name to newParent/newName; flags are RENAME_NOREPLACE,
	// RENAME_EXCHANGE or RENAME_WHITEOUT (0 for plain RENAME).
	Rename(ctx *Context, parent uint64, name string, newParent uint64, newName string, flags uint32) Errno
	Link(ctx *Context, nodeID, newParent uint64, newName string, out *EntryOut) Errno

	Open(ctx *Context, nodeID uint64, in *OpenIn, out *OpenOut) Errno
	Create(ctx *Context, parent uint64, name string, in *CreateIn, entry *EntryOut, open *OpenOut) Errno
	// Tmpfile creates an unnamed file in directory parent (O_TMPFILE).
	Tmpfile(ctx *Context, parent uint64, in *CreateIn, entry *EntryOut, open *OpenOut) Errno
	// Read reads up to in.Size bytes into dst (guest memory, at least in.Size bytes in total)
	// and returns how many it read.
	Read(ctx *Context, nodeID uint64, in *ReadIn, dst [][]byte) (int, Errno)
	// Write writes src (guest memory, in.Size bytes in total) and returns how many it wrote.
	Write(ctx *Context, nodeID uint64, in *WriteIn, src [][]byte) (int, Errno)
	Flush(ctx *Context, nodeID uint64, in *FlushIn) Errno
	Release(ctx *Context, nodeID uint64, in *ReleaseIn) Errno
	Fsync(ctx *Context, nodeID uint64, in *FsyncIn) Errno
	Fallocate(ctx *Context, nodeID uint64, in *FallocateIn) Errno
	Lseek(ctx *Context, nodeID uint64, in *LseekIn, out *LseekOut) Errno
	CopyFileRange(ctx *Context, nodeID uint64, in *CopyFileRangeIn, out *WriteOut) Errno

	OpenDir(ctx *Context, nodeID uint64, in *OpenIn, out *OpenOut) Errno
	// ReadDir fills out with entries starting after cookie in.Offset. With plus, each entry
	// but "." and ".." carries an EntryOut and takes a lookup reference, exactly for the
	// entries that fit. It must not fail once it has added an entry: an error reply drops the
	// listing, and with it the references the guest would never learn it holds.
	ReadDir(ctx *Context, nodeID uint64, in *ReadIn, plus bool, out *DirList) Errno
	ReleaseDir(ctx *Context, nodeID uint64, in *ReleaseIn) Errno
	FsyncDir(ctx *Context, nodeID uint64, in *FsyncIn) Errno

	StatFs(ctx *Context, nodeID uint64, out *StatfsOut) Errno
	SyncFs(ctx *Context, nodeID uint64) Errno
	Access(ctx *Context, nodeID uint64, mask uint32) Errno

	// SetXattr sets an attribute; flags are XATTR_CREATE or XATTR_REPLACE. A FileSystem that
	// also implements SetxattrExter gets SETXATTR through it once SETXATTR_EXT is negotiated.
	SetXattr(ctx *Context, nodeID uint64, name string, value []byte, flags uint32) Errno
	// GetXattr copies the value into dst; with len(dst) == 0 it only reports the size.
	// It returns the value's size; ERANGE when dst is too small.
	GetXattr(ctx *Context, nodeID uint64, name string, dst []byte) (int, Errno)
	// ListXattr works like GetXattr for the NUL-separated list of names.
	ListXattr(ctx *Context, nodeID uint64, dst []byte) (int, Errno)
	RemoveXattr(ctx *Context, nodeID uint64, name string) Errno

	// GetLk reports in out the first lock that would conflict with in.Lk taken by in.Owner
	// (type F_UNLCK if none). Only called once the guest negotiated InitPosixLocks.
	GetLk(ctx *Context, nodeID uint64, in *LkIn, out *LkOut) Errno
	// SetLk takes, changes or releases (F_UNLCK) in.Lk for in.Owner: a POSIX record lock, or a
	// flock(2) lock when in.LkFlags has LkFlock. It is only called for the kinds of lock the guest
	// negotiated (InitPosixLocks, InitFlockLocks). Without wait (SETLK) a conflict answers
	// EAGAIN. With wait (SETLKW) it must not block either: on a conflict it returns a Waiter,
	// which finishes the request later, and the errno is ignored.
	SetLk(ctx *Context, nodeID uint64, in *LkIn, wait bool) (Waiter, Errno)
}

// Waiter is a request that could not finish when its FileSystem method returned: a SETLKW
// waiting for a conflicting lock to go away. The server replies to the request only when the
// Waiter finishes, without holding up any other request.
type Waiter interface {
	// Start begins waiting in the background and returns at once. done is called exactly once,
	// from any goroutine, with the request's result: OK once the lock is taken, EINTR after
	// Cancel, another errno if waiting failed. The server calls Start once.
	Start(done func(Errno))
	// Cancel gives up waiting: done is called with EINTR soon, unless the wait finished first.
	// The server calls it on INTERRUPT of the request, on DESTROY, on a new INIT and when the
	// device goes away. It may be called at any time, before Start too, and more than once.
	Cancel()
}

// SetxattrExter is an optional interface of a FileSystem. Once the guest negotiated
// SETXATTR_EXT the server calls SetXattrExt instead of SetXattr, with fuse_setxattr_in's
// setxattr_flags (SetxattrACLKillSgid) too.
type SetxattrExter interface {
	SetXattrExt(ctx *Context, nodeID uint64, name string, value []byte, flags, setxattrFlags uint32) Errno
}
