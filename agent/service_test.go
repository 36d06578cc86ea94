package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/console"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/rpcedge"
)

// fakeRuntime plays runc: a "process" is a goroutine running a behaviour chosen by its
// first argument, on the stdio the service handed over; its exit is reported to the service
// as the reaper would.
type fakeRuntime struct {
	svc *Service

	mu      sync.Mutex
	nextPid int
	procs   map[int]*fakeProc    // guarded by mu
	inits   map[string]*fakeProc // guarded by mu: by container id
	bundles map[string]string    // guarded by mu
	calls   []string             // guarded by mu
	// exitEarly makes a created process exit before Create/Exec returns its pid.
	exitEarly bool
	// killRefusal, if set, is what Kill answers, as runc does for a container whose init has
	// exited and is not reaped yet; killSpares leaves the targets running as well.
	killRefusal error
	killSpares  bool
}

type fakeProc struct {
	pid   int
	cid   string
	args  []string
	io    ProcessIO
	start chan struct{}
	kill  chan syscall.Signal
	once  sync.Once
}

func newFakeRuntime() *fakeRuntime {
	return &fakeRuntime{nextPid: 100, procs: map[int]*fakeProc{}, inits: map[string]*fakeProc{}, bundles: map[string]string{}}
}

func (f *fakeRuntime) record(format string, args ...any) {
	f.mu.Lock()
	f.calls = append(f.calls, fmt.Sprintf(format, args...))
	f.mu.Unlock()
}

func (f *fakeRuntime) newProc(cid string, args []string, io ProcessIO) *fakeProc {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.nextPid++
	p := &fakeProc{pid: f.nextPid, cid: cid, args: args, io: io, start: make(chan struct{}), kill: make(chan syscall.Signal, 1)}
	f.procs[p.pid] = p
	return p
}

// run is the process's life: wait for start (or a kill), do what args say, exit. A terminal
// process gets a new pty, whose master goes back to the service as runc's would.
func (f *fakeRuntime) run(p *fakeProc) (console.Console, error) {
	var stdin, stdout, stderr *os.File
	var master console.Console
	if p.io.Terminal {
		m, slavePath, err := console.NewPty()
		if err != nil {
			return nil, err
		}
		slave, err := os.OpenFile(slavePath, os.O_RDWR|syscall.O_NOCTTY, 0)
		if err != nil {
			m.Close()
			return nil, err
		}
		master, stdin, stdout, stderr = m, slave, dup(slave), dup(slave)
	} else {
		// The files are the child's copies: the service closes its own after Create/Exec.
		stdin, stdout, stderr = dup(p.io.Stdin), dup(p.io.Stdout), dup(p.io.Stderr)
	}
	go func() {
		status := 0
		select {
		case <-p.start:
			status = behave(p, stdin, stdout, stderr)
		case sig := <-p.kill:
			status = 128 + int(sig)
		}
		for _, c := range []io.Closer{stdin, stdout, stderr} {
			c.Close()
		}
		f.mu.Lock()
		delete(f.procs, p.pid)
		f.mu.Unlock()
		f.svc.ProcessExited(p.pid, status, time.Now())
	}()
	return master, nil
}

func dup(f *os.File) *os.File {
	fd, err := syscall.Dup(int(f.Fd()))
	if err != nil {
		panic(err)
	}
	return os.NewFile(uintptr(fd), f.Name())
}

// behave: "echo OUT ERR STATUS", "cat" (stdin to stdout), "sleep" (until killed), "size"
// (after a line on stdin, the terminal's window size as stty size says it).
func behave(p *fakeProc, stdin, stdout, stderr *os.File) int {
	switch p.args[0] {
	case "size":
		if _, err := bufio.NewReader(stdin).ReadString('\n'); err != nil {
			return 1
		}
		ws, err := unix.IoctlGetWinsize(int(stdout.Fd()), unix.TIOCGWINSZ)
		if err != nil {
			return 2
		}
		fmt.Fprintf(stdout, "size %d %d\n", ws.Row, ws.Col)
		return 0
	case "echo":
		fmt.Fprint(stdout, p.args[1])
		fmt.Fprint(stderr, p.args[2])
		var st int
		fmt.Sscan(p.args[3], &st)
		return st
	case "cat":
		io.Copy(stdout, stdin)
		return 0
	case "sleep":
		return 128 + int(<-p.kill)
	case "orphan":
		// Write, leave a "child" holding stdout for a long time, exit.
		fmt.Fprint(stdout, "before the exit")
		held := dup(stdout)
		go func() {
			time.Sleep(time.Minute)
			held.Close()
		}()
		return 0
	}
	return 127
}

func (f *fakeRuntime) Create(ctx context.Context, id, bundle string, io ProcessIO) (Created, error) {
	f.record("create %s", id)
	var spec specs.Spec
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return Created{}, err
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		return Created{}, err
	}
	if spec.Process.Args[0] == "fail" {
		return Created{}, fmt.Errorf("runc create failed: exit status 1")
	}
	p := f.newProc(id, spec.Process.Args, io)
	f.mu.Lock()
	f.inits[id] = p
	f.bundles[id] = bundle
	early := f.exitEarly
	f.mu.Unlock()
	if _, err := f.run(p); err != nil {
		return Created{}, err
	}
	if early {
		p.kill <- syscall.SIGKILL
		time.Sleep(20 * time.Millisecond)
	}
	return Created{Pid: p.pid}, nil
}

func (f *fakeRuntime) Start(ctx context.Context, id string) error {
	f.record("start %s", id)
	f.mu.Lock()
	p := f.inits[id]
	f.mu.Unlock()
	close(p.start)
	return nil
}

func (f *fakeRuntime) Exec(ctx context.Context, id, execID string, ps *specs.Process, io ProcessIO) (Created, error) {
	f.record("exec %s %s", id, execID)
	p := f.newProc(id, ps.Args, io)
	master, err := f.run(p)
	if err != nil {
		return Created{}, err
	}
	close(p.start)
	f.mu.Lock()
	early := f.exitEarly
	f.mu.Unlock()
	if early {
		time.Sleep(20 * time.Millisecond)
	}
	return Created{Pid: p.pid, Console: master}, nil
}

