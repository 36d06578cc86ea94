package vhostuser

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// ErrUnsupported is wrapped by the error for a request the back-end does not implement.
var ErrUnsupported = errors.New("unsupported vhost-user request")

// Device is the virtio device a Backend serves.
type Device interface {
	// NumQueues is the total number of vrings (virtio-fs: 1 hiprio + N request queues). At most
	// 256 (the vring index of SET_VRING_KICK/CALL/ERR is 8 bits).
	NumQueues() int
	// Features returns the device-specific virtio feature bits (virtio-fs: none). Bits of the
	// transport range (24–49) are ignored: the Backend decides those.
	Features() uint64
	// HandleQueue processes what is available on vring idx. It is called on that vring's own
	// goroutine after each kick, with guest memory stable (the Backend holds the memory read lock
	// while it runs), so it must return promptly: SET_MEM_TABLE and GET_VRING_BASE wait for it.
	// A guest can publish chains as fast as they are served, so the device serves a bounded batch
	// and reports more when it stopped with chains still available; the Backend then calls it
	// again without waiting for a kick, after letting a stop or a memory update through. It
	// returns an error only when the ring is broken; the Backend then stops serving that ring,
	// signals its error eventfd and logs. It returns more false only after enabling kicks
	// (virtq.Queue.EnableNotify) and finding the ring empty: a ring that polls
	// (WithAdaptivePolling) calls it for a chain it saw with kicks still suppressed, and relies
	// on it to enable them.
	HandleQueue(idx int, vr *Vring) (more bool, err error)
	// Reset tells the device that the driver was reset (RESET_OWNER, RESET_DEVICE) or went away
	// (the front-end disconnected). All rings are stopped when it is called.
	Reset()
}

// Offered virtio features besides the device's own. VHOST_F_LOG_ALL is deliberately absent: the
// back-end keeps no dirty log, so it must not be migrated (QEMU 7.2 marks vhost-user-fs
// unmigratable anyway). NOTIFY_ON_EMPTY is not offered either (legacy; Linux does not use it).
const backendFeatures = FeatureVersion1 | FeatureIndirectDesc | FeatureEventIdx | FeatureProtocolFeatures

// transportFeatures are the feature bits reserved for the transport (virtio spec: 24–49); a
// device's Features() may not claim them.
const transportFeatures uint64 = (1<<50 - 1) &^ (1<<24 - 1)

// OfferedProtocolFeatures is the protocol feature offer. CONFIG (bit 9) must never be offered:
// QEMU 7.1–7.2.2 crash when a vhost-user-fs back-end advertises it. LOG_SHMFD is absent for the
// same reason as LOG_ALL.
const OfferedProtocolFeatures = ProtocolMQ | ProtocolReplyAck | ProtocolBackendReq |
	ProtocolBackendSendFD | ProtocolConfigureMemSlots

// Option configures a Backend.
type Option func(*Backend)

// WithPollInterval sets how often a ring whose kick was set with NOFD is polled (default 1 ms).
func WithPollInterval(d time.Duration) Option {
	return func(b *Backend) {
		if d > 0 {
			b.pollInterval = d
		}
	}
}

// WithAdaptivePolling makes the rings for which poll returns true (all of them if poll is nil)
// poll their avail ring after each batch, with the driver's kicks suppressed, for a window that
// adapts to how soon work comes and never exceeds limit, before they go back to sleep: a
// request published within the window is served without a kick and without the ring's
// thread going to sleep and being woken (Vring.run says how the window adapts). It costs a
// CPU spinning for up to limit after every batch, so it pays only where the host has CPUs to
// spare. limit ≤ 0 leaves polling off, the default.
func WithAdaptivePolling(limit time.Duration, poll func(idx int) bool) Option {
	return func(b *Backend) {
		b.pollMax, b.pollRing = max(limit, 0), poll
	}
}

