// Package conformance is one FUSE operation suite for every virtio-fs server: it drives a server
// through a fuseclient.Client (in-process, through the in-repo front-end, or against the C
// virtiofsd) and checks each operation twice — by what the server answers, and by what the
// operation did to the shared directory on the host.
//
// Each step's answer is reduced to an outcome string that leaves out what legitimately differs
// between servers and runs (node ids, handles, inode numbers, times), so that two servers can be
// compared step by step.
package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"golang.org/x/sys/unix"
)

// StepTimeout bounds each step, so that a server that stops answering fails the remaining steps
// quickly instead of hanging the suite.
const StepTimeout = 5 * time.Second

// Result is what one step did.
type Result struct {
	Step string
	// Outcome is the server's answer, reduced to what every correct server agrees on.
	Outcome string
	// Want is what a correct server answers.
	Want string
	// HostErr says what the host-side check found wrong (nil: the shared directory is as the
	// step should have left it).
	HostErr error
}

// OK reports whether the server answered as wanted and left the host as it should.
func (r Result) OK() bool { return r.Outcome == r.Want && r.HostErr == nil }

// env is the state steps share.
type env struct {
	c     *fuseclient.Client
	root  string            // the shared directory on the host
	nodes map[string]uint64 // node ids by suite name
	fhs   map[string]uint64 // open handles by suite name
}

type step struct {
	name string
	want string
	run  func(ctx context.Context, e *env) (outcome string, hostErr error)
}

// Run executes the suite against the server behind c, which serves the empty directory root,
// and returns one result per step. The session must be initialised already.
func Run(ctx context.Context, c *fuseclient.Client, root string) []Result {
	return run(ctx, &env{c: c, root: root, nodes: map[string]uint64{"/": fuse.RootID}, fhs: map[string]uint64{}}, steps)
}

// run runs steps in order, each bounded by StepTimeout.
func run(ctx context.Context, e *env, steps []step) []Result {
	var out []Result
	for _, s := range steps {
		sctx, cancel := context.WithTimeout(ctx, StepTimeout)
		outcome, hostErr := s.run(sctx, e)
		cancel()
		out = append(out, Result{Step: s.name, Outcome: outcome, Want: s.want, HostErr: hostErr})
	}
	return out
}

// Steps lists the step names in order.
func Steps() []string {
	var names []string
	for _, s := range steps {
		names = append(names, s.name)
	}
	return names
}

// errOutcome renders an error: a server errno by name, anything else verbatim, and no error
// (a server that did what the step expects it to refuse) as "ok".
func errOutcome(err error) string {
	if err == nil {
		return "ok"
	}
	var en unix.Errno
	if errors.As(err, &en) {
		return "errno " + unix.ErrnoName(en)
	}
	return "error " + err.Error()
}

func attrOutcome(a *fuse.Attr) string {
	return fmt.Sprintf("ok mode=%#o size=%d nlink=%d uid=%d gid=%d", a.Mode, a.Size, a.Nlink, a.UID, a.GID)
}

func (e *env) path(name string) string { return filepath.Join(e.root, name) }

// hostStat checks a host file's type+mode, size and owner (-1: don't care).
func (e *env) hostStat(name string, mode uint32, size int64, uid int) error {
	var st unix.Stat_t
	if err := unix.Lstat(e.path(name), &st); err != nil {
		return fmt.Errorf("host: %w", err)
	}
	if mode != 0 && st.Mode != mode {
		return fmt.Errorf("host: %s mode %#o, want %#o", name, st.Mode, mode)
	}
	if size >= 0 && st.Size != size {
		return fmt.Errorf("host: %s size %d, want %d", name, st.Size, size)
	}
	if uid >= 0 && int(st.Uid) != uid {
		return fmt.Errorf("host: %s owner %d, want %d", name, st.Uid, uid)
	}
	return nil
}

func (e *env) hostAbsent(name string) error {
	if _, err := os.Lstat(e.path(name)); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("host: %s should not exist (%v)", name, err)
	}
	return nil
}

