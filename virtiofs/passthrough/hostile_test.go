package passthrough

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// nameOps are the operations taking a name, each called with parent dir and the given name.
func nameOps(fs *FS, dir, file uint64) map[string]func(name string) fuse.Errno {
	var ent fuse.EntryOut
	var open fuse.OpenOut
	return map[string]func(string) fuse.Errno{
		"Lookup":  func(n string) fuse.Errno { return fs.Lookup(rootCtx, dir, n, &ent) },
		"Symlink": func(n string) fuse.Errno { return fs.Symlink(rootCtx, dir, n, "target", &ent) },
		"Mknod": func(n string) fuse.Errno {
			return fs.Mknod(rootCtx, dir, n, &fuse.MknodIn{Mode: unix.S_IFREG | 0o644}, &ent)
		},
		"Mkdir":   func(n string) fuse.Errno { return fs.Mkdir(rootCtx, dir, n, &fuse.MkdirIn{Mode: 0o755}, &ent) },
		"Unlink":  func(n string) fuse.Errno { return fs.Unlink(rootCtx, dir, n) },
		"Rmdir":   func(n string) fuse.Errno { return fs.Rmdir(rootCtx, dir, n) },
		"Rename1": func(n string) fuse.Errno { return fs.Rename(rootCtx, dir, n, dir, "new", 0) },
		"Rename2": func(n string) fuse.Errno { return fs.Rename(rootCtx, dir, "f", dir, n, 0) },
		"Exchange": func(n string) fuse.Errno {
			return fs.Rename(rootCtx, dir, "f", dir, n, unix.RENAME_EXCHANGE)
		},
		"Link": func(n string) fuse.Errno { return fs.Link(rootCtx, file, dir, n, &ent) },
		"Create": func(n string) fuse.Errno {
			return fs.Create(rootCtx, dir, n, &fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}, &ent, &open)
		},
	}
}

func TestBadNames(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.Mkdir(e.path("d"), 0o755))
	must(t, os.WriteFile(e.path("d", "f"), []byte("f"), 0o644))
	must(t, os.WriteFile(e.path("f"), []byte("f"), 0o644))
	before := snapshot(t, e.share)
	d := e.lookup(t, 1, "d").NodeID
	f := e.lookup(t, d, "f").NodeID
	// What the host answers for "." and ".." as the last component of each call (at the root
	// they would escape); Lookup refuses them.
	dots := map[string][2]fuse.Errno{
		"Lookup": {unix.EINVAL, unix.EINVAL}, "Symlink": {unix.EEXIST, unix.EEXIST},
		"Mknod": {unix.EEXIST, unix.EEXIST}, "Mkdir": {unix.EEXIST, unix.EEXIST},
		"Unlink": {unix.EISDIR, unix.EISDIR}, "Rmdir": {unix.EINVAL, unix.ENOTEMPTY},
		"Rename1": {unix.EBUSY, unix.EBUSY}, "Rename2": {unix.EBUSY, unix.EBUSY},
		"Exchange": {unix.EBUSY, unix.EBUSY}, "Link": {unix.EEXIST, unix.EEXIST},
		"Create": {unix.EISDIR, unix.EISDIR},
	}
	for _, parent := range []uint64{1, d} {
		for op, call := range nameOps(e.fs, parent, f) {
			wantErrno(t, op+"(.)", call("."), dots[op][0])
			wantErrno(t, op+"(..)", call(".."), dots[op][1])
			// What the server should have refused already.
			wantErrno(t, op+"(empty)", call(""), unix.ENOENT)
			wantErrno(t, op+"(256 bytes)", call(strings.Repeat("n", 256)), unix.ENAMETOOLONG)
			for _, name := range []string{"a/b", "../outside", "/", "x\x00y"} {
				wantErrno(t, op+"("+name+")", call(name), unix.EINVAL)
			}
		}
	}
	if after := snapshot(t, e.share); after != before {
		t.Errorf("share changed:\n%s\n%s", before, after)
	}
}

