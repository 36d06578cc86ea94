package serverbench

import (
	"bytes"
	"image/png"
	"strings"
	"testing"
	"time"
)

// fakeResults are two rounds of every setup but the C virtiofsd with a pool, which "died", of the
// named workloads (default: LOOKUP+GETATTR and CREATE+RELEASE+UNLINK).
func fakeResults(names ...string) *Results {
	if len(names) == 0 {
		names = []string{"LOOKUP+GETATTR", "CREATE+RELEASE+UNLINK"}
	}
	res := &Results{Config: Config{Rounds: 2, Duration: time.Second, Files: 10, DataSize: 1 << 20},
		Workloads: pick(workloads(10), names...), Setups: setups(),
		NA: map[Setup]string{}, NADetail: map[Setup]string{}, Samples: map[Setup]map[string][]Sample{}}
	for _, su := range res.Setups {
		if su.Server == virtiofsd && su.Pool > 0 {
			res.NA[su] = seccompKilled
			continue
		}
		res.Samples[su] = map[string][]Sample{}
		for i, w := range res.Workloads {
			if !su.runs(w) {
				continue
			}
			ops := 1000 * (i + 1)
			switch su.Server {
			case kvfsd:
				ops *= 2
			case floor:
				ops *= 4
			}
			for range res.Config.Rounds {
				res.Samples[su][w.Name] = append(res.Samples[su][w.Name], Sample{Ops: ops, Elapsed: time.Second,
					CPU: time.Duration(ops) * 10 * time.Microsecond, SystemCPU: time.Duration(ops) * 8 * time.Microsecond, Switches: uint64(ops), P50: time.Microsecond, P99: 2 * time.Microsecond,
					FrontendCPU: time.Duration(ops) * 7 * time.Microsecond})
			}
		}
	}
	return res
}

