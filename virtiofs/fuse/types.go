package fuse

// Wire structures of the FUSE protocol, laid out exactly as in the kernel's
// include/uapi/linux/fuse.h (protocol 7.38). They hold no pointers, so they are copied to and
// from the wire as raw bytes in host byte order; sizes are asserted in types_test.go against the
// kernel's.

// Protocol version spoken by this server.
const (
	KernelVersion = 7
	// KernelMinorVersion is the minor version kvfs implements.
	KernelMinorVersion = 38
	// MinKernelMinorVersion is the oldest guest protocol accepted (virtio-fs appeared with 7.31).
	MinKernelMinorVersion = 31
	// RootID is the node id of the shared directory.
	RootID = 1
)

// InHeader starts every request.
type InHeader struct {
	Len         uint32
	Opcode      uint32
	Unique      uint64
	NodeID      uint64
	UID         uint32
	GID         uint32
	PID         uint32
	TotalExtlen uint16 // 7.38: length of extensions after the arguments, in 8-byte units
	Padding     uint16
}

// OutHeader starts every reply. Error is 0 or a negated errno.
type OutHeader struct {
	Len    uint32
	Error  int32
	Unique uint64
}

// Attr is struct fuse_attr.
type Attr struct {
	Ino       uint64
	Size      uint64
	Blocks    uint64
	Atime     uint64
	Mtime     uint64
	Ctime     uint64
	Atimensec uint32
	Mtimensec uint32
	Ctimensec uint32
	Mode      uint32
	Nlink     uint32
	UID       uint32
	GID       uint32
	Rdev      uint32
	Blksize   uint32
	Flags     uint32 // AttrSubmount, AttrDAX
}

// Attr.Flags bits.
const (
	AttrSubmount = 1 << 0
	AttrDAX      = 1 << 1
)

// EntryOut answers LOOKUP and the creating operations.
type EntryOut struct {
	NodeID         uint64
	Generation     uint64
	EntryValid     uint64
	AttrValid      uint64
	EntryValidNsec uint32
	AttrValidNsec  uint32
	Attr           Attr
}

// AttrOut answers GETATTR and SETATTR.
type AttrOut struct {
	AttrValid     uint64
	AttrValidNsec uint32
	Dummy         uint32
	Attr          Attr
}

// InitIn is the 64-byte fuse_init_in of 7.36+; older guests send only the first 16 bytes.
type InitIn struct {
	Major        uint32
	Minor        uint32
	MaxReadahead uint32
	Flags        uint32
	Flags2       uint32
	Unused       [11]uint32
}

// initInCompatSize is the size of fuse_init_in before 7.36.
const initInCompatSize = 16

// InitOut answers INIT.
type InitOut struct {
	Major               uint32
	Minor               uint32
	MaxReadahead        uint32
	Flags               uint32
	MaxBackground       uint16
	CongestionThreshold uint16
	MaxWrite            uint32
	TimeGran            uint32
	MaxPages            uint16
	MapAlignment        uint16
	Flags2              uint32
	Unused              [7]uint32
}

// INIT flags (bits of Flags | Flags2<<32).
const (
	InitAsyncRead         = 1 << 0
	InitPosixLocks        = 1 << 1
	InitFileOps           = 1 << 2
	InitAtomicOTrunc      = 1 << 3
	InitExportSupport     = 1 << 4
	InitBigWrites         = 1 << 5
	InitDontMask          = 1 << 6
	InitSpliceWrite       = 1 << 7
	InitSpliceMove        = 1 << 8
	InitSpliceRead        = 1 << 9
	InitFlockLocks        = 1 << 10
	InitHasIoctlDir       = 1 << 11
	InitAutoInvalData     = 1 << 12
	InitDoReaddirplus     = 1 << 13
	InitReaddirplusAuto   = 1 << 14
	InitAsyncDIO          = 1 << 15
	InitWritebackCache    = 1 << 16
	InitNoOpenSupport     = 1 << 17
	InitParallelDirops    = 1 << 18
	InitHandleKillpriv    = 1 << 19
	InitPosixACL          = 1 << 20
	InitAbortError        = 1 << 21
	InitMaxPages          = 1 << 22
	InitCacheSymlinks     = 1 << 23
	InitNoOpendirSupport  = 1 << 24
	InitExplicitInvalData = 1 << 25
	InitMapAlignment      = 1 << 26
	InitSubmounts         = 1 << 27
	InitHandleKillprivV2  = 1 << 28
	InitSetxattrExt       = 1 << 29
	InitInitExt           = 1 << 30
	InitInitReserved      = 1 << 31
	InitSecurityCtx       = 1 << 32
	InitHasInodeDAX       = 1 << 33
	InitCreateSuppGroup   = 1 << 34
	InitHasExpireOnly     = 1 << 35
	// InitDirectIOAllowMmap lets the guest mmap files opened with FOPEN_DIRECT_IO (7.39).
	InitDirectIOAllowMmap = 1 << 36
)

