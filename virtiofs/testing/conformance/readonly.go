package conformance

import (
	"context"
	"fmt"
	"os"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"golang.org/x/sys/unix"
)

// RunReadOnly runs the read-only suite against the server behind c, which exports the empty
// directory root read-only (virtiofsd's --readonly): it prepares files on the host, then checks
// that reading works and that every request that would change the share answers EROFS and
// leaves the host as it was. The session must be initialised already.
func RunReadOnly(ctx context.Context, c *fuseclient.Client, root string) []Result {
	return run(ctx, &env{c: c, root: root, nodes: map[string]uint64{"/": fuse.RootID}, fhs: map[string]uint64{}}, readOnlySteps)
}

// unchanged is the host check of every refused step: the files setupReadOnly made are as it
// made them, and nothing else is there.
func (e *env) unchanged() error {
	if err := e.hostContent("pre/data", "0123456789"); err != nil {
		return err
	}
	if err := e.hostStat("pre/data", unix.S_IFREG|0o644, 10, -1); err != nil {
		return err
	}
	ents, err := os.ReadDir(e.root)
	if err != nil {
		return fmt.Errorf("host: %w", err)
	}
	if len(ents) != 1 || ents[0].Name() != "pre" {
		return fmt.Errorf("host: the share holds %v, want only pre", ents)
	}
	if ents, err = os.ReadDir(e.path("pre")); err != nil || len(ents) != 2 {
		return fmt.Errorf("host: pre holds %v (%v), want data and sub", ents, err)
	}
	return nil
}

// refused is a step that must answer EROFS and change nothing.
func refused(op func(ctx context.Context, e *env) error) func(ctx context.Context, e *env) (string, error) {
	return func(ctx context.Context, e *env) (string, error) {
		return okOr(op(ctx, e)), e.unchanged()
	}
}

func setupReadOnly(ctx context.Context, e *env) (string, error) {
	if err := os.MkdirAll(e.path("pre/sub"), 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(e.path("pre/data"), []byte("0123456789"), 0o644); err != nil {
		return "", err
	}
	return "ok", nil
}

const erofs = "errno EROFS"

var readOnlySteps = []step{
	{"setup", "ok", setupReadOnly},
	{"lookup pre", "ok mode=040755 size=4096 nlink=3 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, fuse.RootID, "pre")
		if err == nil {
			out.Attr.Size = 4096 // directory sizes depend on the host file system
		}
		return e.entry("pre", out, err), nil
	}},
	{"lookup pre/data", "ok mode=0100644 size=10 nlink=1 uid=0 gid=0", lookup("pre", "data")},
	{"lookup pre/sub", "ok mode=040755 size=4096 nlink=2 uid=0 gid=0", func(ctx context.Context, e *env) (string, error) {
		out, err := e.c.Lookup(ctx, e.node("pre"), "sub")
		if err == nil {
			out.Attr.Size = 4096
		}
		return e.entry("pre/sub", out, err), nil
	}},
	{"read pre/data", "ok 0123456789", func(ctx context.Context, e *env) (string, error) {
		node := e.node("pre/data")
		o, err := e.c.Open(ctx, node, unix.O_RDONLY)
		if err != nil {
			return errOutcome(err), nil
		}
		defer e.c.Release(ctx, node, o.Fh)
		b, err := e.c.Read(ctx, node, o.Fh, 0, 64)
		if err != nil {
			return errOutcome(err), nil
		}
		return "ok " + string(b), nil
	}},
	{"readdir pre", "ok", func(ctx context.Context, e *env) (string, error) {
		o, err := e.c.Opendir(ctx, e.node("pre"))
		if err != nil {
			return errOutcome(err), nil
		}
		defer e.c.Releasedir(ctx, e.node("pre"), o.Fh)
		_, err = e.c.Readdir(ctx, e.node("pre"), o.Fh, 0, 4096, false)
		return okOr(err), nil
	}},
	{"access read", "ok", func(ctx context.Context, e *env) (string, error) {
		return okOr(e.c.Access(ctx, e.node("pre/data"), unix.R_OK)), nil
	}},
	{"access write", erofs, refused(func(ctx context.Context, e *env) error {
		return e.c.Access(ctx, e.node("pre/data"), unix.W_OK)
	})},
	{"open for writing", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Open(ctx, e.node("pre/data"), unix.O_WRONLY)
		return err
	})},
	{"open read-write", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Open(ctx, e.node("pre/data"), unix.O_RDWR)
		return err
	})},
	{"open to truncate", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Open(ctx, e.node("pre/data"), unix.O_RDONLY|unix.O_TRUNC)
		return err
	})},
	{"create", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Create(ctx, e.node("pre"), "new", unix.O_RDWR|unix.O_CREAT, unix.S_IFREG|0o644)
		return err
	})},
	{"mkdir", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Mkdir(ctx, e.node("pre"), "newdir", 0o755)
		return err
	})},
	{"mknod", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Mknod(ctx, e.node("pre"), "fifo", unix.S_IFIFO|0o644, 0)
		return err
	})},
	{"symlink", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Symlink(ctx, e.node("pre"), "link", "data")
		return err
	})},
	{"link", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Link(ctx, e.node("pre/data"), e.node("pre"), "hard")
		return err
	})},
	{"unlink", erofs, refused(func(ctx context.Context, e *env) error {
		return e.c.Unlink(ctx, e.node("pre"), "data")
	})},
	{"rmdir", erofs, refused(func(ctx context.Context, e *env) error {
		return e.c.Rmdir(ctx, e.node("pre"), "sub")
	})},
	{"rename", erofs, refused(func(ctx context.Context, e *env) error {
		return e.c.Rename(ctx, e.node("pre"), "data", e.node("pre"), "moved", 0)
	})},
	{"chmod", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Setattr(ctx, e.node("pre/data"), &fuse.SetattrIn{Valid: fuse.FattrMode, Mode: 0o600})
		return err
	})},
	{"truncate", erofs, refused(func(ctx context.Context, e *env) error {
		_, err := e.c.Setattr(ctx, e.node("pre/data"), &fuse.SetattrIn{Valid: fuse.FattrSize})
		return err
	})},
}
