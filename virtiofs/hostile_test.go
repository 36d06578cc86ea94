package virtiofs_test

// The hostile-guest suite: kvfsd in-process on a real unix socket, driven by the in-repo
// front-end playing a malicious guest driver (raw descriptors, forged FUSE requests) and a
// malicious QEMU (raw vhost-user messages). Every case must end in an errno reply or a broken
// ring, never a crash, a hang or an access outside guest memory or outside the shared
// directory; afterwards kvfsd must serve normally again (after a device reset when the ring
// broke).

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/frontend"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/fuseclient"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

const (
	hostileMemSize   = 64 << 20
	hostileQueueSize = 256
	hostileTimeout   = 10 * time.Second
	secretContent    = "outside the share: never to be read or written by the guest\n"
	shareFileContent = "hello from inside the share\n"
	escapeProbe      = "kvfs-hostile-escape-probe"
)

func hostileNeedsRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root (file ownership, per-request credentials)")
	}
}

// ---------------------------------------------------------------------------------------------
// The host side: a shared directory with traps in it, and everything around it watched.

// hostileShare is the host tree of a hostile test:
//
//	base/                       watched ("../.." of the share)
//	base/root/                  watched (the share's parent)
//	base/root/neighbour.txt     watched
//	base/root/outside/secret    watched: owner 4321:4321, mode 0640, old mtime, an xattr
//	base/root/outside/sub/f     watched
//	base/root/share/            the shared directory
//	    file, big, dir/inner, fifo
//	    etc -> /etc, upup -> ../.., up -> .., out -> ../outside, sec -> ../outside/secret,
//	    abs -> base/root/outside (absolute)
//
// plus /etc, /etc/passwd and /etc/hostname, watched without being touched.
type hostileShare struct {
	base, root, share, outside string
	big                        []byte
	before                     map[string]string
}

func newHostileShare(t *testing.T) *hostileShare {
	t.Helper()
	base := t.TempDir()
	h := &hostileShare{base: base, root: filepath.Join(base, "root")}
	h.share = filepath.Join(h.root, "share")
	h.outside = filepath.Join(h.root, "outside")
	for _, d := range []string{h.root, h.share, h.outside, filepath.Join(h.outside, "sub"), filepath.Join(h.share, "dir")} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	h.big = make([]byte, 100<<10)
	for i := range h.big {
		h.big[i] = byte(i*7 + i>>8)
	}
	files := map[string]string{
		filepath.Join(h.root, "neighbour.txt"):    "next to the share\n",
		filepath.Join(h.outside, "secret"):        secretContent,
		filepath.Join(h.outside, "sub", "f"):      "deeper outside\n",
		filepath.Join(h.share, "file"):            shareFileContent,
		filepath.Join(h.share, "dir", "inner"):    "inner\n",
		filepath.Join(h.share, "big"):             string(h.big),
		filepath.Join(h.share, "dir", "filler-1"): "x",
	}
	for p, c := range files {
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	secret := filepath.Join(h.outside, "secret")
	hostileMust(t, os.Chmod(secret, 0o640))
	hostileMust(t, os.Chown(secret, 4321, 4321))
	unix.Lsetxattr(secret, "user.kvfs-test", []byte("outside"), 0) // best effort: not every fs has user xattrs
	old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	for _, p := range []string{secret, filepath.Join(h.outside, "sub", "f"), filepath.Join(h.root, "neighbour.txt")} {
		hostileMust(t, os.Chtimes(p, old, old))
	}
	hostileMust(t, unix.Mkfifo(filepath.Join(h.share, "fifo"), 0o644))
	links := map[string]string{
		"etc":  "/etc",
		"upup": "../..",
		"up":   "..",
		"out":  "../outside",
		"sec":  "../outside/secret",
		"abs":  h.outside,
	}
	for name, target := range links {
		hostileMust(t, os.Symlink(target, filepath.Join(h.share, name)))
	}
	for _, p := range []string{filepath.Join(h.outside, "sub"), h.outside, h.root, base} {
		hostileMust(t, os.Chtimes(p, old, old))
	}
	h.before = h.snapshot(t)
	return h
}

func hostileMust(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// describe is everything about one host path that a write through an escape would change:
// type and mode, owner, size, link count, mtime and ctime (so even a chmod to the same mode
// shows), content or link target, and extended attributes.
func describeHostPath(path string, content bool) (string, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return "", err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "mode=%o uid=%d gid=%d size=%d nlink=%d mtime=%d.%09d ctime=%d.%09d",
		st.Mode, st.Uid, st.Gid, st.Size, st.Nlink, st.Mtim.Sec, st.Mtim.Nsec, st.Ctim.Sec, st.Ctim.Nsec)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		if content {
			c, err := os.ReadFile(path)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(&b, " content=%q", c)
		}
	case unix.S_IFLNK:
		target, err := os.Readlink(path)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(&b, " target=%q", target)
	}
	buf := make([]byte, 64<<10)
	if n, err := unix.Llistxattr(path, buf); err == nil && n > 0 {
		names := strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00")
		sort.Strings(names)
		for _, name := range names {
			v := make([]byte, 64<<10)
			m, err := unix.Lgetxattr(path, name, v)
			if err != nil {
				m = 0
			}
			fmt.Fprintf(&b, " xattr[%s]=%q", name, v[:m])
		}
	}
	return b.String(), nil
}

// snapshot describes everything under base except the share, and a few files of /etc.
func (h *hostileShare) snapshot(t *testing.T) map[string]string {
	t.Helper()
	snap := map[string]string{}
	err := filepath.WalkDir(h.base, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == h.share {
			return filepath.SkipDir
		}
		s, err := describeHostPath(p, true)
		if err != nil {
			return err
		}
		snap[p] = s
		return nil
	})
	if err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	for _, p := range []string{"/etc", "/etc/passwd", "/etc/hostname"} {
		if s, err := describeHostPath(p, p != "/etc"); err == nil {
			snap[p] = s
		}
	}
	return snap
}

// check fails the test if anything outside the share changed or appeared since setup.
func (h *hostileShare) check(t *testing.T) {
	t.Helper()
	after := h.snapshot(t)
	for p, was := range h.before {
		now, ok := after[p]
		switch {
		case !ok:
			t.Errorf("ESCAPE: %s outside the share disappeared (was %s)", p, was)
		case now != was:
			t.Errorf("ESCAPE: %s outside the share changed:\n  was %s\n  now %s", p, was, now)
		}
	}
	for p, now := range after {
		if _, ok := h.before[p]; !ok {
			t.Errorf("ESCAPE: %s appeared outside the share (%s)", p, now)
		}
	}
}

