package virtiofs_test

// Security labels (--security-label) through the in-repo front-end: with SECURITY_CTX the
// guest appends the new file's security context to CREATE, MKNOD, MKDIR and SYMLINK.

import (
	"bytes"
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

const (
	labelName  = "security.selinux"
	labelValue = "system_u:object_r:kvfs_test_t:s0\x00"
)

// secctxTrailer encodes nr copies of one security context as Linux appends them, padded to 8.
func secctxTrailer(nr int, name, value string) []byte {
	var body []byte
	for range nr {
		c := fuse.Secctx{Size: uint32(len(value))}
		body = append(body, fuse.AsBytes(&c)...)
		body = append(append(append(body, name...), 0), value...)
	}
	h := fuse.SecctxHeader{NrSecctx: uint32(nr)}
	total := len(fuse.AsBytes(&h)) + len(body)
	total = (total + 7) &^ 7
	h.Size = uint32(total)
	b := append(append([]byte(nil), fuse.AsBytes(&h)...), body...)
	return append(b, make([]byte, total-len(b))...)
}

// asExtension marks the last n bytes of an encoded request as its extension area, as a 7.38
// guest sends it (fuse_in_header.total_extlen, in 8-byte units, at offset 36).
func asExtension(req []byte, n int) []byte {
	binary.LittleEndian.PutUint16(req[36:], uint16(n/8))
	return req
}

func startLabelled(t *testing.T, cfg virtiofs.Config) (string, *fuseclient.Client, uint64) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	cfg.SharedDir = shareDir(t)
	probe := filepath.Join(cfg.SharedDir, "probe")
	if err := os.WriteFile(probe, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(probe, labelName, []byte(labelValue), 0); err != nil {
		t.Skipf("cannot set %s here: %v", labelName, err)
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
	return cfg.SharedDir, c, uint64(out.Flags) | uint64(out.Flags2)<<32
}

func hostLabel(path string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(path, labelName, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

func TestSecurityLabel(t *testing.T) {
	_, _, granted := startLabelled(t, virtiofs.Config{Xattr: true})
	if granted&fuse.InitSecurityCtx != 0 {
		t.Errorf("SECURITY_CTX granted without SecurityLabel")
	}
	dir, c, granted := startLabelled(t, virtiofs.Config{SecurityLabel: true})
	if granted&fuse.InitSecurityCtx == 0 {
		t.Fatalf("SECURITY_CTX not granted with SecurityLabel")
	}
	ctx, cancel := ctxT()
	defer cancel()
	cstr := func(s string) []byte { return append([]byte(s), 0) }
	trailer := secctxTrailer(1, labelName, labelValue)
	requests := map[string][]byte{
		"file": c.Encode(fuse.OpCreate, fuse.RootID, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}), cstr("file"), trailer),
		"dir":  c.Encode(fuse.OpMkdir, fuse.RootID, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), cstr("dir"), trailer),
		"fifo": c.Encode(fuse.OpMknod, fuse.RootID, fuse.AsBytes(&fuse.MknodIn{Mode: unix.S_IFIFO | 0o644}), cstr("fifo"), trailer),
		"link": c.Encode(fuse.OpSymlink, fuse.RootID, cstr("link"), cstr("file"), trailer),
		// A 7.38 guest sends the contexts as a request extension, counted in total_extlen.
		"file38": asExtension(c.Encode(fuse.OpCreate, fuse.RootID, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}), cstr("file38"), trailer), len(trailer)),
		// No context (the guest has no LSM label for it): the header alone.
		"plain": c.Encode(fuse.OpCreate, fuse.RootID, fuse.AsBytes(&fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}), cstr("plain"), secctxTrailer(0, "", "")),
	}
	for name, req := range requests {
		if _, err := c.Do(ctx, req, 4096); err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		got, err := hostLabel(filepath.Join(dir, name))
		switch {
		case name == "plain":
			if !errors.Is(err, unix.ENODATA) {
				t.Errorf("plain: label %q, %v; want none", got, err)
			}
		case err != nil || got != labelValue:
			t.Errorf("%s: label %q, %v; want %q", name, got, err, labelValue)
		}
	}

	// An extension record whose size runs past the request is refused too.
	bad := secctxTrailer(1, labelName, labelValue)
	binary.LittleEndian.PutUint32(bad, uint32(len(bad)+8))
	req := asExtension(c.Encode(fuse.OpMkdir, fuse.RootID, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), cstr("bad38"), bad), len(bad))
	if _, err := c.Do(ctx, req, 4096); !errors.Is(err, unix.EINVAL) {
		t.Errorf("extension record too long: %v, want EINVAL", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "bad38")); err == nil {
		t.Errorf("extension record too long: created anyway")
	}

	// Malformed trailers are refused and create nothing.
	for name, trailer := range map[string][]byte{
		"two contexts": secctxTrailer(2, labelName, labelValue),
		"short":        secctxTrailer(1, labelName, labelValue)[:12],
		"no header":    nil,
	} {
		req := c.Encode(fuse.OpMkdir, fuse.RootID, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), cstr("bad"), trailer)
		if _, err := c.Do(ctx, req, 4096); !errors.Is(err, unix.EINVAL) {
			t.Errorf("%s: %v, want EINVAL", name, err)
		}
		if _, err := os.Lstat(filepath.Join(dir, "bad")); err == nil {
			t.Fatalf("%s: created anyway", name)
		}
	}
}

// TestSecurityLabelMapped: the label goes where XattrMap says, and a label the map refuses
// fails the create, leaving nothing behind.
func TestSecurityLabelMapped(t *testing.T) {
	dir, c, _ := startLabelled(t, virtiofs.Config{SecurityLabel: true,
		XattrMap: ":prefix:client:security.selinux:user.virtiofs.::bad:all:::"})
	ctx, cancel := ctxT()
	defer cancel()
	cstr := func(s string) []byte { return append([]byte(s), 0) }
	in := fuse.CreateIn{Flags: unix.O_RDWR, Mode: 0o644}
	req := c.Encode(fuse.OpCreate, fuse.RootID, fuse.AsBytes(&in), cstr("f"), secctxTrailer(1, labelName, labelValue))
	if _, err := c.Do(ctx, req, 4096); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 256)
	n, err := unix.Getxattr(filepath.Join(dir, "f"), "user.virtiofs."+labelName, buf)
	if err != nil || !bytes.Equal(buf[:n], []byte(labelValue)) {
		t.Errorf("mapped label %q, %v", buf[:max(n, 0)], err)
	}
	req = c.Encode(fuse.OpMkdir, fuse.RootID, fuse.AsBytes(&fuse.MkdirIn{Mode: 0o755}), cstr("d"),
		secctxTrailer(1, "security.other", "x"))
	if _, err := c.Do(ctx, req, 4096); !errors.Is(err, unix.EPERM) {
		t.Errorf("MKDIR with a refused label: %v, want EPERM", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "d")); err == nil {
		t.Errorf("directory left behind after a refused label")
	}
}
