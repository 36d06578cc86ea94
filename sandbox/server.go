package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"

	"github.com/kvfs/kvfs/sandbox/serverproc"
	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// readyLine is what kvfsd, its confined server and both virtiofsd print on stderr once they
// wait for the front-end (Kata's runtime-rs waits for it too).
const readyLine = "Waiting for vhost-user socket connection"

// Timeouts of the server's life.
const (
	// serverReadyTimeout bounds the wait for readyLine. The socket exists before the server
	// starts, so QEMU's connection waits in its backlog meanwhile; a server that never prints
	// the line (say, one logging to syslog) is used anyway once this passes.
	serverReadyTimeout = 5 * time.Second
	// serverStopGrace is how long a server has to exit after SIGTERM before SIGKILL.
	serverStopGrace = 2 * time.Second
)

// fsServer is a running virtio-fs server: confined, in-process, or an external daemon.
type fsServer interface {
	// exited is closed when the server stopped serving.
	exited() <-chan struct{}
	// exitErr says why, once exited is closed: nil when the front-end disconnected (QEMU
	// exited), which is how a server ends normally.
	exitErr() error
	// killed says, once exited is closed, whether a signal ended the server: a server that
	// ends because its VM did exits (the front-end disconnected), so it was not that.
	killed() bool
	// stop ends the server and waits for it.
	stop() error
	// describe names the server in messages: "confined kvfsd (pid 123)", "in-process kvfsd",
	// "/usr/bin/kvfsd (pid 123)".
	describe() string
	// info returns what is known of the server for Stats.
	info() ServerStats
	// record returns what the state file keeps of it.
	record() serverRecord
	// process is the server's own process; nil for the in-process server.
	process() Process
}

// daxSetter is a server whose DAX policy can be replaced while it runs: kvfsd's own, confined
// or in-process.
type daxSetter interface {
	setDAXPolicy(ctx context.Context, p passthrough.DAXPolicy) error
}

// serverRecord is the persisted description of a server.
type serverRecord struct {
	Daemon  string    `json:"daemon"` // Confined, InProcessUnconfined or a path
	Args    []string  `json:"args,omitempty"`
	Process *procID   `json:"process,omitempty"`
	Started time.Time `json:"started"`
}

// listen creates the vhost-user socket at path, mode 0600, replacing a stale socket (never
// anything else) left there by an earlier server.
func listen(path string) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("refusing to replace %s: a %s, not a socket", path, fileKind(fi.Mode()))
		}
		if err := os.Remove(path); err != nil {
			return nil, err
		}
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	l.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		os.Remove(path)
		return nil, err
	}
	return l, nil
}

// inProcServer is kvfsd running in this process.
type inProcServer struct {
	srv     *virtiofs.Server
	cancel  context.CancelFunc
	done    chan struct{}
	err     error // written before done is closed
	started time.Time
}

