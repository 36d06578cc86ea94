package ctrd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
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
// Commands run in it with InNetNS. Empty without CRI (containerd then runs in the caller's
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
func (c *Containerd) importPause() error {
	img, err := ociimage.Busybox(PauseImage, ociimage.BusyboxPath)
	if err != nil {
		return err
	}
	img.Config.Cmd = []string{"sleep", "2147483647"}
	return c.ImportCRI(img)
}

// ImportImage imports the busybox test image into CRINamespace as name, for the CRI
// (ImportBusybox imports it into the ctr namespace), and returns name.
func (c *Containerd) ImportImage(name string) (string, error) {
	img, err := ociimage.Busybox(name, ociimage.BusyboxPath)
	if err != nil {
		return "", err
	}
	return name, c.ImportCRI(img)
}

// ImportCRI imports img into CRINamespace, for the CRI.
func (c *Containerd) ImportCRI(img *ociimage.Image) error {
	archive := filepath.Join(c.dir, strings.NewReplacer("/", "_", ":", "_").Replace(img.Name)+".tar")
	if err := img.WriteFile(archive); err != nil {
		return err
	}
	_, err := c.Ctr(context.Background(), "--namespace", CRINamespace, "images", "import", archive)
	return err
}

// CrictlCmd is `crictl --config CONFIG args...` on the containerd's CRI, run in NetNS (the
// streaming server of exec, attach and port-forward listens there), killed when ctx is done.
func (c *Containerd) CrictlCmd(ctx context.Context, args ...string) *exec.Cmd {
	return c.InNetNS(ctx, c.bins.Crictl, append([]string{"--config", ctrdconf.CrictlConfig(c.dir)}, args...)...)
}

// CritestCmd is `critest args...` (cri-tools' CRI validation suite) on the containerd's CRI,
// run in its network and mount namespaces, as critest runs beside containerd on a node: the
// host paths its specs make and mount there are the ones containerd's shims are given, and
// the pods' addresses and the streaming server are reached from there. Killed when ctx is
// done.
func (c *Containerd) CritestCmd(ctx context.Context, args ...string) *exec.Cmd {
	endpoint := "unix://" + filepath.Join(c.dir, ctrdconf.GRPCSocket)
	ns := []string{"--net=" + c.NetNS(), fmt.Sprintf("--mount=/proc/%d/ns/mnt", c.PID()), "--"}
	cmd := exec.CommandContext(ctx, "nsenter", append(append(ns, c.bins.Critest, "--runtime-endpoint", endpoint, "--image-endpoint", endpoint), args...)...)
	cmd.Env = c.environ()
	cmd.WaitDelay = 5 * time.Second
	return cmd
}

// RunCrictl runs crictl with args and returns its output and exit status. Its error says when
// crictl cannot be started, is killed by a signal, or outlasts ctx or Options.CtrTimeout (and
// 10 seconds: crictl's own calls are bounded by it).
func (c *Containerd) RunCrictl(ctx context.Context, args ...string) (Result, error) {
	tctx, cancel := context.WithTimeout(ctx, c.opts.CtrTimeout+10*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := c.CrictlCmd(tctx, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		return Result{}, fmt.Errorf("crictl %s: %w", strings.Join(args, " "), ctx.Err())
	case tctx.Err() != nil:
		return Result{}, fmt.Errorf("crictl %s: timed out\nstdout: %s\nstderr: %s", strings.Join(args, " "), &stdout, &stderr)
	case errors.As(err, &ee) && ee.ExitCode() >= 0:
	case err != nil:
		return Result{}, fmt.Errorf("crictl %s: %v\nstdout: %s\nstderr: %s", strings.Join(args, " "), err, &stdout, &stderr)
	}
	return Result{Stdout: stdout.String(), Stderr: stderr.String(), ExitCode: cmd.ProcessState.ExitCode()}, nil
}

// Crictl runs crictl with args and returns its standard output; it is an error unless crictl
// exits 0.
func (c *Containerd) Crictl(ctx context.Context, args ...string) (string, error) {
	r, err := c.RunCrictl(ctx, args...)
	if err != nil {
		return "", err
	}
	if r.ExitCode != 0 {
		return r.Stdout, fmt.Errorf("crictl %s: exit status %d\nstdout: %s\nstderr: %s", strings.Join(args, " "), r.ExitCode, r.Stdout, r.Stderr)
	}
	return r.Stdout, nil
}