// Backend serves one front-end connection at a time for a Device.
type Backend struct {
	dev            Device
	pollInterval   time.Duration
	pollMax        time.Duration  // WithAdaptivePolling; 0: off
	pollRing       func(int) bool // which rings poll; nil: all
	pollStart      time.Duration  // the first window (pollStartWindow; tests change it)
	pollEnd        func(idx int)  // tests: called when a poll runs out, before kicks are re-enabled
	backendTimeout time.Duration
	ringProcs      bool // WithRingProcs

	serving atomic.Bool

	reqMu     sync.Mutex      // serialises back-end requests (FSMap, FSUnmap) with their replies
	chMu      sync.Mutex      // guards backendCh
	backendCh *backendChannel // guarded by chMu
}

// NewBackend returns a Backend for dev.
func NewBackend(dev Device, opts ...Option) *Backend {
	b := &Backend{dev: dev, pollInterval: time.Millisecond, pollStart: pollStartWindow,
		backendTimeout: DefaultBackendTimeout}
	for _, o := range opts {
		o(b)
	}
	return b
}

// BackendChannel returns the back-end → front-end channel received with SET_BACKEND_REQ_FD, or nil.
// It is closed when it is replaced, breaks (FSMap, FSUnmap) or Serve returns. Requests on it use
// BackendRequest ids and the reply rules of front-end requests; FSMap and FSUnmap read their
// replies from it, so anyone else sending on it must not run at the same time.
func (b *Backend) BackendChannel() *Conn {
	b.chMu.Lock()
	defer b.chMu.Unlock()
	if b.backendCh == nil {
		return nil
	}
	return b.backendCh.c
}

// setBackendChannel installs ch (nil: none) and closes the previous channel, which fails a
// back-end request waiting on it. It never waits for reqMu: the message loop calls it.
func (b *Backend) setBackendChannel(ch *backendChannel) {
	b.chMu.Lock()
	old := b.backendCh
	b.backendCh = ch
	b.chMu.Unlock()
	if old != nil {
		old.c.Close()
	}
}

// dropBackendChannel closes ch and forgets it if it is still the current channel.
func (b *Backend) dropBackendChannel(ch *backendChannel) {
	b.chMu.Lock()
	if b.backendCh == ch {
		b.backendCh = nil
	}
	b.chMu.Unlock()
	ch.c.Close()
}

// Serve speaks the vhost-user protocol on conn until the front-end disconnects, a fatal protocol
// error occurs or ctx is cancelled. It returns nil when the front-end disconnects cleanly (EOF
// between messages). On return all rings are stopped, all guest memory is unmapped, every
// received fd is closed and conn is closed. Only one Serve may run at a time.
func (b *Backend) Serve(ctx context.Context, conn *net.UnixConn) error {
	if !b.serving.CompareAndSwap(false, true) {
		conn.Close()
		return errors.New("vhost-user backend: already serving a connection")
	}
	defer b.serving.Store(false)

	s, err := newSession(ctx, b, conn)
	if err != nil {
		conn.Close()
		return err
	}
	defer s.shutdown()

	// A read blocked in the netpoller returns once the deadline passes.
	stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()

	for {
		m, err := s.conn.ReadMessage()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err == io.EOF {
				log.G(ctx).Debug("vhost-user: front-end disconnected")
				return nil
			}
			return fmt.Errorf("vhost-user: reading request: %w", err)
		}
		if err := s.handle(m); err != nil {
			log.G(ctx).WithError(err).Error("vhost-user: closing connection")
			return err
		}
	}
}

// session is the state of one front-end connection.
type session struct {
	ctx  context.Context
	b    *Backend
	dev  Device
	conn *Conn

	// Owned by the message loop (Serve's goroutine); no lock.
	owner    bool
	offered  uint64 // virtio features offered
	acked    uint64 // virtio features acked with SET_FEATURES
	protocol uint64 // protocol features acked with SET_PROTOCOL_FEATURES

	rings []*Vring

	// memMu: the message loop takes it for writing to change mem or a ring's queue, and to wait
	// out a batch when it disables a ring; ring goroutines take it for reading while they touch
	// guest memory.
	memMu sync.RWMutex
	mem   *guestmem.Memory // guarded by memMu; written only by the message loop
}

