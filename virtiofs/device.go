package virtiofs

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// maxRequestQueues bounds num-request-queues; vrings that are never started cost nothing.
const maxRequestQueues = 16

// device is the virtio-fs device: vring 0 is the high-priority queue (FORGET), vrings 1.. the
// request queues. Both kinds carry FUSE requests, so both are served the same way: every
// descriptor chain is one request handed to the FUSE server, and its reply is written straight
// into the chain's writable buffers.
//
// With a thread pool, a vring's goroutine pops every available chain and hands them to the
// shared workers; it waits for all of them before returning, because guest memory is only
// guaranteed stable while HandleQueue runs. Completions come back in any order.
//
// # Replies that wait
//
// A request the FUSE server defers (SETLKW waiting for a lock) is left in flight: its chain is
// neither completed nor kept, and the queue goes on with the next one. When its reply comes (on
// the waiter's goroutine, through CompleteDeferred), it is queued on the vring's queueState
// together with the chain's head, and the vring goroutine is woken (Vring.Wake). The next
// HandleQueue call, under the memory read lock like any other, completes it first: it re-reads
// the chain from its head (virtq.Queue.Rewalk), so the reply is written through the memory
// table of that call, never through slices of one that may have been replaced or unmapped
// since, writes the reply, and returns the chain to the guest. No other goroutine ever touches
// the queue or guest memory, so inline mode needs no lock for it.
//
// A chain belongs to a run of its ring. A ring that is stopped and started again exactly where
// it stopped (a paused VM resumed: virtq.Queue.Resumes) continues the run, and chains still in
// flight are completed on it. A ring started afresh (the guest driver was reset) or a device
// Reset begins a new run: replies for chains of an earlier run are dropped, since the guest no
// longer waits for them and their heads may already mean something else. Reset also cancels
// every waiting request, and a new INIT or DESTROY from the guest does the same.
type device struct {
	fuse   *fuse.Server
	queues [1 + maxRequestQueues]queueState
	jobs   chan job // nil without a thread pool
}

// queueState is a vring's share of the device. Inline, only the vring's goroutine touches it;
// with a pool, mu serialises every use of the queue (popping, completing, notifying), since the
// vring goroutine and the workers share it.
type queueState struct {
	mu     sync.Mutex
	chain  virtq.Chain    // inline mode
	chains []*virtq.Chain // pool mode: free chains, touched by the vring goroutine only

	// Deferred replies. run, q and redo belong to the vring goroutine (and to Reset, which runs
	// while every ring is stopped).
	run  uint64       // the ring's current run; deferred tags carry it
	q    *virtq.Queue // the queue the current run was last served with
	redo virtq.Chain  // a deferred chain, re-read to complete it

	// inFlight counts the chains of the current run taken from the ring and not yet completed
	// (waiting requests included).
	inFlight atomic.Int64

	readyMu sync.Mutex
	vr      *vhostuser.Vring // woken when a reply is ready; guarded by readyMu
	ready   []readyReply     // replies waiting for the vring goroutine; guarded by readyMu
}

// readyReply is the reply of a deferred request, waiting to be written into its chain.
type readyReply struct {
	tag   uint64 // deferTag
	reply []byte
}

// deferTag identifies a deferred chain for CompleteDeferred: its head and the run it belongs to.
func deferTag(run uint64, head uint16) uint64 { return run<<16 | uint64(head) }

type job struct {
	vr    *vhostuser.Vring
	qs    *queueState
	chain *virtq.Chain
	tag   uint64
	wg    *sync.WaitGroup
	err   *error
}

func newDevice(f *fuse.Server, workers int) *device {
	d := &device{fuse: f}
	if workers > 0 {
		d.jobs = make(chan job)
		for range workers {
			go d.worker()
		}
	}
	return d
}

// close stops the workers; no HandleQueue may be running.
func (d *device) close() {
	if d.jobs != nil {
		close(d.jobs)
	}
}

