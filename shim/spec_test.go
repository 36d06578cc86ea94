package shim

import (
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

func TestAdaptSpec(t *testing.T) {
	base := func() *specs.Spec {
		return &specs.Spec{
			Version: "1.2.0",
			Root:    &specs.Root{Path: "/var/lib/containerd/bundle/rootfs", Readonly: true},
			Process: &specs.Process{Args: []string{"sh"}, ApparmorProfile: "cri-containerd.apparmor.d", SelinuxLabel: "system_u:system_r:container_t"},
			Hooks: &specs.Hooks{
				Prestart:        []specs.Hook{{Path: "/usr/bin/nvidia-hook"}},
				CreateRuntime:   []specs.Hook{{Path: "/usr/bin/cr"}},
				CreateContainer: []specs.Hook{{Path: "/bin/cc", Args: []string{"cc", "-x"}, Env: []string{"A=1"}}},
				StartContainer:  []specs.Hook{{Path: "/bin/sc"}, {Path: "/bin/sc2"}},
				Poststart:       []specs.Hook{{Path: "/usr/bin/ps"}},
				Poststop:        []specs.Hook{{Path: "/usr/bin/pt"}},
			},
			Linux: &specs.Linux{
				Namespaces: []specs.LinuxNamespace{
					{Type: specs.PIDNamespace, Path: "/proc/42/ns/pid"},
					{Type: specs.NetworkNamespace, Path: "/var/run/netns/cni-1"},
					{Type: specs.IPCNamespace, Path: "/proc/42/ns/ipc"},
					{Type: specs.MountNamespace},
				},
				Devices: []specs.LinuxDevice{{Path: "/dev/sda", Type: "b", Major: 8}, {Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229},
					{Path: "/dev/net/tun", Type: "c", Major: 10, Minor: 201}, {Path: "/dev/kvm", Type: "c", Major: 10, Minor: 232},
					{Path: "/dev/net/tun", Type: "c", Major: 10, Minor: 200}},
				MountLabel:  "system_u:object_r:container_file_t",
				CgroupsPath: "/default/c1",
			},
			Mounts: []specs.Mount{
				{Destination: "/proc", Type: "proc", Source: "proc"},
				{Destination: "/etc/resolv.conf", Type: "bind", Source: "/var/lib/containerd/sandboxes/p/resolv.conf", Options: []string{"rbind", "ro"}},
				{Destination: "/data", Source: "/srv/data", Options: []string{"rbind", "rw"}},
				{Destination: "/", Type: "bind", Source: "/", Options: []string{"bind"}},
				{Destination: "/odd", Type: "bind", Source: "/srv/we ird,name", Options: []string{"bind"}},
			},
			Annotations: map[string]string{"a": "b"},
		}
	}
	tests := []struct {
		name      string
		modify    func(*specs.Spec)
		check     func(t *testing.T, g *specs.Spec, binds []HostBind)
		wantError string
	}{
		{
			name: "everything host-only goes, bind mounts move into the share",
			check: func(t *testing.T, g *specs.Spec, binds []HostBind) {
				if g.Root.Path != "/run/kvfs/shared/c1" || !g.Root.Readonly {
					t.Errorf("root %+v", g.Root)
				}
				wantHooks := &specs.Hooks{
					CreateContainer: []specs.Hook{{Path: "/bin/cc", Args: []string{"cc", "-x"}, Env: []string{"A=1"}}},
					StartContainer:  []specs.Hook{{Path: "/bin/sc"}, {Path: "/bin/sc2"}},
				}
				if !reflect.DeepEqual(g.Hooks, wantHooks) {
					t.Errorf("guest hooks\n got %+v\nwant only the container-namespace phases %+v", g.Hooks, wantHooks)
				}
				if g.Linux.MountLabel != "" || g.Process.ApparmorProfile != "" || g.Process.SelinuxLabel != "" {
					t.Errorf("host-only labels kept: %q %q %q", g.Linux.MountLabel, g.Process.ApparmorProfile, g.Process.SelinuxLabel)
				}
				// The guest's own tun and FUSE stay, under their numbers; the host's disk, KVM and
				// a tun of other numbers go.
				wantDevices := []specs.LinuxDevice{{Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229}, {Path: "/dev/net/tun", Type: "c", Major: 10, Minor: 200}}
				if !reflect.DeepEqual(g.Linux.Devices, wantDevices) {
					t.Errorf("guest devices %+v, want %+v", g.Linux.Devices, wantDevices)
				}
				// The sandbox's PID namespace, joined by path, becomes the pod's in the guest.
				want := []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: agent.PodPIDNamespace}, {Type: specs.MountNamespace}}
				if !reflect.DeepEqual(g.Linux.Namespaces, want) {
					t.Errorf("namespaces %+v", g.Linux.Namespaces)
				}
				if g.Linux.CgroupsPath != "/kvfs/c1" || g.Annotations["a"] != "b" || g.Process.Args[0] != "sh" {
					t.Errorf("kept parts changed: %q %v %v", g.Linux.CgroupsPath, g.Annotations, g.Process.Args)
				}
				wantBinds := []HostBind{
					{Source: "/var/lib/containerd/sandboxes/p/resolv.conf", Name: "c1-0-resolv.conf", Flags: sandbox.BindRecursive | sandbox.BindReadOnly},
					{Source: "/srv/data", Name: "c1-1-data", Flags: sandbox.BindRecursive},
					{Source: "/", Name: "c1-2-root"},
					{Source: "/srv/we ird,name", Name: "c1-3-we_ird_name"},
				}
				if !reflect.DeepEqual(binds, wantBinds) {
					t.Errorf("binds\n got %+v\nwant %+v", binds, wantBinds)
				}
				srcs := []string{"proc", "/run/kvfs/shared/c1-0-resolv.conf", "/run/kvfs/shared/c1-1-data",
					"/run/kvfs/shared/c1-2-root", "/run/kvfs/shared/c1-3-we_ird_name"}
				for i, m := range g.Mounts {
					if m.Source != srcs[i] {
						t.Errorf("mount %d source %q, want %q", i, m.Source, srcs[i])
					}
				}
				if g.Mounts[1].Destination != "/etc/resolv.conf" || strings.Join(g.Mounts[1].Options, ",") != "rbind,ro" {
					t.Errorf("mount 1 %+v", g.Mounts[1])
				}
			},
		},
		{
			name:   "a network namespace without a path is dropped too: the pod shares the VM's",
			modify: func(s *specs.Spec) { s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.NetworkNamespace}} },
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				if len(g.Linux.Namespaces) != 0 {
					t.Errorf("namespaces %+v", g.Linux.Namespaces)
				}
			},
		},
		{
			name: "an unprivileged container of a cgroup v1 host gets a cgroup namespace of its own, as on a v2 host",
			modify: func(s *specs.Spec) {
				s.Linux.MaskedPaths = []string{"/proc/kcore"}
				s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.CgroupNamespace, Path: "/proc/42/ns/cgroup"})
			},
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				want := []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: agent.PodPIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.CgroupNamespace}}
				if !reflect.DeepEqual(g.Linux.Namespaces, want) {
					t.Errorf("namespaces %+v, want %+v", g.Linux.Namespaces, want)
				}
			},
		},
		{
			name: "a container of a cgroup v2 host keeps its cgroup namespace",
			modify: func(s *specs.Spec) {
				s.Linux.MaskedPaths = []string{"/proc/kcore"}
				s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.CgroupNamespace})
			},
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				want := []specs.LinuxNamespace{{Type: specs.PIDNamespace, Path: agent.PodPIDNamespace}, {Type: specs.MountNamespace}, {Type: specs.CgroupNamespace}}
				if !reflect.DeepEqual(g.Linux.Namespaces, want) {
					t.Errorf("namespaces %+v, want %+v", g.Linux.Namespaces, want)
				}
			},
		},
		{
			name:   "a systemd cgroups path becomes a plain one",
			modify: func(s *specs.Spec) { s.Linux.CgroupsPath = "kubepods-besteffort.slice:cri-containerd:c1" },
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				if g.Linux.CgroupsPath != "/kvfs/c1" {
					t.Errorf("cgroups path %q", g.Linux.CgroupsPath)
				}
			},
		},
		{
			name:   "no root in the spec: the guest root still",
			modify: func(s *specs.Spec) { s.Root = nil; s.Linux = nil },
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				if g.Root == nil || g.Root.Path != "/run/kvfs/shared/c1" || g.Root.Readonly || g.Linux != nil {
					t.Errorf("root %+v linux %+v", g.Root, g.Linux)
				}
			},
		},
		{
			name:   "only host hooks: the guest's spec has none",
			modify: func(s *specs.Spec) { s.Hooks.CreateContainer, s.Hooks.StartContainer = nil, nil },
			check: func(t *testing.T, g *specs.Spec, _ []HostBind) {
				if g.Hooks != nil {
					t.Errorf("hooks %+v", g.Hooks)
				}
			},
		},
		{
			name: "read-only binds stay read-only on the host, recursively as the options say; slave and shared ones follow the host",
			modify: func(s *specs.Spec) {
				s.Mounts = []specs.Mount{
					{Destination: "/a", Type: "bind", Source: "/h/a", Options: []string{"bind", "ro"}},
					{Destination: "/b", Type: "bind", Source: "/h/b", Options: []string{"rbind", "ro"}},
					{Destination: "/c", Type: "bind", Source: "/h/c", Options: []string{"rbind", "rro"}},
					{Destination: "/d", Type: "bind", Source: "/h/d", Options: []string{"rbind", "ro", "rro"}},
					{Destination: "/e", Type: "bind", Source: "/h/e", Options: []string{"bind", "rro"}},
					{Destination: "/f", Source: "/h/f", Options: []string{"rbind", "ro", "rw"}},
					{Destination: "/g", Source: "/h/g", Options: []string{"rw", "rbind", "ro"}},
					{Destination: "/h", Source: "/h/h", Options: []string{"rbind", "ro", "rrw"}},
					{Destination: "/i", Source: "/h/i", Options: []string{"rbind", "rro", "rrw", "ro"}},
					{Destination: "/j", Source: "/h/j", Options: []string{"rbind", "rrw", "rro", "rw"}},
					{Destination: "/k", Type: "bind", Source: "/h/k"},
					{Destination: "/l", Type: "bind", Source: "/h/l", Options: []string{"rbind", "rslave"}},
					{Destination: "/m", Type: "bind", Source: "/h/m", Options: []string{"rbind", "ro", "rshared"}},
					{Destination: "/n", Type: "bind", Source: "/h/n", Options: []string{"rbind", "rslave", "rprivate"}},
				}
			},
			check: func(t *testing.T, g *specs.Spec, binds []HostBind) {
				const rec, ro, rro, follow = sandbox.BindRecursive, sandbox.BindReadOnly, sandbox.BindRecursiveReadOnly, sandbox.BindFollowHost
				want := []sandbox.BindFlags{ro, rec | ro, rec | rro, rec | rro, rro, rec, rec | ro, rec, rec, rec | rro, 0, rec | follow, rec | ro | follow, rec}
				if len(binds) != len(want) {
					t.Fatalf("binds %+v", binds)
				}
				for i, b := range binds {
					if b.Flags != want[i] {
						t.Errorf("%s (%v): flags %#x, want %#x", g.Mounts[i].Destination, g.Mounts[i].Options, b.Flags, want[i])
					}
				}
			},
		},
		{
			name: "a user namespace joined by path becomes the pod's; its mounts of sysfs and mqueue binds of the guest's; idmapped binds are idmapped on the host",
			modify: func(s *specs.Spec) {
				s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace, Path: "/proc/42/ns/user"})
				s.Linux.UIDMappings, s.Linux.GIDMappings = userMap(), userMap()
				s.Mounts = append(s.Mounts, specs.Mount{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "ro"}},
					specs.Mount{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue"})
				s.Mounts[1].UIDMappings, s.Mounts[1].GIDMappings = userMap(), userMap()
				s.Mounts[2].UIDMappings, s.Mounts[2].GIDMappings = userMap(), userMap()
				s.Mounts[2].Options = append(s.Mounts[2].Options, "ridmap")
			},
			check: func(t *testing.T, g *specs.Spec, binds []HostBind) {
				if i := slices.IndexFunc(g.Linux.Namespaces, func(ns specs.LinuxNamespace) bool { return ns.Type == specs.UserNamespace }); i < 0 || g.Linux.Namespaces[i].Path != agent.PodUserNamespace {
					t.Errorf("namespaces %+v: want the pod's user namespace", g.Linux.Namespaces)
				}
				if !reflect.DeepEqual(g.Linux.UIDMappings, userMap()) || !reflect.DeepEqual(g.Linux.GIDMappings, userMap()) {
					t.Errorf("the user namespace's mappings %+v %+v, want them kept", g.Linux.UIDMappings, g.Linux.GIDMappings)
				}
				for _, m := range g.Mounts {
					if m.UIDMappings != nil || m.GIDMappings != nil || slices.Contains(m.Options, "ridmap") {
						t.Errorf("guest mount %+v: idmapped, which the guest cannot make", m)
					}
				}
				want := []specs.Mount{{Destination: "/sys", Type: "bind", Source: "/sys", Options: []string{"rbind", "rro", "nosuid", "nodev", "noexec"}},
					{Destination: "/dev/mqueue", Type: "bind", Source: "/dev/mqueue", Options: []string{"rbind", "nosuid", "nodev", "noexec"}}}
				if got := g.Mounts[len(g.Mounts)-2:]; !reflect.DeepEqual(got, want) {
					t.Errorf("sysfs and mqueue mounts %+v, want %+v", got, want)
				}
				if !reflect.DeepEqual(binds[0].UIDMappings, userMap()) || binds[1].Flags&sandbox.BindIDMapRecursive == 0 || binds[2].UIDMappings != nil {
					t.Errorf("binds %+v: want the first two idmapped, the second recursively", binds)
				}
			},
		},
		{
			name: "a container with its own IPC namespace in a user namespace mounts its own mqueue",
			modify: func(s *specs.Spec) {
				s.Linux.Namespaces = []specs.LinuxNamespace{{Type: specs.UserNamespace}, {Type: specs.IPCNamespace}}
				s.Linux.UIDMappings, s.Linux.GIDMappings = userMap(), userMap()
				s.Mounts = []specs.Mount{{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue"}}
			},
			check: func(t *testing.T, g *specs.Spec, binds []HostBind) {
				if want := []specs.LinuxNamespace{{Type: specs.UserNamespace}, {Type: specs.IPCNamespace}}; !reflect.DeepEqual(g.Linux.Namespaces, want) {
					t.Errorf("namespaces %+v, want %+v", g.Linux.Namespaces, want)
				}
				if g.Mounts[0].Type != "mqueue" {
					t.Errorf("mounts %+v: want its own mqueue", g.Mounts)
				}
			},
		},
		{name: "two uid mappings", modify: func(s *specs.Spec) {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
			s.Linux.UIDMappings = append(userMap(), specs.LinuxIDMapping{ContainerID: 65536, HostID: 300000, Size: 1})
			s.Linux.GIDMappings = userMap()
		}, wantError: "user namespace: 2 uid mappings, want one"},
		{name: "no gid mapping", modify: func(s *specs.Spec) {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
			s.Linux.UIDMappings = userMap()
		}, wantError: "user namespace: 0 gid mappings, want one"},
		{name: "a mapping without container id 0", modify: func(s *specs.Spec) {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
			s.Linux.UIDMappings, s.Linux.GIDMappings = userMap(), []specs.LinuxIDMapping{{ContainerID: 1, HostID: 100000, Size: 65536}}
		}, wantError: "the gid mapping 1:100000:65536 does not map container id 0"},
		{name: "a mapping past 32 bits", modify: func(s *specs.Spec) {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: specs.UserNamespace})
			s.Linux.UIDMappings, s.Linux.GIDMappings = []specs.LinuxIDMapping{{HostID: 1<<32 - 10, Size: 11}}, userMap()
		}, wantError: "within 32-bit ids"},
		{name: "mappings without a user namespace", modify: func(s *specs.Spec) { s.Linux.UIDMappings = userMap() },
			wantError: "uidMappings and gidMappings without a user namespace"},
		{name: "an idmapped tmpfs", modify: func(s *specs.Spec) {
			s.Mounts = append(s.Mounts, specs.Mount{Destination: "/t", Type: "tmpfs", Source: "tmpfs", UIDMappings: userMap(), GIDMappings: userMap()})
		}, wantError: `mount at /t: uidMappings and gidMappings on a "tmpfs" mount`},
		{name: "an idmapped bind with two mappings", modify: func(s *specs.Spec) {
			s.Mounts[2].UIDMappings, s.Mounts[2].GIDMappings = userMap(), append(userMap(), userMap()...)
		}, wantError: "bind mount of /srv/data at /data: 2 gid mappings, want one"},
		{name: "relative bind source", modify: func(s *specs.Spec) { s.Mounts[2].Source = "data" }, wantError: `bind mount of "data" at /data`},
		{name: "no process", modify: func(s *specs.Spec) { s.Process = nil }, wantError: "no process"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := base()
			if tt.modify != nil {
				tt.modify(s)
			}
			orig := base()
			if tt.modify != nil {
				tt.modify(orig)
			}
			g, binds, err := AdaptSpec(s, "c1")
			if tt.wantError != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantError) {
					t.Fatalf("error %v, want %q", err, tt.wantError)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, g, binds)
			if !reflect.DeepEqual(s, orig) {
				t.Errorf("AdaptSpec modified its input")
			}
		})
	}
}

