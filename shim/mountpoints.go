package shim

import (
	"errors"
	"fmt"
	"os"
	"path"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// maxSymlinks bounds the symlinks followed resolving one path, as the kernel's MAXSYMLINKS.
const maxSymlinks = 40

// makeMountPoints creates in the root filesystem mounted at rootfs what runc creates in a
// container's root before it makes the root read-only: the mount point of each of s's mounts
// the image lacks (a directory, or an empty file for a bind of a file) and the process's
// working directory. With root.readonly the rootfs is bound read-only on the host, so runc in
// the guest cannot make them. A path that resolves inside an earlier mount (/dev/pts inside
// /dev's tmpfs) is that mount's, not the root's, and is left to crun in the guest.
//
// The image is untrusted: its symlinks are followed as runc follows them in the container,
// inside the root. Every path is resolved from a descriptor of rootfs with openat2's
// RESOLVE_IN_ROOT after its symlinks were read one by one (no more than maxSymlinks), so a
// symlink to /host-dir or ../../.. resolves inside rootfs; each entry is made with mkdirat or
// openat(O_CREAT|O_EXCL|O_NOFOLLOW) in its parent's descriptor, never through a host path.
func makeMountPoints(rootfs string, s *specs.Spec) error {
	root, err := unix.Open(rootfs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open the root filesystem: %w", err)
	}
	defer unix.Close(root)
	w := rootWalker{root: root}
	for _, m := range s.Mounts {
		file, err := isFileBind(m)
		if err != nil {
			return err
		}
		at, err := w.create(m.Destination, file)
		if err != nil {
			return fmt.Errorf("the mount point of %s: %w", m.Destination, err)
		}
		w.mounts = append(w.mounts, at)
	}
	if s.Process != nil && s.Process.Cwd != "" {
		if _, err := w.create(s.Process.Cwd, false); err != nil {
			return fmt.Errorf("the working directory %s: %w", s.Process.Cwd, err)
		}
	}
	return nil
}

// isFileBind says whether m's mount point is a file: m binds something other than a directory
// (a host path from containerd: trusted), as runc decides.
func isFileBind(m specs.Mount) (bool, error) {
	if !isBind(m) {
		return false, nil
	}
	fi, err := os.Stat(m.Source)
	if err != nil {
		return false, fmt.Errorf("bind mount at %s: %w", m.Destination, err)
	}
	return !fi.IsDir(), nil
}

// rootWalker creates paths inside the root filesystem open at root.
type rootWalker struct {
	root   int
	mounts []string // where the mounts so far resolved to: symlink-free paths in the root
}

// covered says whether p, a symlink-free path in the root, is at or under a mount so far.
func (w *rootWalker) covered(p string) bool {
	for _, m := range w.mounts {
		if m == "/" || p == m || strings.HasPrefix(p, m+"/") {
			return true
		}
	}
	return false
}

// create makes the path p (absolute in the container) in the root, as a directory or, if
// file, its last element as an empty file, where it does not exist; what exists is left as it
// is. It returns where p resolved to: a symlink-free path in the root, or, if p leads into
// a mount so far, where it enters that mount joined with what is left of p.
func (w *rootWalker) create(p string, file bool) (string, error) {
	at := "/"
	rest := strings.Split(p, "/")
	links := 0
	for len(rest) > 0 {
		if w.covered(at) {
			return path.Join(append([]string{at}, rest...)...), nil
		}
		name := rest[0]
		rest = rest[1:]
		switch name {
		case "", ".":
			continue
		case "..":
			at = path.Dir(at)
			continue
		}
		target, err := w.step(at, name, file && len(rest) == 0)
		if err != nil {
			return "", err
		}
		next := path.Join(at, name)
		switch {
		case target != "":
			if links++; links > maxSymlinks {
				return "", fmt.Errorf("%s: more than %d symlinks: %w", next, maxSymlinks, unix.ELOOP)
			}
			if path.IsAbs(target) {
				at = "/"
			}
			rest = append(strings.Split(target, "/"), rest...)
		case len(rest) > 0:
			// A directory to go on in: ENOTDIR if it is not one.
			fd, err := w.open(next)
			if err != nil {
				return "", err
			}
			unix.Close(fd)
			fallthrough
		default:
			at = next
		}
	}
	return at, nil
}

// step makes name in the directory dir (a symlink-free path in the root) if it is missing, a
// file if file, else a directory, and returns the target of name if it is a symlink.
func (w *rootWalker) step(dir, name string, file bool) (string, error) {
	fd, err := w.open(dir)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	for range 2 { // a second time if name appeared between the stat and the create
		var st unix.Stat_t
		err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		switch {
		case err == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK:
			return readlinkat(fd, name)
		case err == nil:
			return "", nil
		case !errors.Is(err, unix.ENOENT):
			return "", fmt.Errorf("%s: %w", path.Join(dir, name), err)
		}
		if file {
			var nfd int
			if nfd, err = unix.Openat(fd, name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_WRONLY|unix.O_CLOEXEC, 0o644); err == nil {
				unix.Close(nfd)
			}
		} else {
			err = unix.Mkdirat(fd, name, 0o755)
		}
		if !errors.Is(err, unix.EEXIST) {
			if err != nil {
				return "", fmt.Errorf("create %s: %w", path.Join(dir, name), err)
			}
			return "", nil
		}
	}
	return "", fmt.Errorf("create %s: %w", path.Join(dir, name), unix.EEXIST)
}

// open opens the directory p, a symlink-free path in the root: resolved inside the root
// whatever changed since, and refused if it is a symlink now.
func (w *rootWalker) open(p string) (int, error) {
	name := strings.TrimPrefix(p, "/")
	if name == "" {
		name = "."
	}
	fd, err := unix.Openat2(w.root, name, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return -1, fmt.Errorf("%s: %w", p, err)
	}
	return fd, nil
}

// readlinkat reads the symlink name in the directory fd.
func readlinkat(fd int, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(fd, name, buf)
	if err != nil {
		return "", fmt.Errorf("readlink %s: %w", name, err)
	}
	if n == len(buf) {
		return "", fmt.Errorf("readlink %s: the target is longer than %d bytes", name, len(buf)-1)
	}
	return string(buf[:n]), nil
}

func isBind(m specs.Mount) bool {
	return m.Type == "bind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
}
