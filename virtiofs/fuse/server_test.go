package fuse_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/fusecheck"
	"github.com/kvfs/kvfs/internal/testing/fuzzseed"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// splitTransport hands requests to a Server the way a virtqueue would: the readable and
// writable parts cut into buffers at random points, so that nothing may depend on a layout.
type splitTransport struct {
	s   *fuse.Server
	mu  sync.Mutex
	rnd *rand.Rand
}

func (t *splitTransport) split(b []byte) [][]byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out [][]byte
	for len(b) > 0 {
		n := 1 + t.rnd.IntN(min(len(b), 64))
		if t.rnd.IntN(4) == 0 {
			n = len(b)
		}
		out = append(out, b[:n:n])
		b = b[n:]
	}
	return out
}

func (t *splitTransport) RoundTrip(_ context.Context, _ int, req []byte, replyCap int) ([]byte, error) {
	reply := make([]byte, replyCap)
	n := t.s.Handle(t.split(bytes.Clone(req)), t.split(reply))
	return reply[:n], nil
}

func newClient(t *testing.T, fs fuse.FileSystem) (*fuseclient.Client, *fuse.Server) {
	t.Helper()
	s := fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitDoReaddirplus})
	c := fuseclient.New(&splitTransport{s: s, rnd: rand.New(rand.NewPCG(1, 2))})
	if _, err := c.Init(context.Background(), fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT: %v", err)
	}
	return c, s
}

// fakeFS answers ENOSYS except for what a test sets.
type fakeFS struct {
	fuse.FileSystem // nil: any method not overridden panics, which the server must survive
	mu              sync.Mutex
	calls           []string
	initFlags       uint64
	destroys        int
	data            []byte
}

func (f *fakeFS) record(s string) {
	f.mu.Lock()
	f.calls = append(f.calls, s)
	f.mu.Unlock()
}

func (f *fakeFS) Init(flags uint64) { f.initFlags = flags }
func (f *fakeFS) Destroy()          { f.destroys++ }

func (f *fakeFS) Lookup(ctx *fuse.Context, parent uint64, name string, out *fuse.EntryOut) fuse.Errno {
	f.record("lookup " + name)
	if name != "file" {
		return unix.ENOENT
	}
	out.NodeID, out.Attr.Ino, out.Attr.Mode = 7, 1234, unix.S_IFREG|0o644
	return fuse.OK
}

func (f *fakeFS) Forget(node, n uint64) { f.record("forget") }

func (f *fakeFS) Read(ctx *fuse.Context, node uint64, in *fuse.ReadIn, dst [][]byte) (int, fuse.Errno) {
	n := 0
	src := f.data[min(int(in.Offset), len(f.data)):]
	for _, d := range dst {
		c := copy(d, src[n:])
		n += c
		if c < len(d) {
			break
		}
	}
	return n, fuse.OK
}

func (f *fakeFS) Write(ctx *fuse.Context, node uint64, in *fuse.WriteIn, src [][]byte) (int, fuse.Errno) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.data = f.data[:0]
	for _, s := range src {
		f.data = append(f.data, s...)
	}
	return len(f.data), fuse.OK
}

func (f *fakeFS) Rename(ctx *fuse.Context, parent uint64, name string, newParent uint64, newName string, flags uint32) fuse.Errno {
	f.record("rename " + name + " " + newName)
	return fuse.OK
}

func (f *fakeFS) ReadDir(ctx *fuse.Context, node uint64, in *fuse.ReadIn, plus bool, out *fuse.DirList) fuse.Errno {
	for i := in.Offset; i < 100; i++ {
		name := strings.Repeat("x", int(i%20)+1)
		if !out.Fits(len(name)) {
			break
		}
		out.Add(name, 1000+i, unix.DT_REG, i+1, &fuse.EntryOut{NodeID: 50 + i})
	}
	return fuse.OK
}

