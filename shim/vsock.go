package shim

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/mdlayher/socket"
	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

// maxPrivilegedVsockPort is the last of the vsock ports whose bind needs CAP_NET_BIND_SERVICE
// in the initial user namespace (LAST_RESERVED_PORT in the kernel's af_vsock.c). The guest
// agent serves only the host's connections from such a port.
const maxPrivilegedVsockPort = 1023

// dialVsock connects to port of the guest cid from a privileged port of the host
// (bindPrivilegedVsock), which the guest agent requires of its peer; ctx bounds the connect.
func dialVsock(ctx context.Context, cid, port uint32) (net.Conn, error) {
	c, local, err := bindPrivilegedVsock()
	if err != nil {
		return nil, err
	}
	if _, err := c.Connect(ctx, &unix.SockaddrVM{CID: cid, Port: port}); err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock %d:%d from port %d: %w", cid, port, local, err)
	}
	sa, err := c.Getsockname()
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("vsock %d:%d: %w", cid, port, err)
	}
	vm, ok := sa.(*unix.SockaddrVM)
	if !ok {
		c.Close()
		return nil, fmt.Errorf("vsock %d:%d: local address %T", cid, port, sa)
	}
	return &vsockConn{Conn: c, local: &vsock.Addr{ContextID: vm.CID, Port: vm.Port},
		remote: &vsock.Addr{ContextID: cid, Port: port}}, nil
}

// bindPrivilegedVsock opens a vsock stream socket bound to the highest free port from
// maxPrivilegedVsockPort down to 1 and answers it with its port. Every connection to a
// guest agent holds one (the host's 1023 are shared by all its vsock users) until it
// closes, so ports in use are skipped. Binding one needs CAP_NET_BIND_SERVICE.
func bindPrivilegedVsock() (*socket.Conn, uint32, error) {
	c, err := socket.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0, "vsock", nil)
	if err != nil {
		return nil, 0, fmt.Errorf("vsock socket: %w", err)
	}
	for p := uint32(maxPrivilegedVsockPort); p >= 1; p-- {
		err := c.Bind(&unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: p})
		switch {
		case err == nil:
			return c, p, nil
		case errors.Is(err, unix.EADDRINUSE):
			continue
		case errors.Is(err, unix.EACCES):
			c.Close()
			return nil, 0, fmt.Errorf("binding vsock port %d: the shim needs CAP_NET_BIND_SERVICE (the guest agent serves only ports up to %d): %w",
				p, maxPrivilegedVsockPort, err)
		default:
			c.Close()
			return nil, 0, fmt.Errorf("binding vsock port %d: %w", p, err)
		}
	}
	c.Close()
	return nil, 0, fmt.Errorf("binding a vsock port: every port from 1 to %d is in use", maxPrivilegedVsockPort)
}

// vsockConn is a connected vsock socket as a net.Conn: socket.Conn has everything but the
// addresses.
type vsockConn struct {
	*socket.Conn
	local, remote *vsock.Addr
}

func (c *vsockConn) LocalAddr() net.Addr  { return c.local }
func (c *vsockConn) RemoteAddr() net.Addr { return c.remote }
