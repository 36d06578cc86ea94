package virtq

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
)

// Each case writes a malformed chain with the driver's raw access and publishes it. The device
// must return an error wrapping ErrInvalidRing, promptly, without panicking, and stay broken.
func TestHostileChains(t *testing.T) {
	const size = 8
	table := func(d *Driver, ds ...RawDesc) {
		if err := d.WriteIndirect(0x6000, ds); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name     string
		indirect bool // negotiated
		setup    func(d *Driver)
		isOOB    bool // also wraps guestmem.ErrOutOfBounds
	}{
		{name: "loop", setup: func(d *Driver) {
			d.WriteDesc(0, dataGPA, 8, DescFNext, 1)
			d.WriteDesc(1, dataGPA, 8, DescFNext, 0)
			d.Publish(0)
		}},
		{name: "self loop", setup: func(d *Driver) {
			d.WriteDesc(5, dataGPA, 8, DescFNext, 5)
			d.Publish(5)
		}},
		{name: "zero-length loop", setup: func(d *Driver) {
			d.WriteDesc(0, 0, 0, DescFNext, 1)
			d.WriteDesc(1, 0, 0, DescFNext|DescFWrite, 0)
			d.Publish(0)
		}},
		{name: "next >= size", setup: func(d *Driver) {
			d.WriteDesc(0, dataGPA, 8, DescFNext, size)
			d.Publish(0)
		}},
		{name: "next = 65535", setup: func(d *Driver) {
			d.WriteDesc(0, dataGPA, 8, DescFNext, math.MaxUint16)
			d.Publish(0)
		}},
		{name: "head >= size", setup: func(d *Driver) { d.Publish(size) }},
		{name: "head = 65535", setup: func(d *Driver) { d.Publish(math.MaxUint16) }},
		{name: "addr unmapped", isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0x20000, 8, 0, 0) // between B and C
			d.Publish(0)
		}},
		{name: "addr+len past region C", isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, gpaC+sizeC-8, 9, 0, 0)
			d.Publish(0)
		}},
		{name: "addr+len past B into the gap", isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, gpaB, sizeB+1, DescFWrite, 0)
			d.Publish(0)
		}},
		{name: "addr+len overflows 2^64", isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, math.MaxUint64-15, 0x100, 0, 0)
			d.Publish(0)
		}},
		{name: "len 4GiB-1 from a mapped address", isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, dataGPA, math.MaxUint32, DescFWrite, 0)
			d.Publish(0)
		}},
		{name: "readable after writable", setup: func(d *Driver) {
			d.WriteDesc(0, dataGPA, 8, DescFWrite|DescFNext, 1)
			d.WriteDesc(1, dataGPA, 8, 0, 0)
			d.Publish(0)
		}},
		{name: "indirect not negotiated", setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, 0, 0})
			d.WriteDesc(0, 0x6000, 16, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "nested indirect", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, DescFNext, 1}, RawDesc{0x6000, 32, DescFIndirect, 0})
			d.WriteDesc(0, 0x6000, 32, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table pointing at itself", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{0x6000, 16, DescFIndirect, 0})
			d.WriteDesc(0, 0x6000, 16, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "INDIRECT|NEXT", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, 0, 0})
			d.WriteDesc(0, 0x6000, 16, DescFIndirect|DescFNext, 1)
			d.WriteDesc(1, dataGPA, 8, 0, 0)
			d.Publish(0)
		}},
		{name: "indirect table len 0", indirect: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0x6000, 0, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table len 17", indirect: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0x6000, 17, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table len 8", indirect: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0x6000, 8, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table too long", indirect: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0, 16*(MaxIndirectDescs+1), DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table len 2^32-16", indirect: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0, math.MaxUint32-15, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table unmapped", indirect: true, isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, 0x30000, 32, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "indirect table across A/B", indirect: true, isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, gpaB-16, 32, DescFIndirect, 0) // contiguous in GPA, but tables must be in one region
			d.Publish(0)
		}},
		{name: "indirect table overflows 2^64", indirect: true, isOOB: true, setup: func(d *Driver) {
			d.WriteDesc(0, math.MaxUint64-15, 32, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "loop inside indirect table", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, DescFNext, 1}, RawDesc{dataGPA, 8, DescFNext, 0})
			d.WriteDesc(0, 0x6000, 32, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "next past indirect table", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, DescFNext, 2}, RawDesc{dataGPA, 8, 0, 0}, RawDesc{dataGPA, 8, 0, 0})
			d.WriteDesc(0, 0x6000, 32, DescFIndirect, 0) // table of 2: entry 2 exists in memory but not in the table
			d.Publish(0)
		}},
		{name: "readable in indirect after writable direct", indirect: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, 0, 0})
			d.WriteDesc(0, dataGPA, 8, DescFWrite|DescFNext, 1)
			d.WriteDesc(1, 0x6000, 16, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "bad buffer inside indirect table", indirect: true, isOOB: true, setup: func(d *Driver) {
			table(d, RawDesc{dataGPA, 8, DescFNext, 1}, RawDesc{math.MaxUint64, 2, DescFWrite, 0})
			d.WriteDesc(0, 0x6000, 32, DescFIndirect, 0)
			d.Publish(0)
		}},
		{name: "avail idx jumps by size+1", setup: func(d *Driver) {
			for i := range uint16(size) {
				d.WriteDesc(i, dataGPA, 8, 0, 0)
			}
			d.SetAvailIdx(size + 1)
		}},
		{name: "avail idx goes backwards", setup: func(d *Driver) { d.SetAvailIdx(math.MaxUint16) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigOpts{size: size, indirect: tc.indirect})
			tc.setup(r.d)
			done := make(chan struct{})
			var ok bool
			var err error
			c := Chain{In: make([][]byte, 0, 4)}
			go func() {
				defer close(done)
				ok, err = r.q.Next(&c)
			}()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("Next hangs")
			}
			if ok || !errors.Is(err, ErrInvalidRing) {
				t.Fatalf("Next = %v, %v; want ErrInvalidRing", ok, err)
			}
			if tc.isOOB != errors.Is(err, guestmem.ErrOutOfBounds) {
				t.Errorf("error %q: wraps ErrOutOfBounds = %v, want %v", err, !tc.isOOB, tc.isOOB)
			}
			if len(c.In) != 0 || len(c.Out) != 0 || c.InLen != 0 || c.OutLen != 0 {
				t.Error("partial chain left in c")
			}
			t.Log(err)
			// Broken for good: further calls fail the same way and complete nothing.
			if ok, err2 := r.q.Next(&c); ok || err2 != err || r.q.Err() != err {
				t.Fatalf("second Next = %v, %v", ok, err2)
			}
			r.q.Complete(0, 0)
			if _, _, ok := r.d.PopUsed(); ok {
				t.Fatal("broken queue completed a chain")
			}
			if r.q.NeedsNotify() || r.q.EnableNotify() {
				t.Fatal("broken queue wants notifications")
			}
		})
	}
}

// The guest rewrites a descriptor after the device popped the chain: the popped chain keeps the
// buffers that were checked, and the rewritten descriptor is checked afresh when published again.
func TestDescriptorRewrittenBetweenChains(t *testing.T) {
	r := newRig(t, rigOpts{})
	r.d.WriteDesc(0, dataGPA, 8, 0, 0)
	r.d.Publish(0)
	var c Chain
	mustNext(t, r.q, &c)
	r.d.WriteDesc(0, math.MaxUint64, 8, 0, 0)
	if len(c.In) != 1 || !sameMem(c.In[0], r.bytes(t, dataGPA, 8)) {
		t.Fatal("popped chain changed after the descriptor was rewritten")
	}
	r.d.Publish(0)
	if _, err := r.q.Next(&c); !errors.Is(err, ErrInvalidRing) {
		t.Fatalf("rewritten descriptor: %v", err)
	}
}
