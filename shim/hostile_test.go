package shim

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// The hostile-agent suite: the real task service against an agent that misbehaves as root in
// the guest can make it, over a real ttrpc connection. Each test asserts the bound the shim
// promises (agentdoor.go, podrun.go) and that nothing is left.

// hostileAgent is the fake agent with faults.
type hostileAgent struct {
	*fakeAgent
	// silent names the calls that never answer (until the test ends).
	silent map[string]bool
	// killIgnored makes SignalProcess answer without signalling; killRefused makes it refuse
	// without signalling, as runc's "container not running"; killNotFound makes it answer
	// NotFound, as the agent answers for an init that has exited but whose exit it has not
	// reported yet.
	killIgnored, killRefused, killNotFound bool
	// execKillIgnored makes SignalProcess answer without signalling an exec, and a signal to
	// all of a container's processes reach its init only.
	execKillIgnored bool
	// execExitsHidden makes WaitProcess never answer for an exec; exitsHidden, for any
	// process (until the caller gives up).
	execExitsHidden, exitsHidden bool
	// refuseRunningDeletes makes DeleteProcess refuse, as the real agent does, an exec that
	// has not exited, and a container one of whose execs has not.
	refuseRunningDeletes bool
	// oomFlood, if set, is the container every GetOOMEvent names, at once.
	oomFlood  string
	oomAnswer atomic.Int64
	// exitStatus, if set, is every WaitProcess's exit status.
	exitStatus uint32
	// longError, if set, is the error Stats answers, a long one; with errDetail, a status
	// detail of that many bytes goes with it.
	longError string
	errDetail int
	// statsDelay delays every Stats answer; stdinDelay every WriteStdin's.
	statsDelay, stdinDelay time.Duration

	end chan struct{} // closed at the test's end: silent calls return
}

func newHostileAgent(t *testing.T, a *fakeAgent) *hostileAgent {
	h := &hostileAgent{fakeAgent: a, silent: map[string]bool{}, end: make(chan struct{})}
	t.Cleanup(func() { close(h.end) })
	return h
}

// hold answers nothing until the test ends, if call is silent; it says whether it held.
func (h *hostileAgent) hold(call string) bool {
	if !h.silent[call] {
		return false
	}
	<-h.end
	return true
}

var errSilent = errors.New("the silent agent's test ended")

func (h *hostileAgent) CreateContainer(ctx context.Context, r *agent.CreateContainerRequest) (*agent.CreateContainerResponse, error) {
	if h.hold("CreateContainer") {
		return nil, errSilent
	}
	return h.fakeAgent.CreateContainer(ctx, r)
}

func (h *hostileAgent) DeleteProcess(ctx context.Context, r *agent.DeleteProcessRequest) (*agent.DeleteProcessResponse, error) {
	if h.hold("DeleteProcess") {
		return nil, errSilent
	}
	if h.refuseRunningDeletes {
		h.fakeAgent.mu.Lock()
		var running []string
		for k, p := range h.fakeAgent.procs {
			if k[0] == r.ContainerId && k[1] != "" && (r.ExecId == "" || k[1] == r.ExecId) && !isClosed(p.exited) {
				running = append(running, k[1])
			}
		}
		h.fakeAgent.mu.Unlock()
		if len(running) > 0 {
			return nil, status.Errorf(codes.FailedPrecondition, "container %q still runs its processes %q", r.ContainerId, running)
		}
	}
	return h.fakeAgent.DeleteProcess(ctx, r)
}

func (h *hostileAgent) Stats(ctx context.Context, r *agent.StatsRequest) (*agent.StatsResponse, error) {
	if h.hold("Stats") {
		return nil, errSilent
	}
	if h.longError != "" {
		st := status.New(codes.Internal, h.longError)
		if h.errDetail > 0 {
			var err error
			if st, err = st.WithDetails(wrapperspb.Bytes(make([]byte, h.errDetail))); err != nil {
				return nil, err
			}
		}
		return nil, st.Err()
	}
	if h.statsDelay > 0 {
		time.Sleep(h.statsDelay)
	}
	return h.fakeAgent.Stats(ctx, r)
}

func (h *hostileAgent) WriteStdin(ctx context.Context, r *agent.WriteStdinRequest) (*agent.WriteStdinResponse, error) {
	time.Sleep(h.stdinDelay)
	return h.fakeAgent.WriteStdin(ctx, r)
}

