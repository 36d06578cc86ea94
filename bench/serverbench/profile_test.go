package serverbench

import "testing"

func TestSampleKind(t *testing.T) {
	for _, tc := range []struct {
		stack []string // leaf first
		want  string
	}{
		// A system call made by kvfsd's code, in the kernel.
		{[]string{"internal/runtime/syscall/linux.Syscall6", "syscall.Syscall6", "golang.org/x/sys/unix.openat", "github.com/kvfs/kvfs/virtiofs/passthrough.(*FS).Lookup"}, kindSyscall},
		// The notification path: the call eventfd's write, the kick fd's poll.
		{[]string{"internal/runtime/syscall/linux.Syscall6", "syscall.Syscall", "golang.org/x/sys/unix.write", "github.com/kvfs/kvfs/virtiofs/vhostuser.signal", "github.com/kvfs/kvfs/virtiofs/vhostuser.(*Vring).Notify", "github.com/kvfs/kvfs/virtiofs.(*device).serveInline"}, kindNotify},
		{[]string{"syscall.Syscall6", "golang.org/x/sys/unix.ppoll", "golang.org/x/sys/unix.Poll", "github.com/kvfs/kvfs/virtiofs/vhostuser.(*Vring).run"}, kindNotify},
		// Leaving that system call: the scheduler's cost, not the kernel's.
		{[]string{"runtime.exitsyscall", "syscall.Syscall6", "golang.org/x/sys/unix.ppoll"}, kindScheduler},
		// The runtime's own system calls belong to the scheduler.
		{[]string{"internal/runtime/syscall/linux.Syscall6", "internal/runtime/syscall/linux.EpollWait", "runtime.netpoll", "runtime.findRunnable", "runtime.schedule"}, kindScheduler},
		{[]string{"runtime.usleep", "runtime.sysmon", "runtime.mstart1"}, kindScheduler},
		{[]string{"runtime.memclrNoHeapPointers", "runtime.mallocgc", "runtime.newobject", "github.com/kvfs/kvfs/virtiofs/fuse.doLookup"}, kindGC},
		{[]string{"runtime.mapaccess1_fast64", "github.com/kvfs/kvfs/virtiofs/passthrough.(*nodeTable).get"}, kindGo},
	} {
		if got := sampleKind(tc.stack); got != tc.want {
			t.Errorf("sampleKind(%q) = %q, want %q", tc.stack, got, tc.want)
		}
	}
}
