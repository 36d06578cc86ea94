// Package stdio resolves a process's standard streams as containerd names them — fifo paths,
// file:// and binary:// URIs — into readers and writers, in one place, so the task service
// only sees an io.Reader for stdin and io.Writers for stdout and stderr.
//
//   - a path (or fifo://): containerd's fifos, opened with github.com/containerd/fifo: stdin
//     read-only, stdout and stderr write-only. Opening does not wait for containerd's end:
//     reads and writes wait for it, until the fifo is closed or Open's ctx ends. The stdin
//     fifo also gets a write side of the shim's own, so that its reader sees the end of file
//     only once CloseStdin has closed that side and the client has closed its own: a client
//     that closes its end has not asked for EOF (ctr reopens it), and what it wrote before
//     CloseStdin is all read.
//   - file:///PATH: stdout and stderr appended to one file (created 0644, its directory 0755).
//   - binary:///PATH?k=v: containerd's logging-binary protocol: PATH runs with its query as
//     arguments (k v), CONTAINER_ID and CONTAINER_NAMESPACE in its environment, the read ends of
//     a stdout and a stderr pipe as fds 3 and 4, and the write end of a ready pipe as fd 5;
//     Open returns once it has closed fd 5 (binary-v2: written a byte). Close closes the
//     pipes, so the binary reads EOF; if it has not exited a second later, it gets SIGTERM,
//     and SIGKILL after BinaryExitTimeout more.
//
// With a terminal there is no stderr: the process's pty carries both streams.
//
// The URIs come from containerd (trusted). The data written here comes from the guest
// (untrusted) but is only copied, never interpreted.
package stdio

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/fifo"
)

// BinaryExitTimeout is how long a logging binary has to exit after SIGTERM.
const BinaryExitTimeout = 10 * time.Second

// Config names a process's streams as the task API does.
type Config struct {
	Stdin, Stdout, Stderr string
	Terminal              bool
	// ContainerID and Namespace are given to a logging binary.
	ContainerID, Namespace string
}

// IO is a process's opened streams. A nil field is a stream not connected.
type IO struct {
	Stdin  io.ReadCloser
	Stdout io.WriteCloser
	Stderr io.WriteCloser
	// stdinHold is the shim's own write side of the stdin fifo; CloseStdin closes it.
	stdinHold io.Closer

	closeOnce sync.Once
	closeErr  error
	finish    func() error // after the streams are closed: the logging binary's end
}

// Wants says which streams the process should have connected: what the agent is asked for.
func (c Config) Wants() (stdin, stdout, stderr bool) {
	return c.Stdin != "", c.Stdout != "", c.Stderr != "" && !c.Terminal
}

// ReadyTimeout bounds the wait for a logging binary to signal that it is ready.
const ReadyTimeout = 30 * time.Second

// Open opens the streams of c. ctx must live as long as the streams: a fifo whose other end
// has not been opened when ctx ends is closed (containerd/fifo). A logging binary has
// ReadyTimeout to get ready.
func Open(ctx context.Context, c Config) (_ *IO, err error) {
	p := &IO{}
	defer func() {
		if err != nil {
			p.Close()
		}
	}()
	if c.Stdin != "" {
		in, err := fifo.OpenFifo(ctx, c.Stdin, syscall.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("stdin %s: %w", c.Stdin, err)
		}
		p.Stdin = in
		if p.stdinHold, err = fifo.OpenFifo(ctx, c.Stdin, syscall.O_WRONLY|syscall.O_NONBLOCK, 0); err != nil {
			return nil, fmt.Errorf("stdin %s, the shim's write side: %w", c.Stdin, err)
		}
	}
	_, wantOut, wantErr := c.Wants()
	if !wantOut && !wantErr {
		return p, nil
	}
	u, err := url.Parse(c.Stdout)
	if err != nil {
		return nil, fmt.Errorf("stdout %q: %w", c.Stdout, err)
	}
	switch u.Scheme {
	case "", "fifo":
		if wantOut {
			if p.Stdout, err = openFifo(ctx, c.Stdout); err != nil {
				return nil, fmt.Errorf("stdout %s: %w", c.Stdout, err)
			}
		}
		if wantErr {
			if p.Stderr, err = openFifo(ctx, c.Stderr); err != nil {
				return nil, fmt.Errorf("stderr %s: %w", c.Stderr, err)
			}
		}
	case "file":
		if err := os.MkdirAll(filepath.Dir(u.Path), 0o755); err != nil {
			return nil, fmt.Errorf("stdout %s: %w", c.Stdout, err)
		}
		f, err := os.OpenFile(u.Path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return nil, fmt.Errorf("stdout %s: %w", c.Stdout, err)
		}
		shared := &sharedFile{f: f, refs: 1}
		p.Stdout = shared
		if !c.Terminal {
			shared.refs++
			p.Stderr = shared
		}
	case "binary", "binary-v2":
		if err := p.startBinary(ctx, u, c); err != nil {
			return nil, fmt.Errorf("stdout %s: %w", c.Stdout, err)
		}
	default:
		return nil, fmt.Errorf("stdout %q: unknown scheme %q (want a fifo path, file:// or binary://)", c.Stdout, u.Scheme)
	}
	return p, nil
}