// startInProcess serves cfg on l, which it takes over. The shared directory is opened in the
// namespace ns: what is mounted there later is reached through that descriptor, from any thread.
func startInProcess(ctx context.Context, ns *mountNS, cfg virtiofs.Config, l *net.UnixListener) (*inProcServer, error) {
	var srv *virtiofs.Server
	err := ns.do(func() (err error) {
		srv, err = virtiofs.NewServer(cfg)
		return err
	})
	if err != nil {
		l.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	s := &inProcServer{srv: srv, cancel: cancel, done: make(chan struct{}), started: time.Now()}
	go func() {
		s.err = srv.Serve(ctx, l) // closes l
		close(s.done)
	}()
	return s, nil
}

func (s *inProcServer) exited() <-chan struct{} { return s.done }
func (s *inProcServer) exitErr() error          { <-s.done; return s.err }
func (s *inProcServer) killed() bool            { return false }
func (s *inProcServer) describe() string        { return "in-process kvfsd" }

func (s *inProcServer) stop() error {
	s.cancel()
	err := s.srv.Close() // waits for Serve
	<-s.done
	return err
}

func (s *inProcServer) info() ServerStats {
	st := s.srv.Stats()
	running := true
	select {
	case <-s.done:
		running = false
	default:
	}
	return ServerStats{Daemon: InProcessUnconfined, PID: os.Getpid(), Started: s.started, Uptime: time.Since(s.started),
		Running: running, FS: &st}
}

func (s *inProcServer) record() serverRecord {
	return serverRecord{Daemon: InProcessUnconfined, Started: s.started}
}

func (s *inProcServer) process() Process { return nil }

func (s *inProcServer) setDAXPolicy(_ context.Context, p passthrough.DAXPolicy) error {
	if err := s.srv.SetDAXPolicy(p); err != nil {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// extServer is a virtiofsd-compatible daemon in its own process.
type extServer struct {
	daemon  string
	args    []string
	proc    Process
	id      procID
	started time.Time
	out     *pipedLog // its log; nil for an adopted daemon, whose pipe was its first owner's
}

// stopServerProcess ends a server's process and waits for it, then for the drain of its log
// (out; nil for an adopted server) to read what it left.
func stopServerProcess(p Process, out *pipedLog) error {
	err := terminate(p, serverStopGrace)
	if out != nil && err == nil {
		out.finish()
	}
	return err
}

// startExternal runs daemon args in the namespace ns with l's socket as fd 3, its output
// drained into logPath (a pipedLog), in a session of its own (it outlives the owner, which may
// adopt it again after a restart, without its output). It returns once the daemon says it is
// ready, or fails with the log's last lines if it exits first. l is closed either way: the
// daemon holds the socket.
func startExternal(ctx context.Context, ns *mountNS, daemon string, args []string, l *net.UnixListener, logPath string) (*extServer, error) {
	lf, err := l.File()
	l.Close()
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	s := &extServer{daemon: daemon, args: args}
	err = startServerProcess(ctx, ns, logPath, func(out *os.File) (*exec.Cmd, error) {
		cmd := exec.Command(daemon, args...)
		cmd.Stdout, cmd.Stderr = out, out
		cmd.ExtraFiles = []*os.File{lf}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		return cmd, nil
	}, func(p Process, id procID, out *pipedLog) {
		s.proc, s.id, s.started, s.out = p, id, time.Now(), out
	}, s.describe)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// startServerProcess starts the server command makes, in the mount namespace ns (a child is
// born in the namespace of the thread that forks it: ns's), its stdout and stderr the write
// end of a pipe the owner drains into logPath, a boundedLog: the server writes no host file,
// so even one a guest took over keeps at most 2*serverLogLimit of its log on /run. It waits
// until the server says it is ready, or fails with the log's last lines if it exits first.
// started is told of the process and its log as soon as it runs; describe names it in errors.
//
// The drain runs while the server holds the pipe. If the owner dies first, the server's
// writes fail with EPIPE and are dropped: the confined server and kvfsd ignore SIGPIPE, as
// virtiofsd does, so that an owner's restart, which may adopt the server again, does not end
// it at its next line.
func startServerProcess(ctx context.Context, ns *mountNS, logPath string, command func(out *os.File) (*exec.Cmd, error),
	started func(Process, procID, *pipedLog), describe func() string) error {
	out, w, err := openPipedLog(ctx, logPath, serverLogLimit, "server log")
	if err != nil {
		return err
	}
	ready := out.log.watchFor(readyLine)
	cmd, err := command(w)
	if err != nil {
		w.Close()
		out.close()
		return err
	}
	var p *childProcess
	err = ns.do(func() (err error) {
		p, err = startChild(cmd)
		return err
	})
	w.Close()
	if err != nil {
		out.close()
		return fmt.Errorf("start %s: %w", cmd.Path, err)
	}
	out.start()
	id, err := identify(p.Pid())
	if err != nil {
		// It died at once: report that below.
		id = procID{PID: p.Pid(), BootID: bootID()}
	}
	started(p, id, out)
	if err := waitReady(p, ready, out); err != nil {
		_ = kill(p)
		out.finish()
		return fmt.Errorf("%s: %w", describe(), err)
	}
	return nil
}

// adoptExternal takes hold of a daemon recorded by an earlier owner.
func adoptExternal(rec serverRecord) (*extServer, error) {
	if rec.Process == nil {
		return nil, fmt.Errorf("no process recorded: %w", errNotRunning)
	}
	p, err := adopt(*rec.Process)
	if err != nil {
		return nil, err
	}
	return &extServer{daemon: rec.Daemon, args: rec.Args, proc: p, id: *rec.Process, started: rec.Started}, nil
}

// waitReady waits until the server's log has had readyLine (ready is closed).
func waitReady(p Process, ready <-chan struct{}, out *pipedLog) error {
	select {
	case <-ready:
		return nil
	case <-p.Exited():
		select {
		case <-out.drained:
		case <-time.After(outputDrainGrace):
		}
		tail := "(no output)"
		if lines := out.log.lastLines(tailLines); len(lines) > 0 {
			tail = strings.Join(lines, " | ")
		}
		return fmt.Errorf("exited before serving (%v): %s", p.ExitErr(), tail)
	case <-time.After(serverReadyTimeout):
		return nil // see serverReadyTimeout
	}
}

func (s *extServer) exited() <-chan struct{} { return s.proc.Exited() }
func (s *extServer) exitErr() error          { return s.proc.ExitErr() }
func (s *extServer) killed() bool            { return signaled(s.proc.ExitErr()) }
func (s *extServer) stop() error             { return stopServerProcess(s.proc, s.out) }

func (s *extServer) describe() string {
	return fmt.Sprintf("%s (pid %d)", s.daemon, s.proc.Pid())
}

func (s *extServer) info() ServerStats {
	running := true
	select {
	case <-s.proc.Exited():
		running = false
	default:
	}
	return ServerStats{Daemon: s.daemon, PID: s.proc.Pid(), Started: s.started, Uptime: time.Since(s.started), Running: running}
}

func (s *extServer) record() serverRecord {
	id := s.id
	return serverRecord{Daemon: s.daemon, Args: s.args, Process: &id, Started: s.started}
}

func (s *extServer) process() Process { return s.proc }

// channelTimeout bounds a call on a confined server's channel.
const channelTimeout = 2 * time.Second

// confinedServer is kvfsd in a confined process of its own, started from this executable
// (package sandbox/serverproc) and reached over its channel.
type confinedServer struct {
	ctx     context.Context // for logging
	proc    Process
	id      procID
	started time.Time
	channel serverproc.Client
	out     *pipedLog // its log; nil for an adopted server, whose pipe was its first owner's
	// final is closed once finalStats, the counters the server left when it stopped serving,
	// is written (nil if it left none); nil for an adopted server, whose pipe was its first
	// owner's.
	final      chan struct{}
	finalStats *virtiofs.Stats
}

// startConfined starts the confined server of spec in the namespace ns on l, with its channel
// on channel and its output drained into logPath (startServerProcess), and returns once it says
// it is ready, or fails with the log's last lines if it exits first. l and channel are closed
// either way: the server holds the sockets.
func startConfined(ctx context.Context, ns *mountNS, spec serverproc.Spec, l, channel *net.UnixListener, channelPath, logPath string) (*confinedServer, error) {
	lf, err := l.File()
	l.Close()
	cf, cerr := channel.File()
	channel.Close()
	if err = errors.Join(err, cerr); err != nil {
		lf.Close()
		cf.Close()
		return nil, err
	}
	defer lf.Close()
	defer cf.Close()
	fr, fw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer fw.Close()
	s := &confinedServer{ctx: ctx, channel: serverproc.Client{Path: channelPath}, final: make(chan struct{})}
	go func() {
		if st, err := serverproc.FinalStats(fr); err == nil {
			s.finalStats = &st
		}
		close(s.final)
	}()
	err = startServerProcess(ctx, ns, logPath, func(out *os.File) (*exec.Cmd, error) {
		return serverproc.Command(spec, lf, cf, fw, out)
	}, func(p Process, id procID, out *pipedLog) {
		s.proc, s.id, s.started, s.out = p, id, time.Now(), out
	}, s.describe)
	if err != nil {
		fw.Close() // ends the reader, if the command never started
		return nil, err
	}
	return s, nil
}

// adoptConfined takes hold of a confined server recorded by an earlier owner.
func adoptConfined(ctx context.Context, rec serverRecord, channelPath string) (*confinedServer, error) {
	if rec.Process == nil {
		return nil, fmt.Errorf("no process recorded: %w", errNotRunning)
	}
	p, err := adopt(*rec.Process)
	if err != nil {
		return nil, err
	}
	return &confinedServer{ctx: ctx, proc: p, id: *rec.Process, started: rec.Started, channel: serverproc.Client{Path: channelPath}}, nil
}

func (s *confinedServer) exited() <-chan struct{} { return s.proc.Exited() }
func (s *confinedServer) exitErr() error          { return s.proc.ExitErr() }

// killed: the supervisor killed, or the serving process (the supervisor exits with 128 plus
// its signal, as a shell does).
func (s *confinedServer) killed() bool {
	err := s.proc.ExitErr()
	var ee *exec.ExitError
	return signaled(err) || errors.As(err, &ee) && ee.ExitCode() > 128
}
func (s *confinedServer) stop() error      { return stopServerProcess(s.proc, s.out) }
func (s *confinedServer) process() Process { return s.proc }

func (s *confinedServer) describe() string {
	return fmt.Sprintf("confined kvfsd (pid %d)", s.proc.Pid())
}

// finalWait bounds the wait, once the server has exited, for the counters it left.
const finalWait = time.Second

// info asks the running server for its counters (FS stays nil, and the failure is logged, if it
// does not answer and leaves none); an exited one's are those it left when it stopped serving.
func (s *confinedServer) info() ServerStats {
	st := ServerStats{Daemon: Confined, PID: s.proc.Pid(), Started: s.started, Uptime: time.Since(s.started),
		Running: !isClosed(s.proc.Exited())}
	if !st.Running {
		if s.final != nil {
			select {
			case <-s.final: // the pipe's writers are gone with the process
				st.FS = s.finalStats
			case <-time.After(finalWait):
			}
		}
		return st
	}
	ctx, cancel := context.WithTimeout(s.ctx, channelTimeout)
	defer cancel()
	fs, err := s.channel.Stats(ctx)
	if err != nil {
		// A server whose front-end has gone stops serving its channel a moment before it
		// exits, leaving its counters on the pipe as it goes: those are the answer then.
		if s.final != nil {
			select {
			case <-s.final:
				if s.finalStats != nil {
					st.FS, st.Running = s.finalStats, !isClosed(s.proc.Exited())
					return st
				}
			case <-time.After(finalWait):
			}
		}
		log.G(s.ctx).WithError(err).Warn("no statistics from the confined server")
		return st
	}
	st.FS = &fs
	return st
}

func (s *confinedServer) record() serverRecord {
	id := s.id
	return serverRecord{Daemon: Confined, Process: &id, Started: s.started}
}

func (s *confinedServer) setDAXPolicy(ctx context.Context, p passthrough.DAXPolicy) error {
	ctx, cancel := context.WithTimeout(ctx, channelTimeout)
	defer cancel()
	err := s.channel.SetDAXPolicy(ctx, p)
	if errors.Is(err, serverproc.ErrRefused) {
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return err
}

func (s *confinedServer) setLogLevel(ctx context.Context, level string) error {
	ctx, cancel := context.WithTimeout(ctx, channelTimeout)
	defer cancel()
	return s.channel.SetLogLevel(ctx, level)
}

// signaled says whether err, a process's exit error, is a death by a signal.
func signaled(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled()
}

// errServerClean is the exit reason of a server whose front-end disconnected.
var errServerClean = errors.New("the front-end disconnected and the server exited")
