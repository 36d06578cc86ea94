package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"google.golang.org/protobuf/types/known/anypb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// The pod's owner: the state the task service and the Sandbox API service share, and the
// pod's life as they see it: booted by the first Create (or StartSandbox), owned by a podRun
// until it is stopped, failed by the host when its guest misbehaves.

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

// DefaultConfigPath is where the node's sandbox configuration is, if it has one.
const DefaultConfigPath = "/etc/kvfs/configuration.toml"

// ConfigFileEnv is the environment variable that names the sandbox configuration in place of
// DefaultConfigPath, for a runtime handler without options: set in containerd's environment,
// its shims inherit it. Such a handler is what runs user-namespaced CRI pods: containerd's
// CRI (v2.4) gives their tasks runc's options (IoUid, IoGid), and fails on a handler whose
// options are of another type, as ConfigPath's are.
const ConfigFileEnv = "KVFS_CONFIG_FILE"

// Pod owns the pod of one shim: its containers, its run (the VM, the door to its agent,
// the failure policy), and the Sandbox API's sandbox. TaskService and SandboxService serve
// containerd's calls on it. See the package documentation for the lock order and the threat
// model.
type Pod struct {
	ctx  context.Context // the shim's; outlives requests
	opts Options

	mu         sync.Mutex
	containers map[string]*Container // guarded by mu; a container is listed from Create's start
	run        *podRun               // guarded by mu; the pod, from its boot to its stop
	booting    chan struct{}         // guarded by mu; non-nil while a Create boots the pod
	guestLog   guestLogger           // the log lines the guest can cause, rate-limited
	// sandbox is the Sandbox API's pod (sandboxservice.go), from CreateSandbox to
	// ShutdownSandbox; nil when the task API makes the pod (its first Create).
	sandbox *podSandbox // guarded by mu
}

// NewPod returns the owner of a shim's pod, with no pod yet. ctx is the shim's: it
// carries the logger and the namespace.
func NewPod(ctx context.Context, opts Options) *Pod {
	if opts.DefaultConfigPath == "" {
		opts.DefaultConfigPath = DefaultConfigPath
	}
	opts.Limits = opts.Limits.withDefaults()
	return &Pod{ctx: ctx, opts: opts, containers: make(map[string]*Container)}
}

func (o *Pod) publish(evt any) {
	if err := o.opts.Publisher.Publish(o.ctx, runtime.GetTopic(evt), evt); err != nil {
		log.G(o.ctx).WithError(err).Error("publish event")
	}
}

