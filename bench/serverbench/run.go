package serverbench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvfs/kvfs/bench/report"
)

// Setup is one server configuration, or the host ("limit").
type Setup struct {
	Server string // "kvfsd", "virtiofsd", "limit" or "floor"
	Pool   int    // --thread-pool-size
	Cache  string // "auto" or "none"
	// Xattr is "" (extended attributes off, both servers' default), or the -o options that turn
	// them on, comma-separated: see xattrSetups.
	Xattr string
}

const (
	kvfsd     = "kvfsd"
	virtiofsd = "virtiofsd"
	limit     = "limit"
	floor     = "floor"
)

// isServer reports whether the setup is a server, not the limit or the floor.
func (s Setup) isServer() bool { return s.Server == kvfsd || s.Server == virtiofsd }

func (s Setup) id() string {
	if !s.isServer() {
		return s.Server
	}
	id := fmt.Sprintf("%s-pool%d-%s", s.Server, s.Pool, s.Cache)
	if s.Xattr != "" {
		id += "-" + strings.NewReplacer(",", "-", "_", "").Replace(s.Xattr)
	}
	return id
}

func (s Setup) String() string {
	switch s.Server {
	case limit:
		return "limit (host syscalls)"
	case floor:
		return "floor (eventfd ping-pong)"
	}
	return fmt.Sprintf("%s pool %d cache %s", s.Server, s.Pool, s.cacheLabel())
}

// cacheLabel is the cache mode, and the xattr options if any, as the tables show them.
func (s Setup) cacheLabel() string {
	if s.Xattr == "" {
		return s.Cache
	}
	return s.Cache + ", -o " + strings.ReplaceAll(s.Xattr, ",", " -o ")
}

// runs reports whether the setup runs workload w: the xattr setups run only the xattr
// workloads, the other servers only the rest, the limit runs everything and the floor every
// workload at queue depth 1.
func (s Setup) runs(w workload) bool {
	switch s.Server {
	case limit:
		return true
	case floor:
		return w.Depth <= 1
	}
	return (s.Xattr != "") == w.Xattr
}

// setups are the configurations of issue 3, in report order.
func setups() []Setup {
	var out []Setup
	for _, cache := range []string{"auto", "none"} {
		for _, pool := range []int{0, 4} {
			out = append(out, Setup{Server: kvfsd, Pool: pool, Cache: cache}, Setup{Server: virtiofsd, Pool: pool, Cache: cache})
		}
	}
	out = append(out, xattrSetups()...)
	return append(out, Setup{Server: limit}, Setup{Server: floor})
}

// xattrSetups are the configurations with extended attributes on (pool 0, cache auto): kvfsd
// with HANDLE_KILLPRIV_V2 offered (its default with xattrs) and without, and the C virtiofsd with
// its own default (it offers killpriv_v2 only when told to). Whether the guest asks for
// security.capability before each WRITE follows from what INIT negotiated (see
// serverDriver.killprivCheck).
func xattrSetups() []Setup {
	return []Setup{
		{Server: kvfsd, Cache: "auto", Xattr: "xattr,killpriv_v2"},
		{Server: kvfsd, Cache: "auto", Xattr: "xattr,no_killpriv_v2"},
		{Server: virtiofsd, Cache: "auto", Xattr: "xattr"},
	}
}

// target is one setup being measured.
type target struct {
	Setup
	drv  driver
	life context.Context // ends when the server process does
	na   string          // why it is not measured (set at start or when it fails)

	d      *daemon // nil for the host
	mayDie bool    // a death is a finding to report, not a failure of the benchmark
	detail string  // what the kernel said about the death
}

// Sample is one measurement: one workload on one target in one round.
type Sample struct {
	Ops     int
	Bytes   int64
	Elapsed time.Duration
	CPU     time.Duration // of the target's process (tree)
	// SystemCPU is the system (kernel) part of CPU: the system calls, the page faults and the
	// wake-ups they cost.
	SystemCPU time.Duration
	// FrontendCPU is this process's CPU time over the measurement: for a server, the
	// front-end's (see selfCPU); for the floor, the pinging side's; for the limit, the same as CPU.
	FrontendCPU time.Duration
	Switches    uint64 // context switches of the target's live threads
	P50, P99    time.Duration
}

