// Command kvfsd is a vhost-user virtio-fs back-end: it serves a host directory to one virtual
// machine, and takes the command lines of both virtiofsd (see kvfsd --help). Like virtiofsd, it
// confines itself before serving unless told not to: see package virtiofs/confine.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/containerd/log"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/cmdline"
	"github.com/kvfs/kvfs/virtiofs/confine"
)

// version is set at link time: -ldflags "-X main.version=...".
var version = "devel"

func main() {
	// A daemon's log may be a pipe (a sandbox's owner drains it): if its reader goes, a write
	// there fails with EPIPE and is dropped, rather than end the server, as in virtiofsd.
	signal.Ignore(syscall.SIGPIPE)
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
	if fd, ok := confine.Child(); ok {
		// PID 1 of a --sandbox=namespace kvfsd's namespaces: the supervisor made the socket;
		// this process starts the server with fewer capabilities and pivots.
		status, err := confine.Setup(opts.Server.SharedDir, args, fd, stdout, stderr, opts.ServerCapabilities())
		if err != nil {
			log.L.WithError(err).Error("kvfsd failed")
		}
		return status
	}
	if fd, ok := confine.ServingChild(); ok {
		// The server of a --sandbox=namespace kvfsd, child of the one above.
		opts.SocketPath, opts.SocketGroup, opts.FD = "", "", fd
		return exitCode(serve(opts, false))
	}
	warnTag(opts)
	if opts.Sandbox == confine.SandboxNamespace {
		return supervise(args, opts, stdout, stderr)
	}
	return exitCode(serve(opts, true))
}

func exitCode(err error) int {
	if err != nil {
		log.L.WithError(err).Error("kvfsd failed")
		return 1
	}
	return 0
}

// warnTag says what --tag does here: nothing the guest sees.
func warnTag(opts *cmdline.Options) {
	if opts.Tag != "" {
		log.L.Warnf("--tag=%s: the guest sees the tag the front-end sets (QEMU: -device vhost-user-fs-pci,tag=...); kvfsd offers no device configuration space, on which QEMU 7.1 to 8.0 crash", opts.Tag)
	}
}

// setNofileLimit applies --rlimit-nofile, or kvfsd's default limit.
func setNofileLimit(opts *cmdline.Options) error {
	ch, err := cmdline.SetNofileLimit(opts)
	if err != nil {
		return err
	}
	if ch.After.Cur < ch.Wanted {
		log.L.Warnf("RLIMIT_NOFILE stays at %d, not %d: the hard limit cannot be raised without CAP_SYS_RESOURCE", ch.After.Cur, ch.Wanted)
	} else if ch.After != ch.Before {
		log.L.Debugf("RLIMIT_NOFILE raised from %d to %d", ch.Before.Cur, ch.After.Cur)
	}
	return nil
}

// supervise is --sandbox=namespace: this process creates the socket (so it can remove it and
// its pidfile at the end, outside the sandbox) and runs kvfsd again, sandboxed, to serve on it.
func supervise(args []string, opts *cmdline.Options, stdout, stderr io.Writer) int {
	if err := setNofileLimit(opts); err != nil {
		return exitCode(err)
	}
	l, release, err := cmdline.Listen(opts)
	if err != nil {
		return exitCode(err)
	}
	defer release()
	f, err := l.File()
	if err != nil {
		return exitCode(err)
	}
	defer f.Close()
	status, err := confine.Supervise(args, f, opts.UserNamespace(), os.Stdin, stdout, stderr)
	if err != nil {
		log.L.WithError(err).Error("kvfsd failed")
	}
	return status
}

// cpuProfileEnv names the file the serving kvfsd writes a CPU profile of its whole run to (see
// --help). With --sandbox=namespace that is the sandboxed server, which inherits the environment;
// the file is created before the sandbox is entered, so the path is the host's.
const cpuProfileEnv = "KVFSD_CPUPROFILE"

// startCPUProfile starts profiling into path, if not empty, and returns what ends it.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", cpuProfileEnv, err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", cpuProfileEnv, err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			log.L.WithError(err).Errorf("%s: writing the profile", cpuProfileEnv)
		}
	}, nil
}

// serve serves until the front-end disconnects or a signal comes: unconfined, chrooted, or as
// the sandboxed server. The seccomp filter goes on last, when nothing but serving is left.
// setRlimit is false in the sandboxed server, which inherits the limit its supervisor set.
func serve(opts *cmdline.Options, setRlimit bool) error {
	stopProfile, err := startCPUProfile(os.Getenv(cpuProfileEnv))
	if err != nil {
		return err
	}
	defer stopProfile()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer stop()
	// After the first signal, a second one gets its default action: a stuck shutdown can be
	// interrupted.
	context.AfterFunc(ctx, stop)

	if setRlimit {
		if err := setNofileLimit(opts); err != nil {
			return err
		}
	}
	l, release, err := cmdline.Listen(opts)
	if err != nil {
		return err
	}
	defer release()

	switch opts.Sandbox {
	case confine.SandboxNamespace: // only the sandboxed server gets here (see run)
		err = confine.EnterRoot(opts.Server.SharedDir)
	case confine.SandboxChroot:
		err = confine.Chroot(opts.Server.SharedDir)
	}
	if err != nil {
		return err
	}
	cfg := opts.Server
	if opts.Sandbox != confine.SandboxNone {
		cfg.SharedDir, cfg.ProcSelfFd = "/", confine.ProcSelfFd
	}
	srv, err := virtiofs.NewServer(cfg)
	if err != nil {
		return err
	}
	defer srv.Close()

	// Kata's runtime-rs reads stderr for this line to know the socket is ready. It is logged
	// before the filter goes on, so that the logger has set itself up (a terminal check).
	log.L.Info("Waiting for vhost-user socket connection...")
	if err := confine.InstallSeccomp(opts.Seccomp); err != nil {
		return err
	}
	err = srv.Serve(ctx, l)
	if ctx.Err() != nil && (err == nil || errors.Is(err, context.Canceled)) {
		log.L.Info("Signal received, shut down")
		return nil
	}
	return err
}
