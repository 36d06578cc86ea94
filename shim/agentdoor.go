package shim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/errdefs"
	"github.com/containerd/errdefs/pkg/errgrpc"
	"github.com/containerd/log"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// The door to the guest agent. Root in the guest controls the agent, so the shim treats it as
// kvfsd treats the guest's driver: every call the shim makes to it goes through one agentDoor,
// which gives the call a deadline by its kind, checks the answer before anything of it goes
// further, and counts the agent's misbehaviour. An agent that misses deadlines past missLimit
// (or one lifecycle deadline), or breaks the protocol violationLimit times (a broken answer,
// or a frame the agent connection's filter dropped, agentwire.go; one frame too long for it is
// enough), has failed: the door calls its fail function once, which stops the pod's VM (the
// Pod's failure policy), and every later call fails at once. What it logs of the
// guest's misbehaviour goes through the pod's guestLogger. The door is made as soon as the
// agent has answered the Ping that ends the VM's boot (a handshake on each new connection,
// under agent.boot_timeout, before there is an agent to misbehave): the guest's
// configuration after the boot (its network, its sysctls), every container's call, and the
// Shutdown at the pod's stop all go through it.
//
// The deadlines, by kind (GuestLimits, whose defaults are below):
//   - queries (Ping, Stats, ResizePty, CloseStdin): Query. containerd's CRI
//     asks every task's Stats one after another with no deadline of its own, so one silent
//     guest would otherwise hold the metrics of every pod on the node.
//   - signals (SignalProcess): Signal. A SIGKILL the agent does not confirm is finished
//     by the host (see Container.kill).
//   - lifecycle calls (CreateContainer, ExecProcess, StartProcess, DeleteProcess, Pause,
//     Resume, Update, ConfigureNetwork, SetSysctls, Shutdown): Lifecycle, as Kata's shim
//     bounds its agent requests. A healthy agent never takes that long: one miss fails the pod.
//   - port-forward's calls (portforward.go): ClosePort is a query; OpenPort and WritePort
//     wait for the guest's side at most the agent's own bound (agent.PortDialTimeout,
//     agent.PortWriteWait), so theirs is that bound plus Query; a miss counts as a query's.
//   - streams (WaitProcess, GetOOMEvent, ReadStdout, ReadStderr, WriteStdin, ReadPort): no
//     deadline of the door's; they wait on the guest's processes or servers, and their callers
//     end them with the pod (or, for output, a drain deadline after the exit; for a port, its
//     client's connection).
const (
	// missLimit is how many query or signal deadlines in a row the agent may miss.
	missLimit = 3
	// violationLimit is how many answers that break the protocol the agent may give.
	violationLimit = 3
	// maxStatsBytes bounds a Stats answer: a container's cgroup2 metrics take well under 2
	// KiB (its memory counters, an entry per block device, page size and interface).
	maxStatsBytes = 16 << 10
	// maxStatsEntries bounds each list of a Stats answer: the guest's block devices, huge
	// page sizes, network interfaces and RDMA devices are a handful each.
	maxStatsEntries = 64
)

// callKind is a call's class of deadline.
type callKind int

const (
	kindQuery callKind = iota
	kindSignal
	kindLifecycle
	kindPortOpen
	kindPortWrite
	kindStream
)

// GuestLimits bound what the shim waits for from the guest and takes from it. A field left
// zero is its default (DefaultGuestLimits).
type GuestLimits struct {
	// Query, Signal and Lifecycle are the door's deadlines by kind of call.
	Query, Signal, Lifecycle time.Duration
	// KillGrace is how long the guest may take to confirm a SIGKILL (report the process's
	// exit) before the host ends the process: a container's init by killing the pod's VM, an
	// exec by declaring it exited (Container.enforceKill).
	KillGrace time.Duration
	// OOMInterval is the least time between two TaskOOM events of one container: the guest
	// can report OOM kills as fast as it likes, and containerd handles events on the queue
	// every pod's exits share. The OOM kills in between are the same news.
	OOMInterval time.Duration
	// StatsWait is how long a Stats call waits for the guest's new answer when it has an
	// older one to serve instead (stats.go).
	StatsWait time.Duration
}

