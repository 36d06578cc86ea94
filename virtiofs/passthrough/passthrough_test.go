package passthrough

import (
	"bytes"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

func TestLookupCountsAndForget(t *testing.T) {
	e := newEnv(t, Options{EntryTimeout: 1500 * time.Millisecond, AttrTimeout: 2 * time.Second})
	must(t, os.WriteFile(e.path("f"), []byte("data"), 0o644))

	a := e.lookup(t, 1, "f")
	b := e.lookup(t, 1, "f")
	if a.NodeID != b.NodeID || a.NodeID == 0 || a.NodeID == 1 {
		t.Fatalf("node ids %d, %d: want one id other than 0 and 1", a.NodeID, b.NodeID)
	}
	st := lstat(t, e.path("f"))
	if a.Attr.Ino != st.Ino || a.Attr.Size != 4 || a.Attr.Mode != unix.S_IFREG|0o644 {
		t.Errorf("attr %+v, want ino %d size 4 mode 0100644", a.Attr, st.Ino)
	}
	if a.EntryValid != 1 || a.EntryValidNsec != 500_000_000 || a.AttrValid != 2 || a.AttrValidNsec != 0 {
		t.Errorf("timeouts %d.%d / %d.%d", a.EntryValid, a.EntryValidNsec, a.AttrValid, a.AttrValidNsec)
	}
	if got := e.fs.nodes.refs(a.NodeID); got != 2 {
		t.Fatalf("refs %d, want 2", got)
	}
	if s := e.fs.Stats(); s.CachedInodes != 2 || s.Fds != 3 {
		t.Errorf("stats %+v, want 2 inodes (root and f), 3 fds", s)
	}
	e.fs.Forget(a.NodeID, 1)
	e.getattr(t, a.NodeID) // still there
	e.fs.Forget(a.NodeID, 1)
	var out fuse.AttrOut
	wantErrno(t, "GetAttr after forget", e.fs.GetAttr(rootCtx, a.NodeID, &fuse.GetattrIn{}, &out), unix.EBADF)
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.Fds != 2 {
		t.Errorf("stats %+v, want only the root", s)
	}

	// A new lookup gets a new id: ids are never reused.
	c := e.lookup(t, 1, "f")
	if c.NodeID == a.NodeID {
		t.Errorf("node id %d reused", c.NodeID)
	}
	// Over-forget: the count stops at zero, once.
	e.fs.Forget(c.NodeID, 1<<62)
	e.fs.Forget(c.NodeID, 1)
	if got := e.fs.nodes.refs(c.NodeID); got != 0 {
		t.Errorf("refs after over-forget %d", got)
	}
	// Unknown ids and the root: ignored.
	for _, id := range []uint64{0, 1, 2, 3, 15, 16, 17, 1 << 40, 1<<64 - 1} {
		e.fs.Forget(id, 1)
		e.fs.Forget(id, 1<<64-1)
	}
	e.getattr(t, 1)
	e.lookup(t, 1, "f")
	if s := e.fs.Stats(); s.CachedInodes != 2 {
		t.Errorf("stats %+v", s)
	}
}

func TestHardLinksShareNode(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("a"), nil, 0o644))
	must(t, os.Link(e.path("a"), e.path("b")))
	a := e.lookup(t, 1, "a")
	b := e.lookup(t, 1, "b")
	if a.NodeID != b.NodeID {
		t.Fatalf("hard links got nodes %d and %d", a.NodeID, b.NodeID)
	}
	if got := e.fs.nodes.refs(a.NodeID); got != 2 {
		t.Errorf("refs %d, want 2", got)
	}
	// LINK of our own makes a third name of the same node.
	var l fuse.EntryOut
	if errno := e.fs.Link(rootCtx, a.NodeID, 1, "c", &l); errno != 0 {
		t.Fatalf("Link: %v", errno)
	}
	if l.NodeID != a.NodeID || l.Attr.Nlink != 3 {
		t.Errorf("Link answered node %d nlink %d, want %d, 3", l.NodeID, l.Attr.Nlink, a.NodeID)
	}
	if got := e.fs.nodes.refs(a.NodeID); got != 3 {
		t.Errorf("refs %d, want 3", got)
	}
}

func TestGetAttr(t *testing.T) {
	e := newEnv(t, Options{AttrTimeout: time.Hour})
	must(t, os.WriteFile(e.path("f"), []byte("12345"), 0o640))
	must(t, os.Mkdir(e.path("d"), 0o750))
	f := e.lookup(t, 1, "f")
	d := e.lookup(t, 1, "d")
	var out fuse.AttrOut
	if errno := e.fs.GetAttr(rootCtx, f.NodeID, &fuse.GetattrIn{}, &out); errno != 0 {
		t.Fatal(errno)
	}
	st := lstat(t, e.path("f"))
	a := out.Attr
	if a.Ino != st.Ino || a.Size != 5 || a.Mode != st.Mode || a.Nlink != 1 || a.UID != st.Uid ||
		a.Blksize != uint32(st.Blksize) || a.Mtime != uint64(st.Mtim.Sec) || a.Mtimensec != uint32(st.Mtim.Nsec) {
		t.Errorf("attr %+v, stat %+v", a, st)
	}
	if out.AttrValid != 3600 {
		t.Errorf("attr valid %d", out.AttrValid)
	}
	root := e.getattr(t, 1)
	if root.Ino != lstat(t, e.share).Ino || root.Mode&unix.S_IFMT != unix.S_IFDIR {
		t.Errorf("root attr %+v", root)
	}
	// With a handle: it must be one of the node's.
	fh := e.open(t, f.NodeID, unix.O_RDONLY)
	dh := e.openDir(t, d.NodeID)
	wantErrno(t, "getattr with fh", e.fs.GetAttr(rootCtx, f.NodeID, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: fh}, &out), 0)
	wantErrno(t, "getattr with dir fh", e.fs.GetAttr(rootCtx, d.NodeID, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: dh}, &out), 0)
	wantErrno(t, "getattr with other node's fh", e.fs.GetAttr(rootCtx, d.NodeID, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: fh}, &out), unix.EBADF)
	wantErrno(t, "getattr with unknown fh", e.fs.GetAttr(rootCtx, f.NodeID, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: 999}, &out), unix.EBADF)
}

