package vhostuser

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// Vring is one virtqueue as the Backend runs it: the device-side queue over guest memory plus the
// call eventfd that notifies the driver. The Backend passes it to Device.HandleQueue; its methods
// may be used only from there (they rely on the memory read lock HandleQueue runs under), except
// Wake and Index, which any goroutine may call at any time.
type Vring struct {
	idx int
	s   *session

	// Configuration, owned by the message loop.
	num        uint16
	addr       VringAddr
	base       uint16 // next available index while stopped
	configured uint8
	kickFD     int  // -1: none
	polled     bool // kick set with NOFD: poll the ring

	// Run state, owned by the message loop; the ring goroutine reads only the atomics.
	running  bool
	wakeFD   int // eventfd waking the ring goroutine (stop, enable, broken, Wake); written under fdMu
	done     chan struct{}
	stopping atomic.Bool
	enabled  atomic.Bool
	broken   atomic.Bool

	q *virtq.Queue // guarded by s.memMu; non-nil while running

	// Adaptive polling (WithAdaptivePolling). pollMax is set by the message loop before the
	// ring goroutine starts; pollWindow belongs to the ring goroutine.
	pollMax    time.Duration // 0: the ring does not poll
	pollWindow time.Duration // how long the next poll may last
	woken      atomic.Bool   // Wake was called since the last HandleQueue began

	fdMu   sync.Mutex // also held to write wakeFD, so that Wake never signals a closed fd
	callFD int        // guarded by fdMu; -1: none
	errFD  int        // guarded by fdMu; -1: none

	yielded time.Time // the ring goroutine's last runtime.Gosched (Yield); its own
}

// Index returns the vring index.
func (v *Vring) Index() int { return v.idx }

// Queue returns the device side of the split ring.
func (v *Vring) Queue() *virtq.Queue { return v.q }

// Notify signals the call eventfd if the queue says the driver wants an interrupt for what was
// completed since the last notification (and a call fd is set).
func (v *Vring) Notify() error {
	if v.q == nil || !v.q.NeedsNotify() {
		return nil
	}
	v.fdMu.Lock()
	defer v.fdMu.Unlock()
	if v.callFD < 0 {
		return nil
	}
	if err := signal(v.callFD); err != nil {
		return fmt.Errorf("vring %d: signalling call fd: %w", v.idx, err)
	}
	return nil
}

// Wake makes the ring goroutine call Device.HandleQueue again soon, even without a kick: a
// device that finished a request on another goroutine (a reply that had to wait) uses it to get
// back onto the ring goroutine, under the memory read lock, to complete it. It may be called
// from any goroutine at any time. While the ring is stopped it does nothing: HandleQueue is
// called anyway when the ring starts again (and, with PROTOCOL_FEATURES, is enabled).
func (v *Vring) Wake() {
	v.fdMu.Lock()
	defer v.fdMu.Unlock()
	if v.wakeFD >= 0 {
		v.woken.Store(true) // for a polling ring, which is not waiting for the eventfd
		signal(v.wakeFD)    // EAGAIN (saturated) is success; nothing else can fail on an eventfd
	}
}

// signal adds 1 to an eventfd. EAGAIN means the counter is saturated: it is signalled already.
func signal(fd int) error {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], 1)
	_, err := unix.Write(fd, b[:])
	if err == unix.EAGAIN {
		return nil
	}
	return err
}

// setEnabled handles SET_VRING_ENABLE. Disabling a running ring waits for a batch the ring
// goroutine may be in to end (the memory write lock): once the message loop moves on, no chain is
// taken from the ring, and a chain the driver publishes after the front-end saw this message
// handled stays there until the ring is enabled again. process checks enabled under the read lock.
// The wait is the one a memory update or GET_VRING_BASE has too: a batch held up by a back-end
// request holds it up for at most the back-end timeout.
func (v *Vring) setEnabled(on bool) {
	v.enabled.Store(on)
	switch {
	case on && v.running:
		v.wake() // kicks that arrived while disabled were dropped
	case !on && v.running:
		v.s.memMu.Lock()
		v.s.memMu.Unlock() // nothing to guard: only to wait out the batch
	}
}

// wake pokes the ring goroutine. Message loop only, while running.
func (v *Vring) wake() {
	if err := signal(v.wakeFD); err != nil {
		log.G(v.s.ctx).WithError(err).WithField("vring", v.idx).Error("vhost-user: waking vring")
	}
}

func (v *Vring) setKickFD(fd int) {
	if v.kickFD >= 0 {
		unix.Close(v.kickFD)
	}
	v.kickFD = fd
}

