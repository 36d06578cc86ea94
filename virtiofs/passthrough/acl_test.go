package passthrough

import (
	"encoding/binary"
	"os"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// TestCreateModeDefaultACL creates as a non-root caller, whose thread then reads the
// directory's default ACL with the caller's fsuid.
func TestCreateModeDefaultACL(t *testing.T) {
	needRoot(t)
	for _, posixACL := range []bool{false, true} {
		e := newEnv(t, Options{Xattr: true, PosixACL: posixACL})
		must(t, os.Mkdir(e.path("d"), 0o777))
		must(t, os.Chmod(e.path("d"), 0o777))
		// A minimal default ACL: user rwx, group rwx, other r-x (version 2 entries).
		acl := binary.LittleEndian.AppendUint32(nil, 2)
		for _, ent := range [][2]uint16{{0x01, 7}, {0x04, 7}, {0x20, 5}} {
			acl = binary.LittleEndian.AppendUint16(acl, ent[0])
			acl = binary.LittleEndian.AppendUint16(acl, ent[1])
			acl = binary.LittleEndian.AppendUint32(acl, 0xffffffff)
		}
		if err := unix.Setxattr(e.path("d"), "system.posix_acl_default", acl, 0); err != nil {
			t.Skipf("no POSIX ACLs here: %v", err)
		}
		d := e.lookup(t, 1, "d").NodeID
		var out fuse.EntryOut
		wantErrno(t, "Mkdir", e.fs.Mkdir(userCtx, d, "sub", &fuse.MkdirIn{Mode: 0o777, Umask: 0o077}, &out), 0)
		wantErrno(t, "Mknod", e.fs.Mknod(userCtx, d, "fifo", &fuse.MknodIn{Mode: unix.S_IFIFO | 0o666, Umask: 0o077}, &out), 0)
		want := map[string]uint32{"d/sub": 0o700, "d/fifo": 0o600} // umask applied
		if posixACL {
			want = map[string]uint32{"d/sub": 0o775, "d/fifo": 0o664} // umask ignored
		}
		for p, w := range want {
			var st unix.Stat_t
			must(t, unix.Stat(e.path(p), &st))
			if st.Mode&07777 != w || st.Uid != 1000 {
				t.Errorf("PosixACL=%v: %s mode %04o uid %d, want %04o uid 1000", posixACL, p, st.Mode&07777, st.Uid, w)
			}
		}
	}
}
