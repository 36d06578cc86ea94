package virtiofs_test

// Hostile guests at the ring level: malformed descriptor chains, a flooded queue, guest
// memory pulled from under running rings, an unusable kick fd.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// ---------------------------------------------------------------------------------------------
// Ring level: a hostile guest driver writes descriptors itself.

// ringRig is what a ring case needs to forge descriptors.
type ringRig struct {
	d       *virtq.Driver
	size    uint16
	scratch uint64 // 4 KiB of valid guest memory
	table   uint64 // 64 KiB of valid guest memory for indirect tables
}

type ringCase struct {
	name    string
	publish func(t *testing.T, r *ringRig)
}

func ringCases() []ringCase {
	const memSize = hostileMemSize
	ind := func(t *testing.T, r *ringRig, at uint64, ds ...virtq.RawDesc) {
		t.Helper()
		if err := r.d.WriteIndirect(at, ds); err != nil {
			t.Fatal(err)
		}
	}
	return []ringCase{
		{"descriptor loop", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 16, virtq.DescFNext, 0)
			r.d.Publish(0)
		}},
		{"descriptor pointing at itself", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(3, r.scratch, 40, virtq.DescFNext, 3)
			r.d.Publish(3)
		}},
		{"chain through the whole table and around", func(t *testing.T, r *ringRig) {
			for i := range r.size {
				r.d.WriteDesc(i, r.scratch, 8, virtq.DescFNext, (i+1)%r.size)
			}
			r.d.Publish(0)
		}},
		{"head equal to the queue size", func(t *testing.T, r *ringRig) { r.d.Publish(r.size) }},
		{"head 0xffff", func(t *testing.T, r *ringRig) { r.d.Publish(math.MaxUint16) }},
		{"next equal to the queue size", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, r.size)
			r.d.Publish(0)
		}},
		{"next 0xffff", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, math.MaxUint16)
			r.d.Publish(0)
		}},
		{"address just past guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize, 40, 0, 0)
			r.d.Publish(0)
		}},
		{"address far outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, 1<<62, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"writable address outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, memSize+4096, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"addr+len overflows 2^64", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, math.MaxUint64-15, 4096, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"length runs past the end of memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize-16, 4096, 0, 0)
			r.d.Publish(0)
		}},
		{"length 2^32-1", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+4096, math.MaxUint32, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"readable after writable", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.scratch, 16, virtq.DescFWrite|virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 40, 0, 0)
			r.d.Publish(0)
		}},
		{"indirect inside indirect", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.table + 1024, Len: 16, Flags: virtq.DescFIndirect})
			ind(t, r, r.table+1024, virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect inside indirect after a good descriptor", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.table + 1024, Len: 16, Flags: virtq.DescFIndirect})
			ind(t, r, r.table+1024, virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"INDIRECT|NEXT", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect|virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.scratch+64, 16, virtq.DescFWrite, 0)
			r.d.Publish(0)
		}},
		{"indirect after a direct descriptor", func(t *testing.T, r *ringRig) {
			// Allowed by the spec (the last descriptor of a chain may be INDIRECT); the table
			// then holds a loop, which must be caught within the table's length.
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch + 128, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 0})
			r.d.WriteDesc(0, r.scratch, 40, virtq.DescFNext, 1)
			r.d.WriteDesc(1, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 0 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, 0, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 17 bytes", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40}, virtq.RawDesc{})
			r.d.WriteDesc(0, r.table, 17, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 8 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, 8, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table longer than allowed", func(t *testing.T, r *ringRig) {
			n := max(uint32(r.size), virtq.MaxIndirectDescs) + 1
			r.d.WriteDesc(0, r.table, 16*n, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table of 2^32-16 bytes", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, r.table, math.MaxUint32-15, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table outside guest memory", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, memSize-16, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect table wrapping around 2^64", func(t *testing.T, r *ringRig) {
			r.d.WriteDesc(0, math.MaxUint64-15, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect next past the table", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table, virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1})
			r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect loop", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch, Len: 8, Flags: virtq.DescFNext, Next: 0})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"readable after writable in an indirect table", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch + 64, Len: 16, Flags: virtq.DescFWrite | virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: r.scratch, Len: 40})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"indirect entry outside guest memory", func(t *testing.T, r *ringRig) {
			ind(t, r, r.table,
				virtq.RawDesc{Addr: r.scratch, Len: 40, Flags: virtq.DescFNext, Next: 1},
				virtq.RawDesc{Addr: memSize - 8, Len: 16, Flags: virtq.DescFWrite})
			r.d.WriteDesc(0, r.table, 32, virtq.DescFIndirect, 0)
			r.d.Publish(0)
		}},
		{"avail idx jumps by queue size + 1", func(t *testing.T, r *ringRig) {
			r.d.SetAvailIdx(r.d.AvailIdx() + r.size + 1)
		}},
		{"avail idx jumps backwards", func(t *testing.T, r *ringRig) {
			r.d.SetAvailIdx(r.d.AvailIdx() - 1)
		}},
	}
}