func (h *hostileShare) hostFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(h.share, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ---------------------------------------------------------------------------------------------
// The server and the guest.

// hostileServer is a kvfsd serving one connection on a fresh socket.
type hostileServer struct {
	sock string
	srv  *virtiofs.Server
	done chan error
}

func startHostileServer(t *testing.T, cfg virtiofs.Config) *hostileServer {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "vhost-fs.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	s, err := virtiofs.NewServer(cfg)
	if err != nil {
		l.Close()
		t.Fatal(err)
	}
	hs := &hostileServer{sock: sock, srv: s, done: make(chan error, 1)}
	go func() { hs.done <- s.Serve(context.Background(), l) }()
	t.Cleanup(func() { s.Close() })
	return hs
}

// stillServing fails the test if Serve has returned.
func (hs *hostileServer) stillServing(t *testing.T) {
	t.Helper()
	select {
	case err := <-hs.done:
		hs.done <- err
		t.Fatalf("Serve returned while the connection should be up: %v", err)
	default:
	}
}

// served waits for Serve to return and returns its result.
func (hs *hostileServer) served(t *testing.T) error {
	t.Helper()
	select {
	case err := <-hs.done:
		hs.done <- err
		return err
	case <-time.After(hostileTimeout):
		t.Fatal("HANG: Serve did not return")
		return nil
	}
}

// hostileGuest is a connected front-end with its FUSE client.
type hostileGuest struct {
	fe *frontend.Frontend
	c  *fuseclient.Client
}

func dialHostile(t *testing.T, sock string, opts frontend.Options) *hostileGuest {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hostileTimeout)
	defer cancel()
	fe, err := frontend.Dial(ctx, sock, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fe.Close() })
	g := &hostileGuest{fe: fe, c: fuseclient.New(fe)}
	if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT: %v", err)
	}
	return g
}

func hostileCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), hostileTimeout)
}

func (g *hostileGuest) lookup(t *testing.T, parent uint64, name string) *fuse.EntryOut {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	e, err := g.c.Lookup(ctx, parent, name)
	if err != nil {
		t.Fatalf("LOOKUP %q: %v", name, err)
	}
	return e
}

func (g *hostileGuest) open(t *testing.T, node uint64, flags uint32) uint64 {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	o, err := g.c.Open(ctx, node, flags)
	if err != nil {
		t.Fatalf("OPEN: %v", err)
	}
	return o.Fh
}

func (g *hostileGuest) opendir(t *testing.T, node uint64) uint64 {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	o, err := g.c.Opendir(ctx, node)
	if err != nil {
		t.Fatalf("OPENDIR: %v", err)
	}
	return o.Fh
}

// healthy checks that a normal request on the request queue works and reads the share.
func (g *hostileGuest) healthy(t *testing.T) {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	e, err := g.c.Lookup(ctx, fuse.RootID, "file")
	if err != nil {
		t.Fatalf("a normal LOOKUP after the hostile request: %v", err)
	}
	if e.Attr.Size != uint64(len(shareFileContent)) {
		t.Fatalf("a normal LOOKUP after the hostile request: size %d", e.Attr.Size)
	}
	if err := g.c.Forget(ctx, e.NodeID, 1); err != nil {
		t.Fatalf("FORGET: %v", err)
	}
}

// ---------------------------------------------------------------------------------------------
// Raw requests with canaries: every buffer, readable or writable, sits between two canaries in
// guest memory, so a write outside the writable buffers shows.

const canaryLen = 64

type guestBuf struct {
	gpa uint64 // of the allocation; the buffer is at addr()
	mem []byte // canary, buffer, canary
	n   int
	pat byte
}

func (b *guestBuf) body() []byte { return b.mem[canaryLen : canaryLen+b.n] }

func (b *guestBuf) addr() uint64 { return b.gpa + canaryLen }

func (b *guestBuf) checkCanaries(t *testing.T, what string) {
	t.Helper()
	for i, c := range b.mem {
		if i >= canaryLen && i < canaryLen+b.n {
			continue
		}
		if c != b.pat {
			where := fmt.Sprintf("%d bytes after", i-canaryLen-b.n+1)
			if i < canaryLen {
				where = fmt.Sprintf("%d bytes before", canaryLen-i)
			}
			t.Errorf("OUT OF BOUNDS: %s: the canary byte %s the buffer changed to %#x", what, where, c)
			return
		}
	}
}

func (g *hostileGuest) alloc(t *testing.T, n int, pat byte) *guestBuf {
	t.Helper()
	gpa, mem := g.fe.Alloc(uint64(n + 2*canaryLen))
	if mem == nil {
		t.Fatal("guest memory exhausted")
	}
	for i := range mem {
		mem[i] = pat
	}
	return &guestBuf{gpa: gpa, mem: mem, n: n, pat: pat}
}

// rawReply is what the device did with a chain.
type rawReply struct {
	written uint32
	out     []byte // the writable buffers, concatenated, up to written
}

// submit places readable buffers (each its own descriptor) and writable buffers of the given
// sizes on queue q, waits for the device to use the chain, and checks every canary.
func (g *hostileGuest) submit(t *testing.T, q int, readable [][]byte, writable []int) rawReply {
	t.Helper()
	var rd, wr []virtq.Buf
	var bufs []*guestBuf
	defer func() {
		for _, b := range bufs {
			g.fe.Free(b.gpa)
		}
	}()
	for i, p := range readable {
		b := g.alloc(t, len(p), 0xA0+byte(i%16))
		copy(b.body(), p)
		bufs = append(bufs, b)
		rd = append(rd, virtq.Buf{Addr: b.addr(), Len: uint32(len(p))})
	}
	nr := len(bufs)
	total := 0
	for i, n := range writable {
		b := g.alloc(t, n, 0xC0+byte(i%16))
		for j := range b.body() {
			b.body()[j] = 0xEE
		}
		bufs = append(bufs, b)
		wr = append(wr, virtq.Buf{Addr: b.addr(), Len: uint32(n)})
		total += n
	}
	ctx, cancel := hostileCtx()
	defer cancel()
	written, err := g.fe.Submit(ctx, q, rd, wr)
	if err != nil {
		t.Fatalf("HANG: the device did not complete the request: %v", err)
	}
	for i, b := range bufs {
		b.checkCanaries(t, fmt.Sprintf("buffer %d", i))
		if i < nr && !bytes.Equal(b.body(), readable[i]) {
			t.Errorf("OUT OF BOUNDS: the device wrote into readable buffer %d", i)
		}
	}
	if int(written) > total {
		t.Fatalf("OUT OF BOUNDS: the device claims %d bytes written into %d writable bytes", written, total)
	}
	var out []byte
	for _, b := range bufs[nr:] {
		out = append(out, b.body()...)
	}
	return rawReply{written: written, out: out[:written]}
}

