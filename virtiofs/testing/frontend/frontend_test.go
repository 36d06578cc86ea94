package frontend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// echoDevice copies each chain's readable bytes into its writable buffers.
type echoDevice struct {
	queues int
	resets atomic.Int64
	chains atomic.Int64
}

func (d *echoDevice) NumQueues() int   { return d.queues }
func (d *echoDevice) Features() uint64 { return 0 }
func (d *echoDevice) Reset()           { d.resets.Add(1) }

func (d *echoDevice) HandleQueue(idx int, vr *vhostuser.Vring) (bool, error) {
	q := vr.Queue()
	var c virtq.Chain
	for {
		q.DisableNotify()
		for {
			ok, err := q.Next(&c)
			if err != nil {
				return false, err
			}
			if !ok {
				break
			}
			d.chains.Add(1)
			q.Complete(c.Head, uint32(copyIovecs(c.Out, c.In)))
		}
		if err := vr.Notify(); err != nil {
			return false, err
		}
		if !q.EnableNotify() {
			return false, nil
		}
	}
}

func copyIovecs(dst, src [][]byte) int {
	n := 0
	var s []byte
	for _, d := range dst {
		for len(d) > 0 {
			for len(s) == 0 {
				if len(src) == 0 {
					return n
				}
				s, src = src[0], src[1:]
			}
			m := copy(d, s)
			d, s, n = d[m:], s[m:], n+m
		}
	}
	return n
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// server runs a Backend for an echoDevice on a real unix socket and serves one connection.
type server struct {
	path   string
	dev    *echoDevice
	b      *vhostuser.Backend
	served chan error
}

func startServer(t *testing.T, queues int) *server {
	t.Helper()
	s := &server{
		path:   filepath.Join(t.TempDir(), "vhost.sock"),
		dev:    &echoDevice{queues: queues},
		served: make(chan error, 1),
	}
	s.b = vhostuser.NewBackend(s.dev)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: s.path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		c, err := l.AcceptUnix()
		l.Close()
		if err != nil {
			s.served <- err
			return
		}
		s.served <- s.b.Serve(ctx, c)
	}()
	t.Cleanup(func() {
		cancel()
		l.Close()
	})
	return s
}

func (s *server) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-s.served:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
		return nil
	}
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// request is one echo request built in guest memory.
type request struct {
	readable, writable []virtq.Buf
	want               []byte
	out                [][]byte
	blocks             []uint64
}

// newRequest allocates n bytes of payload split over nr readable buffers, filled with random
// bytes, and n bytes of response space split over nw writable buffers.
func newRequest(t *testing.T, f *Frontend, rng *rand.Rand, n, nr, nw int) *request {
	t.Helper()
	r := &request{want: make([]byte, 0, n)}
	split := func(parts int) []int {
		sizes := make([]int, parts)
		left := n
		for i := range sizes {
			if i == parts-1 {
				sizes[i] = left
			} else {
				sizes[i] = rng.IntN(left/(parts-i) + 1)
			}
			left -= sizes[i]
		}
		return sizes
	}
	for _, sz := range split(nr) {
		gpa, buf := f.Alloc(uint64(sz))
		if buf == nil {
			t.Fatal("out of guest memory")
		}
		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
		r.want = append(r.want, buf...)
		r.readable = append(r.readable, virtq.Buf{Addr: gpa, Len: uint32(sz)})
		r.blocks = append(r.blocks, gpa)
	}
	for _, sz := range split(nw) {
		gpa, buf := f.Alloc(uint64(sz))
		if buf == nil {
			t.Fatal("out of guest memory")
		}
		clear(buf)
		r.out = append(r.out, buf)
		r.writable = append(r.writable, virtq.Buf{Addr: gpa, Len: uint32(sz)})
		r.blocks = append(r.blocks, gpa)
	}
	return r
}

func (r *request) check(t *testing.T, written uint32) {
	t.Helper()
	if int(written) != len(r.want) {
		t.Fatalf("written %d, want %d", written, len(r.want))
	}
	if got := bytes.Join(r.out, nil); !bytes.Equal(got, r.want) {
		t.Fatal("echoed bytes differ")
	}
}

