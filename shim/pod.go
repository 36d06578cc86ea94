package shim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/types/known/anypb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// The pod: its containers, and its life: booted by the first Create (or StartSandbox), run by
// a podRun until it is stopped, failed by the host when its guest misbehaves.

// Options configure a Pod.
type Options struct {
	// Publisher receives the task events, in order.
	Publisher events.Publisher
	// Shutdown is the shim's: Shutdown with no container left ends the process.
	Shutdown shutdown.Service
	// StartVM makes the pod at the first Create.
	StartVM VMStarter
	// DefaultConfigPath is the sandbox configuration used when Create's options name none
	// (DefaultConfigPath, if it exists; else sandbox.DefaultConfig()).
	DefaultConfigPath string
	// Limits bound the waits on the guest (agentdoor.go); zero fields are the defaults.
	Limits GuestLimits
}

// Pod is the pod of one shim: its containers, its run (the VM, the door to its agent, the
// failure policy), its OOM events, and the Sandbox API's sandbox. TaskService and
// SandboxService serve containerd's calls on it. See the package documentation for the lock
// order and the threat model.
type Pod struct {
	*podEnv // the shim's context, the publisher, the guest logger, the limits
	opts    Options

	mu         sync.Mutex
	containers map[string]*Container // guarded by mu; a container is listed from Create's start
	run        *podRun               // guarded by mu; the pod, from its boot to its stop
	booting    chan struct{}         // guarded by mu; non-nil while a Create boots the pod
	// sandbox is the Sandbox API's pod (sandboxlife.go), from CreateSandbox to
	// ShutdownSandbox; nil when the task API makes the pod (its first Create).
	sandbox *podSandbox // guarded by mu
}

// NewPod returns a shim's pod, not yet booted. ctx is the shim's: it carries the logger and
// the namespace.
func NewPod(ctx context.Context, opts Options) *Pod {
	if opts.DefaultConfigPath == "" {
		opts.DefaultConfigPath = DefaultConfigPath
	}
	env := &podEnv{ctx: ctx, pub: opts.Publisher, limits: opts.Limits.withDefaults()}
	return &Pod{podEnv: env, opts: opts, containers: make(map[string]*Container)}
}