func TestSetAttr(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("f"), []byte("0123456789"), 0o644))
	f := e.lookup(t, 1, "f")
	fh := e.open(t, f.NodeID, unix.O_RDWR)
	rofh := e.open(t, f.NodeID, unix.O_RDONLY)

	tests := []struct {
		name  string
		in    fuse.SetattrIn
		errno fuse.Errno
		check func(t *testing.T, st unix.Stat_t, a fuse.Attr)
	}{
		{"mode", fuse.SetattrIn{Valid: fuse.FattrMode, Mode: unix.S_IFREG | 0o4751}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Mode != unix.S_IFREG|0o4751 || a.Mode != st.Mode {
					t.Errorf("mode %o, attr %o", st.Mode, a.Mode)
				}
			}},
		{"uid", fuse.SetattrIn{Valid: fuse.FattrUID, UID: 1234}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Uid != 1234 || st.Gid != 0 || a.UID != 1234 {
					t.Errorf("owner %d:%d", st.Uid, st.Gid)
				}
			}},
		{"gid", fuse.SetattrIn{Valid: fuse.FattrGID, GID: 4321}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Uid != 1234 || st.Gid != 4321 || a.GID != 4321 {
					t.Errorf("owner %d:%d", st.Uid, st.Gid)
				}
			}},
		{"size by path", fuse.SetattrIn{Valid: fuse.FattrSize, Size: 3}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Size != 3 || a.Size != 3 {
					t.Errorf("size %d", st.Size)
				}
			}},
		{"size by handle", fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Size: 100, Fh: fh}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Size != 100 {
					t.Errorf("size %d", st.Size)
				}
			}},
		{"size by read-only handle", fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Size: 1, Fh: rofh}, unix.EINVAL, nil},
		{"size by unknown handle", fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Size: 1, Fh: 4242}, unix.EBADF, nil},
		{"size too large", fuse.SetattrIn{Valid: fuse.FattrSize, Size: 1 << 63}, unix.EINVAL, nil},
		{"times", fuse.SetattrIn{Valid: fuse.FattrAtime | fuse.FattrMtime, Atime: 1000, Atimensec: 5, Mtime: 2000, Mtimensec: 7}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Atim.Sec != 1000 || st.Atim.Nsec != 5 || st.Mtim.Sec != 2000 || st.Mtim.Nsec != 7 || a.Mtime != 2000 {
					t.Errorf("times %v %v", st.Atim, st.Mtim)
				}
			}},
		{"mtime only", fuse.SetattrIn{Valid: fuse.FattrMtime, Mtime: 3000}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				if st.Atim.Sec != 1000 || st.Mtim.Sec != 3000 {
					t.Errorf("times %v %v", st.Atim, st.Mtim)
				}
			}},
		{"times now", fuse.SetattrIn{Valid: fuse.FattrAtime | fuse.FattrAtimeNow | fuse.FattrMtime | fuse.FattrMtimeNow}, 0,
			func(t *testing.T, st unix.Stat_t, a fuse.Attr) {
				now := time.Now().Unix()
				if st.Atim.Sec < now-60 || st.Mtim.Sec < now-60 {
					t.Errorf("times %v %v, want about %d", st.Atim, st.Mtim, now)
				}
			}},
		{"nsec out of range", fuse.SetattrIn{Valid: fuse.FattrMtime, Mtimensec: 2e9}, unix.EINVAL, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out fuse.AttrOut
			errno := e.fs.SetAttr(rootCtx, f.NodeID, &tt.in, &out)
			wantErrno(t, "SetAttr", errno, tt.errno)
			if errno == 0 && tt.check != nil {
				tt.check(t, lstat(t, e.path("f")), out.Attr)
			}
		})
	}

	// Size applies to regular files only.
	must(t, os.Mkdir(e.path("d"), 0o755))
	must(t, unix.Mkfifo(e.path("p"), 0o644))
	var out fuse.AttrOut
	wantErrno(t, "truncate dir", e.fs.SetAttr(rootCtx, e.lookup(t, 1, "d").NodeID, &fuse.SetattrIn{Valid: fuse.FattrSize}, &out), unix.EISDIR)
	withTimeout(t, "truncate fifo", func() {
		wantErrno(t, "truncate fifo", e.fs.SetAttr(rootCtx, e.lookup(t, 1, "p").NodeID, &fuse.SetattrIn{Valid: fuse.FattrSize}, &out), unix.EINVAL)
	})
	// A directory handle is no file handle.
	dh := e.openDir(t, 1)
	wantErrno(t, "setattr with dir handle", e.fs.SetAttr(rootCtx, 1, &fuse.SetattrIn{Valid: fuse.FattrFh | fuse.FattrMode, Fh: dh, Mode: 0o777}, &out), unix.EBADF)
}

func TestSymlinkReadlink(t *testing.T) {
	e := newEnv(t, Options{})
	var out fuse.EntryOut
	if errno := e.fs.Symlink(rootCtx, 1, "l", "some/where/../../x", &out); errno != 0 {
		t.Fatal(errno)
	}
	if out.Attr.Mode&unix.S_IFMT != unix.S_IFLNK || out.Attr.Size != uint64(len("some/where/../../x")) {
		t.Errorf("symlink attr %+v", out.Attr)
	}
	got, errno := e.fs.Readlink(rootCtx, out.NodeID, []byte("prefix:"))
	if errno != 0 || string(got) != "prefix:some/where/../../x" {
		t.Errorf("Readlink = %q, %v", got, errno)
	}
	got, errno = e.fs.Readlink(rootCtx, out.NodeID, nil)
	if errno != 0 || string(got) != "some/where/../../x" {
		t.Errorf("Readlink = %q, %v", got, errno)
	}
	if target, _ := os.Readlink(e.path("l")); target != "some/where/../../x" {
		t.Errorf("host target %q", target)
	}
	_, errno = e.fs.Readlink(rootCtx, 1, nil)
	wantErrno(t, "Readlink of a directory", errno, unix.EINVAL)
	wantErrno(t, "Symlink over existing", e.fs.Symlink(rootCtx, 1, "l", "x", &out), unix.EEXIST)
}

