package sandbox

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	control "github.com/kvfs/kvfs/api/control/v1"
	"github.com/kvfs/kvfs/internal/rpcedge"
	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/virtiofs/confine"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// confinedChild returns the serving process of a confined server whose supervisor is pid: its
// only child.
func confinedChild(t *testing.T, pid int) int {
	t.Helper()
	p := strconv.Itoa(pid)
	b, err := os.ReadFile("/proc/" + p + "/task/" + p + "/children")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) != 1 {
		t.Fatalf("the supervisor %d has children %q, want one", pid, f)
	}
	child, err := strconv.Atoi(f[0])
	if err != nil {
		t.Fatal(err)
	}
	return child
}

// statusField returns a field of /proc/PID/status.
func statusField(t *testing.T, pid int, name string) string {
	t.Helper()
	s, err := procstatus.ReadPID(pid)
	if err != nil {
		t.Fatal(err)
	}
	v, ok := s[name]
	if !ok {
		t.Fatalf("/proc/%d/status has no %s", pid, name)
	}
	return v
}

// waitLog waits until the sandbox's server.log has want.
func waitLog(t *testing.T, s *Sandbox, want string) {
	t.Helper()
	path := filepath.Join(s.Dir(), serverLogName)
	deadline := time.Now().Add(10 * time.Second)
	for !logHas(path, 0, want) {
		if time.Now().After(deadline) {
			t.Fatalf("server.log lacks %q:\n%s", want, readFrom(path, 0, 1<<20))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConfinedServer checks the default server from outside: a process of its own whose
// serving process runs under seccomp with no_new_privs, with only the server's capabilities, in
// namespaces of its own with the shared directory as its root; that it serves the in-repo
// front-end (the data path), answers the control API's status, log level and DAX policy over
// its channel, gets its DAX policy again when restarted; and that its death by SIGKILL is
// reported by the sandbox's monitor.
func TestConfinedServer(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	ctx := context.Background()
	src := t.TempDir()
	s, err := Create(ctx, "conf", Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	if err := s.Bind(src, "vol", 0); err != nil {
		t.Fatal(err)
	}
	st := s.Stats()
	if st.Server.Daemon != Confined || st.Server.PID == os.Getpid() || !st.Server.Running {
		t.Fatalf("server %+v, want a confined one in another process", st.Server)
	}
	srv := confinedChild(t, st.Server.PID)

	// Seccomp, no_new_privs, capabilities.
	if v := statusField(t, srv, "Seccomp"); v != "2" {
		t.Errorf("Seccomp: %s, want 2 (filter)", v)
	}
	if v := statusField(t, srv, "NoNewPrivs"); v != "1" {
		t.Errorf("NoNewPrivs: %s, want 1", v)
	}
	own, err := strconv.ParseUint(statusField(t, os.Getpid(), "CapBnd"), 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	var want uint64
	for _, c := range confine.ServerCapabilities {
		want |= 1 << c
	}
	want &= own
	for _, set := range []string{"CapPrm", "CapEff", "CapBnd"} {
		got, err := strconv.ParseUint(statusField(t, srv, set), 16, 64)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %016x, want %016x", set, got, want)
		}
		for _, c := range []int{unix.CAP_SYS_ADMIN, unix.CAP_DAC_READ_SEARCH, unix.CAP_SYS_PTRACE, unix.CAP_NET_ADMIN,
			unix.CAP_SYS_MODULE, unix.CAP_SETPCAP, unix.CAP_SYS_CHROOT, unix.CAP_KILL} {
			if got&(1<<c) != 0 {
				t.Errorf("%s has capability %d", set, c)
			}
		}
	}
	for _, set := range []string{"CapInh", "CapAmb"} {
		if v := statusField(t, srv, set); v != "0000000000000000" {
			t.Errorf("%s = %s, want none", set, v)
		}
	}
	// Every thread, not only the first.
	tasks, _ := filepath.Glob("/proc/" + strconv.Itoa(srv) + "/task/*/status")
	for _, task := range tasks {
		b, err := os.ReadFile(task)
		if err != nil {
			continue // a thread that just ended
		}
		if !strings.Contains(string(b), "Seccomp:\t2") || !strings.Contains(string(b), "CapEff:\t"+statusField(t, srv, "CapEff")) {
			t.Errorf("%s: not confined like the first thread", task)
		}
	}
	if len(tasks) < 2 {
		t.Errorf("the server has %d threads", len(tasks))
	}

	// Its root is the shared directory, and nothing of the host is mounted in its tree.
	var root, shared unix.Stat_t
	if err := unix.Stat("/proc/"+strconv.Itoa(srv)+"/root/", &root); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(inNS(s, s.SharedDir()), &shared); err != nil {
		t.Fatal(err)
	}
	if root.Dev != shared.Dev || root.Ino != shared.Ino {
		t.Errorf("the server's root is dev %d ino %d, not the shared directory's (dev %d ino %d)", root.Dev, root.Ino, shared.Dev, shared.Ino)
	}
	mi, err := os.ReadFile("/proc/" + strconv.Itoa(srv) + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(strings.TrimSpace(string(mi)), "\n") {
		if f := strings.Fields(l); len(f) > 4 && f[4] != "/" && !strings.HasPrefix(f[4], "/vol") {
			t.Errorf("the server's mount tree has %s: %s", f[4], l)
		}
	}
	// New mount, PID, network and IPC namespaces.
	for _, ns := range []string{"mnt", "pid", "net", "ipc"} {
		mine, err1 := os.Readlink("/proc/self/ns/" + ns)
		its, err2 := os.Readlink("/proc/" + strconv.Itoa(srv) + "/ns/" + ns)
		if err := errors.Join(err1, err2); err != nil {
			t.Fatal(err)
		}
		if mine == its {
			t.Errorf("the server shares the %s namespace %s", ns, its)
		}
	}

	// The data path: a file written through the front-end lands on the host.
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	fe, err := frontend.Dial(dctx, s.SocketPath(), frontend.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer fe.Close()
	c := fuseclient.New(fe)
	if _, err := c.Init(dctx, fuseclient.LinuxInitFlags); err != nil {
		t.Fatalf("INIT: %v", err)
	}
	vol, err := c.Lookup(dctx, fuse.RootID, "vol")
	if err != nil {
		t.Fatalf("LOOKUP vol: %v", err)
	}
	cr, err := c.Create(dctx, vol.NodeID, "f", uint32(os.O_RDWR), 0o644)
	if err != nil {
		t.Fatalf("CREATE: %v", err)
	}
	if _, err := c.Write(dctx, cr.Entry.NodeID, cr.Open.Fh, 0, []byte("hello"), 0); err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	if err := c.Fsync(dctx, cr.Entry.NodeID, cr.Open.Fh, false); err != nil {
		t.Fatalf("FSYNC: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(src, "f")); err != nil || string(b) != "hello" {
		t.Errorf("on the host: %q, %v", b, err)
	}

	// The control API, as kvfsctl status, metrics, log-level and dax-policy use it.
	svc := NewControlService(s, nil)
	status, err := svc.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: "conf"})
	if err != nil {
		t.Fatal(err)
	}
	ss := status.GetServer()
	if ss.GetDaemon() != Confined || ss.GetPid() != int64(st.Server.PID) || ss.GetStats() == nil || ss.GetStats().GetBytesWritten() != 5 {
		t.Errorf("status %+v", ss)
	}
	ops := map[string]uint64{}
	for _, o := range ss.GetStats().GetOps() {
		ops[o.GetOpcode()] = o.GetCount()
	}
	if ops["LOOKUP"] == 0 || ops["CREATE"] != 1 || ops["WRITE"] != 1 {
		t.Errorf("opcode counts %v", ops)
	}
	prev := levelName(log.GetLevel())
	t.Cleanup(func() { _ = log.SetLevel(prev) })
	if _, err := svc.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: "debug"}); err != nil {
		t.Fatal(err)
	}
	waitLog(t, s, "log level set to debug")
	if _, err := svc.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: prev}); err != nil {
		t.Fatal(err)
	}
	if _, err := svc.UpdateDAXPolicy(ctx, &control.UpdateDAXPolicyRequest{Id: "conf", Policy: control.DAXPolicy_DAX_POLICY_INODE,
		Rules: []*control.DAXRule{{Glob: "["}}}); grpcstatus.Code(rpcedge.Status(err)) != codes.InvalidArgument {
		t.Errorf("a bad glob: %v, want InvalidArgument", err)
	}
	if _, err := svc.UpdateDAXPolicy(ctx, &control.UpdateDAXPolicyRequest{Id: "conf", Policy: control.DAXPolicy_DAX_POLICY_INODE,
		Rules: []*control.DAXRule{{Glob: "*.so", Dax: true}}}); err != nil {
		t.Fatal(err)
	}
	waitLog(t, s, `msg="DAX policy updated" mode=inode rules=1`)

	// A restarted server starts with the policy set. (The front-end stays connected until
	// then: a server that it leaves while no VM runs is a failure.)
	s.opMu.Lock()
	s.mu.Lock()
	old := s.srv
	s.mu.Unlock()
	err = s.restartServerLocked(old, &ServerError{Server: old.describe(), Err: errors.New("test restart")})
	s.opMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	waitLog(t, s, "dax=inode dax_rules=1")

	// SIGKILL of the serving process: the monitor reports it (the stop policy; no VM).
	st = s.Stats()
	srv = confinedChild(t, st.Server.PID)
	killed := time.Now()
	if err := syscall.Kill(srv, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the sandbox did not notice its server's death")
	}
	t.Logf("the server's death reported %v after SIGKILL", time.Since(killed).Round(time.Millisecond))
	var se *ServerError
	if !errors.As(s.Err(), &se) || !strings.Contains(se.Server, "confined kvfsd") || !strings.Contains(se.Error(), "exit status 137") {
		t.Errorf("Err() = %v", s.Err())
	}
	s.mu.Lock()
	dead := s.srv
	s.mu.Unlock()
	if !dead.killed() {
		t.Error("a confined server whose serving process was SIGKILLed is not taken as killed")
	}
	waitLog(t, s, "signal: killed")
}

// TestInProcessUnconfined: the opt-in still serves, from this process, and warns at every start.
func TestInProcessUnconfined(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	hook := logtest.NewLocal(log.L.Logger)
	t.Cleanup(func() { log.L.Logger.ReplaceHooks(make(logrus.LevelHooks)) })
	c := testConfig(base)
	c.Server.Daemon = InProcessUnconfined
	s, err := Create(context.Background(), "unconf", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	st := s.Stats()
	if st.Server.Daemon != InProcessUnconfined || st.Server.PID != os.Getpid() || st.Server.FS == nil || !st.Server.Running {
		t.Errorf("server %+v", st.Server)
	}
	warnings := func() int {
		n := 0
		for _, e := range hook.AllEntries() {
			if e.Level == logrus.WarnLevel && strings.Contains(e.Message, `runs unconfined inside this process (server.daemon = "in-process-unconfined")`) {
				n++
			}
		}
		return n
	}
	if n := warnings(); n != 1 {
		t.Errorf("%d warnings at the first start, want 1", n)
	}
	s.opMu.Lock()
	s.mu.Lock()
	old := s.srv
	s.mu.Unlock()
	err = s.restartServerLocked(old, &ServerError{Server: old.describe(), Err: errors.New("test restart")})
	s.opMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if n := warnings(); n != 2 {
		t.Errorf("%d warnings after a restart, want 2", n)
	}
	if b, _ := os.ReadFile(filepath.Join(s.Dir(), serverLogName)); len(bytes.TrimSpace(b)) != 0 {
		t.Errorf("an in-process server wrote a server.log: %s", b)
	}
}

// logHas says whether the file path, from offset on, has s.
func logHas(path string, offset int64, s string) bool {
	return bytes.Contains(readFrom(path, offset, 1<<20), []byte(s))
}

func readFrom(path string, offset, limit int64) []byte {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.NewSectionReader(f, offset, limit))
	return b
}
