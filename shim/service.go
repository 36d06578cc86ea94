package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	sandboxAPI "github.com/containerd/containerd/api/runtime/sandbox/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	runcopts "github.com/containerd/containerd/api/types/runc/options"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/v2/core/events"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/runtime"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/hooks"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/shim/stdio"
)

// Pod is one pod's running sandbox as the task service uses it: the agent in its VM, the
// share its containers' files reach the guest through, and its end.
type Pod interface {
	// Agent is the guest agent's API. Its answers are untrusted.
	Agent() agent.AgentService
	// Bind puts src at agent.SharedDir/name in the guest (sandbox.Bind); Unbind undoes it.
	Bind(src, name string, readOnly bool) error
	Unbind(name string) error
	// Done is closed when the pod died: its VM or its virtio-fs server ended (not by Stop).
	Done() <-chan struct{}
	// Err says why Done was closed.
	Err() error
	// Pid is the VM's process id (0 if it has none on this host): every task's pid.
	Pid() uint32
	// Kill ends the VM at once: the pod is dead, Done closes with why (unless it was being
	// stopped). What is left (the server, the share, the network) goes with Stop.
	Kill(why error)
	// Stop shuts the agent down, stops the VM and the server and removes the sandbox.
	Stop(ctx context.Context) error
}

// PodRequest is what a pod is made from: the first container's Create.
type PodRequest struct {
	// ID is the sandbox id: the CRI sandbox id, or the container's id without one.
	ID string
	// Config is the sandbox configuration (validated).
	Config *sandbox.Config
	// Annotations are the first container's (untrusted; see sandbox.Config.Resolve).
	Annotations map[string]string
	// SandboxTask says the first container is CRI's pod sandbox container: its task is the
	// VM's, answered by the shim (sandboxtask.go).
	SandboxTask bool
	// Hostname is the pod's (the sandbox container's spec), given to the guest, whose UTS
	// namespace the pod's containers share. Empty: none.
	Hostname string
	// NetNS is the pod's network namespace path (the sandbox container's spec, linux.namespaces
	// type network): joined to the VM by a tap. Empty: the VM has no NIC.
	NetNS string
	// Cgroup is the host cgroup of CRI's pod sandbox container (its spec's
	// linux.cgroupsPath), where the pod's shim, kvfsd and QEMU run (cgroup.go). Empty: none is
	// joined.
	Cgroup string
}

// PodStarter makes and boots a pod; it returns once its agent answers. StartVMPod is the
// real one.
type PodStarter func(ctx context.Context, req PodRequest) (Pod, error)

// Timeouts of the exit sequence. A hostile or broken guest must not hold an exit forever.
const (
	// drainTimeout bounds, after the agent reported an exit, the copy of what is left of the
	// process's output.
	drainTimeout = 30 * time.Second
	// execsTimeout bounds how long an init's exit waits for its running execs' exits, which
	// containerd wants published first.
	execsTimeout = 10 * time.Second
	// readMax is the most bytes asked of the agent per ReadStdout/ReadStderr.
	readMax = 32 << 10
	// exitVMDied is the exit status of every process of a pod whose VM or server died.
	exitVMDied = 255
	// exitKilled is the exit status of a process the host was asked to SIGKILL and whose exit
	// came with its VM's end.
	exitKilled = 128 + uint32(syscall.SIGKILL)
)

// Options configure a Service.
type Options struct {
	// Publisher receives the task events, in order.
	Publisher events.Publisher
	// Shutdown is the shim's: Shutdown with no container left ends the process.
	Shutdown shutdown.Service
	// StartPod makes the pod at the first Create.
	StartPod PodStarter
	// DefaultConfigPath is the sandbox configuration used when Create's options name none
	// (DefaultConfigPath, if it exists; else sandbox.DefaultConfig()).
	DefaultConfigPath string
	// Limits bound the waits on the guest (agentdoor.go); zero fields are the defaults.
	Limits GuestLimits
}

// DefaultConfigPath is where the node's sandbox configuration is, if it has one.
const DefaultConfigPath = "/etc/kvfs/configuration.toml"

// Service is the task API (v3) of one pod's shim. See the package documentation for the lock
// order and the threat model.
type Service struct {
	ctx  context.Context // the shim's; outlives requests
	opts Options

	mu         sync.Mutex
	containers map[string]*container // guarded by mu; a container is listed from Create's start
	run        *podRun               // guarded by mu; the pod, from its boot to its stop
	booting    chan struct{}         // guarded by mu; non-nil while a Create boots the pod
	guestLog   guestLogger           // the log lines the guest can cause, rate-limited
	// sandbox is the Sandbox API's pod (sandboxservice.go), from CreateSandbox to
	// ShutdownSandbox; nil when the task API makes the pod (its first Create).
	sandbox *podSandbox // guarded by mu
}

