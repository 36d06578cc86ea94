// Package k8s tests kvfs as Kubernetes users run it: a real single-node cluster (etcd,
// kube-apiserver, controller-manager, scheduler and kubelet, internal/testing/k8stest) on a
// private containerd whose CRI has the runc and kvfs runtime handlers, the RuntimeClass kvfs
// of packaging/kubernetes, and kubectl. Each behaviour runs twice in the same cluster, for a
// pod of containerd's runc runtime and for one of RuntimeClass kvfs (a QEMU VM, TCG here),
// and asserts the same of both: what a runc pod does is the bar. Only tests.
package k8s

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

func TestMain(m *testing.M) { os.Exit(shimtest.Main(m)) }

// runtime is a pod's RuntimeClass: "" for containerd's default handler (runc), or "kvfs".
type runtime string

const (
	runc runtime = ""
	kvfs runtime = "kvfs"
)

func (r runtime) String() string {
	if r == runc {
		return "runc"
	}
	return string(r)
}

// runtimes are the runtimes each behaviour runs under, runc first.
var runtimes = []runtime{runc, kvfs}

// TestKubernetes runs every behaviour in one cluster: most for each runtime, as subtests
// named behaviour/runtime; those whose pods print what they see for both runtimes at once, as
// subtests named behaviour/kvfs=runc that compare the two; and those about the node (its
// kubelet's and containerd's restarts under running pods) last. Then containerd's log must not
// have a shim's refusal of a task's metrics (checkMetricsLog).
func TestKubernetes(t *testing.T) {
	c := k8stest.Start(t)
	for _, b := range []struct {
		name string
		run  func(t *testing.T, c *k8stest.Cluster, rt runtime)
	}{
		{"deployment", testDeployment},
		{"init-containers", testInitContainers},
		{"probes", testProbes},
		{"jobs", testJobs},
		{"oom-killed", testOOMKilled},
		{"termination", testTermination},
		{"stdin", testStdin},
		{"attach", testAttach},
		{"configmap", testConfigMap},
		{"secret-projected", testSecretProjected},
		{"emptydir", testEmptyDir},
		{"hostpath", testHostPath},
		{"env", testEnv},
		{"share-process-namespace", testShareProcessNamespace},
		{"pod-to-pod", testPodToPod},
		{"port-forward", testPortForward},
		{"pod-cgroup", testPodCgroup},
		{"five-at-once", testFiveAtOnce},
	} {
		t.Run(b.name, func(t *testing.T) {
			for _, rt := range runtimes {
				t.Run(rt.String(), func(t *testing.T) { b.run(t, c, rt) })
			}
		})
	}
	for _, b := range []struct {
		name string
		spec func(c *k8stest.Cluster, rt runtime) map[string]any
	}{
		{"security-context", securityContextPod},
		{"limits", limitsPod},
		{"hosts-dns", hostsDNSPod},
	} {
		t.Run(b.name+"/kvfs=runc", func(t *testing.T) { compare(t, c, b.name, b.spec) })
	}
	t.Run("node-restarts", func(t *testing.T) { testNodeRestarts(t, c) })
	t.Run("containerd-log", func(t *testing.T) { checkMetricsLog(t, c) })
}

// podSpec is the spec of a pod of rt whose containers are given, each image the test image
// (never pulled: it is in containerd already).
func podSpec(c *k8stest.Cluster, rt runtime, containers ...map[string]any) map[string]any {
	for _, ctr := range containers {
		withImage(c, ctr)
	}
	spec := map[string]any{"containers": containers, "terminationGracePeriodSeconds": 2}
	if rt != runc {
		spec["runtimeClassName"] = string(rt)
	}
	return spec
}

// shell is a container running sh -c script.
func shell(name, script string) map[string]any {
	return map[string]any{"name": name, "command": []string{"sh", "-c", script}}
}

func manifest(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// name is a name of the test's objects for rt: Kubernetes names are lower case.
func name(base string, rt runtime) string { return base + "-" + rt.String() }

// pod is what the tests read of a pod.
type pod struct {
	Metadata struct {
		Name string
		UID  string `json:"uid"`
	}
	Spec   struct{ RuntimeClassName string }
	Status struct {
		Phase, PodIP          string
		InitContainerStatuses []containerStatus
		ContainerStatuses     []containerStatus
	}
}

type containerStatus struct {
	Name         string
	Ready        bool
	RestartCount int
	State        containerState
	LastState    containerState
}

type containerState struct {
	Running    *struct{}
	Waiting    *struct{ Reason string }
	Terminated *struct {
		ExitCode        int
		Reason, Message string
	}
}

// ready says whether every container of p is ready.
func (p *pod) ready() bool {
	for _, cs := range p.Status.ContainerStatuses {
		if !cs.Ready {
			return false
		}
	}
	return len(p.Status.ContainerStatuses) > 0
}

// container is the status of p's container name (an empty one when there is none yet).
func (p *pod) container(name string) containerStatus {
	for _, cs := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if cs.Name == name {
			return cs
		}
	}
	return containerStatus{}
}

// restarts is the sum of p's containers' restart counts.
func (p *pod) restarts() int {
	n := 0
	for _, cs := range p.Status.ContainerStatuses {
		n += cs.RestartCount
	}
	return n
}

// podsOf lists the pods whose label app is app.
func podsOf(t *testing.T, c *k8stest.Cluster, app string) []pod {
	t.Helper()
	var list struct{ Items []pod }
	if err := json.Unmarshal([]byte(c.Kubectl(t, "get", "pods", "-l", "app="+app, "-o", "json")), &list); err != nil {
		t.Fatal(err)
	}
	return list.Items
}

