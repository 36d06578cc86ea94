package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"
)

// What a VM writes is the guest's to choose and without end: the serial console wholly, and
// QEMU's own output in part (a guest can make QEMU complain). The sandbox directory is on a
// tmpfs (/run), where an unbounded file would take the host's memory and, once /run is full,
// break every other pod and containerd itself. So neither is a file QEMU writes: each goes to
// a pipe — the console through QEMU's file chardev opened on the inherited pipe, QEMU's stdout
// and stderr as they are — that the owner drains as it comes into a boundedLog.
//
// Draining never stops while QEMU runs. A full console pipe makes QEMU's serial port hold the
// guest's next byte (QEMU writes it non-blocking and retries when the pipe has room), and
// the guest's kernel waits on its console, so the guest would stall. A boundedLog's Write
// only copies into memory and writes a tmpfs file; it never fails and never waits on
// anything else. If the owner dies, QEMU's writes fail (EPIPE; QEMU ignores SIGPIPE) and are
// dropped: the guest never waits for a reader that is gone. A restarted owner that adopts
// the VM has neither stream any more.
//
// What is kept is sanitized (see sanitize): a log reader's terminal and an error message
// never see the guest's control bytes.

// Bounds of what is kept of a VM's output.
const (
	// consoleFileLimit bounds console.log and console.log.1: the host keeps at most twice
	// this of a guest's console.
	consoleFileLimit = 1 << 20
	// qemuFileLimit bounds qemu.log and qemu.log.1. QEMU says little unless something is
	// wrong, and then its last lines are what matters.
	qemuFileLimit = 256 << 10
	// tailBytes is how much of the end of each stream is kept in memory for VMError.
	tailBytes = 2 << 10
	// tailLines is how many lines VMError quotes of each stream, at most.
	tailLines = 20
	// drainBufSize is the size of a drain's reads.
	drainBufSize = 8 << 10
)

// A read of drainBufSize bytes sanitizes to at most 4 times as many: every file limit holds
// several, so a write never needs more than the one rotation before it.
const _ = uint(qemuFileLimit - 4*drainBufSize)

// Timing of the drains.
const (
	// drainPause is how long a drain waits after a read that did not fill half its buffer.
	// QEMU's serial port writes the console a byte at a time, as the guest writes it: read as
	// it comes, a flood would cost the host a wakeup, a read and a file write per byte or
	// so. A pause lets the pipe gather it instead: its 64 KiB take 6 MiB/s before the pause
	// holds the guest up, far more than QEMU's serial port moves, and a read that fills the
	// buffer does not pause.
	drainPause = 10 * time.Millisecond
	// outputDrainGrace bounds the wait, after QEMU exited, for the drains to read what it
	// left in the pipes.
	outputDrainGrace = 2 * time.Second
)

// sanitize appends src to dst as text safe to show and unambiguous to read: printable ASCII,
// newline and tab as they are; a backslash doubled; a carriage return dropped (the serial
// console ends each line with "\r\n"); every other byte — control characters, escape
// sequences, NUL, bytes of UTF-8 or not — as \xNN. Any piece of its output is just as safe.
func sanitize(dst, src []byte) []byte {
	const hex = "0123456789abcdef"
	for _, c := range src {
		switch {
		case c == '\\':
			dst = append(dst, '\\', '\\')
		case c == '\n' || c == '\t' || c >= 0x20 && c < 0x7f:
			dst = append(dst, c)
		case c == '\r':
		default:
			dst = append(dst, '\\', 'x', hex[c>>4], hex[c&0xf])
		}
	}
	return dst
}

// boundedLog keeps an untrusted stream within fixed bounds: sanitized, its last tailBytes in
// memory (for error messages), and, for operators, in the file path, which is renamed to
// path.1 (replacing it) when a write would take it past limit. The host so keeps at most
// 2*limit bytes of the stream on disk and tailBytes in memory, however much comes.
type boundedLog struct {
	ctx   context.Context // for the warning when the file cannot be written
	path  string
	limit int64

	mu    sync.Mutex
	f     *os.File // guarded by mu; nil once closed, or after a file error
	size  int64    // guarded by mu: bytes in f
	tail  []byte   // guarded by mu: the end of the sanitized stream, at most tailBytes
	total int64    // guarded by mu: sanitized bytes written, in all
	esc   []byte   // guarded by mu: sanitize's output, reused
}