// container is one container of the pod.
type container struct {
	id, bundle string
	init       *process
	// Set by Create before the container is ready, read after: no lock.
	rootfsMounted bool     // <bundle>/rootfs was mounted by us
	binds         []string // names bound in the share, the rootfs (the id) first
	hooks         containerHooks

	mu    sync.Mutex
	ready bool                // guarded by mu; Create has finished
	execs map[string]*process // guarded by mu
}

var _ taskAPI.TTRPCTaskService = (*Service)(nil)

// NewService returns the task service. ctx is the shim's: it carries the logger and the
// namespace.
func NewService(ctx context.Context, opts Options) *Service {
	if opts.DefaultConfigPath == "" {
		opts.DefaultConfigPath = DefaultConfigPath
	}
	opts.Limits = opts.Limits.withDefaults()
	return &Service{ctx: ctx, opts: opts, containers: make(map[string]*container)}
}

// RegisterTTRPC registers the task service and the Sandbox API (sandboxservice.go), with
// errors translated to gRPC codes at this edge.
func (s *Service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTTRPCTaskService(server, errorEdge{s})
	sandboxAPI.RegisterTTRPCSandboxService(server, sandboxEdge{s})
	return nil
}

func (s *Service) publish(evt any) {
	if err := s.opts.Publisher.Publish(s.ctx, runtime.GetTopic(evt), evt); err != nil {
		log.G(s.ctx).WithError(err).Error("publish event")
	}
}

