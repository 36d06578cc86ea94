package sandbox

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Names inside a sandbox directory.
const (
	mountsName    = "mounts" // where the owner binds root filesystems and volumes (Bind)
	sharedName    = "shared" // read-only slave bind of mounts/: what the server exports
	socketName    = "vhost-fs.sock"
	stateName     = "state.json"
	lockName      = "owner.lock"
	consoleName   = "console.log" // the guest's console, sanitized; console.log.1 the MiB before
	qemuLogName   = "qemu.log"    // QEMU's stdout and stderr, sanitized; qemu.log.1 before
	serverLogName = "server.log"
	channelName   = "server.sock" // the confined server's channel (no longer than socketName)
	agentSockName = "agent.sock"  // the agent's virtio-serial port: QEMU listens, the shim connects
)

// ControlSocketName is the control API socket a sandbox's owner serves in the sandbox
// directory (BASE/<id>/control.sock), where kvfsctl finds it without being told.
const ControlSocketName = "control.sock"

// Directory modes. Only root (the owner, the server, QEMU as root) looks inside, but for
// mounts/, the share's root in the guest, which others may cross (not list): the root of a
// user-namespaced container, an unprivileged guest uid, crosses it to its root file system
// and volumes, as runc's crosses its bundle's directories (containerd makes them 0711). On
// the host the sandbox and base directories keep everyone else out.
const (
	sandboxDirMode = 0o750
	shareRootMode  = 0o751
	mountPointMode = 0o750
	sharedDirMode  = 0o700
	baseDirMode    = 0o700
)

// unmountFlags never follow a symlink in the last component and detach a busy mount (its
// users keep what they have open; nothing new can reach it).
const unmountFlags = unix.MNT_DETACH | unix.UMOUNT_NOFOLLOW

// maxStackedMounts bounds the unmount loop on one mount point.
const maxStackedMounts = 16

// setupMounts makes mounts/ a shared mount point (a bind onto itself), then shared/ a
// read-only slave bind of it: every mount made later under mounts/ propagates to shared/, and
// nothing mounted under shared/ propagates back. Binding mounts/ onto itself makes this
// independent of the host's propagation (on a host whose / is private, as in many containers,
// a plain directory would propagate nothing).
func setupMounts(dir string) error {
	mounts := filepath.Join(dir, mountsName)
	shared := filepath.Join(dir, sharedName)
	steps := []struct {
		what                   string
		source, target, fstype string
		flags                  uintptr
	}{
		{"bind mounts/ onto itself", mounts, mounts, "", unix.MS_BIND},
		{"make mounts/ shared", "", mounts, "", unix.MS_SHARED},
		{"bind mounts/ to shared/", mounts, shared, "", unix.MS_BIND},
		{"make shared/ read-only", "", shared, "", unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY},
		{"make shared/ a slave", "", shared, "", unix.MS_SLAVE},
	}
	for _, s := range steps {
		if err := unix.Mount(s.source, s.target, s.fstype, s.flags, ""); err != nil {
			return fmt.Errorf("%s (%s): %w", s.what, s.target, err)
		}
	}
	return nil
}

// teardown undoes a sandbox directory: in the sandbox's mount namespace ns, it unmounts
// shared/ and mounts/ (each with everything below it) and checks that nothing under dir is
// mounted there any more, then ends ns's thread; in the caller's namespace, it unmounts the
// pin (the namespace then goes with the last process in it) and checks the same, and removes
// dir without following symlinks or crossing into another file system. It refuses to work on
// a symlink anywhere it looks. ns is nil where no thread of this process holds the namespace:
// one whose owner is gone (Recover, Cleanup) is not joined but let go; a Create that failed
// before it made one has none. A directory that does not exist is not an error.
func teardown(dir string, ns *mountNS) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		return fmt.Errorf("refusing to tear down %s: a %s, not a directory", dir, fileKind(fi.Mode()))
	}
	if ns != nil {
		err := ns.do(func() error {
			if err := unmountAll(dir); err != nil {
				return err
			}
			return checkUnmounted(dir)
		})
		ns.close()
		if err != nil {
			return fmt.Errorf("in the sandbox's mount namespace: %w", err)
		}
	}
	if err := unmountPath(filepath.Join(dir, pinName)); err != nil {
		return err
	}
	// A sandbox made before the sandboxes had namespaces of their own has its mounts here.
	if err := unmountAll(dir); err != nil {
		return err
	}
	if err := checkUnmounted(dir); err != nil {
		return err
	}
	return removeTree(dir)
}