func TestCreateOps(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{DirectIO: true, KeepCache: true})
	var ent fuse.EntryOut
	var open fuse.OpenOut

	// CREATE as uid 1000 with umask 022.
	in := &fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT | unix.O_EXCL, Mode: unix.S_IFREG | 0o666, Umask: 0o022}
	if errno := e.fs.Create(userCtx, 1, "file", in, &ent, &open); errno != 0 {
		t.Fatalf("Create: %v", errno)
	}
	st := lstat(t, e.path("file"))
	if st.Uid != 1000 || st.Gid != 1000 || st.Mode != unix.S_IFREG|0o644 {
		t.Errorf("created %d:%d %o, want 1000:1000 0100644", st.Uid, st.Gid, st.Mode)
	}
	if ent.Attr.Ino != st.Ino || ent.Attr.UID != 1000 || e.fs.nodes.refs(ent.NodeID) != 1 {
		t.Errorf("entry %+v", ent)
	}
	if open.OpenFlags != fuse.FopenDirectIO|fuse.FopenKeepCache {
		t.Errorf("open flags %#x", open.OpenFlags)
	}
	e.write(t, ent.NodeID, open.Fh, 0, []byte("hello"))
	wantErrno(t, "Release", e.fs.Release(rootCtx, ent.NodeID, &fuse.ReleaseIn{Fh: open.Fh}), 0)
	wantErrno(t, "Release again", e.fs.Release(rootCtx, ent.NodeID, &fuse.ReleaseIn{Fh: open.Fh}), unix.EBADF)

	// CREATE of an existing name: EEXIST with O_EXCL; without, the file is opened (and
	// truncated) as the caller, who must be allowed to.
	wantErrno(t, "Create O_EXCL existing", e.fs.Create(userCtx, 1, "file", in, &ent, &open), unix.EEXIST)
	in2 := &fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT | unix.O_TRUNC, Mode: unix.S_IFREG | 0o600}
	if errno := e.fs.Create(userCtx, 1, "file", in2, &ent, &open); errno != 0 {
		t.Fatalf("Create existing: %v", errno)
	}
	if st := lstat(t, e.path("file")); st.Size != 0 || e.fs.nodes.refs(ent.NodeID) != 2 {
		t.Errorf("existing file: size %d refs %d", st.Size, e.fs.nodes.refs(ent.NodeID))
	}
	must(t, os.WriteFile(e.path("rootonly"), []byte("x"), 0o600))
	wantErrno(t, "Create over a file the caller may not write", e.fs.Create(userCtx, 1, "rootonly", in2, &ent, &open), unix.EACCES)
	if st := lstat(t, e.path("rootonly")); st.Size != 1 {
		t.Errorf("rootonly truncated")
	}

	// MKDIR, MKNOD, SYMLINK as uid 1000.
	if errno := e.fs.Mkdir(userCtx, 1, "dir", &fuse.MkdirIn{Mode: 0o777, Umask: 0o027}, &ent); errno != 0 {
		t.Fatalf("Mkdir: %v", errno)
	}
	if st := lstat(t, e.path("dir")); st.Uid != 1000 || st.Gid != 1000 || st.Mode != unix.S_IFDIR|0o750 {
		t.Errorf("mkdir: %d:%d %o", st.Uid, st.Gid, st.Mode)
	}
	dir := ent.NodeID
	if errno := e.fs.Mknod(userCtx, dir, "fifo", &fuse.MknodIn{Mode: unix.S_IFIFO | 0o666, Umask: 0o002}, &ent); errno != 0 {
		t.Fatalf("Mknod: %v", errno)
	}
	if st := lstat(t, filepath.Join(e.share, "dir", "fifo")); st.Uid != 1000 || st.Mode != unix.S_IFIFO|0o664 {
		t.Errorf("mknod: %d %o", st.Uid, st.Mode)
	}
	if ent.Attr.Mode != unix.S_IFIFO|0o664 {
		t.Errorf("mknod entry mode %o", ent.Attr.Mode)
	}
	if errno := e.fs.Mknod(userCtx, dir, "reg", &fuse.MknodIn{Mode: unix.S_IFREG | 0o644}, &ent); errno != 0 {
		t.Fatalf("Mknod regular: %v", errno)
	}
	// A device node needs CAP_MKNOD, which a non-root fsuid does not have.
	wantErrno(t, "Mknod device as uid 1000", e.fs.Mknod(userCtx, dir, "null", &fuse.MknodIn{Mode: unix.S_IFCHR | 0o666, Rdev: 1<<8 | 3}, &ent), unix.EPERM)
	if errno := e.fs.Symlink(userCtx, dir, "link", "fifo", &ent); errno != 0 {
		t.Fatalf("Symlink: %v", errno)
	}
	if st := lstat(t, filepath.Join(e.share, "dir", "link")); st.Uid != 1000 || st.Gid != 1000 {
		t.Errorf("symlink owner %d:%d", st.Uid, st.Gid)
	}
	// uid 1000 may not create where only root may write.
	must(t, os.Mkdir(e.path("private"), 0o755))
	priv := e.lookup(t, 1, "private").NodeID
	wantErrno(t, "Mkdir as 1000 in a root dir", e.fs.Mkdir(userCtx, priv, "x", &fuse.MkdirIn{Mode: 0o755}, &ent), unix.EACCES)
	wantErrno(t, "Create as 1000 in a root dir", e.fs.Create(userCtx, priv, "x", in, &ent, &open), unix.EACCES)
	if errno := e.fs.Mkdir(rootCtx, priv, "x", &fuse.MkdirIn{Mode: 0o755}, &ent); errno != 0 {
		t.Errorf("Mkdir as root: %v", errno)
	}
	// An unusable id is refused before anything is created.
	bad := &fuse.Context{UID: 1<<32 - 1, GID: 1000}
	wantErrno(t, "Mkdir as uid -1", e.fs.Mkdir(bad, 1, "bad", &fuse.MkdirIn{Mode: 0o755}, &ent), unix.EPERM)
	if _, err := os.Lstat(e.path("bad")); !os.IsNotExist(err) {
		t.Errorf("bad created")
	}

	// UNLINK and RMDIR.
	wantErrno(t, "Rmdir non-empty", e.fs.Rmdir(rootCtx, 1, "dir"), unix.ENOTEMPTY)
	wantErrno(t, "Unlink dir", e.fs.Unlink(rootCtx, 1, "dir"), unix.EISDIR)
	wantErrno(t, "Unlink", e.fs.Unlink(rootCtx, dir, "fifo"), 0)
	wantErrno(t, "Unlink missing", e.fs.Unlink(rootCtx, dir, "fifo"), unix.ENOENT)
	for _, n := range []string{"reg", "link"} {
		wantErrno(t, "Unlink "+n, e.fs.Unlink(rootCtx, dir, n), 0)
	}
	wantErrno(t, "Rmdir", e.fs.Rmdir(rootCtx, 1, "dir"), 0)
	if _, err := os.Lstat(e.path("dir")); !os.IsNotExist(err) {
		t.Errorf("dir still there")
	}
}

