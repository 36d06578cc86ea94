package hooks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// script writes an executable /bin/sh script to dir.
func script(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func read(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func seconds(n int) *int { return &n }

func testState(bundle string) *specs.State {
	return &specs.State{Version: specs.Version, ID: "c1", Status: specs.StateCreating, Pid: 42, Bundle: bundle,
		Annotations: map[string]string{"io.kubernetes.cri.sandbox-id": "p1"}}
}

// TestRunInOrder: each hook gets exactly its argv and environment (nothing of ours), the state
// on stdin and the bundle as its working directory, in the order given.
func TestRunInOrder(t *testing.T) {
	dir := t.TempDir()
	bundle := t.TempDir()
	// $$ is the shell the hook runs as: /proc/$$ shows the argv and environment it was
	// executed with, before the shell adds anything.
	record := func(n int) string {
		return fmt.Sprintf(`/bin/cat /proc/$$/cmdline >%[1]s/%[2]d.args
/bin/cat /proc/$$/environ >%[1]s/%[2]d.env
/bin/cat >%[1]s/%[2]d.state
/bin/pwd >%[1]s/%[2]d.cwd
echo %[2]d >>%[1]s/order`, dir, n)
	}
	s0 := script(t, dir, "hook0", record(0))
	s1 := script(t, dir, "hook1", record(1))
	hs := []specs.Hook{
		// Through /bin/sh itself, so that argv[0] reaches the process (a #! script's
		// interpreter gets the script's path instead).
		{Path: "/bin/sh", Args: []string{"argv0-of-hook0", s0, "a b", ""}, Env: []string{"A=1", "B=two words", "PATH=/nowhere"}},
		{Path: s1},
	}
	st := testState(bundle)
	t.Setenv("KVFS_HOOKS_TEST_LEAK", "1")
	if err := Run(context.Background(), Prestart, hs, st); err != nil {
		t.Fatal(err)
	}
	if got := read(t, filepath.Join(dir, "order")); got != "0\n1\n" {
		t.Errorf("order %q, want 0 then 1", got)
	}
	for i, want := range []struct{ args, env []string }{
		{[]string{"argv0-of-hook0", s0, "a b", ""}, []string{"A=1", "B=two words", "PATH=/nowhere"}},
		// No Args: argv is the path alone (a #! script's interpreter comes first); no Env: an
		// empty environment.
		{[]string{"/bin/sh", s1}, nil},
	} {
		args := strings.Split(strings.TrimSuffix(read(t, filepath.Join(dir, fmt.Sprint(i)+".args")), "\x00"), "\x00")
		if !reflect.DeepEqual(args, want.args) {
			t.Errorf("hook %d: argv %q, want %q", i, args, want.args)
		}
		var env []string
		if e := read(t, filepath.Join(dir, fmt.Sprint(i)+".env")); e != "" {
			env = strings.Split(strings.TrimSuffix(e, "\x00"), "\x00")
		}
		if !reflect.DeepEqual(env, want.env) {
			t.Errorf("hook %d: environment %q, want exactly %q", i, env, want.env)
		}
		var got specs.State
		if err := json.Unmarshal([]byte(read(t, filepath.Join(dir, fmt.Sprint(i)+".state"))), &got); err != nil {
			t.Fatalf("hook %d: the state on its stdin: %v", i, err)
		}
		if !reflect.DeepEqual(&got, st) {
			t.Errorf("hook %d: state %+v, want %+v", i, got, *st)
		}
		if cwd := strings.TrimSpace(read(t, filepath.Join(dir, fmt.Sprint(i)+".cwd"))); cwd != bundle {
			t.Errorf("hook %d: working directory %s, want the bundle %s", i, cwd, bundle)
		}
	}
}

// TestRunStopsAtFailure: a failing hook ends the phase; its error names the phase, the hook's
// index and path, its exit status and its output (stdout and stderr).
func TestRunStopsAtFailure(t *testing.T) {
	dir := t.TempDir()
	hs := []specs.Hook{
		{Path: script(t, dir, "ok", "echo ok >>"+dir+"/ran")},
		{Path: script(t, dir, "fails", "echo no GPU here\necho see the driver >&2\nexit 3")},
		{Path: script(t, dir, "after", "echo after >>"+dir+"/ran")},
	}
	err := Run(context.Background(), CreateRuntime, hs, testState(dir))
	if err == nil {
		t.Fatal("Run succeeded")
	}
	for _, want := range []string{"createRuntime hook 1 (" + hs[1].Path + ")", "exit status 3", "no GPU here", "see the driver"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if got := read(t, filepath.Join(dir, "ran")); got != "ok\n" {
		t.Errorf("hooks that ran: %q, want only the first", got)
	}
}

// TestRunPostPhasesContinue: in poststart and poststop, a failing hook lets the next ones run,
// and the error names each failure.
func TestRunPostPhasesContinue(t *testing.T) {
	for _, phase := range []Phase{Poststart, Poststop} {
		t.Run(string(phase), func(t *testing.T) {
			dir := t.TempDir()
			hs := []specs.Hook{
				{Path: script(t, dir, "fails", "echo first >>"+dir+"/ran\necho oops\nexit 1")},
				{Path: script(t, dir, "ok", "echo second >>"+dir+"/ran")},
				{Path: script(t, dir, "fails too", "echo third >>"+dir+"/ran\nexit 2")},
			}
			err := Run(context.Background(), phase, hs, testState(dir))
			if got := read(t, filepath.Join(dir, "ran")); got != "first\nsecond\nthird\n" {
				t.Errorf("hooks that ran: %q, want all three", got)
			}
			if err == nil {
				t.Fatal("Run succeeded")
			}
			for _, want := range []string{string(phase) + " hook 0 (" + hs[0].Path + "): exit status 1", "oops", string(phase) + " hook 2 (" + hs[2].Path + "): exit status 2"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %v does not say %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "hook 1") {
				t.Errorf("error %v names the hook that succeeded", err)
			}
		})
	}
}

func TestRunSignalled(t *testing.T) {
	dir := t.TempDir()
	err := Run(context.Background(), Poststop, []specs.Hook{{Path: script(t, dir, "h", "kill -TERM $$")}}, testState(dir))
	if err == nil || !strings.Contains(err.Error(), "poststop hook 0") || !strings.Contains(err.Error(), "killed by signal 15 (SIGTERM)") {
		t.Errorf("error %v, want poststop hook 0 killed by SIGTERM", err)
	}
}

// TestRunTimeout: a hook still running at its timeout is killed, and so is the child it
// started (its process group).
func TestRunTimeout(t *testing.T) {
	dir := t.TempDir()
	h := specs.Hook{Timeout: seconds(1), Path: script(t, dir, "sleeps", `echo $$ >`+dir+`/pid
/bin/sleep 1000 &
echo $! >`+dir+`/child
echo sleeping
wait`)}
	err := Run(context.Background(), Poststart, []specs.Hook{h}, testState(dir))
	if err == nil || !strings.Contains(err.Error(), "poststart hook 0 ("+h.Path+"): timed out after 1s") || !strings.Contains(err.Error(), "sleeping") {
		t.Fatalf("error %v, want poststart hook 0 timed out after 1s, with its output", err)
	}
	for _, f := range []string{"pid", "child"} {
		waitGone(t, f, pidIn(t, filepath.Join(dir, f)))
	}
}

// TestRunCancelled: the context's end kills a running hook.
func TestRunCancelled(t *testing.T) {
	dir := t.TempDir()
	h := specs.Hook{Path: script(t, dir, "sleeps", "echo $$ >"+dir+"/pid.new && mv "+dir+"/pid.new "+dir+"/pid\nexec /bin/sleep 1000")}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- Run(ctx, Prestart, []specs.Hook{h}, testState(dir)) }()
	for {
		if _, err := os.Stat(filepath.Join(dir, "pid")); err == nil {
			break
		}
		select {
		case err := <-errc:
			t.Fatalf("Run ended before the hook wrote its pid: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	err := <-errc
	if err == nil || !strings.Contains(err.Error(), "cancelled") {
		t.Fatalf("error %v, want cancelled", err)
	}
	waitGone(t, "the hook", pidIn(t, filepath.Join(dir, "pid")))
}

// TestRunBackgroundChild: a hook that exits 0 and leaves a child holding its stdout has
// succeeded; Run does not wait for the child.
func TestRunBackgroundChild(t *testing.T) {
	dir := t.TempDir()
	h := specs.Hook{Path: script(t, dir, "daemon", "/bin/sleep 1000 &\necho $! >"+dir+"/child\necho started")}
	err := Run(context.Background(), Prestart, []specs.Hook{h}, testState(dir))
	child := pidIn(t, filepath.Join(dir, "child"))
	syscall.Kill(child, syscall.SIGKILL)
	if err != nil {
		t.Fatal(err)
	}
}

func TestRunOutputBounded(t *testing.T) {
	dir := t.TempDir()
	h := specs.Hook{Path: script(t, dir, "chatty", "i=0\nwhile [ $i -lt 2000 ]; do echo line $i; i=$((i+1)); done\necho THE END\nexit 1")}
	err := Run(context.Background(), Prestart, []specs.Hook{h}, testState(dir))
	if err == nil {
		t.Fatal("Run succeeded")
	}
	msg := err.Error()
	if !strings.Contains(msg, "THE END") || !strings.Contains(msg, "[...]") || strings.Contains(msg, "line 0\\n") {
		t.Errorf("error %.200q... does not keep only the output's end", msg)
	}
	if len(msg) > OutputMax+OutputMax/2 {
		t.Errorf("error of %d bytes for %d bytes of output kept", len(msg), OutputMax)
	}
}

func TestRunBadHook(t *testing.T) {
	dir := t.TempDir()
	ok := script(t, dir, "ok", "echo ran >>"+dir+"/ran")
	for _, tt := range []struct {
		name string
		hook specs.Hook
		want string
	}{
		{"relative path", specs.Hook{Path: "ok"}, "prestart hook 0 (ok): the path is not absolute"},
		{"zero timeout", specs.Hook{Path: ok, Timeout: seconds(0)}, "timeout 0: not a positive number of seconds"},
		{"missing", specs.Hook{Path: filepath.Join(dir, "missing")}, "no such file or directory"},
		{"not executable", specs.Hook{Path: filepath.Join(dir, "ran")}, "permission denied"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			os.WriteFile(filepath.Join(dir, "ran"), nil, 0o644)
			err := Run(context.Background(), Prestart, []specs.Hook{tt.hook}, testState(dir))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want %q", err, tt.want)
			}
			if got := read(t, filepath.Join(dir, "ran")); got != "" {
				t.Errorf("the hook ran: %q", got)
			}
		})
	}
}

func TestPhaseOf(t *testing.T) {
	h := &specs.Hooks{
		Prestart: []specs.Hook{{Path: "/p"}}, CreateRuntime: []specs.Hook{{Path: "/cr"}},
		CreateContainer: []specs.Hook{{Path: "/cc"}}, StartContainer: []specs.Hook{{Path: "/sc"}},
		Poststart: []specs.Hook{{Path: "/ps"}}, Poststop: []specs.Hook{{Path: "/pt"}},
	}
	for p, want := range map[Phase]string{Prestart: "/p", CreateRuntime: "/cr", Poststart: "/ps", Poststop: "/pt"} {
		if got := p.Of(h); len(got) != 1 || got[0].Path != want {
			t.Errorf("%s: %v, want %s", p, got, want)
		}
	}
	if got := Phase("createContainer").Of(h); got != nil {
		t.Errorf("a guest phase on the host: %v", got)
	}
	if got := Prestart.Of(nil); got != nil {
		t.Errorf("no hooks: %v", got)
	}
}

func pidIn(t *testing.T, file string) int {
	t.Helper()
	pid, err := strconv.Atoi(strings.TrimSpace(read(t, file)))
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	return pid
}

// waitGone waits until pid has exited: no longer in /proc, or a zombie waiting for its
// reaper (a hook's orphan is re-parented to one the test does not control).
func waitGone(t *testing.T, what string, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if errors.Is(err, os.ErrNotExist) {
			return
		}
		if err == nil {
			s := string(b)
			if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) && s[i+2] == 'Z' {
				return
			}
		}
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("%s (pid %d) still runs: %s", what, pid, b)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
