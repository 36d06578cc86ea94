package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox"
)

// bootTimeout bounds a boot of the agent's guest under TCG (20-40 s here, more when other
// guests run at the same time).
const bootTimeout = 4 * time.Minute

// TestAgentInGuest boots the agent's image in a sandbox (in-process kvfsd, the agent on a
// virtio-serial port) and drives it over ttrpc as the shim does: containers run by runc in the
// guest, their root filesystems busybox directories bound into the share. c1 writes to both
// streams, exits 3 and leaves a file in its root; c3 is OOM-killed under a memory limit; c2
// runs long enough for execs (stdin, a terminal), Stats, an update, pause and resume,
// a reconnection of the host, and SIGKILL. Shutdown then powers the VM off.
func TestAgentInGuest(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (mounts, QEMU)")
	}
	if testing.Short() {
		t.Skip("boots a guest under QEMU (skipped with -short)")
	}
	g := vmtest.AgentImage(t)
	accel := testAccel(t)
	ctx := context.Background()

	base, err := os.MkdirTemp("", "kvfs-ag-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir = base
	s, err := sandbox.Create(ctx, "agent", sandbox.Options{Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(context.Background()); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	roots := map[string]string{}
	for _, id := range []string{"c1", "c2"} {
		roots[id] = busyboxRoot(t)
		if err := s.Bind(roots[id], id, 0); err != nil {
			t.Fatal(err)
		}
	}

	// The sandbox's own VM: its agent channel (the virtio-serial port on agent.sock) and
	// kernel command line are the shim's.
	agentSock := s.AgentSocketPath()
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Root = accel, g.Kernel, g.Initrd, g.Root
	if vm.Agent.Transport != sandbox.AgentSerial || vm.Agent.Socket != agentSock {
		t.Fatalf("the sandbox's VM has agent channel %+v, want serial on %s", vm.Agent, agentSock)
	}
	diag := func() string {
		b, _ := os.ReadFile(s.ConsolePath())
		q, _ := os.ReadFile(filepath.Join(s.Dir(), "qemu.log"))
		return "--- console ---\n" + string(b) + "\n--- qemu.log ---\n" + string(q)
	}
	start := time.Now()
	if err := s.Start(ctx, vm); err != nil {
		t.Fatal(err)
	}

	ag, closeAgent := dialAgent(t, s, diag)
	bootCtx, cancel := context.WithTimeout(ctx, bootTimeout)
	pong, err := ag.Ping(bootCtx, &apiv1.PingRequest{})
	cancel()
	if err != nil {
		t.Fatalf("ping: %v\n%s", err, diag())
	}
	t.Logf("accel %s: QEMU start to Ping answered: %v (agent %s, kernel %s)", accel,
		time.Since(start).Round(time.Millisecond), pong.Version, pong.Kernel)

	call := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v\n%s", what, err, diag())
		}
	}
	rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()

	// c1: output on both streams, an exit status, a file written into the share.
	_, err = ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{
		ContainerId: "c1",
		Spec:        specJSON(t, "c1", "sh", "-c", "echo hello; echo err >&2; echo from-guest > /written.txt; exit 3"),
		Stdio:       &apiv1.Stdio{Stdout: true, Stderr: true},
	})
	call("create c1", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c1"})
	call("start c1", err)
	if out := readAll(t, rctx, ag.ReadStdout, "c1", ""); out != "hello\n" {
		t.Errorf("c1 stdout %q", out)
	}
	if out := readAll(t, rctx, ag.ReadStderr, "c1", ""); out != "err\n" {
		t.Errorf("c1 stderr %q", out)
	}
	w, err := ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c1"})
	call("wait c1", err)
	if w.ExitStatus != 3 {
		t.Errorf("c1 exit status %d, want 3", w.ExitStatus)
	}
	if b, err := os.ReadFile(filepath.Join(roots["c1"], "written.txt")); err != nil || string(b) != "from-guest\n" {
		t.Errorf("the file the container wrote, on the host: %q, %v", b, err)
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "c1"})
	call("delete c1", err)

	// c3: a memory limit it exceeds; the OOM kill is reported.
	oomSpec := specJSON(t, "c3", "dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1")
	var sp specs.Spec
	call("spec", json.Unmarshal(oomSpec, &sp))
	limit, swap := int64(32<<20), int64(32<<20)
	sp.Linux.Resources = &specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit, Swap: &swap}}
	oomSpec, err = json.Marshal(&sp)
	call("spec", err)
	if err := s.Bind(roots["c1"], "c3", 0); err != nil {
		t.Fatal(err)
	}
	_, err = ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{ContainerId: "c3", Spec: oomSpec})
	call("create c3", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c3"})
	call("start c3", err)
	oom, err := ag.GetOOMEvent(rctx, &apiv1.GetOOMEventRequest{})
	call("OOM event", err)
	if oom.ContainerId != "c3" {
		t.Errorf("OOM event for %q, want c3", oom.ContainerId)
	}
	w, err = ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c3"})
	call("wait c3", err)
	if w.ExitStatus != 128+uint32(syscall.SIGKILL) {
		t.Errorf("c3 exit status %d, want 137 (OOM-killed)", w.ExitStatus)
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "c3"})
	call("delete c3", err)

	// c2: a long-running init, execs into it, its cgroup.
	_, err = ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{
		ContainerId: "c2", Spec: specJSON(t, "c2", "sleep", "1000"),
	})
	call("create c2", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c2"})
	call("start c2", err)

	_, err = ag.ExecProcess(rctx, &apiv1.ExecProcessRequest{
		ContainerId: "c2", ExecId: "e1", Process: processJSON(t, "sh", "-c", "echo exec-out; ip link show lo | grep -q UP || echo lo is down; cat"),
		Stdio: &apiv1.Stdio{Stdin: true, Stdout: true},
	})
	call("exec e1", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c2", ExecId: "e1"})
	call("start e1", err)
	_, err = ag.WriteStdin(rctx, &apiv1.WriteStdinRequest{ContainerId: "c2", ExecId: "e1", Data: []byte("from-stdin\n")})
	call("write stdin", err)
	_, err = ag.CloseStdin(rctx, &apiv1.CloseStdinRequest{ContainerId: "c2", ExecId: "e1"})
	call("close stdin", err)
	if out := readAll(t, rctx, ag.ReadStdout, "c2", "e1"); out != "exec-out\nfrom-stdin\n" {
		t.Errorf("e1 stdout %q", out)
	}
	w, err = ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c2", ExecId: "e1"})
	call("wait e1", err)
	if w.ExitStatus != 0 {
		t.Errorf("e1 exit status %d", w.ExitStatus)
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "c2", ExecId: "e1"})
	call("delete e1", err)

	sr, err := ag.Stats(rctx, &apiv1.StatsRequest{ContainerId: "c2"})
	call("stats", err)
	v, err := typeurl.UnmarshalAny(sr.Stats)
	call("decode stats", err)
	m, ok := v.(*stats.Metrics)
	if !ok {
		t.Fatalf("stats are a %T (%s)", v, sr.Stats.GetTypeUrl())
	}
	if m.GetPids().GetCurrent() == 0 || m.GetMemory().GetUsage() == 0 {
		t.Errorf("stats: pids %v memory %v", m.GetPids(), m.GetMemory())
	}

	_, err = ag.UpdateContainer(rctx, &apiv1.UpdateContainerRequest{ContainerId: "c2", Resources: []byte(`{"pids":{"limit":42}}`)})
	call("update", err)
	sr, err = ag.Stats(rctx, &apiv1.StatsRequest{ContainerId: "c2"})
	call("stats after update", err)
	v, err = typeurl.UnmarshalAny(sr.Stats)
	call("decode stats", err)
	if m, _ := v.(*stats.Metrics); m.GetPids().GetLimit() != 42 {
		t.Errorf("pids after an update to a limit of 42: %v", m.GetPids())
	}

	_, err = ag.PauseContainer(rctx, &apiv1.PauseContainerRequest{ContainerId: "c2"})
	call("pause", err)
	_, err = ag.ExecProcess(rctx, &apiv1.ExecProcessRequest{
		ContainerId: "c2", ExecId: "paused", Process: processJSON(t, "true")})
	call("exec while paused", err)
	if _, err := ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c2", ExecId: "paused"}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("start while paused: %v, want FailedPrecondition", err)
	}
	_, err = ag.ResumeContainer(rctx, &apiv1.ResumeContainerRequest{ContainerId: "c2"})
	call("resume", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c2", ExecId: "paused"})
	call("start after resume", err)
	w, err = ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c2", ExecId: "paused"})
	call("wait after resume", err)
	if w.ExitStatus != 0 {
		t.Errorf("exec after resume: exit status %d", w.ExitStatus)
	}

	// A terminal: the window size set by ResizePty is what stty reads.
	_, err = ag.ExecProcess(rctx, &apiv1.ExecProcessRequest{
		ContainerId: "c2", ExecId: "tty", Process: processJSON(t, "sh", "-c", "read x; stty size"),
		Stdio: &apiv1.Stdio{Terminal: true, Stdin: true, Stdout: true},
	})
	call("exec tty", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c2", ExecId: "tty"})
	call("start tty", err)
	_, err = ag.ResizePty(rctx, &apiv1.ResizePtyRequest{ContainerId: "c2", ExecId: "tty", Width: 123, Height: 45})
	call("resize", err)
	_, err = ag.WriteStdin(rctx, &apiv1.WriteStdinRequest{ContainerId: "c2", ExecId: "tty", Data: []byte("go\n")})
	call("write tty", err)
	if out := readAll(t, rctx, ag.ReadStdout, "c2", "tty"); !strings.Contains(out, "45 123") {
		t.Errorf("terminal output %q does not have the size 45 123", out)
	}
	w, err = ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c2", ExecId: "tty"})
	call("wait tty", err)
	if w.ExitStatus != 0 {
		t.Errorf("tty exit status %d", w.ExitStatus)
	}

	// The shim may restart: a new connection on the same port is served, after a pause (the
	// agent's poll sees POLLHUP) and also at once (usually before it can: the stream ids
	// tell; TestSerialListenerNewHostAtOnce checks that path without a guest).
	closeAgent()
	time.Sleep(500 * time.Millisecond)
	ag, closeAgent = dialAgent(t, s, diag)
	_, err = ag.Ping(rctx, &apiv1.PingRequest{})
	call("ping after reconnecting", err)
	closeAgent()
	ag, closeAgent = dialAgent(t, s, diag)
	defer closeAgent()
	_, err = ag.Ping(rctx, &apiv1.PingRequest{})
	call("ping after reconnecting at once", err)

	_, err = ag.SignalProcess(rctx, &apiv1.SignalProcessRequest{ContainerId: "c2", Signal: uint32(syscall.SIGKILL)})
	call("kill c2", err)
	w, err = ag.WaitProcess(rctx, &apiv1.WaitProcessRequest{ContainerId: "c2"})
	call("wait c2", err)
	if w.ExitStatus != 128+uint32(syscall.SIGKILL) {
		t.Errorf("c2 exit status %d, want 137", w.ExitStatus)
	}
	_, err = ag.DeleteProcess(rctx, &apiv1.DeleteProcessRequest{ContainerId: "c2"})
	call("delete c2", err)

	// A host without the boot's secret is served nothing: its hello is refused, and its
	// Shutdown never reaches the service (the VM would power off). The shim's next connection
	// is served.
	closeAgent()
	wrong := make([]byte, apiv1.SecretLen)
	copy(wrong, s.AgentSecret())
	wrong[0] ^= 1
	intruder, closeIntruder := dialAgentWith(t, agentSock, wrong, s.VMExited(), diag)
	ictx, icancel := context.WithTimeout(rctx, 10*time.Second)
	_, err = intruder.Shutdown(ictx, &apiv1.ShutdownRequest{})
	icancel()
	closeIntruder()
	if err == nil {
		t.Fatalf("a host with a wrong secret was served Shutdown\n%s", diag())
	}
	t.Logf("a host with a wrong secret: %v", err)
	ag, closeAgent = dialAgent(t, s, diag)
	_, err = ag.Ping(rctx, &apiv1.PingRequest{})
	call("ping after a host with a wrong secret", err)

	// c4 still runs at Shutdown: the agent, as PID 1, kills every process at once without
	// running the runtime for it (the console shows no deletion), and what c4 wrote is on the
	// host.
	if err := s.Bind(roots["c1"], "c4", 0); err != nil {
		t.Fatal(err)
	}
	_, err = ag.CreateContainer(rctx, &apiv1.CreateContainerRequest{
		ContainerId: "c4", Spec: specJSON(t, "c4", "sh", "-c", "echo c4-ran > /c4.txt; exec sleep 1000"),
	})
	call("create c4", err)
	_, err = ag.StartProcess(rctx, &apiv1.StartProcessRequest{ContainerId: "c4"})
	call("start c4", err)
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		if b, _ := os.ReadFile(filepath.Join(roots["c1"], "c4.txt")); string(b) == "c4-ran\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("c4 wrote nothing in a minute\n%s", diag())
		}
	}

	_, err = ag.Shutdown(rctx, &apiv1.ShutdownRequest{})
	call("shutdown", err)
	closeAgent() // as the shim does: the agent powers off once the host has its answer
	select {
	case <-s.VMExited():
	case <-time.After(time.Minute):
		t.Fatalf("QEMU still runs a minute after Shutdown\n%s", diag())
	}
	console, _ := os.ReadFile(s.ConsolePath())
	// After the pause the agent saw the host leave (its read answers end of file, or the
	// poll POLLHUP), and waited for the next host without spinning. The host that came at
	// once was told apart by its stream ids, unless the agent's poll saw that host leave
	// too before the next one came (a matter of microseconds): either way each of the two
	// new hosts was noticed once.
	// The last host hung up after Shutdown's answer, before the agent shut down.
	if !bytes.Contains(console, []byte("refused a host connection error=a hello with the wrong secret")) {
		t.Errorf("the console does not show the refusal of the host with a wrong secret\n%s", console)
	}
	reconnections, shutdown, ok := bytes.Cut(console, []byte("kvfs-agent: info container deleted container=c2"))
	if !ok {
		t.Fatalf("the console does not show c2's deletion\n%s", console)
	}
	left := bytes.Count(reconnections, []byte("kvfs-agent: info host left"))
	began := bytes.Count(reconnections, []byte("kvfs-agent: info a new host session began"))
	if left < 1 || left+began != 2 {
		t.Errorf("the console shows %d departures of the host and %d new sessions told by their stream ids, want 1 and 1, or 2 and 0\n%s", left, began, console)
	}
	if bytes.Contains(shutdown, []byte("container deleted container=c4")) {
		t.Errorf("the agent ran the runtime for c4 at Shutdown\n%s", console)
	}
	hungUp, _, ok := bytes.Cut(shutdown, []byte("kvfs-agent: info shut down"))
	if !ok {
		t.Errorf("the console does not show the agent's shutdown\n%s", console)
	} else if !bytes.Contains(hungUp, []byte("kvfs-agent: info host left")) {
		t.Errorf("the agent shut down before the host hung up\n%s", console)
	}
	t.Logf("done after %v; the console:\n%s", time.Since(start).Round(time.Millisecond), console)
}

