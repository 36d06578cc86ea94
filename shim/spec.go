package shim

import (
	"fmt"
	"maps"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// HostBind is a host directory or file a container's spec mounts, to be bound into the pod's
// share (sandbox.Bind(Source, Name, Flags)) so the guest finds it at agent.SharedDir/Name.
type HostBind struct {
	Source string
	Name   string
	Flags  sandbox.BindFlags
}

// GuestRoot is where the guest sees container id's root filesystem.
func GuestRoot(id string) string { return path.Join(agent.SharedDir, id) }

// AdaptSpec returns the OCI spec of container id as the guest runs it, and the host binds its
// mounts need. s is not modified. What only makes sense on the host goes:
//
//   - root.path becomes agent.SharedDir/<id>, where the rootfs bound at mounts/<id> appears;
//   - namespaces joined by a host path are dropped (the guest cannot open host paths): the
//     pod's containers share the guest's, as they share their sandbox's under runc, but for
//     the PID namespace, which becomes the pod's own (agent.PodPIDNamespace), whose init is
//     not the agent; the network namespace is dropped too: the containers share the VM's
//     network;
//   - linux.devices (host device nodes) are dropped, but for those the guest's kernel has
//     of its own under the same numbers (guestDevices: tun, FUSE), and so are AppArmor/SELinux
//     labels (the host's policy);
//   - of the hooks, only createContainer and startContainer stay: runc in the guest runs them
//     in the container's namespaces, and their paths are the guest's (createContainer's in
//     the guest's root, startContainer's in the container's). The shim runs the others on the
//     host (package hooks);
//   - the cgroups path becomes agent.ContainersCgroup/<id>: the host's (a systemd slice, or
//     CRI's pod parent) means nothing in the guest, and the pod's metrics are those of the
//     parent of every container's group;
//   - each bind mount's source, a host path, is bound into the share as <id>-<n>-<base> and
//     the mount's source becomes its guest path; it is bound on the host as the mount's
//     options say (bindFlags): read-only on the host what is read-only in the container, so
//     that root in the guest cannot write there either.
func AdaptSpec(s *specs.Spec, id string) (*specs.Spec, []HostBind, error) {
	if s == nil {
		return nil, nil, fmt.Errorf("container %s: no spec", id)
	}
	if s.Process == nil {
		return nil, nil, fmt.Errorf("container %s: the spec has no process", id)
	}
	g := *s
	g.Root = &specs.Root{Path: GuestRoot(id)}
	if s.Root != nil {
		g.Root.Readonly = s.Root.Readonly
	}
	g.Hooks = guestHooks(s.Hooks)
	g.Process = adaptProcess(s.Process)
	if s.Linux != nil {
		l := *s.Linux
		l.Namespaces = nil
		for _, ns := range s.Linux.Namespaces {
			switch {
			case ns.Type == specs.PIDNamespace && ns.Path != "":
				ns.Path = agent.PodPIDNamespace
			case ns.Path != "" || ns.Type == specs.NetworkNamespace:
				continue
			}
			l.Namespaces = append(l.Namespaces, ns)
		}
		l.Devices = nil
		for _, d := range s.Linux.Devices {
			if n, ok := guestDevices[d.Path]; ok && d.Type == "c" && d.Major == n[0] && d.Minor == n[1] {
				l.Devices = append(l.Devices, d)
			}
		}
		l.MountLabel = ""
		l.CgroupsPath = path.Join(agent.ContainersCgroup, id)
		g.Linux = &l
	}
	var binds []HostBind
	g.Mounts = make([]specs.Mount, 0, len(s.Mounts))
	for _, m := range s.Mounts {
		m.Options = slices.Clone(m.Options)
		if isBind(m) {
			if !filepath.IsAbs(m.Source) {
				return nil, nil, fmt.Errorf("container %s: bind mount of %q at %s: the source is not an absolute host path", id, m.Source, m.Destination)
			}
			name := fmt.Sprintf("%s-%d-%s", id, len(binds), baseName(m.Source))
			binds = append(binds, HostBind{Source: m.Source, Name: name, Flags: bindFlags(m.Options)})
			m.Source = path.Join(agent.SharedDir, name)
		}
		g.Mounts = append(g.Mounts, m)
	}
	return &g, binds, nil
}

// hostNamespaces refuses a pod that asks for the node's PID or IPC namespace (Kubernetes'
// hostPID, hostIPC), as hostPID and hostIPC say: its containers run in the guest, whose
// processes and IPC objects are not the host's, and could see or share neither.
func hostNamespaces(hostPID, hostIPC bool) error {
	var asked []string
	if hostPID {
		asked = append(asked, "PID (hostPID)")
	}
	if hostIPC {
		asked = append(asked, "IPC (hostIPC)")
	}
	if len(asked) == 0 {
		return nil
	}
	return fmt.Errorf("the pod asks for the node's %s namespace: not supported, its containers run in a VM whose processes and IPC are not the host's", strings.Join(asked, " and "))
}

// sharesHost says whether a CRI sandbox container's spec s (podsandbox's pause) has no
// namespace of type t of its own, that is, shares the host's.
func sharesHost(s *specs.Spec, t specs.LinuxNamespaceType) bool {
	return s.Linux == nil || !slices.ContainsFunc(s.Linux.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == t })
}