// checkUnmounted fails if anything at or below dir is a mount point.
func checkUnmounted(dir string) error {
	under, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	if len(under) > 0 {
		return fmt.Errorf("not removing %s: still mounted under it: %s", dir, strings.Join(under, ", "))
	}
	return nil
}

// unmountAll unmounts what a sandbox mounts inside dir: shared/ first (the server's view),
// then mounts/. MNT_DETACH takes the submounts along.
func unmountAll(dir string) error {
	var errs []error
	if err := unmountPath(filepath.Join(dir, sharedName)); err != nil {
		errs = append(errs, err)
	}
	if err := unmountPath(filepath.Join(dir, mountsName)); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// unmountPath unmounts every mount stacked on path. It refuses a symlink (Lstat, then
// UMOUNT_NOFOLLOW for what changes in between) and does nothing if path does not exist or is
// not a mount point.
func unmountPath(path string) error {
	for range maxStackedMounts {
		fi, err := os.Lstat(path)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return fmt.Errorf("refusing to unmount %s: it is a symlink", path)
		}
		mounted, err := isMountPoint(path)
		if err != nil || !mounted {
			return err
		}
		if err := unix.Unmount(path, unmountFlags); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %w", path, err)
		}
	}
	return fmt.Errorf("unmount %s: still mounted after %d unmounts", path, maxStackedMounts)
}

// mountInfo returns the mount points of the calling thread's mount namespace, in mount order:
// on a sandbox's thread (mountNS.do), the sandbox's.
func mountInfo() ([]string, error) {
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		// id parent major:minor root mount-point options ...
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		points = append(points, unescapeMountInfo(fields[4]))
	}
	return points, sc.Err()
}

// unescapeMountInfo decodes the octal escapes (\040 for a space, ...) of mountinfo fields.
func unescapeMountInfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// mountsBelow returns the mount points of the calling thread's mount namespace strictly below
// dir, relative to it, in mount order (a parent before its children).
func mountsBelow(dir string) ([]string, error) {
	under, err := mountsUnder(dir)
	if err != nil {
		return nil, err
	}
	var below []string
	for _, p := range under {
		if rel, ok := strings.CutPrefix(p, dir+"/"); ok && !slices.Contains(below, rel) {
			below = append(below, rel)
		}
	}
	return below, nil
}

func isMountPoint(path string) (bool, error) {
	points, err := mountInfo()
	if err != nil {
		return false, err
	}
	for _, p := range points {
		if p == path {
			return true, nil
		}
	}
	return false, nil
}

// mountsUnder returns the mount points at or below dir.
func mountsUnder(dir string) ([]string, error) {
	points, err := mountInfo()
	if err != nil {
		return nil, err
	}
	var under []string
	for _, p := range points {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			under = append(under, p)
		}
	}
	return under, nil
}

// maxRemoveDepth bounds the recursion of removeTree.
const maxRemoveDepth = 64

// removeTree removes dir and everything in it. It works on file descriptors opened with
// O_NOFOLLOW, so a symlink is removed, never followed, and it refuses to descend into a
// directory on another device (a mount it did not expect): then nothing more is removed there.
func removeTree(dir string) error {
	parent, name := filepath.Split(dir)
	pfd, err := unix.Open(parent, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", parent, err)
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstatat(pfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("refusing to remove %s: not a directory", dir)
	}
	if err := removeContents(pfd, name, dir, st.Dev, 0); err != nil {
		return err
	}
	if err := unix.Unlinkat(pfd, name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// removeContents empties the directory name in pfd (shown as path in errors), which must be on
// device dev.
func removeContents(pfd int, name, path string, dev uint64, depth int) error {
	if depth > maxRemoveDepth {
		return fmt.Errorf("refusing to remove %s: nested deeper than %d", path, maxRemoveDepth)
	}
	fd, err := unix.Openat(pfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	d := os.NewFile(uintptr(fd), path)
	defer d.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if st.Dev != dev {
		return fmt.Errorf("refusing to remove %s: it is on another file system (a mount point?)", path)
	}
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	var errs []error
	for _, n := range names {
		child := filepath.Join(path, n)
		var cst unix.Stat_t
		if err := unix.Fstatat(fd, n, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("stat %s: %w", child, err))
			}
			continue
		}
		if cst.Mode&unix.S_IFMT == unix.S_IFDIR {
			if err := removeContents(fd, n, child, dev, depth+1); err != nil {
				errs = append(errs, err)
				continue
			}
			if err := unix.Unlinkat(fd, n, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("remove %s: %w", child, err))
			}
			continue
		}
		if err := unix.Unlinkat(fd, n, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("remove %s: %w", child, err))
		}
	}
	return errors.Join(errs...)
}

