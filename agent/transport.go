package agent

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/mdlayher/vsock"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// DefaultVirtioPorts is where the kernel lists virtio-serial ports.
const DefaultVirtioPorts = "/sys/class/virtio-ports"

// hostPollInterval is how often a serial listener looks whether the host has connected:
// the port gives no event for it (while the host is away, poll answers POLLHUP at once).
const hostPollInterval = 10 * time.Millisecond

// FindSerialPort answers the device (/dev/vportNpM) of the virtio-serial port called name,
// looked up in sysDir (DefaultVirtioPorts).
func FindSerialPort(sysDir, name string) (string, error) {
	entries, err := os.ReadDir(sysDir)
	if err != nil {
		return "", fmt.Errorf("virtio-serial ports: %w", err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(sysDir, e.Name(), "name"))
		if err != nil {
			continue
		}
		if strings.TrimSpace(string(b)) == name {
			return filepath.Join("/dev", e.Name()), nil
		}
	}
	return "", fmt.Errorf("no virtio-serial port named %q in %s", name, sysDir)
}

// ListenSerial opens the virtio-serial port dev and answers a listener whose connections are
// the host's sessions on it; their beginnings and ends are logged to log.
func ListenSerial(dev string, log *logrus.Entry) (net.Listener, error) {
	f, err := os.OpenFile(dev, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return newSerialListener(f, f, func() (bool, error) { return hostConnected(f) }, log), nil
}

// hostConnected polls the port once: POLLHUP means no host program has the port's chardev
// open (the host end of the socket is not connected).
func hostConnected(f *os.File) (bool, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return false, err
	}
	var revents int16
	var perr error
	if err := rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLOUT}}
		for {
			_, perr = unix.Poll(fds, 0)
			if perr != unix.EINTR {
				break
			}
		}
		revents = fds[0].Revents
	}); err != nil {
		return false, err
	}
	if perr != nil {
		return false, perr
	}
	return revents&unix.POLLHUP == 0, nil
}

// The vsock peer the agent serves: the host, from a port only a privileged process binds.
const (
	// vsockMaxPrivilegedPort is the last of the vsock ports whose bind needs
	// CAP_NET_BIND_SERVICE in the initial user namespace (LAST_RESERVED_PORT in the kernel's
	// af_vsock.c); an unprivileged process gets a port above it, also when connect binds it.
	vsockMaxPrivilegedPort = 1023
	// refusalLogInterval is the least time between two log lines about refused vsock peers:
	// a peer can connect in a loop.
	refusalLogInterval = time.Second
)

// ListenVsock listens on a vsock port of the guest and hands out only the connections of a
// privileged process of the host: a peer that is not the host (VMADDR_CID_HOST), or that
// connects from a port above 1023, is closed at once and logged to log (see checkVsockPeer).
func ListenVsock(port uint32, log *logrus.Entry) (net.Listener, error) {
	l, err := vsock.Listen(port, nil)
	if err != nil {
		return nil, err
	}
	return newHostOnlyListener(l, unix.VMADDR_CID_HOST, log), nil
}

// checkVsockPeer answers why the peer address a is refused, or nil if it is the host (vsock
// CID host) on a privileged port: the host's shim binds one (vsockMaxPrivilegedPort).
func checkVsockPeer(a net.Addr, host uint32) error {
	va, ok := a.(*vsock.Addr)
	if !ok {
		return fmt.Errorf("peer %v (%T): not a vsock address", a, a)
	}
	if va.ContextID != host {
		return fmt.Errorf("peer %s: not the host (CID %d)", va, host)
	}
	if va.Port > vsockMaxPrivilegedPort {
		return fmt.Errorf("peer %s: port above %d, which a host process binds without privilege", va, vsockMaxPrivilegedPort)
	}
	return nil
}

