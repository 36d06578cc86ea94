package virtiofs_test

// Remote locks (-o posix_lock, -o flock) through the in-repo front-end: kvfsd on its real
// socket, requests in guest memory on the virtqueues.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

const lockTimeout = 10 * time.Second

// lockRig is a served share holding the file "f", open once in the guest.
type lockRig struct {
	s        *virtiofs.Server
	done     <-chan error
	fe       *frontend.Frontend
	c        *fuseclient.Client
	granted  uint64 // INIT flags
	node, fh uint64
	host     string // the file on the host
}

func newLockRig(t *testing.T, cfg virtiofs.Config) *lockRig {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	cfg.SharedDir = shareDir(t)
	host := filepath.Join(cfg.SharedDir, "f")
	if err := os.WriteFile(host, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	sock, s, done := startServer(t, cfg)
	fe, c := dial(t, sock)
	t.Cleanup(func() { fe.Close() })
	r := &lockRig{s: s, done: done, fe: fe, c: c, host: host}
	ctx, cancel := context.WithTimeout(context.Background(), lockTimeout)
	defer cancel()
	out, err := c.Init(ctx, fuseclient.LinuxInitFlags) // again, to see what was granted
	if err != nil {
		t.Fatal(err)
	}
	r.granted = uint64(out.Flags) | uint64(out.Flags2)<<32
	e, err := c.Lookup(ctx, fuse.RootID, "f")
	if err != nil {
		t.Fatal(err)
	}
	o, err := c.Open(ctx, e.NodeID, unix.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	r.node, r.fh = e.NodeID, o.Fh
	return r
}

func ctxT() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), lockTimeout)
}

func flk(typ uint32, start, end uint64, pid uint32) fuse.FileLock {
	return fuse.FileLock{Type: typ, Start: start, End: end, PID: pid}
}

func (r *lockRig) setlk(t *testing.T, fh, owner uint64, l fuse.FileLock, flags uint32) error {
	t.Helper()
	ctx, cancel := ctxT()
	defer cancel()
	return r.c.Setlk(ctx, r.node, fh, owner, l, flags, false)
}

// setlkw sends a SETLKW and returns its unique and the channel its answer arrives on.
func (r *lockRig) setlkw(t *testing.T, fh, owner uint64, l fuse.FileLock, flags uint32) (uint64, <-chan error) {
	t.Helper()
	req, unique := r.c.EncodeSetlk(r.node, fh, owner, l, flags, true)
	ch := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*lockTimeout)
		defer cancel()
		body, err := r.c.Do(ctx, req, fuseclient.DefaultReplyCap)
		if err == nil && len(body) != 0 {
			err = fmt.Errorf("SETLKW answered with a %d-byte body", len(body))
		}
		ch <- err
	}()
	r.waitWaiting(t, 1)
	return unique, ch
}

// waitWaiting waits until n requests wait in the server.
func (r *lockRig) waitWaiting(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(lockTimeout)
	for r.s.Stats().FUSE.Waiting != n {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests waiting, want %d", r.s.Stats().FUSE.Waiting, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func answer(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(lockTimeout):
		t.Fatal("SETLKW was never answered")
		return nil
	}
}

func notAnswered(t *testing.T, ch <-chan error) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("SETLKW answered (%v) while the lock is held", err)
	case <-time.After(150 * time.Millisecond):
	}
}

func hostOpen(t *testing.T, path string) *os.File {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// hostOFD runs an OFD lock command for the host process holding f.
func hostOFD(f *os.File, cmd int, typ int16, start, n int64) (unix.Flock_t, error) {
	fl := unix.Flock_t{Type: typ, Whence: unix.SEEK_SET, Start: start, Len: n}
	err := unix.FcntlFlock(f.Fd(), cmd, &fl)
	return fl, err
}

// TestLocksLocalByDefault: without -o posix_lock or -o flock the guest is not offered remote
// locks, and the lock opcodes answer ENOSYS (the guest never sends them then).
func TestLocksLocalByDefault(t *testing.T) {
	r := newLockRig(t, virtiofs.Config{})
	if r.granted&(fuse.InitPosixLocks|fuse.InitFlockLocks) != 0 {
		t.Errorf("INIT granted %#x: lock flags without posix_lock or flock", r.granted)
	}
	ctx, cancel := ctxT()
	defer cancel()
	whole := flk(unix.F_WRLCK, 0, fuse.OffsetMax, 1)
	if _, err := r.c.Getlk(ctx, r.node, r.fh, 1, whole); !errors.Is(err, unix.ENOSYS) {
		t.Errorf("GETLK: %v, want ENOSYS", err)
	}
	for _, wait := range []bool{false, true} {
		for _, flags := range []uint32{0, fuse.LkFlock} {
			if err := r.c.Setlk(ctx, r.node, r.fh, 1, whole, flags, wait); !errors.Is(err, unix.ENOSYS) {
				t.Errorf("SETLK (wait %v, flags %d): %v, want ENOSYS", wait, flags, err)
			}
		}
	}
	f := hostOpen(t, r.host)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
		t.Errorf("host lock: %v", err)
	}
}

