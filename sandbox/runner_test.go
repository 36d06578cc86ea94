package sandbox

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/nettest"
)

// TestQEMURunnerExtraFiles runs a shell in QEMU's place: the files of VMCommand.ExtraFiles are
// its descriptors 3 and 4, in order (VM.Args names NIC i's tap fd=3+i), and its stdout and
// stderr go to VMCommand.Output.
func TestQEMURunnerExtraFiles(t *testing.T) {
	dir := t.TempDir()
	var files []*os.File
	for _, content := range []string{"first\n", "second\n"} {
		p := filepath.Join(dir, content[:len(content)-1])
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		files = append(files, f)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p, err := QEMURunner{}.Run(context.Background(), VMCommand{
		Path: "/bin/sh", Args: []string{"-c", "cat <&3; cat <&4 >&2"}, Output: w, ExtraFiles: files,
	})
	w.Close()
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan []byte)
	go func() {
		b, _ := io.ReadAll(r)
		out <- b
	}()
	select {
	case <-p.Exited():
	case <-time.After(30 * time.Second):
		t.Fatal("the shell did not exit")
	}
	if err := p.ExitErr(); err != nil {
		t.Fatalf("the shell: %v", err)
	}
	if b := <-out; string(b) != "first\nsecond\n" {
		t.Errorf("descriptors 3 and 4 read %q to stdout and stderr, want the extra files in order in Output", b)
	}
}

// netnsOf is the identity (device, inode) of the network namespace at path: a namespace
// file, or a process's or thread's /proc link.
func netnsOf(t *testing.T, path string) [2]uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return [2]uint64{st.Dev, st.Ino}
}

// TestQEMURunnerNetNS: with a NetNS, the hypervisor (sleep in QEMU's place) is born in that
// network namespace, and the caller's thread and every other thread of the process are still
// in their own afterwards; a NetNS that is no network namespace starts nothing and says so.
func TestQEMURunnerNetNS(t *testing.T) {
	requireRoot(t)
	ns := nettest.New(t, "kvfs-runner")
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	host := netnsOf(t, "/proc/thread-self/ns/net")
	if pod := netnsOf(t, ns.Path); pod == host {
		t.Fatalf("the test's namespace %s is the host's", ns.Path)
	}
	dir := t.TempDir()
	p, err := QEMURunner{}.Run(context.Background(), VMCommand{Path: "/bin/sleep", Args: []string{"600"}, NetNS: ns.Path})
	if err != nil {
		t.Fatal(err)
	}
	defer kill(p)
	if got, want := netnsOf(t, "/proc/"+strconv.Itoa(p.Pid())+"/ns/net"), netnsOf(t, ns.Path); got != want {
		t.Errorf("the VM's network namespace is %v, want the pod's %v (the host's: %v)", got, want, host)
	}
	if got := netnsOf(t, "/proc/thread-self/ns/net"); got != host {
		t.Errorf("the caller's thread is in network namespace %v after Run, want its own %v", got, host)
	}
	tasks, err := filepath.Glob("/proc/self/task/*/ns/net")
	if err != nil || len(tasks) == 0 {
		t.Fatalf("the process's threads: %v, %v", tasks, err)
	}
	for _, task := range tasks {
		if got := netnsOf(t, task); got != host {
			t.Errorf("thread %s is in network namespace %v after Run, want the process's %v", task, got, host)
		}
	}

	notNS := filepath.Join(dir, "not-a-netns")
	if err := os.WriteFile(notNS, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p2, err := QEMURunner{}.Run(context.Background(), VMCommand{Path: "/bin/sh", Args: []string{"-c", "echo started"}, Output: w, NetNS: notNS})
	w.Close()
	if err == nil {
		kill(p2)
		t.Fatal("Run with a NetNS that is a regular file succeeded")
	}
	if !strings.Contains(err.Error(), notNS) || !strings.Contains(err.Error(), "not a network namespace") {
		t.Errorf("Run with a regular file for NetNS: %q, want an error that names it and says it is not a network namespace", err)
	}
	if b, _ := io.ReadAll(r); len(b) != 0 {
		t.Errorf("something ran: its output %q", b)
	}
}
