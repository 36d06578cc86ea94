package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sync"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// Timeouts of the exit sequence. A hostile or broken guest must not hold an exit forever.
const (
	// drainTimeout bounds, after the agent reported an exit, the copy of what is left of the
	// process's output.
	drainTimeout = 30 * time.Second
	// execsTimeout bounds how long an init's exit waits for its running execs' exits, which
	// containerd wants published first; the host then declares exited those the guest has not
	// reported (waitExecs), and waits as long again for their exit sequences.
	execsTimeout = 10 * time.Second
	// readMax is the most bytes asked of the agent per ReadStdout/ReadStderr.
	readMax = 32 << 10
)

// Container is one Container of the pod.
type Container struct {
	id, bundle string
	init       *process
	// Set by Create before the container is ready, read after: no lock.
	rootfsMounted bool     // <bundle>/rootfs was mounted by us
	binds         []string // names bound in the share, the rootfs (the id) first
	hooks         containerHooks

	stats statsCache // the guest's last Stats answer (stats.go)

	mu    sync.Mutex
	ready bool                // guarded by mu; Create has finished
	execs map[string]*process // guarded by mu
	// strays says the host declared an exec of c exited that the guest had not reported
	// (guarded by mu): it may still run there, and the guest may refuse to delete c for it.
	strays bool
}

// endExecByHost declares c's exec p exited without the guest's report (process.endByHost),
// and says whether it did. The stray is recorded under c.mu with the declaration (lock order:
// c.mu, then p.mu): a Wait that returns may be followed at once by the container's Delete,
// which must find it.
func (c *Container) endExecByHost(p *process) bool {
	c.mu.Lock()
	endCalls, ok := p.endByHost()
	if ok {
		c.strays = true
	}
	c.mu.Unlock()
	if endCalls != nil {
		endCalls()
	}
	return ok
}

// hasStrays says whether the host declared an exec of c exited that the guest had not
// reported.
func (c *Container) hasStrays() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.strays
}

// bind puts c's files in the pod's share: its root filesystem (Create's mounts, mounted on
// <bundle>/rootfs, or the spec's root path) at the container's id, then its bind mounts. It
// returns the guest paths of the host's mounts the recursive binds carried
// (CreateContainerRequest.submounts). What it did is undone by the functions it appends to
// undo. ctx is the shim's: its logger.
func (c *Container) bind(ctx context.Context, pod VM, r *taskAPI.CreateTaskRequest, spec *specs.Spec, hostBinds []HostBind, undo *[]func()) ([]string, error) {
	rootfs := filepath.Join(r.Bundle, "rootfs")
	if len(r.Rootfs) > 0 {
		if err := os.MkdirAll(rootfs, 0o711); err != nil {
			return nil, err
		}
		if err := mount.All(mount.FromProto(r.Rootfs), rootfs); err != nil {
			return nil, fmt.Errorf("mount the rootfs of %s: %w", r.ID, err)
		}
		c.rootfsMounted = true
		*undo = append(*undo, func() { unmountRootfs(ctx, rootfs) })
	} else if spec.Root != nil && spec.Root.Path != "" {
		rootfs = spec.Root.Path
		if !filepath.IsAbs(rootfs) {
			rootfs = filepath.Join(r.Bundle, rootfs)
		}
	}
	if err := bindRootfs(pod, rootfs, r.ID, spec); err != nil {
		return nil, fmt.Errorf("bind the rootfs of %s into the pod's share: %w", r.ID, err)
	}
	c.binds = append(c.binds, r.ID)
	*undo = append(*undo, func() { c.unbind(ctx, pod) })
	recursive := []string{r.ID}
	// One user namespace per mapping the container's idmapped binds use (most often one,
	// for /etc/hosts, hostname and resolv.conf alike), each made by a process of its own.
	userns := map[string]*os.File{}
	defer func() {
		for _, f := range userns {
			f.Close()
		}
	}()
	for _, b := range hostBinds {
		if err := bindHost(pod, b, userns); err != nil {
			return nil, fmt.Errorf("bind mount %s of %s into the pod's share: %w", b.Source, r.ID, err)
		}
		c.binds = append(c.binds, b.Name)
		if b.Flags&sandbox.BindRecursive != 0 {
			recursive = append(recursive, b.Name)
		}
	}
	var submounts []string
	for _, name := range recursive {
		below, err := pod.Submounts(name)
		if err != nil {
			return nil, fmt.Errorf("the mounts below %s in the pod's share: %w", name, err)
		}
		for _, rel := range below {
			submounts = append(submounts, path.Join(agent.SharedDir, name, rel))
		}
	}
	if len(submounts) > agent.MaxSubmounts {
		return nil, fmt.Errorf("container %s: %d mounts below its root and volumes, more than %d: %w", r.ID, len(submounts), agent.MaxSubmounts, errdefs.ErrInvalidArgument)
	}
	return submounts, nil
}

// bindHost binds b into the pod's share, idmapped by a user namespace of its mappings if it
// has them: the one in userns (by the mappings) if there is one, else a new one it adds there.
func bindHost(pod VM, b HostBind, userns map[string]*os.File) error {
	if b.UIDMappings == nil {
		return pod.Bind(b.Source, b.Name, b.Flags)
	}
	key := fmt.Sprint(b.UIDMappings, b.GIDMappings)
	ns, ok := userns[key]
	if !ok {
		var err error
		if ns, err = sandbox.UserNamespace(idMappings(b.UIDMappings), idMappings(b.GIDMappings)); err != nil {
			return fmt.Errorf("a user namespace for its idmapped mount: %w", err)
		}
		userns[key] = ns
	}
	return pod.BindIDMapped(b.Source, b.Name, b.Flags, ns)
}

