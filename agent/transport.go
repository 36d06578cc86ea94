package agent

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/binary"
	"errors"
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

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// DefaultVirtioPorts is where the kernel lists virtio-serial ports.
const DefaultVirtioPorts = "/sys/class/virtio-ports"

// hostPollInterval is how often a serial listener with no host looks whether one has
// connected: the port gives no event for it (while the host is away, poll answers POLLHUP at
// once). Once a host is there, nothing is polled on a timer: the port pump sleeps until the
// port or a connection has something for it.
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
// the host's sessions on it that begin with the host's hello with secret (see
// secretListener); their beginnings and ends are logged to log. The port is opened with
// open(2), not as an os.File: Go's netpoller would register it with its epoll, whose polls of
// the port would steal the pump's wake-ups (see serialListener).
func ListenSerial(dev string, secret []byte, log *logrus.Entry) (net.Listener, error) {
	if len(secret) != apiv1.SecretLen {
		return nil, fmt.Errorf("a secret of %d bytes, want %d", len(secret), apiv1.SecretLen)
	}
	fd, err := unix.Open(dev, unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dev, Err: err}
	}
	l := newSerialListener(serialPort{name: dev, r: fd, w: fd, close: func() { unix.Close(fd) }},
		func() (bool, error) { return hostConnected(fd) }, log)
	return newSecretListener(l, secret, log), nil
}

// hostConnected polls the port once: POLLHUP means no host program has the port's chardev
// open (the host end of the socket is not connected).
func hostConnected(fd int) (bool, error) {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLOUT}}
	for {
		_, err := unix.Poll(fds, 0)
		if err == nil {
			return fds[0].Revents&unix.POLLHUP == 0, nil
		}
		if err != unix.EINTR {
			return false, err
		}
	}
}

// The vsock peer the agent serves: the host, from a port only a privileged process binds.
const (
	// vsockMaxPrivilegedPort is the last of the vsock ports whose bind needs
	// CAP_NET_BIND_SERVICE in the initial user namespace (LAST_RESERVED_PORT in the kernel's
	// af_vsock.c); an unprivileged process gets a port above it, also when connect binds it.
	vsockMaxPrivilegedPort = 1023
	// refusalLogInterval is the least time between two log lines about refused connections:
	// a peer can connect in a loop.
	refusalLogInterval = time.Second
)

