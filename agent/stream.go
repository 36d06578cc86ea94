package agent

import (
	"context"
	"errors"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// MaxRead is the most bytes one ReadStdout or ReadStderr answers (the request's max is
	// checked against it).
	MaxRead = 1 << 20
	// streamBuffer is how much of a stream's output the agent holds for the host; past it
	// the reader stops reading, so the process blocks in write until the host reads.
	streamBuffer = 1 << 20
	readChunk    = 32 << 10
)

// outStream is one output stream of a process (stdout, stderr or the pty): a goroutine reads
// it into a bounded buffer until end of file, and Read hands the buffer out. The data a
// process wrote stays readable after it exited; eof comes only once everything was read.
type outStream struct {
	mu       sync.Mutex
	buf      []byte        // guarded by mu: read from the stream, not yet read by the host
	ended    bool          // guarded by mu: the stream hit end of file (or an error)
	discard  bool          // guarded by mu: nobody will read any more (the process was deleted)
	attached bool          // guarded by mu: attach was called
	changed  chan struct{} // guarded by mu: closed (and replaced) when buf or ended changes
	pipe     *os.File      // guarded by mu: the stream when it is a pipe (not a pty)
	closing  bool          // guarded by mu: closeWhenDrained was called
}

// newOutStream returns a stream with nothing attached yet: Read waits.
func newOutStream() *outStream {
	return &outStream{changed: make(chan struct{})}
}

// attach starts reading r, which is closed at its end; a nil r is a stream that has ended.
// Only the first call counts; a later r is closed.
func (s *outStream) attach(r io.ReadCloser) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.attached {
		if r != nil {
			r.Close()
		}
		return
	}
	s.attached = true
	if r == nil {
		s.ended = true
		s.notifyLocked()
		return
	}
	s.pipe, _ = r.(*os.File)
	go s.pump(r)
}

// closeWhenDrained ends a pipe stream once what is in the pipe now has been read, even if
// some process still holds its write end (a background child of an exited process): the
// process has exited, and the host waits for the end of its output. A pty is left alone.
func (s *outStream) closeWhenDrained() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pipe == nil || s.ended || s.closing {
		return
	}
	s.closing = true
	// A blocked read returns at once (nothing read); the reader then drains without waiting.
	_ = s.pipe.SetReadDeadline(time.Now())
}

// drainLocked reads what the pipe holds now without waiting (it is non-blocking), keeps it
// and ends the stream.
func (s *outStream) drainLocked(chunk []byte) {
	// The deadline only served to wake the reader; with it, no read would be tried at all.
	_ = s.pipe.SetReadDeadline(time.Time{})
	if rc, err := s.pipe.SyscallConn(); err == nil {
		for {
			var n int
			var rerr error
			if err := rc.Read(func(fd uintptr) bool {
				n, rerr = unix.Read(int(fd), chunk)
				return rerr != unix.EINTR
			}); err != nil || rerr != nil || n <= 0 {
				break
			}
			if !s.discard {
				s.buf = append(s.buf, chunk[:n]...)
			}
		}
	}
	s.ended = true
	s.notifyLocked()
}

func (s *outStream) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *outStream) pump(r io.ReadCloser) {
	defer r.Close()
	chunk := make([]byte, readChunk)
	for {
		s.mu.Lock()
		for len(s.buf) >= streamBuffer && !s.discard {
			c := s.changed
			s.mu.Unlock()
			<-c
			s.mu.Lock()
		}
		s.mu.Unlock()
		n, err := r.Read(chunk)
		s.mu.Lock()
		if n > 0 && !s.discard {
			s.buf = append(s.buf, chunk[:n]...)
			s.notifyLocked()
		}
		if err != nil && errors.Is(err, os.ErrDeadlineExceeded) && s.closing {
			s.drainLocked(chunk)
			s.mu.Unlock()
			return
		}
		// A pty's master reads EIO once no process holds the terminal any more: its end.
		if err != nil && !errors.Is(err, syscall.EINTR) {
			s.ended = true
			s.notifyLocked()
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
	}
}

// Read waits for data or the end of the stream and answers up to max bytes of data, or eof
// once the stream ended and everything was read. done (the service shutting down) and ctx end
// the wait.
func (s *outStream) Read(ctx context.Context, done <-chan struct{}, max int) ([]byte, bool, error) {
	for {
		s.mu.Lock()
		if len(s.buf) > 0 {
			n := min(max, len(s.buf))
			data := append([]byte(nil), s.buf[:n]...)
			s.buf = s.buf[n:]
			if len(s.buf) == 0 {
				s.buf = nil
			}
			s.notifyLocked()
			s.mu.Unlock()
			return data, false, nil
		}
		if s.ended || s.discard {
			s.mu.Unlock()
			return nil, true, nil
		}
		c := s.changed
		s.mu.Unlock()
		select {
		case <-c:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-done:
			return nil, false, errShuttingDown
		}
	}
}

// Discard drops what is buffered and what is still to come: the process was deleted. Reads
// answer eof from now on; the stream's reader keeps draining it to its end, so the process
// never blocks on a full pipe.
func (s *outStream) Discard() {
	s.mu.Lock()
	s.discard = true
	s.buf = nil
	s.notifyLocked()
	s.mu.Unlock()
}
