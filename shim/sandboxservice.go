package shim

import (
	"context"
	"fmt"
	"maps"
	"runtime"
	"time"

	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

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
type SandboxService struct{ pod *Pod }

var _ sandboxAPI.TTRPCSandboxService = (*SandboxService)(nil)

// NewSandboxService returns the Sandbox API of pod.
func NewSandboxService(pod *Pod) *SandboxService { return &SandboxService{pod} }

// RegisterTTRPC registers the Sandbox API (its errors translated by ErrorEdge).
func (s *SandboxService) RegisterTTRPC(server *ttrpc.Server) error {
	sandboxAPI.RegisterTTRPCSandboxService(server, s)
	return nil
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
func (s *SandboxService) CreateSandbox(ctx context.Context, r *sandboxAPI.CreateSandboxRequest) (*sandboxAPI.CreateSandboxResponse, error) {
	if r.SandboxID == "" {
		return nil, fmt.Errorf("a sandbox without an id: %w", errdefs.ErrInvalidArgument)
	}
	if err := s.pod.checkNoPod(r.SandboxID); err != nil { // before its files are written over
		return nil, err
	}
	opts, err := readRuntimeOptions(r.BundlePath)
	if err != nil {
		return nil, err
	}
	cfg, err := s.pod.loadConfig(opts)
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
	if err := s.pod.createSandbox(r.BundlePath, req, pc); err != nil {
		return nil, err
	}
	return &sandboxAPI.CreateSandboxResponse{}, nil
}

// StartSandbox boots the pod's VM; it returns once the guest agent answers. A failed start
// ends the sandbox (containerd then shuts it down).
func (s *SandboxService) StartSandbox(ctx context.Context, r *sandboxAPI.StartSandboxRequest) (*sandboxAPI.StartSandboxResponse, error) {
	pid, createdAt, err := s.pod.startSandbox(ctx, r.SandboxID)
	if err != nil {
		return nil, err
	}
	return &sandboxAPI.StartSandboxResponse{Pid: pid, CreatedAt: timestamppb.New(createdAt)}, nil
}

// StopSandbox stops the pod (Pod.stopSandbox), within the request's timeout or
// sandboxStopTimeout. Stopping a stopped sandbox is done.
func (s *SandboxService) StopSandbox(ctx context.Context, r *sandboxAPI.StopSandboxRequest) (*sandboxAPI.StopSandboxResponse, error) {
	timeout := sandboxStopTimeout
	if r.TimeoutSecs > 0 {
		timeout = time.Duration(r.TimeoutSecs) * time.Second
	}
	if err := s.pod.stopSandbox(ctx, r.SandboxID, timeout); err != nil {
		return nil, err
	}
	return &sandboxAPI.StopSandboxResponse{}, nil
}

// WaitSandbox returns once the sandbox has stopped, with its exit: 0 when stopped by
// StopSandbox (or never started), 255 when its VM or virtio-fs server died or it failed to
// start.
func (s *SandboxService) WaitSandbox(ctx context.Context, r *sandboxAPI.WaitSandboxRequest) (*sandboxAPI.WaitSandboxResponse, error) {
	e, err := s.pod.waitSandbox(ctx, r.SandboxID)
	if err != nil {
		return nil, err
	}
	return &sandboxAPI.WaitSandboxResponse{ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}, nil
}

// SandboxStatus answers the sandbox's state as CRI names it (SANDBOX_READY while its VM
// runs, else SANDBOX_NOTREADY), the VM's pid while it runs, and its times.
func (s *SandboxService) SandboxStatus(ctx context.Context, r *sandboxAPI.SandboxStatusRequest) (*sandboxAPI.SandboxStatusResponse, error) {
	st, err := s.pod.sandboxStatus(r.SandboxID)
	if err != nil {
		return nil, err
	}
	resp := &sandboxAPI.SandboxStatusResponse{SandboxID: r.SandboxID, Pid: st.pid, CreatedAt: timestamppb.New(st.createdAt),
		State: criapi.PodSandboxState_SANDBOX_NOTREADY.String()}
	switch st.phase {
	case sandboxReady:
		resp.State = criapi.PodSandboxState_SANDBOX_READY.String()
	case sandboxStopped:
		resp.ExitedAt = timestamppb.New(st.exit.at)
	}
	return resp, nil
}

// PingSandbox answers once the ready sandbox's guest agent answers Ping.
func (s *SandboxService) PingSandbox(ctx context.Context, r *sandboxAPI.PingRequest) (*sandboxAPI.PingResponse, error) {
	if err := s.pod.pingSandbox(ctx, r.SandboxID); err != nil {
		return nil, err
	}
	return &sandboxAPI.PingResponse{}, nil
}

// SandboxMetrics answers the pod's metrics (Pod.sandboxMetrics): its host cgroup parent's,
// or the guest's without one.
func (s *SandboxService) SandboxMetrics(ctx context.Context, r *sandboxAPI.SandboxMetricsRequest) (*sandboxAPI.SandboxMetricsResponse, error) {
	data, err := s.pod.sandboxMetrics(ctx, r.SandboxID)
	if err != nil {
		return nil, err
	}
	return &sandboxAPI.SandboxMetricsResponse{Metrics: &types.Metric{Timestamp: timestamppb.Now(), ID: r.SandboxID, Data: data}}, nil
}

// Platform is the guest's: Linux on the host's architecture (QEMU runs the host's).
func (s *SandboxService) Platform(ctx context.Context, r *sandboxAPI.PlatformRequest) (*sandboxAPI.PlatformResponse, error) {
	if err := s.pod.checkSandbox(r.SandboxID); err != nil {
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
	if err := s.pod.shutdownSandbox(ctx, r.SandboxID); err != nil {
		return nil, err
	}
	return &sandboxAPI.ShutdownSandboxResponse{}, nil
}
