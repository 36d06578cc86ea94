package sandbox

import (
	"os"
	"path/filepath"
)

// The sandbox's binds: the host's files the shim puts in the share (a container's root, its
// volumes), each a mount at MountsDir()/name in the sandbox's mount namespace (mountNS; the
// host's holds none of them), and their removal.

// BindFlags say how Bind binds its source. The zero value is a read-write bind of the
// source's own mount: the mounts under the source are not in the bind.
type BindFlags uint

const (
	// BindRecursive brings the mounts under the source along (an rbind).
	BindRecursive BindFlags = 1 << iota
	// BindReadOnly makes the bind's own mount read-only, as runc makes a mount with the OCI
	// option "ro": the mounts under it (BindRecursive) keep their flags.
	BindReadOnly
	// BindRecursiveReadOnly makes every mount of the bind read-only (the OCI option "rro").
	BindRecursiveReadOnly
	// BindFollowHost makes the bind a slave of its source's mount: mounts the host makes
	// under the source later appear in the bind too (the OCI options "rslave" and
	// "rshared": Kubernetes' HostToContainer and Bidirectional propagation), if the source's
	// mount is shared or a slave itself. Nothing goes back to the host.
	BindFollowHost
	// BindIDMapRecursive makes every mount of a BindIDMapped bind idmapped (the OCI option
	// "ridmap"), not only its own.
	BindIDMapRecursive

	bindFlagsAll = BindRecursive | BindReadOnly | BindRecursiveReadOnly | BindFollowHost | BindIDMapRecursive
)

// Bind bind-mounts src (a directory or a regular file) at MountsDir()/name, name being a
// single path component, as flags say; it appears in the guest as /name in the share. What
// is read-only on the host is read-only to the guest whatever the guest does: the server's
// writes there fail with EROFS. Mounts made under src later do not appear, unless flags has
// BindFollowHost. Bind needs Linux 5.12 (open_tree, move_mount, mount_setattr).
func (s *Sandbox) Bind(src, name string, flags BindFlags) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return bindMount(src, s.MountsDir(), name, flags, -1, s.mnt.do)
}

// BindIDMapped is Bind through an idmapped mount (MOUNT_ATTR_IDMAP): the owners of the
// files below src appear, to the server and so to the guest, as userns (an open user
// namespace) maps them, a file of uid U as the uid userns maps U to; files the server creates
// there as uid V land owned by the uid that userns maps to V. It is what runc makes of an
// OCI mount with uidMappings and gidMappings, on the host's side of the share. The bind's own
// mount is idmapped, every one of it with BindIDMapRecursive; each must be of a filesystem
// that supports idmapped mounts. userns is not kept.
func (s *Sandbox) BindIDMapped(src, name string, flags BindFlags, userns *os.File) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return bindMount(src, s.MountsDir(), name, flags, int(userns.Fd()), s.mnt.do)
}

// Submounts returns the mount points below the bind name (Bind with BindRecursive carries
// the mounts under its source), relative to it, parents before children.
func (s *Sandbox) Submounts(name string) ([]string, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	var below []string
	err := s.mnt.do(func() (err error) {
		below, err = mountsBelow(filepath.Join(s.MountsDir(), name))
		return err
	})
	return below, err
}

// Unbind undoes Bind.
func (s *Sandbox) Unbind(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return s.mnt.do(func() error { return unbindMount(s.dir, name) })
}
