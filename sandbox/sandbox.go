package sandbox

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox/serverproc"
	"github.com/kvfs/kvfs/virtiofs"
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
	defer func() {
		if err != nil {
			if terr := teardown(dir); terr != nil {
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
	if err := setupMounts(dir); err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", id, err)
	}

	s := &Sandbox{
		id: id, dir: dir, cfg: rc, runner: runner, lock: lock,
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

func (s *Sandbox) fsDevice() FSDevice {
	return FSDevice{
		Socket:           s.SocketPath(),
		Tag:              s.cfg.Device.Tag,
		QueueSize:        s.cfg.Device.QueueSize,
		NumRequestQueues: s.cfg.RequestQueues(),
	}
}

// DefaultVM returns the VM the configuration describes, connected to this sandbox (Start adds
// the serial console, kept in ConsolePath), with the configured guest kernel and root image or
// initrd, the agent channel of agent.transport, and the kernel command line the guest agent
// reads:
//
//	console=ttyS0 quiet panic=-1 kvfs.tag=<device.tag> kvfs.agent=serial|vsock:1024 [RootCmdline] [vm.kernel_params]
func (s *Sandbox) DefaultVM() VM {
	c := s.cfg.VM
	accel := c.Accel
	if accel == "" {
		accel = DetectAccel()
	}
	vm := VM{
		Name: "kvfs-" + s.id, Machine: c.Machine, Accel: accel, CPU: c.CPU, VCPUs: c.VCPUs,
		Memory:            Memory{Size: c.Memory, Hugepages: c.Hugepages, Path: c.FileMemPath, Placement: c.MemoryPlacement},
		FS:                s.fsDevice(),
		FreePageReporting: c.FreePageReporting,
		TCGTBSize:         c.TCGTBSize,
	}
	if c.Hugepages {
		vm.Memory.Path = c.HugepagePath
	}
	vm.Kernel, vm.Initrd, vm.Root = c.Kernel, c.Initrd, c.Rootfs
	transport := agent.CmdlineTransport + "=" + AgentSerial
	switch s.cfg.Agent.Transport {
	case AgentVsock:
		vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: GuestCID(s.id)}
		transport = fmt.Sprintf("%s=%s:%d", agent.CmdlineTransport, AgentVsock, agent.DefaultVsockPort)
	default:
		vm.Agent = AgentDevice{Transport: AgentSerial, Socket: s.AgentSocketPath()}
	}
	vm.Cmdline = fmt.Sprintf("console=ttyS0 quiet panic=-1 %s=%s %s", agent.CmdlineTag, s.cfg.Device.Tag, transport)
	if vm.Root != "" {
		vm.Cmdline += " " + RootCmdline
	}
	if c.KernelParams != "" {
		vm.Cmdline += " " + c.KernelParams
	}
	return vm
}

// RootCmdline is what the kernel command line says of a root image (VM.Root): the kernel
// mounts it itself, read-only, with DAX (its pages mapped from the device, never copied into
// the page cache), and starts the agent, /init.
const RootCmdline = "root=/dev/pmem0 rootfstype=erofs rootflags=dax ro rootwait init=/init"

// GuestCID is the vsock context id DefaultVM gives the guest of sandbox id: a hash of the id
// in 3 to 2^31-1, so that sandboxes on one host rarely collide (QEMU refuses a CID in use, and
// the start then fails with that error).
func GuestCID(id string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(id))
	return 3 + h.Sum32()%(1<<31-4)
}

// DetectAccel returns AccelKVM if /dev/kvm can be opened, else AccelTCG.
func DetectAccel() string {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return AccelTCG
	}
	f.Close()
	return AccelKVM
}