// allOps calls every FileSystem method that takes a node id with node and handle fh; file is a
// valid file node, for LINK.
func allOps(fs *FS, node, fh, file uint64) map[string]fuse.Errno {
	var ent fuse.EntryOut
	var open fuse.OpenOut
	var attr fuse.AttrOut
	var statfs fuse.StatfsOut
	var lseek fuse.LseekOut
	var wout fuse.WriteOut
	buf := make([]byte, 64)
	r := map[string]fuse.Errno{}
	r["Lookup"] = fs.Lookup(rootCtx, node, "f", &ent)
	r["GetAttr"] = fs.GetAttr(rootCtx, node, &fuse.GetattrIn{}, &attr)
	r["GetAttrFh"] = fs.GetAttr(rootCtx, node, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: fh}, &attr)
	r["SetAttr"] = fs.SetAttr(rootCtx, node, &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o777}, &attr)
	r["SetAttrFh"] = fs.SetAttr(rootCtx, node, &fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Fh: fh}, &attr)
	_, r["Readlink"] = fs.Readlink(rootCtx, node, nil)
	r["Symlink"] = fs.Symlink(rootCtx, node, "s", "t", &ent)
	r["Mknod"] = fs.Mknod(rootCtx, node, "m", &fuse.MknodIn{Mode: unix.S_IFIFO | 0o644}, &ent)
	r["Mkdir"] = fs.Mkdir(rootCtx, node, "m", &fuse.MkdirIn{Mode: 0o755}, &ent)
	r["Unlink"] = fs.Unlink(rootCtx, node, "f")
	r["Rmdir"] = fs.Rmdir(rootCtx, node, "d")
	r["RenameFrom"] = fs.Rename(rootCtx, node, "f", 1, "g", 0)
	r["RenameTo"] = fs.Rename(rootCtx, 1, "f", node, "g", 0)
	r["LinkNode"] = fs.Link(rootCtx, node, 1, "l", &ent)
	r["LinkParent"] = fs.Link(rootCtx, file, node, "l", &ent)
	r["Open"] = fs.Open(rootCtx, node, &fuse.OpenIn{Flags: unix.O_RDONLY}, &open)
	r["Create"] = fs.Create(rootCtx, node, "c", &fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}, &ent, &open)
	r["Tmpfile"] = fs.Tmpfile(rootCtx, node, &fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}, &ent, &open)
	_, r["Read"] = fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Size: 64}, [][]byte{buf})
	_, r["Write"] = fs.Write(rootCtx, node, &fuse.WriteIn{Fh: fh, Size: 1}, [][]byte{buf[:1]})
	r["Flush"] = fs.Flush(rootCtx, node, &fuse.FlushIn{Fh: fh})
	r["Fsync"] = fs.Fsync(rootCtx, node, &fuse.FsyncIn{Fh: fh})
	r["Fallocate"] = fs.Fallocate(rootCtx, node, &fuse.FallocateIn{Fh: fh, Length: 1})
	r["Lseek"] = fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Whence: unix.SEEK_DATA}, &lseek)
	r["CopyFileRangeIn"] = fs.CopyFileRange(rootCtx, node, &fuse.CopyFileRangeIn{FhIn: fh, NodeIDOut: node, FhOut: fh, Len: 1}, &wout)
	r["OpenDir"] = fs.OpenDir(rootCtx, node, &fuse.OpenIn{}, &open)
	r["FsyncDir"] = fs.FsyncDir(rootCtx, node, &fuse.FsyncIn{Fh: fh})
	r["StatFs"] = fs.StatFs(rootCtx, node, &statfs)
	r["SyncFs"] = fs.SyncFs(rootCtx, node)
	r["SetXattr"] = fs.SetXattr(rootCtx, node, "user.a", []byte("1"), 0)
	_, r["GetXattr"] = fs.GetXattr(rootCtx, node, "user.a", buf)
	_, r["ListXattr"] = fs.ListXattr(rootCtx, node, buf)
	r["RemoveXattr"] = fs.RemoveXattr(rootCtx, node, "user.a")
	r["Release"] = fs.Release(rootCtx, node, &fuse.ReleaseIn{Fh: fh})
	r["ReleaseDir"] = fs.ReleaseDir(rootCtx, node, &fuse.ReleaseIn{Fh: fh})
	fs.Forget(node, 1)
	fs.Forget(node, 1<<64-1)
	return r
}

