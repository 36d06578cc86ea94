package podbench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
)

// The CRI runtime handlers the pods are run with (crictl runp --runtime HANDLER): kvfs's
// (as packaging's containerd drop-in names it) and containerd's runc.
const (
	HandlerKvfs = "kvfs"
	HandlerRunc = "runc"
)

// criImage is the busybox image the CRI pods' containers run; the pause image is
// ctrd.PauseImage, busybox sleeping.
const criImage = "localhost/busybox:podbench"

// readyLine is what a pod's container prints first; its appearance in the container's CRI
// log file ends the pod's start.
const readyLine = "ready"

// clockTick is the unit of /proc/PID/stat's CPU times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// CRIRound is one runtime handler's figures for one pod.
type CRIRound struct {
	RunP, Create, Start time.Duration // crictl runp, create and start, each's wall time
	// FirstLine is from running crictl runp to the container's first line in its CRI log
	// file (the file polled every 10 ms).
	FirstLine time.Duration
	// From containerd's log: RunPodSandbox received → StartContainer returned (LogStart), and
	// → the first line's timestamp in the CRI log file (LogLine).
	LogStart, LogLine time.Duration
	StopP, RmP        time.Duration // crictl stopp and rmp, wall time
	Shim              Mem           // the pod's shim
	Server            Mem           // the pod's confined kvfsd, its supervisor and server (kvfs)
	VMM               Mem           // QEMU (kvfs); zero for runc
	Others            Mem           // the shim's other descendants: runc's pause and container
	// StartCPU is the CPU time of the shim and its descendants (theirs and their waited-for
	// children's) from their start to the memory reading; IdleCPU the CPUs they used over the
	// idle window after it (1 is one CPU busy).
	StartCPU time.Duration
	IdleCPU  float64

	pod, ctr   string    // the pod's name, the container's id
	lineStamp  time.Time // the first line's timestamp in the CRI log file
	checkError []string  // VmRSS and smaps_rollup disagreeing
}

// Total is the memory the pod costs the host: shim, kvfsd, QEMU and the other descendants.
func (r CRIRound) Total() Mem { return r.Shim.Add(r.Server).Add(r.VMM).Add(r.Others) }

// CRIReport is a CRI run's results.
type CRIReport struct {
	Config            Config
	Machine           Machine
	Accel, AccelWhy   string
	Started, Finished time.Time
	Rounds            map[string][]CRIRound // by handler
	RSSMismatch       []string              // status VmRSS and smaps_rollup Rss disagreeing by over 5%
}

