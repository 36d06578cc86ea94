package passthrough

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Remote locks: see "Remote file locks" in the package documentation.

// maxLockOwners bounds the lock owners (and so the extra descriptors) of one node. A guest
// asking for more gets ENOLCK, as when the kernel runs out of lock records.
const maxLockOwners = 4096

// A SETLKW that finds its lock taken tries again after lockRetryMin, then at intervals that
// double up to lockRetryMax: a released lock is noticed within lockRetryMax.
const (
	lockRetryMin = time.Millisecond
	lockRetryMax = 50 * time.Millisecond
)

// nodeLocks is the POSIX lock state of one node: the open file description of each guest lock
// owner that has used locks on it. It is created by the first lock request and lives as long
// as the node.
type nodeLocks struct {
	mu     sync.Mutex
	owners map[uint64]*lockOwner // by FUSE lock owner; guarded by mu; nil once the node is gone
}

// lockOwner is the open file description on which one guest lock owner's POSIX locks are
// taken, as host OFD locks.
type lockOwner struct {
	fd      int32         // opened for this owner; immutable; closed by the last unpin
	pins    atomic.Int32  // 1 while in nodeLocks.owners, +1 per request or wait using fd
	pid     atomic.Uint32 // the guest pid that last took a lock with it, for GETLK
	locked  atomic.Bool   // a lock was taken with it at some point: it may hold one
	waiters int           // SETLKWs waiting with it; guarded by nodeLocks.mu
}

// lockState returns n's lock state, creating it.
func (n *inode) lockState() *nodeLocks {
	if l := n.locks.Load(); l != nil {
		return l
	}
	n.locks.CompareAndSwap(nil, &nodeLocks{owners: make(map[uint64]*lockOwner)})
	return n.locks.Load()
}

// closeAll drops every owner, releasing its locks once nothing uses its descriptor. Called by
// the node's last unpin.
func (l *nodeLocks) closeAll(fds *atomic.Int64) {
	l.mu.Lock()
	owners := l.owners
	l.owners = nil
	l.mu.Unlock()
	for _, o := range owners {
		o.put(fds)
	}
}

// put unpins o, closing its descriptor (and so releasing its locks) if it was the last pin.
func (o *lockOwner) put(fds *atomic.Int64) {
	if o.pins.Add(-1) == 0 {
		unix.Close(int(o.fd))
		fds.Add(-1)
	}
}

// lockOwner returns the descriptor of owner id on node n (whose handle h the request came
// through), pinned; release it with o.put. Without create it returns nil when the owner has
// none: it holds no lock on n.
func (fs *FS) lockOwner(n *inode, h *handle, id uint64, create bool) (*lockOwner, fuse.Errno) {
	l := n.lockState()
	l.mu.Lock()
	if o := l.owners[id]; o != nil {
		o.pins.Add(1)
		l.mu.Unlock()
		return o, fuse.OK
	}
	full := len(l.owners) >= maxLockOwners
	l.mu.Unlock()
	if !create {
		return nil, fuse.OK
	}
	if full {
		return nil, unix.ENOLCK
	}
	fd, err := fs.openLockOwner(h)
	if err != nil {
		if err == unix.EMFILE || err == unix.ENFILE {
			return nil, unix.ENOLCK
		}
		return nil, errno(err)
	}
	l.mu.Lock()
	if l.owners == nil { // cannot happen while the caller pins n; be safe anyway
		l.mu.Unlock()
		unix.Close(fd)
		return nil, unix.EBADF
	}
	if o := l.owners[id]; o != nil { // another request of the same owner was quicker
		o.pins.Add(1)
		l.mu.Unlock()
		unix.Close(fd)
		return o, fuse.OK
	}
	o := &lockOwner{fd: int32(fd)}
	o.pins.Store(2)
	l.owners[id] = o
	l.mu.Unlock()
	fs.fds.Add(1)
	return o, fuse.OK
}