// DefaultGuestLimits are the limits of the shipped shim. With them, under TCG: a query answers
// or fails within 10 s, a SIGKILLed container or exec is stopped within 30 s, a Create whose
// agent goes silent fails within 90 s, and at most one OOM event per container per second
// reaches containerd (docs/measurements/reliability.md).
var DefaultGuestLimits = GuestLimits{
	Query:       5 * time.Second,
	Signal:      5 * time.Second,
	Lifecycle:   60 * time.Second,
	KillGrace:   10 * time.Second,
	OOMInterval: time.Second,
	StatsWait:   500 * time.Millisecond,
}

// withDefaults is l with each zero field its default.
func (l GuestLimits) withDefaults() GuestLimits {
	d := DefaultGuestLimits
	for _, f := range []struct{ v, def *time.Duration }{
		{&l.Query, &d.Query}, {&l.Signal, &d.Signal}, {&l.Lifecycle, &d.Lifecycle},
		{&l.KillGrace, &d.KillGrace}, {&l.OOMInterval, &d.OOMInterval}, {&l.StatsWait, &d.StatsWait},
	} {
		if *f.v <= 0 {
			*f.v = *f.def
		}
	}
	return l
}

// timeout is the deadline of a call of kind k; 0 for none.
func (l GuestLimits) timeout(k callKind) time.Duration {
	switch k {
	case kindQuery:
		return l.Query
	case kindSignal:
		return l.Signal
	case kindLifecycle:
		return l.Lifecycle
	case kindPortOpen:
		return agent.PortDialTimeout + l.Query
	case kindPortWrite:
		return agent.PortWriteWait + l.Query
	}
	return 0
}

// errAgentFailed is the error of every call after the door has failed the pod.
var errAgentFailed = errors.New("the guest agent was cut off for misbehaving")

// agentDoor is the shim's one door to the guest agent (see above). It implements the agent's
// API, so that what fronts it (the pod sandbox's task, sandboxtask.go) keeps its shape.
type agentDoor struct {
	ctx    context.Context    // the shim's: its logger
	pod    context.Context    // ends when the pod dies or is stopped, and every call with it
	ag     agent.AgentService // the guest's; its answers are untrusted
	limits GuestLimits
	log    *guestLogger // the pod's: the door's lines are the guest's to cause
	fail   func(error)  // stops the pod; called at most once, with no lock held

	mu         sync.Mutex
	misses     int   // guarded by mu: query and signal deadlines missed in a row
	violations int   // guarded by mu
	failure    error // guarded by mu: why the door failed the pod; nil while it has not
}

var _ agent.AgentService = (*agentDoor)(nil)

// newAgentDoor is the door to ag, the agent of the pod whose life is pod; ctx is the shim's.
func newAgentDoor(ctx, pod context.Context, ag agent.AgentService, limits GuestLimits, glog *guestLogger, fail func(error)) *agentDoor {
	return &agentDoor{ctx: ctx, pod: pod, ag: ag, limits: limits, log: glog, fail: fail}
}

// failed is why the door cut the agent off, or nil.
func (d *agentDoor) failed() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.failure
}

// failLocked records why the pod fails and returns the function that fails it, to be called
// once d.mu is released; nil if the pod had failed already.
func (d *agentDoor) failLocked(why error) func() {
	if d.failure != nil {
		return nil
	}
	d.failure = why
	return func() { d.fail(why) }
}

// cutOff fails the pod for why, unless it has failed already; every later call fails at once.
func (d *agentDoor) cutOff(why error) {
	d.mu.Lock()
	fail := d.failLocked(why)
	d.mu.Unlock()
	if fail != nil {
		fail()
	}
}

// missed counts a deadline the agent missed.
func (d *agentDoor) missed(k callKind, what string) {
	d.mu.Lock()
	d.misses++
	var fail func()
	switch {
	case k == kindLifecycle:
		fail = d.failLocked(fmt.Errorf("the guest agent did not answer %s within %v", what, d.limits.timeout(k)))
	case d.misses >= missLimit:
		fail = d.failLocked(fmt.Errorf("the guest agent missed %d deadlines in a row (the last: %s within %v)", d.misses, what, d.limits.timeout(k)))
	}
	d.mu.Unlock()
	if fail != nil {
		fail()
	}
}

// violation counts an answer that breaks the protocol, and returns the error its caller gets.
func (d *agentDoor) violation(what string, args ...any) error {
	err := fmt.Errorf("the guest agent broke the protocol: "+what+": %w", append(args, errdefs.ErrUnknown)...)
	d.broke("violation", err, false)
	return err
}

