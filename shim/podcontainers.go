package shim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// The pod's containers come and go: a container is listed from its Create's start, the pod
// booted for the first (or the Sandbox API's joined), and the pod ends with its last (or CRI's
// pod sandbox container's) Delete.

// createContainer creates the container req asks for: listed first (a second Create of its id
// is refused), its bundle's record written (if this shim dies while booting the pod, the delete
// action still finds the sandbox to clean up), the pod acquired (booted if it is the first
// container), then the container made in it (Container.create). A failure undoes it all, and
// stops the pod if it has no container left.
func (pod *Pod) createContainer(ctx context.Context, req *containerRequest) (_ *Container, retErr error) {
	c := newContainer(pod.podEnv, req)
	pod.mu.Lock()
	if _, ok := pod.containers[c.id]; ok {
		pod.mu.Unlock()
		return nil, fmt.Errorf("container %s: %w", c.id, errdefs.ErrAlreadyExists)
	}
	pod.containers[c.id] = c
	pod.mu.Unlock()

	var undo []func()
	defer func() {
		if retErr == nil {
			return
		}
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
		pod.mu.Lock()
		delete(pod.containers, c.id)
		pod.mu.Unlock()
		pod.stopPodIfEmpty()
	}()
	if err := writeBundleRecord(c.bundle, req.record); err != nil {
		return nil, err
	}
	undo = append(undo, func() { os.Remove(filepath.Join(c.bundle, bundleRecordName)) })
	run, err := pod.acquirePod(ctx, req.pod, false)
	if err != nil {
		return nil, err
	}
	if err := c.create(ctx, run, req, &undo); err != nil {
		return nil, err
	}
	return c, nil
}

// deleteProcess deletes p of c, exited (or created: it is killed first), and returns its
// exit. The init's Delete removes the container, and the last container's the pod, as does
// CRI's pod sandbox container's (takeEndingRun).
func (pod *Pod) deleteProcess(ctx context.Context, c *Container, p *process) (uint32, exit, error) {
	if err := p.check(opDelete); err != nil {
		return 0, exit{}, err
	}
	run, err := pod.currentRun()
	if err != nil {
		// The pod was stopped with the container in it (StopSandbox): its processes have
		// exited, and its binds went with the sandbox. What is left is on the host.
		if st, _, _ := p.snapshot(); st != stateStopped {
			return 0, exit{}, err
		}
		run = nil
	}
	// live says the pod's agent can still be asked.
	live := func() bool { return run != nil && run.live() }
	forgotten := false // the agent has forgotten p already
	if st, _, _ := p.snapshot(); st == stateCreated && p.execID != "" {
		// A never-started exec has no process in the guest to kill: the agent forgets it,
		// and its waiters are released as if it had been killed.
		if live() {
			if err := run.forget(ctx, p); err != nil {
				return 0, exit{}, err
			}
		}
		forgotten = true
		c.exited(p, exit{status: exitKilled, at: time.Now()})
	} else if st == stateCreated {
		// A created init is runc's created container: killing it ends it, the host
		// finishing the kill if the guest does not.
		if err := c.kill(ctx, run, p, uint32(syscall.SIGKILL), false); err != nil {
			return 0, exit{}, err
		}
		select {
		case <-p.exited:
		case <-ctx.Done():
			return 0, exit{}, ctx.Err()
		}
	}
	if p.execID == "" {
		if running := c.runningExecs(); len(running) > 0 && live() {
			return 0, exit{}, fmt.Errorf("container %s still has execs %q: %w", c.id, running, errdefs.ErrFailedPrecondition)
		}
	}
	// The pod's last container, or CRI's pod sandbox container: the VM stops with it, and the
	// agent's Shutdown ends it with everything else in the guest. Deleting it in the guest
	// first would only run the container runtime there once more (50–90 ms under TCG here)
	// before the VM's end. The pod's other containers left (after a pod sandbox's) are
	// ended by the host: their processes exit with exitKilled, and their Deletes follow.
	var ending *podRun
	var others []*Container
	if p.execID == "" && run != nil {
		ending, others = pod.takeEndingRun(c)
	}
	end := func() {
		markAllKilled(others)
		pod.endRun(ending, others)
	}
	if live() && !forgotten && ending == nil {
		if err := run.forget(ctx, p); err != nil {
			// A process the host declared exited may still run in the guest, which then
			// refuses to delete it (or its container): it stays in the VM until the pod ends,
			// and containerd's Delete is done.
			if !p.endedByHost() && (p.execID != "" || !c.hasStrays()) {
				return 0, exit{}, err
			}
			pod.guestLog.warn("stray-delete", log.G(pod.ctx).WithError(err).WithField("process", p.name()),
				"the guest did not delete a process (or the container of one) whose exit the host declared")
		}
	}
	if err := p.transition(opDelete, stateDeleted); err != nil {
		if ending != nil {
			// The concurrent Delete that won finds no run to stop: this one stops it.
			end()
		}
		return 0, exit{}, err // a concurrent Delete won
	}
	_, pid, e := p.snapshot()
	if p.execID != "" {
		c.forgetExec(p)
		return pid, e, nil
	}
	c.remove(run)
	pod.mu.Lock()
	delete(pod.containers, c.id)
	pod.mu.Unlock()
	pod.publish(&eventstypes.TaskDelete{ContainerID: c.id, Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at)})
	if ending != nil {
		end()
	} else {
		pod.stopPodIfEmpty()
	}
	return pid, e, nil
}
