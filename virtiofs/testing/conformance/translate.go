package conformance

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// RustVirtiofsd is the reference peer Kata ships, the Rust virtiofsd 1.13 (Debian trixie's),
// which scripts/deps.sh unpacks with its C library and runs through this script.
var RustVirtiofsd = filepath.Join(cmp.Or(os.Getenv("KVFS_CACHE"), "/var/cache/kvfs"), "bin", "virtiofsd-rust")

// TranslateArgs are the options, in virtiofsd's syntax, of the server RunTranslate expects:
// guest uids and gids 0-65535 to host ids 100000-165535 and 200000-265535 both ways, guest
// uids 65536-66535 forbidden, and host gids 300000-300009 all shown as the guest's 99.
var TranslateArgs = []string{"--translate-uid=map:0:100000:65536", "--translate-uid=forbid-guest:65536:1000",
	"--translate-gid=map:0:200000:65536", "--translate-gid=squash-host:300000:99:10"}

// RunTranslate runs the id translation suite against the server behind c, which exports the
// empty directory root with the rules of TranslateArgs (virtiofsd's --translate-uid and
// --translate-gid): it makes files of several owners on the host, then checks the owners the
// guest sees, the host owners of what the guest creates and chowns, and that a forbidden
// caller or new owner is refused with EPERM and changes nothing. The session must be
// initialised already.
func RunTranslate(ctx context.Context, c *fuseclient.Client, root string) []Result {
	return run(ctx, &env{c: c, root: root, nodes: map[string]uint64{"/": fuse.RootID}, fhs: map[string]uint64{}}, translateSteps)
}

// hostOwner checks a host file's owner.
func (e *env) hostOwner(name string, uid, gid uint32) error {
	var st unix.Stat_t
	if err := unix.Lstat(e.path(name), &st); err != nil {
		return fmt.Errorf("host: %w", err)
	}
	if st.Uid != uid || st.Gid != gid {
		return fmt.Errorf("host: %s owned by %d:%d, want %d:%d", name, st.Uid, st.Gid, uid, gid)
	}
	return nil
}

func setupTranslate(ctx context.Context, e *env) (string, error) {
	if err := os.Chmod(e.root, 0o777); err != nil {
		return "", err
	}
	for name, owner := range map[string][2]int{"mapped": {100005, 200005}, "squashed": {7, 300003}, "untouched": {7, 7}} {
		if err := os.WriteFile(e.path(name), []byte("x"), 0o644); err != nil {
			return "", err
		}
		if err := os.Chown(e.path(name), owner[0], owner[1]); err != nil {
			return "", err
		}
	}
	return "ok", nil
}

// owners renders the owner of an entry.
func owners(out *fuse.EntryOut, err error) string {
	if err != nil {
		return errOutcome(err)
	}
	return fmt.Sprintf("ok uid=%d gid=%d", out.Attr.UID, out.Attr.GID)
}

func lookupOwner(name string) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, fuse.RootID, name)
		if err == nil {
			e.nodes[name] = out.NodeID
		}
		return owners(out, err), nil
	}
}

var translateSteps = []step{
	{"setup", "ok", setupTranslate},
	{"a mapped owner", "ok uid=5 gid=5", lookupOwner("mapped")},
	{"a squashed group", "ok uid=7 gid=99", lookupOwner("squashed")},
	{"ids no rule covers", "ok uid=7 gid=7", lookupOwner("untouched")},
	{"create as guest root", "ok uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Create(ctx, fuse.RootID, "made", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o644)
		if err != nil {
			return errOutcome(err), nil
		}
		e.nodes["made"] = out.Entry.NodeID
		return owners(&out.Entry, nil), e.hostOwner("made", 100000, 200000)
	}},
	{"mkdir as guest 1000", "ok uid=1000 gid=1000", func(ctx context.Context, e *env) (string, error) {
		e.c.UID, e.c.GID = 1000, 1000
		out, err := e.c.Mkdir(ctx, fuse.RootID, "dir", 0o755)
		e.c.UID, e.c.GID = 0, 0
		if err != nil {
			return errOutcome(err), nil
		}
		return owners(out, nil), e.hostOwner("dir", 101000, 201000)
	}},
	{"chown to guest 7:8", "ok uid=7 gid=8", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Setattr(ctx, e.node("mapped"), &fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID, UID: 7, GID: 8})
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok uid=%d gid=%d", out.Attr.UID, out.Attr.GID), e.hostOwner("mapped", 100007, 200008)
	}},
	{"chown to a forbidden uid", "errno EPERM", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Setattr(ctx, e.node("made"), &fuse.SetattrIn{Valid: fuse.FattrUID, UID: 65600})
		return errOutcome(err), e.hostOwner("made", 100000, 200000)
	}},
	{"create as a forbidden caller", "errno EPERM", func(ctx context.Context, e *env) (string, error) {
		e.c.UID, e.c.GID = 66000, 0
		_, err := e.c.Create(ctx, fuse.RootID, "forbidden", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o644)
		e.c.UID, e.c.GID = 0, 0
		return errOutcome(err), e.hostAbsent("forbidden")
	}},
	{"getattr after the chown", "ok mode=0100644 size=1 nlink=1 uid=7 gid=8", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Getattr(ctx, e.node("mapped"), 0)
		if err != nil {
			return errOutcome(err), nil
		}
		return attrOutcome(&out.Attr), nil
	}},
}
