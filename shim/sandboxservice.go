package shim

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox/network"
)

// The Sandbox API (containerd.runtime.sandbox.v1), served beside the task API: containerd's
// sandbox controller "shim", which CRI uses with sandboxer = "shim". The controller starts
// the shim for the sandbox's id, in a bundle without a spec, and asks it: CreateSandbox (the
// pod's CRI config and network namespace), StartSandbox (the VM boots: the pod exists, with
// no pause container), then WaitSandbox, SandboxStatus, PingSandbox, SandboxMetrics and
// Platform while it runs; StopSandbox, then ShutdownSandbox, which ends the shim. The pod's
// containers come to this shim through the task API (containerd connects them to the address
// the sandbox's shim serves) and join its VM; their Delete does not stop it, and the task
// API's Shutdown does not end the shim while the sandbox is there.

const (
	// shutdownGrace is how long after answering ShutdownSandbox the shim ends: the answer must
	// reach containerd first, whose sandbox controller (unlike its task client) takes a
	// connection closed on it as a failed shutdown.
	shutdownGrace = 200 * time.Millisecond
)

// SandboxService is containerd's Sandbox API for the pod (CRI's sandboxer "shim").
type SandboxService struct{ *Pod }

var _ sandboxAPI.TTRPCSandboxService = (*SandboxService)(nil)

// NewSandboxService returns the Sandbox API of o's pod.
func NewSandboxService(o *Pod) *SandboxService { return &SandboxService{o} }

// RegisterTTRPC registers the Sandbox API (its errors translated by ErrorEdge).
func (s *SandboxService) RegisterTTRPC(server *ttrpc.Server) error {
	sandboxAPI.RegisterTTRPCSandboxService(server, s)
	return nil
}

// sandboxLocked is sandbox id, if it is this shim's. s.mu is held.
func (s *SandboxService) sandboxLocked(id string) (*podSandbox, error) {
	if s.sandbox == nil || s.sandbox.id != id {
		return nil, fmt.Errorf("sandbox %s is not this shim's: %w", id, errdefs.ErrNotFound)
	}
	return s.sandbox, nil
}

// readySandbox returns sandbox id if it is this shim's and ready.
func (s *SandboxService) readySandbox(id string) (*podSandbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, err := s.sandboxLocked(id)
	if err != nil {
		return nil, err
	}
	if sb.phase != sandboxReady {
		return nil, fmt.Errorf("sandbox %s is %s, not ready: %w", id, sb.phase, errdefs.ErrFailedPrecondition)
	}
	return sb, nil
}

// endSandboxLocked records sb's end: stopped, with exit e; WaitSandbox returns. s.mu is held.
func (s *SandboxService) endSandboxLocked(sb *podSandbox, e exit) {
	if sb.phase == sandboxStopped {
		return
	}
	sb.phase, sb.pid, sb.exit = sandboxStopped, 0, e
	close(sb.exited)
}

// criPodConfig decodes CreateSandbox's options: CRI's PodSandboxConfig. No options (not
// CRI) is a pod without a config: no resources, no annotations.
func criPodConfig(a *anypb.Any) (*criapi.PodSandboxConfig, error) {
	if a.GetTypeUrl() == "" && len(a.GetValue()) == 0 {
		return nil, nil
	}
	var pc criapi.PodSandboxConfig
	if !a.MessageIs(&pc) {
		return nil, fmt.Errorf("sandbox options of type %s: want %s", a.GetTypeUrl(), pc.ProtoReflect().Descriptor().FullName())
	}
	if err := a.UnmarshalTo(&pc); err != nil {
		return nil, fmt.Errorf("sandbox options (%s): %v", a.GetTypeUrl(), err)
	}
	return &pc, nil
}

