package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// fakeAgent is an in-memory agent.AgentService: processes that run until the test (or a
// signal) ends them, with output the test writes. It exists only in tests.
type fakeAgent struct {
	mu         sync.Mutex
	procs      map[[2]string]*fakeProc // guarded by mu
	nextPid    uint32
	signals    []*agent.SignalProcessRequest
	paused     []string
	resumed    []string
	updates    [][]byte
	shutdowns  int
	deleted    [][2]string
	specs      map[string][]byte
	submounts  map[string][]string          // CreateContainerRequest.submounts by container
	podTmpfs   map[string][]*agent.PodTmpfs // CreateContainerRequest.pod_tmpfs by container
	mirrored   map[string][]string          // CreateContainerRequest.mirrored by container
	oom        chan string
	drainDelay time.Duration // how long after the exit the last output chunk comes
	// oversize makes ReadStdout answer this many bytes whatever was asked (a hostile guest).
	oversize int
	// statsAsked are the container ids Stats was asked for; badStats, if set, is its answer.
	statsAsked []string
	badStats   *anypb.Any
	networks   []*agent.ConfigureNetworkRequest
	// ports are the port connections OpenPort made.
	ports fakePorts
	// trace, if set, is told of each create, start and delete, and of the pod's unbinds, as
	// they come.
	trace func(call string)
}

func (a *fakeAgent) note(call string) {
	if a.trace != nil {
		a.trace(call)
	}
}

type fakeProc struct {
	stdio    *agent.Stdio
	pid      uint32
	started  bool
	stdout   *fakeStream
	stderr   *fakeStream
	stdin    []byte
	stdinEOF chan struct{}
	exited   chan struct{}
	status   uint32
	tail     []byte // written to stdout drainDelay after the exit
}

type fakeStream struct {
	mu   sync.Mutex
	data []byte
	eof  bool
	wake chan struct{}
}

func newStream() *fakeStream { return &fakeStream{wake: make(chan struct{}, 1)} }

