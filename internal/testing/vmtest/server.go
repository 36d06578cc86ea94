package vmtest

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// serverStartTimeout bounds the wait for the server's socket.
const serverStartTimeout = 15 * time.Second

// StartServer starts a virtiofsd-compatible server as
//
//	binary --socket-path=SOCKET args...
//
// on a fresh socket path, waits until the socket exists and returns it. stop
// ends the server (SIGTERM, then SIGKILL after a grace period) and removes
// the socket's directory; it is also registered with t.Cleanup, and calling
// it twice is fine. The server's output is logged if the test has failed by
// the time stop runs.
//
// The C virtiofsd accepts a single connection and exits when QEMU
// disconnects, so start one server per boot.
func StartServer(t testing.TB, binary string, args ...string) (socket string, stop func()) {
	t.Helper()
	dir, socket := socketDir(t)
	return socket, start(t, binary, append([]string{"--socket-path=" + socket}, args...), dir, socket, nil)
}

// StartServerWithListener starts a server the way Kata does: it creates the listening socket
// itself and passes it as fd 3, so args must say --fd=3. It returns like StartServer.
func StartServerWithListener(t testing.TB, binary string, args ...string) (socket string, stop func()) {
	t.Helper()
	dir, socket := socketDir(t)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: socket, Net: "unix"})
	if err != nil {
		os.RemoveAll(dir)
		t.Fatalf("vmtest: %v", err)
	}
	l.SetUnlinkOnClose(false)
	f, err := l.File()
	l.Close()
	if err != nil {
		os.RemoveAll(dir)
		t.Fatalf("vmtest: %v", err)
	}
	defer f.Close() // the child has its own copy once started
	return socket, start(t, binary, args, dir, socket, f)
}

// socketDir makes a directory for a socket. Not t.TempDir: a socket path must fit in sun_path
// (108 bytes), and test names can be long.
func socketDir(t testing.TB) (dir, socket string) {
	dir, err := os.MkdirTemp("", "kvfs-vhost-")
	if err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	return dir, filepath.Join(dir, "vhost-user-fs.sock")
}

// start runs the server with listener (if any) as fd 3 and waits for its socket.
func start(t testing.TB, binary string, args []string, dir, socket string, listener *os.File) (stop func()) {
	t.Helper()
	var out syncbuf.Buffer
	cmd := exec.Command(binary, args...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if listener != nil {
		cmd.ExtraFiles = []*os.File{listener}
	}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		t.Fatalf("vmtest: starting server: %v", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()

	stop = sync.OnceFunc(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(5 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
			}
		}
		os.RemoveAll(dir)
		if t.Failed() {
			t.Logf("vmtest: server %v exited (%v); its output:\n%s", cmd.Args, waitErr, out.String())
		}
	})
	t.Cleanup(stop)

	deadline := time.Now().Add(serverStartTimeout)
	for {
		if fi, err := os.Stat(socket); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return stop
		}
		select {
		case <-exited:
			t.Fatalf("vmtest: server %v exited before creating its socket (%v):\n%s", cmd.Args, waitErr, out.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("vmtest: server %v created no socket within %v:\n%s", cmd.Args, serverStartTimeout, out.String())
		}
	}
}
