package podbench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/ociimage"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
)

// The two runtimes, as ctr names them, and their shims' binaries.
const (
	RuntimeKvfs = "io.containerd.kvfs.v2"
	RuntimeRunc = "io.containerd.runc.v2"
	shimKvfs    = "containerd-shim-kvfs-v2"
	shimRunc    = "containerd-shim-runc-v2"
)

// Config configures a run.
type Config struct {
	Runs     int    // rounds; each runs both runtimes, kvfs first
	ShimDir  string // holds containerd-shim-kvfs-v2
	BinDir   string // containerd, ctr and containerd-shim-runc-v2 (scripts/deps.sh)
	GuestDir string // the agent guest image (packaging/guest/build.sh --agent)
	Accel    string // "" for what a probe boot of ProbeGuest finds (vmtest.Accel)
	Memory   string // the guest's memory (vm.memory)
	QEMU     string // the emulator (vm.qemu), for the pods and the floor
	VCPUs    int    // the guest's vCPUs (vm.vcpus)
	// VMTOML is more of the kvfs configuration's [vm] table, as TOML lines
	// ("free_page_reporting = false"), for comparisons of one setting.
	VMTOML string
	Settle time.Duration // wait after a sleep container started before its memory is read
	// Density is how many pods of each runtime run at once, after the rounds, for their
	// memory per pod (0: none).
	Density int
	KeepLog string        // where containerd's log is copied at the end; "" for nowhere
	CRI     bool          // pods through the CRI (crictl) instead of ctr (RunCRI)
	Idle    time.Duration // CRI: how long a running pod's CPU use is measured for
	// ProbeGuest is the test guest (packaging/guest/build.sh DIR) that, with Accel empty, a
	// KVM boot is tried with: /dev/kvm can open on a host where KVM boots fail or hang.
	ProbeGuest string

	Command, Invoked, Rev string // for the report
	Progress              io.Writer
}

// PodMem is the memory a pod costs the host, by process.
type PodMem struct {
	Shim      Mem // the shim process
	Server    Mem // the pod's confined kvfsd, its supervisor and server (kvfs); zero for runc
	VMM       Mem // QEMU (kvfs); zero for runc
	Container Mem // the shim's other descendants: the container's processes (runc)
}

// Total is the memory a pod costs the host: shim, kvfsd, QEMU and the container's processes.
func (m PodMem) Total() Mem { return m.Shim.Add(m.Server).Add(m.VMM).Add(m.Container) }

// Add is m plus o, process by process.
func (m PodMem) Add(o PodMem) PodMem {
	return PodMem{m.Shim.Add(o.Shim), m.Server.Add(o.Server), m.VMM.Add(o.VMM), m.Container.Add(o.Container)}
}

// Round is one runtime's figures in one round.
type Round struct {
	Run      time.Duration // ctr run --rm ... true, wall time
	RunSpan  time.Duration // the same run in containerd's log: connecting to shim → shim disconnected
	Detached time.Duration // ctr run -d ... sleep, wall time (Create and Start, until ctr has the task running)
	PodMem                 // the sleep container's pod
	Boot     map[string]time.Duration
	// Floor (kvfs) is the round's boot of the same QEMU and kernel to an /init that powers off
	// at once (floorBoot), measured just before the kvfs run.
	Floor time.Duration
	// StartedAt is when `ctr run -d` returned (wall clock, as containerd's log); CreateStart
	// is from the detached run's shim connection to then, in containerd's log, and
	// AnswerToStarted (kvfs) from its agent's answer to then: Create's rest and Start.
	StartedAt                    time.Time
	CreateStart, AnswerToStarted time.Duration
	// AfterAnswer is the kvfs run's time from the agent's answer to the shim's disconnect
	// (the container made, started, run and deleted in the guest, the VM stopped); BeforeVM is
	// from the shim's connection to QEMU's start (the sandbox made: layout, kvfsd).
	AfterAnswer, BeforeVM time.Duration
}