// TestRemotePosixLocks: two guest owners sharing one handle contend; GETLK reports the
// conflict; a waiting SETLKW leaves the queue free for other requests and is granted when the
// holder unlocks; INTERRUPT cancels a wait; host processes' locks conflict with the guest's.
func TestRemotePosixLocks(t *testing.T) {
	for _, pool := range []int{0, 2} {
		t.Run(fmt.Sprintf("pool=%d", pool), func(t *testing.T) {
			testRemotePosixLocks(t, pool)
		})
	}
}

func testRemotePosixLocks(t *testing.T, pool int) {
	r := newLockRig(t, virtiofs.Config{PosixLock: true, ThreadPoolSize: pool})
	if r.granted&fuse.InitPosixLocks == 0 || r.granted&fuse.InitFlockLocks != 0 {
		t.Fatalf("INIT granted %#x: want POSIX locks, not flock", r.granted)
	}
	ctx, cancel := ctxT()
	defer cancel()
	f := hostOpen(t, r.host)

	// Owners 1 and 2 use the same handle, as two processes sharing an open file do.
	if err := r.setlk(t, r.fh, 1, flk(unix.F_WRLCK, 0, 99, 101), 0); err != nil {
		t.Fatalf("owner 1 SETLK: %v", err)
	}
	if err := r.setlk(t, r.fh, 2, flk(unix.F_RDLCK, 50, 50, 102), 0); !errors.Is(err, unix.EAGAIN) {
		t.Fatalf("owner 2 SETLK over owner 1's lock: %v, want EAGAIN", err)
	}
	got, err := r.c.Getlk(ctx, r.node, r.fh, 2, flk(unix.F_RDLCK, 10, 10, 102))
	if err != nil || *got != flk(unix.F_WRLCK, 0, 99, 101) {
		t.Errorf("owner 2 GETLK: %+v, %v; want owner 1's lock with its pid", got, err)
	}
	if got, err := r.c.Getlk(ctx, r.node, r.fh, 1, flk(unix.F_WRLCK, 0, 99, 101)); err != nil || got.Type != unix.F_UNLCK {
		t.Errorf("owner 1 GETLK over its own lock: %+v, %v; want F_UNLCK", got, err)
	}
	// The host sees the guest's lock.
	if fl, err := hostOFD(f, unix.F_OFD_GETLK, unix.F_RDLCK, 0, 1); err != nil || fl.Type != unix.F_WRLCK || fl.Len != 100 {
		t.Errorf("host F_OFD_GETLK: %+v, %v; want the guest's write lock", fl, err)
	}
	if _, err := hostOFD(f, unix.F_SETLK, unix.F_RDLCK, 0, 1); err != unix.EAGAIN && err != unix.EACCES {
		t.Errorf("host F_SETLK over the guest's lock: %v, want EAGAIN", err)
	}

	// Owner 2 waits. Meanwhile the same queue keeps answering.
	_, granted := r.setlkw(t, r.fh, 2, flk(unix.F_WRLCK, 0, 9, 102), 0)
	for i := range 20 {
		if _, err := r.c.Lookup(ctx, fuse.RootID, "f"); err != nil {
			t.Fatalf("LOOKUP %d while SETLKW waits: %v", i, err)
		}
	}
	if _, err := r.c.Getlk(ctx, r.node, r.fh, 3, flk(unix.F_RDLCK, 0, 0, 103)); err != nil {
		t.Fatalf("GETLK while SETLKW waits: %v", err)
	}
	if data, err := r.c.Read(ctx, r.node, r.fh, 0, 100); err != nil || len(data) != 100 {
		t.Fatalf("READ while SETLKW waits: %d bytes, %v", len(data), err)
	}
	notAnswered(t, granted)
	if n := r.s.Stats().InFlight; n != 1 {
		t.Errorf("%d requests in flight while one SETLKW waits, want 1", n)
	}
	if err := r.setlk(t, r.fh, 1, flk(unix.F_UNLCK, 0, fuse.OffsetMax, 101), 0); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, granted); err != nil {
		t.Fatalf("SETLKW after the unlock: %v", err)
	}
	if n := r.s.Stats().InFlight; n != 0 {
		t.Errorf("%d requests in flight once answered, want 0", n)
	}
	if fl, err := hostOFD(f, unix.F_OFD_GETLK, unix.F_RDLCK, 0, 0); err != nil || fl.Type != unix.F_WRLCK || fl.Start != 0 || fl.Len != 10 {
		t.Errorf("host F_OFD_GETLK after the grant: %+v, %v; want owner 2's lock 0-9", fl, err)
	}

	// INTERRUPT cancels a waiting SETLKW with EINTR.
	unique, cancelled := r.setlkw(t, r.fh, 3, flk(unix.F_RDLCK, 5, 5, 103), 0)
	if err := r.c.Interrupt(ctx, unique); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, cancelled); !errors.Is(err, unix.EINTR) {
		t.Errorf("interrupted SETLKW: %v, want EINTR", err)
	}
	r.waitWaiting(t, 0)

	// A host process's lock conflicts with the guest's, and a SETLKW waits for it.
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 1000, 1); err != nil {
		t.Fatal(err)
	}
	if err := r.setlk(t, r.fh, 1, flk(unix.F_RDLCK, 1000, 1000, 101), 0); !errors.Is(err, unix.EAGAIN) {
		t.Errorf("guest SETLK over a host lock: %v, want EAGAIN", err)
	}
	if got, err := r.c.Getlk(ctx, r.node, r.fh, 1, flk(unix.F_RDLCK, 900, 1100, 101)); err != nil || *got != flk(unix.F_WRLCK, 1000, 1000, 0) {
		t.Errorf("guest GETLK over a host lock: %+v, %v; want it with pid 0", got, err)
	}
	_, hostWait := r.setlkw(t, r.fh, 1, flk(unix.F_RDLCK, 1000, 1000, 101), 0)
	notAnswered(t, hostWait)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_UNLCK, 1000, 1); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, hostWait); err != nil {
		t.Fatalf("SETLKW after the host unlocked: %v", err)
	}

	// FLUSH (a close(2) by owner 2's process) releases owner 2's locks.
	in := fuse.FlushIn{Fh: r.fh, LockOwner: 2}
	if _, err := r.c.Do(ctx, r.c.Encode(fuse.OpFlush, r.node, fuse.AsBytes(&in)), fuseclient.DefaultReplyCap); err != nil {
		t.Fatal(err)
	}
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 10); err != nil {
		t.Errorf("host lock after owner 2's FLUSH: %v", err)
	}
	st := r.s.Stats()
	if st.FUSE.Ops["SETLKW"].Count != 3 || st.FUSE.Ops["SETLKW"].Errors != 1 || st.FUSE.Waiting != 0 || st.FUSE.Panics != 0 {
		t.Errorf("stats: SETLKW %+v, waiting %d, panics %d", st.FUSE.Ops["SETLKW"], st.FUSE.Waiting, st.FUSE.Panics)
	}
}