// errEventfd installs an eventfd of ours as the error notifier of vring q (as QEMU does with
// SET_VRING_ERR) and returns it.
func errEventfd(t *testing.T, fe *frontend.Frontend, q int) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := fe.Client().SetVringErr(uint8(q), fd); err != nil {
		t.Fatalf("SET_VRING_ERR: %v", err)
	}
	// SET_VRING_ERR has no reply: a request that has one tells when the back-end got there,
	// since it handles messages in order. Until then a broken ring signals the old fd.
	if _, err := fe.Client().GetFeatures(); err != nil {
		t.Fatalf("GET_FEATURES: %v", err)
	}
	return fd
}

// eventfdSignalled waits up to d for fd to become readable and drains it.
func eventfdSignalled(fd int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		ms := int(time.Until(deadline) / time.Millisecond)
		if ms < 0 {
			ms = 0
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, ms)
		if err == unix.EINTR {
			continue
		}
		if n > 0 {
			var b [8]byte
			unix.Read(fd, b[:])
			return true
		}
		return false
	}
}

func usedIndex(t *testing.T, fe *frontend.Frontend, q int) uint16 {
	t.Helper()
	b, err := fe.Memory().Slice(fe.Driver(q).UsedAddr(), 4)
	if err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint16(b[2:])
}