func (f *fakeRuntime) Kill(ctx context.Context, id string, sig syscall.Signal, all bool) error {
	f.record("kill %s %d %v", id, sig, all)
	f.mu.Lock()
	var targets []*fakeProc
	for _, p := range f.procs {
		if p.cid == id && (all || p == f.inits[id]) {
			targets = append(targets, p)
		}
	}
	f.mu.Unlock()
	if !f.killSpares {
		for _, p := range targets {
			p.signal(sig)
		}
	}
	return f.killRefusal
}

func (p *fakeProc) signal(sig syscall.Signal) {
	p.once.Do(func() { p.kill <- sig })
}

func (f *fakeRuntime) Signal(pid int, sig syscall.Signal) error {
	f.record("signal %d %d", pid, sig)
	f.mu.Lock()
	p, ok := f.procs[pid]
	f.mu.Unlock()
	if !ok {
		return syscall.ESRCH
	}
	p.signal(sig)
	return nil
}

func (f *fakeRuntime) Delete(ctx context.Context, id string, force bool) error {
	f.record("delete %s %v", id, force)
	if force {
		return f.Kill(ctx, id, syscall.SIGKILL, true)
	}
	return nil
}

func (f *fakeRuntime) Pause(ctx context.Context, id string) error {
	f.record("pause %s", id)
	return nil
}
func (f *fakeRuntime) Resume(ctx context.Context, id string) error {
	f.record("resume %s", id)
	return nil
}
func (f *fakeRuntime) Update(ctx context.Context, id string, r *specs.LinuxResources) error {
	f.record("update %s %d", id, *r.Pids.Limit)
	return nil
}

// fakeCgroups answers fixed metrics and lets the test trigger OOM kills.
type fakeCgroups struct {
	mu     sync.Mutex
	onOOM  map[string]func() // guarded by mu
	groups []string          // guarded by mu
}

func (g *fakeCgroups) Stats(group string) (*stats.Metrics, error) {
	return &stats.Metrics{Pids: &stats.PidsStat{Current: 2}, Memory: &stats.MemoryStat{Usage: 4096}}, nil
}

func (g *fakeCgroups) WatchOOM(ctx context.Context, group string, onOOM func()) {
	g.mu.Lock()
	g.onOOM[group] = onOOM
	g.groups = append(g.groups, group)
	g.mu.Unlock()
	<-ctx.Done()
}

func (g *fakeCgroups) oom(t *testing.T, group string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		g.mu.Lock()
		f := g.onOOM[group]
		g.mu.Unlock()
		if f != nil {
			f()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nobody watches cgroup %s", group)
		}
		time.Sleep(time.Millisecond)
	}
}

type fixture struct {
	svc  *Service
	rt   *fakeRuntime
	cg   *fakeCgroups
	root string
	ctx  context.Context
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	rt := newFakeRuntime()
	cg := &fakeCgroups{onOOM: map[string]func(){}}
	root := t.TempDir()
	log := logrus.New()
	log.SetOutput(io.Discard)
	svc, err := NewService(Config{Runtime: rt, Cgroups: cg, StateDir: t.TempDir(), RootDir: root, Version: "test",
		PodTmpfsDir: t.TempDir(), MirrorDir: t.TempDir(), Log: logrus.NewEntry(log), OutputGrace: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	rt.svc = svc
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return &fixture{svc: svc, rt: rt, cg: cg, root: root, ctx: ctx}
}

// shutdown calls Shutdown and checks that Done is closed when it answers.
func (fx *fixture) shutdown(t *testing.T) {
	t.Helper()
	if _, err := fx.svc.Shutdown(fx.ctx, &apiv1.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-fx.svc.Done():
	default:
		t.Fatal("Done not closed after Shutdown")
	}
}

// bundleSpec is the spec the service wrote in container id's bundle for runc.
func (fx *fixture) bundleSpec(t *testing.T, id string) specs.Spec {
	t.Helper()
	fx.rt.mu.Lock()
	bundle := fx.rt.bundles[id]
	fx.rt.mu.Unlock()
	data, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	var got specs.Spec
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	return got
}

func (fx *fixture) spec(id string, args ...string) []byte {
	b, _ := json.Marshal(&specs.Spec{
		Version: specs.Version,
		Process: &specs.Process{Args: args, Cwd: "/"},
		Root:    &specs.Root{Path: fx.root + "/" + id},
		Linux:   &specs.Linux{},
	})
	return b
}

func (fx *fixture) create(t *testing.T, id string, stdio *apiv1.Stdio, args ...string) uint32 {
	t.Helper()
	r, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: fx.spec(id, args...), Stdio: stdio})
	if err != nil {
		t.Fatalf("create %s: %v", id, err)
	}
	return r.Pid
}

func (fx *fixture) start(t *testing.T, cid, eid string) uint32 {
	t.Helper()
	r, err := fx.svc.StartProcess(fx.ctx, &apiv1.StartProcessRequest{ContainerId: cid, ExecId: eid})
	if err != nil {
		t.Fatalf("start %s/%s: %v", cid, eid, err)
	}
	return r.Pid
}

func (fx *fixture) wait(t *testing.T, cid, eid string) *apiv1.WaitProcessResponse {
	t.Helper()
	r, err := fx.svc.WaitProcess(fx.ctx, &apiv1.WaitProcessRequest{ContainerId: cid, ExecId: eid})
	if err != nil {
		t.Fatalf("wait %s/%s: %v", cid, eid, err)
	}
	return r
}

func (fx *fixture) readAll(t *testing.T, stderr bool, cid, eid string) string {
	t.Helper()
	read := fx.svc.ReadStdout
	if stderr {
		read = fx.svc.ReadStderr
	}
	var b bytes.Buffer
	for {
		r, err := read(fx.ctx, &apiv1.ReadStreamRequest{ContainerId: cid, ExecId: eid, Max: 3})
		if err != nil {
			t.Fatalf("read %s/%s: %v", cid, eid, err)
		}
		if len(r.Data) > 3 {
			t.Fatalf("read answered %d bytes, more than max 3", len(r.Data))
		}
		if r.Eof && len(r.Data) > 0 {
			t.Fatalf("eof with data")
		}
		b.Write(r.Data)
		if r.Eof {
			return b.String()
		}
	}
}