// TestRemoteFlock: flock(2) locks belong to the guest's open file (the FUSE handle).
func TestRemoteFlock(t *testing.T) {
	r := newLockRig(t, virtiofs.Config{Flock: true})
	if r.granted&fuse.InitFlockLocks == 0 || r.granted&fuse.InitPosixLocks != 0 {
		t.Fatalf("INIT granted %#x: want flock, not POSIX locks", r.granted)
	}
	ctx, cancel := ctxT()
	defer cancel()
	o, err := r.c.Open(ctx, r.node, unix.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	fh2 := o.Fh
	ex, sh, un := flk(unix.F_WRLCK, 0, fuse.OffsetMax, 0), flk(unix.F_RDLCK, 0, fuse.OffsetMax, 0), flk(unix.F_UNLCK, 0, fuse.OffsetMax, 0)
	if err := r.setlk(t, r.fh, 11, ex, 0); !errors.Is(err, unix.ENOSYS) {
		t.Errorf("POSIX lock with only flock: %v, want ENOSYS", err)
	}
	if err := r.setlk(t, r.fh, 11, ex, fuse.LkFlock); err != nil {
		t.Fatalf("flock EX on handle 1: %v", err)
	}
	if err := r.setlk(t, fh2, 12, sh, fuse.LkFlock); !errors.Is(err, unix.EAGAIN) {
		t.Errorf("flock SH on handle 2: %v, want EAGAIN", err)
	}
	f := hostOpen(t, r.host)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != unix.EWOULDBLOCK {
		t.Errorf("host flock over the guest's: %v, want EWOULDBLOCK", err)
	}
	_, granted := r.setlkw(t, fh2, 12, sh, fuse.LkFlock)
	if _, err := r.c.Lookup(ctx, fuse.RootID, "f"); err != nil {
		t.Fatalf("LOOKUP while a flock waits: %v", err)
	}
	notAnswered(t, granted)
	if err := r.setlk(t, r.fh, 11, un, fuse.LkFlock); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, granted); err != nil {
		t.Fatalf("flock SETLKW after the unlock: %v", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != unix.EWOULDBLOCK {
		t.Errorf("host flock EX over the guest's shared lock: %v, want EWOULDBLOCK", err)
	}
	// RELEASE of a file that held flock locks releases them.
	in := fuse.ReleaseIn{Fh: fh2, ReleaseFlags: fuse.ReleaseFlockUnlock, LockOwner: 12}
	if _, err := r.c.Do(ctx, r.c.Encode(fuse.OpRelease, r.node, fuse.AsBytes(&in)), fuseclient.DefaultReplyCap); err != nil {
		t.Fatal(err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Errorf("host flock after RELEASE: %v", err)
	}
	_, hostWait := r.setlkw(t, r.fh, 11, sh, fuse.LkFlock)
	notAnswered(t, hostWait)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, hostWait); err != nil {
		t.Fatalf("flock SETLKW after the host unlocked: %v", err)
	}
}

// TestLockWaitSurvivesMemoryUpdate: the front-end replaces the memory table (the same guest
// RAM mapped anew) while a SETLKW waits; the reply is written through the new mapping.
func TestLockWaitSurvivesMemoryUpdate(t *testing.T) {
	r := newLockRig(t, virtiofs.Config{PosixLock: true})
	f := hostOpen(t, r.host)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 1); err != nil {
		t.Fatal(err)
	}
	_, granted := r.setlkw(t, r.fh, 1, flk(unix.F_WRLCK, 0, 0, 101), 0)
	memfd := frontendMemfd(t, r.fe)
	regions := regionsOf(r.fe)
	fds := make([]int, len(regions))
	for i := range fds {
		fds[i] = memfd
	}
	if err := r.fe.Client().SetMemTable(regions, fds); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := ctxT()
	defer cancel()
	if _, err := r.c.Lookup(ctx, fuse.RootID, "f"); err != nil {
		t.Fatalf("LOOKUP after the memory update: %v", err)
	}
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_UNLCK, 0, 1); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, granted); err != nil {
		t.Fatalf("SETLKW granted after the memory update: %v", err)
	}
}

