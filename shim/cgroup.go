package shim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/containerd/cgroups/v3"
	"github.com/containerd/cgroups/v3/cgroup1"
	"github.com/containerd/cgroups/v3/cgroup2"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/types/known/anypb"
)

// The pod's host cgroup. containerd's CRI (sandboxer "podsandbox") reads a pod's stats
// (crictl statsp) from the host cgroup of its pod, the parent of the cgroup its pause
// container's spec names (linux.cgroupsPath). Here the VM is the pod, so the shim joins that
// cgroup before it starts the pod's kvfsd and QEMU, which are born in it, and stays there for
// the pod's life, as Kata's shim does with sandbox_cgroup_only: the pod's CPU and memory on
// the host are the VM's, its server's and the shim's. At the pod's end the shim goes back to
// the cgroup it came from and removes the pod's; after a shim crash the delete action removes
// it (Cleanup). On a host with cgroup v1 (or hybrid, cgroup2 at /sys/fs/cgroup/unified and
// the controllers on v1, as containerd reads them) the shim joins every v1 hierarchy; with
// cgroup v2 only, the unified one.
//
// The path is containerd's cgroupfs driver's (an absolute, clean path) or its systemd
// driver's (SystemdCgroup = true: slice:prefix:name, cgroup_systemd.go). For a systemd one the
// shim asks systemd for the scope prefix-name.scope in the slice, with itself in it, as runc's
// systemd driver does for a container, then joins the scope's cgroupfs path (the slice's
// expanded path and the scope) as above; at the pod's end, or in the delete action after a
// crash, it stops the scope. Both cgroup modes are taken for either driver. Where systemd is
// not running, a systemd path is an error that fails the pod's start (nothing is made): the
// pod never runs outside the cgroup it was given.
//
// With CRI's sandboxer "shim" there is no pause container: the Sandbox API's CreateSandbox
// gets the pod's cgroup parent (the pod's CRI config, linux.cgroup_parent: the kubelet's
// kubepods/.../pod<uid>, or its pod slice) and the shim derives from it the cgroup podsandbox
// would give the pause container (sandboxCgroupPath), joined the same way; its pod stats
// (SandboxMetrics) are then the parent's, read on the host as podsandbox reads them
// (podCgroupMetrics; a slice's at its expanded path).

// sandboxCgroupPath is the cgroup containerd's CRI (podsandbox) gives the pause container of
// pod id under the pod's cgroup parent: for a systemd slice (a parent whose last element ends
// in .slice) the systemd path slice:cri-containerd:id, else parent/id; none without a parent.
func sandboxCgroupPath(parent, id string) string {
	if parent == "" {
		return ""
	}
	if base := path.Base(parent); strings.HasSuffix(base, ".slice") {
		return base + ":cri-containerd:" + id
	}
	return filepath.Join(parent, id)
}

// podCgroupMetrics reads the CPU and memory figures of the host cgroup at path (a cgroupfs
// path, checkCgroupPath) as containerd's podsandbox reads a pod's cgroup parent: a cgroup2
// Metrics on a host with cgroup v2 only, else a cgroup v1 one (the v1 hierarchies: hybrid
// hosts too).
func podCgroupMetrics(path string) (*anypb.Any, error) {
	if err := checkCgroupPath(path); err != nil {
		return nil, err
	}
	var data any
	if cgroups.Mode() == cgroups.Unified {
		m, err := cgroup2.Load(path)
		if err != nil {
			return nil, fmt.Errorf("the pod's cgroup %s: %w", path, err)
		}
		if data, err = m.StatFiltered(cgroup2.StatCPU | cgroup2.StatMemory); err != nil {
			return nil, fmt.Errorf("the pod's cgroup %s: %w", path, err)
		}
	} else {
		cg, err := cgroup1.Load(cgroup1.StaticPath(path))
		if err != nil {
			return nil, fmt.Errorf("the pod's cgroup %s: %w", path, err)
		}
		if data, err = cg.Stat(cgroup1.IgnoreNotExist); err != nil {
			return nil, fmt.Errorf("the pod's cgroup %s: %w", path, err)
		}
	}
	return typeurl.MarshalAnyToProto(data)
}

// podCgroup is the pod's cgroup the shim joined, and where the shim was before.
type podCgroup struct {
	path       string // as given: a cgroupfs or a systemd path
	fs         string // its cgroupfs path
	scope      string // the systemd scope unit of a systemd path
	v1, v1From cgroup1.Cgroup
	v2, v2From *cgroup2.Manager
}

// checkCgroupPath checks that path is a cgroupfs path the shim can join: absolute, clean,
// not the root.
func checkCgroupPath(path string) error {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path || path == "/" || strings.Contains(path, ":") {
		return fmt.Errorf("cgroup path %q: want an absolute, clean cgroupfs path below the root, or a systemd slice:prefix:name path", path)
	}
	return nil
}

// resolvePodCgroup reads the pod's cgroup path p: its cgroupfs path, and for a systemd path its
// scope (nil for a cgroupfs one).
func resolvePodCgroup(p string) (string, *systemdScope, error) {
	if !isSystemdCgroupPath(p) {
		if err := checkCgroupPath(p); err != nil {
			return "", nil, err
		}
		return p, nil, nil
	}
	s, err := parseSystemdCgroup(p)
	if err != nil {
		return "", nil, err
	}
	return s.fs, &s, nil
}

