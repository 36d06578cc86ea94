package virtiofs_test

// Hostile guests at the FUSE level: forged requests in well-formed chains, a guest that
// exhausts the host's descriptors, one that races renames with lookups to reach outside the
// share, FORGET storms, lock floods with interrupted waits, xattrs at the kernel's size limits.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// ---------------------------------------------------------------------------------------------
// FUSE level: well-formed chains carrying forged requests.

type fuseRig struct {
	h  *hostileShare
	hs *hostileServer
	g  *hostileGuest
}

func newFuseRig(t *testing.T) *fuseRig {
	t.Helper()
	h := newHostileShare(t)
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share, Xattr: true})
	g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize})
	return &fuseRig{h: h, hs: hs, g: g}
}

// after is the end of every FUSE case: the server still serves the same queue normally and
// nothing outside the share changed.
func (r *fuseRig) after(t *testing.T) {
	t.Helper()
	r.hs.stillServing(t)
	r.g.healthy(t)
	r.h.check(t)
}

// nameOps are the requests taking a file name, with the name bytes (terminator included, or
// not) placed where the name goes.
func hostileNameOps(dirNode, fileNode uint64) map[string]func(name []byte) (fuse.Opcode, uint64, [][]byte) {
	return map[string]func([]byte) (fuse.Opcode, uint64, [][]byte){
		"LOOKUP": func(n []byte) (fuse.Opcode, uint64, [][]byte) { return fuse.OpLookup, dirNode, [][]byte{n} },
		"MKDIR": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpMkdir, dirNode, [][]byte{fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), n}
		},
		"MKNOD": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpMknod, dirNode, [][]byte{fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFREG | 0o644}), n}
		},
		"CREATE": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpCreate, dirNode, [][]byte{fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), n}
		},
		"SYMLINK name": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpSymlink, dirNode, [][]byte{n, fuseName("target")}
		},
		"UNLINK": func(n []byte) (fuse.Opcode, uint64, [][]byte) { return fuse.OpUnlink, dirNode, [][]byte{n} },
		"RMDIR":  func(n []byte) (fuse.Opcode, uint64, [][]byte) { return fuse.OpRmdir, dirNode, [][]byte{n} },
		"RENAME old name": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpRename, dirNode, [][]byte{fuse.AsBytes(&fuse.RenameIn{Newdir: dirNode}), n, fuseName("renamed")}
		},
		"RENAME new name": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpRename, dirNode, [][]byte{fuse.AsBytes(&fuse.RenameIn{Newdir: dirNode}), fuseName("file"), n}
		},
		"RENAME2 EXCHANGE new name": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpRename2, dirNode, [][]byte{
				fuse.AsBytes(&fuse.Rename2In{Newdir: dirNode, Flags: unix.RENAME_EXCHANGE}), fuseName("file"), n}
		},
		"LINK": func(n []byte) (fuse.Opcode, uint64, [][]byte) {
			return fuse.OpLink, dirNode, [][]byte{fuse.AsBytes(&fuse.LinkIn{Oldnodeid: fileNode}), n}
		},
	}
}