func TestInitNegotiation(t *testing.T) {
	fs := &fakeFS{}
	s := fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitDoReaddirplus | fuse.InitSubmounts})
	c := fuseclient.New(&splitTransport{s: s, rnd: rand.New(rand.NewPCG(3, 4))})
	ctx := context.Background()
	if _, err := c.Lookup(ctx, 1, "file"); !errors.Is(err, unix.EIO) {
		t.Fatalf("LOOKUP before INIT: %v, want EIO", err)
	}
	checkUnanswered(t, s, "before INIT")
	out, err := c.Init(ctx, fuse.InitAsyncRead|fuse.InitSubmounts|fuse.InitWritebackCache)
	if err != nil {
		t.Fatal(err)
	}
	if out.Major != 7 || out.Minor != fuse.KernelMinorVersion || out.MaxWrite != fuse.MaxWrite || out.MaxPages != fuse.MaxPages {
		t.Errorf("init out %+v", out)
	}
	want := uint64(fuse.InitAsyncRead | fuse.InitSubmounts | fuse.InitInitExt)
	if got := uint64(out.Flags) | uint64(out.Flags2)<<32; got != want || fs.initFlags != want {
		t.Errorf("granted %#x (fs saw %#x), want %#x: only what both sides offer", got, fs.initFlags, want)
	}
	// A rebooted guest initialises again without DESTROY.
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatal(err)
	}
	if fs.destroys != 1 {
		t.Errorf("second INIT: %d destroys, want 1", fs.destroys)
	}
	if err := c.Destroy(ctx); err != nil || fs.destroys != 2 {
		t.Errorf("DESTROY: %v, %d destroys", err, fs.destroys)
	}
	checkUnanswered(t, s, "after DESTROY")
}

// checkUnanswered: FORGET, BATCH_FORGET and INTERRUPT get no reply from s, initialised or not.
func checkUnanswered(t *testing.T, s *fuse.Server, when string) {
	t.Helper()
	c := fuseclient.New(nil)
	for _, req := range [][]byte{
		c.Encode(fuse.OpForget, 7, fuse.AsBytes(&fuse.ForgetIn{Nlookup: 1})),
		c.Encode(fuse.OpBatchForget, 0, fuse.AsBytes(&fuse.BatchForgetIn{})),
		c.Encode(fuse.OpInterrupt, 0, fuse.AsBytes(&fuse.InterruptIn{Unique: 3})),
	} {
		if n := s.Handle([][]byte{req}, [][]byte{make([]byte, 64)}); n != 0 {
			t.Errorf("%s: %v got a %d-byte reply, want none", when, fuse.Opcode(req[4]), n)
		}
	}
}

func TestInitRejectsOldProtocol(t *testing.T) {
	s := fuse.NewServer(&fakeFS{}, fuse.Options{})
	c := fuseclient.New(&splitTransport{s: s, rnd: rand.New(rand.NewPCG(5, 6))})
	in := fuse.InitIn{Major: 7, Minor: 30}
	_, err := c.Do(context.Background(), c.Encode(fuse.OpInit, 0, fuse.AsBytes(&in)[:16]), 4096)
	if !errors.Is(err, unix.EPROTO) {
		t.Errorf("INIT 7.30: %v, want EPROTO", err)
	}
}

func TestRequests(t *testing.T) {
	fs := &fakeFS{}
	c, s := newClient(t, fs)
	ctx := context.Background()

	e, err := c.Lookup(ctx, 1, "file")
	if err != nil || e.NodeID != 7 || e.Attr.Ino != 1234 {
		t.Fatalf("LOOKUP: %+v, %v", e, err)
	}
	if _, err := c.Lookup(ctx, 1, "nope"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("LOOKUP nope: %v", err)
	}
	if err := c.Rename(ctx, 1, "a", 1, "b", unix.RENAME_NOREPLACE); err != nil {
		t.Errorf("RENAME2: %v", err)
	}
	payload := bytes.Repeat([]byte("0123456789abcdef"), 4096)
	if n, err := c.Write(ctx, 7, 1, 0, payload, 0); err != nil || n != uint32(len(payload)) {
		t.Fatalf("WRITE: %d, %v", n, err)
	}
	got, err := c.Read(ctx, 7, 1, 16, 1000)
	if err != nil || !bytes.Equal(got, payload[16:1016]) {
		t.Fatalf("READ: %d bytes, %v", len(got), err)
	}
	if err := c.Forget(ctx, 7, 1); err != nil {
		t.Fatal(err)
	}
	// Directory listings fit the size asked for, across calls by cookie.
	var names []string
	for off := uint64(0); ; {
		ents, err := c.Readdir(ctx, 1, 1, off, 512, true)
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) == 0 {
			break
		}
		for _, e := range ents {
			names = append(names, e.Name)
			if e.Entry.NodeID != 50+e.Off-1 {
				t.Fatalf("entry %q: node %d", e.Name, e.Entry.NodeID)
			}
		}
		off = ents[len(ents)-1].Off
	}
	if len(names) != 100 {
		t.Errorf("READDIRPLUS listed %d entries, want 100", len(names))
	}
	st := s.Stats()
	if st.Ops["LOOKUP"].Count != 2 || st.Ops["LOOKUP"].Errors != 1 || st.BytesWritten != uint64(len(payload)) || st.BytesRead != 1000 {
		t.Errorf("stats: %+v", st)
	}
}

