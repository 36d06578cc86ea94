package vhostuser

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// withPollStart sets the first poll window, so that a test can have a long window at once.
func withPollStart(d time.Duration) Option {
	return func(b *Backend) { b.pollStart = d }
}

// withPollEnd has hook called on the ring goroutine whenever a poll runs out without work,
// before kicks are enabled again.
func withPollEnd(hook func(idx int)) Option {
	return func(b *Backend) { b.pollEnd = hook }
}

// kicksSuppressed reports whether the device told the driver not to kick even for the next chain
// it adds: what a polling ring does (virtq.Queue.SuppressNotify), and what a ring waiting for
// kicks never does.
func (r *rig) kicksSuppressed(tr *testRing) bool {
	used := tr.drv.UsedAddr()
	if !tr.eventIdx {
		return r.load16(used)&1 != 0 // used.flags NO_NOTIFY
	}
	return r.load16(used+4+8*rigRingSz) == tr.drv.AvailIdx()-1 // avail_event behind
}

// expectNoPoll checks that the ring, idle for settle, does not poll: its kicks are not
// suppressed, and a request published without a kick asks for one and is served only once it
// comes.
func (r *rig) expectNoPoll(t *testing.T, tr *testRing, settle time.Duration) {
	t.Helper()
	time.Sleep(settle)
	if r.kicksSuppressed(tr) {
		t.Fatal("kicks suppressed on a ring that does not poll")
	}
	want := r.publishEcho(tr, 100, false, 1<<20, 2<<20)
	if !tr.drv.NeedsKick() {
		t.Fatal("no kick asked for on a ring that does not poll")
	}
	waitEvent(t, tr.call, false)
	kick(t, tr.kick)
	r.expectEcho(tr, want, 2<<20)
}

// load16 loads the little-endian u16 at gpa (4-aligned) atomically, as the device stores it.
func (r *rig) load16(gpa uint64) uint16 {
	w := atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.mapping[gpa])))
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], w)
	return binary.LittleEndian.Uint16(b[:])
}

// waitPolling waits until the ring polls: kicks suppressed after a batch, outside HandleQueue
// (which suppresses kicks its own way while it serves).
func (r *rig) waitPolling(tr *testRing) {
	r.t.Helper()
	polling := func() bool { return !r.dev.busy[tr.idx].Load() && r.kicksSuppressed(tr) }
	for deadline := time.Now().Add(5 * time.Second); !polling(); time.Sleep(50 * time.Microsecond) {
		if time.Now().After(deadline) {
			r.t.Fatal("the ring does not poll: kicks not suppressed after 5 s")
		}
	}
}

// idleRoundTrip waits until the ring is out of HandleQueue, so that the request is not served by
// the batch before it (which looks for more before it returns), then makes a round trip.
func (r *rig) idleRoundTrip(tr *testRing) {
	r.t.Helper()
	for r.dev.busy[tr.idx].Load() {
		time.Sleep(50 * time.Microsecond)
	}
	r.roundTrip(tr)
}

// usedIdx is the used ring's index as the device last published it.
func (r *rig) usedIdx(tr *testRing) uint16 {
	w := atomic.LoadUint32((*uint32)(unsafe.Pointer(&r.mapping[tr.drv.UsedAddr()])))
	var b [4]byte
	binary.NativeEndian.PutUint32(b[:], w)
	return binary.LittleEndian.Uint16(b[2:])
}

// publishWhilePolling publishes an echo request while the ring polls and checks the driver is
// not asked to kick for it. Without EVENT_IDX a driver that looks after the request was served
// and kicks enabled again is asked to (a harmless kick, which the test does not send): only a
// request not served yet must find kicks suppressed.
func (r *rig) publishWhilePolling(tr *testRing) []byte {
	r.t.Helper()
	used := r.usedIdx(tr)
	want := r.publishEcho(tr, 500, false, 1<<20, 2<<20)
	if tr.drv.NeedsKick() && r.usedIdx(tr) == used {
		r.t.Fatal("the driver is asked to kick while the ring polls")
	}
	return want
}

// startPollingRing sets a rig up with one started request ring (1).
func startPollingRing(t *testing.T, eventIdx bool, opts ...Option) (*rig, *testRing) {
	r := newRig(t, opts...)
	r.realize(qemuProtocol)
	features := guestAcked
	if !eventIdx {
		features &^= FeatureEventIdx
	}
	must(t, r.c.SetFeatures(features))
	must(t, r.c.AddMemReg(r.region(), r.memfd))
	tr := r.newRing(1, eventIdx)
	r.startRing(tr, 0, true)
	must(t, r.c.SetVringErr(1, tr.errf))
	r.sync()
	return r, tr
}

