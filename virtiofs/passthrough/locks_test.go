package passthrough

import (
	"os"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// lockEnv is a shared file opened once by the guest, with remote locks negotiated.
type lockEnv struct {
	*env
	node, fh uint64
	host     string // the file's host path
}

func newLockEnv(t *testing.T, flags uint64) *lockEnv {
	t.Helper()
	e := newEnv(t, Options{})
	e.fs.Init(flags)
	entry, fh := e.create(t, rootCtx, rootID, "f", 0o644)
	e.write(t, entry.NodeID, fh, 0, make([]byte, 4096))
	return &lockEnv{env: e, node: entry.NodeID, fh: fh, host: e.path("f")}
}

func lk(typ uint32, start, end uint64, pid uint32) fuse.FileLock {
	return fuse.FileLock{Type: typ, Start: start, End: end, PID: pid}
}

// setlk is SETLK by owner through handle fh.
func (e *lockEnv) setlk(fh, owner uint64, l fuse.FileLock, flags uint32) fuse.Errno {
	w, errno := e.fs.SetLk(rootCtx, e.node, &fuse.LkIn{Fh: fh, Owner: owner, Lk: l, LkFlags: flags}, false)
	if w != nil {
		panic("SETLK returned a waiter")
	}
	return errno
}

func (e *lockEnv) getlk(t *testing.T, owner uint64, l fuse.FileLock) fuse.FileLock {
	t.Helper()
	var out fuse.LkOut
	if errno := e.fs.GetLk(rootCtx, e.node, &fuse.LkIn{Fh: e.fh, Owner: owner, Lk: l}, &out); errno != 0 {
		t.Fatalf("GETLK: %v", errName(errno))
	}
	return out.Lk
}

// setlkw starts a SETLKW that must wait and returns the channel its result arrives on.
func (e *lockEnv) setlkw(t *testing.T, fh, owner uint64, l fuse.FileLock, flags uint32) (fuse.Waiter, <-chan fuse.Errno) {
	t.Helper()
	w, errno := e.fs.SetLk(rootCtx, e.node, &fuse.LkIn{Fh: fh, Owner: owner, Lk: l, LkFlags: flags}, true)
	if w == nil {
		t.Fatalf("SETLKW did not wait: %v", errName(errno))
	}
	ch := make(chan fuse.Errno, 1)
	w.Start(func(e fuse.Errno) { ch <- e })
	return w, ch
}

func waitResult(t *testing.T, ch <-chan fuse.Errno, want fuse.Errno) {
	t.Helper()
	select {
	case got := <-ch:
		wantErrno(t, "SETLKW", got, want)
	case <-time.After(5 * time.Second):
		t.Fatal("SETLKW never finished")
	}
}

func stillWaiting(t *testing.T, ch <-chan fuse.Errno) {
	t.Helper()
	select {
	case got := <-ch:
		t.Fatalf("SETLKW finished (%v) while the lock was taken", errName(got))
	case <-time.After(3 * lockRetryMax):
	}
}

// hostFile opens the shared file on the host, as another host process would.
func hostFile(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	must(t, err)
	t.Cleanup(func() { f.Close() })
	return f
}

func hostOFD(f *os.File, cmd int, typ int16, start, n int64) (unix.Flock_t, error) {
	fl := unix.Flock_t{Type: typ, Whence: unix.SEEK_SET, Start: start, Len: n}
	err := unix.FcntlFlock(f.Fd(), cmd, &fl)
	return fl, err
}

// TestPosixLockOwners: two guest processes sharing one FUSE handle are distinct owners.
func TestPosixLockOwners(t *testing.T) {
	e := newLockEnv(t, fuse.InitPosixLocks)
	fds := e.fs.Stats().Fds
	wantErrno(t, "owner 1 write-locks 0-99", e.setlk(e.fh, 1, lk(unix.F_WRLCK, 0, 99, 101), 0), 0)
	if got := e.fs.Stats().Fds; got != fds+1 {
		t.Errorf("fds after the first lock: %d, want %d (one for the owner)", got, fds+1)
	}
	wantErrno(t, "owner 2 write-locks 50-60 (same handle)", e.setlk(e.fh, 2, lk(unix.F_WRLCK, 50, 60, 102), 0), unix.EAGAIN)
	wantErrno(t, "owner 2 read-locks 100-", e.setlk(e.fh, 2, lk(unix.F_RDLCK, 100, fuse.OffsetMax, 102), 0), 0)
	wantErrno(t, "owner 1 changes its lock", e.setlk(e.fh, 1, lk(unix.F_RDLCK, 0, 49, 101), 0), 0)

	// GETLK: one's own locks never conflict; another guest owner's are reported with its pid.
	if got := e.getlk(t, 1, lk(unix.F_WRLCK, 0, 49, 0)); got.Type != unix.F_UNLCK {
		t.Errorf("GETLK of owner 1 over its own lock: %+v, want F_UNLCK", got)
	}
	got := e.getlk(t, 3, lk(unix.F_WRLCK, 0, 10, 0))
	if want := lk(unix.F_RDLCK, 0, 49, 101); got != want {
		t.Errorf("GETLK of owner 3: %+v, want %+v", got, want)
	}
	got = e.getlk(t, 1, lk(unix.F_WRLCK, 200, 300, 0))
	if want := lk(unix.F_RDLCK, 100, fuse.OffsetMax, 102); got != want {
		t.Errorf("GETLK of owner 1 over owner 2's lock: %+v, want %+v", got, want)
	}

	// Unlocking frees the range for the other owner.
	wantErrno(t, "owner 1 unlocks", e.setlk(e.fh, 1, lk(unix.F_UNLCK, 0, fuse.OffsetMax, 0), 0), 0)
	wantErrno(t, "owner 2 write-locks 50-60", e.setlk(e.fh, 2, lk(unix.F_WRLCK, 50, 60, 102), 0), 0)

	// FLUSH of owner 2 (its process closed a descriptor of the file) releases all its locks
	// and its descriptor; owner 1's stays.
	wantErrno(t, "FLUSH", e.fs.Flush(rootCtx, e.node, &fuse.FlushIn{Fh: e.fh, LockOwner: 2}), 0)
	wantErrno(t, "owner 1 write-locks everything", e.setlk(e.fh, 1, lk(unix.F_WRLCK, 0, fuse.OffsetMax, 101), 0), 0)
	if got := e.fs.Stats().Fds; got != fds+1 {
		t.Errorf("fds after FLUSH of owner 2: %d, want %d", got, fds+1)
	}
	// An owner unlocking without ever having locked costs nothing.
	wantErrno(t, "owner 9 unlocks", e.setlk(e.fh, 9, lk(unix.F_UNLCK, 0, 10, 0), 0), 0)
	wantErrno(t, "owner 9 conflicts", e.setlk(e.fh, 9, lk(unix.F_RDLCK, 0, 10, 109), 0), unix.EAGAIN)
	if got := e.fs.Stats().Fds; got != fds+1 {
		t.Errorf("fds after owner 9 failed: %d, want %d", got, fds+1)
	}
	// RELEASE does not touch POSIX locks (each close sent its FLUSH); the node's end does.
	wantErrno(t, "RELEASE", e.fs.Release(rootCtx, e.node, &fuse.ReleaseIn{Fh: e.fh}), 0)
	e.fs.Destroy()
	if got := e.fs.Stats().Fds; got != 2 {
		t.Errorf("fds after DESTROY: %d, want 2 (root and /proc/self/fd)", got)
	}
	f := hostFile(t, e.host)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
		t.Errorf("host lock after DESTROY: %v", err)
	}
}

