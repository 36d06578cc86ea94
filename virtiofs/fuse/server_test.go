package fuse_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/fuseclient"
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
		{"empty name", c.Encode(fuse.OpLookup, 1, []byte("\x00")), unix.EINVAL},
		{"name too long", c.Encode(fuse.OpLookup, 1, append(bytes.Repeat([]byte("a"), 256), 0)), unix.EINVAL},
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

// FuzzHandle feeds arbitrary bytes, cut at arbitrary points, to the server.
func FuzzHandle(f *testing.F) {
	c := fuseclient.New(nil)
	lookup := c.Encode(fuse.OpLookup, 1, []byte("file\x00"))
	w := fuse.WriteIn{Size: 4}
	f.Add(lookup, uint8(3), uint16(4096))
	f.Add(c.Encode(fuse.OpWrite, 7, fuse.AsBytes(&w), []byte("abcd")), uint8(7), uint16(64))
	r := fuse.ReadIn{Size: 100}
	f.Add(c.Encode(fuse.OpReaddirplus, 1, fuse.AsBytes(&r)), uint8(1), uint16(300))
	f.Add(c.Encode(fuse.OpRename2, 1, make([]byte, 16), []byte("a\x00b\x00")), uint8(2), uint16(16))
	f.Fuzz(func(t *testing.T, req []byte, cut uint8, outCap uint16) {
		fs := &fakeFS{data: []byte("some file data")}
		s := fuse.NewServer(fs, fuse.Options{InitFlags: fuse.InitDoReaddirplus})
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
		if n < 0 || n > len(out) {
			t.Fatalf("wrote %d into %d bytes", n, len(out))
		}
		if n >= 16 {
			var h fuse.OutHeader
			copy(fuse.AsBytes(&h), out)
			if int(h.Len) != n || h.Error > 0 {
				t.Fatalf("reply header %+v for %d bytes", h, n)
			}
		}
	})
}