var errNoFUSEReply = errors.New("no reply written")

// parse checks a FUSE reply and returns its body or errno.
func (r rawReply) parse(unique uint64) ([]byte, error) {
	if r.written == 0 {
		return nil, errNoFUSEReply
	}
	if r.written < 16 {
		return nil, fmt.Errorf("%w: %d-byte reply", fuseclient.ErrProtocol, r.written)
	}
	var h fuse.OutHeader
	copy(fuse.AsBytes(&h), r.out)
	switch {
	case h.Len != r.written:
		return nil, fmt.Errorf("%w: header says %d bytes, %d written", fuseclient.ErrProtocol, h.Len, r.written)
	case h.Unique != unique:
		return nil, fmt.Errorf("%w: unique %d for request %d", fuseclient.ErrProtocol, h.Unique, unique)
	case h.Error > 0:
		return nil, fmt.Errorf("%w: positive error %d", fuseclient.ErrProtocol, h.Error)
	case h.Error < 0:
		if r.written != 16 {
			return nil, fmt.Errorf("%w: error reply with a body", fuseclient.ErrProtocol)
		}
		return nil, unix.Errno(-h.Error)
	}
	return r.out[16:], nil
}

// splitReq lays a request out as Linux does: the header in one buffer, the arguments in another.
func splitReq(req []byte) [][]byte {
	if len(req) <= 40 {
		return [][]byte{req}
	}
	return [][]byte{req[:40], req[40:]}
}

// replyBufs are the writable buffers Linux offers: the out header, then room for the body.
func replyBufs(replyCap int) []int {
	if replyCap == 0 {
		return nil
	}
	if replyCap <= 16 {
		return []int{replyCap}
	}
	return []int{16, replyCap - 16}
}

func uniqueOf(req []byte) uint64 {
	var h fuse.InHeader
	copy(fuse.AsBytes(&h), req)
	return h.Unique
}

// send sends an encoded request on queue q with replyCap writable bytes.
func (g *hostileGuest) send(t *testing.T, q int, req []byte, replyCap int) ([]byte, error) {
	t.Helper()
	return g.submit(t, q, splitReq(req), replyBufs(replyCap)).parse(uniqueOf(req))
}

// call encodes and sends a request on the request queue with 4 KiB of reply room.
func (g *hostileGuest) call(t *testing.T, op fuse.Opcode, node uint64, args ...[]byte) ([]byte, error) {
	t.Helper()
	return g.send(t, 1, g.c.Encode(op, node, args...), 4096)
}

func fuseName(s string) []byte { return append([]byte(s), 0) }

func expectErrno(t *testing.T, what string, err error, want ...unix.Errno) {
	t.Helper()
	var e unix.Errno
	if !errors.As(err, &e) {
		t.Errorf("%s: got %v, want errno %v", what, err, want)
		return
	}
	for _, w := range want {
		if e == w {
			return
		}
	}
	t.Errorf("%s: got %v (%s), want %v", what, e, unix.ErrnoName(e), want)
}

func expectOK(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v", what, err)
	}
}

func decodeEntryOut(t *testing.T, body []byte) fuse.EntryOut {
	t.Helper()
	var e fuse.EntryOut
	if len(body) != len(fuse.AsBytes(&e)) {
		t.Fatalf("entry reply of %d bytes", len(body))
	}
	copy(fuse.AsBytes(&e), body)
	return e
}

// ---------------------------------------------------------------------------------------------
// Ring level: a hostile guest driver writes descriptors itself.

// ringRig is what a ring case needs to forge descriptors.
type ringRig struct {
	d       *virtq.Driver
	size    uint16
	scratch uint64 // 4 KiB of valid guest memory
	table   uint64 // 64 KiB of valid guest memory for indirect tables
}

type ringCase struct {
	name    string
	publish func(t *testing.T, r *ringRig)
}

func ringCases() []ringCase {
	const memSize = hostileMemSize
	ind := func(t *testing.T, r *ringRig, at uint64, ds ...virtq.RawDesc) {
		t.Helper()
		if err := r.d.WriteIndirect(at, ds); err != nil {
			t.Fatal(err)
		}
	}
	return []ringCase{
		{"descriptor loop", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 16, virtq.DescFNext, 0)
			r.d.Publish(0)
		}},
		{"descriptor pointing at itself", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(3, r.scratch, 40, virtq.DescFNext, 3)
			r.d.Publish(3)
		}},
		{"chain through the whole table and around", func(t *testing.T, r *ringRig) {
			for i := range r.size {
				r.d.WriteDesc(i, r.scratch, 8, virtq.DescFNext, (i+1)%r.size)
			}
			r.d.Publish(0)
		}},
		{"head equal to the queue size", func(t *testing.T, r *ringRig) { r.d.Publish(r.size) }},
		{"head 0xffff", func(t *testing.T, r *ringRig) { r.d.Publish(math.MaxUint16) }},
		{"next equal to the queue size", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, r.size)
			r.d.Publish(0)
		}},
		{"next 0xffff", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, math.MaxUint16)
			r.d.Publish(0)
		}},
		{"address just past guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize, 40, 0, 0)
			r.d.Publish(0)
		}},
		{"address far outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, 1<<62, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"writable address outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, memSize+4096, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"addr+len overflows 2^64", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, math.MaxUint64-15, 4096, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"length runs past the end of memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize-16, 4096, 0, 0)
			r.d.Publish(0)
		}},
		{"length 2^32-1", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+4096, math.MaxUint32, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"readable after writable", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 16, virtq.DescFWrite|virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 40, 0, 0)
			r.d.Publish(0)
		}},
		{"indirect inside indirect", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.table + 1024, Len: 16, Flags: virtq.DescFIndirect})
			ind(t, r, r.table+1024, virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect inside indirect after a good descriptor", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.table + 1024, Len: 16, Flags: virtq.DescFIndirect})
			ind(t, r, r.table+1024, virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"INDIRECT|NEXT", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect|virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"indirect after a direct descriptor", func(t *testing.T, r *ringRig) {
			// Allowed by the spec (the last descriptor of a chain may be INDIRECT); the table
			// then holds a loop, which must be caught within the table's length.
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch + 128, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 0})
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 0 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, 0, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 17 bytes", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40}, virtq.RawDesc{})
			r.d.WriteDesc(0, r.table, 17, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 8 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, 8, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table longer than allowed", func(t *testing.T, r *ringRig) {
			n := max(uint32(r.size), virtq.MaxIndirectDescs) + 1
			r.d.WriteDesc(0, r.table, 16*n, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 2^32-16 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, math.MaxUint32-15, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize-16, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table wrapping around 2^64", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, math.MaxUint64-15, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect next past the table", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect loop", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch, Len: 8, Flags: virtq.DescFNext, Next: 0})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"readable after writable in an indirect table", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect entry outside guest memory", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: memSize - 8, Len: 16, Flags: virtq.DescFWrite})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"avail idx jumps by queue size + 1", func(t *testing.T, r *ringRig) {
			r.d.SetAvailIdx(r.d.AvailIdx() + r.size + 1)
		}},
		{"avail idx jumps backwards", func(t *testing.T, r *ringRig) {
			r.d.SetAvailIdx(r.d.AvailIdx() - 1)
		}},
	}
}