func TestUnknownNodeIDs(t *testing.T) {
	e := newEnv(t, Options{Xattr: true})
	must(t, os.WriteFile(e.path("f"), []byte("f"), 0o644))
	forgotten := e.lookup(t, 1, "f").NodeID
	e.fs.Forget(forgotten, 1)
	must(t, os.WriteFile(e.path("g"), []byte("g"), 0o644))
	g := e.lookup(t, 1, "g").NodeID
	before := snapshot(t, e.share)
	for _, id := range []uint64{0, 2, 3, 15, 16, 17, 32, forgotten, forgotten + 16<<20, 1 << 32, 1 << 63, 1<<64 - 1} {
		if id == g {
			continue // a small id may well be g's
		}
		for op, errno := range allOps(e.fs, id, 1, g) {
			if errno != unix.EBADF {
				t.Errorf("%s on node %d: %v, want EBADF", op, id, errName(errno))
			}
		}
	}
	if after := snapshot(t, e.share); after != before {
		t.Errorf("share changed:\n%s\n%s", before, after)
	}
	if s := e.fs.Stats(); s.CachedInodes != 2 || s.OpenFiles != 0 || s.Fds != 3 {
		t.Errorf("stats %+v", s)
	}
}

func TestBadHandles(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("f"), []byte("content"), 0o644))
	must(t, os.WriteFile(e.path("g"), []byte("other"), 0o644))
	must(t, os.Mkdir(e.path("d"), 0o755))
	f := e.lookup(t, 1, "f").NodeID
	g := e.lookup(t, 1, "g").NodeID
	d := e.lookup(t, 1, "d").NodeID
	ffh := e.open(t, f, unix.O_RDWR)
	gfh := e.open(t, g, unix.O_RDWR)
	dfh := e.openDir(t, d)

	var lseek fuse.LseekOut
	var wout fuse.WriteOut
	var attr fuse.AttrOut
	buf := make([]byte, 16)
	type call struct {
		name string
		do   func(node, fh uint64) fuse.Errno
	}
	fileCalls := []call{
		{"Read", func(n, h uint64) fuse.Errno {
			_, e := e.fs.Read(rootCtx, n, &fuse.ReadIn{Fh: h, Size: 16}, [][]byte{buf})
			return e
		}},
		{"Write", func(n, h uint64) fuse.Errno {
			_, e := e.fs.Write(rootCtx, n, &fuse.WriteIn{Fh: h, Size: 1}, [][]byte{buf[:1]})
			return e
		}},
		{"Flush", func(n, h uint64) fuse.Errno { return e.fs.Flush(rootCtx, n, &fuse.FlushIn{Fh: h}) }},
		{"Fsync", func(n, h uint64) fuse.Errno { return e.fs.Fsync(rootCtx, n, &fuse.FsyncIn{Fh: h}) }},
		{"Fallocate", func(n, h uint64) fuse.Errno {
			return e.fs.Fallocate(rootCtx, n, &fuse.FallocateIn{Fh: h, Length: 1})
		}},
		{"Lseek", func(n, h uint64) fuse.Errno {
			return e.fs.Lseek(rootCtx, n, &fuse.LseekIn{Fh: h, Whence: unix.SEEK_SET}, &lseek)
		}},
		{"CopyFileRange", func(n, h uint64) fuse.Errno {
			return e.fs.CopyFileRange(rootCtx, n, &fuse.CopyFileRangeIn{FhIn: h, NodeIDOut: g, FhOut: gfh, Len: 1}, &wout)
		}},
		{"SetAttrFh", func(n, h uint64) fuse.Errno {
			return e.fs.SetAttr(rootCtx, n, &fuse.SetattrIn{Valid: fuse.FattrFh | fuse.FattrSize, Fh: h, Size: 7}, &attr)
		}},
		{"Release", func(n, h uint64) fuse.Errno { return e.fs.Release(rootCtx, n, &fuse.ReleaseIn{Fh: h}) }},
	}
	dirCalls := []call{
		{"FsyncDir", func(n, h uint64) fuse.Errno { return e.fs.FsyncDir(rootCtx, n, &fuse.FsyncIn{Fh: h}) }},
		{"ReleaseDir", func(n, h uint64) fuse.Errno { return e.fs.ReleaseDir(rootCtx, n, &fuse.ReleaseIn{Fh: h}) }},
	}
	for _, c := range fileCalls {
		wantErrno(t, c.name+" unknown handle", c.do(f, 12345), unix.EBADF)
		wantErrno(t, c.name+" handle 0", c.do(f, 0), unix.EBADF)
		wantErrno(t, c.name+" other node's handle", c.do(f, gfh), unix.EBADF)
		wantErrno(t, c.name+" directory handle", c.do(d, dfh), unix.EBADF)
	}
	for _, c := range dirCalls {
		wantErrno(t, c.name+" unknown handle", c.do(d, 12345), unix.EBADF)
		wantErrno(t, c.name+" other node's handle", c.do(1, dfh), unix.EBADF)
		wantErrno(t, c.name+" file handle", c.do(f, ffh), unix.EBADF)
	}
	wantErrno(t, "CopyFileRange out handle of another node", e.fs.CopyFileRange(rootCtx, f,
		&fuse.CopyFileRangeIn{FhIn: ffh, NodeIDOut: f, FhOut: gfh, Len: 1}, &wout), unix.EBADF)
	// The handles survived all that and still work for their own node.
	n, errno := e.fs.Read(rootCtx, f, &fuse.ReadIn{Fh: ffh, Size: 16}, [][]byte{buf})
	if errno != 0 || string(buf[:n]) != "content" {
		t.Errorf("Read after the attacks: %q %v", buf[:n], errno)
	}
	if s := e.fs.Stats(); s.OpenFiles != 3 {
		t.Errorf("open files %d", s.OpenFiles)
	}
	if data, _ := os.ReadFile(e.path("g")); string(data) != "other" {
		t.Errorf("g changed: %q", data)
	}
}

