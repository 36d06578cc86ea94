package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	"github.com/containerd/log"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// A process's life after its creation, the container's to run: its output copied to
// containerd's streams, its stdin copied to the guest, its exit waited for and its exit
// sequence run (output drained, stdio closed, TaskExit, Wait released), and a SIGKILL the
// guest does not finish ended by the host.

// Timeouts of the exit sequence. A hostile or broken guest must not hold an exit forever.
const (
	// drainTimeout bounds, after the agent reported an exit, the copy of what is left of the
	// process's output.
	drainTimeout = 30 * time.Second
	// execsTimeout bounds how long an init's exit waits for its running execs' exits, which
	// containerd wants published first; the host then declares exited those the guest has not
	// reported (waitExecs), and waits as long again for their exit sequences.
	execsTimeout = 10 * time.Second
)

// watch starts p's output copies and its exit watcher. The exit watcher runs from creation,
// so a process killed before it starts still exits. p's own calls to the agent (the wait, the
// copies, Start's stdin copy) end with the pod, or when the host declares p exited
// (endByHost): then its output is cut, and its exit is exitKilled.
func (c *Container) watch(run *podRun, p *process) {
	calls, endCalls := context.WithCancel(run.ctx)
	p.mu.Lock()
	p.calls, p.endCalls = calls, endCalls
	if p.hostEnded { // declared before its Exec had returned
		endCalls()
	}
	p.mu.Unlock()
	drainCtx, cancelDrain := context.WithCancel(calls)
	var wg sync.WaitGroup
	copyOut := func(w interface{ Write([]byte) (int, error) }, read func(context.Context, *agent.ReadStreamRequest) (*agent.ReadStreamResponse, error), stream string) {
		defer wg.Done()
		var werr error
		for {
			resp, err := read(drainCtx, &agent.ReadStreamRequest{ContainerId: p.cid, ExecId: p.execID, Max: readMax})
			if err != nil {
				if drainCtx.Err() == nil {
					c.env.guestLog.warn("read-"+stream, log.G(c.env.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), "reading "+stream)
				}
				return
			}
			if len(resp.Data) > 0 && werr == nil {
				// A reader gone (containerd restarted) must not stop the drain: the
				// process would block on a full pty or pipe in the guest.
				if _, werr = w.Write(resp.Data); werr != nil {
					log.G(c.env.ctx).WithError(werr).WithField("process", p.name()).Warnf("writing %s", stream)
				}
			}
			if resp.Eof {
				return
			}
		}
	}
	if p.io.Stdout != nil {
		wg.Add(1)
		go copyOut(p.io.Stdout, run.agent.ReadStdout, "stdout")
	}
	if p.io.Stderr != nil {
		wg.Add(1)
		go copyOut(p.io.Stderr, run.agent.ReadStderr, "stderr")
	}
	go func() { wg.Wait(); close(p.outputDone) }()

	go func() {
		defer endCalls() // what is left of its calls (its stdin copy) ends with its exit
		defer cancelDrain()
		var e exit
		resp, err := run.agent.WaitProcess(calls, &agent.WaitProcessRequest{ContainerId: p.cid, ExecId: p.execID})
		close(p.reported)
		switch {
		case err != nil && run.ctx.Err() != nil:
			e = exit{status: p.vmEndStatus(), at: time.Now()}
		case err != nil && p.endedByHost():
			e = exit{status: exitKilled, at: time.Now()} // its output copies were cut with its wait
		case err != nil:
			// A lost connection is usually the pod's death, reported (and logged) just after.
			select {
			case <-run.vm.Done():
			case <-time.After(2 * time.Second):
				c.env.guestLog.warn("wait", log.G(c.env.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), fmt.Sprintf("the agent's wait failed: exit status %d", exitVMDied))
			}
			e = exit{status: p.vmEndStatus(), at: time.Now()}
		default:
			e = exit{status: resp.ExitStatus, at: time.Now()}
			if t := resp.ExitedAt; t != nil && t.IsValid() {
				e.at = t.AsTime()
			}
		}
		select {
		case <-p.outputDone:
		case <-run.ctx.Done():
		case <-time.After(drainTimeout):
			log.G(c.env.ctx).WithField("process", p.name()).Warnf("its output was not drained %v after its exit: cut", drainTimeout)
		}
		c.exited(p, e)
	}()
}

// exited runs p's exit sequence once: output drained (by the caller), stdio closed, the exit
// recorded, TaskExit published, Wait released. An exit that comes while the process is
// starting waits for Start to publish TaskStart first.
func (c *Container) exited(p *process, e exit) {
	p.mu.Lock()
	if p.finishing {
		p.mu.Unlock()
		return
	}
	if p.state == stateStarting {
		p.pending = &e
		p.mu.Unlock()
		return
	}
	p.finishing = true
	p.mu.Unlock()

	if p.execID == "" {
		c.waitExecs()
	}
	if p.io != nil {
		if err := p.io.Close(); err != nil {
			log.G(c.env.ctx).WithError(err).WithField("process", p.name()).Warn("closing stdio")
		}
	}
	p.mu.Lock()
	p.state, p.exit = stateStopped, e
	pid := p.pid
	p.mu.Unlock()
	c.env.publish(&eventstypes.TaskExit{
		ContainerID: p.cid, ID: execOrContainer(p), Pid: pid, ExitStatus: e.status, ExitedAt: timestamppb.New(e.at),
	})
	close(p.exited)
}

