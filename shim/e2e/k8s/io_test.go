package k8s

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/k8stest"
)

// testStdin: every byte sent to `kubectl exec -i` reaches the process (4 MiB, checked by
// size and digest); `kubectl cp` copies a file into the container and back whole (tar over
// exec's stdin and stdout).
func testStdin(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("stdin", rt)
	runPod(t, c, pn, podSpec(c, rt, shell("main", "exec sleep 3600")))
	waitPod(t, c, pn, "running", 5*time.Minute, running)

	data := make([]byte, 4<<20)
	rand.Read(data)
	sum := sha256.Sum256(data)
	out, err := c.RunKubectl(context.Background(), bytes.NewReader(data), "exec", "-i", pn, "--", "wc", "-c")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(out); got != fmt.Sprint(len(data)) {
		t.Errorf("exec -i: the process read %s bytes of %d", got, len(data))
	}
	out, err = c.RunKubectl(context.Background(), bytes.NewReader(data), "exec", "-i", pn, "--", "sha256sum")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Fields(out); len(got) == 0 || got[0] != hex.EncodeToString(sum[:]) {
		t.Errorf("exec -i: the process's sha256 %q, want %x", out, sum)
	}

	dir := t.TempDir()
	in, back := filepath.Join(dir, "in"), filepath.Join(dir, "back")
	if err := os.WriteFile(in, data[:1<<20], 0o644); err != nil {
		t.Fatal(err)
	}
	c.Kubectl(t, "cp", in, pn+":/tmp/copied")
	if got := strings.TrimSpace(c.Kubectl(t, "exec", pn, "--", "wc", "-c", "/tmp/copied")); got != fmt.Sprintf("%d /tmp/copied", 1<<20) {
		t.Errorf("kubectl cp into the container: %q, want 1 MiB", got)
	}
	c.Kubectl(t, "cp", pn+":/tmp/copied", back)
	if b, err := os.ReadFile(back); err != nil || !bytes.Equal(b, data[:1<<20]) {
		t.Errorf("kubectl cp out of the container: %d bytes (%v), not the file copied in", len(b), err)
	}
}

// testAttach: every byte `kubectl attach -i` sends reaches the container's process, whose
// stdin (stdinOnce) then ends.
func testAttach(t *testing.T, c *k8stest.Cluster, rt runtime) {
	pn := name("attach", rt)
	main := shell("main", "wc -c")
	main["stdin"], main["stdinOnce"] = true, true
	spec := podSpec(c, rt, main)
	spec["restartPolicy"] = "Never"
	runPod(t, c, pn, spec)
	waitPod(t, c, pn, "running", 5*time.Minute, func(p *pod) bool { return p.Status.Phase == "Running" })
	data := make([]byte, 1<<20)
	rand.Read(data)
	// kubectl's own end (it may report the container's exit) is not what is checked: the
	// process's count is.
	c.RunKubectl(context.Background(), bytes.NewReader(data), "attach", "-i", pn)
	waitPod(t, c, pn, "terminated", 2*time.Minute, func(p *pod) bool { return p.container("main").State.Terminated != nil })
	if got := strings.TrimSpace(c.Kubectl(t, "logs", pn)); got != fmt.Sprint(len(data)) {
		t.Errorf("attach -i: the process read %s bytes of %d", got, len(data))
	}
}
