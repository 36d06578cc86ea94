package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	runc "github.com/containerd/go-runc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// Defaults of OCIRuntime.
const (
	DefaultRuntimeRoot    = "/run/crun"
	DefaultRuntimeCommand = "crun"
)

// OCIRuntime is the Runtime of the guest: an OCI runtime with runc's command line, the
// image's crun (packaging/guest/build.sh says why not runc), driven through go-runc. Its
// commands are started and waited for by go-runc's Monitor, which must be the agent's
// [Reaper] (set runc.Monitor) when the agent reaps every child.
type OCIRuntime struct {
	// Command is the runtime's binary (default DefaultRuntimeCommand, found in PATH).
	Command string
	// Root is the runtime's state directory (--root; default DefaultRuntimeRoot).
	Root string
	// BundleDir holds the containers' bundles (the service's StateDir); the runtime's log of
	// each container is BundleDir/<id>/log.json.
	BundleDir string
}

// cli is go-runc's client of the runtime, logging to the container's log.json.
func (r *OCIRuntime) cli(id string) *runc.Runc {
	cmd, root := r.Command, r.Root
	if cmd == "" {
		cmd = DefaultRuntimeCommand
	}
	if root == "" {
		root = DefaultRuntimeRoot
	}
	return &runc.Runc{
		Command:   cmd,
		Root:      root,
		Log:       r.logPath(id),
		LogFormat: runc.JSON,
	}
}

func (r *OCIRuntime) logPath(id string) string {
	return filepath.Join(r.BundleDir, id, "log.json")
}

// failed adds the runtime's last error message from its log to err.
func (r *OCIRuntime) failed(id string, err error) error {
	if err == nil {
		return nil
	}
	if msg := lastRuntimeError(r.logPath(id)); msg != "" {
		return fmt.Errorf("%w: %s", err, msg)
	}
	return err
}

// lastRuntimeError answers the message of the last error in the runtime's JSON log (runc's
// format, which crun writes too), or "".
func lastRuntimeError(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var last string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &e) == nil && (e.Level == "error" || e.Level == "fatal") {
			last = e.Msg
		}
	}
	return last
}

// fileIO hands a ProcessIO's files to a runtime command.
type fileIO struct{ p ProcessIO }

func (f fileIO) Close() error          { return nil }
func (f fileIO) Stdin() io.WriteCloser { return nil }
func (f fileIO) Stdout() io.ReadCloser { return nil }
func (f fileIO) Stderr() io.ReadCloser { return nil }
func (f fileIO) Set(cmd *exec.Cmd) {
	cmd.Stdin, cmd.Stdout, cmd.Stderr = f.p.Stdin, f.p.Stdout, f.p.Stderr
}

// Create runs the runtime's create with the process's stdio or a console socket for its pty.
func (r *OCIRuntime) Create(ctx context.Context, id, bundle string, stdio ProcessIO) (Created, error) {
	pidFile := filepath.Join(bundle, "init.pid")
	sock, rio, err := runtimeStdio(stdio)
	if err != nil {
		return Created{}, err
	}
	opts := &runc.CreateOpts{PidFile: pidFile, IO: rio}
	if sock != nil {
		defer sock.Close()
		opts.ConsoleSocket = sock
	}
	if err := r.cli(id).Create(ctx, id, bundle, opts); err != nil {
		return Created{}, r.failed(id, err)
	}
	cr, err := created(pidFile, sock)
	if err != nil {
		// The runtime made the container: do not leave it behind unknown.
		_ = r.cli(id).Delete(context.Background(), id, &runc.DeleteOpts{Force: true})
	}
	return cr, err
}

// runtimeStdio is what the runtime's create or exec is given for a process's stdio: for a
// terminal, a console socket to send the pty master through (the caller closes it), else
// the process's files.
func runtimeStdio(stdio ProcessIO) (*runc.Socket, runc.IO, error) {
	if !stdio.Terminal {
		return nil, fileIO{stdio}, nil
	}
	sock, err := runc.NewTempConsoleSocket()
	if err != nil {
		return nil, nil, fmt.Errorf("console socket: %w", err)
	}
	return sock, nil, nil
}

// created reads the pid the runtime wrote and receives the pty master of a terminal process.
func created(pidFile string, sock *runc.Socket) (Created, error) {
	pid, err := runc.ReadPidFile(pidFile)
	if err != nil {
		return Created{}, fmt.Errorf("pid file: %w", err)
	}
	cr := Created{Pid: pid}
	if sock != nil {
		if cr.Console, err = sock.ReceiveMaster(); err != nil {
			// The process exists: kill it rather than leave it without its terminal.
			_ = unix.Kill(pid, unix.SIGKILL)
			return Created{}, fmt.Errorf("receiving the pty master: %w", err)
		}
	}
	return cr, nil
}

// Start runs the runtime's start.
func (r *OCIRuntime) Start(ctx context.Context, id string) error {
	return r.failed(id, r.cli(id).Start(ctx, id))
}

// Exec runs the runtime's exec --detach.
func (r *OCIRuntime) Exec(ctx context.Context, id, execID string, p *specs.Process, stdio ProcessIO) (Created, error) {
	dir, err := os.MkdirTemp(filepath.Join(r.BundleDir, id), "exec-")
	if err != nil {
		return Created{}, err
	}
	defer os.RemoveAll(dir)
	pidFile := filepath.Join(dir, "pid")
	sock, rio, err := runtimeStdio(stdio)
	if err != nil {
		return Created{}, err
	}
	opts := &runc.ExecOpts{PidFile: pidFile, Detach: true, IO: rio}
	if sock != nil {
		defer sock.Close()
		opts.ConsoleSocket = sock
	}
	if err := r.cli(id).Exec(ctx, id, *p, opts); err != nil {
		return Created{}, r.failed(id, fmt.Errorf("exec %s: %w", execID, err))
	}
	cr, err := created(pidFile, sock)
	if err != nil {
		return Created{}, fmt.Errorf("exec %s: %w", execID, err)
	}
	return cr, nil
}

// Kill runs the runtime's kill [--all].
func (r *OCIRuntime) Kill(ctx context.Context, id string, sig syscall.Signal, all bool) error {
	return r.failed(id, r.cli(id).Kill(ctx, id, int(sig), &runc.KillOpts{All: all}))
}

// Signal signals an exec by pid, as containerd's runc shim does.
func (r *OCIRuntime) Signal(pid int, sig syscall.Signal) error {
	return unix.Kill(pid, sig)
}

// Delete runs the runtime's delete [--force].
func (r *OCIRuntime) Delete(ctx context.Context, id string, force bool) error {
	return r.failed(id, r.cli(id).Delete(ctx, id, &runc.DeleteOpts{Force: force}))
}

// Pause runs the runtime's pause.
func (r *OCIRuntime) Pause(ctx context.Context, id string) error {
	return r.failed(id, r.cli(id).Pause(ctx, id))
}

// Resume runs the runtime's resume.
func (r *OCIRuntime) Resume(ctx context.Context, id string) error {
	return r.failed(id, r.cli(id).Resume(ctx, id))
}

// Update runs the runtime's update.
func (r *OCIRuntime) Update(ctx context.Context, id string, res *specs.LinuxResources) error {
	return r.failed(id, r.cli(id).Update(ctx, id, res))
}
