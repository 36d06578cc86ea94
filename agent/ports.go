package agent

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/containerd/errdefs"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Port-forward's connections: the host's relay (shim/portforward.go) has the agent connect to a
// TCP port of the guest's localhost (OpenPort) and carries a client's bytes through ReadPort,
// WritePort and ClosePort, shaped as the stdio calls are. The agent's network namespace is the
// pod's: the containers share the VM's (the shim drops their spec's network namespace), so a
// server listening on 127.0.0.1 in a container is reached as under runc, where containerd's
// CRI dials localhost in the pod's namespace.
//
// What the host can make the agent hold is bounded: at most apiv1.MaxPortStreams connections
// open at once, a read of at most MaxRead bytes, a write of at most apiv1.MaxPortWrite bytes
// that waits at most apiv1.PortWriteWait, a dial of at most apiv1.PortDialTimeout. A
// connection lives until ClosePort or Shutdown; the host closes each when its client's
// connection ends, and a host that goes away without closing them (a shim that died ends
// its pod) leaves them to the guest's power-off.

// portStreams are the open port connections, by id.
type portStreams struct {
	mu   sync.Mutex
	next uint64                 // guarded by mu: the last id given
	open map[uint64]*portStream // guarded by mu
	// reserved counts the slots taken by OpenPort calls still dialling; guarded by mu.
	reserved int
	closed   bool // guarded by mu: Shutdown closed them all; no more open
}

// portStream is one connection. readMu and writeMu serialise the host's reads and writes of
// it (the relay makes one of each at a time; a second waits); they are leaves, held across
// the connection's I/O, never with portStreams.mu.
type portStream struct {
	id   uint64
	port uint32
	conn *net.TCPConn

	readMu  sync.Mutex
	writeMu sync.Mutex
	shut    bool // guarded by writeMu: the write side is shut (ClosePort write_only)
}

func newPortStreams() *portStreams { return &portStreams{open: make(map[uint64]*portStream)} }

// reserve takes a slot for a connection being opened; release gives it back.
func (ps *portStreams) reserve() error {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	switch {
	case ps.closed:
		return errShuttingDown
	case len(ps.open)+ps.reserved >= apiv1.MaxPortStreams:
		return errf(errdefs.ErrResourceExhausted, "%d port connections are open, the most a pod may have", apiv1.MaxPortStreams)
	}
	ps.reserved++
	return nil
}

func (ps *portStreams) release() {
	ps.mu.Lock()
	ps.reserved--
	ps.mu.Unlock()
}

// add turns a reserved slot into the open connection conn and answers its id; after
// Shutdown it closes conn instead.
func (ps *portStreams) add(port uint32, conn *net.TCPConn) (uint64, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.reserved--
	if ps.closed {
		conn.Close()
		return 0, errShuttingDown
	}
	ps.next++
	ps.open[ps.next] = &portStream{id: ps.next, port: port, conn: conn}
	return ps.next, nil
}

// get finds an open connection.
func (ps *portStreams) get(id uint64) (*portStream, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	st, ok := ps.open[id]
	if !ok {
		return nil, errf(errdefs.ErrNotFound, "port connection %d is not open", id)
	}
	return st, nil
}

// remove forgets an open connection and answers it.
func (ps *portStreams) remove(id uint64) (*portStream, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	st, ok := ps.open[id]
	if !ok {
		return nil, errf(errdefs.ErrNotFound, "port connection %d is not open", id)
	}
	delete(ps.open, id)
	return st, nil
}

// closeAll closes every connection, and refuses those to come; for Shutdown.
func (ps *portStreams) closeAll() {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.closed = true
	for id, st := range ps.open {
		st.conn.Close()
		delete(ps.open, id)
	}
}

// OpenPort connects to the port on 127.0.0.1, else on [::1], within apiv1.PortDialTimeout.
func (s *Service) OpenPort(ctx context.Context, req *apiv1.OpenPortRequest) (*apiv1.OpenPortResponse, error) {
	if req.Port == 0 || req.Port > 65535 {
		return nil, errf(errdefs.ErrInvalidArgument, "port %d is not 1 to 65535", req.Port)
	}
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	if err := s.ports.reserve(); err != nil {
		return nil, err
	}
	conn, err := dialLoopback(ctx, req.Port)
	if err != nil {
		s.ports.release()
		return nil, err
	}
	id, err := s.ports.add(req.Port, conn)
	if err != nil {
		return nil, err
	}
	return &apiv1.OpenPortResponse{Id: id}, nil
}

