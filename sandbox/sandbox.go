package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// Timeouts of the VM's and the monitor's decisions.
const (
	// vmStopGrace is how long QEMU has to exit after SIGTERM before SIGKILL.
	vmStopGrace = 3 * time.Second
	// serverExitGrace: when the server exits, the VM may be ending too (a guest power-off ends
	// QEMU, which ends the server's connection). A server's exit is a failure only if the VM is
	// still running this long after it. A server killed by a signal did not end with its VM:
	// its death is a failure at once.
	serverExitGrace = time.Second
)

// Options are the inputs of Create besides the sandbox ID.
type Options struct {
	// Config is the configuration; nil means DefaultConfig().
	Config *Config
	// Annotations are the pod's annotations (untrusted): those under Config.Annotations.Prefix
	// override enabled keys.
	Annotations map[string]string
	// Runner starts the VM; nil means QEMURunner.
	Runner VMRunner
	// OOMScoreAdj is the pod's oom_score_adj, given to QEMU and to the server's processes
	// (see oom.go); nil: they keep the owner's.
	OOMScoreAdj *int
}

// Sandbox is one pod's virtio-fs side: its directory layout, its vhost-user socket, its
// server, and the VM connected to it. See the package documentation for the lifecycle and
// the lock order.
type Sandbox struct {
	id     string
	dir    string
	cfg    *Config         // resolved; never modified
	runner VMRunner        // nil for a recovered sandbox (it cannot Start)
	ctx    context.Context // for the servers' lifetime and logging; never cancelled
	lock   *os.File        // owner.lock, flocked while this process owns the sandbox
	mnt    *mountNS        // where the share's mounts are; closed by Stop

	created time.Time

	// opMu serialises Start, Stop, Bind, Unbind and the failure policy. Taken before mu.
	opMu sync.Mutex

	mu          sync.Mutex
	phase       Phase         // guarded by mu
	srv         fsServer      // guarded by mu
	vm          Process       // guarded by mu
	vmRec       *vmRecord     // guarded by mu
	vmAccel     string        // guarded by mu; the accelerator Start gave the VM
	out         *vmOutput     // guarded by mu; the VM's console and QEMU's output
	vmExited    chan struct{} // guarded by mu; closed by watchVM (see VMExited)
	agentSecret []byte        // guarded by mu; the VM's agent secret (Start), nil before
	restarts    int           // guarded by mu
	lastFailure error         // guarded by mu; the last server failure, restarted or not
	failure     error         // guarded by mu; why the sandbox failed (PhaseFailed)
	done        chan struct{} // closed under mu on PhaseFailed or PhaseStopped
	doneClosed  bool          // guarded by mu
	// dax is the DAX policy set with SetDAXPolicy (nil: the configuration's); guarded by mu,
	// and written with opMu held too, so startServer (under opMu) reads it without mu. A
	// restarted in-process server gets it again.
	dax *passthrough.DAXPolicy
	// oomAdj is the oom_score_adj of QEMU and of the server (nil: the owner's), set by Create
	// and RaiseOOMScoreAdj; guarded by mu, and written with opMu held too, so startServer
	// (under opMu) reads it without mu. A restarted server gets it again.
	oomAdj *int

	wg sync.WaitGroup // monitor goroutines
}

var idRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

func checkID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("invalid sandbox id %q: want 1 to 128 letters, digits, '_', '.' or '-', starting with a letter or digit", id)
	}
	return nil
}

