// Package frontend is an in-repo vhost-user front-end for virtio-fs: it plays QEMU 7.2 (the
// vhost-user messages of vhost-user-fs-pci, in QEMU's order) and the Linux virtio-fs guest driver
// (rings in shared guest memory, kicks, completions). Tests use it to drive a back-end — ours
// in-process or a reference daemon such as the C virtiofsd — without a VM.
//
// Guest memory is one memfd mapped shared into this process, split into Options.Regions regions
// that are contiguous in guest-physical space and in the memfd. As in QEMU, the user addresses
// sent to the back-end are this process's own addresses of the mapping. The first pages of region
// 0 hold the rings (one virtq.Driver per queue); the rest is handed out by Alloc.
//
// With Options.DAXWindow it plays the DAX-capable QEMU Kata ships instead (vhost-user-fs-pci
// cache-size=N): the device has a DAX window, and the back-end channel serves FS_MAP and FS_UNMAP
// into it (dax.go).
//
// Concurrency: Submit, SubmitAsync, Wait, Alloc, Free and Kick may be used from any goroutine.
// Start, Stop and Close are serialised with each other.
//
// Completions: a request alone in flight on its queue is reaped by its own Wait, as a guest's
// driver takes its interrupt on the CPU that waits, with no goroutine in between: at queue depth
// 1 the front-end costs no Go scheduler hand-off, only the call eventfd's wake-up of the thread
// that waits, in poll(2) on the raw eventfd. With several requests in flight, the Wait that
// finds the queue without a reaper starts a reaper goroutine, which reads the call eventfd
// through Go's netpoller and completes requests until none is in flight; the waiters wait on
// their requests' done channels meanwhile, so that completions come in batches as before.
//
// Each queue has at most one reaper at a time, either kind (the role is queue.reaping, taken and
// left under queue.mu). A reaper pops every used entry of its queue, completing other waiters'
// requests too. No wake-up is lost: a reaper reads the call eventfd before popping the used
// ring, and re-arms the interrupt (used_event, or clearing NO_INTERRUPT) with a re-check after a
// barrier, so a completion published after the re-check signals the eventfd and one published
// before it is popped; a signal left over from an earlier reaper makes the next one's first wait
// return at once, which costs a loop and loses nothing. Waiters without the role also wait on
// the queue's handoff channel, which a reaper closes when it leaves; they then race for the
// role. A Wait that reaps leaves when its request is done or its ctx ends, the reaper goroutine
// when no request is in flight; to get a reaper out of its wait, its ctx (context.AfterFunc),
// Stop and Close write the queue's wake eventfd and its call eventfd (the reaper goroutine reads
// only the latter). Requests nobody waits for are completed by the next reaper of their queue.
//
// Lock order: Frontend.ctlMu before queue.mu.
package frontend

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

var (
	// ErrStopped is returned for requests submitted to, or in flight on, stopped queues.
	ErrStopped = errors.New("frontend: queues are stopped")
	// ErrClosed is returned once the Frontend is closed.
	ErrClosed = errors.New("frontend: closed")
)

// Options describe the emulated device and guest. Zero fields take the defaults.
type Options struct {
	MemSize       uint64 // guest RAM; default 64 MiB
	QueueSize     uint16 // per queue; default 1024 (QEMU's maximum; Kata's setting)
	RequestQueues int    // request queues besides hiprio; default 1
	NoEventIdx    bool   // do not negotiate VIRTIO_RING_F_EVENT_IDX (negotiated by default)
	NoIndirect    bool   // do not negotiate or use indirect descriptors (used by default)
	Regions       int    // split guest RAM into this many memory regions; default 1
	// DAXWindow, when not zero, gives the device a DAX window of this many bytes (a power of
	// two, at least a page), as QEMU's out-of-tree cache-size=N does; see DAXWindow.
	DAXWindow uint64
}

const pageSize = 4096

