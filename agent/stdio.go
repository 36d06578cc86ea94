package agent

import (
	"context"
	"io"
	"os"

	"github.com/containerd/console"
	"github.com/containerd/errdefs"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// A process's stdio: the pipes or the pty it is given (newProcess), its output streams the host
// reads (ReadStdout, ReadStderr), its stdin the host writes and closes, its terminal's size.

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
