package virtiofs_test

// POSIX ACLs (--posix-acl) through the in-repo front-end: the guest sets the raw
// system.posix_acl_* values as setfacl does, sends its umask with DONT_MASK, and asks for the
// set-group-ID bit to go with SETXATTR_ACL_KILL_SGID.

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// ACL entry tags of the system.posix_acl_* value format (version 2).
const (
	aclUserObj  = 0x01
	aclUser     = 0x02
	aclGroupObj = 0x04
	aclMask     = 0x10
	aclOther    = 0x20
)

type aclEntry struct {
	tag, perm uint16
	id        uint32
}

// aclValue encodes entries, which must be sorted by tag, as the kernel expects them.
func aclValue(entries ...aclEntry) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 2)
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint16(b, e.tag)
		b = binary.LittleEndian.AppendUint16(b, e.perm)
		b = binary.LittleEndian.AppendUint32(b, e.id)
	}
	return b
}

const noID = 0xffffffff

// setxattrExt sends SETXATTR with the 16-byte fuse_setxattr_in of SETXATTR_EXT.
func setxattrExt(ctx context.Context, c *fuseclient.Client, node uint64, name string, value []byte, setxattrFlags uint32) error {
	in := fuse.SetxattrIn{Size: uint32(len(value)), SetxattrFlags: setxattrFlags}
	_, err := c.Do(ctx, c.Encode(fuse.OpSetxattr, node, fuse.AsBytes(&in), append([]byte(name), 0), value), 4096)
	return err
}

type aclRig struct {
	dir string
	c   *fuseclient.Client
}

func newACLRig(t *testing.T, cfg virtiofs.Config) (*aclRig, uint64) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	cfg.SharedDir = shareDir(t)
	probe := filepath.Join(cfg.SharedDir, "probe")
	if err := os.WriteFile(probe, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	acl := aclValue(aclEntry{aclUserObj, 6, noID}, aclEntry{aclGroupObj, 4, noID}, aclEntry{aclOther, 4, noID})
	if err := unix.Setxattr(probe, "system.posix_acl_access", acl, 0); err != nil {
		t.Skipf("%s has no POSIX ACLs: %v", cfg.SharedDir, err)
	}
	sock, _, _ := startServer(t, cfg)
	fe, c := dial(t, sock)
	t.Cleanup(func() { fe.Close() })
	ctx, cancel := ctxT()
	defer cancel()
	out, err := c.Init(ctx, fuseclient.LinuxInitFlags)
	if err != nil {
		t.Fatal(err)
	}
	return &aclRig{dir: cfg.SharedDir, c: c}, uint64(out.Flags) | uint64(out.Flags2)<<32
}

func TestPosixACLNegotiation(t *testing.T) {
	const want = fuse.InitPosixACL | fuse.InitDontMask | fuse.InitSetxattrExt
	_, granted := newACLRig(t, virtiofs.Config{})
	if granted&want != 0 {
		t.Errorf("without PosixACL granted %#x of POSIX_ACL|DONT_MASK|SETXATTR_EXT", granted&want)
	}
	r, granted := newACLRig(t, virtiofs.Config{PosixACL: true})
	if granted&want != want {
		t.Errorf("with PosixACL granted %#x, want all of %#x", granted&want, uint64(want))
	}
	if granted&fuse.InitHandleKillprivV2 == 0 {
		t.Errorf("PosixACL implies xattr, so HANDLE_KILLPRIV_V2 by default; not granted")
	}
	ctx, cancel := ctxT()
	defer cancel()
	if _, n, err := r.c.Getxattr(ctx, fuse.RootID, "user.none", 0); !errors.Is(err, unix.ENODATA) {
		t.Errorf("GETXATTR with PosixACL (implying xattr) = %d, %v; want ENODATA", n, err)
	}
}