// broke counts err, a violation of kind, logs it (at most one line of its kind per
// guestLogInterval) and cuts the guest off if it was fatal or one too many: an answer that
// breaks the protocol, or a frame the agent connection's filter dropped (agentwire.go; a
// fatal one, after which the connection carries nothing, cuts the guest off at once).
func (d *agentDoor) broke(kind string, err error, fatal bool) {
	d.mu.Lock()
	d.violations++
	var fail func()
	switch {
	case fatal:
		fail = d.failLocked(err)
	case d.violations >= violationLimit:
		fail = d.failLocked(fmt.Errorf("%d answers that break the protocol (the last: %v)", d.violations, err))
	}
	d.mu.Unlock()
	d.log.warn(kind, log.G(d.ctx).WithError(err), "the guest agent misbehaves")
	if fail != nil {
		fail()
	}
}

func (d *agentDoor) answered() {
	d.mu.Lock()
	d.misses = 0
	d.mu.Unlock()
}

// call makes one call through the door: refused once the agent is cut off; ended with the
// pod (Unavailable, not the context's Canceled, which containerd would take for its
// client's); under the deadline of its kind; a missed deadline counted; the guest's error
// text bounded.
func call[Req, Resp any](d *agentDoor, ctx context.Context, k callKind, what string, f func(context.Context, Req) (Resp, error), r Req) (Resp, error) {
	var zero Resp
	if err := d.failed(); err != nil {
		return zero, fmt.Errorf("%s: %w (%v): %w", what, errAgentFailed, err, errdefs.ErrUnavailable)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(d.pod, cancel)()
	if t := d.limits.timeout(k); t > 0 {
		var cancelT context.CancelFunc
		cctx, cancelT = context.WithTimeout(cctx, t)
		defer cancelT()
	}
	resp, err := f(cctx, r)
	if err == nil {
		if k != kindStream {
			d.answered()
		}
		return resp, nil
	}
	if ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded) {
		d.missed(k, what)
		return zero, fmt.Errorf("the guest agent did not answer %s within %v: %w", what, d.limits.timeout(k), context.DeadlineExceeded)
	}
	if ctx.Err() == nil && d.pod.Err() != nil {
		return zero, fmt.Errorf("%s: the pod has ended: %w", what, errdefs.ErrUnavailable)
	}
	return zero, guestError(err)
}

// guestError rebuilds an error the agent answered (a gRPC status over ttrpc, all of it the
// guest's) from its code and its text alone, as an error of the code's errdefs kind
// (errgrpc.ToNative), what the shim's code and its error edge read: the code kept if it is
// one gRPC defines (else Unknown), the text made printable and cut (guestText), the status
// details dropped.
// containerd would otherwise pass the details on whole (whatever their size) and decode the
// types they name; and the text reaches containerd's log and the kubelet's events.
func guestError(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err // the shim's own: ttrpc's, a context's
	}
	code := st.Code()
	if code > codes.Unauthenticated {
		code = codes.Unknown
	}
	return errgrpc.ToNative(status.Error(code, guestText(st.Message())))
}

func (d *agentDoor) Ping(ctx context.Context, r *agent.PingRequest) (*agent.PingResponse, error) {
	return call(d, ctx, kindQuery, "Ping", d.ag.Ping, r)
}

func (d *agentDoor) CreateContainer(ctx context.Context, r *agent.CreateContainerRequest) (*agent.CreateContainerResponse, error) {
	return call(d, ctx, kindLifecycle, "CreateContainer "+r.ContainerId, d.ag.CreateContainer, r)
}

func (d *agentDoor) ExecProcess(ctx context.Context, r *agent.ExecProcessRequest) (*agent.ExecProcessResponse, error) {
	return call(d, ctx, kindLifecycle, "ExecProcess "+r.ExecId, d.ag.ExecProcess, r)
}

func (d *agentDoor) StartProcess(ctx context.Context, r *agent.StartProcessRequest) (*agent.StartProcessResponse, error) {
	return call(d, ctx, kindLifecycle, "StartProcess "+procName(r.ContainerId, r.ExecId), d.ag.StartProcess, r)
}

func (d *agentDoor) SignalProcess(ctx context.Context, r *agent.SignalProcessRequest) (*agent.SignalProcessResponse, error) {
	return call(d, ctx, kindSignal, "SignalProcess "+procName(r.ContainerId, r.ExecId), d.ag.SignalProcess, r)
}

