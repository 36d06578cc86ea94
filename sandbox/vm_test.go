package sandbox

import (
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

// The guests below are vmtest's: /init mounts the virtio-fs tag from kvfs.tag= at /mnt and
// runs kvfs.run= from the share. The share's root is the sandbox's read-only shared/, so each
// test binds a read-write host directory "ctl" into it: it holds the guest's script and is the
// channel of a handshake through the share itself (the guest writes ctl/ready, the host
// answers with a file or a bind the guest polls for).

// guestTimeout bounds a boot under TCG, which takes 10-40 s here.
const guestTimeout = 4 * time.Minute

func guestCmdline(tag string) string {
	return "console=ttyS0 quiet panic=-1 kvfs.tag=" + tag + " kvfs.run=ctl/guest.sh kvfs.timeout=300"
}

// guestSetup makes ctl with the guest script in it.
func guestSetup(t *testing.T, script string) (ctl string) {
	t.Helper()
	ctl = t.TempDir()
	if err := os.WriteFile(filepath.Join(ctl, "guest.sh"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return ctl
}

// diagnose returns the sandbox's logs for a failure message.
func diagnose(dir string) func() string {
	return func() string {
		var b strings.Builder
		for _, name := range []string{consoleName, qemuLogName, serverLogName} {
			data, err := os.ReadFile(filepath.Join(dir, name))
			if err != nil {
				continue
			}
			fmt.Fprintf(&b, "--- %s ---\n%s\n", name, tail(string(data), 4000))
		}
		return b.String()
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestVMLifecycle boots a guest against a sandbox with every default (in-process kvfsd, memfd
// memory on a NUMA node, queue size 1024, tag kataShared) and checks that a read-only bind
// made after the guest came up appears in the guest, read-only.
func TestVMLifecycle(t *testing.T) {
	requireGuest(t)
	g := vmtest.Image(t)
	accel := testAccel(t, g)
	base := testBase(t)
	ctx := context.Background()

	s, err := Create(ctx, "life", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	ctl := guestSetup(t, `
M=$KVFS_MNT
cat $M/ctl/input.txt > $M/ctl/read.txt || exit 2
echo ready > $M/ctl/ready
i=0
while [ ! -e $M/late/hello.txt ]; do
	i=$((i+1))
	[ $i -le 1500 ] || { echo "KVFS-TEST the late bind never appeared"; exit 3; }
	sleep 0.2
done
cat $M/late/hello.txt > $M/ctl/late.txt || exit 4
if touch $M/late/new 2>/dev/null; then echo "KVFS-TEST the read-only bind is writable"; exit 5; fi
if touch $M/new 2>/dev/null; then echo "KVFS-TEST the share's root is writable"; exit 6; fi
echo "KVFS-TEST polls: $i"
exit 0
`)
	if err := os.WriteFile(filepath.Join(ctl, "input.txt"), []byte("input from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	late := t.TempDir()
	if err := os.WriteFile(filepath.Join(late, "hello.txt"), []byte("bound after boot\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := s.Bind(ctl, "ctl", 0); err != nil {
		t.Fatal(err)
	}

	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Cmdline = accel, g.Kernel, g.Initrd, guestCmdline(s.Config().Device.Tag)
	start := time.Now()
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	diag := diagnose(s.Dir())
	waitFile(t, filepath.Join(ctl, "ready"), guestTimeout, s.VMExited(), diag)
	ready := time.Since(start)
	if err := s.Bind(late, "late", BindReadOnly); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.VMExited():
	case <-time.After(guestTimeout):
		t.Fatalf("the guest did not finish\n%s", diag())
	}
	console := readFile(t, s.ConsolePath())
	t.Logf("accel %s: guest ready after %v, done after %v; %s", accel, ready.Round(time.Millisecond),
		time.Since(start).Round(time.Millisecond), grepLines(console, "KVFS-TEST"))
	if st := vmtest.ExitStatus(console); st != 0 {
		t.Fatalf("guest exit status %d\n%s", st, diag())
	}
	if got := readFile(t, filepath.Join(ctl, "read.txt")); got != "input from the host\n" {
		t.Errorf("the guest read %q", got)
	}
	if got := readFile(t, filepath.Join(ctl, "late.txt")); got != "bound after boot\n" {
		t.Errorf("the guest read %q from the late bind", got)
	}

	stats := s.Stats()
	if stats.Server.FS == nil || stats.Server.FS.FUSE.Ops["LOOKUP"].Count == 0 || stats.Server.FS.FUSE.Ops["WRITE"].Count == 0 {
		t.Errorf("server stats %+v", stats.Server.FS)
	}
	// QEMU exited with the guest; the server's end that followed is not a failure.
	time.Sleep(serverExitGrace + 200*time.Millisecond)
	if stats := s.Stats(); stats.Phase != PhaseRunning || stats.VM.Running || stats.Server.Running || s.Err() != nil {
		t.Errorf("after the guest powered off: %+v, err %v", stats, s.Err())
	}
	dir := s.Dir()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("directory left: %v", err)
	}
	if under, _ := mountsUnder(base); len(under) > 0 {
		t.Errorf("mounts left: %q", under)
	}
}

// TestVMRecoverThenServerCrash leaves a running sandbox behind — external kvfsd, guest memory a
// preallocated shared file (the hugepages configuration) as the machine's memory backend, queue
// size 128, two request queues — by exiting its owner, recovers it, checks the guest still
// works through the adopted server, then kills the server with SIGKILL: the stop policy must
// kill QEMU and say why.
//
// Hugepages are not available on these hosts (no hugetlbfs mount, no pages reserved), so the
// hugepages configuration is booted with its path on a plain tmpfs directory: QEMU gets the
// same memory-backend-file,share=on,prealloc=on arguments, backed by normal pages.
func TestVMRecoverThenServerCrash(t *testing.T) {
	requireGuest(t)
	becomeSubreaper(t)
	g := vmtest.Image(t)
	accel := testAccel(t, g)
	base := testBase(t)
	ctx := context.Background()

	memDir := shmDir(t)
	cfg := externalConfig(t, base)
	cfg.VM.Hugepages = true
	cfg.VM.HugepagePath = memDir
	cfg.VM.MemoryPlacement = PlacementMachine
	cfg.Device.QueueSize = 128
	cfg.Device.NumRequestQueues = 2

	ctl := guestSetup(t, `
M=$KVFS_MNT
echo ready > $M/ctl/ready
i=0
while [ ! -e $M/ctl/go ]; do
	i=$((i+1))
	[ $i -le 1500 ] || exit 3
	sleep 0.2
done
cat $M/data/hello.txt > $M/ctl/ack.tmp && mv $M/ctl/ack.tmp $M/ctl/ack || exit 4
echo "KVFS-TEST acknowledged"
while :; do sleep 1; done
`)
	data := t.TempDir()
	if err := os.WriteFile(filepath.Join(data, "hello.txt"), []byte("read after adoption\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	res := runHelperProcess(t, helperSpec{
		Config: cfg, ID: "adopt",
		Binds:    []helperBind{{Src: ctl, Name: "ctl"}, {Src: data, Name: "data", Flags: BindReadOnly}},
		VM:       &helperVM{Accel: accel, Kernel: g.Kernel, Initrd: g.Initrd, Cmdline: guestCmdline(cfg.Device.Tag)},
		WaitFile: filepath.Join(ctl, "ready"), WaitLimit: guestTimeout,
	})
	t.Logf("the helper owner started the guest (ready after %v) and exited", time.Since(start).Round(time.Millisecond))
	dir := filepath.Join(base, "adopt")
	diag := diagnose(dir)
	args := strings.Join(mustState(t, dir).VM.Args, " ")
	for _, want := range []string{"memory-backend-file,id=kvfs-mem0,size=512M,mem-path=" + memDir + ",share=on",
		",memory-backend=kvfs-mem0", "queue-size=128,num-request-queues=2"} {
		if !strings.Contains(args, want) {
			t.Errorf("QEMU arguments %q lack %q", args, want)
		}
	}

	rep, err := Recover(ctx, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Adopted) != 1 {
		t.Fatalf("Recover: %+v\n%s", rep, diag())
	}
	s := rep.Adopted[0]
	stopOnCleanup(t, s)
	stats := s.Stats()
	if stats.Phase != PhaseRunning || stats.Server.PID != res.Stats.Server.PID || stats.VM == nil ||
		stats.VM.PID != res.Stats.VM.PID || !stats.Server.Running || !stats.VM.Running {
		t.Fatalf("adopted %+v\nhelper had %+v", stats, res.Stats)
	}
	vmID := *mustState(t, dir).VM.Process

	// The guest still works through the adopted server.
	if err := os.WriteFile(filepath.Join(ctl, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	waitFile(t, filepath.Join(ctl, "ack"), time.Minute, s.VMExited(), diag)
	if got := readFile(t, filepath.Join(ctl, "ack")); got != "read after adoption\n" {
		t.Errorf("the guest read %q", got)
	}

	// kill -9 the server.
	killed := time.Now()
	if err := syscall.Kill(stats.Server.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(30 * time.Second):
		t.Fatalf("the sandbox did not react to its server's death\n%s", diag())
	}
	t.Logf("server killed: sandbox failed after %v: %v", time.Since(killed).Round(time.Millisecond), s.Err())
	var se *ServerError
	if !errors.As(s.Err(), &se) || se.Policy != PolicyStop ||
		!strings.Contains(se.Server, "(pid "+strconv.Itoa(stats.Server.PID)+")") ||
		!strings.Contains(se.Err.Error(), "signal: killed") ||
		se.Action != "stopped the VM (pid "+strconv.Itoa(stats.VM.PID)+")" {
		t.Errorf("Err() = %#v", s.Err())
	}
	if !processGone(vmID) {
		t.Errorf("QEMU (pid %d) still runs", vmID.PID)
	}
	if st := mustState(t, dir); st.Phase != PhaseFailed || !strings.Contains(st.Failure, "signal: killed") {
		t.Errorf("state: phase %s, failure %q", st.Phase, st.Failure)
	}
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if under, _ := mountsUnder(base); len(under) > 0 {
		t.Errorf("mounts left: %q", under)
	}
	reapSandboxedServers(t)
	if kids := childPids(t); len(kids) > 0 {
		t.Errorf("children left: %v", kids)
	}
}

func mustState(t *testing.T, dir string) *state {
	t.Helper()
	st, err := readState(dir)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// shmDir makes a directory on /dev/shm, a tmpfs, for file-backed guest memory.
func shmDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "kvfs-mem-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// TestVMServerRestart kills the server of a running guest (external kvfsd; a shared file as
// the machine's memory backend) under the restart policy, and records what the guest sees:
// QEMU 7.2 does not reconnect a vhost-user-fs device, so the new server never gets a
// connection and the guest's pending request never completes — the guest hangs in the share
// until the VM is restarted.
func TestVMServerRestart(t *testing.T) {
	requireGuest(t)
	g := vmtest.Image(t)
	accel := testAccel(t, g)
	base := testBase(t)
	ctx := context.Background()

	memDir := shmDir(t)
	cfg := externalConfig(t, base)
	cfg.Server.OnFailure = PolicyRestart
	cfg.VM.FileMemPath = memDir // a shared file in a tmpfs, not preallocated
	cfg.VM.MemoryPlacement = PlacementMachine
	s, err := Create(ctx, "restart", Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	ctl := guestSetup(t, `
M=$KVFS_MNT
echo ready > $M/ctl/ready
n=0
while [ $n -lt 3000 ]; do
	n=$((n+1))
	echo "KVFS-TICK $n start"
	echo $n > $M/ctl/tick
	echo "KVFS-TICK $n done"
	sleep 0.1
done
exit 7
`)
	if err := s.Bind(ctl, "ctl", 0); err != nil {
		t.Fatal(err)
	}
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Cmdline = accel, g.Kernel, g.Initrd, guestCmdline(cfg.Device.Tag)
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	diag := diagnose(s.Dir())
	waitFile(t, filepath.Join(ctl, "ready"), guestTimeout, s.VMExited(), diag)
	tick := func() int {
		b, _ := os.ReadFile(filepath.Join(ctl, "tick"))
		n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		return n
	}
	for deadline := time.Now().Add(time.Minute); tick() < 5; {
		if time.Now().After(deadline) {
			t.Fatalf("the guest does not tick\n%s", diag())
		}
		time.Sleep(100 * time.Millisecond)
	}

	old := s.Stats().Server
	if err := syscall.Kill(old.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	atKill := tick()
	for deadline := time.Now().Add(15 * time.Second); s.Stats().Server.Restarts != 1; {
		if time.Now().After(deadline) {
			t.Fatalf("no restart: %+v\n%s", s.Stats(), diag())
		}
		time.Sleep(20 * time.Millisecond)
	}
	restarted := s.Stats()
	t.Logf("server pid %d killed; restarted as pid %d after %v", old.PID, restarted.Server.PID, time.Since(killed).Round(time.Millisecond))

	// The guest's next write to the share must start and never complete. A loaded TCG guest
	// may take a while to get there (its console line "start" comes first), so wait for the
	// start, then watch for a while.
	started := ""
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if l := lastLine(readFile(t, s.ConsolePath()), "KVFS-TICK"); strings.HasSuffix(l, " start") {
			started = l
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the guest started no request after the kill\n%s", diag())
		}
		time.Sleep(100 * time.Millisecond)
	}
	const watch = 8 * time.Second
	time.Sleep(watch)
	after := s.Stats()
	console := readFile(t, s.ConsolePath())
	lastTick := lastLine(console, "KVFS-TICK")
	serverLog := readFile(t, filepath.Join(s.Dir(), serverLogName))
	qemuLog := readFile(t, filepath.Join(s.Dir(), qemuLogName))
	connects := strings.Count(serverLog, "vhost-user front-end connected")
	t.Logf("observed %v after the restart: tick file %d at the kill, %d now; last console line %q; "+
		"server log has %d front-end connections; QEMU running: %v; QEMU's output: %q",
		watch, atKill, tick(), lastTick, connects, after.VM.Running, strings.TrimSpace(qemuLog))

	if restarted.Server.PID == old.PID || !after.Server.Running || after.Phase != PhaseRunning || isClosed(s.Done()) {
		t.Errorf("after the restart: %+v", after)
	}
	if !after.VM.Running {
		t.Errorf("QEMU exited after the server's death\n%s", diag())
	}
	if n := tick(); n > atKill+1 {
		t.Errorf("the guest kept writing to the share after the server died (tick %d → %d): QEMU reconnected?", atKill, n)
	}
	if lastTick != started {
		t.Errorf("the guest's last console line went from %q to %q, want a request that never completed", started, lastTick)
	}
	if connects != 1 {
		t.Errorf("%d front-end connections in the server log, want 1 (QEMU 7.2 does not reconnect)\n%s", connects, serverLog)
	}

	start := time.Now()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("Stop took %v (QEMU with a dead vhost-user back-end)", time.Since(start).Round(time.Millisecond))
	if under, _ := mountsUnder(base); len(under) > 0 {
		t.Errorf("mounts left: %q", under)
	}
}

// grepLines returns the lines of s that contain substr, joined by "; ".
func grepLines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, strings.TrimSpace(l))
		}
	}
	return strings.Join(out, "; ")
}

// lastLine returns the last line of s that contains substr.
func lastLine(s, substr string) string {
	last := ""
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			last = strings.TrimSpace(strings.TrimRight(l, "\r"))
		}
	}
	return last
}

// TestVMRootImageReadOnly: a root image (VM.Root) is the guest's to read, never to change:
// one file serves every pod on the host. The guest (the test guest's initramfs, booted by the
// kvfs kernel, which drives virtio-pmem) reads the device, then writes zeros over all of it
// and syncs; the host's file keeps every byte.
func TestVMRootImageReadOnly(t *testing.T) {
	requireGuest(t)
	g := vmtest.Image(t)
	kernel := vmtest.AgentImage(t).Kernel
	accel := testAccel(t, g)
	ctx := context.Background()

	image := filepath.Join(t.TempDir(), "rootfs.erofs")
	want := make([]byte, 4<<20)
	for i := range want {
		want[i] = byte(i*7 + i>>12)
	}
	if err := os.WriteFile(image, want, 0o444); err != nil {
		t.Fatal(err)
	}
	s, err := Create(ctx, "rootimage", Options{Config: testConfig(testBase(t))})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	ctl := guestSetup(t, `
M=$KVFS_MNT
dd if=/dev/pmem0 of=$M/ctl/read bs=64k 2>$M/ctl/read.err || exit 2
dd if=/dev/zero of=/dev/pmem0 bs=64k conv=fsync 2>$M/ctl/write.err
echo $? > $M/ctl/write.status
sync
exit 0
`)
	if err := s.Bind(ctl, "ctl", 0); err != nil {
		t.Fatal(err)
	}
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Root, vm.Cmdline = accel, kernel, g.Initrd, image, guestCmdline(s.Config().Device.Tag)
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	diag := diagnose(s.Dir())
	select {
	case <-s.VMExited():
	case <-time.After(guestTimeout):
		t.Fatalf("the guest did not finish\n%s", diag())
	}
	if st := vmtest.ExitStatus(readFile(t, s.ConsolePath())); st != 0 {
		t.Fatalf("guest exit status %d\n%s", st, diag())
	}
	if read := readFile(t, filepath.Join(ctl, "read")); read != string(want) {
		t.Fatalf("the guest read %d bytes of /dev/pmem0, not the image's %d", len(read), len(want))
	}
	t.Logf("the guest's write: status %s%s", readFile(t, filepath.Join(ctl, "write.status")), readFile(t, filepath.Join(ctl, "write.err")))
	if got, err := os.ReadFile(image); err != nil || string(got) != string(want) {
		t.Fatalf("the image changed under the guest's writes (%v)", err)
	}
}