func execOrContainer(p *process) string {
	if p.execID == "" {
		return p.cid
	}
	return p.execID
}

// waitExecs waits for the exits of c's execs, which containerd wants published before the
// init's. The started ones get execsTimeout to exit; then every exec the guest has not
// reported (a created one at once) is declared exited by the host (exitKilled: the end of a
// container's init kills what runs in its PID namespace, and an exec the guest does not
// report then is its to account for, not the host's to wait on), and their exit sequences are
// waited for, within execsTimeout again: so the container's Delete finds no exec running.
func (c *Container) waitExecs() {
	c.mu.Lock()
	execs := slices.Collect(maps.Values(c.execs))
	c.mu.Unlock()
	deadline := time.NewTimer(execsTimeout)
	defer deadline.Stop()
wait:
	for _, p := range execs {
		if st, _, _ := p.snapshot(); st == stateCreated {
			continue // never started: no exit to wait for
		}
		select {
		case <-p.exited:
		case <-deadline.C:
			break wait
		}
	}
	var declared []string
	for _, p := range execs {
		if c.endExecByHost(p) {
			declared = append(declared, p.execID)
		}
	}
	if len(declared) > 0 {
		c.env.guestLog.warn("exec-exits", log.G(c.env.ctx).WithField("container", c.id).WithField("execs", declared),
			fmt.Sprintf("execs the guest did not report exited after the init: the host declares them exited (%d)", exitKilled))
	}
	deadline.Reset(execsTimeout)
	for _, p := range execs {
		select {
		case <-p.exited:
		case <-deadline.C:
			log.G(c.env.ctx).WithField("container", c.id).Warnf("its execs had not exited %v after the host declared them exited", execsTimeout)
			return
		}
	}
}

// copyStdin copies the stdin fifo to the agent until its end of file, which comes once CloseIO
// has closed the shim's write side and the client its own (package stdio), and then closes the
// process's stdin in the guest: every byte written before is delivered first. The client
// closing its side alone has not asked for EOF (ctr at the end of its input). That is
// containerd's runc shim's behaviour. The copy also ends when the process's streams are closed
// (its exit) or the pod ends.
func (c *Container) copyStdin(run *podRun, p *process) {
	if p.io == nil || p.io.Stdin == nil {
		return
	}
	ctx := p.callContext()
	go func() {
		buf := make([]byte, readMax)
		for {
			n, rerr := p.io.Stdin.Read(buf)
			if n > 0 {
				if _, err := run.agent.WriteStdin(ctx, &agent.WriteStdinRequest{ContainerId: p.cid, ExecId: p.execID, Data: slices.Clone(buf[:n])}); err != nil {
					if ctx.Err() == nil {
						c.env.guestLog.warn("write-stdin", log.G(c.env.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), "writing stdin")
					}
					return
				}
			}
			if errors.Is(rerr, io.EOF) {
				if err := run.closeStdin(ctx, p); err != nil && run.live() {
					c.env.guestLog.warn("close-stdin", log.G(c.env.ctx).WithError(err).WithField("process", p.name()), "closing stdin")
				}
				return
			}
			if rerr != nil {
				return
			}
		}
	}()
}

// enforceKill ends p, SIGKILLed, unless the agent reports its exit within
// GuestLimits.KillGrace. (What follows the report, the drain of its output and its execs'
// exits, has bounds of its own and is no longer the guest's to confirm.)
//
// A container's init is ended by killing the pod's VM: the guest cannot be trusted to have
// killed one container and not the others, and a container's end is what frees what the host
// gave it (its binds in the share, its rootfs, CRI's pod stop after it). An exec is declared
// exited by the host (exitKilled: its output cut, TaskExit published, Wait released, Delete
// allowed), and the pod goes on. That is not counted as the guest's misbehaviour at the door:
// a healthy guest's exec can outlive a SIGKILL for as long as it sleeps uninterruptibly (a
// hung mount, a stuck device), which must not take its pod down; and a guest that keeps an
// exec running on purpose gains nothing root in it could not have anyway, since the process
// runs inside the VM, on the pod's resources, and the host keeps nothing of it once deleted.
func (c *Container) enforceKill(run *podRun, p *process) {
	grace := c.env.limits.KillGrace
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.reported:
		return
	case <-run.ctx.Done(): // the pod ended: p's exit comes with it
		return
	case <-t.C:
	}
	why := fmt.Errorf("the guest did not end %s within %v of SIGKILL", p.name(), grace)
	if p.execID == "" {
		run.door.cutOff(why)
		return
	}
	if c.endExecByHost(p) {
		c.env.guestLog.warn("exec-kill", log.G(c.env.ctx).WithError(why),
			fmt.Sprintf("the host declares the exec exited (%d); it may still run in the guest", exitKilled))
	}
}
