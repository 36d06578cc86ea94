package agent

import (
	"context"
	"os"
	"syscall"

	"github.com/containerd/console"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// Runtime runs containers: crun in the guest ([OCIRuntime]), a fake in the service's tests.
// Every method may be slow (it runs a runtime command); the service calls none of them with its
// lock held. Exits of the processes a Runtime starts are reported to
// [Service.ProcessExited] by whoever reaps them, not by the Runtime.
type Runtime interface {
	// Create creates container id from the bundle (its config.json written by the service):
	// its init process exists, stopped before the user's program, until Start.
	Create(ctx context.Context, id, bundle string, stdio ProcessIO) (Created, error)
	// Start starts the init process of a created container.
	Start(ctx context.Context, id string) error
	// Exec starts process p in the running container id.
	Exec(ctx context.Context, id, execID string, p *specs.Process, stdio ProcessIO) (Created, error)
	// Kill sends sig to the container's init process, or with all to every process in it.
	Kill(ctx context.Context, id string, sig syscall.Signal, all bool) error
	// Signal sends sig to one process of a container, by pid (an exec).
	Signal(pid int, sig syscall.Signal) error
	// Delete deletes the container; force kills what still runs of it first.
	Delete(ctx context.Context, id string, force bool) error
	// Pause freezes the container's processes; Resume thaws them.
	Pause(ctx context.Context, id string) error
	Resume(ctx context.Context, id string) error
	// Update applies new resource limits.
	Update(ctx context.Context, id string, r *specs.LinuxResources) error
}

// ProcessIO is what a new process's standard streams are connected to. Without Terminal,
// Stdin, Stdout and Stderr are the process's ends (a pipe the service owns the other end of,
// or /dev/null); with Terminal they are nil and the runtime makes a pty.
type ProcessIO struct {
	Terminal              bool
	Stdin, Stdout, Stderr *os.File
}

// Created is what Create and Exec answer: the new process's pid and, for a terminal
// process, the pty's master.
type Created struct {
	Pid     int
	Console console.Console
}
