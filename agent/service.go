package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/console"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"

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
	// PodTmpfsDir is where the pod's tmpfs volumes are mounted (default apiv1.PodTmpfsDir).
	PodTmpfsDir string
	// MirrorDir is where mirrored volumes are copied (default apiv1.MirrorDir).
	MirrorDir string
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
	// podTmpfs are the pod's tmpfs volumes.
	podTmpfs *podTmpfs
	podNS    *podNamespaces // the pod's shared PID and user namespaces; its lock is a leaf
	ports    *portStreams   // port-forward's connections (ports.go); its lock is a leaf
	oom      chan string    // the queue of OOM events; GetOOMEvent takes from it
	done     chan struct{}  // closed when Shutdown has stopped everything

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
	// mirrors are the copies of its mirrored volumes (mirror.go) and the end of their
	// polling; set by its creation, before it is visible.
	mirrors    []string
	mirroring  []<-chan struct{}
	endMirrors context.CancelFunc
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
	if cfg.PodTmpfsDir == "" {
		cfg.PodTmpfsDir = apiv1.PodTmpfsDir
	}
	if cfg.MirrorDir == "" {
		cfg.MirrorDir = apiv1.MirrorDir
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
		podTmpfs:   newPodTmpfs(cfg.PodTmpfsDir),
		podNS:      &podNamespaces{init: cfg.PodInit},
		ports:      newPortStreams(),
		oom:        make(chan string, oomQueueLen),
		done:       make(chan struct{}),
		containers: make(map[string]*container),
		byPid:      make(map[int]*process),
		collectors: make(map[*exitCollector]struct{}),
	}, nil
}

// Done is closed once Shutdown has killed and deleted every container.
func (s *Service) Done() <-chan struct{} { return s.done }

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

// Ping answers the agent's version, the kernel's release, when the agent started and the
// guest's uptime (both CLOCK_BOOTTIME).
func (s *Service) Ping(ctx context.Context, _ *apiv1.PingRequest) (*apiv1.PingResponse, error) {
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	return &apiv1.PingResponse{Version: s.cfg.Version, Kernel: s.kernel,
		InitStartedNs: uint64(max(s.cfg.Started, 0)), UptimeNs: uint64(max(BootTime(), 0))}, nil
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
		s.ports.closeAll()
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
