package serverbench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/procstatus"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// memoryName is the name -run matches to select the memory measurement.
const memoryName = "memory"

// memoryDir is the directory of the files the memory measurement looks up.
const memoryDir = "memory"

// memServer is one server configuration of the memory measurement.
type memServer struct {
	Name   string // as the report shows it
	Server string // kvfsd or virtiofsd
	Args   []string
}

func memoryServers() []memServer {
	return []memServer{
		{"kvfsd --inode-file-handles=never", kvfsd, []string{"--inode-file-handles=never"}},
		{"kvfsd --inode-file-handles=mandatory", kvfsd, []string{"--inode-file-handles=mandatory"}},
		{"C virtiofsd", virtiofsd, nil},
	}
}

// memSample is what a server's processes hold at one moment, summed over the process tree.
type memSample struct {
	RSS, Anon int64 // VmRSS and RssAnon, bytes
	Fds       int   // open descriptors
}

// MemoryResult is the memory measurement of one server.
type MemoryResult struct {
	Server      string
	Files       int       // files it was asked to look up
	Looked      int       // distinct files it looked up, each kept cached (no FORGET)
	Stopped     string    // why it stopped short of Files ("" if it did not)
	Idle, After memSample // after INIT, and after the lookups
	Nofile      string    // its RLIMIT_NOFILE (soft limit) while serving
	Err         string    // why there are no figures
}

func (r MemoryResult) perInode(f func(memSample) int64) float64 {
	if r.Looked == 0 {
		return 0
	}
	return float64(f(r.After)-f(r.Idle)) / float64(r.Looked)
}

// makeMemoryFiles creates n empty files in memoryDir of the share.
func makeMemoryFiles(sh *share, n int) ([]string, error) {
	dir := filepath.Join(sh.dir, memoryDir)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	width := len(strconv.Itoa(n - 1))
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("m%0*d", width, i)
		if err := unix.Mknod(filepath.Join(dir, names[i]), unix.S_IFREG|0o644, 0); err != nil {
			return nil, err
		}
	}
	return names, nil
}

// measureMemory measures each memory server in turn, alone: started fresh, connected, idle
// after INIT, then after looking up every file of memoryDir once, as a guest that keeps them
// all cached.
func measureMemory(ctx context.Context, cfg *Config, sh *share, runDir string, logf func(string, ...any)) ([]MemoryResult, error) {
	names, err := makeMemoryFiles(sh, cfg.MemoryFiles)
	if err != nil {
		return nil, fmt.Errorf("making the files of the memory measurement: %w", err)
	}
	var out []MemoryResult
	for i, ms := range memoryServers() {
		r := MemoryResult{Server: ms.Name, Files: len(names)}
		if err := measureMemory1(ctx, cfg, sh, filepath.Join(runDir, fmt.Sprintf("memory%d", i)), ms, names, &r); err != nil {
			r.Err = err.Error()
			logf("kvfsbench: memory, %s: %v", ms.Name, err)
		} else {
			logf("memory  %-38s idle %6.1f MiB  after %d lookups %6.1f MiB  %4.0f B/inode  fds %d -> %d",
				ms.Name, mib(r.Idle.RSS), r.Looked, mib(r.After.RSS), r.perInode(func(s memSample) int64 { return s.RSS }),
				r.Idle.Fds, r.After.Fds)
		}
		out = append(out, r)
	}
	return out, nil
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

func measureMemory1(ctx context.Context, cfg *Config, sh *share, base string, ms memServer, names []string, r *MemoryResult) error {
	bin := cfg.Kvfsd
	if ms.Server == virtiofsd {
		bin = cfg.Virtiofsd
	}
	sock := base + ".sock"
	argv := append([]string{bin, "--socket-path=" + sock, "-o", "source=" + sh.dir, "-o", "cache=auto"}, ms.Args...)
	d, err := startDaemon(argv, base+".log")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	var fe *frontend.Frontend
	defer func() {
		if fe != nil {
			fe.Close()
		}
		d.stop()
	}()
	fail := func(err error) error {
		if d.dead(time.Second) {
			return fmt.Errorf("%w; the server %s; its output:\n%s", err, d.exitReason(), d.logTail())
		}
		return err
	}
	if err := d.waitSocket(ctx, sock); err != nil {
		return fail(err)
	}
	if fe, err = frontend.Dial(ctx, sock, frontend.Options{}); err != nil {
		return fail(err)
	}
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		return fail(fmt.Errorf("INIT: %w", err))
	}
	dir, err := c.Lookup(ctx, 1, memoryDir)
	if err != nil {
		return fail(fmt.Errorf("LOOKUP %s: %w", memoryDir, err))
	}
	if r.Idle, err = sampleMemory(d); err != nil {
		return err
	}
	r.Nofile = nofileLimit(d)
	seen := make(map[uint64]bool, len(names))
	for _, name := range names {
		e, err := c.Lookup(ctx, dir.NodeID, name)
		if err != nil {
			var errno unix.Errno
			if !errors.As(err, &errno) {
				return fail(fmt.Errorf("LOOKUP %s: %w", name, err))
			}
			r.Stopped = fmt.Sprintf("LOOKUP answered %s (%v)", unix.ErrnoName(errno), errno)
			break
		}
		if seen[e.NodeID] {
			return fmt.Errorf("LOOKUP %s: node %d again", name, e.NodeID)
		}
		seen[e.NodeID] = true
	}
	r.Looked = len(seen)
	if r.After, err = sampleMemory(d); err != nil {
		return err
	}
	if d.dead(0) {
		return fail(errors.New("died during the lookups"))
	}
	return nil
}