func testAccel(t *testing.T) string {
	if a := os.Getenv("KVFS_ACCEL"); a != "" {
		return a
	}
	if sandbox.DetectAccel() == sandbox.AccelTCG {
		return sandbox.AccelTCG
	}
	accel, why := vmtest.Accel(context.Background(), vmtest.Image(t))
	t.Logf("accel %s: %s", accel, why)
	return accel
}

// newSandbox creates sandbox name with the default configuration, changed by tune if not nil,
// in a directory of its own; both go when the test ends.
func newSandbox(t *testing.T, name string, tune func(*sandbox.Config)) *sandbox.Sandbox {
	t.Helper()
	base, err := os.MkdirTemp("", "kvfs-ag-")
	if err != nil {
		t.Fatal(err)
	}
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir = base
	if tune != nil {
		tune(cfg)
	}
	s, err := sandbox.Create(context.Background(), name, sandbox.Options{Config: cfg})
	if err != nil {
		os.RemoveAll(base)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Stop(context.Background()); err != nil {
			t.Errorf("stop: %v", err)
		}
		os.RemoveAll(base)
	})
	return s
}

// bootAgent starts vm in s and returns its agent once it answers a Ping (the connection
// closes when the test ends), and diag, what the guest's console and QEMU have said.
func bootAgent(t *testing.T, s *sandbox.Sandbox, vm sandbox.VM) (apiv1.AgentService, func() string) {
	t.Helper()
	diag := func() string {
		b, _ := os.ReadFile(s.ConsolePath())
		q, _ := os.ReadFile(filepath.Join(s.Dir(), "qemu.log"))
		return "--- console ---\n" + string(b) + "\n--- qemu.log ---\n" + string(q)
	}
	start := time.Now()
	if err := s.Start(context.Background(), vm); err != nil {
		t.Fatal(err)
	}
	ag, closeAgent := dialAgent(t, s, diag)
	t.Cleanup(closeAgent)
	ctx, cancel := context.WithTimeout(context.Background(), bootTimeout)
	defer cancel()
	if _, err := ag.Ping(ctx, &apiv1.PingRequest{}); err != nil {
		t.Fatalf("ping: %v\n%s", err, diag())
	}
	t.Logf("accel %s: the agent answers after %v", vm.Accel, time.Since(start).Round(time.Millisecond))
	return ag, diag
}

