// Package serverproc runs a sandbox's virtio-fs server in a process of its own, started from
// the owner's own executable (as runc starts its init) and confined as kvfsd
// --sandbox=namespace --seccomp=kill confines itself, with fewer capabilities still. Package
// sandbox uses it for its default server (server.daemon = "confined"); a binary that creates
// sandboxes calls Init first thing in main, and a test package that creates them calls it first
// thing in TestMain.
//
// # The server process
//
// Command starts /proc/self/exe (the running binary, even if the file was replaced since) with
// a marker in its environment, in new mount, PID, network and IPC namespaces
// (confine.Namespaces) and a session of its own, so that it outlives its owner, which records
// it in the sandbox's state and may adopt it again after a restart. It inherits the vhost-user
// listening socket the owner created (descriptor 3), the listening socket of its channel
// (descriptor 4), the write end of a pipe on which it leaves its last statistics when it stops
// serving (descriptor 5; FinalStats), and, for its stdout and stderr, the write end of a pipe
// the owner drains into the sandbox's bounded server log (it writes no host file; it ignores
// SIGPIPE, so that an owner's death drops its lines rather than end it). The Spec (the
// server's virtiofs.Config, the sandbox's id and the log level) is in its environment.
//
// Init, in the new process, sees the marker and serves instead of returning; the marker is
// obeyed only where Command's processes run (PID 1 of a new PID namespace, and its child).
// Two processes make the server:
//
//	supervisor  PID 1 of the namespaces: raises RLIMIT_NOFILE (as kvfsd does), makes its mount
//	            tree a slave of the host's with a proc of its own (confine.PrepareMounts), and
//	            starts the serving process with only confine.ServerCapabilities
//	            (confine.StartServing: bounding, permitted, effective, inheritable and ambient
//	            sets, on every thread, in a cgo build too) while the host's tree is still the
//	            root, so that the dynamic loader of a binary built with cgo finds its
//	            libraries; once the server holds its /proc/self/fd it pivots into the shared
//	            directory and detaches the host's tree (confine.PivotRoot), which moves the
//	            server's root too, then forwards SIGTERM, SIGINT and SIGHUP to the server and
//	            exits as it does. It runs none of the server's code, reads nothing the guest
//	            controls, and holds no descriptor of the host's files; it keeps its
//	            capabilities (a Go program cannot drop them on all its threads in a cgo build),
//	            which the server, with fewer and without ptrace, cannot reach.
//	server      its child: moves its working directory into the namespace's /proc/self/fd, waits
//	            for the pivot (confine.EnterRoot: nothing of the host is left in its mount tree;
//	            "/" is the shared directory, which it checks), opens the shared directory, logs
//	            that it waits for the front-end, installs the seccomp allowlist on every thread
//	            with no_new_privs (confine.InstallSeccomp, confine.DefaultAction: kill on
//	            linux/amd64), and serves the front-end and the channel.
//
// The server exits 0 when the front-end disconnects (QEMU exited) or on a signal the supervisor
// forwards, and 1 with the error in the log otherwise; a system call outside the allowlist
// kills it (SIGSYS, which the supervisor logs). The supervisor exits as a shell does: with the
// server's status, or 128 plus the signal that killed it. The owner holds the supervisor: killing it
// (SIGKILL) ends the namespace, and the server with it.
//
// # The channel
//
// The owner reaches the running server through a Unix socket it created in the sandbox
// directory, outside the server's root (Client): one request per connection, a JSON line each
// way — the server's statistics, its log level, its DAX policy. The server accepts connections
// from root and its own uid only (SO_PEERCRED). The owner treats what the server answers as it
// treats the guest, since a guest that took over the server writes the answers: replies are
// bounded in size and time, and are only decoded into counters.
//
// The data path is the in-process server's code, unchanged: a request costs nothing more. The
// channel is used only when asked (kvfsctl status, metrics, log-level, dax-policy).
package serverproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"

	"github.com/containerd/log"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/cmdline"
	"github.com/kvfs/kvfs/virtiofs/confine"
)

// Argv0 is the server process's argv[0], as ps shows it.
const Argv0 = "kvfs-sandbox-server"

// ReadyLine is logged by the server once it waits for the front-end (what kvfsd logs).
const ReadyLine = "Waiting for vhost-user socket connection..."

// The environment of the server process: the marker says which step runs, the spec is JSON.
const (
	markerEnv = "KVFS_SANDBOX_SERVER"
	specEnv   = "KVFS_SANDBOX_SERVER_SPEC"

	stepSetup = "setup"
	stepServe = "serve"
)

// Descriptors of the server process, the supervisor's as Command passes them (exec.Cmd's
// ExtraFiles): the vhost-user and channel listening sockets, and the pipe of the final
// statistics (see FinalStats).
const (
	vhostFD   = 3
	channelFD = 4
	finalFD   = 5
)