// Report is a run's results.
type Report struct {
	Config            Config
	Machine           Machine
	Accel, AccelWhy   string
	Started, Finished time.Time
	Rounds            map[string][]Round // by runtime
	Density           map[string]Density // by runtime, with Config.Density
	RSSMismatch       []string           // status VmRSS and smaps_rollup Rss disagreeing by over 5%
	Teardown          []string           // sleep containers whose deletion hung (see teardown)
}

func (c *Config) logf(format string, args ...any) {
	if c.Progress != nil {
		fmt.Fprintf(c.Progress, "kvfspodbench: "+format+"\n", args...)
	}
}

// prepared is what both benchmarks find before containerd starts.
type prepared struct {
	kernel          string // the agent guest image's
	rootfs, initrd  string // the agent guest image's root: one is empty
	accel, accelWhy string
}

// imageKernel is the kernel of the guest image in dir: its ELF vmlinux, or the bzImage of an
// image built before build.sh shipped the ELF (an older image compared against the new one).
func imageKernel(dir string) string {
	k := filepath.Join(dir, guestimage.KernelFile)
	if _, err := os.Stat(k); errors.Is(err, os.ErrNotExist) {
		if _, err := os.Stat(filepath.Join(dir, "vmlinuz")); err == nil {
			return filepath.Join(dir, "vmlinuz")
		}
	}
	return k
}

// prepare makes cfg's directories absolute (containerd runs in its own directory), checks
// that the guest image, the kvfs shim and the containerd binaries (ctrd.Binaries) are there,
// and picks the accelerator.
func prepare(ctx context.Context, cfg *Config) (prepared, error) {
	for _, d := range []*string{&cfg.ShimDir, &cfg.BinDir, &cfg.GuestDir} {
		abs, err := filepath.Abs(*d)
		if err != nil {
			return prepared{}, err
		}
		*d = abs
	}
	p := prepared{kernel: imageKernel(cfg.GuestDir)}
	p.rootfs, p.initrd = guestimage.RootIn(cfg.GuestDir)
	for _, f := range []string{p.kernel, p.rootfs + p.initrd, filepath.Join(cfg.ShimDir, shimKvfs)} {
		if _, err := os.Stat(f); err != nil {
			return prepared{}, err
		}
	}
	if _, err := ctrd.Binaries(cfg.BinDir); err != nil {
		return prepared{}, err
	}
	p.accel, p.accelWhy = cfg.Accel, "set with -accel"
	if p.accel == "" {
		g := vmtest.Guest{Kernel: imageKernel(cfg.ProbeGuest), Initrd: filepath.Join(cfg.ProbeGuest, guestimage.InitrdFile)}
		for _, f := range []string{g.Kernel, g.Initrd} {
			if _, err := os.Stat(f); err != nil {
				return prepared{}, fmt.Errorf("the probe guest (-probe-guest; packaging/guest/build.sh DIR), which finds whether KVM boots here: %w", err)
			}
		}
		p.accel, p.accelWhy = vmtest.Accel(ctx, g)
	}
	return p, nil
}

// kvfsConfig is the kvfs shim's configuration: its sandboxes in baseDir, the guest image,
// accelerator and size.
func (p prepared) kvfsConfig(baseDir string, cfg Config) string {
	return fmt.Sprintf("base_dir = %q\n[vm]\nqemu = %q\nkernel = %q\nrootfs = %q\ninitrd = %q\naccel = %q\nmemory = %q\nvcpus = %d\n%s\n",
		baseDir, cfg.QEMU, p.kernel, p.rootfs, p.initrd, p.accel, cfg.Memory, cfg.VCPUs, cfg.VMTOML)
}

