package serverbench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// userHZ is the unit of the times in /proc/PID/stat (USER_HZ, 100 on every Linux ABI).
const userHZ = 100

// processCPU returns the user plus system CPU time the process pid has used, and the system
// time alone, all its threads included, from /proc/PID/stat (resolution 10 ms).
func processCPU(pid int) (cpu, system time.Duration, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) is in parentheses and may contain anything; fields start after
	// its closing parenthesis with field 3 (state). utime and stime are fields 14 and 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	var ticks [2]uint64 // utime, stime
	for j, s := range f[11:13] {
		n, err := strconv.ParseUint(string(s), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks[j] = n
	}
	tick := func(n uint64) time.Duration { return time.Duration(n) * time.Second / userHZ }
	return tick(ticks[0] + ticks[1]), tick(ticks[1]), nil
}

// usage is what a process has consumed so far.
type usage struct {
	CPU      time.Duration // user + system time, all threads
	System   time.Duration // the system (kernel) part of CPU
	Switches uint64        // voluntary + involuntary context switches of its live threads
}

func (u usage) add(v usage) usage {
	return usage{u.CPU + v.CPU, u.System + v.System, u.Switches + v.Switches}
}

func (u usage) sub(v usage) usage {
	return usage{u.CPU - v.CPU, u.System - v.System, u.Switches - v.Switches}
}

// processUsage returns the usage of the process pid. The CPU time includes threads that have
// exited; the context switches are summed over the threads alive now (the kernel keeps no
// process total of them).
func processUsage(pid int) (usage, error) {
	cpu, sys, err := processCPU(pid)
	if err != nil {
		return usage{}, err
	}
	u := usage{CPU: cpu, System: sys}
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, _ := os.ReadDir(dir)
	for _, task := range tasks {
		b, err := os.ReadFile(dir + task.Name() + "/status")
		if err != nil {
			continue // a thread that has just exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(line, ":")
			if ok && (k == "voluntary_ctxt_switches" || k == "nonvoluntary_ctxt_switches") {
				n, _ := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				u.Switches += n
			}
		}
	}
	return u, nil
}

// treeUsage returns the usage of the process pid and all its descendants, and their PIDs. The C
// virtiofsd forks into its sandbox (new PID and mount namespaces) and serves from the child;
// kvfsd serves from the process itself.
func treeUsage(pid int) (usage, []int, error) {
	var total usage
	var pids []int
	queue := []int{pid}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		u, err := processUsage(p)
		if err != nil {
			if p == pid || !errors.Is(err, os.ErrNotExist) {
				return usage{}, nil, err
			}
			continue // a descendant that has just exited
		}
		total = total.add(u)
		pids = append(pids, p)
		tasks, _ := os.ReadDir("/proc/" + strconv.Itoa(p) + "/task")
		for _, task := range tasks {
			b, _ := os.ReadFile("/proc/" + strconv.Itoa(p) + "/task/" + task.Name() + "/children")
			for _, f := range bytes.Fields(b) {
				if c, err := strconv.Atoi(string(f)); err == nil {
					queue = append(queue, c)
				}
			}
		}
	}
	return total, pids, nil
}

// daemon is a server process started for the benchmark.
type daemon struct {
	cmd    *exec.Cmd
	pids   map[int]bool  // the process and the descendants seen by usage
	log    string        // its stdout and stderr
	exited chan struct{} // closed when it has exited
	err    error         // cmd.Wait's result; valid once exited is closed
}

// startDaemon starts argv with its output going to the file logPath.
func startDaemon(argv []string, logPath string) (*daemon, error) {
	return startDaemonEnv(argv, nil, logPath)
}

// startDaemonEnv is startDaemon with env added to this process's environment.
func startDaemonEnv(argv, env []string, logPath string) (*daemon, error) {
	lf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer lf.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = lf, lf
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	d := &daemon{cmd: cmd, log: logPath, exited: make(chan struct{}), pids: map[int]bool{cmd.Process.Pid: true}}
	go func() {
		d.err = cmd.Wait()
		close(d.exited)
	}()
	return d, nil
}

