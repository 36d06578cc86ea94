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
// share (sandbox.Bind(Source, Name, Flags)) so the guest finds it at agent.SharedDir/Name;
// idmapped (sandbox.BindIDMapped) if the mount has uidMappings and gidMappings.
type HostBind struct {
	Source                   string
	Name                     string
	Flags                    sandbox.BindFlags
	UIDMappings, GIDMappings []specs.LinuxIDMapping
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
//     not the agent, and the user namespace, which becomes the pod's own
//     (agent.PodUserNamespace) with the spec's mappings (checkUserNamespace); the network
//     namespace is dropped too: the containers share the VM's network;
//   - in a user namespace, whose container root has no privilege over the guest's network
//     and IPC namespaces, the container's /sys is the guest's, bound read-only, and its
//     /dev/mqueue the guest's (that of the IPC namespace it shares), rather than mounts of
//     their own the kernel refuses there (userNamespaceMounts);
//   - linux.devices (host device nodes) are dropped, but for those the guest's kernel has
//     of its own under the same numbers (guestDevices: tun, FUSE), and so are AppArmor/SELinux
//     labels (the host's policy);
//   - of the hooks, only createContainer and startContainer stay: crun in the guest runs them
//     in the container's namespaces, and their paths are the guest's (createContainer's in
//     the guest's root, startContainer's in the container's). The shim runs the others on the
//     host (package hooks);
//   - the guest's cgroups are v2 whatever the host's, so a container gets the cgroup
//     namespace containerd's CRI gives it on a cgroup v2 host: its own, unless privileged
//     (which the CRI makes without masked paths), so that its /sys/fs/cgroup is its own group,
//     whose files have its limits; a spec made on a v1 host has none;
//   - the cgroups path becomes agent.ContainersCgroup/<id>: the host's (a systemd slice, or
//     CRI's pod parent) means nothing in the guest, and the pod's metrics are those of the
//     parent of every container's group;
//   - each bind mount's source, a host path, is bound into the share as <id>-<n>-<base> and
//     the mount's source becomes its guest path; it is bound on the host as the mount's
//     options say (bindFlags): read-only on the host what is read-only in the container, so
//     that root in the guest cannot write there either; a mount's uidMappings and
//     gidMappings (an idmapped mount, which the guest's virtio-fs cannot make) idmap the
//     host's bind instead.
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
		if err := checkUserNamespace(&l); err != nil {
			return nil, nil, fmt.Errorf("container %s: %w", id, err)
		}
		l.Namespaces = nil
		for _, ns := range s.Linux.Namespaces {
			switch {
			case ns.Type == specs.PIDNamespace && ns.Path != "":
				ns.Path = agent.PodPIDNamespace
			case ns.Type == specs.UserNamespace && ns.Path != "":
				ns.Path = agent.PodUserNamespace
			case ns.Path != "" || ns.Type == specs.NetworkNamespace:
				continue
			}
			l.Namespaces = append(l.Namespaces, ns)
		}
		if len(s.Linux.MaskedPaths) > 0 && !slices.ContainsFunc(l.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == specs.CgroupNamespace }) {
			l.Namespaces = append(l.Namespaces, specs.LinuxNamespace{Type: specs.CgroupNamespace})
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
		idmapped := len(m.UIDMappings) > 0 || len(m.GIDMappings) > 0
		if idmapped && !isBind(m) {
			return nil, nil, fmt.Errorf("container %s: mount at %s: uidMappings and gidMappings on a %q mount: only bind mounts are idmapped", id, m.Destination, m.Type)
		}
		if isBind(m) {
			if !filepath.IsAbs(m.Source) {
				return nil, nil, fmt.Errorf("container %s: bind mount of %q at %s: the source is not an absolute host path", id, m.Source, m.Destination)
			}
			name := fmt.Sprintf("%s-%d-%s", id, len(binds), baseName(m.Source))
			b := HostBind{Source: m.Source, Name: name, Flags: bindFlags(m.Options)}
			if idmapped {
				if err := checkIDMappings(m.UIDMappings, m.GIDMappings); err != nil {
					return nil, nil, fmt.Errorf("container %s: bind mount of %s at %s: %w", id, m.Source, m.Destination, err)
				}
				b.UIDMappings, b.GIDMappings = m.UIDMappings, m.GIDMappings
				m.UIDMappings, m.GIDMappings = nil, nil
				m.Options = slices.DeleteFunc(m.Options, func(o string) bool { return o == "idmap" || o == "ridmap" })
			}
			binds = append(binds, b)
			m.Source = path.Join(agent.SharedDir, name)
		}
		g.Mounts = append(g.Mounts, m)
	}
	if hasNamespace(&g, specs.UserNamespace) {
		userNamespaceMounts(&g)
	}
	return &g, binds, nil
}