// A polling ring serves what is published during its window without a kick (the driver is told
// not to kick, in both notification modes), and a stop, a memory update, disabling the ring and
// a Wake are all honoured at once, long before a window of 10 s has run out.
func TestBackendPollingWindow(t *testing.T) {
	const window = 10 * time.Second
	const prompt = 2 * time.Second // much less than the window, even under load
	for _, eventIdx := range []bool{false, true} {
		t.Run(fmt.Sprintf("eventIdx=%v", eventIdx), func(t *testing.T) {
			checkNoLeak(t)
			r, tr := startPollingRing(t, eventIdx, WithAdaptivePolling(window, nil), withPollStart(window))
			c := r.c
			// The second request's wake-up came soon after the batch of the first: the window
			// grows from 0 to its start value, the whole limit here.
			r.idleRoundTrip(tr)
			if w := r.dev.window[1].Load(); w != 0 {
				t.Fatalf("poll window of the first batch: %v, want 0", time.Duration(w))
			}
			r.idleRoundTrip(tr)
			if w := time.Duration(r.dev.window[1].Load()); w != window {
				t.Fatalf("poll window after a quick wake-up: %v, want %v", w, window)
			}
			kicks := r.dev.calls[1].Load()
			for range 3 {
				r.waitPolling(tr)
				want := r.publishWhilePolling(tr)
				r.expectEcho(tr, want, 2<<20) // served without a kick
			}
			if n := r.dev.calls[1].Load() - kicks; n != 3 {
				t.Fatalf("%d HandleQueue calls for 3 requests", n)
			}

			// A Wake is served while polling. That batch takes nothing from the ring, so no poll
			// follows it: the ring sleeps, kicks on, until a kick.
			r.waitPolling(tr)
			for len(r.dev.called) > 0 {
				<-r.dev.called
			}
			r.dev.vrings[1].Load().Wake()
			select {
			case <-r.dev.called:
			case <-time.After(prompt):
				t.Fatalf("Wake not honoured within %v while polling", prompt)
			}
			for r.dev.busy[1].Load() {
				time.Sleep(50 * time.Microsecond)
			}
			time.Sleep(10 * time.Millisecond)
			if r.kicksSuppressed(tr) {
				t.Fatal("the ring polls after a batch that took nothing")
			}
			r.idleRoundTrip(tr) // kicked: polling again after it

			// A memory update while polling: the poll lets it through and goes on with the new
			// table, which maps the same memory in two regions.
			r.waitPolling(tr)
			half := uint64(rigMemSize / 2)
			split := []MemoryRegion{
				{GuestPhysAddr: 0, Size: half, UserAddr: r.base},
				{GuestPhysAddr: half, Size: half, UserAddr: r.base + half, MmapOffset: half},
			}
			start := time.Now()
			must(t, c.SetMemTable(split, []int{r.memfd, r.memfd}))
			if d := time.Since(start); d > prompt {
				t.Fatalf("SET_MEM_TABLE took %v while the ring polled", d)
			}
			want := r.publishWhilePolling(tr)
			r.expectEcho(tr, want, 2<<20)

			// Disabling the ring ends the poll: kicks are asked for again, and nothing is served
			// until the ring is enabled.
			r.waitPolling(tr)
			must(t, c.SetVringEnable(1, false))
			r.sync()
			for deadline := time.Now().Add(prompt); r.kicksSuppressed(tr); time.Sleep(50 * time.Microsecond) {
				if time.Now().After(deadline) {
					t.Fatalf("a disabled ring still polls after %v", prompt)
				}
			}
			want = r.publishEcho(tr, 500, false, 1<<20, 2<<20)
			if !tr.drv.NeedsKick() {
				t.Fatal("no kick asked for by a disabled ring")
			}
			kick(t, tr.kick)
			waitEvent(t, tr.call, false)
			must(t, c.SetVringEnable(1, true))
			r.expectEcho(tr, want, 2<<20)

			// Stopping the ring (GET_VRING_BASE) while it polls.
			r.waitPolling(tr)
			start = time.Now()
			base, err := c.GetVringBase(1)
			if d := time.Since(start); d > prompt {
				t.Fatalf("GET_VRING_BASE took %v while the ring polled", d)
			}
			if err != nil || base != 8 {
				t.Fatalf("GET_VRING_BASE = %d, %v; want 8", base, err)
			}
		})
	}
}

