package sandbox

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// mountLine returns the mountinfo line of the mount point path, or "".
func mountLine(t testing.TB, path string) string {
	t.Helper()
	return mountLineIn(t, "/proc/self/mountinfo", path)
}

// mountLineIn is mountLine in the mount namespace whose mountinfo file is mountinfo.
func mountLineIn(t testing.TB, mountinfo, path string) string {
	t.Helper()
	b, err := os.ReadFile(mountinfo)
	if err != nil {
		t.Fatal(err)
	}
	line := ""
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && unescapeMountInfo(f[4]) == path {
			line = l // the last one is on top
		}
	}
	return line
}

func TestLayout(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	s, err := Create(ctx, "layout", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)

	// mounts/ is a shared mount, shared/ a read-only slave of it, in the sandbox's namespace.
	if l := nsMountLine(t, s, s.MountsDir()); !strings.Contains(l, " shared:") {
		t.Errorf("mounts/ is not a shared mount: %q", l)
	}
	l := nsMountLine(t, s, s.SharedDir())
	if !strings.Contains(l, " master:") || !strings.Contains(strings.Fields(l)[5], "ro") {
		t.Errorf("shared/ is not a read-only slave mount: %q", l)
	}
	if fi, err := os.Lstat(s.SocketPath()); err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket: %v %v", fi.Mode(), err)
	}
	st, err := readState(s.Dir())
	if err != nil || st.Phase != PhaseCreated || st.Server.Daemon != Confined || st.Owner.PID != os.Getpid() {
		t.Errorf("state %+v, %v", st, err)
	}

	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A read-write bind: visible and writable through shared/ (the server writes there).
	if err := s.Bind(src, "rw", 0); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(inNS(s, filepath.Join(s.SharedDir(), "rw", "f"))); err != nil || string(b) != "hello" {
		t.Errorf("shared/rw/f: %q, %v", b, err)
	}
	if err := os.WriteFile(inNS(s, filepath.Join(s.SharedDir(), "rw", "g")), nil, 0o644); err != nil {
		t.Errorf("writing through shared/rw: %v", err)
	}
	// A read-only bind is read-only in shared/ too (the propagated copy keeps the flag).
	if err := s.Bind(src, "ro", BindReadOnly); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(inNS(s, filepath.Join(s.SharedDir(), "ro", "f"))); err != nil || string(b) != "hello" {
		t.Errorf("shared/ro/f: %q, %v", b, err)
	}
	for _, p := range []string{filepath.Join(s.SharedDir(), "ro", "h"), filepath.Join(s.MountsDir(), "ro", "h"), filepath.Join(s.SharedDir(), "top")} {
		if err := os.WriteFile(inNS(s, p), nil, 0o644); !errors.Is(err, syscall.EROFS) {
			t.Errorf("writing %s: %v, want EROFS", p, err)
		}
	}
	// A single file.
	if err := s.Bind(filepath.Join(src, "f"), "file", BindReadOnly); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(inNS(s, filepath.Join(s.SharedDir(), "file"))); err != nil || string(b) != "hello" {
		t.Errorf("shared/file: %q, %v", b, err)
	}
	// A symlink as the source is refused, not followed.
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(src, link); err != nil {
		t.Fatal(err)
	}
	if err := s.Bind(link, "link", 0); err == nil || !strings.Contains(err.Error(), "is a symlink") {
		t.Errorf("binding a symlink: %v, want a refusal", err)
	}
	if _, err := os.Lstat(inNS(s, filepath.Join(s.MountsDir(), "link"))); err == nil {
		t.Error("a refused bind left its mount point")
	}
	// Names are single components.
	for _, bad := range []string{"", ".", "..", "a/b", "../x"} {
		if err := s.Bind(src, bad, 0); err == nil {
			t.Errorf("Bind(%q) succeeded", bad)
		}
	}
	if err := s.Bind(src, "rw", 0); err == nil {
		t.Errorf("binding twice to one name succeeded")
	}
	// Unbind: gone from both.
	if err := s.Unbind("rw"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(s.MountsDir(), "rw"), filepath.Join(s.SharedDir(), "rw")} {
		if nsMountLine(t, s, p) != "" {
			t.Errorf("%s still mounted after Unbind", p)
		}
	}
	if _, err := os.Lstat(inNS(s, filepath.Join(s.MountsDir(), "rw"))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount point left after Unbind: %v", err)
	}

	dir := s.Dir()
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sandbox directory left: %v", err)
	}
	if under, _ := mountsUnder(base); len(under) != 0 {
		t.Errorf("mounts left: %q", under)
	}
	if b, err := os.ReadFile(filepath.Join(src, "g")); err != nil || len(b) != 0 {
		t.Errorf("the bind source lost a file: %v", err)
	}
	if s.Phase() != PhaseStopped || !isClosed(s.Done()) || s.Err() != nil {
		t.Errorf("after Stop: phase %s, done %v, err %v", s.Phase(), isClosed(s.Done()), s.Err())
	}
	if err := s.Stop(ctx); err != nil {
		t.Errorf("second Stop: %v", err)
	}
	if err := s.Bind(src, "late", 0); err == nil {
		t.Errorf("Bind after Stop succeeded")
	}
}

