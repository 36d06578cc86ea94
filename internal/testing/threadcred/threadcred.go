// Package threadcred runs code as another user on one OS thread of a test process that is
// root: the thread's user and group ids are switched, which empties its capability sets as any
// switch away from root does, the code runs, and the thread is thrown away with it. The rest
// of the process keeps its credentials. It is for tests only: it lets a root test see what an
// unprivileged user gets from the kernel.
package threadcred

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// Nobody is the overflow user and group id.
const Nobody = 65534

// Run calls f on an OS thread whose real, effective and saved user and group ids are uid and
// gid, with no supplementary groups and no capabilities, and returns once f has. The thread
// is locked to f's goroutine and never unlocked, so the runtime ends it with f and no other
// goroutine runs with these credentials (nor any thread the runtime starts later: it starts
// none from a locked thread). f runs in a goroutine of its own, so it must not call
// t.Fatal or t.FailNow. The error is the switch's (it needs root).
func Run(uid, gid int, f func()) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The raw system calls change this thread only; the syscall package's setters change
		// every thread of the process.
		for _, c := range []struct {
			name    string
			nr      uintptr
			a, b, d uintptr
		}{
			{"setgroups", unix.SYS_SETGROUPS, 0, 0, 0},
			{"setresgid", unix.SYS_SETRESGID, uintptr(gid), uintptr(gid), uintptr(gid)},
			{"setresuid", unix.SYS_SETRESUID, uintptr(uid), uintptr(uid), uintptr(uid)},
		} {
			if _, _, e := unix.RawSyscall(c.nr, c.a, c.b, c.d); e != 0 {
				errc <- fmt.Errorf("%s: %w", c.name, e)
				return
			}
		}
		f()
		errc <- nil
	}()
	return <-errc
}
