package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/console"
	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"
	"google.golang.org/protobuf/types/known/timestamppb"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Defaults of Config.
const (
	DefaultStateDir = "/run/kvfs/containers"
	// maxIDLen bounds container and exec ids.
	maxIDLen = 255
	// oomQueueLen is how many OOM events are kept while nobody calls GetOOMEvent.
	oomQueueLen = 128
	// shutdownWait is how long Shutdown waits for killed containers' init processes to exit.
	shutdownWait = 5 * time.Second
	// specLimit bounds a spec or process JSON document.
	specLimit = 4 << 20
	// DefaultOutputGrace is Config.OutputGrace's default: containerd's runc shim also waits 2 s
	// for an exec's output after its exit.
	DefaultOutputGrace = 2 * time.Second
)

// exitReportWait is how long a refused kill of an init waits for the reaper's report of its
// exit before the refusal is answered.
const exitReportWait = time.Second

var errShuttingDown = errf(errdefs.ErrUnavailable, "the agent is shutting down")

// Config configures a Service. Runtime and Cgroups are required.
type Config struct {
	Runtime Runtime
	Cgroups Cgroups
	// StateDir holds one bundle per container, StateDir/<id>/config.json (default
	// DefaultStateDir).
	StateDir string
	// RootDir is where containers' root filesystems must be (default apiv1.SharedDir).
	RootDir string
	// Version is what Ping answers as the agent's version.
	Version string
	// Started is BootTime when the agent started, answered by Ping as init_started_ns
	// (0: not known).
	Started time.Duration
	// Log receives the service's messages (default: logrus's standard logger).
	Log *logrus.Entry
	// OutputGrace is how long a process's output pipes may stay open after it exited
	// (held by a child it left behind) before they are read out and ended (default
	// DefaultOutputGrace).
	OutputGrace time.Duration
	// Network configures the guest's NICs for ConfigureNetwork (default: Netlink{}, the
	// agent's own network namespace).
	Network Network
	// SysctlDir is where SetSysctls writes (default /proc/sys).
	SysctlDir string
	// PodInit is the init of the pod's shared PID namespace (default PodInit).
	PodInit string
	// KillAll, when set, is how Shutdown ends the containers: it sends SIGKILL to every process
	// of the machine but the agent, which powers the machine off after (as PID 1,
	// kill(-1, SIGKILL); a frozen cgroup v2 does not stop a fatal signal). The runtime is not
	// run: its state, like everything else in the guest, ends with the machine. Nil: Shutdown
	// kills and deletes each container through the runtime.
	KillAll func() error
}

// Service implements apiv1.AgentService. Processes' exits reach it through ProcessExited,
// called by the reaper. The runtime calls that change a container run to their end even if
// the host gives up on the request (context.WithoutCancel): a runc command killed half-way
// would leave runc's state and the service's apart.
type Service struct {
	cfg    Config
	log    *logrus.Entry
	kernel string
	mounts *submounts
	podNS  *podNamespaces // the pod's shared PID and user namespaces; its lock is a leaf
	oom    chan string    // the queue of OOM events; GetOOMEvent takes from it
	done   chan struct{}  // closed when Shutdown has stopped everything

	shutdownOnce sync.Once
	// netMu serialises ConfigureNetwork and SetSysctls requests; a leaf.
	netMu sync.Mutex

	mu         sync.Mutex
	containers map[string]*container       // guarded by mu
	byPid      map[int]*process            // guarded by mu: processes with a pid that has not exited
	collectors map[*exitCollector]struct{} // guarded by mu: process starts in flight
	shutting   bool                        // guarded by mu: Shutdown was called
}

// container is one container. op serialises the runtime calls that change it (create, start,
// exec, pause, resume, delete); it is taken before Service.mu, never while holding it.
type container struct {
	id, bundle, cgroup string
	op                 sync.Mutex

	init    *process            // set at creation, before the container is visible
	execs   map[string]*process // guarded by Service.mu
	paused  bool                // guarded by Service.mu
	gone    bool                // guarded by Service.mu: deleted, or its creation failed
	stopOOM context.CancelFunc  // guarded by Service.mu
	pins    []string            // guarded by op: the submounts held for it (submounts.pin)
}

type procState int

const (
	stateCreated procState = iota
	stateRunning
	stateStopped
)

func (s procState) String() string {
	return [...]string{"created", "running", "stopped"}[s]
}

// process is a container's init or one of its execs.
type process struct {
	c        *container
	execID   string
	terminal bool
	spec     *specs.Process // an exec's process, until it starts
	stdout   *outStream
	stderr   *outStream
	exited   chan struct{} // closed when the process has exited

	// childIO holds the process's ends of its pipes (non-terminal) until runc has them;
	// guarded by c.op (made before the process is published).
	childIO ProcessIO

	state      procState       // guarded by Service.mu
	pid        int             // guarded by Service.mu
	exitStatus int             // guarded by Service.mu
	exitedAt   time.Time       // guarded by Service.mu
	stdin      *os.File        // guarded by Service.mu: the write end of stdin's pipe
	console    console.Console // guarded by Service.mu: a terminal process's pty master
	stdinShut  bool            // guarded by Service.mu: CloseStdin was called
}