// Start runs the VM vm, its virtio-fs device and its serial console set to the sandbox's
// (vm.FS and vm.Console are replaced): the sandbox drains the console and QEMU's output into
// console.log and qemu.log, each kept bounded. The server is already listening. A sandbox
// runs one VM in its life.
func (s *Sandbox) Start(ctx context.Context, vm VM) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	phase, srv := s.phase, s.srv
	s.mu.Unlock()
	if phase != PhaseCreated {
		return fmt.Errorf("sandbox %s: cannot start a VM in phase %s", s.id, phase)
	}
	if s.runner == nil {
		return fmt.Errorf("sandbox %s: a recovered sandbox cannot start a VM", s.id)
	}
	select {
	case <-srv.exited():
		return fmt.Errorf("sandbox %s: the virtio-fs server has exited: %v", s.id, srv.exitErr())
	default:
	}
	vm.FS = s.fsDevice()
	out, console, qemuOut, err := newVMOutput(s.ctx, s.dir)
	if err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	vm.Console = console
	var secret []byte
	vm.AgentSecret = nil
	if vm.Agent.Transport != "" {
		var f *os.File
		if secret, f, err = newAgentSecret(); err != nil {
			console.Close()
			qemuOut.Close()
			out.close()
			return fmt.Errorf("sandbox %s: %w", s.id, err)
		}
		vm.AgentSecret = f
		defer f.Close() // QEMU has read it once it runs
	}
	args, err := vm.Args()
	if err != nil {
		console.Close()
		qemuOut.Close()
		out.close()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	cmd := VMCommand{Path: s.cfg.VM.QEMU, Args: args, Output: qemuOut, ExtraFiles: vm.Files(), NetNS: vm.NetNS}
	p, err := s.runner.Run(ctx, cmd)
	console.Close()
	qemuOut.Close()
	if err != nil {
		out.close()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	if s.oomAdj != nil && p.Pid() > 0 {
		// Before the guest's first container: the guest runs only the kernel and the agent.
		if err := setOOMScoreAdj(p.Pid(), *s.oomAdj); err != nil {
			_ = kill(p)
			out.close()
			return fmt.Errorf("sandbox %s: the VM: %w", s.id, err)
		}
	}
	out.start()
	rec := &vmRecord{Path: cmd.Path, Args: args, Started: time.Now()}
	if pid := p.Pid(); pid > 0 {
		if id, err := identify(pid); err == nil {
			rec.Process = &id
		}
	}
	exited := make(chan struct{})
	s.mu.Lock()
	s.vm, s.vmRec, s.vmAccel, s.out, s.vmExited, s.phase = p, rec, vm.Accel, out, exited, PhaseRunning
	s.agentSecret = secret
	err = s.persistLocked()
	if err != nil {
		s.vm, s.vmRec, s.vmAccel, s.out, s.vmExited, s.phase = nil, nil, "", nil, nil, PhaseCreated
		s.agentSecret = nil
	}
	s.mu.Unlock()
	if err != nil {
		_ = kill(p)
		out.stop()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.wg.Add(1)
	go s.watchVM(p, out, exited)
	log.G(s.ctx).WithField("pid", p.Pid()).Info("VM started")
	return nil
}

// AgentSecret answers the secret Start gave the VM's guest agent (api/agent/v1: SecretLen
// bytes), which the host sends first on each connection to it (agent.Hello); nil before
// Start, for a VM without an agent channel and for a recovered sandbox. It is kept in memory
// only: nothing of it is on disk or on QEMU's command line.
func (s *Sandbox) AgentSecret() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.agentSecret)
}

// newAgentSecret makes a fresh agent secret and the sealed memfd holding its SMBIOS OEM
// string (agent.SecretOEMString), which QEMU inherits (VM.AgentSecret).
func newAgentSecret() ([]byte, *os.File, error) {
	secret := make([]byte, agent.SecretLen)
	rand.Read(secret) // never fails (crypto/rand)
	fd, err := unix.MemfdCreate("kvfs-agent-secret", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, nil, fmt.Errorf("the agent's secret: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvfs-agent-secret")
	if _, err := f.WriteString(agent.SecretOEMString(secret)); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("the agent's secret: %w", err)
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("the agent's secret: sealing its memfd: %w", err)
	}
	return secret, f, nil
}