// getContainer returns a container whose Create has finished.
func (s *Service) getContainer(id string) (*container, error) {
	s.mu.Lock()
	c := s.containers[id]
	s.mu.Unlock()
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

func (s *Service) getProcess(id, execID string) (*container, *process, error) {
	c, err := s.getContainer(id)
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

// Create makes the container: the pod first if it is the first one.
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, retErr error) {
	if r.Checkpoint != "" || r.ParentCheckpoint != "" {
		return nil, fmt.Errorf("restoring a checkpoint: %w", errdefs.ErrNotImplemented)
	}
	cfg, err := s.loadConfig(r.Options)
	if err != nil {
		return nil, err
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, err
	}
	sandboxID, err := SandboxID(r.ID, spec.Annotations)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	// CRI's pod sandbox container runs nothing: the VM is the pod (sandboxtask.go).
	isSandbox := spec.Annotations[AnnotationContainerType] == containerTypeSandbox
	podReq := PodRequest{ID: sandboxID, Config: cfg, Annotations: spec.Annotations, SandboxTask: isSandbox}
	var guestSpec *specs.Spec
	var hostBinds []HostBind
	if isSandbox {
		if podReq.Config, err = SizePod(cfg, spec.Annotations); err != nil {
			return nil, fmt.Errorf("pod sandbox %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
		if spec.Linux != nil {
			podReq.Cgroup = spec.Linux.CgroupsPath
		}
	} else {
		// The Sandbox API leaves a container's /etc/hosts, /etc/resolv.conf and
		// /etc/hostname to the sandbox, and its /dev/shm (the pod's, in the guest).
		dir, apiSandbox := s.podFilesOf(sandboxID)
		if apiSandbox {
			withPodFiles(spec, dir)
		}
		if guestSpec, hostBinds, err = AdaptSpec(spec, r.ID); err != nil {
			return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
		}
		if apiSandbox {
			withPodShm(guestSpec)
		}
	}
	// The pod's network is its sandbox's (or, without CRI, its one container's). A CRI
	// container joins the pod's VM, whose network it shares: its spec names the sandbox task's
	// namespace by pid, the VM's, which is not the pod's.
	if spec.Annotations[AnnotationContainerType] != containerTypeContainer {
		if podReq.NetNS, err = podNetNS(spec); err != nil {
			return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
		if podReq.Hostname = spec.Hostname; podReq.Hostname != "" {
			if err := agent.CheckHostname(podReq.Hostname); err != nil {
				return nil, fmt.Errorf("container %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
			}
		}
	}
	ns, _ := namespaces.Namespace(ctx)
	sc := stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}
	c := &container{id: r.ID, bundle: r.Bundle, init: newProcess(r.ID, "", sc), execs: map[string]*process{},
		hooks: containerHooks{hooks: spec.Hooks, annotations: spec.Annotations}}

	s.mu.Lock()
	if _, ok := s.containers[r.ID]; ok {
		s.mu.Unlock()
		return nil, fmt.Errorf("container %s: %w", r.ID, errdefs.ErrAlreadyExists)
	}
	s.containers[r.ID] = c
	s.mu.Unlock()

	var undo []func()
	defer func() {
		if retErr == nil {
			return
		}
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		s.mu.Lock()
		delete(s.containers, r.ID)
		s.mu.Unlock()
		s.stopPodIfEmpty()
	}()

	// The record comes first: if this shim dies while booting the pod, the delete action
	// still finds the sandbox to clean up.
	if err := writeBundleRecord(r.Bundle, bundleRecord{SandboxID: sandboxID, BaseDir: cfg.BaseDir, Cgroup: podReq.Cgroup}); err != nil {
		return nil, err
	}
	undo = append(undo, func() { os.Remove(filepath.Join(r.Bundle, bundleRecordName)) })
	run, err := s.acquirePod(ctx, podReq, false)
	if err != nil {
		return nil, err
	}
	if !isSandbox {
		if err := s.bindContainer(run.pod, c, r, spec, hostBinds, &undo); err != nil {
			return nil, err
		}
	}

	pio, err := stdio.Open(s.ctx, sc)
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", r.ID, err)
	}
	c.init.io = pio
	undo = append(undo, func() { pio.Close() })

	specJSON, err := json.Marshal(guestSpec)
	if err != nil {
		return nil, err
	}
	in, out, errw := sc.Wants()
	actx, cancel := run.call(ctx)
	_, err = run.agent.CreateContainer(actx, &agent.CreateContainerRequest{
		ContainerId: r.ID, Spec: specJSON,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	cancel()
	if err != nil {
		return nil, fmt.Errorf("the agent creating container %s: %w", r.ID, err)
	}
	pid := run.pod.Pid()
	c.init.pid = pid
	undo = append(undo, func() {
		if err := s.agentDelete(s.ctx, run, c.init); err != nil {
			log.G(s.ctx).WithError(err).Warnf("deleting container %s in the guest after its failed create", r.ID)
		}
	})
	if err := s.createHooks(c); err != nil {
		// The runtime spec goes on from a failed hook to the destroy, then the poststop
		// hooks: first in the undo chain, they run once everything else is undone.
		undo = slices.Insert(undo, 0, func() { s.postHooks(hooks.Poststop, c, specs.StateStopped) })
		return nil, err
	}

	c.mu.Lock()
	c.ready = true
	c.mu.Unlock()
	s.publish(&eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs, Pid: pid,
		IO: &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
	})
	s.watch(run, c, c.init)
	return &taskAPI.CreateTaskResponse{Pid: pid}, nil
}

// bindContainer puts container c's files in the pod's share: its root filesystem (Create's
// mounts, mounted on <bundle>/rootfs, or the spec's root path) at the container's id, then its
// bind mounts. What it did is undone by the functions it appends to undo.
func (s *Service) bindContainer(pod Pod, c *container, r *taskAPI.CreateTaskRequest, spec *specs.Spec, hostBinds []HostBind, undo *[]func()) error {
	rootfs := filepath.Join(r.Bundle, "rootfs")
	if len(r.Rootfs) > 0 {
		if err := os.MkdirAll(rootfs, 0o711); err != nil {
			return err
		}
		if err := mount.All(mount.FromProto(r.Rootfs), rootfs); err != nil {
			return fmt.Errorf("mount the rootfs of %s: %w", r.ID, err)
		}
		c.rootfsMounted = true
		*undo = append(*undo, func() { unmountRootfs(s.ctx, rootfs) })
	} else if spec.Root != nil && spec.Root.Path != "" {
		rootfs = spec.Root.Path
		if !filepath.IsAbs(rootfs) {
			rootfs = filepath.Join(r.Bundle, rootfs)
		}
	}
	if err := pod.Bind(rootfs, r.ID, false); err != nil {
		return fmt.Errorf("bind the rootfs of %s into the pod's share: %w", r.ID, err)
	}
	c.binds = append(c.binds, r.ID)
	*undo = append(*undo, func() { s.unbindAll(pod, c) })
	for _, b := range hostBinds {
		if err := pod.Bind(b.Source, b.Name, b.ReadOnly); err != nil {
			return fmt.Errorf("bind mount %s of %s into the pod's share: %w", b.Source, r.ID, err)
		}
		c.binds = append(c.binds, b.Name)
	}
	return nil
}

// loadConfig decodes runtime options (Create's, or those the shim was started with) into the
// sandbox configuration: runtimeoptions' ConfigPath or ConfigBody, else DefaultConfigPath if
// it exists, else the defaults.
func (s *Service) loadConfig(opts *anypb.Any) (*sandbox.Config, error) {
	path, body, err := ConfigSource(opts)
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	var cfg *sandbox.Config
	switch {
	case len(body) > 0:
		cfg, err = sandbox.ParseConfig(body)
	case path != "":
		cfg, err = sandbox.LoadConfig(path)
	default:
		if _, serr := os.Stat(s.opts.DefaultConfigPath); serr == nil {
			cfg, err = sandbox.LoadConfig(s.opts.DefaultConfigPath)
		} else {
			cfg = sandbox.DefaultConfig()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return cfg, nil
}

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("the bundle's spec: %w", err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("the bundle's spec %s: %v: %w", filepath.Join(bundle, "config.json"), err, errdefs.ErrInvalidArgument)
	}
	return &spec, nil
}

// watch starts p's output copies and its exit watcher. The exit watcher runs from creation,
// so a process killed before it starts still exits.
func (s *Service) watch(run *podRun, c *container, p *process) {
	drainCtx, cancelDrain := context.WithCancel(run.ctx)
	var wg sync.WaitGroup
	copyOut := func(w interface{ Write([]byte) (int, error) }, read func(context.Context, *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error), stream string) {
		defer wg.Done()
		var werr error
		for {
			resp, err := read(drainCtx, &agent.ReadStreamRequest{ContainerId: p.cid, ExecId: p.execID, Max: readMax})
			if err != nil {
				if drainCtx.Err() == nil {
					log.G(s.ctx).WithError(err).WithField("process", p.name()).Warnf("reading %s", stream)
				}
				return
			}
			if len(resp.Data) > 0 && werr == nil {
				// A reader gone (containerd restarted) must not stop the drain: the
				// process would block on a full pty or pipe in the guest.
				if _, werr = w.Write(resp.Data); werr != nil {
					log.G(s.ctx).WithError(werr).WithField("process", p.name()).Warnf("writing %s", stream)
				}
			}
			if resp.Eof {
				return
			}
		}
	}
	if p.io.Stdout != nil {
		wg.Add(1)
		go copyOut(p.io.Stdout, run.agent.ReadStdout, "stdout")
	}
	if p.io.Stderr != nil {
		wg.Add(1)
		go copyOut(p.io.Stderr, run.agent.ReadStderr, "stderr")
	}
	go func() { wg.Wait(); close(p.outputDone) }()

	go func() {
		defer cancelDrain()
		var e exit
		resp, err := run.agent.WaitProcess(run.ctx, &agent.WaitProcessRequest{ContainerId: p.cid, ExecId: p.execID})
		switch {
		case err != nil && run.ctx.Err() != nil:
			e = exit{status: p.vmEndStatus(), at: time.Now()}
		case err != nil:
			// A lost connection is usually the pod's death, reported (and logged) just after.
			select {
			case <-run.pod.Done():
			case <-time.After(2 * time.Second):
				log.G(s.ctx).WithError(err).WithField("process", p.name()).Errorf("the agent's wait failed: exit status %d", exitVMDied)
			}
			e = exit{status: p.vmEndStatus(), at: time.Now()}
		default:
			e = exit{status: resp.ExitStatus, at: time.Now()}
			if t := resp.ExitedAt; t != nil && t.IsValid() {
				e.at = t.AsTime()
			}
		}
		select {
		case <-p.outputDone:
		case <-run.ctx.Done():
		case <-time.After(drainTimeout):
			log.G(s.ctx).WithField("process", p.name()).Warnf("its output was not drained %v after its exit: cut", drainTimeout)
		}
		s.exited(c, p, e)
	}()
}

// exited runs p's exit sequence once: output drained (by the caller), stdio closed, the exit
// recorded, TaskExit published, Wait released. An exit that comes while the process is
// starting waits for Start to publish TaskStart first.
func (s *Service) exited(c *container, p *process, e exit) {
	p.mu.Lock()
	if p.finishing {
		p.mu.Unlock()
		return
	}
	if p.state == stateStarting {
		p.pending = &e
		p.mu.Unlock()
		return
	}
	p.finishing = true
	p.mu.Unlock()

	if p.execID == "" {
		s.waitExecs(c)
	}
	if p.io != nil {
		if err := p.io.Close(); err != nil {
			log.G(s.ctx).WithError(err).WithField("process", p.name()).Warn("closing stdio")
		}
	}
	p.mu.Lock()
	p.state, p.exit = stateStopped, e
	pid := p.pid
	p.mu.Unlock()
	s.publish(&eventstypes.TaskExit{
		ContainerID: p.cid, ID: execOrContainer(p), Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at),
	})
	close(p.exited)
}

func execOrContainer(p *process) string {
	if p.execID == "" {
		return p.cid
	}
	return p.execID
}

// waitExecs waits (bounded) for the exits of c's started execs: containerd expects the
// init's TaskExit last.
func (s *Service) waitExecs(c *container) {
	c.mu.Lock()
	var waits []chan struct{}
	for _, p := range c.execs {
		if st, _, _ := p.snapshot(); st == stateRunning || st == statePaused || st == stateStarting {
			waits = append(waits, p.exited)
		}
	}
	c.mu.Unlock()
	deadline := time.After(execsTimeout)
	for _, w := range waits {
		select {
		case <-w:
		case <-deadline:
			log.G(s.ctx).WithField("container", c.id).Warnf("its execs did not exit %v after its init", execsTimeout)
			return
		}
	}
}

// Start starts a created process.
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if p.execID != "" {
		if err := c.init.check(opExec); err != nil {
			return nil, err
		}
	}
	if err := p.transition(opStart, stateStarting); err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	_, err = run.agent.StartProcess(actx, &agent.StartProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	cancel()
	if err != nil {
		p.mu.Lock()
		p.state = stateCreated
		pending := p.pending
		p.pending = nil
		p.mu.Unlock()
		if pending != nil {
			go s.exited(c, p, *pending)
		}
		return nil, fmt.Errorf("the agent starting %s: %w", p.name(), err)
	}
	pid := run.pod.Pid()
	p.mu.Lock()
	p.pid = pid
	p.mu.Unlock()
	if p.execID == "" {
		s.publish(&eventstypes.TaskStart{ContainerID: p.cid, Pid: pid})
	} else {
		s.publish(&eventstypes.TaskExecStarted{ContainerID: p.cid, ExecID: p.execID, Pid: pid})
	}
	p.mu.Lock()
	p.state = stateRunning
	pending := p.pending
	p.pending = nil
	p.mu.Unlock()
	if pending != nil {
		go s.exited(c, p, *pending)
	}
	s.copyStdin(run, p)
	if p.execID == "" {
		s.postHooks(hooks.Poststart, c, specs.StateRunning)
	}
	return &taskAPI.StartResponse{Pid: pid}, nil
}

// copyStdin copies the stdin fifo to the agent until it ends: the client closed its end, or
// CloseIO closed ours. Neither closes the process's stdin; only CloseIO does, after this copy
// has forwarded what it read. That is containerd's runc shim's behaviour: a client closing the
// fifo (ctr at the end of its input) has not asked for EOF.
func (s *Service) copyStdin(run *podRun, p *process) {
	if p.io == nil || p.io.Stdin == nil {
		close(p.stdinDone)
		return
	}
	go func() {
		defer close(p.stdinDone)
		buf := make([]byte, readMax)
		for {
			n, rerr := p.io.Stdin.Read(buf)
			if n > 0 {
				if _, err := run.agent.WriteStdin(run.ctx, &agent.WriteStdinRequest{ContainerId: p.cid, ExecId: p.execID, Data: slices.Clone(buf[:n])}); err != nil {
					if run.ctx.Err() == nil {
						log.G(s.ctx).WithError(err).WithField("process", p.name()).Warn("writing stdin")
					}
					return
				}
			}
			if rerr != nil {
				return
			}
		}
	}()
}

// Exec adds a process to a running container.
func (s *Service) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (_ *emptypb.Empty, retErr error) {
	c, err := s.getContainer(r.ID)
	if err != nil {
		return nil, err
	}
	if r.ExecID == "" {
		return nil, fmt.Errorf("exec without an id: %w", errdefs.ErrInvalidArgument)
	}
	if err := c.init.check(opExec); err != nil {
		return nil, err
	}
	procJSON, err := execProcess(r.Spec)
	if err != nil {
		return nil, fmt.Errorf("exec %s: %v: %w", r.ExecID, err, errdefs.ErrInvalidArgument)
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	ns, _ := namespaces.Namespace(ctx)
	sc := stdio.Config{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal, ContainerID: r.ID, Namespace: ns}
	p := newProcess(r.ID, r.ExecID, sc)
	c.mu.Lock()
	if _, ok := c.execs[r.ExecID]; ok {
		c.mu.Unlock()
		return nil, fmt.Errorf("exec %s of container %s: %w", r.ExecID, r.ID, errdefs.ErrAlreadyExists)
	}
	c.execs[r.ExecID] = p // reserved; started only once Exec returns
	c.mu.Unlock()
	defer func() {
		if retErr != nil {
			c.mu.Lock()
			delete(c.execs, r.ExecID)
			c.mu.Unlock()
			if p.io != nil {
				p.io.Close()
			}
		}
	}()
	if p.io, err = stdio.Open(s.ctx, sc); err != nil {
		return nil, fmt.Errorf("exec %s: %w", r.ExecID, err)
	}
	in, out, errw := sc.Wants()
	actx, cancel := run.call(ctx)
	_, err = run.agent.ExecProcess(actx, &agent.ExecProcessRequest{
		ContainerId: r.ID, ExecId: r.ExecID, Process: procJSON,
		Stdio: &agent.Stdio{Terminal: r.Terminal, Stdin: in, Stdout: out, Stderr: errw},
	})
	cancel()
	if err != nil {
		return nil, fmt.Errorf("the agent adding exec %s to %s: %w", r.ExecID, r.ID, err)
	}
	s.publish(&eventstypes.TaskExecAdded{ContainerID: r.ID, ExecID: r.ExecID})
	s.watch(run, c, p)
	return &emptypb.Empty{}, nil
}

// execProcess checks an exec's process spec (JSON in an Any, as containerd sends
// specs.Process) and returns it adapted for the guest, as JSON.
func execProcess(a interface {
	GetTypeUrl() string
	GetValue() []byte
}) ([]byte, error) {
	if a == nil || len(a.GetValue()) == 0 {
		return nil, errors.New("no process spec")
	}
	var proc specs.Process
	if err := json.Unmarshal(a.GetValue(), &proc); err != nil {
		return nil, fmt.Errorf("process spec (%s): %v", a.GetTypeUrl(), err)
	}
	return json.Marshal(adaptProcess(&proc))
}

// Kill signals a process; with All, every process of the container. A SIGKILL of a container
// is finished by the host if the guest does not (Service.kill).
func (s *Service) Kill(ctx context.Context, r *taskAPI.KillRequest) (*emptypb.Empty, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opKill); err != nil {
		if st, _, _ := p.snapshot(); st == stateStopped {
			// As runc's shim: a finished process is not found, which containerd's
			// callers (CRI's StopContainer, ctr kill) take as "already dead".
			return nil, fmt.Errorf("%s: process already finished: %w", p.name(), errdefs.ErrNotFound)
		}
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	if err := s.kill(ctx, run, c, p, r.Signal, r.All); err != nil {
		return nil, err
	}
	return &emptypb.Empty{}, nil
}

// Wait blocks until the process has exited, its output drained and TaskExit published.
func (s *Service) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	_, _, e := p.snapshot()
	return &taskAPI.WaitResponse{ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}, nil
}

// Delete deletes an exited (or created: it is killed first) process; the init's Delete
// removes the container, and the last container's the pod.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opDelete); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		// The pod was stopped with the container in it (StopSandbox): its processes have
		// exited, and its binds went with the sandbox. What is left is on the host.
		if st, _, _ := p.snapshot(); st != stateStopped {
			return nil, err
		}
		run = nil
	}
	// live says the pod's agent can still be asked.
	live := func() bool { return run != nil && run.live() }
	forgotten := false // the agent has forgotten p already
	if st, _, _ := p.snapshot(); st == stateCreated && p.execID != "" {
		// A never-started exec has no process in the guest to kill: the agent forgets it,
		// and its waiters are released as if it had been killed.
		if live() {
			if err := s.agentDelete(ctx, run, p); err != nil {
				return nil, err
			}
		}
		forgotten = true
		s.exited(c, p, exit{status: exitKilled, at: time.Now()})
	} else if st == stateCreated {
		// A created init is runc's created container: killing it ends it, the host
		// finishing the kill if the guest does not.
		if err := s.kill(ctx, run, c, p, uint32(syscall.SIGKILL), false); err != nil {
			return nil, err
		}
		select {
		case <-p.exited:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if p.execID == "" {
		c.mu.Lock()
		var running []string
		for id, e := range c.execs {
			if st, _, _ := e.snapshot(); st != stateStopped && st != stateDeleted {
				running = append(running, id)
			}
		}
		c.mu.Unlock()
		if len(running) > 0 && live() {
			return nil, fmt.Errorf("container %s still has execs %q: %w", c.id, running, errdefs.ErrFailedPrecondition)
		}
	}
	if live() && !forgotten {
		if err := s.agentDelete(ctx, run, p); err != nil {
			return nil, err
		}
	}
	if err := p.transition(opDelete, stateDeleted); err != nil {
		return nil, err // a concurrent Delete won
	}
	_, pid, e := p.snapshot()
	resp := &taskAPI.DeleteResponse{Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)}
	if p.execID != "" {
		c.mu.Lock()
		delete(c.execs, p.execID)
		c.mu.Unlock()
		return resp, nil
	}
	if run != nil {
		s.unbindAll(run.pod, c)
	}
	if c.rootfsMounted {
		unmountRootfs(s.ctx, filepath.Join(c.bundle, "rootfs"))
	}
	s.postHooks(hooks.Poststop, c, specs.StateStopped)
	s.mu.Lock()
	delete(s.containers, c.id)
	s.mu.Unlock()
	s.publish(&eventstypes.TaskDelete{ContainerID: c.id, Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)})
	s.stopPodIfEmpty()
	return resp, nil
}

// agentDelete asks the agent to forget p; a process it does not know is already forgotten.
func (s *Service) agentDelete(ctx context.Context, run *podRun, p *process) error {
	actx, cancel := run.call(ctx)
	defer cancel()
	_, err := run.agent.DeleteProcess(actx, &agent.DeleteProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	if err != nil && run.live() && !agentErrIs(err, codes.NotFound, errdefs.ErrNotFound) {
		return fmt.Errorf("the agent deleting %s: %w", p.name(), err)
	}
	return nil
}

func (s *Service) unbindAll(pod Pod, c *container) {
	for i := len(c.binds) - 1; i >= 0; i-- {
		if err := pod.Unbind(c.binds[i]); err != nil {
			log.G(s.ctx).WithError(err).WithField("container", c.id).Warnf("unbinding %s from the pod's share", c.binds[i])
		}
	}
	c.binds = nil
}

func unmountRootfs(ctx context.Context, rootfs string) {
	if err := mount.UnmountRecursive(rootfs, 0); err != nil {
		log.G(ctx).WithError(err).Warnf("unmounting %s", rootfs)
	}
}

// State reports a process's state.
func (s *Service) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	c, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st, pid, e := p.snapshot()
	resp := &taskAPI.StateResponse{
		ID: c.id, ExecID: p.execID, Bundle: c.bundle, Pid: pid, Status: st.status(),
		Stdin: p.stdio.Stdin, Stdout: p.stdio.Stdout, Stderr: p.stdio.Stderr, Terminal: p.stdio.Terminal,
	}
	if st == stateStopped || st == stateDeleted {
		resp.ExitStatus, resp.ExitedAt = e.status, timestamppb.New(e.at)
	}
	return resp, nil
}

// Pause freezes the container.
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*emptypb.Empty, error) {
	return s.pauseResume(ctx, r.ID, opPause, statePaused)
}

// Resume thaws the container.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*emptypb.Empty, error) {
	return s.pauseResume(ctx, r.ID, opResume, stateRunning)
}