// exitCollector keeps the exits of pids nobody knows yet while a process is being started:
// a process can exit before runc has told its pid.
type exitCollector struct {
	exits map[int]exitEvent
}

type exitEvent struct {
	status int
	at     time.Time
}

// NewService returns a service with no containers.
func NewService(cfg Config) (*Service, error) {
	if cfg.Runtime == nil || cfg.Cgroups == nil {
		return nil, errors.New("agent: Config needs a Runtime and Cgroups")
	}
	if cfg.StateDir == "" {
		cfg.StateDir = DefaultStateDir
	}
	if cfg.RootDir == "" {
		cfg.RootDir = apiv1.SharedDir
	}
	if cfg.Log == nil {
		cfg.Log = logrus.NewEntry(logrus.StandardLogger())
	}
	if cfg.OutputGrace == 0 {
		cfg.OutputGrace = DefaultOutputGrace
	}
	if cfg.Network == nil {
		cfg.Network = Netlink{}
	}
	if cfg.SysctlDir == "" {
		cfg.SysctlDir = "/proc/sys"
	}
	if cfg.PodInit == "" {
		cfg.PodInit = PodInit
	}
	return &Service{
		cfg:        cfg,
		log:        cfg.Log,
		kernel:     KernelRelease(),
		mounts:     newSubmounts(cfg.RootDir, cfg.Log),
		podNS:      &podNamespaces{init: cfg.PodInit},
		oom:        make(chan string, oomQueueLen),
		done:       make(chan struct{}),
		containers: make(map[string]*container),
		byPid:      make(map[int]*process),
		collectors: make(map[*exitCollector]struct{}),
	}, nil
}

// Done is closed once Shutdown has killed and deleted every container.
func (s *Service) Done() <-chan struct{} { return s.done }

// ProcessExited records that pid exited with status (128+signal for a killed process). An
// exit of a pid the service does not know is kept while a process start is in flight, and
// otherwise dropped (an orphan reparented to the agent).
func (s *Service) ProcessExited(pid, status int, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.byPid[pid]; ok {
		delete(s.byPid, pid)
		s.exitLocked(p, status, at)
		return
	}
	for c := range s.collectors {
		c.exits[pid] = exitEvent{status, at}
	}
}

func (s *Service) exitLocked(p *process, status int, at time.Time) {
	if p.state == stateStopped {
		return
	}
	p.state, p.exitStatus, p.exitedAt = stateStopped, status, at
	close(p.exited)
	// What the process wrote is in its pipes now; a background child that inherited them
	// must not hold the host's wait for the end of the output for ever.
	time.AfterFunc(s.cfg.OutputGrace, func() {
		p.stdout.closeWhenDrained()
		p.stderr.closeWhenDrained()
	})
	s.log.WithFields(logrus.Fields{"container": p.c.id, "exec": p.execID, "pid": p.pid, "status": status}).Debug("process exited")
}

// startCollecting begins keeping unknown exits; registerLocked ends it.
func (s *Service) startCollecting() *exitCollector {
	c := &exitCollector{exits: make(map[int]exitEvent)}
	s.mu.Lock()
	s.collectors[c] = struct{}{}
	s.mu.Unlock()
	return c
}

func (s *Service) stopCollecting(c *exitCollector) {
	s.mu.Lock()
	delete(s.collectors, c)
	s.mu.Unlock()
}

// registerLocked gives p its pid and applies an exit that came before.
func (s *Service) registerLocked(p *process, col *exitCollector, pid int) {
	delete(s.collectors, col)
	p.pid = pid
	if e, ok := col.exits[pid]; ok {
		s.exitLocked(p, e.status, e.at)
		return
	}
	s.byPid[pid] = p
}

// --- errors and validation ---------------------------------------------------------------------

// errf is an error of kind (an errdefs kind), whose text is the format's alone: the agent's
// edge (Interceptor) answers it with the kind's code.
func errf(kind error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if k, ok := kind.(interface{ WithMessage(string) error }); ok {
		return k.WithMessage(msg)
	}
	return fmt.Errorf("%s: %w", msg, kind)
}

// runtimeErr is a runtime failure at the API edge: Internal, unless it is of a kind already.
func runtimeErr(what string, err error) error {
	if !errdefs.IsUnknown(errdefs.Resolve(err)) {
		return err
	}
	return errf(errdefs.ErrInternal, "%s: %v", what, err)
}

// checkID accepts a container or exec id: one path component, no "." or "..", nothing a
// runc command line would take for a flag, at most maxIDLen bytes.
func checkID(what, id string) error {
	switch {
	case id == "":
		return errf(errdefs.ErrInvalidArgument, "%s is empty", what)
	case len(id) > maxIDLen:
		return errf(errdefs.ErrInvalidArgument, "%s is %d bytes long, more than %d", what, len(id), maxIDLen)
	case id == "." || id == "..":
		return errf(errdefs.ErrInvalidArgument, "%s %q is not a name", what, id)
	case strings.HasPrefix(id, "-"):
		return errf(errdefs.ErrInvalidArgument, "%s %q starts with '-'", what, id)
	}
	for _, r := range id {
		if r == '/' || r < ' ' || r == 0x7f {
			return errf(errdefs.ErrInvalidArgument, "%s %q contains '/' or a control character", what, id)
		}
	}
	return nil
}