// openBoundedLog opens the log at path, appending to what is there (a recovered sandbox's
// console goes on where it was).
func openBoundedLog(ctx context.Context, path string, limit int64) (*boundedLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o640)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	return &boundedLog{ctx: ctx, path: path, limit: limit, f: f, size: fi.Size(), tail: make([]byte, 0, tailBytes)}, nil
}

// Write keeps p. It always reports all of p written: the drain must go on whatever happens
// to the file.
func (l *boundedLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.esc = sanitize(l.esc[:0], p)
	s := l.esc
	l.total += int64(len(s))
	l.appendTail(s)
	l.writeFile(s)
	return len(p), nil
}

// appendTail keeps the last tailBytes of the stream. l.mu is held.
func (l *boundedLog) appendTail(s []byte) {
	if len(s) >= tailBytes {
		l.tail = append(l.tail[:0], s[len(s)-tailBytes:]...)
		return
	}
	if over := len(l.tail) + len(s) - tailBytes; over > 0 {
		l.tail = l.tail[:copy(l.tail, l.tail[over:])]
	}
	l.tail = append(l.tail, s...)
}

// writeFile appends s to the file, rotating it first if s would take it past the limit. l.mu
// is held.
func (l *boundedLog) writeFile(s []byte) {
	if l.f == nil {
		return
	}
	if int64(len(s)) > l.limit {
		s = s[int64(len(s))-l.limit:]
	}
	if l.size > 0 && l.size+int64(len(s)) > l.limit {
		if err := l.rotate(); err != nil {
			l.fail(err)
			return
		}
	}
	n, err := l.f.Write(s)
	l.size += int64(n)
	if err != nil {
		l.fail(err)
	}
}

// rotate renames the file to path.1 and starts a new one. l.mu is held.
func (l *boundedLog) rotate() error {
	l.f.Close()
	l.f = nil
	if err := os.Rename(l.path, l.path+".1"); err != nil {
		return err
	}
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o640)
	if err != nil {
		return err
	}
	l.f, l.size = f, 0
	return nil
}

// fail stops writing the file (a full /run, say): the stream is still drained, and its tail
// kept in memory. l.mu is held.
func (l *boundedLog) fail(err error) {
	log.G(l.ctx).WithError(err).WithField("file", l.path).Warn("no longer writing the VM's output to its file; it is still drained")
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
}

