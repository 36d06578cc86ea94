package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/sandbox"
)

// staleSocket leaves a socket nothing listens on at dir/control.sock, as a shim killed with
// SIGKILL leaves it.
func staleSocket(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, sandbox.ControlSocketName)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	return p
}

func TestDiscovery(t *testing.T) {
	e := newEnv(t, "pod-b", "pod-a", "pod-d")
	stale := staleSocket(t, filepath.Join(e.base, "pod-gone"))
	// Not a socket: not looked at.
	if err := os.MkdirAll(filepath.Join(e.base, "pod-file"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.base, "pod-file", sandbox.ControlSocketName), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	staleNote := regexp.MustCompile(`(?m)^kvfsctl: skipping ` + regexp.QuoteMeta(stale) + `: connecting to the control socket: .*connection refused\n`)

	// list: every socket's sandboxes, sorted; the stale socket noted, not fatal.
	code, out, errOut := e.ctl(t, "list")
	if code != 0 {
		t.Fatalf("list: %d %s", code, errOut)
	}
	var ids []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
		ids = append(ids, strings.Fields(l)[0])
	}
	if strings.Join(ids, " ") != "pod-a pod-b pod-d" {
		t.Errorf("list: %q:\n%s", ids, out)
	}
	if !staleNote.MatchString(errOut) || strings.Count(errOut, "\n") != 1 {
		t.Errorf("list's stderr: %q; want one note on %s", errOut, stale)
	}
	code, out, _ = e.ctl(t, "--json", "list")
	var list listOutput
	if err := json.Unmarshal([]byte(out), &list); code != 0 || err != nil || len(list.Sandboxes) != 3 || list.Sandboxes[2].ID != "pod-d" {
		t.Errorf("list --json: %d %v\n%s", code, err, out)
	}

	// A command on one sandbox goes to the socket that has it: each socket has one
	// sandbox's, and the others answer NotFound.
	for _, id := range []string{"pod-a", "pod-b", "pod-d"} {
		code, out, errOut = e.ctl(t, "status", id)
		if code != 0 || !regexp.MustCompile(`(?m)^Sandbox: +`+id+`$`).MatchString(out) {
			t.Errorf("status %s: %d %q %q", id, code, out, errOut)
		}
	}
	code, out, errOut = e.ctl(t, "metrics", "pod-b")
	if code != 0 || !strings.Contains(out, `kvfs_server_up{sandbox="pod-b"} 1`) {
		t.Errorf("metrics pod-b: %d %q %q", code, out, errOut)
	}
	code, out, errOut = e.ctl(t, "dax-policy", "--rules", "on glob=*.so", "pod-a", "inode")
	if code != 0 || out != "sandbox pod-a: DAX policy updated\n" {
		t.Errorf("dax-policy pod-a: %d %q %q", code, out, errOut)
	}

	// A sandbox no socket has: NotFound naming it.
	code, out, errOut = e.ctl(t, "status", "pod-x")
	if code != 1 || out != "" || !strings.Contains(errOut, `sandbox "pod-x": not found in any of the 4 control sockets found`) ||
		!strings.Contains(errOut, "(NotFound)") || !staleNote.MatchString(errOut) {
		t.Errorf("status pod-x: %d %q %q", code, out, errOut)
	}
	code, _, errOut = e.ctl(t, "stop", "../pod-a")
	if code != 1 || !strings.Contains(errOut, `sandbox "../pod-a": not found`) {
		t.Errorf("stop ../pod-a: %d %q", code, errOut)
	}

	// stop through the shim's socket: the sandbox is stopped, its directory (and socket) gone.
	code, out, errOut = e.ctl(t, "stop", "pod-b")
	if code != 0 || out != "sandbox pod-b stopped\n" {
		t.Errorf("stop pod-b: %d %q %q", code, out, errOut)
	}
	if p := e.boxes["pod-b"].Phase(); p != sandbox.PhaseStopped {
		t.Errorf("pod-b after stop: %s", p)
	}
	code, out, _ = e.ctl(t, "list")
	if code != 0 || strings.Contains(out, "pod-b") || !strings.Contains(out, "pod-a") {
		t.Errorf("list after stop: %d\n%s", code, out)
	}

	// log-level goes to every shim found.
	code, out, errOut = e.ctl(t, "log-level", "info")
	if code != 0 || !regexp.MustCompile(`^pod-a: log level info \(was \w+\)\npod-d: log level info \(was info\)\n$`).MatchString(out) ||
		!staleNote.MatchString(errOut) {
		t.Errorf("log-level: %d %q %q", code, out, errOut)
	}

	// --address keeps to its one socket.
	shimA := filepath.Join(e.boxes["pod-a"].Dir(), sandbox.ControlSocketName)
	code, out, errOut = e.run(t, "--address", shimA, "list")
	if code != 0 || !strings.Contains(out, "pod-a") || strings.Contains(out, "pod-d") || errOut != "" {
		t.Errorf("--address list: %d %q %q", code, out, errOut)
	}
	code, _, errOut = e.run(t, "--address", shimA, "status", "pod-d")
	if code != 1 || !strings.Contains(errOut, `sandbox "pod-d": not found (NotFound)`) {
		t.Errorf("--address SHIM status pod-d: %d %q", code, errOut)
	}
}

// TestDiscoveryNothingFound: no shim is an empty list with a note, and a command on a
// sandbox, or log-level, fails.
func TestDiscoveryNothingFound(t *testing.T) {
	base := t.TempDir()
	run := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := Run(context.Background(), append([]string{"--base-dir", filepath.Join(base, "sandboxes")}, args...), &out, &errOut)
		return code, out.String(), errOut.String()
	}
	code, out, errOut := run("list")
	if code != 0 || strings.TrimSpace(out) != "ID  PHASE  SERVER  VM  FAILURE" ||
		!strings.Contains(errOut, "no control socket found (looked at "+filepath.Join(base, "sandboxes", "*", "control.sock")+")") {
		t.Errorf("list: %d %q %q", code, out, errOut)
	}
	code, out, errOut = run("--json", "list")
	if code != 0 || out != "{\n  \"sandboxes\": []\n}\n" {
		t.Errorf("list --json: %d %q %q", code, out, errOut)
	}
	code, _, errOut = run("status", "pod-a")
	if code != 1 || !strings.Contains(errOut, `sandbox "pod-a": not found in any of the 0 control sockets found`) {
		t.Errorf("status: %d %q", code, errOut)
	}
	code, _, errOut = run("log-level", "debug")
	if code != 1 || !strings.Contains(errOut, "no control socket found") {
		t.Errorf("log-level without a shim: %d %q", code, errOut)
	}
	code, _, errOut = run("--address", filepath.Join(base, "x.sock"), "list")
	if code != 2 || !strings.Contains(errOut, "--address and --base-dir exclude each other") {
		t.Errorf("--address with --base-dir: %d %q", code, errOut)
	}
}

// TestDiscoveryUnreadableBase: a base directory that cannot be read is noted, and the list
// is empty.
func TestDiscoveryUnreadableBase(t *testing.T) {
	notDir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	code := Run(context.Background(), []string{"--base-dir", notDir, "list"}, &out, &errOut)
	if code != 0 || strings.TrimSpace(out.String()) != "ID  PHASE  SERVER  VM  FAILURE" ||
		!strings.Contains(errOut.String(), "kvfsctl: skipping the shims' sockets: open "+notDir+": not a directory") {
		t.Errorf("list: %d %q %q", code, out.String(), errOut.String())
	}
}