func checkExecID(id string) error {
	if id == "" {
		return nil
	}
	return checkID("exec_id", id)
}

func (s *Service) checkServing() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutting {
		return errShuttingDown
	}
	return nil
}

// lookup finds a container that exists.
func (s *Service) lookup(id string) (*container, error) {
	if err := checkID("container_id", id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shutting {
		return nil, errShuttingDown
	}
	c, ok := s.containers[id]
	if !ok {
		return nil, errf(errdefs.ErrNotFound, "container %q not found", id)
	}
	return c, nil
}

// lookupProcess finds a process: the init for exec id "".
func (s *Service) lookupProcess(cid, eid string) (*process, error) {
	if err := checkExecID(eid); err != nil {
		return nil, err
	}
	c, err := s.lookup(cid)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.processLocked(c, eid)
}

func (s *Service) processLocked(c *container, eid string) (*process, error) {
	if c.gone {
		return nil, errf(errdefs.ErrNotFound, "container %q not found", c.id)
	}
	if eid == "" {
		return c.init, nil
	}
	p, ok := c.execs[eid]
	if !ok {
		return nil, errf(errdefs.ErrNotFound, "process %q of container %q not found", eid, c.id)
	}
	return p, nil
}

// --- stdio ---------------------------------------------------------------------------------------

// newProcess makes a process and, for a non-terminal one, the pipes of the streams the host
// asked for (the others are /dev/null).
func newProcess(c *container, execID string, stdio *apiv1.Stdio) (_ *process, err error) {
	if stdio == nil {
		stdio = &apiv1.Stdio{}
	}
	p := &process{c: c, execID: execID, terminal: stdio.Terminal, exited: make(chan struct{})}
	if p.terminal {
		// stdin and stdout are the pty; stderr goes there too (stdio.stderr is unused).
		p.childIO.Terminal = true
		p.stdout, p.stderr = newOutStream(), newOutStream()
		p.stderr.attach(nil)
		return p, nil
	}
	var opened []*os.File
	defer func() {
		if err != nil {
			for _, f := range opened {
				f.Close()
			}
		}
	}()
	devNull := func(flag int) (*os.File, error) {
		f, err := os.OpenFile(os.DevNull, flag, 0)
		if err == nil {
			opened = append(opened, f)
		}
		return f, err
	}
	pipe := func() (r, w *os.File, err error) {
		r, w, err = os.Pipe()
		if err == nil {
			opened = append(opened, r, w)
		}
		return r, w, err
	}
	var stdout, stderr *os.File
	if stdio.Stdin {
		if p.childIO.Stdin, p.stdin, err = pipe(); err != nil {
			return nil, errf(errdefs.ErrInternal, "stdin pipe: %v", err)
		}
	} else if p.childIO.Stdin, err = devNull(os.O_RDONLY); err != nil {
		return nil, errf(errdefs.ErrInternal, "%v", err)
	}
	if stdio.Stdout {
		if stdout, p.childIO.Stdout, err = pipe(); err != nil {
			return nil, errf(errdefs.ErrInternal, "stdout pipe: %v", err)
		}
	} else if p.childIO.Stdout, err = devNull(os.O_WRONLY); err != nil {
		return nil, errf(errdefs.ErrInternal, "%v", err)
	}
	if stdio.Stderr {
		if stderr, p.childIO.Stderr, err = pipe(); err != nil {
			return nil, errf(errdefs.ErrInternal, "stderr pipe: %v", err)
		}
	} else if p.childIO.Stderr, err = devNull(os.O_WRONLY); err != nil {
		return nil, errf(errdefs.ErrInternal, "%v", err)
	}
	p.stdout, p.stderr = newOutStream(), newOutStream()
	p.stdout.attach(fileOrNil(stdout))
	p.stderr.attach(fileOrNil(stderr))
	return p, nil
}

func fileOrNil(f *os.File) io.ReadCloser {
	if f == nil {
		return nil
	}
	return f
}

// closeChildIO closes the agent's copies of the process's ends once runc has passed them on
// (or failed): the streams then end when the process's own copies close.
func (p *process) closeChildIO() {
	for _, f := range []*os.File{p.childIO.Stdin, p.childIO.Stdout, p.childIO.Stderr} {
		if f != nil {
			f.Close()
		}
	}
	p.childIO = ProcessIO{Terminal: p.terminal}
}

// started takes what the runtime answered: a terminal's master becomes stdin and stdout.
func (p *process) started(cr Created) {
	if p.terminal {
		p.stdout.attach(consoleOrNil(cr.Console))
	}
}

func consoleOrNil(c console.Console) io.ReadCloser {
	if c == nil {
		return nil
	}
	return c
}

// releaseLocked drops the process's streams and closes its stdin and pty; for a deleted
// process.
func (s *Service) releaseLocked(p *process) {
	p.stdout.Discard()
	p.stderr.Discard()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	if p.console != nil {
		p.console.Close()
		p.console = nil
	}
	p.closeChildIO()
}

// --- the RPCs ------------------------------------------------------------------------------------

// Ping answers the agent's version, the kernel's release, when the agent started and the
// guest's uptime (both CLOCK_BOOTTIME).
func (s *Service) Ping(ctx context.Context, _ *apiv1.PingRequest) (*apiv1.PingResponse, error) {
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	return &apiv1.PingResponse{Version: s.cfg.Version, Kernel: s.kernel,
		InitStartedNs: uint64(max(s.cfg.Started, 0)), UptimeNs: uint64(max(BootTime(), 0))}, nil
}

// decodeJSON decodes the request's JSON document what (a spec, a process, resources) into v,
// at most specLimit bytes; errors are InvalidArgument naming it.
func decodeJSON(what string, data []byte, v any) error {
	if len(data) > specLimit {
		return errf(errdefs.ErrInvalidArgument, "%s is %d bytes, more than %d", what, len(data), specLimit)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return errf(errdefs.ErrInvalidArgument, "%s: %v", what, err)
	}
	return nil
}

// parseSpec decodes and checks a container's spec and adapts it to the request's stdio.
func (s *Service) parseSpec(id string, data []byte, stdio *apiv1.Stdio) (*specs.Spec, error) {
	if len(data) == 0 {
		return nil, errf(errdefs.ErrInvalidArgument, "spec is empty")
	}
	var spec specs.Spec
	if err := decodeJSON("spec", data, &spec); err != nil {
		return nil, err
	}
	switch {
	case spec.Process == nil:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: process is missing")
	case len(spec.Process.Args) == 0:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: process.args is empty")
	case spec.Root == nil || spec.Root.Path == "":
		return nil, errf(errdefs.ErrInvalidArgument, "spec: root.path is missing")
	case spec.Linux == nil:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: linux is missing")
	}
	root := filepath.Clean(spec.Root.Path)
	if !filepath.IsAbs(root) || !strings.HasPrefix(root, s.cfg.RootDir+"/") {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: root.path %q is not below %s", spec.Root.Path, s.cfg.RootDir)
	}
	if h := spec.Hooks; h != nil && (len(h.Prestart) > 0 || len(h.CreateRuntime) > 0 || len(h.Poststart) > 0 || len(h.Poststop) > 0) {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: prestart, createRuntime, poststart and poststop hooks run on the host, not in the guest")
	}
	spec.Root.Path = root
	spec.Process.Terminal = stdio != nil && stdio.Terminal
	if spec.Linux.CgroupsPath == "" {
		spec.Linux.CgroupsPath = path.Join(apiv1.ContainersCgroup, id)
	}
	if !strings.HasPrefix(spec.Linux.CgroupsPath, "/") {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: linux.cgroupsPath %q is not an absolute cgroup path (the guest runs runc with cgroupfs)", spec.Linux.CgroupsPath)
	}
	if err := s.joinPodNamespaces(spec.Linux); err != nil {
		return nil, err
	}
	return &spec, nil
}

// joinPodNamespaces replaces the names of the pod's shared namespaces in l
// (apiv1.PodUserNamespace, apiv1.PodPIDNamespace) with the paths runc joins them by, the user
// namespace first: the pod's PID namespace is made in it.
func (s *Service) joinPodNamespaces(l *specs.Linux) error {
	for _, t := range []specs.LinuxNamespaceType{specs.UserNamespace, specs.PIDNamespace} {
		for i, ns := range l.Namespaces {
			var p string
			var err error
			switch {
			case t == specs.UserNamespace && ns.Type == t && ns.Path == apiv1.PodUserNamespace:
				p, err = s.podNS.User(l.UIDMappings, l.GIDMappings)
			case t == specs.PIDNamespace && ns.Type == t && ns.Path == apiv1.PodPIDNamespace:
				p, err = s.podNS.PID()
			default:
				continue
			}
			if err != nil {
				return errf(errdefs.ErrFailedPrecondition, "spec: %v", err)
			}
			l.Namespaces[i].Path = p
		}
	}
	return nil
}

// CreateContainer writes the bundle and creates the container with runc.
func (s *Service) CreateContainer(ctx context.Context, req *apiv1.CreateContainerRequest) (_ *apiv1.CreateContainerResponse, err error) {
	id := req.ContainerId
	if err := checkID("container_id", id); err != nil {
		return nil, err
	}
	spec, err := s.parseSpec(id, req.Spec, req.Stdio)
	if err != nil {
		return nil, err
	}
	if err := apiv1.CheckSubmounts(req.Submounts); err != nil {
		return nil, errf(errdefs.ErrInvalidArgument, "%v", err)
	}
	c := &container{id: id, bundle: filepath.Join(s.cfg.StateDir, id), cgroup: spec.Linux.CgroupsPath, execs: make(map[string]*process)}
	p, err := newProcess(c, "", req.Stdio)
	if err != nil {
		return nil, err
	}
	c.init = p
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	err = s.checkNewLocked(id)
	if err == nil {
		s.containers[id] = c
	}
	s.mu.Unlock()
	if err != nil {
		p.closeChildIO()
		s.mu.Lock()
		s.releaseLocked(p)
		s.mu.Unlock()
		return nil, err
	}
	defer func() {
		if err != nil {
			s.mu.Lock()
			c.gone = true
			delete(s.containers, id)
			// Whoever waits for this init hears that it is gone.
			s.exitLocked(p, 255, time.Now())
			s.releaseLocked(p)
			s.mu.Unlock()
			s.mounts.release(c.pins)
			os.RemoveAll(c.bundle)
		}
	}()

	if err := writeBundle(c.bundle, spec); err != nil {
		return nil, errf(errdefs.ErrInternal, "bundle: %v", err)
	}
	c.pins = s.mounts.pin(spec, req.Submounts)
	col := s.startCollecting()
	cr, err := s.cfg.Runtime.Create(context.WithoutCancel(ctx), id, c.bundle, p.childIO)
	p.closeChildIO()
	if err != nil {
		s.stopCollecting(col)
		return nil, runtimeErr("runc create", err)
	}
	p.started(cr)
	s.mu.Lock()
	p.console = cr.Console
	s.registerLocked(p, col, cr.Pid)
	ctxOOM, stop := context.WithCancel(context.Background())
	c.stopOOM = stop
	s.mu.Unlock()
	go s.cfg.Cgroups.WatchOOM(ctxOOM, c.cgroup, func() { s.queueOOM(id) })
	s.log.WithFields(logrus.Fields{"container": id, "pid": cr.Pid}).Info("container created")
	return &apiv1.CreateContainerResponse{Pid: uint32(cr.Pid)}, nil
}

// checkNewLocked says whether a container id can be created now.
func (s *Service) checkNewLocked(id string) error {
	if s.shutting {
		return errShuttingDown
	}
	if _, ok := s.containers[id]; ok {
		return errf(errdefs.ErrAlreadyExists, "container %q already exists", id)
	}
	return nil
}

func writeBundle(dir string, spec *specs.Spec) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
}