// errEventfd installs an eventfd of ours as the error notifier of vring q (as QEMU does with
// SET_VRING_ERR) and returns it.
func errEventfd(t *testing.T, fe *frontend.Frontend, q int) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := fe.Client().SetVringErr(uint8(q), fd); err != nil {
		t.Fatalf("SET_VRING_ERR: %v", err)
	}
	// SET_VRING_ERR has no reply: a request that has one tells when the back-end got there,
	// since it handles messages in order. Until then a broken ring signals the old fd.
	if _, err := fe.Client().GetFeatures(); err != nil {
		t.Fatalf("GET_FEATURES: %v", err)
	}
	return fd
}

// eventfdSignalled waits up to d for fd to become readable and drains it.
func eventfdSignalled(fd int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		ms := int(time.Until(deadline) / time.Millisecond)
		if ms < 0 {
			ms = 0
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, ms)
		if err == unix.EINTR {
			continue
		}
		if n > 0 {
			var b [8]byte
			unix.Read(fd, b[:])
			return true
		}
		return false
	}
}

func usedIndex(t *testing.T, fe *frontend.Frontend, q int) uint16 {
	t.Helper()
	b, err := fe.Memory().Slice(fe.Driver(q).UsedAddr(), 4)
	if err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint16(b[2:])
}

// wantBroken checks that vring q was marked broken: its error eventfd fired, the hostile chain
// was not completed, and a good request published afterwards is not served either.
func (g *hostileGuest) wantBroken(t *testing.T, q, errFD int, used uint16) {
	t.Helper()
	if !eventfdSignalled(errFD, hostileTimeout) {
		t.Fatalf("vring %d was not marked broken (no error eventfd signal)", q)
	}
	if now := usedIndex(t, g.fe, q); now != used {
		t.Errorf("vring %d: used idx moved from %d to %d for a hostile chain", q, used, now)
	}
	req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
	in := g.alloc(t, len(req), 0)
	out := g.alloc(t, 4096, 0)
	copy(in.body(), req)
	p, err := g.fe.SubmitAsync(q, []virtq.Buf{{Addr: in.addr(), Len: uint32(len(req))}},
		[]virtq.Buf{{Addr: out.addr(), Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	g.fe.Kick(q)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := p.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("vring %d: a request on the broken ring was answered (%v)", q, err)
	}
	t.Cleanup(func() { g.fe.Free(in.gpa); g.fe.Free(out.gpa) }) // after the reset stops the ring
}

// reset is a guest reboot: the device is stopped and started with fresh rings, and the new
// driver sends INIT. Then a normal LOOKUP must work on every queue.
func (g *hostileGuest) reset(t *testing.T) {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	if err := g.fe.Stop(ctx); err != nil {
		t.Fatalf("device stop: %v", err)
	}
	if err := g.fe.Start(ctx); err != nil {
		t.Fatalf("device start: %v", err)
	}
	if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT after reset: %v", err)
	}
	g.healthy(t)
	for q := range g.fe.NumQueues() {
		body, err := g.send(t, q, g.c.Encode(fuse.OpLookup, fuse.RootID, fuseName("file")), 4096)
		if err != nil {
			t.Fatalf("LOOKUP on vring %d after reset: %v", q, err)
		}
		decodeEntryOut(t, body)
	}
}

func (g *hostileGuest) ringRig(t *testing.T, q int) *ringRig {
	t.Helper()
	s := g.alloc(t, 4096*2, 0)
	tb := g.alloc(t, 64<<10, 0)
	t.Cleanup(func() { g.fe.Free(s.gpa); g.fe.Free(tb.gpa) })
	return &ringRig{d: g.fe.Driver(q), size: g.fe.Driver(q).Size(), scratch: s.addr(), table: tb.addr()}
}

// TestHostileRing feeds the device malformed descriptor chains. Each must break the ring (error
// eventfd signalled, chain not completed, ring no longer served) while the connection stays up,
// and a device reset must bring the device back.
func TestHostileRing(t *testing.T) {
	hostileNeedsRoot(t)
	for _, cfg := range []struct {
		name   string
		pool   int
		queues []int
	}{
		{"inline", 0, []int{1, 0}},
		{"pool", 2, []int{1}},
	} {
		t.Run(cfg.name, func(t *testing.T) {
			h := newHostileShare(t)
			hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: cfg.pool})
			g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize})
			errFDs := map[int]int{}
			for _, q := range cfg.queues {
				errFDs[q] = errEventfd(t, g.fe, q)
			}
			for _, q := range cfg.queues {
				for _, rc := range ringCases() {
					t.Run(fmt.Sprintf("vring%d/%s", q, rc.name), func(t *testing.T) {
						used := usedIndex(t, g.fe, q)
						rc.publish(t, g.ringRig(t, q))
						if err := g.fe.Kick(q); err != nil {
							t.Fatal(err)
						}
						g.wantBroken(t, q, errFDs[q], used)
						hs.stillServing(t)
						g.reset(t)
						h.check(t)
					})
				}
			}
			hs.stillServing(t)
		})
	}

	t.Run("indirect not negotiated", func(t *testing.T) {
		h := newHostileShare(t)
		hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
		g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize, NoIndirect: true})
		errFD := errEventfd(t, g.fe, 1)
		used := usedIndex(t, g.fe, 1)
		r := g.ringRig(t, 1)
		if err := r.d.WriteIndirect(r.table, []virtq.RawDesc{{Addr: r.scratch, Len: 40}}); err != nil {
			t.Fatal(err)
		}
		r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
		r.d.Publish(0)
		g.fe.Kick(1)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})
}

