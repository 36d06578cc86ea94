// Package installtest runs kvfs's installer (packaging/install.sh) for tests: the packaging
// tests, and the tests that run the runtime as a node has it installed (the Kubernetes suite).
package installtest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// Command is install.sh with args, in an environment without the variables it reads its
// layout from (the test's arguments say it).
func Command(t testing.TB, args ...string) *exec.Cmd {
	t.Helper()
	root, err := vmtest.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", append([]string{filepath.Join(root, "packaging", "install.sh")}, args...)...)
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case "DESTDIR", "PREFIX", "SYSCONFDIR", "LOCALSTATEDIR":
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	return cmd
}

// Run runs install.sh with args and returns its output; it fails the test unless the script
// exits 0.
func Run(t testing.TB, args ...string) string {
	t.Helper()
	out, err := Command(t, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("install.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("install.sh %s:\n%s", strings.Join(args, " "), out)
	return string(out)
}

// Layout is install.sh's layout of a scratch root: PREFIX, SYSCONFDIR and LOCALSTATEDIR under
// it, no DESTDIR, so that the paths in the installed files are real.
func Layout(root string) []string {
	return []string{"--prefix", root + "/usr", "--sysconfdir", root + "/etc", "--localstatedir", root + "/var"}
}

// EditConfig makes the operator's one edit to the installed configuration at path: where the
// sandboxes go (baseDir: a test containerd's, which its leak check covers), and the
// accelerator if /dev/kvm opens but KVM cannot boot a guest (vmtest.Accel).
func EditConfig(t testing.TB, path, baseDir string) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	edited := strings.Replace(string(data), "\n# base_dir = \"/run/kvfs/sandboxes\"\n", "\nbase_dir = \""+baseDir+"\"\n", 1)
	if accel, why := vmtest.Accel(context.Background(), vmtest.Image(t)); accel == "tcg" {
		t.Logf("accelerator tcg: %s", why)
		edited = strings.Replace(edited, "\n# accel = \"\"\n", "\naccel = \"tcg\"\n", 1)
	}
	if edited == string(data) {
		t.Fatalf("no base_dir to set in the installed configuration:\n%s", data)
	}
	if err := os.WriteFile(path, []byte(edited), 0o644); err != nil {
		t.Fatal(err)
	}
}
