package passthrough

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// FileHandleMode says whether nodes keep a host file handle instead of a descriptor: see the
// package documentation, "File handles".
type FileHandleMode int

const (
	// FileHandlesNever: every node holds an O_PATH descriptor. The default.
	FileHandlesNever FileHandleMode = iota
	// FileHandlesPrefer: a node keeps a file handle where its file system supports them and
	// an O_PATH descriptor where it does not.
	FileHandlesPrefer
	// FileHandlesMandatory: every node but the root keeps a file handle; a lookup of a file
	// that has none fails with EOPNOTSUPP, and New fails when the shared directory's file
	// system has none or the process cannot open them (CAP_DAC_READ_SEARCH).
	FileHandlesMandatory
)

var fileHandleModeNames = map[FileHandleMode]string{
	FileHandlesNever:     "never",
	FileHandlesPrefer:    "prefer",
	FileHandlesMandatory: "mandatory",
}

func (m FileHandleMode) String() string {
	if s, ok := fileHandleModeNames[m]; ok {
		return s
	}
	return fmt.Sprintf("FileHandleMode(%d)", int(m))
}

// ParseFileHandleMode accepts never, prefer and mandatory (virtiofsd's --inode-file-handles).
func ParseFileHandleMode(s string) (FileHandleMode, error) {
	for m, name := range fileHandleModeNames {
		if s == name {
			return m, nil
		}
	}
	return 0, fmt.Errorf("invalid inode file handle mode %q: want never, prefer or mandatory", s)
}

// maxHandleSize is MAX_HANDLE_SZ, the largest file handle the kernel hands out.
const maxHandleSize = 128

// fileHandleBuf is struct file_handle with room for the largest handle.
type fileHandleBuf struct {
	size uint32 // handle_bytes
	typ  int32  // handle_type
	f    [maxHandleSize]byte
}

// fhHeader is the length of what starts an encoded handle: its length and its type.
const fhHeader = 1 + 4

// encHandle is an encoded file handle: one byte of length (of what follows), the handle type
// (4 bytes, native order), then the handle; nil for none. A pointer to the first byte of one
// allocation, so that an inode spends 8 bytes on it, not a slice's 24 or a string's 16.
type encHandle = *byte

// handleBytes returns the whole encoding of h.
func handleBytes(h encHandle) []byte {
	return unsafe.Slice(h, 1+int(*h))
}

// nameToHandle returns the file handle of what fd refers to (AT_EMPTY_PATH: the inode itself,
// never a symlink's target), encoded, and the id of the mount fd was reached through.
func nameToHandle(fd int) (encHandle, uint64, error) {
	var b fileHandleBuf
	b.size = maxHandleSize
	var mnt int32
	_, _, e := unix.Syscall6(unix.SYS_NAME_TO_HANDLE_AT, uintptr(fd),
		uintptr(unsafe.Pointer(&emptyPath[0])), uintptr(unsafe.Pointer(&b)),
		uintptr(unsafe.Pointer(&mnt)), unix.AT_EMPTY_PATH, 0)
	if e != 0 {
		return nil, 0, e
	}
	if b.size > maxHandleSize {
		return nil, 0, unix.EOVERFLOW
	}
	enc := make([]byte, fhHeader+int(b.size))
	enc[0] = byte(len(enc) - 1)
	binary.NativeEndian.PutUint32(enc[1:], uint32(b.typ))
	copy(enc[fhHeader:], b.f[:b.size])
	return &enc[0], uint64(uint32(mnt)), nil
}

