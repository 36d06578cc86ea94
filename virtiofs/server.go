// Package virtiofs is kvfsd as a library: a vhost-user-fs back-end that serves a host directory
// to a guest over virtio-fs. A Server runs in whatever process owns it — kvfsd, or the per-pod
// sandbox — on a listener that process created.
//
// The data path, from the socket to the syscall and back:
//
//	vhostuser.Backend   messages from the front-end (QEMU): features, memory table, vrings
//	  → device          one goroutine per started vring; each descriptor chain is a request
//	  → fuse.Server     decodes the request out of guest memory and dispatches it
//	  → passthrough.FS  *at() syscalls on O_PATH fds under the shared directory
//	  ← fuse.Server     writes the reply straight into the chain's writable guest buffers
//	  ← virtq.Queue     used ring update, then the call eventfd if the guest wants it
//
// A request that has to wait (SETLKW with -o posix_lock or -o flock) does not hold up its
// queue: it stays in flight while the next ones are served, and its reply is written later, on
// the ring's goroutine again (see device).
//
// With a front-end that has a DAX window (the DAX-capable QEMU Kata ships), a guest that wants
// DAX maps file ranges into it: FUSE SETUPMAPPING/REMOVEMAPPING become FS_MAP/FS_UNMAP requests
// on the vhost-user back-end channel, sent from the queue goroutine serving the request, never
// from the vhost-user message loop. Which files the guest should map is the host's DAX policy
// (Config.DAX, SetDAXPolicy; passthrough's dax.go).
//
// The guest is treated as hostile at every layer; each package documents what it checks.
package virtiofs

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/containerd/log"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
)

// Server serves one shared directory to one front-end connection at a time.
type Server struct {
	cfg     Config
	fs      *passthrough.FS
	fuse    *fuse.Server
	dev     *device
	backend *vhostuser.Backend

	mu      sync.Mutex
	cancel  context.CancelFunc // of the running Serve; guarded by mu
	serving chan struct{}      // closed when the running Serve returns; guarded by mu
	closed  bool               // guarded by mu
}

// NewServer opens the shared directory and returns a server for it. Like virtiofsd, it sets the
// process umask to 0, so that the guest's umask alone decides the modes of the files it
// creates: a process that runs a server in-process must give explicit modes to what it creates
// itself (the sandbox package does).
func NewServer(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	window := &daxWindow{}
	opts := passthroughOptions(&cfg)
	opts.DAXWindow = window
	fs, err := passthrough.New(cfg.SharedDir, opts)
	if err != nil {
		return nil, fmt.Errorf("shared directory %s: %w", cfg.SharedDir, err)
	}
	if cfg.InodeFileHandles == passthrough.FileHandlesPrefer && !fs.UsesFileHandles() {
		log.L.Warn("inode file handles cannot be opened (open_by_handle_at needs CAP_DAC_READ_SEARCH): every cached inode holds a descriptor")
	}
	s := &Server{cfg: cfg, fs: fs}
	s.fuse = fuse.NewServer(fs, fuse.Options{InitFlags: initFlags(&cfg), Logger: log.L})
	s.dev = newDevice(s.fuse, cfg.ThreadPoolSize)
	var bopts []vhostuser.Option
	if cfg.ThreadPoolSize == 0 {
		// The rings serve the requests themselves: see WithRingProcs. With a pool, the
		// workers would run on the extra Ps and wake more threads
		// (docs/measurements/performance.md).
		bopts = append(bopts, vhostuser.WithRingProcs())
	}
	if cfg.PollMax > 0 {
		// The request queues only: the high-priority queue carries FORGETs, which have no
		// reply that anyone waits for.
		bopts = append(bopts, vhostuser.WithAdaptivePolling(cfg.PollMax, func(idx int) bool { return idx >= 1 }))
	}
	s.backend = vhostuser.NewBackend(s.dev, bopts...)
	window.b = s.backend
	return s, nil
}

// SetDAXPolicy replaces the DAX policy at run time: requests already running finish with the
// old one, later ones use the new one. See Config.DAX.
func (s *Server) SetDAXPolicy(p passthrough.DAXPolicy) error { return s.fs.SetDAXPolicy(p) }

// DAXPolicy returns the current DAX policy.
func (s *Server) DAXPolicy() passthrough.DAXPolicy { return s.fs.DAXPolicy() }

// daxWindow is the front-end's DAX window as passthrough sees it: FS_MAP and FS_UNMAP on the
// vhost-user back-end channel. Its requests come from the queue goroutines (FUSE SETUPMAPPING,
// REMOVEMAPPING), never from the vhost-user message loop.
type daxWindow struct {
	b *vhostuser.Backend // set once, before the server serves
}

// Available asks the front-end whether it has a DAX window: an FS_UNMAP without ranges is a
// no-op for the DAX-capable QEMU and an unknown request, answered with failure, for upstream
// QEMU. It is asked at INIT, only of a guest that wants DAX (a Linux guest asks for
// MAP_ALIGNMENT only when its device shows a window), on the queue goroutine serving INIT.
func (w *daxWindow) Available() bool {
	return w.b.FSMapAvailable() && w.b.FSUnmap(&vhostuser.FSMapMsg{}) == nil
}