// wantBroken checks that vring q was marked broken: its error eventfd fired, the hostile chain
// was not completed, and a good request published afterwards is not served either.
func (g *hostileGuest) wantBroken(t *testing.T, q, errFD int, used uint16) {
	t.Helper()
	if !eventfdSignalled(errFD, hostileTimeout) {
		t.Fatalf("vring %d was not marked broken (no error eventfd signal)", q)
	}
	if now := usedIndex(t, g.fe, q); now != used {
		t.Errorf("vring %d: used idx moved from %d to %d for a hostile chain", q, used, now)
	}
	req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
	in := g.alloc(t, len(req), 0)
	out := g.alloc(t, 4096, 0)
	copy(in.body(), req)
	p, err := g.fe.SubmitAsync(q, []virtq.Buf{{Addr: in.addr(), Len: uint32(len(req))}},
		[]virtq.Buf{{Addr: out.addr(), Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	g.fe.Kick(q)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := p.Wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("vring %d: a request on the broken ring was answered (%v)", q, err)
	}
	t.Cleanup(func() { g.fe.Free(in.gpa); g.fe.Free(out.gpa) }) // after the reset stops the ring
}

// reset is a guest reboot: the device is stopped and started with fresh rings, and the new
// driver sends INIT. Then a normal LOOKUP must work on every queue.
func (g *hostileGuest) reset(t *testing.T) {
	t.Helper()
	ctx, cancel := hostileCtx()
	defer cancel()
	if err := g.fe.Stop(ctx); err != nil {
		t.Fatalf("device stop: %v", err)
	}
	if err := g.fe.Start(ctx); err != nil {
		t.Fatalf("device start: %v", err)
	}
	if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT after reset: %v", err)
	}
	g.healthy(t)
	for q := range g.fe.NumQueues() {
		body, err := g.send(t, q, g.c.Encode(fuse.OpLookup, fuse.RootID, fuseName("file")), 4096)
		if err != nil {
			t.Fatalf("LOOKUP on vring %d after reset: %v", q, err)
		}
		decodeEntryOut(t, body)
	}
}

func (g *hostileGuest) ringRig(t *testing.T, q int) *ringRig {
	t.Helper()
	s := g.alloc(t, 4096*2, 0)
	tb := g.alloc(t, 64<<10, 0)
	t.Cleanup(func() { g.fe.Free(s.gpa); g.fe.Free(tb.gpa) })
	return &ringRig{d: g.fe.Driver(q), size: g.fe.Driver(q).Size(), scratch: s.addr(), table: tb.addr()}
}

// TestHostileRing feeds the device malformed descriptor chains. Each must break the ring (error
// eventfd signalled, chain not completed, ring no longer served) while the connection stays up,
// and a device reset must bring the device back.
func TestHostileRing(t *testing.T) {
	hostileNeedsRoot(t)
	for _, cfg := range []struct {
		name   string
		pool   int
		queues []int
	}{
		{"inline", 0, []int{1, 0}},
		{"pool", 2, []int{1}},
	} {
		t.Run(cfg.name, func(t *testing.T) {
			h := newHostileShare(t)
			hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: cfg.pool})
			g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize})
			errFDs := map[int]int{}
			for _, q := range cfg.queues {
				errFDs[q] = errEventfd(t, g.fe, q)
			}
			for _, q := range cfg.queues {
				for _, rc := range ringCases() {
					t.Run(fmt.Sprintf("vring%d/%s", q, rc.name), func(t *testing.T) {
						used := usedIndex(t, g.fe, q)
						rc.publish(t, g.ringRig(t, q))
						if err := g.fe.Kick(q); err != nil {
							t.Fatal(err)
						}
						g.wantBroken(t, q, errFDs[q], used)
						hs.stillServing(t)
						g.reset(t)
						h.check(t)
					})
				}
			}
			hs.stillServing(t)
		})
	}

	t.Run("indirect not negotiated", func(t *testing.T) {
		h := newHostileShare(t)
		hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
		g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize, NoIndirect: true})
		errFD := errEventfd(t, g.fe, 1)
		used := usedIndex(t, g.fe, 1)
		r := g.ringRig(t, 1)
		if err := r.d.WriteIndirect(r.table, []virtq.RawDesc{{Addr: r.scratch, Len: 40}}); err != nil {
			t.Fatal(err)
		}
		r.d.WriteDesc(0, r.table, 16, virtq.DescFIndirect, 0)
		r.d.Publish(0)
		g.fe.Kick(1)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})
}

