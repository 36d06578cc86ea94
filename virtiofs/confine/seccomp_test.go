package confine

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// childEnvVar makes the test binary, run again by runChild, act as a filtered child;
// forbiddenEnvVar names the call it makes last (forbiddenPtrace when empty).
const (
	childEnvVar     = "CONFINE_TEST_SECCOMP_CHILD"
	forbiddenEnvVar = "CONFINE_TEST_SECCOMP_FORBIDDEN"
)

// The calls outside the list that the child can make: ptrace, or ioctl with a request other
// than the one ioctl is allowed with (FS_IOC_FSGETXATTR).
const (
	forbiddenPtrace = "ptrace"
	forbiddenIoctl  = "ioctl"
)

func TestMain(m *testing.M) {
	if a := os.Getenv(childEnvVar); a != "" {
		os.Exit(seccompChild(Action(a)))
	}
	if step := os.Getenv(capsEnvVar); step != "" {
		os.Exit(capsChild(step))
	}
	os.Exit(m.Run())
}

// seccompChild installs the filter for action, exercises the Go runtime under it (goroutines,
// new threads, GC, timers, a blocking read on a pipe through the netpoller) and the one ioctl
// allowed (FS_IOC_FSGETXATTR), prints "served", then makes a system call the list does not
// allow (ptrace, or ioctl TCGETS, each failing harmlessly if allowed) from a thread that
// existed before the filter, and prints "survived".
func seccompChild(action Action) int {
	f, err := os.Open(os.Args[0])
	if err != nil {
		os.Stderr.WriteString("open: " + err.Error() + "\n")
		return 5
	}
	defer f.Close()
	forbidden := func() (uintptr, uintptr, syscall.Errno) {
		return unix.Syscall6(unix.SYS_PTRACE, ^uintptr(0), 0, 0, 0, 0, 0)
	}
	if os.Getenv(forbiddenEnvVar) == forbiddenIoctl {
		forbidden = func() (uintptr, uintptr, syscall.Errno) {
			var t unix.Termios
			return unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.TCGETS, uintptr(unsafe.Pointer(&t)))
		}
	}
	before := make(chan struct{})
	var errno syscall.Errno
	var wg sync.WaitGroup
	wg.Add(1)
	started := make(chan struct{})
	go func() {
		defer wg.Done()
		runtime.LockOSThread() // this thread predates the filter: TSYNC must reach it
		close(started)
		<-before
		_, _, errno = forbidden()
	}()
	<-started
	if err := InstallSeccomp(action); err != nil {
		os.Stderr.WriteString("install: " + err.Error() + "\n")
		return 3
	}
	status, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(l, "Seccomp") || strings.HasPrefix(l, "NoNewPrivs") {
			os.Stdout.WriteString(l + "\n")
		}
	}
	if err := exerciseRuntime(); err != nil {
		os.Stderr.WriteString("runtime: " + err.Error() + "\n")
		return 4
	}
	// DAX's FS_XFLAG_DAX check; whatever the file system answers, the call is let through.
	if _, err := unix.IoctlGetUint32(int(f.Fd()), fsIocFsgetxattr); err != nil {
		os.Stdout.WriteString("FS_IOC_FSGETXATTR: " + err.Error() + "\n")
	}
	os.Stdout.WriteString("served\n")
	close(before)
	wg.Wait()
	os.Stdout.WriteString("survived: " + errno.Error() + "\n")
	return 0
}

func exerciseRuntime() error {
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread() // ends its thread on return: threads come and go
			b := make([]byte, 1<<20)
			b[len(b)-1] = 1
			time.Sleep(time.Millisecond)
		}()
	}
	wg.Wait()
	runtime.GC()
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	defer r.Close()
	go func() {
		time.Sleep(10 * time.Millisecond)
		w.Write([]byte("x"))
		w.Close()
	}()
	buf := make([]byte, 1)
	if _, err := r.Read(buf); err != nil {
		return err
	}
	return nil
}

// runChild runs this test binary as seccompChild(action), making the forbidden call named.
func runChild(t *testing.T, action Action, forbidden string) (string, *os.ProcessState) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnvVar+"="+string(action), forbiddenEnvVar+"="+forbidden)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return out.String(), cmd.ProcessState
}

func TestSeccompKill(t *testing.T) {
	for _, forbidden := range []string{forbiddenPtrace, forbiddenIoctl} {
		t.Run(forbidden, func(t *testing.T) {
			out, ps := runChild(t, SeccompKill, forbidden)
			ws := ps.Sys().(syscall.WaitStatus)
			if !ws.Signaled() || ws.Signal() != syscall.SIGSYS {
				t.Fatalf("child: %v, want killed by SIGSYS; output:\n%s", ps, out)
			}
			for _, want := range []string{"Seccomp:\t2", "Seccomp_filters:\t1", "NoNewPrivs:\t1", "served\n"} {
				if !strings.Contains(out, want) {
					t.Errorf("output lacks %q:\n%s", want, out)
				}
			}
			if strings.Contains(out, "survived") {
				t.Errorf("the forbidden call returned:\n%s", out)
			}
		})
	}
}

