package ctrdtest

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// logTail is how much of containerd's log a failed test prints.
const logTail = 64 << 10

// cleanup ends the containerd at the end of the test (see Start).
func (c *Containerd) cleanup(t testing.TB) {
	t.Helper()
	var reported []string
	select {
	case <-c.exited:
		t.Errorf("ctrdtest: containerd exited during the test: %v", c.waitErr)
	default:
		c.removeLeftovers(t)
		// Shims exit shortly after their last task is deleted.
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			s, err := c.snapshot()
			if err != nil || len(newProcesses(c.start, s)) == 0 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		// Mounts in containerd's namespace are seen only while it runs (and go with it).
		if pre, err := c.snapshot(); err != nil {
			t.Errorf("ctrdtest: cleanup: %v", err)
		} else {
			for _, m := range pre.Mounts {
				if !slices.Contains(c.start.Mounts, m) {
					reported = append(reported, "mount "+m)
				}
			}
		}
		c.stop(t)
	}
	now, err := c.snapshot()
	if err != nil {
		t.Errorf("ctrdtest: cleanup: %v", err)
	}
	for _, l := range diff(c.start, now) {
		if !slices.Contains(reported, l) {
			reported = append(reported, l)
		}
	}
	for _, l := range reported {
		t.Errorf("ctrdtest: leak after the test: %s", l)
	}
	c.reclaim(t, now)

	if t.Failed() {
		log := c.Log()
		if len(log) > logTail {
			log = "...\n" + log[len(log)-logTail:]
		}
		t.Logf("ctrdtest: containerd's log (%s):\n%s", c.logPath, log)
	}
	mounts, err := c.mounts()
	var left []string
	for _, m := range mounts {
		if under(m, c.dir) {
			left = append(left, m)
		}
	}
	if err != nil || len(left) > 0 {
		t.Errorf("ctrdtest: %s is kept: mounts are left under it (%q) or unknown (%v)", c.dir, left, err)
		return
	}
	if err := os.RemoveAll(c.dir); err != nil {
		t.Errorf("ctrdtest: cleanup: %v", err)
	}
}

// removeLeftovers deletes, in every namespace, the tasks (killed first) and containers the
// test left, each with a note in the test's log.
func (c *Containerd) removeLeftovers(t testing.TB) {
	t.Helper()
	if c.opts.CRI {
		// The CRI's pods first: with their containers, network namespaces and shm mounts.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		out, err := c.CrictlCmd(ctx, "pods", "--quiet").Output()
		for _, id := range strings.Fields(string(out)) {
			t.Logf("ctrdtest: cleanup: removing pod %s left by the test", id)
			if out, err := c.CrictlCmd(ctx, "rmp", "--force", id).CombinedOutput(); err != nil {
				t.Errorf("ctrdtest: cleanup: crictl rmp --force %s: %v: %s", id, err, out)
			}
		}
		cancel()
		if err != nil {
			t.Errorf("ctrdtest: cleanup: crictl pods: %v", err)
		}
	}
	nss, err := c.ctrIn("", "namespaces", "list", "--quiet")
	if err != nil {
		t.Errorf("ctrdtest: cleanup: %v", err)
		return
	}
	for _, ns := range strings.Fields(nss) {
		tasks, err := c.ctrIn(ns, "tasks", "list", "--quiet")
		if err != nil {
			t.Errorf("ctrdtest: cleanup: %v", err)
		}
		for _, id := range strings.Fields(tasks) {
			t.Logf("ctrdtest: cleanup: deleting task %s/%s left by the test", ns, id)
			if _, err := c.ctrIn(ns, "tasks", "delete", "--force", id); err != nil {
				t.Errorf("ctrdtest: cleanup: %v", err)
			}
		}
		ctrs, err := c.ctrIn(ns, "containers", "list", "--quiet")
		if err != nil {
			t.Errorf("ctrdtest: cleanup: %v", err)
		}
		for _, id := range strings.Fields(ctrs) {
			t.Logf("ctrdtest: cleanup: deleting container %s/%s left by the test", ns, id)
			if _, err := c.ctrIn(ns, "containers", "delete", id); err != nil {
				t.Errorf("ctrdtest: cleanup: %v", err)
			}
		}
	}
}