// openLockOwner opens the file of handle h afresh for one lock owner: read-write, so that the owner can take
// read and write locks through whichever of its handles it uses (the guest kernel has checked
// the handle's mode against the lock type already); with the mode of handle h when the file
// cannot be opened read-write (a read-only mount, a running executable).
func (fs *FS) openLockOwner(h *handle) (int, error) {
	// Through the handle's descriptor: /proc leads to the same inode, and an open file's inode
	// is there even when the node's file handle can no longer be opened.
	fd, err := fs.openProc(h.fd, unix.O_RDWR|unix.O_NOCTTY)
	if err == nil {
		return fd, nil
	}
	fl, ferr := unix.FcntlInt(uintptr(h.fd), unix.F_GETFL, 0)
	if ferr != nil || fl&unix.O_ACCMODE == unix.O_RDWR {
		return -1, err
	}
	return fs.openProc(h.fd, fl&unix.O_ACCMODE|unix.O_NOCTTY)
}

// dropIfUnused takes o out of l when it never held a lock, nobody waits with it and nobody
// but the caller (one pin) and the table (one) uses it: a SETLK or SETLKW that failed or was
// cancelled then leaves no descriptor behind. It consumes the caller's pin.
func (fs *FS) dropIfUnused(l *nodeLocks, id uint64, o *lockOwner) {
	l.mu.Lock()
	drop := !o.locked.Load() && o.waiters == 0 && o.pins.Load() == 2 && l.owners[id] == o
	if drop {
		delete(l.owners, id)
	}
	l.mu.Unlock()
	if drop {
		o.put(&fs.fds)
	}
	o.put(&fs.fds)
}

// lockRange checks a lock from the guest and turns it into a host one. F_UNLCK is accepted
// only with unlock.
func lockRange(lk *fuse.FileLock, unlock bool) (unix.Flock_t, fuse.Errno) {
	switch lk.Type {
	case unix.F_RDLCK, unix.F_WRLCK:
	case unix.F_UNLCK:
		if !unlock {
			return unix.Flock_t{}, unix.EINVAL
		}
	default:
		return unix.Flock_t{}, unix.EINVAL
	}
	if lk.Start > fuse.OffsetMax || lk.End > fuse.OffsetMax || lk.End < lk.Start {
		return unix.Flock_t{}, unix.EINVAL
	}
	fl := unix.Flock_t{Type: int16(lk.Type), Whence: unix.SEEK_SET, Start: int64(lk.Start)}
	if lk.End != fuse.OffsetMax {
		fl.Len = int64(lk.End - lk.Start + 1) // at most OffsetMax: End < OffsetMax
	}
	return fl, fuse.OK
}

// conflict reports whether err from a non-blocking lock attempt means "held by someone else".
func conflict(err error) bool {
	return err == unix.EAGAIN || err == unix.EACCES
}

// GetLk reports the first lock that conflicts with in.Lk taken by in.Owner: F_OFD_GETLK on the
// owner's descriptor (or, if it has none and so holds no lock, on the handle's). The pid of the
// conflicting lock is translated for the guest: see lockHolder.
func (fs *FS) GetLk(ctx *fuse.Context, nodeID uint64, in *fuse.LkIn, out *fuse.LkOut) fuse.Errno {
	if fs.flags.Load()&fuse.InitPosixLocks == 0 {
		return unix.ENOSYS
	}
	if in.LkFlags&fuse.LkFlock != 0 {
		return unix.EINVAL // the guest tests flock(2) locks itself
	}
	fl, e := lockRange(&in.Lk, false)
	if e != fuse.OK {
		return e
	}
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.nodes.put(n)
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return e
	}
	defer fs.handles.put(h)
	o, e := fs.lockOwner(n, h, in.Owner, false)
	if e != fuse.OK {
		return e
	}
	fd := h.fd
	if o != nil {
		defer o.put(&fs.fds)
		fd = o.fd
	}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &fl); err != nil {
		return errno(err)
	}
	if fl.Type == unix.F_UNLCK {
		out.Lk = fuse.FileLock{Type: unix.F_UNLCK}
		return fuse.OK
	}
	out.Lk = fuse.FileLock{Start: uint64(fl.Start), End: fuse.OffsetMax, Type: uint32(fl.Type)}
	if fl.Len > 0 {
		out.Lk.End = uint64(fl.Start + fl.Len - 1)
	}
	out.Lk.PID = fs.lockHolder(n, o, &fl)
	return fuse.OK
}