// TestCreateFailsCleanly checks that a bad configuration, annotation or daemon leaves nothing
// behind.
func TestCreateFailsCleanly(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	const p = "io.kvfs.config."
	tests := []struct {
		name   string
		id     string
		config func(c *Config)
		ann    map[string]string
		want   string
	}{
		{"annotation not enabled", "a1", nil, map[string]string{p + "server.cache": "never"}, "not enabled"},
		{"bad annotation value", "a2", func(c *Config) { c.Annotations.Enabled = []string{"device.queue_size"} },
			map[string]string{p + "device.queue_size": "3"}, `device.queue_size = "3": want a power of two`},
		{"invalid id", "../x", nil, nil, "invalid sandbox id"},
		{"daemon missing", "a3", func(c *Config) { c.Server.Daemon = "/nonexistent/kvfsd" }, nil,
			`server.daemon = "/nonexistent/kvfsd": stat /nonexistent/kvfsd: no such file`},
		{"daemon exits at once", "a4", func(c *Config) { c.Server.Daemon = "/bin/false" }, nil, "exited before serving (exit status 1)"},
		{"daemon refuses an option", "a5", func(c *Config) {
			c.Server.Daemon = kvfsdBinary(t)
			c.Server.ExtraArgs = []string{"--migration-confirm-paths"}
		}, nil, "--migration-confirm-paths: not supported yet"},
		{"bad cache mode in the file", "a6", func(c *Config) { c.Server.Cache = "bogus" }, nil, "server.cache"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := testConfig(base)
			if tt.config != nil {
				tt.config(c)
			}
			s, err := Create(ctx, tt.id, Options{Config: c, Annotations: tt.ann})
			if err == nil {
				s.Stop(ctx)
				t.Fatalf("Create succeeded")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
			if entries, _ := os.ReadDir(base); len(entries) != 0 {
				t.Errorf("left in the base directory: %v", entries)
			}
			if under, _ := mountsUnder(base); len(under) != 0 {
				t.Errorf("mounts left: %q", under)
			}
		})
	}

	// An existing sandbox is not touched by a second Create.
	s, err := Create(ctx, "dup", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	if _, err := Create(ctx, "dup", Options{Config: testConfig(base)}); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("second Create: %v", err)
	}
	if _, err := os.Stat(s.SocketPath()); err != nil || nsMountLine(t, s, s.SharedDir()) == "" {
		t.Errorf("the first sandbox was damaged: %v", err)
	}
}

