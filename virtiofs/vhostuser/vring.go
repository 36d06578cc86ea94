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
		signal(v.wakeFD) // EAGAIN (saturated) is success; nothing else can fail on an eventfd
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

func (v *Vring) setEnabled(on bool) {
	v.enabled.Store(on)
	if on && v.running {
		v.wake() // kicks that arrived while disabled were dropped
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
	work := true // buffers may be available already when the ring starts
	for !v.stopping.Load() {
		if v.broken.Load() { // remapping failed
			fail(errors.New("rings not mapped by the new memory table"))
			return
		}
		more := false
		if work && v.enabled.Load() {
			var err error
			if more, err = v.process(); err != nil {
				fail(err)
				return
			}
		}
		if more {
			continue // another batch, once stop and memory updates have had their chance
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

// process runs the device on the ring under the memory read lock. A panic in the device breaks
// the ring rather than the process.
func (v *Vring) process() (more bool, err error) {
	v.Yield()
	v.s.memMu.RLock()
	defer v.s.memMu.RUnlock()
	if v.q == nil || v.broken.Load() {
		return false, nil
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("device panicked: %v\n%s", r, debug.Stack())
		}
	}()
	return v.s.dev.HandleQueue(v.idx, v)
}