// lastLines returns at most n of the last lines kept in memory. A line cut by the start of
// what is kept is left out, unless it is all there is: then it is marked with a leading "...".
func (l *boundedLog) lastLines(n int) []string {
	l.mu.Lock()
	text := string(l.tail)
	cut := l.total > int64(len(l.tail))
	l.mu.Unlock()
	text = strings.TrimRight(text, "\n")
	if text == "" {
		return nil
	}
	lines := strings.Split(text, "\n")
	if cut {
		if len(lines) > 1 {
			lines = lines[1:]
		} else {
			lines[0] = "..." + lines[0]
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return lines
}

// written returns how many sanitized bytes l was given in all.
func (l *boundedLog) written() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

// close closes the file; what is kept in memory stays readable.
func (l *boundedLog) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
}

// drain copies what comes on the pipe fd (non-blocking) into l until every writer has closed
// it, or until stop (the read end of a pipe) becomes readable or hung up. After a read that
// did not fill half its buffer it pauses for drainPause, so that what comes a byte at a time
// is taken in batches.
//
// It polls the descriptors itself instead of leaving them to Go's network poller: there,
// every write to the pipe — one per byte of the console — is an epoll event that wakes the
// runtime, pause or not. poll(2) looks only when asked. Measured under TCG with a guest
// flooding its console (TestVMConsoleFlood): through Go's poller the owner spent 60% of a
// CPU and the guest wrote 200 KiB/s; polled, 1.6% and 333 KiB/s.
func drain(fd, stop int, l *boundedLog) {
	buf := make([]byte, drainBufSize)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}, {Fd: int32(stop), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil && err != unix.EINTR {
			log.G(l.ctx).WithError(err).WithField("file", l.path).Error("polling the VM's output; no longer drained")
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		n, err := unix.Read(fd, buf)
		switch {
		case n > 0:
			l.Write(buf[:n])
		case err == unix.EAGAIN || err == unix.EINTR:
			continue
		default: // the end (every writer closed the pipe), or an error on it
			return
		}
		if n < len(buf)/2 {
			time.Sleep(drainPause)
		}
	}
}

// vmOutput is what the sandbox keeps of its VM's output: the guest's console and QEMU's own
// stdout and stderr, each drained from a pipe into a boundedLog.
type vmOutput struct {
	console, qemu *boundedLog
	// consoleFD and qemuFD are the pipes' read ends (non-blocking); closing stopW ends the
	// drains, which poll stopR. The drains close all three when they end; then drained is
	// closed.
	consoleFD, qemuFD, stopR, stopW int
	drained                         chan struct{}
}

// newVMOutput opens the logs of the sandbox in dir and makes the pipes: it returns the write
// ends, for the guest's console (VM.Console) and for QEMU's stdout and stderr
// (VMCommand.Output); once the runner has given them to QEMU, the caller closes them. The
// write ends are blocking, as a program's stdout and stderr usually are (QEMU makes its own
// opening of the console's non-blocking).
func newVMOutput(ctx context.Context, dir string) (*vmOutput, *os.File, *os.File, error) {
	o := &vmOutput{consoleFD: -1, qemuFD: -1, stopR: -1, stopW: -1, drained: make(chan struct{})}
	var console, qemu *os.File
	err := func() (err error) {
		if o.console, err = openBoundedLog(ctx, filepath.Join(dir, consoleName), consoleFileLimit); err != nil {
			return err
		}
		if o.qemu, err = openBoundedLog(ctx, filepath.Join(dir, qemuLogName), qemuFileLimit); err != nil {
			return err
		}
		if o.consoleFD, console, err = outputPipe("console"); err != nil {
			return err
		}
		if o.qemuFD, qemu, err = outputPipe("qemu"); err != nil {
			return err
		}
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return fmt.Errorf("pipe: %w", err)
		}
		o.stopR, o.stopW = p[0], p[1]
		return nil
	}()
	if err != nil {
		for _, f := range []*os.File{console, qemu} {
			if f != nil {
				f.Close()
			}
		}
		o.close()
		return nil, nil, nil, err
	}
	return o, console, qemu, nil
}

// outputPipe makes a pipe: its read end non-blocking, its write end a blocking *os.File named
// name.
func outputPipe(name string) (int, *os.File, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return -1, nil, fmt.Errorf("pipe: %w", err)
	}
	if err := unix.SetNonblock(p[0], true); err != nil {
		unix.Close(p[0])
		unix.Close(p[1])
		return -1, nil, fmt.Errorf("pipe: %w", err)
	}
	return p[0], os.NewFile(uintptr(p[1]), name), nil
}

// close closes the pipes and the logs without draining: for a VM that did not start.
func (o *vmOutput) close() {
	for _, fd := range []int{o.consoleFD, o.qemuFD, o.stopR, o.stopW} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	for _, l := range []*boundedLog{o.console, o.qemu} {
		if l != nil {
			l.close()
		}
	}
}

// start drains both pipes until every writer has closed them (QEMU exited) or stop.
func (o *vmOutput) start() {
	var wg sync.WaitGroup
	wg.Go(func() { drain(o.consoleFD, o.stopR, o.console) })
	wg.Go(func() { drain(o.qemuFD, o.stopR, o.qemu) })
	go func() {
		wg.Wait()
		unix.Close(o.consoleFD)
		unix.Close(o.qemuFD)
		unix.Close(o.stopR)
		close(o.drained)
	}()
}

// stop ends the drains (QEMU may still run), waits for them and closes the files. What is
// kept in memory stays readable. start must have been called.
func (o *vmOutput) stop() {
	unix.Close(o.stopW)
	<-o.drained
	o.console.close()
	o.qemu.close()
}

// lastLines returns the last lines of QEMU's output and of the console, at most tailLines
// each.
func (o *vmOutput) lastLines() (qemu, console []string) {
	return o.qemu.lastLines(tailLines), o.console.lastLines(tailLines)
}