func (s *Service) pauseResume(ctx context.Context, id string, o op, next state) (*emptypb.Empty, error) {
	c, err := s.getContainer(id)
	if err != nil {
		return nil, err
	}
	if err := c.init.check(o); err != nil {
		return nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	if o == opPause {
		_, err = run.agent.PauseContainer(actx, &agent.PauseContainerRequest{ContainerId: id})
	} else {
		_, err = run.agent.ResumeContainer(actx, &agent.ResumeContainerRequest{ContainerId: id})
	}
	if err != nil {
		return nil, fmt.Errorf("the agent: %s container %s: %w", o, id, err)
	}
	// The process may have exited meanwhile: then it stays stopped.
	if err := c.init.transition(o, next); err != nil {
		return nil, err
	}
	if o == opPause {
		s.publish(&eventstypes.TaskPaused{ContainerID: id})
	} else {
		s.publish(&eventstypes.TaskResumed{ContainerID: id})
	}
	return &emptypb.Empty{}, nil
}

// Pids lists the container's processes with their pids in the guest: the task's own pid is
// the VM's (a host process of the pod), but containerd's Pids, as ctr task ps shows them, are
// container-level pids, which only the guest's numbers can be. The agent's answer names an
// exec only if the container has it.
func (s *Service) Pids(ctx context.Context, r *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	c, run, err := s.query(r.ID)
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	resp, err := run.agent.ListPids(actx, &agent.ListPidsRequest{ContainerId: c.id})
	if err != nil {
		return nil, fmt.Errorf("the agent listing the processes of %s: %w", c.id, err)
	}
	out := &taskAPI.PidsResponse{}
	for _, pi := range resp.Processes {
		info := &task.ProcessInfo{Pid: pi.Pid}
		if pi.IsKnown && pi.ExecId != "" {
			c.mu.Lock()
			_, ok := c.execs[pi.ExecId]
			c.mu.Unlock()
			if !ok {
				return nil, run.door.violation("ListPids %s: exec %q, which the container does not have", c.id, guestText(pi.ExecId))
			}
			a, err := typeurl.MarshalAnyToProto(&runcopts.ProcessDetails{ExecID: pi.ExecId})
			if err != nil {
				return nil, err
			}
			info.Info = a
		}
		out.Processes = append(out.Processes, info)
	}
	return out, nil
}

// query is the common start of the container-wide queries: the container, which must not
// have exited, and the pod's run.
func (s *Service) query(id string) (*container, *podRun, error) {
	c, err := s.getContainer(id)
	if err != nil {
		return nil, nil, err
	}
	if err := c.init.check(opQuery); err != nil {
		return nil, nil, err
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, nil, err
	}
	return c, run, nil
}

// Stats answers the agent's cgroup metrics of the container (the pod's, for the pod sandbox),
// as the door checked them: a cgroup2 Metrics that decodes, which containerd's CRI decodes by
// its type.
func (s *Service) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	c, run, err := s.query(r.ID)
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	resp, err := run.agent.Stats(actx, &agent.StatsRequest{ContainerId: c.id})
	if err != nil {
		return nil, fmt.Errorf("the agent's stats of %s: %w", c.id, err)
	}
	return &taskAPI.StatsResponse{Stats: resp.Stats}, nil
}