// inFlight is the number of requests taken from the virtqueues and not yet answered.
func (d *device) inFlight() uint64 {
	var n int64
	for i := range d.queues {
		n += d.queues[i].inFlight.Load()
	}
	return uint64(max(n, 0))
}

func (d *device) NumQueues() int   { return 1 + maxRequestQueues }
func (d *device) Features() uint64 { return 0 }

// Reset is called when the driver resets or the front-end goes away, with every ring stopped.
// The FUSE session is not torn down here: a rebooted guest sends a new INIT, which does that.
// Requests still waiting are cancelled, and the replies of chains in flight dropped: nobody is
// left to read them.
func (d *device) Reset() {
	d.fuse.CancelWaiting()
	for i := range d.queues {
		qs := &d.queues[i]
		qs.run++
		qs.q = nil
		qs.inFlight.Store(0)
		qs.readyMu.Lock()
		qs.vr, qs.ready = nil, nil
		qs.readyMu.Unlock()
	}
}

// CompleteDeferred receives the reply of a deferred request, on any goroutine, and has the
// vring goroutine complete it (fuse.Completer).
func (qs *queueState) CompleteDeferred(tag uint64, reply []byte) {
	qs.readyMu.Lock()
	qs.ready = append(qs.ready, readyReply{tag: tag, reply: reply})
	vr := qs.vr
	qs.readyMu.Unlock()
	if vr != nil {
		vr.Wake()
	}
}

// begin notes the vring a HandleQueue call serves and starts a new run unless the ring's queue
// is the one of the current run or resumes it.
func (qs *queueState) begin(vr *vhostuser.Vring) {
	q := vr.Queue()
	if q == qs.q {
		return
	}
	if !q.Resumes(qs.q) {
		qs.run++
		qs.inFlight.Store(0)
	}
	qs.q = q
	qs.readyMu.Lock()
	qs.vr = vr
	qs.readyMu.Unlock()
}

// completeReady completes the chains whose deferred replies have come, re-reading each chain
// under the current memory table. Replies of an earlier run are dropped.
func (qs *queueState) completeReady(vr *vhostuser.Vring) error {
	qs.readyMu.Lock()
	ready := qs.ready
	qs.ready = nil
	qs.readyMu.Unlock()
	if len(ready) == 0 {
		return nil
	}
	q := vr.Queue()
	qs.mu.Lock() // no worker runs for this queue between HandleQueue calls; cheap all the same
	for _, r := range ready {
		if r.tag>>16 != qs.run&(1<<48-1) {
			continue
		}
		head := uint16(r.tag)
		n := 0
		if err := q.Rewalk(&qs.redo, head); err == nil {
			n = scatterReply(qs.redo.Out, r.reply)
		}
		// A chain rewritten into garbage while it waited is still returned, with nothing in it.
		q.Complete(head, uint32(n))
		qs.inFlight.Add(-1)
	}
	qs.mu.Unlock()
	return vr.Notify()
}

// scatterReply copies reply into the writable buffers out and returns how many bytes it copied.
func scatterReply(out [][]byte, reply []byte) int {
	n := 0
	for _, b := range out {
		if n == len(reply) {
			break
		}
		n += copy(b, reply[n:])
	}
	return n
}

// batchSize bounds the chains served per HandleQueue call, so that a guest publishing requests
// as fast as they are answered cannot hold guest memory locked and keep the front-end from
// stopping the ring or changing the memory table.
const batchSize = 64

// HandleQueue serves the requests available on the vring, at most batchSize of them, signalling
// the guest as soon as it asked to be told of a completion. Once the ring is empty it re-enables
// kicks and looks again, so a request published in between is not missed.
func (d *device) HandleQueue(idx int, vr *vhostuser.Vring) (more bool, err error) {
	q := vr.Queue()
	qs := &d.queues[idx]
	qs.begin(vr)
	if err := qs.completeReady(vr); err != nil {
		return false, err
	}
	budget := batchSize
	for {
		q.DisableNotify()
		var served int
		if d.jobs == nil {
			served, err = d.serveInline(idx, vr, qs, budget)
		} else {
			served, err = d.servePooled(idx, vr, qs, budget)
		}
		if err != nil {
			return false, err
		}
		if budget -= served; budget == 0 {
			return true, nil
		}
		if !q.EnableNotify() {
			return false, nil
		}
	}
}

