// Command kvfs-deploy installs kvfs on a Kubernetes node from the install image, and builds
// that image (package deploy).
//
//	kvfs-deploy install [flags]     install into the host root, restart containerd, label the
//	                                node; then wait for SIGTERM (with -cleanup-on-exit,
//	                                uninstall then)
//	kvfs-deploy uninstall [flags]   take the label off, uninstall, restart containerd; then wait
//	kvfs-deploy image -o FILE -bin DIR -guest DIR [-name NAME]
//	                                write the install image as an OCI archive (ctr image import)
//
// Every install and uninstall flag has an environment variable (in brackets in -help), which
// the DaemonSets in packaging/kubernetes set. The service account in
// /var/run/secrets/kubernetes.io/serviceaccount, when one is mounted, is used to label the
// node NODE_NAME.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/kvfs/kvfs/internal/ociimage"
	"github.com/kvfs/kvfs/packaging/kubernetes/deploy"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "install", "uninstall":
		err = run(os.Args[1], os.Args[2:])
	case "image":
		err = image(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", deploy.Command, err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintf(os.Stderr, "usage: %s install|uninstall [flags] | image -o FILE -bin DIR -guest DIR\n", deploy.Command)
	os.Exit(2)
}

func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

func run(cmd string, args []string) error {
	fs := flag.NewFlagSet(deploy.Command+" "+cmd, flag.ExitOnError)
	in := deploy.Installer{Out: os.Stdout}
	fs.StringVar(&in.HostRoot, "host-root", env("KVFS_HOST_ROOT", "/host"), "where the node's / is mounted [KVFS_HOST_ROOT]")
	fs.StringVar(&in.Payload, "payload", env("KVFS_PAYLOAD", deploy.PayloadDir), "the directory of bin/, guest/ and install.sh [KVFS_PAYLOAD]")
	fs.StringVar(&in.Prefix, "prefix", env("KVFS_PREFIX", "/opt/kvfs"), "the install's PREFIX on the host [KVFS_PREFIX]")
	fs.StringVar(&in.Sysconfdir, "sysconfdir", env("KVFS_SYSCONFDIR", "/etc"), "the install's SYSCONFDIR on the host: containerd's configuration is in SYSCONFDIR/containerd [KVFS_SYSCONFDIR]")
	fs.StringVar(&in.Localstatedir, "localstatedir", env("KVFS_LOCALSTATEDIR", "/var"), "the install's LOCALSTATEDIR on the host: the manifest is in LOCALSTATEDIR/lib/kvfs [KVFS_LOCALSTATEDIR]")
	fs.StringVar(&in.Restart, "restart", env("KVFS_RESTART_CONTAINERD", ""), "a shell command that restarts the host's containerd; none when empty [KVFS_RESTART_CONTAINERD]")
	fs.StringVar(&in.Node, "node", env("NODE_NAME", ""), "the node to label [NODE_NAME]")
	fs.StringVar(&in.Label, "label", env("KVFS_NODE_LABEL", "kvfs.io/kvfs-runtime"), "the node label, set to true once installed [KVFS_NODE_LABEL]")
	saDir := fs.String("service-account", env("KVFS_SERVICE_ACCOUNT", deploy.ServiceAccountDir), "the service account's directory (token, ca.crt) [KVFS_SERVICE_ACCOUNT]")
	cleanup := fs.Bool("cleanup-on-exit", envBool("KVFS_CLEANUP_ON_EXIT"), "install: uninstall at SIGTERM [KVFS_CLEANUP_ON_EXIT]")
	wait := fs.Bool("wait", true, "wait for SIGTERM or SIGINT once done (a DaemonSet's pod must keep running)")
	fs.Parse(args)
	if fs.NArg() != 0 {
		return fmt.Errorf("%s: unexpected arguments %q", cmd, fs.Args())
	}
	kube, err := deploy.InCluster(*saDir)
	if err != nil {
		return err
	}
	in.Kube = kube

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// The work itself is not cut short by a signal: a half-done install or uninstall is
	// worse than a late exit (the kubelet's grace period ends it if it must).
	if cmd == "install" {
		err = in.Install(context.Background())
	} else {
		err = in.Uninstall(context.Background())
	}
	if err != nil {
		// deploy.ErrNotImported too: the files are in place, but the pod fails so that the
		// node's problem shows, and its next start (an idempotent install) finishes the
		// job once it is fixed.
		return err
	}
	if !*wait {
		return nil
	}
	fmt.Printf("%s: waiting for SIGTERM\n", deploy.Command)
	<-ctx.Done()
	stop()
	if cmd == "install" && *cleanup {
		fmt.Printf("%s: SIGTERM: cleaning up\n", deploy.Command)
		return in.Uninstall(context.Background())
	}
	return nil
}

func envBool(name string) bool {
	b, _ := strconv.ParseBool(os.Getenv(name))
	return b
}

func image(args []string) error {
	fs := flag.NewFlagSet(deploy.Command+" image", flag.ExitOnError)
	out := fs.String("o", "", "the archive to write (required)")
	name := fs.String("name", "localhost/kvfs-deploy:latest", "the image's name")
	var src deploy.Sources
	fs.StringVar(&src.Bin, "bin", "", "the directory of the statically linked binaries (required)")
	fs.StringVar(&src.Guest, "guest", "", "the guest image directory (required)")
	fs.StringVar(&src.Installer, "installer", "packaging/install.sh", "install.sh")
	fs.StringVar(&src.Busybox, "busybox", ociimage.BusyboxPath, "a statically linked busybox")
	fs.StringVar(&src.Bash, "bash", "/bin/bash", "bash, with its libraries")
	fs.Parse(args)
	if *out == "" || src.Bin == "" || src.Guest == "" || fs.NArg() != 0 {
		fs.Usage()
		os.Exit(2)
	}
	img, err := deploy.Image(*name, src)
	if err != nil {
		return err
	}
	if err := img.WriteFile(*out); err != nil {
		return err
	}
	fmt.Printf("%s: wrote %s (%s)\n", deploy.Command, *out, *name)
	return nil
}