// TestPosixLockHost: guest locks are host locks, both ways.
func TestPosixLockHost(t *testing.T) {
	e := newLockEnv(t, fuse.InitPosixLocks)
	f := hostFile(t, e.host)
	wantErrno(t, "guest write-locks 0-9", e.setlk(e.fh, 1, lk(unix.F_WRLCK, 0, 9, 101), 0), 0)
	if fl, err := hostOFD(f, unix.F_OFD_GETLK, unix.F_RDLCK, 5, 1); err != nil || fl.Type != unix.F_WRLCK || fl.Start != 0 || fl.Len != 10 {
		t.Errorf("host F_OFD_GETLK: %+v, %v; want the guest's write lock 0-9", fl, err)
	}
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_RDLCK, 0, 1); err != unix.EAGAIN {
		t.Errorf("host F_OFD_SETLK over the guest's lock: %v, want EAGAIN", err)
	}
	// A classic POSIX lock of a host process (this one) and an OFD lock of the host.
	if _, err := hostOFD(f, unix.F_SETLK, unix.F_WRLCK, 100, 10); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, "guest over a host process's lock", e.setlk(e.fh, 1, lk(unix.F_RDLCK, 105, 105, 101), 0), unix.EAGAIN)
	if got, want := e.getlk(t, 1, lk(unix.F_RDLCK, 100, 200, 0)), lk(unix.F_WRLCK, 100, 109, 0); got != want {
		t.Errorf("GETLK over a host process's lock: %+v, want %+v (no guest pid)", got, want)
	}
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 200, 1); err != nil {
		t.Fatal(err)
	}
	if got, want := e.getlk(t, 1, lk(unix.F_WRLCK, 150, 250, 0)), lk(unix.F_WRLCK, 200, 200, 0); got != want {
		t.Errorf("GETLK over a host OFD lock: %+v, want %+v (no guest pid)", got, want)
	}

	// SETLKW waits for the host to let go.
	_, ch := e.setlkw(t, e.fh, 1, lk(unix.F_WRLCK, 200, 200, 101), 0)
	stillWaiting(t, ch)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_UNLCK, 200, 1); err != nil {
		t.Fatal(err)
	}
	waitResult(t, ch, 0)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_RDLCK, 200, 1); err != unix.EAGAIN {
		t.Errorf("host lock after the guest's SETLKW: %v, want EAGAIN", err)
	}
}