// TestHostileRingFlood has the guest keep the request queue full forever, republishing one
// chain as fast as the device consumes it (a driver may not reuse a head in flight, but the
// device cannot tell). The device may serve the flood, but the front-end must still be able to
// stop the device: GET_VRING_BASE (a VM stop or reset) and memory table changes must not wait on
// the guest's good will.
func TestHostileRingFlood(t *testing.T) {
	hostileNeedsRoot(t)
	for _, pool := range []int{0, 2} {
		t.Run(fmt.Sprintf("pool=%d", pool), func(t *testing.T) {
			h := newHostileShare(t)
			hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: pool})
			g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: 4096})
			r := g.ringRig(t, 1)
			// One valid GETATTR whose request and reply are cut into single bytes through an
			// indirect table: legal, and slow enough to serve that a full ring of them keeps
			// the device busy for longer than the guest needs to refill it.
			req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
			b, err := g.fe.Memory().Slice(r.scratch, uint64(len(req)))
			hostileMust(t, err)
			copy(b, req)
			var table []virtq.RawDesc
			for i := range uint64(len(req)) {
				table = append(table, virtq.RawDesc{Addr: r.scratch + i, Len: 1})
			}
			for i := range uint64(512 - len(req)) {
				table = append(table, virtq.RawDesc{Addr: r.scratch + 4096 + i, Len: 1, Flags: virtq.DescFWrite})
			}
			for i := range table[:len(table)-1] {
				table[i].Flags |= virtq.DescFNext
				table[i].Next = uint16(i + 1)
			}
			hostileMust(t, r.d.WriteIndirect(r.table, table))
			r.d.WriteDesc(0, r.table, uint32(16*len(table)), virtq.DescFIndirect, 0)

			used, err := g.fe.Memory().Slice(r.d.UsedAddr(), 4)
			hostileMust(t, err)
			stop := make(chan struct{})
			flooding := make(chan uint64)
			go func() {
				var n uint64
				defer func() { flooding <- n }()
				for {
					select {
					case <-stop:
						return
					default:
					}
					// Refill every slot the device has freed, in one burst, so it never finds
					// the ring empty.
					room := r.size - (r.d.AvailIdx() - binary.LittleEndian.Uint16(used[2:]))
					for range room {
						r.d.Publish(0)
					}
					if room > 0 {
						n += uint64(room)
						g.fe.Kick(1)
					} else {
						runtime.Gosched()
					}
				}
			}()
			time.Sleep(200 * time.Millisecond)

			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			start := time.Now()
			stopErr := g.fe.Stop(ctx)
			cancel()
			close(stop)
			n := <-flooding
			t.Logf("%d chains published; device stop took %v", n, time.Since(start))
			if stopErr != nil {
				t.Errorf("HANG: the front-end could not stop the device while the guest floods the ring: %v", stopErr)
				// The late GET_VRING_BASE reply desynchronises the connection: start over.
				g.fe.Close()
				start = time.Now()
				if err := hs.served(t); err != nil {
					t.Logf("Serve: %v", err)
				}
				t.Logf("Serve returned %v after the flood stopped", time.Since(start))
				hs = startHostileServer(t, virtiofs.Config{SharedDir: h.share, ThreadPoolSize: pool})
				g = dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: 4096})
				g.healthy(t)
				h.check(t)
				return
			}
			hs.stillServing(t)
			ctx, cancel = hostileCtx()
			defer cancel()
			hostileMust(t, g.fe.Start(ctx))
			if _, err := g.c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
				t.Fatal(err)
			}
			g.healthy(t)
			h.check(t)
		})
	}
}

// ---------------------------------------------------------------------------------------------
// Hostile QEMU, ring level: memory pulled from under running rings, an unusable kick fd.

// frontendMemfd finds the memfd behind the front-end's guest memory (the front-end keeps it to
// itself), so that a test can hand the same memory to the back-end again.
func frontendMemfd(t *testing.T, fe *frontend.Frontend) int {
	t.Helper()
	uaddr := fe.Memory().Regions()[0].UserAddr
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	var ino uint64
	for _, line := range strings.Split(string(maps), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || uaddr < start || uaddr >= end {
			continue
		}
		ino, _ = strconv.ParseUint(f[4], 10, 64)
		break
	}
	if ino == 0 {
		t.Fatal("guest memory not found in /proc/self/maps")
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		link, _ := os.Readlink("/proc/self/fd/" + e.Name())
		var st unix.Stat_t
		if strings.HasPrefix(link, "/memfd:") && unix.Fstat(fd, &st) == nil && st.Ino == ino {
			return fd
		}
	}
	t.Fatal("the front-end's memfd not found")
	return -1
}

func regionsOf(fe *frontend.Frontend) []vhostuser.MemoryRegion {
	var rs []vhostuser.MemoryRegion
	for _, r := range fe.Memory().Regions() {
		rs = append(rs, vhostuser.MemoryRegion{GuestPhysAddr: r.GuestPhysAddr, Size: r.Size,
			UserAddr: r.UserAddr, MmapOffset: r.MmapOffset})
	}
	return rs
}