// Results are everything Run measured, and where.
type Results struct {
	Config    Config
	Machine   Machine
	Started   time.Time
	Finished  time.Time
	Workloads []workload
	Setups    []Setup
	Profiles  []*Profile                    // kvfsd's CPU profiles (see profileWorkload)
	NA        map[Setup]string              // setups not measured, and why
	NADetail  map[Setup]string              // what the kernel's audit log said about a seccomp kill
	Samples   map[Setup]map[string][]Sample // by setup and workload name, one per round
	Errors    []string                      // failures during the run
	Memory    []MemoryResult                // the memory measurement, if it ran
}

// Failed reports whether anything that should have worked did not.
func (r *Results) Failed() bool { return len(r.Errors) > 0 }

// Run prepares the shared directory, starts every server, runs the rounds and stops the servers.
func Run(ctx context.Context, cfg *Config) (*Results, error) {
	logf := func(format string, args ...any) {
		if cfg.Log != nil {
			fmt.Fprintf(cfg.Log, format+"\n", args...)
		}
	}
	if cfg.ProfileTime > 0 && cfg.ProfileDir != "" {
		if err := os.MkdirAll(cfg.ProfileDir, 0o755); err != nil {
			return nil, fmt.Errorf("-profile-dir: %w", err)
		}
	}
	base := cfg.Dir
	if base == "" {
		base = defaultDir()
	}
	tmp, err := os.MkdirTemp(base, "kvfsbench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	shareDir, runDir := filepath.Join(tmp, "share"), filepath.Join(tmp, "run")
	for _, d := range []string{shareDir, runDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return nil, err
		}
	}
	sh, err := makeShare(shareDir, cfg.Files, cfg.DataSize)
	if err != nil {
		return nil, fmt.Errorf("making the shared directory: %w", err)
	}
	only := regexp.MustCompile(cfg.Only)
	res := &Results{Config: *cfg, Started: time.Now(), Setups: setups(),
		NA: map[Setup]string{}, NADetail: map[Setup]string{}, Samples: map[Setup]map[string][]Sample{}}
	for _, w := range workloads(cfg.Files) {
		if only.MatchString(w.Name) {
			res.Workloads = append(res.Workloads, w)
		}
	}
	doMemory := only.MatchString(memoryName)
	if len(res.Workloads) == 0 && !doMemory {
		return nil, fmt.Errorf("no workload matches %q", cfg.Only)
	}
	res.Machine = describeMachine(cfg, sh)
	logf("kvfsbench: shared directory %s (%s), %d files, %d MiB data file", shareDir, sh.fsType, cfg.Files, cfg.DataSize>>20)
	if doMemory {
		if res.Memory, err = measureMemory(ctx, cfg, sh, runDir, logf); err != nil {
			return nil, err
		}
		for _, r := range res.Memory {
			if r.Err != "" {
				res.Errors = append(res.Errors, fmt.Sprintf("memory, %s: %s", r.Server, r.Err))
			}
		}
		if len(res.Workloads) == 0 {
			res.Finished = time.Now()
			res.Machine.LoadAfter = report.LoadAvg()
			return res, nil
		}
	}

	var targets []*target
	defer func() {
		for _, t := range targets {
			if t.drv != nil {
				t.drv.close()
			}
		}
	}()
	for _, su := range res.Setups {
		t, err := start(ctx, cfg, su, sh, runDir)
		if err != nil {
			return nil, fmt.Errorf("%v: %w", su, err)
		}
		targets = append(targets, t)
		if t.na != "" {
			res.NA[su], res.NADetail[su] = t.na, t.detail
			logf("kvfsbench: %v: n/a (%s): %s; its output:\n%s", su, t.na, t.detail, t.d.logTail())
		}
	}

	for round := range cfg.Rounds {
		for wi, w := range res.Workloads {
			seed := uint64(round)<<8 | uint64(wi)
			g := slices.DeleteFunc(roundOrder(targets, round), func(t *target) bool { return t.na != "" || !t.runs(w) })
			samples, errs := measureGroup(g, w, cfg, seed)
			for i, t := range g {
				if errs[i] != nil {
					res.drop(t, fmt.Sprintf("round %d, %s", round+1, w.Name), errs[i], logf)
					continue
				}
				s := samples[i]
				if res.Samples[t.Setup] == nil {
					res.Samples[t.Setup] = map[string][]Sample{}
				}
				res.Samples[t.Setup][w.Name] = append(res.Samples[t.Setup][w.Name], s)
				logf("round %d/%d  %-24s %-30v %10.0f ops/s  p50 %8v  p99 %8v  cpu %6.2f µs/op  front-end cpu %6.2f µs/op",
					round+1, cfg.Rounds, w.Name, t.Setup, s.opsPerSec(), s.P50, s.P99, s.cpuPerOp(), s.frontendCPUPerOp())
			}
		}
	}
	if cfg.ProfileTime > 0 {
		for _, w := range res.Workloads {
			if !slices.Contains(profiledWorkloads, w.Name) {
				continue
			}
			keep := ""
			if cfg.ProfileDir != "" {
				keep = filepath.Join(cfg.ProfileDir, "kvfsd-"+strings.NewReplacer(" ", "-", "+", "-").Replace(w.Name)+".pprof")
			}
			p := profileWorkload(ctx, cfg, sh, runDir, w, cfg.ProfileTime, keep)
			res.Profiles = append(res.Profiles, p)
			if p.Err != "" {
				res.Errors = append(res.Errors, fmt.Sprintf("profile of kvfsd under %s: %s", w.Name, p.Err))
				logf("kvfsbench: profile of kvfsd under %s: %s", w.Name, p.Err)
			}
		}
	}
	res.Finished = time.Now()
	res.Machine.LoadAfter = report.LoadAvg()
	return res, nil
}

