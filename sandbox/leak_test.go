package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// TestLeaks runs leakCycles sandbox lives in rounds of leakRound: leakLanes sandboxes side by
// side, leakRound/leakLanes lives each. A first round, the warm-up, sets the baseline (it grows
// the runtime's pools, the log's buffers and the page cache, which later rounds reuse). A cycle
// under -race takes about 0.3 s here, mostly starting the confined server, and make test has no
// minute to spare: hence the lanes.
const (
	leakCycles = 200
	leakRound  = 20
	leakLanes  = 4
)

// leakRSSSlack is how far the owner's RSS may end above the baseline, and leakHeapSlack its
// live heap (after a collection). A leak worth catching is one a sandbox's life leaves behind:
// a goroutine (8 KiB of stack at least), a front-end's guest memory (16 MiB here) or a pipe's
// buffers (64 KiB) per cycle is 1.6 to 3200 MiB over 200 cycles. Without a leak the RSS moves
// with the runtime's pools (measured: +0.7 to +2.6 MiB over 200 cycles without -race) and, under the race
// detector, with its own bookkeeping (measured: +8.5 to +13 MiB, while the live heap moved by
// 70 KiB): 8 MiB, 32 MiB under -race. The live heap is the tight check either way: 1 MiB is 5 KiB
// a cycle.
const (
	leakRSSSlack     = 8 << 20
	leakRaceRSSSlack = 32 << 20
	leakHeapSlack    = 1 << 20
)

// owned is what the owner process holds: the counts that must come back to the baseline.
type owned struct {
	counts
	goroutines int
	rss        int64
	heap       uint64 // live heap bytes after a collection
}

// selfRSS is this process's VmRSS in bytes.
func selfRSS(t testing.TB) int64 {
	t.Helper()
	return procMemory(t, os.Getpid(), "VmRSS")
}

// procMemory is a memory field of /proc/PID/status (VmRSS, RssAnon, ...) in bytes.
func procMemory(t testing.TB, pid int, field string) int64 {
	t.Helper()
	s, err := procstatus.ReadPID(pid)
	if err != nil {
		t.Fatal(err)
	}
	n, err := s.Bytes(field)
	if err != nil {
		t.Fatalf("/proc/%d/%v", pid, err)
	}
	return n
}

