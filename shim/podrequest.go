package shim

import (
	"fmt"
	"runtime"
	"strconv"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// A pod's request (PodRequest) is made in one place, whichever API makes the pod: the task
// API's first container (CRI's pod sandbox container, or a pod's one container under ctr) or
// the Sandbox API's CreateSandbox (CRI's PodSandboxConfig). Each says what the pod asks in
// common terms (a podAsk: podAskOfSpec, podAskOfCRI); newPodRequest checks it whole and sizes
// the VM.

// podAsk is what a pod asks of its VM and its guest.
type podAsk struct {
	id          string
	sandboxTask bool              // CRI's pod sandbox container: its task is the VM's
	annotations map[string]string // untrusted (sandbox.Config.Resolve)
	resources   podResources
	// hostPID and hostIPC: the pod asks for the node's PID or IPC namespace.
	hostPID, hostIPC bool
	// userNS is the source's own check of the pod's user namespace, whose terms differ.
	userNS      error
	netNS       string // "": no NIC
	hostname    string
	sysctls     map[string]string
	cgroup      string // "": none joined
	oomScoreAdj *int   // nil: the shim's
}

// podResources are a pod's limits, the sums of its containers' (CRI's linux.resources of the
// PodSandboxConfig): CPU quota per period, and memory in bytes. Zero: no limit.
type podResources struct {
	cpuPeriod, cpuQuota, memory int64
}

// CRI's annotations on the pod sandbox container with the pod's resources (the sums of its
// containers' limits, from the PodSandboxConfig's linux.resources).
const (
	AnnotationSandboxCPUPeriod = "io.kubernetes.cri.sandbox-cpu-period"
	AnnotationSandboxCPUQuota  = "io.kubernetes.cri.sandbox-cpu-quota"
	AnnotationSandboxMemory    = "io.kubernetes.cri.sandbox-memory"
)

// podAskOfSpec is what the task API's first container asks, whose spec is spec (guestSpec: as
// the guest runs it; nil for CRI's pod sandbox container, which runs nothing). CRI's pod
// sandbox container brings the pod's namespaces, resources and cgroup; it, or a container
// outside CRI, the pod's network, hostname and sysctls. A CRI container joins a pod its
// sandbox made, whose network it shares (its spec names the sandbox task's namespace by pid,
// the VM's, which is not the pod's): only the id is read.
func podAskOfSpec(id string, spec, guestSpec *specs.Spec) (podAsk, error) {
	a := podAsk{id: id, annotations: spec.Annotations}
	a.oomScoreAdj, _ = podOOMScoreAdj(spec)
	switch spec.Annotations[AnnotationContainerType] {
	case containerTypeContainer:
		return a, nil
	case containerTypeSandbox:
		a.sandboxTask = true
		a.hostPID, a.hostIPC = !hasNamespace(spec, specs.PIDNamespace), !hasNamespace(spec, specs.IPCNamespace)
		if spec.Linux != nil {
			a.userNS = checkUserNamespace(spec.Linux)
			a.cgroup = spec.Linux.CgroupsPath
		}
		var err error
		if a.resources, err = resourcesOfAnnotations(spec.Annotations); err != nil {
			return podAsk{}, fmt.Errorf("pod %s: %v: %w", id, err, errdefs.ErrInvalidArgument)
		}
	}
	a.hostname = spec.Hostname
	a.sysctls = podSysctls(spec, guestSpec)
	var err error
	if a.netNS, err = podNetNS(spec); err != nil {
		return podAsk{}, fmt.Errorf("pod %s: %v: %w", id, err, errdefs.ErrInvalidArgument)
	}
	return a, nil
}

// podAskOfCRI is what CRI's PodSandboxConfig pc asks, for the Sandbox API's pod id on netns.
// The VM's size comes from the pod's resources only, never from the pod's annotations; a
// negative one is an error naming its field.
func podAskOfCRI(id string, pc *criapi.PodSandboxConfig, annotations map[string]string, netns, cgroup string) (podAsk, error) {
	ns := pc.GetLinux().GetSecurityContext().GetNamespaceOptions()
	res := pc.GetLinux().GetResources()
	for _, f := range []struct {
		name string
		v    int64
	}{{"cpu_period", res.GetCpuPeriod()}, {"cpu_quota", res.GetCpuQuota()}, {"memory_limit_in_bytes", res.GetMemoryLimitInBytes()}} {
		if f.v < 0 {
			return podAsk{}, fmt.Errorf("pod %s: linux.resources.%s %d: want a non-negative number: %w", id, f.name, f.v, errdefs.ErrInvalidArgument)
		}
	}
	return podAsk{
		id:          id,
		annotations: annotations,
		resources:   podResources{cpuPeriod: res.GetCpuPeriod(), cpuQuota: res.GetCpuQuota(), memory: res.GetMemoryLimitInBytes()},
		hostPID:     ns.GetPid() == criapi.NamespaceMode_NODE,
		hostIPC:     ns.GetIpc() == criapi.NamespaceMode_NODE,
		userNS:      checkCRIUserNamespace(ns.GetUsernsOptions()),
		netNS:       netns,
		hostname:    pc.GetHostname(),
		sysctls:     pc.GetLinux().GetSysctls(),
		cgroup:      cgroup,
	}, nil
}

// resourcesOfAnnotations reads the pod's resources from CRI's annotations on its pod sandbox
// container; a value that is not a non-negative integer is an error naming its annotation.
func resourcesOfAnnotations(annotations map[string]string) (podResources, error) {
	var r podResources
	for _, f := range []struct {
		name string
		v    *int64
	}{{AnnotationSandboxCPUPeriod, &r.cpuPeriod}, {AnnotationSandboxCPUQuota, &r.cpuQuota}, {AnnotationSandboxMemory, &r.memory}} {
		s, ok := annotations[f.name]
		if !ok || s == "" {
			continue
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			return podResources{}, fmt.Errorf("annotation %s=%q: want a non-negative integer", f.name, s)
		}
		*f.v = n
	}
	return r, nil
}

// newPodRequest checks what a pod asks, whole, and makes the request that boots it, its VM
// sized from cfg (sizePod). What the pod may not have is InvalidArgument; a cgroup the shim
// could not join, FailedPrecondition: either fails the pod before anything is made.
func newPodRequest(cfg *sandbox.Config, a podAsk) (PodRequest, error) {
	invalid := func(err error) (PodRequest, error) {
		return PodRequest{}, fmt.Errorf("pod %s: %v: %w", a.id, err, errdefs.ErrInvalidArgument)
	}
	if err := hostNamespaces(a.hostPID, a.hostIPC); err != nil {
		return invalid(err)
	}
	if a.userNS != nil {
		return invalid(a.userNS)
	}
	if a.hostname != "" {
		if err := agent.CheckHostname(a.hostname); err != nil {
			return invalid(err)
		}
	}
	if err := agent.CheckSysctls(a.sysctls); err != nil {
		return invalid(err)
	}
	if a.oomScoreAdj != nil {
		if err := sandbox.CheckOOMScoreAdj(*a.oomScoreAdj); err != nil {
			return invalid(err)
		}
	}
	sized, err := sizePod(cfg, a.resources)
	if err != nil {
		return invalid(err)
	}
	if a.cgroup != "" {
		if err := checkPodCgroup(a.cgroup); err != nil {
			return PodRequest{}, fmt.Errorf("pod %s: %v: %w", a.id, err, errdefs.ErrFailedPrecondition)
		}
	}
	return PodRequest{ID: a.id, Config: sized, Annotations: a.annotations, SandboxTask: a.sandboxTask,
		Hostname: a.hostname, NetNS: a.netNS, Cgroup: a.cgroup, Sysctls: a.sysctls, OOMScoreAdj: a.oomScoreAdj}, nil
}

// sizePod returns cfg with the VM sized for a pod with resources r: vm.vcpus plus the CPUs the
// pod's quota asks for (quota / period, rounded up), at most the host's CPUs; vm.memory plus
// the pod's memory limit (rounded up to MiB). The configured sizes are what the guest's
// kernel, agent and page cache need; the pod's limits come on top, as Kata sizes its VMs.
// Without limits cfg's sizes stand. cfg is not modified.
func sizePod(cfg *sandbox.Config, r podResources) (*sandbox.Config, error) {
	out := cfg.Clone()
	if r.cpuQuota > 0 && r.cpuPeriod > 0 {
		extra := (r.cpuQuota + r.cpuPeriod - 1) / r.cpuPeriod
		out.VM.VCPUs = int(min(int64(out.VM.VCPUs)+extra, int64(runtime.NumCPU())))
		out.VM.VCPUs = max(out.VM.VCPUs, cfg.VM.VCPUs)
	}
	if r.memory > 0 {
		base, err := sandbox.ParseMemorySize(out.VM.Memory)
		if err != nil {
			return nil, fmt.Errorf("vm.memory %q: %v", out.VM.Memory, err)
		}
		const mib = 1 << 20
		total := (base+mib-1)/mib + (uint64(r.memory)+mib-1)/mib
		if total > 1<<30 { // 1 PiB: no host has it; the sum must not wrap
			return nil, fmt.Errorf("a memory limit of %d bytes: the VM would need %d MiB", r.memory, total)
		}
		out.VM.Memory = strconv.FormatUint(total, 10) + "M"
	}
	return out, nil
}

// checkCRIUserNamespace accepts the pod's user namespace options as checkUserNamespace takes
// a container's: none, or mode NODE (the node's user namespace, as without one), or mode POD
// with one uid and one gid mapping, each mapping container id 0.
func checkCRIUserNamespace(o *criapi.UserNamespace) error {
	switch o.GetMode() {
	case criapi.NamespaceMode_NODE:
		return nil
	case criapi.NamespaceMode_POD:
		if o == nil {
			return nil
		}
	default:
		return fmt.Errorf("user namespace mode %s: kvfs takes POD or NODE", o.GetMode())
	}
	ids := func(m []*criapi.IDMapping) []specs.LinuxIDMapping {
		out := make([]specs.LinuxIDMapping, len(m))
		for i, e := range m {
			out[i] = specs.LinuxIDMapping{ContainerID: e.GetContainerId(), HostID: e.GetHostId(), Size: e.GetLength()}
		}
		return out
	}
	if err := checkIDMappings(ids(o.GetUids()), ids(o.GetGids())); err != nil {
		return fmt.Errorf("user namespace: %w", err)
	}
	return nil
}