// checkName accepts a single path component for Bind.
func checkName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("invalid name %q", name)
	case len(name) > 255:
		return fmt.Errorf("name %q is longer than 255 bytes", name)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("name %q contains '/' or NUL: want a single path component", name)
	}
	return nil
}

// bindMount binds src at the new mount point name inside the directory mountsDir, as flags
// say (see BindFlags). The bind is made on a detached copy of src's mount (open_tree), made
// private (mounts later made under src stay out of the sandbox) or, with BindFollowHost, a
// slave of src's, and read-only as asked, before it is attached in mountsDir (move_mount):
// nothing is reachable before it is finished, and the copy propagated to shared/ is a copy
// of the finished mount, flags included. Attached under the shared mounts/, the bind is in a
// peer group of its own with that copy, a slave; it is then made private, everything under
// it too, unless it follows the host: then what the host mounts under src reaches the bind,
// and from it the copy in shared/.
//
// src is opened and copied in the caller's mount namespace, where the owner's paths mean what
// they say; attach runs the attaching (the mount point, move_mount, the private remount) in
// the namespace of mountsDir's mounts, the sandbox's (mountNS.do). A copy is bound to no
// namespace until it is attached.
//
// src is opened once, without following a symlink at its end, and bound from that descriptor:
// what is checked is what is bound, whatever the path names meanwhile, and a symlink as the
// source (a pod's volume pointing elsewhere on the host) is refused rather than followed.
// Symlinks inside a bound directory are the guest's to read as links: the server never
// follows them on the host.
func bindMount(src, mountsDir, name string, flags BindFlags, userns int, attach func(func() error) error) error {
	if err := checkName(name); err != nil {
		return err
	}
	if bad := flags &^ bindFlagsAll; bad != 0 {
		return fmt.Errorf("bind %s: unknown flags %#x", src, uint(bad))
	}
	fd, err := unix.Open(src, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("bind source %s: %w", src, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("bind source %s: %w", src, err)
	}
	fi := statMode(st.Mode)
	switch {
	case fi.Type() == fs.ModeSymlink:
		return fmt.Errorf("bind source %s is a symlink: name the file or directory it points to", src)
	case !fi.IsDir() && !fi.IsRegular():
		return fmt.Errorf("bind source %s is a %s: want a directory or a regular file", src, fileKind(fi))
	}
	tree, err := cloneMount(fd, flags, userns)
	if err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	defer unix.Close(tree)
	return attach(func() error {
		target, err := makeMountPoint(mountsDir, name, fi.IsDir())
		if err != nil {
			return err
		}
		if err := unix.MoveMount(tree, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			removeMountPoint(mountsDir, name)
			return fmt.Errorf("bind %s to %s: %w", src, target, err)
		}
		if flags&BindFollowHost != 0 {
			return nil
		}
		if err := unix.Mount("", target, "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
			_ = unmountPath(target)
			removeMountPoint(mountsDir, name)
			return fmt.Errorf("make %s private: %w", target, err)
		}
		return nil
	})
}

// unbindMount undoes bindMount of name in the sandbox directory dir.
func unbindMount(dir, name string) error {
	mounts := filepath.Join(dir, mountsName)
	if err := unmountPath(filepath.Join(mounts, name)); err != nil {
		return err
	}
	// The unmount propagates to shared/; make sure.
	if err := unmountPath(filepath.Join(dir, sharedName, name)); err != nil {
		return err
	}
	removeMountPoint(mounts, name)
	return nil
}

// cloneMount returns a detached copy of the mount fd is in, rooted at fd, with the mounts
// under it if flags has BindRecursive: every mount private (a slave of its source with
// BindFollowHost), the top one read-only if flags has BindReadOnly, every one if
// BindRecursiveReadOnly, the top one idmapped by the user namespace userns if it is not -1,
// every one with BindIDMapRecursive. mount_setattr changes only the flags it names: a
// source's nosuid, nodev or noexec stays.
func cloneMount(fd int, flags BindFlags, userns int) (tree int, err error) {
	how := unix.OPEN_TREE_CLONE | unix.OPEN_TREE_CLOEXEC | unix.AT_EMPTY_PATH
	if flags&BindRecursive != 0 {
		how |= unix.AT_RECURSIVE
	}
	tree, err = unix.OpenTree(fd, "", uint(how))
	if err != nil {
		return -1, fmt.Errorf("open_tree: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(tree)
		}
	}()
	all := unix.MountAttr{Propagation: unix.MS_PRIVATE}
	if flags&BindFollowHost != 0 {
		all.Propagation = unix.MS_SLAVE
	}
	if flags&BindRecursiveReadOnly != 0 {
		all.Attr_set = unix.MOUNT_ATTR_RDONLY
	}
	if err := setMountAttr(tree, unix.AT_RECURSIVE, &all); err != nil {
		return -1, err
	}
	if flags&(BindReadOnly|BindRecursiveReadOnly) == BindReadOnly {
		if err := setMountAttr(tree, 0, &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}); err != nil {
			return -1, err
		}
	}
	if userns >= 0 {
		var recursive uint
		if flags&BindIDMapRecursive != 0 {
			recursive = unix.AT_RECURSIVE
		}
		if err := setMountAttr(tree, recursive, &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns)}); err != nil {
			return -1, fmt.Errorf("idmapped: %w", err)
		}
	}
	return tree, nil
}