// TestCredentialsStayPerRequest runs creates as uid 1000 and as root at the same time: a thread
// left with another fsuid would show in the owners.
func TestCredentialsStayPerRequest(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{})
	var wg sync.WaitGroup
	const perWorker = 50
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perWorker; i++ {
				ctx := rootCtx
				if (w+i)%2 == 0 {
					ctx = userCtx
				}
				var ent fuse.EntryOut
				name := "f" + string(rune('a'+w)) + string(rune('a'+i%26)) + string(rune('a'+i/26))
				if errno := e.fs.Mknod(ctx, 1, name, &fuse.MknodIn{Mode: unix.S_IFREG | 0o644}, &ent); errno != 0 {
					t.Errorf("Mknod %s: %v", name, errno)
					return
				}
				if ent.Attr.UID != ctx.UID || ent.Attr.GID != ctx.GID {
					t.Errorf("%s owned by %d:%d, want %d:%d", name, ent.Attr.UID, ent.Attr.GID, ctx.UID, ctx.GID)
				}
			}
		}()
	}
	wg.Wait()
	// Our own ids are unchanged on this thread too.
	if uid := setfsuid(1<<32 - 1); uid != e.fs.uid {
		t.Errorf("fsuid %d", uid)
	}
}

func TestTmpfile(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{})
	var ent fuse.EntryOut
	var open fuse.OpenOut
	in := &fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o666, Umask: 0o022}
	if errno := e.fs.Tmpfile(userCtx, 1, in, &ent, &open); errno != 0 {
		t.Fatalf("Tmpfile: %v", errno)
	}
	if ent.Attr.Nlink != 0 || ent.Attr.UID != 1000 || ent.Attr.Mode != unix.S_IFREG|0o644 {
		t.Errorf("tmpfile attr %+v", ent.Attr)
	}
	e.write(t, ent.NodeID, open.Fh, 0, []byte("anonymous"))
	entries, _ := os.ReadDir(e.share)
	if len(entries) != 0 {
		t.Errorf("tmpfile has a name: %v", entries)
	}
	var l fuse.EntryOut
	if errno := e.fs.Link(rootCtx, ent.NodeID, 1, "named", &l); errno != 0 {
		t.Fatalf("Link tmpfile: %v", errno)
	}
	if l.NodeID != ent.NodeID || l.Attr.Nlink != 1 {
		t.Errorf("linked tmpfile: node %d nlink %d", l.NodeID, l.Attr.Nlink)
	}
	if data, _ := os.ReadFile(e.path("named")); string(data) != "anonymous" {
		t.Errorf("content %q", data)
	}
	// O_EXCL: never to be linked.
	in.Flags |= unix.O_EXCL
	if errno := e.fs.Tmpfile(rootCtx, 1, in, &ent, &open); errno != 0 {
		t.Fatalf("Tmpfile O_EXCL: %v", errno)
	}
	wantErrno(t, "Link O_EXCL tmpfile", e.fs.Link(rootCtx, ent.NodeID, 1, "named2", &l), unix.ENOENT)
	wantErrno(t, "Tmpfile in a file", e.fs.Tmpfile(rootCtx, l.NodeID, in, &ent, &open), unix.ENOTDIR)
}

func TestRename(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("a"), []byte("A"), 0o644))
	must(t, os.WriteFile(e.path("b"), []byte("B"), 0o644))
	must(t, os.Mkdir(e.path("d"), 0o755))
	d := e.lookup(t, 1, "d").NodeID
	read := func(name string) string {
		b, _ := os.ReadFile(e.path(name))
		return string(b)
	}

	wantErrno(t, "NOREPLACE onto existing", e.fs.Rename(rootCtx, 1, "a", 1, "b", unix.RENAME_NOREPLACE), unix.EEXIST)
	wantErrno(t, "EXCHANGE", e.fs.Rename(rootCtx, 1, "a", 1, "b", unix.RENAME_EXCHANGE), 0)
	if read("a") != "B" || read("b") != "A" {
		t.Errorf("after exchange a=%q b=%q", read("a"), read("b"))
	}
	wantErrno(t, "EXCHANGE with missing", e.fs.Rename(rootCtx, 1, "a", 1, "zz", unix.RENAME_EXCHANGE), unix.ENOENT)
	wantErrno(t, "NOREPLACE|EXCHANGE", e.fs.Rename(rootCtx, 1, "a", 1, "b", unix.RENAME_NOREPLACE|unix.RENAME_EXCHANGE), unix.EINVAL)
	wantErrno(t, "unknown flag", e.fs.Rename(rootCtx, 1, "a", 1, "c", 1<<7), unix.EINVAL)
	wantErrno(t, "rename into dir", e.fs.Rename(rootCtx, 1, "a", d, "a2", 0), 0)
	wantErrno(t, "NOREPLACE to new", e.fs.Rename(rootCtx, d, "a2", 1, "c", unix.RENAME_NOREPLACE), 0)
	wantErrno(t, "plain over existing", e.fs.Rename(rootCtx, 1, "c", 1, "b", 0), 0)
	if read("b") != "B" {
		t.Errorf("b=%q", read("b"))
	}
	wantErrno(t, "dir into itself", e.fs.Rename(rootCtx, 1, "d", d, "x", 0), unix.EINVAL)
}

