package shim

import (
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/threadcred"
)

// TestBindPrivilegedVsock binds for real (nothing is sent): the highest free port up to 1023,
// the next one below while the first is held, the first again once it is free; an
// unprivileged user gets an error that says what the shim lacks.
func TestBindPrivilegedVsock(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("binding a privileged vsock port needs root")
	}
	if fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); errors.Is(err, unix.EAFNOSUPPORT) {
		t.Skip("the kernel has no vsock")
	} else if err == nil {
		unix.Close(fd)
	}
	bound := func() uint32 {
		t.Helper()
		c, port, err := bindPrivilegedVsock()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		sa, err := c.Getsockname()
		if err != nil {
			t.Fatal(err)
		}
		if got := sa.(*unix.SockaddrVM).Port; got != port || port < 1 || port > maxPrivilegedVsockPort {
			t.Fatalf("answered port %d, bound %d; want one and the same from 1 to %d", port, got, maxPrivilegedVsockPort)
		}
		return port
	}
	c1, p1, err := bindPrivilegedVsock()
	if err != nil {
		t.Fatal(err)
	}
	p2 := bound()
	if p2 >= p1 {
		t.Errorf("with port %d held, bound %d; want one below", p1, p2)
	}
	c1.Close()
	if p3 := bound(); p3 <= p2 {
		t.Errorf("with port %d free again, bound %d; want one above %d", p1, p3, p2)
	}

	var uerr error
	if err := threadcred.Run(threadcred.Nobody, threadcred.Nobody, func() {
		c, _, err := bindPrivilegedVsock()
		if err == nil {
			c.Close()
		}
		uerr = err
	}); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(uerr, unix.EACCES) || !strings.Contains(uerr.Error(), "the shim needs CAP_NET_BIND_SERVICE") {
		t.Errorf("an unprivileged user's bind: %v; want EACCES saying the shim needs CAP_NET_BIND_SERVICE", uerr)
	}
}