func (e *env) hostContent(name, want string) error {
	b, err := os.ReadFile(e.path(name))
	if err != nil {
		return fmt.Errorf("host: %w", err)
	}
	if string(b) != want {
		return fmt.Errorf("host: %s holds %q, want %q", name, b, want)
	}
	return nil
}

// entry records a created or looked-up node and renders the answer.
func (e *env) entry(name string, out *fuse.EntryOut, err error) string {
	if err != nil {
		return errOutcome(err)
	}
	e.nodes[name] = out.NodeID
	return attrOutcome(&out.Attr)
}

func (e *env) node(name string) uint64 { return e.nodes[name] }

// setup creates host files the steps use, as the host side of a sandbox would.
func setup(ctx context.Context, e *env) (string, error) {
	for _, d := range []string{"pre", "pre/sub"} {
		if err := os.Mkdir(e.path(d), 0o755); err != nil {
			return "", err
		}
	}
	if err := os.WriteFile(e.path("pre/data"), []byte("0123456789"), 0o644); err != nil {
		return "", err
	}
	if err := os.Symlink("/etc", e.path("pre/etc-link")); err != nil {
		return "", err
	}
	if err := os.Symlink("../../..", e.path("pre/up-link")); err != nil {
		return "", err
	}
	if err := unix.Mkfifo(e.path("pre/fifo"), 0o644); err != nil {
		return "", err
	}
	// A file outside the share that no step may touch.
	if err := os.WriteFile(filepath.Join(filepath.Dir(e.root), "outside"), []byte("outside"), 0o644); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return "ok", nil
}

// lockStep runs a lock request on pre/data, opened for it, and checks that the host file
// carries no lock afterwards.
func lockStep(op func(ctx context.Context, e *env, node, fh uint64) error) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		node := e.node("pre/data")
		o, err := e.c.Open(ctx, node, unix.O_RDWR)
		if err != nil {
			return errOutcome(err), nil
		}
		err = op(ctx, e, node, o.Fh)
		e.c.Release(ctx, node, o.Fh)
		out := "ok"
		if err != nil {
			out = errOutcome(err)
		}
		f, herr := os.OpenFile(e.path("pre/data"), os.O_RDWR, 0)
		if herr != nil {
			return out, fmt.Errorf("host: %w", herr)
		}
		defer f.Close()
		fl := unix.Flock_t{Type: unix.F_WRLCK, Whence: unix.SEEK_SET}
		if herr := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &fl); herr != nil || fl.Type != unix.F_UNLCK {
			return out, fmt.Errorf("host: pre/data is locked (%+v, %v)", fl, herr)
		}
		return out, nil
	}
}

func lookup(parent, name string) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node(parent), name)
		return e.entry(strings.TrimPrefix(filepath.Join(parent, name), "/"), out, err), nil
	}
}

