package k8s

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
)

// testConfigMap: an update of a configMap reaches the running container through the volume's
// ..data link, and an inotify watch on the volume in the container sees its steps (the new
// data directory, ..data moved into place, the new key's link, the old directory deleted).
func testConfigMap(t *testing.T, c *k8stest.Cluster, rt runtime) {
	cm := name("cfg", rt)
	configMap := func(data map[string]string) string {
		return manifest(t, map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": cm}, "data": data})
	}
	c.Apply(t, configMap(map[string]string{"key": "one"}))
	t.Cleanup(func() { deleteObject(t, c, "configmap", cm) })
	progs := buildInotify(t)
	w := shell("watch", "exec /progs/inotify /cfg")
	w["volumeMounts"] = []any{map[string]any{"name": "cfg", "mountPath": "/cfg"}, map[string]any{"name": "progs", "mountPath": "/progs"}}
	spec := podSpec(c, rt, w)
	spec["volumes"] = []any{
		map[string]any{"name": "cfg", "configMap": map[string]any{"name": cm}},
		map[string]any{"name": "progs", "hostPath": map[string]any{"path": progs}},
	}
	pn := name("cfg", rt)
	runPod(t, c, pn, spec)
	waitPod(t, c, pn, "running", 5*time.Minute, running)
	waitLog(t, c, pn, "watching\n", time.Minute)

	c.Apply(t, configMap(map[string]string{"key": "two", "more": "new"}))
	log := waitLog(t, c, pn, " 0x40000200\n", 3*time.Minute) // a directory deleted: the update's last step
	for _, want := range []string{" 0x40000100\n", "event ..data 0x80\n", "event more 0x100\n"} {
		if !strings.Contains(log, want) {
			t.Errorf("the configMap's watch has no %q:\n%s", want, log)
		}
	}
	if got := c.Kubectl(t, "exec", pn, "--", "cat", "/cfg/key", "/cfg/more"); got != "twonew" {
		t.Errorf("the updated configMap in the container: %q, want twonew", got)
	}
	if got := c.Kubectl(t, "exec", pn, "--", "readlink", "/cfg/..data"); !strings.HasPrefix(got, "..") {
		t.Errorf("the configMap's ..data link: %q, want a link to its data directory", got)
	}
}

// testEmptyDir: an emptyDir is shared by the pod's containers; one of medium Memory is a tmpfs
// of its sizeLimit in the container.
func testEmptyDir(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("emptydir", rt)
	writer := shell("writer", "echo from-writer >/shared/f; exec sleep 3600")
	reader := shell("reader", `while [ ! -f /shared/f ]; do sleep 0.2; done; cat /shared/f
awk '$2 == "/mem" { print $3 }' /proc/mounts; df -k /mem | awk 'NR == 2 { print $2 }'; exec sleep 3600`)
	writer["volumeMounts"] = []any{map[string]any{"name": "shared", "mountPath": "/shared"}}
	reader["volumeMounts"] = []any{map[string]any{"name": "shared", "mountPath": "/shared"}, map[string]any{"name": "mem", "mountPath": "/mem"}}
	spec := podSpec(c, rt, writer, reader)
	spec["volumes"] = []any{
		map[string]any{"name": "shared", "emptyDir": map[string]any{}},
		map[string]any{"name": "mem", "emptyDir": map[string]any{"medium": "Memory", "sizeLimit": "32Mi"}},
	}
	runPod(t, c, pn, spec)
	waitPod(t, c, pn, "running", 5*time.Minute, running)
	if got := waitLogWords(t, c, pn, "reader", 3, time.Minute); strings.Join(got, " ") != "from-writer tmpfs 32768" {
		t.Errorf("the reader: %q, want the writer's file, then its memory emptyDir a tmpfs of 32768 KiB", got)
	}
}

// buildInotify builds the CRI tests' inotify watcher (shim/e2e/cri/testdata/inotify) into a
// directory of the test, for a hostPath volume, and returns the directory.
func buildInotify(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "inotify"), "../cri/testdata/inotify")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the inotify watcher: %v\n%s", err, out)
	}
	return dir
}

// waitLog waits until the log of the pod's (only) container has want, and returns it.
func waitLog(t *testing.T, c *k8stest.Cluster, pod, want string, timeout time.Duration) string {
	t.Helper()
	var log string
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
		if log = c.Kubectl(t, "logs", pod); strings.Contains(log, want) {
			return log
		}
	}
	t.Fatalf("pod %s: no %q in its log within %v:\n%s", pod, want, timeout, log)
	return ""
}

// waitLogWords waits until the log of the pod's container ctr has n words, and returns them.
func waitLogWords(t *testing.T, c *k8stest.Cluster, pod, ctr string, n int, timeout time.Duration) []string {
	t.Helper()
	var got []string
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(time.Second) {
		if got = strings.Fields(c.Kubectl(t, "logs", pod, "-c", ctr)); len(got) >= n {
			return got
		}
	}
	t.Fatalf("pod %s: container %s logged %q within %v, want %d words", pod, ctr, got, timeout, n)
	return nil
}

