package sandbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"github.com/containerd/log"

	"github.com/kvfs/kvfs/sandbox/network"
)

// VMRunner starts a sandbox's hypervisor. The default, QEMURunner, runs QEMU as a child of
// the owning process; a shim that runs it differently (another cgroup, a jailer) supplies its
// own.
type VMRunner interface {
	// Run starts the hypervisor and returns once it is running. ctx covers the start only.
	Run(ctx context.Context, cmd VMCommand) (Process, error)
}

// VMCommand is what to run.
type VMCommand struct {
	// Path is the hypervisor binary, Args its arguments (VM.Args).
	Path string
	Args []string
	// Output receives its stdout and stderr: the write end of a pipe the sandbox drains into
	// qemu.log, kept bounded. The runner does not close it.
	Output *os.File
	// ExtraFiles are inherited by the hypervisor as descriptors 3, 4, ... (VM.Files: the NICs'
	// taps, then the console's pipe). The runner does not close them.
	ExtraFiles []*os.File
	// NetNS is the path of the network namespace to start the hypervisor in (VM.NetNS);
	// empty: the owner's.
	NetNS string
}

// QEMURunner runs the hypervisor as a child process in a session of its own, without a
// parent-death signal, so that it outlives a restart of the owner and can be adopted again
// (its output and its console then reach no one: QEMU's writes to the pipes fail and are
// dropped). With a NetNS it is started from a thread in that namespace (network.Do), so it is
// born there, and the owner's threads stay in their own.
type QEMURunner struct{}

// Run implements VMRunner.
func (QEMURunner) Run(ctx context.Context, c VMCommand) (Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cmd := exec.Command(c.Path, c.Args...)
	// Set only when not nil: a nil *os.File in an io.Writer is not a nil Writer.
	if c.Output != nil {
		cmd.Stdout = c.Output
		cmd.Stderr = c.Output
	}
	cmd.ExtraFiles = c.ExtraFiles
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var p *childProcess
	start := func() error {
		var err error
		p, err = startChild(cmd)
		return err
	}
	if c.NetNS == "" {
		if err := start(); err != nil {
			return nil, fmt.Errorf("start %s: %w", c.Path, err)
		}
		return p, nil
	}
	err := network.Do(c.NetNS, start)
	if p == nil {
		return nil, fmt.Errorf("start %s in network namespace %s: %w", c.Path, c.NetNS, err)
	}
	if err != nil { // started there, but the thread could not come back: it ends with its goroutine
		log.G(ctx).WithError(err).Warn("starting the VM in the pod's network namespace")
	}
	return p, nil
}
