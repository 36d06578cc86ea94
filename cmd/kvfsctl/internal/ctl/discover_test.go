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

// nodeEnv is a node in miniature: shims, each serving the control API of its one sandbox at
// BASE/<id>/control.sock, and a daemon serving its sandboxes (in the same base directory,
// without a socket in their directories) at its own socket.
type nodeEnv struct {
	base   string
	daemon string
	boxes  map[string]*sandbox.Sandbox
}

func newNodeEnv(t *testing.T, shims, daemonPods []string) *nodeEnv {
	t.Helper()
	requireRoot(t)
	base, err := os.MkdirTemp("", "kvfs-node-") // short: socket paths must fit in 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(base); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	e := &nodeEnv{base: base, daemon: filepath.Join(base, "kvfs.sock"), boxes: map[string]*sandbox.Sandbox{}}
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir = base
	create := func(m *sandbox.Manager, id string) {
		t.Helper()
		s, err := sandbox.Create(context.Background(), id, sandbox.Options{Config: cfg})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := s.Stop(context.Background()); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		})
		if err := m.Add(s); err != nil {
			t.Fatal(err)
		}
		e.boxes[id] = s
	}
	serve := func(m *sandbox.Manager, path string) {
		t.Helper()
		cs, err := sandbox.NewControlServer(m, path)
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- cs.Serve(context.Background()) }()
		t.Cleanup(func() {
			if err := cs.Close(); err != nil {
				t.Errorf("closing the control server: %v", err)
			}
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	for _, id := range shims {
		m := sandbox.NewManager()
		create(m, id)
		serve(m, filepath.Join(e.boxes[id].Dir(), sandbox.ControlSocketName))
	}
	if daemonPods != nil {
		m := sandbox.NewManager()
		for _, id := range daemonPods {
			create(m, id)
		}
		serve(m, e.daemon)
	}
	return e
}

// ctl runs kvfsctl in-process, finding the sockets in the environment.
func (e *nodeEnv) ctl(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = runWithDaemon(context.Background(), append([]string{"--base-dir", e.base}, args...), &out, &errOut, e.daemon)
	return code, out.String(), errOut.String()
}

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
	e := newNodeEnv(t, []string{"pod-b", "pod-a"}, []string{"pod-d"})
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
	code, out, errOut := e.ctl("list")
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
	code, out, _ = e.ctl("--json", "list")
	var list listOutput
	if err := json.Unmarshal([]byte(out), &list); code != 0 || err != nil || len(list.Sandboxes) != 3 || list.Sandboxes[2].ID != "pod-d" {
		t.Errorf("list --json: %d %v\n%s", code, err, out)
	}

	// A command on one sandbox goes to the socket that has it: each socket has one
	// sandbox's, and the others answer NotFound.
	for _, id := range []string{"pod-a", "pod-b", "pod-d"} {
		code, out, errOut = e.ctl("status", id)
		if code != 0 || !regexp.MustCompile(`(?m)^Sandbox: +`+id+`$`).MatchString(out) {
			t.Errorf("status %s: %d %q %q", id, code, out, errOut)
		}
	}
	code, out, errOut = e.ctl("metrics", "pod-b")
	if code != 0 || !strings.Contains(out, `kvfs_server_up{sandbox="pod-b"} 1`) {
		t.Errorf("metrics pod-b: %d %q %q", code, out, errOut)
	}
	code, out, errOut = e.ctl("dax-policy", "--rules", "on glob=*.so", "pod-a", "inode")
	if code != 0 || out != "sandbox pod-a: DAX policy updated\n" {
		t.Errorf("dax-policy pod-a: %d %q %q", code, out, errOut)
	}

	// A sandbox no socket has: NotFound naming it.
	code, out, errOut = e.ctl("status", "pod-x")
	if code != 1 || out != "" || !strings.Contains(errOut, `sandbox "pod-x": not found in any of the 4 control sockets found`) ||
		!strings.Contains(errOut, "(NotFound)") || !staleNote.MatchString(errOut) {
		t.Errorf("status pod-x: %d %q %q", code, out, errOut)
	}
	code, _, errOut = e.ctl("stop", "../pod-a")
	if code != 1 || !strings.Contains(errOut, `sandbox "../pod-a": not found`) {
		t.Errorf("stop ../pod-a: %d %q", code, errOut)
	}

	// stop through the shim's socket: the sandbox is stopped, its directory (and socket) gone.
	code, out, errOut = e.ctl("stop", "pod-b")
	if code != 0 || out != "sandbox pod-b stopped\n" {
		t.Errorf("stop pod-b: %d %q %q", code, out, errOut)
	}
	if p := e.boxes["pod-b"].Phase(); p != sandbox.PhaseStopped {
		t.Errorf("pod-b after stop: %s", p)
	}
	code, out, _ = e.ctl("list")
	if code != 0 || strings.Contains(out, "pod-b") || !strings.Contains(out, "pod-a") {
		t.Errorf("list after stop: %d\n%s", code, out)
	}

	// log-level goes to the daemon.
	code, out, errOut = e.ctl("log-level", "info")
	if code != 0 || !strings.HasPrefix(out, "log level info (was ") {
		t.Errorf("log-level: %d %q %q", code, out, errOut)
	}

	// --address keeps to its one socket.
	var o, eo bytes.Buffer
	code = runWithDaemon(context.Background(), []string{"--address", e.daemon, "list"}, &o, &eo, e.daemon)
	if code != 0 || strings.Contains(o.String(), "pod-a") || !strings.Contains(o.String(), "pod-d") || eo.Len() != 0 {
		t.Errorf("--address list: %d %q %q", code, o.String(), eo.String())
	}
	o.Reset()
	eo.Reset()
	shimA := filepath.Join(e.boxes["pod-a"].Dir(), sandbox.ControlSocketName)
	code = runWithDaemon(context.Background(), []string{"--address", shimA, "status", "pod-d"}, &o, &eo, e.daemon)
	if code != 1 || !strings.Contains(eo.String(), `sandbox "pod-d": not found (NotFound)`) {
		t.Errorf("--address SHIM status pod-d: %d %q", code, eo.String())
	}
}

