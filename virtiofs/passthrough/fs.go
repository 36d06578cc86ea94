package passthrough

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Options configures an FS; the virtiofs cache mode decides most of them.
type Options struct {
	// EntryTimeout and AttrTimeout say how long the guest may cache names and attributes
	// (0 for cache=never, 1 s for auto, 24 h for metadata and always, unless -o timeout= says).
	EntryTimeout, AttrTimeout time.Duration
	// DirectIO sets FOPEN_DIRECT_IO on opened files (cache=never, metadata).
	DirectIO bool
	// KeepCache sets FOPEN_KEEP_CACHE on opened files (cache=always).
	KeepCache bool
	// CacheDir sets FOPEN_CACHE_DIR|FOPEN_KEEP_CACHE on opened directories (cache=always,
	// metadata).
	CacheDir bool
	// Xattr enables the extended attribute operations; without it they answer ENOSYS.
	Xattr bool
	// PosixACL serves POSIX ACLs (with Xattr, and the guest's DONT_MASK): a create in a
	// directory with a default ACL ignores the guest's umask, and SETXATTR_ACL_KILL_SGID is
	// honoured.
	PosixACL bool
	// XattrMap, when set, translates attribute names between guest and host (with Xattr).
	XattrMap *XattrMap
	// SecurityLabel sets the security context a guest sends with CREATE, MKNOD, MKDIR and
	// SYMLINK (SECURITY_CTX) on the new file, as an attribute right after creating it.
	SecurityLabel bool
	// AnnounceSubmounts sets fuse.AttrSubmount on directories that are mount points (another
	// device or mount id than their parent) when the guest negotiated fuse.InitSubmounts.
	AnnounceSubmounts bool
	// DAX is the initial DAX policy (the zero value: mode inode, no rules); see dax.go.
	DAX DAXPolicy
	// DAXWindow, when set, serves SETUPMAPPING and REMOVEMAPPING; without it nothing DAX is
	// negotiated.
	DAXWindow DAXWindow
	// FileHandles says whether nodes keep host file handles instead of O_PATH descriptors
	// (see the package documentation, "File handles").
	FileHandles FileHandleMode
	// ReadOnly exports the shared directory read-only (virtiofsd's --readonly): every request
	// that would change it answers EROFS, and so does an open for writing or truncation and an
	// access check for writing; reading, locks and DAX read mappings work.
	ReadOnly bool
	// PreserveNoatime passes the guest's O_NOATIME on to the host's open (virtiofsd's
	// --preserve-noatime). Without it the flag is dropped, as virtiofsd drops it: an open with
	// O_NOATIME fails with EPERM unless the opener owns the file or has CAP_FOWNER, which the
	// guest's caller need not have on the host.
	PreserveNoatime bool
	// UIDs and GIDs, when set, translate user and group ids between the guest and the host
	// (virtiofsd's --translate-uid and --translate-gid): the caller's ids and a SETATTR's
	// new owner on their way in, the attributes' owners on their way out. Not with
	// PosixACL: the ids inside ACLs are not translated.
	UIDs, GIDs *IDTranslation
	// ProcSelfFd is the path of the process's /proc/self/fd directory; empty means
	// "/proc/self/fd". It is opened by New and, for extended attributes, which have only
	// path-based calls, used as the prefix of "PATH/N": a relative path ("." with the working
	// directory in /proc/self/fd) works where /proc is not reachable from the root.
	ProcSelfFd string
}

// Stats is a snapshot of what an FS holds.
type Stats struct {
	CachedInodes int // nodes in the inode table, the root included
	OpenFiles    int // open file and directory handles
	Fds          int // host descriptors held: nodes, handles, mounts and /proc/self/fd
}

const rootID = fuse.RootID

// FS is a passthrough file system onto a host directory. It implements fuse.FileSystem and is
// safe for concurrent use.
type FS struct {
	opts      Options
	entrySec  uint64
	attrSec   uint64
	entryNsec uint32
	attrNsec  uint32
	procfd    int    // /proc/self/fd, O_PATH
	procPath  string // its path, for the few syscalls that only take paths (xattrs)
	uid, gid  uint32 // our own fsuid and fsgid
	flags     atomic.Uint64
	dax       atomic.Pointer[daxPolicy]
	rootPath  string // the shared directory's host path, as /proc/self/fd shows it (DAX rules)
	nodes     nodeTable
	known     knownSteer // LOOKUP's way to known inodes (lookup.go)
	handles   handleTable
	mounts    mountTable // with FileHandles
	// handlesOff: FileHandlesPrefer found that handles cannot be opened; set by New.
	handlesOff bool
	fds        atomic.Int64
	closeOnce  sync.Once
}

var _ fuse.FileSystem = (*FS)(nil)

const procSelfFd = "/proc/self/fd"

