package serverbench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"github.com/kvfs/kvfs/virtiofs/virtq"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// serverDriver runs the workloads through the front-end against a server process.
type serverDriver struct {
	d     *daemon
	fe    *frontend.Frontend
	c     *fuseclient.Client
	names []string // of the files in files/

	files    uint64 // node ID of files/
	create   uint64 // node ID of this server's create directory
	data     uint64 // node ID of the data file
	dataFh   uint64 // its handle, open read-write
	dataSize int64

	cursor    int          // next name of names to look up
	heldDir   uint64       // node ID of held/
	heldNames []string     // the files in held/
	held      []uint64     // their node IDs, each looked up once (relookup)
	seq       atomic.Int64 // next name to create

	killprivV2 bool // INIT negotiated HANDLE_KILLPRIV_V2
	noGetxattr bool // the server answered GETXATTR with ENOSYS: a guest stops asking
}

// forgetBatch is how many nodes one BATCH_FORGET carries.
const forgetBatch = 256

// dialServer connects to the server d listening at sock, negotiates FUSE as a Linux guest does
// and looks up what the workloads use.
func dialServer(ctx context.Context, d *daemon, sock string, sh *share, createDir string) (_ *serverDriver, err error) {
	fe, err := frontend.Dial(ctx, sock, frontend.Options{})
	if err != nil {
		return nil, err
	}
	s := &serverDriver{d: d, fe: fe, c: fuseclient.New(fe), names: sh.names, heldNames: sh.held, dataSize: sh.dataSize}
	defer func() {
		if err != nil {
			fe.Close()
		}
	}()
	init, err := s.c.Init(ctx, fuseclient.LinuxInitFlags)
	if err != nil {
		return nil, fmt.Errorf("INIT: %w", err)
	}
	s.killprivV2 = (uint64(init.Flags)|uint64(init.Flags2)<<32)&fuse.InitHandleKillprivV2 != 0
	if init.MaxWrite < 1<<20 {
		return nil, fmt.Errorf("INIT: max_write %d, the workloads need 1 MiB", init.MaxWrite)
	}
	for _, l := range []struct {
		name string
		node *uint64
	}{{filesDir, &s.files}, {heldDir, &s.heldDir}, {createDir, &s.create}, {dataFile, &s.data}} {
		e, err := s.c.Lookup(ctx, 1, l.name)
		if err != nil {
			return nil, fmt.Errorf("LOOKUP %s: %w", l.name, err)
		}
		*l.node = e.NodeID
	}
	for _, name := range s.heldNames {
		e, err := s.c.Lookup(ctx, s.heldDir, name)
		if err != nil {
			return nil, fmt.Errorf("LOOKUP %s: %w", name, err)
		}
		s.held = append(s.held, e.NodeID)
	}
	open, err := s.c.Open(ctx, s.data, unix.O_RDWR)
	if err != nil {
		return nil, fmt.Errorf("OPEN %s: %w", dataFile, err)
	}
	s.dataFh = open.Fh
	return s, nil
}

func (s *serverDriver) usage() (usage, error) { return s.d.usage() }

func (s *serverDriver) close() error {
	err := s.fe.Close()
	s.d.stop()
	return err
}

// forget drops the lookups counted in counts, in BATCH_FORGETs.
func (s *serverDriver) forget(ctx context.Context, items []fuse.ForgetOne) error {
	for len(items) > 0 {
		n := min(len(items), forgetBatch)
		if err := s.c.BatchForget(ctx, items[:n]); err != nil {
			return fmt.Errorf("BATCH_FORGET: %w", err)
		}
		items = items[n:]
	}
	return nil
}

func (s *serverDriver) lookupGetattr(ctx context.Context, m *meter) error {
	return s.lookupGetattrEach(ctx, m, s.files, func() (string, uint64) {
		name := s.names[s.cursor]
		s.cursor = (s.cursor + 1) % len(s.names)
		return name, 0
	})
}

func (s *serverDriver) relookup(ctx context.Context, m *meter) error {
	i := 0
	return s.lookupGetattrEach(ctx, m, s.heldDir, func() (string, uint64) {
		j := i % len(s.held)
		i++
		return s.heldNames[j], s.held[j]
	})
}