func wantCode(t *testing.T, what string, err error, code codes.Code, substr string) {
	t.Helper()
	err = rpcedge.Status(err) // as the agent's edge answers it
	if status.Code(err) != code {
		t.Errorf("%s: %v, want %s", what, err, code)
		return
	}
	if substr != "" && !strings.Contains(status.Convert(err).Message(), substr) {
		t.Errorf("%s: %q does not say %q", what, status.Convert(err).Message(), substr)
	}
}

var outErr = &apiv1.Stdio{Stdout: true, Stderr: true}

func TestOutputThenExit(t *testing.T) {
	fx := newFixture(t)
	pid := fx.create(t, "c", outErr, "echo", "hello world\n", "oops\n", "3")
	if got := fx.start(t, "c", ""); got != pid {
		t.Errorf("start answered pid %d, create %d", got, pid)
	}
	w := fx.wait(t, "c", "")
	if w.ExitStatus != 3 || w.Pid != pid || w.ExitedAt.AsTime().IsZero() {
		t.Errorf("wait: %+v", w)
	}
	// Everything written is still there after the exit, then eof.
	if out := fx.readAll(t, false, "c", ""); out != "hello world\n" {
		t.Errorf("stdout %q", out)
	}
	if out := fx.readAll(t, true, "c", ""); out != "oops\n" {
		t.Errorf("stderr %q", out)
	}
	// A second wait answers the same.
	if w2 := fx.wait(t, "c", ""); w2.ExitStatus != 3 {
		t.Errorf("second wait %+v", w2)
	}
	if _, err := fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(fx.svc.cfg.StateDir, "c")); !os.IsNotExist(err) {
		t.Errorf("bundle left: %v", err)
	}
	_, err := fx.svc.WaitProcess(fx.ctx, &apiv1.WaitProcessRequest{ContainerId: "c"})
	wantCode(t, "wait after delete", err, codes.NotFound, `"c"`)
}

func TestStreamNotAskedForIsDevNull(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", &apiv1.Stdio{Stderr: true}, "echo", "to null", "to host", "0")
	fx.start(t, "c", "")
	fx.wait(t, "c", "")
	if out := fx.readAll(t, false, "c", ""); out != "" {
		t.Errorf("stdout not asked for answered %q", out)
	}
	if out := fx.readAll(t, true, "c", ""); out != "to host" {
		t.Errorf("stderr %q", out)
	}
	_, err := fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", Data: []byte("x")})
	wantCode(t, "stdin not asked for", err, codes.FailedPrecondition, "without stdin")
}

func TestStateRules(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	_, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: "c", Spec: fx.spec("c", "sleep")})
	wantCode(t, "create twice", err, codes.AlreadyExists, "")
	_, err = fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e", Process: []byte(`{"args":["cat"]}`)})
	wantCode(t, "exec into a created container", err, codes.FailedPrecondition, "not running")
	fx.start(t, "c", "")
	_, err = fx.svc.StartProcess(fx.ctx, &apiv1.StartProcessRequest{ContainerId: "c"})
	wantCode(t, "start twice", err, codes.FailedPrecondition, "running, not created")
	_, err = fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c"})
	wantCode(t, "delete while running", err, codes.FailedPrecondition, "running")
	_, err = fx.svc.ResumeContainer(fx.ctx, &apiv1.ResumeContainerRequest{ContainerId: "c"})
	wantCode(t, "resume a running container", err, codes.FailedPrecondition, "not paused")
	if _, err := fx.svc.PauseContainer(fx.ctx, &apiv1.PauseContainerRequest{ContainerId: "c"}); err != nil {
		t.Fatal(err)
	}
	_, err = fx.svc.PauseContainer(fx.ctx, &apiv1.PauseContainerRequest{ContainerId: "c"})
	wantCode(t, "pause twice", err, codes.FailedPrecondition, "already paused")
	if _, err := fx.svc.ResumeContainer(fx.ctx, &apiv1.ResumeContainerRequest{ContainerId: "c"}); err != nil {
		t.Fatal(err)
	}

	// An exec that runs keeps the container from being deleted once its init is gone.
	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e", Process: []byte(`{"args":["sleep"]}`)}); err != nil {
		t.Fatal(err)
	}
	_, err = fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e", Process: []byte(`{"args":["sleep"]}`)})
	wantCode(t, "exec id twice", err, codes.AlreadyExists, "")
	_, err = fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", ExecId: "e", Signal: 15})
	wantCode(t, "signal a created exec", err, codes.FailedPrecondition, "not started")
	fx.start(t, "c", "e")
	if _, err := fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", Signal: 9}); err != nil {
		t.Fatal(err)
	}
	if w := fx.wait(t, "c", ""); w.ExitStatus != 137 {
		t.Errorf("init exit %d", w.ExitStatus)
	}
	_, err = fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c"})
	wantCode(t, "delete with an exec running", err, codes.FailedPrecondition, `process "e"`)
	_, err = fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c", ExecId: "e"})
	wantCode(t, "delete a running exec", err, codes.FailedPrecondition, "running")
	_, err = fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", Signal: 9})
	wantCode(t, "signal an exited init", err, codes.NotFound, "exited")
	if _, err := fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", ExecId: "e", Signal: 15}); err != nil {
		t.Fatal(err)
	}
	if w := fx.wait(t, "c", "e"); w.ExitStatus != 128+15 {
		t.Errorf("exec exit %d", w.ExitStatus)
	}
	if _, err := fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c", ExecId: "e"}); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c"}); err != nil {
		t.Fatal(err)
	}
}

