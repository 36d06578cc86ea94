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