func TestHostileFUSE(t *testing.T) {
	hostileNeedsRoot(t)
	r := newFuseRig(t)
	g, h := r.g, r.h

	t.Run("names", func(t *testing.T) {
		dir := g.lookup(t, fuse.RootID, "dir").NodeID
		for _, parent := range []uint64{fuse.RootID, dir} {
			file := g.lookup(t, parent, map[uint64]string{fuse.RootID: "file", dir: "inner"}[parent]).NodeID
			bad := map[string][]byte{
				"empty":                 fuseName(""),
				".":                     fuseName("."),
				"..":                    fuseName(".."),
				"a/b":                   fuseName("a/b"),
				"/":                     fuseName("/"),
				"../outside/secret":     fuseName("../outside/secret"),
				"/etc/passwd":           fuseName("/etc/passwd"),
				"256 bytes":             fuseName(strings.Repeat("n", 256)),
				"4096 bytes":            fuseName(strings.Repeat("n", 4096)),
				"missing NUL":           []byte("file"),
				"missing NUL, 256 long": bytes.Repeat([]byte("n"), 256),
				"NUL first":             []byte("\x00file\x00"),
				"../ with embedded NUL": []byte("..\x00xyz\x00"),
			}
			// What Linux answers for "." and ".." as the last component of each call (LOOKUP:
			// refused, the guest resolves them itself).
			dots := map[string][2]unix.Errno{
				"LOOKUP": {unix.EINVAL, unix.EINVAL}, "MKDIR": {unix.EEXIST, unix.EEXIST},
				"MKNOD": {unix.EEXIST, unix.EEXIST}, "CREATE": {unix.EISDIR, unix.EISDIR},
				"SYMLINK name": {unix.EEXIST, unix.EEXIST}, "UNLINK": {unix.EISDIR, unix.EISDIR},
				"RMDIR": {unix.EINVAL, unix.ENOTEMPTY}, "RENAME old name": {unix.EBUSY, unix.EBUSY},
				"RENAME new name": {unix.EBUSY, unix.EBUSY}, "RENAME2 EXCHANGE new name": {unix.EBUSY, unix.EBUSY},
				"LINK": {unix.EEXIST, unix.EEXIST},
			}
			want := func(op, what string) []unix.Errno {
				switch what {
				case "empty", "NUL first":
					return []unix.Errno{unix.ENOENT}
				case "256 bytes", "4096 bytes":
					return []unix.Errno{unix.ENAMETOOLONG}
				case ".":
					return []unix.Errno{dots[op][0]}
				case "..", "../ with embedded NUL":
					return []unix.Errno{dots[op][1]}
				case "missing NUL", "missing NUL, 256 long":
					// The next string of the request (SYMLINK's target, RENAME's new name)
					// then ends the name, too long or not.
					return []unix.Errno{unix.EINVAL, unix.ENAMETOOLONG}
				}
				return []unix.Errno{unix.EINVAL} // a '/'
			}
			for op, build := range hostileNameOps(parent, file) {
				if _, ok := dots[op]; !ok {
					t.Fatalf("no answers for . and .. of %s", op)
				}
				for what, name := range bad {
					o, node, args := build(name)
					_, err := g.call(t, o, node, args...)
					expectErrno(t, fmt.Sprintf("%s(%d, %s)", op, parent, what), err, want(op, what)...)
				}
			}
			// 255 bytes is a valid name.
			_, err := g.call(t, fuse.OpLookup, parent, fuseName(strings.Repeat("n", 255)))
			expectErrno(t, "LOOKUP of a 255-byte name", err, unix.ENOENT)
		}
		// An embedded NUL ends the name: what follows must be ignored, never used.
		body, err := g.call(t, fuse.OpLookup, fuse.RootID, []byte("file\x00/../../outside/secret\x00"))
		if err == nil {
			if e := decodeEntryOut(t, body); e.Attr.Size != uint64(len(shareFileContent)) {
				t.Errorf("LOOKUP file\\0...: entry of size %d", e.Attr.Size)
			}
		} else {
			expectErrno(t, "LOOKUP with an embedded NUL", err, unix.EINVAL)
		}
		_, err = g.call(t, fuse.OpMkdir, fuse.RootID, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), []byte("nul-dir\x00/../../evil\x00"))
		if err == nil {
			if st, serr := os.Lstat(filepath.Join(h.share, "nul-dir")); serr != nil || !st.IsDir() {
				t.Errorf("MKDIR nul-dir\\0...: OK but no directory nul-dir in the share: %v", serr)
			}
			os.Remove(filepath.Join(h.share, "nul-dir"))
		} else {
			expectErrno(t, "MKDIR with an embedded NUL", err, unix.EINVAL)
		}
		// A symlink target is data, never followed: any target may be stored.
		_, err = g.call(t, fuse.OpSymlink, fuse.RootID, fuseName("lnk"), []byte("no terminator"))
		expectErrno(t, "SYMLINK target without NUL", err, unix.EINVAL)
		_, err = g.call(t, fuse.OpSymlink, fuse.RootID, fuseName("lnk"), fuseName(strings.Repeat("t", 4097)))
		expectErrno(t, "SYMLINK target longer than PATH_MAX", err, unix.ENAMETOOLONG)
		ents, err := os.ReadDir(h.share)
		hostileMust(t, err)
		for _, e := range ents {
			switch e.Name() {
			case "file", "big", "dir", "fifo", "etc", "upup", "up", "out", "sec", "abs":
			default:
				t.Errorf("unexpected entry %q in the share after the bad names", e.Name())
			}
		}
		r.after(t)
	})

	t.Run("headers", func(t *testing.T) {
		lookup := func() []byte { return g.c.Encode(fuse.OpLookup, fuse.RootID, fuseName("file")) }
		setLen := func(req []byte, n uint32) []byte { binary.LittleEndian.PutUint32(req[0:], n); return req }
		setExt := func(req []byte, n uint16) []byte { binary.LittleEndian.PutUint16(req[36:], n); return req }
		for what, req := range map[string][]byte{
			"len beyond the buffers":     setLen(lookup(), 40+5+1),
			"len 2^32-1":                 setLen(lookup(), math.MaxUint32),
			"len smaller than a header":  setLen(lookup(), 39),
			"len 0":                      setLen(lookup(), 0),
			"total_extlen past the end":  setExt(lookup(), 1),
			"total_extlen 0xffff":        setExt(lookup(), math.MaxUint16),
			"total_extlen eating a name": setExt(setLen(append(lookup(), make([]byte, 3)...), 48), 1),
		} {
			_, err := g.send(t, 1, req, 4096)
			expectErrno(t, what, err, unix.EINVAL)
		}
		// Extensions that fit are skipped.
		req := append(g.c.Encode(fuse.OpLookup, fuse.RootID, []byte("file\x00\x00\x00\x00")), make([]byte, 8)...)
		req = setExt(setLen(req, uint32(len(req))), 1)
		body, err := g.send(t, 1, req, 4096)
		expectOK(t, "LOOKUP with one 8-byte extension", err)
		if err == nil {
			decodeEntryOut(t, body)
		}

		// Not even a header: there is no unique to answer to; nothing may be written.
		rep := g.submit(t, 1, [][]byte{lookup()[:20]}, []int{16, 4080})
		if rep.written != 0 {
			t.Errorf("truncated header: %d bytes written", rep.written)
		}
		rep = g.submit(t, 1, [][]byte{{}}, []int{16, 4080})
		if rep.written != 0 {
			t.Errorf("empty request: %d bytes written", rep.written)
		}
		// No room for the out header: nothing written, canaries intact.
		for _, w := range [][]int{{8}, {0}, {15}, {8, 7}} {
			rep := g.submit(t, 1, splitReq(lookup()), w)
			if rep.written != 0 {
				t.Errorf("writable %v: %d bytes written", w, rep.written)
			}
		}
		rep = g.submit(t, 1, splitReq(lookup()), nil)
		if rep.written != 0 {
			t.Errorf("no writable buffer: %d bytes written", rep.written)
		}
		// Room for the header but not the body: ERANGE, header only.
		for _, w := range [][]int{{16}, {8, 8}, {16, 16}, {32, 8}, {1, 2, 3, 4, 5, 6}} {
			req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
			_, err := g.submit(t, 1, splitReq(req), w).parse(uniqueOf(req))
			expectErrno(t, fmt.Sprintf("GETATTR into %v bytes", w), err, unix.ERANGE)
		}
		// A request and a reply scattered over many tiny buffers is still a valid request.
		req = g.c.Encode(fuse.OpLookup, fuse.RootID, fuseName("file"))
		var pieces [][]byte
		for i := range req {
			pieces = append(pieces, req[i:i+1])
		}
		var tiny []int
		for range 200 {
			tiny = append(tiny, 7)
		}
		body, err = g.submit(t, 1, pieces, tiny).parse(uniqueOf(req))
		expectOK(t, "LOOKUP in 1-byte pieces, reply into 7-byte pieces", err)
		if err == nil && decodeEntryOut(t, body).Attr.Size != uint64(len(shareFileContent)) {
			t.Error("LOOKUP in pieces: wrong entry")
		}
		// Unknown and unimplemented opcodes.
		for _, op := range []fuse.Opcode{0, 7, 19, fuse.OpGetlk, fuse.OpSetlk, fuse.OpSetlkw, fuse.OpBmap,
			fuse.OpIoctl, fuse.OpPoll, fuse.OpNotifyReply, fuse.OpSetupmapping, fuse.OpRemovemapping,
			52, 63, 64, 1000, math.MaxUint32} {
			_, err := g.send(t, 1, g.c.Encode(op, fuse.RootID, make([]byte, 64)), 4096)
			expectErrno(t, fmt.Sprintf("opcode %d", op), err, unix.ENOSYS)
		}
		// INIT a guest cannot mean; none of them may reset the session.
		for what, c := range map[string]struct {
			in   []byte
			want unix.Errno
		}{
			"truncated": {make([]byte, 8), unix.EINVAL},
			"major 6":   {fuse.AsBytes(&fuse.InitIn{Major: 6, Minor: 31})[:16], unix.EPROTO},
			"minor 0":   {fuse.AsBytes(&fuse.InitIn{Major: 7})[:16], unix.EPROTO},
		} {
			_, err := g.send(t, 1, g.c.Encode(fuse.OpInit, 0, c.in), 4096)
			expectErrno(t, "INIT "+what, err, c.want)
		}
		// A newer major is answered with our version only, for the guest to retry.
		body, err = g.send(t, 1, g.c.Encode(fuse.OpInit, 0,
			fuse.AsBytes(&fuse.InitIn{Major: math.MaxUint32, Minor: math.MaxUint32})), 4096)
		if err != nil || len(body) != 8 || binary.LittleEndian.Uint32(body) != fuse.KernelVersion {
			t.Errorf("INIT major 2^32-1: body %x, %v; want the 8-byte version", body, err)
		}
		// A WRITE of more than the arguments may hold is refused before anything is copied.
		_, err = g.send(t, 1, setLen(g.c.Encode(fuse.OpGetattr, fuse.RootID, make([]byte, 200<<10)), 40+200<<10), 4096)
		expectErrno(t, "GETATTR with 200 KiB of arguments", err, unix.E2BIG)
		r.after(t)
	})

	t.Run("symlink escapes", func(t *testing.T) {
		secret := filepath.Join(h.outside, "secret")
		// Should a creation escape through the link to /etc, take the probe away again.
		t.Cleanup(func() {
			if err := os.RemoveAll(filepath.Join("/etc", escapeProbe)); err != nil {
				t.Log(err)
			}
		})
		for _, link := range []string{"etc", "upup", "up", "out", "sec", "abs"} {
			l := g.lookup(t, fuse.RootID, link)
			if l.Attr.Mode&unix.S_IFMT != unix.S_IFLNK {
				t.Fatalf("LOOKUP %s: mode %o, want a symlink node", link, l.Attr.Mode)
			}
			n := l.NodeID
			what := func(op string) string { return op + " through " + link }
			for _, name := range []string{"passwd", "secret", "outside", "root", "f", "share"} {
				_, err := g.call(t, fuse.OpLookup, n, fuseName(name))
				expectErrno(t, what("LOOKUP "+name), err, unix.ENOTDIR)
			}
			_, err := g.call(t, fuse.OpCreate, n, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), fuseName(escapeProbe))
			expectErrno(t, what("CREATE"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpMkdir, n, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), fuseName(escapeProbe))
			expectErrno(t, what("MKDIR"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpMknod, n, fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFREG | 0o644}), fuseName(escapeProbe))
			expectErrno(t, what("MKNOD"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpSymlink, n, fuseName(escapeProbe), fuseName("x"))
			expectErrno(t, what("SYMLINK"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpTmpfile, n, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}))
			expectErrno(t, what("TMPFILE"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpUnlink, n, fuseName("secret"))
			expectErrno(t, what("UNLINK"), err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpRmdir, n, fuseName("sub"))
			expectErrno(t, what("RMDIR"), err, unix.ENOTDIR)
			for _, flags := range []uint32{unix.O_RDONLY, unix.O_RDWR, unix.O_WRONLY | unix.O_TRUNC, unix.O_RDONLY | unix.O_DIRECTORY} {
				_, err = g.call(t, fuse.OpOpen, n, fuse.AsBytes(&fuse.OpenIn{Flags: flags}))
				expectErrno(t, what(fmt.Sprintf("OPEN %#o", flags)), err, unix.ELOOP)
			}
			_, err = g.call(t, fuse.OpOpendir, n, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_DIRECTORY}))
			expectErrno(t, what("OPENDIR"), err, unix.ENOTDIR)
			// Requests that change what they reach. Through the link to /etc they are left out,
			// so that a regression cannot damage the host: the links into the watched tree
			// take the same paths.
			if link != "etc" {
				_, err = g.call(t, fuse.OpSetattr, n, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o777}))
				expectErrno(t, what("SETATTR mode"), err, unix.EOPNOTSUPP)
				_, err = g.call(t, fuse.OpSetattr, n, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrSize}))
				expectErrno(t, what("SETATTR size 0"), err, unix.EINVAL)
				_, err = g.call(t, fuse.OpSetxattr, n, fuse.AsBytes(&fuse.SetxattrIn{Size: 4})[:8], fuseName("user.evil"), []byte("evil"))
				expectErrno(t, what("SETXATTR user.evil"), err, unix.EPERM)
				_, err = g.call(t, fuse.OpRemovexattr, n, fuseName("user.kvfs-test"))
				expectErrno(t, what("REMOVEXATTR"), err, unix.ENODATA, unix.EPERM, unix.EOPNOTSUPP)
				// Owner and times apply to the link itself, never to what it points to.
				_, err = g.call(t, fuse.OpSetattr, n, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID, UID: 777, GID: 777}))
				expectOK(t, what("SETATTR owner"), err)
				_, err = g.call(t, fuse.OpSetattr, n, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrMtime | fuse.FattrAtime, Mtime: 42, Atime: 42}))
				if err != nil {
					expectErrno(t, what("SETATTR times"), err, unix.EINVAL) // kernels without utimensat(AT_EMPTY_PATH)
				}
				var st unix.Stat_t
				hostileMust(t, unix.Lstat(filepath.Join(h.share, link), &st))
				if st.Uid != 777 || st.Gid != 777 {
					t.Errorf("%s: the link's owner is %d:%d, want 777:777", what("SETATTR owner"), st.Uid, st.Gid)
				}
			}
			// Reading the target's xattrs must not work either.
			body, err := g.call(t, fuse.OpGetxattr, n, fuse.AsBytes(&fuse.GetxattrIn{Size: 100}), fuseName("user.kvfs-test"))
			if err == nil {
				t.Errorf("%s: read the target's xattr %q", what("GETXATTR"), body)
			}
			target, err := g.call(t, fuse.OpReadlink, n)
			expectOK(t, what("READLINK"), err)
			if want, _ := os.Readlink(filepath.Join(h.share, link)); string(target) != want {
				t.Errorf("%s: %q, want %q", what("READLINK"), target, want)
			}
		}
		// CREATE over an existing symlink without O_EXCL must not open (and truncate) its target.
		for _, link := range []string{"sec", "etc", "out"} {
			_, err := g.call(t, fuse.OpCreate, fuse.RootID,
				fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR | unix.O_TRUNC, Mode: unix.S_IFREG | 0o644}), fuseName(link))
			expectErrno(t, "CREATE O_TRUNC over symlink "+link, err, unix.ELOOP)
		}
		// A hard link of a symlink node is a link to the symlink, never to its target.
		sec := g.lookup(t, fuse.RootID, "sec").NodeID
		_, err := g.call(t, fuse.OpLink, fuse.RootID, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: sec}), fuseName("hardlink-of-sec"))
		if err == nil {
			var st unix.Stat_t
			hostileMust(t, unix.Lstat(filepath.Join(h.share, "hardlink-of-sec"), &st))
			if st.Mode&unix.S_IFMT != unix.S_IFLNK {
				t.Errorf("ESCAPE: LINK of the symlink node sec made a hard link to its target (mode %o)", st.Mode)
			}
			os.Remove(filepath.Join(h.share, "hardlink-of-sec"))
		} else {
			t.Logf("LINK of a symlink node: %v", err)
		}
		if b, err := os.ReadFile(secret); err != nil || string(b) != secretContent {
			t.Errorf("ESCAPE: the secret outside now reads %q (%v)", b, err)
		}
		r.after(t)
	})

	t.Run("rename and link escapes", func(t *testing.T) {
		out := g.lookup(t, fuse.RootID, "out").NodeID
		up := g.lookup(t, fuse.RootID, "upup").NodeID
		file := g.lookup(t, fuse.RootID, "file").NodeID
		dir := g.lookup(t, fuse.RootID, "dir").NodeID
		for name, newdir := range map[string]uint64{"out": out, "upup": up} {
			_, err := g.call(t, fuse.OpRename, fuse.RootID, fuse.AsBytes(&fuse.RenameIn{Newdir: newdir}), fuseName("file"), fuseName("stolen"))
			expectErrno(t, "RENAME into symlink "+name, err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpRename2, fuse.RootID,
				fuse.AsBytes(&fuse.Rename2In{Newdir: newdir, Flags: unix.RENAME_NOREPLACE}), fuseName("file"), fuseName("stolen"))
			expectErrno(t, "RENAME2 into symlink "+name, err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpRename, newdir, fuse.AsBytes(&fuse.RenameIn{Newdir: fuse.RootID}), fuseName("secret"), fuseName("stolen"))
			expectErrno(t, "RENAME out of symlink "+name, err, unix.ENOTDIR)
			_, err = g.call(t, fuse.OpLink, newdir, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: file}), fuseName("planted"))
			expectErrno(t, "LINK into symlink "+name, err, unix.ENOTDIR)
		}
		for _, bad := range []uint64{0, 2, 0xdeadbeef, math.MaxUint64} {
			_, err := g.call(t, fuse.OpRename, fuse.RootID, fuse.AsBytes(&fuse.RenameIn{Newdir: bad}), fuseName("file"), fuseName("stolen"))
			expectErrno(t, fmt.Sprintf("RENAME to newdir %#x", bad), err, unix.EBADF)
			_, err = g.call(t, fuse.OpRename2, fuse.RootID, fuse.AsBytes(&fuse.Rename2In{Newdir: bad, Flags: unix.RENAME_EXCHANGE}), fuseName("file"), fuseName("dir"))
			expectErrno(t, fmt.Sprintf("RENAME2 EXCHANGE with newdir %#x", bad), err, unix.EBADF)
			_, err = g.call(t, fuse.OpLink, fuse.RootID, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: bad}), fuseName("planted"))
			expectErrno(t, fmt.Sprintf("LINK of node %#x", bad), err, unix.EBADF)
		}
		// Names that would walk: refused however they are combined (".." with rename(2)'s EBUSY).
		_, err := g.call(t, fuse.OpRename, dir, fuse.AsBytes(&fuse.RenameIn{Newdir: fuse.RootID}), fuseName("inner"), fuseName(".."))
		expectErrno(t, "RENAME to ..", err, unix.EBUSY)
		_, err = g.call(t, fuse.OpRename2, fuse.RootID, fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID, Flags: 1 << 7}), fuseName("file"), fuseName("x"))
		expectErrno(t, "RENAME2 with unknown flags", err, unix.EINVAL)
		_, err = g.call(t, fuse.OpLink, fuse.RootID, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: dir}), fuseName("dirlink"))
		expectErrno(t, "LINK of a directory", err, unix.EPERM)
		_, err = g.call(t, fuse.OpLink, fuse.RootID, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: fuse.RootID}), fuseName("rootlink"))
		expectErrno(t, "LINK of the root", err, unix.EPERM)
		// The root cannot be moved away or exchanged: it has no name in any node we hold.
		_, err = g.call(t, fuse.OpRename2, dir, fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID, Flags: unix.RENAME_EXCHANGE}), fuseName("inner"), fuseName("."))
		expectErrno(t, "RENAME2 EXCHANGE with .", err, unix.EBUSY)
		if b := h.hostFile(t, "file"); string(b) != shareFileContent {
			t.Errorf("share/file now %q", b)
		}
		r.after(t)
	})

	t.Run("special files", func(t *testing.T) {
		body, err := g.call(t, fuse.OpMknod, fuse.RootID,
			fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFCHR | 0o666, Rdev: uint32(unix.Mkdev(1, 3))}), fuseName("nulldev"))
		if err != nil {
			t.Fatalf("MKNOD a character device as root: %v", err)
		}
		dev := decodeEntryOut(t, body).NodeID
		fifo := g.lookup(t, fuse.RootID, "fifo").NodeID
		for name, n := range map[string]uint64{"device": dev, "fifo": fifo} {
			for _, flags := range []uint32{unix.O_RDONLY, unix.O_WRONLY, unix.O_RDWR | unix.O_NONBLOCK} {
				_, err := g.call(t, fuse.OpOpen, n, fuse.AsBytes(&fuse.OpenIn{Flags: flags}))
				expectErrno(t, fmt.Sprintf("OPEN %s %#o", name, flags), err, unix.ENXIO)
			}
			_, err := g.call(t, fuse.OpSetattr, n, fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrSize}))
			expectErrno(t, "SETATTR size of "+name, err, unix.EINVAL)
			_, err = g.call(t, fuse.OpOpendir, n, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_DIRECTORY}))
			expectErrno(t, "OPENDIR "+name, err, unix.ENOTDIR)
		}
		for _, name := range []string{"nulldev", "fifo"} {
			_, err := g.call(t, fuse.OpCreate, fuse.RootID, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), fuseName(name))
			expectErrno(t, "CREATE over "+name, err, unix.ENXIO)
		}
		file := g.lookup(t, fuse.RootID, "file").NodeID
		_, err = g.call(t, fuse.OpOpendir, file, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_DIRECTORY}))
		expectErrno(t, "OPENDIR of a file", err, unix.ENOTDIR)
		_, err = g.call(t, fuse.OpOpen, fuse.RootID, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR}))
		expectErrno(t, "OPEN of a directory", err, unix.EISDIR)
		os.Remove(filepath.Join(h.share, "nulldev"))
		r.after(t)
	})

	t.Run("huge READ", func(t *testing.T) {
		big := g.lookup(t, fuse.RootID, "big").NodeID
		fh := g.open(t, big, unix.O_RDONLY)
		read := func(off uint64, size uint32) []byte {
			return g.c.Encode(fuse.OpRead, big, fuse.AsBytes(&fuse.ReadIn{Fh: fh, Offset: off, Size: size}))
		}
		for _, w := range [][]int{{16, 4096}, {16, 100, 1, 300, 7}, {16}, {20}, {16, 1 << 20}, {4096}} {
			req := read(0, math.MaxUint32)
			rep := g.submit(t, 1, splitReq(req), w)
			body, err := rep.parse(uniqueOf(req))
			if err != nil {
				t.Errorf("READ 2^32-1 into %v: %v", w, err)
				continue
			}
			want := min(sumInts(w)-16, len(h.big), fuse.MaxWrite)
			if !bytes.Equal(body, h.big[:want]) {
				t.Errorf("READ 2^32-1 into %v: %d bytes, want the first %d of the file", w, len(body), want)
			}
		}
		for _, off := range []uint64{math.MaxInt64, math.MaxInt64 + 1, math.MaxUint64} {
			_, err := g.send(t, 1, read(off, math.MaxUint32), 4096)
			if err != nil {
				expectErrno(t, fmt.Sprintf("READ at %#x", off), err, unix.EINVAL, unix.EOVERFLOW)
			}
		}
		// Handles that are not this node's.
		dfh := g.opendir(t, fuse.RootID)
		file := g.lookup(t, fuse.RootID, "file").NodeID
		for what, req := range map[string][]byte{
			"a directory handle":     g.c.Encode(fuse.OpRead, fuse.RootID, fuse.AsBytes(&fuse.ReadIn{Fh: dfh, Size: 100})),
			"another file's handle":  g.c.Encode(fuse.OpRead, file, fuse.AsBytes(&fuse.ReadIn{Fh: fh, Size: 100})),
			"an unknown handle":      g.c.Encode(fuse.OpRead, big, fuse.AsBytes(&fuse.ReadIn{Fh: 0xdeadbeef, Size: 100})),
			"handle 0":               g.c.Encode(fuse.OpRead, big, fuse.AsBytes(&fuse.ReadIn{Size: 100})),
			"a directory's handle 2": g.c.Encode(fuse.OpReaddir, big, fuse.AsBytes(&fuse.ReadIn{Fh: fh, Size: 100})),
		} {
			_, err := g.send(t, 1, req, 4096)
			expectErrno(t, "READ with "+what, err, unix.EBADF)
		}
		_, err := g.send(t, 1, g.c.Encode(fuse.OpRead, big, make([]byte, 8)), 4096)
		expectErrno(t, "READ with truncated arguments", err, unix.EINVAL)
		r.after(t)
	})

	t.Run("huge WRITE claims", func(t *testing.T) {
		file := g.lookup(t, fuse.RootID, "file").NodeID
		fh := g.open(t, file, unix.O_RDWR)
		write := func(size uint32, off uint64, data []byte) []byte {
			return g.c.Encode(fuse.OpWrite, file, fuse.AsBytes(&fuse.WriteIn{Fh: fh, Offset: off, Size: size}), data)
		}
		data := []byte("0123456789")
		for what, c := range map[string]struct {
			req  []byte
			want []unix.Errno
		}{
			"size 2^32-1, 10 bytes":   {write(math.MaxUint32, 0, data), []unix.Errno{unix.EINVAL}},
			"size 20, 10 bytes":       {write(20, 0, data), []unix.Errno{unix.EINVAL}},
			"size 5, 10 bytes":        {write(5, 0, data), []unix.Errno{unix.EINVAL}},
			"size 10, no bytes":       {write(10, 0, nil), []unix.Errno{unix.EINVAL}},
			"size over MaxWrite":      {write(fuse.MaxWrite+1, 0, make([]byte, fuse.MaxWrite+1)), []unix.Errno{unix.EFBIG}},
			"offset 2^63":             {write(10, 1<<63, data), []unix.Errno{unix.EINVAL, unix.EFBIG}},
			"offset 2^64-5":           {write(10, math.MaxUint64-4, data), []unix.Errno{unix.EINVAL, unix.EFBIG}},
			"truncated WriteIn":       {g.c.Encode(fuse.OpWrite, file, make([]byte, 20)), []unix.Errno{unix.EINVAL}},
			"len beyond the buffers":  {func() []byte { b := write(10, 0, data); binary.LittleEndian.PutUint32(b, uint32(len(b)+100)); return b }(), []unix.Errno{unix.EINVAL}},
			"extlen eating the data":  {func() []byte { b := write(16, 0, make([]byte, 16)); binary.LittleEndian.PutUint16(b[36:], 1); return b }(), []unix.Errno{unix.EINVAL}},
			"unknown handle":          {g.c.Encode(fuse.OpWrite, file, fuse.AsBytes(&fuse.WriteIn{Fh: 0xdeadbeef, Size: 10}), data), []unix.Errno{unix.EBADF}},
			"handle of another node":  {g.c.Encode(fuse.OpWrite, fuse.RootID, fuse.AsBytes(&fuse.WriteIn{Fh: fh, Size: 10}), data), []unix.Errno{unix.EBADF}},
			"unknown node, good size": {g.c.Encode(fuse.OpWrite, 0xdeadbeef, fuse.AsBytes(&fuse.WriteIn{Fh: fh, Size: 10}), data), []unix.Errno{unix.EBADF}},
		} {
			_, err := g.send(t, 1, c.req, 4096)
			expectErrno(t, "WRITE "+what, err, c.want...)
		}
		if b := h.hostFile(t, "file"); string(b) != shareFileContent {
			t.Errorf("share/file changed by refused WRITEs: %q", b)
		}
		// A read-only handle stays read-only.
		big := g.lookup(t, fuse.RootID, "big").NodeID
		ro := g.open(t, big, unix.O_RDONLY)
		_, err := g.send(t, 1, g.c.Encode(fuse.OpWrite, big, fuse.AsBytes(&fuse.WriteIn{Fh: ro, Size: 10}), data), 4096)
		expectErrno(t, "WRITE through a read-only handle", err, unix.EBADF)
		r.after(t)
	})

	t.Run("huge READDIR", func(t *testing.T) {
		for _, op := range []fuse.Opcode{fuse.OpReaddir, fuse.OpReaddirplus} {
			for _, w := range [][]int{{16, 200}, {16, 24}, {16}, {16, 7, 9, 100, 3}, {16, 1 << 20}} {
				dfh := g.opendir(t, fuse.RootID)
				req := g.c.Encode(op, fuse.RootID, fuse.AsBytes(&fuse.ReadIn{Fh: dfh, Size: math.MaxUint32}))
				body, err := g.submit(t, 1, splitReq(req), w).parse(uniqueOf(req))
				if err != nil {
					t.Errorf("%v 2^32-1 into %v: %v", op, w, err)
				} else if len(body) > sumInts(w)-16 {
					t.Errorf("%v 2^32-1 into %v: %d-byte body", op, w, len(body))
				}
				for _, off := range []uint64{math.MaxInt64 + 1, math.MaxUint64} {
					_, err := g.send(t, 1, g.c.Encode(op, fuse.RootID, fuse.AsBytes(&fuse.ReadIn{Fh: dfh, Offset: off, Size: 4096})), 4096)
					expectErrno(t, fmt.Sprintf("%v at %#x", op, off), err, unix.EINVAL)
				}
				_, err = g.call(t, fuse.OpReleasedir, fuse.RootID, fuse.AsBytes(&fuse.ReleaseIn{Fh: dfh}))
				expectOK(t, "RELEASEDIR", err)
			}
		}
		r.after(t)
	})

	t.Run("unknown node ids", func(t *testing.T) {
		file := g.lookup(t, fuse.RootID, "file").NodeID
		fh := g.open(t, file, unix.O_RDWR)
		dfh := g.opendir(t, fuse.RootID)
		// A node the guest forgot is as unknown as one never handed out.
		stale := g.lookup(t, fuse.RootID, "big").NodeID
		_, err := g.send(t, 0, g.c.Encode(fuse.OpForget, stale, fuse.AsBytes(&fuse.ForgetIn{Nlookup: 1 << 40})), 0)
		if err != errNoFUSEReply {
			t.Errorf("FORGET: %v", err)
		}
		type req struct {
			op   fuse.Opcode
			args [][]byte
			want []unix.Errno
		}
		ebadf := []unix.Errno{unix.EBADF}
		ops := []req{
			{fuse.OpLookup, [][]byte{fuseName("file")}, ebadf},
			{fuse.OpGetattr, [][]byte{fuse.AsBytes(&fuse.GetattrIn{})}, ebadf},
			{fuse.OpGetattr, [][]byte{fuse.AsBytes(&fuse.GetattrIn{Flags: fuse.GetattrFh, Fh: fh})}, ebadf},
			{fuse.OpSetattr, [][]byte{fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o777})}, ebadf},
			{fuse.OpSetattr, [][]byte{fuse.AsBytes(&fuse.SetattrIn{Valid: fuse.FattrSize | fuse.FattrFh, Fh: fh})}, ebadf},
			{fuse.OpReadlink, nil, ebadf},
			{fuse.OpSymlink, [][]byte{fuseName("n"), fuseName("t")}, ebadf},
			{fuse.OpMknod, [][]byte{fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFREG | 0o644}), fuseName("n")}, ebadf},
			{fuse.OpMkdir, [][]byte{fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), fuseName("n")}, ebadf},
			{fuse.OpUnlink, [][]byte{fuseName("file")}, ebadf},
			{fuse.OpRmdir, [][]byte{fuseName("dir")}, ebadf},
			{fuse.OpRename, [][]byte{fuse.AsBytes(&fuse.RenameIn{Newdir: fuse.RootID}), fuseName("file"), fuseName("n")}, ebadf},
			{fuse.OpRename2, [][]byte{fuse.AsBytes(&fuse.Rename2In{Newdir: fuse.RootID}), fuseName("file"), fuseName("n")}, ebadf},
			{fuse.OpLink, [][]byte{fuse.AsBytes(&fuse.LinkIn{Oldnodeid: file}), fuseName("n")}, ebadf},
			{fuse.OpOpen, [][]byte{fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})}, ebadf},
			{fuse.OpRead, [][]byte{fuse.AsBytes(&fuse.ReadIn{Fh: fh, Size: 100})}, ebadf},
			{fuse.OpWrite, [][]byte{fuse.AsBytes(&fuse.WriteIn{Fh: fh, Size: 3}), []byte("abc")}, ebadf},
			{fuse.OpStatfs, nil, ebadf},
			{fuse.OpRelease, [][]byte{fuse.AsBytes(&fuse.ReleaseIn{Fh: fh})}, ebadf},
			{fuse.OpFsync, [][]byte{fuse.AsBytes(&fuse.FsyncIn{Fh: fh})}, ebadf},
			{fuse.OpSetxattr, [][]byte{fuse.AsBytes(&fuse.SetxattrIn{Size: 1})[:8], fuseName("user.x"), []byte("v")}, ebadf},
			{fuse.OpGetxattr, [][]byte{fuse.AsBytes(&fuse.GetxattrIn{Size: 100}), fuseName("user.x")}, ebadf},
			{fuse.OpListxattr, [][]byte{fuse.AsBytes(&fuse.GetxattrIn{Size: 100})}, ebadf},
			{fuse.OpRemovexattr, [][]byte{fuseName("user.x")}, ebadf},
			{fuse.OpFlush, [][]byte{fuse.AsBytes(&fuse.FlushIn{Fh: fh})}, ebadf},
			{fuse.OpOpendir, [][]byte{fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_DIRECTORY})}, ebadf},
			{fuse.OpReaddir, [][]byte{fuse.AsBytes(&fuse.ReadIn{Fh: dfh, Size: 4096})}, ebadf},
			{fuse.OpReaddirplus, [][]byte{fuse.AsBytes(&fuse.ReadIn{Fh: dfh, Size: 4096})}, ebadf},
			{fuse.OpReleasedir, [][]byte{fuse.AsBytes(&fuse.ReleaseIn{Fh: dfh})}, ebadf},
			{fuse.OpFsyncdir, [][]byte{fuse.AsBytes(&fuse.FsyncIn{Fh: dfh})}, ebadf},
			{fuse.OpAccess, [][]byte{fuse.AsBytes(&fuse.AccessIn{Mask: unix.R_OK})}, []unix.Errno{unix.ENOSYS, unix.EBADF}},
			{fuse.OpCreate, [][]byte{fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), fuseName("n")}, ebadf},
			{fuse.OpTmpfile, [][]byte{fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644})}, ebadf},
			{fuse.OpFallocate, [][]byte{fuse.AsBytes(&fuse.FallocateIn{Fh: fh, Length: 4096})}, ebadf},
			{fuse.OpLseek, [][]byte{fuse.AsBytes(&fuse.LseekIn{Fh: fh, Whence: unix.SEEK_DATA})}, ebadf},
			{fuse.OpCopyFileRange, [][]byte{fuse.AsBytes(&fuse.CopyFileRangeIn{FhIn: fh, NodeIDOut: file, FhOut: fh, Len: 10})}, ebadf},
			{fuse.OpSyncfs, [][]byte{fuse.AsBytes(&fuse.SyncfsIn{})}, ebadf},
		}
		for _, bad := range []uint64{0, 2, 15, 0xdeadbeef, 1<<63 | 1, math.MaxUint64, stale} {
			for _, o := range ops {
				_, err := g.call(t, o.op, bad, o.args...)
				expectErrno(t, fmt.Sprintf("%v on node %#x", o.op, bad), err, o.want...)
			}
		}
		// The other node id fields.
		for _, bad := range []uint64{0, 0xdeadbeef, stale} {
			_, err := g.call(t, fuse.OpCopyFileRange, file, fuse.AsBytes(&fuse.CopyFileRangeIn{FhIn: fh, NodeIDOut: bad, FhOut: fh, Len: 10}))
			expectErrno(t, fmt.Sprintf("COPY_FILE_RANGE to node %#x", bad), err, unix.EBADF)
			_, err = g.call(t, fuse.OpLink, fuse.RootID, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: bad}), fuseName("n"))
			expectErrno(t, fmt.Sprintf("LINK of node %#x", bad), err, unix.EBADF)
			_, err = g.call(t, fuse.OpRename, fuse.RootID, fuse.AsBytes(&fuse.RenameIn{Newdir: bad}), fuseName("file"), fuseName("n"))
			expectErrno(t, fmt.Sprintf("RENAME to node %#x", bad), err, unix.EBADF)
		}
		// The handles given with wrong node ids must have survived.
		ctx, cancel := hostileCtx()
		defer cancel()
		if got, err := g.c.Read(ctx, file, fh, 0, 100); err != nil || string(got) != shareFileContent {
			t.Errorf("READ through the handle afterwards: %q, %v", got, err)
		}
		if err := g.c.Release(ctx, file, fh); err != nil {
			t.Errorf("RELEASE afterwards: %v", err)
		}
		if err := g.c.Releasedir(ctx, fuse.RootID, dfh); err != nil {
			t.Errorf("RELEASEDIR afterwards: %v", err)
		}
		if b := h.hostFile(t, "file"); string(b) != shareFileContent {
			t.Errorf("share/file changed: %q", b)
		}
		r.after(t)
	})

	t.Run("FORGET and BATCH_FORGET", func(t *testing.T) {
		noReply := func(what string, q int, req []byte, replyCap int) {
			t.Helper()
			if _, err := g.send(t, q, req, replyCap); err != errNoFUSEReply {
				t.Errorf("%s: %v, want no reply", what, err)
			}
		}
		forget := func(node, n uint64) []byte {
			return g.c.Encode(fuse.OpForget, node, fuse.AsBytes(&fuse.ForgetIn{Nlookup: n}))
		}
		batch := func(count uint32, items ...fuse.ForgetOne) []byte {
			args := [][]byte{fuse.AsBytes(&fuse.BatchForgetIn{Count: count})}
			for i := range items {
				args = append(args, fuse.AsBytes(&items[i]))
			}
			return g.c.Encode(fuse.OpBatchForget, 0, args...)
		}
		for _, bad := range []uint64{0, 2, 0xdeadbeef, math.MaxUint64} {
			noReply(fmt.Sprintf("FORGET of node %#x", bad), 0, forget(bad, 1), 0)
			noReply(fmt.Sprintf("FORGET of node %#x, 2^64-1 times", bad), 0, forget(bad, math.MaxUint64), 0)
		}
		noReply("FORGET of the root, 2^64-1 times", 0, forget(fuse.RootID, math.MaxUint64), 0)
		noReply("FORGET without arguments", 0, g.c.Encode(fuse.OpForget, fuse.RootID), 0)
		noReply("FORGET on the request queue", 1, forget(0xdeadbeef, 1), 4096)
		noReply("BATCH_FORGET of 2^32-1 entries, none sent", 0, batch(math.MaxUint32), 0)
		noReply("BATCH_FORGET of 1000 entries, 2 sent", 0, batch(1000,
			fuse.ForgetOne{NodeID: 0xdeadbeef, Nlookup: 1}, fuse.ForgetOne{NodeID: 0, Nlookup: math.MaxUint64}), 0)
		noReply("BATCH_FORGET without arguments", 0, g.c.Encode(fuse.OpBatchForget, 0), 0)
		noReply("BATCH_FORGET with half an entry", 0, append(batch(1), make([]byte, 12)...), 0)

		// Counts larger than held: the node goes, exactly once, and comes back on LOOKUP.
		a := g.lookup(t, fuse.RootID, "file").NodeID
		if b := g.lookup(t, fuse.RootID, "file").NodeID; b != a {
			t.Fatalf("two LOOKUPs of one file: nodes %d and %d", a, b)
		}
		noReply("BATCH_FORGET with count 0", 0, batch(0, fuse.ForgetOne{NodeID: a, Nlookup: math.MaxUint64}), 0)
		if _, err := g.call(t, fuse.OpGetattr, a, fuse.AsBytes(&fuse.GetattrIn{})); err != nil {
			t.Errorf("GETATTR after BATCH_FORGET of count 0 (its entries must be ignored): %v", err)
		}
		noReply("FORGET 1000 of 2 lookups", 0, forget(a, 1000), 0)
		_, err := g.call(t, fuse.OpGetattr, a, fuse.AsBytes(&fuse.GetattrIn{}))
		expectErrno(t, "GETATTR of an over-forgotten node", err, unix.EBADF)
		noReply("FORGET of the forgotten node again", 0, forget(a, 1), 0)
		c := g.lookup(t, fuse.RootID, "file").NodeID
		noReply("BATCH_FORGET repeating a node", 0, batch(3,
			fuse.ForgetOne{NodeID: c, Nlookup: 1}, fuse.ForgetOne{NodeID: c, Nlookup: math.MaxUint64},
			fuse.ForgetOne{NodeID: c, Nlookup: 1}), 0)
		_, err = g.call(t, fuse.OpGetattr, c, fuse.AsBytes(&fuse.GetattrIn{}))
		expectErrno(t, "GETATTR after BATCH_FORGET", err, unix.EBADF)
		if _, err := g.call(t, fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{})); err != nil {
			t.Errorf("GETATTR of the root after forgetting it: %v", err)
		}
		if got := r.hs.srv.Stats().FUSE.Panics; got != 0 {
			t.Errorf("%d handler panics", got)
		}
		r.after(t)
	})

	t.Run("caller credentials", func(t *testing.T) {
		defer func() { g.c.UID, g.c.GID = 0, 0 }()
		mkdir := func(parent uint64, name string) error {
			_, err := g.call(t, fuse.OpMkdir, parent, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), fuseName(name))
			return err
		}
		pubPath := filepath.Join(h.share, "pub")
		hostileMust(t, os.Mkdir(pubPath, 0o777))
		hostileMust(t, os.Chmod(pubPath, 0o777))
		defer os.RemoveAll(pubPath)
		pub := g.lookup(t, fuse.RootID, "pub").NodeID
		owner := func(name string) (uint32, uint32) {
			var st unix.Stat_t
			hostileMust(t, unix.Lstat(filepath.Join(pubPath, name), &st))
			return st.Uid, st.Gid
		}
		g.c.UID, g.c.GID = 1234, 1234
		expectOK(t, "MKDIR as 1234", mkdir(pub, "as-1234"))
		if u, gr := owner("as-1234"); u != 1234 || gr != 1234 {
			t.Errorf("MKDIR as 1234: owner %d:%d", u, gr)
		}
		dir := g.lookup(t, fuse.RootID, "dir").NodeID // root's, mode 0755
		expectErrno(t, "MKDIR as 1234 in a directory of root's", mkdir(dir, "as-1234"), unix.EACCES)
		// Ids the host cannot switch to (-1 asks setfsuid for the current id) are refused,
		// never run as root.
		for _, ids := range [][2]uint32{{math.MaxUint32, math.MaxUint32}, {0, math.MaxUint32}, {math.MaxUint32, 0}} {
			g.c.UID, g.c.GID = ids[0], ids[1]
			err := mkdir(pub, "as-minus-one")
			expectErrno(t, fmt.Sprintf("MKDIR as %d:%d", ids[0], ids[1]), err, unix.EPERM, unix.EINVAL)
			if err == nil {
				u, gr := owner("as-minus-one")
				t.Errorf("MKDIR as %d:%d made a directory owned by %d:%d", ids[0], ids[1], u, gr)
				os.Remove(filepath.Join(pubPath, "as-minus-one"))
			}
		}
		// Whatever came before, a request as root runs as root again: no thread keeps a
		// caller's ids.
		g.c.UID, g.c.GID = 0, 0
		for i := range 20 {
			name := fmt.Sprintf("as-root-%d", i)
			expectOK(t, "MKDIR as root", mkdir(pub, name))
			if u, gr := owner(name); u != 0 || gr != 0 {
				t.Errorf("MKDIR as root after other callers: owner %d:%d", u, gr)
			}
		}
		r.after(t)
	})

	t.Run("DESTROY then requests", func(t *testing.T) {
		_, err := g.call(t, fuse.OpDestroy, 0)
		expectOK(t, "DESTROY", err)
		_, err = g.call(t, fuse.OpLookup, fuse.RootID, fuseName("file"))
		expectErrno(t, "LOOKUP after DESTROY", err, unix.EIO)
		_, err = g.call(t, fuse.OpDestroy, 0)
		expectErrno(t, "DESTROY without a session", err, unix.EIO)
		ctx, cancel := hostileCtx()
		defer cancel()
		if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
			t.Fatalf("INIT after DESTROY: %v", err)
		}
		r.after(t)
	})

	if got := r.hs.srv.Stats().FUSE.Panics; got != 0 {
		t.Errorf("%d handler panics recovered during the suite", got)
	}
}