func TestReadWrite(t *testing.T) {
	e := newEnv(t, Options{})
	ent, fh := e.create(t, rootCtx, 1, "f", 0o644)
	node := ent.NodeID

	// WRITE from several guest buffers, some empty.
	src := [][]byte{[]byte("hel"), nil, []byte("lo, "), []byte("world")}
	n, errno := e.fs.Write(rootCtx, node, &fuse.WriteIn{Fh: fh, Offset: 2, Size: 12}, src)
	if errno != 0 || n != 12 {
		t.Fatalf("Write: %d %v", n, errno)
	}
	if data, _ := os.ReadFile(e.path("f")); string(data) != "\x00\x00hello, world" {
		t.Errorf("file %q", data)
	}
	// More buffers than IOV_MAX.
	many := make([][]byte, 3000)
	for i := range many {
		many[i] = []byte{byte('a' + i%26)}
	}
	n, errno = e.fs.Write(rootCtx, node, &fuse.WriteIn{Fh: fh, Offset: 0, Size: 3000}, many)
	if errno != 0 || n != 3000 {
		t.Fatalf("Write 3000 iovecs: %d %v", n, errno)
	}

	// READ into split buffers, short at the end of the file.
	dst := [][]byte{make([]byte, 1000), make([]byte, 1500), make([]byte, 1000)}
	n, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Offset: 0, Size: 3500}, dst)
	if errno != 0 || n != 3000 {
		t.Fatalf("Read: %d %v", n, errno)
	}
	got := append(append(append([]byte(nil), dst[0]...), dst[1]...), dst[2][:500]...)
	for i, c := range got {
		if c != byte('a'+i%26) {
			t.Fatalf("byte %d = %q", i, c)
		}
	}
	// A READ never writes beyond in.Size, nor beyond dst.
	small := [][]byte{make([]byte, 4), make([]byte, 4)}
	n, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Offset: 0, Size: 6}, small)
	if errno != 0 || n != 6 || string(small[0]) != "abcd" || string(small[1]) != "ef\x00\x00" {
		t.Errorf("Read 6: %d %v %q", n, errno, small)
	}
	n, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Offset: 0, Size: 1<<32 - 1}, [][]byte{make([]byte, 10)})
	if errno != 0 || n != 10 {
		t.Errorf("huge Read: %d %v", n, errno)
	}
	n, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Offset: 1 << 40, Size: 10}, [][]byte{make([]byte, 10)})
	if errno != 0 || n != 0 {
		t.Errorf("Read past the end: %d %v", n, errno)
	}
	_, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Offset: 1 << 63, Size: 10}, [][]byte{make([]byte, 10)})
	wantErrno(t, "Read at a negative offset", errno, unix.EINVAL)
	_, errno = e.fs.Write(rootCtx, node, &fuse.WriteIn{Fh: fh, Offset: 1<<64 - 1, Size: 1}, [][]byte{{1}})
	wantErrno(t, "Write at a negative offset", errno, unix.EINVAL)
	n, errno = e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Size: 0}, nil)
	if errno != 0 || n != 0 {
		t.Errorf("empty Read: %d %v", n, errno)
	}

	// Access modes are the host's: a read-only handle cannot write.
	ro := e.open(t, node, unix.O_RDONLY)
	_, errno = e.fs.Write(rootCtx, node, &fuse.WriteIn{Fh: ro, Size: 1}, [][]byte{{1}})
	wantErrno(t, "Write on read-only handle", errno, unix.EBADF)

	// O_APPEND and O_TRUNC pass; O_DIRECT is dropped.
	app := e.open(t, node, unix.O_WRONLY|unix.O_APPEND|unix.O_DIRECT)
	e.write(t, node, app, 0, []byte("END"))
	if data, _ := os.ReadFile(e.path("f")); !bytes.HasSuffix(data, []byte("END")) || len(data) != 3003 {
		t.Errorf("append: len %d", len(data))
	}
	e.open(t, node, unix.O_RDWR|unix.O_TRUNC)
	if st := lstat(t, e.path("f")); st.Size != 0 {
		t.Errorf("O_TRUNC: size %d", st.Size)
	}

	// FLUSH, FSYNC (both kinds), RELEASE.
	wantErrno(t, "Flush", e.fs.Flush(rootCtx, node, &fuse.FlushIn{Fh: fh}), 0)
	wantErrno(t, "Fsync", e.fs.Fsync(rootCtx, node, &fuse.FsyncIn{Fh: fh}), 0)
	wantErrno(t, "Fdatasync", e.fs.Fsync(rootCtx, node, &fuse.FsyncIn{Fh: fh, FsyncFlags: fuse.FsyncFdatasync}), 0)
	dh := e.openDir(t, 1)
	wantErrno(t, "FsyncDir", e.fs.FsyncDir(rootCtx, 1, &fuse.FsyncIn{Fh: dh}), 0)
	wantErrno(t, "Fsync of a dir handle", e.fs.Fsync(rootCtx, 1, &fuse.FsyncIn{Fh: dh}), unix.EBADF)
	wantErrno(t, "Release", e.fs.Release(rootCtx, node, &fuse.ReleaseIn{Fh: fh}), 0)
	wantErrno(t, "Flush released", e.fs.Flush(rootCtx, node, &fuse.FlushIn{Fh: fh}), unix.EBADF)
	wantErrno(t, "ReleaseDir", e.fs.ReleaseDir(rootCtx, 1, &fuse.ReleaseIn{Fh: dh}), 0)
}

func TestLseekFallocateCopy(t *testing.T) {
	e := newEnv(t, Options{})
	ent, fh := e.create(t, rootCtx, 1, "sparse", 0o644)
	node := ent.NodeID
	block := bytes.Repeat([]byte{'x'}, 4096)
	e.write(t, node, fh, 0, block)
	e.write(t, node, fh, 1<<20, block)

	var out fuse.LseekOut
	wantErrno(t, "SEEK_DATA", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 4096, Whence: unix.SEEK_DATA}, &out), 0)
	if out.Offset != 1<<20 {
		t.Errorf("SEEK_DATA from 4096 = %d, want %d", out.Offset, 1<<20)
	}
	wantErrno(t, "SEEK_HOLE", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 0, Whence: unix.SEEK_HOLE}, &out), 0)
	if out.Offset != 4096 {
		t.Errorf("SEEK_HOLE from 0 = %d, want 4096", out.Offset)
	}
	wantErrno(t, "SEEK_END", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 0, Whence: unix.SEEK_END}, &out), 0)
	if out.Offset != 1<<20+4096 {
		t.Errorf("SEEK_END = %d", out.Offset)
	}
	wantErrno(t, "SEEK_SET", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 7, Whence: unix.SEEK_SET}, &out), 0)
	wantErrno(t, "SEEK_CUR", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 1, Whence: unix.SEEK_CUR}, &out), 0)
	if out.Offset != 8 {
		t.Errorf("SEEK_CUR = %d", out.Offset)
	}
	wantErrno(t, "SEEK_DATA past the end", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 1 << 30, Whence: unix.SEEK_DATA}, &out), unix.ENXIO)
	wantErrno(t, "bad whence", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Whence: 5}, &out), unix.EINVAL)
	wantErrno(t, "negative SEEK_SET", e.fs.Lseek(rootCtx, node, &fuse.LseekIn{Fh: fh, Offset: 1<<64 - 1, Whence: unix.SEEK_SET}, &out), unix.EINVAL)

	// FALLOCATE: grow, then punch a hole.
	wantErrno(t, "Fallocate", e.fs.Fallocate(rootCtx, node, &fuse.FallocateIn{Fh: fh, Offset: 0, Length: 4 << 20}), 0)
	if st := lstat(t, e.path("sparse")); st.Size != 4<<20 {
		t.Errorf("size after fallocate %d", st.Size)
	}
	wantErrno(t, "punch hole", e.fs.Fallocate(rootCtx, node, &fuse.FallocateIn{Fh: fh, Offset: 0, Length: 4096,
		Mode: unix.FALLOC_FL_PUNCH_HOLE | unix.FALLOC_FL_KEEP_SIZE}), 0)
	buf := make([]byte, 4096)
	if n, _ := e.fs.Read(rootCtx, node, &fuse.ReadIn{Fh: fh, Size: 4096}, [][]byte{buf}); n != 4096 || !bytes.Equal(buf, make([]byte, 4096)) {
		t.Errorf("punched range not zero")
	}
	wantErrno(t, "Fallocate huge offset", e.fs.Fallocate(rootCtx, node, &fuse.FallocateIn{Fh: fh, Offset: 1 << 63, Length: 1}), unix.EINVAL)

	// COPY_FILE_RANGE between two of our handles.
	dst, dfh := e.create(t, rootCtx, 1, "copy", 0o644)
	var wout fuse.WriteOut
	wantErrno(t, "CopyFileRange", e.fs.CopyFileRange(rootCtx, node, &fuse.CopyFileRangeIn{FhIn: fh, OffIn: 1 << 20,
		NodeIDOut: dst.NodeID, FhOut: dfh, OffOut: 10, Len: 4096}, &wout), 0)
	if wout.Size != 4096 {
		t.Errorf("copied %d", wout.Size)
	}
	if data, _ := os.ReadFile(e.path("copy")); len(data) != 4106 || !bytes.Equal(data[10:], block) {
		t.Errorf("copy: len %d", len(data))
	}
	wantErrno(t, "CopyFileRange wrong out node", e.fs.CopyFileRange(rootCtx, node, &fuse.CopyFileRangeIn{FhIn: fh,
		NodeIDOut: node, FhOut: dfh, Len: 1}, &wout), unix.EBADF)
	wantErrno(t, "CopyFileRange wrong in node", e.fs.CopyFileRange(rootCtx, dst.NodeID, &fuse.CopyFileRangeIn{FhIn: fh,
		NodeIDOut: dst.NodeID, FhOut: dfh, Len: 1}, &wout), unix.EBADF)
	wantErrno(t, "CopyFileRange flags", e.fs.CopyFileRange(rootCtx, node, &fuse.CopyFileRangeIn{FhIn: fh,
		NodeIDOut: dst.NodeID, FhOut: dfh, Len: 1, Flags: 1}, &wout), unix.EINVAL)
}