// openByHandle opens the inode of encoded handle fh (from nameToHandle) on the file system of
// mountfd with flags. ESTALE: the inode is gone.
func openByHandle(mountfd int, fh encHandle, flags int) (int, error) {
	enc := handleBytes(fh)
	var b fileHandleBuf
	b.size = uint32(len(enc) - fhHeader)
	b.typ = int32(binary.NativeEndian.Uint32(enc[1:]))
	copy(b.f[:], enc[fhHeader:])
	r, _, e := unix.Syscall(unix.SYS_OPEN_BY_HANDLE_AT, uintptr(mountfd), uintptr(unsafe.Pointer(&b)),
		uintptr(flags|unix.O_CLOEXEC))
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

// mountTable holds one descriptor per mount that nodes have file handles on: open_by_handle_at
// needs one of the mount (opened for reading: it refuses O_PATH descriptors). The descriptors
// stay open until Close, so those mounts stay busy.
type mountTable struct {
	mu  sync.Mutex                       // serialises add; a leaf
	fds atomic.Pointer[map[uint64]int32] // mount id → descriptor; copied on write
}

func (t *mountTable) get(mnt uint64) (int, bool) {
	if m := t.fds.Load(); m != nil {
		fd, ok := (*m)[mnt]
		return int(fd), ok
	}
	return -1, false
}

// add returns the descriptor of mount mnt, calling open for one if there is none yet. It
// reports whether it opened one.
func (t *mountTable) add(mnt uint64, open func() (int, error)) (int, bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if fd, ok := t.get(mnt); ok {
		return fd, false, nil
	}
	fd, err := open()
	if err != nil {
		return -1, false, err
	}
	old := t.fds.Load()
	m := make(map[uint64]int32, 1)
	if old != nil {
		for k, v := range *old {
			m[k] = v
		}
	}
	m[mnt] = int32(fd)
	t.fds.Store(&m)
	return fd, true, nil
}

// closeAll closes every mount descriptor and returns how many it closed.
func (t *mountTable) closeAll() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.fds.Swap(nil)
	if m == nil {
		return 0
	}
	for _, fd := range *m {
		unix.Close(int(fd))
	}
	return len(*m)
}

// initHandles sets up file handles for New on the shared directory rootfd: with
// FileHandlesMandatory it fails unless a handle of the root can be made and opened again;
// with FileHandlesPrefer it turns handles off when the root's handle cannot be opened again
// (no CAP_DAC_READ_SEARCH, say), and leaves per-file fallback to addNode otherwise.
func (fs *FS) initHandles(rootfd int, root string) error {
	if fs.opts.FileHandles == FileHandlesNever {
		return nil
	}
	mandatory := fs.opts.FileHandles == FileHandlesMandatory
	fh, mnt, err := nameToHandle(rootfd)
	if err != nil {
		if mandatory {
			return fmt.Errorf("inode file handles are mandatory, but the file system of %s has none: %w", root, err)
		}
		return nil // submounts may have them
	}
	mfd, _, err := fs.mountFd(mnt, rootfd, rootfd, unix.S_IFDIR)
	if err != nil {
		if mandatory {
			return fmt.Errorf("inode file handles are mandatory, but the mount of %s cannot be opened: %w", root, err)
		}
		return nil
	}
	fd, err := openByHandle(mfd, fh, unix.O_PATH)
	if err != nil {
		fs.fds.Add(-int64(fs.mounts.closeAll()))
		switch {
		case !mandatory:
			fs.handlesOff = true
			return nil
		case err == unix.EPERM:
			return fmt.Errorf("inode file handles are mandatory, but open_by_handle_at needs CAP_DAC_READ_SEARCH: %w", err)
		}
		return fmt.Errorf("inode file handles are mandatory, but a handle of %s cannot be opened: %w", root, err)
	}
	unix.Close(fd)
	return nil
}

