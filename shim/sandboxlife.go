package shim

// The Sandbox API's pod, the Pod's to run (SandboxService is its adapter): created
// (addSandbox), started (its VM booted), stopped (its processes killed, then its VM), waited
// for, and shut down (the shim ends).

import (
	"context"
	"fmt"
	"path/filepath"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"google.golang.org/protobuf/types/known/anypb"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// sandboxLocked is sandbox id, if it is this shim's. pod.mu is held.
func (pod *Pod) sandboxLocked(id string) (*podSandbox, error) {
	if pod.sandbox == nil || pod.sandbox.id != id {
		return nil, fmt.Errorf("sandbox %s is not this shim's: %w", id, errdefs.ErrNotFound)
	}
	return pod.sandbox, nil
}

// readySandbox returns sandbox id if it is this shim's and ready.
func (pod *Pod) readySandbox(id string) (*podSandbox, error) {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	sb, err := pod.sandboxLocked(id)
	if err != nil {
		return nil, err
	}
	if sb.phase != sandboxReady {
		return nil, fmt.Errorf("sandbox %s is %s, not ready: %w", id, sb.phase, errdefs.ErrFailedPrecondition)
	}
	return sb, nil
}

// endSandboxLocked records sb's end: stopped, with exit e; WaitSandbox returns. pod.mu is held.
func (pod *Pod) endSandboxLocked(sb *podSandbox, e exit) {
	if sb.phase == sandboxStopped {
		return
	}
	sb.phase, sb.pid, sb.exit = sandboxStopped, 0, e
	close(sb.exited)
}

// startSandbox boots the VM of sandbox id; it returns once the guest agent answers, with the
// VM's pid and the sandbox's creation time. A failed start ends the sandbox (containerd then
// shuts it down).
func (pod *Pod) startSandbox(ctx context.Context, id string) (uint32, time.Time, error) {
	pod.mu.Lock()
	sb, err := pod.sandboxLocked(id)
	if err == nil && sb.phase != sandboxCreated {
		err = fmt.Errorf("sandbox %s is %s: %w", sb.id, sb.phase, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		pod.mu.Unlock()
		return 0, time.Time{}, err
	}
	sb.phase = sandboxStarting
	bootCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	sb.cancelStart, sb.started = cancel, make(chan struct{})
	pod.mu.Unlock()
	defer close(sb.started)

	run, err := pod.acquirePod(bootCtx, sb.req, true)
	pod.mu.Lock()
	sb.cancelStart = nil
	if err == nil && bootCtx.Err() != nil {
		// A stop came as the boot ended: the pod is this sandbox's, and the stop waits for
		// this start to stop it.
		err = fmt.Errorf("sandbox %s: stopped while it started: %w", sb.id, context.Cause(bootCtx))
		pod.mu.Unlock()
		pod.stopSandboxPod(pod.ctx, sandboxStopTimeout, true)
		pod.mu.Lock()
	}
	if err != nil {
		pod.endSandboxLocked(sb, exit{status: exitVMDied, at: time.Now()})
		pod.mu.Unlock()
		return 0, time.Time{}, err
	}
	pid := run.vm.Pid()
	sb.phase, sb.pid = sandboxReady, pid
	pod.mu.Unlock()
	go pod.watchSandbox(sb, run.vm)
	return pid, sb.createdAt, nil
}

// watchSandbox ends the sandbox whose pod died: its processes end with exitVMDied or
// exitKilled (see watchPod), what is left of the VM, the share and the tap is removed, and
// WaitSandbox answers exitVMDied.
func (pod *Pod) watchSandbox(sb *podSandbox, vm VM) {
	select {
	case <-vm.Done():
	case <-sb.exited:
		return
	}
	pod.mu.Lock()
	if sb.phase != sandboxReady {
		pod.mu.Unlock()
		return // StopSandbox is stopping it
	}
	sb.phase = sandboxStopping
	pod.mu.Unlock()
	log.G(pod.ctx).WithError(vm.Err()).WithField("sandbox", sb.id).Error("the sandbox's VM or virtio-fs server died")
	pod.stopSandboxPod(pod.ctx, sandboxStopTimeout, false)
	pod.mu.Lock()
	pod.endSandboxLocked(sb, exit{status: exitVMDied, at: time.Now()})
	pod.mu.Unlock()
}

// stopSandbox stops the pod of sandbox id: every process of its containers still running is killed
// (SIGKILL, which the host finishes within GuestLimits.KillGrace if the guest does not; CRI
// has stopped its containers already) and their exits waited for, within the request's
// timeout; then the VM, the share and the tap go. The containers stay, stopped, until their
// Delete. Stopping a stopped sandbox is done; WaitSandbox answers exit status 0.
// A sandbox still starting has its boot cancelled and waited for: StartSandbox fails (and
// stops the pod if the boot had got one), and the stop is then done.
func (pod *Pod) stopSandbox(ctx context.Context, id string, timeout time.Duration) error {
	pod.mu.Lock()
	sb, err := pod.sandboxLocked(id)
	if err != nil {
		pod.mu.Unlock()
		return err
	}
	switch sb.phase {
	case sandboxCreated:
		pod.endSandboxLocked(sb, exit{at: time.Now()}) // never started: nothing runs
		pod.mu.Unlock()
		return nil
	case sandboxStarting:
		// Its boot is cancelled: StartSandbox fails, ends the sandbox, and stops what it
		// booted. containerd's controller gives up on a shim whose stop or shutdown fails
		// (it never deletes it), so a stop during the boot must not be refused.
		sb.cancelStart()
		pod.mu.Unlock()
		select {
		case <-sb.started:
		case <-ctx.Done():
			return ctx.Err()
		}
		return pod.stopSandbox(ctx, id, timeout)
	case sandboxStopping, sandboxStopped:
		pod.mu.Unlock()
		select { // another stop, or the pod's death, is under way: done when it is
		case <-sb.exited:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	sb.phase = sandboxStopping
	pod.mu.Unlock()
	pod.stopSandboxPod(ctx, timeout, true)
	pod.mu.Lock()
	pod.endSandboxLocked(sb, exit{at: time.Now()})
	pod.mu.Unlock()
	return nil
}

// stopSandboxPod stops the pod under the sandbox. With kill, every container not yet exited
// gets SIGKILL (all its processes, the host finishing what the guest does not: see
// Container.kill), all at once, and their exits are waited for: the kills and the waits
// together within timeout. Then the pod is stopped whatever the guest did, and the exits of
// the processes left (exitKilled, or exitVMDied) are waited for within sandboxStopTimeout:
// once it returns, the containers' tasks are stopped.
func (pod *Pod) stopSandboxPod(ctx context.Context, timeout time.Duration, kill bool) {
	pod.mu.Lock()
	run := pod.run
	var cs []*Container
	for _, c := range pod.containers {
		c.mu.Lock()
		if c.ready {
			cs = append(cs, c)
		}
		c.mu.Unlock()
	}
	pod.mu.Unlock()
	if run == nil {
		return
	}
	if kill {
		markAllKilled(cs)
		kctx, cancel := context.WithTimeout(ctx, timeout)
		var waits []chan struct{}
		for _, c := range cs {
			p := c.init
			if st, _, _ := p.snapshot(); st == stateStopped || st == stateDeleted {
				continue
			}
			go func() {
				if err := c.kill(kctx, run, p, uint32(syscall.SIGKILL), true); err != nil && !errdefs.IsNotFound(err) {
					log.G(pod.ctx).WithError(err).WithField("container", p.cid).Warn("killing the container's processes to stop the sandbox")
				}
			}()
			waits = append(waits, p.exited)
		}
		waitAll(kctx, waits)
		cancel()
	}
	pod.mu.Lock()
	if pod.run == run {
		pod.takeRunLocked()
	}
	pod.mu.Unlock()
	pod.endRun(run, cs)
}

// waitSandbox returns once sandbox id has stopped, with its exit: 0 when stopped by
// stopSandbox (or never started), exitVMDied when its VM or virtio-fs server died or it
// failed to start.
func (pod *Pod) waitSandbox(ctx context.Context, id string) (exit, error) {
	pod.mu.Lock()
	sb, err := pod.sandboxLocked(id)
	pod.mu.Unlock()
	if err != nil {
		return exit{}, err
	}
	select {
	case <-sb.exited:
	case <-ctx.Done():
		return exit{}, ctx.Err()
	}
	pod.mu.Lock()
	defer pod.mu.Unlock()
	return sb.exit, nil
}

// sandboxStatus is sandbox id's status now.
func (pod *Pod) sandboxStatus(id string) (sandboxStatus, error) {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	sb, err := pod.sandboxLocked(id)
	if err != nil {
		return sandboxStatus{}, err
	}
	return sandboxStatus{phase: sb.phase, pid: sb.pid, createdAt: sb.createdAt, exit: sb.exit}, nil
}

// checkSandbox says whether sandbox id is this shim's.
func (pod *Pod) checkSandbox(id string) error {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	_, err := pod.sandboxLocked(id)
	return err
}

// pingSandbox returns once the guest agent of ready sandbox id answers Ping.
func (pod *Pod) pingSandbox(ctx context.Context, id string) error {
	if _, err := pod.readySandbox(id); err != nil {
		return err
	}
	run, err := pod.currentRun()
	if err != nil {
		return err
	}
	if _, err := run.agent.Ping(ctx, &agent.PingRequest{}); err != nil {
		return fmt.Errorf("the guest agent of sandbox %s: %w", id, err)
	}
	return nil
}

// sandboxMetrics is the metrics of ready sandbox id's pod. With a cgroup parent the shim's pod cgroup is
// under, they are that parent's CPU and memory on the host, as containerd's podsandbox reads
// them: the VM's, its kvfsd's and the shim's use, which the guest has no say in. Without one,
// the pod's cgroup2 metrics from the guest: the agent's Stats of every container (no
// container id), checked by the door and served on a budget as the task API's Stats are.
func (pod *Pod) sandboxMetrics(ctx context.Context, id string) (*anypb.Any, error) {
	sb, err := pod.readySandbox(id)
	if err != nil {
		return nil, err
	}
	if sb.cgroupParent != "" {
		data, err := podCgroupMetrics(sb.cgroupParent)
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", id, err)
		}
		return data, nil
	}
	run, err := pod.currentRun()
	if err != nil {
		return nil, err
	}
	data, err := sb.stats.get(ctx, run.ctx, pod.limits.StatsWait, func(ctx context.Context) (*anypb.Any, error) {
		resp, err := run.agent.Stats(ctx, &agent.StatsRequest{})
		return resp.GetStats(), err
	})
	if err != nil {
		return nil, fmt.Errorf("the agent's stats of sandbox %s: %w", id, err)
	}
	return data, nil
}

// shutdownSandbox stops sandbox id if it still runs, unmounts its pod files, forgets it and
// ends the shim, once it has answered (shutdownGrace). A shim whose CreateSandbox failed has
// no sandbox: it ends too.
func (pod *Pod) shutdownSandbox(ctx context.Context, id string) error {
	pod.mu.Lock()
	sb := pod.sandbox
	pod.mu.Unlock()
	if sb != nil {
		if sb.id != id {
			return fmt.Errorf("sandbox %s is not this shim's: %w", id, errdefs.ErrNotFound)
		}
		if err := pod.stopSandbox(ctx, sb.id, sandboxStopTimeout); err != nil {
			return err
		}
		if err := unmountPodFiles(sb.files); err != nil {
			return fmt.Errorf("sandbox %s: %w", sb.id, err)
		}
	}
	pod.mu.Lock()
	pod.sandbox = nil
	pod.mu.Unlock()
	time.AfterFunc(shutdownGrace, pod.opts.Shutdown.Shutdown)
	return nil
}

// createSandbox makes the sandbox of req (its Cgroup under CRI's cgroup parent), not yet
// started, in bundle: the pod files its containers get (writePodFiles, from CRI's pod config
// pc), then the bundle's record (if this shim dies, the delete action in the sandbox's bundle
// finds the sandbox, and its cgroup, to clean up). A failure leaves no pod files mounted.
func (pod *Pod) createSandbox(bundle string, req PodRequest, pc *criapi.PodSandboxConfig) (retErr error) {
	var cgroupParent string
	if req.Cgroup != "" {
		var err error
		if cgroupParent, err = podCgroupParent(req.Cgroup); err != nil {
			return fmt.Errorf("sandbox %s: %w", req.ID, err)
		}
	}
	files := filepath.Join(bundle, podFilesDir)
	if err := mountPodFiles(files); err != nil {
		return fmt.Errorf("sandbox %s: %w", req.ID, err)
	}
	defer func() {
		if retErr != nil {
			if err := unmountPodFiles(files); err != nil {
				log.G(pod.ctx).WithError(err).Warn("unmounting the pod files")
			}
		}
	}()
	if err := writePodFiles(files, pc); err != nil {
		return fmt.Errorf("sandbox %s: %w", req.ID, err)
	}
	if err := writeBundleRecord(bundle, bundleRecord{SandboxID: req.ID, BaseDir: req.Config.BaseDir, Cgroup: req.Cgroup}); err != nil {
		return err
	}
	return pod.addSandbox(&podSandbox{id: req.ID, files: files, cgroupParent: cgroupParent, createdAt: time.Now(),
		exited: make(chan struct{}), req: req})
}

// checkNoPod refuses sandbox id in a shim that has a pod already.
func (pod *Pod) checkNoPod(id string) error {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	return pod.checkNoPodLocked(id)
}

// addSandbox makes sb the shim's sandbox, unless it has a pod already.
func (pod *Pod) addSandbox(sb *podSandbox) error {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	if err := pod.checkNoPodLocked(sb.id); err != nil {
		return err
	}
	pod.sandbox = sb
	return nil
}