// ExecProcess records an exec; StartProcess runs it.
func (s *Service) ExecProcess(ctx context.Context, req *apiv1.ExecProcessRequest) (*apiv1.ExecProcessResponse, error) {
	if err := checkID("exec_id", req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	var ps specs.Process
	if err := decodeJSON("process", req.Process, &ps); err != nil {
		return nil, err
	}
	if len(ps.Args) == 0 {
		return nil, errf(errdefs.ErrInvalidArgument, "process: args is empty")
	}
	ps.Terminal = req.Stdio != nil && req.Stdio.Terminal
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.gone {
		return nil, errf(errdefs.ErrNotFound, "container %q not found", c.id)
	}
	if _, ok := c.execs[req.ExecId]; ok {
		return nil, errf(errdefs.ErrAlreadyExists, "process %q of container %q already exists", req.ExecId, c.id)
	}
	if st := c.init.state; st != stateRunning {
		return nil, errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", c.id, st)
	}
	p, err := newProcess(c, req.ExecId, req.Stdio)
	if err != nil {
		return nil, err
	}
	p.spec = &ps
	c.execs[req.ExecId] = p
	return &apiv1.ExecProcessResponse{}, nil
}

// StartProcess starts a container's init or an exec.
func (s *Service) StartProcess(ctx context.Context, req *apiv1.StartProcessRequest) (*apiv1.StartProcessResponse, error) {
	if err := checkExecID(req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	p, pid, err := s.startableLocked(c, req.ExecId)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}

	if p == c.init {
		if err := s.cfg.Runtime.Start(context.WithoutCancel(ctx), c.id); err != nil {
			return nil, runtimeErr("runc start", err)
		}
		s.mu.Lock()
		if p.state == stateCreated {
			p.state = stateRunning
		}
		s.mu.Unlock()
		return &apiv1.StartProcessResponse{Pid: uint32(pid)}, nil
	}

	col := s.startCollecting()
	cr, err := s.cfg.Runtime.Exec(context.WithoutCancel(ctx), c.id, p.execID, p.spec, p.childIO)
	p.closeChildIO()
	if err != nil {
		s.stopCollecting(col)
		s.mu.Lock()
		// The exec never ran: it is stopped with status 255 (what containerd's runc shim
		// answers for a process that failed to start), its streams at their end (its pipes'
		// ends were closed above; a terminal never had one).
		if p.terminal {
			p.stdout.attach(nil)
		}
		s.exitLocked(p, 255, time.Now())
		s.mu.Unlock()
		return nil, runtimeErr("runc exec", err)
	}
	p.started(cr)
	s.mu.Lock()
	p.console = cr.Console
	p.spec = nil
	if p.state == stateCreated {
		p.state = stateRunning
	}
	s.registerLocked(p, col, cr.Pid)
	s.mu.Unlock()
	return &apiv1.StartProcessResponse{Pid: uint32(cr.Pid)}, nil
}

// startableLocked finds a process that StartProcess may start, and its pid (the init's, known
// since create).
func (s *Service) startableLocked(c *container, eid string) (*process, int, error) {
	p, err := s.processLocked(c, eid)
	switch {
	case err != nil:
		return nil, 0, err
	case p.state != stateCreated:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is %s, not created", eid, c.id, p.state)
	case c.paused:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "container %q is paused", c.id)
	case p != c.init && c.init.state != stateRunning:
		return nil, 0, errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", c.id, c.init.state)
	}
	return p, p.pid, nil
}