// dialAgent connects to the agent of s's started VM on its chardev socket, which QEMU
// creates as it starts, and sends the boot's secret as the shim does.
func dialAgent(t *testing.T, s *sandbox.Sandbox, diag func() string) (apiv1.AgentService, func()) {
	t.Helper()
	secret := s.AgentSecret()
	if len(secret) != apiv1.SecretLen {
		t.Fatalf("the sandbox's agent secret has %d bytes, want %d", len(secret), apiv1.SecretLen)
	}
	return dialAgentWith(t, s.AgentSocketPath(), secret, s.VMExited(), diag)
}

// dialAgentWith connects to the agent's chardev socket sock and sends secret in the hello.
func dialAgentWith(t *testing.T, sock string, secret []byte, exited <-chan struct{}, diag func() string) (apiv1.AgentService, func()) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		conn, err := net.Dial("unix", sock)
		if err == nil {
			if _, err := conn.Write(apiv1.Hello(secret)); err != nil {
				t.Fatalf("the hello: %v\n%s", err, diag())
			}
			c := ttrpc.NewClient(conn)
			return apiv1.NewAgentClient(c), func() { c.Close() }
		}
		select {
		case <-exited:
			t.Fatalf("QEMU exited\n%s", diag())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("dial %s: %v\n%s", sock, err, diag())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

type readFunc func(context.Context, *apiv1.ReadStreamRequest) (*apiv1.ReadStreamResponse, error)

// readAll reads a stream to its end.
func readAll(t *testing.T, ctx context.Context, read readFunc, cid, eid string) string {
	t.Helper()
	var b bytes.Buffer
	for {
		r, err := read(ctx, &apiv1.ReadStreamRequest{ContainerId: cid, ExecId: eid, Max: 4096})
		if err != nil {
			t.Fatalf("read %s/%s: %v (so far %q)", cid, eid, err, b.String())
		}
		b.Write(r.Data)
		if r.Eof {
			return b.String()
		}
	}
}

// busyboxRoot makes a container root file system: static busybox, its applets, a minimal
// /etc and the mount points.
func busyboxRoot(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{"bin", "etc", "proc", "sys", "dev", "tmp", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	bb := "/bin/busybox"
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatalf("busybox-static: %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range strings.Fields(string(out)) {
		if err := os.Symlink("busybox", filepath.Join(dir, "bin", a)); err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
		"etc/group":  "root:x:0:\n",
		"etc/hosts":  "127.0.0.1 localhost\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func process(args ...string) *specs.Process {
	return &specs.Process{
		Args: args,
		Env:  []string{"PATH=/bin", "HOME=/root", "TERM=xterm"},
		Cwd:  "/",
		Capabilities: &specs.LinuxCapabilities{
			Bounding:  []string{"CAP_KILL", "CAP_CHOWN"},
			Effective: []string{"CAP_KILL", "CAP_CHOWN"},
			Permitted: []string{"CAP_KILL", "CAP_CHOWN"},
		},
		NoNewPrivileges: true,
	}
}

func processJSON(t *testing.T, args ...string) []byte {
	b, err := json.Marshal(process(args...))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// specJSON is the spec a shim sends: the root in the share, the usual namespaces and mounts,
// a cgroup of its own.
func specJSON(t *testing.T, id string, args ...string) []byte {
	spec := &specs.Spec{
		Version:  specs.Version,
		Process:  process(args...),
		Root:     &specs.Root{Path: apiv1.SharedDir + "/" + id},
		Hostname: id,
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", "ro"}},
		},
		Linux: &specs.Linux{
			CgroupsPath: "/kvfs/" + id,
			Namespaces: []specs.LinuxNamespace{
				{Type: specs.PIDNamespace}, {Type: specs.MountNamespace},
				{Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			},
		},
	}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
