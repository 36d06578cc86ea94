package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// The kubelet updates a running pod's configMap, secret, projected and downward API volumes
// in place, atomically: it writes the new content into a new hidden directory beside the old
// (..<timestamp>), swaps the ..data symlink to it by a rename, adds or removes the
// user-visible links (key -> ..data/key), and removes the old directory. A container of a runc
// pod sees each step, and an inotify watch in it sees the events (applications that reload
// their configuration on change rely on them). Over virtio-fs the new content reaches the
// guest, but no event does: FUSE has no notifications from the host. So such a volume is
// mirrored (CreateContainerRequest.mirrored): the agent copies it from the share into a tmpfs
// of the guest's (MirrorDir/<name>), which the container binds, and polls the share every
// mirrorInterval, replaying each change in the copy in the kubelet's order: new entries first,
// then the links (each replaced by a rename, as ..data is), then what went away. A watch in
// the container then sees the events a runc container's would.

// startMirrors copies c's mirrored volumes (names of the share's binds) to MirrorDir, and
// keeps the copies in step until endMirrors.
func (s *Service) startMirrors(c *container, names []string) error {
	if len(names) == 0 {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.endMirrors = cancel
	for _, name := range names {
		dst := filepath.Join(s.cfg.MirrorDir, name)
		c.mirrors = append(c.mirrors, dst)
		done, err := mirror(ctx, filepath.Join(s.cfg.RootDir, name), dst, mirrorInterval, s.log)
		if err != nil {
			return errf(errdefs.ErrInternal, "%v", err)
		}
		c.mirroring = append(c.mirroring, done)
	}
	return nil
}

// endMirrors stops the polling of c's mirrored volumes and removes their copies.
func (s *Service) endMirrors(c *container) {
	if c.endMirrors == nil {
		return
	}
	c.endMirrors()
	for _, done := range c.mirroring {
		<-done
	}
	for _, dst := range c.mirrors {
		if err := os.RemoveAll(dst); err != nil {
			s.log.WithError(err).WithField("container", c.id).Warn("removing a mirrored volume")
		}
	}
}

// readOnlyMirrors makes the mounts of spec that bind a mirrored copy (below dir) read-only,
// whatever the spec asked: the copy is the mirror's alone to write, as agent root, and a
// container that could write it could put a link where the mirror writes next. (The kubelet
// mounts these volumes read-only anyway.)
func readOnlyMirrors(spec *specs.Spec, dir string) {
	for i, m := range spec.Mounts {
		if src := path.Clean(m.Source); src != dir && !strings.HasPrefix(src, dir+"/") {
			continue
		}
		opts := slices.DeleteFunc(slices.Clone(m.Options), func(o string) bool { return o == "rw" || o == "ro" })
		spec.Mounts[i].Options = append(opts, "ro")
	}
}

// mirrorInterval is how often a mirrored volume's source is compared with its copy.
const mirrorInterval = 2 * time.Second

// mirrorMaxEntries bounds a mirrored volume (files, directories and links, all levels): a
// configMap or secret holds at most 1 MiB of data, in keys of a few bytes at least.
const mirrorMaxEntries = 1 << 16

// mirror keeps dst a copy of src, polling src every interval until ctx ends; done is closed
// then. The first copy is made before it returns; a failure of a later one is logged and
// tried again.
func mirror(ctx context.Context, src, dst string, interval time.Duration, log *logrus.Entry) (done <-chan struct{}, err error) {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return nil, err
	}
	m := newMirrorTree(src, dst)
	if err := m.sync(); err != nil {
		return nil, fmt.Errorf("mirror %s: %w", src, err)
	}
	ch := make(chan struct{})
	go func() {
		defer close(ch)
		t := time.NewTicker(interval)
		defer t.Stop()
		failing := false
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			err := m.sync()
			if err != nil && !failing {
				log.WithError(err).WithField("volume", src).Warn("mirroring the volume")
			}
			failing = err != nil
		}
	}()
	return ch, nil
}

