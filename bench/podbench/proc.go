package podbench

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kvfs/kvfs/sandbox/serverproc"
)

// Mem is one process's memory, in KiB: VmRSS from /proc/PID/status, Rss and Pss from
// /proc/PID/smaps_rollup (two readings of the same resident set: the check that they agree),
// and Memfd, the Rss of its memfd mappings in /proc/PID/smaps: the guest's RAM (QEMU's memory
// backend, which kvfsd maps too).
type Mem struct {
	StatusRSS, RSS, PSS, Memfd int64
}

// Add is m plus o, field by field.
func (m Mem) Add(o Mem) Mem {
	return Mem{m.StatusRSS + o.StatusRSS, m.RSS + o.RSS, m.PSS + o.PSS, m.Memfd + o.Memfd}
}

// ParseMemfdRss sums the Rss of the mappings in smaps (/proc/PID/smaps's text) whose path
// starts with /memfd:.
func ParseMemfdRss(smaps string) (int64, error) {
	var sum int64
	in := false
	sc := bufio.NewScanner(strings.NewReader(smaps))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) >= 5 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = len(f) >= 6 && strings.HasPrefix(f[5], "/memfd:")
			continue
		}
		if in && len(f) == 3 && f[0] == "Rss:" && f[2] == "kB" {
			n, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("smaps: %q: %w", line, err)
			}
			sum += n
		}
	}
	return sum, sc.Err()
}

// parseKB finds "key: N kB" in a /proc file's text.
func parseKB(text, key string) (int64, error) {
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != key {
			continue
		}
		f := strings.Fields(v)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("%s: %q is not N kB", key, v)
		}
		return strconv.ParseInt(f[0], 10, 64)
	}
	return 0, fmt.Errorf("no %s", key)
}

// ParseMem reads a process's Mem from the text of its status and smaps_rollup.
func ParseMem(status, rollup string) (Mem, error) {
	var m Mem
	var err error
	if m.StatusRSS, err = parseKB(status, "VmRSS"); err != nil {
		return m, fmt.Errorf("status: %w", err)
	}
	if m.RSS, err = parseKB(rollup, "Rss"); err != nil {
		return m, fmt.Errorf("smaps_rollup: %w", err)
	}
	if m.PSS, err = parseKB(rollup, "Pss"); err != nil {
		return m, fmt.Errorf("smaps_rollup: %w", err)
	}
	return m, nil
}

func readMem(pid int) (Mem, error) {
	dir := fmt.Sprintf("/proc/%d", pid)
	st, err := os.ReadFile(filepath.Join(dir, "status"))
	if err != nil {
		return Mem{}, err
	}
	ro, err := os.ReadFile(filepath.Join(dir, "smaps_rollup"))
	if err != nil {
		return Mem{}, err
	}
	m, err := ParseMem(string(st), string(ro))
	if err != nil {
		return m, fmt.Errorf("pid %d: %w", pid, err)
	}
	sm, err := os.ReadFile(filepath.Join(dir, "smaps"))
	if err != nil {
		return m, err
	}
	if m.Memfd, err = ParseMemfdRss(string(sm)); err != nil {
		return m, fmt.Errorf("pid %d: %w", pid, err)
	}
	return m, nil
}

// proc is a process of the machine: its pid, parent and command name.
type proc struct {
	pid, ppid int
	comm      string
	cmdline   []string
}

// ParseStat reads the pid, command name and parent pid from /proc/PID/stat's text (the name
// is in parentheses and may hold spaces and parentheses itself).
func ParseStat(stat string) (pid, ppid int, comm string, err error) {
	open, end := strings.IndexByte(stat, '('), strings.LastIndexByte(stat, ')')
	if open < 0 || end < open {
		return 0, 0, "", fmt.Errorf("stat %q: no (comm)", stat)
	}
	if pid, err = strconv.Atoi(strings.TrimSpace(stat[:open])); err != nil {
		return 0, 0, "", fmt.Errorf("stat: pid: %w", err)
	}
	f := strings.Fields(stat[end+1:])
	if len(f) < 2 {
		return 0, 0, "", fmt.Errorf("stat %q: no ppid", stat)
	}
	if ppid, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, "", fmt.Errorf("stat: ppid: %w", err)
	}
	return pid, ppid, stat[open+1 : end], nil
}

// processes lists the machine's processes (those that vanish while read are skipped).
func processes() ([]proc, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []proc
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		st, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		pid, ppid, comm, err := ParseStat(string(st))
		if err != nil {
			continue
		}
		cl, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		out = append(out, proc{pid: pid, ppid: ppid, comm: comm, cmdline: strings.Split(strings.TrimRight(string(cl), "\x00"), "\x00")})
	}
	return out, nil
}

// isServer reports whether p is one of a sandbox's confined kvfsd processes (its supervisor
// and server, started by the shim from its own executable as serverproc.Argv0).
func isServer(p proc) bool { return len(p.cmdline) > 0 && p.cmdline[0] == serverproc.Argv0 }

// FindShim is the pid of the shim serving container id in namespace ns: a process whose
// argv[0] ends in shimBinary and whose arguments are -namespace ns and -id id (as containerd
// starts a v2 shim), not the short-lived "start" invocation.
func FindShim(procs []proc, shimBinary, ns, id string) (int, error) {
	var found []int
	for _, p := range procs {
		if len(p.cmdline) == 0 || filepath.Base(p.cmdline[0]) != shimBinary {
			continue
		}
		args := map[string]string{}
		start := false
		for i := 1; i < len(p.cmdline); i++ {
			a := p.cmdline[i]
			if strings.HasPrefix(a, "-") && i+1 < len(p.cmdline) && !strings.HasPrefix(p.cmdline[i+1], "-") {
				args[strings.TrimLeft(a, "-")] = p.cmdline[i+1]
				i++
			} else if a == "start" {
				start = true
			}
		}
		if args["namespace"] == ns && args["id"] == id && !start {
			found = append(found, p.pid)
		}
	}
	if len(found) != 1 {
		return 0, fmt.Errorf("%d processes of %s for %s/%s, want 1", len(found), shimBinary, ns, id)
	}
	return found[0], nil
}

// Descendants are the pids of pid's children, their children, and so on.
func Descendants(procs []proc, pid int) []proc {
	kids := map[int][]proc{}
	for _, p := range procs {
		kids[p.ppid] = append(kids[p.ppid], p)
	}
	var out []proc
	todo := []int{pid}
	for len(todo) > 0 {
		n := todo[0]
		todo = todo[1:]
		for _, k := range kids[n] {
			out = append(out, k)
			todo = append(todo, k.pid)
		}
	}
	return out
}
