package k8s

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
)

// testInitContainers: init containers run in order, each to completion, before the pod's
// container, which sees what they wrote.
func testInitContainers(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("init", rt)
	work := map[string]any{"name": "work", "mountPath": "/work"}
	first, second := shell("first", "echo one >>/work/order"), shell("second", "echo two >>/work/order")
	main := shell("main", "cat /work/order; exec sleep 3600")
	for _, ctr := range []map[string]any{first, second, main} {
		ctr["volumeMounts"] = []any{work}
	}
	spec := podSpec(c, rt, main)
	spec["initContainers"] = []any{withImage(c, first), withImage(c, second)}
	spec["volumes"] = []any{map[string]any{"name": "work", "emptyDir": map[string]any{}}}
	runPod(t, c, pn, spec)
	p := waitPod(t, c, pn, "running", 5*time.Minute, running)
	for _, n := range []string{"first", "second"} {
		if term := p.container(n).State.Terminated; term == nil || term.ExitCode != 0 || term.Reason != "Completed" {
			t.Errorf("init container %s: %+v, want terminated, Completed with 0", n, p.container(n).State)
		}
	}
	if got := waitLogWords(t, c, pn, "main", 2, time.Minute); strings.Join(got, " ") != "one two" {
		t.Errorf("the container after the init containers read %q, want one then two", got)
	}
}

// testProbes: a readiness probe (httpGet) and a liveness probe (tcpSocket) that pass keep a
// web server's container ready and never restarted; a liveness probe (exec) that starts
// failing restarts its container, and the restarts are counted; a readiness probe (exec)
// makes its container ready when it passes, and keeps another not ready where it fails.
func testProbes(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("probes", rt)
	web := shell("web", "mkdir -p /www && echo ok >/www/index.html && exec httpd -f -p 8080 -h /www")
	web["readinessProbe"] = map[string]any{"httpGet": map[string]any{"path": "/", "port": 8080}, "periodSeconds": 2}
	web["livenessProbe"] = map[string]any{"tcpSocket": map[string]any{"port": 8080}, "periodSeconds": 2}
	flaky := shell("flaky", "touch /tmp/alive; sleep 8; rm /tmp/alive; exec sleep 3600")
	flaky["livenessProbe"] = map[string]any{"exec": map[string]any{"command": []string{"cat", "/tmp/alive"}}, "periodSeconds": 2, "failureThreshold": 1}
	readyExec := map[string]any{"exec": map[string]any{"command": []string{"cat", "/tmp/ready"}}, "periodSeconds": 2}
	ready := shell("ready", "touch /tmp/ready; exec sleep 3600")
	ready["readinessProbe"] = readyExec
	unready := shell("unready", "exec sleep 3600")
	unready["readinessProbe"] = readyExec
	runPod(t, c, pn, podSpec(c, rt, web, flaky, ready, unready))
	p := waitPod(t, c, pn, "restarted by its liveness probe", 5*time.Minute, func(p *pod) bool {
		return p.container("flaky").RestartCount >= 1 && p.container("web").Ready && p.container("ready").Ready
	})
	if w := p.container("web"); w.RestartCount != 0 {
		t.Errorf("the web container whose probes pass: %d restarts, want none", w.RestartCount)
	}
	// Its exec probe has failed every 2 s since the pod started, a liveness probe's restart
	// ago at least.
	if u := p.container("unready"); u.Ready || u.State.Running == nil {
		t.Errorf("the container whose readiness probe fails: ready %v, %+v; want running and not ready", u.Ready, u.State)
	}
	if last := p.container("flaky").LastState.Terminated; last == nil {
		t.Errorf("the restarted container: no last state: %+v", p.container("flaky"))
	}
}

