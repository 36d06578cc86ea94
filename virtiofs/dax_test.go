package virtiofs_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// The DAX tests run the in-repo front-end as the DAX-capable QEMU Kata ships (a window of
// daxWindowSize bytes, FS_MAP/FS_UNMAP served on the back-end channel) and as upstream QEMU 7.2
// (no window). A Linux guest maps 2 MiB ranges.
const (
	daxWindowSize = 16 << 20
	daxRange      = 2 << 20
)

// dialDAX connects a front-end with a window of window bytes (0: none) and INITs as a Linux
// guest that adds flags.
func dialDAX(t *testing.T, sock string, window uint64, flags uint64) (*frontend.Frontend, *fuseclient.Client, *fuse.InitOut) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, sock, frontend.Options{DAXWindow: window})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fe.Close() })
	c := fuseclient.New(fe)
	out, err := c.Init(ctx, fuseclient.LinuxInitFlags|flags)
	if err != nil {
		t.Fatalf("INIT: %v", err)
	}
	return fe, c, out
}

func initFlags(out *fuse.InitOut) uint64 { return uint64(out.Flags) | uint64(out.Flags2)<<32 }

// mappingAt returns the permissions and the path of this process's mapping that contains b[0].
func mappingAt(t *testing.T, b []byte) (perms, path string) {
	t.Helper()
	addr := uint64(uintptr(unsafe.Pointer(&b[0])))
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		lo, hi, _ := strings.Cut(fields[0], "-")
		l, _ := strconv.ParseUint(lo, 16, 64)
		h, _ := strconv.ParseUint(hi, 16, 64)
		if addr >= l && addr < h {
			if len(fields) >= 6 {
				path = fields[5]
			}
			return fields[1], path
		}
	}
	t.Fatalf("address %#x is not mapped", addr)
	return "", ""
}

func daxCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 20*time.Second)
}

func mustWrite(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func setXattr(t *testing.T, path, name, value string) {
	t.Helper()
	if err := unix.Setxattr(path, name, []byte(value), 0); err != nil {
		t.Fatal(err)
	}
}

// setXflagDAX sets FS_XFLAG_DAX on path (FS_IOC_FSSETXATTR; ext4 and xfs support it, and the
// test machines' /tmp is ext4).
func setXflagDAX(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var x [28]byte
	const get, set = 0x801c581f, 0x401c5820
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), get, uintptr(unsafe.Pointer(&x[0]))); e != 0 {
		t.Fatalf("FS_IOC_FSGETXATTR on %s: %v", path, e)
	}
	x[1] |= 0x80 // FS_XFLAG_DAX = 0x8000, little-endian
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), set, uintptr(unsafe.Pointer(&x[0]))); e != 0 {
		t.Fatalf("FS_IOC_FSSETXATTR on %s: %v", path, e)
	}
}

func expectErr(t *testing.T, what string, err error, want unix.Errno) {
	t.Helper()
	if err != want {
		t.Errorf("%s: %v, want %v", what, err, want)
	}
}

