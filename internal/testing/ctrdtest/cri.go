package ctrdtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/ociimage"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
)

// The CRI test network (see ctrdconf): a CNI bridge network whose bridge is in the
// containerd's own network namespace (NetNS), so its addresses and traffic stay there.
const (
	// PodSubnet is where the pods' addresses come from.
	PodSubnet = ctrdconf.PodSubnet
	// PodGateway is the bridge's address, in NetNS.
	PodGateway = ctrdconf.PodGateway
)

// CRINamespace is the containerd namespace of everything the CRI makes.
const CRINamespace = ctrdconf.CRINamespace

// PauseImage is the pod sandbox image the CRI is pinned to, imported into CRINamespace at
// Start: the busybox test image sleeping for ever (there is no registry to pull the real pause
// image from). A runtime whose VM does the pause container's job never runs it.
const PauseImage = ctrdconf.PauseImage

// NetNS is the path of the containerd's network namespace, with CRI, while containerd runs
// (/proc/PID/ns/net: the namespace has no name, and goes with the containerd's last process):
// the test network's bridge is there, and the pods' veths have their host ends there.
// Commands run in it with InNetNS. Empty without CRI (containerd then runs in the test's
// network namespace).
func (c *Containerd) NetNS() string {
	if !c.opts.CRI {
		return ""
	}
	return fmt.Sprintf("/proc/%d/ns/net", c.PID())
}

// InNetNS is the command name args... run in NetNS (through nsenter), killed when ctx is done.
func (c *Containerd) InNetNS(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + c.NetNS(), "--", name}, args...)...)
	cmd.Env = c.environ()
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// importPause imports PauseImage into CRINamespace.
func (c *Containerd) importPause(t testing.TB) {
	t.Helper()
	img, err := ociimage.Busybox(PauseImage, ociimage.BusyboxPath)
	if err != nil {
		t.Fatal(err)
	}
	img.Config.Cmd = []string{"sleep", "2147483647"}
	archive := filepath.Join(c.dir, "pause.tar")
	if err := img.WriteFile(archive); err != nil {
		t.Fatal(err)
	}
	c.Ctr(t, "--namespace", CRINamespace, "images", "import", archive)
}

// ImportImage imports the busybox test image into CRINamespace as name, for the CRI
// (ImportBusybox imports it into the ctr namespace).
func ImportImage(t testing.TB, c *Containerd, name string) string {
	t.Helper()
	img, err := ociimage.Busybox(name, ociimage.BusyboxPath)
	if err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(c.dir, strings.NewReplacer("/", "_", ":", "_").Replace(name)+".tar")
	if err := img.WriteFile(archive); err != nil {
		t.Fatal(err)
	}
	c.Ctr(t, "--namespace", CRINamespace, "images", "import", archive)
	return name
}

// CrictlCmd is `crictl --config CONFIG args...` on the containerd's CRI, run in NetNS (the
// streaming server of exec, attach and port-forward listens there), killed when ctx is done.
func (c *Containerd) CrictlCmd(ctx context.Context, args ...string) *exec.Cmd {
	return c.InNetNS(ctx, c.bins.Crictl, append([]string{"--config", ctrdconf.CrictlConfig(c.dir)}, args...)...)
}

// RunCrictl runs crictl with args and returns its output and exit status. It fails the test if
// crictl cannot be started, is killed by a signal, or outlasts Options.CtrTimeout.
func (c *Containerd) RunCrictl(t testing.TB, args ...string) Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.CtrTimeout+10*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := c.CrictlCmd(ctx, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("ctrdtest: crictl %s: timed out\nstdout: %s\nstderr: %s", strings.Join(args, " "), &stdout, &stderr)
	case errors.As(err, &ee) && ee.ExitCode() >= 0:
	case err != nil:
		t.Fatalf("ctrdtest: crictl %s: %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), err, &stdout, &stderr)
	}
	return Result{Stdout: stdout.String(), Stderr: stderr.String(), ExitCode: cmd.ProcessState.ExitCode()}
}

// Crictl runs crictl with args and returns its standard output; it fails the test unless
// crictl exits 0.
func (c *Containerd) Crictl(t testing.TB, args ...string) string {
	t.Helper()
	r := c.RunCrictl(t, args...)
	if r.ExitCode != 0 {
		t.Fatalf("ctrdtest: crictl %s: exit status %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.ExitCode, r.Stdout, r.Stderr)
	}
	return r.Stdout
}
