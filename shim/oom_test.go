package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// TestPodOOMScoreAdjOf checks which value each kind of container's spec gives its pod: a
// sandbox container's and a lone container's are where the pod starts, a CRI container's
// raises it, a spec without one leaves the pod at the shim's.
func TestPodOOMScoreAdjOf(t *testing.T) {
	v := func(n int) *int { return &n }
	for _, tc := range []struct {
		name         string
		ann          map[string]string
		proc         *specs.Process
		start, raise *int
	}{
		{"pause container", criSandbox("pod", nil), &specs.Process{OOMScoreAdj: v(-998)}, v(-998), nil},
		{"BestEffort container", criContainer("pod"), &specs.Process{OOMScoreAdj: v(1000)}, nil, v(1000)},
		{"Guaranteed container", criContainer("pod"), &specs.Process{OOMScoreAdj: v(-997)}, nil, v(-997)},
		{"lone container", nil, &specs.Process{OOMScoreAdj: v(300)}, v(300), nil},
		{"no value", criContainer("pod"), &specs.Process{}, nil, nil},
		{"no process", criSandbox("pod", nil), nil, nil, nil},
	} {
		start, raise := podOOMScoreAdj(&specs.Spec{Annotations: tc.ann, Process: tc.proc})
		if str(start) != str(tc.start) || str(raise) != str(tc.raise) {
			t.Errorf("%s: start %s, raise %s; want %s, %s", tc.name, str(start), str(raise), str(tc.start), str(tc.raise))
		}
	}
}

func str(p *int) string {
	if p == nil {
		return "nil"
	}
	b, _ := json.Marshal(*p)
	return string(b)
}

// withOOMScoreAdj sets process.oomScoreAdj in the bundle's spec.
func withOOMScoreAdj(t *testing.T, bundle string, v int) string {
	t.Helper()
	spec, err := readSpec(bundle)
	if err != nil {
		t.Fatal(err)
	}
	spec.Process.OOMScoreAdj = &v
	data, _ := json.Marshal(spec)
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	return bundle
}

// TestPodOOMScoreAdj checks what the task service does with the values: the pod is started
// with its sandbox container's, each CRI container raises it to its own before the container
// is made, and a value outside [-1000, 1000] is refused before anything is.
func TestPodOOMScoreAdj(t *testing.T) {
	h := newHarness(t)
	h.create(&taskAPI.CreateTaskRequest{ID: "pod", Bundle: withOOMScoreAdj(t, h.bundle("pod", criSandbox("pod", nil)), -998)})
	pod := h.pod()
	if got := str(pod.req.OOMScoreAdj); got != "-998" {
		t.Errorf("the pod started with oom_score_adj %s, want the sandbox container's -998", got)
	}
	h.create(&taskAPI.CreateTaskRequest{ID: "c1", Bundle: withOOMScoreAdj(t, h.bundle("c1", criContainer("pod")), 1000)})
	h.create(&taskAPI.CreateTaskRequest{ID: "c2", Bundle: h.bundle("c2", criContainer("pod"))})
	_, err := h.svc.Create(h.ctx, &taskAPI.CreateTaskRequest{ID: "c3", Bundle: withOOMScoreAdj(t, h.bundle("c3", criContainer("pod")), 1001)})
	wantKind(t, "oom_score_adj 1001", err, errdefs.ErrInvalidArgument)
	if err == nil || !strings.Contains(err.Error(), "oom_score_adj 1001") {
		t.Errorf("Create with 1001: %v, want a refusal naming it", err)
	}
	pod.mu.Lock()
	raises := pod.oomRaises
	pod.mu.Unlock()
	if len(raises) != 1 || raises[0] != 1000 {
		t.Errorf("the pod was raised to %v, want [1000] (c1's; c2 has none, c3's is refused)", raises)
	}
}
