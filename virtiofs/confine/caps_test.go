package confine

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// capsEnvVar makes the test binary, run again by TestStartWithCapabilities, start itself with
// the server's capabilities ("start"), which then reports every thread's ("report").
const capsEnvVar = "CONFINE_TEST_CAPS_CHILD"

func capsChild(step string) int {
	switch step {
	case "start":
		os.Setenv(capsEnvVar, "report")
		cmd := exec.Command("/proc/self/exe", "-test.run=^$")
		cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
		if err := StartWithCapabilities(cmd, ServerCapabilities); err != nil {
			fmt.Println("start:", err)
			return 1
		}
		if err := cmd.Wait(); err != nil {
			fmt.Println("wait:", err)
			return 1
		}
		// This process keeps its capabilities: its other threads (the one that forked is gone,
		// or wedged if it was the main thread, which /proc/self/status shows).
		runtime.LockOSThread()
		b, _ := os.ReadFile("/proc/thread-self/status")
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "CapEff:") {
				fmt.Println("starter", l)
			}
		}
		return 0
	case "report":
		// New threads after the execve inherit the main thread's sets.
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 4 {
			wg.Add(1)
			go func() { defer wg.Done(); runtime.LockOSThread(); <-start }()
		}
		defer close(start)
		tasks, _ := filepath.Glob("/proc/self/task/*/status")
		for _, t := range tasks {
			b, err := os.ReadFile(t)
			if err != nil {
				fmt.Println("read:", err)
				return 1
			}
			for _, l := range strings.Split(string(b), "\n") {
				if strings.HasPrefix(l, "Cap") {
					fmt.Println(l)
				}
			}
		}
		fmt.Println("threads:", len(tasks))
		return 0
	}
	return 2
}

// TestStartWithCapabilities checks that every thread of the program StartWithCapabilities
// starts has exactly ServerCapabilities in its bounding, permitted and effective sets, and none
// inheritable or ambient, and that the starting process keeps its own.
func TestStartWithCapabilities(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: checks that root's capabilities are dropped")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), capsEnvVar+"=start")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("child: %v\n%s", err, out.String())
	}
	var want uint64
	for _, c := range ServerCapabilities {
		want |= 1 << c
	}
	// What the test process has bounds what the child can keep.
	self, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	want &= capField(t, string(self), "CapBnd")
	if want&(1<<unix.CAP_SETUID) == 0 {
		t.Skip("the test process lacks CAP_SETUID: nothing to check")
	}
	if !strings.Contains(out.String(), "starter "+strings.SplitN(capLine(string(self), "CapEff"), "\n", 2)[0]) {
		t.Errorf("the starting process lost capabilities:\n%s", out.String())
	}
	threads := 0
	sets := map[string]int{}
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(l, "starter ") {
			continue
		}
		name, v, ok := strings.Cut(l, ":")
		if !ok || !strings.HasPrefix(name, "Cap") {
			if strings.HasPrefix(l, "threads: ") {
				threads, _ = strconv.Atoi(strings.TrimPrefix(l, "threads: "))
			}
			continue
		}
		got, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		if err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		exp := want
		if name == "CapInh" || name == "CapAmb" {
			exp = 0
		}
		if got != exp {
			t.Errorf("%s = %016x, want %016x", name, got, exp)
		}
		sets[name]++
	}
	if threads < 2 {
		t.Errorf("the child reported %d threads:\n%s", threads, out.String())
	}
	for _, name := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if sets[name] != threads {
			t.Errorf("%s reported for %d of %d threads:\n%s", name, sets[name], threads, out.String())
		}
	}
}

// capLine returns the line of capability set name in a /proc/PID/status text.
func capLine(status, name string) string {
	for _, l := range strings.Split(status, "\n") {
		if strings.HasPrefix(l, name+":") {
			return l
		}
	}
	return ""
}

// capField returns the hexadecimal capability set name of a /proc/PID/status text.
func capField(t *testing.T, status, name string) uint64 {
	t.Helper()
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no %s in status", name)
	return 0
}

// TestCapabilityNames checks the name table against the kernel's numbers.
func TestCapabilityNames(t *testing.T) {
	for name, c := range map[string]int{
		"chown": unix.CAP_CHOWN, "dac_read_search": unix.CAP_DAC_READ_SEARCH, "setpcap": unix.CAP_SETPCAP,
		"net_raw": unix.CAP_NET_RAW, "sys_chroot": unix.CAP_SYS_CHROOT, "sys_admin": unix.CAP_SYS_ADMIN,
		"mknod": unix.CAP_MKNOD, "setfcap": unix.CAP_SETFCAP, "syslog": unix.CAP_SYSLOG,
		"audit_read": unix.CAP_AUDIT_READ, "checkpoint_restore": unix.CAP_CHECKPOINT_RESTORE,
	} {
		if got := slices.Index(capabilityNames, name); got != c {
			t.Errorf("%s: %d, want %d", name, got, c)
		}
	}
	if len(capabilityNames) != unix.CAP_LAST_CAP+1 {
		t.Errorf("%d names, want %d", len(capabilityNames), unix.CAP_LAST_CAP+1)
	}
}
