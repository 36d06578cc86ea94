package agent

import (
	"context"
	"encoding/json"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/sirupsen/logrus"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Containers: their specs checked and created with the runtime, their stats, resources, pause
// and resume, and their OOM events.

// decodeJSON decodes the request's JSON document what (a spec, a process, resources) into v,
// at most specLimit bytes; errors are InvalidArgument naming it.
func decodeJSON(what string, data []byte, v any) error {
	if len(data) > specLimit {
		return errf(errdefs.ErrInvalidArgument, "%s is %d bytes, more than %d", what, len(data), specLimit)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return errf(errdefs.ErrInvalidArgument, "%s: %v", what, err)
	}
	return nil
}

// parseSpec decodes and checks a container's spec and adapts it to the request's stdio.
func (s *Service) parseSpec(id string, data []byte, stdio *apiv1.Stdio) (*specs.Spec, error) {
	if len(data) == 0 {
		return nil, errf(errdefs.ErrInvalidArgument, "spec is empty")
	}
	var spec specs.Spec
	if err := decodeJSON("spec", data, &spec); err != nil {
		return nil, err
	}
	switch {
	case spec.Process == nil:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: process is missing")
	case len(spec.Process.Args) == 0:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: process.args is empty")
	case spec.Root == nil || spec.Root.Path == "":
		return nil, errf(errdefs.ErrInvalidArgument, "spec: root.path is missing")
	case spec.Linux == nil:
		return nil, errf(errdefs.ErrInvalidArgument, "spec: linux is missing")
	}
	root := filepath.Clean(spec.Root.Path)
	if !filepath.IsAbs(root) || !strings.HasPrefix(root, s.cfg.RootDir+"/") {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: root.path %q is not below %s", spec.Root.Path, s.cfg.RootDir)
	}
	if h := spec.Hooks; h != nil && (len(h.Prestart) > 0 || len(h.CreateRuntime) > 0 || len(h.Poststart) > 0 || len(h.Poststop) > 0) {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: prestart, createRuntime, poststart and poststop hooks run on the host, not in the guest")
	}
	spec.Root.Path = root
	spec.Process.Terminal = stdio != nil && stdio.Terminal
	if spec.Linux.CgroupsPath == "" {
		spec.Linux.CgroupsPath = path.Join(apiv1.ContainersCgroup, id)
	}
	if !strings.HasPrefix(spec.Linux.CgroupsPath, "/") {
		return nil, errf(errdefs.ErrInvalidArgument, "spec: linux.cgroupsPath %q is not an absolute cgroup path (the guest runs runc with cgroupfs)", spec.Linux.CgroupsPath)
	}
	if err := s.joinPodNamespaces(spec.Linux); err != nil {
		return nil, err
	}
	return &spec, nil
}

// CreateContainer writes the bundle and creates the container with runc.
func (s *Service) CreateContainer(ctx context.Context, req *apiv1.CreateContainerRequest) (_ *apiv1.CreateContainerResponse, err error) {
	id := req.ContainerId
	if err := checkID("container_id", id); err != nil {
		return nil, err
	}
	spec, err := s.parseSpec(id, req.Spec, req.Stdio)
	if err != nil {
		return nil, err
	}
	if err := apiv1.CheckSubmounts(req.Submounts); err != nil {
		return nil, errf(errdefs.ErrInvalidArgument, "%v", err)
	}
	if err := apiv1.CheckPodTmpfs(req.PodTmpfs); err != nil {
		return nil, errf(errdefs.ErrInvalidArgument, "%v", err)
	}
	if err := apiv1.CheckMirrored(req.Mirrored); err != nil {
		return nil, errf(errdefs.ErrInvalidArgument, "%v", err)
	}
	c := &container{id: id, bundle: filepath.Join(s.cfg.StateDir, id), cgroup: spec.Linux.CgroupsPath, execs: make(map[string]*process)}
	p, err := newProcess(c, "", req.Stdio)
	if err != nil {
		return nil, err
	}
	c.init = p
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	err = s.checkNewLocked(id)
	if err == nil {
		s.containers[id] = c
	}
	s.mu.Unlock()
	if err != nil {
		p.closeChildIO()
		s.mu.Lock()
		s.releaseLocked(p)
		s.mu.Unlock()
		return nil, err
	}
	defer func() {
		if err != nil {
			s.mu.Lock()
			c.gone = true
			delete(s.containers, id)
			// Whoever waits for this init hears that it is gone.
			s.exitLocked(p, 255, time.Now())
			s.releaseLocked(p)
			s.mu.Unlock()
			s.mounts.release(c.pins)
			s.endMirrors(c)
			os.RemoveAll(c.bundle)
		}
	}()

	if err := s.podTmpfs.ensure(req.PodTmpfs); err != nil {
		return nil, err
	}
	if err := s.startMirrors(c, req.Mirrored); err != nil {
		return nil, err
	}
	readOnlyMirrors(spec, s.cfg.MirrorDir)
	if err := writeBundle(c.bundle, spec); err != nil {
		return nil, errf(errdefs.ErrInternal, "bundle: %v", err)
	}
	c.pins = s.mounts.pin(spec, req.Submounts)
	col := s.startCollecting()
	cr, err := s.cfg.Runtime.Create(context.WithoutCancel(ctx), id, c.bundle, p.childIO)
	p.closeChildIO()
	if err != nil {
		s.stopCollecting(col)
		return nil, runtimeErr("runc create", err)
	}
	p.started(cr)
	s.mu.Lock()
	p.console = cr.Console
	s.registerLocked(p, col, cr.Pid)
	ctxOOM, stop := context.WithCancel(context.Background())
	c.stopOOM = stop
	s.mu.Unlock()
	go s.cfg.Cgroups.WatchOOM(ctxOOM, c.cgroup, func() { s.queueOOM(id) })
	s.log.WithFields(logrus.Fields{"container": id, "pid": cr.Pid}).Info("container created")
	return &apiv1.CreateContainerResponse{Pid: uint32(cr.Pid)}, nil
}

// checkNewLocked says whether a container id can be created now.
func (s *Service) checkNewLocked(id string) error {
	if s.shutting {
		return errShuttingDown
	}
	if _, ok := s.containers[id]; ok {
		return errf(errdefs.ErrAlreadyExists, "container %q already exists", id)
	}
	return nil
}

func writeBundle(dir string, spec *specs.Spec) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	data, err := json.Marshal(spec)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
}