func (r *request) free(f *Frontend) {
	for _, b := range r.blocks {
		f.Free(b)
	}
}

func TestEchoManyRequests(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"default", Options{}},
		{"no event idx", Options{NoEventIdx: true}},
		{"no indirect", Options{NoIndirect: true, QueueSize: 256}},
		{"4 regions", Options{Regions: 4, MemSize: 8 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := openFDs(t)
			s := startServer(t, 2)
			ctx := testCtx(t)
			f, err := Dial(ctx, s.path, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			wantInd := !tc.opts.NoIndirect
			if got := f.Features()&vhostuser.FeatureIndirectDesc != 0; got != wantInd {
				t.Fatalf("indirect negotiated = %v", got)
			}
			if f.ProtocolFeatures()&vhostuser.ProtocolConfig != 0 {
				t.Fatal("CONFIG negotiated")
			}
			free := f.alloc.freeBytes()
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range 1000 {
				n := 1 + rng.IntN(9000)
				if i%50 == 0 {
					n = 1 << 20 // spans regions in the 4-region case
				}
				r := newRequest(t, f, rng, n, 1+rng.IntN(3), 1+rng.IntN(3))
				written, err := f.Submit(ctx, 1, r.readable, r.writable)
				if err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
				r.check(t, written)
				r.free(f)
			}
			if got := f.alloc.freeBytes(); got != free {
				t.Fatalf("allocator leaked: %d free, was %d", got, free)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			if err := s.wait(t); err != nil {
				t.Fatalf("Serve after Close = %v, want nil", err)
			}
			if after := openFDs(t); after != before {
				t.Fatalf("fd leak: %d before, %d after", before, after)
			}
		})
	}
}

