package cri

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/ociimage"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// critestSpecs are the specs of critest (cri-tools' CRI validation suite, run as a node's
// operator runs it) that TestCritest runs, by their leaf text: the read-only mount specs,
// whose host path holds a tmpfs that critest unmounts and removes while the pod still runs,
// and the port-forward spec of a pod with a network of its own, whose web server is reached
// at the pod's address and then through the CRI's port-forward.
var critestSpecs = []string{
	"should support non-recursive readonly mounts",
	"should support recursive readonly mounts",
	"should reject a recursive readonly mount with PROPAGATION_HOST_TO_CONTAINER",
	"should reject a recursive readonly mount with PROPAGATION_BIDIRECTIONAL",
	"should reject a recursive readonly mount with ReadOnly: false",
	"runtime should support portforward [Conformance]",
}

// critestFocus selects critestSpecs (a ginkgo focus matches a spec's full text).
const critestFocus = `Container Mount Readonly|runtime should support portforward \[Conformance\]`

// TestCritest: critest's specs of critestSpecs pass, none skipped, for runc (which shows the
// specs and this containerd fit: the control) and for the kvfs handler under both
// sandboxers.
func TestCritest(t *testing.T) {
	t.Run("runc", func(t *testing.T) { testCritest(t, podSandboxer, "runc") })
	for _, sb := range criSandboxers {
		t.Run("kvfs-"+sb, func(t *testing.T) { testCritest(t, sb, shimtest.CRIHandler) })
	}
}

func testCritest(t *testing.T, sandboxer, handler string) {
	e := shimtest.Start(t, "", sandboxer)
	web, err := ociimage.Busybox("localhost/httpd:cri", ociimage.BusyboxPath)
	if err != nil {
		t.Fatal(err)
	}
	web.Files = append(web.Files, ociimage.File{Path: "www/index.html", Mode: 0o644, Data: []byte("hello from critest's web server\n")})
	web.Config.Cmd = []string{"/bin/busybox", "httpd", "-f", "-p", "80", "-h", "/www"}
	if err := e.C.ImportCRI(web); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	images := filepath.Join(dir, "images.yaml")
	if err := os.WriteFile(images, fmt.Appendf(nil, "defaultTestContainerImage: %s\nwebServerTestImage: %s\n", e.Image, web.Name), 0o644); err != nil {
		t.Fatal(err)
	}
	report := filepath.Join(dir, "report.json")

	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	cmd := e.C.CritestCmd(ctx, "--runtime-handler", handler, "--test-images-file", images,
		"--ginkgo.focus", critestFocus, "--ginkgo.json-report", report, "--ginkgo.no-color")
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("critest did not end within 15 minutes:\n%s", out)
	}
	specs, rerr := critestReport(report)
	if rerr != nil {
		t.Fatalf("critest: %v (its run: %v)\n%s", rerr, err, out)
	}
	results := map[string]critestSpec{}
	for _, s := range specs {
		switch {
		case slices.Contains(critestSpecs, s.LeafNodeText):
			results[s.LeafNodeText] = s
		case s.State != "passed" && s.State != "skipped":
			// Another spec, or a node of the suite's own (its BeforeSuite has no text).
			t.Errorf("critest %s %q: %s: %s", s.LeafNodeType, s.LeafNodeText, s.State, s.Failure.Message)
		case s.LeafNodeText != "" && s.State == "passed":
			t.Errorf("critest ran %q, which its focus does not select", s.LeafNodeText)
		}
	}
	for _, spec := range critestSpecs {
		switch r, ok := results[spec]; {
		case !ok:
			t.Errorf("critest has no spec %q", spec)
		case r.State != "passed":
			t.Errorf("critest %q: %s: %s", spec, r.State, r.Failure.Message)
		default:
			t.Logf("critest %q: passed in %v", spec, r.RunTime.Round(time.Millisecond))
		}
	}
	if err != nil && !t.Failed() {
		t.Errorf("critest: %v", err)
	}
	if t.Failed() {
		t.Logf("critest:\n%s", out)
	}
}

// critestSpec is what TestCritest reads of a node in ginkgo's JSON report: every spec of the
// suite (those the focus leaves out "skipped") and the suite's setup.
type critestSpec struct {
	LeafNodeType string
	LeafNodeText string
	State        string
	RunTime      time.Duration
	Failure      struct{ Message string }
}

// critestReport reads ginkgo's JSON report at path.
func critestReport(path string) ([]critestSpec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("no report: %w", err)
	}
	var reports []struct{ SpecReports []critestSpec }
	if err := json.Unmarshal(b, &reports); err != nil {
		return nil, fmt.Errorf("its report: %w", err)
	}
	var specs []critestSpec
	for _, r := range reports {
		specs = append(specs, r.SpecReports...)
	}
	return specs, nil
}