func TestStatFsSyncFsAccess(t *testing.T) {
	e := newEnv(t, Options{})
	var out fuse.StatfsOut
	wantErrno(t, "StatFs", e.fs.StatFs(rootCtx, 1, &out), 0)
	var want unix.Statfs_t
	must(t, unix.Statfs(e.share, &want))
	if out.Bsize != uint32(want.Bsize) || out.Namelen != uint32(want.Namelen) || out.Blocks != want.Blocks || out.Files != want.Files {
		t.Errorf("statfs %+v, want %+v", out, want)
	}
	must(t, unix.Mkfifo(e.path("p"), 0o644))
	p := e.lookup(t, 1, "p").NodeID
	wantErrno(t, "StatFs of a fifo", e.fs.StatFs(rootCtx, p, &out), 0)
	wantErrno(t, "SyncFs", e.fs.SyncFs(rootCtx, 1), 0)
	withTimeout(t, "SyncFs of a fifo", func() {
		wantErrno(t, "SyncFs of a fifo", e.fs.SyncFs(rootCtx, p), unix.EINVAL)
	})
}

func TestAccess(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("root-only"), []byte("x"), 0o600))
	must(t, os.WriteFile(e.path("exec"), []byte("x"), 0o755))
	must(t, unix.Mkfifo(e.path("p"), 0o666))
	must(t, os.Symlink("/etc/shadow", e.path("s")))
	ro, ex, p, s := e.lookup(t, 1, "root-only").NodeID, e.lookup(t, 1, "exec").NodeID,
		e.lookup(t, 1, "p").NodeID, e.lookup(t, 1, "s").NodeID
	for _, c := range []struct {
		name string
		ctx  *fuse.Context
		node uint64
		mask uint32
		want unix.Errno
	}{
		{"root reads a 0600 file", rootCtx, ro, unix.R_OK | unix.W_OK, 0},
		{"root may not execute without an x bit", rootCtx, ro, unix.X_OK, unix.EACCES},
		{"uid 1000 may not read a root 0600 file", userCtx, ro, unix.R_OK, unix.EACCES},
		{"uid 1000 exists check", userCtx, ro, unix.F_OK, 0},
		{"uid 1000 executes a 0755 file", userCtx, ex, unix.R_OK | unix.X_OK, 0},
		{"uid 1000 may not write a root 0755 file", userCtx, ex, unix.W_OK, unix.EACCES},
		{"a fifo is not opened to check it", userCtx, p, unix.R_OK | unix.W_OK, 0},
		{"a symlink is checked itself, not /etc/shadow", userCtx, s, unix.R_OK, 0},
		{"bad mask", rootCtx, ro, 0x10, unix.EINVAL},
		{"unknown node", rootCtx, 1 << 40, unix.R_OK, unix.EBADF},
	} {
		wantErrno(t, c.name, e.fs.Access(c.ctx, c.node, c.mask), c.want)
	}
}