// GetattrIn is the argument of GETATTR.
type GetattrIn struct {
	Flags uint32 // GetattrFh
	Dummy uint32
	Fh    uint64
}

// GetattrFh says GetattrIn.Fh is valid.
const GetattrFh = 1 << 0

// SetattrIn is the argument of SETATTR. Valid says which fields to change.
type SetattrIn struct {
	Valid     uint32
	Padding   uint32
	Fh        uint64
	Size      uint64
	LockOwner uint64
	Atime     uint64
	Mtime     uint64
	Ctime     uint64
	Atimensec uint32
	Mtimensec uint32
	Ctimensec uint32
	Mode      uint32
	Unused4   uint32
	UID       uint32
	GID       uint32
	Unused5   uint32
}

// SetattrIn.Valid bits.
const (
	FattrMode        = 1 << 0
	FattrUID         = 1 << 1
	FattrGID         = 1 << 2
	FattrSize        = 1 << 3
	FattrAtime       = 1 << 4
	FattrMtime       = 1 << 5
	FattrFh          = 1 << 6
	FattrAtimeNow    = 1 << 7
	FattrMtimeNow    = 1 << 8
	FattrLockOwner   = 1 << 9
	FattrCtime       = 1 << 10
	FattrKillSuidgid = 1 << 11
)

// MknodIn is the argument of MKNOD, followed by the name.
type MknodIn struct {
	Mode    uint32
	Rdev    uint32
	Umask   uint32
	Padding uint32
}

// MkdirIn is the argument of MKDIR, followed by the name.
type MkdirIn struct {
	Mode  uint32
	Umask uint32
}

// RenameIn is the argument of RENAME, followed by the old and new names.
type RenameIn struct {
	Newdir uint64
}

// Rename2In is the argument of RENAME2, followed by the old and new names.
type Rename2In struct {
	Newdir  uint64
	Flags   uint32
	Padding uint32
}

// LinkIn is the argument of LINK, followed by the new name.
type LinkIn struct {
	Oldnodeid uint64
}

// OpenIn is the argument of OPEN and OPENDIR.
type OpenIn struct {
	Flags     uint32
	OpenFlags uint32 // OpenKillSuidgid
}

// OpenKillSuidgid in OpenIn.OpenFlags: clear setuid/setgid when truncating (KILLPRIV_V2).
const OpenKillSuidgid = 1 << 0

// OpenOut answers OPEN, OPENDIR and (with EntryOut) CREATE.
type OpenOut struct {
	Fh        uint64
	OpenFlags uint32
	Padding   uint32
}

// OpenOut.OpenFlags bits.
const (
	FopenDirectIO             = 1 << 0
	FopenKeepCache            = 1 << 1
	FopenNonseekable          = 1 << 2
	FopenCacheDir             = 1 << 3
	FopenStream               = 1 << 4
	FopenNoflush              = 1 << 5
	FopenParallelDirectWrites = 1 << 6
)

// CreateIn is the argument of CREATE and TMPFILE, followed by the name.
type CreateIn struct {
	Flags     uint32
	Mode      uint32
	Umask     uint32
	OpenFlags uint32
}

// ReleaseIn is the argument of RELEASE and RELEASEDIR.
type ReleaseIn struct {
	Fh           uint64
	Flags        uint32
	ReleaseFlags uint32
	LockOwner    uint64
}

// ReleaseIn.ReleaseFlags bits.
const (
	// ReleaseFlush: flush the file too (sent instead of a separate FLUSH).
	ReleaseFlush = 1 << 0
	// ReleaseFlockUnlock: the file held flock(2) locks; release them (LockOwner is their owner).
	ReleaseFlockUnlock = 1 << 1
)

// FlushIn is the argument of FLUSH.
type FlushIn struct {
	Fh        uint64
	Unused    uint32
	Padding   uint32
	LockOwner uint64
}

// ReadIn is the argument of READ, READDIR and READDIRPLUS.
type ReadIn struct {
	Fh        uint64
	Offset    uint64
	Size      uint32
	ReadFlags uint32
	LockOwner uint64
	Flags     uint32
	Padding   uint32
}

// WriteIn is the argument of WRITE, followed by the data.
type WriteIn struct {
	Fh         uint64
	Offset     uint64
	Size       uint32
	WriteFlags uint32
	LockOwner  uint64
	Flags      uint32
	Padding    uint32
}

// WriteIn.WriteFlags bits.
const (
	WriteCache       = 1 << 0
	WriteLockOwner   = 1 << 1
	WriteKillSuidgid = 1 << 2
)

// WriteOut answers WRITE and COPY_FILE_RANGE.
type WriteOut struct {
	Size    uint32
	Padding uint32
}

// StatfsOut answers STATFS.
type StatfsOut struct {
	Blocks  uint64
	Bfree   uint64
	Bavail  uint64
	Files   uint64
	Ffree   uint64
	Bsize   uint32
	Namelen uint32
	Frsize  uint32
	Padding uint32
	Spare   [6]uint32
}

