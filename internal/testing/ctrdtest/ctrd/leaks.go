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

	"golang.org/x/sys/unix"
)

// Snapshot is what a containerd holds at one moment, as the leak check sees it.
type Snapshot struct {
	// Processes are those of the containerd's cgroups (every process it started, and theirs,
	// even once orphaned: see cgroup.go), those whose command line names the containerd's
	// directory (its shims, by the -address argument containerd gives them) or a LeakDir (a
	// VM of a sandbox there), and the descendants of containerd and of those. containerd
	// itself is not among them.
	Processes []Process
	// Mounts are the mount points under the containerd's directory and the LeakDirs, in the
	// caller's mount namespace and in containerd's.
	Mounts []string
	// Cgroups are the cgroups in the containerd's namespace (ctr makes /NAMESPACE/ID in each
	// hierarchy), but for the containerd's own there (cgroup.go), and the runc state
	// directories in it (/run/containerd/runc/NAMESPACE/ID).
	Cgroups []string
	// Entries are the entries of the LeakDirs (a sandbox directory per pod, say).
	Entries []string
	// FDs are containerd's open descriptors by what they are ("socket", "pipe", a path),
	// with how many of each; nil once containerd has exited.
	FDs map[string]int
	// FDsOf is the pid of the containerd process FDs are of (Restart starts another).
	FDsOf int
}

// Process is a process of the machine.
type Process struct {
	PID     int
	PPID    int
	Start   uint64 // start time in clock ticks since boot: a pid and its start name one process
	State   byte   // 'R', 'S', 'Z'...
	Cmdline string
}

func (p Process) String() string { return fmt.Sprintf("pid %d (%s)", p.PID, p.Cmdline) }

// Alive reports whether p still runs: its pid names the same process (by its start time),
// and that is not a zombie.
func (p Process) Alive() bool {
	q, err := readProcess(p.PID)
	return err == nil && q.Start == p.Start && q.State != 'Z'
}

// Snapshot takes a snapshot of the containerd.
func (c *Containerd) Snapshot() (Snapshot, error) { return c.snapshot() }

