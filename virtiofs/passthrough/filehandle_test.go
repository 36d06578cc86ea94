package passthrough

import (
	"bytes"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// processFds counts the descriptors the test process has open.
func processFds(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	must(t, err)
	return len(ents)
}

// wantHandle fails unless node id keeps a file handle (want) or a descriptor (!want).
func wantHandle(t testing.TB, e *env, id uint64, want bool) {
	t.Helper()
	n, ok := e.fs.nodes.get(id)
	if !ok {
		t.Fatalf("node %d not in the table", id)
	}
	defer e.fs.nodes.put(n)
	if got := n.fh != nil; got != want || got == (n.fd.Load() >= 0) {
		t.Fatalf("node %d: file handle %v (fd %d), want handle %v", id, got, n.fd.Load(), want)
	}
}

// TestFileHandlesFdCount: with handles, looking files up does not hold a descriptor per file.
func TestFileHandlesFdCount(t *testing.T) {
	needRoot(t)
	const n = 3000
	e := newEnv(t, Options{FileHandles: FileHandlesMandatory})
	names := makeFiles(t, e, n)
	before := processFds(t)
	var out fuse.EntryOut
	ids := make(map[uint64]bool)
	for _, name := range names {
		if errno := e.fs.Lookup(rootCtx, 1, name, &out); errno != 0 {
			t.Fatalf("Lookup %s: %v", name, errno)
		}
		ids[out.NodeID] = true
	}
	after := processFds(t)
	if len(ids) != n {
		t.Fatalf("%d distinct nodes for %d files", len(ids), n)
	}
	// The first handle of the share's mount opened its mount descriptor in New already.
	if after > before+2 {
		t.Errorf("%d lookups took the process from %d to %d open descriptors", n, before, after)
	}
	if s := e.fs.Stats(); s.CachedInodes != n+1 || s.Fds != 3 {
		t.Errorf("stats %+v, want %d inodes and 3 fds (root, /proc/self/fd, one mount)", s, n+1)
	}
	// Every node still works.
	for id := range ids {
		e.getattr(t, id)
	}
	if after2 := processFds(t); after2 != after {
		t.Errorf("GETATTRs left descriptors open: %d, then %d", after, after2)
	}
}

// TestFileHandlesOps runs the node operations on nodes that keep file handles.
func TestFileHandlesOps(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{FileHandles: FileHandlesMandatory, Xattr: true})
	must(t, os.Mkdir(e.path("d"), 0o755))
	must(t, os.Chmod(e.path("d"), 0o777)) // uid 1000 creates in it
	must(t, os.WriteFile(e.path("d", "f"), []byte("hello"), 0o644))
	must(t, os.Symlink("../../outside/secret", e.path("d", "l")))

	d := e.lookup(t, 1, "d")
	wantHandle(t, e, d.NodeID, true)
	f := e.lookup(t, d.NodeID, "f")
	wantHandle(t, e, f.NodeID, true)
	if a := e.getattr(t, f.NodeID); a.Size != 5 || a.Mode != unix.S_IFREG|0o644 || a.Ino != lstat(t, e.path("d", "f")).Ino {
		t.Errorf("getattr %+v", a)
	}

	// A symlink keeps a handle of the link itself: READLINK reads it, never follows it.
	l := e.lookup(t, d.NodeID, "l")
	wantHandle(t, e, l.NodeID, true)
	target, errno := e.fs.Readlink(rootCtx, l.NodeID, nil)
	if errno != 0 || string(target) != "../../outside/secret" {
		t.Errorf("readlink %q, %v", target, errno)
	}

	// open, write, read
	fh := e.open(t, f.NodeID, unix.O_RDWR)
	e.write(t, f.NodeID, fh, 5, []byte(" world"))
	buf := make([]byte, 64)
	k, errno := e.fs.Read(rootCtx, f.NodeID, &fuse.ReadIn{Fh: fh, Size: 64}, [][]byte{buf})
	if errno != 0 || string(buf[:k]) != "hello world" {
		t.Errorf("read %q, %v", buf[:k], errno)
	}

	// setattr: mode, owner, size, times, without and with a handle
	var ao fuse.AttrOut
	in := &fuse.SetattrIn{Valid: fuse.FattrMode | fuse.FattrUID | fuse.FattrGID | fuse.FattrMtime,
		Mode: 0o600, UID: 1000, GID: 1000, Mtime: 1_000_000}
	if errno := e.fs.SetAttr(rootCtx, f.NodeID, in, &ao); errno != 0 {
		t.Fatalf("setattr: %v", errno)
	}
	st := lstat(t, e.path("d", "f"))
	if st.Mode != unix.S_IFREG|0o600 || st.Uid != 1000 || st.Gid != 1000 || st.Mtim.Sec != 1_000_000 || ao.Attr.Mtime != 1_000_000 {
		t.Errorf("after setattr: host %+v, answer %+v", st, ao.Attr)
	}
	if errno := e.fs.SetAttr(rootCtx, f.NodeID, &fuse.SetattrIn{Valid: fuse.FattrSize, Size: 3}, &ao); errno != 0 || ao.Attr.Size != 3 {
		t.Errorf("truncate: %v, size %d", errno, ao.Attr.Size)
	}
	if errno := e.fs.SetAttr(rootCtx, f.NodeID, &fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Fh: fh, Size: 2}, &ao); errno != 0 || ao.Attr.Size != 2 {
		t.Errorf("ftruncate: %v, size %d", errno, ao.Attr.Size)
	}

	// xattrs
	wantErrno(t, "setxattr", e.fs.SetXattr(rootCtx, f.NodeID, "user.k", []byte("v"), 0), 0)
	val := make([]byte, 16)
	if k, errno := e.fs.GetXattr(rootCtx, f.NodeID, "user.k", val); errno != 0 || string(val[:k]) != "v" {
		t.Errorf("getxattr %q, %v", val[:k], errno)
	}
	list := make([]byte, 64)
	if k, errno := e.fs.ListXattr(rootCtx, f.NodeID, list); errno != 0 || !bytes.Contains(list[:k], []byte("user.k\x00")) {
		t.Errorf("listxattr %q, %v", list[:k], errno)
	}
	wantErrno(t, "removexattr", e.fs.RemoveXattr(rootCtx, f.NodeID, "user.k"), 0)

	// readdirplus in a handle-backed directory
	dfh := e.openDir(t, d.NodeID)
	srv := newServer(t, e.fs)
	ents, errno := srv.readdir(t, d.NodeID, dfh, 0, 4096, true)
	if errno != 0 {
		t.Fatalf("readdirplus: %v", errno)
	}
	names := map[string]bool{}
	for _, ent := range ents {
		names[ent.name] = true
	}
	if !names["f"] || !names["l"] || len(ents) != 4 {
		t.Errorf("readdirplus listed %v", ents)
	}

	// create, mkdir, symlink in a handle-backed directory; link, rename, unlink, rmdir
	c, cfh := e.create(t, userCtx, d.NodeID, "c", 0o640)
	wantHandle(t, e, c.NodeID, true)
	if st := lstat(t, e.path("d", "c")); st.Uid != 1000 || st.Mode != unix.S_IFREG|0o640 {
		t.Errorf("created %+v", st)
	}
	var ent fuse.EntryOut
	wantErrno(t, "mkdir", e.fs.Mkdir(rootCtx, d.NodeID, "sub", &fuse.MkdirIn{Mode: 0o755}, &ent), 0)
	wantHandle(t, e, ent.NodeID, true)
	sub := ent.NodeID
	wantErrno(t, "link", e.fs.Link(rootCtx, f.NodeID, sub, "f2", &ent), 0)
	if ent.NodeID != f.NodeID || ent.Attr.Nlink != 2 {
		t.Errorf("link: node %d nlink %d, want node %d nlink 2", ent.NodeID, ent.Attr.Nlink, f.NodeID)
	}
	wantErrno(t, "rename", e.fs.Rename(rootCtx, d.NodeID, "f", sub, "moved", 0), 0)
	if _, err := os.Lstat(e.path("d", "sub", "moved")); err != nil {
		t.Errorf("rename: %v", err)
	}
	// The node follows its inode across the rename: the handle names the inode, not a path.
	e.getattr(t, f.NodeID)
	wantErrno(t, "unlink", e.fs.Unlink(rootCtx, sub, "moved"), 0)
	if a := e.getattr(t, f.NodeID); a.Nlink != 1 {
		t.Errorf("nlink after unlink %d, want 1", a.Nlink)
	}
	if s := e.fs.Stats(); s.Fds != 3+3 { // + the open files and directory
		t.Errorf("stats %+v: a node whose file keeps a link took a descriptor", s)
	}
	// The last link goes: the node takes a descriptor first, so the guest can still use the
	// file (ext4 refuses handles of unlinked inodes), as it could without handles.
	wantErrno(t, "unlink", e.fs.Unlink(rootCtx, sub, "f2"), 0)
	if a := e.getattr(t, f.NodeID); a.Nlink != 0 || a.Size != 2 {
		t.Errorf("getattr of the unlinked file: nlink %d size %d, want 0 and 2", a.Nlink, a.Size)
	}
	wantErrno(t, "rmdir", e.fs.Rmdir(rootCtx, d.NodeID, "sub"), 0)
	e.getattr(t, sub)
	// Renamed over: the same for the file that loses its name.
	must(t, os.WriteFile(e.path("d", "victim"), []byte("v"), 0o644))
	victim := e.lookup(t, d.NodeID, "victim")
	wantErrno(t, "rename over", e.fs.Rename(rootCtx, d.NodeID, "c", d.NodeID, "victim", 0), 0)
	if a := e.getattr(t, victim.NodeID); a.Nlink != 0 || a.Size != 1 {
		t.Errorf("getattr of the file renamed over: nlink %d size %d, want 0 and 1", a.Nlink, a.Size)
	}

	// The file is gone, but its open handle still reaches it: GETATTR with the handle, reads.
	var gao fuse.AttrOut
	if errno := e.fs.GetAttr(rootCtx, f.NodeID, &fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: fh}, &gao); errno != 0 || gao.Attr.Nlink != 0 {
		t.Errorf("getattr through the handle of an unlinked file: %v, nlink %d", errno, gao.Attr.Nlink)
	}
	if k, errno := e.fs.Read(rootCtx, f.NodeID, &fuse.ReadIn{Fh: fh, Size: 64}, [][]byte{buf}); errno != 0 || string(buf[:k]) != "he" {
		t.Errorf("read of an unlinked file %q, %v", buf[:k], errno)
	}
	wantErrno(t, "release", e.fs.Release(rootCtx, f.NodeID, &fuse.ReleaseIn{Fh: fh}), 0)
	wantErrno(t, "release", e.fs.Release(rootCtx, c.NodeID, &fuse.ReleaseIn{Fh: cfh}), 0)
	wantErrno(t, "releasedir", e.fs.ReleaseDir(rootCtx, d.NodeID, &fuse.ReleaseIn{Fh: dfh}), 0)

	// statfs, access
	var sfs fuse.StatfsOut
	wantErrno(t, "statfs", e.fs.StatFs(rootCtx, d.NodeID, &sfs), 0)
	wantErrno(t, "access", e.fs.Access(userCtx, c.NodeID, unix.R_OK), 0)
	wantErrno(t, "access", e.fs.Access(userCtx, c.NodeID, unix.X_OK), unix.EACCES)
	if s := e.fs.Stats(); s.Fds != 3+3 || s.OpenFiles != 0 {
		t.Errorf("stats %+v, want 6 fds (root, /proc/self/fd, mount, three removed nodes)", s)
	}
	for _, id := range []uint64{f.NodeID, sub, victim.NodeID} {
		e.fs.Forget(id, 1<<30) // all its lookups, READDIRPLUS's included
	}
	if s := e.fs.Stats(); s.Fds != 3 {
		t.Errorf("stats %+v after forgetting the removed nodes, want 3 fds", s)
	}
}