func newSession(ctx context.Context, b *Backend, conn *net.UnixConn) (*session, error) {
	n := b.dev.NumQueues()
	if n < 1 || n > int(VringIndexMask)+1 {
		return nil, fmt.Errorf("vhost-user backend: device has %d queues, want 1..%d", n, VringIndexMask+1)
	}
	s := &session{
		ctx:     ctx,
		b:       b,
		dev:     b.dev,
		conn:    NewConn(conn),
		offered: backendFeatures | b.dev.Features()&^transportFeatures,
		rings:   make([]*Vring, n),
	}
	for i := range s.rings {
		s.rings[i] = &Vring{idx: i, s: s, kickFD: -1, wakeFD: -1, callFD: -1, errFD: -1}
	}
	return s, nil
}

// shutdown stops every ring, resets the device, unmaps memory and closes every fd.
func (s *session) shutdown() {
	for _, v := range s.rings {
		s.stopRing(v)
		v.closeFDs()
	}
	s.dev.Reset()
	s.memMu.Lock()
	mem := s.mem
	s.mem = nil
	s.memMu.Unlock()
	if err := mem.Close(); err != nil {
		log.G(s.ctx).WithError(err).Warn("vhost-user: unmapping guest memory")
	}
	s.b.setBackendChannel(nil)
	s.conn.Close()
}

// handle processes one message. An error return is fatal for the connection; a failed request
// that the front-end asked to have acknowledged (REPLY_ACK) is reported in the ack instead.
func (s *session) handle(m *Message) error {
	defer m.Close()
	l := log.G(s.ctx).WithField("request", m.Request.String())
	if log.GetLevel() >= log.DebugLevel {
		l.WithField("flags", m.Flags).WithField("size", m.Size).WithField("fds", len(m.FDs)).
			Debug("vhost-user request")
	}
	if err := m.CheckRequest(); err != nil {
		return err
	}
	reply, err := s.dispatch(m)
	needAck := m.NeedReply() && s.protocol&ProtocolReplyAck != 0 && !m.Request.HasReply()
	if err != nil {
		err = fmt.Errorf("%v: %w", m.Request, err)
		if !needAck {
			return err
		}
		l.WithError(err).Warn("vhost-user: request failed")
		return s.conn.WriteReply(m.Request, U64(1))
	}
	if reply != nil {
		return s.conn.WriteReply(m.Request, reply)
	}
	if needAck {
		return s.conn.WriteReply(m.Request, U64(0))
	}
	return nil
}

// dispatch decodes and executes one request and returns its reply body, if it has one.
func (s *session) dispatch(m *Message) (Payload, error) {
	p, err := Decode(m.Request, m.Payload, len(m.FDs))
	if err != nil {
		return nil, err
	}
	switch m.Request {
	case GetFeatures:
		return U64(s.offered), nil
	case SetFeatures:
		return nil, s.setFeatures(uint64(p.(U64)))
	case GetProtocolFeatures:
		return U64(OfferedProtocolFeatures), nil
	case SetProtocolFeatures:
		f := uint64(p.(U64))
		if extra := f &^ OfferedProtocolFeatures; extra != 0 {
			return nil, invalidf("protocol features %#x were not offered", extra)
		}
		s.protocol = f
		return nil, nil
	case SetOwner:
		if s.owner {
			return nil, errors.New("already owned")
		}
		s.owner = true
		return nil, nil
	case ResetOwner, ResetDevice:
		s.reset()
		if m.Request == ResetOwner {
			s.owner = false
		}
		return nil, nil
	case GetQueueNum:
		return U64(len(s.rings)), nil
	case GetMaxMemSlots:
		return U64(MaxMemSlots), nil
	case SetMemTable:
		return nil, s.setMemTable(m, p.(MemoryTable))
	case AddMemReg:
		return nil, s.addMemReg(m, p.(SingleRegion).Region)
	case RemMemReg:
		return nil, s.remMemReg(p.(SingleRegion).Region)
	case SetVringNum, SetVringBase, SetVringEnable:
		return nil, s.setVringState(m.Request, p.(VringState))
	case SetVringAddr:
		return nil, s.setVringAddr(p.(VringAddr))
	case GetVringBase:
		return s.getVringBase(p.(VringState))
	case SetVringKick:
		return nil, s.setVringKick(m, p.(VringFile))
	case SetVringCall, SetVringErr:
		return nil, s.setVringNotifier(m, p.(VringFile))
	case SetBackendReqFD:
		return nil, s.setBackendReqFD(m)
	case SetLogBase, SetLogFD:
		return nil, fmt.Errorf("%w: dirty logging was not offered (no LOG_ALL, no LOG_SHMFD)", ErrUnsupported)
	}
	return nil, ErrUnsupported
}

