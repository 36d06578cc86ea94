package fuse_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"golang.org/x/sys/unix"
)

// lockFS holds one lock per file; SETLKW on a held lock waits until Release(owner) or a
// cancellation.
type lockFS struct {
	fakeFS
	lmu     sync.Mutex
	holder  map[uint64]uint64 // node → owner; guarded by lmu
	waiters []*fakeWait       // guarded by lmu
}

// fakeWait finishes with the first result given to finish (a grant or Cancel's EINTR).
type fakeWait struct {
	node, owner uint64
	once        sync.Once
	result      chan fuse.Errno
}

func (w *fakeWait) Start(done func(fuse.Errno)) {
	go func() { done(<-w.result) }()
}

func (w *fakeWait) finish(e fuse.Errno) {
	w.once.Do(func() { w.result <- e })
}

func (w *fakeWait) Cancel() { w.finish(unix.EINTR) }

func (f *lockFS) GetLk(ctx *fuse.Context, node uint64, in *fuse.LkIn, out *fuse.LkOut) fuse.Errno {
	f.lmu.Lock()
	defer f.lmu.Unlock()
	if h, ok := f.holder[node]; ok && h != in.Owner {
		out.Lk = fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax, PID: uint32(h)}
	} else {
		out.Lk = fuse.FileLock{Type: unix.F_UNLCK}
	}
	return fuse.OK
}

func (f *lockFS) SetLk(ctx *fuse.Context, node uint64, in *fuse.LkIn, wait bool) (fuse.Waiter, fuse.Errno) {
	f.lmu.Lock()
	defer f.lmu.Unlock()
	if in.Lk.Type == unix.F_UNLCK {
		if f.holder[node] == in.Owner {
			delete(f.holder, node)
			for i, w := range f.waiters {
				if w.node == node {
					f.holder[node] = w.owner
					f.waiters = append(f.waiters[:i], f.waiters[i+1:]...)
					w.finish(fuse.OK)
					break
				}
			}
		}
		return nil, fuse.OK
	}
	if h, ok := f.holder[node]; !ok || h == in.Owner {
		f.holder[node] = in.Owner
		return nil, fuse.OK
	}
	if !wait {
		return nil, unix.EAGAIN
	}
	w := &fakeWait{node: node, owner: in.Owner, result: make(chan fuse.Errno, 1)}
	f.waiters = append(f.waiters, w)
	return w, fuse.OK
}

func newLockClient(t *testing.T, offer uint64) (*fuseclient.Client, *fuse.Server, *lockFS) {
	t.Helper()
	fs := &lockFS{holder: map[uint64]uint64{}}
	s := fuse.NewServer(fs, fuse.Options{InitFlags: offer})
	c := fuseclient.New(&splitTransport{s: s, rnd: rand.New(rand.NewPCG(7, 8))})
	if _, err := c.Init(context.Background(), fuseclient.LinuxInitFlags); err != nil {
		t.Fatal(err)
	}
	return c, s, fs
}

// asyncCompleter records deferred replies.
type asyncCompleter struct {
	ch chan []byte
}

func (a *asyncCompleter) CompleteDeferred(tag uint64, reply []byte) {
	if tag != 42 {
		panic("wrong tag")
	}
	a.ch <- reply
}

func replyErrno(t *testing.T, reply []byte, unique uint64) fuse.Errno {
	t.Helper()
	var h fuse.OutHeader
	if len(reply) != 16 {
		t.Fatalf("deferred reply of %d bytes", len(reply))
	}
	copy(fuse.AsBytes(&h), reply)
	if h.Len != 16 || h.Unique != unique {
		t.Fatalf("deferred reply header %+v, want unique %d", h, unique)
	}
	return fuse.Errno(-h.Error)
}

func waitReply(t *testing.T, ch <-chan []byte) []byte {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal("no deferred reply")
		return nil
	}
}

