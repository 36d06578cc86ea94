package virtiofs_test

// The hostile-guest suite: kvfsd in-process on a real unix socket, driven by the in-repo
// front-end playing a malicious guest driver (raw descriptors, forged FUSE requests) and a
// malicious QEMU (raw vhost-user messages). Every case must end in an errno reply or a broken
// ring, never a crash, a hang or an access outside guest memory or outside the shared
// directory; afterwards kvfsd must serve normally again (after a device reset when the ring
// broke).
//
// This file is the harness the hostile tests share: the host share with its traps, the server,
// the guest with raw requests between canaries. The cases are by layer: rings
// (hostile_ring_test.go), vhost-user (hostile_vhostuser_test.go), FUSE (hostile_fuse_test.go).

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
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

func hostileOpts() frontend.Options {
	return frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize}
}