// checkUserNamespace accepts the user namespace of a container's spec l as the CRI has it
// (Kubernetes' hostUsers: false), and as the agent makes the pod's: if l has one, exactly one
// uid and one gid mapping, each mapping container id 0 (checkIDMappings).
func checkUserNamespace(l *specs.Linux) error {
	if !slices.ContainsFunc(l.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == specs.UserNamespace }) {
		if len(l.UIDMappings) > 0 || len(l.GIDMappings) > 0 {
			return fmt.Errorf("linux.uidMappings and gidMappings without a user namespace")
		}
		return nil
	}
	if err := checkIDMappings(l.UIDMappings, l.GIDMappings); err != nil {
		return fmt.Errorf("user namespace: %w", err)
	}
	return nil
}

// checkIDMappings accepts uid and gid mappings a kvfs pod takes: one of each (as the CRI
// takes them), each mapping container id 0 and at least one id, within 32 bits.
func checkIDMappings(uids, gids []specs.LinuxIDMapping) error {
	for _, m := range []struct {
		what string
		ids  []specs.LinuxIDMapping
	}{{"uid", uids}, {"gid", gids}} {
		if len(m.ids) != 1 {
			return fmt.Errorf("%d %s mappings, want one", len(m.ids), m.what)
		}
		e := m.ids[0]
		switch {
		case e.ContainerID != 0:
			return fmt.Errorf("the %s mapping %d:%d:%d does not map container id 0", m.what, e.ContainerID, e.HostID, e.Size)
		case e.Size == 0 || uint64(e.HostID)+uint64(e.Size) > 1<<32:
			return fmt.Errorf("the %s mapping %d:%d:%d: want a size of at least 1 that stays within 32-bit ids", m.what, e.ContainerID, e.HostID, e.Size)
		}
	}
	return nil
}

// userNamespaceMounts adapts the mounts of g, a container in a user namespace, to the guest's
// network and IPC namespaces it shares, which the user namespace does not own: the kernel
// refuses it a sysfs or mqueue mount of its own there. /sys becomes a read-only bind of the
// guest's (what containerd gives a user-namespaced pod on the host's network). /dev/mqueue
// becomes a bind of the guest's (agent.MountSystem mounts it), which is the mqueue of the IPC
// namespace the container shares; a container with an IPC namespace of its own mounts its
// own.
func userNamespaceMounts(g *specs.Spec) {
	ownIPC := hasNamespace(g, specs.IPCNamespace)
	for i, m := range g.Mounts {
		switch {
		case m.Type == "sysfs":
			g.Mounts[i] = specs.Mount{Destination: m.Destination, Type: "bind", Source: "/sys", Options: []string{"rbind", "rro", "nosuid", "nodev", "noexec"}}
		case m.Type == "mqueue" && !ownIPC:
			g.Mounts[i] = specs.Mount{Destination: m.Destination, Type: "bind", Source: "/dev/mqueue", Options: []string{"rbind", "nosuid", "nodev", "noexec"}}
		}
	}
}

// hasNamespace says whether the container of spec g has a namespace of type t of its own or
// joined by path: for a host's spec (podsandbox's pause), one that is not the host's; for a
// guest's, one that is not the guest's.
func hasNamespace(g *specs.Spec, t specs.LinuxNamespaceType) bool {
	return g.Linux != nil && slices.ContainsFunc(g.Linux.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == t })
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
// own stay in guest's linux.sysctl for crun to write there; the rest leave it.
func podSysctls(spec, guest *specs.Spec) map[string]string {
	if spec.Linux == nil || len(spec.Linux.Sysctl) == 0 {
		return nil
	}
	if guest == nil || guest.Linux == nil {
		return maps.Clone(spec.Linux.Sysctl)
	}
	ownIPC := hasNamespace(guest, specs.IPCNamespace)
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
// shared do (only from the host: the guest's mounts are the guest kernel's). ridmap idmaps
// every mount of an idmapped bind.
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
		case "ridmap":
			f |= sandbox.BindIDMapRecursive
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
func bindRootfs(pod VM, rootfs, id string, s *specs.Spec) error {
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

// podOOMScoreAdj says what a container's process.oomScoreAdj does to its pod's: the value
// the pod's QEMU and kvfsd start with (start), or one they are raised to if theirs is lower
// (raise), before the container runs. CRI gives containers their pod's QoS class (Guaranteed
// -997, BestEffort 1000, Burstable by memory request, each at least containerd's own under
// restrict_oom_score_adj) but gives the pod sandbox none of it: podsandbox's pause container
// has -998 whatever the class, and the Sandbox API's pod config carries only cpu and memory.
// So the pod's value comes from its containers: a sandbox container's, or the one container
// of a pod without CRI, is where the pod starts; each CRI container raises it to its own, and
// the VM, whose one OOM kill takes every container, is no better protected than the least
// protected of them.
func podOOMScoreAdj(spec *specs.Spec) (start, raise *int) {
	if spec.Process == nil || spec.Process.OOMScoreAdj == nil {
		return nil, nil
	}
	v := *spec.Process.OOMScoreAdj
	if spec.Annotations[AnnotationContainerType] == containerTypeContainer {
		return nil, &v
	}
	return &v, nil
}
