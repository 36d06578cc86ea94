package shim

import (
	"fmt"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/shim/stdio"
)

// containerRequest is what a task Create asks, checked whole before anything is done: the
// container (its bundle's spec, the guest's spec and the host directories bound into the
// share for it), its stdio, and the pod it joins, or boots if it is the first.
type containerRequest struct {
	task *taskAPI.CreateTaskRequest
	spec *specs.Spec // the bundle's: its hooks and annotations are the host's to run
	// guestSpec is the spec the agent creates the container from (AdaptSpec); nil for CRI's
	// pod sandbox container, which runs nothing: the VM is the pod (sandboxtask.go).
	guestSpec *specs.Spec
	hostBinds []HostBind
	// podTmpfs are the pod's tmpfs volumes the guest's spec binds, and mirrored the share's
	// binds it binds through the agent's copies (kubeletvolumes.go).
	podTmpfs []*agent.PodTmpfs
	mirrored []string
	stdio    stdio.Config
	pod      PodRequest
	// raiseOOM is the container's oom_score_adj if it bounds the pod's (podOOMScoreAdj).
	raiseOOM *int
	// record is what the bundle keeps of the pod, for the delete action of a dead shim.
	record bundleRecord
}

// newContainerRequest checks task Create r (its bundle's spec, the sandbox configuration
// cfg, its containerd namespace ns) and makes the container's request. podFiles says where
// the pod files of a Sandbox API sandbox are, if this shim has that sandbox: such a
// container's /etc/hosts, /etc/resolv.conf and /etc/hostname are the sandbox's, and its
// /dev/shm is the pod's in the guest.
func newContainerRequest(cfg *sandbox.Config, r *taskAPI.CreateTaskRequest, spec *specs.Spec, ns string,
	podFiles func(sandboxID string) (string, bool)) (*containerRequest, error) {
	sandboxID, err := SandboxID(r.ID, spec.Annotations)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	req := &containerRequest{task: r, spec: spec,
		stdio: stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}}
	if _, req.raiseOOM = podOOMScoreAdj(spec); req.raiseOOM != nil {
		if err := sandbox.CheckOOMScoreAdj(*req.raiseOOM); err != nil {
			return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
	}
	if spec.Annotations[AnnotationContainerType] != containerTypeSandbox {
		dir, apiSandbox := podFiles(sandboxID)
		if apiSandbox {
			withPodFiles(spec, dir)
		}
		if req.guestSpec, req.hostBinds, err = AdaptSpec(spec, r.ID); err != nil {
			return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
		if apiSandbox {
			withPodShm(req.guestSpec)
		}
		if req.hostBinds, req.podTmpfs, err = podTmpfsOf(req.guestSpec, req.hostBinds); err != nil {
			return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
		if req.mirrored, err = mirroredOf(req.guestSpec, req.hostBinds); err != nil {
			return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
	}
	ask, err := podAskOfSpec(sandboxID, spec, req.guestSpec)
	if err != nil {
		return nil, err
	}
	if req.pod, err = newPodRequest(cfg, ask); err != nil {
		return nil, err
	}
	req.record = bundleRecord{SandboxID: sandboxID, BaseDir: cfg.BaseDir, Cgroup: req.pod.Cgroup}
	return req, nil
}
