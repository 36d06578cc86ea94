package passthrough

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// TestReadOnly: with Options.ReadOnly every request that would change the share answers
// EROFS and changes nothing, an open for writing or truncation and an access check for
// writing too; lookups, reads, listings and read-only opens work.
func TestReadOnly(t *testing.T) {
	e := newEnv(t, Options{ReadOnly: true, Xattr: true})
	must(t, os.WriteFile(e.path("f"), []byte("content"), 0o644))
	must(t, os.Mkdir(e.path("d"), 0o755))
	must(t, os.Symlink("f", e.path("l")))
	before := snapshot(t, e.share)

	f := e.lookup(t, fuse.RootID, "f").NodeID
	d := e.lookup(t, fuse.RootID, "d").NodeID
	fh := e.open(t, f, unix.O_RDONLY)
	buf := make([]byte, 16)
	if n, errno := e.fs.Read(rootCtx, f, &fuse.ReadIn{Fh: fh, Size: 16}, [][]byte{buf}); errno != 0 || string(buf[:n]) != "content" {
		t.Errorf("Read: %q, %v", buf[:n], errno)
	}
	if errno := e.fs.Access(rootCtx, f, unix.R_OK); errno != 0 {
		t.Errorf("Access(R_OK): %v", errno)
	}
	e.openDir(t, d)

	var entry fuse.EntryOut
	var open fuse.OpenOut
	var attr fuse.AttrOut
	for what, do := range map[string]func() fuse.Errno{
		"open for writing": func() fuse.Errno { return e.fs.Open(rootCtx, f, &fuse.OpenIn{Flags: unix.O_WRONLY}, &open) },
		"open read-write":  func() fuse.Errno { return e.fs.Open(rootCtx, f, &fuse.OpenIn{Flags: unix.O_RDWR}, &open) },
		"open to truncate": func() fuse.Errno {
			return e.fs.Open(rootCtx, f, &fuse.OpenIn{Flags: unix.O_RDONLY | unix.O_TRUNC}, &open)
		},
		"access for writing": func() fuse.Errno { return e.fs.Access(rootCtx, f, unix.W_OK) },
		"create": func() fuse.Errno {
			return e.fs.Create(rootCtx, fuse.RootID, "new", &fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT, Mode: unix.S_IFREG | 0o644}, &entry, &open)
		},
		"tmpfile": func() fuse.Errno {
			return e.fs.Tmpfile(rootCtx, fuse.RootID, &fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}, &entry, &open)
		},
		"mkdir": func() fuse.Errno { return e.fs.Mkdir(rootCtx, fuse.RootID, "nd", &fuse.MkdirIn{Mode: 0o755}, &entry) },
		"mknod": func() fuse.Errno {
			return e.fs.Mknod(rootCtx, fuse.RootID, "fifo", &fuse.MknodIn{Mode: unix.S_IFIFO | 0o644}, &entry)
		},
		"symlink": func() fuse.Errno { return e.fs.Symlink(rootCtx, fuse.RootID, "nl", "f", &entry) },
		"link":    func() fuse.Errno { return e.fs.Link(rootCtx, f, fuse.RootID, "hard", &entry) },
		"unlink":  func() fuse.Errno { return e.fs.Unlink(rootCtx, fuse.RootID, "f") },
		"rmdir":   func() fuse.Errno { return e.fs.Rmdir(rootCtx, fuse.RootID, "d") },
		"rename":  func() fuse.Errno { return e.fs.Rename(rootCtx, fuse.RootID, "f", fuse.RootID, "g", 0) },
		"chmod": func() fuse.Errno {
			return e.fs.SetAttr(rootCtx, f, &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o600}, &attr)
		},
		"truncate": func() fuse.Errno {
			return e.fs.SetAttr(rootCtx, f, &fuse.SetattrIn{Valid: fuse.FattrSize}, &attr)
		},
		"write": func() fuse.Errno {
			_, errno := e.fs.Write(rootCtx, f, &fuse.WriteIn{Fh: fh, Size: 1}, [][]byte{{'x'}})
			return errno
		},
		"fallocate":   func() fuse.Errno { return e.fs.Fallocate(rootCtx, f, &fuse.FallocateIn{Fh: fh, Length: 4096}) },
		"setxattr":    func() fuse.Errno { return e.fs.SetXattr(rootCtx, f, "user.kvfs", []byte("x"), 0) },
		"removexattr": func() fuse.Errno { return e.fs.RemoveXattr(rootCtx, f, "user.kvfs") },
		"copy_file_range": func() fuse.Errno {
			return e.fs.CopyFileRange(rootCtx, f, &fuse.CopyFileRangeIn{FhIn: fh, NodeIDOut: f, FhOut: fh, Len: 1}, &fuse.WriteOut{})
		},
	} {
		if errno := do(); errno != unix.EROFS {
			t.Errorf("%s: %v, want EROFS", what, errno)
		}
	}
	if after := snapshot(t, e.share); after != before {
		t.Errorf("the read-only share changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestNoatime: the guest's O_NOATIME reaches the host's open only with PreserveNoatime, as
// with virtiofsd's --preserve-noatime.
func TestNoatime(t *testing.T) {
	for _, preserve := range []bool{false, true} {
		e := newEnv(t, Options{PreserveNoatime: preserve})
		must(t, os.WriteFile(e.path("f"), []byte("x"), 0o644))
		f := e.lookup(t, fuse.RootID, "f").NodeID
		fh := e.open(t, f, unix.O_RDONLY|unix.O_NOATIME)
		h, errno := e.fs.handle(fh, f, false)
		if errno != 0 {
			t.Fatal(errno)
		}
		flags, err := unix.FcntlInt(uintptr(h.fd), unix.F_GETFL, 0)
		e.fs.handles.put(h)
		if err != nil {
			t.Fatal(err)
		}
		if got := flags&unix.O_NOATIME != 0; got != preserve {
			t.Errorf("PreserveNoatime %v: the host's open has O_NOATIME %v", preserve, got)
		}
	}
}