func idMappings(m []specs.LinuxIDMapping) []sandbox.IDMapping {
	out := make([]sandbox.IDMapping, len(m))
	for i, e := range m {
		out[i] = sandbox.IDMapping{ContainerID: e.ContainerID, HostID: e.HostID, Size: e.Size}
	}
	return out
}

func readSpec(bundle string) (*specs.Spec, error) {
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("the bundle's spec: %w", err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(b, &spec); err != nil {
		return nil, fmt.Errorf("the bundle's spec %s: %v: %w", filepath.Join(bundle, "config.json"), err, errdefs.ErrInvalidArgument)
	}
	return &spec, nil
}

// watch starts p's output copies and its exit watcher. The exit watcher runs from creation,
// so a process killed before it starts still exits. p's own calls to the agent (the wait, the
// copies, Start's stdin copy) end with the pod, or when the host declares p exited
// (endByHost): then its output is cut, and its exit is exitKilled.
func (o *Pod) watch(run *podRun, c *Container, p *process) {
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
					o.guestLog.warn("read-"+stream, log.G(o.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), "reading "+stream)
				}
				return
			}
			if len(resp.Data) > 0 && werr == nil {
				// A reader gone (containerd restarted) must not stop the drain: the
				// process would block on a full pty or pipe in the guest.
				if _, werr = w.Write(resp.Data); werr != nil {
					log.G(o.ctx).WithError(werr).WithField("process", p.name()).Warnf("writing %s", stream)
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
				o.guestLog.warn("wait", log.G(o.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), fmt.Sprintf("the agent's wait failed: exit status %d", exitVMDied))
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
			log.G(o.ctx).WithField("process", p.name()).Warnf("its output was not drained %v after its exit: cut", drainTimeout)
		}
		o.exited(c, p, e)
	}()
}

// exited runs p's exit sequence once: output drained (by the caller), stdio closed, the exit
// recorded, TaskExit published, Wait released. An exit that comes while the process is
// starting waits for Start to publish TaskStart first.
func (o *Pod) exited(c *Container, p *process, e exit) {
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
		o.waitExecs(c)
	}
	if p.io != nil {
		if err := p.io.Close(); err != nil {
			log.G(o.ctx).WithError(err).WithField("process", p.name()).Warn("closing stdio")
		}
	}
	p.mu.Lock()
	p.state, p.exit = stateStopped, e
	pid := p.pid
	p.mu.Unlock()
	o.publish(&eventstypes.TaskExit{
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
func (o *Pod) waitExecs(c *Container) {
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
		o.guestLog.warn("exec-exits", log.G(o.ctx).WithField("container", c.id).WithField("execs", declared),
			fmt.Sprintf("execs the guest did not report exited after the init: the host declares them exited (%d)", exitKilled))
	}
	deadline.Reset(execsTimeout)
	for _, p := range execs {
		select {
		case <-p.exited:
		case <-deadline.C:
			log.G(o.ctx).WithField("container", c.id).Warnf("its execs had not exited %v after the host declared them exited", execsTimeout)
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
func (o *Pod) copyStdin(run *podRun, p *process) {
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
						o.guestLog.warn("write-stdin", log.G(o.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), "writing stdin")
					}
					return
				}
			}
			if errors.Is(rerr, io.EOF) {
				if err := run.closeStdin(ctx, p); err != nil && run.live() {
					o.guestLog.warn("close-stdin", log.G(o.ctx).WithError(err).WithField("process", p.name()), "closing stdin")
				}
				return
			}
			if rerr != nil {
				return
			}
		}
	}()
}

// closeStdin closes p's stdin in the guest (for a terminal, the agent sends its end-of-file
// character).
func (run *podRun) closeStdin(ctx context.Context, p *process) error {
	if _, err := run.agent.CloseStdin(ctx, &agent.CloseStdinRequest{ContainerId: p.cid, ExecId: p.execID}); err != nil {
		return fmt.Errorf("the agent closing the stdin of %s: %w", p.name(), err)
	}
	return nil
}

// forget asks the agent to forget p; a process it does not know is already forgotten.
func (run *podRun) forget(ctx context.Context, p *process) error {
	_, err := run.agent.DeleteProcess(ctx, &agent.DeleteProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	if err != nil && run.live() && !errdefs.IsNotFound(err) {
		return fmt.Errorf("the agent deleting %s: %w", p.name(), err)
	}
	return nil
}

// unbind takes c's files out of the pod's share, the last bound first. ctx is the shim's: its
// logger.
func (c *Container) unbind(ctx context.Context, pod VM) {
	for i := len(c.binds) - 1; i >= 0; i-- {
		if err := pod.Unbind(c.binds[i]); err != nil {
			log.G(ctx).WithError(err).WithField("container", c.id).Warnf("unbinding %s from the pod's share", c.binds[i])
		}
	}
	c.binds = nil
}

func unmountRootfs(ctx context.Context, rootfs string) {
	if err := mount.UnmountRecursive(rootfs, 0); err != nil {
		log.G(ctx).WithError(err).Warnf("unmounting %s", rootfs)
	}
}

// markKilled marks every process of cs as killed by the host: those the pod's end that
// follows ends exit with exitKilled.
func markKilled(cs []*Container) {
	for _, c := range cs {
		c.init.markKilled()
		c.mu.Lock()
		for _, e := range c.execs {
			e.markKilled()
		}
		c.mu.Unlock()
	}
}

// containerHooks is what a container's host hooks are run with: its spec's hooks and
// annotations. (AdaptSpec gives the guest the container-namespace phases.)
type containerHooks struct {
	hooks       *specs.Hooks
	annotations map[string]string
}