// TestDeleteUnstartedExec: an exec deleted before its start wakes its waiters and readers.
func TestDeleteUnstartedExec(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e",
		Process: []byte(`{"args":["cat"]}`), Stdio: &apiv1.Stdio{Terminal: true, Stdout: true}}); err != nil {
		t.Fatal(err)
	}
	waited := make(chan uint32, 1)
	read := make(chan bool, 1)
	go func() {
		w, err := fx.svc.WaitProcess(fx.ctx, &apiv1.WaitProcessRequest{ContainerId: "c", ExecId: "e"})
		if err != nil {
			t.Error(err)
		}
		waited <- w.GetExitStatus()
	}()
	go func() {
		r, err := fx.svc.ReadStdout(fx.ctx, &apiv1.ReadStreamRequest{ContainerId: "c", ExecId: "e", Max: 10})
		if err != nil {
			t.Error(err)
		}
		read <- r.GetEof()
	}()
	time.Sleep(50 * time.Millisecond)
	if _, err := fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c", ExecId: "e"}); err != nil {
		t.Fatal(err)
	}
	if st := <-waited; st != 255 {
		t.Errorf("wait of a deleted unstarted exec: %d, want 255", st)
	}
	if eof := <-read; !eof {
		t.Error("read of a deleted unstarted exec: no eof")
	}
}

func TestDeleteCreatedForces(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	if _, err := fx.svc.DeleteProcess(fx.ctx, &apiv1.DeleteProcessRequest{ContainerId: "c"}); err != nil {
		t.Fatal(err)
	}
	fx.rt.mu.Lock()
	calls := strings.Join(fx.rt.calls, "; ")
	fx.rt.mu.Unlock()
	if !strings.Contains(calls, "delete c true") {
		t.Errorf("runtime calls %q: want a forced delete", calls)
	}
}

// TestKillOfAnExitingInit: runc refuses to signal an init that has exited but is not reaped
// yet; once the reaper reports the exit, the kill answers NotFound (containerd's "already
// finished"), not runc's error. A refusal with the init still running stays an error.
func TestKillOfAnExitingInit(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	fx.rt.killRefusal = errors.New("runc did not terminate successfully: exit status 1: container not running")
	_, err := fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", Signal: 9})
	wantCode(t, "kill of an init that exits as runc refuses", err, codes.NotFound, "exited")
	if w := fx.wait(t, "c", ""); w.ExitStatus != 137 {
		t.Errorf("init exit %d, want 137", w.ExitStatus)
	}

	fx.create(t, "d", nil, "sleep")
	fx.start(t, "d", "")
	fx.rt.killSpares = true
	_, err = fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "d", Signal: 9})
	wantCode(t, "a refused kill of a running init", err, codes.Internal, "container not running")
}

// TestGuestHooksKept: the container-namespace hooks reach runc's bundle as they were sent.
func TestGuestHooksKept(t *testing.T) {
	fx := newFixture(t)
	want := &specs.Hooks{
		CreateContainer: []specs.Hook{{Path: "/bin/sh", Args: []string{"sh", "-c", "true"}, Env: []string{"A=1"}}},
		StartContainer:  []specs.Hook{{Path: "/bin/true"}},
	}
	b, _ := json.Marshal(&specs.Spec{Version: specs.Version, Process: &specs.Process{Args: []string{"sleep"}, Cwd: "/"},
		Root: &specs.Root{Path: fx.root + "/c"}, Linux: &specs.Linux{}, Hooks: want})
	if _, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: "c", Spec: b}); err != nil {
		t.Fatal(err)
	}
	if got := fx.bundleSpec(t, "c"); !reflect.DeepEqual(got.Hooks, want) {
		t.Errorf("hooks in runc's bundle %+v, want %+v", got.Hooks, want)
	}
}

func TestNotFoundAndInvalid(t *testing.T) {
	fx := newFixture(t)
	ctx := fx.ctx
	_, err := fx.svc.StartProcess(ctx, &apiv1.StartProcessRequest{ContainerId: "nope"})
	wantCode(t, "start unknown", err, codes.NotFound, `"nope"`)
	_, err = fx.svc.WaitProcess(ctx, &apiv1.WaitProcessRequest{ContainerId: "nope"})
	wantCode(t, "wait unknown", err, codes.NotFound, "")
	_, err = fx.svc.Stats(ctx, &apiv1.StatsRequest{ContainerId: "nope"})
	wantCode(t, "stats unknown", err, codes.NotFound, "")
	fx.create(t, "c", nil, "sleep")
	_, err = fx.svc.ReadStdout(ctx, &apiv1.ReadStreamRequest{ContainerId: "c", ExecId: "x", Max: 10})
	wantCode(t, "read unknown exec", err, codes.NotFound, `"x"`)
	_, err = fx.svc.ReadStdout(ctx, &apiv1.ReadStreamRequest{ContainerId: "c", Max: MaxRead + 1})
	wantCode(t, "read more than 1 MiB", err, codes.InvalidArgument, "max")
	_, err = fx.svc.ReadStdout(ctx, &apiv1.ReadStreamRequest{ContainerId: "c"})
	wantCode(t, "read max 0", err, codes.InvalidArgument, "max")
	_, err = fx.svc.ResizePty(ctx, &apiv1.ResizePtyRequest{ContainerId: "c", Width: 80, Height: 24})
	wantCode(t, "resize without a terminal", err, codes.FailedPrecondition, "no terminal")

	for _, id := range []string{"", "a/b", "..", ".", "-rf", "x\n", strings.Repeat("a", 256)} {
		_, err := fx.svc.CreateContainer(ctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: fx.spec("ok", "sleep")})
		wantCode(t, fmt.Sprintf("container id %q", id), err, codes.InvalidArgument, "container_id")
	}
	_, err = fx.svc.WaitProcess(ctx, &apiv1.WaitProcessRequest{ContainerId: "c", ExecId: "../x"})
	wantCode(t, "exec id with a slash", err, codes.InvalidArgument, "exec_id")

	specs := []struct{ spec, want string }{
		{`{"process":`, "unexpected end of JSON input"},
		{`{"process":{"args":"sh"}}`, "process.args"},
		{`{"root":{"path":"/x"}}`, "process is missing"},
		{`{"process":{"args":[]},"root":{"path":"/x"},"linux":{}}`, "process.args is empty"},
		{`{"process":{"args":["sh"]},"linux":{}}`, "root.path is missing"},
		{`{"process":{"args":["sh"]},"root":{"path":"/etc"},"linux":{}}`, "not below"},
		{`{"process":{"args":["sh"]},"root":{"path":"` + fx.root + `/../etc"},"linux":{}}`, "not below"},
		{`{"process":{"args":["sh"]},"root":{"path":"` + fx.root + `/r"}}`, "linux is missing"},
		{`{"process":{"args":["sh"]},"root":{"path":"` + fx.root + `/r"},"linux":{},"hooks":{"prestart":[{"path":"/x"}]}}`, "hooks run on the host"},
		{`{"process":{"args":["sh"]},"root":{"path":"` + fx.root + `/r"},"linux":{},"hooks":{"startContainer":[{"path":"/x"}],"poststop":[{"path":"/x"}]}}`, "hooks run on the host"},
		{`{"process":{"args":["sh"]},"root":{"path":"` + fx.root + `/r"},"linux":{"cgroupsPath":"system.slice:x:y"}}`, "cgroupsPath"},
	}
	for _, s := range specs {
		_, err := fx.svc.CreateContainer(ctx, &apiv1.CreateContainerRequest{ContainerId: "bad", Spec: []byte(s.spec)})
		wantCode(t, "spec "+s.spec, err, codes.InvalidArgument, s.want)
	}
	_, err = fx.svc.StartProcess(ctx, &apiv1.StartProcessRequest{ContainerId: "bad"})
	wantCode(t, "a refused container is not kept", err, codes.NotFound, "")
	fx.start(t, "c", "")
	_, err = fx.svc.ExecProcess(ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e", Process: []byte(`{"args":`)})
	wantCode(t, "bad process JSON", err, codes.InvalidArgument, "process:")
	_, err = fx.svc.UpdateContainer(ctx, &apiv1.UpdateContainerRequest{ContainerId: "c", Resources: []byte(`{"pids":{"limit":"x"}}`)})
	wantCode(t, "bad resources", err, codes.InvalidArgument, "resources:")
	_, err = fx.svc.SignalProcess(ctx, &apiv1.SignalProcessRequest{ContainerId: "c", Signal: 0})
	wantCode(t, "signal 0", err, codes.InvalidArgument, "signal")
}