var steps = []step{
	{"setup", "ok", setup},
	{"statfs", "ok", func(ctx context.Context, e *env) (string, error) {
		st, err := e.c.Statfs(ctx, fuse.RootID)
		if err != nil {
			return errOutcome(err), nil
		}
		if st.Bsize == 0 || st.Namelen != 255 || st.Blocks == 0 {
			return fmt.Sprintf("bad statfs %+v", st), nil
		}
		return "ok", nil
	}},
	{"getattr root", "ok mode=040755", func(ctx context.Context, e *env) (string, error) {
		a, err := e.c.Getattr(ctx, fuse.RootID, 0)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok mode=%#o", a.Attr.Mode), nil
	}},
	{"lookup missing", "errno ENOENT", lookup("/", "missing")},
	{"lookup pre", "ok mode=040755 size=4096 nlink=3 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, fuse.RootID, "pre")
		if err == nil && out.Attr.Size != 4096 {
			out.Attr.Size = 4096 // directory sizes depend on the host file system
		}
		return e.entry("pre", out, err), nil
	}},
	{"lookup pre/data", "ok mode=0100644 size=10 nlink=1 uid=0 gid=0", lookup("pre", "data")},
	{"lookup dot-dot", "errno EINVAL", lookup("/", "..")},
	{"lookup dot", "errno EINVAL", lookup("/", ".")},
	{"create f", "ok mode=0100644 size=0 nlink=1 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Create(ctx, fuse.RootID, "f", unix.O_RDWR|unix.O_CREAT, unix.S_IFREG|0o644)
		if err != nil {
			return errOutcome(err), nil
		}
		e.fhs["f"] = out.Open.Fh
		return e.entry("f", &out.Entry, nil), e.hostStat("f", unix.S_IFREG|0o644, 0, 0)
	}},
	{"create existing O_EXCL", "errno EEXIST", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Create(ctx, fuse.RootID, "f", unix.O_RDWR|unix.O_CREAT|unix.O_EXCL, unix.S_IFREG|0o644)
		return errOutcome(err), nil
	}},
	{"write f", "ok 11", func(ctx context.Context, e *env) (string, error) {
		n, err := e.c.Write(ctx, e.node("f"), e.fhs["f"], 0, []byte("hello world"), 0)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %d", n), e.hostContent("f", "hello world")
	}},
	{"write f at offset", "ok 4", func(ctx context.Context, e *env) (string, error) {
		n, err := e.c.Write(ctx, e.node("f"), e.fhs["f"], 11, []byte("!!!!"), 0)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %d", n), e.hostContent("f", "hello world!!!!")
	}},
	{"read f", "ok \"world!!!!\"", func(ctx context.Context, e *env) (string, error) {
		b, err := e.c.Read(ctx, e.node("f"), e.fhs["f"], 6, 100)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %q", b), nil
	}},
	{"read past end", "ok \"\"", func(ctx context.Context, e *env) (string, error) {
		b, err := e.c.Read(ctx, e.node("f"), e.fhs["f"], 1000, 100)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %q", b), nil
	}},
	{"read bad handle", "errno EBADF", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Read(ctx, e.node("f"), 0xdead, 0, 10)
		return errOutcome(err), nil
	}},
	{"getattr f", "ok mode=0100644 size=15 nlink=1 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		a, err := e.c.Getattr(ctx, e.node("f"), 0)
		if err != nil {
			return errOutcome(err), nil
		}
		return attrOutcome(&a.Attr), nil
	}},
	{"setattr truncate", "ok mode=0100644 size=5 nlink=1 uid=0 gid=0", setattr("f", &fuse.SetattrIn{Valid: fuse.FattrSize, Size: 5},
		func(e *env) error { return e.hostContent("f", "hello") })},
	{"setattr chmod", "ok mode=0100600 size=5 nlink=1 uid=0 gid=0", setattr("f", &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o600},
		func(e *env) error { return e.hostStat("f", unix.S_IFREG|0o600, 5, -1) })},
	{"setattr chown", "ok mode=0100600 size=5 nlink=1 uid=1000 gid=1000", setattr("f", &fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID, UID: 1000, GID: 1000},
		func(e *env) error { return e.hostStat("f", 0, -1, 1000) })},
	{"setattr mtime", "ok", func(ctx context.Context, e *env) (string, error) {
		in := &fuse.SetattrIn{Valid: fuse.FattrMtime | fuse.FattrAtime, Mtime: 1_000_000_000, Atime: 1_000_000_000}
		a, err := e.c.Setattr(ctx, e.node("f"), in)
		if err != nil {
			return errOutcome(err), nil
		}
		fi, serr := os.Stat(e.path("f"))
		if serr == nil && fi.ModTime().Unix() != 1_000_000_000 {
			serr = fmt.Errorf("host: mtime %v", fi.ModTime())
		}
		if a.Attr.Mtime != 1_000_000_000 {
			return fmt.Sprintf("mtime %d", a.Attr.Mtime), serr
		}
		return "ok", serr
	}},
	{"flush f", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Flush(ctx, e.node("f"), e.fhs["f"])), nil
	}},
	{"fsync f", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Fsync(ctx, e.node("f"), e.fhs["f"], false)), nil
	}},
	{"fdatasync f", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Fsync(ctx, e.node("f"), e.fhs["f"], true)), nil
	}},
	{"fallocate f", "ok", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Fallocate(ctx, e.node("f"), e.fhs["f"], 0, 1<<20, 0)
		return okOr(err), e.hostStat("f", 0, 1<<20, -1)
	}},
	// A sparse file: one page of data, then a hole up to 1 MiB (on every host file system with
	// blocks or pages of 4 KiB).
	{"sparse file", "ok mode=0100644 size=1048576 nlink=1 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Create(ctx, fuse.RootID, "sparse", unix.O_RDWR|unix.O_CREAT, unix.S_IFREG|0o644)
		if err != nil {
			return errOutcome(err), nil
		}
		e.nodes["sparse"], e.fhs["sparse"] = out.Entry.NodeID, out.Open.Fh
		if _, err := e.c.Write(ctx, out.Entry.NodeID, out.Open.Fh, 0, []byte("x"), 0); err != nil {
			return errOutcome(err), nil
		}
		a, err := e.c.Setattr(ctx, out.Entry.NodeID, &fuse.SetattrIn{Valid: fuse.FattrSize, Size: 1 << 20})
		if err != nil {
			return errOutcome(err), nil
		}
		return attrOutcome(&a.Attr), e.hostStat("sparse", 0, 1<<20, -1)
	}},
	{"lseek data", "ok 0", func(ctx context.Context, e *env) (string, error) {
		off, err := e.c.Lseek(ctx, e.node("sparse"), e.fhs["sparse"], 0, unix.SEEK_DATA)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %d", off), nil
	}},
	{"lseek hole", "ok 4096", func(ctx context.Context, e *env) (string, error) {
		off, err := e.c.Lseek(ctx, e.node("sparse"), e.fhs["sparse"], 0, unix.SEEK_HOLE)
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %d", off), nil
	}},
	{"lseek data past the hole", "errno ENXIO", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Lseek(ctx, e.node("sparse"), e.fhs["sparse"], 8192, unix.SEEK_DATA)
		err2 := e.c.Release(ctx, e.node("sparse"), e.fhs["sparse"])
		if err == nil {
			return okOr(err2), nil
		}
		return errOutcome(err), nil
	}},
	{"release f", "ok", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Release(ctx, e.node("f"), e.fhs["f"])
		delete(e.fhs, "f")
		return okOr(err), nil
	}},
	{"open f", "ok", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Open(ctx, e.node("f"), unix.O_RDWR)
		if err != nil {
			return errOutcome(err), nil
		}
		e.fhs["f"] = out.Fh
		return "ok", nil
	}},
	{"open O_TRUNC", "ok", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Open(ctx, e.node("f"), unix.O_WRONLY|unix.O_TRUNC)
		if err != nil {
			return errOutcome(err), nil
		}
		rerr := e.c.Release(ctx, e.node("f"), out.Fh)
		return okOr(rerr), e.hostStat("f", 0, 0, -1)
	}},
	{"copy_file_range", "ok 10", func(ctx context.Context, e *env) (string, error) {
		src, err := e.c.Open(ctx, e.node("pre/data"), unix.O_RDONLY)
		if err != nil {
			return errOutcome(err), nil
		}
		defer e.c.Release(ctx, e.node("pre/data"), src.Fh)
		n, err := e.c.CopyFileRange(ctx, &fuse.CopyFileRangeIn{FhIn: src.Fh, NodeIDOut: e.node("f"),
			FhOut: e.fhs["f"], Len: 100}, e.node("pre/data"))
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %d", n), e.hostContent("f", "0123456789")
	}},
	{"mkdir d", "ok mode=040750 size=4096 nlink=2 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Mkdir(ctx, fuse.RootID, "d", 0o750)
		if err == nil {
			out.Attr.Size = 4096
		}
		return e.entry("d", out, err), e.hostStat("d", unix.S_IFDIR|0o750, -1, 0)
	}},
	{"mkdir existing", "errno EEXIST", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Mkdir(ctx, fuse.RootID, "d", 0o750)
		return errOutcome(err), nil
	}},
	{"create as uid 1000", "ok mode=0100640 size=0 nlink=1 uid=1000 gid=1000", func(ctx context.Context, e *env) (string, error) {
		if err := os.Chmod(e.path("d"), 0o777); err != nil {
			return "", err
		}
		e.c.UID, e.c.GID = 1000, 1000
		out, err := e.c.Create(ctx, e.node("d"), "mine", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o640)
		e.c.UID, e.c.GID = 0, 0
		if err != nil {
			return errOutcome(err), nil
		}
		e.fhs["d/mine"] = out.Open.Fh
		return e.entry("d/mine", &out.Entry, nil), e.hostStat("d/mine", unix.S_IFREG|0o640, 0, 1000)
	}},
	{"release d/mine", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Release(ctx, e.node("d/mine"), e.fhs["d/mine"])), nil
	}},
	{"symlink s", "ok mode=0120777 size=1 nlink=1 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Symlink(ctx, fuse.RootID, "s", "f")
		return e.entry("s", out, err), e.hostStat("s", unix.S_IFLNK|0o777, 1, -1)
	}},
	{"readlink s", "ok \"f\"", func(ctx context.Context, e *env) (string, error) {
		t, err := e.c.Readlink(ctx, e.node("s"))
		if err != nil {
			return errOutcome(err), nil
		}
		return fmt.Sprintf("ok %q", t), nil
	}},
	{"link f h", "ok mode=0100600 size=10 nlink=2 uid=1000 gid=1000", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Link(ctx, e.node("f"), fuse.RootID, "h")
		return e.entry("h", out, err), e.hostStat("h", 0, 10, -1)
	}},
	{"link of a directory", "errno EPERM", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Link(ctx, e.node("d"), fuse.RootID, "dlink")
		return errOutcome(err), e.hostAbsent("dlink")
	}},
	{"mknod fifo", "ok mode=010644 size=0 nlink=1 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Mknod(ctx, fuse.RootID, "p", unix.S_IFIFO|0o644, 0)
		return e.entry("p", out, err), e.hostStat("p", unix.S_IFIFO|0o644, -1, -1)
	}},
	{"rename f g", "ok", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Rename(ctx, fuse.RootID, "f", fuse.RootID, "g", 0)
		if err != nil {
			return errOutcome(err), nil
		}
		if herr := e.hostAbsent("f"); herr != nil {
			return "ok", herr
		}
		return "ok", e.hostContent("g", "0123456789")
	}},
	{"rename noreplace", "errno EEXIST", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Rename(ctx, fuse.RootID, "g", fuse.RootID, "h", unix.RENAME_NOREPLACE)
		return errOutcome(err), e.hostContent("g", "0123456789")
	}},
	{"rename exchange", "ok", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Rename(ctx, fuse.RootID, "g", e.node("d"), "mine", unix.RENAME_EXCHANGE)
		if err != nil {
			return errOutcome(err), nil
		}
		return "ok", e.hostContent("d/mine", "0123456789")
	}},
	{"rename into a file", "errno ENOTDIR", func(ctx context.Context, e *env) (string, error) {
		err := e.c.Rename(ctx, fuse.RootID, "h", e.node("pre/data"), "x", 0)
		return errOutcome(err), nil
	}},
	{"readdir root", "ok [. .. d g h p pre s sparse]", readdirStep(fuse.RootID, false)},
	{"readdirplus root", "ok [. .. d g h p pre s sparse]", readdirStep(fuse.RootID, true)},
	{"unlink h", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Unlink(ctx, fuse.RootID, "h")), e.hostAbsent("h")
	}},
	{"unlink missing", "errno ENOENT", func(ctx context.Context, e *env) (string, error) {
		return errOutcome(e.c.Unlink(ctx, fuse.RootID, "h")), nil
	}},
	{"rmdir non-empty", "errno ENOTEMPTY", func(ctx context.Context, e *env) (string, error) {
		return errOutcome(e.c.Rmdir(ctx, fuse.RootID, "d")), nil
	}},
	{"unlink d/mine", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Unlink(ctx, e.node("d"), "mine")), e.hostAbsent("d/mine")
	}},
	{"rmdir d", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Rmdir(ctx, fuse.RootID, "d")), e.hostAbsent("d")
	}},
	{"tmpfile", "ok mode=0100600 size=0 nlink=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Tmpfile(ctx, fuse.RootID, unix.O_RDWR, unix.S_IFREG|0o600)
		if err != nil {
			return errOutcome(err), nil
		}
		e.c.Release(ctx, out.Entry.NodeID, out.Open.Fh)
		a := out.Entry.Attr
		return fmt.Sprintf("ok mode=%#o size=%d nlink=%d", a.Mode, a.Size, a.Nlink), nil
	}},
	{"access read", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Access(ctx, e.node("pre/data"), unix.R_OK)), nil
	}},
	{"access write as uid 1000", "errno EACCES", func(ctx context.Context, e *env) (string, error) {
		e.c.UID, e.c.GID = 1000, 1000
		err := e.c.Access(ctx, e.node("pre/data"), unix.W_OK)
		e.c.UID, e.c.GID = 0, 0
		return okOr(err), nil
	}},
	{"syncfs", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Syncfs(ctx, fuse.RootID)), nil
	}},
	{"getxattr without xattr", "errno ENOSYS", func(ctx context.Context, e *env) (string, error) {
		_, _, err := e.c.Getxattr(ctx, e.node("pre/data"), "user.x", 0)
		return errOutcome(err), nil
	}},
	{"setxattr without xattr", "errno ENOSYS", func(ctx context.Context, e *env) (string, error) {
		return errOutcome(e.c.Setxattr(ctx, e.node("pre/data"), "user.x", []byte("v"), 0)), nil
	}},
	// Without posix_lock and flock (the default of every server) locks stay in the guest: INIT
	// does not grant them and the lock requests answer ENOSYS.
	{"getlk without posix_lock", "errno ENOSYS", lockStep(func(ctx context.Context, e *env, node, fh uint64) error {
		_, err := e.c.Getlk(ctx, node, fh, 1, fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax, PID: 1})
		return err
	})},
	{"setlk without posix_lock", "errno ENOSYS", lockStep(func(ctx context.Context, e *env, node, fh uint64) error {
		return e.c.Setlk(ctx, node, fh, 1, fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax, PID: 1}, 0, false)
	})},
	{"setlkw without posix_lock", "errno ENOSYS", lockStep(func(ctx context.Context, e *env, node, fh uint64) error {
		return e.c.Setlk(ctx, node, fh, 1, fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax, PID: 1}, 0, true)
	})},
	{"flock without flock", "errno ENOSYS", lockStep(func(ctx context.Context, e *env, node, fh uint64) error {
		return e.c.Setlk(ctx, node, fh, 1, fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax}, fuse.LkFlock, false)
	})},
	// Hostile requests: each must fail and leave everything outside the share alone.
	{"lookup through absolute symlink", "errno ENOTDIR", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node("pre"), "etc-link")
		if err != nil {
			return errOutcome(err), nil
		}
		_, err = e.c.Lookup(ctx, out.NodeID, "passwd")
		return errOutcome(err), nil
	}},
	{"create through relative symlink", "errno ENOTDIR", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node("pre"), "up-link")
		if err != nil {
			return errOutcome(err), nil
		}
		_, err = e.c.Create(ctx, out.NodeID, "escaped", unix.O_WRONLY|unix.O_CREAT, unix.S_IFREG|0o644)
		return errOutcome(err), e.outsideUntouched()
	}},
	{"open a symlink", "errno ELOOP", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node("pre"), "etc-link")
		if err != nil {
			return errOutcome(err), nil
		}
		_, err = e.c.Open(ctx, out.NodeID, unix.O_RDONLY)
		return errOutcome(err), nil
	}},
	{"setattr through symlink", "ok mode=0120777", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node("pre"), "up-link")
		if err != nil {
			return errOutcome(err), nil
		}
		a, err := e.c.Setattr(ctx, out.NodeID, &fuse.SetattrIn{Valid: fuse.FattrUID, UID: 4321})
		if err != nil {
			return errOutcome(err), e.outsideUntouched()
		}
		return fmt.Sprintf("ok mode=%#o", a.Attr.Mode), e.outsideUntouched()
	}},
	{"unknown node", "errno EBADF", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Getattr(ctx, 1<<40, 0)
		return errOutcome(err), nil
	}},
	{"rename to unknown dir", "errno EBADF", func(ctx context.Context, e *env) (string, error) {
		return errOutcome(e.c.Rename(ctx, fuse.RootID, "g", 1<<40, "x", 0)), e.hostContent("g", "")
	}},
	{"name with slash", "errno EINVAL", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Lookup(ctx, fuse.RootID, "pre/data")
		return errOutcome(err), nil
	}},
	{"mkdir dot-dot", "errno EEXIST", func(ctx context.Context, e *env) (string, error) {
		_, err := e.c.Mkdir(ctx, e.node("pre"), "..", 0o755)
		return errOutcome(err), nil
	}},
	{"forget unknown", "ok", func(ctx context.Context, e *env) (string, error) {
		if err := e.c.Forget(ctx, 1<<40, 1); err != nil {
			return errOutcome(err), nil
		}
		// The server must still answer.
		_, err := e.c.Getattr(ctx, fuse.RootID, 0)
		return okOr(err), nil
	}},
	// Last: the C virtiofsd aborts on it.
	{"over-forget pre/data", "ok", func(ctx context.Context, e *env) (string, error) {
		if err := e.c.Forget(ctx, e.node("pre/data"), 1<<40); err != nil {
			return errOutcome(err), nil
		}
		// Looked up again, it is a live node.
		out, err := e.c.Lookup(ctx, e.node("pre"), "data")
		if err != nil {
			return errOutcome(err), nil
		}
		e.nodes["pre/data"] = out.NodeID
		_, err = e.c.Getattr(ctx, out.NodeID, 0)
		return okOr(err), nil
	}},
}