// WaitProcess checks the exit: a status a process can have (0-255; another is a violation,
// and the exit stands with 255, as the guest says the process ended) and a time that has come.
func (d *agentDoor) WaitProcess(ctx context.Context, r *agent.WaitProcessRequest) (*agent.WaitProcessResponse, error) {
	what := "WaitProcess " + procName(r.ContainerId, r.ExecId)
	resp, err := call(d, ctx, kindStream, what, d.ag.WaitProcess, r)
	if err != nil {
		return nil, err
	}
	if resp.ExitStatus > 255 {
		_ = d.violation("%s: exit status %d", what, resp.ExitStatus) // counted; the exit stands
		resp.ExitStatus = 255
	}
	if t := resp.ExitedAt; t != nil && (!t.IsValid() || t.AsTime().After(time.Now().Add(time.Minute))) {
		resp.ExitedAt = nil // the host's clock then says when
	}
	return resp, nil
}

func (d *agentDoor) DeleteProcess(ctx context.Context, r *agent.DeleteProcessRequest) (*agent.DeleteProcessResponse, error) {
	return call(d, ctx, kindLifecycle, "DeleteProcess "+procName(r.ContainerId, r.ExecId), d.ag.DeleteProcess, r)
}

func (d *agentDoor) ReadStdout(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	return d.read(ctx, "stdout", d.ag.ReadStdout, r)
}

func (d *agentDoor) ReadStderr(ctx context.Context, r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	return d.read(ctx, "stderr", d.ag.ReadStderr, r)
}

// read checks a stream's answer: no more bytes than asked.
func (d *agentDoor) read(ctx context.Context, stream string, f func(context.Context, *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error), r *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error) {
	what := "Read " + stream + " of " + procName(r.ContainerId, r.ExecId)
	resp, err := call(d, ctx, kindStream, what, f, r)
	if err != nil {
		return nil, err
	}
	if len(resp.Data) > int(r.Max) {
		return nil, d.violation("%s: %d bytes, more than the %d asked", what, len(resp.Data), r.Max)
	}
	return resp, nil
}

func (d *agentDoor) WriteStdin(ctx context.Context, r *agent.WriteStdinRequest) (*agent.WriteStdinResponse, error) {
	return call(d, ctx, kindStream, "WriteStdin "+procName(r.ContainerId, r.ExecId), d.ag.WriteStdin, r)
}

func (d *agentDoor) CloseStdin(ctx context.Context, r *agent.CloseStdinRequest) (*agent.CloseStdinResponse, error) {
	return call(d, ctx, kindQuery, "CloseStdin "+procName(r.ContainerId, r.ExecId), d.ag.CloseStdin, r)
}

func (d *agentDoor) ResizePty(ctx context.Context, r *agent.ResizePtyRequest) (*agent.ResizePtyResponse, error) {
	return call(d, ctx, kindQuery, "ResizePty "+procName(r.ContainerId, r.ExecId), d.ag.ResizePty, r)
}