func TestLocksNotOffered(t *testing.T) {
	c, s, _ := newLockClient(t, 0)
	if s.Flags()&(fuse.InitPosixLocks|fuse.InitFlockLocks) != 0 {
		t.Errorf("granted %#x without lock flags offered", s.Flags())
	}
	ctx := context.Background()
	whole := fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax}
	if _, err := c.Getlk(ctx, 7, 1, 1, whole); !errors.Is(err, unix.ENOSYS) {
		t.Errorf("GETLK: %v, want ENOSYS", err)
	}
	for _, wait := range []bool{false, true} {
		for _, flags := range []uint32{0, fuse.LkFlock} {
			if err := c.Setlk(ctx, 7, 1, 1, whole, flags, wait); !errors.Is(err, unix.ENOSYS) {
				t.Errorf("SETLK(wait %v, flags %d): %v, want ENOSYS", wait, flags, err)
			}
		}
	}
	// Offering one kind grants only that one.
	c, _, _ = newLockClient(t, fuse.InitFlockLocks)
	if err := c.Setlk(ctx, 7, 1, 1, whole, fuse.LkFlock, false); err != nil {
		t.Errorf("flock with flock offered: %v", err)
	}
	if err := c.Setlk(ctx, 7, 1, 1, whole, 0, false); !errors.Is(err, unix.ENOSYS) {
		t.Errorf("POSIX lock with only flock offered: %v, want ENOSYS", err)
	}
}

// TestDeferredSetlkw: a SETLKW that waits is deferred, its reply comes through the Completer,
// and INTERRUPT, DESTROY and CancelWaiting end it with EINTR.
func TestDeferredSetlkw(t *testing.T) {
	c, s, _ := newLockClient(t, fuse.InitPosixLocks)
	ctx := context.Background()
	whole := fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax}
	if err := c.Setlk(ctx, 7, 1, 1, whole, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := c.Setlk(ctx, 7, 1, 2, whole, 0, false); !errors.Is(err, unix.EAGAIN) {
		t.Fatalf("SETLK conflict: %v", err)
	}
	if lk, err := c.Getlk(ctx, 7, 1, 2, whole); err != nil || lk.Type != unix.F_WRLCK || lk.PID != 1 {
		t.Fatalf("GETLK: %+v, %v", lk, err)
	}

	ac := &asyncCompleter{ch: make(chan []byte, 4)}
	setlkw := func(owner uint64) uint64 {
		req, unique := c.EncodeSetlk(7, 1, owner, whole, 0, true)
		out := make([]byte, 64)
		n, deferred := s.HandleAsync([][]byte{req}, [][]byte{out}, ac, 42)
		if !deferred || n != 0 {
			t.Fatalf("SETLKW: %d bytes, deferred %v", n, deferred)
		}
		clear(out) // the server must not have kept it
		return unique
	}

	// Granted when the holder unlocks; other requests go on meanwhile.
	u := setlkw(2)
	if got := s.Stats().Waiting; got != 1 {
		t.Errorf("waiting: %d", got)
	}
	if _, err := c.Lookup(ctx, 1, "file"); err != nil {
		t.Fatalf("LOOKUP while a SETLKW waits: %v", err)
	}
	if err := c.Setlk(ctx, 7, 1, 1, fuse.FileLock{Type: unix.F_UNLCK}, 0, false); err != nil {
		t.Fatal(err)
	}
	if e := replyErrno(t, waitReply(t, ac.ch), u); e != 0 {
		t.Errorf("granted SETLKW: %v", e)
	}

	// INTERRUPT of the unique cancels it; INTERRUPT of anything else does nothing.
	u = setlkw(3)
	if err := c.Interrupt(ctx, u+1000); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-ac.ch:
		t.Fatalf("INTERRUPT of another unique answered the SETLKW: %x", r)
	case <-time.After(20 * time.Millisecond):
	}
	if err := c.Interrupt(ctx, u); err != nil {
		t.Fatal(err)
	}
	if e := replyErrno(t, waitReply(t, ac.ch), u); e != unix.EINTR {
		t.Errorf("interrupted SETLKW: %v, want EINTR", e)
	}

	// DESTROY and CancelWaiting answer every waiting request before returning.
	u1, u2 := setlkw(4), setlkw(5)
	s.CancelWaiting()
	got := map[uint64]fuse.Errno{}
	for range 2 {
		r := waitReply(t, ac.ch)
		var h fuse.OutHeader
		copy(fuse.AsBytes(&h), r)
		got[h.Unique] = fuse.Errno(-h.Error)
	}
	if got[u1] != unix.EINTR || got[u2] != unix.EINTR {
		t.Errorf("after CancelWaiting: %v", got)
	}
	u = setlkw(6)
	if err := c.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if e := replyErrno(t, waitReply(t, ac.ch), u); e != unix.EINTR {
		t.Errorf("SETLKW at DESTROY: %v, want EINTR", e)
	}
	st := s.Stats()
	if st.Waiting != 0 || st.Ops["SETLKW"].Count != 5 || st.Ops["SETLKW"].Errors != 4 {
		t.Errorf("stats: waiting %d, SETLKW %+v", st.Waiting, st.Ops["SETLKW"])
	}
}