// SignalProcess signals a process, or with all every process of the container.
func (s *Service) SignalProcess(ctx context.Context, req *apiv1.SignalProcessRequest) (*apiv1.SignalProcessResponse, error) {
	if req.Signal == 0 || req.Signal > 64 {
		return nil, errf(errdefs.ErrInvalidArgument, "signal %d is not a signal (1 to 64)", req.Signal)
	}
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	sig := syscall.Signal(req.Signal)
	s.mu.Lock()
	state, pid := p.state, p.pid
	s.mu.Unlock()
	if p == p.c.init {
		if state == stateStopped && !req.All {
			return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
		}
		if err := s.cfg.Runtime.Kill(ctx, p.c.id, sig, req.All); err != nil {
			// runc refuses ("container not running") an init that has exited and that the
			// reaper has not reported yet: once it has, the signal was for an exited process.
			select {
			case <-p.exited:
				return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
			case <-time.After(exitReportWait):
			}
			return nil, runtimeErr("runc kill", err)
		}
		return &apiv1.SignalProcessResponse{}, nil
	}
	switch state {
	case stateCreated:
		return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is not started", req.ExecId, p.c.id)
	case stateStopped:
		return nil, errf(errdefs.ErrNotFound, "process %q of container %q has exited", req.ExecId, p.c.id)
	}
	if err := s.cfg.Runtime.Signal(pid, sig); err != nil {
		return nil, runtimeErr("kill", err)
	}
	return &apiv1.SignalProcessResponse{}, nil
}