// TestHostileRingFlood has the guest keep the request queue full forever, republishing one
// chain as fast as the device consumes it (a driver may not reuse a head in flight, but the
// device cannot tell). The device may serve the flood, but the front-end must still be able to
// stop the device: GET_VRING_BASE (a VM stop or reset) and memory table changes must not wait on
// the guest's good will.
func TestHostileRingFlood(t *testing.T) {
	hostileNeedsRoot(t)
	for _, pool := range []int{0, 2} {
		t.Run(fmt.Sprintf("pool=%d", pool), func(t *testing.T) {
			h := newHostileShare(t)
			hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: pool})
			g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: 4096})
			r := g.ringRig(t, 1)
			// One valid GETATTR whose request and reply are cut into single bytes through an
			// indirect table: legal, and slow enough to serve that a full ring of them keeps
			// the device busy for longer than the guest needs to refill it.
			req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
			b, err := g.fe.Memory().Slice(r.scratch, uint64(len(req)))
			hostileMust(t, err)
			copy(b, req)
			var table []virtq.RawDesc
			for i := range uint64(len(req)) {
				table = append(table, virtq.RawDesc{Addr: r.scratch + i, Len: 1})
			}
			for i := range uint64(512 - len(req)) {
				table = append(table, virtq.RawDesc{Addr: r.scratch + 4096 + i, Len: 1, Flags: virtq.DescFWrite})
			}
			for i := range table[:len(table)-1] {
				table[i].Flags |= virtq.DescFNext
				table[i].Next = uint16(i + 1)
			}
			hostileMust(t, r.d.WriteIndirect(r.table, table))
			r.d.WriteDesc(0, r.table, uint32(16*len(table)), virtq.DescFIndirect, 0)

			used, err := g.fe.Memory().Slice(r.d.UsedAddr(), 4)
			hostileMust(t, err)
			stop := make(chan struct{})
			flooding := make(chan uint64)
			go func() {
				var n uint64
				defer func() { flooding <- n }()
				for {
					select {
					case <-stop:
						return
					default:
					}
					// Refill every slot the device has freed, in one burst, so it never finds
					// the ring empty.
					room := r.size - (r.d.AvailIdx() - binary.LittleEndian.Uint16(used[2:]))
					for range room {
						r.d.Publish(0)
					}
					if room > 0 {
						n += uint64(room)
						g.fe.Kick(1)
					} else {
						runtime.Gosched()
					}
				}
			}()
			time.Sleep(200 * time.Millisecond)

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			start := time.Now()
			stopErr := g.fe.Stop(ctx)
			cancel()
			close(stop)
			n := <-flooding
			t.Logf("%d chains published; device stop took %v", n, time.Since(start))
			if stopErr != nil {
				t.Errorf("HANG: the front-end could not stop the device while the guest floods the ring: %v", stopErr)
				// The late GET_VRING_BASE reply desynchronises the connection: start over.
				g.fe.Close()
				start = time.Now()
				if err := hs.served(t); err != nil {
					t.Logf("Serve: %v", err)
				}
				t.Logf("Serve returned %v after the flood stopped", time.Since(start))
				hs = startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: pool})
				g = dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: 4096})
				g.healthy(t)
				h.check(t)
				return
			}
			hs.stillServing(t)
			ctx, cancel = hostileCtx()
			defer cancel()
			hostileMust(t, g.fe.Start(ctx))
			if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
				t.Fatal(err)
			}
			g.healthy(t)
			h.check(t)
		})
	}
}

// ---------------------------------------------------------------------------------------------
// Hostile QEMU, ring level: memory pulled from under running rings, an unusable kick fd.

// frontendMemfd finds the memfd behind the front-end's guest memory (the front-end keeps it to
// itself), so that a test can hand the same memory to the back-end again.
func frontendMemfd(t *testing.T, fe *frontend.Frontend) int {
	t.Helper()
	uaddr := fe.Memory().Regions()[0].UserAddr
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	var ino uint64
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || uaddr < start || uaddr >= end {
			continue
		}
		ino, _ = strconv.ParseUint(f[4], 10, 64)
		break
	}
	if ino == 0 {
		t.Fatal("guest memory not found in /proc/self/maps")
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		link, _ := os.Readlink("/proc/self/fd/" + e.Name())
		var st unix.Stat_t
		if strings.HasPrefix(link, "/memfd:") && unix.Fstat(fd, &st) == nil && st.Ino == ino {
			return fd
		}
	}
	t.Fatal("the front-end's memfd not found")
	return -1
}

func regionsOf(fe *frontend.Frontend) []vhostuser.MemoryRegion {
	var rs []vhostuser.MemoryRegion
	for _, r := range fe.Memory().Regions() {
		rs = append(rs, vhostuser.MemoryRegion{GuestPhysAddr: r.GuestPhysAddr, Size: r.Size,
			UserAddr: r.UserAddr, MmapOffset: r.MmapOffset})
	}
	return rs
}