func (v *Vring) swapCall(fd int) {
	v.fdMu.Lock()
	old := v.callFD
	v.callFD = fd
	v.fdMu.Unlock()
	if old >= 0 {
		unix.Close(old)
	}
}

func (v *Vring) swapErr(fd int) {
	v.fdMu.Lock()
	old := v.errFD
	v.errFD = fd
	v.fdMu.Unlock()
	if old >= 0 {
		unix.Close(old)
	}
}

func (v *Vring) signalErr() {
	v.fdMu.Lock()
	defer v.fdMu.Unlock()
	if v.errFD >= 0 {
		signal(v.errFD)
	}
}

// closeFDs closes the kick, call and error fds. The ring must be stopped.
func (v *Vring) closeFDs() {
	v.setKickFD(-1)
	v.polled = false
	v.swapCall(-1)
	v.swapErr(-1)
}

// run is the ring goroutine. It waits in epoll_wait(2) on an epoll instance of its own holding
// the kick eventfd and the ring's own wake eventfd, both edge-triggered, and calls the device
// under the memory read lock. Edge-triggered, every write to either eventfd reports one event
// whether or not its counter was read, so the ring never reads them: one system call per
// wake-up (the C virtiofsd makes two, ppoll and read). The counters only grow, by one per kick;
// at ten million kicks a second a 64-bit counter would take 58 000 years to saturate. An fd that
// epoll cannot wait on (a regular file) or that hangs up breaks the ring, and no fd can make
// it spin: each wake-up needs a new event. The message loop closes the kick fd only after the
// goroutine has exited (done), and the epoll instance is closed before that. A ring whose kick
// was set with NOFD has no kick fd and is polled every interval instead.
//
// # Adaptive polling
//
// A ring with a poll limit (v.pollMax, WithAdaptivePolling; off by default) does not go to sleep
// right after a batch that took chains from the ring: for a window (v.pollWindow, 0 to pollMax)
// it keeps looking at the avail ring, with the driver's kicks suppressed
// (virtq.Queue.SuppressNotify), and serves what comes without a kick and without a sleep and
// wake-up of its thread (Vring.poll). The window adapts, as QEMU's iothread poll-max-ns,
// poll-grow and poll-shrink do, to the idle time: from the end of the last batch that took
// chains to a wake-up, measured only when the ring did go to sleep:
//
//   - it starts at 0 (no polling) when the ring starts;
//   - after a sleep that ended within pollMax of the batch, polling longer might have caught
//     the work: the window grows, to pollStartWindow from 0, otherwise twice as long, never
//     beyond pollMax;
//   - after a sleep that ended later than pollMax, no allowed window would have caught it: the
//     window drops to 0;
//   - a poll that finds work leaves the window as it is.
//
// The factors are fixed rather than options: growth by 2 reaches any limit in a few batches,
// and dropping to 0 in one step is what bounds the cost of polling where it does not help (on
// a machine without a CPU to spare, docs/measurements/performance.md): once the guest's requests
// come further apart than pollMax, the ring spins for at most one window more and then sleeps at
// once after every batch, as without polling, until requests come closer together again.
//
// Threat model: the guest decides when requests come, so it decides how much of pollMax is
// spent, but never more: a poll follows only a batch that took at least one of the guest's
// chains, lasts at most the window (≤ pollMax) counted from the end of that batch, and does not
// start again until the next such batch; a kick or a Wake that finds nothing to take is served
// and followed by sleep, as without polling. A guest can keep a polling ring's thread busy, as
// it can by sending requests without pause anyway; it cannot make one batch poll longer than
// pollMax, and a guest that sends nothing costs nothing after the first window. The avail idx a
// poll reads is only compared (virtq.Queue.Available); the batch that follows validates it.
func (v *Vring) run(ctx context.Context, kickFD, wakeFD int, polled bool, interval time.Duration) {
	defer close(v.done)
	l := log.G(ctx).WithField("vring", v.idx)
	fail := func(err error) {
		l.WithError(err).Error("vhost-user: vring broken, no longer served")
		v.broken.Store(true)
		v.signalErr()
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		fail(fmt.Errorf("epoll_create1: %w", err))
		return
	}
	defer unix.Close(epfd)
	for _, fd := range []int{wakeFD, kickFD} {
		if fd < 0 {
			continue
		}
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
		if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
			what := "wake"
			if fd == kickFD {
				what = "kick"
			}
			fail(fmt.Errorf("%s fd cannot be waited on: %w", what, err))
			return
		}
	}
	timeout := -1
	if polled {
		timeout = max(1, int(interval/time.Millisecond))
	}

	var evs [2]unix.EpollEvent
	work := true            // buffers may be available already when the ring starts
	var idleSince time.Time // polling: when the last batch that took chains ended
	for !v.stopping.Load() {
		if v.broken.Load() { // remapping failed
			fail(errors.New("rings not mapped by the new memory table"))
			return
		}
		more, popped := false, false
		if work && v.enabled.Load() {
			var err error
			if more, popped, err = v.process(); err != nil {
				fail(err)
				return
			}
		}
		if more {
			continue // another batch, once stop and memory updates have had their chance
		}
		if v.pollMax > 0 && popped {
			idleSince = time.Now()
			if v.pollWindow > 0 && v.poll(idleSince) {
				work = true
				continue
			}
		}
		work = polled
		n, err := unix.EpollWait(epfd, evs[:], timeout)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			fail(fmt.Errorf("epoll_wait: %w", err))
			return
		}
		if !idleSince.IsZero() {
			// Kept until the next batch that takes chains: after a wake-up that finds nothing
			// (a kick the driver sent as kicks were being suppressed), the next wake-up is
			// measured from the same batch again.
			v.adaptPoll(time.Since(idleSince))
		}
		if n == 0 { // polled ring: interval elapsed
			work = true
			continue
		}
		for _, ev := range evs[:n] {
			if ev.Fd == int32(kickFD) &&
				ev.Events&(unix.EPOLLERR|unix.EPOLLHUP|unix.EPOLLRDHUP) != 0 {
				fail(fmt.Errorf("kick fd unusable (events %#x)", ev.Events))
				return
			}
			work = true
		}
	}
}

