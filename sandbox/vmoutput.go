package sandbox

import (
	"bytes"
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

// The same holds for a server's log (server.go, startServerProcess): a server a guest took over
// writes what it likes there. Each stream is a pipedLog.
//
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
	// serverLogLimit bounds server.log and server.log.1: a few lines at start and stop, and
	// a stack trace per request that panicked, which a guest that found such a request can
	// make at will.
	serverLogLimit = 512 << 10
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
	// watch, if not nil, is a line looked for in the stream (watchFor); seen is closed when it
	// comes, and watch set to nil. carry holds the end of what came, where the start of the
	// line may be. Guarded by mu.
	watch, carry []byte
	seen         chan struct{}
}

// watchFor returns a channel closed once line (printable ASCII, which sanitize keeps as it
// is) has come in the stream, in one write or across several. It is called before the
// stream starts.
func (l *boundedLog) watchFor(line string) <-chan struct{} {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.watch, l.seen = []byte(line), make(chan struct{})
	return l.seen
}

// look looks for the watched line in what came so far and s. l.mu is held.
func (l *boundedLog) look(s []byte) {
	if l.watch == nil {
		return
	}
	l.carry = append(l.carry, s...)
	if bytes.Contains(l.carry, l.watch) {
		close(l.seen)
		l.watch, l.carry = nil, nil
		return
	}
	if keep := len(l.watch) - 1; len(l.carry) > keep {
		l.carry = l.carry[:copy(l.carry, l.carry[len(l.carry)-keep:])]
	}
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
	l.look(s)
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
	log.G(l.ctx).WithError(err).WithField("file", l.path).Warn("no longer writing this output to its file; it is still drained")
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
			log.G(l.ctx).WithError(err).WithField("file", l.path).Error("polling an output's pipe; no longer drained")
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

// pipedLog is a stream a process writes into a pipe and the owner drains, as it comes, into a
// boundedLog: the VM's console, QEMU's output, a server's log. The process never writes a
// file of the host, so what it writes is bounded whatever it is made to write.
type pipedLog struct {
	log *boundedLog
	// fd is the pipe's read end (non-blocking); closing stopW ends the drain, which polls
	// stopR. The drain closes fd and stopR when it ends; then drained is closed.
	fd, stopR, stopW int
	drained          chan struct{}
	stopOnce         sync.Once
}

// openPipedLog opens the boundedLog at path (appending) and makes its pipe: it returns the
// write end, named name, which the caller gives the process and then closes. The write end is
// blocking, as a program's stdout and stderr usually are.
func openPipedLog(ctx context.Context, path string, limit int64, name string) (*pipedLog, *os.File, error) {
	p := &pipedLog{fd: -1, stopR: -1, stopW: -1, drained: make(chan struct{})}
	var w *os.File
	err := func() (err error) {
		if p.log, err = openBoundedLog(ctx, path, limit); err != nil {
			return err
		}
		if p.fd, w, err = outputPipe(name); err != nil {
			return err
		}
		var stop [2]int
		if err := unix.Pipe2(stop[:], unix.O_CLOEXEC); err != nil {
			return fmt.Errorf("pipe: %w", err)
		}
		p.stopR, p.stopW = stop[0], stop[1]
		return nil
	}()
	if err != nil {
		if w != nil {
			w.Close()
		}
		p.close()
		return nil, nil, err
	}
	return p, w, nil
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

// close closes the pipe and the log without draining: for a process that did not start.
func (p *pipedLog) close() {
	for _, fd := range []int{p.fd, p.stopR, p.stopW} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	if p.log != nil {
		p.log.close()
	}
}

// start drains the pipe until every writer has closed it (the process, and any child it gave
// it to, exited) or stop.
func (p *pipedLog) start() {
	go func() {
		drain(p.fd, p.stopR, p.log)
		unix.Close(p.fd)
		unix.Close(p.stopR)
		close(p.drained)
	}()
}

// stop ends the drain (the process may still run), waits for it and closes the file. What is
// kept in memory stays readable. start must have been called.
func (p *pipedLog) stop() {
	p.stopOnce.Do(func() {
		unix.Close(p.stopW)
		<-p.drained
		p.log.close()
	})
}

// finish lets the drain read what an exited process left in the pipe, for at most
// outputDrainGrace (a child of it may still hold the pipe), then stops it.
func (p *pipedLog) finish() {
	select {
	case <-p.drained:
	case <-time.After(outputDrainGrace):
	}
	p.stop()
}

// vmOutput is what the sandbox keeps of its VM's output: the guest's console and QEMU's own
// stdout and stderr, each a pipedLog.
type vmOutput struct {
	console, qemu *pipedLog
	// drained is closed once both drains have ended.
	drained chan struct{}
}

// newVMOutput opens the logs of the sandbox in dir and makes the pipes: it returns the write
// ends, for the guest's console (VM.Console) and for QEMU's stdout and stderr
// (VMCommand.Output); once the runner has given them to QEMU, the caller closes them. (QEMU
// makes its own opening of the console's non-blocking.)
func newVMOutput(ctx context.Context, dir string) (*vmOutput, *os.File, *os.File, error) {
	o := &vmOutput{drained: make(chan struct{})}
	var console, qemu *os.File
	var err error
	if o.console, console, err = openPipedLog(ctx, filepath.Join(dir, consoleName), consoleFileLimit, "console"); err != nil {
		return nil, nil, nil, err
	}
	if o.qemu, qemu, err = openPipedLog(ctx, filepath.Join(dir, qemuLogName), qemuFileLimit, "qemu"); err != nil {
		console.Close()
		o.console.close()
		return nil, nil, nil, err
	}
	return o, console, qemu, nil
}

// close closes the pipes and the logs without draining: for a VM that did not start.
func (o *vmOutput) close() {
	o.console.close()
	o.qemu.close()
}

// start drains both pipes until every writer has closed them (QEMU exited) or stop.
func (o *vmOutput) start() {
	o.console.start()
	o.qemu.start()
	go func() {
		<-o.console.drained
		<-o.qemu.drained
		close(o.drained)
	}()
}

// stop ends the drains (QEMU may still run), waits for them and closes the files. What is
// kept in memory stays readable. start must have been called.
func (o *vmOutput) stop() {
	o.console.stop()
	o.qemu.stop()
}

// lastLines returns the last lines of QEMU's output and of the console, at most tailLines
// each.
func (o *vmOutput) lastLines() (qemu, console []string) {
	return o.qemu.log.lastLines(tailLines), o.console.log.lastLines(tailLines)
}
