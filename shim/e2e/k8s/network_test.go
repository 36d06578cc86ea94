package k8s

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
	"github.com/kvfs/kvfs/internal/testing/syncbuf"
)

// testEnv: environment variables from the downward API (the pod's name and IP, a resource
// limit), from a configMap and from a secret are the container's.
func testEnv(t *testing.T, c *k8stest.Cluster, rt runtime) {
	cm := name("env", rt)
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": cm}, "data": map[string]string{"FROM_CONFIGMAP": "cm-value"}}))
	t.Cleanup(func() { deleteObject(t, c, "configmap", cm) })
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "Secret", "metadata": map[string]any{"name": cm}, "stringData": map[string]string{"key": "secret-value"}}))
	t.Cleanup(func() { deleteObject(t, c, "secret", cm) })
	pn := name("env", rt)
	main := shell("main", `echo "$POD_NAME $POD_IP $MEM_LIMIT $FROM_CONFIGMAP $FROM_SECRET"; exec sleep 3600`)
	main["resources"] = map[string]any{"limits": map[string]any{"memory": "100Mi"}}
	main["env"] = []any{
		map[string]any{"name": "POD_NAME", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "metadata.name"}}},
		map[string]any{"name": "POD_IP", "valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "status.podIP"}}},
		map[string]any{"name": "MEM_LIMIT", "valueFrom": map[string]any{"resourceFieldRef": map[string]any{"resource": "limits.memory", "divisor": "1Mi"}}},
		map[string]any{"name": "FROM_SECRET", "valueFrom": map[string]any{"secretKeyRef": map[string]any{"name": cm, "key": "key"}}},
	}
	main["envFrom"] = []any{map[string]any{"configMapRef": map[string]any{"name": cm}}}
	runPod(t, c, pn, podSpec(c, rt, main))
	p := waitPod(t, c, pn, "running", 5*time.Minute, running)
	want := strings.Join([]string{pn, p.Status.PodIP, "100", "cm-value", "secret-value"}, " ")
	if got := waitLogWords(t, c, pn, "main", 5, time.Minute); strings.Join(got, " ") != want {
		t.Errorf("the container's environment: %q, want %q", got, want)
	}
}

// testPodToPod: a pod of rt serves HTTP on its address, and a pod of the other runtime
// fetches from it, and the other way round.
func testPodToPod(t *testing.T, c *k8stest.Cluster, rt runtime) {
	other := runc
	if rt == runc {
		other = kvfs
	}
	server, client := name("web", rt), name("client-of", rt)
	runPod(t, c, server, podSpec(c, rt, shell("web", `mkdir -p /www && echo "hello from $(hostname)" >/www/index.html && exec httpd -f -p 8080 -h /www`)))
	runPod(t, c, client, podSpec(c, other, shell("main", "exec sleep 3600")))
	s := waitPod(t, c, server, "running", 5*time.Minute, running)
	waitPod(t, c, client, "running", 5*time.Minute, running)
	// No -T: Debian's busybox-static wget crashes with it.
	if got := c.Kubectl(t, "exec", client, "--", "wget", "-q", "-O", "-", "http://"+s.Status.PodIP+":8080/"); got != "hello from "+server+"\n" {
		t.Errorf("a %s pod fetching from a %s pod: %q", other, rt, got)
	}
}

// testPortForward: kubectl port-forward reaches a server the pod runs on its loopback alone,
// and a forwarded connection to a port nothing listens on fails.
func testPortForward(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("portfwd", rt)
	runPod(t, c, pn, podSpec(c, rt, shell("web", `mkdir -p /www && echo "hello from $(hostname)" >/www/index.html && exec httpd -f -p 127.0.0.1:8080 -h /www`)))
	waitPod(t, c, pn, "running", 5*time.Minute, running)
	// The local ports, in the cluster's network namespace: the web server's, the silent port's.
	local, silent := map[runtime]string{runc: "18080", kvfs: "18081"}[rt], map[runtime]string{runc: "19080", kvfs: "19081"}[rt]
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	fwd := c.KubectlCmd(ctx, "port-forward", "pod/"+pn, local+":8080", silent+":9999")
	var out syncbuf.Buffer
	fwd.Stdout, fwd.Stderr = &out, &out
	if err := fwd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cancel()
		fwd.Wait()
	}()
	for deadline := time.Now().Add(time.Minute); strings.Count(out.String(), "Forwarding from 127.0.0.1:") < 2; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("kubectl port-forward does not listen:\n%s", out.String())
		}
	}
	if got, err := c.Env.C.InNetNS(ctx, "busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:"+local+"/").CombinedOutput(); err != nil || string(got) != "hello from "+pn+"\n" {
		t.Errorf("the pod's 127.0.0.1:8080 through port-forward: %q, %v\n%s", got, err, out.String())
	}
	if got, err := c.Env.C.InNetNS(ctx, "busybox", "wget", "-q", "-O", "-", "http://127.0.0.1:"+silent+"/").CombinedOutput(); err == nil {
		t.Errorf("port 9999, where nothing listens in the pod, answered through port-forward: %q", got)
	}
}