func TestCreateFailureLeavesNothing(t *testing.T) {
	fx := newFixture(t)
	_, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: "c", Spec: fx.spec("c", "fail")})
	wantCode(t, "runc create failing", err, codes.Internal, "runc create")
	if _, err := os.Stat(filepath.Join(fx.svc.cfg.StateDir, "c")); !os.IsNotExist(err) {
		t.Errorf("bundle left: %v", err)
	}
	// The id is free again.
	fx.create(t, "c", nil, "sleep")
}

func TestStdinAndExec(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	_, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "cat",
		Process: []byte(`{"args":["cat"]}`), Stdio: &apiv1.Stdio{Stdin: true, Stdout: true}})
	if err != nil {
		t.Fatal(err)
	}
	// Stdin written before the start waits in the pipe.
	if _, err := fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", ExecId: "cat", Data: []byte("one ")}); err != nil {
		t.Fatal(err)
	}
	fx.start(t, "c", "cat")
	if _, err := fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", ExecId: "cat", Data: []byte("two")}); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.svc.CloseStdin(fx.ctx, &apiv1.CloseStdinRequest{ContainerId: "c", ExecId: "cat"}); err != nil {
		t.Fatal(err)
	}
	_, err = fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", ExecId: "cat", Data: []byte("three")})
	wantCode(t, "write after close", err, codes.FailedPrecondition, "closed")
	if out := fx.readAll(t, false, "c", "cat"); out != "one two" {
		t.Errorf("cat answered %q", out)
	}
	if w := fx.wait(t, "c", "cat"); w.ExitStatus != 0 {
		t.Errorf("cat exit %d", w.ExitStatus)
	}
}

func TestExitBeforePidIsKnown(t *testing.T) {
	fx := newFixture(t)
	fx.rt.exitEarly = true
	fx.create(t, "c", nil, "sleep")
	if w := fx.wait(t, "c", ""); w.ExitStatus != 137 {
		t.Errorf("init exit %d", w.ExitStatus)
	}
	fx.rt.exitEarly = false
	fx.create(t, "d", nil, "sleep")
	fx.start(t, "d", "")
	fx.rt.mu.Lock()
	fx.rt.exitEarly = true
	fx.rt.mu.Unlock()
	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "d", ExecId: "e",
		Process: []byte(`{"args":["echo","","","5"]}`)}); err != nil {
		t.Fatal(err)
	}
	fx.start(t, "d", "e")
	if w := fx.wait(t, "d", "e"); w.ExitStatus != 5 {
		t.Errorf("exec exit %d", w.ExitStatus)
	}
}

func TestKillAllAndShutdown(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	for _, e := range []string{"e1", "e2"} {
		if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: e, Process: []byte(`{"args":["sleep"]}`)}); err != nil {
			t.Fatal(err)
		}
		fx.start(t, "c", e)
	}
	if _, err := fx.svc.SignalProcess(fx.ctx, &apiv1.SignalProcessRequest{ContainerId: "c", Signal: 9, All: true}); err != nil {
		t.Fatal(err)
	}
	for _, e := range []string{"", "e1", "e2"} {
		if w := fx.wait(t, "c", e); w.ExitStatus != 137 {
			t.Errorf("%q exit %d", e, w.ExitStatus)
		}
	}

	fx.create(t, "d", nil, "sleep")
	fx.start(t, "d", "")
	waited := make(chan error, 1)
	go func() {
		_, err := fx.svc.GetOOMEvent(fx.ctx, &apiv1.GetOOMEventRequest{})
		waited <- err
	}()
	fx.shutdown(t)
	wantCode(t, "GetOOMEvent across Shutdown", <-waited, codes.Unavailable, "")
	_, err := fx.svc.Ping(fx.ctx, &apiv1.PingRequest{})
	wantCode(t, "ping after shutdown", err, codes.Unavailable, "")
	_, err = fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: "e", Spec: fx.spec("e", "sleep")})
	wantCode(t, "create after shutdown", err, codes.Unavailable, "")
	fx.rt.mu.Lock()
	calls := strings.Join(fx.rt.calls, "; ")
	left := len(fx.rt.procs)
	fx.rt.mu.Unlock()
	if !strings.Contains(calls, "kill d 9 true") || !strings.Contains(calls, "delete d true") || left != 0 {
		t.Errorf("after shutdown: calls %q, %d processes left", calls, left)
	}
}