func (w *daxWindow) Map(fd int, foffset, moffset, length uint64, write bool) error {
	var m vhostuser.FSMapMsg
	m.FDOffset[0], m.CacheOffset[0], m.Len[0], m.Flags[0] = foffset, moffset, length, vhostuser.FSMapRead
	if write {
		m.Flags[0] |= vhostuser.FSMapWrite
	}
	return w.b.FSMap(&m, fd)
}

// Unmap sends the ranges FSMsgEntries at a time.
func (w *daxWindow) Unmap(ranges []fuse.RemovemappingOne) error {
	for len(ranges) > 0 {
		var m vhostuser.FSMapMsg
		n := 0
		for n < vhostuser.FSMsgEntries && n < len(ranges) {
			m.CacheOffset[n], m.Len[n] = ranges[n].Moffset, ranges[n].Len
			n++
		}
		if err := w.b.FSUnmap(&m); err != nil {
			return err
		}
		ranges = ranges[n:]
	}
	return nil
}

// passthroughOptions maps the cache mode onto what the guest is told to cache.
func passthroughOptions(cfg *Config) passthrough.Options {
	o := passthrough.Options{
		EntryTimeout:      cfg.EntryAttrTimeout(),
		AttrTimeout:       cfg.EntryAttrTimeout(),
		Xattr:             cfg.XattrEnabled(),
		PosixACL:          cfg.PosixACL,
		SecurityLabel:     cfg.SecurityLabel,
		AnnounceSubmounts: cfg.AnnounceSubmounts,
		ReadOnly:          cfg.ReadOnly,
		PreserveNoatime:   cfg.PreserveNoatime,
		DAX:               cfg.DAX,
		FileHandles:       cfg.InodeFileHandles,
		ProcSelfFd:        cfg.ProcSelfFd,
	}
	if cfg.XattrMap != "" {
		o.XattrMap, _ = passthrough.ParseXattrMap(cfg.XattrMap) // Validate accepted it
	}
	if len(cfg.TranslateUID) > 0 {
		o.UIDs, _ = passthrough.NewIDTranslation(cfg.TranslateUID) // Validate accepted them
	}
	if len(cfg.TranslateGID) > 0 {
		o.GIDs, _ = passthrough.NewIDTranslation(cfg.TranslateGID)
	}
	switch cfg.Cache {
	case CacheNever:
		o.DirectIO = true
	case CacheMetadata:
		o.DirectIO, o.CacheDir = true, true
	case CacheAlways:
		o.KeepCache, o.CacheDir = true, true
	}
	return o
}

// initFlags are the INIT flags offered beyond the FUSE server's base set.
func initFlags(cfg *Config) uint64 {
	var f uint64
	if cfg.ReaddirplusEnabled() {
		f |= fuse.InitDoReaddirplus | fuse.InitReaddirplusAuto
	}
	if cfg.Writeback {
		f |= fuse.InitWritebackCache
	}
	if cfg.AnnounceSubmounts {
		f |= fuse.InitSubmounts
	}
	if cfg.PosixLock {
		f |= fuse.InitPosixLocks
	}
	if cfg.Flock {
		f |= fuse.InitFlockLocks
	}
	if cfg.KillprivV2Enabled() {
		f |= fuse.InitHandleKillprivV2
	}
	if cfg.PosixACL {
		f |= fuse.InitPosixACL | fuse.InitDontMask | fuse.InitSetxattrExt
	}
	if cfg.SecurityLabel {
		f |= fuse.InitSecurityCtx
	}
	if cfg.AllowMmap {
		f |= fuse.InitDirectIOAllowMmap
	}
	return f
}

// Serve accepts one front-end connection on l, closes l (like virtiofsd, which serves a single
// VM), and serves the connection until the front-end disconnects, when it returns nil, or ctx
// is cancelled or Close is called.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return net.ErrClosed
	}
	if s.cancel != nil {
		s.mu.Unlock()
		return errors.New("server is already serving")
	}
	s.cancel, s.serving = cancel, make(chan struct{})
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		close(s.serving)
		s.cancel, s.serving = nil, nil
		s.mu.Unlock()
	}()

	stop := context.AfterFunc(ctx, func() { l.Close() })
	conn, err := l.AcceptUnix()
	l.Close()
	if !stop() || ctx.Err() != nil {
		if conn != nil {
			conn.Close()
		}
		return ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("accepting the vhost-user front-end: %w", err)
	}
	log.G(ctx).Info("vhost-user front-end connected")
	err = s.backend.Serve(ctx, conn)
	if err == nil {
		log.G(ctx).Info("vhost-user front-end disconnected")
	}
	return err
}

// Stats are a server's counters.
type Stats struct {
	// FUSE counts requests per opcode, errors, latencies and bytes moved.
	FUSE fuse.Stats
	// FS counts cached inodes and open files.
	FS passthrough.Stats
	// InFlight is the number of requests taken from the virtqueues and not yet answered,
	// those waiting for a lock included: the depth of the server's own queue.
	InFlight uint64
}

// Stats returns a snapshot of the server's counters.
func (s *Server) Stats() Stats {
	return Stats{FUSE: s.fuse.Stats(), FS: s.fs.Stats(), InFlight: s.dev.inFlight()}
}

// Close stops a running Serve, waits for it to return, and releases the shared directory.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	serving := s.serving
	if s.cancel != nil {
		s.cancel()
	}
	s.mu.Unlock()
	if serving != nil {
		<-serving
	}
	s.dev.close()
	s.fuse.CancelWaiting() // none are left once Serve returned (device Reset); for safety
	return s.fs.Close()
}
