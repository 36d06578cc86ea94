package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// podTmpfs are the pod's tmpfs volumes (CreateContainerRequest.pod_tmpfs: Kubernetes'
// emptyDir of medium Memory), each mounted at dir/<name> in the agent's namespace the first
// time a container names it, for the pod's life: the containers that bind it share it, and a
// container restarted finds what the one before it wrote, as the host's tmpfs under runc
// keeps it. Its pages are the guest's memory, charged to the container that writes them.
// mu is a leaf, taken while a container's op is held.
type podTmpfs struct {
	dir string

	mu      sync.Mutex
	mounted map[string]*apiv1.PodTmpfs // guarded by mu: by name, as first asked
}

func newPodTmpfs(dir string) *podTmpfs {
	return &podTmpfs{dir: dir, mounted: make(map[string]*apiv1.PodTmpfs)}
}

// ensure mounts each of vols (checked: apiv1.CheckPodTmpfs) not mounted yet. A volume
// mounted already must be asked alike: the same name with another size, mode or owner is an
// error that names it.
func (t *podTmpfs) ensure(vols []*apiv1.PodTmpfs) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, v := range vols {
		if m, ok := t.mounted[v.Name]; ok {
			if m.Size != v.Size || m.Mode != v.Mode || m.Uid != v.Uid || m.Gid != v.Gid {
				return errf(errdefs.ErrInvalidArgument, "pod tmpfs %q: asked with size %d, mode %#o, owner %d:%d; it has %d, %#o, %d:%d",
					v.Name, v.Size, v.Mode, v.Uid, v.Gid, m.Size, m.Mode, m.Uid, m.Gid)
			}
			continue
		}
		if err := t.mount(v); err != nil {
			return errf(errdefs.ErrInternal, "pod tmpfs %q: %v", v.Name, err)
		}
		t.mounted[v.Name] = v
	}
	return nil
}

// mount mounts v at dir/<name>: nosuid and nodev, as the kubelet's.
func (t *podTmpfs) mount(v *apiv1.PodTmpfs) error {
	target := filepath.Join(t.dir, v.Name)
	if err := os.MkdirAll(target, 0o700); err != nil {
		return err
	}
	opts := fmt.Sprintf("mode=%o,uid=%d,gid=%d", v.Mode, v.Uid, v.Gid)
	if v.Size > 0 {
		opts += fmt.Sprintf(",size=%d", v.Size)
	}
	if err := unix.Mount("tmpfs", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount a tmpfs at %s (%s): %w", target, opts, err)
	}
	return nil
}