func (s *session) setFeatures(f uint64) error {
	if extra := f &^ s.offered; extra != 0 {
		return invalidf("features %#x were not offered", extra)
	}
	s.acked = f
	if f&FeatureProtocolFeatures == 0 {
		// Without PROTOCOL_FEATURES there is no SET_VRING_ENABLE: rings are enabled.
		for _, v := range s.rings {
			v.setEnabled(true)
		}
	}
	return nil
}

// reset stops all rings, forgets their configuration and the acked features, and resets the
// device (RESET_OWNER, RESET_DEVICE). Memory stays mapped: the next SET_MEM_TABLE replaces it.
func (s *session) reset() {
	for _, v := range s.rings {
		s.stopRing(v)
		v.closeFDs()
		v.num, v.addr, v.base, v.configured = 0, VringAddr{}, 0, 0
		v.enabled.Store(false)
	}
	s.acked = 0
	s.dev.Reset()
}

func (s *session) ring(idx uint32) (*Vring, error) {
	if idx >= uint32(len(s.rings)) {
		return nil, invalidf("vring index %d out of range (%d vrings)", idx, len(s.rings))
	}
	return s.rings[idx], nil
}

// Ring configuration items (Vring.configured bits).
const (
	configuredNum uint8 = 1 << iota
	configuredAddr
)

func (s *session) setVringState(req Request, st VringState) error {
	v, err := s.ring(st.Index)
	if err != nil {
		return err
	}
	if req == SetVringEnable {
		if st.Num > 1 {
			return invalidf("vring %d: enable value %d", st.Index, st.Num)
		}
		v.setEnabled(st.Num == 1)
		return nil
	}
	if v.running {
		return fmt.Errorf("vring %d is running", st.Index)
	}
	switch req {
	case SetVringNum:
		if st.Num == 0 || st.Num > MaxQueueSize || st.Num&(st.Num-1) != 0 {
			return invalidf("vring %d: size %d is not a power of two in 1..%d", st.Index, st.Num, MaxQueueSize)
		}
		v.num = uint16(st.Num) // MaxQueueSize fits
		v.configured |= configuredNum
	case SetVringBase:
		if st.Num > 0xffff {
			return invalidf("vring %d: base %d exceeds 16 bits", st.Index, st.Num)
		}
		v.base = uint16(st.Num)
	}
	return nil
}

func (s *session) setVringAddr(a VringAddr) error {
	v, err := s.ring(a.Index)
	if err != nil {
		return err
	}
	if v.running {
		return fmt.Errorf("vring %d is running", a.Index)
	}
	if a.Flags&^VringFlagLog != 0 {
		return invalidf("vring %d: unknown address flags %#x", a.Index, a.Flags)
	}
	if a.Flags&VringFlagLog != 0 {
		return fmt.Errorf("%w: vring %d: used-ring logging was not offered", ErrUnsupported, a.Index)
	}
	if a.Desc%16 != 0 || a.Avail%2 != 0 || a.Used%4 != 0 {
		return invalidf("vring %d: misaligned rings (desc %#x, avail %#x, used %#x)", a.Index, a.Desc, a.Avail, a.Used)
	}
	v.addr = a
	v.configured |= configuredAddr
	return nil
}

func (s *session) getVringBase(st VringState) (Payload, error) {
	v, err := s.ring(st.Index)
	if err != nil {
		return nil, err
	}
	s.stopRing(v)
	// libvhost-user closes both; the front-end sends new ones before the next start.
	v.setKickFD(-1)
	v.swapCall(-1)
	if s.acked&FeatureProtocolFeatures != 0 {
		v.enabled.Store(false) // the next start begins disabled again
	}
	return VringState{Index: st.Index, Num: uint32(v.base)}, nil
}

