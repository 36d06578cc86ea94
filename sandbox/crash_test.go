package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// crashGuest writes and fsyncs in a loop: for n = 1, 2, ... a new file w/f<n> of
// crashFileSize(n) bytes of "kvfs <n>\n" lines, then one line "line <n>" appended to w/log, each
// with dd conv=fsync (dd fails if the fsync does); only then does it print "KVFS-FSYNC <n>".
const crashGuest = `
M=$KVFS_MNT
mkdir $M/ctl/w || exit 2
echo ready > $M/ctl/ready
n=0
while [ $n -lt 100000 ]; do
	n=$((n+1))
	yes "kvfs $n" | head -c $((4096 + n * 997 % 12288)) | dd of=$M/ctl/w/f$n bs=64k conv=fsync 2>/dev/null || { echo "KVFS-TEST dd f$n failed"; exit 3; }
	printf 'line %08d\n' $n | dd of=$M/ctl/w/log bs=64k conv=notrunc,fsync oflag=append 2>/dev/null || { echo "KVFS-TEST dd log $n failed"; exit 4; }
	echo "KVFS-FSYNC $n"
done
exit 5
`

// crashFileSize and crashFile are what the guest writes to w/f<n>.
func crashFileSize(n int) int { return 4096 + n*997%12288 }

func crashFile(n int) []byte {
	line := []byte("kvfs " + strconv.Itoa(n) + "\n")
	return bytes.Repeat(line, crashFileSize(n)/len(line)+1)[:crashFileSize(n)]
}

// fsyncedUpTo returns the last n of the console's "KVFS-FSYNC n" lines (0 if none), and fails
// the test if they are not 1, 2, ..., n. A last line without its newline is left out: the
// console's file may be read while the line is being written ("KVFS-FSYNC 1" of a 16).
func fsyncedUpTo(t *testing.T, console string) int {
	t.Helper()
	last := 0
	lines := strings.Split(console, "\n")
	for _, l := range lines[:len(lines)-1] {
		v, ok := strings.CutPrefix(strings.TrimSpace(l), "KVFS-FSYNC ")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n != last+1 {
			t.Fatalf("console line %q after KVFS-FSYNC %d", l, last)
		}
		last = n
	}
	return last
}

// TestVMServerCrash kills the confined server (SIGKILL of its serving process) of a real guest
// in the middle of its fsync'd writes, under the stop policy, and checks the promises of a
// storage daemon: the sandbox reports the death within a second (a killed server did not end
// with its VM, so the monitor decides at once, then stops QEMU), QEMU is stopped,
// every byte the guest reported fsync'd is on the host, the state file says failed and why,
// and a restarted owner (Recover) cleans the sandbox up. The restart policy's new server is
// TestVMServerRestart's.
func TestVMServerCrash(t *testing.T) {
	requireGuest(t)
	g := vmtest.Image(t)
	accel := testAccel(t, g)
	base := testBase(t)
	ctx := context.Background()

	s, err := Create(ctx, "crash", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	ctl := guestSetup(t, crashGuest)
	if err := s.Bind(ctl, "ctl", 0); err != nil {
		t.Fatal(err)
	}
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Cmdline = accel, g.Kernel, g.Initrd, guestCmdline(s.Config().Device.Tag)
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	dir := s.Dir()
	diag := diagnose(dir)
	waitFile(t, filepath.Join(ctl, "ready"), guestTimeout, s.VMExited(), diag)
	for deadline := time.Now().Add(2 * time.Minute); fsyncedUpTo(t, readFile(t, s.ConsolePath())) < 20; {
		if time.Now().After(deadline) || isClosed(s.VMExited()) {
			t.Fatalf("the guest does not get to 20 fsyncs\n%s", diag())
		}
		time.Sleep(50 * time.Millisecond)
	}

	st := s.Stats()
	serving := confinedChild(t, st.Server.PID)
	vmID := *mustState(t, dir).VM.Process
	killed := time.Now()
	if err := syscall.Kill(serving, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(30 * time.Second):
		t.Fatalf("the sandbox did not report its server's death\n%s", diag())
	}
	reported := time.Since(killed)
	var se *ServerError
	if !errors.As(s.Err(), &se) {
		t.Fatalf("Err() = %v", s.Err())
	}
	noticed := se.At.Sub(killed)
	t.Logf("serving process %d killed: the monitor decided after %v, Done (QEMU stopped) after %v: %v",
		serving, noticed.Round(time.Millisecond), reported.Round(time.Millisecond), se)
	if noticed >= time.Second {
		t.Errorf("the death was reported %v after the kill", noticed)
	}
	// Stopping QEMU takes up to vmStopGrace, and the machine is shared and slow.
	if reported > 5*time.Second {
		t.Errorf("the death was reported %v after the kill", reported)
	}
	if se.Policy != PolicyStop || !strings.Contains(se.Server, "confined kvfsd (pid "+strconv.Itoa(st.Server.PID)+")") ||
		!strings.Contains(se.Err.Error(), "exit status 137") || se.Action != "stopped the VM (pid "+strconv.Itoa(st.VM.PID)+")" {
		t.Errorf("Err() = %#v", se)
	}
	if !processGone(vmID) || s.Stats().VM.Running {
		t.Errorf("QEMU (pid %d) still runs", vmID.PID)
	}

	// Every byte fsync'd before the kill is on the host. (No fsync can complete after it: the
	// only server is dead; so every one the console shows counts.)
	n := fsyncedUpTo(t, readFile(t, s.ConsolePath()))
	for i := 1; i <= n; i++ {
		got, err := os.ReadFile(filepath.Join(ctl, "w", "f"+strconv.Itoa(i)))
		if err != nil || !bytes.Equal(got, crashFile(i)) {
			t.Errorf("f%d: %d bytes (%v), want the %d the guest fsync'd", i, len(got), err, crashFileSize(i))
		}
	}
	var wantLog strings.Builder
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&wantLog, "line %08d\n", i)
	}
	gotLog := readFile(t, filepath.Join(ctl, "w", "log"))
	if !strings.HasPrefix(gotLog, wantLog.String()) {
		t.Errorf("the log on the host (%d bytes) does not start with the %d lines the guest fsync'd", len(gotLog), n)
	}
	t.Logf("the guest reported %d fsync'd files and log lines; all on the host (the log has %d lines)", n, strings.Count(gotLog, "\n"))

	// The state file is consistent: it reads, and says failed and why.
	if st := mustState(t, dir); st.Phase != PhaseFailed || st.Failure != se.Error() || st.ID != "crash" {
		t.Errorf("state: id %q, phase %s, failure %q", st.ID, st.Phase, st.Failure)
	}

	// The owner dies (its lock goes with it); a restarted one cleans up.
	s.lock.Close()
	rep, err := Recover(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Adopted) != 0 || len(rep.Cleaned) != 1 || rep.Cleaned[0].ID != "crash" || rep.Cleaned[0].Err != nil {
		t.Fatalf("Recover: %+v", rep)
	}
	t.Logf("Recover: cleaned up %q: %s", rep.Cleaned[0].ID, rep.Cleaned[0].Reason)
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory left: %v", err)
	}
	if under, _ := mountsUnder(base); len(under) > 0 {
		t.Errorf("mounts left: %q", under)
	}
	if kids := childPids(t); len(kids) > 0 {
		t.Errorf("children left: %v", kids)
	}
}
