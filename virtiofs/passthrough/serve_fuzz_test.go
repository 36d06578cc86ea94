package passthrough

import (
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/kvfs/kvfs/internal/testing/fusecheck"
	"github.com/kvfs/kvfs/internal/testing/fuzzseed"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// FuzzPassthrough drives the file system through the FUSE core with a fuzzed session: the
// input is a sequence of requests, each as long as its header's len says (the last takes what
// is left). So that a session reaches past its first LOOKUP, a node id below 2^16 is taken as
// an index into the nodes the server answered so far (the root first), in the header and in
// the arguments that name a node (LINK, RENAME, COPY_FILE_RANGE, BATCH_FORGET), and a file
// handle below 2^16 as an index into the handles it opened; the reply room is the low 16 bits
// of the unique plus the header. SETLKW is sent as SETLK (a wait would block
// Handle for as long as the lock is held).
//
// Invariants: no handler panics; every reply is well formed (length header equal to the bytes
// written, the request's unique, a negative errno with no body, or nothing for the requests
// without a reply); nothing outside the share changes (the directory holding it, and the canary
// directory next to it); and once the session
// is destroyed and the file system closed, it holds no descriptor. The share is on a tmpfs of
// 16 MiB, so that no request can fill the host's disk.
func FuzzPassthrough(f *testing.F) {
	needRoot(f)
	base := filepath.Join(f.TempDir(), "tmpfs")
	must(f, os.Mkdir(base, 0o755))
	if err := unix.Mount("kvfs-fuzz", base, "tmpfs", 0, "size=16m"); err != nil {
		f.Skipf("mounting a tmpfs: %v", err)
	}
	f.Cleanup(func() { unix.Unmount(base, unix.MNT_DETACH) })
	quiet := logrus.New()
	quiet.SetOutput(io.Discard)
	f.Fuzz(func(t *testing.T, data []byte) { servePassthrough(t, base, logrus.NewEntry(quiet), data) })
}

// fhAtStart are the opcodes whose arguments start with a file handle.
var fhAtStart = map[fuse.Opcode]bool{
	fuse.OpRead: true, fuse.OpWrite: true, fuse.OpRelease: true, fuse.OpReleasedir: true,
	fuse.OpFlush: true, fuse.OpFsync: true, fuse.OpFsyncdir: true, fuse.OpReaddir: true,
	fuse.OpReaddirplus: true, fuse.OpFallocate: true, fuse.OpLseek: true, fuse.OpGetlk: true,
	fuse.OpSetlk: true, fuse.OpCopyFileRange: true,
}

// maxFuzzRequests bounds a session.
const maxFuzzRequests = 64

func servePassthrough(t *testing.T, base string, logger *logrus.Entry, data []byte) {
	dir, err := os.MkdirTemp(base, "run")
	must(t, err)
	defer os.RemoveAll(dir)
	share, outside := filepath.Join(dir, "share"), filepath.Join(dir, "outside")
	for _, d := range []string{share, outside, filepath.Join(share, "d")} {
		must(t, os.Mkdir(d, 0o755))
	}
	must(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("never through the server"), 0o644))
	must(t, os.WriteFile(filepath.Join(share, "f"), []byte("file data"), 0o644))
	must(t, os.WriteFile(filepath.Join(share, "d", "g"), nil, 0o644))
	must(t, os.Symlink("../outside/secret", filepath.Join(share, "l")))
	must(t, os.Symlink("..", filepath.Join(share, "d", "up")))
	must(t, unix.Mkfifo(filepath.Join(share, "p"), 0o644))
	// What an escape would change: the directory holding the share, and the one next to it.
	watch := func() string {
		var st unix.Stat_t
		must(t, unix.Lstat(dir, &st))
		return fmt.Sprintf("%s mode=%o uid=%d gid=%d nlink=%d mtime=%d.%d\n%s", dir, st.Mode, st.Uid, st.Gid,
			st.Nlink, st.Mtim.Sec, st.Mtim.Nsec, snapshot(t, outside))
	}
	before := watch()

	fs, err := New(share, Options{Xattr: true})
	must(t, err)
	s := fuse.NewServer(fs, fuse.Options{Logger: logger,
		InitFlags: fuse.InitDoReaddirplus | fuse.InitPosixLocks | fuse.InitFlockLocks | fuse.InitSetxattrExt})
	init := fuse.InitIn{Major: fuse.KernelVersion, Minor: fuse.KernelMinorVersion,
		Flags: fuse.InitDoReaddirplus | fuse.InitPosixLocks | fuse.InitFlockLocks}
	c := fuseclient.New(nil)
	s.Handle([][]byte{c.Encode(fuse.OpInit, 0, fuse.AsBytes(&init))}, [][]byte{make([]byte, 128)})

	nodes, fhs := []uint64{fuse.RootID}, []uint64{}
	var hdr fuse.InHeader
	hsize := int(unsafe.Sizeof(hdr))
	for rest, i := data, 0; len(rest) >= hsize && i < maxFuzzRequests; i++ {
		n := int(binary.LittleEndian.Uint32(rest))
		if n < hsize || n > len(rest) {
			n = len(rest)
		}
		req := append([]byte(nil), rest[:n]...)
		rest = rest[n:]
		copy(fuse.AsBytes(&hdr), req)
		if hdr.NodeID < 1<<16 {
			hdr.NodeID = nodes[hdr.NodeID%uint64(len(nodes))]
		}
		op := fuse.Opcode(hdr.Opcode)
		if op == fuse.OpSetlkw {
			op, hdr.Opcode = fuse.OpSetlk, uint32(fuse.OpSetlk)
		}
		copy(req, fuse.AsBytes(&hdr))
		args := req[hsize:]
		index := func(off int, ids []uint64) {
			if len(ids) > 0 && len(args) >= off+8 {
				if v := binary.LittleEndian.Uint64(args[off:]); v < 1<<16 {
					binary.LittleEndian.PutUint64(args[off:], ids[v%uint64(len(ids))])
				}
			}
		}
		if fhAtStart[op] {
			index(0, fhs)
		}
		switch op {
		case fuse.OpLink, fuse.OpRename, fuse.OpRename2:
			index(0, nodes) // the old node, the new parent
		case fuse.OpCopyFileRange:
			index(16, nodes)
			index(24, fhs)
		case fuse.OpBatchForget:
			for off := 8; off+16 <= len(args); off += 16 {
				index(off, nodes)
			}
		}
		out := make([]byte, 16+int(hdr.Unique&0xffff))
		written := s.Handle([][]byte{req}, [][]byte{out})
		body, err := fusecheck.Reply(req, out, written, func(e unix.Errno) bool { return unix.ErrnoName(e) != "" })
		if err != nil {
			t.Fatal(err)
		}
		if body == nil {
			continue
		}
		var entry fuse.EntryOut
		var open fuse.OpenOut
		switch op {
		case fuse.OpLookup, fuse.OpMkdir, fuse.OpMknod, fuse.OpSymlink, fuse.OpLink:
			copy(fuse.AsBytes(&entry), body)
			nodes = append(nodes, entry.NodeID)
		case fuse.OpCreate, fuse.OpTmpfile:
			copy(fuse.AsBytes(&entry), body)
			copy(fuse.AsBytes(&open), body[len(fuse.AsBytes(&entry)):])
			nodes, fhs = append(nodes, entry.NodeID), append(fhs, open.Fh)
		case fuse.OpOpen, fuse.OpOpendir:
			copy(fuse.AsBytes(&open), body)
			fhs = append(fhs, open.Fh)
		case fuse.OpReaddirplus:
			ents, err := fuseclient.ParseDirents(body, true)
			if err != nil {
				t.Fatalf("READDIRPLUS reply: %v", err)
			}
			for _, e := range ents {
				if e.Entry.NodeID != 0 {
					nodes = append(nodes, e.Entry.NodeID)
				}
			}
		}
	}
	s.Handle([][]byte{c.Encode(fuse.OpDestroy, 0)}, [][]byte{make([]byte, 16)})
	if p := s.Stats().Panics; p != 0 {
		t.Fatalf("%d handler panics", p)
	}
	fs.Close()
	if st := fs.Stats(); st.Fds != 0 || st.OpenFiles != 0 {
		t.Fatalf("after DESTROY and Close: %+v, want no descriptor", st)
	}
	if after := watch(); after != before {
		t.Fatalf("ESCAPE: outside the share changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// passthroughSeeds are the seed corpus in testdata/fuzz/FuzzPassthrough, by file name: the
// sessions a Linux guest runs, and hostile ones. Node ids and handles are indexes (see
// FuzzPassthrough): 0 is the root, then each node in the order the replies gave them.
func passthroughSeeds() map[string][]byte {
	c := fuseclient.New(nil)
	name := func(s string) []byte { return append([]byte(s), 0) }
	seq := func(reqs ...[]byte) []byte {
		var b []byte
		for _, r := range reqs {
			b = append(b, r...)
		}
		return b
	}
	// Reply room: the unique's low 16 bits; Encode numbers requests 1, 2...: set it.
	room := func(req []byte, n uint16) []byte {
		binary.LittleEndian.PutUint64(req[8:], uint64(n))
		return req
	}
	read := fuse.ReadIn{Fh: 0, Size: 4096}
	return map[string][]byte{
		"read-file": seq(room(c.Encode(fuse.OpLookup, 0, name("f")), 200),
			room(c.Encode(fuse.OpOpen, 1, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})), 64),
			room(c.Encode(fuse.OpRead, 1, fuse.AsBytes(&read)), 4096),
			room(c.Encode(fuse.OpWrite, 1, fuse.AsBytes(&fuse.WriteIn{Size: 5, Offset: 3}), []byte("hello")), 64),
			room(c.Encode(fuse.OpSetattr, 1, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrSize, Size: 4})), 200),
			room(c.Encode(fuse.OpFlush, 1, make([]byte, 24)), 64),
			room(c.Encode(fuse.OpRelease, 1, make([]byte, 24)), 64),
			c.Encode(fuse.OpForget, 1, fuse.AsBytes(&fuse.ForgetIn{Nlookup: 1}))),
		"create-tree": seq(room(c.Encode(fuse.OpMkdir, 0, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), name("new")), 200),
			room(c.Encode(fuse.OpCreate, 1, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), name("c")), 300),
			room(c.Encode(fuse.OpSymlink, 1, name("s"), name("../../outside/secret")), 200),
			room(c.Encode(fuse.OpReadlink, 3), 200),
			room(c.Encode(fuse.OpLink, 1, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: 2}), name("hard")), 200),
			room(c.Encode(fuse.OpRename, 1, fuse.AsBytes(&fuse.RenameIn{Newdir: 0}), name("hard"), name("moved")), 64),
			room(c.Encode(fuse.OpRename2, 1, fuse.AsBytes(&fuse.Rename2In{Newdir: 0, Flags: unix.RENAME_EXCHANGE}), name("c"), name("f")), 64),
			room(c.Encode(fuse.OpUnlink, 1, name("s")), 64),
			room(c.Encode(fuse.OpRmdir, 0, name("new")), 64)),
		"list-dirs": seq(room(c.Encode(fuse.OpLookup, 0, name("d")), 200),
			room(c.Encode(fuse.OpOpendir, 1, fuse.AsBytes(&fuse.OpenIn{})), 64),
			room(c.Encode(fuse.OpReaddirplus, 1, fuse.AsBytes(&read)), 4096),
			room(c.Encode(fuse.OpReaddir, 1, fuse.AsBytes(&fuse.ReadIn{Offset: 1, Size: 100})), 100),
			room(c.Encode(fuse.OpLookup, 1, name("up")), 200),
			room(c.Encode(fuse.OpReleasedir, 1, make([]byte, 24)), 64),
			c.Encode(fuse.OpBatchForget, 0, fuse.AsBytes(&fuse.BatchForgetIn{Count: 2}),
				fuse.AsBytes(&fuse.ForgetOne{NodeID: 1, Nlookup: 1}), fuse.AsBytes(&fuse.ForgetOne{NodeID: 2, Nlookup: 5}))),
		"xattrs": seq(room(c.Encode(fuse.OpLookup, 0, name("f")), 200),
			room(c.Encode(fuse.OpSetxattr, 1, fuse.AsBytes(&fuse.SetxattrIn{Size: 1})[:8], name("user.a"), []byte("v")), 64),
			room(c.Encode(fuse.OpListxattr, 1, fuse.AsBytes(&fuse.GetxattrIn{Size: 0})), 64),
			room(c.Encode(fuse.OpGetxattr, 1, fuse.AsBytes(&fuse.GetxattrIn{Size: 0}), name("user.a")), 64),
			room(c.Encode(fuse.OpListxattr, 1, fuse.AsBytes(&fuse.GetxattrIn{Size: 2})), 64),
			room(c.Encode(fuse.OpRemovexattr, 1, name("trusted.kvfs.dax")), 64)),
		"locks": seq(room(c.Encode(fuse.OpLookup, 0, name("f")), 200),
			room(c.Encode(fuse.OpOpen, 1, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})), 64),
			room(c.Encode(fuse.OpSetlk, 1, fuse.AsBytes(&fuse.LkIn{Owner: 1, Lk: fuse.FileLock{End: 10, Type: unix.F_WRLCK}})), 64),
			room(c.Encode(fuse.OpSetlkw, 1, fuse.AsBytes(&fuse.LkIn{Owner: 2, Lk: fuse.FileLock{End: 10, Type: unix.F_RDLCK}})), 64),
			room(c.Encode(fuse.OpGetlk, 1, fuse.AsBytes(&fuse.LkIn{Owner: 2, Lk: fuse.FileLock{End: 10, Type: unix.F_WRLCK}})), 64),
			room(c.Encode(fuse.OpSetlk, 1, fuse.AsBytes(&fuse.LkIn{Owner: 3, LkFlags: fuse.LkFlock, Lk: fuse.FileLock{Type: unix.F_WRLCK}})), 64)),
		"escapes": seq(room(c.Encode(fuse.OpLookup, 0, name("..")), 200),
			room(c.Encode(fuse.OpLookup, 0, name("l")), 200),
			room(c.Encode(fuse.OpOpen, 1, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})), 64),
			room(c.Encode(fuse.OpSetattr, 1, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o777})), 200),
			room(c.Encode(fuse.OpLookup, 0, name("p")), 200),
			room(c.Encode(fuse.OpOpen, 2, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDONLY})), 64),
			room(c.Encode(fuse.OpRename, 0, fuse.AsBytes(&fuse.RenameIn{Newdir: 0}), name("f"), name("../outside/f")), 64),
			room(c.Encode(fuse.OpMknod, 0, fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFCHR | 0o666, Rdev: 0x103}), name("null")), 200)),
		"big-requests": seq(room(c.Encode(fuse.OpLookup, 0, name("f")), 200),
			room(c.Encode(fuse.OpOpen, 1, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})), 64),
			room(c.Encode(fuse.OpFallocate, 1, fuse.AsBytes(&fuse.FallocateIn{Length: 1 << 40})), 64),
			room(c.Encode(fuse.OpCopyFileRange, 1, fuse.AsBytes(&fuse.CopyFileRangeIn{NodeIDOut: 1, OffOut: 1 << 20, Len: 1 << 30})), 64),
			room(c.Encode(fuse.OpLseek, 1, fuse.AsBytes(&fuse.LseekIn{Offset: 1 << 62, Whence: unix.SEEK_HOLE})), 64)),
	}
}

var updatePassthroughSeeds = flag.Bool("update-passthrough-seeds", false,
	"rewrite testdata/fuzz/FuzzPassthrough from passthroughSeeds")

// TestFuzzPassthroughSeedCorpus keeps the seed files in testdata in sync with passthroughSeeds;
// run with -update-passthrough-seeds to rewrite them. Files not generated (crashers kept as
// regression seeds) are left alone.
func TestFuzzPassthroughSeedCorpus(t *testing.T) {
	files := map[string]string{}
	for name, b := range passthroughSeeds() {
		files[name] = fuzzseed.Bytes(b)
	}
	fuzzseed.Check(t, "FuzzPassthrough", files, *updatePassthroughSeeds, "go test -run TestFuzzPassthroughSeedCorpus -update-passthrough-seeds")
}