func TestHostileRequests(t *testing.T) {
	fs := &fakeFS{}
	c, s := newClient(t, fs)
	ctx := context.Background()
	do := func(req []byte) error {
		_, err := c.Do(ctx, req, 4096)
		return err
	}
	for _, tc := range []struct {
		name string
		req  []byte
		want unix.Errno
	}{
		{"name with slash", c.Encode(fuse.OpLookup, 1, []byte("a/b\x00")), unix.EINVAL},
		{"name without NUL", c.Encode(fuse.OpLookup, 1, []byte("abc")), unix.EINVAL},
		{"empty name", c.Encode(fuse.OpLookup, 1, []byte("\x00")), unix.ENOENT},
		{"name too long", c.Encode(fuse.OpLookup, 1, append(bytes.Repeat([]byte("a"), 256), 0)), unix.ENAMETOOLONG},
		{"name too long, no NUL", c.Encode(fuse.OpLookup, 1, bytes.Repeat([]byte("a"), 256)), unix.EINVAL},
		{"rename new name too long", c.Encode(fuse.OpRename, 1, make([]byte, 8), []byte("a\x00"),
			append(bytes.Repeat([]byte("b"), 256), 0)), unix.ENAMETOOLONG},
		{"symlink target too long", c.Encode(fuse.OpSymlink, 1, []byte("l\x00"),
			append(bytes.Repeat([]byte("t"), 4097), 0)), unix.ENAMETOOLONG},
		{"symlink target empty", c.Encode(fuse.OpSymlink, 1, []byte("l\x00\x00")), unix.ENOENT},
		{"xattr name too long", c.Encode(fuse.OpRemovexattr, 1, append(bytes.Repeat([]byte("u"), 256), 0)), unix.ERANGE},
		{"xattr name empty", c.Encode(fuse.OpGetxattr, 1, make([]byte, 8), []byte("\x00")), unix.ERANGE},
		{"xattr value too large", c.Encode(fuse.OpSetxattr, 1, fuse.AsBytes(&fuse.SetxattrIn{Size: 1<<16 + 1})[:8],
			[]byte("user.a\x00"), make([]byte, 1<<16+1)), unix.E2BIG},
		{"unknown opcode", c.Encode(fuse.Opcode(63), 1), unix.ENOSYS},
		{"huge opcode", c.Encode(fuse.Opcode(1<<31), 1), unix.ENOSYS},
		{"locks not offered", c.Encode(fuse.OpSetlkw, 1, make([]byte, 48)), unix.ENOSYS},
		{"short setattr", c.Encode(fuse.OpSetattr, 1, make([]byte, 10)), unix.EINVAL},
		{"rename missing new name", c.Encode(fuse.OpRename, 1, make([]byte, 8), []byte("a\x00")), unix.EINVAL},
		{"panicking handler", c.Encode(fuse.OpStatfs, 1), unix.EIO},
	} {
		if err := do(tc.req); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	// Header lengths that disagree with the buffers.
	req := c.Encode(fuse.OpLookup, 1, []byte("file\x00"))
	long := bytes.Clone(req)
	long[0] = 200 // claims more than was sent
	if err := do(long); !errors.Is(err, unix.EINVAL) {
		t.Errorf("len beyond buffers: %v", err)
	}
	short := bytes.Clone(req)
	short[0] = 39
	if err := do(short); !errors.Is(err, unix.EINVAL) {
		t.Errorf("len below header: %v", err)
	}
	// WRITE whose size disagrees with the payload.
	w := fuse.WriteIn{Size: 100}
	if err := do(c.Encode(fuse.OpWrite, 7, fuse.AsBytes(&w), make([]byte, 10))); !errors.Is(err, unix.EINVAL) {
		t.Errorf("WRITE size mismatch: %v", err)
	}
	// READ asking for far more than the reply space: bounded by the space.
	fs.data = make([]byte, 1<<20)
	r := fuse.ReadIn{Size: 1 << 30}
	body, err := c.Do(ctx, c.Encode(fuse.OpRead, 7, fuse.AsBytes(&r)), 4096)
	if err != nil || len(body) != 4096-16 {
		t.Errorf("huge READ: %d bytes, %v", len(body), err)
	}
	// No room for a reply at all: nothing written.
	if n := s.Handle([][]byte{c.Encode(fuse.OpLookup, 1, []byte("file\x00"))}, [][]byte{make([]byte, 8)}); n != 0 {
		t.Errorf("reply into 8 bytes: wrote %d", n)
	}
	// A truncated header is dropped.
	if n := s.Handle([][]byte{make([]byte, 20)}, [][]byte{make([]byte, 4096)}); n != 0 {
		t.Errorf("truncated header: wrote %d", n)
	}
	if st := s.Stats(); st.Panics != 1 || st.Malformed != 1 {
		t.Errorf("panics %d malformed %d, want 1 and 1", st.Panics, st.Malformed)
	}
}

func TestBatchForgetBoundedByPayload(t *testing.T) {
	fs := &fakeFS{}
	c := fuseclient.New(nil)
	in := fuse.BatchForgetIn{Count: 1 << 31}
	one := fuse.ForgetOne{NodeID: 9, Nlookup: 1}
	req := c.Encode(fuse.OpBatchForget, 0, fuse.AsBytes(&in), fuse.AsBytes(&one), fuse.AsBytes(&one))
	s := fuse.NewServer(fs, fuse.Options{})
	init := fuse.InitIn{Major: 7, Minor: 38}
	s.Handle([][]byte{c.Encode(fuse.OpInit, 0, fuse.AsBytes(&init))}, [][]byte{make([]byte, 128)})
	if n := s.Handle([][]byte{req}, nil); n != 0 {
		t.Errorf("BATCH_FORGET wrote a %d-byte reply", n)
	}
	n := 0
	for _, call := range fs.calls {
		if call == "forget" {
			n++
		}
	}
	if n != 2 {
		t.Errorf("BATCH_FORGET with count 2^31 and 2 entries: %d forgets", n)
	}
}

// FuzzHandle feeds arbitrary bytes, cut at arbitrary points, to the server with room for a
// reply of any size. The reply must be well formed: nothing for a request without a header or
// without room for a reply header, or for the requests that have no reply (FORGET, BATCH_FORGET,
// INTERRUPT); otherwise a header whose length is the bytes written and whose unique is the
// request's, an error that is negative, one the server or the file system can answer, and
// alone (no body), or a body of the size its opcode answers with.
func FuzzHandle(f *testing.F) {
	c := fuseclient.New(nil)
	lookup := c.Encode(fuse.OpLookup, 1, []byte("file\x00"))
	w := fuse.WriteIn{Size: 4}
	f.Add(lookup, uint8(3), uint16(4096))
	f.Add(c.Encode(fuse.OpWrite, 7, fuse.AsBytes(&w), []byte("abcd")), uint8(7), uint16(64))
	r := fuse.ReadIn{Size: 100}
	f.Add(c.Encode(fuse.OpReaddirplus, 1, fuse.AsBytes(&r)), uint8(1), uint16(300))
	f.Add(c.Encode(fuse.OpRename2, 1, make([]byte, 16), []byte("a\x00b\x00")), uint8(2), uint16(16))
	quiet := logrus.New()
	quiet.SetOutput(io.Discard)
	f.Fuzz(func(t *testing.T, req []byte, cut uint8, outCap uint16) {
		fs := &fakeFS{data: []byte("some file data")}
		s := fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitDoReaddirplus, Logger: logrus.NewEntry(quiet)})
		init := fuse.InitIn{Major: 7, Minor: 38}
		s.Handle([][]byte{c.Encode(fuse.OpInit, 0, fuse.AsBytes(&init))}, [][]byte{make([]byte, 128)})
		var in [][]byte
		step := int(cut) + 1
		for b := req; len(b) > 0; {
			n := min(step, len(b))
			in = append(in, b[:n:n])
			b = b[n:]
		}
		out := make([]byte, outCap)
		n := s.Handle(in, [][]byte{out})
		checkReply(t, req, out, n)
	})
}