func sumInts(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// TestHostileFdExhaustion: the guest looks up and opens files until kvfsd runs out of
// descriptors (RLIMIT_NOFILE lowered for this process, which is kvfsd's), then keeps asking.
// Every request that needs a descriptor is answered EMFILE or ENFILE, the others are served,
// kvfsd keeps serving, and once the guest releases and forgets what it holds the next requests
// work again.
func TestHostileFdExhaustion(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	const files = 200
	for i := range files {
		hostileMust(t, os.WriteFile(filepath.Join(h.share, "dir", fmt.Sprintf("n%03d", i)), []byte{byte(i)}, 0o644))
	}
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	g.healthy(t)
	dir := g.lookup(t, fuse.RootID, "dir").NodeID
	fdsBefore := hs.srv.Stats().FS.Fds

	var saved unix.Rlimit
	hostileMust(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &saved))
	low := unix.Rlimit{Cur: uint64(countOpenFDs(t) + 48), Max: saved.Max}
	hostileMust(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	restored := false
	restore := func() {
		if !restored {
			restored = true
			hostileMust(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &saved))
		}
	}
	defer restore()

	ctx, cancel := hostileCtx()
	defer cancel()
	exhausted := func(what string, err error) bool {
		t.Helper()
		if err == nil {
			return false
		}
		expectErrno(t, what, err, unix.EMFILE, unix.ENFILE)
		return true
	}
	type open struct{ node, fh uint64 }
	var nodes []uint64
	var opens []open
	failures := 0
	for i := range files {
		name := fmt.Sprintf("n%03d", i)
		e, err := g.c.Lookup(ctx, dir, name)
		if exhausted("LOOKUP "+name, err) {
			failures++
			continue
		}
		nodes = append(nodes, e.NodeID)
		o, err := g.c.Open(ctx, e.NodeID, unix.O_RDONLY)
		if exhausted("OPEN "+name, err) {
			failures++
			continue
		}
		opens = append(opens, open{e.NodeID, o.Fh})
	}
	if failures == 0 {
		t.Fatalf("%d lookups and opens never reached the descriptor limit of %d", 2*files, low.Cur)
	}
	t.Logf("%d nodes, %d open files, %d requests refused at the limit", len(nodes), len(opens), failures)

	// It keeps asking: what needs a descriptor is refused, the rest is served.
	for i := range 50 {
		_, err := g.c.Lookup(ctx, fuse.RootID, "big")
		exhausted(fmt.Sprintf("LOOKUP big at the limit (%d)", i), err)
		if err == nil {
			t.Fatalf("LOOKUP big succeeded at the limit")
		}
		_, err = g.c.Opendir(ctx, fuse.RootID)
		if err == nil {
			t.Fatalf("OPENDIR succeeded at the limit")
		}
		exhausted("OPENDIR at the limit", err)
		if _, err := g.c.Getattr(ctx, fuse.RootID, 0); err != nil {
			t.Errorf("GETATTR of the root at the limit: %v", err)
		}
		if len(opens) > 0 {
			data, err := g.c.Read(ctx, opens[0].node, opens[0].fh, 0, 16)
			if err != nil || len(data) != 1 || data[0] != 0 {
				t.Errorf("READ of an open file at the limit: %q, %v", data, err)
			}
		}
	}
	hs.stillServing(t)

	for _, o := range opens {
		if err := g.c.Release(ctx, o.node, o.fh); err != nil {
			t.Errorf("RELEASE: %v", err)
		}
	}
	for _, n := range nodes {
		if err := g.c.Forget(ctx, n, 1); err != nil {
			t.Errorf("FORGET: %v", err)
		}
	}
	// Still at the lowered limit: what kvfsd gave back is enough for the next requests.
	for i := range 3 {
		e, err := g.c.Lookup(ctx, dir, fmt.Sprintf("n%03d", files-1-i))
		if err != nil {
			t.Fatalf("LOOKUP after the guest let go: %v", err)
		}
		o, err := g.c.Open(ctx, e.NodeID, unix.O_RDONLY)
		if err != nil {
			t.Fatalf("OPEN after the guest let go: %v", err)
		}
		if data, err := g.c.Read(ctx, e.NodeID, o.Fh, 0, 16); err != nil || len(data) != 1 || data[0] != byte(files-1-i) {
			t.Errorf("READ after the guest let go: %q, %v", data, err)
		}
		hostileMust(t, g.c.Release(ctx, e.NodeID, o.Fh))
		hostileMust(t, g.c.Forget(ctx, e.NodeID, 1))
	}
	if fds := hs.srv.Stats().FS.Fds; fds != fdsBefore {
		t.Errorf("kvfsd holds %d descriptors after the guest let go of everything, %d before", fds, fdsBefore)
	}
	restore()
	g.healthy(t)
	hs.stillServing(t)
	h.check(t)
}