// TestSetlkwSync: Handle, for callers that cannot defer, waits for the reply itself; two
// requests with the same unique (a hostile guest) are both tracked.
func TestSetlkwSync(t *testing.T) {
	c, s, _ := newLockClient(t, fuse.InitPosixLocks)
	ctx := context.Background()
	whole := fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax}
	if err := c.Setlk(ctx, 7, 1, 1, whole, 0, false); err != nil {
		t.Fatal(err)
	}
	req, unique := c.EncodeSetlk(7, 1, 2, whole, 0, true)
	res := make(chan error, 2)
	for range 2 {
		go func() { _, err := c.Do(ctx, req, 4096); res <- err }()
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Waiting != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("waiting: %d, want 2", s.Stats().Waiting)
		}
		time.Sleep(time.Millisecond)
	}
	if err := c.Interrupt(ctx, unique); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-res; !errors.Is(err, unix.EINTR) {
			t.Errorf("interrupted SETLKW: %v, want EINTR", err)
		}
	}
	// No room for a reply: the deferred reply is empty.
	ac := &asyncCompleter{ch: make(chan []byte, 1)}
	req, _ = c.EncodeSetlk(7, 1, 2, whole, 0, true)
	if _, deferred := s.HandleAsync([][]byte{req}, nil, ac, 42); !deferred {
		t.Fatal("not deferred")
	}
	s.CancelWaiting()
	if r := waitReply(t, ac.ch); len(r) != 0 {
		t.Errorf("reply of %d bytes without room for one", len(r))
	}
}

// TestWaitingBounded: beyond maxWaiting (4096) waiting requests, a SETLKW whose lock is taken
// answers ENOLCK instead of waiting.
func TestWaitingBounded(t *testing.T) {
	c, s, _ := newLockClient(t, fuse.InitPosixLocks)
	ctx := context.Background()
	whole := fuse.FileLock{Type: unix.F_WRLCK, End: fuse.OffsetMax}
	if err := c.Setlk(ctx, 7, 1, 1, whole, 0, false); err != nil {
		t.Fatal(err)
	}
	const max = 4096
	ac := &asyncCompleter{ch: make(chan []byte, max)}
	for i := range max {
		req, _ := c.EncodeSetlk(7, 1, uint64(100+i), whole, 0, true)
		if _, deferred := s.HandleAsync([][]byte{req}, [][]byte{make([]byte, 16)}, ac, 42); !deferred {
			t.Fatalf("SETLKW %d not deferred", i)
		}
	}
	if err := c.Setlk(ctx, 7, 1, 2, whole, 0, true); !errors.Is(err, unix.ENOLCK) {
		t.Errorf("SETLKW beyond the bound: %v, want ENOLCK", err)
	}
	if err := c.Setlk(ctx, 7, 1, 1, whole, 0, true); err != nil {
		t.Errorf("SETLKW beyond the bound on a lock it can take: %v", err)
	}
	s.CancelWaiting()
	if got := len(ac.ch); got != max || s.Stats().Waiting != 0 {
		t.Errorf("after CancelWaiting: %d replies, %d waiting", got, s.Stats().Waiting)
	}
}