// getContainer returns a container whose Create has finished.
func (pod *Pod) getContainer(id string) (*Container, error) {
	pod.mu.Lock()
	c := pod.containers[id]
	pod.mu.Unlock()
	if c == nil {
		return nil, fmt.Errorf("container %s: %w", id, errdefs.ErrNotFound)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.ready {
		return nil, fmt.Errorf("container %s is being created: %w", id, errdefs.ErrFailedPrecondition)
	}
	return c, nil
}

func (pod *Pod) getProcess(id, execID string) (*Container, *process, error) {
	c, err := pod.getContainer(id)
	if err != nil {
		return nil, nil, err
	}
	if execID == "" {
		return c, c.init, nil
	}
	c.mu.Lock()
	p := c.execs[execID]
	c.mu.Unlock()
	if p == nil {
		return nil, nil, fmt.Errorf("exec %s of container %s: %w", execID, id, errdefs.ErrNotFound)
	}
	return c, p, nil
}

// loadConfig decodes runtime options (Create's, or those the shim was started with) into the
// sandbox configuration (loadConfig).
func (pod *Pod) loadConfig(opts *anypb.Any) (*sandbox.Config, error) {
	path, body, err := ConfigSource(opts)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	cfg, err := loadConfig(path, body, pod.opts.DefaultConfigPath)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return cfg, nil
}

// Close is the shim's last act (a shutdown callback): the pod, if one still runs, is stopped
// and the publisher closed.
func (pod *Pod) Close(ctx context.Context) error {
	pod.mu.Lock()
	run := pod.takeRunLocked()
	pod.mu.Unlock()
	var errs []error
	if run != nil {
		errs = append(errs, run.stop(ctx))
	}
	if c, ok := pod.opts.Publisher.(interface{ Close() error }); ok {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}

// sandboxStopTimeout bounds, when StopSandbox gives no timeout, its wait for the exits of the
// processes it killed, and, after the VM stopped, the wait for the exits of those left.
const sandboxStopTimeout = 30 * time.Second

const (
	// oomPace is the least time between two of the guest's OOM answers the shim takes.
	oomPace = 10 * time.Millisecond
	// oomKept is how many containers' last TaskOOM times the OOM loop keeps before it drops
	// those older than GuestLimits.OOMInterval.
	oomKept = 64
)

// currentRun returns the pod's run.
func (pod *Pod) currentRun() (*podRun, error) {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	if pod.run == nil {
		return nil, fmt.Errorf("the pod is not running: %w", errdefs.ErrFailedPrecondition)
	}
	return pod.run, nil
}

// acquirePod returns the pod, booting it if this is the first container (or, bySandbox, for
// StartSandbox). A pod of the Sandbox API is booted only by StartSandbox: a container
// joins it while it is ready. No lock is held while it boots; concurrent Creates wait for
// the boot.
func (pod *Pod) acquirePod(ctx context.Context, req PodRequest, bySandbox bool) (*podRun, error) {
	for {
		pod.mu.Lock()
		if sb := pod.sandbox; sb != nil && !bySandbox && sb.phase != sandboxReady {
			pod.mu.Unlock()
			return nil, fmt.Errorf("sandbox %s is %s, not ready: %w", sb.id, sb.phase, errdefs.ErrFailedPrecondition)
		}
		if run := pod.run; run != nil {
			pod.mu.Unlock()
			if run.id != req.ID {
				return nil, fmt.Errorf("this shim serves sandbox %s, not %s: %w", run.id, req.ID, errdefs.ErrInvalidArgument)
			}
			select {
			case <-run.vm.Done():
				return nil, fmt.Errorf("the pod's VM is gone (%v): %w", run.vm.Err(), errdefs.ErrFailedPrecondition)
			default:
			}
			return run, nil
		}
		if ch := pod.booting; ch != nil {
			pod.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		ch := make(chan struct{})
		pod.booting = ch
		pod.mu.Unlock()

		run, err := pod.boot(ctx, req)
		pod.mu.Lock()
		pod.booting = nil
		pod.run = run
		pod.mu.Unlock()
		close(ch)
		if err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", req.ID, err)
		}
		go pod.watchPod(run)
		go pod.oomLoop(run)
		return run, nil
	}
}

// boot starts the pod's VM for req and configures its guest through the run's door.
func (pod *Pod) boot(ctx context.Context, req PodRequest) (*podRun, error) {
	vm, err := pod.opts.StartVM(ctx, req)
	if err != nil {
		return nil, err
	}
	run := newPodRun(pod.podEnv, vm, req)
	if err := run.configure(ctx, pod.podEnv, req.Sysctls); err != nil {
		pod.stopTakenRun(run)
		return nil, err
	}
	return run, nil
}

// watchPod ends every process when the pod dies: their agent calls are cancelled, and each
// exit watcher then runs the exit sequence (status exitVMDied, or exitKilled for one the host
// was asked to kill).
func (pod *Pod) watchPod(run *podRun) {
	<-run.vm.Done()
	pod.mu.Lock()
	if pod.run != run {
		pod.mu.Unlock()
		return // stopped by us
	}
	run.cancel()
	pod.mu.Unlock()
	log.G(pod.ctx).WithError(run.vm.Err()).Errorf("the pod's VM or virtio-fs server died: every process ends (exit status %d, %d if it was killed)", exitVMDied, exitKilled)
}

// takeRunLocked takes the pod's run from the service, so that nothing new uses it: the caller
// stops it (podRun.stop). pod.mu is held.
func (pod *Pod) takeRunLocked() *podRun {
	run := pod.run
	pod.run = nil
	return run
}

// stopPodIfEmpty stops the pod once no container is left (and none is being created), unless
// it is the Sandbox API's, which StopSandbox stops.
func (pod *Pod) stopPodIfEmpty() {
	pod.mu.Lock()
	if len(pod.containers) > 0 || pod.run == nil || pod.booting != nil || pod.sandbox != nil {
		pod.mu.Unlock()
		return
	}
	run := pod.takeRunLocked()
	pod.mu.Unlock()
	pod.stopTakenRun(run)
}

// takeEndingRun takes the pod's run when c's Delete ends the pod: c is its only container
// (stopPodIfEmpty's conditions once c is gone), or CRI's pod sandbox container, whose task is
// the pod's life (its Delete comes after CRI's StopPodSandbox, or from its cleanup: either way
// the pod is over). Nothing new uses the run then; the caller ends it (endRun) with the other
// containers it returns, still in the pod. Nil otherwise.
func (pod *Pod) takeEndingRun(c *Container) (*podRun, []*Container) {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	run := pod.run
	if pod.containers[c.id] != c || run == nil || pod.booting != nil || pod.sandbox != nil {
		return nil, nil
	}
	if len(pod.containers) != 1 && !(run.sandboxTask && c.id == run.id) {
		return nil, nil
	}
	var others []*Container
	for _, oc := range pod.containers {
		if oc != c {
			others = append(others, oc)
		}
	}
	return pod.takeRunLocked(), others
}

// stopTakenRun stops a run taken from the service, saying in the log when that fails.
func (pod *Pod) stopTakenRun(run *podRun) {
	if err := run.stop(pod.ctx); err != nil {
		log.G(pod.ctx).WithError(err).Error("stopping the pod")
	}
}

// endRun stops a run taken from the service with containers cs still in its pod, then waits
// for the exits of their processes, which the pod's end brings (exitKilled for those marked
// killed, exitVMDied for the others), within sandboxStopTimeout: once it returns, their tasks
// are stopped, and their Deletes need nothing of the pod.
func (pod *Pod) endRun(run *podRun, cs []*Container) {
	pod.stopTakenRun(run)
	var waits []chan struct{}
	for _, c := range cs {
		c.mu.Lock()
		ready := c.ready
		c.mu.Unlock()
		if ready {
			waits = append(waits, c.init.exited)
		}
	}
	ctx, cancel := context.WithTimeout(pod.ctx, sandboxStopTimeout)
	defer cancel()
	if !waitAll(ctx, waits) {
		log.G(pod.ctx).Warnf("processes of the stopped pod had not exited %v after its VM stopped", sandboxStopTimeout)
	}
}

// oomLoop publishes TaskOOM for the OOM kills the agent reports, until the pod ends: at most
// one per container per GuestLimits.OOMInterval, and no more than one of the agent's answers taken per
// oomPace, so that a guest that answers at once, for ever, costs the host little.
func (pod *Pod) oomLoop(run *podRun) {
	last := map[string]time.Time{} // when each container's last TaskOOM went
	for {
		resp, err := run.agent.GetOOMEvent(run.ctx, &agent.GetOOMEventRequest{})
		if err != nil {
			if run.ctx.Err() != nil {
				return
			}
			if errdefs.IsNotImplemented(err) {
				log.G(pod.ctx).WithError(err).Warn("the agent reports no OOM events")
				return
			}
			if errdefs.IsUnavailable(err) {
				return // the agent is shutting down, or was cut off
			}
			if errors.Is(err, ttrpc.ErrClosed) {
				return // the connection is gone: the pod is stopping (Stop hangs up) or dead
			}
			pod.guestLog.warn("oom-wait", log.G(pod.ctx).WithField("error", guestText(err.Error())), "waiting for OOM events")
			if !sleepCtx(run.ctx, time.Second) {
				return
			}
			continue
		}
		id := resp.ContainerId
		pod.mu.Lock()
		_, known := pod.containers[id]
		pod.mu.Unlock()
		switch {
		case !known:
			pod.guestLog.warn("oom-unknown", log.G(pod.ctx).WithField("container", guestText(id)), "the agent reported an OOM kill in an unknown container")
		case time.Since(last[id]) >= pod.limits.OOMInterval:
			last[id] = time.Now()
			pod.publish(&eventstypes.TaskOOM{ContainerID: id})
		}
		if len(last) > oomKept {
			for id, t := range last {
				if time.Since(t) >= pod.limits.OOMInterval { // as good as absent
					delete(last, id)
				}
			}
		}
		if !sleepCtx(run.ctx, oomPace) {
			return
		}
	}
}

// sleepCtx sleeps for d, or until ctx ends; it says whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// shutdownIfIdle ends the shim once it serves no container, boots no pod and has no sandbox
// of the Sandbox API (ShutdownSandbox ends that).
func (pod *Pod) shutdownIfIdle() {
	pod.mu.Lock()
	busy := len(pod.containers) > 0 || pod.booting != nil || pod.sandbox != nil
	pod.mu.Unlock()
	if busy {
		return
	}
	pod.stopPodIfEmpty()
	pod.opts.Shutdown.Shutdown()
}

// podFilesOf is the pod files' directory of the Sandbox API's sandbox id, if this shim has it.
func (pod *Pod) podFilesOf(id string) (string, bool) {
	pod.mu.Lock()
	defer pod.mu.Unlock()
	if pod.sandbox == nil || pod.sandbox.id != id {
		return "", false
	}
	return pod.sandbox.files, true
}

// checkNoPodLocked refuses sandbox id in a shim that has a pod already. pod.mu is held.
func (pod *Pod) checkNoPodLocked(id string) error {
	switch {
	case pod.sandbox != nil:
		return fmt.Errorf("sandbox %s: this shim has sandbox %s already: %w", id, pod.sandbox.id, errdefs.ErrAlreadyExists)
	case pod.run != nil || pod.booting != nil || len(pod.containers) > 0:
		return fmt.Errorf("sandbox %s: this shim runs a pod made through the task API: %w", id, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// waitAll waits for every channel to close, until ctx ends; it says whether they did.
func waitAll(ctx context.Context, chans []chan struct{}) bool {
	for _, c := range chans {
		select {
		case <-c:
		case <-ctx.Done():
			return false
		}
	}
	return true
}