// getPod reads the pod name.
func getPod(t *testing.T, c *k8stest.Cluster, name string) pod {
	t.Helper()
	var p pod
	if err := json.Unmarshal([]byte(c.Kubectl(t, "get", "pod", name, "-o", "json")), &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// waitPods waits until the pods of app are n, each Ready, and returns them.
func waitPods(t *testing.T, c *k8stest.Cluster, app string, n int, timeout time.Duration) []pod {
	t.Helper()
	var pods []pod
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
		pods = podsOf(t, c, app)
		ok := len(pods) == n
		for _, p := range pods {
			ok = ok && p.ready()
		}
		if ok {
			return pods
		}
	}
	t.Fatalf("pods of %s: %d, want %d Ready within %v\n%s", app, len(pods), n, timeout, c.Kubectl(t, "describe", "pods", "-l", "app="+app))
	return nil
}

// waitPod waits until the pod name is as ok wants (what says how), and returns it.
func waitPod(t *testing.T, c *k8stest.Cluster, name, what string, timeout time.Duration, ok func(p *pod) bool) pod {
	t.Helper()
	var p pod
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
		if p = getPod(t, c, name); ok(&p) {
			return p
		}
	}
	t.Fatalf("pod %s: not %s within %v: %+v\n%s", name, what, timeout, p.Status, c.Kubectl(t, "describe", "pod", name))
	return p
}

// runPod creates the pod name of rt with spec (podSpec's), deleted at the end of the test.
func runPod(t *testing.T, c *k8stest.Cluster, name string, spec map[string]any) {
	t.Helper()
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": name}, "spec": spec}))
	t.Cleanup(func() { deleteObject(t, c, "pod", name) })
}

// deleteObject deletes an object of the test and waits until it is gone, and the objects it
// owns (a Deployment's pods, say) before it.
func deleteObject(t *testing.T, c *k8stest.Cluster, kind, name string) {
	t.Helper()
	c.Kubectl(t, "delete", kind, name, "--ignore-not-found", "--cascade=foreground", "--wait", "--timeout=3m")
}

// running says whether every container of p runs and is ready.
func running(p *pod) bool { return p.Status.Phase == "Running" && p.ready() }

// testDeployment: a Deployment of two pods becomes Available, each pod of the runtime asked;
// exec and logs work in each; scaled to three and then to none, its pods follow.
func testDeployment(t *testing.T, c *k8stest.Cluster, rt runtime) {
	app := name("deploy", rt)
	deploy := func(replicas int) string {
		return manifest(t, map[string]any{
			"apiVersion": "apps/v1",
			"kind":       "Deployment",
			"metadata":   map[string]any{"name": app},
			"spec": map[string]any{
				"replicas": replicas,
				"selector": map[string]any{"matchLabels": map[string]any{"app": app}},
				"template": map[string]any{
					"metadata": map[string]any{"labels": map[string]any{"app": app}},
					"spec":     podSpec(c, rt, shell("main", `echo "started in $(hostname)"; exec sleep 3600`)),
				},
			},
		})
	}
	c.Apply(t, deploy(2))
	t.Cleanup(func() { deleteObject(t, c, "deployment", app) })
	for _, p := range waitPods(t, c, app, 2, 5*time.Minute) {
		if p.Spec.RuntimeClassName != string(rt) {
			t.Errorf("pod %s: runtime class %q, want %q", p.Metadata.Name, p.Spec.RuntimeClassName, rt)
		}
		if got := strings.TrimSpace(c.Kubectl(t, "exec", p.Metadata.Name, "--", "cat", "/etc/hostname")); got != p.Metadata.Name {
			t.Errorf("pod %s: exec cat /etc/hostname = %q, want its name", p.Metadata.Name, got)
		}
		if got, want := c.Kubectl(t, "logs", p.Metadata.Name), fmt.Sprintf("started in %s\n", p.Metadata.Name); got != want {
			t.Errorf("pod %s: logs %q, want %q", p.Metadata.Name, got, want)
		}
	}
	c.Apply(t, deploy(3))
	waitPods(t, c, app, 3, 5*time.Minute)
	ids := sandboxesOf(t, c, "--label", "app="+app, "--state", "ready")
	if vms := vmsOf(t, c, ids); rt == kvfs && len(vms) != 3 {
		t.Errorf("three kvfs pods: %d VMs", len(vms))
	}
	c.Apply(t, deploy(0))
	waitPods(t, c, app, 0, 3*time.Minute)
	checkSandboxesGone(t, c, app, ids)
}

// checkMetricsLog fails the test for each failure to collect a task's metrics that
// containerd logged, but those of a task that had just ended, its shim gone (its connection
// closed) or its cgroup removed, which runc's tasks give too: what is left is a shim refusing
// Stats for a container being created or stopped, where runc's answers.
func checkMetricsLog(t *testing.T, c *k8stest.Cluster) {
	log, err := c.Env.C.Log()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(log, "\n")
	for _, l := range lines {
		if !strings.Contains(l, "collecting metrics for") && !strings.Contains(l, "failed to collect") {
			continue
		}
		if strings.Contains(l, `error="ttrpc: closed"`) || strings.Contains(l, `error="cgroups: cgroup deleted"`) {
			continue
		}
		t.Errorf("containerd logged: %s", l)
		// What containerd logged of that task before.
		i := strings.Index(l, "metrics for ")
		if i < 0 {
			continue
		}
		if f := strings.Fields(l[i+len("metrics for "):]); len(f) > 0 {
			id := strings.Trim(f[0], `"`)
			for _, m := range lines {
				if strings.Contains(m, id) && m != l {
					t.Logf("  %s", m)
				}
			}
		}
	}
}
