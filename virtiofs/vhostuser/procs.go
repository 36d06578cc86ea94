package vhostuser

import (
	"runtime"
	"sync"
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
// Ps; docs/performance.md). With one P per ring on top, an idle P always remains and sysmon
// leaves a waiting ring's P alone. The extra Ps run nothing unless there is Go code to run.
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