// WaitProcess waits for a process's exit.
func (s *Service) WaitProcess(ctx context.Context, req *apiv1.WaitProcessRequest) (*apiv1.WaitProcessResponse, error) {
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	select {
	case <-p.exited:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, errShuttingDown
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return &apiv1.WaitProcessResponse{
		Pid:        uint32(p.pid),
		ExitStatus: uint32(p.exitStatus),
		ExitedAt:   timestamppb.New(p.exitedAt),
	}, nil
}

// DeleteProcess forgets an exited process; for the init, deletes the container.
func (s *Service) DeleteProcess(ctx context.Context, req *apiv1.DeleteProcessRequest) (*apiv1.DeleteProcessResponse, error) {
	if err := checkExecID(req.ExecId); err != nil {
		return nil, err
	}
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	if req.ExecId != "" {
		s.mu.Lock()
		defer s.mu.Unlock()
		p, err := s.processLocked(c, req.ExecId)
		if err != nil {
			return nil, err
		}
		if p.state == stateRunning {
			return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is running", req.ExecId, c.id)
		}
		delete(c.execs, req.ExecId)
		// An exec deleted before it started never runs: whoever waits for it hears 255.
		s.exitLocked(p, 255, time.Now())
		s.releaseLocked(p)
		return &apiv1.DeleteProcessResponse{}, nil
	}

	s.mu.Lock()
	if c.gone {
		s.mu.Unlock()
		return nil, errf(errdefs.ErrNotFound, "container %q not found", c.id)
	}
	initState := c.init.state
	if initState == stateRunning {
		s.mu.Unlock()
		return nil, errf(errdefs.ErrFailedPrecondition, "container %q is running", c.id)
	}
	for eid, p := range c.execs {
		if p.state == stateRunning {
			s.mu.Unlock()
			return nil, errf(errdefs.ErrFailedPrecondition, "container %q still runs its process %q", c.id, eid)
		}
	}
	s.mu.Unlock()
	// A container that never started still has its init waiting in runc: force kills it.
	if err := s.cfg.Runtime.Delete(context.WithoutCancel(ctx), c.id, initState == stateCreated); err != nil {
		return nil, runtimeErr("runc delete", err)
	}
	s.forget(c)
	return &apiv1.DeleteProcessResponse{}, nil
}

// forget removes a deleted container and its bundle.
func (s *Service) forget(c *container) {
	s.mu.Lock()
	c.gone = true
	delete(s.containers, c.id)
	if c.stopOOM != nil {
		c.stopOOM()
	}
	s.releaseLocked(c.init)
	for _, p := range c.execs {
		s.releaseLocked(p)
	}
	s.mu.Unlock()
	s.mounts.release(c.pins)
	if err := os.RemoveAll(c.bundle); err != nil {
		s.log.WithError(err).WithField("container", c.id).Warn("removing the bundle")
	}
	s.log.WithField("container", c.id).Info("container deleted")
}

func checkMax(max uint32) error {
	if max == 0 || max > MaxRead {
		return errf(errdefs.ErrInvalidArgument, "max %d is not 1 to %d", max, MaxRead)
	}
	return nil
}

// ReadStdout answers the process's output (a terminal's, for a terminal process).
func (s *Service) ReadStdout(ctx context.Context, req *apiv1.ReadStreamRequest) (*apiv1.ReadStreamResponse, error) {
	return s.read(ctx, req, func(p *process) *outStream { return p.stdout })
}

// ReadStderr answers the process's stderr; eof at once for a terminal.
func (s *Service) ReadStderr(ctx context.Context, req *apiv1.ReadStreamRequest) (*apiv1.ReadStreamResponse, error) {
	return s.read(ctx, req, func(p *process) *outStream { return p.stderr })
}

func (s *Service) read(ctx context.Context, req *apiv1.ReadStreamRequest, which func(*process) *outStream) (*apiv1.ReadStreamResponse, error) {
	if err := checkMax(req.Max); err != nil {
		return nil, err
	}
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	data, eof, err := which(p).Read(ctx, s.done, int(req.Max))
	if err != nil {
		return nil, err
	}
	return &apiv1.ReadStreamResponse{Data: data, Eof: eof}, nil
}

// stdinOf answers where the process's stdin is written: its pipe or its pty.
func (s *Service) stdinOf(cid, eid string) (io.Writer, *process, error) {
	p, err := s.lookupProcess(cid, eid)
	if err != nil {
		return nil, nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.stdinShut {
		return nil, nil, errf(errdefs.ErrFailedPrecondition, "the stdin of process %q of container %q is closed", eid, cid)
	}
	if p.terminal {
		if p.console == nil {
			return nil, nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is not started: no terminal yet", eid, cid)
		}
		return p.console, p, nil
	}
	if p.stdin == nil {
		return nil, nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q was created without stdin", eid, cid)
	}
	return p.stdin, p, nil
}

// WriteStdin writes all of data to the process's stdin.
func (s *Service) WriteStdin(ctx context.Context, req *apiv1.WriteStdinRequest) (*apiv1.WriteStdinResponse, error) {
	w, _, err := s.stdinOf(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write(req.Data); err != nil {
		return nil, errf(errdefs.ErrFailedPrecondition, "writing stdin: %v", err)
	}
	return &apiv1.WriteStdinResponse{}, nil
}

// CloseStdin closes the process's stdin; for a terminal it sends the end-of-file character.
func (s *Service) CloseStdin(ctx context.Context, req *apiv1.CloseStdinRequest) (*apiv1.CloseStdinResponse, error) {
	w, p, err := s.stdinOf(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	p.stdinShut = true
	s.mu.Unlock()
	if p.terminal {
		// VEOF (^D) at the start of a line: the process's read answers end of file.
		_, err = w.Write([]byte{4})
	} else {
		err = w.(*os.File).Close()
	}
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "closing stdin: %v", err)
	}
	return &apiv1.CloseStdinResponse{}, nil
}

// ResizePty sets a terminal process's window size.
func (s *Service) ResizePty(ctx context.Context, req *apiv1.ResizePtyRequest) (*apiv1.ResizePtyResponse, error) {
	if req.Width > 0xffff || req.Height > 0xffff {
		return nil, errf(errdefs.ErrInvalidArgument, "window size %dx%d is larger than 65535x65535", req.Width, req.Height)
	}
	p, err := s.lookupProcess(req.ContainerId, req.ExecId)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	con := p.console
	s.mu.Unlock()
	if !p.terminal {
		return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q has no terminal", req.ExecId, req.ContainerId)
	}
	if con == nil {
		return nil, errf(errdefs.ErrFailedPrecondition, "process %q of container %q is not started: no terminal yet", req.ExecId, req.ContainerId)
	}
	if err := con.Resize(console.WinSize{Width: uint16(req.Width), Height: uint16(req.Height)}); err != nil {
		return nil, errf(errdefs.ErrInternal, "resize: %v", err)
	}
	return &apiv1.ResizePtyResponse{}, nil
}

// Stats answers the container cgroup's metrics, or without a container id the pod's: those of
// ContainersCgroup.
func (s *Service) Stats(ctx context.Context, req *apiv1.StatsRequest) (*apiv1.StatsResponse, error) {
	group := apiv1.ContainersCgroup
	if req.ContainerId != "" {
		c, err := s.lookup(req.ContainerId)
		if err != nil {
			return nil, err
		}
		group = c.cgroup
	}
	m, err := s.cfg.Cgroups.Stats(group)
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "cgroup %s: %v", group, err)
	}
	a, err := typeurl.MarshalAnyToProto(m)
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "marshal stats: %v", err)
	}
	return &apiv1.StatsResponse{Stats: a}, nil
}