// Spec is what a server process serves.
type Spec struct {
	// Sandbox is the sandbox's id, a field of every line the server logs.
	Sandbox string `json:"sandbox"`
	// Server is the server's configuration. SharedDir is the host path; it becomes the
	// server's root, and ProcSelfFd is set by the server itself.
	Server virtiofs.Config `json:"server"`
	// LogLevel is the server's log level at start: trace, debug, info, warn or error.
	LogLevel string `json:"log_level"`
}

// Command returns the command that starts the server of spec (see the package documentation):
// vhost is the vhost-user listening socket, channel the channel's, final the write end of a pipe
// whose read end goes to FinalStats, out its log. The caller starts it and, once it has started,
// closes its copies of the four files.
func Command(spec Spec, vhost, channel, final, out *os.File) (*exec.Cmd, error) {
	if spec.Server.SharedDir == "" {
		return nil, errors.New("confined server: no shared directory")
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("confined server: encoding its spec: %w", err)
	}
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{Argv0}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, markerEnv+"=") && !strings.HasPrefix(kv, specEnv+"=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, markerEnv+"="+stepSetup, specEnv+"="+string(b))
	cmd.Stdout, cmd.Stderr = out, out
	cmd.ExtraFiles = []*os.File{vhost, channel, final}
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: confine.Namespaces, Setsid: true}
	return cmd, nil
}

// Init serves, and exits, if this process is a server Command started; otherwise it returns at
// once. Call it first thing in main (or TestMain) of every binary that creates sandboxes, so
// that none of the owner's own work runs in the server (package initialisers do run: keep them
// free of side effects).
func Init() {
	step, ok := os.LookupEnv(markerEnv)
	if !ok {
		return
	}
	// The supervisor is PID 1 of a new PID namespace, the server its child. Anything else was
	// not started by Command but given its marker: it runs as what was asked for, and keeps the
	// marker from its children. (An orphan of the host's init given a forged serve marker fails
	// at the handshake: nothing is at its descriptors.)
	if !(step == stepSetup && os.Getpid() == 1 || step == stepServe && os.Getppid() == 1) {
		os.Unsetenv(markerEnv)
		os.Unsetenv(specEnv)
		return
	}
	os.Exit(runStep(step))
}

func runStep(step string) int {
	// stdout and stderr are a pipe the owner drains: if it dies (an adopting owner may come
	// after it), a write there fails with EPIPE and is dropped, rather than end the server.
	signal.Ignore(syscall.SIGPIPE)
	log.L.Logger.SetOutput(os.Stderr)
	var spec Spec
	if err := json.Unmarshal([]byte(os.Getenv(specEnv)), &spec); err != nil {
		log.L.WithError(err).Errorf("confined server: %s is not a spec", specEnv)
		return 1
	}
	log.L = log.L.WithField("sandbox", spec.Sandbox)
	if spec.LogLevel != "" {
		if err := log.SetLevel(spec.LogLevel); err != nil {
			log.L.WithError(err).Warn("confined server: keeping the default log level")
		}
	}
	run := serve
	if step == stepSetup {
		run = setup
	}
	if err := run(spec); err != nil {
		log.L.WithError(err).Error("confined virtio-fs server failed")
		var e *serverExit
		if errors.As(err, &e) {
			return e.status
		}
		return 1
	}
	return 0
}

// serveFinalFD is the serving process's descriptor of the final statistics' pipe, on which it
// writes its statistics when it stops serving (after vhostFD and channelFD).
const serveFinalFD = 5

// setup is the supervisor, PID 1 of the namespaces: it mounts the namespace's proc, starts the
// serving process with only the server's capabilities while the host's tree is still its root
// (its dynamic loader may need it), pivots into the shared directory once the server holds its
// /proc/self/fd (which takes the server's root along), then forwards signals to the server and
// exits as it does.
func setup(spec Spec) error {
	ch, err := cmdline.SetNofileLimit(&cmdline.Options{})
	if err != nil {
		return err
	}
	if ch.After.Cur < ch.Wanted {
		log.L.Debugf("RLIMIT_NOFILE stays at %d, not %d: the hard limit cannot be raised without CAP_SYS_RESOURCE", ch.After.Cur, ch.Wanted)
	}
	if err := confine.PrepareMounts(); err != nil {
		return err
	}
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{Argv0}
	cmd.Env = os.Environ()
	for i, kv := range cmd.Env {
		if strings.HasPrefix(kv, markerEnv+"=") {
			cmd.Env[i] = markerEnv + "=" + stepServe
		}
	}
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	vhost, channel := os.NewFile(vhostFD, "vhost-user"), os.NewFile(channelFD, "channel")
	cmd.ExtraFiles = []*os.File{vhost, channel, os.NewFile(finalFD, "final statistics")}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	done, err := confine.StartServing(cmd, spec.Server.SharedDir, confine.ServerCapabilities)
	for _, f := range cmd.ExtraFiles {
		f.Close()
	}
	if errors.Is(err, confine.ErrServerEnded) {
		// It died before it was ready: report how.
		werr := <-done
		return serverEnd(cmd, werr)
	}
	if err != nil {
		return err
	}
	return serverEnd(cmd, confine.ForwardUntilExit(cmd, sigs, done))
}