// guestDevices are the device nodes a container's spec keeps in the guest (path: major,
// minor): the guest's kernel has them under the numbers the host's have (fixed misc minors),
// and loads their driver when one is first opened. A privileged container on the host gets
// them among the host's devices; in the guest, these are what it can use of its own kernel.
var guestDevices = map[string][2]int64{
	"/dev/net/tun": {10, 200},
	"/dev/fuse":    {10, 229},
}

// ipcSysctls are the sysctls of an IPC namespace (runc's list), and fs.mqueue.* besides.
var ipcSysctls = []string{"kernel.msgmax", "kernel.msgmnb", "kernel.msgmni", "kernel.sem",
	"kernel.shmall", "kernel.shmmax", "kernel.shmmni", "kernel.shm_rmid_forced"}

// podSysctls takes from spec, a pod's first container (CRI's sandbox container, or a container
// alone in its pod), the sysctls that are the pod's VM's: the agent writes them in the guest's
// namespaces, which the pod's containers share (the network always; IPC when joined by path,
// as CRI's containers join their sandbox's). Those of an IPC namespace that guest, the
// container's spec in the guest (nil for a sandbox container, which runs nothing), has of its
// own stay in guest's linux.sysctl for runc to write there; the rest leave it.
func podSysctls(spec, guest *specs.Spec) map[string]string {
	if spec.Linux == nil || len(spec.Linux.Sysctl) == 0 {
		return nil
	}
	if guest == nil || guest.Linux == nil {
		return maps.Clone(spec.Linux.Sysctl)
	}
	ownIPC := slices.ContainsFunc(guest.Linux.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == specs.IPCNamespace })
	vm, own := map[string]string{}, map[string]string{}
	for k, v := range spec.Linux.Sysctl {
		if ownIPC && (slices.Contains(ipcSysctls, k) || strings.HasPrefix(k, "fs.mqueue.")) {
			own[k] = v
		} else {
			vm[k] = v
		}
	}
	guest.Linux.Sysctl = nil
	if len(own) > 0 {
		guest.Linux.Sysctl = own
	}
	return vm
}

// bindFlags are the sandbox.BindFlags of a bind mount's OCI options, read as runc reads them:
// rbind brings the submounts along; the last of ro and rw says whether the bind's own mount
// is read-only, unless rro or rrw, the last of which wins, is there: runc applies it to every
// mount of the bind, the top one included, after ro or rw. The last propagation option says
// whether the bind follows the host's mounts under its source: rslave, slave, rshared and
// shared do (only from the host: the guest's mounts are the guest kernel's).
func bindFlags(opts []string) sandbox.BindFlags {
	var f sandbox.BindFlags
	ro, recursive, follow := false, "", false
	for _, o := range opts {
		switch o {
		case "rbind":
			f |= sandbox.BindRecursive
		case "ro", "rw":
			ro = o == "ro"
		case "rro", "rrw":
			recursive = o
		case "rslave", "slave", "rshared", "shared":
			follow = true
		case "rprivate", "private", "runbindable", "unbindable":
			follow = false
		}
	}
	switch {
	case recursive == "rro":
		f |= sandbox.BindRecursiveReadOnly
	case recursive == "" && ro:
		f |= sandbox.BindReadOnly
	}
	if follow {
		f |= sandbox.BindFollowHost
	}
	return f
}

// bindRootfs binds container id's root filesystem, mounted at rootfs on the host, into the
// pod's share, with its submounts as runc binds a root. A read-only root (root.readonly,
// ctr run --read-only) is bound read-only, its own mount as runc makes it in a container,
// once the mount points runc would create in it exist (makeMountPoints).
func bindRootfs(pod Pod, rootfs, id string, s *specs.Spec) error {
	flags := sandbox.BindRecursive
	if s.Root != nil && s.Root.Readonly {
		if err := makeMountPoints(rootfs, s); err != nil {
			return fmt.Errorf("read-only root: %w", err)
		}
		flags |= sandbox.BindReadOnly
	}
	return pod.Bind(rootfs, id, flags)
}

// guestHooks are the hooks of h that run in the guest, or nil if there are none.
func guestHooks(h *specs.Hooks) *specs.Hooks {
	if h == nil || len(h.CreateContainer) == 0 && len(h.StartContainer) == 0 {
		return nil
	}
	return &specs.Hooks{CreateContainer: slices.Clone(h.CreateContainer), StartContainer: slices.Clone(h.StartContainer)}
}

// adaptProcess drops the host's security labels from a process.
func adaptProcess(p *specs.Process) *specs.Process {
	q := *p
	q.ApparmorProfile = ""
	q.SelinuxLabel = ""
	return &q
}

func isBind(m specs.Mount) bool {
	return m.Type == "bind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
}

var unsafeName = regexp.MustCompile(`[^A-Za-z0-9_.-]`)

// baseName is the last element of a host path as a safe single path component.
func baseName(p string) string {
	b := unsafeName.ReplaceAllString(filepath.Base(filepath.Clean(p)), "_")
	if b == "" || b == "." || b == ".." || b == "_" {
		return "root"
	}
	if len(b) > 64 {
		b = b[:64]
	}
	return b
}