// Update sends new resource limits (linux.resources JSON) to the agent.
func (s *Service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*emptypb.Empty, error) {
	if r.Resources == nil || len(r.Resources.GetValue()) == 0 {
		return nil, fmt.Errorf("update of %s without resources: %w", r.ID, errdefs.ErrInvalidArgument)
	}
	var res specs.LinuxResources
	if err := json.Unmarshal(r.Resources.GetValue(), &res); err != nil {
		return nil, fmt.Errorf("update of %s: resources (%s): %v: %w", r.ID, r.Resources.GetTypeUrl(), err, errdefs.ErrInvalidArgument)
	}
	b, err := json.Marshal(&res)
	if err != nil {
		return nil, err
	}
	c, run, err := s.query(r.ID)
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	if _, err := run.agent.UpdateContainer(actx, &agent.UpdateContainerRequest{ContainerId: c.id, Resources: b}); err != nil {
		return nil, fmt.Errorf("the agent updating %s: %w", c.id, err)
	}
	return &emptypb.Empty{}, nil
}

// ResizePty resizes a terminal process's pty.
func (s *Service) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*emptypb.Empty, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if err := p.check(opIO); err != nil {
		return nil, err
	}
	if !p.stdio.Terminal {
		return nil, fmt.Errorf("%s has no terminal: %w", p.name(), errdefs.ErrFailedPrecondition)
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	if _, err := run.agent.ResizePty(actx, &agent.ResizePtyRequest{ContainerId: p.cid, ExecId: p.execID, Width: r.Width, Height: r.Height}); err != nil {
		return nil, fmt.Errorf("the agent resizing the pty of %s: %w", p.name(), err)
	}
	return &emptypb.Empty{}, nil
}

