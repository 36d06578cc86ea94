package vhostuser

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/guestmem"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// fakeDevice echoes: it copies each chain's readable bytes into its writable buffers. It records
// HandleQueue calls, with the ring, and the poll window of the last call that took a chain (a
// call that takes nothing, for a wake-up the batch before had already served, says nothing
// of the window requests are served in). A chain whose data starts
// with "FAIL" or "PANIC" makes it return an error or panic; one that starts with "HOLD" is
// answered only after the test closes hold (holding tells the test that the device waits).
type fakeDevice struct {
	queues  int
	calls   [8]atomic.Int64
	vrings  [8]atomic.Pointer[Vring]
	window  [8]atomic.Int64 // Vring.pollWindow at the last call that took a chain
	busy    [8]atomic.Bool  // in HandleQueue
	resets  atomic.Int64
	called  chan int
	hold    chan struct{}
	holding chan struct{}
}

func newFakeDevice(queues int) *fakeDevice {
	return &fakeDevice{queues: queues, called: make(chan int, 1024), hold: make(chan struct{}),
		holding: make(chan struct{}, 1)}
}

func (d *fakeDevice) NumQueues() int   { return d.queues }
func (d *fakeDevice) Features() uint64 { return 1<<26 | 1<<1 } // a transport bit (ignored) and a device bit
func (d *fakeDevice) Reset()           { d.resets.Add(1) }

func (d *fakeDevice) HandleQueue(idx int, vr *Vring) (bool, error) {
	d.calls[idx].Add(1)
	d.vrings[idx].Store(vr)
	d.busy[idx].Store(true)
	defer d.busy[idx].Store(false)
	select {
	case d.called <- idx:
	default:
	}
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
			d.window[idx].Store(int64(vr.pollWindow))
			if len(c.In) > 0 && bytes.HasPrefix(c.In[0], []byte("FAIL")) {
				return false, errors.New("device says the ring is broken")
			}
			if len(c.In) > 0 && bytes.HasPrefix(c.In[0], []byte("PANIC")) {
				panic("device bug")
			}
			if len(c.In) > 0 && bytes.HasPrefix(c.In[0], []byte("HOLD")) {
				d.holding <- struct{}{}
				<-d.hold
			}
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

// copyIovecs copies the byte stream of src into dst and returns the bytes copied.
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

const (
	rigMemSize = 4 << 20
	rigRingSz  = 256
)

// rig is a Backend serving a fakeDevice over a socketpair, driven by a Client, with 4 MiB of
// memfd guest memory mapped into the test (the front-end view).
type rig struct {
	t       *testing.T
	dev     *fakeDevice
	b       *Backend
	c       *Client
	cancel  context.CancelFunc
	served  chan error
	result  *error
	memfd   int
	mapping []byte
	mem     *guestmem.Memory
	base    uint64 // user address of gpa 0
}

func newRig(t *testing.T, opts ...Option) *rig {
	t.Helper()
	a, b := socketPair(t)
	r := &rig{t: t, dev: newFakeDevice(2), served: make(chan error, 1)}
	r.b = NewBackend(r.dev, opts...)
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.served <- r.b.Serve(ctx, a) }()
	r.c = NewClient(b)

	fd, err := unix.MemfdCreate("rig", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	r.memfd = fd
	if err := unix.Ftruncate(fd, rigMemSize); err != nil {
		t.Fatal(err)
	}
	if r.mapping, err = unix.Mmap(fd, 0, rigMemSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		t.Fatal(err)
	}
	r.base = uint64(uintptr(unsafe.Pointer(&r.mapping[0])))
	if r.mem, err = guestmem.New(guestmem.FromBytes(0, r.base, r.mapping)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.c.Close()
		r.wait()
		cancel()
		unix.Munmap(r.mapping)
		unix.Close(r.memfd)
	})
	return r
}

// wait returns what Serve returned, waiting for it if needed.
func (r *rig) wait() error {
	r.t.Helper()
	if r.result != nil {
		return *r.result
	}
	select {
	case err := <-r.served:
		r.result = &err
		return err
	case <-time.After(10 * time.Second):
		r.t.Fatal("Serve did not return")
		return nil
	}
}

// region is the whole memfd as one region.
func (r *rig) region() MemoryRegion {
	return MemoryRegion{GuestPhysAddr: 0, Size: rigMemSize, UserAddr: r.base}
}

