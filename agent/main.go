package agent

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"time"

	runc "github.com/containerd/go-runc"
	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Version is the agent's version, answered by Ping.
const Version = "0.1.0"

const (
	// portWait bounds the wait for the virtio-serial port to appear after its module loaded.
	portWait = 10 * time.Second
	// hostHangup bounds the wait, after Shutdown, for the host to hang up, which it does once
	// it has Shutdown's answer; serverDrain bounds what the server's own shutdown waits after.
	hostHangup  = 2 * time.Second
	serverDrain = 2 * time.Second
	modulesList = "/etc/kvfs/modules"
)

// logFormat writes "kvfs-agent: level message key=value ..." lines: the console's format.
type logFormat struct{}

func (logFormat) Format(e *logrus.Entry) ([]byte, error) {
	var b bytes.Buffer
	fmt.Fprintf(&b, "kvfs-agent: %s %s", e.Level, e.Message)
	keys := make([]string, 0, len(e.Data))
	for k := range e.Data {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%v", k, e.Data[k])
	}
	b.WriteByte('\n')
	return b.Bytes(), nil
}

// Main is kvfs-agent: the init of a pod's VM. As PID 1 it sets the system up (mounts,
// modules, the share), serves the agent API on the transport the kernel command line names
// until Shutdown, and powers the machine off; it never returns then. Run otherwise (as a
// child subreaper) it only serves, and answers an exit status when Shutdown is done.
func Main() int {
	// The standard logger, so that what the libraries log through it has the prefix too.
	log := logrus.StandardLogger()
	log.SetOutput(os.Stderr)
	log.SetFormatter(logFormat{})
	entry := logrus.NewEntry(log)
	pid1 := os.Getpid() == 1
	err := run(entry, pid1)
	if !pid1 {
		if err != nil {
			entry.WithError(err).Error("exiting")
			return 1
		}
		return 0
	}
	if err != nil {
		entry.WithError(err).Error("fatal")
	}
	if err := PowerOff(apiv1.SharedDir); err != nil {
		entry.WithError(err).Error("power-off failed")
	}
	// Init returning panics the kernel; with panic=-1 and QEMU's -no-reboot that ends the VM.
	return 1
}

func run(log *logrus.Entry, pid1 bool) error {
	booted := BootTime() // the kernel's share of the VM's start: it ran us as init
	start := time.Now()
	if pid1 {
		os.Setenv("PATH", "/bin:/sbin:/usr/bin:/usr/sbin")
		if err := LeaveInitramfs(); err != nil {
			return err
		}
		if err := MountSystem(); err != nil {
			return err
		}
	} else if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("becoming a child subreaper: %w", err)
	}
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return err
	}
	params, err := ParseCmdline(string(cmdline))
	if err != nil {
		return err
	}
	if params.Debug {
		log.Logger.SetLevel(logrus.DebugLevel)
	}
	log.WithField("kernel", KernelRelease()).Info("starting")
	// The host's secret first: without it nothing is served, and the machine powers off.
	secret, err := ReadSecret(DefaultDMITable)
	if err != nil {
		return fmt.Errorf("%w: serving nothing", err)
	}
	if pid1 {
		if err := LoadModules(modulesList, filepath.Join("/lib/modules", KernelRelease())); err != nil {
			return err
		}
		if err := MountShare(params.Tag, apiv1.SharedDir); err != nil {
			return err
		}
		if err := LoopbackUp(); err != nil {
			return err
		}
		if params.Hostname != "" {
			if err := unix.Sethostname([]byte(params.Hostname)); err != nil {
				return fmt.Errorf("setting the hostname %q: %w", params.Hostname, err)
			}
		}
	}

	reaper := NewReaper()
	runc.Monitor = reaper
	cfg := Config{
		Runtime: &OCIRuntime{BundleDir: DefaultStateDir},
		Cgroups: Cgroup2{Root: DefaultCgroupRoot, Log: log},
		Version: Version,
		Started: booted,
		Log:     log,
	}
	if pid1 {
		// The machine powers off after Shutdown: its processes are killed at once, without
		// running the runtime twice for each container (about 0.1 s a run under TCG).
		cfg.KillAll = func() error { return unix.Kill(-1, unix.SIGKILL) }
	}
	svc, err := NewService(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go reaper.Run(ctx, svc.ProcessExited)

	l, err := listen(params, secret, log)
	if err != nil {
		return err
	}
	interceptors := []ttrpc.UnaryServerInterceptor{Interceptor(log)}
	fault, err := faultInterceptor(params.Fault, svc, log)
	if err != nil {
		return err
	}
	if fault != nil {
		interceptors = append(interceptors, fault)
	}
	srv, err := ttrpc.NewServer(ttrpc.WithChainUnaryServerInterceptor(interceptors...))
	if err != nil {
		return err
	}
	apiv1.RegisterAgentService(srv, svc)
	tl := trackConns(l)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, tl) }()
	log.WithFields(logrus.Fields{"transport": params.Transport, "addr": l.Addr().String(),
		"after": time.Since(start).Round(time.Millisecond)}).Info("serving")

	select {
	case <-svc.Done():
	case err := <-served:
		return fmt.Errorf("serving: %w", err)
	}
	stopServing(ctx, srv, tl, log)
	log.Info("shut down")
	return nil
}

// stopServing ends srv, serving on tl, once Shutdown has been called. Shutdown's answer is not
// sent yet when Done closes (its handler closes it), and ttrpc's own shutdown may take the
// connection for idle and close it before the answer leaves: so it first waits for the host
// to hang up, which the host does once it has the answer (a host that does not is waited for
// hostHangup).
func stopServing(ctx context.Context, srv *ttrpc.Server, tl *connTracker, log *logrus.Entry) {
	hctx, hcancel := context.WithTimeout(ctx, hostHangup)
	if !tl.waitClosed(hctx) {
		log.Warn("the host did not hang up after Shutdown")
	}
	hcancel()
	dctx, dcancel := context.WithTimeout(ctx, serverDrain)
	defer dcancel()
	if err := srv.Shutdown(dctx); err != nil {
		log.WithError(err).Warn("the last answers may not have left")
	}
}

// listen opens the transport of params, the virtio-serial port (waiting for it to appear) or
// the vsock port, to serve the host that proves secret.
func listen(params BootParams, secret []byte, log *logrus.Entry) (net.Listener, error) {
	if params.Transport == TransportVsock {
		return ListenVsock(params.VsockPort, secret, log)
	}
	deadline := time.Now().Add(portWait)
	for {
		dev, err := FindSerialPort(DefaultVirtioPorts, apiv1.SerialPortName)
		if err == nil {
			return ListenSerial(dev, secret, log)
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}