// TestPosixLockWait: SETLKW waits for another owner, is cancelled, and leaves nothing behind.
func TestPosixLockWait(t *testing.T) {
	e := newLockEnv(t, fuse.InitPosixLocks)
	fds := e.fs.Stats().Fds
	wantErrno(t, "owner 1 locks", e.setlk(e.fh, 1, lk(unix.F_WRLCK, 0, 0, 101), 0), 0)
	_, granted := e.setlkw(t, e.fh, 2, lk(unix.F_WRLCK, 0, 0, 102), 0)
	w3, cancelled := e.setlkw(t, e.fh, 3, lk(unix.F_RDLCK, 0, 0, 103), 0)
	stillWaiting(t, granted)
	if got := e.fs.Stats().Fds; got != fds+3 {
		t.Errorf("fds with two owners waiting: %d, want %d", got, fds+3)
	}
	w3.Cancel()
	waitResult(t, cancelled, unix.EINTR)
	w3.Cancel() // harmless
	if got := e.fs.Stats().Fds; got != fds+2 {
		t.Errorf("fds after the cancelled wait: %d, want %d (its owner never held a lock)", got, fds+2)
	}
	wantErrno(t, "owner 1 unlocks", e.setlk(e.fh, 1, lk(unix.F_UNLCK, 0, 0, 0), 0), 0)
	waitResult(t, granted, 0)
	if got := e.getlk(t, 1, lk(unix.F_RDLCK, 0, 0, 0)); got != lk(unix.F_WRLCK, 0, 0, 102) {
		t.Errorf("GETLK after the grant: %+v, want owner 2's lock", got)
	}

	// A FLUSH of an owner that still waits releases its locks but keeps its descriptor for
	// the wait.
	wantErrno(t, "owner 2 locks 10", e.setlk(e.fh, 2, lk(unix.F_WRLCK, 10, 10, 102), 0), 0)
	wantErrno(t, "owner 4 locks 20", e.setlk(e.fh, 4, lk(unix.F_WRLCK, 20, 20, 104), 0), 0)
	_, ch := e.setlkw(t, e.fh, 2, lk(unix.F_WRLCK, 20, 20, 102), 0)
	wantErrno(t, "FLUSH of owner 2", e.fs.Flush(rootCtx, e.node, &fuse.FlushIn{Fh: e.fh, LockOwner: 2}), 0)
	wantErrno(t, "owner 1 takes owner 2's old locks", e.setlk(e.fh, 1, lk(unix.F_WRLCK, 0, 10, 101), 0), 0)
	stillWaiting(t, ch)
	wantErrno(t, "owner 4 unlocks", e.setlk(e.fh, 4, lk(unix.F_UNLCK, 20, 20, 0), 0), 0)
	waitResult(t, ch, 0)
	if got := e.getlk(t, 1, lk(unix.F_RDLCK, 20, 20, 0)); got != lk(unix.F_WRLCK, 20, 20, 102) {
		t.Errorf("GETLK after the grant: %+v, want owner 2's lock", got)
	}
}

