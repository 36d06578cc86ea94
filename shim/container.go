package shim

import (
	"context"
	"encoding/json"
	"fmt"
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
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// container is one container of the pod.
type container struct {
	id, bundle string
	init       *process
	// Set by Create before the container is ready, read after: no lock.
	rootfsMounted bool     // <bundle>/rootfs was mounted by us
	binds         []string // names bound in the share, the rootfs (the id) first
	hooks         containerHooks

	mu    sync.Mutex
	ready bool                // guarded by mu; Create has finished
	execs map[string]*process // guarded by mu
}

// bindContainer puts container c's files in the pod's share: its root filesystem (Create's
// mounts, mounted on <bundle>/rootfs, or the spec's root path) at the container's id, then its
// bind mounts. It returns the guest paths of the host's mounts the recursive binds carried
// (CreateContainerRequest.submounts). What it did is undone by the functions it appends to
// undo.
func (o *PodOwner) bindContainer(pod Pod, c *container, r *taskAPI.CreateTaskRequest, spec *specs.Spec, hostBinds []HostBind, undo *[]func()) ([]string, error) {
	rootfs := filepath.Join(r.Bundle, "rootfs")
	if len(r.Rootfs) > 0 {
		if err := os.MkdirAll(rootfs, 0o711); err != nil {
			return nil, err
		}
		if err := mount.All(mount.FromProto(r.Rootfs), rootfs); err != nil {
			return nil, fmt.Errorf("mount the rootfs of %s: %w", r.ID, err)
		}
		c.rootfsMounted = true
		*undo = append(*undo, func() { unmountRootfs(o.ctx, rootfs) })
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
	*undo = append(*undo, func() { o.unbindAll(pod, c) })
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
func bindHost(pod Pod, b HostBind, userns map[string]*os.File) error {
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
// so a process killed before it starts still exits.
func (o *PodOwner) watch(run *podRun, c *container, p *process) {
	drainCtx, cancelDrain := context.WithCancel(run.ctx)
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
		defer cancelDrain()
		var e exit
		resp, err := run.agent.WaitProcess(run.ctx, &agent.WaitProcessRequest{ContainerId: p.cid, ExecId: p.execID})
		close(p.reported)
		switch {
		case err != nil && run.ctx.Err() != nil:
			e = exit{status: p.vmEndStatus(), at: time.Now()}
		case err != nil:
			// A lost connection is usually the pod's death, reported (and logged) just after.
			select {
			case <-run.pod.Done():
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
func (o *PodOwner) exited(c *container, p *process, e exit) {
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

// waitExecs waits (bounded) for the exits of c's started execs: containerd expects the
// init's TaskExit last.
func (o *PodOwner) waitExecs(c *container) {
	c.mu.Lock()
	var waits []chan struct{}
	for _, p := range c.execs {
		if st, _, _ := p.snapshot(); st == stateRunning || st == statePaused || st == stateStarting {
			waits = append(waits, p.exited)
		}
	}
	c.mu.Unlock()
	deadline := time.After(execsTimeout)
	for _, w := range waits {
		select {
		case <-w:
		case <-deadline:
			log.G(o.ctx).WithField("container", c.id).Warnf("its execs did not exit %v after its init", execsTimeout)
			return
		}
	}
}

// copyStdin copies the stdin fifo to the agent until it ends: the client closed its end, or
// CloseIO closed ours. Neither closes the process's stdin; only CloseIO does, after this copy
// has forwarded what it read. That is containerd's runc shim's behaviour: a client closing the
// fifo (ctr at the end of its input) has not asked for EOF.
func (o *PodOwner) copyStdin(run *podRun, p *process) {
	if p.io == nil || p.io.Stdin == nil {
		close(p.stdinDone)
		return
	}
	go func() {
		defer close(p.stdinDone)
		buf := make([]byte, readMax)
		for {
			n, rerr := p.io.Stdin.Read(buf)
			if n > 0 {
				if _, err := run.agent.WriteStdin(run.ctx, &agent.WriteStdinRequest{ContainerId: p.cid, ExecId: p.execID, Data: slices.Clone(buf[:n])}); err != nil {
					if run.ctx.Err() == nil {
						o.guestLog.warn("write-stdin", log.G(o.ctx).WithField("error", guestText(err.Error())).WithField("process", p.name()), "writing stdin")
					}
					return
				}
			}
			if rerr != nil {
				return
			}
		}
	}()
}

// agentDelete asks the agent to forget p; a process it does not know is already forgotten.
func (o *PodOwner) agentDelete(ctx context.Context, run *podRun, p *process) error {
	actx, cancel := run.call(ctx)
	defer cancel()
	_, err := run.agent.DeleteProcess(actx, &agent.DeleteProcessRequest{ContainerId: p.cid, ExecId: p.execID})
	if err != nil && run.live() && !agentErrIs(err, codes.NotFound, errdefs.ErrNotFound) {
		return fmt.Errorf("the agent deleting %s: %w", p.name(), err)
	}
	return nil
}

func (o *PodOwner) unbindAll(pod Pod, c *container) {
	for i := len(c.binds) - 1; i >= 0; i-- {
		if err := pod.Unbind(c.binds[i]); err != nil {
			log.G(o.ctx).WithError(err).WithField("container", c.id).Warnf("unbinding %s from the pod's share", c.binds[i])
		}
	}
	c.binds = nil
}

func unmountRootfs(ctx context.Context, rootfs string) {
	if err := mount.UnmountRecursive(rootfs, 0); err != nil {
		log.G(ctx).WithError(err).Warnf("unmounting %s", rootfs)
	}
}