// TestHostileQEMURings has the front-end pull guest memory from under running rings and hand
// the back-end a kick fd that hangs up. The rings must break (not the process, not the
// connection), and once the front-end puts things right a device reset must work.
func TestHostileQEMURings(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize, Regions: 2})
	memfd := frontendMemfd(t, g.fe)
	regions := regionsOf(g.fe)
	if len(regions) != 2 {
		t.Fatalf("%d regions", len(regions))
	}
	errFD := errEventfd(t, g.fe, 1)

	t.Run("REM_MEM_REG of the ring region", func(t *testing.T) {
		used := usedIndex(t, g.fe, 1)
		err := g.fe.Client().RemMemReg(regions[0])
		t.Logf("REM_MEM_REG: %v", err)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().AddMemReg(regions[0], memfd); err != nil {
			t.Fatalf("ADD_MEM_REG back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("REM_MEM_REG under the guest's buffers", func(t *testing.T) {
		if err := g.fe.Client().RemMemReg(regions[1]); err != nil {
			t.Fatalf("REM_MEM_REG of a region without rings: %v", err)
		}
		g.healthy(t) // the rings and the allocator's first buffers are in region 0
		used := usedIndex(t, g.fe, 1)
		r := g.ringRig(t, 1)
		req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
		copy(g.fe.Memory().Regions()[0].Bytes()[r.scratch:], req)
		r.d.WriteDesc(0, r.scratch, uint32(len(req)), virtq.DescFNext, 1)
		r.d.WriteDesc(1, regions[1].GuestPhysAddr+4096, 4096, virtq.DescFWrite, 0)
		r.d.Publish(0)
		g.fe.Kick(1)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().AddMemReg(regions[1], memfd); err != nil {
			t.Fatalf("ADD_MEM_REG back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("SET_MEM_TABLE moving the rings away", func(t *testing.T) {
		used := usedIndex(t, g.fe, 1)
		moved := slices.Clone(regions)
		for i := range moved {
			moved[i].UserAddr += 1 << 40
		}
		err := g.fe.Client().SetMemTable(moved, []int{memfd, memfd})
		t.Logf("SET_MEM_TABLE: %v", err)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().SetMemTable(regions, []int{memfd, memfd}); err != nil {
			t.Fatalf("SET_MEM_TABLE back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("kick fd that hangs up", func(t *testing.T) {
		var p [2]int
		hostileMust(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
		unix.Close(p[1]) // no writer: the read end reports POLLHUP forever
		err := g.fe.Client().SetVringKick(1, p[0])
		unix.Close(p[0])
		if err != nil {
			t.Fatal(err)
		}
		if !eventfdSignalled(errFD, hostileTimeout) {
			t.Fatal("vring 1 with a hung-up kick fd was not marked broken")
		}
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})

	t.Run("kick fd that is a regular file", func(t *testing.T) {
		f, err := os.Open(filepath.Join(h.share, "file"))
		if err != nil {
			t.Fatal(err)
		}
		err = g.fe.Client().SetVringKick(1, int(f.Fd()))
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		// Always readable, and epoll cannot wait on it: the ring must break rather than spin
		// or wait forever.
		if !eventfdSignalled(errFD, hostileTimeout) {
			t.Fatal("vring 1 with a regular file as kick fd was not marked broken")
		}
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})

	// Resets out of QEMU's usual order: the back-end forgets the rings (and their error fds)
	// while the driver still believes them running; the next device start must work.
	for _, req := range []vhostuser.Request{vhostuser.ResetOwner, vhostuser.ResetDevice} {
		t.Run(req.String()+" mid-session", func(t *testing.T) {
			if _, err := g.fe.Client().Raw(uint32(req), vhostuser.Version, nil, nil); err != nil {
				t.Fatal(err)
			}
			hs.stillServing(t)
			g.reset(t)
			h.check(t)
		})
	}
}

// ---------------------------------------------------------------------------------------------
// vhost-user level: malformed messages from the front-end, each on a fresh server.

// countMemfdMappings counts the memfd mappings of the process: guest memory mapped by the
// back-end and the front-end.
func countMemfdMappings(t *testing.T) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(maps), "/memfd:")
}

func countOpenFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func vringStatePayload(idx, num uint32) []byte {
	return vhostuser.VringState{Index: idx, Num: num}.Append(nil)
}

func memTablePayload(n uint32, rs ...vhostuser.MemoryRegion) []byte {
	b := binary.LittleEndian.AppendUint32(nil, n)
	b = binary.LittleEndian.AppendUint32(b, 0)
	for _, r := range rs {
		b = r.Append(b)
	}
	return b
}

// vuOutcome is how a hostile message must end.
type vuOutcome int

const (
	vuClosed vuOutcome = iota // Serve returns an error and the connection is gone
	vuNacked                  // the message is answered with a failure ack; the connection works
)

type vuCase struct {
	name string
	want vuOutcome
	// send sends the hostile message and returns the raw reply, if any was read.
	send func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error)
}

func rawMsg(req vhostuser.Request, flags uint32, payload []byte, fds ...int) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
		return g.fe.Client().Raw(uint32(req), flags, payload, fds)
	}
}

// rawBytes writes bytes on the socket as they are, and half-closes it if eof.
func rawWire(b []byte, eof bool) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
		uc := g.fe.Client().Conn().UnixConn()
		if _, err := uc.Write(b); err != nil {
			return nil, err
		}
		if eof {
			return nil, uc.CloseWrite()
		}
		return nil, nil
	}
}

func wireHeader(req vhostuser.Request, flags, size uint32) []byte {
	return vhostuser.Header{Request: req, Flags: flags, Size: size}.Append(nil)
}

