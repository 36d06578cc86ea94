package serverbench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ioParams describe a READ or WRITE workload on the data file.
type ioParams struct {
	Write  bool
	Size   int  // bytes per request
	Depth  int  // requests kept in flight
	Random bool // random Size-aligned offsets; otherwise sequential, wrapping at the end
	// GuestKillpriv makes a WRITE cost what it costs a Linux guest whose server did not
	// negotiate HANDLE_KILLPRIV_V2: a GETXATTR of security.capability before it (see
	// serverDriver.killprivCheck).
	GuestKillpriv bool
}

// offsets yields the offsets of an I/O workload over a file of fileSize bytes.
type offsets struct {
	p        ioParams
	fileSize int64
	rng      *rand.Rand
	next     int64
}

func newOffsets(p ioParams, fileSize int64, seed uint64) *offsets {
	return &offsets{p: p, fileSize: fileSize, rng: rand.New(rand.NewPCG(seed, 0x6b7666732d62656e))}
}

func (o *offsets) get() int64 {
	blocks := o.fileSize / int64(o.p.Size)
	if o.p.Random {
		return o.rng.Int64N(blocks) * int64(o.p.Size)
	}
	off := o.next
	o.next = (o.next + int64(o.p.Size)) % (blocks * int64(o.p.Size))
	return off
}

// heldFiles is how many files the guest of the relookup workload holds: the files of held/,
// each looked up once when the driver starts.
const heldFiles = 100

// nameRNG picks the files of the random LOOKUP workloads.
func nameRNG(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x6c6f6f6b7570)) }

// A driver runs the workloads against one target: a server through the front-end, or the host
// directly. Each workload method performs operations until m says to stop, reports each one to
// m, and calls m.stop when the measured work is over (cleanup such as FORGETs may follow).
type driver interface {
	lookupGetattr(ctx context.Context, m *meter) error
	// relookup is LOOKUP and GETATTR of one of the heldFiles files of held/, which the guest
	// looked up once before and holds: every LOOKUP finds a node the server has, as a guest's
	// revalidation of a cached name does once its entry timeout ran out.
	relookup(ctx context.Context, m *meter) error
	// lookupForget is LOOKUP of a random file (seeded by seed), GETATTR, and its FORGET on the
	// high-priority queue, so that the server's inode table grows and shrinks by one each time;
	// depth streams of it at once (see parallel).
	lookupForget(ctx context.Context, m *meter, seed uint64, depth int) error
	createReleaseUnlink(ctx context.Context, m *meter, depth int) error
	// readdirplus is one listing of files/ per operation; readdirPages is one READDIRPLUS page
	// per operation, from depth streams each listing files/ over and over.
	readdirplus(ctx context.Context, m *meter) error
	readdirPages(ctx context.Context, m *meter, depth int) error
	io(ctx context.Context, m *meter, p ioParams, seed uint64) error
	// ioForgets is io with a second stream alongside, until the same deadline: LOOKUP of a
	// random file and its FORGET, one after the other, so that FORGETs arrive on the
	// high-priority queue while the request queue is busy. Both streams' operations count.
	ioForgets(ctx context.Context, m *meter, p ioParams, seed uint64) error
	// usage is what the process doing the work (the server's, or ours for the host) has
	// consumed so far.
	usage() (usage, error)
	close() error
}

// A workload is one row group of the report.
type workload struct {
	Name  string
	Op    string // what one operation is
	Bytes int64  // payload bytes per operation, for MiB/s; 0 where it means nothing
	Depth int    // requests kept in flight (0 or 1: one at a time)
	Xattr bool   // run on the setups with extended attributes on (only)
	run   func(ctx context.Context, d driver, m *meter, seed uint64) error
}

func ioWorkload(name, op string, p ioParams) workload {
	return workload{Name: name, Op: op, Bytes: int64(p.Size), Depth: p.Depth,
		run: func(ctx context.Context, d driver, m *meter, seed uint64) error { return d.io(ctx, m, p, seed) }}
}

// xattrWrite is WRITE 4 KiB random QD1 on the servers with extended attributes on, with the
// guest's security.capability check.
var xattrWrite = func() workload {
	w := ioWorkload("WRITE 4 KiB random QD1, xattr",
		"one 4 KiB WRITE at a random aligned offset, one request in flight, extended attributes on: "+
			"unless HANDLE_KILLPRIV_V2 was negotiated, preceded by the GETXATTR of security.capability a Linux guest sends before each write (file_remove_privs; the C virtiofsd and kvfsd -o no_killpriv_v2 answer ENODATA)",
		ioParams{Write: true, Size: 4 << 10, Depth: 1, Random: true, GuestKillpriv: true})
	w.Xattr = true
	return w
}()