func (o *Options) setDefaults() error {
	if o.MemSize == 0 {
		o.MemSize = 64 << 20
	}
	if o.QueueSize == 0 {
		o.QueueSize = 1024
	}
	if o.RequestQueues == 0 {
		o.RequestQueues = 1
	}
	if o.Regions == 0 {
		o.Regions = 1
	}
	switch {
	case o.QueueSize&(o.QueueSize-1) != 0 || o.QueueSize > virtq.MaxSize:
		return fmt.Errorf("frontend: queue size %d is not a power of two up to %d", o.QueueSize, virtq.MaxSize)
	case o.RequestQueues < 0 || 1+o.RequestQueues > int(vhostuser.VringIndexMask)+1:
		return fmt.Errorf("frontend: %d request queues", o.RequestQueues)
	case o.Regions < 0 || o.Regions > vhostuser.MaxMemTableRegions:
		return fmt.Errorf("frontend: %d regions, want 1..%d", o.Regions, vhostuser.MaxMemTableRegions)
	case o.MemSize%(uint64(o.Regions)*pageSize) != 0:
		return fmt.Errorf("frontend: memory size %d is not a multiple of %d regions of whole pages", o.MemSize, o.Regions)
	}
	return nil
}

// Frontend is a connected, started (or stopped) virtio-fs device as QEMU and the guest see it.
type Frontend struct {
	opts   Options
	client *vhostuser.Client

	memfd   int
	mapping []byte
	mem     *guestmem.Memory
	regions []vhostuser.MemoryRegion
	alloc   *allocator

	// Set during Dial, read-only afterwards.
	offered     uint64 // GET_FEATURES
	protocol    uint64 // acked protocol features
	queueNum    uint64 // GET_QUEUE_NUM (0 if MQ was not negotiated)
	maxMemSlots uint64 // GET_MAX_MEM_SLOTS (0 if CONFIGURE_MEM_SLOTS was not negotiated)
	backendReq  *vhostuser.Conn
	window      []byte // the DAX window, nil without one; unmapped by Close

	queues []*queue

	ctlMu    sync.Mutex // serialises Start, Stop and Close
	features uint64     // guarded by ctlMu: acked with the last SET_FEATURES
	running  bool       // guarded by ctlMu
	memSent  bool       // guarded by ctlMu: with CONFIGURE_MEM_SLOTS, the back-end has our regions

	closed atomic.Bool
	wg     sync.WaitGroup
}

// queue is one virtqueue, driver side.
type queue struct {
	idx    int
	base   uint64 // guest-physical address of the ring block
	kick   int    // eventfd we write to notify the back-end
	masked int    // QEMU's "masked" call notifier, sent at realize
	errFD  int
	call   int // the call eventfd (QEMU's guest notifier), polled by the queue's reaper
	wake   int // eventfd written to make the reaper leave its poll (ctx ended, Stop, Close)

	mu       sync.Mutex
	drv      *virtq.Driver       // guarded by mu; replaced at each start
	indirect bool                // guarded by mu: use indirect tables (negotiated at start)
	pending  map[uint16]*Pending // guarded by mu
	stopped  bool                // guarded by mu
	closed   bool                // guarded by mu: set by Close once it failed the pending requests
	reaping  bool                // guarded by mu: a Wait is the queue's reaper
	// handoff, guarded by mu, is closed (and reset to nil) when the reaper leaves; made by the
	// first waiter that finds the role taken, so that a lone waiter allocates nothing.
	handoff chan struct{}
}

// Dial connects to a vhost-user-fs back-end listening at socketPath and performs QEMU 7.2's
// realize and start sequences (reference §1.11). ctx bounds the handshake only. A socket file
// exists from the back-end's bind(2) on, before its listen(2); Dial retries a refused
// connection until ctx ends, since a back-end that accepts a single connection (the C
// virtiofsd, kvfsd) cannot be probed first.
func Dial(ctx context.Context, socketPath string, opts Options) (_ *Frontend, err error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	nc, err := dialRetry(ctx, socketPath)
	if err != nil {
		return nil, fmt.Errorf("frontend: %w", err)
	}
	f := &Frontend{opts: opts, memfd: -1, client: vhostuser.NewClient(nc.(*net.UnixConn))}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if opts.DAXWindow != 0 {
		if f.window, err = newDAXWindow(opts.DAXWindow); err != nil {
			return nil, err
		}
	}
	if err := f.setupMemory(); err != nil {
		return nil, err
	}
	if err := f.setupQueues(); err != nil {
		return nil, err
	}
	if err := f.withDeadline(ctx, f.realize); err != nil {
		return nil, fmt.Errorf("frontend: realize: %w", err)
	}
	f.ctlMu.Lock()
	defer f.ctlMu.Unlock()
	if err := f.withDeadline(ctx, f.start); err != nil {
		return nil, fmt.Errorf("frontend: start: %w", err)
	}
	return f, nil
}

