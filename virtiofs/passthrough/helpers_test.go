package passthrough

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

var (
	rootCtx = &fuse.Context{UID: uint32(os.Geteuid()), GID: uint32(os.Getegid())}
	userCtx = &fuse.Context{UID: 1000, GID: 1000}
)

// env is a shared directory next to a sibling that must never change.
type env struct {
	fs      *FS
	share   string
	outside string
}

// newEnv makes <tmp>/share (world-writable, so that uid 1000 may create in it) and
// <tmp>/outside with a few files, and checks at the end of the test that outside is unchanged.
func newEnv(t testing.TB, opts Options) *env {
	t.Helper()
	base := t.TempDir()
	e := &env{share: filepath.Join(base, "share"), outside: filepath.Join(base, "outside")}
	must(t, os.Mkdir(e.share, 0o777))
	must(t, os.Chmod(e.share, 0o777))
	must(t, os.Mkdir(e.outside, 0o755))
	must(t, os.WriteFile(filepath.Join(e.outside, "secret"), []byte("do not touch"), 0o644))
	must(t, os.Mkdir(filepath.Join(e.outside, "dir"), 0o755))
	before := snapshot(t, e.outside)
	fs, err := New(e.share, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	e.fs = fs
	t.Cleanup(func() {
		fs.Close()
		if st := fs.Stats(); st.Fds != 0 || st.OpenFiles != 0 {
			t.Errorf("after Close: %+v, want no fds", st)
		}
		if after := snapshot(t, e.outside); after != before {
			t.Errorf("the directory outside the share changed:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})
	return e
}

// snapshot describes a tree: names, types, modes, owners, sizes, times and contents.
func snapshot(t testing.TB, dir string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		fmt.Fprintf(&b, "%s mode=%o uid=%d gid=%d size=%d mtime=%d.%d nlink=%d", p, st.Mode, st.Uid, st.Gid,
			st.Size, st.Mtim.Sec, st.Mtim.Nsec, st.Nlink)
		if d.Type().IsRegular() {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			fmt.Fprintf(&b, " sha=%x", sha256.Sum256(data))
		}
		if xs, err := listXattrs(p); err == nil {
			fmt.Fprintf(&b, " xattrs=%q", xs)
		}
		b.WriteByte('\n')
		return nil
	})
	if err != nil {
		t.Fatalf("snapshot %s: %v", dir, err)
	}
	return b.String()
}

func listXattrs(p string) ([]string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, s := range bytes.Split(buf[:n], []byte{0}) {
		if len(s) > 0 {
			names = append(names, string(s))
		}
	}
	sort.Strings(names)
	return names, nil
}

// needRoot skips tests of what only root may do on the host: other owners, device nodes,
// trusted.* attributes, mounts.
func needRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root")
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func wantErrno(t testing.TB, what string, got, want fuse.Errno) {
	t.Helper()
	if got != want {
		t.Errorf("%s: got %v (%d), want %v (%d)", what, errName(got), int(got), errName(want), int(want))
	}
}

func errName(e fuse.Errno) string {
	if e == 0 {
		return "OK"
	}
	return unix.ErrnoName(e)
}

func (e *env) path(elem ...string) string {
	return filepath.Join(append([]string{e.share}, elem...)...)
}

func (e *env) lookup(t testing.TB, parent uint64, name string) fuse.EntryOut {
	t.Helper()
	var out fuse.EntryOut
	if errno := e.fs.Lookup(rootCtx, parent, name, &out); errno != 0 {
		t.Fatalf("Lookup(%d, %q): %v", parent, name, errno)
	}
	return out
}

func (e *env) open(t testing.TB, node uint64, flags uint32) uint64 {
	t.Helper()
	var out fuse.OpenOut
	if errno := e.fs.Open(rootCtx, node, &fuse.OpenIn{Flags: flags}, &out); errno != 0 {
		t.Fatalf("Open(%d): %v", node, errno)
	}
	return out.Fh
}

func (e *env) openDir(t testing.TB, node uint64) uint64 {
	t.Helper()
	var out fuse.OpenOut
	if errno := e.fs.OpenDir(rootCtx, node, &fuse.OpenIn{}, &out); errno != 0 {
		t.Fatalf("OpenDir(%d): %v", node, errno)
	}
	return out.Fh
}

func (e *env) create(t testing.TB, ctx *fuse.Context, parent uint64, name string, mode uint32) (fuse.EntryOut, uint64) {
	t.Helper()
	var entry fuse.EntryOut
	var open fuse.OpenOut
	in := &fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT, Mode: unix.S_IFREG | mode}
	if errno := e.fs.Create(ctx, parent, name, in, &entry, &open); errno != 0 {
		t.Fatalf("Create(%d, %q): %v", parent, name, errno)
	}
	return entry, open.Fh
}

func (e *env) write(t testing.TB, node, fh uint64, off uint64, data []byte) {
	t.Helper()
	n, errno := e.fs.Write(rootCtx, node, &fuse.WriteIn{Fh: fh, Offset: off, Size: uint32(len(data))}, [][]byte{data})
	if errno != 0 || n != len(data) {
		t.Fatalf("Write: %d, %v", n, errno)
	}
}

func (e *env) getattr(t testing.TB, node uint64) fuse.Attr {
	t.Helper()
	var out fuse.AttrOut
	if errno := e.fs.GetAttr(rootCtx, node, &fuse.GetattrIn{}, &out); errno != 0 {
		t.Fatalf("GetAttr(%d): %v", node, errno)
	}
	return out.Attr
}

func lstat(t testing.TB, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	must(t, unix.Lstat(p, &st))
	return st
}

// withTimeout fails the test if f does not return within a few seconds (a host open of a FIFO
// would block).
func withTimeout(t testing.TB, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s blocked", what)
	}
}

// server drives the FS through the FUSE codec, for READDIR whose DirList only the codec makes.
type server struct {
	s      *fuse.Server
	unique uint64
}

func newServer(t testing.TB, fs fuse.FileSystem) *server {
	t.Helper()
	s := &server{s: fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitDoReaddirplus})}
	in := fuse.InitIn{Major: fuse.KernelVersion, Minor: fuse.KernelMinorVersion, Flags: fuse.InitDoReaddirplus}
	if errno, _ := s.call(fuse.OpInit, 0, fuse.AsBytes(&in), 4096); errno != 0 {
		t.Fatalf("INIT: %v", errno)
	}
	return s
}