// forbiddenInodes are the inode numbers of what lies outside the share (the share's parent,
// the directory next to it, the canary secret, /etc...): none may ever appear in a reply.
func forbiddenInodes(t *testing.T, h *hostileShare) map[uint64]string {
	t.Helper()
	m := map[uint64]string{}
	for p := range h.before {
		var st unix.Stat_t
		hostileMust(t, unix.Lstat(p, &st))
		m[st.Ino] = p
	}
	return m
}

// TestHostileRenameEscape: guests race renames across directories (subtrees moved back and
// forth, a directory exchanged with a symlink pointing out of the share) with walks down the
// moving subtrees, lookups of "..", opens and listings. No reply may name anything outside
// the share, the canary outside is never read (its atime stays), and nothing outside changes.
func TestHostileRenameEscape(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	for _, d := range []string{"p", "q", "p/t", "p/t/u", "p/t/u/v"} {
		hostileMust(t, os.Mkdir(filepath.Join(h.share, d), 0o755))
	}
	hostileMust(t, os.WriteFile(filepath.Join(h.share, "p/t/u/v/w"), []byte("deep"), 0o644))
	hostileMust(t, os.Symlink("../../outside", filepath.Join(h.share, "q", "t")))
	hostileMust(t, os.Symlink("../../../../outside/secret", filepath.Join(h.share, "p/t/u/v/secret")))
	forbidden := forbiddenInodes(t, h)
	secret := filepath.Join(h.outside, "secret")
	var before unix.Stat_t
	hostileMust(t, unix.Lstat(secret, &before))

	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := g.lookup(t, fuse.RootID, "p").NodeID
	q := g.lookup(t, fuse.RootID, "q").NodeID

	var escapes atomic.Int64
	check := func(what string, e *fuse.EntryOut) {
		if path, bad := forbidden[e.Attr.Ino]; bad {
			escapes.Add(1)
			t.Errorf("ESCAPE: %s resolved to %s (inode %d), outside the share", what, path, e.Attr.Ino)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// Renamers: t moves between p and q, and is exchanged with q's symlink to the outside.
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				switch (n + i) % 3 {
				case 0:
					g.c.Rename(ctx, p, "t", q, "t", unix.RENAME_EXCHANGE)
				case 1:
					g.c.Rename(ctx, q, "t", p, "t", unix.RENAME_EXCHANGE)
				case 2:
					g.c.Rename(ctx, p, "t", p, "t2", 0)
					g.c.Rename(ctx, p, "t2", p, "t", 0)
				}
			}
		}()
	}
	// Walkers: down whichever of p/t and q/t is a directory now, and up with "..".
	var walks, deep atomic.Int64
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				walks.Add(1)
				node := []uint64{p, q}[rnd.IntN(2)]
				var held []uint64
				for _, name := range []string{"t", "u", "v", []string{"w", "secret", ".."}[rnd.IntN(3)]} {
					e, err := g.c.Lookup(ctx, node, name)
					if err != nil {
						break
					}
					held = append(held, e.NodeID)
					check("LOOKUP "+name, e)
					node = e.NodeID
					if name == "w" {
						deep.Add(1)
					}
				}
				// Up, as far as ".." would lead (outside, were it ever resolved).
				for up := node; ; {
					e, err := g.c.Lookup(ctx, up, "..")
					if err != nil || len(held) > 16 {
						break
					}
					held = append(held, e.NodeID)
					check("LOOKUP ..", e)
					up = e.NodeID
				}
				if o, err := g.c.Open(ctx, node, unix.O_RDONLY); err == nil {
					if data, err := g.c.Read(ctx, node, o.Fh, 0, 4096); err == nil && string(data) != "deep" {
						escapes.Add(1)
						t.Errorf("ESCAPE: read %q through a walk down the share", data)
					}
					g.c.Release(ctx, node, o.Fh)
				}
				if o, err := g.c.Opendir(ctx, node); err == nil {
					ents, _ := g.c.Readdir(ctx, node, o.Fh, 0, 4096, true)
					for _, ent := range ents {
						if ent.Entry.NodeID != 0 {
							held = append(held, ent.Entry.NodeID)
						}
						if ent.Name != "." && ent.Name != ".." {
							check("READDIRPLUS entry "+ent.Name, &ent.Entry)
						}
					}
					g.c.Releasedir(ctx, node, o.Fh)
				}
				for _, n := range held {
					g.c.Forget(ctx, n, 1)
				}
			}
		}()
	}
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	t.Logf("%d walks, %d reached the file at the bottom", walks.Load(), deep.Load())
	if deep.Load() == 0 {
		t.Error("no walk reached p/t/u/v/w: the race tested nothing")
	}
	// ".." is never looked up, wherever the guest stands.
	for _, node := range []uint64{fuse.RootID, p, q} {
		e, err := g.c.Lookup(ctx, node, "..")
		if err == nil {
			check("LOOKUP ..", e)
		}
		expectErrno(t, "LOOKUP ..", err, unix.EINVAL)
	}
	var after unix.Stat_t
	hostileMust(t, unix.Lstat(secret, &after))
	if after.Atim != before.Atim {
		t.Errorf("ESCAPE: the canary %s was read (atime %v, was %v)", secret, after.Atim, before.Atim)
	}
	hs.stillServing(t)
	g.healthy(t)
	h.check(t)
}