// hostOnlyListener hands out the connections of a vsock listener whose peer passes
// checkVsockPeer and closes the others unread; a refused peer costs its connection only, and
// Accept waits for the next.
//
// Lock order: mu is a leaf.
type hostOnlyListener struct {
	net.Listener
	host     uint32 // the CID taken for the host: VMADDR_CID_HOST but in tests
	log      *logrus.Entry
	logEvery time.Duration

	mu       sync.Mutex
	lastLog  time.Time // guarded by mu: when a refusal was last logged
	unlogged int       // guarded by mu: refusals since, not logged
}

func newHostOnlyListener(l net.Listener, host uint32, log *logrus.Entry) *hostOnlyListener {
	return &hostOnlyListener{Listener: l, host: host, log: log, logEvery: refusalLogInterval}
}

// Accept answers the next connection from the host; its errors are the listener's.
func (l *hostOnlyListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		err = checkVsockPeer(c.RemoteAddr(), l.host)
		if err == nil {
			return c, nil
		}
		c.Close()
		l.refused(err)
	}
}

// refused logs a refusal, at most one a logEvery; a line counts the refusals before it that
// were not logged.
func (l *hostOnlyListener) refused(why error) {
	l.mu.Lock()
	now := time.Now()
	if !l.lastLog.IsZero() && now.Sub(l.lastLog) < l.logEvery {
		l.unlogged++
		l.mu.Unlock()
		return
	}
	n := l.unlogged
	l.lastLog, l.unlogged = now, 0
	l.mu.Unlock()
	e := l.log.WithError(why)
	if n > 0 {
		e = e.WithField("unlogged", n)
	}
	e.Warn("refused a vsock connection")
}

// serialListener turns one long-lived byte stream (a virtio-serial port) into a sequence of
// connections: one at a time, each from when the host is there until it goes away (end of
// file) or ttrpc closes it. The port itself stays open across them; a connection's Close
// only interrupts its reads and writes (a deadline), so a new host session gets a fresh
// connection on the same file.
//
// Lock order: serialConn.mu is a leaf.
type serialListener struct {
	r, w      *os.File
	connected func() (bool, error)
	log       *logrus.Entry
	free      chan struct{} // holds a token while no connection is handed out
	closed    chan struct{}
	closeOnce sync.Once

	// Owned by the connection holding the token (the token's hand-over orders the accesses):
	buf     []byte // what a read of the port fills
	pending []byte // read from the port, not handed to ttrpc yet
}

// ttrpc's framing, as far as the listener looks at it: a 10-byte header (length, stream id,
// type, flags; big-endian), then length bytes.
const (
	ttrpcHeaderLen   = 10
	ttrpcTypeRequest = 1
)

func newSerialListener(r, w *os.File, connected func() (bool, error), log *logrus.Entry) *serialListener {
	l := &serialListener{r: r, w: w, connected: connected, log: log, free: make(chan struct{}, 1), closed: make(chan struct{}),
		buf: make([]byte, readChunk)}
	l.free <- struct{}{}
	return l
}

// Accept waits until the previous connection is done and the host is connected.
func (l *serialListener) Accept() (net.Conn, error) {
	select {
	case <-l.free:
	case <-l.closed:
		return nil, net.ErrClosed
	}
	for {
		ok, err := l.connected()
		if err != nil {
			l.free <- struct{}{}
			return nil, fmt.Errorf("serial port: %w", err)
		}
		if ok {
			break
		}
		select {
		case <-time.After(hostPollInterval):
		case <-l.closed:
			l.free <- struct{}{}
			return nil, net.ErrClosed
		}
	}
	if err := setDeadline(l.r, l.w, time.Time{}); err != nil {
		l.free <- struct{}{}
		return nil, err
	}
	c := &serialConn{l: l, checked: time.Now()}
	l.log.Info("host connected")
	return c, nil
}

func setDeadline(r, w *os.File, t time.Time) error {
	if err := r.SetDeadline(t); err != nil {
		return fmt.Errorf("serial port: %w", err)
	}
	if w != r {
		if err := w.SetDeadline(t); err != nil {
			return fmt.Errorf("serial port: %w", err)
		}
	}
	return nil
}