func TestXattr(t *testing.T) {
	needRoot(t)
	t.Run("off", func(t *testing.T) {
		e := newEnv(t, Options{})
		wantErrno(t, "SetXattr", e.fs.SetXattr(rootCtx, 1, "user.a", []byte("1"), 0), unix.ENOSYS)
		_, errno := e.fs.GetXattr(rootCtx, 1, "user.a", nil)
		wantErrno(t, "GetXattr", errno, unix.ENOSYS)
		_, errno = e.fs.ListXattr(rootCtx, 1, nil)
		wantErrno(t, "ListXattr", errno, unix.ENOSYS)
		wantErrno(t, "RemoveXattr", e.fs.RemoveXattr(rootCtx, 1, "user.a"), unix.ENOSYS)
		if xs, _ := listXattrs(e.share); len(xs) != 0 {
			t.Errorf("xattrs %v", xs)
		}
	})
	t.Run("on", func(t *testing.T) {
		e := newEnv(t, Options{Xattr: true})
		must(t, os.WriteFile(e.path("f"), nil, 0o644))
		f := e.lookup(t, 1, "f").NodeID
		wantErrno(t, "SetXattr", e.fs.SetXattr(rootCtx, f, "user.color", []byte("blue"), 0), 0)
		wantErrno(t, "SetXattr CREATE existing", e.fs.SetXattr(rootCtx, f, "user.color", []byte("red"), unix.XATTR_CREATE), unix.EEXIST)
		wantErrno(t, "SetXattr REPLACE missing", e.fs.SetXattr(rootCtx, f, "user.size", []byte("x"), unix.XATTR_REPLACE), unix.ENODATA)
		n, errno := e.fs.GetXattr(rootCtx, f, "user.color", nil)
		if errno != 0 || n != 4 {
			t.Errorf("GetXattr size: %d %v", n, errno)
		}
		buf := make([]byte, 16)
		n, errno = e.fs.GetXattr(rootCtx, f, "user.color", buf)
		if errno != 0 || string(buf[:n]) != "blue" {
			t.Errorf("GetXattr: %q %v", buf[:n], errno)
		}
		_, errno = e.fs.GetXattr(rootCtx, f, "user.color", buf[:2])
		wantErrno(t, "GetXattr small", errno, unix.ERANGE)
		_, errno = e.fs.GetXattr(rootCtx, f, "user.none", buf)
		wantErrno(t, "GetXattr missing", errno, unix.ENODATA)
		n, errno = e.fs.ListXattr(rootCtx, f, buf)
		if errno != 0 || string(buf[:n]) != "user.color\x00" {
			t.Errorf("ListXattr: %q %v", buf[:n], errno)
		}
		if v := make([]byte, 8); true {
			k, _ := unix.Getxattr(e.path("f"), "user.color", v)
			if string(v[:k]) != "blue" {
				t.Errorf("host xattr %q", v[:k])
			}
		}
		wantErrno(t, "RemoveXattr", e.fs.RemoveXattr(rootCtx, f, "user.color"), 0)
		wantErrno(t, "RemoveXattr again", e.fs.RemoveXattr(rootCtx, f, "user.color"), unix.ENODATA)
		n, errno = e.fs.ListXattr(rootCtx, f, nil)
		if errno != 0 || n != 0 {
			t.Errorf("ListXattr empty: %d %v", n, errno)
		}
		wantErrno(t, "SetXattr unknown node", e.fs.SetXattr(rootCtx, 12345, "user.a", nil, 0), unix.EBADF)

		// On a symlink, the link's own attributes, never the target's.
		must(t, unix.Setxattr(e.path("f"), "user.target", []byte("t"), 0))
		must(t, os.Symlink("f", e.path("l")))
		l := e.lookup(t, 1, "l").NodeID
		_, errno = e.fs.GetXattr(rootCtx, l, "user.target", buf)
		wantErrno(t, "GetXattr through symlink", errno, unix.ENODATA)
		wantErrno(t, "SetXattr user.* on symlink", e.fs.SetXattr(rootCtx, l, "user.x", []byte("1"), 0), unix.EPERM)
		wantErrno(t, "SetXattr trusted.* on symlink", e.fs.SetXattr(rootCtx, l, "trusted.x", []byte("1"), 0), 0)
		if xs, _ := listXattrs(e.path("l")); len(xs) != 1 || xs[0] != "trusted.x" {
			t.Errorf("symlink xattrs %v", xs)
		}
		if xs, _ := listXattrs(e.path("f")); len(xs) != 1 || xs[0] != "user.target" {
			t.Errorf("target xattrs %v", xs)
		}
	})
}

func TestDestroy(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("f"), []byte("x"), 0o644))
	must(t, os.Mkdir(e.path("d"), 0o755))
	f := e.lookup(t, 1, "f").NodeID
	d := e.lookup(t, 1, "d").NodeID
	fh := e.open(t, f, unix.O_RDONLY)
	dh := e.openDir(t, d)
	if s := e.fs.Stats(); s.CachedInodes != 3 || s.OpenFiles != 2 || s.Fds != 6 {
		t.Errorf("stats %+v", s)
	}
	e.fs.Destroy()
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.OpenFiles != 0 || s.Fds != 2 {
		t.Errorf("stats after Destroy %+v", s)
	}
	var out fuse.AttrOut
	wantErrno(t, "GetAttr of a destroyed node", e.fs.GetAttr(rootCtx, f, &fuse.GetattrIn{}, &out), unix.EBADF)
	_, errno := e.fs.Read(rootCtx, f, &fuse.ReadIn{Fh: fh, Size: 1}, [][]byte{make([]byte, 1)})
	wantErrno(t, "Read of a destroyed handle", errno, unix.EBADF)
	wantErrno(t, "ReleaseDir of a destroyed handle", e.fs.ReleaseDir(rootCtx, d, &fuse.ReleaseIn{Fh: dh}), unix.EBADF)
	// A new session starts from the root.
	e.fs.Init(0)
	e.getattr(t, 1)
	if e.lookup(t, 1, "f").NodeID == f {
		t.Errorf("node id reused after Destroy")
	}
}

func TestSubmounts(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{AnnounceSubmounts: true})
	must(t, os.Mkdir(e.path("mnt"), 0o755))
	must(t, os.Mkdir(e.path("plain"), 0o755))
	if err := unix.Mount("tmpfs", e.path("mnt"), "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(e.path("mnt"), unix.MNT_DETACH) })

	flagsOf := func(name string) uint32 {
		a := e.lookup(t, 1, name)
		attr := e.getattr(t, a.NodeID)
		if attr.Flags != a.Attr.Flags {
			t.Errorf("%s: GetAttr flags %#x, Lookup flags %#x", name, attr.Flags, a.Attr.Flags)
		}
		return a.Attr.Flags
	}
	if f := flagsOf("mnt"); f != 0 {
		t.Errorf("submount flag before the guest negotiated it: %#x", f)
	}
	e.fs.Init(fuse.InitSubmounts)
	if f := flagsOf("mnt"); f != fuse.AttrSubmount {
		t.Errorf("mount point flags %#x, want AttrSubmount", f)
	}
	if f := flagsOf("plain"); f != 0 {
		t.Errorf("plain dir flags %#x", f)
	}
	if e.getattr(t, 1).Flags != 0 {
		t.Errorf("root has the submount flag")
	}
	// A directory inside the mounted file system is no mount point.
	mnt := e.lookup(t, 1, "mnt").NodeID
	var ent fuse.EntryOut
	if errno := e.fs.Mkdir(rootCtx, mnt, "in", &fuse.MkdirIn{Mode: 0o755}, &ent); errno != 0 {
		t.Fatal(errno)
	}
	if ent.Attr.Flags != 0 {
		t.Errorf("dir in the submount flags %#x", ent.Attr.Flags)
	}
	wantErrno(t, "SyncFs of the submount", e.fs.SyncFs(rootCtx, mnt), 0)
}