func (s *fakeStream) write(b []byte, eof bool) {
	s.mu.Lock()
	s.data = append(s.data, b...)
	s.eof = s.eof || eof
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *fakeStream) read(ctx context.Context, max uint32) (*agent.ReadStreamResponse, error) {
	for {
		s.mu.Lock()
		if len(s.data) > 0 {
			n := min(int(max), len(s.data))
			d := slices.Clone(s.data[:n])
			s.data = s.data[n:]
			s.mu.Unlock()
			return &agent.ReadStreamResponse{Data: d}, nil
		}
		if s.eof {
			s.mu.Unlock()
			return &agent.ReadStreamResponse{Eof: true}, nil
		}
		s.mu.Unlock()
		select {
		case <-s.wake:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func newFakeAgent() *fakeAgent {
	return &fakeAgent{procs: map[[2]string]*fakeProc{}, nextPid: 100, specs: map[string][]byte{}, submounts: map[string][]string{}, podTmpfs: map[string][]*agent.PodTmpfs{}, mirrored: map[string][]string{}, oom: make(chan string, 4)}
}

func (a *fakeAgent) proc(cid, eid string) (*fakeProc, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	p := a.procs[[2]string{cid, eid}]
	if p == nil {
		return nil, fmt.Errorf("no process %s/%s: %w", cid, eid, errdefs.ErrNotFound)
	}
	return p, nil
}

func (a *fakeAgent) add(cid, eid string, st *agent.Stdio) *fakeProc {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.nextPid++
	p := &fakeProc{stdio: st, pid: a.nextPid, stdout: newStream(), stderr: newStream(), stdinEOF: make(chan struct{}), exited: make(chan struct{})}
	a.procs[[2]string{cid, eid}] = p
	return p
}

// exit ends a process with status: WaitProcess answers; its output ends (after drainDelay,
// with its tail).
func (a *fakeAgent) exit(cid, eid string, status uint32) {
	p, err := a.proc(cid, eid)
	if err != nil {
		panic(err)
	}
	a.mu.Lock()
	select {
	case <-p.exited:
		a.mu.Unlock()
		return
	default:
	}
	p.status = status
	close(p.exited)
	delay, tail := a.drainDelay, p.tail
	a.mu.Unlock()
	go func() {
		time.Sleep(delay)
		p.stdout.write(tail, true)
		p.stderr.write(nil, true)
	}()
}

func (a *fakeAgent) Ping(context.Context, *agent.PingRequest) (*agent.PingResponse, error) {
	return &agent.PingResponse{Version: "fake", Kernel: "none"}, nil
}

func (a *fakeAgent) CreateContainer(_ context.Context, r *agent.CreateContainerRequest) (*agent.CreateContainerResponse, error) {
	a.note("agent:create " + r.ContainerId)
	a.mu.Lock()
	a.specs[r.ContainerId] = r.Spec
	a.submounts[r.ContainerId] = r.Submounts
	a.podTmpfs[r.ContainerId] = r.PodTmpfs
	a.mirrored[r.ContainerId] = r.Mirrored
	a.mu.Unlock()
	p := a.add(r.ContainerId, "", r.Stdio)
	return &agent.CreateContainerResponse{Pid: p.pid}, nil
}

func (a *fakeAgent) ExecProcess(_ context.Context, r *agent.ExecProcessRequest) (*agent.ExecProcessResponse, error) {
	if _, err := a.proc(r.ContainerId, ""); err != nil {
		return nil, err
	}
	a.add(r.ContainerId, r.ExecId, r.Stdio)
	return &agent.ExecProcessResponse{}, nil
}

func (a *fakeAgent) StartProcess(_ context.Context, r *agent.StartProcessRequest) (*agent.StartProcessResponse, error) {
	a.note("agent:start " + r.ContainerId)
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if p.started {
		return nil, fmt.Errorf("started twice: %w", errdefs.ErrFailedPrecondition)
	}
	p.started = true
	return &agent.StartProcessResponse{Pid: p.pid}, nil
}

func (a *fakeAgent) SignalProcess(_ context.Context, r *agent.SignalProcessRequest) (*agent.SignalProcessResponse, error) {
	a.mu.Lock()
	a.signals = append(a.signals, &agent.SignalProcessRequest{ContainerId: r.ContainerId, ExecId: r.ExecId, Signal: r.Signal, All: r.All})
	var targets [][2]string
	for k := range a.procs {
		if k[0] == r.ContainerId && (r.All || k[1] == r.ExecId) {
			targets = append(targets, k)
		}
	}
	a.mu.Unlock()
	if r.Signal == uint32(syscall.SIGKILL) || r.Signal == uint32(syscall.SIGTERM) {
		for _, k := range targets {
			a.exit(k[0], k[1], 128+r.Signal)
		}
	}
	return &agent.SignalProcessResponse{}, nil
}

func (a *fakeAgent) WaitProcess(ctx context.Context, r *agent.WaitProcessRequest) (*agent.WaitProcessResponse, error) {
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return &agent.WaitProcessResponse{Pid: p.pid, ExitStatus: p.status, ExitedAt: timestamppb.Now()}, nil
}

func (a *fakeAgent) DeleteProcess(_ context.Context, r *agent.DeleteProcessRequest) (*agent.DeleteProcessResponse, error) {
	a.note("agent:delete " + r.ContainerId)
	if _, err := a.proc(r.ContainerId, r.ExecId); err != nil {
		return nil, err
	}
	a.mu.Lock()
	delete(a.procs, [2]string{r.ContainerId, r.ExecId})
	a.deleted = append(a.deleted, [2]string{r.ContainerId, r.ExecId})
	a.mu.Unlock()
	return &agent.DeleteProcessResponse{}, nil
}

func (a *fakeAgent) ReadStdout(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	if a.oversize > 0 {
		return &agent.ReadStreamResponse{Data: make([]byte, a.oversize)}, nil
	}
	return p.stdout.read(ctx, r.Max)
}

func (a *fakeAgent) ReadStderr(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	return p.stderr.read(ctx, r.Max)
}

func (a *fakeAgent) WriteStdin(_ context.Context, r *agent.WriteStdinRequest) (*agent.WriteStdinResponse, error) {
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	p.stdin = append(p.stdin, r.Data...)
	a.mu.Unlock()
	return &agent.WriteStdinResponse{}, nil
}

func (a *fakeAgent) CloseStdin(_ context.Context, r *agent.CloseStdinRequest) (*agent.CloseStdinResponse, error) {
	p, err := a.proc(r.ContainerId, r.ExecId)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	select {
	case <-p.stdinEOF:
	default:
		close(p.stdinEOF)
	}
	return &agent.CloseStdinResponse{}, nil
}

var resizes = make(chan *agent.ResizePtyRequest, 8)

func (a *fakeAgent) ResizePty(_ context.Context, r *agent.ResizePtyRequest) (*agent.ResizePtyResponse, error) {
	resizes <- r
	return &agent.ResizePtyResponse{}, nil
}

func (a *fakeAgent) Stats(_ context.Context, r *agent.StatsRequest) (*agent.StatsResponse, error) {
	a.mu.Lock()
	a.statsAsked = append(a.statsAsked, r.ContainerId)
	bad := a.badStats
	a.mu.Unlock()
	if bad != nil {
		return &agent.StatsResponse{Stats: bad}, nil
	}
	// The container is told by the count of its pids: the length of its id (the pod's: 0).
	v, err := typeurl.MarshalAnyToProto(&cgroupstats.Metrics{Pids: &cgroupstats.PidsStat{Current: uint64(len(r.ContainerId))}})
	if err != nil {
		return nil, err
	}
	return &agent.StatsResponse{Stats: v}, nil
}

func (a *fakeAgent) UpdateContainer(_ context.Context, r *agent.UpdateContainerRequest) (*agent.UpdateContainerResponse, error) {
	a.mu.Lock()
	a.updates = append(a.updates, r.Resources)
	a.mu.Unlock()
	return &agent.UpdateContainerResponse{}, nil
}

func (a *fakeAgent) PauseContainer(_ context.Context, r *agent.PauseContainerRequest) (*agent.PauseContainerResponse, error) {
	a.mu.Lock()
	a.paused = append(a.paused, r.ContainerId)
	a.mu.Unlock()
	return &agent.PauseContainerResponse{}, nil
}

func (a *fakeAgent) ResumeContainer(_ context.Context, r *agent.ResumeContainerRequest) (*agent.ResumeContainerResponse, error) {
	a.mu.Lock()
	a.resumed = append(a.resumed, r.ContainerId)
	a.mu.Unlock()
	return &agent.ResumeContainerResponse{}, nil
}

func (a *fakeAgent) GetOOMEvent(ctx context.Context, _ *agent.GetOOMEventRequest) (*agent.GetOOMEventResponse, error) {
	select {
	case id := <-a.oom:
		return &agent.GetOOMEventResponse{ContainerId: id}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (a *fakeAgent) ConfigureNetwork(_ context.Context, r *agent.ConfigureNetworkRequest) (*agent.ConfigureNetworkResponse, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.networks = append(a.networks, r)
	return &agent.ConfigureNetworkResponse{}, nil
}

func (a *fakeAgent) SetSysctls(_ context.Context, r *agent.SetSysctlsRequest) (*agent.SetSysctlsResponse, error) {
	return &agent.SetSysctlsResponse{}, nil
}

// fakePorts are the fake agent's port connections: real ones, to the test process's loopback,
// where the test's servers stand for the guest's.
type fakePorts struct {
	mu     sync.Mutex
	next   uint64
	open   map[uint64]*net.TCPConn // guarded by mu
	opened []uint32                // guarded by mu: the ports OpenPort was asked for
}

func (a *fakeAgent) portConn(id uint64) (*net.TCPConn, error) {
	a.ports.mu.Lock()
	defer a.ports.mu.Unlock()
	c := a.ports.open[id]
	if c == nil {
		return nil, fmt.Errorf("port connection %d: %w", id, errdefs.ErrNotFound)
	}
	return c, nil
}

// openPorts is how many port connections are open.
func (a *fakeAgent) openPorts() int {
	a.ports.mu.Lock()
	defer a.ports.mu.Unlock()
	return len(a.ports.open)
}

func (a *fakeAgent) OpenPort(ctx context.Context, r *agent.OpenPortRequest) (*agent.OpenPortResponse, error) {
	a.ports.mu.Lock()
	a.ports.opened = append(a.ports.opened, r.Port)
	a.ports.mu.Unlock()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp4", fmt.Sprintf("127.0.0.1:%d", r.Port))
	if err != nil {
		if c, err = d.DialContext(ctx, "tcp6", fmt.Sprintf("[::1]:%d", r.Port)); err != nil {
			return nil, fmt.Errorf("port %d: %v: %w", r.Port, err, errdefs.ErrUnavailable)
		}
	}
	a.ports.mu.Lock()
	defer a.ports.mu.Unlock()
	if a.ports.open == nil {
		a.ports.open = map[uint64]*net.TCPConn{}
	}
	a.ports.next++
	a.ports.open[a.ports.next] = c.(*net.TCPConn)
	return &agent.OpenPortResponse{Id: a.ports.next}, nil
}

func (a *fakeAgent) ReadPort(ctx context.Context, r *agent.ReadPortRequest) (*agent.ReadPortResponse, error) {
	c, err := a.portConn(r.Id)
	if err != nil {
		return nil, err
	}
	defer context.AfterFunc(ctx, func() { c.SetReadDeadline(time.Unix(1, 0)) })()
	b := make([]byte, r.Max)
	n, err := c.Read(b)
	switch {
	case err == nil:
		return &agent.ReadPortResponse{Data: b[:n]}, nil
	case errors.Is(err, io.EOF):
		return &agent.ReadPortResponse{Eof: true}, nil
	case ctx.Err() != nil:
		return nil, ctx.Err()
	}
	return nil, fmt.Errorf("port connection %d: %v: %w", r.Id, err, errdefs.ErrAborted)
}

func (a *fakeAgent) WritePort(_ context.Context, r *agent.WritePortRequest) (*agent.WritePortResponse, error) {
	c, err := a.portConn(r.Id)
	if err != nil {
		return nil, err
	}
	n, err := c.Write(r.Data)
	if err != nil {
		return nil, fmt.Errorf("port connection %d: %v: %w", r.Id, err, errdefs.ErrAborted)
	}
	return &agent.WritePortResponse{Written: uint32(n)}, nil
}

func (a *fakeAgent) ClosePort(_ context.Context, r *agent.ClosePortRequest) (*agent.ClosePortResponse, error) {
	c, err := a.portConn(r.Id)
	if err != nil {
		return nil, err
	}
	if r.WriteOnly {
		return &agent.ClosePortResponse{}, c.CloseWrite()
	}
	a.ports.mu.Lock()
	delete(a.ports.open, r.Id)
	a.ports.mu.Unlock()
	return &agent.ClosePortResponse{}, c.Close()
}

func (a *fakeAgent) Shutdown(context.Context, *agent.ShutdownRequest) (*agent.ShutdownResponse, error) {
	a.note("agent:shutdown")
	a.mu.Lock()
	a.shutdowns++
	a.mu.Unlock()
	return &agent.ShutdownResponse{}, nil
}

// fakeVMPid is the VM pid of every fakePod.
const fakeVMPid = 4242

// fakePod is a Pod around a fakeAgent (or, if remote is set, around that agent).
type fakePod struct {
	agent  *fakeAgent
	remote agent.AgentService
	wire   *agentWire // remote's connection, if it is filtered
	req    PodRequest
	mu     sync.Mutex
	binds  map[string]HostBind
	// idmapped are the names bound by BindIDMapped.
	idmapped []string
	// mountsIn are the mounts below each bind source (by source), what Submounts answers.
	mountsIn map[string][]string
	stopped  int
	// oomRaises are RaiseOOMScoreAdj's values, in order.
	oomRaises []int
	killed    []error // the reasons of Kill's calls
	done      chan struct{}
	dieOnce   sync.Once
	err       error // set before done is closed
}

func (p *fakePod) Agent() agent.AgentService {
	if p.remote != nil {
		return p.remote
	}
	return p.agent
}

func (p *fakePod) agentWire() *agentWire { return p.wire }

func (p *fakePod) Bind(src, name string, flags sandbox.BindFlags) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.binds[name]; ok {
		return fmt.Errorf("bind %s twice", name)
	}
	p.binds[name] = HostBind{Source: src, Name: name, Flags: flags}
	return nil
}

// BindIDMapped records the bind as Bind does, with a user namespace's descriptor open.
func (p *fakePod) BindIDMapped(src, name string, flags sandbox.BindFlags, userns *os.File) error {
	if _, err := unix.FcntlInt(userns.Fd(), unix.F_GETFD, 0); err != nil {
		return fmt.Errorf("bind %s: the user namespace's descriptor: %w", name, err)
	}
	p.mu.Lock()
	p.idmapped = append(p.idmapped, name)
	p.mu.Unlock()
	return p.Bind(src, name, flags)
}

func (p *fakePod) Submounts(name string) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	b, ok := p.binds[name]
	if !ok {
		return nil, fmt.Errorf("submounts of %s: not bound", name)
	}
	return p.mountsIn[b.Source], nil
}

func (p *fakePod) Unbind(name string) error {
	p.agent.note("pod:unbind " + name)
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.binds[name]; !ok {
		return fmt.Errorf("unbind %s: not bound", name)
	}
	delete(p.binds, name)
	return nil
}

// RaiseOOMScoreAdj records v.
func (p *fakePod) RaiseOOMScoreAdj(v int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.oomRaises = append(p.oomRaises, v)
	return nil
}

func (p *fakePod) Done() <-chan struct{} { return p.done }
func (p *fakePod) Pid() uint32           { return fakeVMPid }
func (p *fakePod) Err() error {
	select {
	case <-p.done:
		return p.err
	default:
		return nil
	}
}

// Kill implements Pod: the fake VM dies at once.
func (p *fakePod) Kill(why error) {
	p.mu.Lock()
	p.killed = append(p.killed, why)
	p.mu.Unlock()
	p.die(why)
}

// kills are Kill's reasons so far.
func (p *fakePod) kills() []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.killed)
}

// ConfigureNetwork implements VM: the fake VM has no NIC.
func (p *fakePod) ConfigureNetwork(context.Context, agent.AgentService) error { return nil }

// Stop implements VM: as QEMUVM's, a guest that does not shut down is stopped all the same.
func (p *fakePod) Stop(ctx context.Context, shutdown func(context.Context) error) error {
	p.mu.Lock()
	p.stopped++
	p.mu.Unlock()
	shutdown(ctx)
	return nil
}

func (p *fakePod) die(err error) {
	p.dieOnce.Do(func() {
		p.err = err
		close(p.done)
	})
}

func (p *fakePod) bound() map[string]HostBind {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := map[string]HostBind{}
	for k, v := range p.binds {
		m[k] = v
	}
	return m
}

// recorder is an events.Publisher that keeps the events in order.
type recorder struct {
	mu     sync.Mutex
	events []any
	wake   chan struct{}
	// onPublish, if set, runs synchronously in Publish, before the event is recorded.
	onPublish func(any)
}

var _ events.Publisher = (*recorder)(nil)

func newRecorder() *recorder { return &recorder{wake: make(chan struct{}, 1)} }

func (r *recorder) Publish(_ context.Context, _ string, e events.Event) error {
	if r.onPublish != nil {
		r.onPublish(e)
	}
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return nil
}

func (r *recorder) all() []any {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// waitFor waits until an event satisfies match and returns its index.
func (r *recorder) waitFor(t *testing.T, what string, match func(any) bool) int {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		for i, e := range r.all() {
			if match(e) {
				return i
			}
		}
		select {
		case <-r.wake:
		case <-time.After(20 * time.Millisecond):
		case <-deadline:
			t.Fatalf("no %s event; got %s", what, describe(r.all()))
		}
	}
}

func describe(evs []any) string {
	var s []string
	for _, e := range evs {
		s = append(s, fmt.Sprintf("%T%+v", e, e))
	}
	return fmt.Sprint(s)
}

// fakeShutdown is a shutdown.Service.
type fakeShutdown struct {
	once sync.Once
	done chan struct{}
}

func (f *fakeShutdown) Shutdown()                                    { f.once.Do(func() { close(f.done) }) }
func (f *fakeShutdown) RegisterCallback(func(context.Context) error) {}
func (f *fakeShutdown) Done() <-chan struct{}                        { return f.done }
func (f *fakeShutdown) Err() error                                   { return nil }