// dialRetry connects to socketPath, retrying ECONNREFUSED every 10 ms until ctx ends.
func dialRetry(ctx context.Context, socketPath string) (net.Conn, error) {
	var d net.Dialer
	for {
		nc, err := d.DialContext(ctx, "unix", socketPath)
		if err == nil || !errors.Is(err, unix.ECONNREFUSED) {
			return nc, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// withDeadline runs fn with the connection's deadline taken from ctx.
func (f *Frontend) withDeadline(ctx context.Context, fn func() error) error {
	uc := f.client.Conn().UnixConn()
	if dl, ok := ctx.Deadline(); ok {
		uc.SetDeadline(dl)
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		uc.SetDeadline(time.Unix(1, 0))
		close(fired)
	})
	err := fn()
	if !stop() && ctx.Err() != nil {
		<-fired
	}
	uc.SetDeadline(time.Time{})
	if err == nil {
		return nil
	}
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%w)", cerr, err)
	}
	// The socket deadline may fire just before ctx's own timer.
	if dl, ok := ctx.Deadline(); ok && errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(dl) {
		return fmt.Errorf("%w (%w)", context.DeadlineExceeded, err)
	}
	return err
}

func (f *Frontend) setupMemory() error {
	fd, err := unix.MemfdCreate("kvfs-frontend-ram", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("frontend: memfd: %w", err)
	}
	f.memfd = fd
	if err := unix.Ftruncate(fd, int64(f.opts.MemSize)); err != nil {
		return fmt.Errorf("frontend: sizing guest memory: %w", err)
	}
	m, err := unix.Mmap(fd, 0, int(f.opts.MemSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("frontend: mapping guest memory: %w", err)
	}
	f.mapping = m
	per := f.opts.MemSize / uint64(f.opts.Regions)
	rs := make([]*guestmem.Region, f.opts.Regions)
	f.regions = make([]vhostuser.MemoryRegion, f.opts.Regions)
	for i := range rs {
		off := uint64(i) * per
		uaddr := uint64(uintptr(unsafe.Pointer(&m[off])))
		f.regions[i] = vhostuser.MemoryRegion{GuestPhysAddr: off, Size: per, UserAddr: uaddr, MmapOffset: off}
		rs[i] = guestmem.FromBytes(off, uaddr, m[off:off+per])
	}
	f.mem, err = guestmem.New(rs...)
	return err
}

func (f *Frontend) setupQueues() error {
	ringBytes := (virtq.DriverLayoutSize(f.opts.QueueSize) + pageSize - 1) &^ (pageSize - 1)
	n := 1 + f.opts.RequestQueues
	if uint64(n)*ringBytes > f.regions[0].Size {
		return fmt.Errorf("frontend: %d rings of %d bytes do not fit the first region (%d bytes)",
			n, ringBytes, f.regions[0].Size)
	}
	f.alloc = newAllocator(uint64(n)*ringBytes, f.opts.MemSize)
	newEventfd := func() (int, error) {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			return -1, fmt.Errorf("frontend: eventfd: %w", err)
		}
		return fd, nil
	}
	for i := 0; i < n; i++ {
		q := &queue{idx: i, base: uint64(i) * ringBytes, kick: -1, masked: -1, errFD: -1, call: -1, wake: -1, stopped: true}
		f.queues = append(f.queues, q)
		for _, fd := range []*int{&q.kick, &q.masked, &q.errFD, &q.call, &q.wake} {
			var err error
			if *fd, err = newEventfd(); err != nil {
				return err
			}
		}
	}
	return nil
}