// Close ends Accept; the port is closed once its connection is done.
func (l *serialListener) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		go func() {
			<-l.free
			l.r.Close()
			if l.w != l.r {
				l.w.Close()
			}
		}()
	})
	return nil
}

func (l *serialListener) Addr() net.Addr { return serialAddr(l.r.Name()) }

type serialAddr string

func (a serialAddr) Network() string { return "virtio-serial" }
func (a serialAddr) String() string  { return string(a) }

// serialConn is one host session on the port. Its reads and writes wait on the port with
// poll(2) (portIO) and probe the host between polls. Besides that, it follows ttrpc's
// framing of what the host sends: a request whose stream id does not grow is the first of a
// new host's session (a new ttrpc client starts again at 1), so the connection ends before it
// and leaves its bytes to the next one. That catches the reconnections the poll is too slow
// for, unless the previous host vanished in the middle of a message.
type serialConn struct {
	l        *serialListener
	mu       sync.Mutex
	closed   bool // guarded by mu
	inflight int  // guarded by mu: reads and writes under way
	released bool // guarded by mu: the listener's token was given back
	hostGone bool // guarded by mu: the host went away; what is pending is its leftovers

	// Used by the one reading goroutine (ttrpc's):
	need    int       // bytes of the current message still to hand out
	lastReq uint32    // the stream id of the last request
	ended   bool      // the next session has begun
	checked time.Time // when the host's presence was last probed
}

func (c *serialConn) enter() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return net.ErrClosed
	}
	c.inflight++
	return nil
}

func (c *serialConn) leave() {
	c.mu.Lock()
	c.inflight--
	c.releaseLocked()
	c.mu.Unlock()
}

// releaseLocked gives the port back to the listener once the connection is closed and no
// read or write of it is left on the file.
func (c *serialConn) releaseLocked() {
	if c.closed && c.inflight == 0 && !c.released {
		c.released = true
		if c.hostGone {
			c.l.pending = nil
		}
		c.l.free <- struct{}{}
	}
}

// markHostGone records that the host went away and reports whether this is the first to see
// it: a read's end of file and the poll's POLLHUP can both see one departure.
func (c *serialConn) markHostGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	first := !c.hostGone
	c.hostGone = true
	return first
}

// probeHost looks whether the host is still there and, if it left, closes the connection
// (its reads and writes end). It runs from Read and Write, between their own polls of the
// port, never while another goroutine waits on the port (see portIO).
func (c *serialConn) probeHost() (gone bool) {
	ok, err := c.l.connected()
	if err == nil && ok {
		return false
	}
	if c.markHostGone() {
		c.l.log.WithError(err).Info("host left (POLLHUP)")
	}
	c.Close()
	return true
}

// Read hands out what the host sent, up to the start of a new host's session; end of file
// is the host going away.
func (c *serialConn) Read(b []byte) (int, error) {
	if err := c.enter(); err != nil {
		return 0, err
	}
	defer c.leave()
	l := c.l
	for {
		if c.ended {
			return 0, io.EOF
		}
		if c.need == 0 && len(l.pending) >= ttrpcHeaderLen {
			h := l.pending[:ttrpcHeaderLen]
			if h[8] == ttrpcTypeRequest {
				stream := binary.BigEndian.Uint32(h[4:8])
				if stream <= c.lastReq {
					l.log.WithFields(logrus.Fields{"stream": stream, "last": c.lastReq}).Info("a new host session began")
					c.ended = true
					continue
				}
				c.lastReq = stream
			}
			c.need = ttrpcHeaderLen + int(binary.BigEndian.Uint32(h[0:4]))
		}
		if c.need > 0 && len(l.pending) > 0 {
			n := copy(b, l.pending[:min(len(l.pending), c.need)])
			l.pending = l.pending[n:]
			c.need -= n
			return n, nil
		}
		// The host is probed every hostPollInterval while Read waits: a read woken late would
		// otherwise carry on with the next host session as if it were this one.
		if time.Since(c.checked) >= hostPollInterval {
			c.checked = time.Now()
			if c.probeHost() {
				return 0, io.EOF
			}
		}
		n, ready, err := portIO(l.r, unix.POLLIN, unix.Read, l.buf)
		l.pending = append(l.pending, l.buf[:n]...)
		if err != nil {
			return 0, err
		}
		if ready && n == 0 {
			if c.markHostGone() {
				l.log.Info("host left (end of file)")
			}
			return 0, io.EOF
		}
	}
}