// BindFlags say how Bind binds its source. The zero value is a read-write bind of the
// source's own mount: the mounts under the source are not in the bind.
type BindFlags uint

const (
	// BindRecursive brings the mounts under the source along (an rbind).
	BindRecursive BindFlags = 1 << iota
	// BindReadOnly makes the bind's own mount read-only, as runc makes a mount with the OCI
	// option "ro": the mounts under it (BindRecursive) keep their flags.
	BindReadOnly
	// BindRecursiveReadOnly makes every mount of the bind read-only (the OCI option "rro").
	BindRecursiveReadOnly
	// BindFollowHost makes the bind a slave of its source's mount: mounts the host makes
	// under the source later appear in the bind too (the OCI options "rslave" and
	// "rshared": Kubernetes' HostToContainer and Bidirectional propagation), if the source's
	// mount is shared or a slave itself. Nothing goes back to the host.
	BindFollowHost
	// BindIDMapRecursive makes every mount of a BindIDMapped bind idmapped (the OCI option
	// "ridmap"), not only its own.
	BindIDMapRecursive

	bindFlagsAll = BindRecursive | BindReadOnly | BindRecursiveReadOnly | BindFollowHost | BindIDMapRecursive
)

// Bind bind-mounts src (a directory or a regular file) at MountsDir()/name, name being a
// single path component, as flags say; it appears in the guest as /name in the share. What
// is read-only on the host is read-only to the guest whatever the guest does: the server's
// writes there fail with EROFS. Mounts made under src later do not appear, unless flags has
// BindFollowHost. Bind needs Linux 5.12 (open_tree, move_mount, mount_setattr).
func (s *Sandbox) Bind(src, name string, flags BindFlags) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return bindMount(src, s.MountsDir(), name, flags, -1)
}

// BindIDMapped is Bind through an idmapped mount (MOUNT_ATTR_IDMAP): the owners of the
// files below src appear, to the server and so to the guest, as userns (an open user
// namespace) maps them, a file of uid U as the uid userns maps U to; files the server creates
// there as uid V land owned by the uid that userns maps to V. It is what runc makes of an
// OCI mount with uidMappings and gidMappings, on the host's side of the share. The bind's own
// mount is idmapped, every one of it with BindIDMapRecursive; each must be of a filesystem
// that supports idmapped mounts. userns is not kept.
func (s *Sandbox) BindIDMapped(src, name string, flags BindFlags, userns *os.File) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return bindMount(src, s.MountsDir(), name, flags, int(userns.Fd()))
}

// Submounts returns the mount points below the bind name (Bind with BindRecursive carries
// the mounts under its source), relative to it, parents before children.
func (s *Sandbox) Submounts(name string) ([]string, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	return mountsBelow(filepath.Join(s.MountsDir(), name))
}

// Unbind undoes Bind.
func (s *Sandbox) Unbind(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	if err := s.checkNotStopping(); err != nil {
		return err
	}
	return unbindMount(s.dir, name)
}

func (s *Sandbox) checkNotStopping() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.phase == PhaseStopping || s.phase == PhaseStopped {
		return fmt.Errorf("sandbox %s is %s", s.id, s.phase)
	}
	return nil
}