func setattr(name string, in *fuse.SetattrIn, host func(*env) error) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		a, err := e.c.Setattr(ctx, e.node(name), in)
		if err != nil {
			return errOutcome(err), nil
		}
		return attrOutcome(&a.Attr), host(e)
	}
}

func okOr(err error) string {
	if err != nil {
		return errOutcome(err)
	}
	return "ok"
}

func readdirStep(node uint64, plus bool) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		dh, err := e.c.Opendir(ctx, node)
		if err != nil {
			return errOutcome(err), nil
		}
		defer e.c.Releasedir(ctx, node, dh.Fh)
		var names []string
		// Small replies, so that the listing takes several calls and cookies matter.
		for off := uint64(0); ; {
			ents, err := e.c.Readdir(ctx, node, dh.Fh, off, 200, plus)
			if err != nil {
				return errOutcome(err), nil
			}
			if len(ents) == 0 {
				break
			}
			for _, d := range ents {
				names = append(names, d.Name)
				if plus && d.Name != "." && d.Name != ".." {
					if d.Entry.NodeID == 0 {
						return fmt.Sprintf("%s: no node id", d.Name), nil
					}
					// Give the reference back, as the guest eventually does.
					e.c.Forget(ctx, d.Entry.NodeID, 1)
				}
			}
			off = ents[len(ents)-1].Off
		}
		slices.Sort(names)
		return fmt.Sprintf("ok %v", names), nil
	}
}

// outsideUntouched checks the sibling of the shared directory and /etc were left alone.
func (e *env) outsideUntouched() error {
	b, err := os.ReadFile(filepath.Join(filepath.Dir(e.root), "outside"))
	if err != nil || !bytes.Equal(b, []byte("outside")) {
		return fmt.Errorf("host: file outside the share changed: %q, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(e.root), "escaped")); !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("host: a file was created outside the share")
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(filepath.Dir(e.root), &st); err == nil && st.Uid == 4321 {
		return fmt.Errorf("host: owner of a directory outside the share changed")
	}
	return nil
}
