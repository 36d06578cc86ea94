package ctrd

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A containerd's processes are tracked by a cgroup (v2) of its own, which containerd starts
// in and every process it starts inherits: its shims, their VMs and servers, hooks, and any
// process one of them left behind, in a session of its own, reparented to init, whatever its
// command line says. runc's containers are moved to the namespace's cgroup (/NAMESPACE/ID),
// which is why the containerd's cgroup is a child of that one: the leak check takes every
// process of the subtree /NAMESPACE as the containerd's (Snapshot.Processes).
//
// The cgroup's name records the process that made it (its pid and start time): a test binary
// killed before its cleanup ran (go test's -timeout, say) leaves the containerd's processes
// running with nobody to report them, and the next Start on the machine kills them
// (sweepDeadOwners) and logs what it killed.

// cgroupPrefix starts the name of a containerd's cgroup in its namespace's.
const cgroupPrefix = "containerd-of-"

// cgroup2Root is where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or
// /sys/fs/cgroup/unified on a hybrid machine).
func cgroup2Root() (string, error) {
	all, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	for _, mp := range all {
		if mp.fstype == "cgroup2" {
			return mp.point, nil
		}
	}
	return "", errors.New("no cgroup v2 hierarchy is mounted: the leak check tracks a containerd's processes by its cgroup")
}

// makeCgroup makes the containerd's cgroup, /NAMESPACE/containerd-of-PID-START in the v2
// hierarchy, and returns its path.
func (c *Containerd) makeCgroup() (string, error) {
	root, err := cgroup2Root()
	if err != nil {
		return "", err
	}
	self, err := readProcess(os.Getpid())
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, c.namespace, fmt.Sprintf("%s%d-%d", cgroupPrefix, self.PID, self.Start))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("the containerd's cgroup: %w", err)
	}
	return dir, nil
}

// cgroupPIDs lists the processes of the cgroup dir and of the cgroups under it.
func cgroupPIDs(dir string) ([]int, error) {
	var pids []int
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(path, "cgroup.procs"))
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		for _, f := range strings.Fields(string(b)) {
			pid, err := strconv.Atoi(f)
			if err != nil {
				return fmt.Errorf("%s/cgroup.procs: %q", path, f)
			}
			pids = append(pids, pid)
		}
		return nil
	})
	if errors.Is(err, fs.ErrNotExist) {
		err = nil
	}
	return pids, err
}

// removeCgroupTree removes the cgroup dir and those under it, deepest first.
func removeCgroupTree(dir string) error {
	var dirs []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, d := range slices.Backward(dirs) {
		if err := os.Remove(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// sweepDeadOwners kills what containerds of processes that are gone left running (their
// cgroups' processes) and removes their cgroups, with a line to logf for each process.
func sweepDeadOwners(logf func(string, ...any)) {
	root, err := cgroup2Root()
	if err != nil {
		return // Start fails on it
	}
	cgs, _ := filepath.Glob(filepath.Join(root, "kvfstest-*", cgroupPrefix+"*"))
	for _, cg := range cgs {
		var owner int
		var start uint64
		if _, err := fmt.Sscanf(strings.TrimPrefix(filepath.Base(cg), cgroupPrefix), "%d-%d", &owner, &start); err != nil {
			continue
		}
		if p, err := readProcess(owner); err == nil && p.Start == start {
			continue // its owner runs
		}
		nsDir := filepath.Dir(cg)
		pids, err := cgroupPIDs(nsDir)
		if err != nil {
			logf("the cgroup %s of a process that is gone: %v", nsDir, err)
			continue
		}
		for _, pid := range pids {
			if p, err := readProcess(pid); err == nil {
				logf("killing %s, left in %s by pid %d, which died before it stopped its containerd", p, nsDir, owner)
				if err := kill(p); err != nil {
					logf("killing %s: %v", p, err)
				}
			}
		}
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if pids, err := cgroupPIDs(nsDir); err == nil && len(pids) == 0 {
				break
			}
		}
		if err := removeCgroupTree(nsDir); err != nil {
			logf("removing the cgroups of a process that is gone: %v", err)
		}
	}
}