// TestHostileQEMURings has the front-end pull guest memory from under running rings and hand
// the back-end a kick fd that hangs up. The rings must break (not the process, not the
// connection), and once the front-end puts things right a device reset must work.
func TestHostileQEMURings(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize, Regions: 2})
	memfd := frontendMemfd(t, g.fe)
	regions := regionsOf(g.fe)
	if len(regions) != 2 {
		t.Fatalf("%d regions", len(regions))
	}
	errFD := errEventfd(t, g.fe, 1)

	t.Run("REM_MEM_REG of the ring region", func(t *testing.T) {
		used := usedIndex(t, g.fe, 1)
		err := g.fe.Client().RemMemReg(regions[0])
		t.Logf("REM_MEM_REG: %v", err)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().AddMemReg(regions[0], memfd); err != nil {
			t.Fatalf("ADD_MEM_REG back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("REM_MEM_REG under the guest's buffers", func(t *testing.T) {
		if err := g.fe.Client().RemMemReg(regions[1]); err != nil {
			t.Fatalf("REM_MEM_REG of a region without rings: %v", err)
		}
		g.healthy(t) // the rings and the allocator's first buffers are in region 0
		used := usedIndex(t, g.fe, 1)
		r := g.ringRig(t, 1)
		req := g.c.Encode(fuse.OpGetattr, fuse.RootID, fuse.AsBytes(&fuse.GetattrIn{}))
		copy(g.fe.Memory().Regions()[0].Bytes()[r.scratch:], req)
		r.d.WriteDesc(0, r.scratch, uint32(len(req)), virtq.DescFNext, 1)
		r.d.WriteDesc(1, regions[1].GuestPhysAddr+4096, 4096, virtq.DescFWrite, 0)
		r.d.Publish(0)
		g.fe.Kick(1)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().AddMemReg(regions[1], memfd); err != nil {
			t.Fatalf("ADD_MEM_REG back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("SET_MEM_TABLE moving the rings away", func(t *testing.T) {
		used := usedIndex(t, g.fe, 1)
		moved := slices.Clone(regions)
		for i := range moved {
			moved[i].UserAddr += 1 << 40
		}
		err := g.fe.Client().SetMemTable(moved, []int{memfd, memfd})
		t.Logf("SET_MEM_TABLE: %v", err)
		g.wantBroken(t, 1, errFD, used)
		hs.stillServing(t)
		if err := g.fe.Client().SetMemTable(regions, []int{memfd, memfd}); err != nil {
			t.Fatalf("SET_MEM_TABLE back: %v", err)
		}
		g.reset(t)
		h.check(t)
	})

	t.Run("kick fd that hangs up", func(t *testing.T) {
		var p [2]int
		hostileMust(t, unix.Pipe2(p[:], unix.O_CLOEXEC))
		unix.Close(p[1]) // no writer: the read end reports POLLHUP forever
		err := g.fe.Client().SetVringKick(1, p[0])
		unix.Close(p[0])
		if err != nil {
			t.Fatal(err)
		}
		if !eventfdSignalled(errFD, hostileTimeout) {
			t.Fatal("vring 1 with a hung-up kick fd was not marked broken")
		}
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})

	t.Run("kick fd that is a regular file", func(t *testing.T) {
		f, err := os.Open(filepath.Join(h.share, "file"))
		if err != nil {
			t.Fatal(err)
		}
		err = g.fe.Client().SetVringKick(1, int(f.Fd()))
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		// Always readable, and epoll cannot wait on it: the ring must break rather than spin
		// or wait forever.
		if !eventfdSignalled(errFD, hostileTimeout) {
			t.Fatal("vring 1 with a regular file as kick fd was not marked broken")
		}
		hs.stillServing(t)
		g.reset(t)
		h.check(t)
	})

	// Resets out of QEMU's usual order: the back-end forgets the rings (and their error fds)
	// while the driver still believes them running; the next device start must work.
	for _, req := range []vhostuser.Request{vhostuser.ResetOwner, vhostuser.ResetDevice} {
		t.Run(req.String()+" mid-session", func(t *testing.T) {
			if _, err := g.fe.Client().Raw(uint32(req), vhostuser.Version, nil, nil); err != nil {
				t.Fatal(err)
			}
			hs.stillServing(t)
			g.reset(t)
			h.check(t)
		})
	}
}