func vuCases() []vuCase {
	const v, ack = vhostuser.Version, vhostuser.Version | vhostuser.FlagNeedReply
	region := func(gpa, size uint64) vhostuser.MemoryRegion {
		return vhostuser.MemoryRegion{GuestPhysAddr: gpa, Size: size, UserAddr: 0x7000_0000_0000 + gpa}
	}
	nine := make([]vhostuser.MemoryRegion, 9)
	for i := range nine {
		nine[i] = region(uint64(i)<<20, 1<<20)
	}
	memTableWith := func(flags uint32, nfds int, n uint32, rs ...vhostuser.MemoryRegion) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			fds := make([]int, nfds)
			for i := range fds {
				fds[i] = memfd
			}
			return g.fe.Client().Raw(uint32(vhostuser.SetMemTable), flags, memTablePayload(n, rs...), fds)
		}
	}
	withFD := func(req vhostuser.Request, flags uint32, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			return g.fe.Client().Raw(uint32(req), flags, payload, []int{fd})
		}
	}
	threeFDs := func(req vhostuser.Request, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(req), v, payload, []int{memfd, memfd, memfd})
		}
	}
	u64 := func(x uint64) []byte { return binary.LittleEndian.AppendUint64(nil, x) }
	vringFile := func(idx uint64) []byte { return u64(idx) }
	return []vuCase{
		{"SET_MEM_TABLE claiming 9 regions with 8 fds", vuClosed, memTableWith(v, 8, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with 8 fds, NEED_REPLY", vuNacked, memTableWith(ack, 8, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with 9 fds", vuClosed, memTableWith(ack, 9, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with no fds", vuNacked, memTableWith(ack, 0, 9, nine...)},
		{"SET_MEM_TABLE claiming 2^32-1 regions", vuNacked, memTableWith(ack, 1, math.MaxUint32, nine[0])},
		{"SET_MEM_TABLE claiming 1 region carrying 2", vuNacked, memTableWith(ack, 1, 1, nine[0], nine[1])},
		{"SET_MEM_TABLE region of 2^50 bytes", vuNacked, memTableWith(ack, 1, 1, region(0, 1<<50))},
		{"SET_MEM_TABLE region of 2^50 bytes, no reply asked", vuClosed, memTableWith(v, 1, 1, region(0, 1<<50))},
		{"SET_MEM_TABLE region larger than its memfd", vuNacked, memTableWith(ack, 1, 1, region(0, 2*hostileMemSize))},
		{"SET_MEM_TABLE region of 2^64-1 bytes", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{Size: math.MaxUint64})},
		{"SET_MEM_TABLE region wrapping around 2^64", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{GuestPhysAddr: math.MaxUint64 - 4095, Size: 8192, UserAddr: 1 << 40})},
		{"SET_MEM_TABLE region of 0 bytes", vuNacked, memTableWith(ack, 1, 1, region(0, 0))},
		{"SET_MEM_TABLE overlapping regions", vuNacked, memTableWith(ack, 2, 2, region(0, 1<<20), region(4096, 1<<20))},
		{"SET_MEM_TABLE mmap offset past the memfd", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{Size: 1 << 20, UserAddr: 1 << 40, MmapOffset: hostileMemSize})},
		{"ADD_MEM_REG of 2^50 bytes", vuNacked, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack,
				vhostuser.SingleRegion{Region: region(1<<40, 1<<50)}.Append(nil), []int{memfd})
		}},
		{"ADD_MEM_REG overlapping guest memory", vuNacked, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack,
				vhostuser.SingleRegion{Region: region(4096, 4096)}.Append(nil), []int{memfd})
		}},
		{"REM_MEM_REG of an unknown region", vuNacked, rawMsg(vhostuser.RemMemReg, ack,
			vhostuser.SingleRegion{Region: region(1<<40, 4096)}.Append(nil))},
		{"SET_VRING_NUM 1000 (not a power of two)", vuClosed, rawMsg(vhostuser.SetVringNum, v, vringStatePayload(5, 1000))},
		{"SET_VRING_NUM 1000, NEED_REPLY", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 1000))},
		{"SET_VRING_NUM 0", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 0))},
		{"SET_VRING_NUM 65536", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 65536))},
		{"SET_VRING_NUM 2^32-1", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, math.MaxUint32))},
		{"SET_VRING_NUM on a running vring", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(1, 3))},
		{"SET_VRING_NUM vring 17 (out of range)", vuClosed, rawMsg(vhostuser.SetVringNum, v, vringStatePayload(17, 256))},
		{"SET_VRING_NUM vring 2^32-1", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(math.MaxUint32, 256))},
		{"SET_VRING_BASE vring 1000", vuNacked, rawMsg(vhostuser.SetVringBase, ack, vringStatePayload(1000, 0))},
		{"SET_VRING_BASE wider than 16 bits", vuNacked, rawMsg(vhostuser.SetVringBase, ack, vringStatePayload(5, 1<<16))},
		{"SET_VRING_ENABLE vring 99", vuNacked, rawMsg(vhostuser.SetVringEnable, ack, vringStatePayload(99, 1))},
		{"SET_VRING_ENABLE value 2", vuNacked, rawMsg(vhostuser.SetVringEnable, ack, vringStatePayload(1, 2))},
		{"GET_VRING_BASE vring 99", vuClosed, rawMsg(vhostuser.GetVringBase, v, vringStatePayload(99, 0))},
		{"SET_VRING_ADDR vring 40", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 40}.Append(nil))},
		{"SET_VRING_ADDR misaligned", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 5, Desc: 8}.Append(nil))},
		{"SET_VRING_ADDR unknown flags", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 5, Flags: 6}.Append(nil))},
		{"SET_VRING_ADDR outside guest memory, then SET_VRING_KICK", vuClosed, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			c := g.fe.Client()
			if err := c.SetVringNum(5, 256); err != nil {
				return nil, err
			}
			if err := c.SetVringAddr(vhostuser.VringAddr{Index: 5, Desc: 1 << 44, Avail: 1<<44 + 4096, Used: 1<<44 + 8192}); err != nil {
				return nil, err
			}
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			return nil, c.SetVringKick(5, fd)
		}},
		{"SET_VRING_KICK vring 200 with an fd", vuClosed, withFD(vhostuser.SetVringKick, v, vringFile(200))},
		{"SET_VRING_KICK vring 200, NEED_REPLY", vuNacked, withFD(vhostuser.SetVringKick, ack, vringFile(200))},
		{"SET_VRING_CALL vring 255", vuNacked, withFD(vhostuser.SetVringCall, ack, vringFile(255))},
		{"SET_VRING_ERR vring 17", vuNacked, withFD(vhostuser.SetVringErr, ack, vringFile(17))},
		{"SET_VRING_CALL reserved bits", vuNacked, withFD(vhostuser.SetVringCall, ack, vringFile(1|1<<9))},
		{"SET_VRING_KICK announcing an fd but sending none", vuNacked, rawMsg(vhostuser.SetVringKick, ack, vringFile(1))},
		{"SET_VRING_KICK NOFD with an fd attached", vuNacked, withFD(vhostuser.SetVringKick, ack, vringFile(1|1<<8))},
		{"GET_FEATURES with 3 fds attached", vuClosed, threeFDs(vhostuser.GetFeatures, nil)},
		{"SET_FEATURES not offered", vuNacked, rawMsg(vhostuser.SetFeatures, ack, u64(math.MaxUint64))},
		{"SET_PROTOCOL_FEATURES not offered", vuNacked, rawMsg(vhostuser.SetProtocolFeatures, ack, u64(vhostuser.ProtocolConfig))},
		{"SET_OWNER twice", vuNacked, rawMsg(vhostuser.SetOwner, ack, nil)},
		{"SET_LOG_BASE", vuNacked, withFD(vhostuser.SetLogBase, ack, make([]byte, 16))},
		{"unknown request 0", vuClosed, rawMsg(0, v, nil)},
		{"unknown request 41, NEED_REPLY", vuNacked, rawMsg(41, ack, nil)},
		{"unknown request 1000", vuClosed, rawMsg(1000, v, u64(7))},
		{"unknown request 2^32-1", vuClosed, rawMsg(math.MaxUint32, v, nil)},
		{"opaque request with a payload and fds", vuNacked, threeFDsAck(vhostuser.GetInflightFD, make([]byte, 24))},
		{"header flags with the reply bit", vuClosed, rawMsg(vhostuser.GetFeatures, vhostuser.Version|vhostuser.FlagReply, nil)},
		{"header version 2", vuClosed, rawMsg(vhostuser.GetFeatures, 2, nil)},
		{"header unknown flag bits", vuClosed, rawMsg(vhostuser.SetOwner, v|1<<20, nil)},
		{"payload size 2^32-1", vuClosed, rawWire(wireHeader(vhostuser.SetFeatures, v, math.MaxUint32), false)},
		{"payload size 4097", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 4097), make([]byte, 4097)...), false)},
		{"payload shorter than its size, then EOF", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 100), u64(0)...), true)},
		{"header cut short, then EOF", vuClosed, rawWire(wireHeader(vhostuser.SetFeatures, v, 8)[:7], true)},
		{"payload size 4 for a u64", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 4), 0, 0, 0, 0), false)},
		{"payload size 4 for a u64, NEED_REPLY", vuNacked, rawWire(append(wireHeader(vhostuser.SetFeatures, ack, 4), 0, 0, 0, 0), false)},
		{"payload size swallowing the next message", vuClosed, rawWire(append(append(wireHeader(vhostuser.SetVringNum, v, 20),
			vringStatePayload(5, 256)...), wireHeader(vhostuser.GetFeatures, v, 0)...), false)},
		{"payload size 0 for a vring state", vuNacked, rawWire(wireHeader(vhostuser.SetVringNum, ack, 0), false)},
		{"SET_VRING_CALL with 200 fds", vuClosed, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			fds := make([]int, 200)
			for i := range fds {
				fds[i] = fd
			}
			return g.fe.Client().Raw(uint32(vhostuser.SetVringCall), v, vringFile(1), fds)
		}},
		{"fds sent with the header and more with the payload", vuClosed, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			uc := g.fe.Client().Conn().UnixConn()
			fds := []int{memfd, memfd, memfd, memfd, memfd}
			if _, _, err := uc.WriteMsgUnix(wireHeader(vhostuser.SetVringCall, v, 8), unix.UnixRights(fds...), nil); err != nil {
				return nil, err
			}
			_, _, err := uc.WriteMsgUnix(vringFile(1), unix.UnixRights(fds...), nil)
			return nil, err
		}},
		{"ADD_MEM_REG beyond the slots", vuNacked, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.MemfdCreate("kvfs-hostile-slot", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			hostileMust(t, unix.Ftruncate(fd, 4096))
			for i := range uint64(vhostuser.MaxMemSlots) {
				r := region(1<<40+i<<20, 4096)
				reply, err := g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack, vhostuser.SingleRegion{Region: r}.Append(nil), []int{fd})
				if err != nil || binary.LittleEndian.Uint64(reply) != 0 {
					return reply, err // the slot after the last
				}
			}
			t.Fatalf("%d regions accepted, at most %d allowed", vhostuser.MaxMemSlots+1, vhostuser.MaxMemSlots)
			return nil, nil
		}},
	}
}

