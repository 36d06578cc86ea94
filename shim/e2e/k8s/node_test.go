package k8s

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/k8stest"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// kvfsOverhead is the RuntimeClass kvfs's overhead.podFixed memory
// (packaging/kubernetes/runtimeclass.yaml), which the kubelet adds to a kvfs pod's cgroup limit.
const kvfsOverhead = 168 << 20

// testPodCgroup: the pod's memory limit on the host is its containers' limits, and for a kvfs
// pod the RuntimeClass's overhead on top; the kvfs pod's VM runs in that cgroup.
func testPodCgroup(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("podcg", rt)
	main := shell("main", "exec sleep 3600")
	main["resources"] = map[string]any{"limits": map[string]any{"cpu": "500m", "memory": "128Mi"}}
	runPod(t, c, pn, podSpec(c, rt, main))
	p := waitPod(t, c, pn, "running", 5*time.Minute, running)
	// Requests equal to limits: the pod is Guaranteed, its cgroup kubepods/pod<uid>.
	memcg := filepath.Join("/sys/fs/cgroup/memory", c.Env.C.Namespace(), "kubepods", "pod"+p.Metadata.UID)
	b, err := os.ReadFile(filepath.Join(memcg, "memory.limit_in_bytes"))
	if err != nil {
		t.Fatalf("the pod's memory cgroup: %v", err)
	}
	want := 128 << 20
	if rt == kvfs {
		want += kvfsOverhead
	}
	if got := strings.TrimSpace(string(b)); got != strconv.Itoa(want) {
		t.Errorf("the pod's memory cgroup limit on the host: %s, want %d", got, want)
	}
	if rt != kvfs {
		return
	}
	vms := vmsOf(t, c, sandboxesOf(t, c, "--name", pn))
	if len(vms) != 1 {
		t.Fatalf("the kvfs pod's VM: %d QEMU processes name its sandbox, want 1", len(vms))
	}
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", vms[0].PID))
	if err != nil {
		t.Fatal(err)
	}
	rel := "/" + c.Env.C.Namespace() + "/kubepods/pod" + p.Metadata.UID
	inPod := false
	for _, l := range strings.Split(string(cg), "\n") {
		// ID:CONTROLLERS:PATH
		if f := strings.SplitN(l, ":", 3); len(f) == 3 && strings.Contains(","+f[1]+",", ",memory,") {
			inPod = f[2] == rel || strings.HasPrefix(f[2], rel+"/")
		}
	}
	if !inPod {
		t.Errorf("the kvfs pod's QEMU is not in the pod's memory cgroup %s:\n%s", rel, cg)
	}
}

// testFiveAtOnce: five pods created at once are all Ready, and once deleted all are gone.
func testFiveAtOnce(t *testing.T, c *k8stest.Cluster, rt runtime) {
	app := name("five", rt)
	var items []any
	for i := range 5 {
		items = append(items, map[string]any{
			"apiVersion": "v1", "kind": "Pod",
			"metadata": map[string]any{"name": fmt.Sprintf("%s-%d", app, i), "labels": map[string]string{"app": app}},
			"spec":     podSpec(c, rt, shell("main", "exec sleep 3600")),
		})
	}
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "List", "items": items}))
	t.Cleanup(func() { c.Kubectl(t, "delete", "pods", "-l", "app="+app, "--wait", "--timeout=3m") })
	waitPods(t, c, app, 5, 5*time.Minute)
	ids := sandboxesOf(t, c, "--label", "app="+app, "--state", "ready")
	if rt == kvfs {
		if vms := vmsOf(t, c, ids); len(vms) != 5 {
			t.Errorf("five kvfs pods: %d VMs", len(vms))
		}
	}
	c.Kubectl(t, "delete", "pods", "-l", "app="+app, "--wait", "--timeout=3m")
	checkSandboxesGone(t, c, app, ids)
}

// testNodeRestarts: a runc pod and a kvfs pod keep running, unrestarted, through a restart of
// the kubelet and then one of containerd; exec and logs work after each.
func testNodeRestarts(t *testing.T, c *k8stest.Cluster) {
	for _, rt := range runtimes {
		runPod(t, c, name("restarts", rt), podSpec(c, rt, shell("main", `echo "up in $(hostname)"; exec sleep 3600`)))
	}
	check := func(after string) {
		t.Helper()
		for _, rt := range runtimes {
			pn := name("restarts", rt)
			p := waitPod(t, c, pn, "running after the "+after, 3*time.Minute, running)
			if p.restarts() != 0 {
				t.Errorf("%s pod after the %s: %d restarts", rt, after, p.restarts())
			}
			if got := c.Kubectl(t, "exec", pn, "--", "echo", "still"); got != "still\n" {
				t.Errorf("%s pod after the %s: exec said %q", rt, after, got)
			}
			if got := c.Kubectl(t, "logs", pn); got != "up in "+pn+"\n" {
				t.Errorf("%s pod after the %s: logs %q", rt, after, got)
			}
		}
	}
	check("start")
	c.RestartKubelet(t)
	check("kubelet's restart")
	c.Env.C.Restart(t)
	check("containerd's restart")
}

// sandboxesOf are the ids of the pod sandboxes crictl pods lists with the filter args.
func sandboxesOf(t *testing.T, c *k8stest.Cluster, args ...string) []string {
	t.Helper()
	return strings.Fields(c.Env.C.Crictl(t, append([]string{"pods", "-q"}, args...)...))
}

// vmsOf are the running QEMU processes of the sandboxes ids (a kvfs pod's QEMU is named
// kvfs-ID).
func vmsOf(t *testing.T, c *k8stest.Cluster, ids []string) []ctrd.Process {
	t.Helper()
	var vms []ctrd.Process
	for _, p := range shimtest.Alive(c.Env.C.Snapshot(t).Processes) {
		for _, id := range ids {
			if strings.Contains(p.Cmdline, "qemu-system") && strings.Contains(p.Cmdline, "kvfs-"+id) {
				vms = append(vms, p)
			}
		}
	}
	return vms
}

// checkSandboxesGone fails the test unless the sandboxes ids of the pods of app, once deleted,
// are stopped with nothing of them running: none ready, and no process names one (a kvfs pod's
// VM and server have its id in their command lines).
func checkSandboxesGone(t *testing.T, c *k8stest.Cluster, app string, ids []string) {
	t.Helper()
	if ready := sandboxesOf(t, c, "--state", "ready", "--label", "app="+app); len(ready) > 0 {
		t.Errorf("sandboxes of %s still ready after its pods were deleted: %v", app, ready)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Second) {
		var left []string
		for _, p := range shimtest.Alive(c.Env.C.Snapshot(t).Processes) {
			for _, id := range ids {
				if strings.Contains(p.Cmdline, id) {
					left = append(left, p.Cmdline)
				}
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("processes of the deleted pods of %s still run:\n%s", app, strings.Join(left, "\n"))
			return
		}
	}
}