// TestSymlinkEscapes: links out of the share are looked up as links and never followed.
func TestSymlinkEscapes(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{Xattr: true})
	targets := map[string]string{
		"etc":      "/etc",
		"up":       "../..",
		"out":      e.outside,
		"outrel":   "../outside",
		"secret":   filepath.Join(e.outside, "secret"),
		"secretup": "../outside/secret",
	}
	for name, target := range targets {
		must(t, os.Symlink(target, e.path(name)))
	}
	etcBefore := lstat(t, "/etc")
	must(t, os.WriteFile(e.path("file"), []byte("f"), 0o644))
	file := e.lookup(t, 1, "file").NodeID

	for name, target := range targets {
		t.Run(name, func(t *testing.T) {
			ent := e.lookup(t, 1, name)
			l := ent.NodeID
			st := lstat(t, e.path(name))
			if ent.Attr.Mode != st.Mode || ent.Attr.Mode&unix.S_IFMT != unix.S_IFLNK || ent.Attr.Ino != st.Ino ||
				ent.Attr.Size != uint64(len(target)) {
				t.Errorf("lookup gave %+v, want the link itself", ent.Attr)
			}
			if got, errno := e.fs.Readlink(rootCtx, l, nil); errno != 0 || string(got) != target {
				t.Errorf("Readlink %q %v", got, errno)
			}
			var out fuse.OpenOut
			for _, flags := range []uint32{unix.O_RDONLY, unix.O_RDWR | unix.O_TRUNC, unix.O_WRONLY | unix.O_APPEND} {
				wantErrno(t, "Open", e.fs.Open(rootCtx, l, &fuse.OpenIn{Flags: flags}, &out), unix.ELOOP)
			}
			wantErrno(t, "OpenDir", e.fs.OpenDir(rootCtx, l, &fuse.OpenIn{}, &out), unix.ENOTDIR)
			var attr fuse.AttrOut
			wantErrno(t, "GetAttr", e.fs.GetAttr(rootCtx, l, &fuse.GetattrIn{}, &attr), 0)
			if attr.Attr.Mode&unix.S_IFMT != unix.S_IFLNK {
				t.Errorf("GetAttr mode %o", attr.Attr.Mode)
			}
			wantErrno(t, "chmod", e.fs.SetAttr(rootCtx, l, &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o777}, &attr), unix.EOPNOTSUPP)
			wantErrno(t, "truncate", e.fs.SetAttr(rootCtx, l, &fuse.SetattrIn{Valid: fuse.FattrSize}, &attr), unix.EINVAL)
			wantErrno(t, "chown", e.fs.SetAttr(rootCtx, l, &fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID, UID: 4242, GID: 4242}, &attr), 0)
			wantErrno(t, "utimes", e.fs.SetAttr(rootCtx, l, &fuse.SetattrIn{Valid: fuse.FattrMtime | fuse.FattrAtime, Mtime: 12345, Atime: 12345}, &attr), 0)
			if st := lstat(t, e.path(name)); st.Uid != 4242 || st.Mtim.Sec != 12345 || attr.Attr.Mtime != 12345 {
				t.Errorf("link owner %d mtime %d", st.Uid, st.Mtim.Sec)
			}
			// Nothing can be made or found "inside" the link.
			var ent2 fuse.EntryOut
			var open fuse.OpenOut
			for op, call := range nameOps(e.fs, l, file) {
				wantErrno(t, op+" inside", call("x"), unix.ENOTDIR)
			}
			wantErrno(t, "Lookup secret inside", e.fs.Lookup(rootCtx, l, "secret", &ent2), unix.ENOTDIR)
			wantErrno(t, "Unlink secret inside", e.fs.Unlink(rootCtx, l, "secret"), unix.ENOTDIR)
			wantErrno(t, "Tmpfile inside", e.fs.Tmpfile(rootCtx, l, &fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}, &ent2, &open), unix.ENOTDIR)
			wantErrno(t, "Rename into", e.fs.Rename(rootCtx, 1, "file", l, "file", 0), unix.ENOTDIR)
			// xattrs are the link's own.
			buf := make([]byte, 256)
			n, errno := e.fs.ListXattr(rootCtx, l, buf)
			if errno != 0 || n != 0 {
				t.Errorf("ListXattr %q %v", buf[:n], errno)
			}
			wantErrno(t, "SetXattr user.*", e.fs.SetXattr(rootCtx, l, "user.x", []byte("1"), 0), unix.EPERM)
			wantErrno(t, "SyncFs", e.fs.SyncFs(rootCtx, l), unix.EINVAL)
			// A hard link to the link is another link, not the target.
			wantErrno(t, "Link", e.fs.Link(rootCtx, l, 1, name+".hard", &ent2), 0)
			if st := lstat(t, e.path(name+".hard")); st.Mode&unix.S_IFMT != unix.S_IFLNK || ent2.NodeID != l {
				t.Errorf("hard link to symlink: mode %o node %d", st.Mode, ent2.NodeID)
			}
			wantErrno(t, "Rename the link", e.fs.Rename(rootCtx, 1, name+".hard", 1, name+".moved", 0), 0)
			wantErrno(t, "Unlink the link", e.fs.Unlink(rootCtx, 1, name+".moved"), 0)
		})
	}
	if st := lstat(t, "/etc"); st.Mtim != etcBefore.Mtim || st.Ctim != etcBefore.Ctim || st.Uid != etcBefore.Uid {
		t.Errorf("/etc changed")
	}
	if _, err := os.Lstat("/etc/x"); err == nil {
		t.Errorf("/etc/x exists")
	}
}

