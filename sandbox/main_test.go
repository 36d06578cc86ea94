package sandbox

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox/serverproc"
)

// helperEnv makes the test binary act as a sandbox owner that exits without stopping its
// sandboxes (see runHelper): a restart of the owning process, for the recovery tests.
const helperEnv = "KVFS_SANDBOX_TEST_HELPER"

func TestMain(m *testing.M) {
	serverproc.Init() // the sandboxes' confined servers are this test binary run again
	// make test builds this binary with -race, and the race runtime sleeps a second at every
	// exit (atexit_sleep_ms) for late reports: a confined server's supervisor and its serving
	// process would each sleep, and every Stop would wait out serverStopGrace and SIGKILL them.
	// The servers and helpers started from here skip that sleep.
	os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	if spec := os.Getenv(helperEnv); spec != "" {
		os.Exit(runHelper(spec))
	}
	if os.Getenv(fakeQEMUEnv) != "" {
		os.Exit(runFakeQEMU(os.Args[1:]))
	}
	code := m.Run()
	if kvfsdDir != "" {
		os.RemoveAll(kvfsdDir)
	}
	os.Exit(code)
}

// requireRoot skips tests that mount, own files of other users or run QEMU.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the sandbox bind-mounts its directories (run the tests as root)")
	}
}

// requireGuest skips tests that boot a guest when they cannot or should not run.
func requireGuest(t testing.TB) {
	t.Helper()
	requireRoot(t)
	if testing.Short() {
		t.Skip("boots a guest under QEMU (skipped with -short)")
	}
}

var (
	kvfsdOnce sync.Once
	kvfsdDir  string
	kvfsdPath string
	kvfsdErr  error
)

// kvfsdBinary builds ./cmd/kvfsd once per test binary: the external daemon of the tests.
func kvfsdBinary(t testing.TB) string {
	t.Helper()
	kvfsdOnce.Do(func() {
		root, err := vmtest.RepoRoot()
		if err != nil {
			kvfsdErr = err
			return
		}
		if kvfsdDir, err = os.MkdirTemp("", "kvfs-sandbox-bin-"); err != nil {
			kvfsdErr = err
			return
		}
		kvfsdPath = filepath.Join(kvfsdDir, "kvfsd")
		cmd := exec.Command("go", "build", "-o", kvfsdPath, "./cmd/kvfsd")
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			kvfsdErr = fmt.Errorf("go build ./cmd/kvfsd: %v\n%s", err, out)
		}
	})
	if kvfsdErr != nil {
		t.Fatal(kvfsdErr)
	}
	return kvfsdPath
}

