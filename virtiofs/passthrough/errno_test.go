package passthrough

import (
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// errnoRig is a host directory and a share of the same layout served through the FUSE core:
//
//	f (a regular file with xattr user.k), d/ (empty), full/x, l -> f, p (a FIFO)
type errnoRig struct {
	host    string
	hostFD  int // O_PATH of host
	fileFD  int // host f, read-write
	fileFD2 int // another descriptor of host f
	dirFD   int // host directory, for lseek
	s       *server
	nodes   map[string]uint64
	fh      uint64 // f opened read-write through the server
	dirFh   uint64 // the root opened through the server
}

func newErrnoRig(t *testing.T) *errnoRig {
	t.Helper()
	r := &errnoRig{host: t.TempDir(), nodes: map[string]uint64{}}
	share := t.TempDir()
	for _, dir := range []string{r.host, share} {
		must(t, os.WriteFile(filepath.Join(dir, "f"), []byte("content"), 0o644))
		must(t, unix.Setxattr(filepath.Join(dir, "f"), "user.k", []byte("a value"), 0))
		must(t, os.Mkdir(filepath.Join(dir, "d"), 0o755))
		must(t, os.Mkdir(filepath.Join(dir, "full"), 0o755))
		must(t, os.WriteFile(filepath.Join(dir, "full", "x"), nil, 0o644))
		must(t, os.Symlink("f", filepath.Join(dir, "l")))
		must(t, unix.Mkfifo(filepath.Join(dir, "p"), 0o644))
	}
	var err error
	open := func(p string, flags int) int {
		fd, err := unix.Open(p, flags|unix.O_CLOEXEC, 0)
		must(t, err)
		t.Cleanup(func() { unix.Close(fd) })
		return fd
	}
	r.hostFD = open(r.host, unix.O_PATH|unix.O_DIRECTORY)
	r.fileFD = open(filepath.Join(r.host, "f"), unix.O_RDWR)
	r.fileFD2 = open(filepath.Join(r.host, "f"), unix.O_RDWR)
	r.dirFD = open(r.host, unix.O_RDONLY|unix.O_DIRECTORY)

	fs, err := New(share, Options{Xattr: true})
	must(t, err)
	t.Cleanup(func() { fs.Close() })
	r.s = &server{s: fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitPosixLocks})}
	in := fuse.InitIn{Major: fuse.KernelVersion, Minor: fuse.KernelMinorVersion, Flags: fuse.InitPosixLocks}
	if e, _ := r.s.call(fuse.OpInit, 0, fuse.AsBytes(&in), 4096); e != 0 {
		t.Fatalf("INIT: %v", e)
	}
	for _, name := range []string{"f", "d", "full", "l", "p"} {
		e, body := r.s.call(fuse.OpLookup, fuse.RootID, cname(name), 4096)
		if e != 0 {
			t.Fatalf("LOOKUP %s: %v", name, e)
		}
		var out fuse.EntryOut
		copy(fuse.AsBytes(&out), body)
		r.nodes[name] = out.NodeID
	}
	var oo fuse.OpenOut
	e, body := r.s.call(fuse.OpOpen, r.nodes["f"], fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR}), 4096)
	if e != 0 {
		t.Fatalf("OPEN f: %v", e)
	}
	copy(fuse.AsBytes(&oo), body)
	r.fh = oo.Fh
	if e, body = r.s.call(fuse.OpOpendir, fuse.RootID, fuse.AsBytes(&fuse.OpenIn{}), 4096); e != 0 {
		t.Fatalf("OPENDIR: %v", e)
	}
	copy(fuse.AsBytes(&oo), body)
	r.dirFh = oo.Fh
	return r
}

func cname(s string) []byte { return append([]byte(s), 0) }

func cat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

// errnoCase is one call made both ways: on the host directory with the syscall the server
// makes or stands in for, and through the server.
type errnoCase struct {
	name   string
	kernel func(r *errnoRig) error
	op     fuse.Opcode
	node   func(r *errnoRig) uint64
	args   func(r *errnoRig) []byte
	// deviation, when set, says why the server may answer differently from the host on
	// purpose; the server must then answer want.
	deviation string
	want      unix.Errno
}