// RunCRI runs the CRI benchmark: in each round a pod through HandlerKvfs, then one through
// HandlerRunc.
func RunCRI(ctx context.Context, cfg Config) (_ *CRIReport, retErr error) {
	p, err := prepare(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	rep := &CRIReport{Config: cfg, Started: time.Now(), Rounds: map[string][]CRIRound{}, Accel: p.accel, AccelWhy: p.accelWhy}
	rep.Machine = describeMachine(cfg, p.kernel)
	// crictl built with go install does not know its version; scripts/deps.sh stamps it.
	if b, err := os.ReadFile(filepath.Join(cfg.BinDir, ".crictl-version")); err == nil {
		rep.Machine.Crictl = "crictl " + strings.TrimSpace(string(b))
	} else {
		rep.Machine.Crictl = "crictl unknown (" + err.Error() + ")"
	}

	c, err := startCRIRun(cfg, p)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := c.stop(cfg.KeepLog); err != nil && retErr == nil {
			retErr = fmt.Errorf("stopping containerd: %w", err)
		}
	}()

	// A first pod of each, not counted: the image's first unpack, page cache, binaries.
	for _, h := range []string{HandlerKvfs, HandlerRunc} {
		if _, err := criRound(ctx, c, cfg, h, "warmup-"+h); err != nil {
			return nil, fmt.Errorf("warm-up, %s: %w", h, err)
		}
	}
	for i := 1; i <= cfg.Runs; i++ {
		for _, h := range []string{HandlerKvfs, HandlerRunc} {
			r, err := criRound(ctx, c, cfg, h, fmt.Sprintf("pod-%s-%d", h, i))
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", i, h, err)
			}
			for _, m := range r.checkError {
				rep.RSSMismatch = append(rep.RSSMismatch, fmt.Sprintf("round %d %s %s", i, h, m))
			}
			rep.Rounds[h] = append(rep.Rounds[h], r)
			cfg.logf("round %d %s: runp %v, create %v, start %v, first line %v; shim %d KiB, vmm %d KiB, others %d KiB; cpu %v, idle %.3f; stopp %v, rmp %v",
				i, h, r.RunP.Round(time.Millisecond), r.Create.Round(time.Millisecond), r.Start.Round(time.Millisecond), r.FirstLine.Round(time.Millisecond),
				r.Shim.RSS, r.VMM.RSS, r.Others.RSS, r.StartCPU, r.IdleCPU, r.StopP.Round(time.Millisecond), r.RmP.Round(time.Millisecond))
		}
	}
	// The second readings, from containerd's log.
	log, err := c.Log()
	if err != nil {
		return nil, err
	}
	ev, err := ParseCRIEvents(log)
	if err != nil {
		return nil, err
	}
	for _, rs := range rep.Rounds {
		for i := range rs {
			t0, ok := ev.RunPodSandbox[rs[i].pod]
			if !ok {
				continue
			}
			if t, ok := ev.StartContainer[rs[i].ctr]; ok {
				rs[i].LogStart = t.Sub(t0)
			}
			rs[i].LogLine = rs[i].lineStamp.Sub(t0)
		}
	}
	rep.Machine.LoadAfter = report.LoadAvg()
	rep.Finished = time.Now()
	return rep, nil
}

// startCRIRun starts the containerd of a CRI run and imports the busybox image its pods run.
// The caller stops it.
func startCRIRun(cfg Config, p prepared) (*containerd, error) {
	c, err := startContainerd(cfg, p, true)
	if err != nil {
		return nil, err
	}
	cfg.logf("CRI containerd in %s, namespace %s", c.Dir(), c.Namespace())
	if _, err := c.ImportImage(criImage); err != nil {
		return nil, errors.Join(err, c.stop(""))
	}
	return c, nil
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// criRound runs pod name through handler: runp, create and start of a busybox container
// printing readyLine, timed to that line in its log; after cfg.Settle the memory of the
// pod's shim and its descendants, and their CPU over cfg.Idle; then stopp and rmp, timed.
func criRound(ctx context.Context, c *containerd, cfg Config, handler, name string) (CRIRound, error) {
	r := CRIRound{pod: name}
	dir := filepath.Join(c.Dir(), "pods", name)
	logDir := filepath.Join(dir, "logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return r, err
	}
	podJSON, ctrJSON := filepath.Join(dir, "pod.json"), filepath.Join(dir, "ctr.json")
	if err := writeJSON(podJSON, map[string]any{
		"metadata":      map[string]any{"name": name, "namespace": "default", "uid": name},
		"log_directory": logDir,
		// runc's cgroups under the benchmark's own parent, removed at the end.
		"linux": map[string]any{"cgroup_parent": "/" + c.Namespace()},
	}); err != nil {
		return r, err
	}
	if err := writeJSON(ctrJSON, map[string]any{
		"metadata": map[string]any{"name": "c"},
		"image":    map[string]any{"image": criImage},
		"command":  []string{"sh", "-c", "echo " + readyLine + "; exec sleep 3600"},
		"log_path": "c.log",
	}); err != nil {
		return r, err
	}
	timed := func(d *time.Duration, args ...string) (string, error) {
		t := time.Now()
		out, err := c.Crictl(ctx, args...)
		*d = time.Since(t)
		return strings.TrimSpace(out), err
	}
	t0 := time.Now()
	podID, err := timed(&r.RunP, "runp", "--runtime", handler, podJSON)
	if err != nil {
		return r, err
	}
	// However the pod ends, it is removed.
	removed := false
	defer func() {
		if !removed {
			c.Crictl(context.WithoutCancel(ctx), "rmp", "-f", podID)
		}
	}()
	if r.ctr, err = timed(&r.Create, "create", podID, ctrJSON, podJSON); err != nil {
		return r, err
	}
	if _, err := timed(&r.Start, "start", r.ctr); err != nil {
		return r, err
	}
	logPath := filepath.Join(logDir, "c.log")
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(10 * time.Millisecond) {
		b, err := os.ReadFile(logPath)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return r, err
		}
		l, ok, err := FirstCRILine(string(b), readyLine)
		if err != nil {
			return r, fmt.Errorf("%s: %w", logPath, err)
		}
		if ok {
			r.FirstLine, r.lineStamp = time.Since(t0), l.Time
			break
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("no %q in %s 3 minutes after crictl start: %q", readyLine, logPath, b)
		}
		if err := ctx.Err(); err != nil {
			return r, err
		}
	}

	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(cfg.Settle):
	}
	if err := r.readPod(ctx, c, cfg, handler, podID); err != nil {
		return r, err
	}

	if _, err := timed(&r.StopP, "stopp", podID); err != nil {
		return r, err
	}
	if _, err := timed(&r.RmP, "rmp", podID); err != nil {
		return r, err
	}
	removed = true
	return r, nil
}