// UpdateContainer applies new resource limits.
func (s *Service) UpdateContainer(ctx context.Context, req *apiv1.UpdateContainerRequest) (*apiv1.UpdateContainerResponse, error) {
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	var r specs.LinuxResources
	if err := decodeJSON("resources", req.Resources, &r); err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	if err := s.cfg.Runtime.Update(context.WithoutCancel(ctx), c.id, &r); err != nil {
		return nil, runtimeErr("runc update", err)
	}
	return &apiv1.UpdateContainerResponse{}, nil
}

// PauseContainer freezes the container.
func (s *Service) PauseContainer(ctx context.Context, req *apiv1.PauseContainerRequest) (*apiv1.PauseContainerResponse, error) {
	if err := s.setPaused(ctx, req.ContainerId, true); err != nil {
		return nil, err
	}
	return &apiv1.PauseContainerResponse{}, nil
}

// ResumeContainer thaws the container.
func (s *Service) ResumeContainer(ctx context.Context, req *apiv1.ResumeContainerRequest) (*apiv1.ResumeContainerResponse, error) {
	if err := s.setPaused(ctx, req.ContainerId, false); err != nil {
		return nil, err
	}
	return &apiv1.ResumeContainerResponse{}, nil
}

func (s *Service) setPaused(ctx context.Context, id string, pause bool) error {
	c, err := s.lookup(id)
	if err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	state, paused, gone := c.init.state, c.paused, c.gone
	s.mu.Unlock()
	switch {
	case gone:
		return errf(errdefs.ErrNotFound, "container %q not found", id)
	case state != stateRunning:
		return errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", id, state)
	case pause && paused:
		return errf(errdefs.ErrFailedPrecondition, "container %q is already paused", id)
	case !pause && !paused:
		return errf(errdefs.ErrFailedPrecondition, "container %q is not paused", id)
	}
	if pause {
		err = s.cfg.Runtime.Pause(context.WithoutCancel(ctx), id)
	} else {
		err = s.cfg.Runtime.Resume(context.WithoutCancel(ctx), id)
	}
	if err != nil {
		return runtimeErr("runc pause/resume", err)
	}
	s.mu.Lock()
	c.paused = pause
	s.mu.Unlock()
	return nil
}