func TestPosixACL(t *testing.T) {
	r, _ := newACLRig(t, virtiofs.Config{PosixACL: true})
	c := r.c
	ctx, cancel := ctxT()
	defer cancel()

	// An access ACL with a named user: the group bits of the mode become the mask.
	f, err := c.Create(ctx, fuse.RootID, "f", unix.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	acl := aclValue(aclEntry{aclUserObj, 7, noID}, aclEntry{aclUser, 4, 1000},
		aclEntry{aclGroupObj, 5, noID}, aclEntry{aclMask, 7, noID}, aclEntry{aclOther, 0, noID})
	if err := setxattrExt(ctx, c, f.Entry.NodeID, "system.posix_acl_access", acl, 0); err != nil {
		t.Fatalf("SETXATTR system.posix_acl_access: %v", err)
	}
	if got := hostMode(t, filepath.Join(r.dir, "f")); got != 0o770 {
		t.Errorf("mode after setting the ACL %04o, want 0770", got)
	}
	buf := make([]byte, 256)
	if n, err := unix.Getxattr(filepath.Join(r.dir, "f"), "system.posix_acl_access", buf); err != nil {
		t.Errorf("host getxattr: %v", err)
	} else if string(buf[:n]) != string(acl) {
		t.Errorf("host ACL % x, want % x", buf[:n], acl)
	}

	// Creates with DONT_MASK: the umask applies only where there is no default ACL.
	mkdir := func(parent uint64, name string, mode, umask uint32) uint64 {
		in := fuse.MkdirIn{Mode: mode, Umask: umask}
		var e fuse.EntryOut
		body, err := c.Do(ctx, c.Encode(fuse.OpMkdir, parent, fuse.AsBytes(&in), append([]byte(name), 0)), 4096)
		if err != nil {
			t.Fatalf("MKDIR %s: %v", name, err)
		}
		copy(fuse.AsBytes(&e), body)
		return e.NodeID
	}
	create := func(parent uint64, name string, mode, umask uint32) {
		in := fuse.CreateIn{Flags: unix.O_RDWR, Mode: mode, Umask: umask}
		if _, err := c.Do(ctx, c.Encode(fuse.OpCreate, parent, fuse.AsBytes(&in), append([]byte(name), 0)), 4096); err != nil {
			t.Fatalf("CREATE %s: %v", name, err)
		}
	}
	plain := mkdir(fuse.RootID, "plain", 0o777, 0o022)
	withDefault := mkdir(fuse.RootID, "default", 0o777, 0o022)
	def := aclValue(aclEntry{aclUserObj, 7, noID}, aclEntry{aclGroupObj, 7, noID}, aclEntry{aclOther, 5, noID})
	if err := setxattrExt(ctx, c, withDefault, "system.posix_acl_default", def, 0); err != nil {
		t.Fatalf("SETXATTR system.posix_acl_default: %v", err)
	}
	create(plain, "f", 0o666, 0o077)
	create(withDefault, "f", 0o666, 0o077)
	mkdir(withDefault, "d", 0o777, 0o077)
	for _, tc := range []struct {
		path string
		want uint32
	}{
		{"plain", 0o755},
		{"plain/f", 0o600},   // 0666 less the umask
		{"default/f", 0o664}, // 0666 within the default ACL, umask ignored
		{"default/d", 0o775},
	} {
		if got := hostMode(t, filepath.Join(r.dir, tc.path)); got != tc.want {
			t.Errorf("%s: mode %04o, want %04o", tc.path, got, tc.want)
		}
	}
	if n, err := unix.Getxattr(filepath.Join(r.dir, "default/d"), "system.posix_acl_default", buf); err != nil || string(buf[:n]) != string(def) {
		t.Errorf("default/d did not inherit the default ACL: % x, %v", buf[:max(n, 0)], err)
	}

	// SETXATTR_ACL_KILL_SGID clears the set-group-ID bit; without it the bit stays.
	for _, tc := range []struct {
		name  string
		flags uint32
		want  uint32
	}{
		{"keep", 0, 0o2770},
		{"kill", fuse.SetxattrACLKillSgid, 0o0770},
	} {
		path := filepath.Join(r.dir, "sgid-"+tc.name)
		if err := os.WriteFile(path, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(path, 0o2770); err != nil {
			t.Fatal(err)
		}
		e, err := c.Lookup(ctx, fuse.RootID, "sgid-"+tc.name)
		if err != nil {
			t.Fatal(err)
		}
		if err := setxattrExt(ctx, c, e.NodeID, "system.posix_acl_access", acl, tc.flags); err != nil {
			t.Fatalf("%s: SETXATTR: %v", tc.name, err)
		}
		if got := hostMode(t, path); got != tc.want {
			t.Errorf("%s: mode %04o, want %04o", tc.name, got, tc.want)
		}
	}
}