// lockHolder returns the guest pid to report for the conflicting lock fl, found by GETLK on
// behalf of owner self (nil: an owner without a descriptor). The host reports -1 for an OFD
// lock and a host pid for a classic POSIX lock; neither means anything in the guest. If the
// lock is one of the guest's own (an OFD lock on another owner's descriptor), the answer is
// the guest pid that took it, which the guest kernel maps back to its process. Which owner
// holds it is found by asking each other owner of the node whether a write lock over the
// conflicting range would conflict with anything but its own locks: no conflict means every
// lock there is its own. Anything else — a host process, or a range shared by several readers
// — is reported as pid 0, which the guest shows as a lock without a local owner.
func (fs *FS) lockHolder(n *inode, self *lockOwner, fl *unix.Flock_t) uint32 {
	if fl.Pid != -1 {
		return 0 // a classic POSIX lock of a host process
	}
	l := n.lockState()
	l.mu.Lock() // the owners' descriptors stay open while they are in the table
	defer l.mu.Unlock()
	for _, o := range l.owners {
		if o == self || !o.locked.Load() {
			continue
		}
		probe := unix.Flock_t{Type: unix.F_WRLCK, Whence: unix.SEEK_SET, Start: fl.Start, Len: fl.Len}
		if unix.FcntlFlock(uintptr(o.fd), unix.F_OFD_GETLK, &probe) == nil && probe.Type == unix.F_UNLCK {
			return o.pid.Load()
		}
	}
	return 0
}

// SetLk takes, changes or releases a lock. POSIX locks (the default) are OFD locks on the
// owner's own descriptor; flock(2) locks (fuse.LkFlock) are flock on the handle's descriptor,
// since a FUSE handle is one open file of the guest, which is what owns a flock lock. A SETLKW
// that finds the lock taken returns a Waiter that keeps trying in the background.
func (fs *FS) SetLk(ctx *fuse.Context, nodeID uint64, in *fuse.LkIn, wait bool) (fuse.Waiter, fuse.Errno) {
	if in.LkFlags&fuse.LkFlock != 0 {
		return fs.setFlock(nodeID, in, wait)
	}
	if fs.flags.Load()&fuse.InitPosixLocks == 0 {
		return nil, unix.ENOSYS
	}
	fl, e := lockRange(&in.Lk, true)
	if e != fuse.OK {
		return nil, e
	}
	n, e := fs.node(nodeID)
	if e != fuse.OK {
		return nil, e
	}
	defer fs.nodes.put(n)
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return nil, e
	}
	defer fs.handles.put(h)
	unlock := fl.Type == unix.F_UNLCK
	o, e := fs.lockOwner(n, h, in.Owner, !unlock)
	if e != fuse.OK || o == nil {
		return nil, e // an owner without a descriptor holds nothing to unlock
	}
	l, id, pid := n.lockState(), in.Owner, in.Lk.PID
	try := func() error {
		lk := fl
		return unix.FcntlFlock(uintptr(o.fd), unix.F_OFD_SETLK, &lk)
	}
	err := try()
	switch {
	case err == nil:
		if !unlock {
			o.pid.Store(pid)
			o.locked.Store(true)
		}
		o.put(&fs.fds)
		return nil, fuse.OK
	case !wait || !conflict(err):
		fs.dropIfUnused(l, id, o)
		if conflict(err) {
			return nil, unix.EAGAIN
		}
		return nil, errno(err)
	}
	l.mu.Lock()
	o.waiters++
	l.mu.Unlock()
	return newLockWait(try, func(granted bool) {
		l.mu.Lock()
		o.waiters--
		l.mu.Unlock()
		if granted {
			o.pid.Store(pid)
			o.locked.Store(true)
		}
		fs.dropIfUnused(l, id, o)
	}), fuse.OK
}