// TestLockWaitGuestReset: the guest driver is reset (rings stopped and set up afresh) while a
// SETLKW waits. When the lock is later granted, nothing is completed on the new rings; the new
// INIT ends the old session and releases its locks.
func TestLockWaitGuestReset(t *testing.T) {
	r := newLockRig(t, virtiofs.Config{PosixLock: true})
	f := hostOpen(t, r.host)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 1); err != nil {
		t.Fatal(err)
	}
	_, old := r.setlkw(t, r.fh, 1, flk(unix.F_WRLCK, 0, 0, 101), 0)
	ctx, cancel := ctxT()
	defer cancel()
	if err := r.fe.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := answer(t, old); !errors.Is(err, frontend.ErrStopped) {
		t.Fatalf("SETLKW across the reset: %v, want the front-end's ErrStopped", err)
	}
	if err := r.fe.Start(ctx); err != nil {
		t.Fatal(err)
	}
	used := usedIndex(t, r.fe, 1)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_UNLCK, 0, 1); err != nil {
		t.Fatal(err)
	}
	r.waitWaiting(t, 0) // granted, on the host, for a guest that is gone
	r.fe.Kick(1)        // have the ring served: a stale completion would show now
	time.Sleep(100 * time.Millisecond)
	if got := usedIndex(t, r.fe, 1); got != used {
		t.Fatalf("used index of the new ring moved from %d to %d: the old chain was completed on it", used, got)
	}
	if _, err := r.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT after the reset: %v", err)
	}
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 1); err != nil {
		t.Errorf("host lock after the new INIT: %v (the old session's lock was kept)", err)
	}
}