// New opens root (O_PATH|O_DIRECTORY; the administrator's path, so symlinks in it are followed)
// as node 1. It sets the process umask to 0: see the package documentation.
func New(root string, opts Options) (*FS, error) {
	dax, err := compileDAXPolicy(opts.DAX)
	if err != nil {
		return nil, fmt.Errorf("passthrough: %w", err)
	}
	if opts.PosixACL && !(opts.UIDs.Empty() && opts.GIDs.Empty()) {
		return nil, fmt.Errorf("passthrough: POSIX ACLs and id translation together: the ids inside ACLs would not be translated")
	}
	procPath := opts.ProcSelfFd
	if procPath == "" {
		procPath = procSelfFd
	}
	procfd, err := unix.Open(procPath, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("passthrough: open %s: %w", procPath, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(procfd, &sfs); err != nil || sfs.Type != unix.PROC_SUPER_MAGIC {
		unix.Close(procfd)
		return nil, fmt.Errorf("passthrough: %s is not procfs", procPath)
	}
	rootfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(procfd)
		return nil, fmt.Errorf("passthrough: open shared directory %s: %w", root, err)
	}
	var st unix.Statx_t
	if err := statxFd(rootfd, &st); err != nil {
		unix.Close(rootfd)
		unix.Close(procfd)
		return nil, fmt.Errorf("passthrough: stat shared directory %s: %w", root, err)
	}
	fs := &FS{
		opts:     opts,
		procfd:   procfd,
		procPath: procPath,
		uid:      uint32(unix.Geteuid()),
		gid:      uint32(unix.Getegid()),
	}
	fs.dax.Store(dax)
	fs.rootPath, _ = os.Readlink(fs.procPathOf(int32(rootfd)))
	fs.entrySec, fs.entryNsec = splitDuration(opts.EntryTimeout)
	fs.attrSec, fs.attrNsec = splitDuration(opts.AttrTimeout)
	r := &inode{key: keyOf(&st), mode: unix.S_IFDIR}
	r.fd.Store(int32(rootfd))
	r.pins.Store(1)
	fs.fds.Store(2)
	fs.nodes.init(r, &fs.fds)
	fs.handles.init(&fs.fds)
	if err := fs.initHandles(rootfd, root); err != nil {
		unix.Close(rootfd)
		unix.Close(procfd)
		return nil, fmt.Errorf("passthrough: %w", err)
	}
	unix.Umask(0)
	return fs, nil
}

// Close drops every node and handle and closes the root. No method may be called during or
// after Close.
func (fs *FS) Close() error {
	fs.closeOnce.Do(func() {
		fs.Destroy()
		fs.nodes.put(fs.nodes.root)
		fs.fds.Add(-int64(fs.mounts.closeAll()))
		unix.Close(fs.procfd)
		fs.fds.Add(-1)
	})
	return nil
}

// Stats reports what the FS holds now.
func (fs *FS) Stats() Stats {
	return Stats{
		CachedInodes: int(fs.nodes.count.Load()) + 1,
		OpenFiles:    int(fs.handles.count.Load()),
		Fds:          int(fs.fds.Load()),
	}
}

// Init remembers the flags agreed with the guest.
func (fs *FS) Init(flags uint64) { fs.flags.Store(flags) }

// Destroy forgets every node but the root and closes every handle (descriptors still used by a
// running request close when it finishes).
func (fs *FS) Destroy() {
	fs.handles.dropAll()
	fs.nodes.dropAll()
}

func splitDuration(d time.Duration) (uint64, uint32) {
	if d <= 0 {
		return 0, 0
	}
	return uint64(d / time.Second), uint32(d % time.Second)
}

// errno turns an error of a syscall into the guest's errno: host errnos pass through,
// anything else is EIO.
func errno(err error) fuse.Errno {
	if err == nil {
		return fuse.OK
	}
	if e, ok := err.(unix.Errno); ok && e != 0 {
		return e
	}
	return unix.EIO
}

// checkName refuses what no name of a single entry may be, with what Linux answers for the
// same name in the same call: dot and dotdot are its answers for "." and ".." as the last
// component (a call that creates or removes an entry never acts on them). The server has
// refused empty, over-long and '/' names already; they are checked again because an *at() call
// with a '/' in the name would walk further than one entry.
func checkName(name string, dot, dotdot fuse.Errno) fuse.Errno {
	switch {
	case name == "":
		return unix.ENOENT
	case len(name) > nameMax:
		return unix.ENAMETOOLONG
	case strings.IndexByte(name, '/') >= 0 || strings.IndexByte(name, 0) >= 0:
		return unix.EINVAL
	case name == ".":
		return dot
	case name == "..":
		return dotdot
	}
	return fuse.OK
}

// node returns node id pinned (release it with fs.nodes.put), or EBADF.
func (fs *FS) node(id uint64) (*inode, fuse.Errno) {
	n, ok := fs.nodes.get(id)
	if !ok {
		return nil, unix.EBADF
	}
	return n, fuse.OK
}

// handle returns handle fh of node, pinned (release it with fs.handles.put), or EBADF.
func (fs *FS) handle(fh, node uint64, dir bool) (*handle, fuse.Errno) {
	h, ok := fs.handles.get(fh, node, dir)
	if !ok {
		return nil, unix.EBADF
	}
	return h, fuse.OK
}

// emptyPath is "" for syscalls given AT_EMPTY_PATH, without an allocation per call.
var emptyPath = [1]byte{0}

const statxMask = unix.STATX_BASIC_STATS | unix.STATX_MNT_ID

// statxFd stats what fd refers to, never following a symlink.
func statxFd(fd int, st *unix.Statx_t) error {
	_, _, e := unix.Syscall6(unix.SYS_STATX, uintptr(fd), uintptr(unsafe.Pointer(&emptyPath[0])),
		unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_SYNC_AS_STAT, statxMask,
		uintptr(unsafe.Pointer(st)), 0)
	if e != 0 {
		return e
	}
	return nil
}

func keyOf(st *unix.Statx_t) nodeKey {
	k := nodeKey{dev: unix.Mkdev(st.Dev_major, st.Dev_minor), ino: st.Ino}
	if st.Mask&unix.STATX_MNT_ID != 0 {
		k.mnt = st.Mnt_id
	}
	return k
}

// procName is the decimal name of fd in /proc/self/fd, NUL-terminated.
type procName [12]byte

func (p *procName) of(fd int32) *byte {
	b := strconv.AppendInt(p[:0], int64(fd), 10)
	b = append(b, 0)
	return &b[0]
}

// openProc re-opens the node descriptor fd through /proc/self/fd with flags. The caller has
// checked the node's type: /proc follows the magic link whatever it is.
func (fs *FS) openProc(fd int32, flags int) (int, error) {
	var name procName
	r, _, e := unix.Syscall6(unix.SYS_OPENAT, uintptr(fs.procfd), uintptr(unsafe.Pointer(name.of(fd))),
		uintptr(flags|unix.O_CLOEXEC), 0, 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

// procPathOf is /proc/self/fd/N as a path, for the syscalls that have no *at() form.
func (fs *FS) procPathOf(fd int32) string {
	return fs.procPath + "/" + strconv.Itoa(int(fd))
}

func fillAttr(a *fuse.Attr, st *unix.Statx_t) {
	*a = fuse.Attr{
		Ino:       st.Ino,
		Size:      st.Size,
		Blocks:    st.Blocks,
		Atime:     uint64(st.Atime.Sec),
		Mtime:     uint64(st.Mtime.Sec),
		Ctime:     uint64(st.Ctime.Sec),
		Atimensec: st.Atime.Nsec,
		Mtimensec: st.Mtime.Nsec,
		Ctimensec: st.Ctime.Nsec,
		Mode:      uint32(st.Mode),
		Nlink:     st.Nlink,
		UID:       st.Uid,
		GID:       st.Gid,
		Rdev:      uint32(unix.Mkdev(st.Rdev_major, st.Rdev_minor)),
		Blksize:   st.Blksize,
	}
}

// attrFlags are the fuse.Attr flags of a node with inode.mode mode; dax is daxAttr's verdict.
func (fs *FS) attrFlags(mode uint32, dax bool) uint32 {
	if mode&modeSubmount != 0 && fs.opts.AnnounceSubmounts && fs.flags.Load()&fuse.InitSubmounts != 0 {
		return fuse.AttrSubmount
	}
	if dax {
		return fuse.AttrDAX
	}
	return 0
}

// fillAttrOut answers the attributes of node n, which the caller holds pinned, read through
// fd, a descriptor of it.
func (fs *FS) fillAttrOut(out *fuse.AttrOut, n *inode, fd int, st *unix.Statx_t) {
	out.AttrValid, out.AttrValidNsec = fs.attrSec, fs.attrNsec
	fillAttr(&out.Attr, st)
	fs.guestOwner(&out.Attr)
	out.Attr.Flags = fs.attrFlags(n.mode, fs.daxAttr(int32(fd), st))
}

// readOnly answers EROFS when the share is exported read-only (Options.ReadOnly), before a
// request that would change it does anything.
func (fs *FS) readOnly() fuse.Errno {
	if fs.opts.ReadOnly {
		return unix.EROFS
	}
	return fuse.OK
}

// writes says whether open flags ask to change the file: write access or truncation.
func writes(flags uint32) bool {
	return flags&unix.O_ACCMODE != unix.O_RDONLY || flags&unix.O_TRUNC != 0
}