// TestHostileForgetStorm: guests flood the hiprio queue with FORGETs and BATCH_FORGETs of
// nodes they hold, nodes they already forgot, unknown ids and the root, while others look the
// same files up again. kvfsd stays consistent: no panic, every LOOKUP answers a node that
// works, and once the guest has forgotten everything the inode table is back to its size
// before the storm.
func TestHostileForgetStorm(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	const files = 64
	for i := range files {
		hostileMust(t, os.WriteFile(filepath.Join(h.share, "dir", fmt.Sprintf("s%02d", i)), nil, 0o644))
	}
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	dir := g.lookup(t, fuse.RootID, "dir").NodeID
	base := hs.srv.Stats().FS.CachedInodes
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// held counts the lookups the guest holds per node, as the Linux guest's inode cache does.
	var mu sync.Mutex
	held := map[uint64]uint64{}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range 2 {
		wg.Add(1)
		go func() { // lookers
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				name := fmt.Sprintf("s%02d", rnd.IntN(files))
				e, err := g.c.Lookup(ctx, dir, name)
				if err != nil {
					t.Errorf("LOOKUP %s during the storm: %v", name, err)
					return
				}
				if _, err := g.c.Getattr(ctx, e.NodeID, 0); err != nil {
					t.Errorf("GETATTR of node %d just looked up: %v", e.NodeID, err)
					return
				}
				mu.Lock()
				held[e.NodeID]++
				mu.Unlock()
			}
		}()
	}
	for i := range 2 {
		wg.Add(1)
		go func() { // forgetters: the guest's own nodes, partly, and garbage
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 2))
			for {
				select {
				case <-stop:
					return
				default:
				}
				var items []fuse.ForgetOne
				mu.Lock()
				for n, c := range held {
					if rnd.IntN(3) == 0 && c > 0 {
						k := 1 + uint64(rnd.IntN(int(c)))
						held[n] -= k
						items = append(items, fuse.ForgetOne{NodeID: n, Nlookup: k})
					}
				}
				mu.Unlock()
				for range 8 {
					items = append(items, fuse.ForgetOne{NodeID: rnd.Uint64(), Nlookup: rnd.Uint64()},
						fuse.ForgetOne{NodeID: fuse.RootID, Nlookup: math.MaxUint64},
						fuse.ForgetOne{NodeID: uint64(rnd.IntN(1000)), Nlookup: 0})
				}
				rnd.Shuffle(len(items), func(a, b int) { items[a], items[b] = items[b], items[a] })
				if rnd.IntN(2) == 0 {
					if err := g.c.BatchForget(ctx, items); err != nil {
						t.Errorf("BATCH_FORGET: %v", err)
						return
					}
					continue
				}
				for _, it := range items {
					if err := g.c.Forget(ctx, it.NodeID, it.Nlookup); err != nil {
						t.Errorf("FORGET: %v", err)
						return
					}
				}
			}
		}()
	}
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}
	st := hs.srv.Stats()
	t.Logf("after the storm: %d FORGETs, %d BATCH_FORGETs, %d cached inodes", st.FUSE.Ops["FORGET"].Count,
		st.FUSE.Ops["BATCH_FORGET"].Count, st.FS.CachedInodes)
	if st.FUSE.Ops["BATCH_FORGET"].Count == 0 || st.FUSE.Ops["FORGET"].Count == 0 {
		t.Fatalf("no storm: %+v", st.FUSE.Ops)
	}
	// Every node the guest holds still works; then it forgets them, some twice over.
	var rest []fuse.ForgetOne
	for n, c := range held {
		if c == 0 {
			continue
		}
		if _, err := g.c.Getattr(ctx, n, 0); err != nil {
			t.Errorf("GETATTR of node %d the guest holds %d lookups of: %v", n, c, err)
		}
		rest = append(rest, fuse.ForgetOne{NodeID: n, Nlookup: c})
	}
	hostileMust(t, g.c.BatchForget(ctx, rest))
	hostileMust(t, g.c.BatchForget(ctx, rest))
	if got := hs.srv.Stats().FS.CachedInodes; got != base {
		t.Errorf("%d cached inodes once the guest forgot everything, %d before the storm", got, base)
	}
	if st := hs.srv.Stats().FUSE; st.Panics != 0 {
		t.Errorf("%d handler panics", st.Panics)
	}
	// Later lookups work, and give nodes that work.
	for i := range files {
		e := g.lookup(t, dir, fmt.Sprintf("s%02d", i))
		if _, err := g.c.Getattr(ctx, e.NodeID, 0); err != nil {
			t.Errorf("GETATTR after the storm: %v", err)
		}
		hostileMust(t, g.c.Forget(ctx, e.NodeID, 1))
	}
	hs.stillServing(t)
	g.healthy(t)
	h.check(t)
}

