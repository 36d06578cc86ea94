package sandbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"

	"golang.org/x/sys/unix"
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
	// LogPath is a file for its stdout and stderr.
	LogPath string
	// ExtraFiles are inherited by the hypervisor as descriptors 3, 4, ... (VM.Files: the NICs'
	// taps). The runner does not close them.
	ExtraFiles []*os.File
}

// QEMURunner runs the hypervisor as a child process in a session of its own, without a
// parent-death signal, so that it outlives a restart of the owner and can be adopted again.
type QEMURunner struct{}

// Run implements VMRunner.
func (QEMURunner) Run(ctx context.Context, c VMCommand) (Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	log, err := os.OpenFile(c.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND|unix.O_NOFOLLOW, 0o640)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(c.Path, c.Args...)
	cmd.Stdout = log
	cmd.Stderr = log
	cmd.ExtraFiles = c.ExtraFiles
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	p, err := startChild(cmd)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", c.Path, err)
	}
	return p, nil
}