// Run runs the benchmark through ctr.
func Run(ctx context.Context, cfg Config) (_ *Report, retErr error) {
	p, err := prepare(ctx, &cfg)
	if err != nil {
		return nil, err
	}
	rep := &Report{Config: cfg, Started: time.Now(), Rounds: map[string][]Round{}, Density: map[string]Density{}, Accel: p.accel, AccelWhy: p.accelWhy}
	rep.Machine = describeMachine(cfg, p.kernel)

	c, err := startContainerd(cfg, p, false)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := c.stop(cfg.KeepLog); err != nil && retErr == nil {
			retErr = fmt.Errorf("stopping containerd: %w", err)
		}
	}()
	cfg.logf("containerd in %s, namespace %s", c.Dir(), c.Namespace())

	if _, err := c.ImportBusybox(); err != nil {
		return nil, err
	}
	runtimeArgs := map[string][]string{
		RuntimeKvfs: {"--runtime", RuntimeKvfs, "--runtime-config-path", c.kvfsConfig},
		RuntimeRunc: {"--runtime", RuntimeRunc},
	}

	// A first run of each, not counted: the image's first unpack, page cache, binaries.
	for _, rt := range []string{RuntimeKvfs, RuntimeRunc} {
		if _, err := runTrue(ctx, c, runtimeArgs[rt], "warmup-"+short(rt)); err != nil {
			return nil, err
		}
	}
	floorInitrd := filepath.Join(c.Dir(), "floor-initramfs.gz")
	if err := writeFloorInitrd(floorInitrd); err != nil {
		return nil, err
	}
	for i := 1; i <= cfg.Runs; i++ {
		for _, rt := range []string{RuntimeKvfs, RuntimeRunc} {
			var floor time.Duration
			if rt == RuntimeKvfs {
				if floor, err = floorBoot(ctx, cfg, p.accel, p.kernel, floorInitrd, c.Dir()); err != nil {
					return nil, fmt.Errorf("round %d: %w", i, err)
				}
			}
			r, err := round(ctx, c, cfg, rt, runtimeArgs[rt], i, rep)
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", i, rt, err)
			}
			r.Floor = floor
			rep.Rounds[rt] = append(rep.Rounds[rt], r)
			cfg.logf("round %d %s: run %v, detached start %v, shim %d KiB, vmm %d KiB, container %d KiB, boot %v",
				i, short(rt), r.Run.Round(time.Millisecond), r.Detached.Round(time.Millisecond), r.Shim.RSS, r.VMM.RSS, r.Container.RSS, r.Boot)
		}
	}
	if cfg.Density > 0 {
		for _, rt := range []string{RuntimeKvfs, RuntimeRunc} {
			d, err := density(ctx, c, cfg, rt, runtimeArgs[rt], rep)
			if err != nil {
				return nil, fmt.Errorf("%d %s pods at once: %w", cfg.Density, short(rt), err)
			}
			rep.Density[rt] = d
			cfg.logf("%d %s pods at once: %d KiB PSS, %d KiB RSS in all", d.Pods, short(rt), d.Total().PSS, d.Total().RSS)
		}
	}
	// The second readings, from containerd's log.
	log, err := c.Log()
	if err != nil {
		return nil, err
	}
	ev, err := ParseEvents(log)
	if err != nil {
		return nil, err
	}
	for rt, rs := range rep.Rounds {
		for i := range rs {
			if d := ev[memID(rt, i+1)]; d != nil {
				if !d.Connect.IsZero() {
					rs[i].CreateStart = rs[i].StartedAt.Sub(d.Connect)
				}
				if !d.Answer.IsZero() {
					rs[i].AnswerToStarted = rs[i].StartedAt.Sub(d.Answer)
				}
			}
			e := ev[runID(rt, i+1)]
			if e == nil {
				continue
			}
			rs[i].RunSpan = e.Span()
			if rt == RuntimeKvfs {
				rs[i].Boot = e.Boot
				if !e.Answer.IsZero() && !e.Disconnect.IsZero() {
					rs[i].AfterAnswer = e.Disconnect.Sub(e.Answer)
				}
				if t, ok := e.Boot["total"]; ok && !e.Answer.IsZero() && !e.Connect.IsZero() {
					rs[i].BeforeVM = e.Answer.Add(-t).Sub(e.Connect)
				}
			}
		}
	}
	rep.Machine.LoadAfter = report.LoadAvg()
	rep.Finished = time.Now()
	return rep, nil
}

func short(rt string) string { return strings.Split(strings.TrimPrefix(rt, "io.containerd."), ".")[0] }

