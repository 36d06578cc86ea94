package sandbox

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	control "github.com/kvfs/kvfs/api/control/v1"
	"github.com/kvfs/kvfs/internal/rpcedge"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// ControlService implements the control API (api/control/v1) of one sandbox: its owner (a
// shim) serves it on the sandbox's control.sock, where kvfsctl finds it. StopSandbox ends the
// pod as its owner does (the service's StopFunc), never behind its back; a service without
// one stops the sandbox itself. Once StopSandbox has returned, the service has none: it lists
// nothing and answers NotFound. Its
// methods return errors of the kinds above; the ttrpc edge (ControlServer, or
// ErrorInterceptor for another server) turns them into status codes. Its lock guards only
// which sandbox it has: it is never held while the sandbox is asked anything (Stats, Stop).
type ControlService struct {
	stop StopFunc
	mu   sync.Mutex
	sb   *Sandbox // guarded by mu; nil once stopped through StopSandbox
}

var _ control.ControlService = (*ControlService)(nil)

// StopFunc ends a sandbox's pod the way its owner does: for a shim, every process of the pod
// reported exited to containerd and the VM stopped, as when the VM dies; the sandbox itself
// is then the owner's to remove, when containerd deletes what ran in it.
type StopFunc func(ctx context.Context) error

// NewControlService returns the control service of sb (nil: a service with no sandbox), whose
// StopSandbox calls stop (nil: it stops sb itself, for a sandbox no one else owns).
func NewControlService(sb *Sandbox, stop StopFunc) *ControlService {
	return &ControlService{sb: sb, stop: stop}
}

// sandbox is the service's sandbox, or nil.
func (c *ControlService) sandbox() *Sandbox {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sb
}

// ListSandboxes lists the service's sandbox, if it has one.
func (c *ControlService) ListSandboxes(ctx context.Context, _ *control.ListSandboxesRequest) (*control.ListSandboxesResponse, error) {
	resp := &control.ListSandboxesResponse{}
	if s := c.sandbox(); s != nil {
		resp.Sandboxes = append(resp.Sandboxes, summary(s.Stats()))
	}
	return resp, nil
}

// SandboxStatus reports a sandbox and its server's counters.
func (c *ControlService) SandboxStatus(ctx context.Context, req *control.SandboxStatusRequest) (*control.SandboxStatusResponse, error) {
	s, err := c.get(req.GetId())
	if err != nil {
		return nil, err
	}
	st := s.Stats()
	resp := &control.SandboxStatusResponse{Sandbox: summary(st), Server: serverStatus(st.Server)}
	if st.VM != nil {
		resp.Vm = &control.VMStatus{
			Pid:             int64(st.VM.PID),
			StartedUnixNano: unixNano(st.VM.Started),
			UptimeNano:      int64(st.VM.Uptime),
			Running:         st.VM.Running,
			Exit:            st.VM.Exit,
		}
	}
	return resp, nil
}

// logLevels are the levels SetLogLevel accepts: fatal and panic would silence the process's
// errors, so they are refused.
var logLevels = []string{"trace", "debug", "info", "warn", "error"}

// SetLogLevel sets the level of the process's logger (containerd/log), which its in-process
// servers share, and of every confined server of its sandboxes; a confined server started later
// starts at that level. An external daemon's level is its command line's.
func (c *ControlService) SetLogLevel(ctx context.Context, req *control.SetLogLevelRequest) (*control.SetLogLevelResponse, error) {
	level := strings.ToLower(req.GetLevel())
	if level == "warning" {
		level = "warn"
	}
	if !slices.Contains(logLevels, level) {
		return nil, fmt.Errorf("log level %q: want one of %s: %w", req.GetLevel(), strings.Join(logLevels, ", "), errdefs.ErrInvalidArgument)
	}
	prev := levelName(log.GetLevel())
	if err := log.SetLevel(level); err != nil {
		return nil, fmt.Errorf("log level %q: %v: %w", level, err, errdefs.ErrInvalidArgument)
	}
	log.G(ctx).WithField("previous", prev).Infof("log level set to %s", level)
	if s := c.sandbox(); s != nil {
		if err := s.SetServerLogLevel(ctx, level); err != nil {
			return nil, fmt.Errorf("log level set to %s in this process, not in its confined server: %w", level, err)
		}
	}
	return &control.SetLogLevelResponse{PreviousLevel: prev, Level: levelName(log.GetLevel())}, nil
}

func levelName(l log.Level) string {
	if l == log.WarnLevel {
		return "warn" // logrus says "warning"; SetLogLevel takes "warn"
	}
	return l.String()
}

// daxWindowAlign is the granularity of a DAX window (the guest maps it in 2 MiB ranges).
const daxWindowAlign = 2 << 20

