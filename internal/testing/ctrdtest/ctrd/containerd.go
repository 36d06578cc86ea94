package ctrd

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
)

// Options configure a containerd.
type Options struct {
	// ShimDirs go first on containerd's PATH, in this order, before the directory of the
	// installed binaries (Bins.Dir) and the caller's own PATH: containerd finds a runtime's
	// shim binary there (containerd-shim-kvfs-v2 for io.containerd.kvfs.v2), and the shims
	// inherit the PATH.
	ShimDirs []string
	// Config is TOML merged into the generated config.toml: tables merged key by key, other
	// values replaced (see ctrdconf.Config). It may not set the version, root, state, temp, imports
	// or the server addresses.
	Config string
	// Imports are drop-in files (or glob patterns of them) containerd's config imports, as a
	// host's config.toml imports /etc/containerd/conf.d/*.toml: the installer's drop-in, for
	// one. Without them the config imports nothing (not the host's conf.d).
	Imports []string
	// Env is added to containerd's environment, and so to its shims'.
	Env []string
	// LeakDirs are more directories the leak check covers, as it covers SandboxBaseDir: the
	// mounts under them, the processes whose command line names them, and their entries.
	LeakDirs []string
	// LogLevel is containerd's log level; "info" when empty.
	LogLevel string
	// CtrTimeout bounds each ctr that Ctr and RunCtr run (and each crictl); 3 minutes when
	// zero (a VM booted under TCG takes tens of seconds).
	CtrTimeout time.Duration
	// CRI turns containerd's CRI on (see ctrdconf.Config), for crictl (Crictl): containerd then runs
	// in a network namespace of its own (NetNS), unnamed (it goes with its processes), where the CNI
	// test network's bridge is, and the pod sandbox image PauseImage is imported. The CRI's
	// sandbox directories and network namespace files are LeakDirs.
	CRI bool
	// Wrapper, when set, is a command containerd is started through: containerd's command line
	// is appended to it, and it must execute that in its place. It starts in containerd's
	// own mount namespace; `nsenter -t PID -m --`, say, runs containerd and its shims in the
	// mount namespace of process PID, where a package under test is installed.
	Wrapper []string
	// BinDir holds the containerd binaries (Binaries); ${KVFS_CACHE:-/var/cache/kvfs}/bin when
	// empty.
	BinDir string
	// Logf, if not nil, is given notes: what Start's sweep killed (see cgroup.go), what Stop
	// removed, what KillSince killed.
	Logf func(format string, args ...any)
}

// Containerd is a private containerd: its own directory, config, sockets and namespace.
type Containerd struct {
	bins      Bins
	opts      Options
	dir       string
	namespace string
	logPath   string
	cgroup    string // the containerd's cgroup (v2), under its namespace's: see cgroup.go
	cmd       *exec.Cmd
	exited    chan struct{} // closed when cmd has been waited for
	waitErr   error         // cmd.Wait's result, set before exited is closed
	start     Snapshot      // taken once containerd answers: Stop checks against it
	image     string        // the busybox archive, once built
}

// shortTempDir is where the containerd's directory is made: unix socket paths must fit in 107
// bytes, and a test's own t.TempDir() can be longer than that.
const shortTempDir = "/tmp"

