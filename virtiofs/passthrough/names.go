package passthrough

import (
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// nameMax is the longest entry name (NAME_MAX): checkName refuses longer ones.
const nameMax = 255

// entryName is one entry's name NUL-terminated for an *at() system call, in the caller's
// (stack) buffer. The x/sys wrappers copy a string argument to the heap (BytePtrFromString) on
// every call: one allocation per LOOKUP, CREATE, UNLINK, MKDIR... and per entry of a
// READDIRPLUS (docs/measurements/performance.md, "Names without copies").
type entryName [nameMax + 1]byte

// of returns name NUL-terminated in b. A name that no single entry may have, too long or with a
// NUL (checkName refused both already), is ENAMETOOLONG or EINVAL here too, so that it is never
// cut short into another entry's name.
func (b *entryName) of(name string) (*byte, error) {
	if len(name) > nameMax {
		return nil, unix.ENAMETOOLONG
	}
	if strings.IndexByte(name, 0) >= 0 {
		return nil, unix.EINVAL
	}
	b[copy(b[:], name)] = 0
	return &b[0], nil
}

// openat is unix.Openat for one entry's name, without its heap copy.
func openat(dirfd int, name string, flags int, mode uint32) (int, error) {
	var b entryName
	p, err := b.of(name)
	if err != nil {
		return -1, err
	}
	r, _, e := unix.Syscall6(unix.SYS_OPENAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)),
		uintptr(flags|unix.O_LARGEFILE), uintptr(mode), 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

// unlinkat is unix.Unlinkat for one entry's name, without its heap copy.
func unlinkat(dirfd int, name string, flags int) error {
	var b entryName
	p, err := b.of(name)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall(unix.SYS_UNLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)), uintptr(flags)); e != 0 {
		return e
	}
	return nil
}

// mkdirat is unix.Mkdirat for one entry's name, without its heap copy.
func mkdirat(dirfd int, name string, mode uint32) error {
	var b entryName
	p, err := b.of(name)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall(unix.SYS_MKDIRAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)), uintptr(mode)); e != 0 {
		return e
	}
	return nil
}

// mknodat is unix.Mknodat for one entry's name, without its heap copy.
func mknodat(dirfd int, name string, mode uint32, dev int) error {
	var b entryName
	p, err := b.of(name)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall6(unix.SYS_MKNODAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)), uintptr(mode),
		uintptr(dev), 0, 0); e != 0 {
		return e
	}
	return nil
}

// renameat2 is unix.Renameat2 for two entries' names, without their heap copies.
func renameat2(olddirfd int, oldname string, newdirfd int, newname string, flags uint) error {
	var ob, nb entryName
	op, err := ob.of(oldname)
	if err != nil {
		return err
	}
	np, err := nb.of(newname)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall6(unix.SYS_RENAMEAT2, uintptr(olddirfd), uintptr(unsafe.Pointer(op)),
		uintptr(newdirfd), uintptr(unsafe.Pointer(np)), uintptr(flags), 0); e != 0 {
		return e
	}
	return nil
}

// statxAt is statx(2) of one entry, without its name's heap copy: the entry itself, a symlink
// not followed (AT_SYMLINK_NOFOLLOW), and no automount triggered (AT_NO_AUTOMOUNT), as the
// O_PATH|O_NOFOLLOW open of lookupAt reaches it.
func statxAt(dirfd int, name string, st *unix.Statx_t) error {
	var b entryName
	p, err := b.of(name)
	if err != nil {
		return err
	}
	if _, _, e := unix.Syscall6(unix.SYS_STATX, uintptr(dirfd), uintptr(unsafe.Pointer(p)),
		unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT|unix.AT_STATX_SYNC_AS_STAT, statxMask,
		uintptr(unsafe.Pointer(st)), 0); e != 0 {
		return e
	}
	return nil
}