// TestShutdownKillAll: an agent that powers the machine off after Shutdown (Config.KillAll:
// PID 1's kill(-1)) ends the containers with one kill of every process, paused ones too, and
// runs the runtime for none of them; Done closes once their inits have exited.
func TestShutdownKillAll(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "a", nil, "sleep")
	fx.start(t, "a", "")
	fx.create(t, "b", nil, "sleep") // created, never started
	fx.create(t, "p", nil, "sleep")
	fx.start(t, "p", "")
	if _, err := fx.svc.PauseContainer(fx.ctx, &apiv1.PauseContainerRequest{ContainerId: "p"}); err != nil {
		t.Fatal(err)
	}
	killed := 0
	fx.svc.cfg.KillAll = func() error {
		fx.rt.mu.Lock()
		defer fx.rt.mu.Unlock()
		for _, p := range fx.rt.procs {
			p.signal(syscall.SIGKILL)
			killed++
		}
		return nil
	}
	fx.rt.mu.Lock()
	before := len(fx.rt.calls)
	fx.rt.mu.Unlock()
	fx.shutdown(t)
	if killed != 3 {
		t.Errorf("KillAll killed %d processes, want the 3 inits", killed)
	}
	fx.rt.mu.Lock()
	calls, left := fx.rt.calls[before:], len(fx.rt.procs)
	fx.rt.mu.Unlock()
	if len(calls) != 0 || left != 0 {
		t.Errorf("after shutdown: runtime calls %q, %d processes left", calls, left)
	}
	for _, id := range []string{"a", "b", "p"} {
		fx.svc.mu.Lock()
		c := fx.svc.containers[id]
		fx.svc.mu.Unlock()
		select {
		case <-c.init.exited:
		default:
			t.Errorf("container %s's init has not exited when Shutdown answers", id)
		}
	}
}

func TestOOMQueue(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "a", nil, "sleep")
	fx.create(t, "b", nil, "sleep")
	// Events that happen while nobody waits are kept, in order.
	fx.cg.oom(t, "/kvfs/a")
	fx.cg.oom(t, "/kvfs/b")
	fx.cg.oom(t, "/kvfs/a")
	for _, want := range []string{"a", "b", "a"} {
		r, err := fx.svc.GetOOMEvent(fx.ctx, &apiv1.GetOOMEventRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if r.ContainerId != want {
			t.Errorf("OOM event for %q, want %q", r.ContainerId, want)
		}
	}
	ctx, cancel := context.WithTimeout(fx.ctx, 50*time.Millisecond)
	defer cancel()
	_, err := fx.svc.GetOOMEvent(ctx, &apiv1.GetOOMEventRequest{})
	if err != context.DeadlineExceeded {
		t.Errorf("with no event: %v", err)
	}
	// The queue is bounded: what does not fit is dropped, not blocking the watcher.
	for i := 0; i < oomQueueLen+10; i++ {
		fx.cg.oom(t, "/kvfs/a")
	}
	if n := len(fx.svc.oom); n != oomQueueLen {
		t.Errorf("queue holds %d events, want %d", n, oomQueueLen)
	}
}

func TestStatsAndUpdate(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	r, err := fx.svc.Stats(fx.ctx, &apiv1.StatsRequest{ContainerId: "c"})
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(r.Stats)
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := v.(*stats.Metrics); !ok || m.Pids.Current != 2 {
		t.Errorf("stats decode to %T %v (%s)", v, v, r.Stats.TypeUrl)
	}
	if _, err := fx.svc.UpdateContainer(fx.ctx, &apiv1.UpdateContainerRequest{ContainerId: "c", Resources: []byte(`{"pids":{"limit":42}}`)}); err != nil {
		t.Fatal(err)
	}
	fx.rt.mu.Lock()
	calls := strings.Join(fx.rt.calls, "; ")
	fx.rt.mu.Unlock()
	if !strings.Contains(calls, "update c 42") {
		t.Errorf("calls %q", calls)
	}
}

// TestConcurrent runs many containers' lives at once (run it with -race).
func TestConcurrent(t *testing.T) {
	fx := newFixture(t)
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			id := fmt.Sprintf("c%d", i)
			ctx := fx.ctx
			svc := fx.svc
			if _, err := svc.CreateContainer(ctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: fx.spec(id, "sleep"), Stdio: outErr}); err != nil {
				errs <- err
				return
			}
			if _, err := svc.StartProcess(ctx, &apiv1.StartProcessRequest{ContainerId: id}); err != nil {
				errs <- err
				return
			}
			for j := 0; j < 3; j++ {
				eid := fmt.Sprintf("e%d", j)
				proc := fmt.Sprintf(`{"args":["echo","%s-%s","","%d"]}`, id, eid, j)
				if _, err := svc.ExecProcess(ctx, &apiv1.ExecProcessRequest{ContainerId: id, ExecId: eid, Process: []byte(proc), Stdio: outErr}); err != nil {
					errs <- err
					return
				}
				if _, err := svc.StartProcess(ctx, &apiv1.StartProcessRequest{ContainerId: id, ExecId: eid}); err != nil {
					errs <- err
					return
				}
			}
			for j := 0; j < 3; j++ {
				eid := fmt.Sprintf("e%d", j)
				r, err := svc.ReadStdout(ctx, &apiv1.ReadStreamRequest{ContainerId: id, ExecId: eid, Max: 100})
				if err != nil || string(r.Data) != id+"-"+eid {
					errs <- fmt.Errorf("%s/%s stdout %q %v", id, eid, r.GetData(), err)
					return
				}
				w, err := svc.WaitProcess(ctx, &apiv1.WaitProcessRequest{ContainerId: id, ExecId: eid})
				if err != nil || w.ExitStatus != uint32(j) {
					errs <- fmt.Errorf("%s/%s wait %v %v", id, eid, w, err)
					return
				}
				if _, err := svc.DeleteProcess(ctx, &apiv1.DeleteProcessRequest{ContainerId: id, ExecId: eid}); err != nil {
					errs <- err
					return
				}
			}
			if _, err := svc.SignalProcess(ctx, &apiv1.SignalProcessRequest{ContainerId: id, Signal: 9}); err != nil {
				errs <- err
				return
			}
			if _, err := svc.WaitProcess(ctx, &apiv1.WaitProcessRequest{ContainerId: id}); err != nil {
				errs <- err
				return
			}
			if _, err := svc.DeleteProcess(ctx, &apiv1.DeleteProcessRequest{ContainerId: id}); err != nil {
				errs <- err
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	fx.svc.mu.Lock()
	n := len(fx.svc.containers)
	fx.svc.mu.Unlock()
	if n != 0 {
		t.Errorf("%d containers left", n)
	}
}

