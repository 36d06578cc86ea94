package shim

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// Two kinds of the kubelet's volumes the guest keeps itself rather than take through the
// share as they are, so that a container sees them as a runc container sees them on the host.
//
// Kubernetes' emptyDir of medium Memory is a tmpfs the kubelet mounts on the host, of the
// volume's sizeLimit, at <the kubelet's root>/pods/<pod uid>/volumes/kubernetes.io~empty-dir/
// <name>. Served through the share, the pod's containers would get the host's tmpfs over
// virtio-fs: memory outside the VM, at the share's speed, and not a tmpfs in the container.
// The guest gets its own instead, as Kata gives it: a tmpfs of the pod's (the agent's
// CreateContainerRequest.pod_tmpfs) of the host tmpfs's size, mode and owner, mounted by the
// agent once for the pod and bound into each container that names it. What the containers
// write there stays in the guest, as it would stay in a runc pod's tmpfs: the kubelet reads
// nothing of it (its size limit is the tmpfs's own, in the guest as on the host).

//
// The configMap, secret, projected and downward API volumes the kubelet updates in place,
// atomically (a new hidden directory, then the ..data link swapped to it by a rename): over
// virtio-fs the new content reaches the guest, but no inotify event does, where a runc
// container's watch sees each step. Such a volume is still bound into the share, and the
// agent mirrors it into a copy of the guest's (CreateContainerRequest.mirrored), replaying
// each update there, which the container binds in its place (agent/mirror.go).

// emptyDirVolumes is the kubelet's directory of a pod's emptyDir volumes, as a path's element.
const emptyDirVolumes = "kubernetes.io~empty-dir"

// updatedVolumes are the kubelet's directories of the volumes it updates in place.
var updatedVolumes = []string{"kubernetes.io~configmap", "kubernetes.io~secret", "kubernetes.io~projected", "kubernetes.io~downward-api"}

// podTmpfsOf takes out of binds those of the pod's tmpfs volumes (podTmpfsVolume) and points
// their mounts in g, the guest's spec, at the pod's tmpfs of that name. It returns the binds
// left and the tmpfs volumes, each once.
func podTmpfsOf(g *specs.Spec, binds []HostBind) ([]HostBind, []*agent.PodTmpfs, error) {
	var left []HostBind
	var vols []*agent.PodTmpfs
	seen := map[string]bool{}
	for _, b := range binds {
		v, err := podTmpfsVolume(b)
		if err != nil {
			return nil, nil, err
		}
		if v == nil {
			left = append(left, b)
			continue
		}
		src := path.Join(agent.SharedDir, b.Name)
		for i := range g.Mounts {
			if g.Mounts[i].Source == src {
				g.Mounts[i].Source = path.Join(agent.PodTmpfsDir, v.Name)
			}
		}
		if !seen[v.Name] {
			seen[v.Name] = true
			vols = append(vols, v)
		}
	}
	if err := agent.CheckPodTmpfs(vols); err != nil {
		return nil, nil, err
	}
	return left, vols, nil
}

// podTmpfsVolume is the pod's tmpfs volume b binds, if it binds one: not idmapped, its source
// a directory of the kubelet's emptyDir volumes that is the root of a tmpfs. Nil otherwise.
func podTmpfsVolume(b HostBind) (*agent.PodTmpfs, error) {
	name := filepath.Base(b.Source)
	if b.UIDMappings != nil || filepath.Base(filepath.Dir(b.Source)) != emptyDirVolumes || agent.CheckPodTmpfs([]*agent.PodTmpfs{{Name: name}}) != nil {
		return nil, nil
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(b.Source, &fs); err != nil {
		return nil, fmt.Errorf("the emptyDir volume %s: %w", b.Source, err)
	}
	var root, parent unix.Stat_t
	if err := unix.Stat(b.Source, &root); err != nil {
		return nil, fmt.Errorf("the emptyDir volume %s: %w", b.Source, err)
	}
	if err := unix.Stat(filepath.Dir(b.Source), &parent); err != nil {
		return nil, fmt.Errorf("the emptyDir volume %s: %w", b.Source, err)
	}
	if fs.Type != unix.TMPFS_MAGIC || root.Dev == parent.Dev || root.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, nil // a volume on the node's disk: the share serves it
	}
	return &agent.PodTmpfs{Name: name, Size: uint64(fs.Blocks) * uint64(fs.Bsize), Mode: root.Mode & 0o7777, Uid: root.Uid, Gid: root.Gid}, nil
}

// mirroredOf points the mounts in g, the guest's spec, of binds of the volumes the kubelet
// updates in place (a directory, not idmapped, in one of updatedVolumes) at the agent's copy
// of the bind, and returns the names of those binds.
func mirroredOf(g *specs.Spec, binds []HostBind) ([]string, error) {
	var names []string
	for _, b := range binds {
		if b.UIDMappings != nil || !slices.Contains(updatedVolumes, filepath.Base(filepath.Dir(b.Source))) {
			continue
		}
		fi, err := os.Stat(b.Source)
		if err != nil {
			return nil, fmt.Errorf("the volume %s: %w", b.Source, err)
		}
		if !fi.IsDir() {
			continue
		}
		src := path.Join(agent.SharedDir, b.Name)
		for i := range g.Mounts {
			if g.Mounts[i].Source == src {
				g.Mounts[i].Source = path.Join(agent.MirrorDir, b.Name)
			}
		}
		names = append(names, b.Name)
	}
	if err := agent.CheckMirrored(names); err != nil {
		return nil, err
	}
	return names, nil
}
