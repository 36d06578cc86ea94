package ctrd

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/containerd/containerd/v2/client"
)

// Client is a Go client of the containerd, in its namespace by default, for what ctr cannot
// do (closing a process's stdin, say). The caller closes it.
func (c *Containerd) Client() (*client.Client, error) {
	cl, err := client.New(c.Address(), client.WithDefaultNamespace(c.namespace), client.WithTimeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("connecting to containerd: %w", err)
	}
	return cl, nil
}

// FIFODir is a directory for the fifos of a client's tasks (cio.WithFIFODir), inside the
// containerd's directory.
func (c *Containerd) FIFODir() string { return filepath.Join(c.dir, "fifo") }