// drop stops measuring t after err. A server allowed to die that has died is reported as not
// measured, like a death at start, and its earlier samples are discarded (no partial rows);
// anything else is a failure of the run.
func (res *Results) drop(t *target, when string, err error, logf func(string, ...any)) {
	t.drv.close()
	t.drv = nil
	if t.mayDie && t.d.dead(0) {
		t.na, t.detail = t.d.deathReason()
		t.detail = joinNonEmpty("; ", t.detail, "it survived its start and died in "+when)
		res.NA[t.Setup], res.NADetail[t.Setup] = t.na, t.detail
		delete(res.Samples, t.Setup)
		logf("kvfsbench: %v: n/a (%s): %s; its output:\n%s", t.Setup, t.na, t.detail, t.d.logTail())
		return
	}
	t.na = fmt.Sprintf("failed in %s: %v", when, err)
	if t.d != nil && t.d.dead(0) {
		t.na += "; the server " + t.d.exitReason()
		logf("kvfsbench: %v output:\n%s", t.Setup, t.d.logTail())
	}
	res.NA[t.Setup] = t.na
	res.Errors = append(res.Errors, fmt.Sprintf("%v: %s", t.Setup, t.na))
	logf("kvfsbench: %v: %s", t.Setup, t.na)
}

func (s Sample) opsPerSec() float64     { return float64(s.Ops) / s.Elapsed.Seconds() }
func (s Sample) mibPerSec() float64     { return float64(s.Bytes) / (1 << 20) / s.Elapsed.Seconds() }
func (s Sample) switchesPerOp() float64 { return float64(s.Switches) / float64(max(s.Ops, 1)) }
func (s Sample) cpuPerOp() float64 {
	return float64(s.CPU) / float64(time.Microsecond) / float64(max(s.Ops, 1))
}
func (s Sample) systemCPUPerOp() float64 {
	return float64(s.SystemCPU) / float64(time.Microsecond) / float64(max(s.Ops, 1))
}
func (s Sample) frontendCPUPerOp() float64 {
	return float64(s.FrontendCPU) / float64(time.Microsecond) / float64(max(s.Ops, 1))
}