// The window grows while work comes back sooner than the limit, never beyond it, and drops to 0
// once work comes later than the limit: the ring then waits for kicks as without polling.
func TestBackendPollingAdapts(t *testing.T) {
	checkNoLeak(t)
	const limit = 400 * time.Millisecond // far above the gap: a loaded machine stalls the test
	const gap = 20 * time.Millisecond
	r, tr := startPollingRing(t, true, WithAdaptivePolling(limit, nil))
	var seen []time.Duration
	for len(seen) < 60 {
		time.Sleep(gap)
		r.roundTrip(tr)
		w := time.Duration(r.dev.window[1].Load())
		if w > limit {
			t.Fatalf("window %v beyond the limit %v", w, limit)
		}
		seen = append(seen, w)
		if w >= gap {
			break
		}
	}
	if last := seen[len(seen)-1]; last < gap {
		t.Fatalf("window did not grow to cover requests %v apart: %v", gap, seen)
	}
	for _, w := range seen { // 0, or the start value doubled k times
		for w > pollStartWindow && w%2 == 0 {
			w /= 2
		}
		if w != 0 && w != pollStartWindow {
			t.Fatalf("windows %v: not 0 nor %v doubled", seen, pollStartWindow)
		}
	}
	t.Logf("windows: %v", seen)

	// Work keeps coming within the window: the ring serves it without kicks (at least once: on
	// a loaded machine the test may be slower than the window).
	unkicked := 0
	for range 3 {
		time.Sleep(gap / 4)
		want := r.publishEcho(tr, 100, false, 1<<20, 2<<20)
		if tr.drv.NeedsKick() {
			kick(t, tr.kick)
		} else {
			unkicked++
		}
		r.expectEcho(tr, want, 2<<20)
	}
	if unkicked == 0 {
		t.Fatalf("the driver was asked to kick for each of 3 requests %v apart with a window of %v", gap/4, seen[len(seen)-1])
	}

	// Nothing for longer than the limit: the window drops to 0 at the next wake-up.
	time.Sleep(limit + limit/2)
	r.roundTrip(tr)
	if w := time.Duration(r.dev.window[1].Load()); w != 0 {
		t.Fatalf("window after a wait longer than the limit: %v, want 0", w)
	}
	// No polling now: a request published without a kick waits for one.
	r.expectNoPoll(t, tr, 10*time.Millisecond)
}

// A chain published after the last look of a poll and before kicks are enabled again gets no
// kick (the driver was told not to kick); the look after kicks are enabled again must find it.
func TestBackendPollingEndRecheck(t *testing.T) {
	for _, eventIdx := range []bool{false, true} {
		t.Run(fmt.Sprintf("eventIdx=%v", eventIdx), func(t *testing.T) {
			checkNoLeak(t)
			type published struct {
				want     []byte
				needKick bool
				err      error
			}
			armed := make(chan *testRing, 1)
			done := make(chan published, 1)
			var r *rig
			hook := func(idx int) {
				select {
				case tr := <-armed: // the test goroutine leaves the driver alone until done
					want := []byte("published as the poll ended")
					copy(r.mapping[1<<20:], want)
					_, err := tr.drv.Add([]virtq.Buf{{Addr: 1 << 20, Len: uint32(len(want))}},
						[]virtq.Buf{{Addr: 3 << 20, Len: uint32(len(want))}}, nil)
					done <- published{want, tr.drv.NeedsKick(), err}
				default:
				}
			}
			r, tr := startPollingRing(t, eventIdx, WithAdaptivePolling(time.Second, nil),
				withPollStart(time.Millisecond), withPollEnd(hook))
			r.idleRoundTrip(tr)
			r.idleRoundTrip(tr) // the window is at least 1 ms now: each batch is followed by a poll
			// The next request is served after a kick, so no kick or wake-up is left pending;
			// the poll after it runs out and the hook publishes a chain without a kick.
			for deadline := time.Now().Add(5 * time.Second); r.dev.busy[1].Load() || r.kicksSuppressed(tr); time.Sleep(100 * time.Microsecond) {
				if time.Now().After(deadline) {
					t.Fatal("the ring still polls after 5 s")
				}
			}
			want := r.publishEcho(tr, 100, false, 1<<20, 2<<20)
			if !tr.drv.NeedsKick() {
				t.Fatal("no kick asked for by a sleeping ring")
			}
			armed <- tr
			kick(t, tr.kick)
			var p published
			select {
			case p = <-done:
			case <-time.After(5 * time.Second):
				t.Fatal("no poll ran out within 5 s")
			}
			if p.err != nil {
				t.Fatal(p.err)
			}
			if p.needKick {
				t.Fatal("the driver is asked to kick before the poll has enabled kicks again")
			}
			for i, w := range [][]byte{want, p.want} {
				deadline := time.Now().Add(5 * time.Second)
				_, n, ok := tr.drv.PopUsed()
				for ; !ok && time.Now().Before(deadline); _, n, ok = tr.drv.PopUsed() {
					time.Sleep(100 * time.Microsecond)
				}
				resp := uint64(2<<20 + i<<20)
				if !ok || int(n) != len(w) || !bytes.Equal(r.mapping[resp:resp+uint64(len(w))], w) {
					t.Fatalf("request %d: used %v, %d bytes (want %d)", i, ok, n, len(w))
				}
			}
		})
	}
}

// Without WithAdaptivePolling, or for a ring it leaves out, a ring never polls: it asks for a
// kick for the next chain as soon as it is idle, and serves nothing without one.
func TestBackendPollingOff(t *testing.T) {
	for name, opts := range map[string][]Option{
		"default":       nil,
		"ring excluded": {WithAdaptivePolling(time.Second, func(idx int) bool { return idx == 0 }), withPollStart(time.Second)},
	} {
		t.Run(name, func(t *testing.T) {
			checkNoLeak(t)
			r, tr := startPollingRing(t, true, opts...)
			for range 3 {
				r.roundTrip(tr)
			}
			if w := r.dev.window[1].Load(); w != 0 {
				t.Fatalf("poll window %v", time.Duration(w))
			}
			r.expectNoPoll(t, tr, 5*time.Millisecond)
		})
	}
}
