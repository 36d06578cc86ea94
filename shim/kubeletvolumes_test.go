package shim

import (
	"encoding/json"
	"os"
	"path"
	"path/filepath"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// TestPodTmpfsVolumes: a bind of an emptyDir volume of medium Memory (the root of a tmpfs in
// the kubelet's kubernetes.io~empty-dir directory) becomes the pod's tmpfs in the guest, of
// the host tmpfs's size, mode and owner, named by the volume, given to the agent with each
// container that binds it and not bound into the share; an emptyDir on the node's disk, and
// a tmpfs elsewhere, are bound into the share as any volume.
func TestPodTmpfsVolumes(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (tmpfs mounts)")
	}
	h := newHarness(t)
	emptyDirs := filepath.Join(h.dir, "kubelet", "pods", "uid1", "volumes", emptyDirVolumes)
	mem, disk, other := filepath.Join(emptyDirs, "cache"), filepath.Join(emptyDirs, "scratch"), filepath.Join(h.dir, "tmpfs")
	for _, d := range []string{mem, disk, other} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for d, opts := range map[string]string{mem: "size=8m,mode=2775,gid=2000", other: "size=4m"} {
		if err := unix.Mount("tmpfs", d, "tmpfs", 0, opts); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(d, unix.MNT_DETACH) })
	}
	bind := func(src, dst string) specs.Mount {
		return specs.Mount{Destination: dst, Type: "bind", Source: src, Options: []string{"rbind", "rw"}}
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", inPod("pod"), bind(mem, "/cache"), bind(disk, "/scratch"), bind(other, "/other"))})
	h.create(&taskAPI.CreateTaskRequest{ID: "c2", Bundle: h.bundle("c2", inPod("pod"), bind(mem, "/data"))})

	want := &agent.PodTmpfs{Name: "cache", Size: 8 << 20, Mode: 0o2775, Uid: 0, Gid: 2000}
	for _, id := range []string{"c1", "c2"} {
		got := h.agent.podTmpfs[id]
		if len(got) != 1 || got[0].Name != want.Name || got[0].Size != want.Size || got[0].Mode != want.Mode || got[0].Uid != want.Uid || got[0].Gid != want.Gid {
			t.Errorf("%s's pod tmpfs: %v, want [%v]", id, got, want)
		}
	}
	sources := guestMountSources(t, h, "c1")
	if s := sources["/cache"]; s != agent.PodTmpfsDir+"/cache" {
		t.Errorf("c1's /cache in the guest binds %s, want the pod's tmpfs %s/cache", s, agent.PodTmpfsDir)
	}
	checkInShare(t, sources, "/scratch", "/other")
	bound := sharedSources(h)
	if bound[mem] || !bound[disk] || !bound[other] {
		t.Errorf("the share binds %v: want the disk emptyDir and the other tmpfs, not the memory emptyDir", bound)
	}
}

// TestMirroredVolumes: the binds of the volumes the kubelet updates in place (configMap,
// secret, projected, downward API: a directory in the kubelet's directory of their kind) are
// bound into the share and given to the agent to mirror, and the guest's spec binds the
// agent's copies; a hostPath directory, and a file in such a volume's directory (a subPath's
// source), are bound as they are.
func TestMirroredVolumes(t *testing.T) {
	h := newHarness(t)
	vols := filepath.Join(h.dir, "kubelet", "pods", "uid1", "volumes")
	cm, sec, plain := filepath.Join(vols, "kubernetes.io~configmap", "cfg"), filepath.Join(vols, "kubernetes.io~secret", "token"), filepath.Join(h.dir, "plain")
	for _, d := range []string{cm, sec, plain} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	file := filepath.Join(vols, "kubernetes.io~projected", "one")
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	bind := func(src, dst string) specs.Mount {
		return specs.Mount{Destination: dst, Type: "bind", Source: src, Options: []string{"rbind", "ro"}}
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: h.bundle("c1", inPod("pod"), bind(cm, "/cfg"), bind(plain, "/plain"), bind(sec, "/sec"), bind(file, "/one"))})

	sources := guestMountSources(t, h, "c1")
	got := h.agent.mirrored["c1"]
	if len(got) != 2 || sources["/cfg"] != path.Join(agent.MirrorDir, got[0]) || sources["/sec"] != path.Join(agent.MirrorDir, got[1]) {
		t.Errorf("mirrored %q; the guest binds /cfg from %s and /sec from %s: want the agent's copies of both", got, sources["/cfg"], sources["/sec"])
	}
	checkInShare(t, sources, "/plain", "/one")
	bound := sharedSources(h)
	for _, src := range []string{cm, sec, plain, file} {
		if !bound[src] {
			t.Errorf("%s is not bound into the share", src)
		}
	}
}

// guestMountSources are the sources of the mounts of container id's guest spec, by
// destination.
func guestMountSources(t *testing.T, h *harness, id string) map[string]string {
	t.Helper()
	var guest specs.Spec
	if err := json.Unmarshal(h.agent.specs[id], &guest); err != nil {
		t.Fatal(err)
	}
	sources := map[string]string{}
	for _, m := range guest.Mounts {
		sources[m.Destination] = m.Source
	}
	return sources
}

// checkInShare checks that the guest binds each of dsts (of sources) from the share.
func checkInShare(t *testing.T, sources map[string]string, dsts ...string) {
	t.Helper()
	for _, d := range dsts {
		if s := sources[d]; filepath.Dir(s) != agent.SharedDir {
			t.Errorf("%s in the guest binds %s, want a bind in the share", d, s)
		}
	}
}

// sharedSources are the host sources the pod binds into its share.
func sharedSources(h *harness) map[string]bool {
	bound := map[string]bool{}
	for _, b := range h.pod().bound() {
		bound[b.Source] = true
	}
	return bound
}
