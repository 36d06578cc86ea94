package shim

import (
	"maps"

	"github.com/opencontainers/runtime-spec/specs-go/features"
)

// podFeatures is what a container's spec may ask of a kvfs pod, for -info: crun in the guest
// runs the spec, so its features (guest, recorded in the image by build.sh) are the base, less
// what does not reach the guest or has nothing there to act on:
//
//   - AppArmor and SELinux: the host's labels are dropped (AdaptSpec), the guest has neither;
//   - cgroup v1 and the systemd drivers: the guest has the cgroup v2 hierarchy and no systemd,
//     and the shim puts every container under agent.ContainersCgroup itself;
//   - Intel RDT, checkpointing and WebAssembly: the guest has no resctrl, no CRIU and no
//     WebAssembly engine for crun to load.
//
// Idmapped mounts are the shim's, on the host's side of the share (sandbox.BindIDMapped), so
// they are on where the host's kernel makes them (idmapped is what containerd's overlay
// snapshotter finds): with "user" among the namespaces, that is what containerd's CRI reads
// to run user-namespaced pods. Mount options stay as crun has them: "rro" among them is what
// the CRI reads to offer recursive read-only mounts, which the shim also makes on the host's
// side (bindFlags). guest is not modified.
func podFeatures(guest *features.Features, idmapped bool) *features.Features {
	f := *guest
	f.Annotations = maps.Clone(guest.Annotations)
	for _, a := range []string{"org.opencontainers.runc.checkpoint.enabled", "run.oci.crun.checkpoint.enabled", "run.oci.crun.wasm"} {
		delete(f.Annotations, a)
	}
	if guest.Linux != nil {
		l := *guest.Linux
		off := false
		l.Apparmor = &features.Apparmor{Enabled: &off}
		l.Selinux = &features.Selinux{Enabled: &off}
		l.IntelRdt = &features.IntelRdt{Enabled: &off}
		l.MountExtensions = &features.MountExtensions{IDMap: &features.IDMap{Enabled: &idmapped}}
		if guest.Linux.Cgroup != nil {
			v2 := guest.Linux.Cgroup.V2 != nil && *guest.Linux.Cgroup.V2
			l.Cgroup = &features.Cgroup{V1: &off, V2: &v2, Systemd: &off, SystemdUser: &off}
		}
		f.Linux = &l
	}
	return &f
}
