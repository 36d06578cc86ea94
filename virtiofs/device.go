package virtiofs

import (
	"fmt"
	"sync"

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
}

type job struct {
	vr    *vhostuser.Vring
	qs    *queueState
	chain *virtq.Chain
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

func (d *device) NumQueues() int   { return 1 + maxRequestQueues }
func (d *device) Features() uint64 { return 0 }

// Reset is called when the driver resets or the front-end goes away. The FUSE session is not
// torn down here: a rebooted guest sends a new INIT, which does that.
func (d *device) Reset() {}

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

// serveInline serves up to max requests, one after the other, and returns how many.
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
		q.Complete(c.Head, uint32(d.fuse.Handle(c.In, c.Out)))
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
		wg.Add(1)
		d.jobs <- job{vr: vr, qs: qs, chain: c, wg: &wg, err: &notifyErr}
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
		n := d.fuse.Handle(j.chain.In, j.chain.Out)
		j.qs.mu.Lock()
		j.vr.Queue().Complete(j.chain.Head, uint32(n))
		if err := j.vr.Notify(); err != nil && *j.err == nil {
			*j.err = err
		}
		j.qs.mu.Unlock()
		j.wg.Done()
	}
}