// roundOrder is the order in which the targets take their turns in round r: the kvfsd and the
// C virtiofsd of one configuration next to each other, which of them comes first alternating
// from round to round, and the configurations rotating, so that no server is systematically
// first or last.
func roundOrder(targets []*target, r int) []*target {
	var groups [][]*target
	for _, t := range targets {
		n := len(groups)
		if n > 0 && t.isServer() && groups[n-1][0].isServer() &&
			groups[n-1][0].Pool == t.Pool && groups[n-1][0].Cache == t.Cache &&
			(groups[n-1][0].Xattr == "") == (t.Xattr == "") {
			groups[n-1] = append(groups[n-1], t)
			continue
		}
		groups = append(groups, []*target{t})
	}
	var out []*target
	for i := range groups {
		g := slices.Clone(groups[(i+r)%len(groups)])
		if r%2 == 1 {
			slices.Reverse(g)
		}
		out = append(out, g...)
	}
	return out
}

// createDirName is the directory each target creates its files in.
func createDirName(su Setup) string { return "create-" + su.id() }

// start starts and connects one target. A server that dies while starting is marked n/a; that
// is expected only of the C virtiofsd with a thread pool on machines where its seccomp filter
// lacks a system call the pool makes, and is an error for anything else.
func start(ctx context.Context, cfg *Config, su Setup, sh *share, runDir string) (*target, error) {
	cdir := createDirName(su)
	if err := os.Mkdir(filepath.Join(sh.dir, cdir), 0o755); err != nil {
		return nil, err
	}
	t := &target{Setup: su}
	if su.Server == floor {
		f, err := startFloor()
		if err != nil {
			return nil, err
		}
		t.drv, t.life = f, context.Background()
		return t, nil
	}
	if su.Server == limit {
		h, err := openHost(sh, cdir)
		if err != nil {
			return nil, err
		}
		t.drv, t.life = h, context.Background()
		return t, nil
	}
	bin := cfg.Kvfsd
	if su.Server == virtiofsd {
		bin = cfg.Virtiofsd
	}
	sock := filepath.Join(runDir, su.id()+".sock")
	argv := []string{bin, "--socket-path=" + sock, "-o", "source=" + sh.dir, "-o", "cache=" + su.Cache}
	if su.Pool > 0 {
		argv = append(argv, "--thread-pool-size="+strconv.Itoa(su.Pool))
	}
	if su.Xattr != "" {
		for _, o := range strings.Split(su.Xattr, ",") {
			argv = append(argv, "-o", o)
		}
	}
	d, err := startDaemon(argv, filepath.Join(runDir, su.id()+".log"))
	if err != nil {
		return nil, err
	}
	life, cancel := context.WithCancel(context.Background())
	go func() {
		<-d.exited
		cancel()
	}()
	t.life = life
	ctx, stop := context.WithTimeout(ctx, 20*time.Second)
	defer stop()
	mayDie := su.Server == virtiofsd && su.Pool > 0
	t.d, t.mayDie = d, mayDie
	fail := func(err error) (*target, error) {
		if d.dead(2 * time.Second) {
			if mayDie {
				t.na, t.detail = d.deathReason()
				t.detail = joinNonEmpty("; ", t.detail, "it died under the probe, before the rounds")
				return t, nil
			}
			return nil, fmt.Errorf("%w; the server %s; its output:\n%s", err, d.exitReason(), d.logTail())
		}
		d.stop()
		return nil, fmt.Errorf("%w; its output:\n%s", err, d.logTail())
	}
	if err := d.waitSocket(ctx, sock); err != nil {
		return fail(err)
	}
	d.usage() // notes the PIDs of the processes it forked, for seccompAudit
	ctx, stopLife := context.WithCancel(ctx)
	defer stopLife()
	context.AfterFunc(life, stopLife)
	s, err := dialServer(ctx, d, sock, sh, cdir)
	if err != nil {
		return fail(err)
	}
	// A probe through the whole path: every workload's kind of request, then both queues busy
	// at once, as a guest reading while it evicts inodes keeps them.
	probes := []func(m *meter) error{
		func(m *meter) error { return s.lookupGetattr(ctx, m) },
		func(m *meter) error { return s.createReleaseUnlink(ctx, m, 1) },
		func(m *meter) error { return s.io(ctx, m, ioParams{Size: 4096, Depth: 16, Random: true}, 1) },
		func(m *meter) error {
			return s.io(ctx, m, ioParams{Write: true, Size: 4096, Depth: 16, Random: true}, 2)
		},
	}
	for _, probe := range probes {
		if err := probe(newMeter(100*time.Millisecond, s.usage, nil)); err != nil {
			s.fe.Close()
			return fail(fmt.Errorf("probe: %w", err))
		}
	}
	// A server that may die of its thread pool gets several bursts with pauses in between (the
	// C virtiofsd's GLib pools retire idle threads after half a second and start new ones).
	bursts := 1
	if mayDie {
		bursts = 5
	}
	for range bursts {
		if err := s.bothQueues(ctx, 300*time.Millisecond); err != nil {
			s.fe.Close()
			return fail(fmt.Errorf("probe: %w", err))
		}
		if d.dead(700 * time.Millisecond) {
			break
		}
	}
	if d.dead(200 * time.Millisecond) {
		s.fe.Close()
		return fail(errors.New("died after the probe"))
	}
	t.drv = s
	return t, nil
}