func (h *hostileAgent) SignalProcess(ctx context.Context, r *agent.SignalProcessRequest) (*agent.SignalProcessResponse, error) {
	if h.hold("SignalProcess") {
		return nil, errSilent
	}
	if h.killIgnored || (h.execKillIgnored && r.ExecId != "") {
		return &agent.SignalProcessResponse{}, nil
	}
	if h.execKillIgnored && r.All {
		return h.fakeAgent.SignalProcess(ctx, &agent.SignalProcessRequest{ContainerId: r.ContainerId, Signal: r.Signal})
	}
	if h.killRefused {
		return nil, status.Error(codes.Internal, "runc kill: container not running")
	}
	if h.killNotFound {
		return nil, status.Error(codes.NotFound, "container c1 has exited")
	}
	return h.fakeAgent.SignalProcess(ctx, r)
}

func (h *hostileAgent) WaitProcess(ctx context.Context, r *agent.WaitProcessRequest) (*agent.WaitProcessResponse, error) {
	if h.exitsHidden || (h.execExitsHidden && r.ExecId != "") {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-h.end:
			return nil, errSilent
		}
	}
	resp, err := h.fakeAgent.WaitProcess(ctx, r)
	if err == nil && h.exitStatus != 0 {
		resp.ExitStatus = h.exitStatus
	}
	return resp, err
}

func (h *hostileAgent) GetOOMEvent(ctx context.Context, r *agent.GetOOMEventRequest) (*agent.GetOOMEventResponse, error) {
	if h.oomFlood == "" {
		return h.fakeAgent.GetOOMEvent(ctx, r)
	}
	h.oomAnswer.Add(1)
	return &agent.GetOOMEventResponse{ContainerId: h.oomFlood}, nil
}

// ttrpcClient serves what register registers on a unix socket with ttrpc (with opts) and
// returns a client of it.
func ttrpcClient(t *testing.T, register func(*ttrpc.Server) error, opts ...ttrpc.ServerOpt) *ttrpc.Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "ttrpc.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ttrpc.NewServer(opts...)
	if err != nil {
		t.Fatal(err)
	}
	if err := register(srv); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(context.Background(), l)
	conn, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	client := ttrpc.NewClient(conn)
	t.Cleanup(func() {
		client.Close()
		srv.Close()
	})
	return client
}

// overTTRPC is a client of a served with ttrpc: the shim meets the hostile agent over the
// same protocol as a real guest's.
func overTTRPC(t *testing.T, a agent.AgentService) agent.AgentService {
	return agent.NewAgentClient(ttrpcClient(t, func(srv *ttrpc.Server) error {
		agent.RegisterAgentService(srv, a)
		return nil
	}))
}

// taskOverTTRPC is a client of svc served with ttrpc behind the shim's ErrorEdge, as
// containerd's pkg/shim chains it.
func taskOverTTRPC(t *testing.T, svc *TaskService) taskAPI.TTRPCTaskService {
	return taskAPI.NewTTRPCTaskClient(ttrpcClient(t, svc.RegisterTTRPC,
		ttrpc.WithUnaryServerInterceptor(ErrorEdge{}.UnaryServerInterceptor())))
}

// hostileHarness is a harness whose pods' agent is a hostileAgent over ttrpc.
func hostileHarness(t *testing.T, limits GuestLimits) (*harness, *hostileAgent) {
	h := newHarnessWith(t, limits, nil)
	ha := newHostileAgent(t, h.agent)
	h.remote = overTTRPC(t, ha)
	return h, ha
}

// within fails the test unless f returns within d; it returns how long f took.
func within(t *testing.T, what string, d time.Duration, f func()) time.Duration {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s: no answer within %v", what, d)
	}
	took := time.Since(start)
	t.Logf("%s: %v", what, took.Round(time.Millisecond))
	return took
}