// TestLockWaitDisconnect: the front-end goes away while a SETLKW waits. The wait ends, and
// neither a goroutine nor a descriptor is left behind.
func TestLockWaitDisconnect(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	goroutines, fds := runtime.NumGoroutine(), countOpenFDs(t)
	r := newLockRig(t, virtiofs.Config{PosixLock: true, ThreadPoolSize: 2})
	if err := r.setlk(t, r.fh, 1, flk(unix.F_WRLCK, 0, 0, 101), 0); err != nil {
		t.Fatal(err)
	}
	before := r.s.Stats().FS.Fds
	_, ch := r.setlkw(t, r.fh, 2, flk(unix.F_WRLCK, 0, 0, 102), 0)
	if got := r.s.Stats().FS.Fds; got != before+1 {
		t.Errorf("FS descriptors while owner 2 waits: %d, want %d (its own)", got, before+1)
	}
	r.fe.Close()
	if err := answer(t, ch); !errors.Is(err, frontend.ErrClosed) {
		t.Errorf("SETLKW at disconnect: %v, want the front-end's ErrClosed", err)
	}
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(lockTimeout):
		t.Fatal("Serve did not return after the disconnect")
	}
	st := r.s.Stats()
	if st.FUSE.Waiting != 0 || st.FUSE.Ops["SETLKW"].Errors != 1 {
		t.Errorf("after the disconnect: %d waiting, SETLKW %+v; want the wait cancelled", st.FUSE.Waiting, st.FUSE.Ops["SETLKW"])
	}
	if st.FS.Fds != before {
		t.Errorf("FS descriptors after the disconnect: %d, want %d (the waiting owner's closed)", st.FS.Fds, before)
	}
	r.s.Close()
	deadline := time.Now().Add(lockTimeout)
	for runtime.NumGoroutine() > goroutines || countOpenFDs(t) > fds {
		if time.Now().After(deadline) {
			t.Fatalf("after Close: %d goroutines (%d before), %d fds (%d before)",
				runtime.NumGoroutine(), goroutines, countOpenFDs(t), fds)
		}
		time.Sleep(10 * time.Millisecond)
	}
	f := hostOpen(t, r.host)
	if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
		t.Errorf("host lock after Close: %v", err)
	}
}