// mountFd returns the descriptor of mount mnt for open_by_handle_at, opening one if needed:
// the directory dirfd when it is on that mount (a node's parent, read through /proc), else
// the node fd itself when it is a directory or regular file; a special file or symlink bind
// mounted on its own cannot serve (EOPNOTSUPP).
func (fs *FS) mountFd(mnt uint64, dirfd, fd int, typ uint32) (int, bool, error) {
	if mfd, ok := fs.mounts.get(mnt); ok {
		return mfd, false, nil
	}
	mfd, opened, err := fs.mounts.add(mnt, func() (int, error) {
		var st unix.Statx_t
		if err := statxFd(dirfd, &st); err == nil && st.Mask&unix.STATX_MNT_ID != 0 && st.Mnt_id == mnt {
			return fs.openProc(int32(dirfd), unix.O_RDONLY|unix.O_DIRECTORY)
		}
		switch typ {
		case unix.S_IFDIR:
			return fs.openProc(int32(fd), unix.O_RDONLY|unix.O_DIRECTORY)
		case unix.S_IFREG:
			return fs.openProc(int32(fd), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
		}
		return -1, unix.EOPNOTSUPP
	})
	if opened {
		fs.fds.Add(1)
	}
	return mfd, opened, err
}

// handleFor returns the file handle node fd (of type typ and key k, found in directory dirfd)
// is to keep, or nil when it keeps fd: with FileHandlesNever, and with FileHandlesPrefer when
// its file system has no handles. With FileHandlesMandatory, a file without a handle answers
// an error.
func (fs *FS) handleFor(dirfd, fd int, typ uint32, k nodeKey) (encHandle, fuse.Errno) {
	if fs.opts.FileHandles == FileHandlesNever || fs.handlesOff {
		return nil, fuse.OK
	}
	fh, mnt, err := nameToHandle(fd)
	if err == nil && k.mnt != mnt {
		err = unix.EOPNOTSUPP // the kernel's two mount ids disagree: never guess
	}
	if err == nil {
		_, _, err = fs.mountFd(mnt, dirfd, fd, typ)
	}
	switch {
	case err == nil:
		return fh, fuse.OK
	case fs.opts.FileHandles == FileHandlesMandatory:
		if err == unix.EOPNOTSUPP || err == unix.EOVERFLOW {
			return nil, unix.EOPNOTSUPP
		}
		return nil, errno(err)
	}
	return nil, fuse.OK
}

// pathFd returns a descriptor of node n for one request: its own O_PATH descriptor, or, for a
// node that keeps a file handle, an O_PATH descriptor opened from the handle, which doneFd
// closes. A handle whose inode is gone answers ESTALE.
func (fs *FS) pathFd(n *inode) (int, fuse.Errno) {
	if fd := n.fd.Load(); fd >= 0 {
		return int(fd), fuse.OK
	}
	mfd, ok := fs.mounts.get(n.key.mnt)
	if !ok {
		return -1, unix.EIO // every handle's mount is in the table until Close
	}
	fd, err := openByHandle(mfd, n.fh, unix.O_PATH)
	if err != nil {
		return -1, errno(err)
	}
	return fd, fuse.OK
}

// doneFd releases what pathFd returned. (A descriptor it opened cannot be the node's own, even
// if hold gave the node one since: both are open at once.)
func (fs *FS) doneFd(n *inode, fd int) {
	if int32(fd) != n.fd.Load() {
		unix.Close(fd)
	}
}

// holdIfLast runs before name in directory dirfd is removed (UNLINK, RMDIR, or RENAME onto
// it). If name is the last link of a file whose node keeps a file handle, the node gets an
// O_PATH descriptor and keeps it until it is forgotten: the guest may still use the file (an
// open file, unlinked, then fstat), and some file systems (ext4, xfs) refuse to open handles
// of unlinked inodes. Should the removal fail, the node just holds a descriptor, as without
// handles.
func (fs *FS) holdIfLast(dirfd int, name string) {
	if !fs.UsesFileHandles() {
		return
	}
	fd, err := openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return // the removal will fail too
	}
	var st unix.Statx_t
	if statxFd(fd, &st) != nil || (st.Nlink > 1 && st.Mode&unix.S_IFMT != unix.S_IFDIR) ||
		!fs.nodes.hold(keyOf(&st), fd) {
		unix.Close(fd)
	}
}

// nodeFd returns node id pinned, with a descriptor of it for this request (see pathFd);
// putFd releases both.
func (fs *FS) nodeFd(id uint64) (*inode, int, fuse.Errno) {
	n, e := fs.node(id)
	if e != fuse.OK {
		return nil, -1, e
	}
	fd, e := fs.pathFd(n)
	if e != fuse.OK {
		fs.nodes.put(n)
		return nil, -1, e
	}
	return n, fd, fuse.OK
}

func (fs *FS) putFd(n *inode, fd int) {
	fs.doneFd(n, fd)
	fs.nodes.put(n)
}

// UsesFileHandles reports whether nodes may keep file handles: the mode is prefer or
// mandatory, and (prefer) the process can open handles.
func (fs *FS) UsesFileHandles() bool {
	return fs.opts.FileHandles != FileHandlesNever && !fs.handlesOff
}
