package ctrdtest

import (
	"context"
	"testing"
	"time"

	"github.com/containerd/containerd/v2/client"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
)

// Binaries returns the installed containerd binaries (ctrd.Binaries). When they are missing
// or of another version it fails the test, saying which command installs them.
func Binaries(t testing.TB) ctrd.Bins {
	t.Helper()
	b, err := ctrd.Binaries("")
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return b
}

// Containerd is a test's private containerd: a ctrd.Containerd whose methods that can fail
// take the test, and fail it.
type Containerd struct{ *ctrd.Containerd }

// Start starts a containerd for the test and returns once it answers; its notes
// (opts.Logf, unless set) go to the test's log. The test's cleanup removes what the test left
// (tasks are killed and deleted, containers removed, with a note in the log), stops
// containerd, and then fails the test for any process of it that outlived that (a shim, a VM,
// a container's process: they are killed), any mount left under its directory or
// Options.LeakDirs (unmounted), and any cgroup or runc state left in its namespace; and removes
// the directory. containerd's log is printed when the test failed.
func Start(t testing.TB, opts ctrd.Options) *Containerd {
	t.Helper()
	if opts.Logf == nil {
		opts.Logf = func(format string, args ...any) { t.Logf("ctrdtest: "+format, args...) }
	}
	c, err := ctrd.Start(opts)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	t.Cleanup(func() {
		leaks, err := c.Stop()
		if err != nil {
			t.Errorf("ctrdtest: %v", err)
		}
		for _, l := range leaks {
			t.Errorf("ctrdtest: leak after the test: %s", l)
		}
		if t.Failed() {
			t.Logf("ctrdtest: containerd's log (in %s):\n%s", c.Dir(), c.LogTail())
		}
		if err := c.Remove(); err != nil {
			t.Errorf("ctrdtest: %v", err)
		}
	})
	return &Containerd{c}
}

// ImportBusybox imports the busybox test image into c's namespace and returns its name
// (ctrd.Containerd.ImportBusybox).
func ImportBusybox(t testing.TB, c *Containerd) string {
	t.Helper()
	name, err := c.ImportBusybox()
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return name
}

// ImportImage imports the busybox test image into ctrd.CRINamespace as name, for the CRI
// (ctrd.Containerd.ImportImage), and returns name.
func ImportImage(t testing.TB, c *Containerd, name string) string {
	t.Helper()
	name, err := c.ImportImage(name)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return name
}

// Client is a Go client of the containerd (ctrd.Containerd.Client), closed at the end of the
// test.
func (c *Containerd) Client(t testing.TB) *client.Client {
	t.Helper()
	cl, err := c.Containerd.Client()
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	t.Cleanup(func() {
		if err := cl.Close(); err != nil {
			t.Errorf("ctrdtest: closing the client: %v", err)
		}
	})
	return cl
}

// Restart stops containerd and starts it again under its running shims
// (ctrd.Containerd.Restart).
func (c *Containerd) Restart(t testing.TB) {
	t.Helper()
	if err := c.Containerd.Restart(); err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
}

// RunCtr runs ctr with args and returns its output and exit status. It fails the test if
// ctr cannot be started, is killed by a signal, or outlasts Options.CtrTimeout.
func (c *Containerd) RunCtr(t testing.TB, args ...string) ctrd.Result {
	t.Helper()
	r, err := c.Containerd.RunCtr(context.Background(), args...)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return r
}

// Ctr runs ctr with args and returns its standard output; it fails the test unless ctr
// exits 0.
func (c *Containerd) Ctr(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.Containerd.Ctr(context.Background(), args...)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return out
}

// RunCrictl runs crictl with args and returns its output and exit status. It fails the test if
// crictl cannot be started, is killed by a signal, or outlasts Options.CtrTimeout.
func (c *Containerd) RunCrictl(t testing.TB, args ...string) ctrd.Result {
	t.Helper()
	r, err := c.Containerd.RunCrictl(context.Background(), args...)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return r
}

// Crictl runs crictl with args and returns its standard output; it fails the test unless
// crictl exits 0.
func (c *Containerd) Crictl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.Containerd.Crictl(context.Background(), args...)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return out
}

// Snapshot takes a snapshot of the containerd.
func (c *Containerd) Snapshot(t testing.TB) ctrd.Snapshot {
	t.Helper()
	s, err := c.Containerd.Snapshot()
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	return s
}

// CheckNoLeaks fails the test for each thing the containerd holds now that it did not hold at
// before (ctrd.Containerd.Leaks), given 10 seconds to go.
func (c *Containerd) CheckNoLeaks(t testing.TB, before ctrd.Snapshot) {
	t.Helper()
	leaks, err := c.Leaks(before, 10*time.Second)
	if err != nil {
		t.Fatalf("ctrdtest: %v", err)
	}
	for _, l := range leaks {
		t.Errorf("ctrdtest: leak: %s", l)
	}
}

// KillSince kills the containerd's processes that before did not have and match accepts
// (ctrd.Containerd.KillSince), and waits for them to go.
func (c *Containerd) KillSince(t testing.TB, before ctrd.Snapshot, match func(ctrd.Process) bool) {
	t.Helper()
	if err := c.Containerd.KillSince(before, match); err != nil {
		t.Errorf("ctrdtest: %v", err)
	}
}
