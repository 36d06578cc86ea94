// Package fuse is the FUSE half of the virtio-fs device: it turns one request, given as the
// device-readable and device-writable buffers of a descriptor chain, into calls on a FileSystem
// and writes the reply. It knows nothing about virtqueues; a request is bytes in, bytes out.
//
// # Threat model
//
// Every byte of a request comes from the guest and may be hostile; the buffers are guest
// memory the guest can rewrite while we look at them. The header and the arguments are
// therefore copied out once, into memory the guest cannot reach, before anything is checked or
// used; only WRITE payloads and READ destinations stay in guest memory, and those are just data.
// Lengths in the header are checked against the buffers actually given; names must be
// NUL-terminated, non-empty, at most 255 bytes and without '/', and a name that is not gets the
// errno Linux answers for it (ENOENT when empty, ENAMETOOLONG when too long; ERANGE for an
// xattr name) or EINVAL when no call could carry it (no NUL, a '/'); every reply is bounded by
// the writable space. A panic in a handler is recovered into EIO and logged, so one request can never
// take the server down. SETUPMAPPING and REMOVEMAPPING (DAX) are served only once DAX was
// negotiated; their flags, range counts (against the bytes actually sent), alignment and
// offset+length overflow are checked before the FileSystem sees them (dax.go).
//
// # Requests that wait
//
// A request may have to wait for something outside the server's control: SETLKW waits for a
// conflicting lock to go away, for as long as another owner keeps it. Such a request must not
// hold up the ones behind it on its queue, so it is deferred. The FileSystem returns a Waiter
// instead of blocking; HandleAsync then returns at once, reporting the request deferred and
// having written nothing, and the caller (the virtio-fs device) leaves the descriptor chain in
// flight and goes on with the next one. When the Waiter finishes, the server builds the reply in
// memory of its own and hands it to the caller's Completer, which writes it into the chain from
// wherever guest memory is safe to touch. Nothing of the request's guest buffers is kept: the
// arguments were copied out before dispatch, and the reply is never written by the server.
//
// A waiting request ends when its Waiter finishes, or is cancelled (answered EINTR, which the
// Linux guest turns into a restart of the system call) on INTERRUPT naming its unique, on
// DESTROY, on a second INIT and when the caller calls CancelWaiting (the device was reset or
// the front-end went away). At most maxWaiting requests wait at once; a SETLKW beyond that
// answers ENOLCK if its lock is taken. Handle, for callers that cannot defer, waits for the
// reply itself.
package fuse