// Stats checks the answer is what containerd's CRI decodes it as, a cgroup2 Metrics of a size
// a guest's cgroups give (at most maxStatsBytes, maxStatsEntries entries in each list), and
// passes it on re-encoded from what was decoded, unknown fields dropped: nothing the guest
// added beyond the message reaches containerd.
func (d *agentDoor) Stats(ctx context.Context, r *agent.StatsRequest) (*agent.StatsResponse, error) {
	what := "Stats"
	if r.ContainerId != "" {
		what += " " + r.ContainerId
	}
	resp, err := call(d, ctx, kindQuery, what, d.ag.Stats, r)
	if err != nil {
		return nil, err
	}
	var m cgroupstats.Metrics
	want := string(m.ProtoReflect().Descriptor().FullName())
	url := resp.GetStats().GetTypeUrl()
	if name := url[strings.LastIndex(url, "/")+1:]; name != want {
		return nil, d.violation("%s: of type %q, not %s", what, guestText(url), want)
	}
	if n := len(resp.Stats.GetValue()); n > maxStatsBytes {
		return nil, d.violation("%s: %d bytes, more than %d", what, n, maxStatsBytes)
	}
	if err := (proto.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(resp.Stats.GetValue(), &m); err != nil {
		return nil, d.violation("%s: %v", what, err)
	}
	for list, n := range map[string]int{
		"hugetlb": len(m.Hugetlb), "network": len(m.Network), "io.usage": len(m.GetIo().GetUsage()),
		"rdma.current": len(m.GetRdma().GetCurrent()), "rdma.limit": len(m.GetRdma().GetLimit()),
	} {
		if n > maxStatsEntries {
			return nil, d.violation("%s: %d %s entries, more than %d", what, n, list, maxStatsEntries)
		}
	}
	a, err := typeurl.MarshalAnyToProto(&m)
	if err != nil {
		return nil, err
	}
	return &agent.StatsResponse{Stats: a}, nil
}

func (d *agentDoor) UpdateContainer(ctx context.Context, r *agent.UpdateContainerRequest) (*agent.UpdateContainerResponse, error) {
	return call(d, ctx, kindLifecycle, "UpdateContainer "+r.ContainerId, d.ag.UpdateContainer, r)
}

func (d *agentDoor) PauseContainer(ctx context.Context, r *agent.PauseContainerRequest) (*agent.PauseContainerResponse, error) {
	return call(d, ctx, kindLifecycle, "PauseContainer "+r.ContainerId, d.ag.PauseContainer, r)
}

func (d *agentDoor) ResumeContainer(ctx context.Context, r *agent.ResumeContainerRequest) (*agent.ResumeContainerResponse, error) {
	return call(d, ctx, kindLifecycle, "ResumeContainer "+r.ContainerId, d.ag.ResumeContainer, r)
}

func (d *agentDoor) GetOOMEvent(ctx context.Context, r *agent.GetOOMEventRequest) (*agent.GetOOMEventResponse, error) {
	return call(d, ctx, kindStream, "GetOOMEvent", d.ag.GetOOMEvent, r)
}

func (d *agentDoor) ConfigureNetwork(ctx context.Context, r *agent.ConfigureNetworkRequest) (*agent.ConfigureNetworkResponse, error) {
	return call(d, ctx, kindLifecycle, "ConfigureNetwork", d.ag.ConfigureNetwork, r)
}

func (d *agentDoor) SetSysctls(ctx context.Context, r *agent.SetSysctlsRequest) (*agent.SetSysctlsResponse, error) {
	return call(d, ctx, kindLifecycle, "SetSysctls", d.ag.SetSysctls, r)
}

func (d *agentDoor) OpenPort(ctx context.Context, r *agent.OpenPortRequest) (*agent.OpenPortResponse, error) {
	return call(d, ctx, kindPortOpen, fmt.Sprintf("OpenPort %d", r.Port), d.ag.OpenPort, r)
}

// ReadPort checks the answer as a stream's: no more bytes than asked; and an answer with no
// data is eof (the agent's read waits for some), or the relay would ask again at once.
func (d *agentDoor) ReadPort(ctx context.Context, r *agent.ReadPortRequest) (*agent.ReadPortResponse, error) {
	what := fmt.Sprintf("ReadPort %d", r.Id)
	resp, err := call(d, ctx, kindStream, what, d.ag.ReadPort, r)
	if err != nil {
		return nil, err
	}
	switch {
	case len(resp.Data) > int(r.Max):
		return nil, d.violation("%s: %d bytes, more than the %d asked", what, len(resp.Data), r.Max)
	case len(resp.Data) == 0 && !resp.Eof:
		return nil, d.violation("%s: no data and no eof", what)
	}
	return resp, nil
}

// WritePort checks the answer: no more bytes taken than were sent.
func (d *agentDoor) WritePort(ctx context.Context, r *agent.WritePortRequest) (*agent.WritePortResponse, error) {
	what := fmt.Sprintf("WritePort %d", r.Id)
	resp, err := call(d, ctx, kindPortWrite, what, d.ag.WritePort, r)
	if err != nil {
		return nil, err
	}
	if int(resp.Written) > len(r.Data) {
		return nil, d.violation("%s: %d bytes taken of the %d sent", what, resp.Written, len(r.Data))
	}
	return resp, nil
}

func (d *agentDoor) ClosePort(ctx context.Context, r *agent.ClosePortRequest) (*agent.ClosePortResponse, error) {
	return call(d, ctx, kindQuery, fmt.Sprintf("ClosePort %d", r.Id), d.ag.ClosePort, r)
}

func (d *agentDoor) Shutdown(ctx context.Context, r *agent.ShutdownRequest) (*agent.ShutdownResponse, error) {
	return call(d, ctx, kindLifecycle, "Shutdown", d.ag.Shutdown, r)
}

func procName(cid, execID string) string {
	if execID == "" {
		return cid
	}
	return cid + "/" + execID
}
