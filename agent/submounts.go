package agent

import (
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// The host's mounts inside the share (a container's root file system, its volumes) reach the
// guest as virtio-fs submounts: each a superblock of its own, mounted where a path walk first
// crosses it, in the mount namespace of whoever walked. runc walks into a container's from
// the container's new namespace, so left alone that namespace holds a submount's only mount,
// and the exit of the container's last process unmounts it and tears its superblock down.
// Debian's 6.1 guest kernel can do that with one of the superblock's inodes still busy (held,
// we believe, by an asynchronous request the exit left in flight: a read-ahead, or the RELEASE
// it delays), and stops with "VFS: Busy inodes after unmount" (a BUG under
// CONFIG_BUG_ON_DATA_CORRUPTION): the exiting process never finishes, its container never
// reports the exit (TestCRIPod saw it in CI). In a guest of 2 vCPUs, a loop of mount
// namespaces that each read and write a file on a submount and exit stopped the kernel within
// 2 to 36 rounds in every run (docs/measurements/reliability.md); with the parent namespace
// holding the submount, and unmounting it after each child had exited, 100 rounds ran clean, and
// 150 with the parent holding it throughout.
//
// submounts is the agent's cure: before runc runs, the agent walks into the container's
// submounts itself, so that its own namespace holds them; it unmounts them when the last
// container using them is deleted, after their processes have exited. The walk covers the
// mount points on the way to the container's root and bind sources, and those the host names
// below them (CreateContainerRequest.submounts: its mounts inside a volume when the container
// was created). A mount the host makes in a volume later, which only the container walks
// into, is not covered.
//
// Holding them also gives the container's binds the host's flags: a bind carries the mounts
// below its source that exist when it is made, each with its own flags, while a submount
// first reached through the container's bind is mounted with that bind's flags. Without the
// walk, a volume bound read-only but not recursively (runc's "ro") would make a read-write
// tmpfs inside it read-only in the container; with it, only the bind's own mount is, as
// under runc on a host.

// submounts pins the share's submounts that containers use in the agent's mount namespace.
// mu is a leaf, taken while a container's op is held.
type submounts struct {
	root string // the share; only paths below it are walked
	log  *logrus.Entry

	mu   sync.Mutex
	held map[string]int // guarded by mu: a mount point below root -> the containers using it
}

func newSubmounts(root string, log *logrus.Entry) *submounts {
	return &submounts{root: filepath.Clean(root), log: log, held: make(map[string]int)}
}

// pin walks into the directories of spec's root and bind sources below the share, and into
// the host's mount points below them (points), mounting the submounts on their way in the
// agent's namespace, and returns the mount points it now holds for the container. Pinning is
// not a check of the spec: a path it cannot walk (gone, a symlink, not a directory) is left
// for runc to judge.
func (m *submounts) pin(spec *specs.Spec, below []string) []string {
	dirs := append([]string{spec.Root.Path}, below...)
	for _, mnt := range spec.Mounts {
		if mnt.Type == "bind" || slices.Contains(mnt.Options, "bind") || slices.Contains(mnt.Options, "rbind") {
			dirs = append(dirs, mnt.Source)
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var points []string
	for _, dir := range dirs {
		dir = filepath.Clean(dir)
		if !strings.HasPrefix(dir, m.root+"/") {
			continue
		}
		for _, p := range m.walk(dir) {
			if !slices.Contains(points, p) {
				points = append(points, p)
				m.held[p]++
			}
		}
	}
	return points
}

// walk enters dir (or, if it is not a directory, its parent) and returns the mount points
// from it up to the share, exclusive. Called with mu held.
func (m *submounts) walk(dir string) []string {
	how := unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_SYMLINKS}
	fd, err := unix.Openat2(unix.AT_FDCWD, dir, &how)
	if errors.Is(err, unix.ENOTDIR) {
		dir = filepath.Dir(dir)
		fd, err = unix.Openat2(unix.AT_FDCWD, dir, &how)
	}
	if err != nil {
		m.log.WithError(err).WithField("dir", dir).Debug("not pinning the submounts of a path")
		return nil
	}
	unix.Close(fd)
	var points []string
	for d := dir; d != m.root; d = filepath.Dir(d) {
		id, err := mountID(d)
		if err != nil {
			return points
		}
		up, err := mountID(filepath.Dir(d))
		if err != nil {
			return points
		}
		if id != up {
			points = append(points, d)
		}
	}
	return points
}

func mountID(path string) (uint64, error) {
	var st unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_MNT_ID, &st)
	return st.Mnt_id, err
}

// release lets go of the mount points pin returned: those no other container holds are
// unmounted from the agent's namespace, the deepest first.
func (m *submounts) release(points []string) {
	points = slices.Clone(points)
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range points {
		m.held[p]--
		if m.held[p] > 0 {
			continue
		}
		delete(m.held, p)
		// An ancestor is held at least as long (pin holds every mount point on the way),
		// so this detaches p alone. EINVAL: p is no longer a mount point.
		if err := unix.Unmount(p, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil && err != unix.EINVAL {
			m.log.WithError(err).WithField("mountpoint", p).Warn("unmounting a container's submount")
		}
	}
}