func runID(rt string, i int) string { return fmt.Sprintf("run-%s-%d", short(rt), i) }

func memID(rt string, i int) string { return fmt.Sprintf("mem-%s-%d", short(rt), i) }

func runTrue(ctx context.Context, c *containerd, rtArgs []string, id string) (time.Duration, error) {
	args := append(append([]string{"run", "--rm"}, rtArgs...), ociimage.BusyboxName, id, "true")
	t0 := time.Now()
	_, err := c.Ctr(ctx, args...)
	return time.Since(t0), err
}

// runSleep starts container id running sleep, detached, and returns how long ctr took: until
// it had the task started.
func runSleep(ctx context.Context, c *containerd, rtArgs []string, id string) (time.Duration, error) {
	args := append(append([]string{"run", "-d"}, rtArgs...), ociimage.BusyboxName, id, "sleep", "3600")
	t0 := time.Now()
	_, err := c.Ctr(ctx, args...)
	return time.Since(t0), err
}

func round(ctx context.Context, c *containerd, cfg Config, rt string, rtArgs []string, i int, rep *Report) (Round, error) {
	var r Round
	var err error
	if r.Run, err = runTrue(ctx, c, rtArgs, runID(rt, i)); err != nil {
		return r, err
	}
	id := memID(rt, i)
	if r.Detached, err = runSleep(ctx, c, rtArgs, id); err != nil {
		return r, err
	}
	r.StartedAt = time.Now()
	var vmm []int // QEMU's pid, once found
	defer func() {
		if err := teardown(ctx, c, id, vmm); err != nil {
			rep.Teardown = append(rep.Teardown, fmt.Sprintf("round %d %s: %v", i, short(rt), err))
		}
	}()
	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(cfg.Settle):
	}
	procs, err := processes()
	if err != nil {
		return r, err
	}
	var mismatch []string
	r.PodMem, vmm, mismatch, err = podMemory(procs, c.Namespace(), rt, id)
	for _, m := range mismatch {
		rep.RSSMismatch = append(rep.RSSMismatch, fmt.Sprintf("round %d %s %s", i, short(rt), m))
	}
	return r, err
}

// podMemory reads the memory of container id's pod of runtime rt in containerd namespace ns:
// its shim's, and its descendants' sorted into kvfsd, QEMU and the container's processes.
// vmm are QEMU's pids; mismatch says which processes' VmRSS and smaps_rollup Rss disagree by
// over 5%.
func podMemory(procs []proc, ns, rt, id string) (m PodMem, vmm []int, mismatch []string, err error) {
	bin := shimRunc
	if rt == RuntimeKvfs {
		bin = shimKvfs
	}
	shim, err := FindShim(procs, bin, ns, id)
	if err != nil {
		return m, nil, nil, err
	}
	if m.Shim, err = readMem(shim); err != nil {
		return m, nil, nil, err
	}
	check := func(what string, mem Mem) {
		if d := mem.StatusRSS - mem.RSS; d*20 > mem.RSS || -d*20 > mem.RSS {
			mismatch = append(mismatch, fmt.Sprintf("%s: VmRSS %d KiB, smaps_rollup Rss %d KiB", what, mem.StatusRSS, mem.RSS))
		}
	}
	check("shim", m.Shim)
	for _, p := range Descendants(procs, shim) {
		mem, err := readMem(p.pid)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			return m, vmm, mismatch, err
		}
		switch {
		case strings.HasPrefix(p.comm, "qemu"):
			vmm = append(vmm, p.pid)
			m.VMM = m.VMM.Add(mem)
			check("qemu", mem)
		case isServer(p):
			m.Server = m.Server.Add(mem)
		default:
			m.Container = m.Container.Add(mem)
		}
	}
	if rt == RuntimeKvfs && m.VMM.RSS == 0 {
		return m, vmm, mismatch, fmt.Errorf("no QEMU under the kvfs shim (pid %d)", shim)
	}
	return m, vmm, mismatch, nil
}