var (
	long       = strings.Repeat("n", 256)
	longXattr  = "user." + strings.Repeat("x", 251)
	nameErrors = map[string]string{"256 bytes": long, "empty": "", ".": ".", "..": ".."}
)

func root(*errnoRig) uint64 { return fuse.RootID }

func node(name string) func(*errnoRig) uint64 {
	return func(r *errnoRig) uint64 { return r.nodes[name] }
}

func fixed(b []byte) func(*errnoRig) []byte { return func(*errnoRig) []byte { return b } }

// errnoCases are the errors the server (the FUSE core and the passthrough) answers itself,
// without passing on one of a syscall.
func errnoCases() []errnoCase {
	var cases []errnoCase
	add := func(c errnoCase) { cases = append(cases, c) }
	for what, n := range nameErrors {
		add(errnoCase{name: "MKDIR " + what, op: fuse.OpMkdir, node: root,
			kernel: func(r *errnoRig) error { return unix.Mkdirat(r.hostFD, n, 0o755) },
			args:   fixed(cat(fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), cname(n)))})
		add(errnoCase{name: "MKNOD " + what, op: fuse.OpMknod, node: root,
			kernel: func(r *errnoRig) error { return unix.Mknodat(r.hostFD, n, unix.S_IFREG|0o644, 0) },
			args:   fixed(cat(fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFREG | 0o644}), cname(n)))})
		add(errnoCase{name: "SYMLINK " + what, op: fuse.OpSymlink, node: root,
			kernel: func(r *errnoRig) error { return unix.Symlinkat("t", r.hostFD, n) },
			args:   fixed(cat(cname(n), cname("t")))})
		add(errnoCase{name: "LINK to " + what, op: fuse.OpLink, node: root,
			kernel: func(r *errnoRig) error { return unix.Linkat(r.hostFD, "f", r.hostFD, n, 0) },
			args:   func(r *errnoRig) []byte { return cat(fuse.AsBytes(&fuse.LinkIn{Oldnodeid: r.nodes["f"]}), cname(n)) }})
		add(errnoCase{name: "UNLINK " + what, op: fuse.OpUnlink, node: root,
			kernel: func(r *errnoRig) error { return unix.Unlinkat(r.hostFD, n, 0) },
			args:   fixed(cname(n))})
		add(errnoCase{name: "RMDIR " + what, op: fuse.OpRmdir, node: root,
			kernel: func(r *errnoRig) error { return unix.Unlinkat(r.hostFD, n, unix.AT_REMOVEDIR) },
			args:   fixed(cname(n))})
		for _, excl := range []uint32{0, unix.O_EXCL} {
			flags := unix.O_RDWR | excl
			add(errnoCase{name: "CREATE " + what + map[uint32]string{0: "", unix.O_EXCL: " O_EXCL"}[excl], op: fuse.OpCreate, node: root,
				kernel: func(r *errnoRig) error {
					fd, err := unix.Openat(r.hostFD, n, int(flags)|unix.O_CREAT|unix.O_NOFOLLOW, 0o644)
					if err == nil {
						unix.Close(fd)
					}
					return err
				},
				args: fixed(cat(fuse.AsBytes(&fuse.CreateIn{Flags: flags, Mode: unix.S_IFREG | 0o644}), cname(n)))})
		}
		for _, flags := range []uint32{0, unix.RENAME_NOREPLACE, unix.RENAME_EXCHANGE} {
			suffix := map[uint32]string{0: "", unix.RENAME_NOREPLACE: " NOREPLACE", unix.RENAME_EXCHANGE: " EXCHANGE"}[flags]
			add(errnoCase{name: "RENAME from " + what + suffix, op: fuse.OpRename2, node: root,
				kernel: func(r *errnoRig) error { return unix.Renameat2(r.hostFD, n, r.hostFD, "new", uint(flags)) },
				args:   fixed(cat(fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID, Flags: flags}), cname(n), cname("new")))})
			add(errnoCase{name: "RENAME to " + what + suffix, op: fuse.OpRename2, node: root,
				kernel: func(r *errnoRig) error { return unix.Renameat2(r.hostFD, "f", r.hostFD, n, uint(flags)) },
				args:   fixed(cat(fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID, Flags: flags}), cname("f"), cname(n)))})
		}
	}
	add(errnoCase{name: "LOOKUP 256 bytes", op: fuse.OpLookup, node: root, args: fixed(cname(long)),
		kernel: func(r *errnoRig) error { return openPath(r.hostFD, long) }})
	add(errnoCase{name: "LOOKUP empty", op: fuse.OpLookup, node: root, args: fixed(cname("")),
		kernel: func(r *errnoRig) error { return openPath(r.hostFD, "") }})
	for _, n := range []string{".", ".."} {
		add(errnoCase{name: "LOOKUP " + n, op: fuse.OpLookup, node: root, args: fixed(cname(n)),
			kernel:    func(r *errnoRig) error { return openPath(r.hostFD, n) },
			deviation: "the guest resolves . and .. itself; .. of the root is outside the share", want: unix.EINVAL})
	}
	for _, target := range []string{"", strings.Repeat("t", 4096), strings.Repeat("t", 4097)} {
		add(errnoCase{name: "SYMLINK target of " + strconv.Itoa(len(target)) + " bytes",
			op: fuse.OpSymlink, node: root, args: fixed(cat(cname("s"), cname(target))),
			kernel: func(r *errnoRig) error { return unix.Symlinkat(target, r.hostFD, "s") }})
	}
	add(errnoCase{name: "RENAME unknown flag", op: fuse.OpRename2, node: root,
		kernel: func(r *errnoRig) error { return unix.Renameat2(r.hostFD, "f", r.hostFD, "g", 1<<5) },
		args:   fixed(cat(fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID, Flags: 1 << 5}), cname("f"), cname("g")))})

	// Extended attributes.
	hostF := func(r *errnoRig) string { return filepath.Join(r.host, "f") }
	setxattr := func(name string, size int) []byte {
		in := fuse.SetxattrIn{Size: uint32(size)}
		return cat(fuse.AsBytes(&in)[:8], cname(name), make([]byte, size))
	}
	getxattr := func(size uint32, name ...string) []byte {
		in := fuse.GetxattrIn{Size: size}
		if len(name) == 0 {
			return fuse.AsBytes(&in)
		}
		return cat(fuse.AsBytes(&in), cname(name[0]))
	}
	for what, n := range map[string]string{"256 bytes": longXattr, "empty": ""} {
		add(errnoCase{name: "SETXATTR name " + what, op: fuse.OpSetxattr, node: node("f"), args: fixed(setxattr(n, 1)),
			kernel: func(r *errnoRig) error { return unix.Setxattr(hostF(r), n, []byte{0}, 0) }})
		add(errnoCase{name: "GETXATTR name " + what, op: fuse.OpGetxattr, node: node("f"), args: fixed(getxattr(64, n)),
			kernel: func(r *errnoRig) error { _, err := unix.Getxattr(hostF(r), n, make([]byte, 64)); return err }})
		add(errnoCase{name: "REMOVEXATTR name " + what, op: fuse.OpRemovexattr, node: node("f"), args: fixed(cname(n)),
			kernel: func(r *errnoRig) error { return unix.Removexattr(hostF(r), n) }})
	}
	add(errnoCase{name: "SETXATTR value of 65537 bytes", op: fuse.OpSetxattr, node: node("f"), args: fixed(setxattr("user.big", 1<<16+1)),
		kernel: func(r *errnoRig) error { return unix.Setxattr(hostF(r), "user.big", make([]byte, 1<<16+1), 0) }})
	add(errnoCase{name: "GETXATTR into too small a buffer", op: fuse.OpGetxattr, node: node("f"), args: fixed(getxattr(2, "user.k")),
		kernel: func(r *errnoRig) error { _, err := unix.Getxattr(hostF(r), "user.k", make([]byte, 2)); return err }})
	add(errnoCase{name: "LISTXATTR into too small a buffer", op: fuse.OpListxattr, node: node("f"), args: fixed(getxattr(2)),
		kernel: func(r *errnoRig) error { _, err := unix.Listxattr(hostF(r), make([]byte, 2)); return err }})

	// Attributes, links and opens.
	setattr := func(in fuse.SetattrIn) func(*errnoRig) []byte { return fixed(fuse.AsBytes(&in)) }
	add(errnoCase{name: "SETATTR size 2^63", op: fuse.OpSetattr, node: node("f"),
		args:   setattr(fuse.SetattrIn{Valid: fuse.FattrSize, Size: 1 << 63}),
		kernel: func(r *errnoRig) error { return unix.Ftruncate(r.fileFD, math.MinInt64) }})
	add(errnoCase{name: "SETATTR size of a directory", op: fuse.OpSetattr, node: node("d"),
		args:   setattr(fuse.SetattrIn{Valid: fuse.FattrSize}),
		kernel: func(r *errnoRig) error { return unix.Truncate(filepath.Join(r.host, "d"), 0) }})
	add(errnoCase{name: "SETATTR size of a FIFO", op: fuse.OpSetattr, node: node("p"),
		args:   setattr(fuse.SetattrIn{Valid: fuse.FattrSize}),
		kernel: func(r *errnoRig) error { return unix.Truncate(filepath.Join(r.host, "p"), 0) }})
	add(errnoCase{name: "SETATTR mode of a symlink", op: fuse.OpSetattr, node: node("l"),
		args:   setattr(fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o600}),
		kernel: func(r *errnoRig) error { return fchmodat2(r.hostFD, "l", 0o600, unix.AT_SYMLINK_NOFOLLOW) }})
	add(errnoCase{name: "READLINK of a file", op: fuse.OpReadlink, node: node("f"), args: fixed(nil),
		kernel: func(r *errnoRig) error { _, err := unix.Readlinkat(r.hostFD, "f", make([]byte, 64)); return err }})
	add(errnoCase{name: "LINK of a directory", op: fuse.OpLink, node: root,
		args:   func(r *errnoRig) []byte { return cat(fuse.AsBytes(&fuse.LinkIn{Oldnodeid: r.nodes["d"]}), cname("d2")) },
		kernel: func(r *errnoRig) error { return unix.Linkat(r.hostFD, "d", r.hostFD, "d2", 0) }})
	add(errnoCase{name: "OPEN of a directory for writing", op: fuse.OpOpen, node: node("d"),
		args:   fixed(fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})),
		kernel: func(r *errnoRig) error { return openClose(r.hostFD, "d", unix.O_RDWR) }})
	add(errnoCase{name: "OPEN of a directory for reading", op: fuse.OpOpen, node: node("d"),
		args:      fixed(fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDONLY})),
		kernel:    func(r *errnoRig) error { return openClose(r.hostFD, "d", unix.O_RDONLY) },
		deviation: "directories are opened with OPENDIR", want: unix.EISDIR})
	add(errnoCase{name: "OPEN of a symlink", op: fuse.OpOpen, node: node("l"),
		args:   fixed(fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDONLY})),
		kernel: func(r *errnoRig) error { return openClose(r.hostFD, "l", unix.O_RDONLY|unix.O_NOFOLLOW) }})
	add(errnoCase{name: "OPEN of a FIFO", op: fuse.OpOpen, node: node("p"),
		args:      fixed(fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDONLY | unix.O_NONBLOCK})),
		kernel:    func(r *errnoRig) error { return openClose(r.hostFD, "p", unix.O_RDONLY|unix.O_NONBLOCK) },
		deviation: "special files are served by the guest kernel and never opened on the host", want: unix.ENXIO})
	add(errnoCase{name: "OPENDIR of a file", op: fuse.OpOpendir, node: node("f"),
		args:   fixed(fuse.AsBytes(&fuse.OpenIn{})),
		kernel: func(r *errnoRig) error { return openClose(r.hostFD, "f", unix.O_RDONLY|unix.O_DIRECTORY) }})
	add(errnoCase{name: "TMPFILE in a file", op: fuse.OpTmpfile, node: node("f"),
		args:   fixed(fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o600})),
		kernel: func(r *errnoRig) error { return openClose(r.hostFD, "f", unix.O_TMPFILE|unix.O_RDWR) }})
	add(errnoCase{name: "ACCESS unknown mask bit", op: fuse.OpAccess, node: node("f"),
		args:   fixed(fuse.AsBytes(&fuse.AccessIn{Mask: 8})),
		kernel: func(r *errnoRig) error { return unix.Faccessat(r.hostFD, "f", 8, 0) }})
	add(errnoCase{name: "SYNCFS of a FIFO", op: fuse.OpSyncfs, node: node("p"), args: fixed(make([]byte, 8)),
		kernel: func(r *errnoRig) error {
			fd, err := unix.Openat(r.hostFD, "p", unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			return unix.Syncfs(fd)
		},
		deviation: "special files are never opened on the host (a guest syncs its mount's root)", want: unix.EINVAL})

	// Offsets and flags of open files.
	fh := func(in func(fh uint64) []byte) func(*errnoRig) []byte {
		return func(r *errnoRig) []byte { return in(r.fh) }
	}
	add(errnoCase{name: "READ at 2^63", op: fuse.OpRead, node: node("f"),
		args: fh(func(fh uint64) []byte { return fuse.AsBytes(&fuse.ReadIn{Fh: fh, Offset: 1 << 63, Size: 8}) }),
		kernel: func(r *errnoRig) error {
			_, err := unix.Pread(r.fileFD, make([]byte, 8), math.MinInt64)
			return err
		}})
	add(errnoCase{name: "WRITE at 2^63", op: fuse.OpWrite, node: node("f"),
		args: fh(func(fh uint64) []byte {
			return cat(fuse.AsBytes(&fuse.WriteIn{Fh: fh, Offset: 1 << 63, Size: 1}), []byte("w"))
		}),
		kernel: func(r *errnoRig) error {
			_, err := unix.Pwrite(r.fileFD, []byte("w"), math.MinInt64)
			return err
		}})
	add(errnoCase{name: "FALLOCATE at 2^63", op: fuse.OpFallocate, node: node("f"),
		args:   fh(func(fh uint64) []byte { return fuse.AsBytes(&fuse.FallocateIn{Fh: fh, Offset: 1 << 63, Length: 8}) }),
		kernel: func(r *errnoRig) error { return unix.Fallocate(r.fileFD, 0, math.MinInt64, 8) }})
	add(errnoCase{name: "FALLOCATE of 2^63 bytes", op: fuse.OpFallocate, node: node("f"),
		args:   fh(func(fh uint64) []byte { return fuse.AsBytes(&fuse.FallocateIn{Fh: fh, Length: 1 << 63}) }),
		kernel: func(r *errnoRig) error { return unix.Fallocate(r.fileFD, 0, 0, math.MinInt64) }})
	add(errnoCase{name: "LSEEK unknown whence", op: fuse.OpLseek, node: node("f"),
		args: fh(func(fh uint64) []byte { return fuse.AsBytes(&fuse.LseekIn{Fh: fh, Whence: 9}) }),
		kernel: func(r *errnoRig) error {
			_, err := unix.Seek(r.fileFD, 0, 9)
			return err
		}})
	copyIn := func(in fuse.CopyFileRangeIn) func(*errnoRig) []byte {
		return func(r *errnoRig) []byte {
			in.FhIn, in.FhOut, in.NodeIDOut = r.fh, r.fh, r.nodes["f"]
			return fuse.AsBytes(&in)
		}
	}
	add(errnoCase{name: "COPY_FILE_RANGE with flags", op: fuse.OpCopyFileRange, node: node("f"),
		args: copyIn(fuse.CopyFileRangeIn{Len: 4, OffOut: 100, Flags: 1}),
		kernel: func(r *errnoRig) error {
			in, out := int64(0), int64(100)
			_, err := unix.CopyFileRange(r.fileFD, &in, r.fileFD2, &out, 4, 1)
			return err
		}})
	add(errnoCase{name: "COPY_FILE_RANGE from 2^63", op: fuse.OpCopyFileRange, node: node("f"),
		args: copyIn(fuse.CopyFileRangeIn{Len: 4, OffIn: 1 << 63, OffOut: 100}),
		kernel: func(r *errnoRig) error {
			in, out := int64(math.MinInt64), int64(100)
			_, err := unix.CopyFileRange(r.fileFD, &in, r.fileFD2, &out, 4, 0)
			return err
		}})
	add(errnoCase{name: "READDIR at 2^63", op: fuse.OpReaddir, node: root,
		args: func(r *errnoRig) []byte { return fuse.AsBytes(&fuse.ReadIn{Fh: r.dirFh, Offset: 1 << 63, Size: 4096}) },
		kernel: func(r *errnoRig) error {
			_, err := unix.Seek(r.dirFD, math.MinInt64, unix.SEEK_SET)
			return err
		}})

	// POSIX locks (negotiated here): F_OFD_* on the host.
	lk := func(op fuse.Opcode, l fuse.FileLock) errnoCase {
		cmd := unix.F_OFD_SETLK
		if op == fuse.OpGetlk {
			cmd = unix.F_OFD_GETLK
		}
		return errnoCase{op: op, node: node("f"),
			args: func(r *errnoRig) []byte { return fuse.AsBytes(&fuse.LkIn{Fh: r.fh, Owner: 1, Lk: l}) },
			kernel: func(r *errnoRig) error {
				fl := unix.Flock_t{Type: int16(l.Type), Whence: unix.SEEK_SET, Start: int64(l.Start)}
				return unix.FcntlFlock(uintptr(r.fileFD), cmd, &fl)
			}}
	}
	c := lk(fuse.OpSetlk, fuse.FileLock{Type: 7, End: fuse.OffsetMax})
	c.name = "SETLK unknown type"
	add(c)
	c = lk(fuse.OpGetlk, fuse.FileLock{Type: unix.F_UNLCK, End: fuse.OffsetMax})
	c.name = "GETLK of F_UNLCK"
	c.deviation = "Linux 6.6's query of one's own OFD locks is not served (older kernels refuse it too)"
	c.want = unix.EINVAL
	add(c)
	c = lk(fuse.OpSetlk, fuse.FileLock{Type: unix.F_WRLCK, Start: 1 << 63, End: fuse.OffsetMax})
	c.name = "SETLK from 2^63"
	add(c)
	return cases
}

