package ctrd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Stop ends the containerd: it removes what was left in it (the CRI's pods, tasks killed and
// deleted, containers), each with a note to Options.Logf, and stops containerd. Then it finds
// what leaked: what the containerd holds now that it did not hold when Start returned (what
// goes away by itself is given 10 seconds to go: a shim exits shortly after its last task is
// deleted). It returns that, and takes it back: it kills the processes, unmounts the mounts,
// and removes the namespace's cgroups and runc state directory. Remove then removes the
// containerd's directory; its log can be read until then.
func (c *Containerd) Stop() (leaks []string, err error) {
	var errs []error
	select {
	case <-c.exited:
		errs = append(errs, fmt.Errorf("containerd exited before Stop: %v", c.waitErr))
	default:
		errs = append(errs, c.removeLeftovers())
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
			errs = append(errs, err)
		} else {
			for _, m := range pre.Mounts {
				if !slices.Contains(c.start.Mounts, m) {
					leaks = append(leaks, "mount "+m)
				}
			}
		}
		errs = append(errs, c.stop())
	}
	now, err := c.snapshot()
	errs = append(errs, err)
	for _, l := range Diff(c.start, now) {
		if !slices.Contains(leaks, l) {
			leaks = append(leaks, l)
		}
	}
	errs = append(errs, c.reclaim(now))
	return leaks, errors.Join(errs...)
}

// Remove removes the containerd's directory once Stop has stopped it, unless mounts are left
// under it.
func (c *Containerd) Remove() error {
	mounts, err := c.mounts()
	var left []string
	for _, m := range mounts {
		if under(m, c.dir) {
			left = append(left, m)
		}
	}
	if err != nil || len(left) > 0 {
		return fmt.Errorf("%s is kept: mounts are left under it (%q) or unknown (%v)", c.dir, left, err)
	}
	return os.RemoveAll(c.dir)
}

// removeLeftovers deletes, in every namespace, the tasks (killed first) and containers left
// in the containerd, each with a note to Options.Logf.
func (c *Containerd) removeLeftovers() error {
	var errs []error
	if c.opts.CRI {
		// The CRI's pods first: with their containers, network namespaces and shm mounts.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		out, err := c.CrictlCmd(ctx, "pods", "--quiet").Output()
		for _, id := range strings.Fields(string(out)) {
			c.opts.Logf("removing pod %s, left behind", id)
			if out, err := c.CrictlCmd(ctx, "rmp", "--force", id).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("crictl rmp --force %s: %v: %s", id, err, out))
			}
		}
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("crictl pods: %w", err))
		}
	}
	nss, err := c.ctrIn("", "namespaces", "list", "--quiet")
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, ns := range strings.Fields(nss) {
		tasks, err := c.ctrIn(ns, "tasks", "list", "--quiet")
		errs = append(errs, err)
		for _, id := range strings.Fields(tasks) {
			c.opts.Logf("deleting task %s/%s, left behind", ns, id)
			_, err := c.ctrIn(ns, "tasks", "delete", "--force", id)
			errs = append(errs, err)
		}
		ctrs, err := c.ctrIn(ns, "containers", "list", "--quiet")
		errs = append(errs, err)
		for _, id := range strings.Fields(ctrs) {
			c.opts.Logf("deleting container %s/%s, left behind", ns, id)
			_, err := c.ctrIn(ns, "containers", "delete", id)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
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
func (c *Containerd) stop() error {
	var errs []error
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		errs = append(errs, fmt.Errorf("stopping containerd: %w", err))
	}
	select {
	case <-c.exited:
		return errors.Join(errs...)
	case <-time.After(10 * time.Second):
	}
	c.opts.Logf("containerd did not exit within 10 s of SIGTERM; killing it")
	if err := c.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		errs = append(errs, fmt.Errorf("killing containerd: %w", err))
	}
	<-c.exited
	return errors.Join(errs...)
}

// reclaim takes back what the containerd left, as now found it: it kills its processes,
// unmounts its mounts, and removes the namespace's cgroups and runc state directory.
func (c *Containerd) reclaim(now Snapshot) error {
	errs := []error{killAll(newProcesses(c.start, now))}
	for _, m := range now.Mounts {
		if !slices.Contains(c.start.Mounts, m) {
			if err := unix.Unmount(m, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("unmounting %s: %w", m, err))
			}
		}
	}
	// Deepest first: a container's cgroup, then the namespace's.
	for _, d := range now.Cgroups {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(c.cgroup); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing the containerd's cgroup: %w", err))
	}
	dirs, err := c.namespaceDirs()
	errs = append(errs, err)
	for _, d := range dirs {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// KillSince kills the containerd's processes that before did not have (its shims, their VMs,
// a ctr still waiting), those match accepts (all with a nil match), each with a note to
// Options.Logf, and waits for them to go: what a failed part of a test left running, so that
// the next part does not meet it. containerd itself goes on; it runs a dead shim's cleanup as
// usual.
func (c *Containerd) KillSince(before Snapshot, match func(Process) bool) error {
	now, err := c.snapshot()
	if err != nil {
		return err
	}
	var left []Process
	for _, p := range newProcesses(before, now) {
		if match == nil || match(p) {
			c.opts.Logf("killing %s", p)
			left = append(left, p)
		}
	}
	return killAll(left)
}

// killAll sends SIGKILL to each process and waits up to 5 seconds for them to have gone.
func killAll(left []Process) error {
	var errs []error
	for _, p := range left {
		if err := kill(p); err != nil {
			errs = append(errs, fmt.Errorf("killing %s: %w", p, err))
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(left) > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		left = slices.DeleteFunc(left, func(p Process) bool { return !p.Alive() })
	}
	for _, p := range left {
		errs = append(errs, fmt.Errorf("%s survived SIGKILL", p))
	}
	return errors.Join(errs...)
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