// Leaks is what the containerd holds now that it did not hold at before: a process, a mount,
// a cgroup or runc state directory, an entry of a LeakDir, or more open descriptors of a kind
// (Diff). What goes away by itself is given timeout to go (a shim exits shortly after its
// last task is deleted).
func (c *Containerd) Leaks(before Snapshot, timeout time.Duration) ([]string, error) {
	deadline := time.Now().Add(timeout)
	for {
		now, err := c.snapshot()
		if err != nil {
			return nil, err
		}
		l := Diff(before, now)
		if len(l) == 0 || time.Now().After(deadline) {
			return l, nil
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Diff describes what now holds and before did not, a line for each thing.
func Diff(before, now Snapshot) []string {
	var out []string
	for _, p := range newProcesses(before, now) {
		out = append(out, "process "+p.String())
	}
	for _, l := range []struct {
		what        string
		before, now []string
	}{
		{"mount", before.Mounts, now.Mounts},
		{"cgroup or runc state", before.Cgroups, now.Cgroups},
		{"entry", before.Entries, now.Entries},
	} {
		for _, x := range l.now {
			if !slices.Contains(l.before, x) {
				out = append(out, l.what+" "+x)
			}
		}
	}
	if before.FDs != nil && now.FDs != nil && before.FDsOf == now.FDsOf {
		kinds := make([]string, 0, len(now.FDs))
		for k := range now.FDs {
			kinds = append(kinds, k)
		}
		slices.Sort(kinds)
		for _, k := range kinds {
			if n, was := now.FDs[k], before.FDs[k]; n > was {
				out = append(out, fmt.Sprintf("containerd's descriptors to %s: %d, were %d", k, n, was))
			}
		}
	}
	return out
}

func (c *Containerd) snapshot() (Snapshot, error) {
	var s Snapshot
	var err error
	if s.Processes, err = c.processes(); err != nil {
		return s, err
	}
	if s.Mounts, err = c.mounts(); err != nil {
		return s, err
	}
	if s.Cgroups, err = c.cgroups(); err != nil {
		return s, err
	}
	for _, d := range c.opts.LeakDirs {
		ents, err := os.ReadDir(d)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return s, err
		}
		for _, e := range ents {
			s.Entries = append(s.Entries, filepath.Join(d, e.Name()))
		}
	}
	select {
	case <-c.exited:
	default:
		fds, err := openFDs(c.PID())
		if err != nil {
			return s, err
		}
		s.FDs, s.FDsOf = fds, c.PID()
	}
	return s, nil
}

// watched are the directories whose mounts and whose naming processes are the containerd's.
func (c *Containerd) watched() []string {
	return append([]string{c.dir}, c.opts.LeakDirs...)
}

func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// processes lists the containerd's processes (see Snapshot.Processes).
func (c *Containerd) processes() ([]Process, error) {
	all, err := allProcesses()
	if err != nil {
		return nil, err
	}
	self := c.PID()
	queue := []int{self}
	select {
	case <-c.exited:
		self, queue = 0, nil // the pid may name another process by now
	default:
	}
	mine := map[int]bool{}
	children := map[int][]int{}
	for _, p := range all {
		children[p.PPID] = append(children[p.PPID], p.PID)
		if p.PID == self || p.PID == os.Getpid() {
			continue
		}
		for _, d := range c.watched() {
			if names(p.Cmdline, d) {
				mine[p.PID] = true
			}
		}
	}
	// Every process of the containerd's cgroups, wherever it was reparented to.
	pids, err := cgroupPIDs(filepath.Dir(c.cgroup))
	if err != nil {
		return nil, err
	}
	for _, pid := range pids {
		if pid != self {
			mine[pid] = true
		}
	}
	// Descendants of containerd and of the processes found so far.
	for pid := range mine {
		queue = append(queue, pid)
	}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		for _, child := range children[pid] {
			if !mine[child] {
				mine[child] = true
				queue = append(queue, child)
			}
		}
	}
	var out []Process
	for _, p := range all {
		if mine[p.PID] {
			out = append(out, p)
		}
	}
	return out, nil
}

// names reports whether the command line holds the path dir or a path under it: dir not
// followed by more of a file name (so /tmp/ctrd-12 is not named by /tmp/ctrd-123/x).
func names(cmdline, dir string) bool {
	for i := 0; ; {
		j := strings.Index(cmdline[i:], dir)
		if j < 0 {
			return false
		}
		end := i + j + len(dir)
		if end == len(cmdline) || !isNameByte(cmdline[end]) {
			return true
		}
		i = i + j + 1
	}
}

func isNameByte(b byte) bool {
	return b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '.' || b == '_' || b == '-'
}

// allProcesses reads /proc. A process that exits while it is read is left out.
func allProcesses() ([]Process, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []Process
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		p, err := readProcess(pid)
		if err != nil {
			continue
		}
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Process) int { return a.PID - b.PID })
	return out, nil
}

func readProcess(pid int) (Process, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return Process{}, err
	}
	// pid (comm) state ppid ... with starttime field 22; comm may hold spaces and parentheses.
	i := strings.LastIndexByte(string(stat), ')')
	if i < 0 {
		return Process{}, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 20 || len(f[0]) != 1 {
		return Process{}, fmt.Errorf("/proc/%d/stat: %q", pid, stat)
	}
	ppid, err := strconv.Atoi(f[1])
	if err != nil {
		return Process{}, err
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return Process{}, err
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return Process{}, err
	}
	return Process{
		PID:     pid,
		PPID:    ppid,
		Start:   start,
		State:   f[0][0],
		Cmdline: strings.TrimSpace(strings.ReplaceAll(string(cmdline), "\x00", " ")),
	}, nil
}

