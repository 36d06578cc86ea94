// Command kvfsd is a vhost-user virtio-fs back-end: it serves a host directory to one virtual
// machine, and takes the command lines of both virtiofsd (see kvfsd --help).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/log"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/cmdline"
)

// version is set at link time: -ldflags "-X main.version=...".
var version = "devel"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	opts, err := cmdline.Parse(args)
	if err != nil {
		fmt.Fprintf(stderr, "kvfsd: %v\nRun 'kvfsd --help' for usage.\n", err)
		return 1
	}
	switch {
	case opts.Help:
		fmt.Fprint(stdout, cmdline.Usage())
		return 0
	case opts.Version:
		fmt.Fprintf(stdout, "kvfsd version %s\n", version)
		return 0
	case opts.PrintCapabilities:
		fmt.Fprintln(stdout, cmdline.Capabilities)
		return 0
	}

	log.L.Logger.SetOutput(stderr)
	if err := cmdline.ConfigureLogger(log.L.Logger, opts); err != nil {
		if !errors.Is(err, cmdline.ErrNoSyslog) {
			fmt.Fprintf(stderr, "kvfsd: %v\n", err)
			return 1
		}
		log.L.WithError(err).Warn("logging to stderr instead")
	}
	if err := serve(opts); err != nil {
		log.L.WithError(err).Error("kvfsd failed")
		return 1
	}
	return 0
}

func serve(opts *cmdline.Options) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// After the first signal, a second one gets its default action: a stuck shutdown can be
	// interrupted.
	context.AfterFunc(ctx, stop)

	ch, err := cmdline.SetNofileLimit(opts)
	if err != nil {
		return err
	}
	if ch.After.Cur < ch.Wanted {
		log.L.Warnf("RLIMIT_NOFILE stays at %d, not %d: the hard limit cannot be raised without CAP_SYS_RESOURCE", ch.After.Cur, ch.Wanted)
	} else if ch.After != ch.Before {
		log.L.Debugf("RLIMIT_NOFILE raised from %d to %d", ch.Before.Cur, ch.After.Cur)
	}

	srv, err := virtiofs.NewServer(opts.Server)
	if err != nil {
		return err
	}
	defer srv.Close()

	l, release, err := cmdline.Listen(opts)
	if err != nil {
		return err
	}
	defer release()

	// Kata's runtime-rs reads stderr for this line to know the socket is ready.
	log.L.Info("Waiting for vhost-user socket connection...")
	err = srv.Serve(ctx, l)
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		log.L.Info("Signal received, shut down")
		return nil
	}
	return err
}