// TestNoLeaks runs 50 create/bind/stat/destroy cycles without a VM, alternating the
// confined server (the default) and an external kvfsd, and checks that mounts, descriptors, child
// processes, goroutines and files are all given back.
func TestNoLeaks(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	confined, external := testConfig(base), externalConfig(t, base)

	cycle := func(i int) {
		cfg := confined
		if i%2 == 1 {
			cfg = external
		}
		s, err := Create(ctx, fmt.Sprintf("leak-%d", i), Options{Config: cfg})
		if err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		flags := BindFlags(0)
		if i%4 < 2 {
			flags = BindReadOnly
		}
		if err := s.Bind(src, "vol", flags); err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		if _, err := os.Stat(inNS(s, filepath.Join(s.SharedDir(), "vol", "f"))); err != nil {
			t.Errorf("cycle %d: %v", i, err)
		}
		st := s.Stats()
		if !st.Server.Running || st.Server.PID == 0 || (i%2 == 0) != (st.Server.FS != nil) {
			t.Errorf("cycle %d: stats %+v", i, st.Server)
		}
		if err := s.Stop(ctx); err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
	}
	cycle(0) // warm-up: the runtime opens some descriptors once
	cycle(1)
	runtime.GC()
	before, goroutines := takeCounts(t, base), runtime.NumGoroutine()
	start := time.Now()
	for i := 2; i < 52; i++ {
		cycle(i)
	}
	elapsed := time.Since(start)
	after := takeCounts(t, base)
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > goroutines && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("50 cycles in %v; before %+v, after %+v; goroutines %d → %d", elapsed.Round(time.Millisecond),
		before, after, goroutines, runtime.NumGoroutine())
	if after != before {
		t.Errorf("leak: before %+v, after %+v", before, after)
	}
	if g := runtime.NumGoroutine(); g > goroutines {
		buf := make([]byte, 1<<20)
		t.Errorf("goroutines %d → %d:\n%s", goroutines, g, buf[:runtime.Stack(buf, true)])
	}
}