func (s *Service) queueOOM(id string) {
	select {
	case s.oom <- id:
		s.log.WithField("container", id).Warn("OOM kill")
	default:
		s.log.WithField("container", id).Warn("OOM kill not queued: the queue is full")
	}
}

// GetOOMEvent waits for the next OOM kill.
func (s *Service) GetOOMEvent(ctx context.Context, _ *apiv1.GetOOMEventRequest) (*apiv1.GetOOMEventResponse, error) {
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	select {
	case id := <-s.oom:
		return &apiv1.GetOOMEventResponse{ContainerId: id}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, errShuttingDown
	}
}

// Shutdown ends every container (Config.KillAll), or kills and deletes each through the
// runtime, then closes Done; what follows (sync, unmount, power-off) is the caller's of Done,
// after this answer has been sent.
func (s *Service) Shutdown(ctx context.Context, _ *apiv1.ShutdownRequest) (*apiv1.ShutdownResponse, error) {
	s.shutdownOnce.Do(func() {
		s.mu.Lock()
		s.shutting = true
		var cs []*container
		for _, c := range s.containers {
			cs = append(cs, c)
		}
		s.mu.Unlock()
		if s.cfg.KillAll != nil {
			s.killAll(cs)
		} else {
			for _, c := range cs {
				s.stopContainer(c)
			}
		}
		close(s.done)
	})
	return &apiv1.ShutdownResponse{}, nil
}

// killAll kills every process but the agent (Config.KillAll) and waits a little for the
// containers' init processes to exit, so that what they wrote is in the page cache before the
// caller syncs.
func (s *Service) killAll(cs []*container) {
	if err := s.cfg.KillAll(); err != nil {
		s.log.WithError(err).Warn("killing every process at shutdown")
	}
	deadline := time.After(shutdownWait)
	for _, c := range cs {
		select {
		case <-c.init.exited:
		case <-deadline:
			s.log.WithField("container", c.id).Warn("init did not exit after SIGKILL")
			return
		}
	}
}

// stopContainer kills everything in c, waits a little for its init to exit and deletes it.
func (s *Service) stopContainer(c *container) {
	ctx, cancel := context.WithTimeout(context.Background(), shutdownWait)
	defer cancel()
	log := s.log.WithField("container", c.id)
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	gone, paused := c.gone, c.paused
	s.mu.Unlock()
	if gone {
		return
	}
	if err := s.cfg.Runtime.Kill(ctx, c.id, syscall.SIGKILL, true); err != nil {
		log.WithError(err).Debug("kill at shutdown")
	}
	if paused {
		// SIGKILL reaches frozen processes only once they are thawed.
		if err := s.cfg.Runtime.Resume(ctx, c.id); err != nil {
			log.WithError(err).Debug("resume at shutdown")
		}
	}
	select {
	case <-c.init.exited:
	case <-ctx.Done():
		log.Warn("init did not exit after SIGKILL")
	}
	if err := s.cfg.Runtime.Delete(ctx, c.id, true); err != nil {
		log.WithError(err).Warn("delete at shutdown")
	}
	s.forget(c)
}