// realize is QEMU 7.2's vhost_user_backend_init + vhost_dev_init for vhost-user-fs.
func (f *Frontend) realize() error {
	c := f.client
	var err error
	if f.offered, err = c.GetFeatures(); err != nil {
		return err
	}
	if f.offered&vhostuser.FeatureProtocolFeatures != 0 {
		pf, err := c.GetProtocolFeatures()
		if err != nil {
			return err
		}
		// QEMU keeps bits < 17 and drops CONFIG for vhost-user-fs (no config ops).
		f.protocol = pf & vhostuser.QEMU72ProtocolMask &^ vhostuser.ProtocolConfig
		if err := c.SetProtocolFeatures(f.protocol); err != nil {
			return err
		}
	}
	if f.protocol&vhostuser.ProtocolMQ != 0 {
		// QEMU does not check the answer for vhost-user-fs.
		if f.queueNum, err = c.GetQueueNum(); err != nil {
			return err
		}
	}
	if f.protocol&vhostuser.ProtocolConfigureMemSlots != 0 {
		if f.maxMemSlots, err = c.GetMaxMemSlots(); err != nil {
			return err
		}
		if f.maxMemSlots < uint64(len(f.regions)) {
			return fmt.Errorf("back-end supports %d memory slots, %d needed", f.maxMemSlots, len(f.regions))
		}
	}
	if f.protocol&vhostuser.ProtocolBackendReq != 0 {
		if err := f.setupBackendChannel(); err != nil {
			return err
		}
	}
	if err := c.SetOwner(); err != nil {
		return err
	}
	if _, err := c.GetFeatures(); err != nil {
		return err
	}
	for _, q := range f.queues {
		if err := c.SetVringCall(uint8(q.idx), q.masked); err != nil {
			return err
		}
		if err := c.SetVringErr(uint8(q.idx), q.errFD); err != nil {
			return err
		}
	}
	return nil
}

// setupBackendChannel sends the back-end its end of a socketpair and serves ours: QEMU 7.2
// understands only IOTLB, CONFIG_CHANGE and HOST_NOTIFIER requests there, none of which a
// vhost-user-fs device without vIOMMU uses, so every request is answered with failure; with a
// DAX window, FS_MAP and FS_UNMAP are served as the DAX-capable QEMU does (dax.go).
func (f *Frontend) setupBackendChannel() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	err = f.client.SetBackendReqFD(fds[1])
	unix.Close(fds[1])
	file := os.NewFile(uintptr(fds[0]), "backend-req")
	nc, ferr := net.FileConn(file)
	file.Close()
	if err != nil {
		if ferr == nil {
			nc.Close()
		}
		return err
	}
	if ferr != nil {
		return ferr
	}
	f.backendReq = vhostuser.NewConn(nc.(*net.UnixConn))
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for {
			m, err := f.backendReq.ReadMessage()
			if err != nil {
				return
			}
			res := f.serveBackendRequest(m)
			m.Close()
			if m.NeedReply() {
				f.backendReq.WriteReply(m.Request, vhostuser.U64(res))
			}
		}
	}()
	return nil
}

// userAddr translates a guest-physical address into the user address the back-end knows.
func (f *Frontend) userAddr(gpa uint64) uint64 {
	for _, r := range f.regions {
		if gpa >= r.GuestPhysAddr && gpa-r.GuestPhysAddr < r.Size {
			return r.UserAddr + (gpa - r.GuestPhysAddr)
		}
	}
	return 0
}

