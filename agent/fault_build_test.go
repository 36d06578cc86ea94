package agent

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestFaultsNotLinked builds kvfs-agent as packaging/guest/build.sh does, with and without the
// kvfsfaults tag: the fault code (its functions and the names of its modes) is in the first
// binary only.
func TestFaultsNotLinked(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvfs-agent twice (skipped with -short)")
	}
	dir := t.TempDir()
	build := func(name string, tags ...string) (symbols string, binary []byte) {
		t.Helper()
		out := filepath.Join(dir, name)
		args := append([]string{"build", "-trimpath", "-buildvcs=false", "-o", out}, tags...)
		cmd := exec.Command("go", append(args, "github.com/kvfs/kvfs/cmd/kvfs-agent")...)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s: %v\n%s", strings.Join(cmd.Args[1:], " "), err, b)
		}
		nm, err := exec.Command("go", "tool", "nm", out).Output()
		if err != nil {
			t.Fatalf("go tool nm %s: %v", out, err)
		}
		bin, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		return string(nm), bin
	}
	const symbol = "github.com/kvfs/kvfs/agent.(*faults).intercept"
	mode := []byte("kill-noexit")
	nm, bin := build("with-faults", "-tags", "kvfsfaults")
	if !strings.Contains(nm, symbol) || !bytes.Contains(bin, mode) {
		t.Fatalf("the agent built with -tags kvfsfaults has no %s or no mode %q: this check cannot see fault code", symbol, mode)
	}
	nm, bin = build("shipped")
	for _, line := range strings.Split(nm, "\n") {
		if strings.Contains(line, "agent.(*faults)") || strings.Contains(line, "agent.faultModes") {
			t.Errorf("the shipped agent links fault code: %s", strings.TrimSpace(line))
		}
	}
	if bytes.Contains(bin, mode) {
		t.Errorf("the shipped agent's binary names the fault mode %q", mode)
	}
}
