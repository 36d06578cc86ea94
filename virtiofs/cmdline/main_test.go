package cmdline

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// helperEnv makes the test binary act as a kvfsd-like child process: its value names the
// helper, and the arguments are a kvfsd command line. Children test what cannot be undone in
// the test process (lowering RLIMIT_NOFILE) or needs a fresh process (an inherited fd 3).
const helperEnv = "KVFS_CMDLINE_TEST_HELPER"

func TestMain(m *testing.M) {
	switch h := os.Getenv(helperEnv); h {
	case "":
		os.Exit(m.Run())
	case "listen":
		os.Exit(helperListen(os.Args[1:]))
	case "rlimit":
		os.Exit(helperRlimit(os.Args[1:]))
	case "rlimit-nocap":
		// A hard limit of 1024, then without CAP_SYS_RESOURCE, on this thread only:
		// capabilities are per thread, so the thread stays locked to this goroutine, which then
		// sets the limit.
		runtime.LockOSThread()
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 1024, Max: 1024}); err != nil {
			fmt.Println("setrlimit:", err)
			os.Exit(1)
		}
		if err := dropCapability(unix.CAP_SYS_RESOURCE); err != nil {
			fmt.Println("capset:", err)
			os.Exit(1)
		}
		os.Exit(helperRlimit(os.Args[1:]))
	default:
		fmt.Fprintf(os.Stderr, "unknown helper %q\n", h)
		os.Exit(2)
	}
}

// helperListen parses args, listens as they say, prints "ready", then greets one connection.
func helperListen(args []string) int {
	o, err := Parse(args)
	if err != nil {
		fmt.Println("parse:", err)
		return 1
	}
	l, release, err := Listen(o)
	if err != nil {
		fmt.Println("listen:", err)
		return 1
	}
	defer release()
	fmt.Println("ready")
	c, err := l.Accept()
	if err != nil {
		fmt.Println("accept:", err)
		return 1
	}
	defer c.Close()
	fmt.Fprintf(c, "hello from pid %d\n", os.Getpid())
	return 0
}

// helperRlimit parses args, applies the file descriptor limit, and prints the result.
func helperRlimit(args []string) int {
	o, err := Parse(args)
	if err != nil {
		fmt.Println("parse:", err)
		return 1
	}
	ch, err := SetNofileLimit(o)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	var now unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &now); err != nil {
		fmt.Println("getrlimit:", err)
		return 1
	}
	fmt.Printf("after %d %d now %d %d\n", ch.After.Cur, ch.After.Max, now.Cur, now.Max)
	return 0
}

// dropCapability removes capability c from the calling thread's effective set.
func dropCapability(c int) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[c/32].Effective &^= 1 << (c % 32)
	return unix.Capset(&hdr, &data[0])
}

// child is a running helper.
type child struct {
	cmd    *exec.Cmd
	stdout *bufio.Reader
}

// startChild starts helper with args, giving it extra as fds 3, 4, ...
func startChild(t *testing.T, helper string, extra []*os.File, args ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+helper)
	cmd.ExtraFiles = extra
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return &child{cmd: cmd, stdout: bufio.NewReader(out)}
}

// line reads the child's next line of output.
func (c *child) line(t *testing.T) string {
	t.Helper()
	type result struct {
		s   string
		err error
	}
	ch := make(chan result, 1)
	go func() {
		s, err := c.stdout.ReadString('\n')
		ch <- result{s, err}
	}()
	select {
	case r := <-ch:
		if r.err != nil && r.err != io.EOF {
			t.Fatalf("read child output: %v", r.err)
		}
		return strings.TrimSpace(r.s)
	case <-time.After(30 * time.Second):
		t.Fatal("timed out waiting for the child")
	}
	return ""
}

// wait waits for the child to exit and returns its exit code.
func (c *child) wait(t *testing.T) int {
	t.Helper()
	err := c.cmd.Wait()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0
}
