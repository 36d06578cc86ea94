package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The sandbox's mount namespace: where the share's mounts live (mounts/, shared/ and the
// binds), so that the host's own namespace holds none of them (see the package documentation,
// "Mount namespace").

// pinName is the file in the sandbox directory the namespace is bound onto (in the owner's
// namespace), which keeps it alive without a process in it, for an owner that adopts the
// sandbox after a restart.
const pinName = "mnt.ns"

// errMountNSClosed is the error of work given to a namespace after its close.
var errMountNSClosed = errors.New("the sandbox's mount namespace is closed")

// mountNS is a mount namespace held by a goroutine locked to an OS thread in it, which runs
// the work it is given there. The thread is never unlocked: it ends with the goroutine, at
// close, and no other goroutine ever runs in the namespace (the runtime starts new threads
// from a template thread, never from a locked one).
type mountNS struct {
	tid  int // the thread's id, for /proc/self/task/TID
	work chan func()
	quit chan struct{}
	done chan struct{} // closed when the thread has ended

	closeOnce sync.Once
}

// newMountNS makes a new mount namespace on a thread of its own, a copy of the caller's with an
// id above it (so that pin can bind it there; see unshareNewer), every mount of it made a slave
// (MS_SLAVE|MS_REC), and runs setup there. Slave, not private: what the host unmounts goes from
// the copy too, so the namespace never keeps a host file system mounted after the host let it
// go; nothing made in the namespace reaches the host.
func newMountNS(setup func() error) (*mountNS, error) {
	return startMountNS(func() error {
		// CLONE_FS: the runtime's threads share their root and working directory, and a
		// thread that does cannot change its mount namespace.
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare the thread's file system attributes: %w", err)
		}
		var cpus unix.CPUSet
		if err := unix.SchedGetaffinity(0, &cpus); err != nil {
			return fmt.Errorf("the thread's CPU affinity: %w", err)
		}
		if err := unshareNewer(&cpus); err != nil {
			return err
		}
		if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("make the mount namespace a slave of the host's: %w", err)
		}
		return setup()
	})
}

// joinMountNS takes a thread into the mount namespace bound at pin (an earlier owner's).
func joinMountNS(pin string) (*mountNS, error) {
	f, err := os.OpenFile(pin, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open the sandbox's mount namespace: %w", err)
	}
	defer f.Close()
	return startMountNS(func() error {
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare the thread's file system attributes: %w", err)
		}
		// setns checks that f is a mount namespace (EINVAL otherwise: a pin unmounted).
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("join the sandbox's mount namespace %s: %w", pin, err)
		}
		return nil
	})
}

// startMountNS starts the namespace's goroutine, which enters the namespace with enter and
// then serves its work until close. An error of enter ends it.
func startMountNS(enter func() error) (*mountNS, error) {
	ns := &mountNS{work: make(chan func()), quit: make(chan struct{}), done: make(chan struct{})}
	errc := make(chan error, 1)
	go ns.run(enter, errc, nil)
	if err := <-errc; err != nil {
		return nil, err
	}
	return ns, nil
}

// run is the namespace's goroutine. The process's main thread is never taken into the
// namespace (/proc/self, which the rest of the owner reads, follows it): on it, run starts
// itself again, which, while this goroutine holds the main thread, gets another; locked tells
// the caller that it may let the main thread go.
func (ns *mountNS) run(enter func() error, errc chan<- error, locked chan<- struct{}) {
	runtime.LockOSThread()
	if locked != nil {
		close(locked)
	}
	if unix.Gettid() == unix.Getpid() {
		next := make(chan struct{})
		go ns.run(enter, errc, next)
		<-next
		runtime.UnlockOSThread()
		return
	}
	ns.tid = unix.Gettid()
	if err := enter(); err != nil {
		errc <- err
		return // the thread, perhaps in the namespace, ends with the goroutine
	}
	errc <- nil
	defer close(ns.done)
	for {
		select {
		case f := <-ns.work:
			f()
		case <-ns.quit:
			return
		}
	}
}

// do runs f on the namespace's thread and returns its error.
func (ns *mountNS) do(f func() error) error {
	errc := make(chan error, 1)
	select {
	case ns.work <- func() { errc <- f() }:
		return <-errc
	case <-ns.done:
		return errMountNSClosed
	}
}

// close ends the namespace's thread, once the work it runs has returned. The namespace goes
// with it unless a process is in it or it is pinned.
func (ns *mountNS) close() {
	ns.closeOnce.Do(func() { close(ns.quit) })
	<-ns.done
}