func TestSeccompLog(t *testing.T) {
	out, ps := runChild(t, SeccompLog, forbiddenPtrace)
	if !ps.Success() {
		t.Fatalf("child: %v, want exit 0; output:\n%s", ps, out)
	}
	// ptrace ran (allowed and logged) and failed on its bogus request.
	for _, want := range []string{"Seccomp:\t2", "served\n", "survived: "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestSeccompTrap(t *testing.T) {
	out, ps := runChild(t, SeccompTrap, forbiddenPtrace)
	if ps.Success() || !strings.Contains(out, "SIGSYS") || strings.Contains(out, "survived") {
		t.Fatalf("child: %v, want the Go runtime's SIGSYS crash; output:\n%s", ps, out)
	}
}

// TestAllowlist checks the table and prints it: go test -v -run TestAllowlist shows the list.
func TestAllowlist(t *testing.T) {
	seen := map[uintptr]string{}
	groups := map[string]int{}
	for _, s := range Syscalls() {
		if prev, ok := seen[s.Nr]; ok {
			t.Errorf("%s (%d) is listed twice (also as %s)", s.Name, s.Nr, prev)
		}
		seen[s.Nr] = s.Name
		groups[s.Group]++
		t.Logf("%-20s %-20s %3d", s.Group, s.Name, s.Nr)
	}
	for _, g := range []string{"go runtime", "vhost-user", "passthrough", "locks", "xattrs", "credentials"} {
		if groups[g] == 0 {
			t.Errorf("group %q is empty", g)
		}
	}
	for _, name := range []string{"futex", "clone", "clone3", "setfsuid", "setfsgid", "flock", "fcntl", "lgetxattr",
		"name_to_handle_at", "open_by_handle_at", "copy_file_range", "fallocate", "lseek", "statx", "syncfs"} {
		found := false
		for _, s := range Syscalls() {
			found = found || s.Name == name
		}
		if !found {
			t.Errorf("%s is not allowed", name)
		}
	}
	for _, nr := range []uintptr{unix.SYS_PTRACE, unix.SYS_MOUNT, unix.SYS_PIVOT_ROOT, unix.SYS_CHROOT, unix.SYS_EXECVE,
		unix.SYS_SETNS, unix.SYS_UNSHARE, unix.SYS_BIND, unix.SYS_LISTEN, unix.SYS_KILL, unix.SYS_SETUID} {
		if name, ok := seen[nr]; ok {
			t.Errorf("%s (%d) must not be allowed while serving", name, nr)
		}
	}
	for _, s := range Syscalls() {
		if s.Nr == unix.SYS_IOCTL && (s.ArgIndex != 1 || s.ArgValue != fsIocFsgetxattr) {
			t.Errorf("ioctl is allowed beyond FS_IOC_FSGETXATTR: %+v", s)
		}
	}
}

func TestFilter(t *testing.T) {
	for _, a := range []Action{SeccompKill, SeccompLog, SeccompTrap} {
		prog, err := Filter(a)
		if err != nil {
			t.Fatalf("%s: %v", a, err)
		}
		if len(prog) > unix.BPF_MAXINSNS || prog[len(prog)-1].Code != unix.BPF_RET|unix.BPF_K {
			t.Errorf("%s: %d instructions, last %+v", a, len(prog), prog[len(prog)-1])
		}
	}
	if _, err := Filter(SeccompNone); err == nil {
		t.Error("Filter(none) made a filter")
	}
	if err := InstallSeccomp(SeccompNone); err != nil {
		t.Errorf("InstallSeccomp(none): %v", err)
	}
	for _, s := range []string{"kill", "log", "trap", "none"} {
		if a, err := ParseAction(s); err != nil || string(a) != s {
			t.Errorf("ParseAction(%q) = %q, %v", s, a, err)
		}
	}
	if _, err := ParseAction("allow"); err == nil {
		t.Error("ParseAction(allow) accepted it")
	}
	for _, s := range []string{"namespace", "chroot", "none"} {
		if m, err := ParseMode(s); err != nil || string(m) != s {
			t.Errorf("ParseMode(%q) = %q, %v", s, m, err)
		}
	}
	if _, err := ParseMode("jail"); err == nil {
		t.Error("ParseMode(jail) accepted it")
	}
}

// TestExitStatus checks how the supervisor reports the end of its child.
func TestExitStatus(t *testing.T) {
	for _, tt := range []struct {
		script string
		want   int
		err    string
	}{
		{"exit 0", 0, ""},
		{"exit 3", 3, ""},
		{"kill -TERM $$", 128 + 15, "killed by terminated"},
		{"kill -SYS $$", 128 + 31, "seccomp allowlist"},
	} {
		cmd := exec.Command("/bin/sh", "-c", tt.script)
		err := cmd.Run()
		got, gotErr := exitStatus(cmd.ProcessState, err)
		if got != tt.want || (tt.err == "") != (gotErr == nil) || (gotErr != nil && !strings.Contains(gotErr.Error(), tt.err)) {
			t.Errorf("%s: status %d, %v; want %d, %q", tt.script, got, gotErr, tt.want, tt.err)
		}
	}
}

func TestChildMarker(t *testing.T) {
	// Not PID 1: the marker alone does not make a child.
	t.Setenv(childEnv, "3")
	if fd, ok := Child(); ok {
		t.Errorf("Child() = %d, true outside a PID namespace", fd)
	}
	if _, set := os.LookupEnv(childEnv); set {
		t.Error("Child left the marker in the environment")
	}
}
