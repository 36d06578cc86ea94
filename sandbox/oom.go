package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// The host's OOM killer weighs a process's memory by its oom_score_adj (-1000 to 1000). A
// VM holds its pod's memory: QEMU and the pod's server take the pod's value (Options.OOMScoreAdj,
// raised later by RaiseOOMScoreAdj), not the owner's, which a shim inherits from containerd
// (-999 plus one): a BestEffort pod's VM would otherwise be better protected than a Guaranteed
// runc container (-997). The owner keeps its own. The in-process server is the owner and keeps
// the owner's value too.
//
// Writing a value the process already has, or a higher one, always works. A lower one needs
// CAP_SYS_RESOURCE, unless it is no lower than the least value a privileged process set for
// the process or an ancestor (the kernel's oom_score_adj_min, inherited). Some hosts withhold
// the capability from the owner: containerd's restrict_oom_score_adj then keeps the values it
// gives at or above its own, which such writes reach. A value that cannot be written is an
// error naming it, and the process it was for does not run: the value is part of the host's
// protection against the pod, as runc fails a container whose oomScoreAdj it cannot set.

// Bounds of oom_score_adj.
const (
	MinOOMScoreAdj = -1000
	MaxOOMScoreAdj = 1000
)

// CheckOOMScoreAdj says whether v is an oom_score_adj.
func CheckOOMScoreAdj(v int) error {
	if v < MinOOMScoreAdj || v > MaxOOMScoreAdj {
		return fmt.Errorf("oom_score_adj %d is outside [%d, %d]", v, MinOOMScoreAdj, MaxOOMScoreAdj)
	}
	return nil
}

// setOOMScoreAdj writes v to the oom_score_adj of pid and of every process below it: a
// server may be more than one process (the confined server's supervisor and its serving child,
// a daemon that forks into its sandbox), each with a value of its own, copied at fork from its
// parent. It is called once the tree has stopped forking (the server is ready). A process that
// exits meanwhile is skipped; pid itself must exist.
func setOOMScoreAdj(pid, v int) error {
	if err := writeOOMScoreAdj(pid, v); err != nil {
		return err
	}
	children, err := childrenOf(pid)
	if err != nil {
		return fmt.Errorf("the processes below pid %d: %w", pid, err)
	}
	for _, c := range children {
		if err := setOOMScoreAdj(c, v); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// writeOOMScoreAdj writes v to /proc/pid/oom_score_adj.
func writeOOMScoreAdj(pid, v int) error {
	path := "/proc/" + strconv.Itoa(pid) + "/oom_score_adj"
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("oom_score_adj %d for pid %d: %w", v, pid, err)
	}
	defer f.Close()
	if _, err := f.WriteString(strconv.Itoa(v)); err != nil {
		cur, _ := readOOMScoreAdj(pid)
		return fmt.Errorf("oom_score_adj %d for pid %d (now %d; lowering it that far needs CAP_SYS_RESOURCE): %w", v, pid, cur, err)
	}
	return nil
}

// readOOMScoreAdj reads /proc/pid/oom_score_adj.
func readOOMScoreAdj(pid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/oom_score_adj")
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// childrenOf lists the children of pid: those of each of its threads
// (/proc/PID/task/TID/children).
func childrenOf(pid int) ([]int, error) {
	tasks, err := filepath.Glob("/proc/" + strconv.Itoa(pid) + "/task/*/children")
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread ended
		}
		for _, f := range strings.Fields(string(b)) {
			c, err := strconv.Atoi(f)
			if err != nil {
				return nil, fmt.Errorf("%s: %q", t, f)
			}
			pids = append(pids, c)
		}
	}
	return pids, nil
}

// RaiseOOMScoreAdj raises the oom_score_adj of the sandbox's VM and server to v, if theirs is
// lower: a pod's container whose value is higher than the pod's so far (a BestEffort
// container's 1000, say) makes the whole VM, which holds its memory, no better protected than
// it. A lower v changes nothing: the VM's one value covers every container of the pod, and one
// OOM kill takes them all.
func (s *Sandbox) RaiseOOMScoreAdj(v int) error {
	if err := CheckOOMScoreAdj(v); err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	cur, srv, vm := s.oomAdj, s.srv, s.vm
	s.mu.Unlock()
	if cur == nil {
		own, err := readOOMScoreAdj(os.Getpid())
		if err != nil {
			return fmt.Errorf("sandbox %s: the owner's oom_score_adj: %w", s.id, err)
		}
		cur = &own
	}
	if v <= *cur {
		return nil
	}
	if vm != nil && vm.Pid() > 0 && !isClosed(vm.Exited()) {
		if err := setOOMScoreAdj(vm.Pid(), v); err != nil && !isClosed(vm.Exited()) {
			return fmt.Errorf("sandbox %s: the VM: %w", s.id, err)
		}
	}
	if p := srv.process(); p != nil && !isClosed(p.Exited()) {
		if err := setOOMScoreAdj(p.Pid(), v); err != nil && !isClosed(p.Exited()) {
			return fmt.Errorf("sandbox %s: %s: %w", s.id, srv.describe(), err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.oomAdj = &v
	return s.persistLocked()
}