// usage returns what the daemon and its descendants have consumed.
func (d *daemon) usage() (usage, error) {
	u, pids, err := treeUsage(d.cmd.Process.Pid)
	for _, p := range pids {
		d.pids[p] = true
	}
	return u, err
}

// seccompAudit returns what the kernel's audit log says about a seccomp kill of one of the
// daemon's processes, or "" if it cannot
// tell (dmesg unreadable, or no such record).
func (d *daemon) seccompAudit() string {
	out, err := exec.Command("dmesg").Output()
	if err != nil {
		return ""
	}
	var found string
	for _, line := range strings.Split(string(out), "\n") {
		if !strings.Contains(line, "type=1326") || !strings.Contains(line, "sig=31") {
			continue
		}
		f := auditFields(line)
		pid, _ := strconv.Atoi(f["pid"])
		if !d.pids[pid] {
			continue
		}
		nr, _ := strconv.Atoi(f["syscall"])
		name := syscallNames[nr]
		if name == "" {
			name = "a system call"
		}
		found = fmt.Sprintf("the kernel's audit log shows SIGSYS for %s (syscall %d on x86-64) in its thread %s", name, nr, f["comm"])
	}
	return found
}

// syscallNames are the x86-64 numbers of the system calls a seccomp-killed virtiofsd has been
// seen to make.
var syscallNames = map[int]string{204: "sched_getaffinity", 203: "sched_setaffinity", 315: "sched_getattr", 314: "sched_setattr"}

// auditFields parses the key=value pairs of an audit record.
func auditFields(line string) map[string]string {
	f := map[string]string{}
	for _, kv := range strings.Fields(line) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			f[k] = v
		}
	}
	return f
}

// dead reports whether the process has exited, waiting up to grace for it to do so.
func (d *daemon) dead(grace time.Duration) bool {
	select {
	case <-d.exited:
		return true
	case <-time.After(grace):
		return false
	}
}

// waitSocket waits until the daemon has created its listening socket at path, or has died.
func (d *daemon) waitSocket(ctx context.Context, path string) error {
	for {
		if _, err := os.Stat(path); err == nil {
			return nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		select {
		case <-d.exited:
			return fmt.Errorf("exited before listening: %s", d.exitReason())
		case <-ctx.Done():
			return fmt.Errorf("no socket at %s: %w", path, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// exitReason describes how the daemon ended; call it once exited is closed.
func (d *daemon) exitReason() string {
	var ee *exec.ExitError
	if !errors.As(d.err, &ee) {
		if d.err == nil {
			return "exited with status 0"
		}
		return d.err.Error()
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	switch {
	case ok && ws.Signaled() && ws.Signal() == syscall.SIGSYS:
		return seccompKilled
	case ok && ws.Signaled():
		return "killed by signal " + ws.Signal().String()
	}
	return fmt.Sprintf("exited with status %d", ee.ExitCode())
}

// deathReason describes how the daemon ended, looking past the C virtiofsd's sandbox: it serves
// from a forked child, and when that child is killed the parent exits with status 1. A seccomp
// kill is then recognised by the kernel's audit record, which detail describes.
func (d *daemon) deathReason() (reason, detail string) {
	reason, detail = d.exitReason(), d.seccompAudit()
	if detail != "" {
		reason = seccompKilled
	}
	return reason, detail
}

const seccompKilled = "killed by its seccomp filter"

// stop waits for the daemon to exit (both servers exit when their front-end disconnects), then
// sends SIGTERM, then SIGKILL.
func (d *daemon) stop() {
	for _, sig := range []os.Signal{nil, syscall.SIGTERM, syscall.SIGKILL} {
		if sig != nil {
			d.cmd.Process.Signal(sig)
		}
		if d.dead(3 * time.Second) {
			return
		}
	}
	<-d.exited
}

// logTail returns the last lines of the daemon's output, for error messages.
func (d *daemon) logTail() string {
	b, _ := os.ReadFile(d.log)
	const max = 2000
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return string(bytes.TrimSpace(b))
}