// fuzzErrnos are the errors the server answers by itself, and those of fakeFS (a method it
// does not implement panics: EIO).
var fuzzErrnos = map[unix.Errno]bool{
	unix.EINVAL: true, unix.ENOSYS: true, unix.EIO: true, unix.EPROTO: true, unix.ERANGE: true,
	unix.E2BIG: true, unix.EFBIG: true, unix.ENOENT: true, unix.ENAMETOOLONG: true,
	unix.ENOLCK: true, unix.EINTR: true,
}

// fuzzBodySizes are the reply body sizes of the opcodes whose successful answer is one struct.
var fuzzBodySizes = map[fuse.Opcode]int{
	fuse.OpLookup: 128, fuse.OpGetattr: 104, fuse.OpSetattr: 104, fuse.OpOpen: 16,
	fuse.OpOpendir: 16, fuse.OpWrite: 8, fuse.OpStatfs: 80, fuse.OpCreate: 144, fuse.OpMkdir: 128,
	fuse.OpMknod: 128, fuse.OpSymlink: 128, fuse.OpLink: 128, fuse.OpLseek: 8,
	fuse.OpCopyFileRange: 8, fuse.OpTmpfile: 144, fuse.OpGetlk: 24,
}

// checkReply checks the reply to a fuzzed request, and the size of a successful one's body.
func checkReply(t *testing.T, req, out []byte, n int) {
	t.Helper()
	body, err := fusecheck.Reply(req, out, n, func(e unix.Errno) bool { return fuzzErrnos[e] })
	if err != nil {
		t.Fatal(err)
	}
	var in fuse.InHeader
	copy(fuse.AsBytes(&in), req)
	if op := fuse.Opcode(in.Opcode); body != nil && fuzzBodySizes[op] != 0 && len(body) != fuzzBodySizes[op] {
		t.Fatalf("%v: %d-byte body, want %d", op, len(body), fuzzBodySizes[op])
	}
}