// portIO makes one read or write (op) of the port f, waiting at most hostPollInterval for it
// to be ready (events: POLLIN or POLLOUT), with poll(2) of its own rather than Go's poller.
// ready reports whether poll said the call could proceed (then n == 0 on a read is end of
// file); err is the connection's deadline (Close), the file's closing, or op's failure.
//
// Why not f.Read and f.Write, which wait in Go's poller: on virtio-serial that wait can last
// for ever with the data there. The poller is edge-triggered and the port's wake-up comes
// from the virtqueue's interrupt; but any poll of the port (the host probe's, say) moves a
// buffer the host has just filled from the virtqueue into the port before that interrupt is
// handled, and the handler, finding no new buffer (vring_interrupt: "no work"), wakes
// nobody. A reader parked in the poller then sleeps with a request in the port until the
// host sends something else, and the host waits for the answer: the shim's hang. The same
// goes for a writer waiting for the host to take buffers. A level-triggered poll with a
// timeout sees what is there whoever took it off the ring.
func portIO(f *os.File, events int16, op func(int, []byte) (int, error), b []byte) (n int, ready bool, err error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, false, err
	}
	var oerr error
	call := func(fd uintptr) bool {
		fds := []unix.PollFd{{Fd: int32(fd), Events: events}}
		k, perr := unix.Poll(fds, int(hostPollInterval/time.Millisecond))
		if perr != nil {
			if perr != unix.EINTR {
				oerr = perr
			}
			return true
		}
		if k == 0 || fds[0].Revents == 0 {
			return true
		}
		for {
			n, oerr = op(int(fd), b)
			if oerr != unix.EINTR {
				break
			}
		}
		if oerr == unix.EAGAIN {
			n, oerr = 0, nil
			return true
		}
		if n < 0 {
			n = 0
		}
		ready = true
		return true
	}
	if events == unix.POLLIN {
		err = rc.Read(call)
	} else {
		err = rc.Write(call)
	}
	if err != nil {
		return 0, false, err
	}
	if oerr != nil {
		return n, ready, &os.PathError{Op: "serial port", Path: f.Name(), Err: oerr}
	}
	return n, ready, nil
}

func (c *serialConn) Write(b []byte) (int, error) {
	if err := c.enter(); err != nil {
		return 0, err
	}
	defer c.leave()
	written := 0
	for len(b) > 0 {
		n, ready, err := portIO(c.l.w, unix.POLLOUT, unix.Write, b)
		written += n
		b = b[n:]
		if err != nil {
			return written, err
		}
		if !ready && c.probeHost() {
			return written, net.ErrClosed
		}
	}
	return written, nil
}

// Close interrupts the connection's reads and writes; the port stays open for the next.
func (c *serialConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	// Under mu: a read that ends now gives the token back only after the deadline is set,
	// so the next Accept's clearing of it comes after.
	err := setDeadline(c.l.r, c.l.w, time.Now())
	c.releaseLocked()
	return err
}

func (c *serialConn) LocalAddr() net.Addr  { return c.l.Addr() }
func (c *serialConn) RemoteAddr() net.Addr { return serialAddr("host") }

// The port's deadlines are the listener's (a closed connection's reads end at once);
// ttrpc sets none.
func (c *serialConn) SetDeadline(t time.Time) error      { return os.ErrNoDeadline }
func (c *serialConn) SetReadDeadline(t time.Time) error  { return os.ErrNoDeadline }
func (c *serialConn) SetWriteDeadline(t time.Time) error { return os.ErrNoDeadline }