// Stats answers the container cgroup's metrics, or without a container id the pod's: those of
// ContainersCgroup.
func (s *Service) Stats(ctx context.Context, req *apiv1.StatsRequest) (*apiv1.StatsResponse, error) {
	group := apiv1.ContainersCgroup
	if req.ContainerId != "" {
		c, err := s.lookup(req.ContainerId)
		if err != nil {
			return nil, err
		}
		group = c.cgroup
	}
	m, err := s.cfg.Cgroups.Stats(group)
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "cgroup %s: %v", group, err)
	}
	a, err := typeurl.MarshalAnyToProto(m)
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "marshal stats: %v", err)
	}
	return &apiv1.StatsResponse{Stats: a}, nil
}

// UpdateContainer applies new resource limits.
func (s *Service) UpdateContainer(ctx context.Context, req *apiv1.UpdateContainerRequest) (*apiv1.UpdateContainerResponse, error) {
	c, err := s.lookup(req.ContainerId)
	if err != nil {
		return nil, err
	}
	var r specs.LinuxResources
	if err := decodeJSON("resources", req.Resources, &r); err != nil {
		return nil, err
	}
	c.op.Lock()
	defer c.op.Unlock()
	if err := s.cfg.Runtime.Update(context.WithoutCancel(ctx), c.id, &r); err != nil {
		return nil, runtimeErr("runc update", err)
	}
	return &apiv1.UpdateContainerResponse{}, nil
}

// PauseContainer freezes the container.
func (s *Service) PauseContainer(ctx context.Context, req *apiv1.PauseContainerRequest) (*apiv1.PauseContainerResponse, error) {
	if err := s.setPaused(ctx, req.ContainerId, true); err != nil {
		return nil, err
	}
	return &apiv1.PauseContainerResponse{}, nil
}

// ResumeContainer thaws the container.
func (s *Service) ResumeContainer(ctx context.Context, req *apiv1.ResumeContainerRequest) (*apiv1.ResumeContainerResponse, error) {
	if err := s.setPaused(ctx, req.ContainerId, false); err != nil {
		return nil, err
	}
	return &apiv1.ResumeContainerResponse{}, nil
}

func (s *Service) setPaused(ctx context.Context, id string, pause bool) error {
	c, err := s.lookup(id)
	if err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	s.mu.Lock()
	state, paused, gone := c.init.state, c.paused, c.gone
	s.mu.Unlock()
	switch {
	case gone:
		return errf(errdefs.ErrNotFound, "container %q not found", id)
	case state != stateRunning:
		return errf(errdefs.ErrFailedPrecondition, "container %q is %s, not running", id, state)
	case pause && paused:
		return errf(errdefs.ErrFailedPrecondition, "container %q is already paused", id)
	case !pause && !paused:
		return errf(errdefs.ErrFailedPrecondition, "container %q is not paused", id)
	}
	if pause {
		err = s.cfg.Runtime.Pause(context.WithoutCancel(ctx), id)
	} else {
		err = s.cfg.Runtime.Resume(context.WithoutCancel(ctx), id)
	}
	if err != nil {
		return runtimeErr("runc pause/resume", err)
	}
	s.mu.Lock()
	c.paused = pause
	s.mu.Unlock()
	return nil
}

func (s *Service) queueOOM(id string) {
	select {
	case s.oom <- id:
		s.log.WithField("container", id).Warn("OOM kill")
	default:
		s.log.WithField("container", id).Warn("OOM kill not queued: the queue is full")
	}
}

// GetOOMEvent waits for the next OOM kill.
func (s *Service) GetOOMEvent(ctx context.Context, _ *apiv1.GetOOMEventRequest) (*apiv1.GetOOMEventResponse, error) {
	if err := s.checkServing(); err != nil {
		return nil, err
	}
	select {
	case id := <-s.oom:
		return &apiv1.GetOOMEventResponse{ContainerId: id}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-s.done:
		return nil, errShuttingDown
	}
}