// TestFlock: flock(2) locks belong to the open file, i.e. to the FUSE handle.
func TestFlock(t *testing.T) {
	e := newLockEnv(t, fuse.InitFlockLocks)
	fh2 := e.open(t, e.node, unix.O_RDONLY)
	whole := lk(unix.F_WRLCK, 0, fuse.OffsetMax, 0)
	wantErrno(t, "POSIX lock without posix_lock", e.setlk(e.fh, 1, whole, 0), unix.ENOSYS)
	var out fuse.LkOut
	wantErrno(t, "GETLK without posix_lock", e.fs.GetLk(rootCtx, e.node, &fuse.LkIn{Fh: e.fh, Lk: whole}, &out), unix.ENOSYS)

	wantErrno(t, "handle 1 flock EX", e.setlk(e.fh, 1, whole, fuse.LkFlock), 0)
	wantErrno(t, "handle 2 flock SH", e.setlk(fh2, 2, lk(unix.F_RDLCK, 0, fuse.OffsetMax, 0), fuse.LkFlock), unix.EAGAIN)
	f := hostFile(t, e.host)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != unix.EWOULDBLOCK {
		t.Errorf("host flock over the guest's: %v, want EWOULDBLOCK", err)
	}
	w, ch := e.setlkw(t, fh2, 2, lk(unix.F_RDLCK, 0, fuse.OffsetMax, 0), fuse.LkFlock)
	stillWaiting(t, ch)
	wantErrno(t, "handle 1 flock UN", e.setlk(e.fh, 1, lk(unix.F_UNLCK, 0, fuse.OffsetMax, 0), fuse.LkFlock), 0)
	waitResult(t, ch, 0)
	w.Cancel() // after the end: harmless
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != unix.EWOULDBLOCK {
		t.Errorf("host flock EX over the guest's shared lock: %v, want EWOULDBLOCK", err)
	}
	// RELEASE with FLOCK_UNLOCK releases at once.
	wantErrno(t, "RELEASE", e.fs.Release(rootCtx, e.node, &fuse.ReleaseIn{Fh: fh2, ReleaseFlags: fuse.ReleaseFlockUnlock, LockOwner: 2}), 0)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Errorf("host flock after RELEASE: %v", err)
	}
	_, ch = e.setlkw(t, e.fh, 1, whole, fuse.LkFlock)
	stillWaiting(t, ch)
	must(t, unix.Flock(int(f.Fd()), unix.LOCK_UN))
	waitResult(t, ch, 0)
}

func TestLockRequestsChecked(t *testing.T) {
	e := newLockEnv(t, fuse.InitPosixLocks|fuse.InitFlockLocks)
	dir := e.openDir(t, rootID)
	fds := e.fs.Stats().Fds
	var out fuse.LkOut
	for _, c := range []struct {
		name  string
		node  uint64
		in    fuse.LkIn
		want  fuse.Errno
		getlk bool
	}{
		{"bad type", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(7, 0, 0, 0)}, unix.EINVAL, false},
		{"end before start", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 10, 9, 0)}, unix.EINVAL, false},
		{"end past OFFSET_MAX", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 0, 1<<63, 0)}, unix.EINVAL, false},
		{"start past OFFSET_MAX", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 1<<63, 1<<64-1, 0)}, unix.EINVAL, false},
		{"unknown handle", e.node, fuse.LkIn{Fh: 999, Lk: lk(unix.F_RDLCK, 0, 0, 0)}, unix.EBADF, false},
		{"handle of another node", rootID, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 0, 0, 0)}, unix.EBADF, false},
		{"directory handle", rootID, fuse.LkIn{Fh: dir, Lk: lk(unix.F_RDLCK, 0, 0, 0)}, unix.EBADF, false},
		{"unknown node", 12345, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 0, 0, 0)}, unix.EBADF, false},
		{"flock of a bad type", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(9, 0, 0, 0), LkFlags: fuse.LkFlock}, unix.EINVAL, false},
		{"flock with a bad handle", e.node, fuse.LkIn{Fh: 999, Lk: lk(unix.F_RDLCK, 0, 0, 0), LkFlags: fuse.LkFlock}, unix.EBADF, false},
		{"GETLK of F_UNLCK", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_UNLCK, 0, 0, 0)}, unix.EINVAL, true},
		{"GETLK of a flock", e.node, fuse.LkIn{Fh: e.fh, Lk: lk(unix.F_RDLCK, 0, 0, 0), LkFlags: fuse.LkFlock}, unix.EINVAL, true},
		{"GETLK with a bad handle", e.node, fuse.LkIn{Fh: 999, Lk: lk(unix.F_RDLCK, 0, 0, 0)}, unix.EBADF, true},
	} {
		var got fuse.Errno
		if c.getlk {
			got = e.fs.GetLk(rootCtx, c.node, &c.in, &out)
		} else {
			for _, wait := range []bool{false, true} {
				w, errno := e.fs.SetLk(rootCtx, c.node, &c.in, wait)
				if w != nil {
					t.Fatalf("%s: a waiter", c.name)
				}
				got = errno
			}
		}
		wantErrno(t, c.name, got, c.want)
	}
	if got := e.fs.Stats().Fds; got != fds {
		t.Errorf("fds: %d, want %d: refused requests open no lock owner", got, fds)
	}
	e.fs.Init(0)
	wantErrno(t, "SETLK not negotiated", e.setlk(e.fh, 1, lk(unix.F_RDLCK, 0, 0, 0), 0), unix.ENOSYS)
	wantErrno(t, "flock not negotiated", e.setlk(e.fh, 1, lk(unix.F_RDLCK, 0, 0, 0), fuse.LkFlock), unix.ENOSYS)
}