func threeFDsAck(req vhostuser.Request, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
		return g.fe.Client().Raw(uint32(req), vhostuser.Version|vhostuser.FlagNeedReply, payload, []int{memfd, memfd, memfd})
	}
}

// readAck reads the REPLY_ACK the back-end owes for a message sent with rawBytes.
func readAck(g *hostileGuest) ([]byte, error) {
	m, err := g.fe.Client().Conn().ReadMessage()
	if err != nil {
		return nil, err
	}
	defer m.Close()
	return m.Payload, nil
}

// TestHostileVhostUser sends malformed vhost-user messages, each on a fresh connection to a
// fresh server. Each must be refused (a failure ack, the connection still usable) or end the
// connection (Serve returns an error); never a panic, a hang or a leaked fd, and a new server
// on a new connection must work afterwards.
func TestHostileVhostUser(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	cfg := virtiofs.Config{SharedDir: h.share}
	opts := frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize}

	// Warm up: the first connection creates process-wide fds (the netpoller's) that stay.
	func() {
		hs := startHostileServer(t, cfg)
		g := dialHostile(t, hs.sock, opts)
		g.healthy(t)
		g.fe.Close()
		hs.served(t)
		hs.srv.Close()
	}()

	for _, vc := range vuCases() {
		t.Run(vc.name, func(t *testing.T) {
			before, mapsBefore := countOpenFDs(t), countMemfdMappings(t)
			func() {
				hs := startHostileServer(t, cfg)
				g := dialHostile(t, hs.sock, opts)
				memfd := frontendMemfd(t, g.fe)
				reply, err := vc.send(t, g, memfd)
				switch vc.want {
				case vuClosed:
					serr := hs.served(t)
					if serr == nil {
						t.Errorf("Serve returned nil; want an error (send: %v)", err)
					} else {
						t.Logf("Serve: %v", serr)
					}
				case vuNacked:
					if reply == nil && err == nil {
						reply, err = readAck(g)
					}
					if err != nil {
						t.Fatalf("want a failure ack, got %v (Serve: %v)", err, func() error {
							select {
							case e := <-hs.done:
								return e
							case <-time.After(time.Second):
								return nil
							}
						}())
					}
					if len(reply) != 8 || binary.LittleEndian.Uint64(reply) == 0 {
						t.Fatalf("want a failure ack, got reply %x", reply)
					}
					hs.stillServing(t)
					g.healthy(t)
				}
				g.fe.Close()
				if vc.want != vuClosed {
					if err := hs.served(t); err != nil {
						t.Errorf("Serve after a clean disconnect: %v", err)
					}
				}
				if c, err := net.Dial("unix", hs.sock); err == nil {
					c.Close()
					t.Error("the listener still accepts connections after Serve returned")
				}
				hs.srv.Close()
			}()
			var after int
			for range 50 { // closes are synchronous; retry only to ride out a stray runtime fd
				if after = countOpenFDs(t); after == before {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if after != before {
				t.Errorf("FD LEAK: %d fds open before, %d after", before, after)
			}
			if m := countMemfdMappings(t); m != mapsBefore {
				t.Errorf("MAPPING LEAK: %d memfd mappings before, %d after", mapsBefore, m)
			}
			// A new server on a new connection works.
			hs := startHostileServer(t, cfg)
			g := dialHostile(t, hs.sock, opts)
			g.healthy(t)
			g.fe.Close()
			hs.served(t)
			h.check(t)
		})
	}
}

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