// setFlock serves a flock(2) request: flock on the handle's descriptor, never blocking.
func (fs *FS) setFlock(nodeID uint64, in *fuse.LkIn, wait bool) (fuse.Waiter, fuse.Errno) {
	if fs.flags.Load()&fuse.InitFlockLocks == 0 {
		return nil, unix.ENOSYS
	}
	var how int
	switch in.Lk.Type {
	case unix.F_RDLCK:
		how = unix.LOCK_SH
	case unix.F_WRLCK:
		how = unix.LOCK_EX
	case unix.F_UNLCK:
		how = unix.LOCK_UN
	default:
		return nil, unix.EINVAL
	}
	h, e := fs.handle(in.Fh, nodeID, false)
	if e != fuse.OK {
		return nil, e
	}
	try := func() error { return unix.Flock(int(h.fd), how|unix.LOCK_NB) }
	err := try()
	if err == nil || !wait || !conflict(err) {
		fs.handles.put(h)
		if conflict(err) {
			return nil, unix.EAGAIN
		}
		return nil, errno(err)
	}
	return newLockWait(try, func(bool) { fs.handles.put(h) }), fuse.OK
}

// releaseOwner is FLUSH's part in POSIX locks: the guest closed a descriptor of the file, which
// releases all of the closing process's locks on it (owner id). Its descriptor is closed; if a
// SETLKW of the same owner is still waiting with it, the locks are released explicitly and the
// descriptor kept for that wait.
func (fs *FS) releaseOwner(n *inode, id uint64) {
	l := n.locks.Load()
	if l == nil {
		return
	}
	l.mu.Lock()
	o := l.owners[id]
	if o == nil {
		l.mu.Unlock()
		return
	}
	if o.waiters == 0 {
		delete(l.owners, id)
		l.mu.Unlock()
		o.put(&fs.fds)
		return
	}
	o.pins.Add(1)
	l.mu.Unlock()
	all := unix.Flock_t{Type: unix.F_UNLCK, Whence: unix.SEEK_SET}
	unix.FcntlFlock(uintptr(o.fd), unix.F_OFD_SETLK, &all)
	o.put(&fs.fds)
}

// lockWait is the fuse.Waiter of a SETLKW: it retries the non-blocking attempt with growing
// intervals until it succeeds, fails otherwise, or is cancelled. A blocking F_OFD_SETLKW or
// flock cannot be cancelled from Go (the runtime installs its signal handlers with SA_RESTART,
// so a signal would only restart the call), and a thread stuck in it would outlive the wait.
type lockWait struct {
	try    func() error     // one non-blocking attempt
	end    func(bool)       // releases what the wait holds; told whether the lock was taken
	cancel chan struct{}    // closed by Cancel
	once   sync.Once        // closes cancel
	done   func(fuse.Errno) // set by Start
}

func newLockWait(try func() error, end func(bool)) *lockWait {
	return &lockWait{try: try, end: end, cancel: make(chan struct{})}
}

// Start implements fuse.Waiter.
func (w *lockWait) Start(done func(fuse.Errno)) {
	w.done = done
	go w.run()
}

// Cancel implements fuse.Waiter.
func (w *lockWait) Cancel() { w.once.Do(func() { close(w.cancel) }) }

func (w *lockWait) run() {
	delay := lockRetryMin
	t := time.NewTimer(delay)
	defer t.Stop()
	for {
		select {
		case <-w.cancel:
			w.finish(unix.EINTR, false)
			return
		case <-t.C:
		}
		select { // a cancellation that raced with the timer wins
		case <-w.cancel:
			w.finish(unix.EINTR, false)
			return
		default:
		}
		err := w.try()
		if err == nil {
			w.finish(fuse.OK, true)
			return
		}
		if !conflict(err) {
			w.finish(errno(err), false)
			return
		}
		delay = min(2*delay, lockRetryMax)
		t.Reset(delay)
	}
}

func (w *lockWait) finish(e fuse.Errno, granted bool) {
	w.end(granted)
	w.done(e)
}