// CreateSandbox makes the pod's sandbox, not yet started: its configuration (the runtime
// options the shim was started with, sized by the pod's resources), its network namespace
// (refused if it is the host's), its annotations: the request's and the pod's, untrusted
// (containerd's pod_annotations filter does not apply here; sandbox.Config.Resolve takes only
// those annotations.enabled lists), and the pod files its containers get (writePodFiles). The
// sandbox's rootfs, if any, is not used: the VM is the sandbox.
func (s *SandboxService) CreateSandbox(ctx context.Context, r *sandboxAPI.CreateSandboxRequest) (_ *sandboxAPI.CreateSandboxResponse, retErr error) {
	if r.SandboxID == "" {
		return nil, fmt.Errorf("a sandbox without an id: %w", errdefs.ErrInvalidArgument)
	}
	s.mu.Lock()
	err := s.checkNoPodLocked(r.SandboxID) // before its files are written over
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	opts, err := readRuntimeOptions(r.BundlePath)
	if err != nil {
		return nil, err
	}
	cfg, err := s.loadConfig(opts)
	if err != nil {
		return nil, err
	}
	pc, err := criPodConfig(r.Options)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %v: %w", r.SandboxID, err, errdefs.ErrInvalidArgument)
	}
	if pc.GetLinux().GetSecurityContext().GetNamespaceOptions().GetNetwork() == criapi.NamespaceMode_NODE {
		return nil, fmt.Errorf("sandbox %s: the pod asks for the node's network namespace: %v: %w", r.SandboxID, network.ErrHostNetwork, errdefs.ErrInvalidArgument)
	}
	if err := network.CheckPodNetNS(r.NetnsPath); err != nil {
		return nil, fmt.Errorf("sandbox %s: %v: %w", r.SandboxID, err, errdefs.ErrInvalidArgument)
	}
	annotations := maps.Clone(pc.GetAnnotations())
	if annotations == nil {
		annotations = map[string]string{}
	}
	maps.Copy(annotations, r.Annotations)
	// The pod's host cgroup, under its cgroup parent: the one podsandbox would give its pause
	// container, where the shim, kvfsd and QEMU then run (cgroup.go).
	cgroup := sandboxCgroupPath(pc.GetLinux().GetCgroupParent(), r.SandboxID)
	ask, err := podAskOfCRI(r.SandboxID, pc, annotations, r.NetnsPath, cgroup)
	if err != nil {
		return nil, err
	}
	req, err := newPodRequest(cfg, ask)
	if err != nil {
		return nil, err
	}
	var cgroupParent string
	if cgroup != "" {
		if cgroupParent, err = podCgroupParent(cgroup); err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", r.SandboxID, err)
		}
	}
	files := filepath.Join(r.BundlePath, podFilesDir)
	if err := mountPodFiles(files); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", r.SandboxID, err)
	}
	defer func() {
		if retErr != nil {
			if err := unmountPodFiles(files); err != nil {
				log.G(ctx).WithError(err).Warn("unmounting the pod files")
			}
		}
	}()
	if err := writePodFiles(files, pc); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", r.SandboxID, err)
	}
	// The record: if this shim dies, the delete action in the sandbox's bundle finds the
	// sandbox, and its cgroup, to clean up.
	if err := writeBundleRecord(r.BundlePath, bundleRecord{SandboxID: r.SandboxID, BaseDir: cfg.BaseDir, Cgroup: cgroup}); err != nil {
		return nil, err
	}
	sb := &podSandbox{id: r.SandboxID, files: files, cgroupParent: cgroupParent, createdAt: time.Now(), exited: make(chan struct{}),
		req: req}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkNoPodLocked(r.SandboxID); err != nil {
		return nil, err
	}
	s.sandbox = sb
	return &sandboxAPI.CreateSandboxResponse{}, nil
}