// TestDAXWindow maps files into the front-end's window as a Linux guest does and checks what
// the window holds, then sends what a hostile guest could.
func TestDAXWindow(t *testing.T) {
	hostileNeedsRoot(t)
	dir := shareDir(t)
	content := bytes.Repeat([]byte("kvfs-dax "), 1000)
	mustWrite(t, filepath.Join(dir, "data"), content)
	mustWrite(t, filepath.Join(dir, "plain"), []byte("plain"))
	setXattr(t, filepath.Join(dir, "data"), passthrough.DAXXattr, "1")
	sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir})
	fe, c, out := dialDAX(t, sock, daxWindowSize, fuseclient.DAXInitFlags)
	ctx, cancel := daxCtx()
	defer cancel()

	if f := initFlags(out); f&fuseclient.DAXInitFlags != fuseclient.DAXInitFlags || out.MapAlignment != 12 {
		t.Fatalf("INIT: flags %#x, map alignment %d; want MAP_ALIGNMENT, HAS_INODE_DAX, 12", f, out.MapAlignment)
	}
	data, err := c.Lookup(ctx, fuse.RootID, "data")
	if err != nil {
		t.Fatal(err)
	}
	plain, err := c.Lookup(ctx, fuse.RootID, "plain")
	if err != nil {
		t.Fatal(err)
	}
	if data.Attr.Flags&fuse.AttrDAX == 0 || plain.Attr.Flags&fuse.AttrDAX != 0 {
		t.Errorf("ATTR_DAX: data %v, plain %v; want data only", data.Attr.Flags, plain.Attr.Flags)
	}
	win := fe.DAXWindow()
	r1, r2 := win[daxRange:2*daxRange], win[2*daxRange:3*daxRange]

	// A read mapping, as Linux asks for it (no file handle): the file's bytes are in the window.
	if err := c.SetupMapping(ctx, data.NodeID, fuse.SetupmappingNoFh, 0, daxRange, fuse.SetupmappingFlagRead, daxRange); err != nil {
		t.Fatalf("SETUPMAPPING read: %v", err)
	}
	if perms, path := mappingAt(t, r1); perms != "r--s" || filepath.Base(path) != "data" {
		t.Errorf("window range 1: %s %s, want r--s onto data", perms, path)
	}
	if !bytes.Equal(r1[:len(content)], content) {
		t.Error("the window does not show the file's bytes")
	}

	// A write mapping through a read-write handle: stores into the window reach the host file.
	rw, err := c.Open(ctx, data.NodeID, unix.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.SetupMapping(ctx, data.NodeID, rw.Fh, 0, daxRange,
		fuse.SetupmappingFlagRead|fuse.SetupmappingFlagWrite, 2*daxRange); err != nil {
		t.Fatalf("SETUPMAPPING write: %v", err)
	}
	if perms, _ := mappingAt(t, r2); perms != "rw-s" {
		t.Errorf("window range 2: %s, want rw-s", perms)
	}
	copy(r2, "HELLO")
	if got, _ := os.ReadFile(filepath.Join(dir, "data")); !bytes.HasPrefix(got, []byte("HELLO")) {
		t.Errorf("host file after a store into the window: %q...", got[:min(len(got), 16)])
	}
	if !bytes.HasPrefix(r1, []byte("HELLO")) {
		t.Error("the read mapping does not see the store")
	}

	// REMOVEMAPPING puts the ranges back to PROT_NONE.
	if err := c.RemoveMapping(ctx, data.NodeID, []fuse.RemovemappingOne{{Moffset: daxRange, Len: daxRange},
		{Moffset: 2 * daxRange, Len: daxRange}}); err != nil {
		t.Fatalf("REMOVEMAPPING: %v", err)
	}
	for i, r := range [][]byte{r1, r2} {
		if perms, path := mappingAt(t, r); perms != "---p" || path != "" {
			t.Errorf("range %d after REMOVEMAPPING: %s %s, want ---p anonymous", i+1, perms, path)
		}
	}

	// Hostile requests: each is refused and changes nothing.
	ro, err := c.Open(ctx, data.NodeID, unix.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	wo, err := c.Open(ctx, data.NodeID, unix.O_WRONLY)
	if err != nil {
		t.Fatal(err)
	}
	pfh, err := c.Open(ctx, plain.NodeID, unix.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	dfh, err := c.Opendir(ctx, fuse.RootID)
	if err != nil {
		t.Fatal(err)
	}
	const rd, wr = fuse.SetupmappingFlagRead, fuse.SetupmappingFlagWrite
	noFh := uint64(fuse.SetupmappingNoFh)
	for _, tc := range []struct {
		what                        string
		node, fh, foff, n, fl, moff uint64
		want                        unix.Errno
	}{
		{"moffset+len overflows", data.NodeID, noFh, 0, 4096, rd, math.MaxUint64 &^ 4095, unix.EINVAL},
		{"foffset+len overflows off_t", data.NodeID, noFh, 1 << 63, 4096, rd, 0, unix.EINVAL},
		{"beyond the window", data.NodeID, noFh, 0, daxRange, rd, daxWindowSize, unix.EINVAL},
		{"across the window's end", data.NodeID, noFh, 0, daxRange, rd, daxWindowSize - 4096, unix.EINVAL},
		{"unaligned moffset", data.NodeID, noFh, 0, daxRange, rd, 100, unix.EINVAL},
		{"unaligned foffset", data.NodeID, noFh, 512, daxRange, rd, 0, unix.EINVAL},
		{"unaligned length", data.NodeID, noFh, 0, 1000, rd, 0, unix.EINVAL},
		{"empty", data.NodeID, noFh, 0, 0, rd, 0, unix.EINVAL},
		{"no flags", data.NodeID, noFh, 0, daxRange, 0, 0, unix.EINVAL},
		{"unknown flag", data.NodeID, noFh, 0, daxRange, rd | 4, 0, unix.EINVAL},
		{"bad fh", data.NodeID, 999999, 0, daxRange, rd, 0, unix.EBADF},
		{"fh of a directory", fuse.RootID, dfh.Fh, 0, daxRange, rd, 0, unix.EBADF},
		{"directory fh on a file", data.NodeID, dfh.Fh, 0, daxRange, rd, 0, unix.EBADF},
		{"fh of another file", data.NodeID, pfh.Fh, 0, daxRange, rd, 0, unix.EBADF},
		{"write map of a read-only open", data.NodeID, ro.Fh, 0, daxRange, rd | wr, 0, unix.EBADF},
		{"map of a write-only open", data.NodeID, wo.Fh, 0, daxRange, rd, 0, unix.EBADF},
		{"directory node", fuse.RootID, noFh, 0, daxRange, rd, 0, unix.EISDIR},
		{"unknown node", 123456, noFh, 0, daxRange, rd, 0, unix.EBADF},
	} {
		err := c.SetupMapping(ctx, tc.node, tc.fh, tc.foff, tc.n, tc.fl, tc.moff)
		expectErr(t, "SETUPMAPPING "+tc.what, err, tc.want)
	}
	one := func(moff, n uint64) []byte {
		return fuse.AsBytes(&fuse.RemovemappingOne{Moffset: moff, Len: n})
	}
	count := func(n uint32) []byte { return fuse.AsBytes(&fuse.RemovemappingIn{Count: n}) }
	many := bytes.Repeat(one(0, daxRange), fuse.MaxRemovemapping+1)
	setup := fuse.SetupmappingIn{Fh: noFh, Len: daxRange, Flags: rd}
	for _, tc := range []struct {
		what string
		op   fuse.Opcode
		args [][]byte
	}{
		{"REMOVEMAPPING with a huge count", fuse.OpRemovemapping, [][]byte{count(1 << 30), one(0, daxRange)}},
		{"REMOVEMAPPING with count 0", fuse.OpRemovemapping, [][]byte{count(0)}},
		{"REMOVEMAPPING with more entries than allowed", fuse.OpRemovemapping, [][]byte{count(uint32(fuse.MaxRemovemapping) + 1), many}},
		{"REMOVEMAPPING with fewer entries than counted", fuse.OpRemovemapping, [][]byte{count(2), one(0, daxRange)}},
		{"REMOVEMAPPING with more entries than counted", fuse.OpRemovemapping, [][]byte{count(1), one(0, daxRange), one(daxRange, daxRange)}},
		{"REMOVEMAPPING overflowing", fuse.OpRemovemapping, [][]byte{count(1), one(math.MaxUint64&^4095, 4096)}},
		{"REMOVEMAPPING unaligned", fuse.OpRemovemapping, [][]byte{count(1), one(10, daxRange)}},
		{"REMOVEMAPPING beyond the window", fuse.OpRemovemapping, [][]byte{count(1), one(daxWindowSize, daxRange)}},
		{"REMOVEMAPPING truncated", fuse.OpRemovemapping, [][]byte{{1, 0}}},
		{"SETUPMAPPING truncated", fuse.OpSetupmapping, [][]byte{fuse.AsBytes(&setup)[:32]}},
		{"SETUPMAPPING with trailing bytes", fuse.OpSetupmapping, [][]byte{fuse.AsBytes(&setup), {0}}},
	} {
		_, err := c.Do(ctx, c.Encode(tc.op, data.NodeID, tc.args...), fuseclient.DefaultReplyCap)
		expectErr(t, tc.what, err, unix.EINVAL)
	}
	for _, r := range [][]byte{win[:daxRange], r1, r2, win[daxWindowSize-4096:]} {
		if perms, _ := mappingAt(t, r); perms != "---p" {
			t.Errorf("window at %#x mapped (%s) by a refused request", uintptr(unsafe.Pointer(&r[0])), perms)
		}
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "plain")); string(got) != "plain" {
		t.Errorf("plain changed: %q", got)
	}

	// Still serving, and the back-end channel still works: the last range of the window.
	last := win[daxWindowSize-daxRange:]
	if err := c.SetupMapping(ctx, plain.NodeID, pfh.Fh, 0, daxRange, rd, daxWindowSize-daxRange); err != nil {
		t.Fatalf("SETUPMAPPING after the hostile ones: %v", err)
	}
	if string(last[:5]) != "plain" {
		t.Errorf("last range shows %q", last[:5])
	}
	if err := c.RemoveMapping(ctx, plain.NodeID, []fuse.RemovemappingOne{{Moffset: daxWindowSize - daxRange, Len: daxRange}}); err != nil {
		t.Fatal(err)
	}
	if perms, _ := mappingAt(t, last); perms != "---p" {
		t.Errorf("last range after REMOVEMAPPING: %s", perms)
	}
}

// TestDAXNoWindow: with a front-end without a window (upstream QEMU 7.2), nothing DAX is
// negotiated even when the guest asks (a Linux guest asks for HAS_INODE_DAX only then; a
// hostile one may ask for MAP_ALIGNMENT too), files never carry ATTR_DAX, and the mapping
// opcodes answer ENOSYS. A policy of never does the same with a window.
func TestDAXNoWindow(t *testing.T) {
	hostileNeedsRoot(t)
	dir := shareDir(t)
	mustWrite(t, filepath.Join(dir, "data"), []byte("data"))
	setXattr(t, filepath.Join(dir, "data"), passthrough.DAXXattr, "1")
	for _, tc := range []struct {
		what   string
		window uint64
		policy passthrough.DAXPolicy
	}{
		{"no window", 0, passthrough.DAXPolicy{Mode: passthrough.DAXAlways}},
		{"policy never", daxWindowSize, passthrough.DAXPolicy{Mode: passthrough.DAXNever}},
	} {
		t.Run(tc.what, func(t *testing.T) {
			sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir, DAX: tc.policy})
			fe, c, out := dialDAX(t, sock, tc.window, fuseclient.DAXInitFlags)
			ctx, cancel := daxCtx()
			defer cancel()
			if f := initFlags(out); f&fuseclient.DAXInitFlags != 0 || out.MapAlignment != 0 {
				t.Errorf("INIT: flags %#x, map alignment %d; want no DAX", f, out.MapAlignment)
			}
			e, err := c.Lookup(ctx, fuse.RootID, "data")
			if err != nil {
				t.Fatal(err)
			}
			if e.Attr.Flags&fuse.AttrDAX != 0 {
				t.Error("ATTR_DAX without DAX")
			}
			err = c.SetupMapping(ctx, e.NodeID, fuse.SetupmappingNoFh, 0, daxRange, fuse.SetupmappingFlagRead, 0)
			expectErr(t, "SETUPMAPPING", err, unix.ENOSYS)
			err = c.RemoveMapping(ctx, e.NodeID, []fuse.RemovemappingOne{{Moffset: 0, Len: daxRange}})
			expectErr(t, "REMOVEMAPPING", err, unix.ENOSYS)
			if w := fe.DAXWindow(); w != nil {
				if perms, _ := mappingAt(t, w); perms != "---p" {
					t.Errorf("window mapped: %s", perms)
				}
			}
		})
	}
	// What a Linux guest without a window asks for (HAS_INODE_DAX alone) gets nothing, with or
	// without a window on the front-end.
	for _, window := range []uint64{0, daxWindowSize} {
		sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir})
		_, _, out := dialDAX(t, sock, window, fuse.InitHasInodeDAX)
		if f := initFlags(out); f&fuseclient.DAXInitFlags != 0 {
			t.Errorf("window %d: INIT with HAS_INODE_DAX only: flags %#x", window, f)
		}
	}
}

