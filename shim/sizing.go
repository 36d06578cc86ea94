package shim

import (
	"fmt"
	"runtime"
	"strconv"

	criapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/kvfs/kvfs/sandbox"
)

// CRI's annotations on the pod sandbox container with the pod's resources (the sums of its
// containers' limits, from the PodSandboxConfig's linux.resources).
const (
	AnnotationSandboxCPUPeriod = "io.kubernetes.cri.sandbox-cpu-period"
	AnnotationSandboxCPUQuota  = "io.kubernetes.cri.sandbox-cpu-quota"
	AnnotationSandboxMemory    = "io.kubernetes.cri.sandbox-memory"
)

// SizePod returns cfg with the VM sized for a pod whose sandbox container has annotations:
// vm.vcpus plus the CPUs the pod's quota asks for (quota / period, rounded up), at most the
// host's CPUs; vm.memory plus the pod's memory limit (rounded up to MiB). The configured
// sizes are what the guest's kernel, agent and page cache need; the pod's limits come on top,
// as Kata sizes its VMs. Without the annotations (a pod without limits) cfg's sizes stand. A
// value that is not a non-negative integer is an error naming its annotation. cfg is not
// modified.
func SizePod(cfg *sandbox.Config, annotations map[string]string) (*sandbox.Config, error) {
	num := func(name string) (int64, error) {
		v, ok := annotations[name]
		if !ok || v == "" {
			return 0, nil
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("annotation %s=%q: want a non-negative integer", name, v)
		}
		return n, nil
	}
	period, err := num(AnnotationSandboxCPUPeriod)
	if err != nil {
		return nil, err
	}
	quota, err := num(AnnotationSandboxCPUQuota)
	if err != nil {
		return nil, err
	}
	mem, err := num(AnnotationSandboxMemory)
	if err != nil {
		return nil, err
	}
	out := cfg.Clone()
	if quota > 0 && period > 0 {
		extra := (quota + period - 1) / period
		out.VM.VCPUs = int(min(int64(out.VM.VCPUs)+extra, int64(runtime.NumCPU())))
		out.VM.VCPUs = max(out.VM.VCPUs, cfg.VM.VCPUs)
	}
	if mem > 0 {
		base, err := sandbox.ParseMemorySize(out.VM.Memory)
		if err != nil {
			return nil, fmt.Errorf("vm.memory %q: %v", out.VM.Memory, err)
		}
		const mib = 1 << 20
		total := (base+mib-1)/mib + (uint64(mem)+mib-1)/mib
		if total > 1<<30 { // 1 PiB: no host has it; the sum must not wrap
			return nil, fmt.Errorf("annotation %s=%d: the VM would need %d MiB", AnnotationSandboxMemory, mem, total)
		}
		out.VM.Memory = strconv.FormatUint(total, 10) + "M"
	}
	return out, nil
}

// podResourceAnnotations are the annotations SizePod reads, from the pod's resources in its
// CRI PodSandboxConfig (linux.resources): what CRI's podsandbox sandboxer puts on the pause
// container, for the Sandbox API, which gets the config itself. No resources, no annotations.
func podResourceAnnotations(res *criapi.LinuxContainerResources) map[string]string {
	if res == nil {
		return nil
	}
	return map[string]string{
		AnnotationSandboxCPUPeriod: strconv.FormatInt(res.GetCpuPeriod(), 10),
		AnnotationSandboxCPUQuota:  strconv.FormatInt(res.GetCpuQuota(), 10),
		AnnotationSandboxMemory:    strconv.FormatInt(res.GetMemoryLimitInBytes(), 10),
	}
}