// Create sets up the sandbox id: its directory under the base directory, the mounts, the
// vhost-user socket and the server listening on it, so that a VM started afterwards finds it
// ready. A bad configuration or annotation fails before anything is created; a failure later
// undoes what was done.
func Create(ctx context.Context, id string, opts Options) (_ *Sandbox, err error) {
	cfg := opts.Config
	if cfg == nil {
		cfg = DefaultConfig()
	}
	rc, err := cfg.Resolve(opts.Annotations)
	if err != nil {
		return nil, err
	}
	if err := checkID(id); err != nil {
		return nil, err
	}
	if opts.OOMScoreAdj != nil {
		if err := CheckOOMScoreAdj(*opts.OOMScoreAdj); err != nil {
			return nil, fmt.Errorf("sandbox %s: %w", id, err)
		}
	}
	if !isKvfsd(rc.Server.Daemon) {
		if err := checkExecutable(rc.Server.Daemon); err != nil {
			return nil, &ConfigError{Source: "config", Key: "server.daemon", Value: strconv.Quote(rc.Server.Daemon), Err: err}
		}
	}
	base, err := prepareBaseDir(rc.BaseDir)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(base, id)
	if sock := filepath.Join(dir, socketName); len(sock) > maxSocketPath {
		return nil, fmt.Errorf("sandbox %s: socket path %s is %d bytes, longer than the %d a Unix socket address holds; use a shorter base_dir",
			id, sock, len(sock), maxSocketPath)
	}
	runner := opts.Runner
	if runner == nil {
		runner = QEMURunner{}
	}

	if err := os.Mkdir(dir, sandboxDirMode); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("sandbox %s already exists (%s)", id, dir)
		}
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}
	var lock *os.File
	var mnt *mountNS
	defer func() {
		if err != nil {
			if terr := teardown(dir, mnt); terr != nil {
				err = fmt.Errorf("%w (and cleaning up: %v)", err, terr)
			}
			if lock != nil {
				lock.Close()
			}
		}
	}()
	if err := os.Chmod(dir, sandboxDirMode); err != nil {
		return nil, err
	}
	if lock, err = createOwnerLock(dir); err != nil {
		return nil, err
	}
	for _, d := range []struct {
		name string
		mode os.FileMode
	}{{mountsName, shareRootMode}, {sharedName, sharedDirMode}} {
		p := filepath.Join(dir, d.name)
		if err := os.Mkdir(p, d.mode); err != nil {
			return nil, err
		}
		if err := os.Chmod(p, d.mode); err != nil {
			return nil, err
		}
	}
	if mnt, err = newMountNS(func() error { return setupMounts(dir) }); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}
	if err := mnt.pin(dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}

	s := &Sandbox{
		id: id, dir: dir, cfg: rc, runner: runner, lock: lock, mnt: mnt,
		ctx:     log.WithLogger(context.WithoutCancel(ctx), log.G(ctx).WithField("sandbox", id)),
		created: time.Now(), phase: PhaseCreated, done: make(chan struct{}), oomAdj: opts.OOMScoreAdj,
	}
	srv, err := s.startServer()
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: starting the virtio-fs server: %w", id, err)
	}
	s.srv = srv
	s.mu.Lock()
	err = s.persistLocked()
	s.mu.Unlock()
	if err != nil {
		_ = srv.stop()
		return nil, err
	}
	s.wg.Add(1)
	go s.watchServer(srv)
	log.G(s.ctx).WithField("server", srv.describe()).Info("sandbox created")
	return s, nil
}

// prepareBaseDir creates the base directory if needed and returns its real path.
func prepareBaseDir(base string) (string, error) {
	if err := checkAbsPath(base); err != nil {
		return "", &ConfigError{Source: "config", Key: "base_dir", Value: strconv.Quote(base), Err: err}
	}
	if err := os.MkdirAll(base, baseDirMode); err != nil {
		return "", err
	}
	real, err := filepath.EvalSymlinks(base)
	if err != nil {
		return "", err
	}
	fi, err := os.Lstat(real)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("base directory %s is not a directory", base)
	}
	return real, nil
}

func checkExecutable(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", path)
	}
	return nil
}

// createOwnerLock creates dir/owner.lock and locks it: while the lock is held, Recover in
// another process leaves the sandbox alone.
func createOwnerLock(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	_, _ = f.WriteString(strconv.Itoa(os.Getpid()) + "\n")
	return f, nil
}

// ID returns the sandbox ID.
func (s *Sandbox) ID() string { return s.id }

// Dir returns the sandbox directory.
func (s *Sandbox) Dir() string { return s.dir }

// MountsDir is where root filesystems and volumes are bound (see Bind); what is mounted there
// appears in SharedDir and so in the guest.
func (s *Sandbox) MountsDir() string { return filepath.Join(s.dir, mountsName) }

// SharedDir is the directory the server exports: a read-only slave bind of MountsDir.
func (s *Sandbox) SharedDir() string { return filepath.Join(s.dir, sharedName) }

// SocketPath is the vhost-user socket the VM connects to.
func (s *Sandbox) SocketPath() string { return filepath.Join(s.dir, socketName) }