// TestDepth16 keeps 16 requests in flight on each of two request queues and the hiprio queue.
func TestDepth16(t *testing.T) {
	s := startServer(t, 3)
	ctx := testCtx(t)
	f, err := Dial(ctx, s.path, Options{RequestQueues: 2, QueueSize: 128})
	if err != nil {
		t.Fatal(err)
	}
	defer s.wait(t)
	defer f.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for q := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(q), 7))
			for round := range 50 {
				var reqs []*request
				var pend []*Pending
				for range 16 {
					r := newRequestNoT(f, rng, 1+rng.IntN(5000))
					if r == nil {
						errs <- errors.New("out of guest memory")
						return
					}
					p, err := f.SubmitAsync(q, r.readable, r.writable)
					if err != nil {
						errs <- fmt.Errorf("queue %d round %d: %w", q, round, err)
						return
					}
					reqs, pend = append(reqs, r), append(pend, p)
				}
				for i, p := range pend {
					written, err := p.Wait(ctx)
					if err != nil {
						errs <- fmt.Errorf("queue %d round %d: %w", q, round, err)
						return
					}
					if int(written) != len(reqs[i].want) || !bytes.Equal(bytes.Join(reqs[i].out, nil), reqs[i].want) {
						errs <- fmt.Errorf("queue %d round %d request %d: bad echo", q, round, i)
						return
					}
					reqs[i].free(f)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := s.dev.chains.Load(); got != 3*50*16 {
		t.Errorf("device saw %d chains, want %d", got, 3*50*16)
	}
}

// newRequestNoT is newRequest for goroutines without a *testing.T: 2 readable, 2 writable.
func newRequestNoT(f *Frontend, rng *rand.Rand, n int) *request {
	r := &request{}
	for _, sz := range []int{n / 2, n - n/2} {
		gpa, buf := f.Alloc(uint64(sz))
		if buf == nil {
			r.free(f)
			return nil
		}
		for j := range buf {
			buf[j] = byte(rng.Uint32())
		}
		r.want = append(r.want, buf...)
		r.readable = append(r.readable, virtq.Buf{Addr: gpa, Len: uint32(sz)})
		r.blocks = append(r.blocks, gpa)
	}
	hdr := min(16, n) // a separate header buffer, like Linux's fuse_out_header
	for _, sz := range []int{hdr, n - hdr} {
		gpa, buf := f.Alloc(uint64(sz))
		if buf == nil {
			r.free(f)
			return nil
		}
		clear(buf)
		r.writable = append(r.writable, virtq.Buf{Addr: gpa, Len: uint32(sz)})
		r.blocks = append(r.blocks, gpa)
		r.out = append(r.out, buf)
	}
	return r
}

func TestStopStart(t *testing.T) {
	before := openFDs(t)
	s := startServer(t, 2)
	ctx := testCtx(t)
	f, err := Dial(ctx, s.path, Options{QueueSize: 64})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	roundTrip := func() {
		t.Helper()
		r := newRequest(t, f, rng, 3000, 2, 2)
		defer r.free(f)
		written, err := f.Submit(ctx, 1, r.readable, r.writable)
		if err != nil {
			t.Fatal(err)
		}
		r.check(t, written)
	}
	roundTrip()
	for cycle := range 3 {
		if err := f.Stop(ctx); err != nil {
			t.Fatalf("cycle %d: %v", cycle, err)
		}
		if err := f.Stop(ctx); err != nil { // idempotent
			t.Fatal(err)
		}
		r := newRequest(t, f, rng, 10, 1, 1)
		if _, err := f.SubmitAsync(1, r.readable, r.writable); !errors.Is(err, ErrStopped) {
			t.Fatalf("submit while stopped: %v, want ErrStopped", err)
		}
		r.free(f)
		if err := f.Start(ctx); err != nil {
			t.Fatalf("cycle %d: %v", cycle, err)
		}
		if err := f.Start(ctx); err == nil {
			t.Fatal("Start while started succeeded")
		}
		for range 20 {
			roundTrip()
		}
	}
	if s.dev.resets.Load() != 0 {
		t.Fatal("device reset by stop/start")
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	if err := s.wait(t); err != nil {
		t.Fatalf("Serve after Close = %v, want nil", err)
	}
	if s.dev.resets.Load() != 1 {
		t.Fatalf("device reset %d times, want 1 (at disconnect)", s.dev.resets.Load())
	}
	if _, err := f.SubmitAsync(1, nil, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("submit after Close: %v", err)
	}
	if err := f.Start(ctx); !errors.Is(err, ErrClosed) {
		t.Fatalf("Start after Close: %v", err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("fd leak: %d before, %d after", before, after)
	}
}

// dialServer connects a Frontend with 64-entry queues to a server of 2 request queues; the
// Frontend is closed and the server waited for when the test ends.
func dialServer(t *testing.T) (*server, *Frontend, context.Context) {
	t.Helper()
	s := startServer(t, 2)
	ctx := testCtx(t)
	f, err := Dial(ctx, s.path, Options{QueueSize: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.wait(t) })
	t.Cleanup(func() { f.Close() })
	return s, f, ctx
}

// TestStopFailsPending checks that requests the device never completes fail with ErrStopped at
// Stop, and that a Wait deadline leaves a request in flight.
func TestStopFailsPending(t *testing.T) {
	_, f, ctx := dialServer(t)
	// Disable the ring so the device does not serve it, then submit.
	if err := f.Client().SetVringEnable(1, false); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Client().GetFeatures(); err != nil { // SET_VRING_ENABLE has no reply
		t.Fatal(err)
	}
	r := newRequest(t, f, rand.New(rand.NewPCG(5, 6)), 100, 1, 1)
	p, err := f.SubmitAsync(1, r.readable, r.writable)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := p.Wait(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait on a disabled ring: %v", err)
	}
	if err := f.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(ctx); !errors.Is(err, ErrStopped) {
		t.Fatalf("pending request after Stop: %v, want ErrStopped", err)
	}
}

func TestAllocator(t *testing.T) {
	a := newAllocator(4096, 4096+64*10)
	var got []uint64
	for range 10 {
		addr, ok := a.alloc(1)
		if !ok {
			t.Fatal("alloc failed")
		}
		got = append(got, addr)
	}
	if _, ok := a.alloc(1); ok {
		t.Fatal("allocated past the end")
	}
	for _, i := range []int{1, 3, 2, 0, 9, 8, 4, 6, 5, 7} {
		if !a.release(got[i]) {
			t.Fatal("release failed")
		}
	}
	if a.release(got[0]) {
		t.Fatal("double release accepted")
	}
	if len(a.free) != 1 || a.free[0] != (extent{4096, 640}) {
		t.Fatalf("free list not coalesced: %v", a.free)
	}
	if addr, ok := a.alloc(640); !ok || addr != 4096 {
		t.Fatalf("whole arena: %d %v", addr, ok)
	}
	if _, ok := a.alloc(^uint64(0)); ok {
		t.Fatal("huge allocation succeeded")
	}
}

func TestDialErrors(t *testing.T) {
	ctx := testCtx(t)
	if _, err := Dial(ctx, filepath.Join(t.TempDir(), "none"), Options{}); err == nil {
		t.Fatal("dial to a missing socket succeeded")
	}
	for _, o := range []Options{{QueueSize: 100}, {Regions: 9}, {Regions: 3, MemSize: 1 << 20}} {
		if _, err := Dial(ctx, "/nonexistent", o); err == nil {
			t.Fatalf("options %+v accepted", o)
		}
	}
	// A back-end that accepts and never answers: the handshake obeys ctx.
	path := filepath.Join(t.TempDir(), "mute.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	before := openFDs(t)
	if _, err := Dial(short, path, Options{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a mute back-end: %v", err)
	}
	c, err := l.Accept()
	if err == nil {
		c.Close()
	}
	if after := openFDs(t); after != before {
		t.Fatalf("fd leak on failed Dial: %d before, %d after", before, after)
	}
}

// TestManyWaitersOneQueue has several goroutines each submitting and waiting for one request at
// a time on the same queue, so that the reaper role passes between them all the time: every
// request must complete with its own echo.
func TestManyWaitersOneQueue(t *testing.T) {
	s, f, ctx := dialServer(t)
	const workers, each = 8, 300
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 11))
			for i := range each {
				r := newRequestNoT(f, rng, 1+rng.IntN(3000))
				if r == nil {
					errs <- errors.New("out of guest memory")
					return
				}
				written, err := f.Submit(ctx, 1, r.readable, r.writable)
				if err != nil {
					errs <- fmt.Errorf("worker %d request %d: %w", w, i, err)
					return
				}
				if int(written) != len(r.want) || !bytes.Equal(bytes.Join(r.out, nil), r.want) {
					errs <- fmt.Errorf("worker %d request %d: bad echo", w, i)
					return
				}
				r.free(f)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := s.dev.chains.Load(); got != workers*each {
		t.Errorf("device saw %d chains, want %d", got, workers*each)
	}
}

// disableRing stops the device serving queue q (its requests stay in the ring).
func disableRing(t *testing.T, f *Frontend, q int) {
	t.Helper()
	if err := f.Client().SetVringEnable(uint32(q), false); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Client().GetFeatures(); err != nil { // SET_VRING_ENABLE has no reply
		t.Fatal(err)
	}
}

// waitUntil polls cond until it holds, failing the test after 10 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

// TestReaperHandoff checks that a Wait reaping its lone request whose ctx is cancelled leaves its
// blocking poll at once and hands the role over to a waiter already waiting on the same queue,
// which then (two requests in flight) starts the reaper goroutine: both requests complete once
// the device serves the ring again, and no wake-up is lost.
func TestReaperHandoff(t *testing.T) {
	_, f, ctx := dialServer(t)
	disableRing(t, f, 1)
	rng := rand.New(rand.NewPCG(7, 8))
	ra, rb := newRequest(t, f, rng, 500, 1, 2), newRequest(t, f, rng, 700, 2, 1)
	pa, err := f.SubmitAsync(1, ra.readable, ra.writable)
	if err != nil {
		t.Fatal(err)
	}
	q := f.queues[1]
	locked := func(fn func() bool) func() bool {
		return func() bool { q.mu.Lock(); defer q.mu.Unlock(); return fn() }
	}
	actx, cancelA := context.WithCancel(ctx)
	aDone := make(chan error, 1)
	go func() { _, err := pa.Wait(actx); aDone <- err }()
	waitUntil(t, "A's waiter reaps", locked(func() bool { return q.reaping }))
	pb, err := f.SubmitAsync(1, rb.readable, rb.writable)
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		n   uint32
		err error
	}
	bDone := make(chan result, 1)
	go func() { n, err := pb.Wait(ctx); bDone <- result{n, err} }()
	waitUntil(t, "B's waiter waits for the role", locked(func() bool { return q.handoff != nil }))

	start := time.Now()
	cancelA()
	select {
	case err := <-aDone:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("A's Wait after cancel: %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a reaper whose ctx was cancelled stayed in its poll")
	}
	t.Logf("the cancelled reaper left after %v", time.Since(start))
	waitUntil(t, "B's waiter starts a reaper", locked(func() bool { return q.reaping }))

	if err := f.Client().SetVringEnable(1, true); err != nil {
		t.Fatal(err)
	}
	if err := f.Kick(1); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-bDone:
		if r.err != nil {
			t.Fatalf("B: %v", r.err)
		}
		rb.check(t, r.n)
	case <-time.After(10 * time.Second):
		t.Fatal("B was not completed after the hand-off")
	}
	n, err := pa.Wait(ctx) // A stayed in flight; B's reaper completed it
	if err != nil {
		t.Fatal(err)
	}
	ra.check(t, n)
	ra.free(f)
	rb.free(f)
}

// TestStopCloseWakeReaper checks that Stop and Close fail the requests of waiters while the
// queue's reaper is blocked in its poll, whether it is the Wait of a lone request or the reaper
// goroutine of two, that the reaper leaves, and that Close leaves no descriptor open.
func TestStopCloseWakeReaper(t *testing.T) {
	for _, tc := range []struct {
		stop bool
		n    int
	}{{true, 1}, {true, 2}, {false, 1}, {false, 2}} {
		stop := tc.stop
		name := fmt.Sprintf("%s/%d in flight", map[bool]string{true: "Stop", false: "Close"}[stop], tc.n)
		t.Run(name, func(t *testing.T) {
			before := openFDs(t)
			s := startServer(t, 2)
			ctx := testCtx(t)
			f, err := Dial(ctx, s.path, Options{QueueSize: 64})
			if err != nil {
				t.Fatal(err)
			}
			disableRing(t, f, 1)
			rng := rand.New(rand.NewPCG(9, 10))
			var pend []*Pending
			for range tc.n { // all submitted before any Wait: with 2, the reaper goroutine reaps
				r := newRequest(t, f, rng, 100, 1, 1)
				defer r.free(f)
				p, err := f.SubmitAsync(1, r.readable, r.writable)
				if err != nil {
					t.Fatal(err)
				}
				pend = append(pend, p)
			}
			var waits []chan error
			for _, p := range pend {
				done := make(chan error, 1)
				go func() { _, err := p.Wait(ctx); done <- err }()
				waits = append(waits, done)
			}
			q := f.queues[1]
			waitUntil(t, "a reaper polls and the waiters wait", func() bool {
				q.mu.Lock()
				defer q.mu.Unlock()
				return q.reaping && (tc.n == 1 || q.handoff != nil)
			})
			want := ErrClosed
			if stop {
				want = ErrStopped
				if err := f.Stop(ctx); err != nil {
					t.Fatal(err)
				}
			} else if err := f.Close(); err != nil {
				t.Fatal(err)
			}
			for i, done := range waits {
				select {
				case err := <-done:
					if !errors.Is(err, want) {
						t.Errorf("waiter %d: %v, want %v", i, err, want)
					}
				case <-time.After(10 * time.Second):
					t.Fatalf("waiter %d still blocked after %s", i, name)
				}
			}
			if stop {
				if err := f.Start(ctx); err != nil {
					t.Fatal(err)
				}
				r := newRequest(t, f, rng, 300, 1, 1)
				n, err := f.Submit(ctx, 1, r.readable, r.writable)
				if err != nil {
					t.Fatalf("after Stop and Start: %v", err)
				}
				r.check(t, n)
				r.free(f)
				if err := f.Close(); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.wait(t); err != nil {
				t.Fatalf("Serve after Close = %v, want nil", err)
			}
			if after := openFDs(t); after != before {
				t.Fatalf("fd leak: %d before, %d after", before, after)
			}
		})
	}
}