// TestTerminal: a terminal exec's output comes from its pty, stderr ends at once, ResizePty
// sets the size its process reads, and CloseStdin is end of file at the terminal.
func TestTerminal(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	tty := &apiv1.Stdio{Terminal: true, Stdin: true, Stdout: true, Stderr: true}
	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "size", Process: []byte(`{"args":["size"]}`), Stdio: tty}); err != nil {
		t.Fatal(err)
	}
	_, err := fx.svc.ResizePty(fx.ctx, &apiv1.ResizePtyRequest{ContainerId: "c", ExecId: "size", Width: 100, Height: 30})
	wantCode(t, "resize before start", err, codes.FailedPrecondition, "not started")
	fx.start(t, "c", "size")
	if out := fx.readAll(t, true, "c", "size"); out != "" {
		t.Errorf("a terminal's stderr answered %q", out)
	}
	if _, err := fx.svc.ResizePty(fx.ctx, &apiv1.ResizePtyRequest{ContainerId: "c", ExecId: "size", Width: 100, Height: 30}); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", ExecId: "size", Data: []byte("go\n")}); err != nil {
		t.Fatal(err)
	}
	if out := fx.readAll(t, false, "c", "size"); !strings.Contains(out, "size 30 100") {
		t.Errorf("terminal output %q does not have the size 30 100", out)
	}
	if w := fx.wait(t, "c", "size"); w.ExitStatus != 0 {
		t.Errorf("size exit %d", w.ExitStatus)
	}

	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "cat", Process: []byte(`{"args":["cat"]}`), Stdio: tty}); err != nil {
		t.Fatal(err)
	}
	fx.start(t, "c", "cat")
	if _, err := fx.svc.WriteStdin(fx.ctx, &apiv1.WriteStdinRequest{ContainerId: "c", ExecId: "cat", Data: []byte("typed\n")}); err != nil {
		t.Fatal(err)
	}
	if _, err := fx.svc.CloseStdin(fx.ctx, &apiv1.CloseStdinRequest{ContainerId: "c", ExecId: "cat"}); err != nil {
		t.Fatal(err)
	}
	if out := fx.readAll(t, false, "c", "cat"); strings.Count(out, "typed") != 2 {
		t.Errorf("cat on a terminal answered %q: want the echo and the copy", out)
	}
	if w := fx.wait(t, "c", "cat"); w.ExitStatus != 0 {
		t.Errorf("cat exit %d", w.ExitStatus)
	}
}

// TestOutputOfAnExitedProcessEnds: a child left behind with the process's stdout does not
// keep the stream open for ever; what was written before is still read, then eof.
func TestOutputOfAnExitedProcessEnds(t *testing.T) {
	fx := newFixture(t)
	fx.create(t, "c", nil, "sleep")
	fx.start(t, "c", "")
	if _, err := fx.svc.ExecProcess(fx.ctx, &apiv1.ExecProcessRequest{ContainerId: "c", ExecId: "e",
		Process: []byte(`{"args":["orphan"]}`), Stdio: outErr}); err != nil {
		t.Fatal(err)
	}
	fx.start(t, "c", "e")
	start := time.Now()
	if out := fx.readAll(t, false, "c", "e"); out != "before the exit" {
		t.Errorf("stdout %q", out)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("eof came after %v", d)
	}
	if out := fx.readAll(t, true, "c", "e"); out != "" {
		t.Errorf("stderr %q", out)
	}
}