// task is the namespace's thread's directory in the owner's /proc: its root, mountinfo and
// namespace files are the namespace's.
func (ns *mountNS) task() string {
	return "/proc/self/task/" + strconv.Itoa(ns.tid)
}

// path is the namespace's file in the owner's /proc.
func (ns *mountNS) path() string {
	return ns.task() + "/ns/mnt"
}

// pin binds the namespace onto dir/mnt.ns, in the caller's namespace, so that it outlives the
// owner's thread. The file is first bound onto itself and made private: the kernel refuses to
// propagate a mount namespace's file (a bind onto a shared mount, as /run is on a systemd host,
// fails with EINVAL), and nothing of the pin then reaches another namespace. That first bind
// does reach this namespace, a slave, when dir's mount is shared: its copy is unmounted there,
// where it would only hold the file. The namespace's id is above the caller's (unshareNewer),
// which the kernel requires of a namespace bound into another (no loop).
func (ns *mountNS) pin(dir string) error {
	p := filepath.Join(dir, pinName)
	f, err := os.OpenFile(p, os.O_RDONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("pin the mount namespace: %w", err)
	}
	f.Close()
	steps := []struct {
		what           string
		source, target string
		flags          uintptr
	}{
		{"bind the pin onto itself", p, p, unix.MS_BIND},
		{"make the pin private", "", p, unix.MS_PRIVATE},
		{"bind the mount namespace onto the pin", ns.path(), p, unix.MS_BIND},
	}
	for _, s := range steps {
		if err := unix.Mount(s.source, s.target, "", s.flags, ""); err != nil {
			return fmt.Errorf("%s (%s): %w", s.what, p, err)
		}
	}
	if err := ns.do(func() error { return unmountPath(p) }); err != nil {
		return fmt.Errorf("in the sandbox's mount namespace: %w", err)
	}
	return nil
}

// unshareNewer takes the calling thread (locked, CLONE_FS unshared) into a new mount namespace,
// a copy of its own (the owner's), whose id is above the owner's: the kernel binds a
// namespace's file only into a namespace with a lower id (mnt_ns_loop), as pin does. Linux
// 6.18 numbers namespaces from per-CPU batches of ids, so one made later on another CPU can
// have the lower id (pin then fails with EINVAL); on the CPU where the owner's was made, a
// later one always has a higher. If the first namespace is not newer, unshareNewer makes
// another on each CPU of cpus in turn, the thread bound to it, until one is; the thread's
// affinity is then restored (the servers it starts inherit it). Kernels that cannot say a
// namespace's id (no NS_GET_MNTNS_ID) number mount namespaces from one counter, in order.
func unshareNewer(cpus *unix.CPUSet) error {
	owner, err := mountNSID()
	if err != nil {
		return err
	}
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare a mount namespace: %w", err)
	}
	if owner == 0 {
		return nil
	}
	id, err := mountNSID()
	if err != nil || id > owner {
		return err
	}
	var saved unix.CPUSet
	if err := unix.SchedGetaffinity(0, &saved); err != nil {
		return fmt.Errorf("the thread's CPU affinity: %w", err)
	}
	defer unix.SchedSetaffinity(0, &saved)
	first := id
	for cpu := range len(cpus) * 64 {
		if !cpus.IsSet(cpu) {
			continue
		}
		var one unix.CPUSet
		one.Set(cpu)
		if unix.SchedSetaffinity(0, &one) != nil {
			continue // offline, or outside the thread's cpuset
		}
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("unshare a mount namespace: %w", err)
		}
		if id, err = mountNSID(); err != nil || id > owner {
			return err
		}
	}
	return fmt.Errorf("no CPU made a mount namespace newer than the owner's (id %d; the first made had %d, the last %d), which the kernel requires to pin it", owner, first, id)
}

// mountNSID is the id of the calling thread's mount namespace, 0 if the kernel cannot say.
func mountNSID() (uint64, error) {
	f, err := os.Open("/proc/thread-self/ns/mnt")
	if err != nil {
		return 0, fmt.Errorf("the thread's mount namespace: %w", err)
	}
	defer f.Close()
	var id uint64
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.NS_GET_MNTNS_ID, uintptr(unsafe.Pointer(&id))); e != 0 {
		if e == unix.ENOTTY {
			return 0, nil
		}
		return 0, fmt.Errorf("the id of the thread's mount namespace: %w", e)
	}
	return id, nil
}
