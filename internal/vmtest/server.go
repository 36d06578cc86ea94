package vmtest

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
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
	// Not t.TempDir: a socket path must fit in sun_path (108 bytes), and
	// test names can be long.
	dir, err := os.MkdirTemp("", "kvfs-vhost-")
	if err != nil {
		t.Fatalf("vmtest: %v", err)
	}
	socket = filepath.Join(dir, "vhost-user-fs.sock")

	var out lockedBuffer
	cmd := exec.Command(binary, append([]string{"--socket-path=" + socket}, args...)...)
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
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
			return socket, stop
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

// lockedBuffer is a bytes.Buffer safe for concurrent Write and String.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer // guarded by mu
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