// testSecretProjected: a secret volume with its defaultMode; a projected volume of a secret's
// key (its own mode), a configMap's, the pod's labels (downward API) and a service account
// token, with the projected defaultMode; a label added to the running pod reaches its labels
// file.
func testSecretProjected(t *testing.T, c *k8stest.Cluster, rt runtime) {
	sec, pn := name("sec", rt), name("projected", rt)
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "Secret", "metadata": map[string]any{"name": sec}, "stringData": map[string]string{"key": "s3cret"}}))
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": sec}, "data": map[string]string{"k": "from-configmap"}}))
	t.Cleanup(func() {
		deleteObject(t, c, "secret", sec)
		deleteObject(t, c, "configmap", sec)
	})
	main := shell("main", "exec sleep 3600")
	main["volumeMounts"] = []any{map[string]any{"name": "sec", "mountPath": "/sec"}, map[string]any{"name": "proj", "mountPath": "/proj"}}
	spec := podSpec(c, rt, main)
	spec["volumes"] = []any{
		map[string]any{"name": "sec", "secret": map[string]any{"secretName": sec, "defaultMode": 0o400}},
		map[string]any{"name": "proj", "projected": map[string]any{"defaultMode": 0o440, "sources": []any{
			map[string]any{"secret": map[string]any{"name": sec, "items": []any{map[string]any{"key": "key", "path": "from-secret", "mode": 0o600}}}},
			map[string]any{"configMap": map[string]any{"name": sec, "items": []any{map[string]any{"key": "k", "path": "from-configmap"}}}},
			map[string]any{"downwardAPI": map[string]any{"items": []any{map[string]any{"path": "labels", "fieldRef": map[string]any{"fieldPath": "metadata.labels"}}}}},
			map[string]any{"serviceAccountToken": map[string]any{"path": "token", "expirationSeconds": 3600}},
		}}},
	}
	c.Apply(t, manifest(t, map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": pn, "labels": map[string]string{"color": "red"}}, "spec": spec}))
	t.Cleanup(func() { deleteObject(t, c, "pod", pn) })
	waitPod(t, c, pn, "running", 5*time.Minute, running)

	got := c.Kubectl(t, "exec", pn, "--", "sh", "-c", `for f in /sec/key /proj/from-secret /proj/from-configmap /proj/labels /proj/token; do echo "$f $(stat -L -c %a $f)"; done
cat /sec/key; echo; cat /proj/from-secret; echo; cat /proj/from-configmap; echo; cat /proj/labels; echo
tr -cd . </proj/token | wc -c`)
	want := []string{"/sec/key 400", "/proj/from-secret 600", "/proj/from-configmap 440", "/proj/labels 440", "/proj/token 440",
		"s3cret", "s3cret", "from-configmap", `color="red"`, "2"}
	if strings.Join(strings.Fields(got), " ") != strings.Join(strings.Fields(strings.Join(want, "\n")), " ") {
		t.Errorf("the secret and projected volumes:\n%s\nwant (modes, contents, the token's two dots):\n%s", got, strings.Join(want, "\n"))
	}
	c.Kubectl(t, "label", "pod", pn, "shape=round")
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		labels := c.Kubectl(t, "exec", pn, "--", "cat", "/proj/labels")
		if strings.Contains(labels, `shape="round"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a label added to the pod: not in its labels file within 2 minutes: %q", labels)
		}
	}
}

// testHostPath: a hostPath directory carries files both ways; a file hostPath rewritten in
// place on the host (the same inode) reads new in the container.
func testHostPath(t *testing.T, c *k8stest.Cluster, rt runtime) {
	dir, fileDir := t.TempDir(), t.TempDir()
	file := filepath.Join(fileDir, "app.conf")
	if err := os.WriteFile(filepath.Join(dir, "from-host"), []byte("host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte("v1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	pn := name("hostpath", rt)
	main := shell("main", "cat /hp/from-host; echo container >/hp/from-container; exec sleep 3600")
	main["volumeMounts"] = []any{map[string]any{"name": "hp", "mountPath": "/hp"}, map[string]any{"name": "hf", "mountPath": "/etc/app.conf"}}
	spec := podSpec(c, rt, main)
	spec["volumes"] = []any{
		map[string]any{"name": "hp", "hostPath": map[string]any{"path": dir, "type": "Directory"}},
		map[string]any{"name": "hf", "hostPath": map[string]any{"path": file, "type": "File"}},
	}
	runPod(t, c, pn, spec)
	waitPod(t, c, pn, "running", 5*time.Minute, running)
	waitLog(t, c, pn, "host\n", time.Minute)
	if b, err := os.ReadFile(filepath.Join(dir, "from-container")); err != nil || string(b) != "container\n" {
		t.Errorf("a file the container wrote in the hostPath, on the host: %q (%v)", b, err)
	}
	if got := c.Kubectl(t, "exec", pn, "--", "cat", "/etc/app.conf"); got != "v1\n" {
		t.Errorf("the file hostPath: %q, want v1", got)
	}
	f, err := os.OpenFile(file, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("v2, longer\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// runc's container reads the host's file: at once. kvfs's guest keeps what it learnt of a
	// file (its size, say) for cache=auto's second, as Kata's does: within it, the new content
	// can read cut to the old size; after it, whole.
	within := time.Duration(0)
	if rt == kvfs {
		within = 3 * time.Second
	}
	for deadline := time.Now().Add(within); ; time.Sleep(200 * time.Millisecond) {
		got := c.Kubectl(t, "exec", pn, "--", "cat", "/etc/app.conf")
		if got == "v2, longer\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the file hostPath rewritten in place: %q after %v, want the new content", got, within)
			break
		}
	}
}