// TestTeardownRefusesSymlinks plants symlinks where a sandbox has its mounts and checks that
// neither the unmounting nor the removal follows them.
func TestTeardownRefusesSymlinks(t *testing.T) {
	requireRoot(t)
	base := testBase(t)

	// victim is a mount point with a file: what a symlink would point the cleanup at.
	victim := t.TempDir()
	if err := unix.Mount(victim, victim, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(victim, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(victim, "precious"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}

	dir := filepath.Join(base, "evil")
	if err := os.MkdirAll(filepath.Join(dir, mountsName), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, filepath.Join(dir, sharedName)); err != nil {
		t.Fatal(err)
	}
	err := teardown(dir, nil)
	if err == nil || !strings.Contains(err.Error(), "is a symlink") {
		t.Errorf("teardown: %v, want a refusal", err)
	}
	if mountLine(t, victim) == "" {
		t.Errorf("the symlink's target was unmounted")
	}

	// removeTree removes a symlink, not what it points to.
	os.Remove(filepath.Join(dir, sharedName))
	if err := os.Symlink(victim, filepath.Join(dir, mountsName, "link")); err != nil {
		t.Fatal(err)
	}
	if err := teardown(dir, nil); err != nil {
		t.Errorf("teardown: %v", err)
	}
	if _, err := os.Stat(filepath.Join(victim, "precious")); err != nil {
		t.Errorf("the symlink's target lost its file: %v", err)
	}

	// removeTree does not cross into another file system.
	if err := os.MkdirAll(filepath.Join(dir, "x"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", filepath.Join(dir, "x"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "x", "kept"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := removeTree(dir); err == nil || !strings.Contains(err.Error(), "another file system") {
		t.Errorf("removeTree across a mount: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "x", "kept")); err != nil {
		t.Errorf("removeTree removed a file on another file system: %v", err)
	}
	if err := teardown(dir, nil); err == nil || !strings.Contains(err.Error(), "still mounted under it") {
		t.Errorf("teardown with a foreign mount: %v", err)
	}
	unix.Unmount(filepath.Join(dir, "x"), 0)
	if err := teardown(dir, nil); err != nil {
		t.Errorf("teardown: %v", err)
	}
}

// fakeServer is an fsServer the tests end at will.
type fakeServer struct {
	done    chan struct{}
	err     error
	signal  bool // killed by a signal
	stopped chan struct{}
}

func newFakeServer() *fakeServer {
	return &fakeServer{done: make(chan struct{}), stopped: make(chan struct{}, 10)}
}

func (f *fakeServer) exited() <-chan struct{} { return f.done }
func (f *fakeServer) exitErr() error          { <-f.done; return f.err }
func (f *fakeServer) killed() bool            { <-f.done; return f.signal }
func (f *fakeServer) stop() error {
	f.stopped <- struct{}{}
	if !isClosed(f.done) {
		close(f.done)
	}
	return nil
}
func (f *fakeServer) describe() string     { return "fake server" }
func (f *fakeServer) info() ServerStats    { return ServerStats{Daemon: "fake"} }
func (f *fakeServer) record() serverRecord { return serverRecord{Daemon: "fake"} }
func (f *fakeServer) process() Process     { return nil }

// fakeVM is a Process that exits when signalled.
type fakeVM struct {
	done    chan struct{}
	signals chan os.Signal
}

func newFakeVM() *fakeVM {
	return &fakeVM{done: make(chan struct{}), signals: make(chan os.Signal, 10)}
}

func (v *fakeVM) Pid() int { return 0 }
func (v *fakeVM) Signal(sig os.Signal) error {
	if isClosed(v.done) {
		return os.ErrProcessDone
	}
	v.signals <- sig
	close(v.done)
	return nil
}
func (v *fakeVM) Exited() <-chan struct{} { return v.done }
func (v *fakeVM) ExitErr() error          { return errors.New("signal: terminated") }

// TestFailurePolicies drives the monitor with a fake server and VM: each policy, the restart
// limit, and a server that ends because the VM ended.
func TestFailurePolicies(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()

	newSandbox := func(t *testing.T, policy string, maxRestarts int) (*Sandbox, *fakeServer, *fakeVM) {
		c := testConfig(base)
		c.Server.OnFailure, c.Server.MaxRestarts = policy, maxRestarts
		s, err := Create(ctx, strings.ReplaceAll(t.Name(), "/", "-"), Options{Config: c})
		if err != nil {
			t.Fatal(err)
		}
		stopOnCleanup(t, s)
		fs, vm := newFakeServer(), newFakeVM()
		s.opMu.Lock()
		s.mu.Lock()
		real := s.srv
		s.srv, s.vm, s.phase = fs, vm, PhaseRunning
		s.mu.Unlock()
		s.opMu.Unlock()
		_ = real.stop() // its monitor sees it replaced and does nothing
		s.wg.Add(1)
		go s.watchServer(fs)
		return s, fs, vm
	}

	t.Run("stop", func(t *testing.T) {
		s, fs, vm := newSandbox(t, PolicyStop, 3)
		fs.err = errors.New("vhost-user: bad message")
		close(fs.done)
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the sandbox did not fail")
		}
		var se *ServerError
		if !errors.As(s.Err(), &se) || se.Policy != PolicyStop || !strings.Contains(se.Error(), "bad message") ||
			!strings.Contains(se.Action, "stopped the VM") {
			t.Errorf("Err() = %v", s.Err())
		}
		if !isClosed(vm.done) || s.Phase() != PhaseFailed {
			t.Errorf("VM running %v, phase %s", !isClosed(vm.done), s.Phase())
		}
		st, err := readState(s.Dir())
		if err != nil || st.Phase != PhaseFailed || !strings.Contains(st.Failure, "bad message") {
			t.Errorf("state %+v %v", st, err)
		}
	})

	t.Run("restart", func(t *testing.T) {
		s, fs, vm := newSandbox(t, PolicyRestart, 1)
		close(fs.done) // a clean exit while the VM runs is a failure too
		deadline := time.Now().Add(10 * time.Second)
		for s.Stats().Server.Restarts != 1 {
			if time.Now().After(deadline) {
				t.Fatalf("no restart: %+v", s.Stats())
			}
			time.Sleep(10 * time.Millisecond)
		}
		st := s.Stats()
		if !st.Server.Running || st.Server.FS == nil || !strings.Contains(st.Server.LastFailure, "front-end disconnected") {
			t.Errorf("after the restart: %+v", st.Server)
		}
		if isClosed(vm.done) || isClosed(s.Done()) {
			t.Errorf("the restart policy stopped the VM or the sandbox")
		}
		// The new server dies too: the limit (1) is reached, so the VM is stopped.
		s.mu.Lock()
		srv := s.srv
		s.mu.Unlock()
		// SIGKILL, from outside, of the confined server: reported by the same monitor.
		if err := srv.process().Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the sandbox did not fail")
		}
		if err := s.Err(); err == nil || !strings.Contains(err.Error(), "restart limit (1) reached") || !isClosed(vm.done) {
			t.Errorf("Err() = %v, VM stopped %v", err, isClosed(vm.done))
		}
	})

	// A server killed by a signal did not end with its VM: the monitor decides at once, where
	// an exit waits serverExitGrace for the VM (the subtest below).
	t.Run("killed", func(t *testing.T) {
		s, fs, vm := newSandbox(t, PolicyStop, 0)
		fs.err, fs.signal = errors.New("signal: killed"), true
		killed := time.Now()
		close(fs.done)
		select {
		case <-s.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the sandbox did not fail")
		}
		var se *ServerError
		if !errors.As(s.Err(), &se) || !strings.Contains(se.Error(), "signal: killed") || !isClosed(vm.done) {
			t.Fatalf("Err() = %v, VM stopped %v", s.Err(), isClosed(vm.done))
		}
		if d := se.At.Sub(killed); d >= serverExitGrace {
			t.Errorf("the monitor decided %v after the kill: it waited for the VM", d)
		}
	})

	t.Run("server ends after the VM", func(t *testing.T) {
		s, fs, vm := newSandbox(t, PolicyStop, 0)
		close(vm.done)
		close(fs.done)
		time.Sleep(serverExitGrace + 200*time.Millisecond)
		if isClosed(s.Done()) || s.Err() != nil {
			t.Errorf("a server ending with its VM was taken for a failure: %v", s.Err())
		}
	})
}

// fakeRunner records the VM it is asked to run and returns a fakeVM.
type fakeRunner struct {
	cmds []VMCommand
	vm   *fakeVM
}

func (r *fakeRunner) Run(_ context.Context, c VMCommand) (Process, error) {
	r.cmds = append(r.cmds, c)
	r.vm = newFakeVM()
	return r.vm, nil
}

// TestStart checks Start without QEMU: what reaches the runner, what is persisted, and the
// errors.
func TestStart(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	runner := &fakeRunner{}
	c := testConfig(base)
	c.VM.QEMU = "/usr/bin/qemu-system-x86_64"
	c.Device.QueueSize = 256
	c.VM.VCPUs = 2
	s, err := Create(ctx, "start", Options{Config: c, Runner: runner})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)

	vm := s.DefaultVM()
	if vm.FS.NumRequestQueues != 2 {
		t.Errorf("a 2-vCPU VM's device has %d request queues, want one per vCPU", vm.FS.NumRequestQueues)
	}
	vm.Memory.Size = "64M"
	if err := s.Start(ctx, vm); err == nil || !strings.Contains(err.Error(), "less than the minimum of 128 MiB") {
		t.Errorf("Start with 64M: %v", err)
	}
	if len(runner.cmds) != 0 || s.Phase() != PhaseCreated {
		t.Fatalf("an invalid VM reached the runner (%d) or changed the phase (%s)", len(runner.cmds), s.Phase())
	}

	if s.AgentSecret() != nil {
		t.Error("an agent secret before Start")
	}
	vm = s.DefaultVM()
	vm.Accel = AccelTCG
	vm.FS = FSDevice{Socket: "/elsewhere.sock", Tag: "other", QueueSize: 2, NumRequestQueues: 1}
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}
	cmd := runner.cmds[0]
	args := strings.Join(cmd.Args, " ")
	if cmd.Path != "/usr/bin/qemu-system-x86_64" || cmd.Output == nil || len(cmd.ExtraFiles) != 2 ||
		!strings.Contains(args, "path="+s.SocketPath()) || !strings.Contains(args, "tag=kataShared,queue-size=256") ||
		!strings.Contains(args, "-chardev file,id=kvfs-console0,path=/proc/self/fd/3,append=on") || !strings.Contains(args, "-name kvfs-start") ||
		!strings.Contains(args, "-smbios type=11,path=/proc/self/fd/4") {
		t.Errorf("runner got %+v", cmd)
	}
	// The agent's secret: fresh, and on no command line nor in the state on disk.
	secret := s.AgentSecret()
	if len(secret) != agent.SecretLen || bytes.Equal(secret, make([]byte, agent.SecretLen)) {
		t.Errorf("the agent secret after Start: %x", secret)
	}
	stateFile, _ := os.ReadFile(filepath.Join(s.Dir(), stateName))
	if hexSecret := hex.EncodeToString(secret); strings.Contains(args, hexSecret) || bytes.Contains(stateFile, []byte(hexSecret)) {
		t.Errorf("the secret is in QEMU's arguments or the state file: %s", args)
	}
	st, err := readState(s.Dir())
	if err != nil || st.Phase != PhaseRunning || st.VM == nil || strings.Join(st.VM.Args, " ") != args || st.VM.Process != nil {
		t.Errorf("state %+v, %v", st, err)
	}
	if err := s.Start(ctx, vm); err == nil || !strings.Contains(err.Error(), "phase running") {
		t.Errorf("second Start: %v", err)
	}
	if err := s.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if sig := <-runner.vm.signals; sig != syscall.SIGTERM {
		t.Errorf("the VM got %v, want SIGTERM", sig)
	}
}

