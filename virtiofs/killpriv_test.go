package virtiofs_test

// FUSE_HANDLE_KILLPRIV_V2 through the in-repo front-end: the flags a guest sends when a user
// without CAP_FSETID writes, truncates or chowns must clear set-id bits and security.capability
// on the host exactly as a local file system would.

import (
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

// fileCaps is a VFS_CAP_REVISION_2 security.capability value granting CAP_NET_RAW.
func fileCaps() []byte {
	b := make([]byte, 20)
	binary.LittleEndian.PutUint32(b[0:], 0x02000000|1) // revision 2, effective
	binary.LittleEndian.PutUint32(b[4:], 1<<13)        // permitted: CAP_NET_RAW
	return b
}

const capName = "security.capability"

// privFile makes a set-user-ID, set-group-ID, group-executable file carrying file capabilities.
func privFile(t *testing.T, path string, mode uint32) {
	t.Helper()
	if err := os.WriteFile(path, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(path, capName, fileCaps(), 0); err != nil {
		t.Skipf("cannot set %s on %s: %v", capName, path, err)
	}
	if err := unix.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func hostMode(t *testing.T, path string) uint32 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Mode & 0o7777
}

func hasCaps(t *testing.T, path string) bool {
	t.Helper()
	_, err := unix.Getxattr(path, capName, nil)
	if errors.Is(err, unix.ENODATA) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

func TestKillprivV2Negotiation(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	for _, tc := range []struct {
		name string
		cfg  virtiofs.Config
		want bool
	}{
		{"xattr off", virtiofs.Config{}, false},
		{"xattr on", virtiofs.Config{Xattr: true}, true},
		{"xattr on, killpriv_v2 off", virtiofs.Config{Xattr: true, KillprivV2: new(false)}, false},
		{"xattr off, killpriv_v2 on", virtiofs.Config{KillprivV2: new(true)}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.SharedDir = shareDir(t)
			sock, _, _ := startServer(t, tc.cfg)
			fe, c := dial(t, sock)
			defer fe.Close()
			ctx, cancel := ctxT()
			defer cancel()
			out, err := c.Init(ctx, fuseclient.LinuxInitFlags|fuse.InitHandleKillprivV2)
			if err != nil {
				t.Fatal(err)
			}
			if got := out.Flags&fuse.InitHandleKillprivV2 != 0; got != tc.want {
				t.Errorf("HANDLE_KILLPRIV_V2 granted = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestKillprivV2 checks each of the three requests with and without its kill flag. Without it
// (a guest writer holding CAP_FSETID) the set-id bits stay; security.capability goes on any
// write or truncate, as on a local file system, where even root's write removes it.
func TestKillprivV2(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	dir := shareDir(t)
	sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir, Xattr: true})
	fe, c := dial(t, sock)
	defer fe.Close()

	type op func(t *testing.T, node uint64, kill bool)
	write := func(t *testing.T, node uint64, kill bool) {
		ctx, cancel := ctxT()
		defer cancel()
		o, err := c.Open(ctx, node, unix.O_WRONLY)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release(ctx, node, o.Fh)
		var flags uint32
		if kill {
			flags = fuse.WriteKillSuidgid
		}
		if _, err := c.Write(ctx, node, o.Fh, 0, []byte("x"), flags); err != nil {
			t.Fatal(err)
		}
	}
	truncate := func(t *testing.T, node uint64, kill bool) {
		ctx, cancel := ctxT()
		defer cancel()
		in := fuse.SetattrIn{Valid: fuse.FattrSize, Size: 1}
		if kill {
			in.Valid |= fuse.FattrKillSuidgid
		}
		if _, err := c.Setattr(ctx, node, &in); err != nil {
			t.Fatal(err)
		}
	}
	openTrunc := func(t *testing.T, node uint64, kill bool) {
		ctx, cancel := ctxT()
		defer cancel()
		in := fuse.OpenIn{Flags: unix.O_WRONLY | unix.O_TRUNC}
		if kill {
			in.OpenFlags = fuse.OpenKillSuidgid
		}
		var o fuse.OpenOut
		body, err := c.Do(ctx, c.Encode(fuse.OpOpen, node, fuse.AsBytes(&in)), 4096)
		if err != nil {
			t.Fatal(err)
		}
		copy(fuse.AsBytes(&o), body)
		c.Release(ctx, node, o.Fh)
	}

	for _, tc := range []struct {
		name     string
		op       op
		kill     bool
		mode     uint32
		wantMode uint32
		wantCaps bool
	}{
		{"write kill", write, true, 0o6755, 0o0755, false},
		{"write kill, sgid without group exec", write, true, 0o6745, 0o2745, false},
		{"write", write, false, 0o6755, 0o6755, false},
		{"truncate kill", truncate, true, 0o6755, 0o0755, false},
		{"truncate", truncate, false, 0o6755, 0o6755, false},
		{"open O_TRUNC kill", openTrunc, true, 0o6755, 0o0755, false},
		{"open O_TRUNC", openTrunc, false, 0o6755, 0o6755, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			name := filepath.Base(t.Name())
			path := filepath.Join(dir, name)
			privFile(t, path, tc.mode)
			ctx, cancel := ctxT()
			defer cancel()
			e, err := c.Lookup(ctx, fuse.RootID, name)
			if err != nil {
				t.Fatal(err)
			}
			tc.op(t, e.NodeID, tc.kill)
			if got := hostMode(t, path); got != tc.wantMode {
				t.Errorf("mode %04o, want %04o", got, tc.wantMode)
			}
			if got := hasCaps(t, path); got != tc.wantCaps {
				t.Errorf("%s present = %v, want %v", capName, got, tc.wantCaps)
			}
		})
	}

	// chown: FATTR_KILL_SUIDGID rides along with the new owner.
	t.Run("chown kill", func(t *testing.T) {
		path := filepath.Join(dir, "chown")
		privFile(t, path, 0o6755)
		ctx, cancel := ctxT()
		defer cancel()
		e, err := c.Lookup(ctx, fuse.RootID, "chown")
		if err != nil {
			t.Fatal(err)
		}
		in := fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID | fuse.FattrKillSuidgid, UID: 1000, GID: 1000}
		if _, err := c.Setattr(ctx, e.NodeID, &in); err != nil {
			t.Fatal(err)
		}
		if got := hostMode(t, path); got != 0o755 {
			t.Errorf("mode %04o, want 0755", got)
		}
		if hasCaps(t, path) {
			t.Errorf("%s survived chown", capName)
		}
	})
}