// realize performs the protocol part of QEMU's realize sequence, acking protocol.
func (r *rig) realize(protocol uint64) {
	t := r.t
	t.Helper()
	c := r.c
	must(t, c.SetProtocolFeatures(protocol))
	if _, err := c.GetQueueNum(); err != nil {
		t.Fatal(err)
	}
	must(t, c.SetOwner())
	for i := uint8(0); i < 2; i++ {
		must(t, c.SetVringCall(i, eventfds(t, 1)[0]))
		must(t, c.SetVringErr(i, eventfds(t, 1)[0]))
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// testRing is one ring, driver side, with its eventfds.
type testRing struct {
	idx              uint8
	drv              *virtq.Driver
	eventIdx         bool
	kick, call, errf int
}

// newRing lays out a fresh ring (zeroed: a rebooted guest) in the first MiB.
func (r *rig) newRing(idx uint8, eventIdx bool) *testRing {
	r.t.Helper()
	drv, err := virtq.NewDriver(r.mem, 0x10000*uint64(idx+1), rigRingSz, eventIdx)
	if err != nil {
		r.t.Fatal(err)
	}
	fds := eventfds(r.t, 3)
	for _, fd := range fds {
		unix.SetNonblock(fd, true)
	}
	return &testRing{idx: idx, drv: drv, eventIdx: eventIdx, kick: fds[0], call: fds[1], errf: fds[2]}
}

// startRing is QEMU's per-ring start: NUM, BASE, ADDR, KICK, [ENABLE], CALL.
func (r *rig) startRing(tr *testRing, base uint32, enable bool) {
	t := r.t
	t.Helper()
	c := r.c
	i := uint32(tr.idx)
	must(t, c.SetVringNum(i, rigRingSz))
	must(t, c.SetVringBase(i, base))
	must(t, c.SetVringAddr(VringAddr{Index: i, Desc: r.base + tr.drv.DescAddr(),
		Used: r.base + tr.drv.UsedAddr(), Avail: r.base + tr.drv.AvailAddr()}))
	must(t, c.SetVringKick(tr.idx, tr.kick))
	if enable {
		must(t, c.SetVringEnable(i, true))
	}
	must(t, c.SetVringCall(tr.idx, tr.call))
	waitEvent(t, tr.call, true) // the back-end signals a new call fd once
}

// waitEvent waits up to 5 s (want) or 100 ms (!want) for fd to become readable and consumes its
// counter. For !want, the short wait is a negative check, not synchronisation.
func waitEvent(t *testing.T, fd int, want bool) {
	t.Helper()
	timeout := 5000
	if !want {
		timeout = 100
	}
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, timeout)
	for err == unix.EINTR {
		n, err = unix.Poll(pfd, timeout)
	}
	if err != nil {
		t.Fatal(err)
	}
	if got := n > 0; got != want {
		t.Fatalf("fd %d readable = %v, want %v", fd, got, want)
	}
	if n > 0 {
		var b [8]byte
		unix.Read(fd, b[:])
	}
}

// kick notifies the back-end.
func kick(t *testing.T, fd int) {
	t.Helper()
	if err := signal(fd); err != nil {
		t.Fatal(err)
	}
}

var echoSeq atomic.Int64

// echo publishes a request of n readable bytes at gpa 1 MiB (split in two descriptors, or one
// indirect table) and n writable bytes at gpa 2 MiB, and returns the expected contents.
func (r *rig) publishEcho(tr *testRing, n int, indirect bool, reqGPA, respGPA uint64) []byte {
	r.t.Helper()
	want := []byte(fmt.Sprintf("request %d:", echoSeq.Add(1)))
	want = append(want, bytes.Repeat([]byte{byte(n)}, n-len(want))...)
	copy(r.mapping[reqGPA:], want)
	clear(r.mapping[respGPA : respGPA+uint64(n)])
	half := uint32(n / 2)
	rd := []virtq.Buf{{Addr: reqGPA, Len: half}, {Addr: reqGPA + uint64(half), Len: uint32(n) - half}}
	wr := []virtq.Buf{{Addr: respGPA, Len: uint32(n)}}
	var ind *virtq.Buf
	if indirect {
		ind = &virtq.Buf{Addr: 0x80000, Len: 16 * 3}
	}
	if _, err := tr.drv.Add(rd, wr, ind); err != nil {
		r.t.Fatal(err)
	}
	return want
}

// roundTrip publishes an echo request, kicks, waits for the completion and checks it.
func (r *rig) roundTrip(tr *testRing) {
	r.t.Helper()
	want := r.publishEcho(tr, 1000, false, 1<<20, 2<<20)
	if tr.drv.NeedsKick() {
		kick(r.t, tr.kick)
	}
	r.expectEcho(tr, want, 2<<20)
}

func (r *rig) expectEcho(tr *testRing, want []byte, respGPA uint64) {
	r.t.Helper()
	waitEvent(r.t, tr.call, true)
	_, written, ok := tr.drv.PopUsed()
	if !ok {
		r.t.Fatal("call signalled but nothing used")
	}
	if int(written) != len(want) || !bytes.Equal(r.mapping[respGPA:respGPA+uint64(len(want))], want) {
		r.t.Fatalf("echo: written %d, want %d; data ok %v", written, len(want),
			bytes.Equal(r.mapping[respGPA:respGPA+uint64(len(want))], want))
	}
	tr.drv.EnableInterrupts()
}

// serialise makes sure the back-end has handled everything sent so far.
func (r *rig) sync() {
	r.t.Helper()
	if _, err := r.c.GetFeatures(); err != nil {
		r.t.Fatal(err)
	}
}
