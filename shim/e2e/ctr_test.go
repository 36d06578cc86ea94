package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/shimtest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// newEnv starts the containerd, without the CRI. extra is TOML added at the top of the kvfs
// configuration (before its [vm] table).
func newEnv(t *testing.T, extra string) *shimtest.Env {
	t.Helper()
	return shimtest.Start(t, extra, "")
}

// run is `ctr run --runtime io.containerd.kvfs.v2 --runtime-config-path CONFIG flags... IMAGE
// ID args...`.
func run(t *testing.T, e *shimtest.Env, flags []string, id string, args ...string) ctrd.Result {
	t.Helper()
	return e.C.RunCtr(t, runArgs(e, flags, id, args...)...)
}

func runArgs(e *shimtest.Env, flags []string, id string, args ...string) []string {
	a := append([]string{"run", "--runtime", shimtest.RuntimeType, "--runtime-config-path", e.Config}, flags...)
	a = append(a, e.Image, id)
	return append(a, args...)
}

func wantResult(t *testing.T, what string, r ctrd.Result, code int, stdout string) {
	t.Helper()
	if r.ExitCode != code || r.Stdout != stdout {
		t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit %d, stdout %q", what, r.ExitCode, r.Stdout, r.Stderr, code, stdout)
	}
}

// TestRun: a process's output and exit status, through ctr, from a VM. The kernel release
// in the output is the guest's, not the host's: the process did run in the VM. It runs under
// the machine's QEMU (Debian 12's 7.2) and again under QEMU 10.
func TestRun(t *testing.T) {
	t.Run("default-qemu", func(t *testing.T) { testRun(t, newEnv(t, "")) })
	t.Run("qemu10", func(t *testing.T) { testRun(t, shimtest.StartQEMU(t, vmtest.QEMU10(t))) })
}

func testRun(t *testing.T, e *shimtest.Env) {
	var host syscall.Utsname
	if err := syscall.Uname(&host); err != nil {
		t.Fatal(err)
	}
	r := run(t, e, []string{"--rm"}, "echo", "sh", "-c", "echo hello; uname -r; grep -c ' / virtiofs ' /proc/self/mounts")
	lines := strings.Split(strings.TrimSuffix(r.Stdout, "\n"), "\n")
	if r.ExitCode != 0 || len(lines) != 3 || lines[0] != "hello" || lines[2] != "1" {
		t.Fatalf("exit %d, stdout %q, stderr %q; want 0, hello, a kernel release, 1 (the root is virtio-fs)", r.ExitCode, r.Stdout, r.Stderr)
	}
	if hostRelease := utsString(host.Release[:]); lines[1] == hostRelease {
		t.Errorf("the container's kernel is the host's (%s): it did not run in the VM", hostRelease)
	}

	r = run(t, e, []string{"--rm"}, "exit3", "sh", "-c", "echo out; echo err >&2; exit 3")
	wantResult(t, "exit 3", r, 3, "out\n")
	if got := withoutCtrLog(r.Stderr); got != "err\n" {
		t.Errorf("exit 3: stderr %q, want %q", got, "err\n")
	}

	a := startAttached(t, e, "kill9")
	e.C.Ctr(t, "task", "kill", "-s", "SIGKILL", "kill9")
	if code := a.wait(t); code != 137 {
		t.Errorf("ctr run of a task killed with SIGKILL: exit %d, want 137; stderr %s", code, a.stderr.String())
	}
}

// withoutCtrLog drops ctr's own log lines (a deprecation warning about the host's cgroup v1)
// from what it wrote on stderr.
func withoutCtrLog(stderr string) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(stderr, "\n") {
		if !strings.HasPrefix(line, "time=") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// attached is a `ctr run --rm` in the background whose task has started.
type attached struct {
	cmd    *exec.Cmd
	stderr *strings.Builder
	cancel context.CancelFunc
}

// startAttached starts `ctr run --rm ... ID sh -c 'echo up; exec sleep 600'` and returns once
// the task has printed "up".
func startAttached(t *testing.T, e *shimtest.Env, id string) *attached {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	a := &attached{cmd: e.C.CtrCmd(ctx, runArgs(e, []string{"--rm"}, id, "sh", "-c", "echo up; exec sleep 600")...), stderr: &strings.Builder{}, cancel: cancel}
	t.Cleanup(cancel)
	stdout, err := a.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	a.cmd.Stderr = a.stderr
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 3)
	if _, err := io.ReadFull(stdout, buf); err != nil || string(buf) != "up\n" {
		a.cmd.Process.Kill()
		a.cmd.Wait()
		t.Fatalf("task %s did not start: %q, %v; stderr %s", id, buf, err, a.stderr.String())
	}
	return a
}

