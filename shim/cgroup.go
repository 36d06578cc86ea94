package shim

import (
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
// Only a cgroupfs path is joined (an absolute, clean path, as containerd's cgroupfs driver
// writes them). A systemd one (slice:prefix:name) would need systemd to make a scope: it is
// left out, with a warning, and the pod is then accounted to the shim's cgroup.
//
// With CRI's sandboxer "shim" there is no pause container: the Sandbox API's CreateSandbox
// gets the pod's cgroup parent (the pod's CRI config, linux.cgroup_parent: the kubelet's
// kubepods/.../pod<uid>) and the shim derives from it the cgroup podsandbox would give the
// pause container (sandboxCgroupPath), joined the same way; its pod stats (SandboxMetrics)
// are then the parent's, read on the host as podsandbox reads them (podCgroupMetrics).

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
	path       string
	v1, v1From cgroup1.Cgroup
	v2, v2From *cgroup2.Manager
}

// checkCgroupPath checks that path is a cgroupfs path the shim can join: absolute, clean,
// not the root.
func checkCgroupPath(path string) error {
	if !filepath.IsAbs(path) || filepath.Clean(path) != path || path == "/" || strings.Contains(path, ":") {
		return fmt.Errorf("cgroup path %q: want an absolute, clean cgroupfs path below the root (a systemd slice:prefix:name path is not joined)", path)
	}
	return nil
}

// joinPodCgroup creates the cgroup path in every hierarchy (see above) and moves the shim
// into it: what the shim starts afterwards is born there.
func joinPodCgroup(path string) (_ *podCgroup, retErr error) {
	if err := checkCgroupPath(path); err != nil {
		return nil, err
	}
	c := &podCgroup{path: path}
	self := os.Getpid()
	if cgroups.Mode() == cgroups.Unified {
		from, err := cgroup2.PidGroupPath(self)
		if err != nil {
			return nil, fmt.Errorf("the shim's cgroup: %w", err)
		}
		if c.v2From, err = cgroup2.Load(from); err != nil {
			return nil, fmt.Errorf("the shim's cgroup %s: %w", from, err)
		}
		if c.v2, err = cgroup2.NewManager("/sys/fs/cgroup", path, &cgroup2.Resources{}); err != nil {
			return nil, fmt.Errorf("create the pod's cgroup %s: %w", path, err)
		}
		if err := c.v2.AddProc(uint64(self)); err != nil {
			_ = c.v2.Delete()
			return nil, fmt.Errorf("join the pod's cgroup %s: %w", path, err)
		}
		return c, nil
	}
	var err error
	if c.v1From, err = cgroup1.Load(cgroup1.PidPath(self)); err != nil {
		return nil, fmt.Errorf("the shim's cgroups: %w", err)
	}
	if c.v1, err = cgroup1.New(cgroup1.StaticPath(path), &specs.LinuxResources{}); err != nil {
		return nil, fmt.Errorf("create the pod's cgroup %s: %w", path, err)
	}
	if err := c.v1.Add(cgroup1.Process{Pid: self}); err != nil {
		_ = c.leave()
		return nil, fmt.Errorf("join the pod's cgroup %s: %w", path, err)
	}
	return c, nil
}

// leave moves the shim back to where it was and removes the pod's cgroup, whose other
// processes (the VM, the server) must have ended.
func (c *podCgroup) leave() error {
	self := os.Getpid()
	if c.v2 != nil {
		if err := c.v2From.AddProc(uint64(self)); err != nil {
			return fmt.Errorf("leave the pod's cgroup %s: %w", c.path, err)
		}
		if err := c.v2.Delete(); err != nil {
			return fmt.Errorf("remove the pod's cgroup %s: %w", c.path, err)
		}
		return nil
	}
	if err := c.v1From.Add(cgroup1.Process{Pid: self}); err != nil {
		return fmt.Errorf("leave the pod's cgroup %s: %w", c.path, err)
	}
	if err := c.v1.Delete(); err != nil {
		return fmt.Errorf("remove the pod's cgroup %s: %w", c.path, err)
	}
	return nil
}

// removePodCgroup removes the pod's cgroup path left by a dead shim (its processes must have
// ended). A cgroup already gone is no error.
func removePodCgroup(path string) error {
	if err := checkCgroupPath(path); err != nil {
		return err
	}
	if cgroups.Mode() == cgroups.Unified {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", path)); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		m, err := cgroup2.Load(path)
		if err != nil {
			return err
		}
		if err := m.Delete(); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove the pod's cgroup %s: %w", path, err)
		}
		return nil
	}
	cg, err := cgroup1.Load(cgroup1.StaticPath(path))
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