// TestSpecialFiles: FIFOs, sockets and device nodes in the share are never opened on the host.
func TestSpecialFiles(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{Xattr: true})
	must(t, unix.Mkfifo(e.path("fifo"), 0o666))
	ln, err := net.Listen("unix", e.path("sock"))
	must(t, err)
	defer ln.Close()
	must(t, unix.Mknod(e.path("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, unix.Mknod(e.path("zero"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 5))))
	must(t, unix.Mknod(e.path("loop0"), unix.S_IFBLK|0o666, int(unix.Mkdev(7, 0))))

	for _, name := range []string{"fifo", "sock", "null", "zero", "loop0"} {
		t.Run(name, func(t *testing.T) {
			withTimeout(t, name, func() {
				ent := e.lookup(t, 1, name)
				n := ent.NodeID
				st := lstat(t, e.path(name))
				if ent.Attr.Mode != st.Mode || ent.Attr.Rdev != uint32(st.Rdev) {
					t.Errorf("attr mode %o rdev %#x, want %o %#x", ent.Attr.Mode, ent.Attr.Rdev, st.Mode, st.Rdev)
				}
				var out fuse.OpenOut
				for _, flags := range []uint32{unix.O_RDONLY, unix.O_WRONLY, unix.O_RDWR, unix.O_RDONLY | unix.O_NONBLOCK, unix.O_WRONLY | unix.O_TRUNC} {
					wantErrno(t, "Open", e.fs.Open(rootCtx, n, &fuse.OpenIn{Flags: flags}, &out), unix.ENXIO)
				}
				wantErrno(t, "OpenDir", e.fs.OpenDir(rootCtx, n, &fuse.OpenIn{}, &out), unix.ENOTDIR)
				var ent2 fuse.EntryOut
				wantErrno(t, "Create without O_EXCL over it", e.fs.Create(rootCtx, 1, name,
					&fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT, Mode: unix.S_IFREG | 0o644}, &ent2, &out), unix.ENXIO)
				wantErrno(t, "Create with O_EXCL over it", e.fs.Create(rootCtx, 1, name,
					&fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT | unix.O_EXCL, Mode: unix.S_IFREG | 0o644}, &ent2, &out), unix.EEXIST)
				var attr fuse.AttrOut
				wantErrno(t, "truncate", e.fs.SetAttr(rootCtx, n, &fuse.SetattrIn{Valid: fuse.FattrSize}, &attr), unix.EINVAL)
				wantErrno(t, "chmod", e.fs.SetAttr(rootCtx, n, &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o600}, &attr), 0)
				wantErrno(t, "utimes", e.fs.SetAttr(rootCtx, n, &fuse.SetattrIn{Valid: fuse.FattrMtime, Mtime: 99}, &attr), 0)
				if st := lstat(t, e.path(name)); st.Mode&0o777 != 0o600 || st.Mtim.Sec != 99 {
					t.Errorf("after setattr: %o %d", st.Mode, st.Mtim.Sec)
				}
				_, errno := e.fs.ListXattr(rootCtx, n, make([]byte, 64))
				wantErrno(t, "ListXattr", errno, 0)
				_, errno = e.fs.Readlink(rootCtx, n, nil)
				wantErrno(t, "Readlink", errno, unix.EINVAL)
				wantErrno(t, "SyncFs", e.fs.SyncFs(rootCtx, n), unix.EINVAL)
			})
		})
	}
	if s := e.fs.Stats(); s.OpenFiles != 0 {
		t.Errorf("open files %d", s.OpenFiles)
	}
	// A whiteout made by RENAME_WHITEOUT is a 0:0 character device: inert too.
	must(t, os.WriteFile(e.path("w"), nil, 0o644))
	wantErrno(t, "RENAME_WHITEOUT", e.fs.Rename(rootCtx, 1, "w", 1, "w2", unix.RENAME_WHITEOUT), 0)
	w := e.lookup(t, 1, "w")
	if w.Attr.Mode&unix.S_IFMT != unix.S_IFCHR || w.Attr.Rdev != 0 {
		t.Errorf("whiteout attr %+v", w.Attr)
	}
	var out fuse.OpenOut
	wantErrno(t, "Open whiteout", e.fs.Open(rootCtx, w.NodeID, &fuse.OpenIn{Flags: unix.O_RDWR}, &out), unix.ENXIO)
}