// Start starts a containerd and returns once it answers. Stop ends it; when Start fails, it
// has ended it.
func Start(opts Options) (*Containerd, error) {
	bins, err := Binaries(opts.BinDir)
	if err != nil {
		return nil, err
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	sweepDeadOwners(opts.Logf)
	if opts.LogLevel == "" {
		opts.LogLevel = "info"
	}
	if opts.CtrTimeout == 0 {
		opts.CtrTimeout = 3 * time.Minute
	}
	namespace, err := newNamespace()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(shortTempDir, "ctrd-")
	if err != nil {
		return nil, err
	}
	c := &Containerd{
		bins:      bins,
		opts:      opts,
		dir:       dir,
		namespace: namespace,
		logPath:   filepath.Join(dir, "containerd.log"),
	}
	if err := c.prepare(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if c.cgroup, err = c.makeCgroup(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := c.launch("", ""); err != nil {
		removeCgroupTree(filepath.Dir(c.cgroup))
		os.RemoveAll(dir)
		return nil, err
	}
	err = c.waitReady(30 * time.Second)
	if err == nil && opts.CRI {
		err = c.importPause()
	}
	if err == nil {
		c.start, err = c.snapshot()
	}
	if err != nil {
		err = fmt.Errorf("%w\ncontainerd's log:\n%s", err, c.LogTail())
		_, serr := c.Stop()
		return nil, errors.Join(err, serr, c.Remove())
	}
	return c, nil
}

// prepare fills the containerd's directory: its config, the directories it is given, and with
// the CRI crictl's config and the CNI network's.
func (c *Containerd) prepare() error {
	// Processes in containers not running as root still reach their bundle through it.
	if err := os.Chmod(c.dir, 0o711); err != nil {
		return err
	}
	cfg, err := ctrdconf.Config(c.dir, c.opts.LogLevel, c.opts.CRI, c.opts.Imports, c.opts.Config)
	if err != nil {
		return fmt.Errorf("Options.Config: %w", err)
	}
	if err := os.WriteFile(filepath.Join(c.dir, "config.toml"), cfg, 0o600); err != nil {
		return err
	}
	for _, d := range []string{"tmp", sandboxesDir} {
		if err := os.Mkdir(filepath.Join(c.dir, d), 0o700); err != nil {
			return err
		}
	}
	c.opts.LeakDirs = append(slices.Clone(c.opts.LeakDirs), c.SandboxBaseDir())
	if !c.opts.CRI {
		return nil
	}
	// The CRI's per-pod directories and network namespace files.
	for _, d := range []string{"root", "state"} {
		c.opts.LeakDirs = append(c.opts.LeakDirs, filepath.Join(c.dir, d, "io.containerd.grpc.v1.cri", "sandboxes"))
	}
	c.opts.LeakDirs = append(c.opts.LeakDirs, filepath.Join(c.dir, "state", "io.containerd.grpc.v1.cri", "netns"))
	return ctrdconf.WriteCRIFiles(c.dir, c.opts.CtrTimeout)
}

// launch starts containerd on the config in c.dir, in its cgroup (which its processes
// inherit), its output appended to its log. With mountNS and netNS empty, it gets a mount
// namespace of its own and, with CRI, a network namespace of its own; else it joins the
// namespaces of those files (nsenter), as Restart does.
func (c *Containerd) launch(mountNS, netNS string) error {
	cgroupFD, err := os.Open(c.cgroup)
	if err != nil {
		return err
	}
	defer cgroupFD.Close()
	logf, err := os.OpenFile(c.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(c.bins.Containerd, "--config", filepath.Join(c.dir, "config.toml"))
	var newNet uintptr
	switch {
	case mountNS != "" || netNS != "":
		var nsenter []string
		if mountNS != "" {
			nsenter = append(nsenter, "--mount="+mountNS)
		}
		if netNS != "" {
			nsenter = append(nsenter, "--net="+netNS)
		}
		// nsenter joins the namespaces and executes containerd in its place.
		cmd = exec.Command("nsenter", append(append(nsenter, "--"), cmd.Args...)...)
	case c.opts.CRI:
		// A network namespace of its own, unnamed: it lives as long as a process of the
		// containerd does (they are all in its cgroup, which the cleanup empties), and no
		// longer. Its loopback is up before containerd starts (the streaming server listens
		// there).
		newNet = syscall.CLONE_NEWNET
		cmd = exec.Command("/bin/sh", append([]string{"-c", `ip link set lo up && exec "$0" "$@"`}, cmd.Args...)...)
	}
	if len(c.opts.Wrapper) > 0 {
		cmd = exec.Command(c.opts.Wrapper[0], append(slices.Clone(c.opts.Wrapper[1:]), cmd.Args...)...)
	}
	cmd.Dir = c.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(c.environ(), c.opts.Env...)
	// Its own mount namespace (private: nothing propagates either way), so that what it and
	// its shims mount (containers' root file systems, sandboxes' binds) stays out of the
	// machine's mount table, where other tests count mounts, and goes with the last of its
	// processes. Its own process group, so that a ^C to its user does not reach it first; and
	// killed if its user dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  newNet,
		Setpgid:     true,
		Pdeathsig:   syscall.SIGKILL,
		UseCgroupFD: true,
		CgroupFD:    int(cgroupFD.Fd()),
	}
	if mountNS == "" {
		cmd.SysProcAttr.Unshareflags = syscall.CLONE_NEWNS
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting containerd: %w", err)
	}
	exited := make(chan struct{})
	c.cmd, c.exited = cmd, exited
	go func() {
		c.waitErr = cmd.Wait()
		close(exited)
	}()
	return nil
}

// Restart stops containerd (SIGTERM, as a service manager stops it) and starts it again on the
// same config, root and state, in the same cgroup, mount namespace (where its shims and their
// mounts are) and network namespace, as a host's containerd is restarted under running
// containers: its shims keep running, and it reconnects to them. It returns once containerd
// answers (with the CRI on, its CRI too). The descriptor counts of a Snapshot taken before are
// not compared with those after (they are another process's). Not to be called at the same
// time as the containerd's other methods.
func (c *Containerd) Restart() error {
	select {
	case <-c.exited:
		return fmt.Errorf("restart: containerd has exited: %v", c.waitErr)
	default:
	}
	// Held open, the namespaces outlive containerd even with no shim left in them.
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	held := func(kind string) (string, error) {
		f, err := os.Open(fmt.Sprintf("/proc/%d/ns/%s", c.PID(), kind))
		if err != nil {
			return "", err
		}
		files = append(files, f)
		return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd()), nil
	}
	mountNS, err := held("mnt")
	if err != nil {
		return fmt.Errorf("restart: %w", err)
	}
	netNS := ""
	if c.opts.CRI {
		if netNS, err = held("net"); err != nil {
			return fmt.Errorf("restart: %w", err)
		}
	}
	if err := c.stop(); err != nil {
		return fmt.Errorf("restart: %w", err)
	}
	if err := c.launch(mountNS, netNS); err != nil {
		return fmt.Errorf("restart: %w", err)
	}
	if err := c.waitReady(30 * time.Second); err != nil {
		return fmt.Errorf("restart: %w", err)
	}
	return nil
}

// newNamespace is a containerd namespace unique on the machine: runc keeps its state in
// /run/containerd/runc/NAMESPACE and ctr puts containers in the cgroup /NAMESPACE/ID, both
// shared by every containerd on the machine.
func newNamespace() (string, error) {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "kvfstest-" + hex.EncodeToString(b[:]), nil
}

// environ is the environment of containerd, ctr and crictl (ctrdconf.Environ): PATH made of
// Options.ShimDirs, the installed binaries and the caller's PATH.
func (c *Containerd) environ() []string {
	return ctrdconf.Environ(c.dir, append(slices.Clone(c.opts.ShimDirs), c.bins.Dir))
}

// waitReady polls until containerd answers, it exits, or the timeout passes: `ctr version`,
// and with the CRI on `crictl version` too, which fails ("server is not initialized yet")
// until the CRI plugin has started, after the gRPC server answers: after a restart it first
// recovers the running pods, which takes seconds with a VM's shim to reconnect to.
func (c *Containerd) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		what := "ctr version"
		out, err := c.CtrCmd(ctx, "version").CombinedOutput()
		if err == nil && c.opts.CRI {
			what = "crictl version"
			out, err = c.CrictlCmd(ctx, "version").CombinedOutput()
		}
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-c.exited:
			return fmt.Errorf("containerd exited at start: %v", c.waitErr)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd did not answer within %v: %s: %v: %s", timeout, what, err, bytes.TrimSpace(out))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Address is containerd's gRPC socket.
func (c *Containerd) Address() string { return filepath.Join(c.dir, ctrdconf.GRPCSocket) }

// Namespace is the containerd namespace ctr uses: unique to this containerd.
func (c *Containerd) Namespace() string { return c.namespace }

// sandboxesDir is SandboxBaseDir's name in the containerd's directory.
const sandboxesDir = "sandboxes"

// SandboxBaseDir is an empty directory (0700) for the kvfs shim's sandboxes (its base_dir):
// short enough for the sockets in it, and one of the LeakDirs, so the leak check covers
// its entries, the mounts under it and the processes naming it.
func (c *Containerd) SandboxBaseDir() string { return filepath.Join(c.dir, sandboxesDir) }

// Dir is the containerd's directory: config.toml, containerd.log, root/, state/, the sockets.
// Files its user makes for it (runtime configs, image archives) can go here too.
func (c *Containerd) Dir() string { return c.dir }

// PID is containerd's process ID.
func (c *Containerd) PID() int { return c.cmd.Process.Pid }

// Cgroup is the containerd's cgroup (v2), which every process it starts inherits (see
// cgroup.go).
func (c *Containerd) Cgroup() string { return c.cgroup }

// Log is containerd's log so far (its shims' lines included).
func (c *Containerd) Log() (string, error) {
	b, err := os.ReadFile(c.logPath)
	return string(b), err
}

// logTailSize is how much of containerd's log LogTail gives.
const logTailSize = 64 << 10

// LogTail is the end of containerd's log, for a failure's report.
func (c *Containerd) LogTail() string {
	log, err := c.Log()
	if err != nil {
		return fmt.Sprintf("(containerd's log: %v)", err)
	}
	if len(log) > logTailSize {
		log = "...\n" + log[len(log)-logTailSize:]
	}
	return log
}

// CtrCmd is the command `ctr --address ADDRESS --namespace NAMESPACE args...`, with the
// containerd's environment, killed when ctx is done.
func (c *Containerd) CtrCmd(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, c.bins.Ctr, append([]string{"--address", c.Address(), "--namespace", c.namespace}, args...)...)
	cmd.Env = c.environ()
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// Result is what a ctr run gave.
type Result struct {
	Stdout, Stderr string
	// ExitCode is ctr's exit status; `ctr run` exits with the container's.
	ExitCode int
}

// RunCtr runs ctr with args and returns its output and exit status. Its error says when ctr
// cannot be started, is killed by a signal, or outlasts ctx or Options.CtrTimeout.
func (c *Containerd) RunCtr(ctx context.Context, args ...string) (Result, error) {
	tctx, cancel := context.WithTimeout(ctx, c.opts.CtrTimeout)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := c.CtrCmd(tctx, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return Result{}, fmt.Errorf("ctr %s: %w", strings.Join(args, " "), ctx.Err())
	case tctx.Err() != nil:
		return Result{}, fmt.Errorf("ctr %s: timed out after %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), c.opts.CtrTimeout, &stdout, &stderr)
	case errors.As(err, &ee) && ee.ExitCode() >= 0:
	case err != nil:
		return Result{}, fmt.Errorf("ctr %s: %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), err, &stdout, &stderr)
	}
	return Result{Stdout: stdout.String(), Stderr: stderr.String(), ExitCode: cmd.ProcessState.ExitCode()}, nil
}

// Ctr runs ctr with args and returns its standard output; it is an error unless ctr exits 0.
func (c *Containerd) Ctr(ctx context.Context, args ...string) (string, error) {
	r, err := c.RunCtr(ctx, args...)
	if err != nil {
		return "", err
	}
	if r.ExitCode != 0 {
		return r.Stdout, fmt.Errorf("ctr %s: exit status %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.ExitCode, r.Stdout, r.Stderr)
	}
	return r.Stdout, nil
}