// checkPodGone checks that the pod's VM was killed (once) and stopped, and no container is
// left.
func checkPodGone(t *testing.T, h *harness, why string) {
	t.Helper()
	pod := h.pod()
	kills := pod.kills()
	if len(kills) != 1 || !strings.Contains(kills[0].Error(), why) {
		t.Errorf("the VM's kills: %v, want one for %q", kills, why)
	}
	if pod.stopped != 1 {
		t.Errorf("the pod was stopped %d times, want once", pod.stopped)
	}
	if len(pod.bound()) != 0 {
		t.Errorf("binds left: %v", pod.bound())
	}
	h.svc.mu.Lock()
	n, run := len(h.svc.containers), h.svc.run
	h.svc.mu.Unlock()
	if n != 0 || run != nil {
		t.Errorf("%d containers and a pod (%v) left", n, run != nil)
	}
}

// TestHostileSilentStats: a guest that never answers Stats. containerd's CRI asks with no
// deadline of its own (context.Background): with the shipped limits each Stats fails within
// the 10 s bound; three misses in a row cut the guest off, its VM is killed, the container
// exits 255 (its Stats then NotFound, which containerd passes over: its cgroup went with the
// VM) and is deleted with nothing left.
func TestHostileSilentStats(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	ha.silent["Stats"] = true
	h.createSimple("c1")
	h.start("c1", "")
	for i := range missLimit {
		var err error
		took := within(t, "Stats of a silent guest", 10*time.Second, func() {
			_, err = h.svc.Stats(context.Background(), &taskAPI.StatsRequest{ID: "c1"})
		})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Stats %d: %v, want a deadline exceeded", i, err)
		}
		if took < DefaultGuestLimits.Query {
			t.Errorf("Stats failed after %v, before its deadline %v", took, DefaultGuestLimits.Query)
		}
	}
	if w := h.wait("c1", ""); w.ExitStatus != exitVMDied {
		t.Errorf("exit %d after the guest was cut off, want %d", w.ExitStatus, exitVMDied)
	}
	_, err := h.svc.Stats(context.Background(), &taskAPI.StatsRequest{ID: "c1"})
	wantKind(t, "Stats after the guest was cut off", err, errdefs.ErrNotFound)
	h.delete("c1", "")
	checkPodGone(t, h, "missed 3 deadlines in a row")
}

// TestHostileSlowStats: a guest that answers every Stats just inside the Query deadline (at
// 0.9 of it) is not cut off, and once it has answered, containerd's Metrics, which asks the
// pod's three containers in turn, costs less than one deadline in total: each call serves the
// guest's last answer after at most StatsWait, and the guest is asked again each round.
func TestHostileSlowStats(t *testing.T) {
	limits := GuestLimits{Query: time.Second, StatsWait: 50 * time.Millisecond}
	h, ha := hostileHarness(t, limits)
	ha.statsDelay = limits.Query * 9 / 10
	ids := []string{"c1", "c2", "c3"}
	for _, id := range ids {
		h.createSimple(id)
		h.start(id, "")
	}
	metrics := func() {
		for _, id := range ids {
			st, err := h.svc.Stats(context.Background(), &taskAPI.StatsRequest{ID: id})
			if err != nil {
				t.Errorf("Stats %s: %v", id, err)
				continue
			}
			if v, err := typeurl.UnmarshalAny(st.Stats); err != nil || v.(*cgroupstats.Metrics).GetPids().GetCurrent() != uint64(len(id)) {
				t.Errorf("Stats %s: %v %v, not the guest's answer", id, v, err)
			}
		}
	}
	within(t, "the first Metrics (each container's first answer)", 10*time.Second, metrics)
	const rounds = 3
	for range rounds {
		// Every answer is old by then, the last round's refreshes done: each call asks again.
		time.Sleep(statsFresh + limits.Query)
		if took := within(t, "Metrics", 10*time.Second, metrics); took >= limits.Query {
			t.Errorf("Metrics of a slow pod took %v, more than one deadline (%v)", took, limits.Query)
		}
	}
	time.Sleep(limits.Query) // the last round's refreshes reach the guest's answer
	h.agent.mu.Lock()
	asked := len(h.agent.statsAsked)
	h.agent.mu.Unlock()
	if want := len(ids) * (1 + rounds); asked < want {
		t.Errorf("the guest was asked for Stats %d times, want at least %d (one per container and round)", asked, want)
	}
	if k := h.pod().kills(); len(k) != 0 {
		t.Errorf("a slow guest was cut off: %v", k)
	}
	for _, id := range ids {
		h.kill(id, syscall.SIGKILL)
		h.wait(id, "")
		h.delete(id, "")
	}
}