// lockScript runs the same lock requests against a server serving dir and renders each answer.
func lockScript(t *testing.T, c *fuseclient.Client, dir string) map[string]string {
	t.Helper()
	ctx, cancel := ctxT()
	defer cancel()
	host := filepath.Join(dir, "f")
	if err := os.WriteFile(host, make([]byte, 100), 0o644); err != nil {
		t.Fatal(err)
	}
	e, err := c.Lookup(ctx, fuse.RootID, "f")
	if err != nil {
		t.Fatal(err)
	}
	o, err := c.Open(ctx, e.NodeID, unix.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	node, fh := e.NodeID, o.Fh
	res := map[string]string{}
	outcome := func(err error) string {
		var en unix.Errno
		if errors.As(err, &en) {
			return unix.ErrnoName(en)
		}
		if err != nil {
			return err.Error()
		}
		return "ok"
	}
	setlk := func(step string, owner uint64, l fuse.FileLock, wait bool) {
		res[step] = outcome(c.Setlk(ctx, node, fh, owner, l, 0, wait))
	}
	getlk := func(step string, owner uint64, l fuse.FileLock) {
		got, err := c.Getlk(ctx, node, fh, owner, l)
		if err != nil {
			res[step] = outcome(err)
			return
		}
		res[step] = fmt.Sprintf("type %d %d-%d pid %d", got.Type, got.Start, got.End, got.PID)
	}
	f := hostOpen(t, host)
	hostCheck := func(step string, start, n int64) {
		fl, err := hostOFD(f, unix.F_OFD_GETLK, unix.F_WRLCK, start, n)
		res[step] = fmt.Sprintf("host type %d %d+%d %v", fl.Type, fl.Start, fl.Len, err)
	}
	setlk("owner 1 locks 0-9", 1, flk(unix.F_WRLCK, 0, 9, 101), false)
	hostCheck("host sees the lock", 0, 0)
	setlk("owner 2 conflicts", 2, flk(unix.F_RDLCK, 5, 5, 102), false)
	// Linux sends GETLK with pid 0 (the C virtiofsd passes the pid on to F_OFD_GETLK, which
	// refuses anything else with EINVAL).
	getlk("owner 2 tests", 2, flk(unix.F_RDLCK, 0, 0, 0))
	getlk("owner 1 tests its own", 1, flk(unix.F_WRLCK, 0, 9, 0))
	setlk("owner 2 locks 10-", 2, flk(unix.F_RDLCK, 10, fuse.OffsetMax, 102), false)
	setlk("owner 1 unlocks", 1, flk(unix.F_UNLCK, 0, fuse.OffsetMax, 0), false)
	getlk("owner 1 tests owner 2's", 1, flk(unix.F_WRLCK, 0, fuse.OffsetMax, 0))
	in := fuse.FlushIn{Fh: fh, LockOwner: 2}
	_, err = c.Do(ctx, c.Encode(fuse.OpFlush, node, fuse.AsBytes(&in)), fuseclient.DefaultReplyCap)
	res["flush owner 2"] = outcome(err)
	hostCheck("flush released owner 2's locks", 0, 0)
	setlk("setlkw without a conflict", 1, flk(unix.F_WRLCK, 0, 0, 101), true)
	setlk("owner 1 unlocks again", 1, flk(unix.F_UNLCK, 0, fuse.OffsetMax, 0), false)
	res["release"] = outcome(c.Release(ctx, node, fh))
	return res
}

// TestRemoteLocksAgainstCVirtiofsd runs the same POSIX lock requests against kvfsd -o posix_lock
// and the C virtiofsd -o posix_lock and compares the answers.
func TestRemoteLocksAgainstCVirtiofsd(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("both servers need root")
	}
	if _, err := os.Stat(cVirtiofsd); err != nil {
		t.Skipf("the C virtiofsd is not installed (%v)", err)
	}
	kdir := shareDir(t)
	ksock, _, _ := startServer(t, virtiofs.Config{SharedDir: kdir, PosixLock: true})
	kfe, kc := dial(t, ksock)
	defer kfe.Close()
	kres := lockScript(t, kc, kdir)

	cdir := shareDir(t)
	csock := filepath.Join(t.TempDir(), "c.sock")
	cmd := exec.Command(cVirtiofsd, "--socket-path="+csock, "-o", "source="+cdir, "-o", "posix_lock")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	waitSocket(t, csock)
	ctx, cancel := ctxT()
	defer cancel()
	cfe, err := frontend.Dial(ctx, csock, frontend.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cfe.Close()
	cc := fuseclient.New(cfe)
	if _, err := cc.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT of the C virtiofsd: %v", err)
	}
	cres := lockScript(t, cc, cdir)

	known := map[string]string{
		// C answers the host's OFD pid (-1) as is; kvfsd the pid of the guest owner.
		"owner 2 tests":           "kvfsd reports the guest pid that took the conflicting lock; C virtiofsd the host's -1",
		"owner 1 tests owner 2's": "as above",
		// C refuses to wait at all.
		"setlkw without a conflict": "C virtiofsd 7.2 answers every SETLKW EOPNOTSUPP; kvfsd waits off the queue",
	}
	for step, k := range kres {
		c := cres[step]
		if k == c {
			if _, ok := known[step]; ok {
				t.Errorf("%s: both answer %q, but it is listed as a known difference", step, k)
			}
			continue
		}
		if why, ok := known[step]; ok {
			t.Logf("known difference %s: kvfsd %q, C virtiofsd %q (%s)", step, k, c, why)
			continue
		}
		t.Errorf("%s: kvfsd %q, C virtiofsd %q", step, k, c)
	}
}