// sampleMemory sums VmRSS, RssAnon and the open descriptors over the daemon's processes (the C
// virtiofsd serves from a child it forks into its sandbox; its parent waits).
func sampleMemory(d *daemon) (memSample, error) {
	_, pids, err := treeUsage(d.cmd.Process.Pid)
	if err != nil {
		return memSample{}, err
	}
	var s memSample
	for _, pid := range pids {
		st, err := procstatus.ReadPID(pid)
		if err != nil {
			return memSample{}, err
		}
		rss, err := st.Bytes("VmRSS")
		if err != nil {
			return memSample{}, fmt.Errorf("/proc/%d/%w", pid, err)
		}
		anon, err := st.Bytes("RssAnon")
		if err != nil {
			return memSample{}, fmt.Errorf("/proc/%d/%w", pid, err)
		}
		s.RSS += rss
		s.Anon += anon
		fds, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
		if err != nil {
			return memSample{}, err
		}
		s.Fds += len(fds)
	}
	return s, nil
}

// nofileLimit is the soft RLIMIT_NOFILE of the daemon's serving process (the last of its tree),
// from /proc/PID/limits, or "?".
func nofileLimit(d *daemon) string {
	_, pids, err := treeUsage(d.cmd.Process.Pid)
	if err != nil || len(pids) == 0 {
		return "?"
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pids[len(pids)-1]) + "/limits")
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Max open files"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				return f[0]
			}
		}
	}
	return "?"
}

// writeMemory renders the memory section of the report; with standalone (only the memory
// measurement ran) it says how and where it ran too.
func writeMemory(p func(string, ...any), res *Results, standalone bool) {
	cfg, m := &res.Config, &res.Machine
	p("## Memory: RSS idle and with %d cached inodes\n\n", cfg.MemoryFiles)
	if standalone {
		p("- **Command:** `%s`\n", cfg.Command)
		p("- **Date:** %s\n", res.Started.UTC().Format("2006-01-02 15:04 MST"))
		p("- **Machine:** %d CPUs, %s RAM, %s\n", m.CPUs, m.MemTotal, m.Kernel)
		p("- **Versions:** kvfsd: %s; C virtiofsd: %s\n\n", m.Kvfsd, m.Virtiofsd)
	}
	p("Each server is started alone on the shared directory (%s, `-o cache=auto`), connected through the in-repo front-end, and sent INIT and a LOOKUP of the directory; ", m.FSType)
	p("then its memory is read (**idle**). The front-end then plays a guest that looks up %d distinct files of that directory, one LOOKUP each, and keeps them all cached (no FORGET), ", cfg.MemoryFiles)
	p("and the memory is read again (**after**). RSS is `VmRSS` and anon is `RssAnon` of `/proc/PID/status`, summed over the server's processes (the C virtiofsd serves from a child it forks into its sandbox; the parent waits); fds are the open descriptors of those processes. ")
	p("**Bytes per cached inode** = (RSS after − RSS idle) ÷ inodes cached. It is what the host sees, Go's garbage not yet collected included; it does not count host kernel memory: an inode held by an O_PATH descriptor also pins a `struct file`, a dentry and an inode in the host kernel, which a file handle does not. ")
	p("A server whose LOOKUP fails stops there (a server holding a descriptor per inode runs into RLIMIT_NOFILE, given as limit), and its figures are for the inodes it did cache.\n\n")
	p("| server | inodes cached | RSS idle | RSS after | bytes/inode (RSS) | anon idle | anon after | bytes/inode (anon) | fds idle | fds after | RLIMIT_NOFILE |\n")
	p("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range res.Memory {
		if r.Err != "" {
			p("| %s | n/a (%s) | | | | | | | | | |\n", r.Server, strings.ReplaceAll(firstLineOf(r.Err), "|", "/"))
			continue
		}
		looked := strconv.Itoa(r.Looked)
		if r.Stopped != "" {
			looked += " of " + strconv.Itoa(r.Files) + ": " + r.Stopped
		}
		p("| %s | %s | %.1f MiB | %.1f MiB | %.0f | %.1f MiB | %.1f MiB | %.0f | %d | %d | %s |\n",
			r.Server, looked, mib(r.Idle.RSS), mib(r.After.RSS), r.perInode(func(s memSample) int64 { return s.RSS }),
			mib(r.Idle.Anon), mib(r.After.Anon), r.perInode(func(s memSample) int64 { return s.Anon }),
			r.Idle.Fds, r.After.Fds, r.Nofile)
	}
	p("\n")
}

func firstLineOf(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
