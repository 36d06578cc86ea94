package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"

	control "github.com/kvfs/kvfs/api/control/v1"
)

// ControlServer serves the control API of a sandbox on a unix socket. The socket is mode 0600
// and, since a mode can be changed or a descriptor passed on, each connection's peer is also
// checked (SO_PEERCRED): only root and the server's own effective uid are served; any other
// connection is closed before a request is read.
type ControlServer struct {
	path string
	l    *net.UnixListener
	srv  *ttrpc.Server
}

// NewControlServer creates the socket at path (its directory made 0700 if missing; a stale
// socket there is replaced, anything else is an error) and the server of sb's control API on
// it (NewControlService, its StopSandbox calling stop). Serve serves it; Close stops it and
// removes the socket.
func NewControlServer(sb *Sandbox, path string, stop StopFunc) (*ControlServer, error) {
	if path == "" {
		return nil, errors.New("control socket: no path")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	srv, err := ttrpc.NewServer(
		ttrpc.WithServerHandshaker(ttrpc.UnixCredentialsFunc(CheckPeer)),
		ttrpc.WithUnaryServerInterceptor(ErrorInterceptor),
	)
	if err != nil {
		return nil, err
	}
	control.RegisterControlService(srv, NewControlService(sb, stop))
	l, err := listen(path)
	if err != nil {
		srv.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	return &ControlServer{path: path, l: l, srv: srv}, nil
}

// Path is the socket's path.
func (c *ControlServer) Path() string { return c.path }

// Serve serves connections until Close; it then returns nil.
func (c *ControlServer) Serve(ctx context.Context) error {
	err := c.srv.Serve(ctx, c.l)
	if errors.Is(err, ttrpc.ErrServerClosed) {
		return nil
	}
	return err
}

// Close stops serving, closes the connections and removes the socket. Serve need not have
// been called.
func (c *ControlServer) Close() error {
	err := c.srv.Close()
	if lerr := c.l.Close(); lerr != nil && !errors.Is(lerr, net.ErrClosed) {
		err = errors.Join(err, lerr)
	}
	if rerr := os.Remove(c.path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		err = errors.Join(err, rerr)
	}
	return err
}

// CheckPeer accepts a control connection from root or from the process's own effective uid.
func CheckPeer(cred *unix.Ucred) error {
	return checkPeer(cred, os.Geteuid())
}

func checkPeer(cred *unix.Ucred, self int) error {
	if cred.Uid == 0 || int64(cred.Uid) == int64(self) {
		return nil
	}
	return fmt.Errorf("peer pid %d uid %d refused: only root or uid %d may use the control socket: %w",
		cred.Pid, cred.Uid, self, unix.EPERM)
}