// call sends one request and returns the error and the reply body.
func (s *server) call(op fuse.Opcode, node uint64, args []byte, outCap int) (fuse.Errno, []byte) {
	s.unique++
	hdr := fuse.InHeader{Opcode: uint32(op), Unique: s.unique, NodeID: node, UID: rootCtx.UID, GID: rootCtx.GID}
	hdr.Len = uint32(int(unsafe.Sizeof(hdr)) + len(args))
	req := append(append([]byte(nil), fuse.AsBytes(&hdr)...), args...)
	reply := make([]byte, outCap)
	n := s.s.Handle([][]byte{req}, [][]byte{reply})
	var oh fuse.OutHeader
	copy(fuse.AsBytes(&oh), reply[:n])
	return fuse.Errno(-oh.Error), reply[unsafe.Sizeof(oh):n]
}

type dirent struct {
	name  string
	ino   uint64
	off   uint64
	typ   uint32
	entry fuse.EntryOut
}

// readdir sends one READDIR(PLUS) of at most size bytes and parses the entries.
func (s *server) readdir(t testing.TB, node, fh, cookie uint64, size uint32, plus bool) ([]dirent, fuse.Errno) {
	t.Helper()
	in := fuse.ReadIn{Fh: fh, Offset: cookie, Size: size}
	op := fuse.OpReaddir
	if plus {
		op = fuse.OpReaddirplus
	}
	errno, body := s.call(op, node, fuse.AsBytes(&in), 16+int(size))
	if errno != 0 {
		return nil, errno
	}
	if len(body) > int(size) {
		t.Fatalf("READDIR answered %d bytes for a %d-byte buffer", len(body), size)
	}
	var out []dirent
	for len(body) > 0 {
		var d dirent
		var fixed int
		var de fuse.Dirent
		if plus {
			var dp fuse.DirentPlus
			fixed = int(unsafe.Sizeof(dp))
			copy(fuse.AsBytes(&dp), body)
			d.entry, de = dp.Entry, dp.Dirent
		} else {
			fixed = int(unsafe.Sizeof(de))
			copy(fuse.AsBytes(&de), body)
		}
		size := (fixed + int(de.Namelen) + 7) &^ 7
		if size > len(body) {
			t.Fatalf("truncated dirent")
		}
		d.name = string(body[fixed : fixed+int(de.Namelen)])
		d.ino, d.off, d.typ = de.Ino, de.Off, de.Type
		out = append(out, d)
		body = body[size:]
	}
	return out, 0
}