// TestFileHandlesStale: a node whose file is gone answers ESTALE; a new file that got the same
// inode number is a new node, not the old one.
func TestFileHandlesStale(t *testing.T) {
	needRoot(t)
	e := newEnv(t, Options{FileHandles: FileHandlesMandatory})
	must(t, os.WriteFile(e.path("f"), []byte("old"), 0o644))
	old := e.lookup(t, 1, "f")
	must(t, os.Remove(e.path("f")))
	var ao fuse.AttrOut
	wantErrno(t, "getattr of a removed file", e.fs.GetAttr(rootCtx, old.NodeID, &fuse.GetattrIn{}, &ao), unix.ESTALE)
	var oo fuse.OpenOut
	wantErrno(t, "open of a removed file", e.fs.Open(rootCtx, old.NodeID, &fuse.OpenIn{Flags: unix.O_RDONLY}, &oo), unix.ESTALE)

	// ext4 hands the freed inode number to the next file; with another generation, so
	// another handle.
	must(t, os.WriteFile(e.path("f"), []byte("new!"), 0o644))
	cur := e.lookup(t, 1, "f")
	if cur.NodeID == old.NodeID {
		t.Fatalf("the new file got the stale node %d", old.NodeID)
	}
	if a := e.getattr(t, cur.NodeID); a.Size != 4 {
		t.Errorf("new file: size %d", a.Size)
	}
	t.Logf("inode numbers: old %d, new %d", old.Attr.Ino, cur.Attr.Ino)
	// Forgetting the stale node leaves the new one reachable by key.
	e.fs.Forget(old.NodeID, 1)
	if again := e.lookup(t, 1, "f"); again.NodeID != cur.NodeID {
		t.Errorf("lookup after forgetting the stale node: node %d, want %d", again.NodeID, cur.NodeID)
	}
}

