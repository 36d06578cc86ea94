package vhostuser

import (
	"runtime"
	"sync"
	"time"
)

// WithRingProcs makes every started ring of the Backend add one to GOMAXPROCS (from the ring's
// start to its stop), above the value found when the first one started, for a device that serves its requests on the
// ring goroutines themselves (virtio-fs without a thread pool).
//
// Why: a ring goroutine waits in epoll_wait, a system call, and a thread in a system call keeps
// its P (its right to run Go code) until sysmon takes the P away, which it does within 20 µs
// when no other P is idle. With as many waiting rings as Ps (the high-priority and the request
// queue on 2 CPUs) that is always the case, so every wake-up found its P gone, and sysmon
// handing it to a spinning thread cost futex wake-ups and context switches the request did not
// need (strace -c, LOOKUP+GETATTR+FORGET: 1.94 futex calls per operation, 0.10 with the spare
// Ps; docs/measurements/performance.md). With one P per ring on top, an idle P always remains and
// sysmon leaves a waiting ring's P alone. The extra Ps run nothing unless there is Go code to run.
// This is a process-wide setting: the last ring to stop puts back the value found.
func WithRingProcs() Option {
	return func(b *Backend) { b.ringProcs = true }
}

// ringProcs counts the started rings of Backends made WithRingProcs, in the process.
var ringProcs struct {
	mu   sync.Mutex
	n    int // started rings
	base int // GOMAXPROCS when n went from 0 to 1
}

// addRingProc adds d (1 or -1) started rings and sets GOMAXPROCS to match.
func addRingProc(d int) {
	ringProcs.mu.Lock()
	defer ringProcs.mu.Unlock()
	if ringProcs.n == 0 {
		ringProcs.base = runtime.GOMAXPROCS(0)
	}
	ringProcs.n += d
	runtime.GOMAXPROCS(ringProcs.base + ringProcs.n)
}

// yieldEvery is how long a ring goroutine may go without passing through the scheduler: half of
// the 10 ms after which sysmon takes a goroutine for one that hogs its P (forcePreemptNS in
// runtime/proc.go).
const yieldEvery = 5 * time.Millisecond

// Yield calls runtime.Gosched if the ring goroutine has not done so for yieldEvery. The ring
// goroutine calls it before each Device.HandleQueue; a device that serves many requests in one
// HandleQueue (a batch can take longer than 10 ms: 64 requests of 1 MiB) calls it between them.
// Only from HandleQueue, like the other methods.
//
// Why: a ring goroutine never blocks in Go (it waits in epoll_wait, a system call, and serves
// its requests with system calls), so the scheduler never starts a new time slice on its P,
// and once it has run 10 ms sysmon treats it as a goroutine that will not yield: it asks it to
// be preempted and takes its P whenever it finds it in a system call. The goroutine then gets
// an idle P back on leaving the call, and sysmon, which had gone to sleep with every P idle,
// is woken and starts again at its shortest period. Traced with perf probes (READ 1 MiB
// sequential QD16, 5 000 requests): sysmon called preemptone 1 074 times and handed off a
// P 990 times; per READ 1 MiB at QD1, 0.7–1.0 nanosleep and 0.6–0.7 futex calls, which the C
// virtiofsd does not make (docs/measurements/performance.md, step 2). A Gosched on every wake-up
// instead costs more than it saves: it puts the goroutine on the global run queue and wakes a
// thread for an idle P (1.9 futex calls per READ 4 KiB at QD1).
func (v *Vring) Yield() {
	if time.Since(v.yielded) < yieldEvery {
		return
	}
	runtime.Gosched()
	v.yielded = time.Now()
}