// KillVM kills the VM at once (SIGKILL) and waits for it, leaving the rest (the server, the
// mounts, the directory) to Stop: what the owner does with a guest it no longer trusts.
func (s *Sandbox) KillVM() error {
	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	if vm == nil {
		return fmt.Errorf("sandbox %s has no VM", s.id)
	}
	return kill(vm)
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
	if err := teardown(s.dir); err != nil {
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

// startServer creates the socket and starts a server on it, with the sandbox's
// oom_score_adj. s.opMu is held, or s is not shared yet.
func (s *Sandbox) startServer() (fsServer, error) {
	srv, err := s.launchServer()
	if err != nil || s.oomAdj == nil {
		return srv, err
	}
	if p := srv.process(); p != nil {
		if err := setOOMScoreAdj(p.Pid(), *s.oomAdj); err != nil {
			_ = srv.stop()
			return nil, fmt.Errorf("%s: %w", srv.describe(), err)
		}
	}
	return srv, nil
}

// launchServer creates the socket and starts a server on it.
func (s *Sandbox) launchServer() (fsServer, error) {
	l, err := listen(s.SocketPath())
	if err != nil {
		return nil, err
	}
	if !isKvfsd(s.cfg.Server.Daemon) {
		return startExternal(s.ctx, s.cfg.Server.Daemon, s.cfg.daemonArgs(s.SharedDir()), l, filepath.Join(s.dir, serverLogName))
	}
	vcfg, err := s.cfg.serverConfig(s.SharedDir())
	if err != nil {
		l.Close()
		return nil, err
	}
	if s.dax != nil {
		vcfg.DAX = *s.dax
	}
	if s.cfg.Server.Daemon == InProcessUnconfined {
		log.G(s.ctx).Warn(unconfinedWarning)
		return startInProcess(s.ctx, vcfg, l)
	}
	channel, err := listen(s.channelPath())
	if err != nil {
		l.Close()
		return nil, err
	}
	spec := serverproc.Spec{Sandbox: s.id, Server: vcfg, LogLevel: levelName(log.GetLevel())}
	return startConfined(s.ctx, spec, l, channel, s.channelPath(), filepath.Join(s.dir, serverLogName))
}

// channelPath is the socket of the confined server's channel.
func (s *Sandbox) channelPath() string { return filepath.Join(s.dir, channelName) }

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

// SetDAXPolicy replaces the DAX policy of the sandbox's kvfsd (confined or in-process) at run
// time and records it in the state file, so a restarted server keeps it. A sandbox served by an
// external daemon refuses (errdefs.ErrFailedPrecondition): kvfs cannot reach into that process.
func (s *Sandbox) SetDAXPolicy(ctx context.Context, p passthrough.DAXPolicy) error {
	if err := p.Validate(); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	// opMu: a server restart in progress must not start its new server with the old policy
	// while this one goes to the old server.
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	phase, srv := s.phase, s.srv
	s.mu.Unlock()
	d, ok := srv.(daxSetter)
	switch {
	case !isKvfsd(s.cfg.Server.Daemon):
		return fmt.Errorf("sandbox %s: its server is the external daemon %s, whose DAX policy is set on its command line (--dax, --dax-rules): %w",
			s.id, s.cfg.Server.Daemon, errdefs.ErrFailedPrecondition)
	case phase != PhaseCreated && phase != PhaseRunning || !ok:
		return fmt.Errorf("sandbox %s is %s: %w", s.id, phase, errdefs.ErrFailedPrecondition)
	}
	if err := d.setDAXPolicy(ctx, p); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dax = &passthrough.DAXPolicy{Mode: p.Mode, Rules: slices.Clone(p.Rules)}
	return s.persistLocked()
}

// RaiseOOMScoreAdj raises the oom_score_adj of the sandbox's VM and server to v, if theirs is
// lower: a pod's container whose value is higher than the pod's so far (a BestEffort
// container's 1000, say) makes the whole VM, which holds its memory, no better protected than
// it. A lower v changes nothing: the VM's one value covers every container of the pod, and one
// OOM kill takes them all.
func (s *Sandbox) RaiseOOMScoreAdj(v int) error {
	if err := CheckOOMScoreAdj(v); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	cur, srv, vm := s.oomAdj, s.srv, s.vm
	s.mu.Unlock()
	if cur == nil {
		own, err := readOOMScoreAdj(os.Getpid())
		if err != nil {
			return fmt.Errorf("sandbox %s: the owner's oom_score_adj: %w", s.id, err)
		}
		cur = &own
	}
	if v <= *cur {
		return nil
	}
	if vm != nil && vm.Pid() > 0 && !isClosed(vm.Exited()) {
		if err := setOOMScoreAdj(vm.Pid(), v); err != nil && !isClosed(vm.Exited()) {
			return fmt.Errorf("sandbox %s: the VM: %w", s.id, err)
		}
	}
	if p := srv.process(); p != nil && !isClosed(p.Exited()) {
		if err := setOOMScoreAdj(p.Pid(), v); err != nil && !isClosed(p.Exited()) {
			return fmt.Errorf("sandbox %s: %s: %w", s.id, srv.describe(), err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.oomAdj = &v
	return s.persistLocked()
}

// SetServerLogLevel sets the log level of the sandbox's confined server (trace, debug, info,
// warn or error). An in-process server shares this process's logger, and an external daemon's
// level is set on its command line: for those there is nothing to do.
func (s *Sandbox) SetServerLogLevel(ctx context.Context, level string) error {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	c, ok := srv.(*confinedServer)
	if !ok || isClosed(c.exited()) {
		return nil
	}
	if err := c.setLogLevel(ctx, level); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	return nil
}

func ownerID() procID {
	id, err := identify(os.Getpid())
	if err != nil {
		return procID{PID: os.Getpid(), BootID: bootID()}
	}
	return id
}

// ServerError is why a sandbox's server stopped serving while its VM was running, and what
// the failure policy did about it.
type ServerError struct {
	// Server names the server: "confined kvfsd (pid N)", "in-process kvfsd" or "PATH (pid N)".
	Server string
	// Err is how it ended: an error from Serve, an exit status or signal, or errServerClean.
	Err error
	// Policy is the configured policy; Action says what was done.
	Policy string
	Action string
	At     time.Time
}

func (e *ServerError) Error() string {
	msg := fmt.Sprintf("virtio-fs server %s stopped serving: %v", e.Server, e.Err)
	if e.Action != "" {
		msg += "; " + e.Action
	}
	return msg
}

func (e *ServerError) Unwrap() error { return e.Err }

// watchServer waits for srv to end and applies the failure policy if that happened while the
// VM was running.
func (s *Sandbox) watchServer(srv fsServer) {
	defer s.wg.Done()
	<-srv.exited()
	exitErr := srv.exitErr()

	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	if vm != nil && !srv.killed() {
		select {
		case <-vm.Exited():
		case <-time.After(serverExitGrace):
		}
	}

	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	if s.srv != srv || (s.phase != PhaseCreated && s.phase != PhaseRunning) {
		s.mu.Unlock()
		return // stopping, or already replaced
	}
	vm = s.vm
	if vm != nil && isClosed(vm.Exited()) {
		s.mu.Unlock()
		log.G(s.ctx).WithField("server", srv.describe()).Info("the virtio-fs server ended after the VM")
		return
	}
	if exitErr == nil {
		exitErr = errServerClean
	}
	// failure is published (lastFailure, failure) only once its Action is final.
	failure := &ServerError{Server: srv.describe(), Err: exitErr, Policy: s.cfg.Server.OnFailure, At: time.Now()}
	restarts := s.restarts
	s.mu.Unlock()

	if s.cfg.Server.OnFailure == PolicyRestart {
		if restarts >= s.cfg.Server.MaxRestarts {
			failure.Action = fmt.Sprintf("restart limit (%d) reached", s.cfg.Server.MaxRestarts)
		} else if err := s.restartServerLocked(srv, failure); err != nil {
			failure.Action = "restarting it failed: " + err.Error()
		} else {
			return
		}
	}
	s.failLocked(srv, failure)
}

// restartServerLocked replaces the dead server old with a new one on a new socket at the same
// path. s.opMu is held.
func (s *Sandbox) restartServerLocked(old fsServer, failure *ServerError) error {
	_ = old.stop() // it has exited; this releases what it held
	srv, err := s.startServer()
	if err != nil {
		return err
	}
	failure.Action = "restarted it as " + srv.describe()
	s.mu.Lock()
	s.srv = srv
	s.restarts++
	s.lastFailure = failure
	err = s.persistLocked()
	s.mu.Unlock()
	if err != nil {
		log.G(s.ctx).WithError(err).Warn("recording the server restart")
	}
	s.wg.Add(1)
	go s.watchServer(srv)
	log.G(s.ctx).WithError(failure).Warn("virtio-fs server restarted; QEMU does not reconnect a vhost-user-fs device, " +
		"so the guest's share stays unusable until the VM restarts")
	return nil
}

// failLocked applies the stop policy: the VM is killed and the sandbox fails with failure.
// s.opMu is held.
func (s *Sandbox) failLocked(srv fsServer, failure *ServerError) {
	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	action := "no VM was running"
	if vm != nil {
		action = fmt.Sprintf("stopped the VM (pid %d)", vm.Pid())
		if err := terminate(vm, vmStopGrace); err != nil {
			action = fmt.Sprintf("stopping the VM (pid %d) failed: %v", vm.Pid(), err)
		}
	}
	if failure.Action != "" {
		failure.Action += "; " + action
	} else {
		failure.Action = action
	}
	_ = srv.stop()
	s.mu.Lock()
	s.phase = PhaseFailed
	s.failure = failure
	s.lastFailure = failure
	if err := s.persistLocked(); err != nil {
		log.G(s.ctx).WithError(err).Warn("recording the failure")
	}
	s.closeDoneLocked()
	s.mu.Unlock()
	log.G(s.ctx).WithError(failure).Error("sandbox failed")
}

// watchVM waits for the VM's end and for the drains of its output (out, if not nil) to read
// what it left (at most outputDrainGrace), then closes exited and logs the end, with QEMU's
// last lines if it failed.
func (s *Sandbox) watchVM(p Process, out *vmOutput, exited chan struct{}) {
	defer s.wg.Done()
	<-p.Exited()
	if out != nil {
		select {
		case <-out.drained:
		case <-time.After(outputDrainGrace):
		}
	}
	close(exited)
	entry := log.G(s.ctx).WithField("pid", p.Pid()).WithField("exit", exitString(p.ExitErr()))
	if p.ExitErr() != nil && out != nil {
		if qemu, _ := out.lastLines(); len(qemu) > 0 {
			entry = entry.WithField("qemu", strings.Join(qemu, "\n"))
		}
	}
	entry.Info("VM exited")
}

// exitString says how a process exited: "exit status 0" for a nil ExitErr.
func exitString(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// VMError is a VM that did not come up, or that exited: why its owner gave up on it, and
// what says why — how QEMU exited, the end of QEMU's output and of the guest's console
// (sanitized: the guest wrote them) — and, when KVM was chosen for vm.accel = "", that KVM
// is the suspect.
type VMError struct {
	Sandbox string
	// Err is why the owner gave up: the VM exited, or its guest did not answer in time.
	Err error
	// Exit is how QEMU exited ("exit status 1", "signal: aborted"); empty if it still runs.
	Exit string
	// QEMU and Console are the last lines of QEMU's stdout and stderr and of the guest's
	// serial console, at most 20 each.
	QEMU, Console []string
	// AutoKVM says that vm.accel was "" and KVM was chosen (/dev/kvm opens).
	AutoKVM bool
}

func (e *VMError) Error() string {
	var b strings.Builder
	b.WriteString(e.Err.Error())
	if e.Exit != "" {
		fmt.Fprintf(&b, "; QEMU exited (%s)", e.Exit)
	}
	if e.AutoKVM {
		b.WriteString(`; the VM ran under KVM, which vm.accel = "" chose because /dev/kvm opens, ` +
			`but a host's KVM may not run this guest (QEMU says why below: a PVM host, for one, aborts ` +
			`with "failed to set MSR 0x10a"): if so, set accel = "tcg" in the [vm] section of the configuration`)
	}
	quoteLines(&b, "QEMU's output", e.QEMU)
	quoteLines(&b, "the guest's console", e.Console)
	return b.String()
}

func (e *VMError) Unwrap() error { return e.Err }

// quoteLines appends lines under a heading, indented.
func quoteLines(b *strings.Builder, what string, lines []string) {
	if len(lines) == 0 {
		fmt.Fprintf(b, "\n%s: nothing", what)
		return
	}
	fmt.Fprintf(b, "\n%s, last lines:", what)
	for _, l := range lines {
		b.WriteString("\n    " + l)
	}
}

// VMError wraps err, why the caller gave up on the VM (its guest did not come up in time,
// or the VM exited), in a *VMError that says what QEMU and the guest said last: the sandbox's
// directory, and the logs in it, go with the sandbox. If the VM exited, it first lets the
// drains read what QEMU left (at most outputDrainGrace).
func (s *Sandbox) VMError(err error) error {
	s.mu.Lock()
	vm, out, exited, accel := s.vm, s.out, s.vmExited, s.vmAccel
	s.mu.Unlock()
	e := &VMError{Sandbox: s.id, Err: err, AutoKVM: s.cfg.VM.Accel == "" && accel == AccelKVM}
	if vm != nil && isClosed(vm.Exited()) {
		select {
		case <-exited:
		case <-time.After(outputDrainGrace):
		}
		e.Exit = exitString(vm.ExitErr())
	}
	if out != nil {
		e.QEMU, e.Console = out.lastLines()
	}
	return e
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// Stats is what a sandbox reports about itself.
type Stats struct {
	ID    string
	Phase Phase
	// Server is the current server.
	Server ServerStats
	// VM is nil before Start.
	VM *VMStats
	// Failure is why the sandbox failed, if it did.
	Failure string
}

// ServerStats describes the virtio-fs server.
type ServerStats struct {
	// Daemon is Confined, InProcessUnconfined or the external daemon's path.
	Daemon string
	// PID is the server's process: the owner's own for the in-process server; for a confined
	// server, its supervisor's (PID 1 of its namespaces; the serving process is its child).
	PID     int
	Started time.Time
	Uptime  time.Duration
	Running bool
	// Restarts counts restarts by the restart policy; LastFailure is the last server failure.
	Restarts    int
	LastFailure string
	// FS holds kvfsd's counters (requests per opcode, errors, latency, bytes, inodes, open
	// files), asked over its channel for a confined server; nil for an external daemon, of
	// which only the above is known, and for a confined server that did not answer.
	FS *virtiofs.Stats
}

// VMStats describes the VM's process.
type VMStats struct {
	PID     int
	Started time.Time
	Uptime  time.Duration
	Running bool
	// Exit is how it exited, once it has.
	Exit string
}

// Stats returns a snapshot of the sandbox's state and its server's counters.
func (s *Sandbox) Stats() Stats {
	s.mu.Lock()
	srv, vm, rec := s.srv, s.vm, s.vmRec
	st := Stats{ID: s.id, Phase: s.phase}
	restarts := s.restarts
	if s.failure != nil {
		st.Failure = s.failure.Error()
	}
	var last string
	if s.lastFailure != nil {
		last = s.lastFailure.Error()
	}
	s.mu.Unlock()
	if srv != nil {
		st.Server = srv.info()
	}
	st.Server.Restarts, st.Server.LastFailure = restarts, last
	if vm != nil {
		v := &VMStats{PID: vm.Pid(), Running: !isClosed(vm.Exited())}
		if rec != nil {
			v.Started, v.Uptime = rec.Started, time.Since(rec.Started)
		}
		if !v.Running {
			v.Exit = fmt.Sprint(vm.ExitErr())
		}
		st.VM = v
	}
	return st
}
