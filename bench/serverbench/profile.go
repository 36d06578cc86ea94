package serverbench

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/pprof/profile"
)

// cpuProfileEnv makes kvfsd write a CPU profile of its run when it exits (cmd/kvfsd).
const cpuProfileEnv = "KVFSD_CPUPROFILE"

// Profile is a CPU profile of kvfsd (pool 0, cache auto) under one workload, summarised: what
// share of its CPU went to which kind of work, and its heaviest functions.
type Profile struct {
	Workload string
	Ops      int
	Elapsed  time.Duration
	CPU      time.Duration // sampled CPU time of the whole run (set-up included, a few ms)
	Kinds    []Share       // by kind of work, largest first
	Top      []Func        // the heaviest functions by own (flat) time
	Err      string        // why there is no profile
}

// Share is a fraction of the sampled CPU.
type Share struct {
	Kind string
	Frac float64
}

// Func is one function's share of the sampled CPU: its own, and with its callees.
type Func struct {
	Name      string
	Flat, Cum float64
}

// The kinds of work a sample is put in, by the first frame from the leaf up that says which.
const (
	kindSyscall   = "system calls for the file system work (openat, statx, pwritev...), their time in the kernel included"
	kindNotify    = "system calls that wait for and signal the guest: the wait for a kick (epoll_wait), write of the call fd (waking the front-end's thread included)"
	kindScheduler = "Go scheduler and runtime threads (parking, waking, sysmon, entering and leaving system calls)"
	kindGC        = "memory allocation and garbage collection"
	kindGo        = "kvfsd's own Go code (virtqueue, FUSE decoding, passthrough bookkeeping)"
)

var (
	schedulerFuncs = []string{"runtime.schedule", "runtime.findRunnable", "runtime.park_m", "runtime.mcall",
		"runtime.gopark", "runtime.goready", "runtime.ready", "runtime.wakep", "runtime.startm", "runtime.stopm",
		"runtime.mPark", "runtime.note", "runtime.futex", "runtime.sysmon", "runtime.usleep", "runtime.osyield",
		"runtime.netpoll", "runtime.handoffp", "runtime.retake", "runtime.entersyscall", "runtime.exitsyscall",
		"runtime.reentersyscall", "runtime.runqgrab", "runtime.stealWork", "runtime.mstart", "runtime.goexit0",
		"runtime.gosched", "runtime.execute", "runtime.resetspinning", "runtime.lock2", "runtime.unlock2",
		"runtime.semacquire", "runtime.semrelease", "runtime.checkTimers", "runtime.(*timers)",
		"runtime.casgstatus", "runtime.injectglist", "runtime.acquirep", "runtime.releasep", "runtime.runq"}
	gcFuncs = []string{"runtime.mallocgc", "runtime.newobject", "runtime.makeslice", "runtime.growslice",
		"runtime.gc", "runtime.(*gc", "runtime.bgsweep", "runtime.bgscavenge", "runtime.(*mheap)",
		"runtime.(*mcache)", "runtime.(*mcentral)", "runtime.scanobject", "runtime.markroot",
		"runtime.sweepone", "runtime.(*sweepLocked)", "runtime.wbBuf", "runtime.greyobject", "runtime.findObject"}
)

// sampleKind classifies a stack (leaf first).
func sampleKind(funcs []string) string {
	hasPrefix := func(name string, prefixes []string) bool {
		return slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(name, p) })
	}
	for i, f := range funcs {
		switch {
		case hasPrefix(f, schedulerFuncs):
			return kindScheduler
		case hasPrefix(f, gcFuncs):
			return kindGC
		// Package syscall is what x/sys/unix and os call; the runtime's own system calls (netpoll,
		// futex, nanosleep) go through internal/runtime/syscall and are classified by their
		// callers above.
		case strings.HasPrefix(f, "syscall.Syscall"), strings.HasPrefix(f, "syscall.RawSyscall"),
			strings.HasPrefix(f, "syscall.rawSyscall"):
			return syscallKind(funcs[i+1:])
		}
	}
	return kindGo
}

// syscallKind tells a system call of the notification path from one of the file system by the
// first of kvfsd's own functions that made it: the vhost-user package makes the first kind.
func syscallKind(callers []string) string {
	for _, f := range callers {
		if strings.HasPrefix(f, "github.com/kvfs/kvfs/") {
			if strings.HasPrefix(f, "github.com/kvfs/kvfs/virtiofs/vhostuser.") {
				return kindNotify
			}
			return kindSyscall
		}
	}
	return kindSyscall
}