// UpdateDAXPolicy replaces the DAX policy of a sandbox's kvfsd, confined or in-process
// (Sandbox.SetDAXPolicy): external daemons answer errdefs.ErrFailedPrecondition. The window is the front-end's (QEMU's
// cache-size), fixed when the VM starts, so a size other than 0 answers errdefs.ErrNotImplemented.
func (c *ControlService) UpdateDAXPolicy(ctx context.Context, req *control.UpdateDAXPolicyRequest) (*control.UpdateDAXPolicyResponse, error) {
	var p passthrough.DAXPolicy
	switch req.GetPolicy() {
	case control.DAXPolicy_DAX_POLICY_NEVER:
		p.Mode = passthrough.DAXNever
	case control.DAXPolicy_DAX_POLICY_ALWAYS:
		p.Mode = passthrough.DAXAlways
	case control.DAXPolicy_DAX_POLICY_INODE:
		p.Mode = passthrough.DAXInode
	case control.DAXPolicy_DAX_POLICY_UNSPECIFIED:
		return nil, fmt.Errorf("DAX policy: none given (want never, always or inode): %w", errdefs.ErrInvalidArgument)
	default:
		return nil, fmt.Errorf("DAX policy: unknown value %d (want never, always or inode): %w", req.GetPolicy(), errdefs.ErrInvalidArgument)
	}
	if w := req.GetWindowBytes(); w%daxWindowAlign != 0 {
		return nil, fmt.Errorf("DAX window size %d: not a multiple of 2 MiB: %w", w, errdefs.ErrInvalidArgument)
	}
	for _, r := range req.GetRules() {
		p.Rules = append(p.Rules, passthrough.DAXRule{Glob: r.GetGlob(), MinSize: r.GetMinSize(), DAX: r.GetDax()})
	}
	if err := p.Validate(); err != nil {
		return nil, fmt.Errorf("DAX policy: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	s, err := c.get(req.GetId())
	if err != nil {
		return nil, err
	}
	if req.GetWindowBytes() != 0 {
		return nil, fmt.Errorf("sandbox %q: the DAX window is the front-end's (QEMU cache-size), fixed when the VM starts; it cannot be resized: %w",
			req.GetId(), errdefs.ErrNotImplemented)
	}
	if err := s.SetDAXPolicy(ctx, p); err != nil {
		return nil, err
	}
	log.G(ctx).WithField("sandbox", s.ID()).WithField("mode", p.Mode).WithField("rules", len(p.Rules)).
		Info("DAX policy updated")
	return &control.UpdateDAXPolicyResponse{}, nil
}

// StopSandbox stops the sandbox and, once it is stopped, forgets it. A sandbox whose Stop
// returns an error stays (in phase stopped, its failure visible in its status) until a later
// StopSandbox, which returns nil for it, forgets it. Concurrent Stops are serialised by the
// sandbox itself (Stop is idempotent).
func (c *ControlService) StopSandbox(ctx context.Context, req *control.StopSandboxRequest) (*control.StopSandboxResponse, error) {
	s, err := c.get(req.GetId())
	if err != nil {
		return nil, err
	}
	stop := s.Stop
	if c.stop != nil {
		stop = c.stop
	}
	if err := stop(ctx); err != nil {
		return nil, fmt.Errorf("stop sandbox %q: %w", s.ID(), err)
	}
	c.mu.Lock()
	if c.sb == s {
		c.sb = nil
	}
	c.mu.Unlock()
	return &control.StopSandboxResponse{}, nil
}

// get returns the service's sandbox if its id is id: an id that is not one is
// errdefs.ErrInvalidArgument, another sandbox's errdefs.ErrNotFound.
func (c *ControlService) get(id string) (*Sandbox, error) {
	if err := checkRequestID(id); err != nil {
		return nil, err
	}
	if s := c.sandbox(); s != nil && s.ID() == id {
		return s, nil
	}
	return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
}

func checkRequestID(id string) error {
	if err := checkID(id); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

func summary(st Stats) *control.SandboxSummary {
	sum := &control.SandboxSummary{
		Id:            st.ID,
		Phase:         string(st.Phase),
		Daemon:        st.Server.Daemon,
		ServerRunning: st.Server.Running,
		Failure:       st.Failure,
	}
	if st.VM != nil {
		sum.VmPid, sum.VmRunning = int64(st.VM.PID), st.VM.Running
	}
	return sum
}

func serverStatus(s ServerStats) *control.ServerStatus {
	out := &control.ServerStatus{
		Daemon:          s.Daemon,
		Pid:             int64(s.PID),
		StartedUnixNano: unixNano(s.Started),
		UptimeNano:      int64(s.Uptime),
		Running:         s.Running,
		Restarts:        uint32(min(s.Restarts, math.MaxUint32)),
		LastFailure:     s.LastFailure,
	}
	if s.FS == nil {
		return out
	}
	f := s.FS.FUSE
	st := &control.ServerStats{
		BytesRead:       f.BytesRead,
		BytesWritten:    f.BytesWritten,
		Malformed:       f.Malformed,
		Panics:          f.Panics,
		CachedInodes:    uint64(max(s.FS.FS.CachedInodes, 0)),
		OpenHandles:     uint64(max(s.FS.FS.OpenFiles, 0)),
		OpenFds:         uint64(max(s.FS.FS.Fds, 0)),
		BlockedRequests: uint64(max(f.Waiting, 0)),
		QueueDepth:      s.FS.InFlight,
	}
	for i := range fuse.LatencyBuckets - 1 {
		st.LatencyBucketBoundsSeconds = append(st.LatencyBucketBoundsSeconds, float64(uint64(1)<<i)/1e6)
	}
	names := make([]string, 0, len(f.Ops))
	for name := range f.Ops {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		o := f.Ops[name]
		st.Ops = append(st.Ops, &control.OpStats{
			Opcode:         name,
			Count:          o.Count,
			Errors:         o.Errors,
			LatencyBuckets: slices.Clone(o.Latency[:]),
			TotalTimeNano:  uint64(max(o.TotalTime, 0)),
		})
	}
	out.Stats = st
	return out
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// ErrorInterceptor is the ttrpc edge of the control API, the policy of every kvfs ttrpc
// server (internal/rpcedge): a handler's panic becomes Internal, an error's kind its status
// code, and each call is logged at debug level.
var ErrorInterceptor = rpcedge.Interceptor(log.G, nil)
