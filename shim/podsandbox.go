package shim

import (
	"context"
	"time"
)

// The Sandbox API's pod (CRI's sandboxer "shim"): what CreateSandbox records, StartSandbox
// boots and the Pod guards (its phase, pid and exit), beside the task API's pod.

// sandboxPhase is where the Sandbox API's pod is: created, starting (its VM booting), ready,
// stopping, stopped. StartSandbox is allowed only once created; containers join it only when
// ready.
type sandboxPhase int

const (
	sandboxCreated sandboxPhase = iota
	sandboxStarting
	sandboxReady
	sandboxStopping
	sandboxStopped
)

func (p sandboxPhase) String() string {
	return [...]string{"created", "starting", "ready", "stopping", "stopped"}[p]
}

// podSandbox is the Sandbox API's pod.
type podSandbox struct {
	id    string
	req   PodRequest // what StartSandbox boots
	files string     // the pod files' directory (writePodFiles)
	// cgroupParent is the cgroupfs path of the pod's cgroup parent (CRI's
	// linux.cgroup_parent; a slice's expanded path) when the shim joins the pod's cgroup under
	// it (req.Cgroup): SandboxMetrics reads it. Set by CreateSandbox.
	cgroupParent string
	// stats is the guest's last Stats answer for the pod: SandboxMetrics' without a cgroup
	// parent (stats.go).
	stats     statsCache
	createdAt time.Time
	exited    chan struct{} // closed when phase becomes sandboxStopped

	// cancelStart cancels StartSandbox's boot, and started is closed when StartSandbox has
	// ended (booted or not): a stop or shutdown that comes during the boot ends it, rather
	// than leave a shim whose containerd gave up on it.
	cancelStart context.CancelFunc // guarded by Pod.mu; set while starting
	started     chan struct{}

	phase sandboxPhase // guarded by Pod.mu
	pid   uint32       // guarded by Pod.mu; the VM's, while it runs
	exit  exit         // guarded by Pod.mu; set when phase becomes sandboxStopped
}

// sandboxStatus is a podSandbox's state at one time.
type sandboxStatus struct {
	phase     sandboxPhase
	pid       uint32
	createdAt time.Time
	exit      exit
}