// TestLeaks runs leakCycles lives of a sandbox with two binds (read-write and read-only) and
// its default, confined server: Create, Bind, Start, the guest's first requests, Stop. The
// "boot" is the in-repo front-end connecting through a VMRunner (frontendRunner: the
// vhost-user handshake, INIT, then a lookup in each bind, a file created, written, fsync'd and
// read back, a file read from the read-only bind) — 200 TCG boots would take an hour. After
// every round the owner's descriptors, mounts, child processes, goroutines and the entries
// under the base directory must be what they were after the warm-up, counted before any
// garbage collection (a leaked *os.File would be closed by its finalizer in one, and the leak
// hidden); at the end, its RSS and live heap within leakRSSSlack (leakRaceRSSSlack) and
// leakHeapSlack.
func TestLeaks(t *testing.T) {
	requireRoot(t)
	if testing.Short() {
		t.Skip("200 sandbox lives (skipped with -short)")
	}
	base := testBase(t)
	ctx := context.Background()
	type lane struct {
		id, rw, ro string
		runner     *frontendRunner
	}
	lanes := make([]lane, leakLanes)
	for i := range lanes {
		l := lane{id: "leak" + strconv.Itoa(i), rw: t.TempDir(), ro: t.TempDir(), runner: &frontendRunner{boot: leakBoot}}
		l.runner.opts.MemSize = 16 << 20
		if err := os.WriteFile(filepath.Join(l.ro, "in"), []byte("read-only input\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		lanes[i] = l
	}
	// round runs leakRound cycles with no garbage collection, then returns what is left, once
	// that is want (or after 5 s: goroutines and descriptors of the last cycles may take a
	// moment to go, a reaper's Wait, a pipe's reader); then it collects, so that the next round
	// reuses this one's heap (the race detector's shadow of it stays mapped).
	round := func(r int, want *owned) owned {
		gcPercent := debug.SetGCPercent(-1)
		defer func() {
			debug.SetGCPercent(gcPercent)
			runtime.GC()
		}()
		var wg sync.WaitGroup
		for _, l := range lanes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < leakRound/leakLanes; i++ {
					if err := leakCycle(ctx, base, l.id, l.rw, l.ro, l.runner); err != nil {
						t.Errorf("round %d, %s, cycle %d: %v", r, l.id, i, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			o := owned{counts: takeCounts(t, base), goroutines: runtime.NumGoroutine()}
			if want == nil || o.counts == want.counts && o.goroutines <= want.goroutines || time.Now().After(deadline) {
				return o
			}
		}
	}
	takeMemory := func(o *owned) {
		debug.FreeOSMemory() // collects first
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		o.rss, o.heap = selfRSS(t), ms.HeapAlloc
	}

	before := round(0, nil)
	takeMemory(&before)
	before.counts = takeCounts(t, base) // the warm-up's garbage, its files included, collected
	start := time.Now()
	var after owned
	for r := 1; r <= leakCycles/leakRound; r++ {
		after = round(r, &before)
		if after.counts != before.counts {
			t.Fatalf("after round %d (%d cycles): %+v, want %+v", r, r*leakRound, after.counts, before.counts)
		}
		if after.goroutines > before.goroutines {
			buf := make([]byte, 1<<20)
			t.Fatalf("after round %d (%d cycles): %d goroutines, want %d\n%s", r, r*leakRound, after.goroutines, before.goroutines,
				buf[:runtime.Stack(buf, true)])
		}
	}
	elapsed := time.Since(start)
	takeMemory(&after)
	t.Logf("%d cycles in %v (%v each, %d side by side); baseline %+v, after %+v; RSS %+.1f MiB, live heap %+.1f KiB",
		leakCycles, elapsed.Round(time.Millisecond), (elapsed / leakCycles).Round(time.Millisecond), leakLanes,
		before, after, float64(after.rss-before.rss)/(1<<20), (float64(after.heap)-float64(before.heap))/(1<<10))
	slack := int64(leakRSSSlack)
	if raceEnabled {
		slack = leakRaceRSSSlack
	}
	if after.rss > before.rss+slack {
		t.Errorf("after %d cycles: RSS %d MiB, baseline %d MiB (slack %d MiB)", leakCycles, after.rss>>20, before.rss>>20, slack>>20)
	}
	if after.heap > before.heap+leakHeapSlack {
		t.Errorf("after %d cycles: live heap %d KiB, baseline %d KiB (slack %d KiB)", leakCycles, after.heap>>10, before.heap>>10, leakHeapSlack>>10)
	}
}

// leakCycle is one life of sandbox id: Create, the binds rw and ro, Start (runner's boot),
// the guest's file checked on the host, Stop.
func leakCycle(ctx context.Context, base, id, rw, ro string, runner *frontendRunner) error {
	s, err := Create(ctx, id, Options{Config: testConfig(base), Runner: runner})
	if err != nil {
		return err
	}
	err = s.Bind(rw, "rw", 0)
	if err == nil {
		err = s.Bind(ro, "ro", BindReadOnly)
	}
	if err == nil {
		err = s.Start(ctx, s.DefaultVM())
	}
	if err == nil {
		if got, rerr := os.ReadFile(filepath.Join(rw, "out")); rerr != nil || string(got) != "cycle output\n" {
			err = fmt.Errorf("the guest's file on the host: %q, %v", got, rerr)
		}
	}
	if serr := s.Stop(ctx); err == nil {
		err = serr
	}
	if err == nil && s.Err() != nil {
		err = fmt.Errorf("the sandbox failed: %w", s.Err())
	}
	return err
}

// leakBoot is the guest's first requests in TestLeaks.
func leakBoot(ctx context.Context, c *fuseclient.Client) error {
	rw, err := c.Lookup(ctx, fuse.RootID, "rw")
	if err != nil {
		return err
	}
	cr, err := c.Create(ctx, rw.NodeID, "out", uint32(os.O_RDWR|os.O_TRUNC), 0o644)
	if err != nil {
		return err
	}
	data := []byte("cycle output\n")
	if _, err := c.Write(ctx, cr.Entry.NodeID, cr.Open.Fh, 0, data, 0); err != nil {
		return err
	}
	if err := c.Fsync(ctx, cr.Entry.NodeID, cr.Open.Fh, false); err != nil {
		return err
	}
	if got, err := c.Read(ctx, cr.Entry.NodeID, cr.Open.Fh, 0, 4096); err != nil || !bytes.Equal(got, data) {
		return fmt.Errorf("read back %q, %v", got, err)
	}
	if err := c.Release(ctx, cr.Entry.NodeID, cr.Open.Fh); err != nil {
		return err
	}
	ro, err := c.Lookup(ctx, fuse.RootID, "ro")
	if err != nil {
		return err
	}
	in, err := c.Lookup(ctx, ro.NodeID, "in")
	if err != nil {
		return err
	}
	op, err := c.Open(ctx, in.NodeID, uint32(os.O_RDONLY))
	if err != nil {
		return err
	}
	if got, err := c.Read(ctx, in.NodeID, op.Fh, 0, 4096); err != nil || string(got) != "read-only input\n" {
		return fmt.Errorf("read %q from the read-only bind, %v", got, err)
	}
	return c.Release(ctx, in.NodeID, op.Fh)
}