// lookupGetattrEach is LOOKUP and GETATTR of the files of directory dir that next names until m
// says to stop, then the FORGETs of the references taken. A node next gives (not 0) is the one
// the LOOKUP must find.
func (s *serverDriver) lookupGetattrEach(ctx context.Context, m *meter, dir uint64, next func() (name string, node uint64)) error {
	counts := map[uint64]uint64{}
	for {
		name, want := next()
		start := time.Now()
		e, err := s.c.Lookup(ctx, dir, name)
		if err != nil {
			return fmt.Errorf("LOOKUP %s: %w", name, err)
		}
		if want != 0 && e.NodeID != want {
			return fmt.Errorf("LOOKUP %s: node %d, looked up as %d before", name, e.NodeID, want)
		}
		if _, err := s.c.Getattr(ctx, e.NodeID, 0); err != nil {
			return fmt.Errorf("GETATTR %s: %w", name, err)
		}
		counts[e.NodeID]++
		if !m.done(start, 0) {
			break
		}
	}
	m.stop()
	items := make([]fuse.ForgetOne, 0, len(counts))
	for node, n := range counts {
		items = append(items, fuse.ForgetOne{NodeID: node, Nlookup: n})
	}
	return s.forget(ctx, items)
}

func (s *serverDriver) lookupForget(ctx context.Context, m *meter, seed uint64, depth int) error {
	defer m.stop()
	if depth > 1 {
		rngs := make([]*rand.Rand, depth)
		for w := range rngs {
			rngs[w] = nameRNG(seed + uint64(w)<<32)
		}
		return parallel(m, depth, 0, func(w int) error {
			return s.lookupOne(ctx, s.names[rngs[w].IntN(len(s.names))], true)
		})
	}
	rng := nameRNG(seed)
	for {
		start := time.Now()
		if err := s.lookupOne(ctx, s.names[rng.IntN(len(s.names))], true); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// lookupOne looks name up in files/, with a GETATTR if getattr, and forgets it.
func (s *serverDriver) lookupOne(ctx context.Context, name string, getattr bool) error {
	e, err := s.c.Lookup(ctx, s.files, name)
	if err != nil {
		return fmt.Errorf("LOOKUP %s: %w", name, err)
	}
	if getattr {
		if _, err := s.c.Getattr(ctx, e.NodeID, 0); err != nil {
			return fmt.Errorf("GETATTR %s: %w", name, err)
		}
	}
	if err := s.c.Forget(ctx, e.NodeID, 1); err != nil {
		return fmt.Errorf("FORGET %s: %w", name, err)
	}
	return nil
}

func (s *serverDriver) ioForgets(ctx context.Context, m *meter, p ioParams, seed uint64) error {
	var side []time.Duration
	var g errgroup.Group
	var over atomic.Bool // the READs are done (they may end before the deadline: meter.maxOps)
	g.Go(func() error {
		rng := nameRNG(^seed)
		for {
			start := time.Now()
			if err := s.lookupOne(ctx, s.names[rng.IntN(len(s.names))], false); err != nil {
				return err
			}
			now := time.Now()
			side = append(side, now.Sub(start))
			if !now.Before(m.deadline) || over.Load() {
				return nil
			}
		}
	})
	err := s.ioLoop(ctx, m, p, seed)
	over.Store(true)
	if gerr := g.Wait(); err == nil {
		err = gerr
	}
	m.merge(side, 0)
	m.stop()
	return err
}

func (s *serverDriver) createReleaseUnlink(ctx context.Context, m *meter, depth int) error {
	defer m.stop()
	if depth > 1 {
		return parallel(m, depth, 0, func(int) error { return s.createOne(ctx) })
	}
	for {
		start := time.Now()
		if err := s.createOne(ctx); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// createOne creates a new file in the create directory, releases it, unlinks it and forgets it.
func (s *serverDriver) createOne(ctx context.Context) error {
	name := "c" + strconv.FormatInt(s.seq.Add(1), 10)
	out, err := s.c.Create(ctx, s.create, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL, unix.S_IFREG|0o644)
	if err != nil {
		return fmt.Errorf("CREATE %s: %w", name, err)
	}
	if err := s.c.Release(ctx, out.Entry.NodeID, out.Open.Fh); err != nil {
		return fmt.Errorf("RELEASE %s: %w", name, err)
	}
	if err := s.c.Unlink(ctx, s.create, name); err != nil {
		return fmt.Errorf("UNLINK %s: %w", name, err)
	}
	if err := s.c.Forget(ctx, out.Entry.NodeID, 1); err != nil {
		return fmt.Errorf("FORGET %s: %w", name, err)
	}
	return nil
}

// readdirBuf is the reply size of READDIRPLUS: one page, as Linux 6.1's FUSE asks.
const readdirBuf = 4096

func (s *serverDriver) readdirplus(ctx context.Context, m *meter) error {
	defer m.stop()
	var items []fuse.ForgetOne
	for {
		start := time.Now()
		open, err := s.c.Opendir(ctx, s.files)
		if err != nil {
			return fmt.Errorf("OPENDIR: %w", err)
		}
		items = items[:0]
		var off uint64
		for {
			ents, err := s.c.Readdir(ctx, s.files, open.Fh, off, readdirBuf, true)
			if err != nil {
				return fmt.Errorf("READDIRPLUS at %d: %w", off, err)
			}
			if len(ents) == 0 {
				break
			}
			for _, e := range ents {
				if e.Entry.NodeID != 0 {
					items = append(items, fuse.ForgetOne{NodeID: e.Entry.NodeID, Nlookup: 1})
				}
				off = e.Off
			}
		}
		if err := s.c.Releasedir(ctx, s.files, open.Fh); err != nil {
			return fmt.Errorf("RELEASEDIR: %w", err)
		}
		if len(items) != len(s.names) {
			return fmt.Errorf("READDIRPLUS returned %d entries with a node, want %d", len(items), len(s.names))
		}
		if err := s.forget(ctx, items); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// dirStream is one stream of readdirPages: a listing of files/ in progress.
type dirStream struct {
	open  bool
	fh    uint64
	off   uint64
	items []fuse.ForgetOne // the entries returned so far, each looked up once
}

// page reads the listing's next non-empty page; at the end of a listing it closes it, forgets
// its entries, checks their number and starts the next listing.
func (s *serverDriver) page(ctx context.Context, st *dirStream) error {
	for {
		if !st.open {
			open, err := s.c.Opendir(ctx, s.files)
			if err != nil {
				return fmt.Errorf("OPENDIR: %w", err)
			}
			st.open, st.fh, st.off, st.items = true, open.Fh, 0, st.items[:0]
		}
		ents, err := s.c.Readdir(ctx, s.files, st.fh, st.off, readdirBuf, true)
		if err != nil {
			return fmt.Errorf("READDIRPLUS at %d: %w", st.off, err)
		}
		if len(ents) > 0 {
			for _, e := range ents {
				if e.Entry.NodeID != 0 {
					st.items = append(st.items, fuse.ForgetOne{NodeID: e.Entry.NodeID, Nlookup: 1})
				}
				st.off = e.Off
			}
			return nil
		}
		if err := s.endListing(ctx, st); err != nil {
			return err
		}
		if n := len(st.items); n != len(s.names) {
			return fmt.Errorf("READDIRPLUS returned %d entries with a node, want %d", n, len(s.names))
		}
	}
}

// endListing releases the stream's directory handle and forgets the entries it returned.
func (s *serverDriver) endListing(ctx context.Context, st *dirStream) error {
	st.open = false
	if err := s.c.Releasedir(ctx, s.files, st.fh); err != nil {
		return fmt.Errorf("RELEASEDIR: %w", err)
	}
	return s.forget(ctx, st.items)
}

func (s *serverDriver) readdirPages(ctx context.Context, m *meter, depth int) error {
	streams := make([]dirStream, depth)
	err := parallel(m, depth, 0, func(w int) error { return s.page(ctx, &streams[w]) })
	m.stop()
	for i := range streams {
		if st := &streams[i]; st.open {
			if eerr := s.endListing(ctx, st); err == nil {
				err = eerr
			}
		}
	}
	return err
}

// ioSlot is one request buffer in guest memory, laid out as Linux's virtio-fs driver lays out a
// READ or WRITE: readable [in header][read_in or write_in][data of a WRITE], then writable
// [out header][data of a READ, or write_out], each part its own descriptor.
type ioSlot struct {
	gpa      uint64
	buf      []byte
	outOff   int // where the out header starts in buf
	readable []virtq.Buf
	writable []virtq.Buf

	p      *frontend.Pending
	unique uint64
	start  time.Time
}

const (
	inHeaderSize  = 40
	ioArgSize     = 40 // read_in and write_in
	outHeaderSize = 16
	writeOutSize  = 8
)

func (s *serverDriver) newSlot(p ioParams) (*ioSlot, error) {
	in := inHeaderSize + ioArgSize
	out := outHeaderSize + writeOutSize
	if p.Write {
		in += p.Size
	} else {
		out = outHeaderSize + p.Size
	}
	gpa, buf := s.fe.Alloc(uint64(in + out))
	if buf == nil {
		return nil, errors.New("guest memory exhausted")
	}
	sl := &ioSlot{gpa: gpa, buf: buf, outOff: in}
	sl.readable = []virtq.Buf{{Addr: gpa, Len: inHeaderSize}, {Addr: gpa + inHeaderSize, Len: ioArgSize}}
	if p.Write {
		sl.readable = append(sl.readable, virtq.Buf{Addr: gpa + inHeaderSize + ioArgSize, Len: uint32(p.Size)})
		for i := inHeaderSize + ioArgSize; i < in; i++ {
			buf[i] = byte(i * 7)
		}
	}
	o := gpa + uint64(in)
	sl.writable = []virtq.Buf{{Addr: o, Len: outHeaderSize}, {Addr: o + outHeaderSize, Len: uint32(out - outHeaderSize)}}
	return sl, nil
}

// killprivCheck is what a Linux 6.1 guest asks before a WRITE (cache=auto, no writeback cache):
// file_remove_privs calls security_inode_need_killpriv, which reads security.capability with a
// GETXATTR of size 0, on every write, unless the inode is marked S_NOSEC, which only happens on a
// superblock with SB_NOSEC, which FUSE sets only when HANDLE_KILLPRIV_V2 was negotiated. A
// server that answers ENOSYS is not asked again (fc->no_getxattr).
func (s *serverDriver) killprivCheck(ctx context.Context) error {
	if s.killprivV2 || s.noGetxattr {
		return nil
	}
	_, _, err := s.c.Getxattr(ctx, s.data, "security.capability", 0)
	switch {
	case err == nil:
		return errors.New("GETXATTR security.capability: the data file has one")
	case errors.Is(err, unix.ENOSYS):
		s.noGetxattr = true
	case !errors.Is(err, unix.ENODATA):
		return fmt.Errorf("GETXATTR security.capability: %w", err)
	}
	return nil
}

// submit encodes a READ or WRITE at off into the slot and places it on the request queue; a
// WRITE with p.GuestKillpriv is preceded by the guest's killpriv check, timed with it.
func (s *serverDriver) submit(ctx context.Context, sl *ioSlot, p ioParams, off int64) error {
	sl.start = time.Now()
	if p.Write && p.GuestKillpriv {
		if err := s.killprivCheck(ctx); err != nil {
			return err
		}
	}
	var req []byte
	if p.Write {
		in := fuse.WriteIn{Fh: s.dataFh, Offset: uint64(off), Size: uint32(p.Size)}
		req = s.c.Encode(fuse.OpWrite, s.data, fuse.AsBytes(&in))
	} else {
		in := fuse.ReadIn{Fh: s.dataFh, Offset: uint64(off), Size: uint32(p.Size)}
		req = s.c.Encode(fuse.OpRead, s.data, fuse.AsBytes(&in))
	}
	var h fuse.InHeader
	copy(fuse.AsBytes(&h), req)
	if p.Write {
		h.Len += uint32(p.Size) // the data is already in place after the arguments
	}
	copy(sl.buf, fuse.AsBytes(&h))
	copy(sl.buf[inHeaderSize:], req[inHeaderSize:])
	sl.unique = h.Unique
	var err error
	sl.p, err = s.fe.SubmitAsync(1, sl.readable, sl.writable)
	return err
}

// check validates a completed slot's reply.
func (s *serverDriver) check(sl *ioSlot, p ioParams, written uint32) error {
	var h fuse.OutHeader
	copy(fuse.AsBytes(&h), sl.buf[sl.outOff:])
	want := uint32(outHeaderSize + p.Size)
	if p.Write {
		want = outHeaderSize + writeOutSize
	}
	switch {
	case h.Error != 0:
		return fmt.Errorf("reply error %v", unix.Errno(-h.Error))
	case h.Unique != sl.unique:
		return fmt.Errorf("reply unique %d for request %d", h.Unique, sl.unique)
	case h.Len != written || h.Len != want:
		return fmt.Errorf("reply of %d bytes (device wrote %d), want %d", h.Len, written, want)
	}
	if p.Write {
		var wo fuse.WriteOut
		copy(fuse.AsBytes(&wo), sl.buf[sl.outOff+outHeaderSize:])
		if wo.Size != uint32(p.Size) {
			return fmt.Errorf("WRITE took %d bytes of %d", wo.Size, p.Size)
		}
	}
	return nil
}

// io keeps p.Depth requests in flight on the request queue, each in its own guest buffer, and
// collects them in submission order.
func (s *serverDriver) io(ctx context.Context, m *meter, p ioParams, seed uint64) error {
	defer m.stop()
	return s.ioLoop(ctx, m, p, seed)
}

// ioLoop is io without the meter's stop.
func (s *serverDriver) ioLoop(ctx context.Context, m *meter, p ioParams, seed uint64) error {
	offs := newOffsets(p, s.dataSize, seed)
	slots := make([]*ioSlot, p.Depth)
	defer func() {
		for _, sl := range slots {
			if sl != nil {
				if sl.p != nil {
					sl.p.Wait(ctx) // never leave a buffer in the device's hands
				}
				s.fe.Free(sl.gpa)
			}
		}
	}()
	for i := range slots {
		var err error
		if slots[i], err = s.newSlot(p); err != nil {
			return err
		}
	}
	for _, sl := range slots {
		if err := s.submit(ctx, sl, p, offs.get()); err != nil {
			return err
		}
	}
	more, inFlight := true, len(slots)
	for i := 0; inFlight > 0; i = (i + 1) % len(slots) {
		sl := slots[i]
		if sl.p == nil {
			continue
		}
		written, err := sl.p.Wait(ctx)
		sl.p = nil
		inFlight--
		if err != nil {
			return err
		}
		if err := s.check(sl, p, written); err != nil {
			return err
		}
		if !m.done(sl.start, int64(p.Size)) {
			more = false
		}
		if more {
			if err := s.submit(ctx, sl, p, offs.get()); err != nil {
				return err
			}
			inFlight++
		}
	}
	return nil
}

// bothQueues keeps both queues busy for d: READs at depth 16 on the request queue while
// LOOKUP+FORGET pairs put FORGETs on the high-priority queue.
func (s *serverDriver) bothQueues(ctx context.Context, d time.Duration) error {
	var g errgroup.Group
	g.Go(func() error {
		return s.io(ctx, newMeter(d, s.usage, nil), ioParams{Size: 4096, Depth: 16, Random: true}, 3)
	})
	g.Go(func() error {
		end := time.Now().Add(d)
		for i := 0; time.Now().Before(end); i++ {
			name := s.names[i%len(s.names)]
			e, err := s.c.Lookup(ctx, s.files, name)
			if err != nil {
				return fmt.Errorf("LOOKUP %s: %w", name, err)
			}
			if err := s.c.Forget(ctx, e.NodeID, 1); err != nil {
				return fmt.Errorf("FORGET %s: %w", name, err)
			}
		}
		return nil
	})
	return g.Wait()
}