// start is QEMU 7.2's vuf_start → vhost_dev_start with a freshly initialised guest driver (new
// rings, avail index 0). Called with ctlMu held.
func (f *Frontend) start() error {
	c := f.client
	if f.offered&vhostuser.FeatureVersion1 == 0 {
		return errors.New("back-end does not offer VIRTIO_F_VERSION_1 (vhost-user-fs-pci is modern-only)")
	}
	// What a Linux guest acks of what QEMU passes through, plus PROTOCOL_FEATURES (QEMU adds
	// its backend_features).
	want := vhostuser.FeatureVersion1
	if !f.opts.NoIndirect {
		want |= vhostuser.FeatureIndirectDesc
	}
	if !f.opts.NoEventIdx {
		want |= vhostuser.FeatureEventIdx
	}
	f.features = f.offered & (want | vhostuser.FeatureProtocolFeatures)
	if err := c.SetFeatures(f.features); err != nil {
		return err
	}

	if f.protocol&vhostuser.ProtocolConfigureMemSlots != 0 {
		// QEMU diffs against its shadow table: the regions go once, later starts send nothing.
		if !f.memSent {
			for _, r := range f.regions {
				if err := c.AddMemReg(r, f.memfd); err != nil {
					return err
				}
			}
			f.memSent = true
		}
	} else {
		fds := make([]int, len(f.regions))
		for i := range fds {
			fds[i] = f.memfd
		}
		if err := c.SetMemTable(f.regions, fds); err != nil {
			return err
		}
	}

	eventIdx := f.features&vhostuser.FeatureEventIdx != 0
	for _, q := range f.queues {
		drv, err := virtq.NewDriver(f.mem, q.base, f.opts.QueueSize, eventIdx)
		if err != nil {
			return err
		}
		q.mu.Lock()
		q.drv, q.pending, q.stopped = drv, map[uint16]*Pending{}, false
		q.indirect = f.features&vhostuser.FeatureIndirectDesc != 0
		q.mu.Unlock()
		idx := uint32(q.idx)
		if err := c.SetVringNum(idx, uint32(f.opts.QueueSize)); err != nil {
			return err
		}
		if err := c.SetVringBase(idx, 0); err != nil {
			return err
		}
		if err := c.SetVringAddr(vhostuser.VringAddr{
			Index: idx,
			Desc:  f.userAddr(drv.DescAddr()),
			Used:  f.userAddr(drv.UsedAddr()),
			Avail: f.userAddr(drv.AvailAddr()),
		}); err != nil {
			return err
		}
		if err := c.SetVringKick(uint8(q.idx), q.kick); err != nil {
			return err
		}
	}
	if f.features&vhostuser.FeatureProtocolFeatures != 0 {
		for _, q := range f.queues {
			if err := c.SetVringEnable(uint32(q.idx), true); err != nil {
				return err
			}
		}
	}
	for _, q := range f.queues { // vhost_virtqueue_mask(false): the guest notifier
		if err := c.SetVringCall(uint8(q.idx), q.call); err != nil {
			return err
		}
	}
	// A round trip before the guest may kick: the back-end has then handled SET_VRING_ENABLE and
	// SET_VRING_CALL. A back-end whose rings run on threads of their own (the Rust virtiofsd) can
	// otherwise take the first kick on a ring it has not enabled yet, drop it, and never answer.
	// QEMU 7.2 does not wait; QEMU 10 sends SET_VRING_ENABLE synchronously for the same reason.
	if _, err := c.GetFeatures(); err != nil {
		return err
	}
	f.running = true
	return nil
}

// Stop performs QEMU's stop sequence (SET_VRING_ENABLE(0) for every queue if PROTOCOL_FEATURES
// was negotiated, then GET_VRING_BASE for every queue). The connection stays up; requests still
// in flight fail with ErrStopped. Start brings the device back as after a guest reboot.
func (f *Frontend) Stop(ctx context.Context) error {
	f.ctlMu.Lock()
	defer f.ctlMu.Unlock()
	if f.closed.Load() {
		return ErrClosed
	}
	if !f.running {
		return nil
	}
	f.running = false
	for _, q := range f.queues {
		q.mu.Lock()
		q.stopped = true
		q.mu.Unlock()
	}
	err := f.withDeadline(ctx, func() error {
		if f.features&vhostuser.FeatureProtocolFeatures != 0 {
			for _, q := range f.queues {
				if err := f.client.SetVringEnable(uint32(q.idx), false); err != nil {
					return err
				}
			}
		}
		for _, q := range f.queues {
			if _, err := f.client.GetVringBase(uint32(q.idx)); err != nil {
				return err
			}
		}
		return nil
	})
	for _, q := range f.queues {
		q.failPending(ErrStopped)
	}
	if err != nil {
		return fmt.Errorf("frontend: stop: %w", err)
	}
	return nil
}

// Start runs QEMU's start sequence again with fresh rings, as when a rebooted guest's driver
// sets DRIVER_OK.
func (f *Frontend) Start(ctx context.Context) error {
	f.ctlMu.Lock()
	defer f.ctlMu.Unlock()
	if f.closed.Load() {
		return ErrClosed
	}
	if f.running {
		return errors.New("frontend: already started")
	}
	if err := f.withDeadline(ctx, f.start); err != nil {
		return fmt.Errorf("frontend: start: %w", err)
	}
	return nil
}