// handleSeeds are the seed corpus in testdata/fuzz/FuzzHandle, by file name: a well-formed
// request of every opcode the server serves, and the malformed ones of TestHostileRequests.
func handleSeeds() map[string][]byte {
	c := fuseclient.New(nil)
	name := func(s string) []byte { return append([]byte(s), 0) }
	setLen := func(req []byte, n uint32) []byte {
		req[0], req[1], req[2], req[3] = byte(n), byte(n>>8), byte(n>>16), byte(n>>24)
		return req
	}
	read := fuse.ReadIn{Fh: 1, Size: 4096}
	write := fuse.WriteIn{Fh: 1, Size: 5}
	init16 := fuse.InitIn{Major: 7, Minor: 31, Flags: fuse.InitAsyncRead}
	init64 := fuse.InitIn{Major: 7, Minor: 38, Flags: fuse.InitInitExt | fuse.InitDoReaddirplus, Flags2: 1}
	initNext := fuse.InitIn{Major: 8}
	setxattr := fuse.SetxattrIn{Size: 3}
	getxattr := fuse.GetxattrIn{Size: 64}
	batch := fuse.BatchForgetIn{Count: 1 << 31}
	one := fuse.ForgetOne{NodeID: 7, Nlookup: 1}
	lk := fuse.LkIn{Fh: 1, Owner: 9, Lk: fuse.FileLock{End: 100, Type: unix.F_WRLCK}}
	return map[string][]byte{
		"init-7.31":          c.Encode(fuse.OpInit, 0, fuse.AsBytes(&init16)[:16]),
		"init-7.38":          c.Encode(fuse.OpInit, 0, fuse.AsBytes(&init64)),
		"init-major-8":       c.Encode(fuse.OpInit, 0, fuse.AsBytes(&initNext)),
		"lookup":             c.Encode(fuse.OpLookup, 1, name("file")),
		"lookup-255":         c.Encode(fuse.OpLookup, 1, name(strings.Repeat("n", 255))),
		"lookup-256":         c.Encode(fuse.OpLookup, 1, name(strings.Repeat("n", 256))),
		"lookup-empty":       c.Encode(fuse.OpLookup, 1, name("")),
		"lookup-slash":       c.Encode(fuse.OpLookup, 1, name("a/b")),
		"lookup-no-nul":      c.Encode(fuse.OpLookup, 1, []byte("file")),
		"lookup-len-beyond":  setLen(c.Encode(fuse.OpLookup, 1, name("file")), 200),
		"lookup-len-short":   setLen(c.Encode(fuse.OpLookup, 1, name("file")), 39),
		"forget":             c.Encode(fuse.OpForget, 7, fuse.AsBytes(&fuse.ForgetIn{Nlookup: 1})),
		"batch-forget-huge":  c.Encode(fuse.OpBatchForget, 0, fuse.AsBytes(&batch), fuse.AsBytes(&one), fuse.AsBytes(&one)),
		"getattr":            c.Encode(fuse.OpGetattr, 1, make([]byte, 16)),
		"setattr-short":      c.Encode(fuse.OpSetattr, 1, make([]byte, 10)),
		"readlink":           c.Encode(fuse.OpReadlink, 7),
		"symlink":            c.Encode(fuse.OpSymlink, 1, name("l"), name("target")),
		"symlink-long":       c.Encode(fuse.OpSymlink, 1, name("l"), name(strings.Repeat("t", 4097))),
		"mknod":              c.Encode(fuse.OpMknod, 1, fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFREG | 0o644}), name("n")),
		"mkdir":              c.Encode(fuse.OpMkdir, 1, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), name("d")),
		"unlink":             c.Encode(fuse.OpUnlink, 1, name("file")),
		"rmdir":              c.Encode(fuse.OpRmdir, 1, name("d")),
		"rename":             c.Encode(fuse.OpRename, 1, fuse.AsBytes(&fuse.RenameIn{Newdir: 1}), name("a"), name("b")),
		"rename-no-new":      c.Encode(fuse.OpRename, 1, make([]byte, 8), name("a")),
		"rename2":            c.Encode(fuse.OpRename2, 1, fuse.AsBytes(&fuse.Rename2In{Newdir: 1, Flags: unix.RENAME_NOREPLACE}), name("a"), name("b")),
		"link":               c.Encode(fuse.OpLink, 1, fuse.AsBytes(&fuse.LinkIn{Oldnodeid: 7}), name("l")),
		"open":               c.Encode(fuse.OpOpen, 7, fuse.AsBytes(&fuse.OpenIn{Flags: unix.O_RDWR})),
		"read":               c.Encode(fuse.OpRead, 7, fuse.AsBytes(&read)),
		"read-huge":          c.Encode(fuse.OpRead, 7, fuse.AsBytes(&fuse.ReadIn{Size: 1 << 30})),
		"write":              c.Encode(fuse.OpWrite, 7, fuse.AsBytes(&write), []byte("hello")),
		"write-size-lies":    c.Encode(fuse.OpWrite, 7, fuse.AsBytes(&fuse.WriteIn{Size: 100}), []byte("hello")),
		"statfs":             c.Encode(fuse.OpStatfs, 1),
		"release":            c.Encode(fuse.OpRelease, 7, fuse.AsBytes(&fuse.ReleaseIn{Fh: 1})),
		"fsync":              c.Encode(fuse.OpFsync, 7, fuse.AsBytes(&fuse.FsyncIn{Fh: 1, FsyncFlags: 1})),
		"flush":              c.Encode(fuse.OpFlush, 7, fuse.AsBytes(&fuse.FlushIn{Fh: 1})),
		"opendir":            c.Encode(fuse.OpOpendir, 1, fuse.AsBytes(&fuse.OpenIn{})),
		"readdir":            c.Encode(fuse.OpReaddir, 1, fuse.AsBytes(&read)),
		"readdirplus":        c.Encode(fuse.OpReaddirplus, 1, fuse.AsBytes(&read)),
		"create":             c.Encode(fuse.OpCreate, 1, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: unix.S_IFREG | 0o644}), name("c")),
		"setxattr":           c.Encode(fuse.OpSetxattr, 7, fuse.AsBytes(&setxattr)[:8], name("user.a"), []byte("abc")),
		"setxattr-size-lies": c.Encode(fuse.OpSetxattr, 7, fuse.AsBytes(&fuse.SetxattrIn{Size: 1 << 20})[:8], name("user.a"), []byte("abc")),
		"getxattr":           c.Encode(fuse.OpGetxattr, 7, fuse.AsBytes(&getxattr), name("user.a")),
		"getxattr-size":      c.Encode(fuse.OpGetxattr, 7, fuse.AsBytes(&fuse.GetxattrIn{}), name("user.a")),
		"listxattr":          c.Encode(fuse.OpListxattr, 7, fuse.AsBytes(&getxattr)),
		"removexattr":        c.Encode(fuse.OpRemovexattr, 7, name("user.a")),
		"access":             c.Encode(fuse.OpAccess, 7, fuse.AsBytes(&fuse.AccessIn{Mask: unix.R_OK})),
		"interrupt":          c.Encode(fuse.OpInterrupt, 0, fuse.AsBytes(&fuse.InterruptIn{Unique: 3})),
		"getlk":              c.Encode(fuse.OpGetlk, 7, fuse.AsBytes(&lk)),
		"setlkw":             c.Encode(fuse.OpSetlkw, 7, fuse.AsBytes(&lk)),
		"fallocate":          c.Encode(fuse.OpFallocate, 7, fuse.AsBytes(&fuse.FallocateIn{Fh: 1, Length: 4096})),
		"lseek":              c.Encode(fuse.OpLseek, 7, fuse.AsBytes(&fuse.LseekIn{Fh: 1, Whence: unix.SEEK_DATA})),
		"copy-file-range":    c.Encode(fuse.OpCopyFileRange, 7, fuse.AsBytes(&fuse.CopyFileRangeIn{FhIn: 1, NodeIDOut: 7, FhOut: 1, Len: 10})),
		"setupmapping":       c.Encode(fuse.OpSetupmapping, 7, make([]byte, 40)),
		"removemapping":      c.Encode(fuse.OpRemovemapping, 7, []byte{1, 0, 0, 0}),
		"syncfs":             c.Encode(fuse.OpSyncfs, 1, make([]byte, 8)),
		"tmpfile":            c.Encode(fuse.OpTmpfile, 1, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o600})),
		"destroy":            c.Encode(fuse.OpDestroy, 0),
		"unknown-opcode":     c.Encode(fuse.Opcode(63), 1),
		"huge-opcode":        c.Encode(fuse.Opcode(1<<31), 1),
		"ext-past-end":       func() []byte { r := c.Encode(fuse.OpLookup, 1, name("file")); r[36] = 0xff; return r }(),
	}
}

var updateHandleSeeds = flag.Bool("update-fuzz-seeds", false, "rewrite testdata/fuzz/FuzzHandle from handleSeeds")

// TestFuzzHandleSeedCorpus keeps the seed files in testdata in sync with handleSeeds (each
// with the buffers cut every 40 bytes and 4 KiB of reply room); run with -update-fuzz-seeds to
// rewrite them. Files not generated (crashers kept as regression seeds) are left alone.
func TestFuzzHandleSeedCorpus(t *testing.T) {
	files := map[string]string{}
	for name, req := range handleSeeds() {
		files[name] = fmt.Sprintf("go test fuzz v1\n[]byte(%q)\nbyte('\\x27')\nuint16(4096)\n", req)
	}
	fuzzseed.Check(t, "FuzzHandle", files, *updateHandleSeeds, "go test -run TestFuzzHandleSeedCorpus -update-fuzz-seeds")
}