// TestHostileLockFlood: lock requests from many owners, and interrupted waits. Without
// posix_lock (the default) every lock request of every owner answers ENOSYS at once and nothing
// waits, whatever the guest interrupts. With it, a hundred owners wait for one writer's lock;
// INTERRUPTs (twice each, of unknown uniques too) end exactly the waits they name with EINTR,
// the others are all granted when the writer unlocks, each wait is answered once, the queue
// serves other requests meanwhile, and once the owners let go the host sees no lock and kvfsd
// holds no descriptor for them.
func TestHostileLockFlood(t *testing.T) {
	hostileNeedsRoot(t)
	const owners = 100
	whole := func(typ uint32, owner uint64) fuse.FileLock { return flk(typ, 0, fuse.OffsetMax, uint32(1000+owner)) }

	t.Run("default", func(t *testing.T) {
		r := newLockRig(t, virtiofs.Config{})
		ctx, cancel := ctxT()
		defer cancel()
		for owner := uint64(1); owner <= owners; owner++ {
			req, unique := r.c.EncodeSetlk(r.node, r.fh, owner, whole(unix.F_WRLCK, owner), 0, true)
			if _, err := r.c.Do(ctx, req, 4096); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("SETLKW of owner %d: %v, want ENOSYS", owner, err)
			}
			hostileMust(t, r.c.Interrupt(ctx, unique))
			hostileMust(t, r.c.Interrupt(ctx, unique+1))
			if err := r.c.Setlk(ctx, r.node, r.fh, owner, whole(unix.F_RDLCK, owner), 0, false); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("SETLK of owner %d: %v, want ENOSYS", owner, err)
			}
			if _, err := r.c.Getlk(ctx, r.node, r.fh, owner, whole(unix.F_WRLCK, owner)); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("GETLK of owner %d: %v, want ENOSYS", owner, err)
			}
		}
		if st := r.s.Stats(); st.FUSE.Waiting != 0 || st.FUSE.Panics != 0 {
			t.Errorf("waiting %d, panics %d", st.FUSE.Waiting, st.FUSE.Panics)
		}
		if _, err := hostOFD(hostOpen(t, r.host), unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
			t.Errorf("host write lock after the flood: %v", err)
		}
	})

	t.Run("posix_lock", func(t *testing.T) {
		r := newLockRig(t, virtiofs.Config{PosixLock: true})
		ctx, cancel := ctxT()
		defer cancel()
		fds := r.s.Stats().FS.Fds
		if err := r.setlk(t, r.fh, 1, whole(unix.F_WRLCK, 1), 0); err != nil {
			t.Fatal(err)
		}
		uniques := make([]uint64, owners+1)
		answers := make([]chan error, owners+1)
		for owner := 2; owner <= owners; owner++ {
			req, unique := r.c.EncodeSetlk(r.node, r.fh, uint64(owner), whole(unix.F_RDLCK, uint64(owner)), 0, true)
			uniques[owner], answers[owner] = unique, make(chan error, 2)
			go func() {
				wctx, cancel := context.WithTimeout(context.Background(), 3*lockTimeout)
				defer cancel()
				_, err := r.c.Do(wctx, req, 4096)
				answers[owner] <- err
			}()
		}
		r.waitWaiting(t, owners-1)
		interrupted := func(owner int) bool { return owner%2 == 1 }
		for owner := 2; owner <= owners; owner++ {
			if interrupted(owner) {
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner]))
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner]))
			}
		}
		for _, bogus := range []uint64{0, 1 << 60, math.MaxUint64} {
			hostileMust(t, r.c.Interrupt(ctx, bogus))
		}
		for owner := 2; owner <= owners; owner++ {
			if interrupted(owner) {
				if err := answer(t, answers[owner]); !errors.Is(err, unix.EINTR) {
					t.Errorf("interrupted SETLKW of owner %d: %v, want EINTR", owner, err)
				}
			}
		}
		r.waitWaiting(t, owners/2)
		if _, err := r.c.Getattr(ctx, r.node, 0); err != nil {
			t.Errorf("GETATTR while %d SETLKW wait: %v", owners/2, err)
		}
		if err := r.setlk(t, r.fh, 1, whole(unix.F_UNLCK, 1), 0); err != nil {
			t.Fatal(err)
		}
		for owner := 2; owner <= owners; owner++ {
			if !interrupted(owner) {
				if err := answer(t, answers[owner]); err != nil {
					t.Errorf("SETLKW of owner %d after the writer unlocked: %v", owner, err)
				}
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner])) // too late: changes nothing
			}
		}
		r.waitWaiting(t, 0)
		for owner := 2; owner <= owners; owner++ {
			select {
			case err := <-answers[owner]:
				t.Errorf("SETLKW of owner %d answered twice (again: %v)", owner, err)
			default:
			}
		}
		f := hostOpen(t, r.host)
		if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); !errors.Is(err, unix.EAGAIN) {
			t.Errorf("host write lock over the granted read locks: %v, want EAGAIN", err)
		}
		for owner := 1; owner <= owners; owner++ {
			in := fuse.FlushIn{Fh: r.fh, LockOwner: uint64(owner)}
			if _, err := r.c.Do(ctx, r.c.Encode(fuse.OpFlush, r.node, fuse.AsBytes(&in)), 4096); err != nil {
				t.Fatalf("FLUSH of owner %d: %v", owner, err)
			}
		}
		if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
			t.Errorf("host write lock once every owner let go: %v", err)
		}
		if st := r.s.Stats(); st.FS.Fds != fds || st.FUSE.Panics != 0 {
			t.Errorf("kvfsd holds %d descriptors (%d before the owners), %d panics", st.FS.Fds, fds, st.FUSE.Panics)
		}
	})
}

