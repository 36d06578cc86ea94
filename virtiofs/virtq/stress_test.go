package virtq

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"testing"
	"time"
)

// TestConcurrentDriverDevice runs the driver and the device on separate goroutines, with
// channels standing in for the kick and call eventfds, and both sides suppressing notifications
// as real ones do. A missing barrier or a wrong suppression decision shows up as a lost wakeup
// (the test times out waiting) or, under -race, as a data race on the buffers or rings.
func TestConcurrentDriverDevice(t *testing.T) {
	total := 5000
	if testing.Short() {
		total = 500
	}
	for _, ev := range []bool{false, true} {
		for _, ind := range []bool{false, true} {
			t.Run(fmt.Sprintf("eventidx=%v/indirect=%v", ev, ind), func(t *testing.T) {
				t.Parallel()
				runStress(t, ev, ind, total)
			})
		}
	}
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default: // already pending, like an eventfd counter
	}
}

func checksum(bufs [][]byte) uint64 {
	h := fnv.New64a()
	for _, b := range bufs {
		h.Write(b)
	}
	return h.Sum64()
}

func runStress(t *testing.T, eventIdx, indirect bool, total int) {
	const size = 16
	r := newRig(t, rigOpts{size: size, eventIdx: eventIdx, indirect: indirect})
	kick := make(chan struct{}, 1)
	call := make(chan struct{}, 1)
	done := make(chan struct{})
	devErr := make(chan error, 1)
	devDone := make(chan struct{})

	// Device: the canonical loop of a vhost-user queue goroutine.
	go func() {
		defer close(devDone)
		var c Chain
		for {
			r.q.DisableNotify()
			for {
				ok, err := r.q.Next(&c)
				if err != nil {
					devErr <- err
					return
				}
				if !ok {
					break
				}
				if len(c.Out) != 1 || len(c.Out[0]) != 8 {
					devErr <- fmt.Errorf("chain %d: unexpected writable buffers %d", c.Head, len(c.Out))
					return
				}
				binary.LittleEndian.PutUint64(c.Out[0], checksum(c.In))
				r.q.Complete(c.Head, 8)
			}
			if r.q.NeedsNotify() {
				signal(call)
			}
			if r.q.EnableNotify() {
				continue
			}
			select {
			case <-kick:
			case <-done:
				return
			}
		}
	}()
	defer func() { close(done); <-devDone }()

	// Driver. Slot k: a header and a payload, readable, at gpaB-0x440+k*0x80 (slot 8 crosses
	// from region A into B), an 8-byte writable reply in B, an indirect table in A.
	type req struct {
		slot int
		want uint64
	}
	inflight := map[uint16]req{}
	var free []int
	for k := range size {
		free = append(free, k)
	}
	sent, completed, interrupts := 0, 0, 0
	for completed < total {
		progressed := false
		for sent < total && len(free) > 0 {
			k := free[len(free)-1]
			base := uint64(gpaB - 0x440 + k*0x80)
			rd := []Buf{{base, 8}, {base + 8, 0x78}}
			wr := []Buf{{0x18000 + uint64(k)*0x10, 8}}
			var ind *Buf
			if indirect {
				ind = &Buf{0x6000 + uint64(k)*0x40, 0x40}
			}
			if r.d.NumFree() < 3 && !indirect {
				break
			}
			var in [][]byte
			for _, b := range rd {
				s, err := r.mem.AppendIovecs(nil, b.Addr, uint64(b.Len))
				if err != nil {
					t.Fatal(err)
				}
				in = append(in, s...)
			}
			binary.LittleEndian.PutUint64(in[0], uint64(sent))
			for i, s := range in[1:] {
				for j := range s {
					s[j] = byte(sent*31 + i*7 + j)
				}
			}
			head, err := r.d.Add(rd, wr, ind)
			if err != nil {
				t.Fatalf("Add #%d: %v", sent, err)
			}
			free = free[:len(free)-1]
			inflight[head] = req{k, checksum(in)}
			sent++
			progressed = true
		}
		if r.d.NeedsKick() {
			signal(kick)
		}
		for {
			h, n, ok := r.d.PopUsed()
			if !ok {
				break
			}
			q, found := inflight[h]
			if !found || n != 8 {
				t.Fatalf("used element for head %d (in flight %v), %d bytes", h, found, n)
			}
			got := binary.LittleEndian.Uint64(r.bytes(t, 0x18000+uint64(q.slot)*0x10, 8))
			if got != q.want {
				t.Fatalf("request in slot %d: checksum %#x, want %#x", q.slot, got, q.want)
			}
			delete(inflight, h)
			free = append(free, q.slot)
			completed++
			progressed = true
		}
		if progressed || completed == total {
			continue
		}
		if r.d.EnableInterrupts() {
			continue
		}
		select {
		case <-call:
			interrupts++
			r.d.DisableInterrupts()
		case err := <-devErr:
			t.Fatalf("device: %v", err)
		case <-time.After(20 * time.Second):
			t.Fatalf("lost wakeup: %d sent, %d completed, %d in flight, device LastAvail %d",
				sent, completed, len(inflight), r.q.LastAvail())
		}
	}
	if r.d.NumFree() != size {
		t.Fatalf("NumFree = %d at the end", r.d.NumFree())
	}
	t.Logf("%d requests, %d interrupts", total, interrupts)
}
