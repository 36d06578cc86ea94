// Package deploy is kvfs's node installer for Kubernetes: the install image (Image, an OCI
// archive for `ctr image import`) and what its entrypoint, kvfs-deploy, does on a node.
//
// The DaemonSet in packaging/kubernetes runs the image with the node's root file system
// mounted at HostRoot. Install runs the image's packaging/install.sh with --destdir HostRoot
// (the same installer as make install and the Debian package, so the same files, manifest and
// containerd drop-in), runs the Restart command (containerd must load the drop-in), and labels
// the node through the Kubernetes API. Uninstall takes the label off, runs the installer's
// uninstall (what the manifest lists, files edited since kept) and Restart again.
//
// Threat model: the entrypoint runs privileged with the host's root mounted writable; what it
// trusts is the image (the installer and the files it installs) and the cluster's API server
// (its CA from the service account). It writes on the host only through install.sh, which
// keeps within the layout's paths under HostRoot, and patches only its own node's labels.
package deploy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Installer installs the payload into a host root.
type Installer struct {
	// HostRoot is where the node's root file system is mounted ("/host"): install.sh's
	// --destdir.
	HostRoot string
	// Payload is the directory holding bin/, guest/ and install.sh (PayloadDir in the
	// image).
	Payload string
	// Prefix, Sysconfdir and Localstatedir are the install layout on the host (install.sh's
	// --prefix, --sysconfdir, --localstatedir): paths as the host sees them.
	Prefix, Sysconfdir, Localstatedir string
	// Restart is a shell command (sh -c) run after the host's files changed, so that
	// containerd loads or drops the runtime; none when empty. In the DaemonSet:
	// nsenter --target 1 --mount -- systemctl restart containerd (with hostPID).
	Restart string
	// Node and Label name the node to label and the label (value "true"); no label when
	// Kube is nil.
	Node, Label string
	// Kube is the API server, from the pod's service account (InCluster); nil for none.
	Kube *Kube
	// Out gets the installer's output and what the entrypoint does.
	Out io.Writer
}

// ErrNotImported is Install's error when the host's containerd config.toml exists and does
// not import the drop-in: install.sh does not rewrite it, so containerd would not load the
// runtime. The files are installed; the node is not labelled and containerd not restarted.
var ErrNotImported = errors.New("containerd's config.toml does not import the kvfs drop-in (add the imports line the installer printed, then restart this pod)")

func (in *Installer) sayf(format string, a ...any) {
	fmt.Fprintf(in.Out, Command+": "+format+"\n", a...)
}

func (in *Installer) layout() []string {
	return []string{"--destdir", in.HostRoot, "--prefix", in.Prefix, "--sysconfdir", in.Sysconfdir, "--localstatedir", in.Localstatedir}
}

// installer runs install.sh with args; its output goes to Out and is returned.
func (in *Installer) installer(ctx context.Context, args ...string) (string, error) {
	var out bytes.Buffer
	script := filepath.Join(in.Payload, "install.sh")
	cmd := exec.CommandContext(ctx, "bash", append([]string{script}, args...)...)
	cmd.Stdout = io.MultiWriter(in.Out, &out)
	cmd.Stderr = cmd.Stdout
	// The layout is given as options; the environment's variables of the same names must
	// not add to it.
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "DESTDIR", "PREFIX", "SYSCONFDIR", "LOCALSTATEDIR":
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w", script, args[0], err)
	}
	return out.String(), nil
}

func (in *Installer) check() error {
	for name, p := range map[string]string{"host root": in.HostRoot, "prefix": in.Prefix, "sysconfdir": in.Sysconfdir, "localstatedir": in.Localstatedir} {
		if !filepath.IsAbs(p) {
			return fmt.Errorf("the %s %q is not an absolute path", name, p)
		}
	}
	if fi, err := os.Stat(in.HostRoot); err != nil || !fi.IsDir() {
		return fmt.Errorf("the host root %s is not a directory (mount the node's / there): %v", in.HostRoot, err)
	}
	if in.Kube != nil && in.Node == "" {
		return fmt.Errorf("a service account but no node name to label (NODE_NAME from spec.nodeName)")
	}
	return nil
}

// Install installs the payload into HostRoot, runs Restart and labels the node. When the
// host's containerd config does not import the drop-in it stops after the files, with
// ErrNotImported.
func (in *Installer) Install(ctx context.Context) error {
	if err := in.check(); err != nil {
		return err
	}
	in.sayf("installing into %s (prefix %s)", in.HostRoot, in.Prefix)
	out, err := in.installer(ctx, append([]string{"install",
		"--bin", filepath.Join(in.Payload, "bin"), "--guest", filepath.Join(in.Payload, "guest")}, in.layout()...)...)
	if err != nil {
		return err
	}
	if strings.Contains(out, "does not import") {
		return ErrNotImported
	}
	if err := in.restart(ctx); err != nil {
		return err
	}
	if in.Kube != nil {
		if err := in.Kube.LabelNode(ctx, in.Node, in.Label, "true"); err != nil {
			return err
		}
		in.sayf("labelled node %s %s=true", in.Node, in.Label)
	} else {
		in.sayf("no service account: node %q not labelled", in.Node)
	}
	in.sayf("installed")
	return nil
}

// Uninstall takes the label off the node, removes what the install manifest lists (files
// edited since are kept, and the installer says so) and runs Restart. With nothing
// installed it says so and does the rest. A label that cannot be taken off does not keep
// the files: the error is returned after the uninstall.
func (in *Installer) Uninstall(ctx context.Context) error {
	if err := in.check(); err != nil {
		return err
	}
	var labelErr error
	if in.Kube != nil {
		if labelErr = in.Kube.LabelNode(ctx, in.Node, in.Label, ""); labelErr == nil {
			in.sayf("removed label %s from node %s", in.Label, in.Node)
		} else {
			in.sayf("%v", labelErr)
		}
	}
	manifest := filepath.Join(in.HostRoot, in.Localstatedir, "lib/kvfs/install.manifest")
	if _, err := os.Stat(manifest); errors.Is(err, os.ErrNotExist) {
		in.sayf("nothing to uninstall: no %s", manifest)
		return labelErr
	}
	if _, err := in.installer(ctx, append([]string{"uninstall"}, in.layout()...)...); err != nil {
		return errors.Join(err, labelErr)
	}
	if err := in.restart(ctx); err != nil {
		return errors.Join(err, labelErr)
	}
	in.sayf("uninstalled")
	return labelErr
}

func (in *Installer) restart(ctx context.Context) error {
	if in.Restart == "" {
		in.sayf("no restart command: containerd loads the change when it restarts")
		return nil
	}
	in.sayf("running %q", in.Restart)
	cmd := exec.CommandContext(ctx, "sh", "-c", in.Restart)
	cmd.Stdout, cmd.Stderr = in.Out, in.Out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("restart command %q: %w", in.Restart, err)
	}
	return nil
}