// workloads returns the workloads of issue 3, over nFiles files and a data file.
func workloads(nFiles int) []workload {
	const k4, m1 = 4 << 10, 1 << 20
	return []workload{
		{Name: "LOOKUP+GETATTR", Op: fmt.Sprintf("LOOKUP of one of %d files in one directory, then GETATTR of it (the FORGETs go after each measured slice, unmeasured)", nFiles),
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error { return d.lookupGetattr(ctx, m) }},
		{Name: "LOOKUP+GETATTR of a held file", Op: fmt.Sprintf("LOOKUP of one of %d files (in a directory of their own) that the guest looked up once before and still holds, then GETATTR of it: the revalidation of a cached name whose entry timeout ran out (1 s with cache=auto, on every component of a path walked again), which finds a node the server has (the FORGETs of the LOOKUPs' references go after each measured slice, unmeasured)", heldFiles),
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error { return d.relookup(ctx, m) }},
		{Name: "LOOKUP+GETATTR+FORGET random", Op: fmt.Sprintf("LOOKUP of a random one of %d files in one directory, GETATTR of it, and its FORGET on the high-priority queue: the server's inode table grows and shrinks with every operation", nFiles),
			run: func(ctx context.Context, d driver, m *meter, seed uint64) error {
				return d.lookupForget(ctx, m, seed, 1)
			}},
		{Name: "LOOKUP+GETATTR+FORGET random QD16", Depth: 16, Op: "the LOOKUP+GETATTR+FORGET random operation from 16 streams at once, each on its own random files: 16 operations in flight, FORGETs on the high-priority queue while the request queue is busy",
			run: func(ctx context.Context, d driver, m *meter, seed uint64) error {
				return d.lookupForget(ctx, m, seed, 16)
			}},
		{Name: "CREATE+RELEASE+UNLINK", Op: "CREATE of a new file, RELEASE, UNLINK, and the FORGET a guest sends when it drops the inode",
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error { return d.createReleaseUnlink(ctx, m, 1) }},
		{Name: "CREATE+RELEASE+UNLINK QD16", Depth: 16, Op: "the CREATE+RELEASE+UNLINK operation (and its FORGET) from 16 streams at once in the same directory: 16 operations in flight",
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error {
				return d.createReleaseUnlink(ctx, m, 16)
			}},
		{Name: "READDIRPLUS", Op: fmt.Sprintf("one listing of the %d-entry directory: OPENDIR, READDIRPLUS with 4 KiB replies (as Linux 6.1 asks) until the end, RELEASEDIR, BATCH_FORGET of every entry returned (entries/s = ops/s × %d)", nFiles, nFiles),
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error { return d.readdirplus(ctx, m) }},
		{Name: "READDIRPLUS QD16", Depth: 16, Op: fmt.Sprintf("one READDIRPLUS request with a 4 KiB reply (a page of entries), 16 in flight: 16 streams each list the %d-entry directory as the READDIRPLUS row does, over and over; a stream's OPENDIR, and its RELEASEDIR and BATCH_FORGETs at the end of a listing, fall in the time of the page next to them", nFiles),
			run: func(ctx context.Context, d driver, m *meter, _ uint64) error { return d.readdirPages(ctx, m, 16) }},
		ioWorkload("READ 4 KiB random QD1", "one 4 KiB READ at a random aligned offset, one request in flight", ioParams{Size: k4, Depth: 1, Random: true}),
		ioWorkload("READ 4 KiB random QD16", "one 4 KiB READ at a random aligned offset, 16 requests in flight", ioParams{Size: k4, Depth: 16, Random: true}),
		{Name: "READ 4 KiB random QD16 + FORGETs", Depth: 16, Bytes: k4,
			Op: fmt.Sprintf("one 4 KiB READ at a random aligned offset with 16 in flight on the request queue, or, from a second stream alongside, one LOOKUP of a random one of the %d files and its FORGET on the high-priority queue (both queues busy at once, as a guest reading while it evicts inodes; MiB/s counts the READs only)", nFiles),
			run: func(ctx context.Context, d driver, m *meter, seed uint64) error {
				return d.ioForgets(ctx, m, ioParams{Size: k4, Depth: 16, Random: true}, seed)
			}},
		ioWorkload("WRITE 4 KiB random QD1", "one 4 KiB WRITE at a random aligned offset, one request in flight", ioParams{Write: true, Size: k4, Depth: 1, Random: true}),
		xattrWrite,
		ioWorkload("WRITE 4 KiB random QD16", "one 4 KiB WRITE at a random aligned offset, 16 requests in flight", ioParams{Write: true, Size: k4, Depth: 16, Random: true}),
		ioWorkload("READ 1 MiB sequential", "one 1 MiB READ, sequential through the file, one request in flight", ioParams{Size: m1, Depth: 1}),
		ioWorkload("WRITE 1 MiB sequential", "one 1 MiB WRITE, sequential through the file, one request in flight", ioParams{Write: true, Size: m1, Depth: 1}),
		ioWorkload("READ 1 MiB sequential QD16", "one 1 MiB READ, sequential through the file, 16 requests in flight", ioParams{Size: m1, Depth: 16}),
		ioWorkload("WRITE 1 MiB sequential QD16", "one 1 MiB WRITE, sequential through the file, 16 requests in flight", ioParams{Write: true, Size: m1, Depth: 16}),
	}
}