func (s *session) setVringKick(m *Message, f VringFile) error {
	v, err := s.ring(uint32(f.Index))
	if err != nil {
		return err
	}
	fd := -1
	if !f.NoFD {
		fd = m.TakeFD(0)
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return fmt.Errorf("vring %d: kick fd: %w", f.Index, err)
		}
	}
	// A kick for a running ring replaces its kick fd: stop it, swap, start it again.
	s.stopRing(v)
	v.setKickFD(fd)
	v.polled = f.NoFD
	if err := s.startRing(v); err != nil {
		v.setKickFD(-1)
		v.polled = false
		return err
	}
	return nil
}

func (s *session) setVringNotifier(m *Message, f VringFile) error {
	v, err := s.ring(uint32(f.Index))
	if err != nil {
		return err
	}
	fd := -1
	if !f.NoFD {
		fd = m.TakeFD(0)
		// Non-blocking, so a front-end handing us something that is not an eventfd cannot make
		// a notification block a ring goroutine.
		if err := unix.SetNonblock(fd, true); err != nil {
			unix.Close(fd)
			return fmt.Errorf("vring %d: notifier fd: %w", f.Index, err)
		}
	}
	if m.Request == SetVringErr {
		v.swapErr(fd)
		return nil
	}
	v.swapCall(fd)
	if fd >= 0 {
		// Like libvhost-user: signal the new fd once, in case a completion was signalled on the
		// old one and lost (a spurious interrupt is harmless).
		if err := signal(fd); err != nil {
			log.G(s.ctx).WithError(err).WithField("vring", v.idx).Warn("vhost-user: signalling new call fd")
		}
	}
	return nil
}

func (s *session) setBackendReqFD(m *Message) error {
	if s.protocol&ProtocolBackendReq == 0 {
		return errors.New("BACKEND_REQ was not negotiated")
	}
	f := os.NewFile(uintptr(m.TakeFD(0)), "vhost-user-backend-req")
	nc, err := net.FileConn(f) // dups the fd
	f.Close()
	if err != nil {
		return fmt.Errorf("backend request channel: %w", err)
	}
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		nc.Close()
		return fmt.Errorf("backend request channel is a %T, want a unix socket", nc)
	}
	const need = ProtocolReplyAck | ProtocolBackendSendFD
	s.b.setBackendChannel(&backendChannel{c: NewConn(uc), usable: s.protocol&need == need})
	return nil
}

// setMemTable replaces all guest memory: map every region, close the fds, swap, remap running
// rings, unmap the old regions.
func (s *session) setMemTable(m *Message, t MemoryTable) error {
	regions := make([]*guestmem.Region, 0, len(t.Regions))
	closeAll := func() {
		for _, r := range regions {
			r.Close()
		}
	}
	for i, r := range t.Regions {
		fd := m.TakeFD(i)
		reg, err := guestmem.MapFD(fd, r.GuestPhysAddr, r.Size, r.UserAddr, r.MmapOffset)
		unix.Close(fd)
		if err != nil {
			closeAll()
			return fmt.Errorf("region %d: %w", i, err)
		}
		regions = append(regions, reg)
	}
	mem, err := guestmem.New(regions...)
	if err != nil {
		closeAll()
		return err
	}
	old := s.mem
	err = s.swapMemory(mem)
	if cerr := old.Close(); cerr != nil {
		log.G(s.ctx).WithError(cerr).Warn("vhost-user: unmapping old guest memory")
	}
	return err
}

func (s *session) addMemReg(m *Message, r MemoryRegion) error {
	if n := len(s.mem.Regions()); n >= MaxMemSlots {
		return fmt.Errorf("all %d memory slots are in use", n)
	}
	fd := m.TakeFD(0)
	reg, err := guestmem.MapFD(fd, r.GuestPhysAddr, r.Size, r.UserAddr, r.MmapOffset)
	unix.Close(fd)
	if err != nil {
		return err
	}
	mem, err := s.mem.With(reg)
	if err != nil {
		reg.Close()
		return err
	}
	// The old Memory shares its regions with the new one: nothing to unmap.
	return s.swapMemory(mem)
}