// FsyncIn is the argument of FSYNC and FSYNCDIR.
type FsyncIn struct {
	Fh         uint64
	FsyncFlags uint32 // FsyncFdatasync
	Padding    uint32
}

// FsyncFdatasync in FsyncIn.FsyncFlags: only data needs to reach the disk.
const FsyncFdatasync = 1 << 0

// SetxattrIn is the argument of SETXATTR, followed by the name and the value. Guests that
// negotiated SETXATTR_EXT send the 16-byte form; others only the first 8 bytes.
type SetxattrIn struct {
	Size          uint32
	Flags         uint32
	SetxattrFlags uint32
	Padding       uint32
}

// setxattrInCompatSize is the size of fuse_setxattr_in without SETXATTR_EXT.
const setxattrInCompatSize = 8

// SetxattrACLKillSgid in SetxattrIn.SetxattrFlags: setting system.posix_acl_access must also
// clear the set-group-ID bit (the guest found the caller neither in the file's group nor
// holding CAP_FSETID).
const SetxattrACLKillSgid = 1 << 0

// SecctxHeader starts the security contexts a guest that negotiated SECURITY_CTX appends to
// CREATE, MKNOD, MKDIR and SYMLINK: Size is the length of the whole trailer, header included.
// Each context is a Secctx, the attribute name (NUL-terminated) and Secctx.Size bytes of value.
type SecctxHeader struct {
	Size     uint32
	NrSecctx uint32
}

// Secctx precedes one security context.
type Secctx struct {
	Size    uint32
	Padding uint32
}

// GetxattrIn is the argument of GETXATTR (followed by the name) and LISTXATTR.
type GetxattrIn struct {
	Size    uint32
	Padding uint32
}

// GetxattrOut answers GETXATTR and LISTXATTR when the guest asked for the size only.
type GetxattrOut struct {
	Size    uint32
	Padding uint32
}

// AccessIn is the argument of ACCESS.
type AccessIn struct {
	Mask    uint32
	Padding uint32
}

// ForgetIn is the argument of FORGET.
type ForgetIn struct {
	Nlookup uint64
}

// BatchForgetIn is the argument of BATCH_FORGET, followed by Count ForgetOne.
type BatchForgetIn struct {
	Count uint32
	Dummy uint32
}

// ForgetOne is one entry of BATCH_FORGET.
type ForgetOne struct {
	NodeID  uint64
	Nlookup uint64
}

// FallocateIn is the argument of FALLOCATE.
type FallocateIn struct {
	Fh      uint64
	Offset  uint64
	Length  uint64
	Mode    uint32
	Padding uint32
}

// LseekIn is the argument of LSEEK.
type LseekIn struct {
	Fh      uint64
	Offset  uint64
	Whence  uint32
	Padding uint32
}

// LseekOut answers LSEEK.
type LseekOut struct {
	Offset uint64
}

// CopyFileRangeIn is the argument of COPY_FILE_RANGE.
type CopyFileRangeIn struct {
	FhIn      uint64
	OffIn     uint64
	NodeIDOut uint64
	FhOut     uint64
	OffOut    uint64
	Len       uint64
	Flags     uint64
}

// SyncfsIn is the argument of SYNCFS.
type SyncfsIn struct {
	Padding uint64
}

// FileLock is struct fuse_file_lock: the byte range [Start, End] (End inclusive;
// OffsetMax means "to the end of the file"), the lock type (F_RDLCK, F_WRLCK or F_UNLCK) and
// the process owning it, as a pid of the guest's FUSE pid namespace (0: none known).
type FileLock struct {
	Start uint64
	End   uint64
	Type  uint32
	PID   uint32
}

// OffsetMax is the largest file offset (the kernel's OFFSET_MAX): a lock that ends there
// extends to the end of the file, however far it grows.
const OffsetMax = 1<<63 - 1

// LkIn is the argument of GETLK, SETLK and SETLKW. Owner identifies the guest lock owner (a
// process's file table for POSIX locks, an open file for flock(2) locks).
type LkIn struct {
	Fh      uint64
	Owner   uint64
	Lk      FileLock
	LkFlags uint32 // LkFlock
	Padding uint32
}

// LkFlock in LkIn.LkFlags: the request is about a flock(2) lock (the whole file, owned by the
// open file) rather than a POSIX record lock. Only SETLK and SETLKW carry it.
const LkFlock = 1 << 0

// LkOut answers GETLK: the first lock that conflicts with the one asked about, or one of type
// F_UNLCK if none does.
type LkOut struct {
	Lk FileLock
}

// InterruptIn is the argument of INTERRUPT.
type InterruptIn struct {
	Unique uint64
}

// Dirent is the fixed part of one READDIR entry; the name follows, padded to 8 bytes.
type Dirent struct {
	Ino     uint64
	Off     uint64
	Namelen uint32
	Type    uint32
}

// DirentPlus is the fixed part of one READDIRPLUS entry.
type DirentPlus struct {
	Entry  EntryOut
	Dirent Dirent
}