// TestHostileKillIgnored: a guest that acknowledges SIGKILL and never reports the exit. The
// host ends the container within KillGrace (the shipped one: the bound is 30 s to stopped and
// deleted) by killing the VM; the killed init exits 137, the other container of the pod 255.
func TestHostileKillIgnored(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	ha.killIgnored = true
	h.createSimple("c1")
	h.start("c1", "")
	h.createSimple("c2")
	h.start("c2", "")
	start := time.Now()
	if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL), All: true}); err != nil {
		t.Fatalf("Kill: %v", err)
	}
	waitKilled(t, h, "c1")
	took := time.Since(start)
	t.Logf("SIGKILL ignored by the guest, to stopped and deleted: %v", took.Round(time.Millisecond))
	if took > 30*time.Second || took < DefaultGuestLimits.KillGrace {
		t.Errorf("stopped and deleted after %v, want between the grace %v and 30 s", took, DefaultGuestLimits.KillGrace)
	}
	if w := h.wait("c2", ""); w.ExitStatus != exitVMDied {
		t.Errorf("the pod's other container's exit %d, want %d", w.ExitStatus, exitVMDied)
	}
	h.delete("c2", "")
	checkPodGone(t, h, "did not end container c1 within 10s of SIGKILL")
}

// TestHostileKillRefused: a guest that refuses SIGKILL with an answer and never reports the
// exit. containerd hears the refusal, and the host still ends the container within KillGrace.
func TestHostileKillRefused(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{KillGrace: 500 * time.Millisecond})
	ha.killRefused = true
	h.createSimple("c1")
	h.start("c1", "")
	_, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL)})
	if err == nil || !strings.Contains(err.Error(), "container not running") {
		t.Errorf("Kill refused by the guest: %v, want its refusal", err)
	}
	waitKilled(t, h, "c1")
	checkPodGone(t, h, "did not end container c1 within 500ms of SIGKILL")
}

// TestKillExitedInGuest: a SIGKILL the agent answers NotFound (the process has exited in the
// guest, its exit not reported yet: a container stopped just as it ends) is "not found" to
// containerd, as runc's shim says of a finished process, which CRI's StopContainer takes as
// stopped; the host still ends the container should its exit never come.
func TestKillExitedInGuest(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{KillGrace: 500 * time.Millisecond})
	ha.killNotFound = true
	h.createSimple("c1")
	h.start("c1", "")
	_, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL)})
	wantKind(t, "Kill of a process that exited in the guest", err, errdefs.ErrNotFound)
	if err == nil || !strings.Contains(err.Error(), "process already finished") {
		t.Errorf("Kill: %v, want \"process already finished\"", err)
	}
	waitKilled(t, h, "c1")
}

// waitKilled waits up to 30 s for container id, SIGKILLed, to exit with exitKilled, and
// deletes it.
func waitKilled(t *testing.T, h *harness, id string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(h.ctx, 30*time.Second)
	defer cancel()
	w, err := h.svc.Wait(ctx, &taskAPI.WaitRequest{ID: id})
	if err != nil {
		t.Fatalf("Wait for the killed container: %v", err)
	}
	if w.ExitStatus != exitKilled {
		t.Errorf("the killed container's exit %d, want %d", w.ExitStatus, exitKilled)
	}
	h.delete(id, "")
}

// TestHostileSilentKill: a guest that does not even answer SignalProcess. Kill answers within
// the signal deadline and the host finishes the kill.
func TestHostileSilentKill(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{Signal: 300 * time.Millisecond, KillGrace: 500 * time.Millisecond})
	ha.silent["SignalProcess"] = true
	h.createSimple("c1")
	h.start("c1", "")
	// A signal other than SIGKILL is the guest's to deliver: its silence is an error.
	_, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGTERM)})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("SIGTERM to a silent guest: %v, want a deadline exceeded", err)
	}
	within(t, "Kill of a silent guest", 2*time.Second, func() {
		if _, err := h.svc.Kill(h.ctx, &taskAPI.KillRequest{ID: "c1", Signal: uint32(syscall.SIGKILL)}); err != nil {
			t.Errorf("Kill: %v", err)
		}
	})
	if w := h.wait("c1", ""); w.ExitStatus != exitKilled {
		t.Errorf("exit %d, want %d", w.ExitStatus, exitKilled)
	}
	h.delete("c1", "")
	checkPodGone(t, h, "of SIGKILL")
}