// OwnMounts lists the mount points under dir in the caller's own mount namespace, where
// containerd's mounts do not show (they are in its own).
func OwnMounts(dir string) ([]string, error) {
	all, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, mp := range all {
		if under(mp.point, dir) {
			out = append(out, mp.point)
		}
	}
	return out, nil
}

// mounts lists the mount points under the watched directories, deepest first: the caller's
// own (its mount namespace) and, while containerd runs, those in containerd's mount namespace,
// where its shims mount.
func (c *Containerd) mounts() ([]string, error) {
	all, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	select {
	case <-c.exited:
	default:
		theirs, err := mountPoints(fmt.Sprintf("/proc/%d/mountinfo", c.PID()))
		if err != nil {
			return nil, err
		}
		all = append(all, theirs...)
	}
	var out []string
	for _, mp := range all {
		for _, d := range c.watched() {
			if under(mp.point, d) && !slices.Contains(out, mp.point) {
				out = append(out, mp.point)
				break
			}
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out, nil
}

type mountPoint struct{ point, fstype string }

// mountPoints reads a mountinfo file.
func mountPoints(mountinfo string) ([]mountPoint, error) {
	b, err := os.ReadFile(mountinfo)
	if err != nil {
		return nil, err
	}
	var out []mountPoint
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		// id parent major:minor root mount-point options [optional...] - fstype source super-options
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if len(f) < 5 || sep < 0 || sep+1 >= len(f) {
			return nil, fmt.Errorf("%s: bad line %q", mountinfo, line)
		}
		out = append(out, mountPoint{point: unescapeMount(f[4]), fstype: f[sep+1]})
	}
	return out, nil
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space, \134 for a backslash).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// namespaceDirs are the directories that hold what runc and ctr make for the namespace: one
// per cgroup hierarchy, and runc's state directory.
func (c *Containerd) namespaceDirs() ([]string, error) {
	all, err := mountPoints("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var dirs []string
	for _, mp := range all {
		if (mp.fstype == "cgroup" || mp.fstype == "cgroup2") && !slices.Contains(dirs, filepath.Join(mp.point, c.namespace)) {
			dirs = append(dirs, filepath.Join(mp.point, c.namespace))
		}
	}
	return append(dirs, filepath.Join(runcRoot, c.namespace)), nil
}

// runcRoot is where containerd's runc shim has runc keep its state, by namespace.
const runcRoot = "/run/containerd/runc"

// cgroups lists the entries of the namespace's directories (see Snapshot.Cgroups), but for
// the containerd's own cgroup.
func (c *Containerd) cgroups() ([]string, error) {
	dirs, err := c.namespaceDirs()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, d := range dirs {
		ents, err := os.ReadDir(d)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if p := filepath.Join(d, e.Name()); e.IsDir() && p != c.cgroup {
				out = append(out, p)
			}
		}
	}
	return out, nil
}

// openFDs counts pid's open descriptors by what they are: a path, or for sockets, pipes and
// anonymous inodes their kind ("socket", "pipe", "anon_inode:[eventpoll]"). Pidfds are not
// counted: containerd makes a user-namespaced pod's network namespace (pkg/sys's
// UnshareAfterEnterUserns) with a process started by os.StartProcess with a PidFD, which Go
// dups for the os.Process containerd never waits for or releases, so containerd holds one per
// such pod until its next garbage collection: containerd's own, nothing a runtime can leak.
func openFDs(pid int) (map[string]int, error) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // closed meanwhile
		}
		if kind, _, ok := strings.Cut(target, ":["); ok && (kind == "socket" || kind == "pipe") {
			target = kind
		}
		if target == "anon_inode:[pidfd]" {
			continue
		}
		out[target]++
	}
	return out, nil
}

// kill sends SIGKILL to p through a pidfd, after checking that the pid still names p.
func kill(p Process) error {
	fd, err := unix.PidfdOpen(p.PID, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil
		}
		return err
	}
	defer unix.Close(fd)
	now, err := readProcess(p.PID)
	if err != nil || now.Start != p.Start {
		return nil // gone, or the pid names another process now
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}