// mountOn mounts a file system of type typ on dir for the test.
func mountOn(t *testing.T, typ, dir string) {
	t.Helper()
	must(t, os.Mkdir(dir, 0o755))
	must(t, unix.Mount(typ, dir, typ, unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""))
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
}

// TestFileHandlesSubmounts: a tmpfs mounted in the share gets a mount descriptor of its own;
// procfs has no file handles, so prefer falls back to descriptors there and mandatory
// refuses its files.
func TestFileHandlesSubmounts(t *testing.T) {
	needRoot(t)
	for _, mode := range []FileHandleMode{FileHandlesPrefer, FileHandlesMandatory} {
		t.Run(mode.String(), func(t *testing.T) {
			e := newEnv(t, Options{FileHandles: mode})
			mountOn(t, "tmpfs", e.path("tmp"))
			mountOn(t, "proc", e.path("proc"))
			must(t, os.WriteFile(e.path("tmp", "f"), []byte("x"), 0o644))

			tmp := e.lookup(t, 1, "tmp")
			wantHandle(t, e, tmp.NodeID, true)
			f := e.lookup(t, tmp.NodeID, "f")
			wantHandle(t, e, f.NodeID, true)
			if a := e.getattr(t, f.NodeID); a.Size != 1 {
				t.Errorf("size %d", a.Size)
			}
			if s := e.fs.Stats(); s.Fds != 4 {
				t.Errorf("stats %+v, want 4 fds (root, /proc/self/fd, two mounts)", s)
			}

			var out fuse.EntryOut
			errno := e.fs.Lookup(rootCtx, 1, "proc", &out)
			if mode == FileHandlesMandatory {
				wantErrno(t, "lookup of a procfs mount point", errno, unix.EOPNOTSUPP)
				return
			}
			wantErrno(t, "lookup of a procfs mount point", errno, 0)
			wantHandle(t, e, out.NodeID, false)
			self := e.lookup(t, out.NodeID, "self")
			wantHandle(t, e, self.NodeID, false)
			if a := e.getattr(t, self.NodeID); a.Mode&unix.S_IFMT != unix.S_IFLNK {
				t.Errorf("/proc/self mode %o", a.Mode)
			}
		})
	}
}