// TestHostileSilentCreate: a guest that answers Ping, then never answers CreateContainer
// (nor the undo's DeleteProcess). Create fails within the lifecycle deadline, the VM is
// killed and stopped, nothing is left, and the shim then shuts down.
func TestHostileSilentCreate(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{Lifecycle: time.Second})
	ha.silent["CreateContainer"] = true
	ha.silent["DeleteProcess"] = true
	b := h.bundle("c1", nil)
	var err error
	created := make(chan struct{})
	go func() {
		defer close(created)
		within(t, "Create with a silent guest", 5*time.Second, func() {
			_, err = h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: b})
		})
	}()
	// Stats of the container being created: NotFound, which containerd's Metrics passes
	// over without a word, as for runc's.
	serr := statsWhile(t, h, "c1", "being created", created)
	wantKind(t, "Stats of a container being created", serr, errdefs.ErrNotFound)
	<-created
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "CreateContainer c1") {
		t.Errorf("Create: %v, want the CreateContainer deadline", err)
	}
	checkNothingLeft(t, h, b)
	checkPodGone(t, h, "did not answer CreateContainer c1 within 1s")
	if _, err := h.svc.Shutdown(h.ctx, &taskAPI.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.sd.Done():
	case <-time.After(5 * time.Second):
		t.Error("the shim did not shut down")
	}
}

// TestHostileOOMFlood: a guest that reports an OOM kill in answer to every GetOOMEvent, at
// once. At most one TaskOOM per container per second reaches containerd, and the shim takes
// no more than one answer per oomPace.
func TestHostileOOMFlood(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	ha.oomFlood = "c1"
	h.createSimple("c1")
	h.start("c1", "")
	const d = 2500 * time.Millisecond
	time.Sleep(d)
	ooms := 0
	for _, e := range h.rec.all() {
		if o, ok := e.(*eventstypes.TaskOOM); ok && o.ContainerID == "c1" {
			ooms++
		}
	}
	answers := ha.oomAnswer.Load()
	t.Logf("in %v: %d TaskOOM events from %d OOM answers of the guest", d, ooms, answers)
	if ooms < 1 || ooms > 3 {
		t.Errorf("%d TaskOOM events in %v, want 1 to 3", ooms, d)
	}
	if max := int64(d/oomPace) + 10; answers > max {
		t.Errorf("the shim took %d OOM answers in %v, more than %d", answers, d, max)
	}
	h.kill("c1", syscall.SIGKILL)
	h.wait("c1", "")
	h.delete("c1", "")
}

// TestHostileLies: answers that break the protocol are refused before containerd sees them,
// each an error naming it; the third cuts the guest off.
func TestHostileLies(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	h.createSimple("c1")
	h.start("c1", "")

	ha.fakeAgent.badStats = &anypb.Any{TypeUrl: "types.example/not.Metrics", Value: []byte{1, 2, 3}}
	_, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "c1"})
	if err == nil || !strings.Contains(err.Error(), "not.Metrics") {
		t.Errorf("Stats of the wrong type: %v", err)
	}
	// 180,000 I/O entries, 3.9 MB: refused by its size before it is decoded.
	big := &cgroupstats.Metrics{Io: &cgroupstats.IOStat{}}
	for i := range 180000 {
		big.Io.Usage = append(big.Io.Usage, &cgroupstats.IOEntry{Major: uint64(i), Rbytes: 1 << 40})
	}
	ha.fakeAgent.badStats = anyOf(t, big)
	_, err = h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "c1"})
	if err == nil || !strings.Contains(err.Error(), "bytes, more than") {
		t.Errorf("a Stats answer of %d bytes: %v", len(ha.fakeAgent.badStats.Value), err)
	}
	if k := h.pod().kills(); len(k) != 0 {
		t.Fatalf("cut off after two violations: %v", k)
	}
	ha.exitStatus = 1000
	h.agent.exit("c1", "", 0)
	if w := h.wait("c1", ""); w.ExitStatus != exitVMDied {
		t.Errorf("exit %d after a lying exit status, want %d", w.ExitStatus, exitVMDied)
	}
	h.delete("c1", "")
	checkPodGone(t, h, "3 answers that break the protocol")
}