// meter times one measurement: operations until the deadline, each one's latency, and what the
// target consumed between start and stop.
type meter struct {
	usage    func() (usage, error)
	deadline time.Time
	maxOps   int // if not 0, stop after this many operations (the deadline still holds)

	lat     []time.Duration
	ops     int
	bytes   int64
	begin   time.Time
	end     time.Time
	u0, u1  usage
	fe0     time.Duration // this process's CPU (selfCPU) at the start
	fe1     time.Duration // and at the stop
	stopped bool
	err     error // from reading the usage
}

// newMeter starts a measurement of length d whose latencies are appended to lat.
func newMeter(d time.Duration, u func() (usage, error), lat []time.Duration) *meter {
	m := &meter{usage: u, lat: lat}
	m.u0, m.err = u()
	m.fe0 = selfCPU()
	m.begin = time.Now()
	m.deadline = m.begin.Add(d)
	return m
}

// done records an operation that started at start and moved n payload bytes, and reports
// whether to start another.
func (m *meter) done(start time.Time, n int64) bool {
	now := time.Now()
	m.lat = append(m.lat, now.Sub(start))
	m.ops++
	m.bytes += n
	return now.Before(m.deadline) && (m.maxOps == 0 || m.ops < m.maxOps)
}

// merge records operations timed elsewhere (by concurrent workers).
func (m *meter) merge(lat []time.Duration, n int64) {
	m.lat = append(m.lat, lat...)
	m.ops += len(lat)
	m.bytes += n
}

// selfCPU is this process's user + system time, all threads (getrusage): while a server is
// measured, the front-end's and the FUSE client's, with whatever else this process does then
// (its garbage collector; the other targets are idle).
func selfCPU() time.Duration { return selfUsage().CPU }

// selfUsage is this process's usage (getrusage: CPU and context switches of all its threads,
// exited ones included).
func selfUsage() usage {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return usage{}
	}
	return usage{CPU: time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), System: time.Duration(ru.Stime.Nano()),
		Switches: uint64(ru.Nvcsw + ru.Nivcsw)}
}

// parallel runs depth streams of an operation, each in its own goroutine, until m's deadline, or
// until m.maxOps operations have started in all: stream w (0 ≤ w < depth) performs one
// operation per call of op(w), timed on its own, and n is an operation's payload bytes. The
// first error stops every stream and is returned. It does not stop m.
func parallel(m *meter, depth int, n int64, op func(w int) error) error {
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		first   error
		started atomic.Int64
		failed  atomic.Bool
	)
	for w := range depth {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var lat []time.Duration
			var err error
			for !failed.Load() && (m.maxOps == 0 || started.Add(1) <= int64(m.maxOps)) {
				start := time.Now()
				if err = op(w); err != nil {
					failed.Store(true)
					break
				}
				now := time.Now()
				lat = append(lat, now.Sub(start))
				if !now.Before(m.deadline) {
					break
				}
			}
			mu.Lock()
			defer mu.Unlock()
			m.merge(lat, int64(len(lat))*n)
			if first == nil {
				first = err
			}
		}()
	}
	wg.Wait()
	return first
}

// stop ends the measured part; later calls do nothing.
func (m *meter) stop() {
	if m.stopped {
		return
	}
	m.stopped = true
	m.end = time.Now()
	m.fe1 = selfCPU()
	var err error
	m.u1, err = m.usage()
	if m.err == nil {
		m.err = err
	}
}