// TestFileHandlesNew: mandatory handles on a file system without them fail at New, with the
// reason; prefer serves it with descriptors.
func TestFileHandlesNew(t *testing.T) {
	needRoot(t)
	dir := filepath.Join(t.TempDir(), "proc")
	mountOn(t, "proc", dir)
	_, err := New(dir, Options{FileHandles: FileHandlesMandatory})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("inode file handles are mandatory, but the file system of")) {
		t.Fatalf("New(procfs, mandatory) = %v", err)
	}
	fs, err := New(dir, Options{FileHandles: FileHandlesPrefer})
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	var out fuse.EntryOut
	wantErrno(t, "lookup", fs.Lookup(rootCtx, 1, "self", &out), 0)
	if s := fs.Stats(); s.Fds != 3 {
		t.Errorf("stats %+v, want 3 fds (root, /proc/self/fd, self)", s)
	}
}

func TestParseFileHandleMode(t *testing.T) {
	for _, m := range []FileHandleMode{FileHandlesNever, FileHandlesPrefer, FileHandlesMandatory} {
		if got, err := ParseFileHandleMode(m.String()); err != nil || got != m {
			t.Errorf("ParseFileHandleMode(%q) = %v, %v", m, got, err)
		}
	}
	if _, err := ParseFileHandleMode("always"); err == nil {
		t.Error("ParseFileHandleMode(always) succeeded")
	}
}