// CloseIO closes a process's stdin: it reads EOF once what was written before has arrived.
func (s *Service) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*emptypb.Empty, error) {
	_, p, err := s.getProcess(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if !r.Stdin {
		return &emptypb.Empty{}, nil
	}
	if err := p.check(opIO); err != nil {
		return nil, err
	}
	if p.io != nil && p.io.Stdin != nil {
		// The copy ends at the closed fifo; what it had read reaches the guest before the
		// EOF below.
		if err := p.io.CloseStdin(); err != nil {
			return nil, err
		}
		if st, _, _ := p.snapshot(); st != stateCreated {
			t := time.NewTimer(s.opts.Limits.Lifecycle)
			defer t.Stop()
			select {
			case <-p.stdinDone:
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-t.C: // the guest takes no more of the process's stdin
				return nil, fmt.Errorf("the stdin of %s: the guest took no more of it within %v: %w", p.name(), s.opts.Limits.Lifecycle, context.DeadlineExceeded)
			}
		}
	}
	run, err := s.currentRun()
	if err != nil {
		return nil, err
	}
	actx, cancel := run.call(ctx)
	defer cancel()
	if _, err := run.agent.CloseStdin(actx, &agent.CloseStdinRequest{ContainerId: p.cid, ExecId: p.execID}); err != nil {
		return nil, fmt.Errorf("the agent closing the stdin of %s: %w", p.name(), err)
	}
	return &emptypb.Empty{}, nil
}

// Checkpoint is not supported: the process runs in a VM.
func (s *Service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (*emptypb.Empty, error) {
	return nil, fmt.Errorf("checkpoint of %s: %w", r.ID, errdefs.ErrNotImplemented)
}

// Connect answers the shim's pid and the task's.
func (s *Service) Connect(ctx context.Context, r *taskAPI.ConnectRequest) (*taskAPI.ConnectResponse, error) {
	resp := &taskAPI.ConnectResponse{ShimPid: uint32(os.Getpid()), Version: Version}
	if c, err := s.getContainer(r.ID); err == nil {
		_, pid, _ := c.init.snapshot()
		resp.TaskPid = pid
	}
	return resp, nil
}

// Shutdown ends the shim once it serves no container, and no sandbox of the Sandbox API
// (ShutdownSandbox ends that).
func (s *Service) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	n := len(s.containers)
	busy := s.booting != nil || s.sandbox != nil
	s.mu.Unlock()
	if n > 0 || busy {
		return &emptypb.Empty{}, nil
	}
	s.stopPodIfEmpty()
	s.opts.Shutdown.Shutdown()
	return &emptypb.Empty{}, nil
}

// agentErrIs says whether an agent's error is of a kind: a gRPC code over ttrpc, or an errdefs
// kind from an in-process agent.
func agentErrIs(err error, code codes.Code, kind error) bool {
	if errors.Is(err, kind) {
		return true
	}
	st, ok := status.FromError(err)
	return ok && st.Code() == code
}

// Close is the shim's last act (a shutdown callback): the pod, if one still runs, is stopped
// and the publisher closed.
func (s *Service) Close(ctx context.Context) error {
	s.mu.Lock()
	run := s.takeRunLocked()
	s.mu.Unlock()
	var errs []error
	if run != nil {
		run.cancel()
		errs = append(errs, run.pod.Stop(ctx))
	}
	if c, ok := s.opts.Publisher.(interface{ Close() error }); ok {
		errs = append(errs, c.Close())
	}
	return errors.Join(errs...)
}