// summarizeProfile reads a CPU profile and summarises it.
func summarizeProfile(path string, top int) (*Profile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	p, err := profile.Parse(f)
	if err != nil {
		return nil, err
	}
	vi := -1
	for i, st := range p.SampleType {
		if st.Type == "cpu" {
			vi = i
		}
	}
	if vi < 0 {
		return nil, errors.New("not a CPU profile")
	}
	var total int64
	kinds := map[string]int64{}
	flat, cum := map[string]int64{}, map[string]int64{}
	for _, s := range p.Sample {
		v := s.Value[vi]
		total += v
		var funcs []string
		seen := map[string]bool{}
		for _, loc := range s.Location {
			for _, ln := range loc.Line { // inlined callees first
				if ln.Function == nil {
					continue
				}
				name := ln.Function.Name
				funcs = append(funcs, name)
				if !seen[name] {
					seen[name] = true
					cum[name] += v
				}
			}
		}
		if len(funcs) > 0 {
			flat[funcs[0]] += v
		}
		kinds[sampleKind(funcs)] += v
	}
	if total == 0 {
		return nil, errors.New("no samples")
	}
	out := &Profile{CPU: time.Duration(total)}
	for k, v := range kinds {
		out.Kinds = append(out.Kinds, Share{k, float64(v) / float64(total)})
	}
	slices.SortFunc(out.Kinds, func(a, b Share) int { return cmpDesc(a.Frac, b.Frac) })
	for name, v := range flat {
		out.Top = append(out.Top, Func{name, float64(v) / float64(total), float64(cum[name]) / float64(total)})
	}
	slices.SortFunc(out.Top, func(a, b Func) int { return cmpDesc(a.Flat, b.Flat) })
	out.Top = out.Top[:min(top, len(out.Top))]
	return out, nil
}

func cmpDesc(a, b float64) int {
	switch {
	case a > b:
		return -1
	case a < b:
		return 1
	}
	return 0
}

// profileWorkload runs w for d on a kvfsd of its own (pool 0, cache auto) that writes a CPU
// profile, and summarises the profile. The raw profile is kept at keep if not empty.
func profileWorkload(ctx context.Context, cfg *Config, sh *share, runDir string, w workload, d time.Duration, keep string) *Profile {
	res := &Profile{Workload: w.Name}
	slug := strings.NewReplacer(" ", "-", "+", "-", ",", "").Replace(w.Name)
	path := filepath.Join(runDir, "profile-"+slug+".pprof")
	if keep != "" {
		path = keep
	}
	sock := filepath.Join(runDir, "profile-"+slug+".sock")
	argv := []string{cfg.Kvfsd, "--socket-path=" + sock, "-o", "source=" + sh.dir, "-o", "cache=auto"}
	dm, err := startDaemonEnv(argv, []string{cpuProfileEnv + "=" + path}, filepath.Join(runDir, "profile-"+slug+".log"))
	if err != nil {
		res.Err = err.Error()
		return res
	}
	err = func() error {
		ctx, cancel := context.WithTimeout(ctx, d+2*time.Minute)
		defer cancel()
		if err := dm.waitSocket(ctx, sock); err != nil {
			return err
		}
		cdir := "create-profile-" + slug
		if err := os.Mkdir(filepath.Join(sh.dir, cdir), 0o755); err != nil {
			return err
		}
		s, err := dialServer(ctx, dm, sock, sh, cdir)
		if err != nil {
			return err
		}
		m := newMeter(d, s.usage, nil)
		err = w.run(ctx, s, m, 1)
		m.stop()
		res.Ops, res.Elapsed = m.ops, m.end.Sub(m.begin)
		s.close() // kvfsd writes the profile as it exits, when the front-end has gone
		return err
	}()
	dm.stop()
	if err == nil {
		var p *Profile
		if p, err = summarizeProfile(path, 12); err == nil {
			p.Workload, p.Ops, p.Elapsed = res.Workload, res.Ops, res.Elapsed
			return p
		}
	}
	res.Err = err.Error()
	return res
}

// kind returns the share of one kind of work (0 if none).
func (p *Profile) kind(k string) float64 {
	for _, s := range p.Kinds {
		if s.Kind == k {
			return s.Frac
		}
	}
	return 0
}

// cpuPerOp is the sampled CPU per operation in µs.
func (p *Profile) cpuPerOp() float64 {
	return float64(p.CPU) / float64(time.Microsecond) / float64(max(p.Ops, 1))
}

// profiledWorkloads are the workloads whose profile the report shows: a metadata one and a
// small I/O one, where the targets are furthest off.
var profiledWorkloads = []string{"LOOKUP+GETATTR", "WRITE 4 KiB random QD1"}