import (
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// Limits on what a request may carry.
const (
	// MaxWrite is the largest WRITE (and READ) the server accepts; announced in INIT.
	MaxWrite = 1 << 20
	// MaxPages is MaxWrite in pages.
	MaxPages = MaxWrite / 4096
	// maxArgs bounds the copied arguments of any request but WRITE: a SETXATTR with a
	// 255-byte name and a 64 KiB value is the largest legitimate one.
	maxArgs = 1 << 17
	// maxNameLen is NAME_MAX.
	maxNameLen = 255
	// maxSymlinkLen is PATH_MAX, the longest symlink target.
	maxSymlinkLen = 4096
	// maxXattrSize is XATTR_SIZE_MAX, the largest xattr value or list.
	maxXattrSize = 1 << 16
	// maxReaddirSize bounds one READDIR reply.
	maxReaddirSize = MaxWrite
	// maxWaiting bounds the requests waiting at once (SETLKW). Each costs a goroutine and a
	// descriptor chain the guest cannot reuse; a real guest has a few blocked processes, a
	// hostile one could otherwise keep every descriptor of 17 queues waiting. A SETLKW beyond
	// it gets one non-blocking try, and ENOLCK if the lock is taken.
	maxWaiting = 4096

	inHeaderSize  = int(unsafe.Sizeof(InHeader{}))
	outHeaderSize = int(unsafe.Sizeof(OutHeader{}))
)

// baseInitFlags are offered to every guest; Options.InitFlags adds to them.
const baseInitFlags = InitAsyncRead | InitParallelDirops | InitBigWrites | InitAutoInvalData |
	InitAsyncDIO | InitAtomicOTrunc | InitMaxPages | InitInitExt

// Options configures a Server.
type Options struct {
	// InitFlags are INIT flags offered in addition to the base set (readdirplus, submounts,
	// writeback...), each granted only if the guest asks for it too.
	InitFlags uint64
	// Logger logs per-request debug lines and recovered panics; log.L by default.
	Logger *logrus.Entry
}

// Server decodes requests and dispatches them to a FileSystem. It is safe for concurrent use:
// each queue (or worker) calls Handle on its own goroutine.
type Server struct {
	fs      FileSystem
	flags   uint64 // offered INIT flags
	log     *logrus.Entry
	initMu  sync.Mutex // serialises INIT and DESTROY
	inited  atomic.Bool
	granted atomic.Uint64 // flags agreed at INIT
	// mapAlign is the log2 of the DAX map alignment agreed at INIT (with InitMapAlignment).
	mapAlign atomic.Uint32
	stats    stats
	pool     sync.Pool // *request

	waitMu  sync.Mutex
	waiting map[uint64]*deferred // waiting requests by unique; guarded by waitMu
	nwait   atomic.Int32         // requests in waiting
}

// NewServer returns a server for fs.
func NewServer(fs FileSystem, opts Options) *Server {
	s := &Server{fs: fs, flags: baseInitFlags | opts.InitFlags, log: opts.Logger}
	if s.log == nil {
		s.log = log.L
	}
	s.pool.New = func() any { return new(request) }
	return s
}

// Flags are the INIT flags agreed with the guest (0 before INIT).
func (s *Server) Flags() uint64 { return s.granted.Load() }

// request is the state of one request while it is handled; pooled.
type request struct {
	Context
	hdr     InHeader
	args    []byte   // copied arguments, consumed from the front by the decoders
	ext     []byte   // copied request extensions (7.38: total_extlen), after the arguments
	payload [][]byte // WRITE data, in guest memory
	out     [][]byte // device-writable guest buffers
	outCap  int      // bytes available in out
	body    []byte   // reply body built in memory
	direct  int      // reply body bytes already placed in out after the header (READ)
	noReply bool
	waiter  Waiter // set by a handler whose request waits (SETLKW)

	argBuf  []byte
	bodyBuf []byte
	iovBuf  [][]byte

	// hot holds the arguments and replies of the most frequent requests. Their addresses go
	// to the FileSystem interface, which makes a local variable escape to the heap on every
	// request; fields of the pooled request are on the heap already.
	hot struct {
		entry   EntryOut
		attr    AttrOut
		getattr GetattrIn
		read    ReadIn
		write   WriteIn
	}
	// scratch holds the argument and reply structs of the other fixed-size requests (inOnly,
	// inOut, outOnly, CREATE), for the same reason: see scratchIn.
	scratch struct {
		in, out [scratchSize / 8]uint64
	}
}

// epoch is when the package was initialised. Request latencies are taken as offsets from it
// (monoNow), which reads only the monotonic clock: time.Now reads the wall clock as well, a
// clock read more per request for a time nothing looks at.
var epoch = time.Now()

// monoNow is the monotonic time since epoch.
func monoNow() time.Duration { return time.Since(epoch) }

// Handle serves one request: in are the device-readable buffers, out the device-writable ones.
// It returns the number of bytes written into out (the used length of the chain). A request
// that has to wait (SETLKW) blocks Handle until it finishes: callers that must not block use
// HandleAsync.
func (s *Server) Handle(in, out [][]byte) int {
	var c syncCompleter
	n, deferred := s.HandleAsync(in, out, &c, 0)
	if !deferred {
		return n
	}
	reply := <-c.wait()
	return scatter(out, 0, reply)
}

// Completer receives the replies of requests that HandleAsync deferred.
type Completer interface {
	// CompleteDeferred is called once per deferred request, from any goroutine, with the tag
	// given to HandleAsync and the whole reply (header and body; empty when the request offered
	// no room for one). reply belongs to the callee. It must not block for long.
	CompleteDeferred(tag uint64, reply []byte)
}

// syncCompleter is Handle's Completer: it hands the reply to the waiting Handle.
type syncCompleter struct {
	once sync.Once
	ch   chan []byte
}

func (c *syncCompleter) wait() chan []byte {
	c.once.Do(func() { c.ch = make(chan []byte, 1) })
	return c.ch
}

func (c *syncCompleter) CompleteDeferred(_ uint64, reply []byte) { c.wait() <- reply }

// HandleAsync serves one request like Handle, except that a request that has to wait (SETLKW)
// is deferred: HandleAsync then returns (0, true) at once without having written anything into
// out, keeps no reference to in or out, and later calls c.CompleteDeferred(tag, reply) exactly
// once with the reply, which the caller writes into the request's writable buffers. See the
// package documentation.
func (s *Server) HandleAsync(in, out [][]byte, c Completer, tag uint64) (written int, deferred bool) {
	r := s.pool.Get().(*request)
	defer s.put(r)
	start := monoNow()

	if gather(AsBytes(&r.hdr), in, 0) < inHeaderSize {
		// Not even a header: there is no unique to answer to.
		s.stats.malformed.Add(1)
		return 0, false
	}
	r.Context = Context{Opcode: Opcode(r.hdr.Opcode), Unique: r.hdr.Unique, NodeID: r.hdr.NodeID,
		UID: r.hdr.UID, GID: r.hdr.GID, PID: r.hdr.PID}
	r.out = out
	r.outCap = iovLen(out)

	errno := s.decode(r, in)
	if errno == OK {
		errno = s.dispatch(r)
	}
	if r.waiter != nil {
		s.deferReply(r, c, tag, start)
		return 0, true
	}
	if r.noReply {
		s.stats.record(r.Opcode, errno, monoNow()-start)
		s.debug(r, errno, start)
		return 0, false
	}
	written = r.reply(errno)
	s.stats.record(r.Opcode, errno, monoNow()-start)
	s.debug(r, errno, start)
	return written, false
}

// deferred is a request waiting for its Waiter. It keeps what the reply needs, nothing of the
// guest's buffers.
type deferred struct {
	s        *Server
	op       Opcode
	unique   uint64
	node     uint64
	hasOut   bool          // the request offered room for a reply header
	start    time.Duration // monoNow
	c        Completer
	tag      uint64
	w        Waiter
	next     *deferred     // another waiting request with the same unique (a hostile guest); guarded by s.waitMu
	finished chan struct{} // closed once the reply was handed over
}

// deferReply registers r's waiter, so that INTERRUPT and the cancellations can find it, and
// starts it.
func (s *Server) deferReply(r *request, c Completer, tag uint64, start time.Duration) {
	d := &deferred{s: s, op: r.Opcode, unique: r.Unique, node: r.NodeID,
		hasOut: r.outCap >= outHeaderSize, start: start, c: c, tag: tag, w: r.waiter,
		finished: make(chan struct{})}
	s.waitMu.Lock()
	if s.waiting == nil {
		s.waiting = make(map[uint64]*deferred)
	}
	d.next = s.waiting[d.unique]
	s.waiting[d.unique] = d
	s.nwait.Add(1)
	s.waitMu.Unlock()
	d.w.Start(d.finish)
}

// finish is the Waiter's done: unregister, build the reply, hand it over.
func (d *deferred) finish(errno Errno) {
	s := d.s
	s.waitMu.Lock()
	if head := s.waiting[d.unique]; head == d {
		if d.next == nil {
			delete(s.waiting, d.unique)
		} else {
			s.waiting[d.unique] = d.next
		}
	} else {
		for p := head; p != nil; p = p.next {
			if p.next == d {
				p.next = d.next
				break
			}
		}
	}
	s.nwait.Add(-1)
	s.waitMu.Unlock()

	var reply []byte
	if d.hasOut {
		h := OutHeader{Len: uint32(outHeaderSize), Error: -int32(errno), Unique: d.unique}
		reply = append([]byte(nil), AsBytes(&h)...)
	}
	s.stats.record(d.op, errno, monoNow()-d.start)
	if s.log.Logger.IsLevelEnabled(logrus.DebugLevel) {
		s.log.WithFields(logrus.Fields{"opcode": d.op.String(), "unique": d.unique, "node": d.node,
			"result": errnoName(errno), "latency": monoNow() - d.start}).Debug("fuse request (waited)")
	}
	d.c.CompleteDeferred(d.tag, reply)
	close(d.finished)
}

// interrupt cancels the waiting requests with this unique (FUSE INTERRUPT). A request that is
// not waiting is not interruptible: it is answered when it finishes, which is soon.
func (s *Server) interrupt(unique uint64) {
	s.waitMu.Lock()
	var ws []Waiter
	for d := s.waiting[unique]; d != nil; d = d.next {
		ws = append(ws, d.w)
	}
	s.waitMu.Unlock()
	for _, w := range ws {
		w.Cancel()
	}
}

// CancelWaiting cancels every waiting request and returns once each has been answered (EINTR,
// unless it finished first). The device calls it when it is reset or the front-end goes away;
// DESTROY and a second INIT do the same.
func (s *Server) CancelWaiting() {
	s.waitMu.Lock()
	var all []*deferred
	for _, d := range s.waiting {
		for ; d != nil; d = d.next {
			all = append(all, d)
		}
	}
	s.waitMu.Unlock()
	for _, d := range all {
		d.w.Cancel()
	}
	for _, d := range all {
		<-d.finished
	}
}

// Waiting reports how many requests are waiting.
func (s *Server) Waiting() int { return int(s.nwait.Load()) }

func (s *Server) put(r *request) {
	argBuf, bodyBuf, iovBuf := r.argBuf, r.bodyBuf, r.iovBuf
	clear(iovBuf[:cap(iovBuf)])
	*r = request{argBuf: argBuf, bodyBuf: bodyBuf[:0], iovBuf: iovBuf[:0]}
	s.pool.Put(r)
}

// decode checks the header against the buffers and copies the arguments out of guest memory.
func (s *Server) decode(r *request, in [][]byte) Errno {
	total := iovLen(in)
	length := int(r.hdr.Len)
	if length < inHeaderSize || length > total {
		return unix.EINVAL
	}
	end := length - int(r.hdr.TotalExtlen)*8
	if end < inHeaderSize {
		return unix.EINVAL
	}
	if r.Opcode == OpWrite {
		var w WriteIn
		if gather(AsBytes(&w), in, inHeaderSize) < int(unsafe.Sizeof(w)) ||
			end-inHeaderSize-int(unsafe.Sizeof(w)) != int(w.Size) {
			return unix.EINVAL
		}
		if w.Size > MaxWrite {
			return unix.EFBIG
		}
		r.args = append(r.argBuf[:0], AsBytes(&w)...)
		r.argBuf = r.args
		r.payload = subIovecs(r.iovBuf[:0], in, inHeaderSize+int(unsafe.Sizeof(w)), int(w.Size))
		r.iovBuf = r.payload
		return OK
	}
	n := length - inHeaderSize
	if n > maxArgs {
		return unix.E2BIG
	}
	if cap(r.argBuf) < n {
		r.argBuf = make([]byte, n, max(n, 4096))
	}
	buf := r.argBuf[:n]
	gather(buf, in, inHeaderSize)
	r.args, r.ext = buf[:end-inHeaderSize], buf[end-inHeaderSize:]
	return OK
}

// dispatch runs the handler of r's opcode, turning a panic into EIO.
func (s *Server) dispatch(r *request) (errno Errno) {
	defer func() {
		if p := recover(); p != nil {
			s.log.WithFields(logrus.Fields{"opcode": r.Opcode.String(), "unique": r.Unique,
				"panic": p}).Errorf("request handler panicked; answering EIO\n%s", debug.Stack())
			s.stats.panics.Add(1)
			errno = unix.EIO
		}
	}()
	// FORGET, BATCH_FORGET and INTERRUPT are never answered, whatever becomes of them (before
	// INIT and after DESTROY too): their sender waits for no reply.
	r.noReply = r.Opcode == OpForget || r.Opcode == OpBatchForget || r.Opcode == OpInterrupt
	var h handler
	if r.Opcode < opcodeLimit {
		h = handlers[r.Opcode]
	}
	if h == nil {
		return unix.ENOSYS
	}
	if !s.inited.Load() && r.Opcode != OpInit {
		return unix.EIO
	}
	return h(s, r)
}

// reply writes the header and body into the writable buffers and returns the bytes written.
func (r *request) reply(errno Errno) int {
	if r.outCap < outHeaderSize {
		return 0
	}
	size := outHeaderSize
	if errno == OK {
		size += len(r.body) + r.direct
		if size > r.outCap {
			errno, size = unix.ERANGE, outHeaderSize
		}
	}
	h := OutHeader{Len: uint32(size), Error: -int32(errno), Unique: r.Unique}
	scatter(r.out, 0, AsBytes(&h))
	if errno == OK && len(r.body) > 0 {
		scatter(r.out, outHeaderSize, r.body)
	}
	if errno != OK {
		return outHeaderSize
	}
	return size
}

func (s *Server) debug(r *request, errno Errno, start time.Duration) {
	if !s.log.Logger.IsLevelEnabled(logrus.DebugLevel) {
		return
	}
	s.log.WithFields(logrus.Fields{
		"opcode":  r.Opcode.String(),
		"unique":  r.Unique,
		"node":    r.NodeID,
		"result":  errnoName(errno),
		"latency": monoNow() - start,
	}).Debug("fuse request")
}

func errnoName(e Errno) string {
	if e == OK {
		return "ok"
	}
	return unix.ErrnoName(e)
}