// yieldBatch is how many requests serveInline serves between two calls of Vring.Yield, which
// reads the clock: 16 requests of 1 MiB take about 3 ms here, within Yield's 5 ms; a read on
// every request was 2 % of READ 4 KiB QD16's CPU.
const yieldBatch = 16

// serveInline serves up to max requests, one after the other, and returns how many. It
// signals the guest after each completion (if the guest asked to be told, by EVENT_IDX or the
// NO_INTERRUPT flag): signalling once per 16 completions at queue depth 16 saved call-eventfd
// writes but cost a fifth to a third of the throughput, as the driver then reaps in bursts
// (docs/measurements/performance.md, "Notifications at QD16").
func (d *device) serveInline(idx int, vr *vhostuser.Vring, qs *queueState, max int) (int, error) {
	q, c := vr.Queue(), &qs.chain
	for n := 0; n < max; n++ {
		ok, err := q.Next(c)
		if err != nil {
			return n, fmt.Errorf("virtio-fs queue %d: %w", idx, err)
		}
		if !ok {
			return n, nil
		}
		if n%yieldBatch == yieldBatch-1 {
			vr.Yield() // a batch can run longer than the 10 ms Vring.Yield is about
		}
		qs.inFlight.Add(1)
		written, deferred := d.fuse.HandleAsync(c.In, c.Out, qs, deferTag(qs.run, c.Head))
		if deferred {
			continue // completed by a later HandleQueue, once the reply has come
		}
		q.Complete(c.Head, uint32(written))
		qs.inFlight.Add(-1)
		if err := vr.Notify(); err != nil {
			return n, err
		}
	}
	return max, nil
}

// servePooled hands up to max requests to the workers, waits for all of them, and returns how
// many it handed out.
func (d *device) servePooled(idx int, vr *vhostuser.Vring, qs *queueState, max int) (int, error) {
	q := vr.Queue()
	var wg sync.WaitGroup
	var notifyErr, popErr error
	var used []*virtq.Chain
	for len(used) < max {
		c := qs.get()
		qs.mu.Lock() // workers complete on the same queue concurrently
		ok, err := q.Next(c)
		qs.mu.Unlock()
		if err != nil || !ok {
			qs.chains = append(qs.chains, c)
			popErr = err
			break
		}
		used = append(used, c)
		qs.inFlight.Add(1)
		wg.Add(1)
		d.jobs <- job{vr: vr, qs: qs, chain: c, tag: deferTag(qs.run, c.Head), wg: &wg, err: &notifyErr}
	}
	wg.Wait()
	qs.chains = append(qs.chains, used...)
	if popErr != nil {
		return len(used), fmt.Errorf("virtio-fs queue %d: %w", idx, popErr)
	}
	return len(used), notifyErr
}

func (qs *queueState) get() *virtq.Chain {
	if n := len(qs.chains); n > 0 {
		c := qs.chains[n-1]
		qs.chains = qs.chains[:n-1]
		return c
	}
	return new(virtq.Chain)
}

func (d *device) worker() {
	for j := range d.jobs {
		n, deferred := d.fuse.HandleAsync(j.chain.In, j.chain.Out, j.qs, j.tag)
		if deferred {
			j.wg.Done()
			continue
		}
		j.qs.mu.Lock()
		j.vr.Queue().Complete(j.chain.Head, uint32(n))
		j.qs.inFlight.Add(-1)
		if err := j.vr.Notify(); err != nil && *j.err == nil {
			*j.err = err
		}
		j.qs.mu.Unlock()
		j.wg.Done()
	}
}
