// Package hooks runs a container's OCI runtime-spec hooks on the host: the phases that the
// runtime spec calls in the runtime namespace (prestart, createRuntime, poststart, poststop).
// The shim runs them around its agent calls; the container-namespace phases (createContainer,
// startContainer) are runc's, in the guest, and never come here.
//
// Run executes a phase's hooks one after the other, in the order given, as the runtime spec
// says: Path (absolute) with Args (Args[0] is argv[0]) and exactly Env (nothing of the
// caller's environment), the container's state JSON on stdin, the working directory the
// state's bundle. A hook's Timeout (seconds) kills it, with every process of its process
// group, once it has passed. A hook's error names the phase, the hook's index and path, how
// it ended and the last OutputMax bytes of its output (stdout and stderr together). As the
// runtime spec says, the first failing prestart or createRuntime hook ends its phase (the
// caller fails the create), while a failing poststart or poststop hook lets the phase's
// other hooks run (the caller logs the errors). A hook that exits but leaves a child holding
// its output does not hold Run: the output is cut WaitDelay after the hook's exit.
//
// # Threat model
//
// The hooks come from the container's OCI spec, that is from containerd, the CRI or an NRI
// plugin, and are trusted as containerd is: they run on the host as the shim's user (root),
// with no sandbox, as runc runs them. What they print is bounded in memory (OutputMax) but
// otherwise copied as it is into errors and logs. Run never waits on a hook longer than its
// Timeout; a hook without one may block its phase (and the call that runs it) for as long as
// it runs, as with runc. The state's pid is the caller's to choose: the kvfs shim gives its
// pod's VM (the container's own processes are in the guest).
package hooks

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// Phase is a hook phase that runs on the host, by its runtime-spec name.
type Phase string

// The host phases, in the order of a container's life.
const (
	// Prestart is deprecated by the runtime spec but still used (by NVIDIA's hook, say): at
	// create, before CreateRuntime.
	Prestart      Phase = "prestart"
	CreateRuntime Phase = "createRuntime"
	Poststart     Phase = "poststart"
	Poststop      Phase = "poststop"
)

// Of returns the hooks of phase p in h (nil for a nil h).
func (p Phase) Of(h *specs.Hooks) []specs.Hook {
	if h == nil {
		return nil
	}
	switch p {
	case Prestart:
		return h.Prestart
	case CreateRuntime:
		return h.CreateRuntime
	case Poststart:
		return h.Poststart
	case Poststop:
		return h.Poststop
	}
	return nil
}

const (
	// OutputMax is how much of a hook's output (its last bytes) an error keeps.
	OutputMax = 4 << 10
	// WaitDelay is how long Run waits, after a hook exited, for the rest of its output: a
	// child it left behind may hold its stdout or stderr open.
	WaitDelay = time.Second
)

// continues says whether the hooks of p after a failing one still run: the runtime spec
// has a poststart or poststop failure logged and "the remaining hooks and lifecycle
// continue".
func (p Phase) continues() bool { return p == Poststart || p == Poststop }

// Run runs the hooks hs of phase, in order, each with state as JSON on its stdin. A prestart
// or createRuntime phase stops at the first hook that fails and returns its error; a
// poststart or poststop phase runs every hook and returns the failures' errors joined. ctx
// ends every hook still running (killed with its process group).
func Run(ctx context.Context, phase Phase, hs []specs.Hook, state *specs.State) error {
	if len(hs) == 0 {
		return nil
	}
	stdin, err := json.Marshal(state)
	if err != nil {
		return fmt.Errorf("%s hooks: the state: %w", phase, err)
	}
	var errs []error
	for i, h := range hs {
		if err := run(ctx, h, stdin, state.Bundle); err != nil {
			errs = append(errs, fmt.Errorf("%s hook %d (%s): %w", phase, i, h.Path, err))
			if !phase.continues() {
				break
			}
		}
	}
	return errors.Join(errs...)
}

// run runs one hook.
func run(ctx context.Context, h specs.Hook, stdin []byte, dir string) error {
	if !filepath.IsAbs(h.Path) {
		return errors.New("the path is not absolute")
	}
	hctx, cancel := ctx, context.CancelFunc(func() {})
	if h.Timeout != nil {
		if *h.Timeout <= 0 {
			return fmt.Errorf("timeout %d: not a positive number of seconds", *h.Timeout)
		}
		hctx, cancel = context.WithTimeout(ctx, time.Duration(*h.Timeout)*time.Second)
	}
	defer cancel()

	out := &tail{}
	cmd := exec.CommandContext(hctx, h.Path)
	if len(h.Args) > 0 {
		cmd.Args = h.Args
	}
	cmd.Env = append([]string{}, h.Env...) // not nil: nil would pass on the shim's environment
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(stdin)
	// One writer for both: exec gives them one pipe and writes from one goroutine.
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error {
		// The process group is the hook's pid (Setpgid); its children die with it.
		if err := unix.Kill(-cmd.Process.Pid, unix.SIGKILL); err != nil {
			if errors.Is(err, unix.ESRCH) {
				return os.ErrProcessDone
			}
			return err
		}
		return nil
	}
	cmd.WaitDelay = WaitDelay

	err := cmd.Run()
	if err == nil || errors.Is(err, exec.ErrWaitDelay) && cmd.ProcessState.Success() {
		return nil
	}
	ps := cmd.ProcessState
	var how string
	switch {
	case ps == nil:
		how = err.Error() // it did not start
	case ps.Exited() && !ps.Success():
		how = exitText(ps) // it failed on its own
	case hctx.Err() != nil && ctx.Err() == nil:
		how = fmt.Sprintf("timed out after %ds: killed", *h.Timeout)
	case ctx.Err() != nil:
		how = fmt.Sprintf("cancelled (%v): killed", ctx.Err())
	case ps.Success():
		how = err.Error() // its exit was fine, its I/O not
	default:
		how = exitText(ps)
	}
	if o := out.String(); o != "" {
		return fmt.Errorf("%s; output: %q", how, o)
	}
	return errors.New(how)
}

// exitText says how a process ended: its exit status, or the signal that killed it.
func exitText(ps *os.ProcessState) string {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return fmt.Sprintf("killed by signal %d (%s)", int(ws.Signal()), unix.SignalName(ws.Signal()))
	}
	return fmt.Sprintf("exit status %d", ps.ExitCode())
}

// tail keeps the last OutputMax bytes written to it. One goroutine writes (see run), and
// String is called after it is done.
type tail struct {
	buf []byte
	cut bool
}

func (t *tail) Write(p []byte) (int, error) {
	n := len(p)
	if len(p) >= OutputMax {
		t.buf = append(t.buf[:0], p[len(p)-OutputMax:]...)
		t.cut = true
		return n, nil
	}
	if over := len(t.buf) + len(p) - OutputMax; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
		t.cut = true
	}
	t.buf = append(t.buf, p...)
	return n, nil
}

// String is the output kept, trimmed, marked when its start was cut.
func (t *tail) String() string {
	s := strings.TrimSpace(string(t.buf))
	if t.cut {
		return "[...] " + s
	}
	return s
}