func (s *session) remMemReg(r MemoryRegion) error {
	// mmap_offset is ignored: the spec matches on guest address, user address and size.
	mem, removed, err := s.mem.Without(r.GuestPhysAddr, r.Size, r.UserAddr)
	if err != nil {
		return err
	}
	err = s.swapMemory(mem)
	if cerr := removed.Close(); cerr != nil {
		log.G(s.ctx).WithError(cerr).Warn("vhost-user: unmapping removed region")
	}
	return err
}

// swapMemory installs mem under the memory write lock and remaps every running ring. A ring whose
// rings are no longer mapped is marked broken (it will not touch memory again).
func (s *session) swapMemory(mem *guestmem.Memory) error {
	var errs []error
	s.memMu.Lock()
	s.mem = mem
	for _, v := range s.rings {
		if v.q == nil || v.broken.Load() {
			continue
		}
		if err := v.q.Remap(mem); err != nil {
			v.broken.Store(true)
			errs = append(errs, fmt.Errorf("vring %d no longer mapped: %w", v.idx, err))
		}
	}
	s.memMu.Unlock()
	for _, v := range s.rings {
		if v.running && v.broken.Load() {
			v.wake() // let its goroutine notice and exit
		}
	}
	return errors.Join(errs...)
}

// startRing creates the ring's queue from its configuration and starts its goroutine.
func (s *session) startRing(v *Vring) error {
	if v.configured != configuredNum|configuredAddr {
		return fmt.Errorf("vring %d: started before SET_VRING_NUM and SET_VRING_ADDR", v.idx)
	}
	q, err := virtq.New(s.mem, virtq.Config{
		Size:      v.num,
		DescAddr:  v.addr.Desc,
		AvailAddr: v.addr.Avail,
		UsedAddr:  v.addr.Used,
		LastAvail: v.base,
		EventIdx:  s.acked&FeatureEventIdx != 0,
		Indirect:  s.acked&FeatureIndirectDesc != 0,
	})
	if err != nil {
		return fmt.Errorf("vring %d: %w", v.idx, err)
	}
	wakeFD, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return fmt.Errorf("vring %d: wake eventfd: %w", v.idx, err)
	}
	if s.acked&FeatureProtocolFeatures == 0 {
		v.enabled.Store(true)
	}
	s.memMu.Lock()
	v.q = q
	v.broken.Store(false)
	s.memMu.Unlock()
	v.stopping.Store(false)
	v.fdMu.Lock()
	v.wakeFD = wakeFD
	v.fdMu.Unlock()
	v.done = make(chan struct{})
	v.running = true
	v.pollMax, v.pollWindow = 0, 0
	if s.b.pollMax > 0 && (s.b.pollRing == nil || s.b.pollRing(v.idx)) {
		v.pollMax = s.b.pollMax
	}
	if s.b.ringProcs {
		addRingProc(1)
	}
	go v.run(s.ctx, v.kickFD, wakeFD, v.polled, s.b.pollInterval)
	log.G(s.ctx).WithField("vring", v.idx).WithField("size", v.num).WithField("base", v.base).
		Debug("vhost-user: vring started")
	return nil
}

// stopRing stops the ring's goroutine, waits for it and records the last available index as the
// ring's base. Its fds stay open.
func (s *session) stopRing(v *Vring) {
	if !v.running {
		return
	}
	v.stopping.Store(true)
	v.wake()
	<-v.done
	if s.b.ringProcs {
		addRingProc(-1)
	}
	v.fdMu.Lock()
	wakeFD := v.wakeFD
	v.wakeFD = -1
	v.fdMu.Unlock()
	unix.Close(wakeFD)
	s.memMu.Lock()
	v.base = v.q.LastAvail()
	v.q = nil
	s.memMu.Unlock()
	v.running = false
	log.G(s.ctx).WithField("vring", v.idx).WithField("base", v.base).Debug("vhost-user: vring stopped")
}
