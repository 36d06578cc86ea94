package ctl

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/sandbox/serverproc"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// helperEnv makes the test binary run kvfsctl with the arguments in the variable (one per
// line) and exit with its code: TestPeerCredentials runs it as another user.
const helperEnv = "KVFSCTL_TEST_HELPER"

func TestMain(m *testing.M) {
	serverproc.Init() // the sandboxes' confined servers are this test binary run again
	if args := os.Getenv(helperEnv); args != "" {
		os.Exit(Run(context.Background(), strings.Split(args, "\n"), os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: sandboxes bind-mount their directories, and the test switches users")
	}
}

// env is a node in miniature: real sandboxes with their default (confined) servers, each
// served on its own control socket in its directory, as a shim serves its pod's.
type env struct {
	base  string
	boxes map[string]*sandbox.Sandbox
	// afterStop runs once the sandboxes are stopped: closing a front-end before would end
	// its server, a failure in a sandbox without a VM.
	afterStop []func()
}

func newEnv(t *testing.T, ids ...string) *env {
	t.Helper()
	requireRoot(t)
	base, err := os.MkdirTemp("", "kvfs-ctl-") // short: socket paths must fit in 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	e := &env{base: base, boxes: map[string]*sandbox.Sandbox{}}
	var made []*sandbox.Sandbox
	t.Cleanup(func() {
		for _, s := range made {
			if err := s.Stop(context.Background()); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
		for _, f := range e.afterStop {
			f()
		}
		for _, s := range made {
			if _, err := os.Lstat(s.Dir()); !os.IsNotExist(err) {
				t.Errorf("cleanup: sandbox %s's directory is left: %v", s.ID(), err)
			}
		}
		// What else is there is the test's own (stale sockets, say).
		if err := os.RemoveAll(base); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir = base
	for _, id := range ids {
		s, err := sandbox.Create(context.Background(), id, sandbox.Options{Config: cfg})
		if err != nil {
			t.Fatal(err)
		}
		made = append(made, s)
		e.boxes[id] = s
		path := filepath.Join(s.Dir(), sandbox.ControlSocketName)
		cs, err := sandbox.NewControlServer(s, path, nil)
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() { served <- cs.Serve(context.Background()) }()
		// Registered after the sandbox's stop, so it runs before: the socket is in its
		// directory.
		t.Cleanup(func() {
			if err := cs.Close(); err != nil {
				t.Errorf("closing the control server: %v", err)
			}
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
			if _, err := os.Lstat(path); !os.IsNotExist(err) {
				t.Errorf("the control socket is left after Close: %v", err)
			}
		})
	}
	return e
}

// ctl runs kvfsctl in-process, finding the sandboxes' sockets in the environment's base
// directory.
func (e *env) ctl(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = Run(context.Background(), append([]string{"--base-dir", e.base}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

// run runs kvfsctl in-process with exactly args.
func (e *env) run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = Run(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// driveFUSE connects to the sandbox's vhost-user socket as QEMU would and makes a few FUSE
// requests in a read-write bind: a lookup, a create, a write, a read, a failed lookup. The
// front-end stays connected until the sandbox stops.
func driveFUSE(t *testing.T, e *env, id string) {
	t.Helper()
	s := e.boxes[id]
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, s.SocketPath(), frontend.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e.afterStop = append(e.afterStop, func() { fe.Close() })
	// The share is read-only; a volume bound read-write into it is not.
	vol := t.TempDir()
	if err := s.Bind(vol, "vol", 0); err != nil {
		t.Fatal(err)
	}
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT: %v", err)
	}
	dir, err := c.Lookup(ctx, 1, "vol")
	if err != nil {
		t.Fatalf("LOOKUP vol: %v", err)
	}
	f, err := c.Create(ctx, dir.NodeID, "hello.txt", unix.O_RDWR|unix.O_CREAT, unix.S_IFREG|0o644)
	if err != nil {
		t.Fatalf("CREATE: %v", err)
	}
	node, fh := f.Entry.NodeID, f.Open.Fh
	if n, err := c.Write(ctx, node, fh, 0, []byte("hello, world\n"), 0); err != nil || n != 13 {
		t.Fatalf("WRITE: %d, %v", n, err)
	}
	if b, err := c.Read(ctx, node, fh, 0, 4096); err != nil || string(b) != "hello, world\n" {
		t.Fatalf("READ: %q, %v", b, err)
	}
	if _, err := c.Lookup(ctx, 1, "missing"); err != unix.ENOENT {
		t.Fatalf("LOOKUP missing: %v, want ENOENT", err)
	}
}

func TestEndToEnd(t *testing.T) {
	e := newEnv(t, "pod-a", "pod-b")
	driveFUSE(t, e, "pod-a")

	// list: a table with both sandboxes, aligned.
	code, out, errOut := e.ctl(t, "list")
	if code != 0 {
		t.Fatalf("list: %d %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "ID ") || !strings.HasPrefix(lines[1], "pod-a ") ||
		!strings.HasPrefix(lines[2], "pod-b ") {
		t.Fatalf("list:\n%s", out)
	}
	col := strings.Index(lines[0], "PHASE")
	for _, l := range lines[1:] {
		if !strings.HasPrefix(l[col:], "created ") {
			t.Errorf("list: columns not aligned:\n%s", out)
		}
	}

	// status: the counters of the requests made above.
	code, out, errOut = e.ctl(t, "status", "pod-a")
	if code != 0 {
		t.Fatalf("status: %d %s", code, errOut)
	}
	for _, re := range []string{
		`(?m)^Sandbox: +pod-a$`, `(?m)^Phase: +created$`, `(?m)^Bytes read: +13$`, `(?m)^Bytes written: +13$`,
		`(?m)^Cached inodes: +3$`, `(?m)^Open handles: +1$`, `(?m)^VM: +not started$`,
		`(?m)^Queue depth: +0 `,
		`(?m)^OPCODE +COUNT +ERRORS +MEAN +P50 +P99$`, `(?m)^LOOKUP +2 +1 `, `(?m)^WRITE +1 +0 `,
		`(?m)^READ +1 +0 `, `(?m)^CREATE +1 +0 `, `(?m)^INIT +1 +0 `,
	} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("status: no match for %s in:\n%s", re, out)
		}
	}

	// status --json.
	code, out, errOut = e.ctl(t, "--json", "status", "pod-a")
	if code != 0 {
		t.Fatalf("status --json: %d %s", code, errOut)
	}
	var st statusOutput
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	stats := st.Server.Stats
	// The counters come from the confined server's own process, over its channel.
	if st.Sandbox.ID != "pod-a" || !st.Server.Running || st.Server.PID == int64(os.Getpid()) || st.Server.PID <= 0 || stats == nil ||
		stats.BytesRead != 13 || stats.BytesWritten != 13 || stats.OpenHandles != 1 || st.VM != nil {
		t.Fatalf("status --json:\n%s", out)
	}
	ops := map[string]opJSON{}
	for _, o := range stats.Ops {
		ops[o.Opcode] = o
		var n uint64
		for _, b := range o.LatencyBuckets {
			n += b
		}
		if n != o.Count || len(o.LatencyBuckets) != len(stats.LatencyBoundsSeconds)+1 {
			t.Errorf("%s: histogram %v does not add up to %d", o.Opcode, o.LatencyBuckets, o.Count)
		}
	}
	if ops["LOOKUP"].Errors != 1 || ops["WRITE"].Count != 1 || ops["READ"].Count != 1 {
		t.Errorf("ops: %+v", ops)
	}

	// metrics: valid text format, with the same counts.
	code, out, errOut = e.ctl(t, "metrics", "pod-a")
	if code != 0 {
		t.Fatalf("metrics: %d %s", code, errOut)
	}
	samples := checkExposition(t, out)
	for name, want := range map[string]float64{
		`kvfs_server_up{sandbox="pod-a"}`:                                                     1,
		`kvfs_fuse_read_bytes_total{sandbox="pod-a"}`:                                         13,
		`kvfs_fuse_written_bytes_total{sandbox="pod-a"}`:                                      13,
		`kvfs_queue_depth{sandbox="pod-a"}`:                                                   0,
		`kvfs_fuse_requests_total{sandbox="pod-a",opcode="LOOKUP"}`:                           2,
		`kvfs_fuse_request_errors_total{sandbox="pod-a",opcode="LOOKUP"}`:                     1,
		`kvfs_fuse_request_errors_total{sandbox="pod-a",opcode="WRITE"}`:                      0,
		`kvfs_fuse_request_duration_seconds_count{sandbox="pod-a",opcode="WRITE"}`:            1,
		`kvfs_fuse_request_duration_seconds_bucket{sandbox="pod-a",opcode="WRITE",le="+Inf"}`: 1,
		`kvfs_cached_inodes{sandbox="pod-a"}`:                                                 3,
		`kvfs_open_handles{sandbox="pod-a"}`:                                                  1,
	} {
		if got, ok := samples[name]; !ok || got != want {
			t.Errorf("metrics: %s = %v (present %v), want %v", name, got, ok, want)
		}
	}

	// The other sandbox's server saw nothing.
	code, out, _ = e.ctl(t, "--json", "status", "pod-b")
	if code != 0 || !strings.Contains(out, `"bytes_read": 0`) || !strings.Contains(out, `"ops": []`) {
		t.Errorf("status pod-b: %d\n%s", code, out)
	}

	// log-level, human and JSON: every shim found answers (here, one process serves both).
	code, out, errOut = e.ctl(t, "log-level", "debug")
	if code != 0 || !regexp.MustCompile(`^pod-a: log level debug \(was \w+\)\npod-b: log level debug \(was debug\)\n$`).MatchString(out) {
		t.Errorf("log-level debug: %d %q %s", code, out, errOut)
	}
	code, out, _ = e.ctl(t, "--json", "log-level", "info")
	if code != 0 || !strings.Contains(out, "\"id\": \"pod-a\",\n    \"previous_level\": \"debug\",\n    \"level\": \"info\"") {
		t.Errorf("log-level --json info: %d %q", code, out)
	}
	// With --address, the one socket's answer.
	code, out, _ = e.run(t, "--address", filepath.Join(e.boxes["pod-a"].Dir(), sandbox.ControlSocketName), "--json", "log-level", "info")
	if code != 0 || out != "{\n  \"previous_level\": \"info\",\n  \"level\": \"info\"\n}\n" {
		t.Errorf("--address log-level --json info: %d %q", code, out)
	}

	// dax-policy: applied to the confined server over its channel; a window size cannot be changed.
	code, out, errOut = e.ctl(t, "dax-policy", "--rules", "on glob=*.so; off size>=1M", "pod-a", "inode")
	if code != 0 || out != "sandbox pod-a: DAX policy updated\n" {
		t.Errorf("dax-policy: %d %q %q", code, out, errOut)
	}
	code, out, errOut = e.ctl(t, "dax-policy", "--window", strconv.Itoa(64<<20), "pod-a", "always")
	if code != 1 || out != "" || !strings.Contains(errOut, "fixed when the VM starts") || !strings.Contains(errOut, "(Unimplemented)") {
		t.Errorf("dax-policy --window: %d %q %q", code, out, errOut)
	}

	// stop pod-b: gone from the list, its directory removed.
	b := e.boxes["pod-b"]
	code, out, errOut = e.ctl(t, "--json", "stop", "pod-b")
	if code != 0 || out != "{\n  \"id\": \"pod-b\",\n  \"stopped\": true\n}\n" {
		t.Errorf("stop: %d %q %s", code, out, errOut)
	}
	if b.Phase() != sandbox.PhaseStopped {
		t.Errorf("pod-b after stop: %s", b.Phase())
	}
	if _, err := os.Stat(b.Dir()); !os.IsNotExist(err) {
		t.Errorf("pod-b's directory after stop: %v", err)
	}
	code, out, _ = e.ctl(t, "--json", "list")
	if code != 0 || strings.Contains(out, "pod-b") || !strings.Contains(out, `"id": "pod-a"`) {
		t.Errorf("list after stop: %d\n%s", code, out)
	}
	code, _, errOut = e.ctl(t, "stop", "pod-b")
	if code != 1 || !strings.Contains(errOut, "(NotFound)") {
		t.Errorf("stop pod-b again: %d %s", code, errOut)
	}
}

// checkExposition checks out against the text exposition format and returns its samples by
// name and labels: every line a HELP, a TYPE or a sample; a family's HELP and TYPE once, before
// its samples; sample names of the declared family (with _bucket, _sum, _count for
// histograms); histogram buckets cumulative, ending with +Inf equal to _count.
func checkExposition(t *testing.T, out string) map[string]float64 {
	t.Helper()
	var (
		helpRE   = regexp.MustCompile(`^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) \S.*$`)
		typeRE   = regexp.MustCompile(`^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$`)
		sampleRE = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\} (\S+)$`)
		labelRE  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)
	)
	samples := map[string]float64{}
	types := map[string]string{}
	helped := map[string]bool{}
	var family string
	lastBucket := map[string]float64{} // series without le -> last cumulative count
	sc := bufio.NewScanner(strings.NewReader(out))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if m := helpRE.FindStringSubmatch(line); m != nil {
			if helped[m[1]] {
				t.Errorf("line %d: second HELP for %s", n, m[1])
			}
			helped[m[1]], family = true, m[1]
			continue
		}
		if m := typeRE.FindStringSubmatch(line); m != nil {
			if _, ok := types[m[1]]; ok || m[1] != family {
				t.Errorf("line %d: TYPE %s repeated or not after its HELP", n, m[1])
			}
			types[m[1]] = m[2]
			continue
		}
		m := sampleRE.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("line %d: not HELP, TYPE or a sample: %q", n, line)
			continue
		}
		name, labels := m[1], m[2]
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			t.Errorf("line %d: value %q: %v", n, m[3], err)
		}
		base := name
		if types[family] == "histogram" {
			for _, suf := range []string{"_bucket", "_sum", "_count"} {
				if strings.HasSuffix(name, suf) {
					base = strings.TrimSuffix(name, suf)
				}
			}
		}
		if base != family {
			t.Errorf("line %d: sample %s outside its family (current %s)", n, name, family)
		}
		var le string
		var rest []string
		for _, l := range labelRE.FindAllStringSubmatch(labels, -1) {
			if l[1] == "le" {
				le = l[2]
			} else {
				rest = append(rest, l[0])
			}
		}
		series := base + "{" + strings.Join(rest, ",") + "}"
		switch {
		case strings.HasSuffix(name, "_bucket") && types[family] == "histogram":
			if le == "" {
				t.Errorf("line %d: bucket without le", n)
			}
			if v < lastBucket[series] {
				t.Errorf("line %d: buckets of %s not cumulative", n, series)
			}
			lastBucket[series] = v
			if le == "+Inf" {
				samples[series+"+Inf"] = v
			}
		case strings.HasSuffix(name, "_count") && types[family] == "histogram":
			if inf, ok := samples[series+"+Inf"]; !ok || inf != v {
				t.Errorf("line %d: %s _count %v, +Inf bucket %v (present %v)", n, series, v, inf, ok)
			}
		}
		samples[name+"{"+labels+"}"] = v
	}
	for name := range helped {
		if _, ok := types[name]; !ok {
			t.Errorf("%s has HELP but no TYPE", name)
		}
	}
	if len(samples) == 0 {
		t.Errorf("no samples in:\n%s", out)
	}
	return samples
}

// TestJSONFieldNames pins the JSON output's field names: scripts depend on them.
func TestJSONFieldNames(t *testing.T) {
	e := newEnv(t, "pod-j")
	driveFUSE(t, e, "pod-j")
	keys := func(v any) []string {
		var ks []string
		for k := range v.(map[string]any) {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		return ks
	}
	check := func(what string, v any, want ...string) {
		t.Helper()
		slices.Sort(want)
		if got := keys(v); !slices.Equal(got, want) {
			t.Errorf("%s: fields %v, want %v", what, got, want)
		}
	}
	summary := []string{"id", "phase", "daemon", "server_running", "vm_pid", "vm_running", "failure"}

	_, out, _ := e.ctl(t, "--json", "list")
	var list map[string]any
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatal(err)
	}
	check("list", list, "sandboxes")
	check("list.sandboxes[0]", list["sandboxes"].([]any)[0], summary...)

	_, out, _ = e.ctl(t, "--json", "status", "pod-j")
	var st map[string]any
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatal(err)
	}
	check("status", st, "sandbox", "server", "vm")
	check("status.sandbox", st["sandbox"], summary...)
	srv := st["server"].(map[string]any)
	check("status.server", srv, "daemon", "pid", "started", "uptime_ns", "running", "restarts", "last_failure", "stats")
	stats := srv["stats"].(map[string]any)
	check("status.server.stats", stats, "bytes_read", "bytes_written", "malformed", "panics", "cached_inodes",
		"open_handles", "open_fds", "blocked_requests", "queue_depth", "latency_bounds_seconds", "ops")
	check("status.server.stats.ops[0]", stats["ops"].([]any)[0], "opcode", "count", "errors", "total_time_ns", "latency_buckets")
	if _, err := time.Parse(time.RFC3339Nano, srv["started"].(string)); err != nil {
		t.Errorf("started: %v", err)
	}
}

func TestBadArguments(t *testing.T) {
	// None of these dials: the address does not exist.
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "no command"},
		{[]string{"frob"}, `unknown command "frob"`},
		{[]string{"--bogus", "list"}, "flag provided but not defined: -bogus"},
		{[]string{"--timeout", "0", "list"}, "--timeout must be positive"},
		{[]string{"list", "x"}, "usage: kvfsctl list"},
		{[]string{"status"}, "usage: kvfsctl status ID"},
		{[]string{"status", "a", "b"}, "usage: kvfsctl status ID"},
		{[]string{"stop"}, "usage: kvfsctl stop ID"},
		{[]string{"log-level"}, "usage: kvfsctl log-level LEVEL"},
		{[]string{"--json", "metrics", "a"}, "--json does not apply"},
		{[]string{"dax-policy", "a"}, "usage: kvfsctl dax-policy"},
		{[]string{"dax-policy", "a", "sometimes"}, `unknown policy "sometimes"`},
		{[]string{"dax-policy", "--window", "lots", "a", "always"}, `--window "lots"`},
		{[]string{"dax-policy", "--rules", "on glob=[", "a", "inode"}, "--rules: DAX rule 1"},
	} {
		var out, errOut bytes.Buffer
		args := append([]string{"--address", "/nonexistent/kvfs.sock"}, tc.args...)
		code := Run(context.Background(), args, &out, &errOut)
		if code != 2 || out.Len() != 0 || !strings.Contains(errOut.String(), tc.want) ||
			!strings.Contains(errOut.String(), "Usage: kvfsctl") {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want 2 and %q", tc.args, code, out.String(), errOut.String(), tc.want)
		}
	}

	var out bytes.Buffer
	if code := Run(context.Background(), []string{"--help"}, &out, io.Discard); code != 0 || !strings.Contains(out.String(), "dax-policy") {
		t.Errorf("--help: %d %q", code, out.String())
	}
	var errOut bytes.Buffer
	if code := Run(context.Background(), []string{"--address", "/nonexistent/kvfs.sock", "list"}, io.Discard, &errOut); code != 1 ||
		!strings.Contains(errOut.String(), "connecting to the control socket") {
		t.Errorf("no socket: %d %q", code, errOut.String())
	}
}

// TestServerErrors: what the server refuses comes back with its status code (asked through
// its socket by --address, so that the server, not the search, answers).
func TestServerErrors(t *testing.T) {
	e := newEnv(t, "pod-e")
	address := filepath.Join(e.boxes["pod-e"].Dir(), sandbox.ControlSocketName)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"status", "nope"}, `sandbox "nope": not found (NotFound)`},
		{[]string{"status", "../etc"}, "(InvalidArgument)"},
		{[]string{"metrics", "nope"}, "(NotFound)"},
		{[]string{"log-level", "loud"}, "(InvalidArgument)"},
		{[]string{"dax-policy", "--window", "4096", "pod-e", "inode"}, "not a multiple of 2 MiB"},
		{[]string{"dax-policy", "nope", "never"}, "(NotFound)"},
	} {
		code, out, errOut := e.run(t, append([]string{"--address", address}, tc.args...)...)
		if code != 1 || out != "" || !strings.Contains(errOut, tc.want) {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want 1 and %q", tc.args, code, out, errOut, tc.want)
		}
	}
}

// TestPeerCredentials runs kvfsctl as another user (nobody, 65534): with the socket's mode
// 0600 it cannot connect, and with the mode opened up the server still refuses it on its peer
// credentials, while root's same request succeeds.
func TestPeerCredentials(t *testing.T) {
	e := newEnv(t, "pod-p")
	address := filepath.Join(e.boxes["pod-p"].Dir(), sandbox.ControlSocketName)
	if fi, err := os.Stat(address); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("control socket: %v, %v; want mode 0600", fi, err)
	}
	// The helper binary and the socket's directory must be reachable by nobody.
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	binDir, err := os.MkdirTemp("", "kvfsctl-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(binDir) })
	bin := filepath.Join(binDir, "kvfsctl.test")
	copyFile(t, self, bin)
	for _, p := range []string{binDir, e.base, e.boxes["pod-p"].Dir()} {
		if err := os.Chmod(p, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	helper := func(cred *syscall.Credential) (int, string) {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin)
		cmd.Env = []string{helperEnv + "=" + strings.Join([]string{"--address", address, "--timeout", "10s", "list"}, "\n")}
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		err := cmd.Run()
		code := cmd.ProcessState.ExitCode()
		if err != nil && code < 0 {
			t.Fatalf("helper: %v\n%s", err, stderr.String())
		}
		return code, stdout.String() + stderr.String()
	}
	nobody := &syscall.Credential{Uid: 65534, Gid: 65534, NoSetGroups: true}

	code, out := helper(nobody)
	if code != 1 || !strings.Contains(out, "permission denied") {
		t.Errorf("nobody, socket 0600: exit %d: %s", code, out)
	}

	if err := os.Chmod(address, 0o666); err != nil {
		t.Fatal(err)
	}
	code, out = helper(nobody)
	if code != 1 || strings.Contains(out, "pod-p") || !strings.Contains(out, "only root and the server's own user") {
		t.Errorf("nobody, socket 0666: exit %d: %s; want refused", code, out)
	}
	t.Logf("nobody was refused: %s", strings.TrimSpace(out))
	code, out = helper(nil)
	if code != 0 || !strings.Contains(out, "pod-p") {
		t.Errorf("root, socket 0666: exit %d: %s", code, out)
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