// testBase returns a fresh base directory with a short path (socket paths must fit in 107
// bytes) and tears down whatever a failed test leaves in it.
func testBase(t testing.TB) string {
	t.Helper()
	base, err := os.MkdirTemp("", "kvfs-sb-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		entries, _ := os.ReadDir(base)
		for _, e := range entries {
			p := filepath.Join(base, e.Name())
			if e.IsDir() {
				if err := teardown(p, nil); err != nil {
					t.Errorf("cleanup: %v", err)
				}
			} else {
				os.Remove(p)
			}
		}
		if err := os.Remove(base); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return base
}

// testConfig is the default configuration with base as the base directory.
func testConfig(base string) *Config {
	c := DefaultConfig()
	c.BaseDir = base
	c.VM.Memory = "512M"
	c.VM.Rootfs = "" // not installed here: a test that boots a guest names its own
	return c
}

// externalConfig runs kvfsd as an external daemon.
func externalConfig(t testing.TB, base string) *Config {
	c := testConfig(base)
	c.Server.Daemon = kvfsdBinary(t)
	return c
}

// stopOnCleanup stops s when the test ends, if it has not been stopped.
func stopOnCleanup(t testing.TB, s *Sandbox) {
	t.Cleanup(func() {
		if err := s.Stop(context.Background()); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
}

// waitFile waits until path exists, or fails the test after timeout; stop, when closed,
// ends the wait early (the VM died).
func waitFile(t testing.TB, path string, timeout time.Duration, stop <-chan struct{}, diag func() string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear within %v\n%s", path, timeout, diag())
		}
		select {
		case <-stop:
			if _, err := os.Stat(path); err == nil {
				return
			}
			t.Fatalf("gave up waiting for %s: the VM exited\n%s", path, diag())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// counts are the resources a sandbox must give back.
type counts struct {
	mounts, fds, children, files int
}

// Mounts are counted under base only: other tests and processes on the machine mount and
// unmount elsewhere at the same time.
func takeCounts(t testing.TB, base string) counts {
	t.Helper()
	points, err := mountsUnder(base)
	if err != nil {
		t.Fatal(err)
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	files := 0
	_ = filepath.WalkDir(base, func(string, os.DirEntry, error) error { files++; return nil })
	return counts{mounts: len(points), fds: len(fds), children: len(childPids(t)), files: files}
}

// childPids returns the pids whose parent is this process, zombies included.
func childPids(t testing.TB) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	self := strconv.Itoa(os.Getpid())
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if f := strings.Fields(string(b[i+1:])); len(f) > 1 && f[1] == self {
			pids = append(pids, pid)
		}
	}
	return pids
}

// processGone says whether the process id names has exited (a zombie counts as exited).
func processGone(id procID) bool {
	st, err := readProcStat(id.PID)
	return err != nil || st.startTime != id.StartTime || st.state == 'Z' || st.state == 'X'
}

// testAccel picks the accelerator for test guests like vmtest does, without a probe boot of
// its own: $KVFS_ACCEL; TCG without a usable /dev/kvm; else vmtest's cached verdict for this
// boot of the host (a /dev/kvm that opens does not prove that KVM works); else TCG.
func testAccel(t testing.TB, g vmtest.Guest) string {
	if a := os.Getenv("KVFS_ACCEL"); a != "" {
		return a
	}
	if DetectAccel() == AccelTCG {
		return AccelTCG
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(g.Kernel), "accel"))
	if err == nil {
		f := strings.Fields(string(b))
		if len(f) >= 2 && f[0] == bootID() && (f[1] == AccelKVM || f[1] == AccelTCG) {
			return f[1]
		}
	}
	t.Logf("no KVM verdict cached by vmtest for this boot: using TCG")
	return AccelTCG
}

// helperSpec tells the helper process what to create before it exits.
type helperSpec struct {
	Config    *Config           `json:"config"`
	ID        string            `json:"id"`
	Binds     []helperBind      `json:"binds,omitempty"`
	VM        *helperVM         `json:"vm,omitempty"`
	WaitFile  string            `json:"wait_file,omitempty"` // after Start: wait for this file
	Annots    map[string]string `json:"annotations,omitempty"`
	WaitLimit time.Duration     `json:"wait_limit,omitempty"`
}

// helperVM is what the helper sets on top of DefaultVM.
type helperVM struct {
	Accel, Kernel, Initrd, Cmdline string
}

type helperBind struct {
	Src, Name string
	Flags     BindFlags
}

// helperResult is what the helper reports on stdout.
type helperResult struct {
	Stats Stats  `json:"stats"`
	Error string `json:"error,omitempty"`
}

// runHelper creates the sandbox spec describes, prints its Stats and exits without stopping
// it: the server (if external) and the VM stay behind, as after a crash of the owner.
func runHelper(specJSON string) int {
	var spec helperSpec
	res := helperResult{}
	defer func() {
		b, _ := json.Marshal(res)
		os.Stdout.Write(b)
	}()
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		res.Error = err.Error()
		return 1
	}
	ctx := context.Background()
	s, err := Create(ctx, spec.ID, Options{Config: spec.Config, Annotations: spec.Annots})
	if err != nil {
		res.Error = err.Error()
		return 1
	}
	for _, b := range spec.Binds {
		if err := s.Bind(b.Src, b.Name, b.Flags); err != nil {
			res.Error = err.Error()
			return 1
		}
	}
	if spec.VM != nil {
		vm := s.DefaultVM()
		vm.Accel, vm.Kernel, vm.Initrd, vm.Cmdline = spec.VM.Accel, spec.VM.Kernel, spec.VM.Initrd, spec.VM.Cmdline
		if err := s.Start(ctx, vm); err != nil {
			res.Error = err.Error()
			return 1
		}
	}
	if spec.WaitFile != "" {
		deadline := time.Now().Add(spec.WaitLimit)
		for {
			if _, err := os.Stat(spec.WaitFile); err == nil {
				break
			}
			if time.Now().After(deadline) || isClosed(s.VMExited()) {
				res.Error = "gave up waiting for " + spec.WaitFile
				res.Stats = s.Stats()
				return 1
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	res.Stats = s.Stats()
	return 0
}

// runHelperProcess runs the test binary as a helper owner and returns its report.
func runHelperProcess(t testing.TB, spec helperSpec) helperResult {
	t.Helper()
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(b))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res helperResult
	if jerr := json.Unmarshal(out, &res); jerr != nil {
		t.Fatalf("helper: %v (%v)\nstdout: %s\nstderr: %s", err, jerr, out, stderr.String())
	}
	if err != nil || res.Error != "" {
		t.Fatalf("helper: %v: %s\nstderr: %s", err, res.Error, stderr.String())
	}
	return res
}

// reapSandboxedServers waits for and reaps the children that kvfsd supervisors left to this
// subreaper when they were killed, as a shim's reaper would: kvfsd --sandbox=namespace (its
// default) serves from a child, PID 1 of its own PID namespace, which dies with its supervisor
// and is then reparented here. Only such children are reaped: a leftover supervisor or QEMU
// still shows in childPids. The confined servers of the test's own sandboxes are left alone
// (they are PID 1 of their namespaces too, and still run).
func reapSandboxedServers(t testing.TB) {
	t.Helper()
	for _, pid := range childPids(t) {
		s, err := procstatus.ReadPID(pid)
		if err != nil {
			continue
		}
		if cmd, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); strings.HasPrefix(string(cmd), serverproc.Argv0+"\x00") {
			continue
		}
		if f := strings.Fields(s["NSpid"]); len(f) == 2 && f[1] == "1" {
			if _, err := unix.Wait4(pid, nil, 0, nil); err != nil {
				t.Errorf("reap sandboxed server %d: %v", pid, err)
			}
		}
	}
}

// becomeSubreaper makes this process adopt the orphans of its children (the helper's server
// and QEMU), as a shim that is a child subreaper would, so that they are reaped here and not
// left as zombies under a PID 1 that may not reap. Undone when the test ends.
func becomeSubreaper(t testing.TB) {
	t.Helper()
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Fatalf("PR_SET_CHILD_SUBREAPER: %v", err)
	}
	t.Cleanup(func() { _ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) })
}
