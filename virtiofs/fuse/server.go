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
// NUL-terminated, non-empty, at most 255 bytes and without '/'; every reply is bounded by the
// writable space. A panic in a handler is recovered into EIO and logged, so one request can never
// take the server down.
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
	stats   stats
	pool    sync.Pool // *request
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
	payload [][]byte // WRITE data, in guest memory
	out     [][]byte // device-writable guest buffers
	outCap  int      // bytes available in out
	body    []byte   // reply body built in memory
	direct  int      // reply body bytes already placed in out after the header (READ)
	noReply bool

	argBuf  []byte
	bodyBuf []byte
	iovBuf  [][]byte
}

// Handle serves one request: in are the device-readable buffers, out the device-writable ones.
// It returns the number of bytes written into out (the used length of the chain).
func (s *Server) Handle(in, out [][]byte) (written int) {
	r := s.pool.Get().(*request)
	defer s.put(r)
	start := time.Now()

	if gather(AsBytes(&r.hdr), in, 0) < inHeaderSize {
		// Not even a header: there is no unique to answer to.
		s.stats.malformed.Add(1)
		return 0
	}
	r.Context = Context{Opcode: Opcode(r.hdr.Opcode), Unique: r.hdr.Unique, NodeID: r.hdr.NodeID,
		UID: r.hdr.UID, GID: r.hdr.GID, PID: r.hdr.PID}
	r.out = out
	r.outCap = iovLen(out)

	errno := s.decode(r, in)
	if errno == OK {
		errno = s.dispatch(r)
	}
	if r.noReply {
		s.stats.record(r.Opcode, errno, time.Since(start))
		s.debug(r, errno, start)
		return 0
	}
	written = r.reply(errno)
	s.stats.record(r.Opcode, errno, time.Since(start))
	s.debug(r, errno, start)
	return written
}

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
	n := end - inHeaderSize
	if n > maxArgs {
		return unix.E2BIG
	}
	if cap(r.argBuf) < n {
		r.argBuf = make([]byte, n, max(n, 4096))
	}
	r.args = r.argBuf[:n]
	gather(r.args, in, inHeaderSize)
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

func (s *Server) debug(r *request, errno Errno, start time.Time) {
	if !s.log.Logger.IsLevelEnabled(logrus.DebugLevel) {
		return
	}
	s.log.WithFields(logrus.Fields{
		"opcode":  r.Opcode.String(),
		"unique":  r.Unique,
		"node":    r.NodeID,
		"result":  errnoName(errno),
		"latency": time.Since(start),
	}).Debug("fuse request")
}

func errnoName(e Errno) string {
	if e == OK {
		return "ok"
	}
	return unix.ErrnoName(e)
}