// TestNodeTableHashCollision: two keys with one keyHash (so one home and tag in the index) in
// one shard stay two nodes.
func TestNodeTableHashCollision(t *testing.T) {
	var fds atomic.Int64
	var tab nodeTable
	tab.init(&inode{key: nodeKey{ino: 1}}, &fds)
	c := uint64(0x9e3779b97f4a7c15) // keyHash's factor of dev
	var k1, k2 nodeKey
	for a := uint64(100); ; a++ {
		k1 = nodeKey{dev: 1, ino: a}
		k2 = nodeKey{dev: 2, ino: a ^ c ^ 2*c}
		if shardOf(k1) == shardOf(k2) {
			break
		}
	}
	if k1 == k2 || keyHash(k1) != keyHash(k2) {
		t.Fatalf("keys %+v and %+v: hashes %x, %x", k1, k2, keyHash(k1), keyHash(k2))
	}
	id1, _, _, _ := tab.insert(k1, -1, nil, unix.S_IFREG)
	id2, _, _, _ := tab.insert(k2, -1, nil, unix.S_IFREG)
	if id1 == id2 {
		t.Fatalf("both keys got node %d", id1)
	}
	if again, _, took, _ := tab.insert(k2, -1, nil, unix.S_IFREG); again != id2 || took {
		t.Errorf("k2 again: node %d (took %v), want %d", again, took, id2)
	}
	if again, _, _, _ := tab.insert(k1, -1, nil, unix.S_IFREG); again != id1 {
		t.Errorf("k1 again: node %d, want %d", again, id1)
	}
	tab.forget(id1, 2)
	if again, _, _, _ := tab.insert(k2, -1, nil, unix.S_IFREG); again != id2 {
		t.Errorf("k2 after k1 left: node %d, want %d", again, id2)
	}
	id3, _, took, _ := tab.insert(k1, -1, nil, unix.S_IFREG)
	if !took || id3 == id1 || id3 == id2 {
		t.Errorf("k1 back: node %d (new %v), want a new one", id3, took)
	}
	tab.forget(id2, 3)
	tab.forget(id3, 1)
	s := &tab.shards[shardOf(k1)]
	for _, id := range []uint64{id1, id2, id3} {
		if n := s.lookup(id); n != nil {
			t.Errorf("node %d still in its slot", id)
		}
	}
	if s.indexed != 0 || tab.count.Load() != 0 {
		t.Errorf("after forgetting everything: %d keys, count %d", s.indexed, tab.count.Load())
	}
}
