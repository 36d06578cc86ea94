package serverbench

import (
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestProcessCPUSplitsSystemTime checks that processCPU's system part grows with time spent in
// the kernel and not with time spent in user code.
func TestProcessCPUSplitsSystemTime(t *testing.T) {
	pid := os.Getpid()
	burn := func(f func()) (cpu, sys time.Duration) {
		t.Helper()
		c0, s0, err := processCPU(pid)
		if err != nil {
			t.Fatal(err)
		}
		for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); {
			f()
		}
		c1, s1, err := processCPU(pid)
		if err != nil {
			t.Fatal(err)
		}
		return c1 - c0, s1 - s0
	}
	// System calls that do some work in the kernel: reading /proc/self/stat.
	b := make([]byte, 4096)
	cpu, sys := burn(func() {
		fd, err := unix.Open("/proc/self/stat", unix.O_RDONLY, 0)
		if err == nil {
			unix.Read(fd, b)
			unix.Close(fd)
		}
	})
	if sys < cpu/2 || sys > cpu {
		t.Errorf("kernel-bound loop: system %v of CPU %v, want at least half and at most all", sys, cpu)
	}
	x := uint64(1)
	cpu, sys = burn(func() {
		for range 10000 {
			x = x*6364136223846793005 + 1442695040888963407
		}
	})
	if x == 0 || sys > cpu/4 {
		t.Errorf("user-bound loop: system %v of CPU %v, want at most a quarter", sys, cpu)
	}
}