// Density is several pods of one runtime running at once.
type Density struct {
	Pods   int
	PodMem // their memory, summed
	// HostUsed is the second reading, in KiB: how much the host's MemAvailable (/proc/meminfo)
	// fell from before the first pod started to when the pods were read. It counts what PSS
	// does not (the kernel's memory for the processes: page tables, slabs) and whatever else
	// the machine did meanwhile; page cache the kernel can reclaim it mostly does not.
	HostUsed int64
}

// memAvailable is the host's MemAvailable, in KiB.
func memAvailable() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	return parseKB(string(b), "MemAvailable")
}

// density starts cfg.Density pods of runtime rt (rtArgs), each a container running sleep, one
// after the other; cfg.Settle after the last it reads the memory of all of them at once
// (podMemory: PSS splits the pages they share among them) and the host's MemAvailable, then
// deletes them.
func density(ctx context.Context, c *containerd, cfg Config, rt string, rtArgs []string, rep *Report) (d Density, err error) {
	var ids []string
	vmm := map[string][]int{}
	defer func() {
		for _, id := range ids {
			if err := teardown(ctx, c, id, vmm[id]); err != nil {
				rep.Teardown = append(rep.Teardown, fmt.Sprintf("%d %s pods at once, %s: %v", cfg.Density, short(rt), id, err))
			}
		}
	}()
	before, err := memAvailable()
	if err != nil {
		return d, err
	}
	for k := 1; k <= cfg.Density; k++ {
		id := fmt.Sprintf("density-%s-%d", short(rt), k)
		if _, err := runSleep(ctx, c, rtArgs, id); err != nil {
			return d, err
		}
		ids = append(ids, id)
	}
	select {
	case <-ctx.Done():
		return d, ctx.Err()
	case <-time.After(cfg.Settle):
	}
	after, err := memAvailable()
	if err != nil {
		return d, err
	}
	d.HostUsed = before - after
	procs, err := processes()
	if err != nil {
		return d, err
	}
	for _, id := range ids {
		m, pids, mismatch, err := podMemory(procs, c.Namespace(), rt, id)
		vmm[id] = pids
		for _, mm := range mismatch {
			rep.RSSMismatch = append(rep.RSSMismatch, fmt.Sprintf("%d %s pods at once, %s %s", cfg.Density, short(rt), id, mm))
		}
		if err != nil {
			return d, err
		}
		d.PodMem = d.PodMem.Add(m)
	}
	d.Pods = len(ids)
	return d, nil
}

// deleteTimeout bounds the deletion of a killed container; a VM's shutdown takes seconds.
const deleteTimeout = 90 * time.Second

// teardown kills and deletes the sleep container id. If the deletion does not end within
// deleteTimeout, the pod's QEMU (vmm, the benchmark's own descendants) is killed, so that
// the shim sees its VM die, and the deletion is tried again; the error says what happened.
func teardown(ctx context.Context, c *containerd, id string, vmm []int) error {
	try := func(args ...string) error {
		tctx, cancel := context.WithTimeout(ctx, deleteTimeout)
		defer cancel()
		_, err := c.Ctr(tctx, args...)
		if tctx.Err() == context.DeadlineExceeded {
			return fmt.Errorf("ctr %s: no answer within %v", strings.Join(args, " "), deleteTimeout)
		}
		return err
	}
	var hung error
	if err := try("tasks", "kill", "-s", "SIGKILL", id); err != nil && strings.Contains(err.Error(), "no answer") {
		hung = err
	}
	if err := try("tasks", "delete", "-f", id); err != nil && strings.Contains(err.Error(), "no answer") {
		hung = err
	}
	if hung != nil {
		for _, pid := range vmm {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if err := try("tasks", "delete", "-f", id); err != nil && strings.Contains(err.Error(), "no answer") {
			return fmt.Errorf("%v; still none after QEMU was killed", hung)
		}
		hung = fmt.Errorf("%v; ended by killing QEMU", hung)
	}
	if err := try("containers", "delete", id); err != nil {
		return errors.Join(hung, err)
	}
	return hung
}