func openFifo(ctx context.Context, path string) (io.WriteCloser, error) {
	path = filepath.Clean(path)
	if u, err := url.Parse(path); err == nil && u.Scheme == "fifo" {
		path = u.Path
	}
	w, err := fifo.OpenFifo(ctx, path, syscall.O_WRONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	f := &fifoWriter{WriteCloser: w, path: path}
	go f.keepOnceOpen()
	return f, nil
}

// fifoWriter is the write side of an output fifo, which keeps a read side of its own open,
// never read, once containerd's reader has opened the fifo: when containerd goes away
// (restarted), writes do not fail with EPIPE but wait in the pipe until the reader containerd
// opens again takes them, as with containerd's runc shim. The kept side is opened only after
// containerd's: before that, a write waits for containerd's reader, so that nothing written
// goes into a pipe nobody but the shim holds.
type fifoWriter struct {
	io.WriteCloser
	path string

	mu     sync.Mutex
	keep   *os.File // guarded by mu
	closed bool     // guarded by mu
}

// keepOnceOpen opens the kept read side once the write side is open (containerd's reader
// is there), unless the writer is closed first.
func (f *fifoWriter) keepOnceOpen() {
	// An empty write returns once the open is done, or with an error once closed.
	if _, err := f.WriteCloser.Write(nil); err == nil {
		f.openKeep()
	}
}

func (f *fifoWriter) openKeep() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.keep != nil || f.closed {
		return
	}
	// Non-blocking: a read side opens at once; it is never read.
	if r, err := os.OpenFile(f.path, os.O_RDONLY|syscall.O_NONBLOCK, 0); err == nil {
		f.keep = r
	}
}

func (f *fifoWriter) Write(b []byte) (int, error) {
	n, err := f.WriteCloser.Write(b)
	if err == nil {
		f.openKeep() // at once, if keepOnceOpen has not yet
	}
	return n, err
}

func (f *fifoWriter) Close() error {
	f.mu.Lock()
	f.closed = true
	keep := f.keep
	f.mu.Unlock()
	err := f.WriteCloser.Close()
	if keep != nil {
		keep.Close()
	}
	return err
}

// sharedFile is one file behind stdout and stderr: closed when both are.
type sharedFile struct {
	mu   sync.Mutex
	f    *os.File
	refs int // guarded by mu
}

func (s *sharedFile) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.f.Write(b)
}

func (s *sharedFile) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refs--
	if s.refs == 0 {
		return s.f.Close()
	}
	return nil
}

func (p *IO) startBinary(ctx context.Context, u *url.URL, c Config) error {
	outR, outW, err := os.Pipe()
	if err != nil {
		return err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return err
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		errR.Close()
		errW.Close()
		return err
	}
	var args []string
	for k, vs := range u.Query() {
		args = append(args, k)
		if len(vs) > 0 && vs[0] != "" {
			args = append(args, vs[0])
		}
	}
	cmd := exec.Command(u.Path, args...)
	cmd.Env = append(os.Environ(), "CONTAINER_ID="+c.ContainerID, "CONTAINER_NAMESPACE="+c.Namespace)
	cmd.ExtraFiles = []*os.File{outR, errR, readyW}
	err = cmd.Start()
	// The binary holds its ends now (or failed to start): ours go.
	outR.Close()
	errR.Close()
	readyW.Close()
	if err != nil {
		outW.Close()
		errW.Close()
		readyR.Close()
		return fmt.Errorf("start the logging binary: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	p.Stdout, p.Stderr = outW, errW
	if c.Terminal {
		errW.Close()
		p.Stderr = nil
	}
	p.finish = func() error { return stopBinary(cmd, exited) }

	ready := make(chan error, 1)
	go func() {
		var b [1]byte
		n, err := readyR.Read(b[:])
		switch {
		case err != nil && !errors.Is(err, io.EOF):
			ready <- err
		case n == 0 && u.Scheme == "binary-v2":
			ready <- errors.New("the logging binary closed its ready pipe without signalling ready")
		default:
			ready <- nil
		}
	}()
	defer readyR.Close()
	select {
	case err := <-ready:
		return err
	case <-ctx.Done():
		return fmt.Errorf("waiting for the logging binary to be ready: %w", ctx.Err())
	case <-time.After(ReadyTimeout):
		return fmt.Errorf("the logging binary was not ready within %v", ReadyTimeout)
	}
}

func stopBinary(cmd *exec.Cmd, exited chan error) error {
	select {
	case <-exited:
		return nil // it ended by itself on EOF
	case <-time.After(time.Second):
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
		return nil
	case <-time.After(BinaryExitTimeout):
		_ = cmd.Process.Kill()
		<-exited
		return fmt.Errorf("the logging binary %s did not exit %v after SIGTERM: killed", cmd.Path, BinaryExitTimeout)
	}
}

// CloseStdin closes the shim's write side of stdin: Stdin's reader then reads what is left in
// the fifo, and the end of file once the client has closed its side too.
func (p *IO) CloseStdin() error {
	if p.stdinHold == nil {
		return nil
	}
	if err := p.stdinHold.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}

// Close closes every stream and ends a logging binary. It is idempotent.
func (p *IO) Close() error {
	p.closeOnce.Do(func() {
		var errs []error
		for _, c := range []io.Closer{p.stdinHold, p.Stdin, p.Stdout, p.Stderr} {
			if c != nil {
				if err := c.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
					errs = append(errs, err)
				}
			}
		}
		if p.finish != nil {
			errs = append(errs, p.finish())
		}
		p.closeErr = errors.Join(errs...)
	})
	return p.closeErr
}