// checkPodCgroup checks that the shim can join the pod's cgroup path p: a well-formed path,
// and systemd running for a systemd one.
func checkPodCgroup(p string) error {
	_, scope, err := resolvePodCgroup(p)
	if err == nil && scope != nil {
		err = checkSystemdRunning(p)
	}
	return err
}

// podCgroupParent is the cgroupfs path of the parent of the pod's cgroup p: where containerd's
// podsandbox reads the pod's stats (for a systemd path, the slice's expanded path).
func podCgroupParent(p string) (string, error) {
	fs, _, err := resolvePodCgroup(p)
	if err != nil {
		return "", err
	}
	return filepath.Dir(fs), nil
}

// joinPodCgroup moves the shim into the pod's cgroup path: for a systemd path into its scope,
// which systemd makes (an error where systemd is not running); then the cgroupfs path is made
// in every hierarchy (see above) and joined. What the shim starts afterwards is born there.
func joinPodCgroup(ctx context.Context, path string) (_ *podCgroup, retErr error) {
	fs, scope, err := resolvePodCgroup(path)
	if err != nil {
		return nil, err
	}
	if scope != nil {
		if err := checkSystemdRunning(path); err != nil {
			return nil, err
		}
	}
	c := &podCgroup{path: path, fs: fs}
	self := os.Getpid()
	// Where the shim is now, to go back to at the pod's end.
	if cgroups.Mode() == cgroups.Unified {
		from, err := cgroup2.PidGroupPath(self)
		if err != nil {
			return nil, fmt.Errorf("the shim's cgroup: %w", err)
		}
		if c.v2From, err = cgroup2.Load(from); err != nil {
			return nil, fmt.Errorf("the shim's cgroup %s: %w", from, err)
		}
	} else if c.v1From, err = cgroup1.Load(cgroup1.PidPath(self)); err != nil {
		return nil, fmt.Errorf("the shim's cgroups: %w", err)
	}
	if scope != nil {
		// From here the shim is in the scope: a failure leaves it and stops the scope.
		c.scope = scope.unit
		if err := startScope(ctx, *scope, self); err != nil {
			_ = c.leave(ctx)
			return nil, fmt.Errorf("the pod's cgroup %s: %w", path, err)
		}
	}
	if c.v2From != nil {
		if c.v2, err = cgroup2.NewManager("/sys/fs/cgroup", fs, &cgroup2.Resources{}); err != nil {
			_ = c.leave(ctx)
			return nil, fmt.Errorf("create the pod's cgroup %s: %w", path, err)
		}
		if err := c.v2.AddProc(uint64(self)); err != nil {
			_ = c.leave(ctx)
			return nil, fmt.Errorf("join the pod's cgroup %s: %w", path, err)
		}
		return c, nil
	}
	if c.v1, err = cgroup1.New(cgroup1.StaticPath(fs), &specs.LinuxResources{}); err != nil {
		_ = c.leave(ctx)
		return nil, fmt.Errorf("create the pod's cgroup %s: %w", path, err)
	}
	if err := c.v1.Add(cgroup1.Process{Pid: self}); err != nil {
		_ = c.leave(ctx)
		return nil, fmt.Errorf("join the pod's cgroup %s: %w", path, err)
	}
	return c, nil
}

// leave moves the shim back to where it was and removes the pod's cgroup, whose other
// processes (the VM, the server) must have ended: a systemd scope is stopped (which kills
// what is left in it), then what systemd did not remove of its cgroupfs path is.
func (c *podCgroup) leave(ctx context.Context) error {
	self := os.Getpid()
	var err error
	if c.v2From != nil {
		err = c.v2From.AddProc(uint64(self))
	} else {
		err = c.v1From.Add(cgroup1.Process{Pid: self})
	}
	if err != nil {
		return fmt.Errorf("leave the pod's cgroup %s: %w", c.path, err)
	}
	if c.scope != "" {
		if err := stopScope(ctx, c.scope); err != nil {
			return fmt.Errorf("remove the pod's cgroup %s: %w", c.path, err)
		}
	}
	switch {
	case c.v2 != nil:
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", c.fs)); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		err = c.v2.Delete()
	case c.v1 != nil:
		err = c.v1.Delete()
	}
	if err != nil {
		return fmt.Errorf("remove the pod's cgroup %s: %w", c.path, err)
	}
	return nil
}

// removePodCgroup removes the pod's cgroup path left by a dead shim (its processes must have
// ended): a systemd scope is stopped, then the cgroupfs path removed. A cgroup already gone is
// no error, nor a systemd path where systemd is not running (the shim made nothing of it).
func removePodCgroup(ctx context.Context, path string) error {
	fs, scope, err := resolvePodCgroup(path)
	if err != nil {
		return err
	}
	if scope != nil {
		if checkSystemdRunning(path) != nil {
			return nil
		}
		if err := stopScope(ctx, scope.unit); err != nil {
			return fmt.Errorf("remove the pod's cgroup %s: %w", path, err)
		}
	}
	if cgroups.Mode() == cgroups.Unified {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", fs)); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		m, err := cgroup2.Load(fs)
		if err != nil {
			return err
		}
		if err := m.Delete(); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove the pod's cgroup %s: %w", path, err)
		}
		return nil
	}
	cg, err := cgroup1.Load(cgroup1.StaticPath(fs))
	if errors.Is(err, cgroup1.ErrCgroupDeleted) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("the pod's cgroup %s: %w", path, err)
	}
	if err := cg.Delete(); err != nil {
		return fmt.Errorf("remove the pod's cgroup %s: %w", path, err)
	}
	return nil
}
