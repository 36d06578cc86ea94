package ctrdtest

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"
)

// Client is a Go client of the containerd, in its namespace by default, for what ctr cannot
// do (closing a process's stdin, say). It is closed at the end of the test.
func (c *Containerd) Client(t testing.TB) *client.Client {
	t.Helper()
	cl, err := client.New(c.Address(), client.WithDefaultNamespace(c.namespace), client.WithTimeout(10*time.Second))
	if err != nil {
		t.Fatalf("ctrdtest: connecting to containerd: %v", err)
	}
	t.Cleanup(func() {
		if err := cl.Close(); err != nil {
			t.Errorf("ctrdtest: closing the client: %v", err)
		}
	})
	return cl
}

// FIFODir is a directory for the fifos of a client's tasks (cio.WithFIFODir), inside the
// containerd's directory.
func (c *Containerd) FIFODir() string { return filepath.Join(c.dir, "fifo") }