// TestNewAgentSecret: the file QEMU reads holds the secret's OEM string and nothing else,
// sealed against writes; each secret is new.
func TestNewAgentSecret(t *testing.T) {
	secret, f, err := newAgentSecret()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil || string(b) != agent.SecretOEMString(secret) || len(secret) != agent.SecretLen {
		t.Errorf("the file holds %q (%v), want %q", b, err, agent.SecretOEMString(secret))
	}
	if _, err := f.WriteAt([]byte("x"), 0); err == nil {
		t.Error("the secret's file can be written")
	}
	other, g, err := newAgentSecret()
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	if bytes.Equal(secret, other) {
		t.Error("two secrets are the same")
	}
}

// TestDefaultVMAgent checks what DefaultVM adds for the guest agent: the configured kernel and
// initrd, the command line the agent reads, and the agent channel of each transport.
func TestDefaultVMAgent(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	c := testConfig(base)
	c.Device.Tag = "podfs"
	c.VM.Kernel, c.VM.Initrd = "/g/vmlinuz", "/g/initramfs.gz"
	s, err := Create(ctx, "agentvm", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	vm := s.DefaultVM()
	if vm.Kernel != "/g/vmlinuz" || vm.Initrd != "/g/initramfs.gz" {
		t.Errorf("kernel %q initrd %q", vm.Kernel, vm.Initrd)
	}
	if want := "console=ttyS0 quiet panic=-1 kvfs.tag=podfs kvfs.agent=serial"; vm.Cmdline != want {
		t.Errorf("cmdline %q, want %q", vm.Cmdline, want)
	}
	if want := (AgentDevice{Transport: AgentSerial, Socket: filepath.Join(s.Dir(), "agent.sock")}); vm.Agent != want ||
		s.AgentSocketPath() != want.Socket {
		t.Errorf("agent %+v (AgentSocketPath %q), want %+v", vm.Agent, s.AgentSocketPath(), want)
	}

	c.Agent.Transport = AgentVsock
	c.VM.KernelParams = "kvfs.debug=1 loglevel=7"
	v, err := Create(ctx, "agentvsock", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, v)
	vm = v.DefaultVM()
	if want := "console=ttyS0 quiet panic=-1 kvfs.tag=podfs kvfs.agent=vsock:1024 kvfs.debug=1 loglevel=7"; vm.Cmdline != want {
		t.Errorf("cmdline %q, want %q", vm.Cmdline, want)
	}
	if vm.Agent.Transport != AgentVsock || vm.Agent.GuestCID != GuestCID("agentvsock") || vm.Agent.GuestCID < 3 {
		t.Errorf("agent %+v", vm.Agent)
	}
	if GuestCID("a") == GuestCID("b") {
		t.Errorf("GuestCID gives a and b the same CID")
	}
	if _, err := vm.Args(); err != nil {
		t.Errorf("Args: %v", err)
	}

	// The guest's root an erofs image: the kernel mounts it and starts the agent.
	c.VM.Initrd, c.VM.Rootfs = "", "/g/rootfs.erofs"
	r, err := Create(ctx, "agentroot", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, r)
	vm = r.DefaultVM()
	if want := "console=ttyS0 quiet panic=-1 kvfs.tag=podfs kvfs.agent=vsock:1024 " + RootCmdline + " kvfs.debug=1 loglevel=7"; vm.Cmdline != want || vm.Root != "/g/rootfs.erofs" || vm.Initrd != "" {
		t.Errorf("root %q initrd %q cmdline %q, want %q", vm.Root, vm.Initrd, vm.Cmdline, want)
	}
}