// TestConcurrent races lookups, forgets, opens, reads, releases and a Destroy on the same
// files; run with -race.
func TestConcurrent(t *testing.T) {
	e := newEnv(t, Options{})
	const files = 8
	for i := 0; i < files; i++ {
		must(t, os.WriteFile(e.path(string(rune('a'+i))), []byte("content"), 0o644))
	}
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 300; i++ {
				name := string(rune('a' + (w+i)%files))
				var ent fuse.EntryOut
				if errno := e.fs.Lookup(rootCtx, 1, name, &ent); errno != 0 {
					t.Errorf("Lookup: %v", errno)
					return
				}
				var open fuse.OpenOut
				if errno := e.fs.Open(rootCtx, ent.NodeID, &fuse.OpenIn{Flags: unix.O_RDONLY}, &open); errno != 0 {
					// Another worker may have forgotten the node in between.
					wantErrno(t, "Open", errno, unix.EBADF)
					continue
				}
				buf := make([]byte, 16)
				if n, errno := e.fs.Read(rootCtx, ent.NodeID, &fuse.ReadIn{Fh: open.Fh, Size: 16}, [][]byte{buf}); errno != 0 || n != 7 {
					t.Errorf("Read: %d %v", n, errno)
				}
				e.fs.Release(rootCtx, ent.NodeID, &fuse.ReleaseIn{Fh: open.Fh})
				e.fs.Forget(ent.NodeID, 1)
				if i%50 == 0 {
					var out fuse.AttrOut
					e.fs.GetAttr(rootCtx, ent.NodeID, &fuse.GetattrIn{}, &out)
				}
			}
		}()
	}
	wg.Wait()
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.OpenFiles != 0 || s.Fds != 2 {
		t.Errorf("stats after balanced lookups and forgets: %+v", s)
	}

	// The same with a Destroy (guest reboot) in the middle: requests on dropped ids fail
	// cleanly, and in the end every descriptor is accounted for.
	stop := make(chan struct{})
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				var ent fuse.EntryOut
				if e.fs.Lookup(rootCtx, 1, string(rune('a'+(w+i)%files)), &ent) != 0 {
					continue
				}
				var open fuse.OpenOut
				if e.fs.Open(rootCtx, ent.NodeID, &fuse.OpenIn{}, &open) == 0 {
					e.fs.Read(rootCtx, ent.NodeID, &fuse.ReadIn{Fh: open.Fh, Size: 4}, [][]byte{make([]byte, 4)})
				}
			}
		}()
	}
	for i := 0; i < 20; i++ {
		time.Sleep(time.Millisecond)
		e.fs.Destroy()
	}
	close(stop)
	wg.Wait()
	e.fs.Destroy()
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.OpenFiles != 0 || s.Fds != 2 {
		t.Errorf("stats after Destroy: %+v", s)
	}
}

// TestPinnedFdOutlivesForget checks that a FORGET does not close a descriptor a request is
// still using.
func TestPinnedFdOutlivesForget(t *testing.T) {
	e := newEnv(t, Options{})
	must(t, os.WriteFile(e.path("f"), nil, 0o644))
	id := e.lookup(t, 1, "f").NodeID
	n, ok := e.fs.nodes.get(id)
	if !ok {
		t.Fatal("node missing")
	}
	e.fs.Forget(id, 1)
	if _, err := unix.FcntlInt(uintptr(n.fd.Load()), unix.F_GETFD, 0); err != nil {
		t.Fatalf("fd closed while pinned: %v", err)
	}
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.Fds != 3 {
		t.Errorf("stats %+v", s)
	}
	e.fs.nodes.put(n)
	if s := e.fs.Stats(); s.Fds != 2 {
		t.Errorf("stats after the last unpin %+v", s)
	}
}

// TestKillSuidgid: the guest leaves clearing set-id bits to us when it negotiated
// HANDLE_KILLPRIV_V2 and flags the request.
func TestKillSuidgid(t *testing.T) {
	e := newEnv(t, Options{})
	ent, fh := e.create(t, rootCtx, 1, "f", 0o644)
	f := ent.NodeID
	chmod := func(mode uint32) { must(t, os.Chmod(e.path("f"), 0)); must(t, unix.Chmod(e.path("f"), mode)) }
	mode := func() uint32 { return lstat(t, e.path("f")).Mode & 0o7777 }

	chmod(0o6755)
	e.write(t, f, fh, 0, []byte("x")) // no flag: we have CAP_FSETID, the bits stay
	if m := mode(); m != 0o6755 {
		t.Errorf("plain write: mode %o", m)
	}
	n, errno := e.fs.Write(rootCtx, f, &fuse.WriteIn{Fh: fh, Size: 1, WriteFlags: fuse.WriteKillSuidgid}, [][]byte{{'y'}})
	if errno != 0 || n != 1 || mode() != 0o755 {
		t.Errorf("write with kill: %d %v mode %o", n, errno, mode())
	}
	chmod(0o2644) // set-group-ID without group execute: mandatory-locking marker, kept
	e.fs.Write(rootCtx, f, &fuse.WriteIn{Fh: fh, Size: 1, WriteFlags: fuse.WriteKillSuidgid}, [][]byte{{'y'}})
	if m := mode(); m != 0o2644 {
		t.Errorf("sgid without group exec: mode %o", m)
	}

	chmod(0o6775)
	var out fuse.AttrOut
	wantErrno(t, "truncate with kill", e.fs.SetAttr(rootCtx, f, &fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrKillSuidgid, Size: 0}, &out), 0)
	if m := mode(); m != 0o775 || out.Attr.Mode&0o7777 != 0o775 {
		t.Errorf("truncate with kill: mode %o, answered %o", m, out.Attr.Mode)
	}

	chmod(0o4755)
	var open fuse.OpenOut
	wantErrno(t, "open without O_TRUNC", e.fs.Open(rootCtx, f, &fuse.OpenIn{Flags: unix.O_RDWR, OpenFlags: fuse.OpenKillSuidgid}, &open), 0)
	if m := mode(); m != 0o4755 {
		t.Errorf("open without O_TRUNC: mode %o", m)
	}
	wantErrno(t, "open O_TRUNC with kill", e.fs.Open(rootCtx, f, &fuse.OpenIn{Flags: unix.O_RDWR | unix.O_TRUNC, OpenFlags: fuse.OpenKillSuidgid}, &open), 0)
	if m := mode(); m != 0o755 {
		t.Errorf("open O_TRUNC with kill: mode %o", m)
	}
}