// testJobs: a Job that succeeds completes; one whose pod fails (exit 3) fails after
// backoffLimit retries, each pod's exit code 3; a pod restarted OnFailure until its third run
// succeeds completes the Job with two restarts counted, its last failure's exit code 4.
func testJobs(t *testing.T, c *k8stest.Cluster, rt runtime) {
	job := func(name, restart string, backoff int, ctr map[string]any, volumes ...any) string {
		spec := podSpec(c, rt, ctr)
		spec["restartPolicy"] = restart
		if len(volumes) > 0 {
			spec["volumes"] = volumes
		}
		return manifest(t, map[string]any{
			"apiVersion": "batch/v1", "kind": "Job", "metadata": map[string]any{"name": name},
			"spec": map[string]any{
				"backoffLimit": backoff,
				"template":     map[string]any{"metadata": map[string]any{"labels": map[string]any{"app": name}}, "spec": spec},
			},
		})
	}
	ok, fail, retry := name("job-ok", rt), name("job-fail", rt), name("job-retry", rt)
	counter := shell("main", `n=$(cat /c/n 2>/dev/null || echo 0); n=$((n+1)); echo $n >/c/n; [ $n -ge 3 ] || exit 4`)
	counter["volumeMounts"] = []any{map[string]any{"name": "c", "mountPath": "/c"}}
	c.Apply(t, job(ok, "Never", 0, shell("main", "echo done")))
	c.Apply(t, job(fail, "Never", 1, shell("main", "exit 3")))
	c.Apply(t, job(retry, "OnFailure", 4, counter, map[string]any{"name": "c", "emptyDir": map[string]any{}}))
	for _, j := range []string{ok, fail, retry} {
		t.Cleanup(func() { deleteObject(t, c, "job", j) })
	}

	waitJob(t, c, ok, "Complete")
	if got := c.Kubectl(t, "logs", "job/"+ok); got != "done\n" {
		t.Errorf("job %s: logs %q, want done", ok, got)
	}
	waitJob(t, c, fail, "Failed")
	pods := podsOf(t, c, fail)
	if len(pods) != 2 {
		t.Errorf("job %s with backoffLimit 1: %d pods, want 2", fail, len(pods))
	}
	for _, p := range pods {
		if term := p.container("main").State.Terminated; term == nil || term.ExitCode != 3 {
			t.Errorf("job %s: pod %s: %+v, want terminated with 3", fail, p.Metadata.Name, p.container("main").State)
		}
	}
	waitJob(t, c, retry, "Complete")
	pods = podsOf(t, c, retry)
	if len(pods) != 1 {
		t.Fatalf("job %s restarted OnFailure: %d pods, want 1", retry, len(pods))
	}
	m := pods[0].container("main")
	if m.RestartCount != 2 || m.LastState.Terminated == nil || m.LastState.Terminated.ExitCode != 4 {
		t.Errorf("job %s: %d restarts, last state %+v; want 2, terminated with 4", retry, m.RestartCount, m.LastState)
	}
}

// waitJob waits until the job has the condition cond (Complete or Failed) true.
func waitJob(t *testing.T, c *k8stest.Cluster, name, cond string) {
	t.Helper()
	var job struct {
		Status struct {
			Conditions []struct{ Type, Status string }
		}
	}
	for deadline := time.Now().Add(5 * time.Minute); time.Now().Before(deadline); time.Sleep(time.Second) {
		if err := json.Unmarshal([]byte(c.Kubectl(t, "get", "job", name, "-o", "json")), &job); err != nil {
			t.Fatal(err)
		}
		for _, jc := range job.Status.Conditions {
			if jc.Type == cond && jc.Status == "True" {
				return
			}
		}
	}
	t.Fatalf("job %s: not %s within 5 minutes: %+v\n%s", name, cond, job.Status, c.Kubectl(t, "describe", "job", name))
}

// withImage is ctr with the test image, for a container outside podSpec's list.
func withImage(c *k8stest.Cluster, ctr map[string]any) map[string]any {
	ctr["image"] = c.Env.Image
	ctr["imagePullPolicy"] = "Never"
	return ctr
}

// testShareProcessNamespace: with shareProcessNamespace, a container sees the other's process.
func testShareProcessNamespace(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("sharepid", rt)
	spec := podSpec(c, rt, shell("one", "exec sleep 3601"), shell("two", "exec sleep 3602"))
	spec["shareProcessNamespace"] = true
	runPod(t, c, pn, spec)
	waitPod(t, c, pn, "running", 5*time.Minute, running)
	if ps := c.Kubectl(t, "exec", pn, "-c", "two", "--", "ps", "-o", "args"); !strings.Contains(ps, "sleep 3601") {
		t.Errorf("container two does not see container one's process:\n%s", ps)
	}
}
