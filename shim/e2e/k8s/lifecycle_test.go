package k8s

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
)

// testOOMKilled: a container that outgrows its memory limit is killed, OOMKilled with 137.
func testOOMKilled(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("oom", rt)
	hog := shell("hog", "head -c 300m /dev/zero | tail")
	hog["resources"] = map[string]any{"limits": map[string]any{"memory": "64Mi"}}
	spec := podSpec(c, rt, hog)
	spec["restartPolicy"] = "Never"
	runPod(t, c, pn, spec)
	p := waitPod(t, c, pn, "terminated", 5*time.Minute, func(p *pod) bool { return p.container("hog").State.Terminated != nil })
	if term := p.container("hog").State.Terminated; term.Reason != "OOMKilled" || term.ExitCode != 137 {
		t.Errorf("a container past its memory limit: %+v, want OOMKilled with 137", *term)
	}
}

// testTermination: the termination message a container writes is in its status; its
// postStart hook runs once it has started; at the pod's deletion its preStop hook runs before
// its process gets SIGTERM; a process that ignores SIGTERM is killed once
// terminationGracePeriodSeconds have passed, not before.
func testTermination(t *testing.T, c *k8stest.Cluster, rt runtime) {
	msg := name("term-msg", rt)
	spec := podSpec(c, rt, shell("main", "echo goodbye >/dev/termination-log"))
	spec["restartPolicy"] = "Never"
	runPod(t, c, msg, spec)
	p := waitPod(t, c, msg, "terminated", 5*time.Minute, func(p *pod) bool { return p.container("main").State.Terminated != nil })
	if term := p.container("main").State.Terminated; term.Message != "goodbye\n" || term.ExitCode != 0 {
		t.Errorf("the termination message: %+v, want goodbye and 0", *term)
	}

	// The hook and the trap write to a hostPath the test reads after the pod is gone.
	obs := t.TempDir()
	if err := os.Chmod(obs, 0o777); err != nil {
		t.Fatal(err)
	}
	order := name("term-order", rt)
	// The process waits for its postStart hook's mark before it says it started: the hook
	// runs beside it.
	main := shell("main", `trap 'echo term >>/obs/order; exit 0' TERM
while [ ! -e /tmp/poststart ]; do sleep 0.1; done
echo started >>/obs/order
while true; do sleep 0.2; done`)
	main["lifecycle"] = map[string]any{
		"postStart": map[string]any{"exec": map[string]any{"command": []string{"sh", "-c", "echo poststart >>/obs/order; touch /tmp/poststart"}}},
		"preStop":   map[string]any{"exec": map[string]any{"command": []string{"sh", "-c", "echo prestop >>/obs/order"}}},
	}
	main["volumeMounts"] = []any{map[string]any{"name": "obs", "mountPath": "/obs"}}
	spec = podSpec(c, rt, main)
	spec["terminationGracePeriodSeconds"] = 30
	spec["volumes"] = []any{map[string]any{"name": "obs", "hostPath": map[string]any{"path": obs}}}
	runPod(t, c, order, spec)
	waitPod(t, c, order, "running", 5*time.Minute, running)
	deleteObject(t, c, "pod", order)
	if b, err := os.ReadFile(filepath.Join(obs, "order")); err != nil || string(b) != "poststart\nstarted\nprestop\nterm\n" {
		t.Errorf("what the container, its hooks and its SIGTERM trap wrote: %q (%v), want poststart, started, prestop, term", b, err)
	}

	grace := name("term-grace", rt)
	stubborn := shell("main", `trap '' TERM; while true; do sleep 0.2; done`)
	spec = podSpec(c, rt, stubborn)
	spec["terminationGracePeriodSeconds"] = 8
	runPod(t, c, grace, spec)
	waitPod(t, c, grace, "running", 5*time.Minute, running)
	start := time.Now()
	deleteObject(t, c, "pod", grace)
	// Not before the grace period; the bound after it is generous, as the machines are shared.
	if d := time.Since(start); d < 8*time.Second || d > 40*time.Second {
		t.Errorf("a pod whose process ignores SIGTERM, with a grace period of 8 s, was gone after %v", d.Round(100*time.Millisecond))
	}
}