// getContainer returns a container whose Create has finished.
func (o *Pod) getContainer(id string) (*Container, error) {
	o.mu.Lock()
	c := o.containers[id]
	o.mu.Unlock()
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

func (o *Pod) getProcess(id, execID string) (*Container, *process, error) {
	c, err := o.getContainer(id)
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
func (o *Pod) loadConfig(opts *anypb.Any) (*sandbox.Config, error) {
	path, body, err := ConfigSource(opts)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	cfg, err := loadConfig(path, body, o.opts.DefaultConfigPath)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return cfg, nil
}

// loadConfig reads the sandbox configuration runtime options give (runtimeoptions'
// ConfigBody, else ConfigPath), else the file $KVFS_CONFIG_FILE names (ConfigFileEnv), else
// defaultPath if it exists, else the defaults.
func loadConfig(path string, body []byte, defaultPath string) (*sandbox.Config, error) {
	switch {
	case len(body) > 0:
		return sandbox.ParseConfig(body)
	case path != "":
		return sandbox.LoadConfig(path)
	}
	if env := os.Getenv(ConfigFileEnv); env != "" {
		if !filepath.IsAbs(env) {
			return nil, fmt.Errorf("%s=%q: not an absolute path", ConfigFileEnv, env)
		}
		return sandbox.LoadConfig(env)
	}
	if _, err := os.Stat(defaultPath); err == nil {
		return sandbox.LoadConfig(defaultPath)
	}
	return sandbox.DefaultConfig(), nil
}

// Close is the shim's last act (a shutdown callback): the pod, if one still runs, is stopped
// and the publisher closed.
func (o *Pod) Close(ctx context.Context) error {
	o.mu.Lock()
	run := o.takeRunLocked()
	o.mu.Unlock()
	var errs []error
	if run != nil {
		run.cancel()
		errs = append(errs, run.vm.Stop(ctx))
	}
	if c, ok := o.opts.Publisher.(interface{ Close() error }); ok {
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

// podRun is the pod from its boot to its stop: its VM (a Pod), the door to its agent, the
// agent the services call (the door, fronted by the pod sandbox's task when CRI's podsandbox
// runs the pod), and the pod's life: its context, with which the door ends every call to the
// agent and the processes' own calls end.
type podRun struct {
	id string
	// sandboxTask says the pod was booted for CRI's pod sandbox container (its id is id),
	// whose task is the pod's life: its Delete ends the pod.
	sandboxTask bool
	vm          VM
	door        *agentDoor
	agent       agent.AgentService
	ctx         context.Context // ends when the pod dies or is stopped
	cancel      context.CancelFunc
}

// newPodRun is the run of pod, booted for req. The door's failure policy kills the VM: the
// pod's death then ends every process (watch). The frames the pod's agent connection drops,
// if it is filtered (agentwire.go), count at the door.
func (o *Pod) newPodRun(pod VM, req PodRequest) *podRun {
	ctx, cancel := context.WithCancel(context.WithoutCancel(o.ctx))
	r := &podRun{id: req.ID, sandboxTask: req.SandboxTask, vm: pod, ctx: ctx, cancel: cancel}
	r.door = newAgentDoor(o.ctx, ctx, pod.Agent(), o.opts.Limits, &o.guestLog, func(why error) {
		log.G(o.ctx).WithError(why).Error("the pod's guest is cut off: killing its VM")
		pod.Kill(why)
	})
	if w, ok := pod.(wireFiltered); ok && w.agentWire() != nil {
		w.agentWire().watch(func(v wireViolation) {
			r.door.broke(v.kind, fmt.Errorf("the guest agent broke the protocol: %w", v), v.fatal)
		})
	}
	r.agent = r.door
	if req.SandboxTask {
		r.agent = newSandboxAgent(r.door, req.ID, pod.Pid())
	}
	return r
}

// live says the pod's agent can still be asked: the pod has not died (its context ends just
// after) nor been stopped.
func (r *podRun) live() bool {
	select {
	case <-r.vm.Done():
		return false
	default:
		return r.ctx.Err() == nil
	}
}

// currentRun returns the pod's run.
func (o *Pod) currentRun() (*podRun, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.run == nil {
		return nil, fmt.Errorf("the pod is not running: %w", errdefs.ErrFailedPrecondition)
	}
	return o.run, nil
}

// acquirePod returns the pod, booting it if this is the first container (or, bySandbox, for
// StartSandbox). A pod of the Sandbox API is booted only by StartSandbox: a container
// joins it while it is ready. No lock is held while it boots; concurrent Creates wait for
// the boot.
func (o *Pod) acquirePod(ctx context.Context, req PodRequest, bySandbox bool) (*podRun, error) {
	for {
		o.mu.Lock()
		if sb := o.sandbox; sb != nil && !bySandbox && sb.phase != sandboxReady {
			o.mu.Unlock()
			return nil, fmt.Errorf("sandbox %s is %s, not ready: %w", sb.id, sb.phase, errdefs.ErrFailedPrecondition)
		}
		if run := o.run; run != nil {
			o.mu.Unlock()
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
		if ch := o.booting; ch != nil {
			o.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		ch := make(chan struct{})
		o.booting = ch
		o.mu.Unlock()

		pod, err := o.opts.StartVM(ctx, req)
		var run *podRun
		if err == nil {
			run = o.newPodRun(pod, req)
		}
		o.mu.Lock()
		o.booting = nil
		o.run = run
		o.mu.Unlock()
		close(ch)
		if err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", req.ID, err)
		}
		go o.watchPod(run)
		go o.oomLoop(run)
		return run, nil
	}
}

// watchPod ends every process when the pod dies: their agent calls are cancelled, and each
// exit watcher then runs the exit sequence (status exitVMDied, or exitKilled for one the host
// was asked to kill).
func (o *Pod) watchPod(run *podRun) {
	<-run.vm.Done()
	o.mu.Lock()
	if o.run != run {
		o.mu.Unlock()
		return // stopped by us
	}
	run.cancel()
	o.mu.Unlock()
	log.G(o.ctx).WithError(run.vm.Err()).Errorf("the pod's VM or virtio-fs server died: every process ends (exit status %d, %d if it was killed)", exitVMDied, exitKilled)
}

// takeRunLocked takes the pod's run from the service, so that nothing new uses it: the caller
// stops it (podRun.stop). o.mu is held.
func (o *Pod) takeRunLocked() *podRun {
	run := o.run
	o.run = nil
	return run
}

// stop stops the pod's VM: the agent's Shutdown answers the pending GetOOMEvent
// (Unavailable), which ends the OOM loop; the run's context goes after, and with it the
// calls left.
func (run *podRun) stop(ctx context.Context) error {
	err := run.vm.Stop(ctx)
	run.cancel()
	return err
}

// stopPodIfEmpty stops the pod once no container is left (and none is being created), unless
// it is the Sandbox API's, which StopSandbox stops.
func (o *Pod) stopPodIfEmpty() {
	o.mu.Lock()
	if len(o.containers) > 0 || o.run == nil || o.booting != nil || o.sandbox != nil {
		o.mu.Unlock()
		return
	}
	run := o.takeRunLocked()
	o.mu.Unlock()
	o.stopTakenRun(run)
}

// takeEndingRun takes the pod's run when c's Delete ends the pod: c is its only container
// (stopPodIfEmpty's conditions once c is gone), or CRI's pod sandbox container, whose task is
// the pod's life (its Delete comes after CRI's StopPodSandbox, or from its cleanup: either way
// the pod is over). Nothing new uses the run then; the caller ends it (endRun) with the other
// containers it returns, still in the pod. Nil otherwise.
func (o *Pod) takeEndingRun(c *Container) (*podRun, []*Container) {
	o.mu.Lock()
	defer o.mu.Unlock()
	run := o.run
	if o.containers[c.id] != c || run == nil || o.booting != nil || o.sandbox != nil {
		return nil, nil
	}
	if len(o.containers) != 1 && !(run.sandboxTask && c.id == run.id) {
		return nil, nil
	}
	var others []*Container
	for _, oc := range o.containers {
		if oc != c {
			others = append(others, oc)
		}
	}
	return o.takeRunLocked(), others
}

// stopTakenRun stops a run taken from the service, saying in the log when that fails.
func (o *Pod) stopTakenRun(run *podRun) {
	if err := run.stop(o.ctx); err != nil {
		log.G(o.ctx).WithError(err).Error("stopping the pod")
	}
}

// endRun stops a run taken from the service with containers cs still in its pod, then waits
// for the exits of their processes, which the pod's end brings (exitKilled for those marked
// killed, exitVMDied for the others), within sandboxStopTimeout: once it returns, their tasks
// are stopped, and their Deletes need nothing of the pod.
func (o *Pod) endRun(run *podRun, cs []*Container) {
	o.stopTakenRun(run)
	var waits []chan struct{}
	for _, c := range cs {
		c.mu.Lock()
		ready := c.ready
		c.mu.Unlock()
		if ready {
			waits = append(waits, c.init.exited)
		}
	}
	ctx, cancel := context.WithTimeout(o.ctx, sandboxStopTimeout)
	defer cancel()
	if !waitAll(ctx, waits) {
		log.G(o.ctx).Warnf("processes of the stopped pod had not exited %v after its VM stopped", sandboxStopTimeout)
	}
}

// oomLoop publishes TaskOOM for the OOM kills the agent reports, until the pod ends: at most
// one per container per GuestLimits.OOMInterval, and no more than one of the agent's answers taken per
// oomPace, so that a guest that answers at once, for ever, costs the host little.
func (o *Pod) oomLoop(run *podRun) {
	last := map[string]time.Time{} // when each container's last TaskOOM went
	for {
		resp, err := run.agent.GetOOMEvent(run.ctx, &agent.GetOOMEventRequest{})
		if err != nil {
			if run.ctx.Err() != nil {
				return
			}
			if errdefs.IsNotImplemented(err) {
				log.G(o.ctx).WithError(err).Warn("the agent reports no OOM events")
				return
			}
			if errdefs.IsUnavailable(err) {
				return // the agent is shutting down, or was cut off
			}
			if errors.Is(err, ttrpc.ErrClosed) {
				return // the connection is gone: the pod is stopping (Stop hangs up) or dead
			}
			o.guestLog.warn("oom-wait", log.G(o.ctx).WithField("error", guestText(err.Error())), "waiting for OOM events")
			if !sleepCtx(run.ctx, time.Second) {
				return
			}
			continue
		}
		id := resp.ContainerId
		o.mu.Lock()
		_, known := o.containers[id]
		o.mu.Unlock()
		switch {
		case !known:
			o.guestLog.warn("oom-unknown", log.G(o.ctx).WithField("container", guestText(id)), "the agent reported an OOM kill in an unknown container")
		case time.Since(last[id]) >= o.opts.Limits.OOMInterval:
			last[id] = time.Now()
			o.publish(&eventstypes.TaskOOM{ContainerID: id})
		}
		if len(last) > oomKept {
			for id, t := range last {
				if time.Since(t) >= o.opts.Limits.OOMInterval { // as good as absent
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

// kill sends sig to p (with all, to every process of p's container). A SIGKILL is the host's
// to finish, whatever the agent answers: the processes it is for are marked killed (exitKilled
// if the VM has to go), and unless the guest reports each one's exit within
// GuestLimits.KillGrace, the host ends it (enforceKill). Without an answer the SIGKILL succeeds
// for containerd all the same; an answer that refuses it (the guest says the process has
// exited: NotFound) goes to containerd as it is.
func (o *Pod) kill(ctx context.Context, run *podRun, c *Container, p *process, sig uint32, all bool) error {
	enforce := sig == uint32(syscall.SIGKILL)
	var execs []*process // with all, the init's execs the SIGKILL is for too
	if enforce {
		p.markKilled()
		if all && p.execID == "" {
			c.mu.Lock()
			for _, e := range c.execs {
				e.markKilled()
				execs = append(execs, e)
			}
			c.mu.Unlock()
		}
	}
	_, err := run.agent.SignalProcess(ctx, &agent.SignalProcessRequest{ContainerId: p.cid, ExecId: p.execID, Signal: sig, All: all})
	if enforce {
		// A refusal is the guest's word too: an exited process's report follows at once.
		go o.enforceKill(run, c, p)
		for _, e := range execs {
			go o.enforceKill(run, c, e)
		}
		if errors.Is(err, context.DeadlineExceeded) || errdefs.IsUnavailable(err) {
			log.G(o.ctx).WithError(err).WithField("process", p.name()).Warnf("no answer to SIGKILL: the host ends the process within %v", o.opts.Limits.KillGrace)
			return nil
		}
	}
	switch {
	case errdefs.IsNotFound(err):
		// Exited in the guest, its report on the way: as runc's shim, "already dead".
		return fmt.Errorf("%s: process already finished: %w", p.name(), errdefs.ErrNotFound)
	case err != nil:
		return fmt.Errorf("the agent signalling %s: %w", p.name(), err)
	}
	return nil
}

// enforceKill ends p, SIGKILLed, unless the agent reports its exit within
// GuestLimits.KillGrace. (What follows the report, the drain of its output and its execs'
// exits, has bounds of its own and is no longer the guest's to confirm.)
//
// A container's init is ended by killing the pod's VM: the guest cannot be trusted to have
// killed one container and not the others, and a container's end is what frees what the host
// gave it (its binds in the share, its rootfs, CRI's pod stop after it). An exec is declared
// exited by the host (exitKilled: its output cut, TaskExit published, Wait released, Delete
// allowed), and the pod goes on. That is not counted as the guest's misbehaviour at the door:
// a healthy guest's exec can outlive a SIGKILL for as long as it sleeps uninterruptibly (a
// hung mount, a stuck device), which must not take its pod down; and a guest that keeps an
// exec running on purpose gains nothing root in it could not have anyway, since the process
// runs inside the VM, on the pod's resources, and the host keeps nothing of it once deleted.
func (o *Pod) enforceKill(run *podRun, c *Container, p *process) {
	grace := o.opts.Limits.KillGrace
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.reported:
		return
	case <-run.ctx.Done(): // the pod ended: p's exit comes with it
		return
	case <-t.C:
	}
	why := fmt.Errorf("the guest did not end %s within %v of SIGKILL", p.name(), grace)
	if p.execID == "" {
		run.door.cutOff(why)
		return
	}
	if c.endExecByHost(p) {
		o.guestLog.warn("exec-kill", log.G(o.ctx).WithError(why),
			fmt.Sprintf("the host declares the exec exited (%d); it may still run in the guest", exitKilled))
	}
}

// podFilesOf is the pod files' directory of the Sandbox API's sandbox id, if this shim has it.
func (o *Pod) podFilesOf(id string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.sandbox == nil || o.sandbox.id != id {
		return "", false
	}
	return o.sandbox.files, true
}

// checkNoPodLocked refuses sandbox id in a shim that has a pod already. o.mu is held.
func (o *Pod) checkNoPodLocked(id string) error {
	switch {
	case o.sandbox != nil:
		return fmt.Errorf("sandbox %s: this shim has sandbox %s already: %w", id, o.sandbox.id, errdefs.ErrAlreadyExists)
	case o.run != nil || o.booting != nil || len(o.containers) > 0:
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