// measureGroup runs w on the targets of g: a warm-up each, then the measurement time of each
// cut into cfg.Slices slices that go round the targets, forwards then backwards (ABC CBA ABC
// ...), so that every target, and above all the two servers of a pair, which are next to each
// other, are measured under the same conditions of a shared machine. A target that fails gets
// an error and is left out of the remaining slices.
func measureGroup(g []*target, w workload, cfg *Config, seed uint64) ([]Sample, []error) {
	type acc struct {
		m       meter // accumulates the slices: ops, bytes, latencies
		elapsed time.Duration
		used    usage
		fe      time.Duration
	}
	accs := make([]acc, len(g))
	errs := make([]error, len(g))
	run := func(i int, d time.Duration, seed uint64, keep bool) {
		t := g[i]
		ctx, cancel := context.WithTimeout(t.life, d+2*time.Minute)
		defer cancel()
		m := newMeter(d, t.drv.usage, accs[i].m.lat)
		err := w.run(ctx, t.drv, m, seed)
		m.stop()
		if err == nil {
			err = m.err
		}
		if err != nil {
			errs[i] = err
			return
		}
		if keep {
			a := &accs[i]
			a.m.lat, a.m.ops, a.m.bytes = m.lat, a.m.ops+m.ops, a.m.bytes+m.bytes
			a.elapsed += m.end.Sub(m.begin)
			a.used = a.used.add(m.u1.sub(m.u0))
			a.fe += m.fe1 - m.fe0
		} else {
			accs[i].m.lat = m.lat[:0]
		}
	}
	if cfg.Warmup > 0 {
		for i := range g {
			run(i, cfg.Warmup, ^seed, false)
		}
	}
	n := max(cfg.Slices, 1)
	for k := range n {
		for j := range g {
			i := j
			if k%2 == 1 { // ABBA
				i = len(g) - 1 - j
			}
			if errs[i] == nil {
				run(i, cfg.Duration/time.Duration(n), seed+uint64(k)<<16, true)
			}
		}
	}
	out := make([]Sample, len(g))
	for i, a := range accs {
		if errs[i] != nil {
			continue
		}
		lat := a.m.lat
		slices.Sort(lat)
		out[i] = Sample{Ops: a.m.ops, Bytes: a.m.bytes, Elapsed: a.elapsed, CPU: a.used.CPU, SystemCPU: a.used.System,
			Switches: a.used.Switches, P50: Percentile(lat, 50), P99: Percentile(lat, 99), FrontendCPU: a.fe}
	}
	return out, errs
}

func joinNonEmpty(sep string, parts ...string) string {
	return strings.Join(slices.DeleteFunc(parts, func(s string) bool { return s == "" }), sep)
}
