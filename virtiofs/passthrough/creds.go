package passthrough

import (
	"runtime"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// setfsuid and setfsgid change the file-system ids of the calling thread only (unlike
// setresuid, which Go applies to every thread) and return the previous id. They cannot report
// failure: success is checked by calling again with the same id, which returns the current one.
func setfsuid(uid uint32) uint32 {
	r, _, _ := unix.RawSyscall(unix.SYS_SETFSUID, uintptr(uid), 0, 0)
	return uint32(r)
}

func setfsgid(gid uint32) uint32 {
	r, _, _ := unix.RawSyscall(unix.SYS_SETFSGID, uintptr(gid), 0, 0)
	return uint32(r)
}

// asCaller switches the current goroutine's OS thread to the caller's fsuid and fsgid (the
// host's ids of the caller's, Options.UIDs and GIDs), so that what it creates next is owned by
// the caller and permission checks are the caller's. It reports whether it switched; the
// caller then calls restoreCreds. Nothing is switched when the caller's ids are ours already.
// A caller whose id is forbidden gets EPERM.
func (fs *FS) asCaller(ctx *fuse.Context) (switched bool, errno fuse.Errno) {
	uid, uok := fs.opts.UIDs.ToHost(ctx.UID)
	gid, gok := fs.opts.GIDs.ToHost(ctx.GID)
	if !uok || !gok {
		return false, unix.EPERM
	}
	if uid == fs.uid && gid == fs.gid {
		return false, fuse.OK
	}
	runtime.LockOSThread()
	// The group first: once the fsuid is not root, changing the fsgid may no longer be allowed.
	setfsgid(gid)
	if setfsgid(gid) != gid {
		fs.restoreCreds()
		return false, unix.EPERM
	}
	setfsuid(uid)
	if setfsuid(uid) != uid {
		fs.restoreCreds()
		return false, unix.EPERM
	}
	return true, fuse.OK
}

// guestOwner translates the owner of attributes a, the host's, into the guest's
// (Options.UIDs and GIDs).
func (fs *FS) guestOwner(a *fuse.Attr) {
	a.UID = fs.opts.UIDs.ToGuest(a.UID)
	a.GID = fs.opts.GIDs.ToGuest(a.GID)
}

// restoreCreds switches the thread back to our own fsuid and fsgid and unlocks it. Should that
// fail, the thread stays locked to its goroutine, so no other goroutine ever runs with the
// caller's ids, and the runtime ends the thread when the goroutine exits. (Failing to restore
// leaves the thread with less privilege, never more.)
func (fs *FS) restoreCreds() {
	setfsuid(fs.uid)
	setfsgid(fs.gid)
	if setfsuid(fs.uid) == fs.uid && setfsgid(fs.gid) == fs.gid {
		runtime.UnlockOSThread()
	}
}