// serverEnd turns the serving process's end into the supervisor's: nil if it exited 0, else a
// *serverExit with its status.
func serverEnd(cmd *exec.Cmd, err error) error {
	if err == nil {
		return nil
	}
	e := &serverExit{status: 1, err: fmt.Errorf("the server (pid %d in its namespace): %w", cmd.Process.Pid, err)}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		e.status = 128 + int(ws.Signal())
		if ws.Signal() == syscall.SIGSYS {
			e.err = errors.New("the server was killed by SIGSYS: it made a system call outside the seccomp allowlist " +
				"(the kernel's audit log, dmesg, has it as a type=1326 record)")
		}
	} else if ok {
		e.status = ws.ExitStatus()
	}
	return e
}

// serverExit is how the serving process ended; the supervisor exits with status, as a shell
// does: the exit status, or 128 plus the signal that killed it.
type serverExit struct {
	status int
	err    error
}

func (e *serverExit) Error() string { return e.err.Error() }
func (e *serverExit) Unwrap() error { return e.err }

// serve is the serving process: it takes its working directory into /proc/self/fd, waits
// until the supervisor has detached the host's root, and serves under the seccomp filter.
func serve(spec Spec) error {
	os.Unsetenv(markerEnv)
	os.Unsetenv(specEnv)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	// After the first signal, a second one gets its default action: a stuck shutdown can be
	// interrupted.
	context.AfterFunc(ctx, stop)

	if err := confine.EnterRoot(spec.Server.SharedDir); err != nil {
		return err
	}
	vhost, err := inheritedListener(vhostFD, "vhost-user")
	if err != nil {
		return err
	}
	defer vhost.Close()
	channel, err := inheritedListener(channelFD, "channel")
	if err != nil {
		return err
	}
	defer channel.Close()

	cfg := spec.Server
	cfg.SharedDir, cfg.ProcSelfFd = "/", confine.ProcSelfFd
	srv, err := virtiofs.NewServer(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()
	log.L.WithFields(log.Fields{
		"shared_dir": spec.Server.SharedDir, "cache": cfg.Cache.String(), "thread_pool": cfg.ThreadPoolSize,
		"dax": cfg.DAX.Mode.String(), "dax_rules": len(cfg.DAX.Rules), "seccomp": string(confine.DefaultAction),
	}).Info("confined virtio-fs server starting")
	// Logged before the filter goes on, as kvfsd does, so the logger has set itself up.
	log.L.Info(ReadyLine)
	if err := confine.InstallSeccomp(confine.DefaultAction); err != nil {
		return err
	}
	go serveChannel(channel, srv)
	err = srv.Serve(ctx, vhost)
	writeFinalStats(srv.Stats())
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		log.L.Info("signal received, shut down")
		return nil
	}
	return err
}

// writeFinalStats hands the owner the server's last counters, which it reports once the
// server has exited (after the VM, usually).
func writeFinalStats(st virtiofs.Stats) {
	f := os.NewFile(serveFinalFD, "final statistics")
	defer f.Close()
	b, err := json.Marshal(st)
	if err == nil {
		_, err = f.Write(b)
	}
	if err != nil {
		log.L.WithError(err).Warn("handing over the final statistics")
	}
}

// FinalStats reads what the server writes to the final statistics pipe when it stops serving
// (r is the pipe's read end, which FinalStats closes): its last counters, or an error if it
// wrote nothing it could decode (it was killed, say). The server is as untrusted as the guest:
// at most maxReply bytes are read.
func FinalStats(r io.ReadCloser) (virtiofs.Stats, error) {
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, maxReply+1))
	if err != nil {
		return virtiofs.Stats{}, fmt.Errorf("final statistics: %w", err)
	}
	if len(b) > maxReply {
		return virtiofs.Stats{}, fmt.Errorf("final statistics: longer than %d bytes", maxReply)
	}
	var st virtiofs.Stats
	if err := json.Unmarshal(b, &st); err != nil {
		return virtiofs.Stats{}, fmt.Errorf("final statistics: %w", err)
	}
	return st, nil
}

// inheritedListener returns the listening Unix socket at descriptor fd.
func inheritedListener(fd int, what string) (*net.UnixListener, error) {
	f := os.NewFile(uintptr(fd), what)
	defer f.Close()
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("the %s socket (descriptor %d): %w", what, fd, err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("the %s socket (descriptor %d) is not a Unix socket", what, fd)
	}
	return ul, nil
}