func TestParentIsNotADirectory(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("f"), []byte("f"), 0o644))
	must(t, os.WriteFile(e.path("g"), []byte("g"), 0o644))
	f := e.lookup(t, 1, "f").NodeID
	for op, call := range nameOps(e.fs, f, f) {
		wantErrno(t, op+" in a file", call("g"), unix.ENOTDIR)
	}
	wantErrno(t, "Rename to a file parent", e.fs.Rename(rootCtx, 1, "g", f, "g", 0), unix.ENOTDIR)
	var ent fuse.EntryOut
	wantErrno(t, "Link into a file", e.fs.Link(rootCtx, f, f, "g", &ent), unix.ENOTDIR)
	var out fuse.OpenOut
	wantErrno(t, "Tmpfile in a file", e.fs.Tmpfile(rootCtx, f, &fuse.CreateIn{Flags: unix.O_RDWR}, &ent, &out), unix.ENOTDIR)
	wantErrno(t, "Open of a directory", e.fs.Open(rootCtx, 1, &fuse.OpenIn{}, &out), unix.EISDIR)
}

func TestLinkDirectory(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.Mkdir(e.path("d"), 0o755))
	d := e.lookup(t, 1, "d").NodeID
	var ent fuse.EntryOut
	wantErrno(t, "Link a directory", e.fs.Link(rootCtx, d, 1, "d2", &ent), unix.EPERM)
	wantErrno(t, "Link the root", e.fs.Link(rootCtx, 1, d, "root", &ent), unix.EPERM)
	if _, err := os.Lstat(e.path("d2")); err == nil {
		t.Errorf("d2 exists")
	}
}