// ctrIn runs ctr in namespace ns (the containerd's when empty) for cleanup, with a timeout.
func (c *Containerd) ctrIn(ns string, args ...string) (string, error) {
	if ns == "" {
		ns = c.namespace
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := c.CtrCmd(ctx, append([]string{"--namespace", ns}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", &ctrError{args: append([]string{"--namespace", ns}, args...), err: err, stderr: stderr.String()}
	}
	return string(out), nil
}

type ctrError struct {
	args   []string
	err    error
	stderr string
}

func (e *ctrError) Error() string {
	return "ctr " + strings.Join(e.args, " ") + ": " + e.err.Error() + ": " + strings.TrimSpace(e.stderr)
}

// stop stops containerd: SIGTERM, and SIGKILL if it has not exited 10 seconds later.
func (c *Containerd) stop(t testing.TB) {
	t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("ctrdtest: stopping containerd: %v", err)
	}
	select {
	case <-c.exited:
		return
	case <-time.After(10 * time.Second):
	}
	t.Logf("ctrdtest: containerd did not exit within 10 s of SIGTERM; killing it")
	if err := c.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		t.Errorf("ctrdtest: killing containerd: %v", err)
	}
	<-c.exited
}

// reclaim takes back what the containerd left, as now found it: it kills its processes,
// unmounts its mounts, and removes the namespace's cgroups and runc state directory.
func (c *Containerd) reclaim(t testing.TB, now Snapshot) {
	t.Helper()
	killAll(t, newProcesses(c.start, now))
	for _, m := range now.Mounts {
		if !slices.Contains(c.start.Mounts, m) {
			if err := unix.Unmount(m, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) {
				t.Errorf("ctrdtest: unmounting %s: %v", m, err)
			}
		}
	}
	// Deepest first: a container's cgroup, then the namespace's.
	for _, d := range now.Cgroups {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("ctrdtest: removing %s: %v", d, err)
		}
	}
	if err := os.Remove(c.cgroup); err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("ctrdtest: removing the containerd's cgroup: %v", err)
	}
	dirs, err := c.namespaceDirs()
	if err != nil {
		t.Errorf("ctrdtest: cleanup: %v", err)
	}
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("ctrdtest: removing %s: %v", d, err)
		}
	}
}

// KillSince kills the containerd's processes that before did not have (its shims, their VMs,
// a ctr still waiting), those match accepts (all with a nil match), and waits for them to go:
// what a failed part of a test left running, so that the next part does not meet it.
// containerd itself goes on; it runs a dead shim's cleanup as usual.
func (c *Containerd) KillSince(t testing.TB, before Snapshot, match func(Process) bool) {
	t.Helper()
	var left []Process
	for _, p := range newProcesses(before, c.Snapshot(t)) {
		if match == nil || match(p) {
			t.Logf("ctrdtest: killing %s", p)
			left = append(left, p)
		}
	}
	killAll(t, left)
}

// killAll sends SIGKILL to each process and waits up to 5 seconds for them to have gone.
func killAll(t testing.TB, left []Process) {
	t.Helper()
	for _, p := range left {
		if err := kill(p); err != nil {
			t.Errorf("ctrdtest: killing %s: %v", p, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(left) > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		var still []Process
		for _, p := range left {
			if q, err := readProcess(p.PID); err == nil && q.Start == p.Start && q.State != 'Z' {
				still = append(still, p)
			}
		}
		left = still
	}
	for _, p := range left {
		t.Errorf("ctrdtest: %s survived SIGKILL", p)
	}
}

// newProcesses are the processes of now that before did not have.
func newProcesses(before, now Snapshot) []Process {
	known := map[[2]uint64]bool{}
	for _, p := range before.Processes {
		known[[2]uint64{uint64(p.PID), p.Start}] = true
	}
	var out []Process
	for _, p := range now.Processes {
		if !known[[2]uint64{uint64(p.PID), p.Start}] {
			out = append(out, p)
		}
	}
	return out
}