// wantInReport fails the test for each of wants that md does not contain.
func wantInReport(t *testing.T, md string, wants ...string) {
	t.Helper()
	for _, want := range wants {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

// pick returns the workloads of ws with these names, in that order.
func pick(ws []workload, names ...string) []workload {
	var out []workload
	for _, n := range names {
		for _, w := range ws {
			if w.Name == n {
				out = append(out, w)
			}
		}
	}
	return out
}

func TestReport(t *testing.T) {
	res := fakeResults()
	md := Report(res, "chart.png")
	wantInReport(t, md,
		"| LOOKUP+GETATTR | 0 | auto | 2.00 (2.00–2.00) |", // kvfsd has twice the ops/s
		"| LOOKUP+GETATTR | 4 † | auto |",                  // compared with virtiofsd pool 0
		"| 200% | 100% | 50% | 25% |\n",                    // of limit, of floor (4× the C virtiofsd's ops/s)
		"| floor (eventfd ping-pong) | – | – | 4000 |",
		"| 10.0 | 1.00 | 7.00 | 2 |\n", // CPU, switches and the front-end's CPU per operation, rounds
		"| virtiofsd | 4 | auto | n/a (killed by its seccomp filter) |",
		"![", "chart.png",
	)
	b, err := Chart(res)
	if err != nil {
		t.Fatal(err)
	}
	img, err := png.Decode(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if r := img.Bounds(); r.Dx() < 500 || r.Dy() < 200 {
		t.Errorf("chart is %v", r)
	}
}

// TestChartRef: the report links the chart relative to itself, as scripts/bench.sh writes both
// into docs/measurements.
func TestChartRef(t *testing.T) {
	for _, c := range []struct{ out, chart, want string }{
		{"docs/measurements/benchmarks.md", "docs/measurements/benchmarks-server.png", "benchmarks-server.png"},
		{"report.md", "docs/measurements/benchmarks-server.png", "docs/measurements/benchmarks-server.png"},
		{"", "docs/measurements/benchmarks-server.png", "docs/measurements/benchmarks-server.png"},
		{"docs/measurements/benchmarks.md", "", ""},
	} {
		if got := chartRef(&Config{Out: c.out, Chart: c.chart}); got != c.want {
			t.Errorf("chartRef(out %q, chart %q) = %q, want %q", c.out, c.chart, got, c.want)
		}
	}
}

func TestReadingFloor(t *testing.T) {
	// READ 4 KiB QD1 (i = 1 in fakeResults: 2000 ops/s for the C virtiofsd, 4000 for kvfsd,
	// 8000 for the floor) and READ 4 KiB QD16, which the floor does not run.
	md := Report(fakeResults("LOOKUP+GETATTR", "READ 4 KiB random QD1", "READ 4 KiB random QD16"), "")
	wantInReport(t, md,
		"made 6000 round trips per second", // the median of its two workloads' 4000 and 8000
		"(pool 0): READ 4 KiB random QD1 (auto) 50% and 25%; READ 4 KiB random QD1 (none) 50% and 25%. ",
		"| READ 4 KiB random QD16 | 0 | auto | 2.00 (2.00–2.00) | 1.00 (1.00–1.00) | 1.00 (1.00–1.00) | 1.00 (1.00–1.00) | 200% | 100% | – | – |",
	)
	if strings.Contains(md, "LOOKUP+GETATTR (auto) 50%") {
		t.Error("the floor's reading lists a multi-request row")
	}
}

func TestRoundOrder(t *testing.T) {
	var targets []*target
	for _, su := range setups() {
		targets = append(targets, &target{Setup: su})
	}
	ids := func(ts []*target) string {
		var s []string
		for _, t := range ts {
			s = append(s, t.id())
		}
		return strings.Join(s, " ")
	}
	for _, tc := range []struct {
		round int
		want  string
	}{
		{0, "kvfsd-pool0-auto virtiofsd-pool0-auto kvfsd-pool4-auto virtiofsd-pool4-auto kvfsd-pool0-none virtiofsd-pool0-none kvfsd-pool4-none virtiofsd-pool4-none " +
			"kvfsd-pool0-auto-xattr-killprivv2 kvfsd-pool0-auto-xattr-nokillprivv2 virtiofsd-pool0-auto-xattr limit floor"},
		{1, "virtiofsd-pool4-auto kvfsd-pool4-auto virtiofsd-pool0-none kvfsd-pool0-none virtiofsd-pool4-none kvfsd-pool4-none " +
			"virtiofsd-pool0-auto-xattr kvfsd-pool0-auto-xattr-nokillprivv2 kvfsd-pool0-auto-xattr-killprivv2 limit floor virtiofsd-pool0-auto kvfsd-pool0-auto"},
	} {
		if got := ids(roundOrder(targets, tc.round)); got != tc.want {
			t.Errorf("round %d:\n got %s\nwant %s", tc.round, got, tc.want)
		}
	}
}

// TestReadingDeepCPUTarget: at queue depth 16 the CPU target is 0.77×, so equal CPU per
// operation misses it, the C virtiofsd's system share is read beside it, and the row has no
// floor share to read.
func TestReadingDeepCPUTarget(t *testing.T) {
	md := Report(fakeResults("READ 4 KiB random QD16"), "")
	wantInReport(t, md,
		"Missed in 1 row: READ 4 KiB random QD16 (1.00×, needed ≤ 0.77×; the C virtiofsd's system time alone is 0.80× its CPU).",
		"with no user time at all and the C daemon's system calls it would still be at that ratio.",
		"Met in 1 row: READ 4 KiB random QD16 (2.00×, lowest 2.00×).",
	)
	if strings.Contains(md, "of the floor row's ops/s at queue depth 1 (") {
		t.Error("a queue-depth-16 row is read against the floor")
	}
}

// TestReadingFloorBound: a single-request row at queue depth 1 says what share of the floor a
// server of no cost would reach: the floor's round trip and the limit row's system calls in
// series, and when kvfsd passes it, that the floor row was no floor. The xattr row (two requests
// without killpriv_v2) gets no bound.
func TestReadingFloorBound(t *testing.T) {
	res := fakeResults("READ 4 KiB random QD1", "WRITE 4 KiB random QD1, xattr")
	for i := range res.Samples[Setup{Server: limit}]["READ 4 KiB random QD1"] {
		res.Samples[Setup{Server: limit}]["READ 4 KiB random QD1"][i].Ops = 12000 // the floor: 4000
	}
	md := Report(res, "")
	if want := "READ 4 KiB random QD1 50% (floor and limit in series: 75%)"; !strings.Contains(md, want) {
		t.Errorf("report lacks %q", want)
	}
	if strings.Contains(md, "killpriv_v2) 50% (floor and limit") {
		t.Error("the xattr row got a single-request bound")
	}
	// A kvfsd above the bound, or above the floor, is neither met nor missed: the floor row was
	// no floor.
	for i := range res.Samples[Setup{Server: limit}]["READ 4 KiB random QD1"] {
		res.Samples[Setup{Server: limit}]["READ 4 KiB random QD1"][i].Ops = 4000 // bound 50%
	}
	for _, w := range []string{"READ 4 KiB random QD1", "WRITE 4 KiB random QD1, xattr"} {
		for i := range res.Samples[Setup{Server: floor}][w] {
			res.Samples[Setup{Server: floor}][w][i].Ops = 1000 // kvfsd: 200%, and 400% on xattr
		}
	}
	md = Report(res, "")
	if want := "Met in no row. Missed in no row. Not readable in 3 rows, where kvfsd passed the floor, or the floor and limit in series: in this run the floor row was no floor: READ 4 KiB random QD1 200% (floor and limit in series: 80%); WRITE 4 KiB random QD1, xattr (-o xattr -o killpriv_v2) 400%; WRITE 4 KiB random QD1, xattr (-o xattr -o no_killpriv_v2) 400%."; !strings.Contains(md, want) {
		t.Errorf("report lacks %q", want)
	}
}

// TestReadingXattrTargets: both kvfsd xattr setups are rows of the targets, named by their
// options.
func TestReadingXattrTargets(t *testing.T) {
	md := Report(fakeResults("WRITE 4 KiB random QD1, xattr"), "")
	wantInReport(t, md,
		"WRITE 4 KiB random QD1, xattr (-o xattr -o killpriv_v2) (2.00×, lowest 2.00×)",
		"WRITE 4 KiB random QD1, xattr (-o xattr -o no_killpriv_v2) (2.00×, lowest 2.00×)",
	)
}

func TestReadingTargets(t *testing.T) {
	res := fakeResults()
	// kvfsd's CREATE+RELEASE+UNLINK ops/s: 0.6× the C virtiofsd's, short of 1.0×.
	for _, su := range res.Setups {
		if su.Server == kvfsd && su.Pool == 0 && su.Xattr == "" {
			for i := range res.Samples[su]["CREATE+RELEASE+UNLINK"] {
				res.Samples[su]["CREATE+RELEASE+UNLINK"][i].Ops = 1200
			}
		}
	}
	res.Machine.CPUs = 2
	res.Profiles = []*Profile{{Workload: "LOOKUP+GETATTR", Ops: 1000, Elapsed: time.Second, CPU: 10 * time.Millisecond,
		Kinds: []Share{{kindNotify, 0.4}, {kindSyscall, 0.3}, {kindScheduler, 0.1}, {kindGC, 0.05}, {kindGo, 0.15}},
		Top:   []Func{{"internal/runtime/syscall/linux.Syscall6", 0.6, 0.6}}}}
	md := Report(res, "")
	wantInReport(t, md,
		"Met in 1 row: LOOKUP+GETATTR (2.00×, lowest 2.00×). Missed in 1 row: CREATE+RELEASE+UNLINK (0.60×, lowest 0.60×).",
		// Equal CPU per operation meets ≤ 1.00×; CREATE's is now 40 ms over 1200 operations.
		"Met in 1 row: LOOKUP+GETATTR (1.00×, needed ≤ 1.00×). Missed in 1 row: CREATE+RELEASE+UNLINK (3.33×, needed ≤ 1.00×).",
		"and no server can pass while the floor row is a true floor) (pool 0, cache auto). Met in no row. Missed in 2 rows: LOOKUP+GETATTR 50%; CREATE+RELEASE+UNLINK 15%.",
		"of its CPU, 40% is the notification path",
		"10% the Go scheduler, 5% allocation and GC, and 15% its own Go code",
		"| `internal/runtime/syscall/linux.Syscall6` | 60.0% | 60.0% |",
	)
	// CREATE's miss is not bounded by the C virtiofsd's system share (0.80× of its CPU).
	if strings.Contains(md, "with no user time at all") {
		t.Error("a miss above the C virtiofsd's system share is read as bounded by it")
	}
}

// TestReportMethodSlices checks that the method says how the servers shared the measured time:
// interleaved slices, or with -slices 1 each alone for its whole cell.
func TestReportMethodSlices(t *testing.T) {
	for slices, want := range map[int]string{
		6: "cut into 6 slices that go round the configurations",
		1: "one configuration after the other (-slices 1): each runs alone for its whole 1s",
	} {
		res := fakeResults()
		res.Config.Slices = slices
		if md := Report(res, ""); !strings.Contains(md, want) {
			t.Errorf("-slices %d: the report lacks %q", slices, want)
		}
	}
}

// TestReadingBusySide: a queue-depth-16 row where the front-end used more of a CPU than both
// servers is read as bound by the front-end, one where both servers used more as bound by the
// server; a row where the two servers disagree is neither.
func TestReadingBusySide(t *testing.T) {
	res := fakeResults("READ 4 KiB random QD16", "WRITE 4 KiB random QD16", "READ 1 MiB sequential QD16")
	set := func(su Setup, w string, fe, srv time.Duration) {
		for i := range res.Samples[su][w] {
			res.Samples[su][w][i].FrontendCPU, res.Samples[su][w][i].CPU = fe, srv
		}
	}
	k, v := Setup{Server: kvfsd, Cache: "auto"}, Setup{Server: virtiofsd, Cache: "auto"}
	set(k, "READ 4 KiB random QD16", 900*time.Millisecond, 700*time.Millisecond)
	set(v, "READ 4 KiB random QD16", 850*time.Millisecond, 600*time.Millisecond)
	set(k, "READ 1 MiB sequential QD16", 300*time.Millisecond, 950*time.Millisecond)
	set(v, "READ 1 MiB sequential QD16", 250*time.Millisecond, 960*time.Millisecond)
	set(k, "WRITE 4 KiB random QD16", 900*time.Millisecond, 700*time.Millisecond)
	set(v, "WRITE 4 KiB random QD16", 500*time.Millisecond, 600*time.Millisecond)
	md := Report(res, "")
	wantInReport(t, md,
		"the front-end, with both servers, in 1 row: READ 4 KiB random QD16 (the front-end 0.90 and kvfsd 0.70 of a CPU; the front-end 0.85 and the C virtiofsd 0.60).",
		"the server, with both, in 1 row: READ 1 MiB sequential QD16 (the front-end 0.30 and kvfsd 0.95 of a CPU; the front-end 0.25 and the C virtiofsd 0.96). There CPU per operation is throughput.",
	)
	if strings.Contains(md, "WRITE 4 KiB random QD16 (the front-end") {
		t.Error("a row where the servers disagree is read as bound by one side")
	}
}
