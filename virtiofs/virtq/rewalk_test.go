package virtq

import (
	"errors"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

// TestRewalkAfterRemap defers a chain, replaces the memory table (same guest RAM, new host
// mapping) and completes the chain through Rewalk: the reply lands in the new mapping.
func TestRewalkAfterRemap(t *testing.T) {
	for _, indirect := range []bool{false, true} {
		r := newRig(t, rigOpts{indirect: indirect})
		rd := []Buf{{dataGPA, 40}}
		wr := []Buf{{dataGPA + 0x200, 16}, {dataGPA + 0x400, 64}}
		var ind *Buf
		if indirect {
			ind = &Buf{Addr: dataGPA + 0x800, Len: 16 * 3}
		}
		head := mustAdd(t, r.d, rd, wr, ind)
		var c Chain
		mustNext(t, r.q, &c)

		// The front-end replaces the table: the same guest RAM, copied to new host memory.
		backing := make([][]byte, len(r.backing))
		for i, b := range r.backing {
			backing[i] = append([]byte(nil), b...)
		}
		mem, err := guestmem.New(
			guestmem.FromBytes(gpaA, userA, backing[0]),
			guestmem.FromBytes(gpaB, userB, backing[1]),
			guestmem.FromBytes(gpaC, userC, backing[2]),
		)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.q.Remap(mem); err != nil {
			t.Fatal(err)
		}
		var again Chain
		if err := r.q.Rewalk(&again, head); err != nil {
			t.Fatalf("Rewalk: %v", err)
		}
		if again.Head != head || again.OutLen != 80 || again.InLen != 40 || len(again.Out) != 2 {
			t.Fatalf("rewalked chain: head %d in %d out %d (%d buffers)", again.Head, again.InLen, again.OutLen, len(again.Out))
		}
		if sameMem(again.Out[0], c.Out[0]) {
			t.Fatal("Rewalk returned the old mapping")
		}
		copy(again.Out[0], "reply")
		if string(backing[0][dataGPA+0x200:dataGPA+0x205]) != "reply" {
			t.Fatal("the reply did not reach the new mapping")
		}
	}
}

// TestRewalkInvalid: a chain rewritten into garbage while in flight is an error, and the queue
// keeps working.
func TestRewalkInvalid(t *testing.T) {
	r := newRig(t, rigOpts{})
	head := mustAdd(t, r.d, nil, []Buf{{dataGPA, 16}, {dataGPA + 0x100, 16}}, nil)
	var c Chain
	mustNext(t, r.q, &c)
	// Make the first descriptor point to itself.
	desc := r.d.desc[int(head)*descSize : int(head)*descSize+descSize]
	desc[12] |= byte(DescFNext)
	desc[14], desc[15] = byte(head), byte(head>>8)
	if err := r.q.Rewalk(&c, head); !errors.Is(err, ErrInvalidRing) {
		t.Fatalf("Rewalk of a looping chain: %v", err)
	}
	if err := r.q.Rewalk(&c, r.q.Size()); !errors.Is(err, ErrInvalidRing) {
		t.Fatalf("Rewalk of an out-of-range head: %v", err)
	}
	if r.q.Err() != nil {
		t.Fatalf("queue broken by Rewalk: %v", r.q.Err())
	}
	r.q.Complete(head, 0)
	mustBeEmpty(t, r.q)
}

// TestResumes tells a paused-and-resumed ring (same base, same used index) from a reset one.
func TestResumes(t *testing.T) {
	r := newRig(t, rigOpts{})
	for range 3 {
		mustAdd(t, r.d, nil, []Buf{{dataGPA, 16}}, nil)
	}
	var c Chain
	mustNext(t, r.q, &c)
	r.q.Complete(c.Head, 0)
	mustNext(t, r.q, &c) // in flight across the restart
	cfg := r.q.cfg

	resumed := cfg
	resumed.LastAvail = r.q.LastAvail()
	q2, err := New(r.mem, resumed)
	if err != nil {
		t.Fatal(err)
	}
	if !q2.Resumes(r.q) {
		t.Error("a ring restarted at the base it stopped at does not resume")
	}
	if q2.Resumes(q2) || q2.Resumes(nil) {
		t.Error("a queue resumes itself or nothing")
	}

	// The guest reset: fresh rings at the same place, indices 0.
	clear(r.backing[0][ringGPA : ringGPA+0x1000])
	fresh := cfg
	fresh.LastAvail = 0
	q3, err := New(r.mem, fresh)
	if err != nil {
		t.Fatal(err)
	}
	if q3.Resumes(r.q) {
		t.Error("a reset ring resumes the old one")
	}
	moved := resumed
	moved.DescAddr += 0x1000
	if q4, err := New(r.mem, moved); err == nil && q4.Resumes(r.q) {
		t.Error("a ring at another address resumes the old one")
	}
}