// TestHostileLongError: the guest's error reaches containerd (through the shim's error edge,
// as containerd reads it) as its code and its text alone: the text cut to guestTextMax and
// printable, the status details (85 KiB of them) dropped.
func TestHostileLongError(t *testing.T) {
	h, ha := hostileHarness(t, GuestLimits{})
	// The longest text and details the agent connection takes (maxAnswerFrame, agentwire.go).
	ha.longError = "\x1b[31mred\r\nforged log line\u202e" + strings.Repeat("x", maxAnswerFrame/2)
	ha.errDetail = maxAnswerFrame / 3
	h.createSimple("c1")
	h.start("c1", "")
	_, err := h.svc.Stats(h.ctx, &taskAPI.StatsRequest{ID: "c1"})
	edge := ErrorEdge{}.UnaryServerInterceptor()
	_, err = edge(h.ctx, nil, &ttrpc.UnaryServerInfo{FullMethod: "/containerd.task.v3.Task/Stats"}, func(context.Context, func(any) error) (any, error) { return nil, err })
	st, ok := status.FromError(err)
	switch {
	case !ok || st.Code() != codes.Internal:
		t.Errorf("Stats' error %v: want the guest's code, Internal", err)
	case len(st.Proto().GetDetails()) != 0 || proto.Size(st.Proto()) > guestTextMax+200:
		t.Errorf("Stats' error: %d details, %d bytes; want none and at most %d", len(st.Proto().GetDetails()), proto.Size(st.Proto()), guestTextMax+200)
	case strings.ContainsAny(st.Message(), "\x1b\r\n\u202e"):
		t.Errorf("Stats' error has the guest's control characters: %q", st.Message()[:100])
	case !strings.Contains(st.Message(), `\x1b[31mred\r\nforged log line\u202e`):
		t.Errorf("Stats' error does not say what the guest said, escaped: %q", st.Message()[:100])
	}
	h.kill("c1", syscall.SIGKILL)
	h.wait("c1", "")
	h.delete("c1", "")
}

// TestTaskPidsAreTheVMs: the pids the task API reports are the VM's (a host process of the
// pod), whatever the agent answered; Pids too, once, though the container runs execs (the
// guest is not asked).
func TestTaskPidsAreTheVMs(t *testing.T) {
	h, _ := hostileHarness(t, GuestLimits{})
	b := h.bundle("c1", nil)
	resp := h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: b})
	start, err := h.svc.Start(h.ctx, &taskAPI.StartRequest{ID: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := h.svc.State(h.ctx, &taskAPI.StateRequest{ID: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Pid != fakeVMPid || start.Pid != fakeVMPid || st.Pid != fakeVMPid {
		t.Errorf("pids: create %d, start %d, state %d; want the VM's %d", resp.Pid, start.Pid, st.Pid, fakeVMPid)
	}
	for _, e := range h.rec.all() {
		switch e := e.(type) {
		case *eventstypes.TaskCreate:
			if e.Pid != fakeVMPid {
				t.Errorf("TaskCreate pid %d", e.Pid)
			}
		case *eventstypes.TaskStart:
			if e.Pid != fakeVMPid {
				t.Errorf("TaskStart pid %d", e.Pid)
			}
		}
	}
	if _, err := h.svc.Exec(h.ctx, &taskAPI.ExecProcessRequest{ID: "c1", ExecID: "e1", Spec: procAny(t)}); err != nil {
		t.Fatal(err)
	}
	h.start("c1", "e1")
	pids, err := h.svc.Pids(h.ctx, &taskAPI.PidsRequest{ID: "c1"})
	if err != nil || len(pids.Processes) != 1 || pids.Processes[0].Pid != fakeVMPid {
		t.Errorf("Pids: %v %v, want the VM's %d alone", pids, err, fakeVMPid)
	}
	h.agent.exit("c1", "e1", 0)
	h.wait("c1", "e1")
	h.kill("c1", syscall.SIGKILL)
	h.wait("c1", "")
	h.delete("c1", "")
}

// anyOf is m as an Any, as the agent answers it.
func anyOf(t *testing.T, m proto.Message) *anypb.Any {
	t.Helper()
	a, err := typeurl.MarshalAnyToProto(m)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