// TestDAXPolicy checks FUSE_ATTR_DAX in every reply that carries attributes under each mode,
// the host attribute, FS_XFLAG_DAX and rules, and a policy replaced at run time.
func TestDAXPolicy(t *testing.T) {
	hostileNeedsRoot(t)
	dir := shareDir(t)
	if err := os.MkdirAll(filepath.Join(dir, "sub", "lib"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"x.so", "flagged", "xon", "xoff", "plain", "sub/lib/a.so"} {
		mustWrite(t, filepath.Join(dir, f), []byte(f))
	}
	if err := os.Truncate(filepath.Join(dir, "plain"), 3<<20); err != nil {
		t.Fatal(err)
	}
	setXflagDAX(t, filepath.Join(dir, "flagged"))
	setXflagDAX(t, filepath.Join(dir, "xoff"))
	setXattr(t, filepath.Join(dir, "xon"), passthrough.DAXXattr, "1")
	setXattr(t, filepath.Join(dir, "xoff"), passthrough.DAXXattr, "0")

	sock, s, _ := startServer(t, virtiofs.Config{SharedDir: dir})
	_, c, out := dialDAX(t, sock, daxWindowSize, fuseclient.DAXInitFlags)
	if initFlags(out)&fuse.InitHasInodeDAX == 0 {
		t.Fatal("HAS_INODE_DAX not negotiated")
	}
	ctx, cancel := daxCtx()
	defer cancel()
	sub, err := c.Lookup(ctx, fuse.RootID, "sub")
	if err != nil {
		t.Fatal(err)
	}
	lib, err := c.Lookup(ctx, sub.NodeID, "lib")
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]uint64{"sub": fuse.RootID, "sub/lib": sub.NodeID}
	parentOf := func(name string) (uint64, string) {
		if d, b := filepath.Split(name); d != "" {
			if d == "sub/lib/" {
				return lib.NodeID, b
			}
		}
		return fuse.RootID, name
	}
	// check compares the DAX flag of every file in LOOKUP, GETATTR and READDIRPLUS with want.
	check := func(what string, want ...string) {
		t.Helper()
		wanted := map[string]bool{}
		for _, w := range want {
			wanted[w] = true
		}
		for _, name := range []string{"x.so", "flagged", "xon", "xoff", "plain", "sub/lib/a.so", "sub"} {
			p, base := parentOf(name)
			e, err := c.Lookup(ctx, p, base)
			if err != nil {
				t.Fatal(err)
			}
			files[name] = e.NodeID
			a, err := c.Getattr(ctx, e.NodeID, 0)
			if err != nil {
				t.Fatal(err)
			}
			got := e.Attr.Flags&fuse.AttrDAX != 0
			if got != wanted[name] || (a.Attr.Flags&fuse.AttrDAX != 0) != got {
				t.Errorf("%s: %s: LOOKUP DAX %v, GETATTR DAX %v; want %v", what, name, got,
					a.Attr.Flags&fuse.AttrDAX != 0, wanted[name])
			}
		}
		dh, err := c.Opendir(ctx, fuse.RootID)
		if err != nil {
			t.Fatal(err)
		}
		ents, err := c.Readdir(ctx, fuse.RootID, dh.Fh, 0, 64<<10, true)
		if err != nil {
			t.Fatal(err)
		}
		for _, de := range ents {
			if de.Name == "." || de.Name == ".." {
				continue
			}
			if got := de.Entry.Attr.Flags&fuse.AttrDAX != 0; got != wanted[de.Name] {
				t.Errorf("%s: READDIRPLUS %s: DAX %v, want %v", what, de.Name, got, wanted[de.Name])
			}
			c.Forget(ctx, de.Entry.NodeID, 1)
		}
		c.Releasedir(ctx, fuse.RootID, dh.Fh)
	}

	check("inode", "flagged", "xon")
	set := func(p passthrough.DAXPolicy) {
		t.Helper()
		if err := s.SetDAXPolicy(p); err != nil {
			t.Fatal(err)
		}
	}
	set(passthrough.DAXPolicy{Mode: passthrough.DAXInode, Rules: []passthrough.DAXRule{
		{Glob: "*.so", DAX: true},
		{MinSize: 2 << 20, DAX: true},
		{Glob: "flagged", DAX: false},
	}})
	check("inode with name and size rules", "x.so", "sub/lib/a.so", "plain", "xon")
	set(passthrough.DAXPolicy{Mode: passthrough.DAXInode, Rules: []passthrough.DAXRule{
		{Glob: "sub/*/*.so", DAX: true},
		{Glob: "*", DAX: false},
	}})
	check("inode with a path rule", "sub/lib/a.so", "xon")
	if got := s.DAXPolicy(); got.Mode != passthrough.DAXInode || len(got.Rules) != 2 || got.Rules[0].Glob != "sub/*/*.so" {
		t.Errorf("DAXPolicy: %+v", got)
	}
	set(passthrough.DAXPolicy{Mode: passthrough.DAXAlways})
	check("always", "x.so", "flagged", "xon", "xoff", "plain", "sub/lib/a.so")
	cr, err := c.Create(ctx, fuse.RootID, "new", unix.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if cr.Entry.Attr.Flags&fuse.AttrDAX == 0 {
		t.Error("always: CREATE without ATTR_DAX")
	}
	c.Release(ctx, cr.Entry.NodeID, cr.Open.Fh)
	os.Remove(filepath.Join(dir, "new"))
	set(passthrough.DAXPolicy{Mode: passthrough.DAXNever})
	check("never")
	// DAX stays negotiated until the next INIT: mappings are still served.
	if err := c.SetupMapping(ctx, files["x.so"], fuse.SetupmappingNoFh, 0, daxRange, fuse.SetupmappingFlagRead, 0); err != nil {
		t.Errorf("SETUPMAPPING under never (negotiated before): %v", err)
	}
	if err := c.RemoveMapping(ctx, files["x.so"], []fuse.RemovemappingOne{{Len: daxRange}}); err != nil {
		t.Error(err)
	}

	// Bad policies are refused and the old one stays.
	for _, bad := range []passthrough.DAXPolicy{
		{Mode: 7},
		{Rules: []passthrough.DAXRule{{Glob: "["}}},
		{Rules: []passthrough.DAXRule{{Glob: "/etc/*"}}},
		{Rules: make([]passthrough.DAXRule, passthrough.MaxDAXRules+1)},
	} {
		if err := s.SetDAXPolicy(bad); err == nil {
			t.Errorf("policy %+v accepted", bad.Mode)
		}
	}
	if s.DAXPolicy().Mode != passthrough.DAXNever {
		t.Error("a refused policy replaced the current one")
	}
	if _, err := virtiofs.NewServer(virtiofs.Config{SharedDir: dir,
		DAX: passthrough.DAXPolicy{Rules: []passthrough.DAXRule{{Glob: "["}}}}); err == nil {
		t.Error("NewServer accepted a bad DAX rule")
	}
}

// TestDAXPolicySwapConcurrent replaces the policy while GETATTRs run: every answer is the
// verdict of one policy or the other (run with -race).
func TestDAXPolicySwapConcurrent(t *testing.T) {
	hostileNeedsRoot(t)
	dir := shareDir(t)
	mustWrite(t, filepath.Join(dir, "f.so"), []byte("x"))
	sock, s, _ := startServer(t, virtiofs.Config{SharedDir: dir, ThreadPoolSize: 4})
	_, c, _ := dialDAX(t, sock, daxWindowSize, fuseclient.DAXInitFlags)
	ctx, cancel := daxCtx()
	defer cancel()
	e, err := c.Lookup(ctx, fuse.RootID, "f.so")
	if err != nil {
		t.Fatal(err)
	}
	on := passthrough.DAXPolicy{Rules: []passthrough.DAXRule{{Glob: "*.so", DAX: true}}}
	off := passthrough.DAXPolicy{Rules: []passthrough.DAXRule{{Glob: "*.so", DAX: false}}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 200 {
			p := on
			if i%2 == 1 {
				p = off
			}
			if err := s.SetDAXPolicy(p); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	seen := map[bool]int{}
	for range 200 {
		a, err := c.Getattr(ctx, e.NodeID, 0)
		if err != nil {
			t.Fatal(err)
		}
		seen[a.Attr.Flags&fuse.AttrDAX != 0]++
	}
	<-done
	s.SetDAXPolicy(on)
	if a, err := c.Getattr(ctx, e.NodeID, 0); err != nil || a.Attr.Flags&fuse.AttrDAX == 0 {
		t.Errorf("after the last swap: %v, %v", a, err)
	}
	t.Logf("GETATTR verdicts during the swaps: %v", seen)
}

// TestDAXXattrHidden: the guest can never read, list, set or remove the policy attribute,
// with or without an xattr map that would reach it.
func TestDAXXattrHidden(t *testing.T) {
	hostileNeedsRoot(t)
	for _, xmap := range []string{"", ":prefix:client:dax:trusted.kvfs.: :ok:all:::"} {
		t.Run(fmt.Sprintf("map=%q", xmap), func(t *testing.T) {
			dir := shareDir(t)
			path := filepath.Join(dir, "f")
			mustWrite(t, path, []byte("x"))
			setXattr(t, path, passthrough.DAXXattr, "0")
			setXattr(t, path, "user.other", "v")
			sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir, Xattr: true, XattrMap: xmap})
			_, c, _ := dialDAX(t, sock, daxWindowSize, fuseclient.DAXInitFlags)
			ctx, cancel := daxCtx()
			defer cancel()
			e, err := c.Lookup(ctx, fuse.RootID, "f")
			if err != nil {
				t.Fatal(err)
			}
			names := []string{passthrough.DAXXattr}
			if xmap != "" {
				names = append(names, "dax")
			}
			for _, name := range names {
				_, _, err := c.Getxattr(ctx, e.NodeID, name, 64)
				expectErr(t, "GETXATTR "+name, err, unix.EPERM)
				err = c.Setxattr(ctx, e.NodeID, name, []byte("1"), 0)
				expectErr(t, "SETXATTR "+name, err, unix.EPERM)
				err = c.Removexattr(ctx, e.NodeID, name)
				expectErr(t, "REMOVEXATTR "+name, err, unix.EPERM)
			}
			list, size, err := c.Listxattr(ctx, e.NodeID, 0)
			if err != nil {
				t.Fatal(err)
			}
			if list, _, err = c.Listxattr(ctx, e.NodeID, size); err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(list, []byte("kvfs")) || !bytes.Contains(list, []byte("user.other")) {
				t.Errorf("LISTXATTR: %q", list)
			}
			if v := make([]byte, 8); func() bool {
				n, err := unix.Getxattr(path, passthrough.DAXXattr, v)
				return err != nil || string(v[:n]) != "0"
			}() {
				t.Error("the policy attribute changed on the host")
			}
		})
	}
}

// TestDAXConcurrentMappings maps and unmaps from many requests at once (a worker pool): the
// back-end channel carries one request at a time and every range ends up showing its own file
// (run with -race).
func TestDAXConcurrentMappings(t *testing.T) {
	hostileNeedsRoot(t)
	dir := shareDir(t)
	const n = daxWindowSize / daxRange
	for i := range n {
		mustWrite(t, filepath.Join(dir, fmt.Sprintf("f%d", i)), bytes.Repeat([]byte{byte('a' + i)}, 4096))
	}
	sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir, ThreadPoolSize: 4})
	fe, c, _ := dialDAX(t, sock, daxWindowSize, fuseclient.DAXInitFlags)
	ctx, cancel := daxCtx()
	defer cancel()
	win := fe.DAXWindow()
	errs := make(chan error, n)
	for i := range n {
		go func() {
			errs <- func() error {
				e, err := c.Lookup(ctx, fuse.RootID, fmt.Sprintf("f%d", i))
				if err != nil {
					return err
				}
				off := uint64(i) * daxRange
				r := win[off : off+daxRange]
				for range 20 {
					if err := c.SetupMapping(ctx, e.NodeID, fuse.SetupmappingNoFh, 0, daxRange, fuse.SetupmappingFlagRead, off); err != nil {
						return fmt.Errorf("f%d: SETUPMAPPING: %w", i, err)
					}
					if r[0] != byte('a'+i) || r[4095] != byte('a'+i) {
						return fmt.Errorf("f%d: range shows %q", i, r[0])
					}
					if err := c.RemoveMapping(ctx, e.NodeID, []fuse.RemovemappingOne{{Moffset: off, Len: daxRange}}); err != nil {
						return fmt.Errorf("f%d: REMOVEMAPPING: %w", i, err)
					}
				}
				return nil
			}()
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if perms, _ := mappingAt(t, win); perms != "---p" {
		t.Errorf("window after the last REMOVEMAPPING: %s", perms)
	}
}
