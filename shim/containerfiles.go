package shim

// A container's files on the host: its root filesystem and volumes bound into the pod's share,
// and its bundle's spec.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// bind puts c's files in the pod's share: its root filesystem (Create's mounts, mounted on
// <bundle>/rootfs, or the spec's root path) at the container's id, then its bind mounts. It
// returns the guest paths of the host's mounts the recursive binds carried
// (CreateContainerRequest.submounts). What it did is undone by the functions it appends to
// undo.
func (c *Container) bind(pod VM, r *taskAPI.CreateTaskRequest, spec *specs.Spec, hostBinds []HostBind, undo *[]func()) ([]string, error) {
	rootfs := filepath.Join(r.Bundle, "rootfs")
	if len(r.Rootfs) > 0 {
		if err := os.MkdirAll(rootfs, 0o711); err != nil {
			return nil, err
		}
		if err := mount.All(mount.FromProto(r.Rootfs), rootfs); err != nil {
			return nil, fmt.Errorf("mount the rootfs of %s: %w", r.ID, err)
		}
		c.rootfsMounted = true
		*undo = append(*undo, func() { unmountRootfs(c.env.ctx, rootfs) })
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
	*undo = append(*undo, func() { c.unbind(pod) })
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

// unbind takes c's files out of the pod's share, the last bound first.
func (c *Container) unbind(pod VM) {
	for i := len(c.binds) - 1; i >= 0; i-- {
		if err := pod.Unbind(c.binds[i]); err != nil {
			log.G(c.env.ctx).WithError(err).WithField("container", c.id).Warnf("unbinding %s from the pod's share", c.binds[i])
		}
	}
	c.binds = nil
}

func unmountRootfs(ctx context.Context, rootfs string) {
	if err := mount.UnmountRecursive(rootfs, 0); err != nil {
		log.G(ctx).WithError(err).Warnf("unmounting %s", rootfs)
	}
}