// openPath is the lookup the server makes: an O_PATH open of name, never following it.
func openPath(dirfd int, name string) error {
	return openClose(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW)
}

func openClose(dirfd int, name string, flags int) error {
	fd, err := unix.Openat(dirfd, name, flags|unix.O_CLOEXEC, 0)
	if err == nil {
		unix.Close(fd)
	}
	return err
}

// fchmodat2 is the syscall itself: unix.Fchmodat answers AT_SYMLINK_NOFOLLOW with
// EOPNOTSUPP without asking the kernel.
func fchmodat2(dirfd int, name string, mode uint32, flags int) error {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return err
	}
	_, _, e := unix.Syscall6(unix.SYS_FCHMODAT2, uintptr(dirfd), uintptr(unsafe.Pointer(p)), uintptr(mode), uintptr(flags), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// TestInventedErrnosMatchKernel makes each call the server answers by itself both ways, on a
// host directory and through the FUSE core, and wants the same errno: a guest must not see an
// error its kernel would not give for the same call on a local file system. A few answers differ
// on purpose; each says why.
func TestInventedErrnosMatchKernel(t *testing.T) {
	needRoot(t) // per-request credentials, as kvfsd runs
	r := newErrnoRig(t)
	for _, c := range errnoCases() {
		t.Run(c.name, func(t *testing.T) {
			kerr := c.kernel(r)
			var kernel unix.Errno
			if kerr != nil {
				var ok bool
				if kernel, ok = kerr.(unix.Errno); !ok {
					t.Fatalf("host call: %v", kerr)
				}
			}
			got, _ := r.s.call(c.op, c.node(r), c.args(r), 4096)
			switch {
			case c.deviation != "":
				if got != c.want {
					t.Errorf("server %v, want %v (host: %v; deviation: %s)", errName(got), errName(c.want), errName(kernel), c.deviation)
				}
			case kernel == 0:
				t.Fatalf("the host call succeeded: the case tests nothing (server: %v)", errName(got))
			case got != kernel:
				t.Errorf("server %v, host %v", errName(got), errName(kernel))
			}
		})
	}
}