// AgentSocketPath is the host side of the guest agent's virtio-serial port (transport
// serial): QEMU listens on it, the shim connects.
func (s *Sandbox) AgentSocketPath() string { return filepath.Join(s.dir, agentSockName) }

// ConsolePath is the file that keeps the guest's serial console, sanitized: its last MiB,
// the MiB before in ConsolePath()+".1".
func (s *Sandbox) ConsolePath() string { return filepath.Join(s.dir, consoleName) }

// Config returns the pod's resolved configuration.
func (s *Sandbox) Config() *Config { return s.cfg.Clone() }

// Done is closed when the sandbox has failed (see Err) or been stopped.
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// Err returns why the sandbox failed (a *ServerError), or nil.
func (s *Sandbox) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failure
}

// Phase returns the sandbox's phase.
func (s *Sandbox) Phase() Phase {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.phase
}

// VMExited returns a channel closed when the VM has exited and what it wrote last is kept
// (console.log and qemu.log are complete, VMError quotes their end); nil before Start (a
// nil channel never becomes ready).
func (s *Sandbox) VMExited() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.vmExited == nil {
		return nil
	}
	return s.vmExited
}

// RootCmdline is what the kernel command line says of a root image (VM.Root): the kernel
// mounts it itself, read-only, with DAX (its pages mapped from the device, never copied into
// the page cache), and starts the agent, /init.
const RootCmdline = "root=/dev/pmem0 rootfstype=erofs rootflags=dax ro rootwait init=/init"

func (s *Sandbox) checkNotStopping() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.phase == PhaseStopping || s.phase == PhaseStopped {
		return fmt.Errorf("sandbox %s is %s", s.id, s.phase)
	}
	return nil
}

// Stop tears the sandbox down in order: the VM (SIGTERM, then SIGKILL), the server, the
// mounts (MNT_DETACH|UMOUNT_NOFOLLOW), the directory. It carries on past errors and returns
// them all; the directory is not removed while anything under it is still mounted, and then
// the state file says "stopping" so that Recover finishes the job. Stop is idempotent.
func (s *Sandbox) Stop(ctx context.Context) error {
	s.opMu.Lock()
	s.mu.Lock()
	if s.phase == PhaseStopped {
		s.mu.Unlock()
		s.opMu.Unlock()
		return nil
	}
	s.phase = PhaseStopping
	perr := s.persistLocked()
	vm, out, srv := s.vm, s.out, s.srv
	s.mu.Unlock()

	var errs []error
	if perr != nil {
		log.G(ctx).WithError(perr).WithField("sandbox", s.id).Warn("recording the stop")
	}
	if vm != nil {
		if err := terminate(vm, vmStopGrace); err != nil {
			errs = append(errs, fmt.Errorf("stopping the VM: %w", err))
		}
	}
	if out != nil {
		out.stop()
	}
	if srv != nil {
		if err := srv.stop(); err != nil {
			errs = append(errs, fmt.Errorf("stopping the server: %w", err))
		}
	}
	if err := teardown(s.dir, s.mnt); err != nil {
		errs = append(errs, err)
	}
	s.lock.Close()

	s.mu.Lock()
	s.phase = PhaseStopped
	s.closeDoneLocked()
	s.mu.Unlock()
	s.opMu.Unlock()
	s.wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sandbox %s: stop: %w", s.id, err)
	}
	log.G(s.ctx).Info("sandbox stopped")
	return nil
}

func (s *Sandbox) closeDoneLocked() {
	if !s.doneClosed {
		s.doneClosed = true
		close(s.done)
	}
}

// persistLocked writes the state file. s.mu is held.
func (s *Sandbox) persistLocked() error {
	st := &state{
		Version:     stateVersion,
		ID:          s.id,
		Created:     s.created,
		Phase:       s.phase,
		Config:      s.cfg,
		VM:          s.vmRec,
		Restarts:    s.restarts,
		Owner:       ownerID(),
		DAX:         recordDAX(s.dax),
		OOMScoreAdj: s.oomAdj,
	}
	if s.srv != nil {
		rec := s.srv.record()
		st.Server = &rec
	}
	if s.failure != nil {
		st.Failure = s.failure.Error()
	}
	return writeState(s.dir, st)
}

func ownerID() procID {
	id, err := identify(os.Getpid())
	if err != nil {
		return procID{PID: os.Getpid(), BootID: bootID()}
	}
	return id
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