// setMountAttr applies attr to the mount tree (and, with AT_RECURSIVE in flags, to every
// mount below it).
func setMountAttr(tree int, flags uint, attr *unix.MountAttr) error {
	err := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH|flags, attr)
	if errors.Is(err, unix.ENOSYS) {
		return fmt.Errorf("mount_setattr: %w (binds need Linux 5.12 or later)", err)
	}
	if err != nil {
		return fmt.Errorf("mount_setattr: %w", err)
	}
	return nil
}

// makeMountPoint creates name in dir as an empty directory or file, failing if anything is
// already there (a symlink included), and returns its path.
func makeMountPoint(dir, name string, isDir bool) (string, error) {
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(dfd)
	path := filepath.Join(dir, name)
	if isDir {
		if err := unix.Mkdirat(dfd, name, mountPointMode); err != nil {
			return "", fmt.Errorf("create mount point %s: %w", path, err)
		}
		return path, nil
	}
	fd, err := unix.Openat(dfd, name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_WRONLY|unix.O_CLOEXEC, 0o640)
	if err != nil {
		return "", fmt.Errorf("create mount point %s: %w", path, err)
	}
	unix.Close(fd)
	return path, nil
}

// removeMountPoint removes the empty directory or file name in dir; best effort.
func removeMountPoint(dir, name string) {
	dfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(dfd)
	if err := unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR); errors.Is(err, unix.ENOTDIR) {
		_ = unix.Unlinkat(dfd, name, 0)
	}
}

// statMode is the fs.FileMode of a stat(2) mode: its type and permission bits.
func statMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		mode |= fs.ModeDir
	case unix.S_IFLNK:
		mode |= fs.ModeSymlink
	case unix.S_IFSOCK:
		mode |= fs.ModeSocket
	case unix.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case unix.S_IFREG:
	default:
		mode |= fs.ModeDevice
	}
	return mode
}

func fileKind(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "regular file"
	case fs.ModeDir:
		return "directory"
	case fs.ModeSymlink:
		return "symlink"
	case fs.ModeSocket:
		return "socket"
	case fs.ModeNamedPipe:
		return "named pipe"
	}
	return "special file"
}