// ListenVsock listens on a vsock port of the guest and hands out only the connections of a
// privileged process of the host that begin with the host's hello with secret: a peer that
// is not the host (VMADDR_CID_HOST), or that connects from a port above 1023, is closed at
// once (see checkVsockPeer), and one without the secret once its hello is wrong or late (see
// secretListener); both are logged to log.
func ListenVsock(port uint32, secret []byte, log *logrus.Entry) (net.Listener, error) {
	if len(secret) != apiv1.SecretLen {
		return nil, fmt.Errorf("a secret of %d bytes, want %d", len(secret), apiv1.SecretLen)
	}
	l, err := vsock.Listen(port, nil)
	if err != nil {
		return nil, err
	}
	return newSecretListener(newHostOnlyListener(l, unix.VMADDR_CID_HOST, log), secret, log), nil
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
type hostOnlyListener struct {
	net.Listener
	host uint32 // the CID taken for the host: VMADDR_CID_HOST but in tests
	refusalLog
}

func newHostOnlyListener(l net.Listener, host uint32, log *logrus.Entry) *hostOnlyListener {
	return &hostOnlyListener{Listener: l, host: host,
		refusalLog: refusalLog{log: log, what: "refused a vsock connection", logEvery: refusalLogInterval}}
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

// refusalLog logs refused connections, at most one line a logEvery (a peer can connect in a
// loop), and counts them.
//
// Lock order: mu is a leaf.
type refusalLog struct {
	log      *logrus.Entry
	what     string // the line's message
	logEvery time.Duration

	mu       sync.Mutex
	lastLog  time.Time // guarded by mu: when a refusal was last logged
	unlogged int       // guarded by mu: refusals since, not logged
	total    int       // guarded by mu: refusals ever
}

// refused logs a refusal, at most one a logEvery; a line counts the refusals before it that
// were not logged, and all of them.
func (l *refusalLog) refused(why error) {
	l.mu.Lock()
	l.total++
	now := time.Now()
	if !l.lastLog.IsZero() && now.Sub(l.lastLog) < l.logEvery {
		l.unlogged++
		l.mu.Unlock()
		return
	}
	n, total := l.unlogged, l.total
	l.lastLog, l.unlogged = now, 0
	l.mu.Unlock()
	e := l.log.WithError(why).WithField("refused", total)
	if n > 0 {
		e = e.WithField("unlogged", n)
	}
	e.Warn(l.what)
}

// Bounds of a new connection's hello (see secretListener).
const (
	// helloWait bounds the wait for a new connection's hello: the host sends it as it
	// connects (over serial, it waits in the port for the guest).
	helloWait = 5 * time.Second
	// maxHelloChecks bounds the connections waiting for their hello at once; a connection
	// beyond is closed at once.
	maxHelloChecks = 8
)

// secretListener hands out the connections of its listener that begin with the host's hello
// (apiv1.Hello) with this boot's secret, read off them before ttrpc sees a byte. A connection
// whose first bytes are not that hello, that ends before them or does not send them within
// helloWait is closed, and logged (see refusalLog). Each waits for its hello in a goroutine
// of its own, at most maxHelloChecks at once, so that a silent peer does not hold up the host.
//
// It serves one host connection at a time: a connection that has proved the secret replaces
// the one being served, which is closed. Only the host has the secret, so a newer connection
// is the host's, that reconnected (a shim that redials after its Ping went unanswered), and
// the older one is dead to it even if the guest cannot tell (a vsock peer gone without a
// reset); refusing or holding the newer one would leave the host waiting on a dead one. Over
// serial the port gives one connection at a time anyway, and the hello, a message of ttrpc's
// shape with stream id 0, is what ends the previous session (see serialConn).
//
// Lock order: mu is a leaf.
type secretListener struct {
	inner     net.Listener
	hello     []byte        // the hello that proves the secret
	wait      time.Duration // helloWait but in tests
	checks    chan struct{} // holds a token for each connection waiting for its hello
	ready     chan net.Conn // connections that proved the secret, for Accept
	failed    chan struct{} // closed when the inner Accept failed, with err set
	err       error
	done      chan struct{} // closed by Close
	closeOnce sync.Once
	refusalLog

	mu      sync.Mutex
	current *hostConn // guarded by mu: the connection being served, or nil
}

func newSecretListener(inner net.Listener, secret []byte, log *logrus.Entry) *secretListener {
	l := &secretListener{inner: inner, hello: apiv1.Hello(secret), wait: helloWait,
		checks: make(chan struct{}, maxHelloChecks), ready: make(chan net.Conn),
		failed: make(chan struct{}), done: make(chan struct{}),
		refusalLog: refusalLog{log: log, what: "refused a host connection", logEvery: refusalLogInterval}}
	go l.acceptLoop()
	return l
}

// acceptLoop accepts the inner listener's connections and starts the check of each.
func (l *secretListener) acceptLoop() {
	for {
		c, err := l.inner.Accept()
		if err != nil {
			l.err = err
			close(l.failed)
			return
		}
		select {
		case l.checks <- struct{}{}:
			go l.check(c)
		default:
			c.Close()
			l.refused(fmt.Errorf("%d connections already wait for their hello", maxHelloChecks))
		}
	}
}

// check reads c's hello and hands c to Accept if it proves the secret, else closes it.
func (l *secretListener) check(c net.Conn) {
	defer func() { <-l.checks }()
	if err := l.readHello(c); err != nil {
		c.Close()
		l.refused(err)
		return
	}
	select {
	case l.ready <- c:
	case <-l.done:
		c.Close()
	}
}

// readHello reads c's first apiv1.HelloLen bytes within l.wait and answers why they are not
// l.hello, or nil. The secret is compared in constant time. The wait is ended by closing c:
// the serial port's connections have no deadlines.
func (l *secretListener) readHello(c net.Conn) error {
	timer := time.AfterFunc(l.wait, func() { c.Close() })
	got := make([]byte, len(l.hello))
	head := len(l.hello) - apiv1.SecretLen
	_, err := io.ReadFull(c, got[:head])
	if err == nil && !bytes.Equal(got[:head], l.hello[:head]) {
		timer.Stop()
		return errors.New("its first bytes are not a hello")
	}
	if err == nil {
		_, err = io.ReadFull(c, got[head:])
	}
	if !timer.Stop() {
		return fmt.Errorf("no hello within %v", l.wait)
	}
	if err != nil {
		return fmt.Errorf("it ended before its hello: %w", err)
	}
	if subtle.ConstantTimeCompare(got[head:], l.hello[head:]) != 1 {
		return errors.New("a hello with the wrong secret")
	}
	return nil
}

// Accept answers the next connection that proved the secret; the connection served until
// then is closed.
func (l *secretListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		h := &hostConn{Conn: c, l: l}
		l.mu.Lock()
		old := l.current
		l.current = h
		l.mu.Unlock()
		if old != nil {
			l.log.Info("a new host connection replaces the one served")
			old.Close()
		}
		return h, nil
	case <-l.failed:
		return nil, l.err
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close ends Accept and closes the inner listener; the connection served stays open.
func (l *secretListener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		close(l.done)
		err = l.inner.Close()
	})
	return err
}

func (l *secretListener) Addr() net.Addr { return l.inner.Addr() }

// hostConn is the connection a secretListener serves.
type hostConn struct {
	net.Conn
	l    *secretListener
	once sync.Once
}

// Close closes the connection, once; the listener serves none until the next.
func (c *hostConn) Close() error {
	err := net.ErrClosed
	c.once.Do(func() {
		c.l.mu.Lock()
		if c.l.current == c {
			c.l.current = nil
		}
		c.l.mu.Unlock()
		err = c.Conn.Close()
	})
	return err
}

// serialListener turns one long-lived byte stream (a virtio-serial port) into a sequence of
// connections: one at a time, each from when the host is there until it goes away (POLLHUP or
// end of file) or ttrpc closes it. The port itself stays open across them.
//
// While a connection is open, one goroutine, the port's pump (portPump), is the only one that
// waits on the port and reads and writes it; the connection's Read and Write only exchange
// bytes with it. That is what makes its waits need no timeout. A poll of a virtio-serial port
// takes a buffer the host just filled off the virtqueue; if that comes before the buffer's
// interrupt is handled, the handler finds no work and wakes nobody. Two pollers of the port
// (a reader waiting for input and a writer for room, or Go's netpoller, whose epoll polls
// every file registered with it when woken) can thus take each other's wake-up, and one
// parked can sleep with a request in the port (the shim hung waiting for its answer). So the
// port is never an os.File, and with one poller, level-triggered, whatever its own poll took
// off the ring it sees in that poll's answer, and what comes later wakes it: the data's
// interrupt, the host's coming and going (the port's control messages wake its waiters),
// room for output (the host took buffers), or its eventfd (a connection has output, or is
// closing).
//
// Lock order: serialConn.mu, then portPump.mu; both are leaves otherwise.
type serialListener struct {
	port      serialPort
	connected func() (bool, error)
	log       *logrus.Entry
	free      chan struct{} // holds a token while no connection is handed out
	closed    chan struct{}
	closeOnce sync.Once

	// Owned by the connection holding the token, and while it is open by its pump under the
	// pump's lock (the token's hand-over orders the accesses):
	pending []byte // read from the port, not handed to ttrpc yet
}

// serialPort is the port's descriptors (the same one for a real port; a pipe each way in
// tests), its name and how to close it.
type serialPort struct {
	name  string
	r, w  int
	close func()
}

// ttrpc's framing, as far as the listener looks at it: a 10-byte header (length, stream id,
// type, flags; big-endian), then length bytes.
const (
	ttrpcHeaderLen   = 10
	ttrpcTypeRequest = 1
)

func newSerialListener(port serialPort, connected func() (bool, error), log *logrus.Entry) *serialListener {
	l := &serialListener{port: port, connected: connected, log: log, free: make(chan struct{}, 1), closed: make(chan struct{})}
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
	p, err := startPump(l)
	if err != nil {
		l.free <- struct{}{}
		return nil, fmt.Errorf("serial port: %w", err)
	}
	l.log.Info("host connected")
	return &serialConn{l: l, p: p}, nil
}

// Close ends Accept; the port is closed once its connection is done.
func (l *serialListener) Close() error {
	l.closeOnce.Do(func() {
		close(l.closed)
		go func() {
			<-l.free
			l.port.close()
		}()
	})
	return nil
}

func (l *serialListener) Addr() net.Addr { return serialAddr(l.port.name) }

type serialAddr string

func (a serialAddr) Network() string { return "virtio-serial" }
func (a serialAddr) String() string  { return string(a) }

// Bounds of what the pump holds for a connection.
const (
	// pumpReadChunk is one read of the port.
	pumpReadChunk = 64 << 10
	// pumpMaxPending is how much read input the pump holds before it stops reading: ttrpc
	// reads it as it comes, so only a stalled reader reaches it.
	pumpMaxPending = 4 << 20
)

// portPump does every wait, read and write of the port for one connection, in its own
// goroutine (see serialListener). Read input goes to the listener's pending bytes; output
// comes from out. It stops when the host goes away (POLLHUP, or end of file), when an I/O
// call fails, or when the connection closes it.
type portPump struct {
	l        *serialListener
	rfd, wfd int // the port's descriptors (the same one for a real port)
	wake     int // eventfd: a connection has output, or wants the pump stopped
	done     chan struct{}

	mu         sync.Mutex
	cond       *sync.Cond // signalled when input comes, output leaves or the pump stops
	out        []byte     // guarded by mu: output not written yet
	queued     uint64     // guarded by mu: bytes ever queued for output
	written    uint64     // guarded by mu: bytes ever written
	stopping   bool       // guarded by mu: the connection asked the pump to stop
	hostGone   bool       // guarded by mu: the host went away
	err        error      // guarded by mu: why the pump stopped, if an I/O call failed
	stopped    bool       // guarded by mu: the pump goroutine is done with the port
	wakeClosed bool       // guarded by mu: stop closed the eventfd
}

// startPump starts the pump of a new connection of l.
func startPump(l *serialListener) (*portPump, error) {
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	p := &portPump{l: l, rfd: l.port.r, wfd: l.port.w, wake: wake, done: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	go p.run()
	return p, nil
}

// kickLocked wakes the pump's poll. Called with mu held, which keeps the eventfd open.
func (p *portPump) kickLocked() {
	if p.wakeClosed {
		return
	}
	one := [8]byte{1}
	_, _ = unix.Write(p.wake, one[:])
}

// stop asks the pump to stop, waits until it no longer touches the port, and closes its
// eventfd. Called once, by the connection's Close.
func (p *portPump) stop() {
	p.mu.Lock()
	p.stopping = true
	p.kickLocked()
	p.mu.Unlock()
	<-p.done
	p.mu.Lock()
	p.wakeClosed = true
	unix.Close(p.wake)
	p.mu.Unlock()
}

// run is the pump. When it stops it gives the port back to the listener, without what a
// departed host left unread, but from a hello on: that is the next host's, come before the
// departure was seen (the guest can read a new host's bytes before it learns that the old one
// left). The next Accept may start the next connection's pump at once.
func (p *portPump) run() {
	defer close(p.done)
	buf := make([]byte, pumpReadChunk)
	for {
		p.mu.Lock()
		if p.stopping || p.hostGone || p.err != nil {
			p.stopped = true
			if p.hostGone {
				if i := bytes.Index(p.l.pending, helloHeader); i >= 0 {
					p.l.pending = p.l.pending[i:]
				} else {
					p.l.pending = nil
				}
			}
			p.cond.Broadcast()
			p.mu.Unlock()
			p.l.free <- struct{}{}
			return
		}
		var rev, wev int16
		if len(p.l.pending) < pumpMaxPending {
			rev = unix.POLLIN
		}
		if len(p.out) > 0 {
			wev = unix.POLLOUT
		}
		p.mu.Unlock()

		fds := []unix.PollFd{{Fd: int32(p.wake), Events: unix.POLLIN}, {Fd: int32(p.rfd), Events: rev}}
		wi := 1
		if p.wfd == p.rfd {
			fds[1].Events |= wev
		} else {
			fds = append(fds, unix.PollFd{Fd: int32(p.wfd), Events: wev})
			wi = 2
		}
		if _, err := unix.Poll(fds, -1); err != nil {
			if err != unix.EINTR {
				p.fail(fmt.Errorf("poll: %w", err))
			}
			continue
		}
		if fds[0].Revents&unix.POLLIN != 0 {
			var b [8]byte
			_, _ = unix.Read(p.wake, b[:])
		}
		r, w := fds[1].Revents, fds[wi].Revents
		switch {
		case r&unix.POLLNVAL != 0 || w&unix.POLLNVAL != 0:
			p.fail(fmt.Errorf("serial port %s: descriptor closed", p.l.port.name))
			continue
		case r&unix.POLLIN != 0:
			p.read(buf)
		case r&(unix.POLLHUP|unix.POLLERR) != 0:
			p.gone("host left (POLLHUP)")
			continue
		}
		switch {
		case w&unix.POLLOUT != 0:
			p.write()
		case wi != 1 && w&(unix.POLLHUP|unix.POLLERR) != 0:
			// A separate output (tests' pipes) whose reader is gone.
			p.gone("host left (its end of the output closed)")
		}
	}
}

func (p *portPump) fail(err error) {
	p.mu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.mu.Unlock()
}

// gone records that the host went away; the pump stops.
func (p *portPump) gone(why string) {
	p.mu.Lock()
	p.hostGone = true
	p.mu.Unlock()
	p.l.log.Info(why)
}

func (p *portPump) read(buf []byte) {
	n, err := unix.Read(p.rfd, buf)
	switch {
	case err == unix.EAGAIN || err == unix.EINTR:
	case err != nil:
		p.fail(&os.PathError{Op: "read", Path: p.l.port.name, Err: err})
	case n == 0:
		p.gone("host left (end of file)")
	default:
		p.mu.Lock()
		p.l.pending = append(p.l.pending, buf[:n]...)
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

func (p *portPump) write() {
	p.mu.Lock()
	out := p.out
	p.mu.Unlock()
	n, err := unix.Write(p.wfd, out)
	switch {
	case err == unix.EAGAIN || err == unix.EINTR:
	case err != nil:
		p.fail(&os.PathError{Op: "write", Path: p.l.port.name, Err: err})
	case n > 0:
		p.mu.Lock()
		// Only the pump takes from out; Write appends after it.
		p.out = p.out[n:]
		p.written += uint64(n)
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

// serialConn is one host session on the port, served by its pump. Besides that, it follows
// ttrpc's framing of what the host sends. A session begins with the host's hello
// (apiv1.Hello: a message of ttrpc's shape with stream id 0): what comes before its header is
// dropped, so that the bytes a refused host left (see secretListener) do not hide the next
// host's hello. After it, a request whose stream id does not grow is the first of a new
// host's session (its hello, or a ttrpc client's request from 1 again), so the connection
// ends before it and leaves its bytes to the next one. That catches the reconnections the
// port does not report (a departure and a return before the pump looks), unless the previous
// host vanished in the middle of a message.
type serialConn struct {
	l *serialListener
	p *portPump

	mu     sync.Mutex
	closed bool // guarded by mu

	// Used by the one reading goroutine (ttrpc's):
	need    int    // bytes of the current message still to hand out
	begun   bool   // the hello's header was found
	dropped int    // bytes dropped before it
	lastReq uint32 // the stream id of the last request
	ended   bool   // the next session has begun
}

// Read hands out what the host sent, up to the start of a new host's session; end of file
// is the host going away or the connection closing.
func (c *serialConn) Read(b []byte) (int, error) {
	p, l := c.p, c.l
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		// Once the pump stopped, the listener's pending bytes are the next connection's.
		switch {
		case c.ended:
			return 0, io.EOF
		case p.err != nil:
			return 0, p.err
		case p.stopped || p.hostGone:
			return 0, io.EOF
		}
		if !c.begun && !c.findHello() {
			p.cond.Wait()
			continue
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
			full := len(l.pending) >= pumpMaxPending
			n := copy(b, l.pending[:min(len(l.pending), c.need)])
			l.pending = l.pending[n:]
			c.need -= n
			if full {
				p.kickLocked() // the pump stopped reading: there is room again
			}
			return n, nil
		}
		p.cond.Wait()
	}
}

// helloHeader is the header of every host's hello: its secret's length, stream id 0, a
// request.
var helloHeader = apiv1.Hello(make([]byte, apiv1.SecretLen))[:ttrpcHeaderLen]

// findHello drops the pending bytes before the hello's header and reports whether the
// header is there; the bytes that may begin one are kept. Called with the pump's lock held,
// before the session's first message.
func (c *serialConn) findHello() bool {
	p, l := c.p, c.l
	full := len(l.pending) >= pumpMaxPending
	i := bytes.Index(l.pending, helloHeader)
	if i < 0 {
		i = max(0, len(l.pending)-(ttrpcHeaderLen-1))
	}
	c.dropped += i
	l.pending = l.pending[i:]
	if full {
		p.kickLocked() // the pump stopped reading: there is room again
	}
	if !bytes.HasPrefix(l.pending, helloHeader) {
		return false
	}
	c.begun = true
	c.need = len(helloHeader) + apiv1.SecretLen // the hello, its first message
	if c.dropped > 0 {
		l.log.WithField("bytes", c.dropped).Info("dropped what came before the host's hello")
	}
	return true
}

// Write queues b for the pump and waits until it is written, the host left or the
// connection closed.
func (c *serialConn) Write(b []byte) (int, error) {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stopped || p.stopping || p.hostGone {
		return 0, net.ErrClosed
	}
	start := p.queued
	p.out = append(p.out, b...)
	p.queued += uint64(len(b))
	end := p.queued
	p.kickLocked()
	for p.written < end {
		var err error
		switch {
		case p.err != nil:
			err = p.err
		case p.stopped || p.hostGone:
			err = net.ErrClosed
		default:
			p.cond.Wait()
			continue
		}
		n := 0
		if p.written > start {
			n = int(p.written - start)
		}
		return n, err
	}
	return len(b), nil
}

// Close stops the connection's pump, which gives the port back to the listener (its reads
// and writes end); the port stays open for the next connection.
func (c *serialConn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	c.p.stop()
	return nil
}

func (c *serialConn) LocalAddr() net.Addr  { return c.l.Addr() }
func (c *serialConn) RemoteAddr() net.Addr { return serialAddr("host") }

// The port's deadlines are not used: the pump's eventfd interrupts its wait. ttrpc sets none.
func (c *serialConn) SetDeadline(t time.Time) error      { return os.ErrNoDeadline }
func (c *serialConn) SetReadDeadline(t time.Time) error  { return os.ErrNoDeadline }
func (c *serialConn) SetWriteDeadline(t time.Time) error { return os.ErrNoDeadline }

// connTracker is a listener that counts its open connections, so that the agent can wait,
// after Shutdown, for the host to hang up (see stopServing).
type connTracker struct {
	net.Listener
	mu      sync.Mutex
	open    int           // guarded by mu
	changed chan struct{} // a connection closed; one pending signal at most
}

func trackConns(l net.Listener) *connTracker {
	return &connTracker{Listener: l, changed: make(chan struct{}, 1)}
}

// Accept counts the connection it returns until it is closed.
func (t *connTracker) Accept() (net.Conn, error) {
	c, err := t.Listener.Accept()
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.open++
	t.mu.Unlock()
	return &trackedConn{Conn: c, t: t}, nil
}

// waitClosed reports whether every connection accepted so far was closed before ctx ended.
func (t *connTracker) waitClosed(ctx context.Context) bool {
	for {
		t.mu.Lock()
		open := t.open
		t.mu.Unlock()
		if open == 0 {
			return true
		}
		select {
		case <-t.changed:
		case <-ctx.Done():
			return false
		}
	}
}

type trackedConn struct {
	net.Conn
	t    *connTracker
	once sync.Once
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		c.t.mu.Lock()
		c.t.open--
		c.t.mu.Unlock()
		select {
		case c.t.changed <- struct{}{}:
		default:
		}
	})
	return err
}