// mirrorTree is a copy (dst) of a directory (src) and what it knows of the copy: what it
// last copied there, by path relative to dst. It reads the source only: an unchanged source
// costs the copy nothing, not even an open (a watch in the container that takes every event
// sees none while nothing changes). Only the mirror writes the copy.
type mirrorTree struct {
	src, dst string
	known    map[string]mirrored
}

// mirrored is what the copy holds at a path, as it was at the source when copied.
type mirrored struct {
	mode         uint32 // the stat mode, type included
	uid, gid     uint32
	size         int64
	mtime, ctime unix.Timespec
	ino          uint64
	target       string // a link's
	isKubeletDir bool   // a directory of the kubelet's (..<timestamp>): never written again
	children     []string
}

func newMirrorTree(src, dst string) *mirrorTree {
	return &mirrorTree{src: src, dst: dst, known: map[string]mirrored{}}
}

// sync makes the copy hold what the source holds, in three passes over each directory:
// entries new or changed but links, then links, then entries gone. A new file or link is
// created as the kubelet creates it; a changed one replaced by a rename (as ..data is); a
// directory of the kubelet's is taken as it is once copied.
func (m *mirrorTree) sync() error {
	now, err := m.stat("")
	if err != nil {
		return err
	}
	root := m.known[""]
	if root.mode != now.mode || root.uid != now.uid || root.gid != now.gid {
		if err := os.Lchown(m.dst, int(now.uid), int(now.gid)); err != nil {
			return err
		}
		if err := os.Chmod(m.dst, fsMode(now.mode)); err != nil {
			return err
		}
	}
	now.children = root.children
	m.known[""] = now
	n := 0
	return m.syncDir("", &n)
}

func (m *mirrorTree) syncDir(rel string, n *int) error {
	src := filepath.Join(m.src, rel)
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	*n += len(entries)
	if *n > mirrorMaxEntries {
		return fmt.Errorf("more than %d entries", mirrorMaxEntries)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	// New or changed directories and files.
	for _, e := range entries {
		r := filepath.Join(rel, e.Name())
		switch {
		case e.Type() == fs.ModeSymlink:
		case e.IsDir():
			if err := m.syncSubdir(r, n); err != nil {
				return err
			}
		case e.Type().IsRegular():
			if err := m.syncFile(r); err != nil {
				return err
			}
		}
	}
	for _, e := range entries {
		if e.Type() == fs.ModeSymlink {
			if err := m.syncLink(filepath.Join(rel, e.Name())); err != nil {
				return err
			}
		}
	}
	// Entries gone.
	dir := m.known[rel]
	for _, old := range dir.children {
		if !slices.Contains(names, old) {
			if err := m.remove(filepath.Join(rel, old)); err != nil {
				return err
			}
		}
	}
	dir.children = names
	m.known[rel] = dir
	return nil
}

// stat is what the source holds at rel, as mirrored compares it.
func (m *mirrorTree) stat(rel string) (mirrored, error) {
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(m.src, rel), &st); err != nil {
		return mirrored{}, err
	}
	return mirrored{mode: st.Mode, uid: st.Uid, gid: st.Gid, size: st.Size, mtime: st.Mtim, ctime: st.Ctim, ino: st.Ino}, nil
}