// StartSandbox boots the pod's VM; it returns once the guest agent answers. A failed start
// ends the sandbox (containerd then shuts it down).
func (s *SandboxService) StartSandbox(ctx context.Context, r *sandboxAPI.StartSandboxRequest) (*sandboxAPI.StartSandboxResponse, error) {
	s.mu.Lock()
	sb, err := s.sandboxLocked(r.SandboxID)
	if err == nil && sb.phase != sandboxCreated {
		err = fmt.Errorf("sandbox %s is %s: %w", sb.id, sb.phase, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	sb.phase = sandboxStarting
	bootCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	sb.cancelStart, sb.started = cancel, make(chan struct{})
	s.mu.Unlock()
	defer close(sb.started)

	run, err := s.acquirePod(bootCtx, sb.req, true)
	s.mu.Lock()
	sb.cancelStart = nil
	if err == nil && bootCtx.Err() != nil {
		// A stop came as the boot ended: the pod is this sandbox's, and the stop waits for
		// this start to stop it.
		err = fmt.Errorf("sandbox %s: stopped while it started: %w", sb.id, context.Cause(bootCtx))
		s.mu.Unlock()
		s.stopSandboxPod(s.ctx, sandboxStopTimeout, true)
		s.mu.Lock()
	}
	if err != nil {
		s.endSandboxLocked(sb, exit{status: exitVMDied, at: time.Now()})
		s.mu.Unlock()
		return nil, err
	}
	pid := run.vm.Pid()
	sb.phase, sb.pid = sandboxReady, pid
	s.mu.Unlock()
	go s.watchSandbox(sb, run.vm)
	return &sandboxAPI.StartSandboxResponse{Pid: pid, CreatedAt: timestamppb.New(sb.createdAt)}, nil
}

// watchSandbox ends the sandbox whose pod died: its processes end with exitVMDied or
// exitKilled (see watchPod), what is left of the VM, the share and the tap is removed, and
// WaitSandbox answers exitVMDied.
func (s *SandboxService) watchSandbox(sb *podSandbox, pod VM) {
	select {
	case <-pod.Done():
	case <-sb.exited:
		return
	}
	s.mu.Lock()
	if sb.phase != sandboxReady {
		s.mu.Unlock()
		return // StopSandbox is stopping it
	}
	sb.phase = sandboxStopping
	s.mu.Unlock()
	log.G(s.ctx).WithError(pod.Err()).WithField("sandbox", sb.id).Error("the sandbox's VM or virtio-fs server died")
	s.stopSandboxPod(s.ctx, sandboxStopTimeout, false)
	s.mu.Lock()
	s.endSandboxLocked(sb, exit{status: exitVMDied, at: time.Now()})
	s.mu.Unlock()
}

// StopSandbox stops the pod: every process of its containers still running is killed
// (SIGKILL, which the host finishes within GuestLimits.KillGrace if the guest does not; CRI
// has stopped its containers already) and their exits waited for, within the request's
// timeout; then the VM, the share and the tap go. The containers stay, stopped, until their
// Delete. Stopping a stopped sandbox is done; WaitSandbox answers exit status 0.
// A sandbox still starting has its boot cancelled and waited for: StartSandbox fails (and
// stops the pod if the boot had got one), and the stop is then done.
func (s *SandboxService) StopSandbox(ctx context.Context, r *sandboxAPI.StopSandboxRequest) (*sandboxAPI.StopSandboxResponse, error) {
	timeout := sandboxStopTimeout
	if r.TimeoutSecs > 0 {
		timeout = time.Duration(r.TimeoutSecs) * time.Second
	}
	s.mu.Lock()
	sb, err := s.sandboxLocked(r.SandboxID)
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	switch sb.phase {
	case sandboxCreated:
		s.endSandboxLocked(sb, exit{at: time.Now()}) // never started: nothing runs
		s.mu.Unlock()
		return &sandboxAPI.StopSandboxResponse{}, nil
	case sandboxStarting:
		// Its boot is cancelled: StartSandbox fails, ends the sandbox, and stops what it
		// booted. containerd's controller gives up on a shim whose stop or shutdown fails
		// (it never deletes it), so a stop during the boot must not be refused.
		sb.cancelStart()
		s.mu.Unlock()
		select {
		case <-sb.started:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return s.StopSandbox(ctx, r)
	case sandboxStopping, sandboxStopped:
		s.mu.Unlock()
		select { // another stop, or the pod's death, is under way: done when it is
		case <-sb.exited:
			return &sandboxAPI.StopSandboxResponse{}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	sb.phase = sandboxStopping
	s.mu.Unlock()
	s.stopSandboxPod(ctx, timeout, true)
	s.mu.Lock()
	s.endSandboxLocked(sb, exit{at: time.Now()})
	s.mu.Unlock()
	return &sandboxAPI.StopSandboxResponse{}, nil
}

// stopSandboxPod stops the pod under the sandbox. With kill, every container not yet exited
// gets SIGKILL (all its processes, the host finishing what the guest does not: see
// Pod.kill), all at once, and their exits are waited for: the kills and the waits
// together within timeout. Then the pod is stopped whatever the guest did, and the exits of
// the processes left (exitKilled, or exitVMDied) are waited for within sandboxStopTimeout:
// once it returns, the containers' tasks are stopped.
func (s *SandboxService) stopSandboxPod(ctx context.Context, timeout time.Duration, kill bool) {
	s.mu.Lock()
	run := s.run
	var cs []*Container
	for _, c := range s.containers {
		c.mu.Lock()
		if c.ready {
			cs = append(cs, c)
		}
		c.mu.Unlock()
	}
	s.mu.Unlock()
	if run == nil {
		return
	}
	if kill {
		markKilled(cs)
		kctx, cancel := context.WithTimeout(ctx, timeout)
		var waits []chan struct{}
		for _, c := range cs {
			p := c.init
			if st, _, _ := p.snapshot(); st == stateStopped || st == stateDeleted {
				continue
			}
			go func() {
				if err := s.kill(kctx, run, c, p, uint32(syscall.SIGKILL), true); err != nil && !errdefs.IsNotFound(err) {
					log.G(s.ctx).WithError(err).WithField("container", p.cid).Warn("killing the container's processes to stop the sandbox")
				}
			}()
			waits = append(waits, p.exited)
		}
		waitAll(kctx, waits)
		cancel()
	}
	s.mu.Lock()
	if s.run == run {
		s.takeRunLocked()
	}
	s.mu.Unlock()
	s.endRun(run, cs)
}

// WaitSandbox returns once the sandbox has stopped, with its exit: 0 when stopped by
// StopSandbox (or never started), exitVMDied when its VM or virtio-fs server died or it
// failed to start.
func (s *SandboxService) WaitSandbox(ctx context.Context, r *sandboxAPI.WaitSandboxRequest) (*sandboxAPI.WaitSandboxResponse, error) {
	s.mu.Lock()
	sb, err := s.sandboxLocked(r.SandboxID)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	select {
	case <-sb.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	s.mu.Lock()
	e := sb.exit
	s.mu.Unlock()
	return &sandboxAPI.WaitSandboxResponse{ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}, nil
}

// SandboxStatus answers the sandbox's state as CRI names it (SANDBOX_READY while its VM
// runs, else SANDBOX_NOTREADY), the VM's pid while it runs, and its times.
func (s *SandboxService) SandboxStatus(ctx context.Context, r *sandboxAPI.SandboxStatusRequest) (*sandboxAPI.SandboxStatusResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, err := s.sandboxLocked(r.SandboxID)
	if err != nil {
		return nil, err
	}
	resp := &sandboxAPI.SandboxStatusResponse{SandboxID: sb.id, Pid: sb.pid, CreatedAt: timestamppb.New(sb.createdAt),
		State: criapi.PodSandboxState_SANDBOX_NOTREADY.String()}
	switch sb.phase {
	case sandboxReady:
		resp.State = criapi.PodSandboxState_SANDBOX_READY.String()
	case sandboxStopped:
		resp.ExitedAt = timestamppb.New(sb.exit.at)
	}
	return resp, nil
}

// PingSandbox answers once the ready sandbox's guest agent answers Ping.
func (s *SandboxService) PingSandbox(ctx context.Context, r *sandboxAPI.PingRequest) (*sandboxAPI.PingResponse, error) {
	if _, err := s.readySandbox(r.SandboxID); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if _, err := run.agent.Ping(ctx, &agent.PingRequest{}); err != nil {
		return nil, fmt.Errorf("the guest agent of sandbox %s: %w", r.SandboxID, err)
	}
	return &sandboxAPI.PingResponse{}, nil
}

// SandboxMetrics answers the pod's metrics. With a cgroup parent the shim's pod cgroup is
// under, they are that parent's CPU and memory on the host, as containerd's podsandbox reads
// them: the VM's, its kvfsd's and the shim's use, which the guest has no say in. Without one,
// the pod's cgroup2 metrics from the guest: the agent's Stats of every container (no
// container id), checked by the door and served on a budget as the task API's Stats are.
func (s *SandboxService) SandboxMetrics(ctx context.Context, r *sandboxAPI.SandboxMetricsRequest) (*sandboxAPI.SandboxMetricsResponse, error) {
	sb, err := s.readySandbox(r.SandboxID)
	if err != nil {
		return nil, err
	}
	if sb.cgroupParent != "" {
		data, err := podCgroupMetrics(sb.cgroupParent)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", r.SandboxID, err)
		}
		return &sandboxAPI.SandboxMetricsResponse{Metrics: &types.Metric{Timestamp: timestamppb.Now(), ID: r.SandboxID, Data: data}}, nil
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	data, err := sb.stats.get(ctx, run.ctx, s.opts.Limits.StatsWait, func(ctx context.Context) (*anypb.Any, error) {
		resp, err := run.agent.Stats(ctx, &agent.StatsRequest{})
		return resp.GetStats(), err
	})
	if err != nil {
		return nil, fmt.Errorf("the agent's stats of sandbox %s: %w", r.SandboxID, err)
	}
	return &sandboxAPI.SandboxMetricsResponse{Metrics: &types.Metric{Timestamp: timestamppb.Now(), ID: r.SandboxID, Data: data}}, nil
}

// Platform is the guest's: Linux on the host's architecture (QEMU runs the host's).
func (s *SandboxService) Platform(ctx context.Context, r *sandboxAPI.PlatformRequest) (*sandboxAPI.PlatformResponse, error) {
	s.mu.Lock()
	_, err := s.sandboxLocked(r.SandboxID)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return &sandboxAPI.PlatformResponse{Platform: &types.Platform{OS: "linux", Architecture: runtime.GOARCH}}, nil
}

// UpdateSandbox is not supported: a VM's size is set when it boots. (containerd's
// controller takes NotImplemented as the shim's answer that it does not update.)
func (s *SandboxService) UpdateSandbox(ctx context.Context, r *sandboxAPI.UpdateSandboxRequest) (*sandboxAPI.UpdateSandboxResponse, error) {
	return nil, fmt.Errorf("update of sandbox %s: a VM's size is set when it boots: %w", r.SandboxID, errdefs.ErrNotImplemented)
}

// ShutdownSandbox stops the sandbox if it still runs, unmounts its pod files, forgets it and
// ends the shim, once it has answered (shutdownGrace). A shim whose CreateSandbox failed has
// no sandbox: it ends too.
func (s *SandboxService) ShutdownSandbox(ctx context.Context, r *sandboxAPI.ShutdownSandboxRequest) (*sandboxAPI.ShutdownSandboxResponse, error) {
	s.mu.Lock()
	sb := s.sandbox
	s.mu.Unlock()
	if sb != nil {
		if sb.id != r.SandboxID {
			return nil, fmt.Errorf("sandbox %s is not this shim's: %w", r.SandboxID, errdefs.ErrNotFound)
		}
		if _, err := s.StopSandbox(ctx, &sandboxAPI.StopSandboxRequest{SandboxID: sb.id}); err != nil {
			return nil, err
		}
		if err := unmountPodFiles(sb.files); err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", sb.id, err)
		}
	}
	s.mu.Lock()
	s.sandbox = nil
	s.mu.Unlock()
	time.AfterFunc(shutdownGrace, s.opts.Shutdown.Shutdown)
	return &sandboxAPI.ShutdownSandboxResponse{}, nil
}