// wait waits for ctr to return and answers its exit status.
func (a *attached) wait(t *testing.T) int {
	t.Helper()
	err := a.cmd.Wait()
	if a.cmd.ProcessState == nil || a.cmd.ProcessState.ExitCode() < 0 {
		t.Fatalf("ctr run: %v; stderr %s", err, a.stderr.String())
	}
	return a.cmd.ProcessState.ExitCode()
}

func utsString(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

// TestStdin: ctr forwards its stdin to the task.
func TestStdin(t *testing.T) {
	e := newEnv(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := e.C.CtrCmd(ctx, runArgs(e, []string{"--rm"}, "stdin", "sh", "-c", "read a; read b; echo got $a $b")...)
	cmd.Stdin = strings.NewReader("one\ntwo\n")
	out, err := cmd.Output()
	if err != nil || string(out) != "got one two\n" {
		t.Fatalf("ctr run with stdin: %v, stdout %q; want %q", err, out, "got one two\n")
	}
}

// TestTerminal: -t gives the process a pty in the guest, sized as ctr's own terminal.
func TestTerminal(t *testing.T) {
	e := newEnv(t, "")
	script, err := exec.LookPath("script")
	if err != nil {
		t.Fatalf("script(1) (util-linux) is needed to give ctr a terminal: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ctr := e.C.CtrCmd(ctx, runArgs(e, []string{"--rm", "-t"}, "tty", "sh", "-c", "tty; stty size")...)
	line := "stty rows 33 cols 101; exec " + shimtest.ShellQuote(ctr.Args)
	cmd := exec.CommandContext(ctx, script, "-qec", line, "/dev/null")
	cmd.Env = ctr.Env
	out, err := cmd.Output()
	got := strings.ReplaceAll(string(out), "\r", "")
	if err != nil || !strings.Contains(got, "/dev/pts/") || !strings.Contains(got, "33 101\n") {
		t.Fatalf("ctr run -t: %v, output %q; want a /dev/pts tty and the size 33 101", err, got)
	}
}

// TestSnapshotWrite: a file the container writes lands in its snapshot on the host (the
// overlayfs upper directory containerd keeps), through the share.
func TestSnapshotWrite(t *testing.T) {
	e := newEnv(t, "")
	token := fmt.Sprintf("written in the guest %d", time.Now().UnixNano())
	r := run(t, e, nil, "writer", "sh", "-c", "echo '"+token+"' >/from-guest && sync")
	wantResult(t, "write", r, 0, "")
	files, err := filepath.Glob(filepath.Join(e.C.Dir(), "root", "io.containerd.snapshotter.v1.overlayfs", "snapshots", "*", "fs", "from-guest"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 1 {
		t.Fatalf("snapshots holding /from-guest: %q, want one", files)
	}
	if b, err := os.ReadFile(files[0]); err != nil || string(b) != token+"\n" {
		t.Errorf("%s: %q, %v; want %q", files[0], b, err, token+"\n")
	}
	e.C.Ctr(t, "container", "rm", "writer")
}

// TestTasks: exec, ps, metrics, pause and resume, and kill, on two running tasks (two pods).
func TestTasks(t *testing.T) {
	e := newEnv(t, "")
	for _, id := range []string{"t1", "t2"} {
		wantResult(t, "run -d "+id, run(t, e, []string{"-d"}, id, "sleep", "600"), 0, "")
	}
	r := e.C.RunCtr(t, "task", "exec", "--exec-id", "e1", "t1", "sh", "-c", "echo in exec; cat /proc/1/cmdline; exit 5")
	wantResult(t, "exec", r, 5, "in exec\nsleep\x00600\x00")

	ps := e.C.Ctr(t, "task", "ps", "t1")
	if n := len(strings.Split(strings.TrimSpace(ps), "\n")); n < 2 {
		t.Errorf("ctr task ps t1: %q, want a header and the init", ps)
	}
	m := e.C.Ctr(t, "task", "metrics", "--format", "json", "t1")
	var metrics struct {
		Memory struct {
			Usage uint64 `json:"usage"`
		} `json:"memory"`
		Pids struct {
			Current uint64 `json:"current"`
		} `json:"pids"`
	}
	if err := json.Unmarshal([]byte(m), &metrics); err != nil {
		t.Fatalf("ctr task metrics: %v\n%s", err, m)
	}
	if metrics.Memory.Usage == 0 || metrics.Pids.Current == 0 {
		t.Errorf("metrics of t1: memory usage %d, pids %d; want both non-zero\n%s", metrics.Memory.Usage, metrics.Pids.Current, m)
	}

	// kvfsctl finds both pods' shims by their control sockets, and t1's in-process kvfsd has
	// served the guest's requests.
	var list struct {
		Sandboxes []struct {
			ID        string `json:"id"`
			VMRunning bool   `json:"vm_running"`
		} `json:"sandboxes"`
	}
	lj := kvfsctl(t, "--base-dir", e.BaseDir, "--json", "list")
	if err := json.Unmarshal([]byte(lj), &list); err != nil {
		t.Fatalf("kvfsctl --json list: %v\n%s", err, lj)
	}
	running := map[string]bool{}
	for _, sb := range list.Sandboxes {
		running[sb.ID] = sb.VMRunning
	}
	if !running["t1"] || !running["t2"] || len(running) != 2 {
		t.Errorf("kvfsctl list: %v, want t1 and t2 with their VMs running\n%s", running, lj)
	}
	var status struct {
		Server struct {
			Stats struct {
				Ops []struct {
					Op    string `json:"opcode"`
					Count uint64 `json:"count"`
				} `json:"ops"`
			} `json:"stats"`
		} `json:"server"`
	}
	js := kvfsctl(t, "--base-dir", e.BaseDir, "--json", "status", "t1")
	if err := json.Unmarshal([]byte(js), &status); err != nil {
		t.Fatalf("kvfsctl --json status t1: %v\n%s", err, js)
	}
	lookups := uint64(0)
	for _, op := range status.Server.Stats.Ops {
		if op.Op == "LOOKUP" {
			lookups = op.Count
		}
	}
	if lookups == 0 {
		t.Errorf("kvfsctl status t1 counts no LOOKUP served to the guest:\n%s", js)
	}

	e.C.Ctr(t, "task", "pause", "t1")
	wantStatus(t, e, map[string]string{"t1": "PAUSED", "t2": "RUNNING"})
	wantResult(t, "exec in t2 while t1 is paused", e.C.RunCtr(t, "task", "exec", "--exec-id", "e2", "t2", "echo", "t2"), 0, "t2\n")
	e.C.Ctr(t, "task", "resume", "t1")
	wantStatus(t, e, map[string]string{"t1": "RUNNING", "t2": "RUNNING"})
	wantResult(t, "exec in t1 after resume", e.C.RunCtr(t, "task", "exec", "--exec-id", "e3", "t1", "echo", "t1"), 0, "t1\n")

	// containerd restarted under the running tasks: it reconnects to their shims.
	e.C.Restart(t)
	wantStatus(t, e, map[string]string{"t1": "RUNNING", "t2": "RUNNING"})
	wantResult(t, "exec in t1 after containerd's restart", e.C.RunCtr(t, "task", "exec", "--exec-id", "e4", "t1", "echo", "t1"), 0, "t1\n")

	// t2's shim SIGKILLed: containerd runs its delete action, which stops t2's VM and
	// kvfsd and removes its sandbox, and drops the task (as for a dead runc shim: ctr task ls
	// no longer lists it); its container is removed with ctr c rm.
	var shim, pod []ctrd.Process
	for _, p := range e.C.Snapshot(t).Processes {
		switch {
		case strings.Contains(p.Cmdline, "containerd-shim-kvfs-v2 -namespace") && strings.Contains(p.Cmdline, "-id t2"):
			shim = append(shim, p)
		case strings.Contains(p.Cmdline, "qemu-system") && strings.Contains(p.Cmdline, filepath.Join(e.BaseDir, "t2")):
			pod = append(pod, p)
		}
	}
	if len(shim) != 1 || len(pod) != 1 {
		t.Fatalf("t2's shim %v and QEMU %v: want one of each", shim, pod)
	}
	for _, p := range e.C.Snapshot(t).Processes {
		if p.PPID == shim[0].PID && !strings.Contains(p.Cmdline, "qemu-system") {
			pod = append(pod, p) // its kvfsd
		}
	}
	if err := syscall.Kill(shim[0].PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for taskStatus(t, e)["t2"] == "RUNNING" || len(shimtest.Alive(pod)) > 0 || exists(filepath.Join(e.BaseDir, "t2")) {
		if time.Now().After(deadline) {
			t.Fatalf("t2's shim killed: a minute later, t2 is %q, its processes %v still run, its sandbox directory exists: %v",
				taskStatus(t, e)["t2"], shimtest.Alive(pod), exists(filepath.Join(e.BaseDir, "t2")))
		}
		time.Sleep(200 * time.Millisecond)
	}
	if st, ok := taskStatus(t, e)["t2"]; ok && st != "STOPPED" {
		t.Errorf("t2's shim killed: t2 is %s, want it stopped or gone", st)
	}
	wantStatus(t, e, map[string]string{"t1": "RUNNING"})

	// sleep is its container's init, which takes no signal it has no handler for but SIGKILL.
	e.C.Ctr(t, "task", "kill", "-s", "SIGKILL", "t1")
	waitStatus(t, e, map[string]string{"t1": "STOPPED"})
	for _, id := range []string{"t1", "t2"} {
		if _, ok := taskStatus(t, e)[id]; ok {
			e.C.Ctr(t, "task", "rm", id)
		}
		e.C.Ctr(t, "container", "rm", id)
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// kvfsctl runs the kvfsctl under test and returns its output; it fails the test unless it
// exits 0.
func kvfsctl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(shimtest.BinDir, "kvfsctl"), args...).Output()
	if err != nil {
		t.Fatalf("kvfsctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// taskStatus is `ctr task ls`: each task's status.
func taskStatus(t *testing.T, e *shimtest.Env) map[string]string {
	t.Helper()
	out := e.C.Ctr(t, "task", "ls")
	st := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) == 3 {
			st[f[0]] = f[2]
		}
	}
	return st
}

func wantStatus(t *testing.T, e *shimtest.Env, want map[string]string) {
	t.Helper()
	got := taskStatus(t, e)
	for id, s := range want {
		if got[id] != s {
			t.Errorf("task %s is %s, want %s (ctr task ls: %v)", id, got[id], s, got)
		}
	}
}

// waitStatus waits until every task in want has its status (a killed task stops a moment
// after the kill returns).
func waitStatus(t *testing.T, e *shimtest.Env, want map[string]string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		got, ok := taskStatus(t, e), true
		for id, s := range want {
			ok = ok && got[id] == s
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tasks: %v, want %v", got, want)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestBadConfig: a configuration that cannot be used fails the run with an error naming
// it, and leaves nothing behind (no shim, VM, mount or sandbox directory).
func TestBadConfig(t *testing.T) {
	e := newEnv(t, "")
	before := e.C.Snapshot(t)

	missing := filepath.Join(filepath.Dir(e.Config), "missing.toml")
	r := e.C.RunCtr(t, "run", "--rm", "--runtime", shimtest.RuntimeType, "--runtime-config-path", missing, e.Image, "bad1", "true")
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, missing) {
		t.Errorf("a missing config: exit %d, stderr %q; want a failure naming %s", r.ExitCode, r.Stderr, missing)
	}

	typo := filepath.Join(filepath.Dir(e.Config), "typo.toml")
	if err := os.WriteFile(typo, []byte("[vm]\nmemroy = \"1G\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r = e.C.RunCtr(t, "run", "--rm", "--runtime", shimtest.RuntimeType, "--runtime-config-path", typo, e.Image, "bad2", "true")
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, "memroy") {
		t.Errorf("an unknown key: exit %d, stderr %q; want a failure naming vm.memroy", r.ExitCode, r.Stderr)
	}
	for _, id := range []string{"bad1", "bad2"} {
		// ctr run --rm removes the container only after a task ran: take it back here.
		e.C.RunCtr(t, "container", "rm", id)
	}
	e.C.CheckNoLeaks(t, before)
}

// TestRunCycles: 20 `ctr run --rm` leave no process, mount, descriptor of containerd,
// cgroup or sandbox directory behind. (TestCRILifecycle's 30 pods through the CRI check the
// same for the pod's whole life; 20 here keep make test within its time.)
func TestRunCycles(t *testing.T) {
	e := newEnv(t, "")
	before := e.C.Snapshot(t)
	const cycles = 20
	start := time.Now()
	for i := range cycles {
		r := run(t, e, []string{"--rm"}, fmt.Sprintf("c%d", i), "true")
		if r.ExitCode != 0 {
			t.Fatalf("cycle %d: exit %d, stderr %q", i, r.ExitCode, r.Stderr)
		}
	}
	t.Logf("%d runs in %v", cycles, time.Since(start).Round(time.Millisecond))
	e.C.CheckNoLeaks(t, before)
}

// TestServerKilled: kvfsd (here as an external daemon, so that it can be killed alone) dies
// under a running task: the task exits with 255 and ctr returns at once, leaving nothing.
func TestServerKilled(t *testing.T) {
	kvfsd := filepath.Join(shimtest.BinDir, "kvfsd")
	e := newEnv(t, fmt.Sprintf("[server]\ndaemon = %q\n", kvfsd))
	before := e.C.Snapshot(t)

	a := startAttached(t, e, "victim")
	pid := serverPID(t, filepath.Join(e.BaseDir, "victim", "state.json"))
	killed := time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 kvfsd %d: %v", pid, err)
	}
	code := a.wait(t)
	took := time.Since(killed)
	if code != 255 {
		t.Fatalf("after kvfsd was killed, ctr run exited %d, want 255; stderr %s", code, a.stderr.String())
	}
	t.Logf("ctr returned %v after kvfsd was killed", took.Round(time.Millisecond))
	// The bound; detection is by the server's exit, not a poll, so this is not a
	// speed goal but a check that nothing waits for a timeout.
	if took > 2*time.Second {
		t.Errorf("ctr returned %v after kvfsd was killed; want within 2 s", took)
	}
	e.C.CheckNoLeaks(t, before)
}

// TestControlStop: kvfsctl stop of a running task's pod ends it through the pod's shim, as a
// VM's death does: the task stops, its sandbox stays until containerd deletes the task (the
// shim removes it then, not kvfsctl behind the shim's back), and nothing is left after.
func TestControlStop(t *testing.T) {
	e := newEnv(t, "")
	before := e.C.Snapshot(t)
	wantResult(t, "run -d halted", run(t, e, []string{"-d"}, "halted", "sleep", "600"), 0, "")
	kvfsctl(t, "--base-dir", e.BaseDir, "stop", "halted")
	waitStatus(t, e, map[string]string{"halted": "STOPPED"})
	if !exists(filepath.Join(e.BaseDir, "halted")) {
		t.Error("kvfsctl stop removed the sandbox of a task its shim still has")
	}
	e.C.Ctr(t, "task", "rm", "halted")
	if exists(filepath.Join(e.BaseDir, "halted")) {
		t.Error("the task's Delete left its sandbox")
	}
	e.C.Ctr(t, "container", "rm", "halted")
	e.C.CheckNoLeaks(t, before)
}

// serverPID reads the pid of the sandbox's external server from its state.json.
func serverPID(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Server struct {
			Daemon  string `json:"daemon"`
			Process struct {
				PID int `json:"pid"`
			} `json:"process"`
		} `json:"server"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if st.Server.Process.PID <= 0 {
		t.Fatalf("%s names no server process: %s", path, b)
	}
	return st.Server.Process.PID
}
