package k8s

import (
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
)

// compare runs the pod spec(rt) for runc and for kvfs at once, each of its containers printing
// what it sees and then "done" before it exits, and fails the test unless each container's log
// in the kvfs pod is the same container's in the runc pod, the pods' names and addresses
// aside (each is replaced by a placeholder).
func compare(t *testing.T, c *k8stest.Cluster, base string, spec func(c *k8stest.Cluster, rt runtime) map[string]any) {
	for _, rt := range runtimes {
		s := spec(c, rt)
		s["restartPolicy"] = "Never"
		runPod(t, c, name(base, rt), s)
	}
	logs := make(map[runtime]map[string]string)
	for _, rt := range runtimes {
		pn := name(base, rt)
		p := waitPod(t, c, pn, "done", 5*time.Minute, func(p *pod) bool { return p.Status.Phase == "Succeeded" || p.Status.Phase == "Failed" })
		logs[rt] = make(map[string]string)
		for _, cs := range p.Status.ContainerStatuses {
			log := c.Kubectl(t, "logs", pn, "-c", cs.Name)
			if !strings.HasSuffix(log, "done\n") {
				t.Errorf("%s pod, container %s: its log does not end with done (exit %+v):\n%s", rt, cs.Name, cs.State.Terminated, log)
			}
			logs[rt][cs.Name] = strings.NewReplacer(pn, "POD", p.Status.PodIP, "POD_IP").Replace(log)
		}
	}
	for ctr, want := range logs[runc] {
		if got := logs[kvfs][ctr]; got != want {
			t.Errorf("container %s: the kvfs pod saw\n%s\nthe runc pod\n%s", ctr, got, want)
		}
	}
	if len(logs[kvfs]) != len(logs[runc]) {
		t.Errorf("the kvfs pod's containers: %d, the runc pod's %d", len(logs[kvfs]), len(logs[runc]))
	}
}

// securityContextPod: the pod's users and groups (fsGroup on a volume, what a file made there
// gets), a read-only root, no privilege escalation, capabilities dropped and added, and
// seccomp RuntimeDefault, in one container; root, seccomp Unconfined and the default
// capabilities in the other.
func securityContextPod(c *k8stest.Cluster, rt runtime) map[string]any {
	status := `grep -E '^(NoNewPrivs|Seccomp|CapInh|CapPrm|CapEff|CapBnd|CapAmb):' /proc/self/status`
	restricted := shell("restricted", `id
if touch /rootfile 2>/dev/null; then echo "root writable"; else echo "root read-only"; fi
touch /vol/made && stat -c 'made %u %g %a' /vol/made
stat -c 'volume %g %a' /vol
`+status+`
echo done`)
	restricted["securityContext"] = map[string]any{
		"allowPrivilegeEscalation": false,
		"readOnlyRootFilesystem":   true,
		"capabilities":             map[string]any{"drop": []string{"ALL"}, "add": []string{"NET_BIND_SERVICE"}},
		"seccompProfile":           map[string]any{"type": "RuntimeDefault"},
	}
	restricted["volumeMounts"] = []any{map[string]any{"name": "vol", "mountPath": "/vol"}}
	unconfined := shell("unconfined", "id\n"+status+"\necho done")
	unconfined["securityContext"] = map[string]any{"runAsUser": 0, "runAsGroup": 0, "seccompProfile": map[string]any{"type": "Unconfined"}}
	spec := podSpec(c, rt, restricted, unconfined)
	spec["securityContext"] = map[string]any{"runAsUser": 1000, "runAsGroup": 3000, "fsGroup": 2000, "supplementalGroups": []int{4000}}
	spec["volumes"] = []any{map[string]any{"name": "vol", "emptyDir": map[string]any{}}}
	return spec
}

// limitsPod: a container's CPU, memory and PID limits as its cgroup has them (cgroup v1 or v2,
// whichever the container has).
func limitsPod(c *k8stest.Cluster, rt runtime) map[string]any {
	limited := shell("limited", `if [ -f /sys/fs/cgroup/memory.max ]; then
	echo "memory $(cat /sys/fs/cgroup/memory.max)"
	echo "cpu $(cat /sys/fs/cgroup/cpu.max)"
	echo "pids $(cat /sys/fs/cgroup/pids.max)"
else
	echo "memory $(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)"
	echo "cpu $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)"
	echo "pids $(cat /sys/fs/cgroup/pids/pids.max)"
fi
echo done`)
	limited["resources"] = map[string]any{"limits": map[string]any{"cpu": "500m", "memory": "128Mi"}}
	return podSpec(c, rt, limited)
}

// hostsDNSPod: hostAliases in /etc/hosts, a dnsConfig of its own in /etc/resolv.conf, and a
// hostname of its own. resolv.conf's options are printed sorted: the kubelet writes them in
// the order of a Go map's range, which differs from pod to pod, runc's two as much.
func hostsDNSPod(c *k8stest.Cluster, rt runtime) map[string]any {
	spec := podSpec(c, rt, shell("main", `cat /etc/hosts
grep -v '^options ' /etc/resolv.conf
grep '^options ' /etc/resolv.conf | tr ' ' '\n' | sort
hostname
echo done`))
	spec["hostname"] = "custom-host"
	spec["hostAliases"] = []any{map[string]any{"ip": "10.1.2.3", "hostnames": []string{"foo.local", "bar.local"}}}
	spec["dnsPolicy"] = "None"
	spec["dnsConfig"] = map[string]any{
		"nameservers": []string{"192.0.2.53"},
		"searches":    []string{"ns1.svc.cluster-domain.example", "my.dns.search.suffix"},
		"options":     []any{map[string]any{"name": "ndots", "value": "2"}, map[string]any{"name": "edns0"}},
	}
	return spec
}