func TestSandboxID(t *testing.T) {
	tests := []struct {
		name, id string
		ann      map[string]string
		want     string
		err      string
	}{
		{"ctr: no annotations, a pod of its own", "t1", nil, "t1", ""},
		{"CRI sandbox container", "p1", map[string]string{AnnotationContainerType: "sandbox", AnnotationSandboxID: "p1"}, "p1", ""},
		{"CRI container joins its sandbox", "c1", map[string]string{AnnotationContainerType: "container", AnnotationSandboxID: "p1"}, "p1", ""},
		{"sandbox id alone groups", "c1", map[string]string{AnnotationSandboxID: "p1"}, "p1", ""},
		{"sandbox without its id", "p1", map[string]string{AnnotationContainerType: "sandbox"}, "p1", ""},
		{"CRI container without a sandbox", "c1", map[string]string{AnnotationContainerType: "container"}, "", "without io.kubernetes.cri.sandbox-id"},
		{"sandbox naming another", "p1", map[string]string{AnnotationContainerType: "sandbox", AnnotationSandboxID: "p2"}, "", "names another sandbox"},
		{"unknown type", "c1", map[string]string{AnnotationContainerType: "podsandbox"}, "", `unknown io.kubernetes.cri.container-type "podsandbox"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := SandboxID(tt.id, tt.ann)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Errorf("SandboxID = %q, %v; want error %q", got, err, tt.err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("SandboxID = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// TestPodSysctls: a pod's first container's sysctls are the VM's, except those of an IPC
// namespace the container has of its own, which stay in its guest spec for runc; a sandbox
// container's are all the VM's; the host's spec is left as it was.
func TestPodSysctls(t *testing.T) {
	sysctls := map[string]string{"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100", "net.ipv4.ip_forward": "1"}
	spec := func(ns ...specs.LinuxNamespaceType) *specs.Spec {
		s := &specs.Spec{Process: &specs.Process{Args: []string{"sh"}}, Linux: &specs.Linux{Sysctl: maps.Clone(sysctls)}}
		for _, n := range ns {
			s.Linux.Namespaces = append(s.Linux.Namespaces, specs.LinuxNamespace{Type: n})
		}
		return s
	}
	// A container alone in its pod, with an IPC namespace of its own.
	s := spec(specs.IPCNamespace, specs.MountNamespace, specs.NetworkNamespace)
	g, _, err := AdaptSpec(s, "c")
	if err != nil {
		t.Fatal(err)
	}
	vm := podSysctls(s, g)
	if !maps.Equal(vm, map[string]string{"net.ipv4.ip_forward": "1"}) {
		t.Errorf("the VM's sysctls %v, want the network's", vm)
	}
	if !maps.Equal(g.Linux.Sysctl, map[string]string{"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100"}) {
		t.Errorf("the guest spec's sysctls %v, want those of its IPC namespace", g.Linux.Sysctl)
	}
	if !maps.Equal(s.Linux.Sysctl, sysctls) {
		t.Errorf("the host's spec changed: %v", s.Linux.Sysctl)
	}
	// Sharing the guest's IPC namespace: all the VM's.
	s = spec(specs.MountNamespace)
	g, _, _ = AdaptSpec(s, "c")
	if vm := podSysctls(s, g); !maps.Equal(vm, sysctls) || g.Linux.Sysctl != nil {
		t.Errorf("without an IPC namespace: the VM's %v, the guest spec's %v; want all the VM's", vm, g.Linux.Sysctl)
	}
	// CRI's sandbox container runs nothing in the guest: all the VM's.
	if vm := podSysctls(spec(specs.IPCNamespace), nil); !maps.Equal(vm, sysctls) {
		t.Errorf("a sandbox container: the VM's %v, want all", vm)
	}
	if vm := podSysctls(&specs.Spec{Linux: &specs.Linux{}}, nil); vm != nil {
		t.Errorf("no sysctls: %v", vm)
	}
}

// userMap is a CRI pod's user namespace mapping: container ids 0-65535 to host ids 100000-165535.
func userMap() []specs.LinuxIDMapping {
	return []specs.LinuxIDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
}