// TestDiscoveryNothingFound: no daemon and no shim is an empty list with a note, and a
// command on a sandbox fails NotFound.
func TestDiscoveryNothingFound(t *testing.T) {
	base := t.TempDir()
	daemon := filepath.Join(base, "kvfs.sock")
	run := func(args ...string) (int, string, string) {
		var out, errOut bytes.Buffer
		code := runWithDaemon(context.Background(), append([]string{"--base-dir", filepath.Join(base, "sandboxes")}, args...), &out, &errOut, daemon)
		return code, out.String(), errOut.String()
	}
	code, out, errOut := run("list")
	if code != 0 || strings.TrimSpace(out) != "ID  PHASE  SERVER  VM  FAILURE" ||
		!strings.Contains(errOut, "no control socket found (looked at "+daemon+" and "+filepath.Join(base, "sandboxes", "*", "control.sock")+")") {
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
	if code != 1 || !strings.Contains(errOut, "connecting to the control socket") {
		t.Errorf("log-level without a daemon: %d %q", code, errOut)
	}
	code, _, errOut = run("--address", daemon, "list")
	if code != 2 || !strings.Contains(errOut, "--address and --base-dir exclude each other") {
		t.Errorf("--address with --base-dir: %d %q", code, errOut)
	}
}

// TestDiscoveryUnreadableBase: a base directory that cannot be read is noted, and the daemon
// is still asked.
func TestDiscoveryUnreadableBase(t *testing.T) {
	e := newNodeEnv(t, nil, []string{"pod-d"})
	notDir := filepath.Join(e.base, "file")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	code := runWithDaemon(context.Background(), []string{"--base-dir", notDir, "list"}, &out, &errOut, e.daemon)
	if code != 0 || !strings.Contains(out.String(), "pod-d") ||
		!strings.Contains(errOut.String(), "kvfsctl: skipping the shims' sockets: open "+notDir+": not a directory") {
		t.Errorf("list: %d %q %q", code, out.String(), errOut.String())
	}
}