func (m *mirrorTree) syncSubdir(rel string, n *int) error {
	now, err := m.stat(rel)
	if err != nil {
		return err
	}
	old, ok := m.known[rel]
	if ok && old.mode&unix.S_IFMT != unix.S_IFDIR {
		if err := m.remove(rel); err != nil {
			return err
		}
		ok = false
	}
	if ok && old.isKubeletDir {
		return nil
	}
	d := filepath.Join(m.dst, rel)
	if !ok {
		if err := os.Mkdir(d, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	if !ok || old.mode != now.mode || old.uid != now.uid || old.gid != now.gid {
		if err := os.Lchown(d, int(now.uid), int(now.gid)); err != nil {
			return err
		}
		if err := os.Chmod(d, fsMode(now.mode)); err != nil {
			return err
		}
	}
	now.children = old.children
	now.isKubeletDir = strings.HasPrefix(filepath.Base(rel), "..")
	m.known[rel] = now
	if err := m.syncDir(rel, n); err != nil {
		if now.isKubeletDir {
			// Copied in part: copied again whole at the next sync.
			e := m.known[rel]
			e.isKubeletDir = false
			m.known[rel] = e
		}
		return err
	}
	return nil
}

func (m *mirrorTree) syncFile(rel string) error {
	now, err := m.stat(rel)
	if err != nil {
		return err
	}
	old, ok := m.known[rel]
	if ok && old.mode == now.mode && old.uid == now.uid && old.gid == now.gid && old.size == now.size &&
		old.mtime == now.mtime && old.ctime == now.ctime && old.ino == now.ino {
		return nil
	}
	if ok && old.mode&unix.S_IFMT != unix.S_IFREG {
		if err := m.remove(rel); err != nil {
			return err
		}
		ok = false
	}
	data, err := os.ReadFile(filepath.Join(m.src, rel))
	if err != nil {
		return err
	}
	d := filepath.Join(m.dst, rel)
	w := d
	if ok {
		w = tmpName(d) // a changed file is replaced whole
	}
	if err := writeFileAs(w, data, now); err != nil {
		return err
	}
	if ok {
		if err := os.Rename(w, d); err != nil {
			os.Remove(w)
			return err
		}
	}
	m.known[rel] = now
	return nil
}

func (m *mirrorTree) syncLink(rel string) error {
	target, err := os.Readlink(filepath.Join(m.src, rel))
	if err != nil {
		return err
	}
	old, ok := m.known[rel]
	if ok && old.mode&unix.S_IFMT == unix.S_IFLNK && old.target == target {
		return nil
	}
	d := filepath.Join(m.dst, rel)
	if ok && old.mode&unix.S_IFMT == unix.S_IFDIR {
		if err := m.remove(rel); err != nil {
			return err
		}
		ok = false
	}
	if !ok {
		if err := os.Symlink(target, d); err != nil {
			return err
		}
	} else {
		tmp := tmpName(d)
		os.Remove(tmp)
		if err := os.Symlink(target, tmp); err != nil {
			return err
		}
		if err := os.Rename(tmp, d); err != nil {
			os.Remove(tmp)
			return err
		}
	}
	m.known[rel] = mirrored{mode: unix.S_IFLNK, target: target}
	return nil
}

// remove removes rel from the copy, and what the mirror knew of it and below it.
func (m *mirrorTree) remove(rel string) error {
	if err := os.RemoveAll(filepath.Join(m.dst, rel)); err != nil {
		return err
	}
	for k := range m.known {
		if k == rel || strings.HasPrefix(k, rel+"/") {
			delete(m.known, k)
		}
	}
	return nil
}

// tmpName is where a new version of d is written before it is renamed over d: ..data_tmp
// for ..data, as the kubelet names it.
func tmpName(d string) string {
	base := filepath.Base(d)
	if !strings.HasPrefix(base, "..") {
		base = ".." + base
	}
	return filepath.Join(filepath.Dir(d), base+"_tmp")
}

// writeFileAs writes a new file at p with data and st's mode and owner.
func writeFileAs(p string, data []byte, st mirrored) error {
	os.Remove(p)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chown(int(st.uid), int(st.gid))
	}
	if err == nil {
		err = f.Chmod(fsMode(st.mode))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(p)
	}
	return err
}

// fsMode is a stat mode's permission, set-user-ID, set-group-ID and sticky bits as os's mode.
func fsMode(m uint32) fs.FileMode {
	b := fs.FileMode(m & 0o777)
	if m&unix.S_ISUID != 0 {
		b |= fs.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		b |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		b |= fs.ModeSticky
	}
	return b
}