// readPod reads the memory of the pod's shim and its descendants, and their CPU time now and
// after cfg.Idle.
func (r *CRIRound) readPod(ctx context.Context, c *containerd, cfg Config, handler, podID string) error {
	procs, err := processes()
	if err != nil {
		return err
	}
	bin := shimRunc
	if handler == HandlerKvfs {
		bin = shimKvfs
	}
	// The CRI runs a pod's containers in the shim started for its sandbox: -id POD_ID.
	shim, err := FindShim(procs, bin, ctrd.CRINamespace, podID)
	if err != nil {
		return err
	}
	pids := []int{shim}
	if r.Shim, err = readMem(shim); err != nil {
		return err
	}
	check := func(what string, m Mem) {
		if d := m.StatusRSS - m.RSS; d*20 > m.RSS || -d*20 > m.RSS {
			r.checkError = append(r.checkError, fmt.Sprintf("%s: VmRSS %d KiB, smaps_rollup Rss %d KiB", what, m.StatusRSS, m.RSS))
		}
	}
	check("shim", r.Shim)
	for _, p := range Descendants(procs, shim) {
		m, err := readMem(p.pid)
		if errors.Is(err, os.ErrNotExist) {
			continue
		} else if err != nil {
			return err
		}
		pids = append(pids, p.pid)
		switch {
		case strings.HasPrefix(p.comm, "qemu"):
			r.VMM = r.VMM.Add(m)
			check("qemu", m)
		case isServer(p):
			r.Server = r.Server.Add(m)
		default:
			r.Others = r.Others.Add(m)
		}
	}
	if handler == HandlerKvfs && r.VMM.RSS == 0 {
		return fmt.Errorf("no QEMU under the kvfs shim (pid %d)", shim)
	}
	before, err := cpuTicks(pids)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(cfg.Idle):
	}
	after, err := cpuTicks(pids)
	if err != nil {
		return err
	}
	r.StartCPU = time.Duration(before) * clockTick
	r.IdleCPU = float64(time.Duration(after-before)*clockTick) / float64(cfg.Idle)
	return nil
}

// cpuTicks is the sum of ParseCPUTicks over pids.
func cpuTicks(pids []int) (int64, error) {
	var sum int64
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return 0, fmt.Errorf("pid %d: %w", pid, err)
		}
		n, err := ParseCPUTicks(string(b))
		if err != nil {
			return 0, fmt.Errorf("pid %d: %w", pid, err)
		}
		sum += n
	}
	return sum, nil
}