// dialLoopback dials tcp4 127.0.0.1:port, then tcp6 [::1]:port, one after the other as
// containerd does for a runc pod (a server may listen on one family only), both within
// apiv1.PortDialTimeout.
func dialLoopback(ctx context.Context, port uint32) (*net.TCPConn, error) {
	ctx, cancel := context.WithTimeout(ctx, apiv1.PortDialTimeout)
	defer cancel()
	var d net.Dialer
	p := strconv.Itoa(int(port))
	var errs []error
	for _, a := range []struct{ network, addr string }{{"tcp4", "127.0.0.1"}, {"tcp6", "::1"}} {
		c, err := d.DialContext(ctx, a.network, net.JoinHostPort(a.addr, p))
		if err == nil {
			return c.(*net.TCPConn), nil
		}
		errs = append(errs, err)
	}
	return nil, errf(errdefs.ErrUnavailable, "nothing answers on port %d of the guest's localhost: %v", port, errors.Join(errs...))
}

// ReadPort answers what the connection has, up to max bytes, waiting for some; eof once the
// guest's side has shut its write side.
func (s *Service) ReadPort(ctx context.Context, req *apiv1.ReadPortRequest) (*apiv1.ReadPortResponse, error) {
	if err := checkMax(req.Max); err != nil {
		return nil, err
	}
	st, err := s.ports.get(req.Id)
	if err != nil {
		return nil, err
	}
	st.readMu.Lock()
	defer st.readMu.Unlock()
	buf := make([]byte, req.Max)
	n, err := readCtx(ctx, st.conn, buf)
	switch {
	case err == nil:
		return &apiv1.ReadPortResponse{Data: buf[:n]}, nil
	case errors.Is(err, io.EOF):
		return &apiv1.ReadPortResponse{Data: buf[:n], Eof: true}, nil
	}
	return nil, st.ioError("reading", err)
}

// readCtx reads from conn until ctx ends (the host went away: the ttrpc server ends its
// requests' contexts with their connection).
func readCtx(ctx context.Context, conn *net.TCPConn, buf []byte) (int, error) {
	if err := conn.SetReadDeadline(time.Time{}); err != nil {
		return 0, err
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = conn.SetReadDeadline(time.Unix(1, 0))
		close(fired)
	})
	n, err := conn.Read(buf)
	if !stop() {
		// The deadline is set: the next read clears it, once the function is done with it.
		<-fired
		if err != nil {
			return n, ctx.Err()
		}
	}
	return n, err
}

// ioError is a failed read or write of st at the API edge: NotFound if ClosePort closed it
// meanwhile, a context's error as it is (the edge gives it its code), Aborted otherwise (the
// guest's side reset it).
func (st *portStream) ioError(what string, err error) error {
	switch {
	case errors.Is(err, net.ErrClosed):
		return errf(errdefs.ErrNotFound, "port connection %d was closed while %s", st.id, what)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	return errf(errdefs.ErrAborted, "%s port connection %d (port %d): %v", what, st.id, st.port, err)
}

// WritePort writes data, waiting at most apiv1.PortWriteWait, and answers how much was taken.
func (s *Service) WritePort(ctx context.Context, req *apiv1.WritePortRequest) (*apiv1.WritePortResponse, error) {
	if len(req.Data) > apiv1.MaxPortWrite {
		return nil, errf(errdefs.ErrInvalidArgument, "%d bytes to write, more than %d", len(req.Data), apiv1.MaxPortWrite)
	}
	st, err := s.ports.get(req.Id)
	if err != nil {
		return nil, err
	}
	st.writeMu.Lock()
	defer st.writeMu.Unlock()
	if st.shut {
		return nil, errf(errdefs.ErrFailedPrecondition, "the write side of port connection %d is shut", st.id)
	}
	if err := st.conn.SetWriteDeadline(time.Now().Add(apiv1.PortWriteWait)); err != nil {
		return nil, st.ioError("writing", err)
	}
	n, err := st.conn.Write(req.Data)
	var ne net.Error
	if err != nil && !(errors.As(err, &ne) && ne.Timeout()) {
		return nil, st.ioError("writing", err)
	}
	return &apiv1.WritePortResponse{Written: uint32(n)}, nil
}

// ClosePort closes the connection, or shuts its write side.
func (s *Service) ClosePort(ctx context.Context, req *apiv1.ClosePortRequest) (*apiv1.ClosePortResponse, error) {
	if req.WriteOnly {
		st, err := s.ports.get(req.Id)
		if err != nil {
			return nil, err
		}
		st.writeMu.Lock()
		defer st.writeMu.Unlock()
		if !st.shut {
			st.shut = true
			if err := st.conn.CloseWrite(); err != nil {
				return nil, st.ioError("shutting the write side of", err)
			}
		}
		return &apiv1.ClosePortResponse{}, nil
	}
	st, err := s.ports.remove(req.Id)
	if err != nil {
		return nil, err
	}
	if err := st.conn.Close(); err != nil {
		return nil, errf(errdefs.ErrInternal, "closing port connection %d: %v", st.id, err)
	}
	return &apiv1.ClosePortResponse{}, nil
}