// tmpfsShare mounts a tmpfs (which holds xattr values up to XATTR_SIZE_MAX, as ext4 without
// ea_inode does not) for the test and returns its path.
func tmpfsShare(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tmpfs")
	hostileMust(t, os.Mkdir(dir, 0o755))
	if err := unix.Mount("kvfs-test", dir, "tmpfs", 0, "size=64m"); err != nil {
		t.Skipf("mounting a tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// TestHostileXattrLimits: xattrs at the kernel's limits, through the front-end. A value of
// XATTR_SIZE_MAX (64 KiB) is stored and read back whole; one byte more is E2BIG; a buffer one
// byte short is ERANGE; a name list longer than the guest's buffer is ERANGE; and a list beyond
// XATTR_LIST_MAX, which the host cannot list at all, is E2BIG, as Linux answers.
func TestHostileXattrLimits(t *testing.T) {
	hostileNeedsRoot(t)
	share := tmpfsShare(t)
	hostileMust(t, os.WriteFile(filepath.Join(share, "file"), []byte(shareFileContent), 0o644))
	hostileMust(t, os.WriteFile(filepath.Join(share, "many"), nil, 0o644))
	hs := startHostileServer(t, virtiofs.Config{SharedDir: share, Xattr: true})
	g := dialHostile(t, hs.sock, hostileOpts())
	file := g.lookup(t, fuse.RootID, "file").NodeID
	many := g.lookup(t, fuse.RootID, "many").NodeID
	const sizeMax = 1 << 16

	setxattr := func(node uint64, name string, value []byte) error {
		in := fuse.SetxattrIn{Size: uint32(len(value))}
		_, err := g.send(t, 1, g.c.Encode(fuse.OpSetxattr, node, fuse.AsBytes(&in)[:8], fuseName(name), value), 4096)
		return err
	}
	getxattr := func(node uint64, name string, size uint32) ([]byte, error) {
		in := fuse.GetxattrIn{Size: size}
		return g.send(t, 1, g.c.Encode(fuse.OpGetxattr, node, fuse.AsBytes(&in), fuseName(name)), 16+int(max(size, 8)))
	}
	listxattr := func(node uint64, size uint32) ([]byte, error) {
		in := fuse.GetxattrIn{Size: size}
		return g.send(t, 1, g.c.Encode(fuse.OpListxattr, node, fuse.AsBytes(&in)), 16+int(max(size, 8)))
	}
	sizeOf := func(what string, body []byte, err error) uint32 {
		t.Helper()
		if err != nil || len(body) != 8 {
			t.Fatalf("%s: %d bytes, %v; want the 8-byte size", what, len(body), err)
		}
		return uint32(body[0]) | uint32(body[1])<<8 | uint32(body[2])<<16 | uint32(body[3])<<24
	}

	value := make([]byte, sizeMax)
	for i := range value {
		value[i] = byte(i * 31)
	}
	expectOK(t, "SETXATTR of 64 KiB", setxattr(file, "user.max", value))
	if v, err := unix.Getxattr(filepath.Join(share, "file"), "user.max", make([]byte, sizeMax)); err != nil || v != sizeMax {
		t.Errorf("on the host: %d bytes, %v", v, err)
	}
	body, err := getxattr(file, "user.max", 0)
	if n := sizeOf("GETXATTR size of the 64 KiB value", body, err); n != sizeMax {
		t.Errorf("GETXATTR size: %d, want %d", n, sizeMax)
	}
	body, err = getxattr(file, "user.max", sizeMax)
	if err != nil || string(body) != string(value) {
		t.Errorf("GETXATTR of the 64 KiB value: %d bytes, %v", len(body), err)
	}
	_, err = getxattr(file, "user.max", sizeMax-1)
	expectErrno(t, "GETXATTR into a buffer one byte short", err, unix.ERANGE)
	expectErrno(t, "SETXATTR of 64 KiB + 1", setxattr(file, "user.over", make([]byte, sizeMax+1)), unix.E2BIG)

	// A list of names that overflows the guest's buffer, then one beyond XATTR_LIST_MAX.
	names := 0
	listLen := 0
	add := func(upTo int) {
		for listLen < upTo {
			name := fmt.Sprintf("user.%04d-%0240d", names, 0)
			hostileMust(t, unix.Setxattr(filepath.Join(share, "many"), name, nil, 0))
			names++
			listLen += len(name) + 1
		}
	}
	add(sizeMax - 1024)
	body, err = listxattr(many, 0)
	if n := sizeOf("LISTXATTR size", body, err); int(n) != listLen {
		t.Errorf("LISTXATTR size: %d, want %d (%d names)", n, listLen, names)
	}
	_, err = listxattr(many, 100)
	expectErrno(t, "LISTXATTR into 100 bytes", err, unix.ERANGE)
	_, err = listxattr(many, uint32(listLen-1))
	expectErrno(t, "LISTXATTR into a buffer one byte short", err, unix.ERANGE)
	body, err = listxattr(many, uint32(listLen))
	if err != nil || len(body) != listLen {
		t.Errorf("LISTXATTR of %d bytes: %d bytes, %v", listLen, len(body), err)
	}
	add(sizeMax + 1024)
	if _, err := unix.Listxattr(filepath.Join(share, "many"), make([]byte, sizeMax)); !errors.Is(err, unix.E2BIG) {
		t.Fatalf("the host lists %d bytes of names: %v, want E2BIG", listLen, err)
	}
	_, err = listxattr(many, sizeMax)
	expectErrno(t, "LISTXATTR of a list beyond XATTR_LIST_MAX", err, unix.E2BIG)
	// Its size cannot be told either: the host cannot list it, so its guest view is unknown.
	_, err = listxattr(many, 0)
	expectErrno(t, "LISTXATTR size of a list beyond XATTR_LIST_MAX", err, unix.E2BIG)
	hs.stillServing(t)
	if _, err := getxattr(file, "user.max", sizeMax); err != nil {
		t.Errorf("GETXATTR after the big list: %v", err)
	}
}
