package fuse

import "strconv"

// Opcode identifies a FUSE request.
type Opcode uint32

// Opcodes of the FUSE protocol up to 7.38.
const (
	OpLookup        Opcode = 1
	OpForget        Opcode = 2
	OpGetattr       Opcode = 3
	OpSetattr       Opcode = 4
	OpReadlink      Opcode = 5
	OpSymlink       Opcode = 6
	OpMknod         Opcode = 8
	OpMkdir         Opcode = 9
	OpUnlink        Opcode = 10
	OpRmdir         Opcode = 11
	OpRename        Opcode = 12
	OpLink          Opcode = 13
	OpOpen          Opcode = 14
	OpRead          Opcode = 15
	OpWrite         Opcode = 16
	OpStatfs        Opcode = 17
	OpRelease       Opcode = 18
	OpFsync         Opcode = 20
	OpSetxattr      Opcode = 21
	OpGetxattr      Opcode = 22
	OpListxattr     Opcode = 23
	OpRemovexattr   Opcode = 24
	OpFlush         Opcode = 25
	OpInit          Opcode = 26
	OpOpendir       Opcode = 27
	OpReaddir       Opcode = 28
	OpReleasedir    Opcode = 29
	OpFsyncdir      Opcode = 30
	OpGetlk         Opcode = 31
	OpSetlk         Opcode = 32
	OpSetlkw        Opcode = 33
	OpAccess        Opcode = 34
	OpCreate        Opcode = 35
	OpInterrupt     Opcode = 36
	OpBmap          Opcode = 37
	OpDestroy       Opcode = 38
	OpIoctl         Opcode = 39
	OpPoll          Opcode = 40
	OpNotifyReply   Opcode = 41
	OpBatchForget   Opcode = 42
	OpFallocate     Opcode = 43
	OpReaddirplus   Opcode = 44
	OpRename2       Opcode = 45
	OpLseek         Opcode = 46
	OpCopyFileRange Opcode = 47
	OpSetupmapping  Opcode = 48
	OpRemovemapping Opcode = 49
	OpSyncfs        Opcode = 50
	OpTmpfile       Opcode = 51

	// opcodeLimit bounds the opcode table; larger opcodes are unknown.
	opcodeLimit = 64
)

var opNames = [opcodeLimit]string{
	OpLookup: "LOOKUP", OpForget: "FORGET", OpGetattr: "GETATTR", OpSetattr: "SETATTR",
	OpReadlink: "READLINK", OpSymlink: "SYMLINK", OpMknod: "MKNOD", OpMkdir: "MKDIR",
	OpUnlink: "UNLINK", OpRmdir: "RMDIR", OpRename: "RENAME", OpLink: "LINK", OpOpen: "OPEN",
	OpRead: "READ", OpWrite: "WRITE", OpStatfs: "STATFS", OpRelease: "RELEASE", OpFsync: "FSYNC",
	OpSetxattr: "SETXATTR", OpGetxattr: "GETXATTR", OpListxattr: "LISTXATTR",
	OpRemovexattr: "REMOVEXATTR", OpFlush: "FLUSH", OpInit: "INIT", OpOpendir: "OPENDIR",
	OpReaddir: "READDIR", OpReleasedir: "RELEASEDIR", OpFsyncdir: "FSYNCDIR", OpGetlk: "GETLK",
	OpSetlk: "SETLK", OpSetlkw: "SETLKW", OpAccess: "ACCESS", OpCreate: "CREATE",
	OpInterrupt: "INTERRUPT", OpBmap: "BMAP", OpDestroy: "DESTROY", OpIoctl: "IOCTL",
	OpPoll: "POLL", OpNotifyReply: "NOTIFY_REPLY", OpBatchForget: "BATCH_FORGET",
	OpFallocate: "FALLOCATE", OpReaddirplus: "READDIRPLUS", OpRename2: "RENAME2",
	OpLseek: "LSEEK", OpCopyFileRange: "COPY_FILE_RANGE", OpSetupmapping: "SETUPMAPPING",
	OpRemovemapping: "REMOVEMAPPING", OpSyncfs: "SYNCFS", OpTmpfile: "TMPFILE",
}

func (op Opcode) String() string {
	if op < opcodeLimit && opNames[op] != "" {
		return opNames[op]
	}
	return "OPCODE_" + strconv.FormatUint(uint64(op), 10)
}