// TestPingTimes: Ping answers when the agent started (Config.Started) and the guest's uptime,
// both CLOCK_BOOTTIME: the shim splits a pod's boot with them.
func TestPingTimes(t *testing.T) {
	started := BootTime()
	if started <= 0 {
		t.Fatalf("BootTime() = %v, want > 0", started)
	}
	svc, err := NewService(Config{Runtime: newFakeRuntime(), Cgroups: &fakeCgroups{onOOM: map[string]func(){}},
		StateDir: t.TempDir(), RootDir: t.TempDir(), Started: started})
	if err != nil {
		t.Fatal(err)
	}
	r, err := svc.Ping(context.Background(), &apiv1.PingRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got := time.Duration(r.GetInitStartedNs()); got != started {
		t.Errorf("init_started_ns = %v, want %v", got, started)
	}
	if up := time.Duration(r.GetUptimeNs()); up < started || up > BootTime() {
		t.Errorf("uptime_ns = %v, want between %v and now (%v)", up, started, BootTime())
	}
}

// TestPodPIDNamespace: a spec naming the pod's shared PID namespace reaches runc's bundle with
// a path to one namespace, not the agent's, the same for every container; its init is
// started once.
func TestPodPIDNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (a new PID namespace)")
	}
	fx := newFixture(t)
	dir := t.TempDir()
	starts := filepath.Join(dir, "starts")
	init := filepath.Join(dir, "init")
	if err := os.WriteFile(init, []byte("#!/bin/sh\necho started >>"+starts+"\nexec sleep 5\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	fx.svc.podNS.init = init
	var paths []string
	for _, id := range []string{"a", "b"} {
		b, _ := json.Marshal(&specs.Spec{Version: specs.Version, Process: &specs.Process{Args: []string{"sleep"}, Cwd: "/"},
			Root: &specs.Root{Path: fx.root + "/" + id}, Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace, Path: apiv1.PodPIDNamespace}, {Type: specs.MountNamespace}}}})
		if _, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: b}); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, fx.bundleSpec(t, id).Linux.Namespaces[0].Path)
	}
	if paths[0] != paths[1] || !strings.HasPrefix(paths[0], fmt.Sprintf("/proc/%d/fd/", os.Getpid())) {
		t.Fatalf("the containers' PID namespace paths %q: want one /proc/<agent>/fd/N", paths)
	}
	ns, err := os.Readlink(paths[0])
	own, _ := os.Readlink("/proc/self/ns/pid")
	if err != nil || !strings.HasPrefix(ns, "pid:[") || ns == own {
		t.Errorf("the pod's PID namespace %q, %v; the agent's %q", ns, err, own)
	}
	// The init's shell makes the file (>>) before it writes the line: wait for the line.
	b, err := os.ReadFile(starts)
	for deadline := time.Now().Add(5 * time.Second); (err != nil || !bytes.HasSuffix(b, []byte("\n"))) && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, err = os.ReadFile(starts)
	}
	if err != nil || string(b) != "started\n" {
		t.Errorf("the namespace's init started: %q, %v; want once", b, err)
	}
}

// TestPodUserNamespace: a spec naming the pod's user namespace reaches runc's bundle with a
// path to one user namespace, not the agent's, mapped as the spec says, the same for every
// container, and the pod's PID namespace is made in it; a container of other mappings is
// refused, and so is a pod user namespace after the pod's PID namespace was made outside one.
func TestPodUserNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (new user and PID namespaces)")
	}
	fx := newFixture(t)
	dir := t.TempDir()
	init := filepath.Join(dir, "init")
	if err := os.WriteFile(init, []byte("#!/bin/sh\ncat /proc/self/uid_map /proc/self/gid_map /proc/self/setgroups >>"+dir+"/maps\nexec sleep 5\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	fx.svc.podNS.init = init
	mapping := []specs.LinuxIDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
	create := func(id string, m []specs.LinuxIDMapping) (specs.Spec, error) {
		b, _ := json.Marshal(&specs.Spec{Version: specs.Version, Process: &specs.Process{Args: []string{"sleep"}, Cwd: "/"},
			Root: &specs.Root{Path: fx.root + "/" + id}, Linux: &specs.Linux{UIDMappings: m, GIDMappings: m,
				Namespaces: []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: apiv1.PodPIDNamespace},
					{Type: specs.UserNamespace, Path: apiv1.PodUserNamespace}, {Type: specs.MountNamespace}}}})
		if _, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: id, Spec: b}); err != nil {
			return specs.Spec{}, err
		}
		return fx.bundleSpec(t, id), nil
	}
	var pidNS, userNS []string
	for _, id := range []string{"a", "b"} {
		s, err := create(id, mapping)
		if err != nil {
			t.Fatal(err)
		}
		pidNS, userNS = append(pidNS, s.Linux.Namespaces[0].Path), append(userNS, s.Linux.Namespaces[1].Path)
	}
	if userNS[0] != userNS[1] || pidNS[0] != pidNS[1] || !strings.HasPrefix(userNS[0], fmt.Sprintf("/proc/%d/fd/", os.Getpid())) {
		t.Fatalf("the containers' user and PID namespace paths %q %q: want one /proc/<agent>/fd/N each", userNS, pidNS)
	}
	user, err := os.Stat(userNS[0])
	own, _ := os.Readlink("/proc/self/ns/user")
	if ns, _ := os.Readlink(userNS[0]); err != nil || !strings.HasPrefix(ns, "user:[") || ns == own {
		t.Fatalf("the pod's user namespace %q, %v; the agent's %q", ns, err, own)
	}
	pfd, err := unix.Open(pidNS[0], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pfd)
	owner, err := unix.IoctlRetInt(pfd, unix.NS_GET_USERNS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(owner)
	var st unix.Stat_t
	if err := unix.Fstat(owner, &st); err != nil || st.Ino != user.Sys().(*syscall.Stat_t).Ino {
		t.Errorf("the pod's PID namespace is owned by user namespace %d (%v), not the pod's %d", st.Ino, err, user.Sys().(*syscall.Stat_t).Ino)
	}
	// The init, root of the pod's user namespace, is uid 100000 outside it.
	b, err := os.ReadFile(filepath.Join(dir, "maps"))
	for deadline := time.Now().Add(5 * time.Second); len(strings.Fields(string(b))) < 7 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, err = os.ReadFile(filepath.Join(dir, "maps"))
	}
	if got := strings.Fields(string(b)); err != nil || !slices.Equal(got, []string{"0", "100000", "65536", "0", "100000", "65536", "allow"}) {
		t.Errorf("the pod's user namespace's uid_map, gid_map and setgroups, once: %q, %v", b, err)
	}

	other := []specs.LinuxIDMapping{{ContainerID: 0, HostID: 200000, Size: 65536}}
	if _, err := create("c", other); status.Code(rpcedge.Status(err)) != codes.FailedPrecondition || !strings.Contains(err.Error(), "maps uids") {
		t.Errorf("a container of other mappings: %v, want FailedPrecondition", err)
	}

	fx2 := newFixture(t)
	fx2.svc.podNS.init = init
	if _, err := fx2.svc.podNS.PID(); err != nil {
		t.Fatal(err)
	}
	if _, err := fx2.svc.podNS.User(mapping, mapping); err == nil || !strings.Contains(err.Error(), "made without a user namespace") {
		t.Errorf("a pod user namespace after its PID namespace: %v", err)
	}
}