// pollStartWindow is the first poll window after one that was 0: about what a sleep in
// epoll_wait and the wake-up after it cost, so a shorter poll would not save one.
const pollStartWindow = 4 * time.Microsecond

// adaptPoll sets the next poll window from the time between the end of a batch and the wake-up
// of the sleep that followed it (see run).
func (v *Vring) adaptPoll(idle time.Duration) {
	switch {
	case idle > v.pollMax:
		v.pollWindow = 0
	case v.pollWindow < v.pollMax:
		v.pollWindow = min(max(2*v.pollWindow, v.s.b.pollStart), v.pollMax)
	}
}

// poll looks at the avail ring from the end of a batch (start) until the poll window has
// passed, with the driver's kicks suppressed, and reports whether there is work for the device:
// a chain the driver published, or a Wake. It stops early when the ring is stopping, broken or
// disabled, so the message loop never waits for a window to run out. When it finds work it
// leaves kicks suppressed: the batch that follows serves the chain and, like every batch that
// empties the ring, enables kicks again before it returns (Device.HandleQueue); enabling them
// here would have the driver kick for the very chain found, if it looks after the poll did.
// When it finds nothing, kicks are enabled again and the ring is looked at once more
// (virtq.Queue.EnableNotify), so a chain published as the poll ends is reported rather than
// left without a kick.
//
// Guest memory may be remapped or unmapped by the message loop at any time outside the memory
// read lock, so every look at the ring takes the read lock for that look alone: a memory update
// or a ring stop waiting for the write lock gets it after at most one iteration. Each iteration
// is atomic loads of the ring's flags and of the avail idx, the read lock's two atomic adds and
// a read of the monotonic clock (vDSO): no system call, so nothing beyond kvfsd's seccomp
// allowlist (clock_gettime, the vDSO's fallback, is in it for Go's runtime).
func (v *Vring) poll(start time.Time) (work bool) {
	mu := &v.s.memMu
	mu.RLock()
	v.q.SuppressNotify()
	mu.RUnlock()
	for time.Since(start) < v.pollWindow && !v.stopping.Load() && !v.broken.Load() && v.enabled.Load() {
		if v.woken.Load() {
			work = true
			break
		}
		mu.RLock()
		work = v.q.Available()
		mu.RUnlock()
		if work {
			break
		}
	}
	if work {
		return true
	}
	if v.s.b.pollEnd != nil {
		v.s.b.pollEnd(v.idx)
	}
	mu.RLock()
	work = v.q.EnableNotify()
	mu.RUnlock()
	return work
}

// process runs the device on the ring under the memory read lock, and reports whether it took
// chains from the ring (popped). A panic in the device breaks the ring rather than the process.
func (v *Vring) process() (more, popped bool, err error) {
	v.Yield()
	v.s.memMu.RLock()
	defer v.s.memMu.RUnlock()
	if v.q == nil || v.broken.Load() || !v.enabled.Load() {
		return false, false, nil
	}
	if v.pollMax > 0 {
		v.woken.Store(false) // this call serves what any Wake before it asked for
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("device panicked: %v\n%s", r, debug.Stack())
		}
	}()
	last := v.q.LastAvail()
	more, err = v.s.dev.HandleQueue(v.idx, v)
	return more, v.q.LastAvail() != last, err
}
