package sandbox

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// consoleFloodFor is how long TestVMConsoleFlood lets the guest flood its console.
const consoleFloodFor = 30 * time.Second

// TestVMConsoleFlood boots a guest that writes to its console without end — text with an
// escape sequence and other control bytes in every line — and watches the host for
// consoleFloodFor: console.log and console.log.1 stay within their limit at every look, more
// than both hold went through (the cap was what held them), the guest is still running and
// still writing at the end (the drain never held it up), and no control byte reached the
// files.
func TestVMConsoleFlood(t *testing.T) {
	requireGuest(t)
	g := vmtest.Image(t)
	accel := testAccel(t, g)
	base := testBase(t)
	ctx := context.Background()

	s, err := Create(ctx, "flood", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	ctl := guestSetup(t, `
line=$(printf 'KVFS-FLOOD 0123456789abcdefghijklmnopqrstuvwxyz \033[31m\001\377 the guest writes to its console without end')
echo ready > $KVFS_MNT/ctl/ready
exec yes "$line" > /dev/console
`)
	if err := s.Bind(ctl, "ctl", 0); err != nil {
		t.Fatal(err)
	}
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Cmdline = accel, g.Kernel, g.Initrd, guestCmdline(s.Config().Device.Tag)
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	diag := diagnose(s.Dir())
	waitFile(t, filepath.Join(ctl, "ready"), guestTimeout, s.VMExited(), diag)

	s.mu.Lock()
	console := s.out.console.log
	s.mu.Unlock()
	onDisk := func() int64 {
		var n int64
		for _, name := range []string{consoleName, consoleName + ".1"} {
			fi, err := os.Stat(filepath.Join(s.Dir(), name))
			if err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
			if err == nil {
				if fi.Size() > consoleFileLimit {
					t.Fatalf("%s holds %d bytes, more than its limit %d", name, fi.Size(), consoleFileLimit)
				}
				n += fi.Size()
			}
		}
		return n
	}
	cpu0 := ownCPU(t)
	start, from := time.Now(), console.written()
	var most int64
	var before int64 // what had gone through 5 s before the end
	for time.Since(start) < consoleFloodFor {
		time.Sleep(500 * time.Millisecond)
		most = max(most, onDisk())
		if isClosed(s.VMExited()) {
			t.Fatalf("the VM exited during the flood\n%s", diag())
		}
		if before == 0 && time.Since(start) >= consoleFloodFor-5*time.Second {
			before = console.written()
		}
	}
	end, elapsed := console.written(), time.Since(start)
	cpu := ownCPU(t) - cpu0
	t.Logf("accel %s: %d KiB of console in %v (%.0f KiB/s), at most %d KiB on disk (limit 2 x %d KiB); the owner used %v of CPU (%.1f%%)",
		accel, (end-from)>>10, elapsed.Round(time.Millisecond), float64(end-from)/1024/elapsed.Seconds(), most>>10, consoleFileLimit>>10,
		cpu.Round(time.Millisecond), 100*cpu.Seconds()/elapsed.Seconds())
	if end-from <= 2*consoleFileLimit {
		t.Errorf("only %d bytes went through: the flood never passed what the two files hold, so the cap was not tested", end-from)
	}
	if end <= before {
		t.Errorf("the console stopped moving in the last 5 s (%d bytes then, %d now): the guest stalled", before, end)
	}
	data, err := os.ReadFile(s.ConsolePath())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.ContainsAny(data, "\x1b\x01\xff\r") {
		t.Error("a control byte reached console.log")
	}
	if want := []byte(`KVFS-FLOOD 0123456789abcdefghijklmnopqrstuvwxyz \x1b[31m\x01\xff the guest writes to its console without end` + "\n"); !bytes.Contains(data, want) {
		t.Errorf("console.log has no sanitized flood line; its end:\n%s", tail(string(data), 500))
	}
}

// ownCPU is the CPU time this process has used, user and system.
func ownCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