// Close disconnects from the back-end (which should then return from its Serve), fails requests
// in flight with ErrClosed and releases guest memory.
func (f *Frontend) Close() error {
	if !f.closed.CompareAndSwap(false, true) {
		return nil
	}
	// Closing the socket first also unblocks a Start or Stop waiting for the back-end.
	err := f.client.Close()
	f.ctlMu.Lock()
	defer f.ctlMu.Unlock()
	f.running = false
	if f.backendReq != nil {
		f.backendReq.Close()
	}
	f.wg.Wait()
	for _, q := range f.queues {
		q.close()
		for _, fd := range []int{q.kick, q.masked, q.errFD, q.call, q.wake} {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}
	if f.mapping != nil {
		// The slice header stays: Alloc may read it concurrently and refuses after Close.
		unix.Munmap(f.mapping)
	}
	if f.memfd >= 0 {
		unix.Close(f.memfd)
		f.memfd = -1
	}
	if f.window != nil {
		// The back-end channel's goroutine, the only one mapping into it, has exited.
		unix.Munmap(f.window)
	}
	return err
}

// Client returns the vhost-user client, for sending raw or out-of-sequence messages.
func (f *Frontend) Client() *vhostuser.Client { return f.client }

// Memory returns guest memory as the driver sees it (unusable after Close).
func (f *Frontend) Memory() *guestmem.Memory { return f.mem }

// Features returns the virtio features acked with the last SET_FEATURES.
func (f *Frontend) Features() uint64 {
	f.ctlMu.Lock()
	defer f.ctlMu.Unlock()
	return f.features
}

// ProtocolFeatures returns the protocol features acked with SET_PROTOCOL_FEATURES.
func (f *Frontend) ProtocolFeatures() uint64 { return f.protocol }

// NumQueues returns the number of queues (hiprio + request queues).
func (f *Frontend) NumQueues() int { return len(f.queues) }

// Alloc returns n bytes of guest memory outside the rings (64-byte aligned, possibly spanning
// regions) as its guest-physical address and this process's view of it. It returns a nil slice
// when guest memory is exhausted or the Frontend is closed. Buffers must not be touched after
// Close, which unmaps guest memory.
func (f *Frontend) Alloc(n uint64) (gpa uint64, buf []byte) {
	if f.closed.Load() {
		return 0, nil
	}
	gpa, ok := f.alloc.alloc(n)
	if !ok {
		return 0, nil
	}
	return gpa, f.mapping[gpa : gpa+n : gpa+n]
}

// Free returns a block obtained from Alloc.
func (f *Frontend) Free(gpa uint64) {
	f.alloc.release(gpa)
}

// Driver returns the driver side of queue q for raw (hostile) use. It is not synchronised with
// Submit or with a Wait reaping the queue, which pops used entries whenever the call eventfd
// fires; the returned Driver is replaced by every Start.
func (f *Frontend) Driver(q int) *virtq.Driver {
	qu := f.queues[q]
	qu.mu.Lock()
	defer qu.mu.Unlock()
	return qu.drv
}

// Kick notifies the back-end that queue q has new buffers.
func (f *Frontend) Kick(q int) error {
	if q < 0 || q >= len(f.queues) {
		return fmt.Errorf("frontend: no queue %d", q)
	}
	var b [8]byte
	b[0] = 1
	_, err := unix.Write(f.queues[q].kick, b[:])
	if err == unix.EAGAIN { // counter saturated: a kick is pending anyway
		err = nil
	}
	return err
}

// Pending is a request in flight.
type Pending struct {
	f        *Frontend
	q        *queue
	head     uint16
	table    uint64 // guest-physical address of its indirect table, 0 if none
	done     chan struct{}
	finished bool   // guarded by the queue's mu: done is closed
	written  uint32 // valid once done is closed
	err      error  // valid once done is closed
}

// SubmitAsync places a chain of readable then writable buffers on queue q (0 = hiprio,
// 1.. = request queues) and kicks the back-end if it wants a kick. With indirect descriptors
// negotiated, a chain of more than one buffer goes through an indirect table, as Linux does.
func (f *Frontend) SubmitAsync(q int, readable, writable []virtq.Buf) (*Pending, error) {
	if f.closed.Load() {
		return nil, ErrClosed
	}
	if q < 0 || q >= len(f.queues) {
		return nil, fmt.Errorf("frontend: no queue %d", q)
	}
	qu := f.queues[q]
	p := &Pending{f: f, q: qu, done: make(chan struct{})}
	qu.mu.Lock()
	if qu.closed {
		qu.mu.Unlock()
		return nil, ErrClosed
	}
	if qu.stopped {
		qu.mu.Unlock()
		return nil, ErrStopped
	}
	var ind *virtq.Buf
	if n := len(readable) + len(writable); n > 1 && qu.indirect {
		gpa, buf := f.Alloc(16 * uint64(n))
		if buf == nil {
			qu.mu.Unlock()
			return nil, errors.New("frontend: guest memory exhausted (indirect table)")
		}
		p.table = gpa
		ind = &virtq.Buf{Addr: gpa, Len: uint32(len(buf))}
	}
	head, err := qu.drv.Add(readable, writable, ind)
	if err != nil {
		qu.mu.Unlock()
		if p.table != 0 {
			f.Free(p.table)
		}
		return nil, fmt.Errorf("frontend: queue %d: %w", q, err)
	}
	p.head = head
	qu.pending[head] = p
	kick := qu.drv.NeedsKick()
	qu.mu.Unlock()
	if kick {
		if err := f.Kick(q); err != nil {
			return p, fmt.Errorf("frontend: kick: %w", err)
		}
	}
	return p, nil
}

// Wait waits for the request to be used by the device and returns the bytes it wrote. If ctx ends
// first the request stays in flight and Wait may be called again. A request alone in flight on
// its queue is reaped by its own Wait, in a blocking poll(2) on the goroutine's thread; with
// others in flight a reaper goroutine completes it (see the package doc).
func (p *Pending) Wait(ctx context.Context) (uint32, error) {
	q := p.q
	for {
		select {
		case <-p.done:
			return p.written, p.err
		default:
		}
		q.mu.Lock()
		if !q.reaping && !q.closed && !p.finished { // Close fails every request before it sets closed
			q.reaping = true
			if len(q.pending) == 1 { // p alone
				q.mu.Unlock()
				return p.reap(ctx)
			}
			go q.reapInFlight()
		}
		if q.handoff == nil {
			q.handoff = make(chan struct{})
		}
		handoff := q.handoff
		q.mu.Unlock()
		select {
		case <-p.done:
			return p.written, p.err
		case <-handoff:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// leave gives up the reaper role and wakes the waiters that wait for it. Called with mu held.
func (q *queue) leave() {
	q.reaping = false
	if q.handoff != nil {
		close(q.handoff)
		q.handoff = nil
	}
}

// reap is Wait as the queue's reaper: it pops used entries until p is done or ctx ends, then
// leaves the role.
func (p *Pending) reap(ctx context.Context) (uint32, error) {
	q := p.q
	var stop func() bool
	defer func() {
		if stop != nil {
			stop()
		}
		q.mu.Lock()
		q.leave()
		q.mu.Unlock()
	}()
	for {
		if q.reap(p) {
			return p.written, p.err
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if stop == nil && ctx.Done() != nil {
			// If ctx ends from here on, the poll below returns.
			stop = context.AfterFunc(ctx, q.interrupt)
		}
		if err := q.sleep(); err != nil {
			return 0, err
		}
	}
}

// reapInFlight is the reaper goroutine a Wait starts, having taken the role for it, when its
// request is not alone in flight: it pops used entries until no request is in flight (or Close),
// then leaves the role. The waiters wait on their requests' done channels meanwhile.
//
// It reads the call eventfd through Go's netpoller (a duplicate of it, registered for this
// goroutine's lifetime only, so that a lone request's wake-up wakes no netpoller thread): the
// completions of requests in flight together then come in the batches a scheduler hand-off
// gathers, and the reaper's wake-up and its waiters' share a thread.
func (q *queue) reapInFlight() {
	var call *os.File
	if fd, err := unix.Dup(q.call); err == nil {
		unix.CloseOnExec(fd)
		call = os.NewFile(uintptr(fd), fmt.Sprintf("call%d", q.idx))
	}
	// The duplicate is closed before the role is left: Close waits for that, then checks nothing
	// of ours is open.
	defer func() {
		if call != nil {
			call.Close()
		}
		q.mu.Lock()
		q.leave()
		q.mu.Unlock()
	}()
	var b [8]byte
	for {
		q.reap(nil)
		q.mu.Lock()
		over := len(q.pending) == 0 || q.closed
		q.mu.Unlock()
		if over {
			return
		}
		var err error
		if call != nil {
			_, err = call.Read(b[:])
		} else {
			err = q.sleep()
		}
		if err != nil {
			// Not expected of an eventfd; the role goes back to the waiters, whose next
			// one starts over.
			return
		}
	}
}

// sleep is the reaper's wait: poll(2) on the call eventfd and the wake eventfd, then read the
// ones that fired. A completion signalled after this read signals again.
func (q *queue) sleep() error {
	fds := [2]unix.PollFd{{Fd: int32(q.call), Events: unix.POLLIN}, {Fd: int32(q.wake), Events: unix.POLLIN}}
	if _, err := unix.Poll(fds[:], -1); err != nil {
		if err == unix.EINTR {
			return nil
		}
		return fmt.Errorf("frontend: queue %d: poll: %w", q.idx, err)
	}
	var b [8]byte
	if fds[0].Revents != 0 {
		unix.Read(q.call, b[:])
	}
	if fds[1].Revents != 0 {
		unix.Read(q.wake, b[:])
	}
	return nil
}

// interrupt makes the queue's reaper, if any, return from its poll and look again.
func (q *queue) interrupt() {
	var b [8]byte
	b[0] = 1
	unix.Write(q.wake, b[:]) // EAGAIN: the counter is saturated, the reaper wakes anyway
	unix.Write(q.call, b[:]) // the reaper goroutine reads only this one; a reaper looks again
}

// Head returns the descriptor head of the request.
func (p *Pending) Head() uint16 { return p.head }

// Submit is SubmitAsync followed by Wait.
func (f *Frontend) Submit(ctx context.Context, q int, readable, writable []virtq.Buf) (uint32, error) {
	p, err := f.SubmitAsync(q, readable, writable)
	if err != nil {
		return 0, err
	}
	return p.Wait(ctx)
}

// finish completes p. Called with the queue's mu held.
func (p *Pending) finish(written uint32, err error) {
	if p.table != 0 {
		p.f.Free(p.table)
	}
	p.written, p.err, p.finished = written, err, true
	close(p.done)
}

// reap completes the used chains of the queue and asks the device for an interrupt at the next
// completion, popping again if one came in between. Called by the queue's reaper; it reports
// whether mine (nil for none) is done.
func (q *queue) reap(mine *Pending) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for {
		if q.drv != nil {
			for {
				head, written, ok := q.drv.PopUsed()
				if !ok {
					break
				}
				if p := q.pending[head]; p != nil { // unknown heads come from raw use or a bad device
					delete(q.pending, head)
					p.finish(written, nil)
				}
			}
		}
		if mine != nil && mine.finished {
			return true
		}
		if q.drv == nil || !q.drv.EnableInterrupts() {
			return false
		}
	}
}

// failPending fails every request in flight with err and wakes the reaper, whose request is
// one of them.
func (q *queue) failPending(err error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.failPendingLocked(err)
}

func (q *queue) failPendingLocked(err error) {
	for head, p := range q.pending {
		delete(q.pending, head)
		p.finish(0, err)
	}
	if q.reaping {
		q.interrupt()
	}
}

// close fails the requests in flight with ErrClosed, refuses new ones and waits for the reaper
// to leave, after which nothing uses the queue's eventfds.
func (q *queue) close() {
	q.mu.Lock()
	q.closed = true
	q.failPendingLocked(ErrClosed)
	for q.reaping {
		if q.handoff == nil {
			q.handoff = make(chan struct{})
		}
		h := q.handoff
		q.mu.Unlock()
		<-h
		q.mu.Lock()
	}
	q.mu.Unlock()
}
