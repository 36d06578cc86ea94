package agent

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// What init does before the agent serves, and after Shutdown. Only PID 1 calls these (Main);
// each takes its paths so that tests can run them on a scratch tree where that makes sense.

// mountPoint is one file system init mounts.
type mountPoint struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

// systemMounts are mounted in this order. /dev/shm is the pod's under the Sandbox API (the
// shim binds it into each container): 64 MiB, the size containerd gives a pod's /dev/shm.
// /dev/mqueue is the guest's IPC namespace's, which a user-namespaced container sharing it
// cannot mount itself: the shim binds it instead (shim.AdaptSpec).
var systemMounts = []mountPoint{
	{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
	{"shm", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777,size=64m"},
	{"mqueue", "/dev/mqueue", "mqueue", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
	{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
	{"cgroup2", DefaultCgroupRoot, "cgroup2", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
}

// LeaveInitramfs makes the root a bind mount of the initramfs instead of the initramfs
// itself: pivot_root(2) refuses to move a process whose root is the initial rootfs, and runc
// pivots into every container's root. The files are the same; only the mount differs. A root
// the kernel mounted itself (the image's erofs, root=) is a mount already: nothing is done.
func LeaveInitramfs() error {
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err != nil {
		return fmt.Errorf("statfs /: %w", err)
	}
	if st.Type != unix.RAMFS_MAGIC && st.Type != unix.TMPFS_MAGIC {
		return nil
	}
	const tmp = "/.kvfs-root"
	if err := os.Mkdir(tmp, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	steps := []struct {
		what string
		do   func() error
	}{
		{"bind / on " + tmp, func() error { return unix.Mount("/", tmp, "", unix.MS_BIND|unix.MS_REC, "") }},
		{"chdir " + tmp, func() error { return unix.Chdir(tmp) }},
		{"move " + tmp + " to /", func() error { return unix.Mount(".", "/", "", unix.MS_MOVE, "") }},
		{"chroot .", func() error { return unix.Chroot(".") }},
		{"chdir /", func() error { return unix.Chdir("/") }},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			return fmt.Errorf("leaving the initramfs: %s: %w", s.what, err)
		}
	}
	return nil
}

// MountSystem mounts /proc, /sys, /dev, /dev/pts, /dev/shm, /dev/mqueue, /run, /tmp and the
// cgroup2 hierarchy, makes /dev/ptmx the devpts instance's, makes the cgroup of the
// containers (agent.ContainersCgroup) and enables every cgroup controller for their groups.
func MountSystem() error {
	for _, m := range systemMounts {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data); err != nil && err != unix.EBUSY {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.target, err)
		}
	}
	links := [][2]string{{"pts/ptmx", "/dev/ptmx"}, {"/proc/self/fd", "/dev/fd"},
		{"/proc/self/fd/0", "/dev/stdin"}, {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"}}
	for _, l := range links {
		if err := os.Remove(l[1]); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if err := os.Symlink(l[0], l[1]); err != nil {
			return err
		}
	}
	if err := EnableControllers(DefaultCgroupRoot); err != nil {
		return err
	}
	pod := filepath.Join(DefaultCgroupRoot, apiv1.ContainersCgroup)
	if err := os.Mkdir(pod, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("making the containers' cgroup: %w", err)
	}
	return EnableControllers(pod)
}

// EnableControllers writes every controller of the cgroup at dir to its subtree_control.
func EnableControllers(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	if err != nil {
		return err
	}
	var enable []string
	for _, c := range strings.Fields(string(b)) {
		enable = append(enable, "+"+c)
	}
	if len(enable) == 0 {
		return nil
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.subtree_control"), []byte(strings.Join(enable, " ")), 0); err != nil {
		return fmt.Errorf("enabling cgroup controllers %v: %w", enable, err)
	}
	return nil
}

// LoadModules loads the modules listed in list (one path a line, relative to moduleDir; blank
// lines and # comments skipped), in order, with finit_module. A module already loaded is
// fine.
func LoadModules(list, moduleDir string) error {
	f, err := os.Open(list)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if filepath.IsAbs(line) || strings.Contains("/"+line+"/", "/../") {
			return fmt.Errorf("%s:%d: %q is not a path below %s", list, n, line, moduleDir)
		}
		if err := loadModule(filepath.Join(moduleDir, line)); err != nil {
			return fmt.Errorf("%s:%d: %w", list, n, err)
		}
	}
	return sc.Err()
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && err != unix.EEXIST {
		return fmt.Errorf("finit_module %s: %w", path, err)
	}
	return nil
}

// LoopbackUp brings the loopback interface up: the containers share the VM's network
// namespace (the shim drops theirs), and programs expect localhost to answer.
func LoopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo: SIOCGIFFLAGS: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo: SIOCSIFFLAGS: %w", err)
	}
	return nil
}

// BootTime is the guest's CLOCK_BOOTTIME: the time since the kernel started, suspends
// included (0 if the clock cannot be read).
func BootTime() time.Duration {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts) != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// KernelRelease answers uname -r.
func KernelRelease() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

// MountShare mounts the virtio-fs tag at dir: nodev, not nosuid. The containers' roots and
// volumes are submounts of it, which take its flags: a set-user-ID file in an image raises
// privileges as it does under runc (a container's no_new_privs is runc's to set), while a
// device node in the share never opens one of the guest's devices (each container's /dev is
// runc's).
func MountShare(tag, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(tag, dir, "virtiofs", unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount -t virtiofs %s %s: %w", tag, dir, err)
	}
	return nil
}

// PowerOff syncs, unmounts the share and powers the machine off. It returns only on failure.
func PowerOff(share string) error {
	unix.Sync()
	if err := unix.Unmount(share, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
		fmt.Fprintf(os.Stderr, "kvfs-agent: unmounting %s: %v\n", share, err)
	}
	unix.Sync()
	return unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
}
