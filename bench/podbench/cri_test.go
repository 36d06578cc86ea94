package podbench

import (
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
	"github.com/pelletier/go-toml/v2"
)

func TestParseCRILogLine(t *testing.T) {
	l, err := ParseCRILogLine("2026-12-02T01:06:20.012345678Z stdout F ready")
	if err != nil {
		t.Fatal(err)
	}
	if want := time.Date(2026, 12, 2, 1, 6, 20, 12345678, time.UTC); !l.Time.Equal(want) || l.Stream != "stdout" || l.Partial || l.Msg != "ready" {
		t.Errorf("got %+v", l)
	}
	if l, err := ParseCRILogLine("2026-12-02T01:06:20Z stderr P part of a line"); err != nil || !l.Partial || l.Msg != "part of a line" {
		t.Errorf("partial: %+v, %v", l, err)
	}
	if l, err := ParseCRILogLine("2026-12-02T01:06:20Z stdout F"); err != nil || l.Msg != "" {
		t.Errorf("empty line: %+v, %v", l, err)
	}
	for _, bad := range []string{"ready", "yesterday stdout F ready", "2026-12-02T01:06:20Z stdin F x", "2026-12-02T01:06:20Z stdout X x"} {
		if _, err := ParseCRILogLine(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestFirstCRILine(t *testing.T) {
	log := "2026-12-02T01:06:19Z stdout P rea\n2026-12-02T01:06:19.5Z stderr F noise\n2026-12-02T01:06:20Z stdout F ready\n2026-12-02T01:06:21Z stdout F ready\n"
	l, ok, err := FirstCRILine(log, "ready")
	if err != nil || !ok || !l.Time.Equal(time.Date(2026, 12, 2, 1, 6, 20, 0, time.UTC)) {
		t.Errorf("got %+v, %v, %v", l, ok, err)
	}
	// A line still being written is not read.
	if _, ok, err := FirstCRILine("2026-12-02T01:06:20Z stdout F ready", "ready"); ok || err != nil {
		t.Errorf("unterminated: %v, %v", ok, err)
	}
	if _, ok, err := FirstCRILine("", "ready"); ok || err != nil {
		t.Errorf("empty: %v, %v", ok, err)
	}
	if _, _, err := FirstCRILine("garbage\n", "ready"); err == nil {
		t.Error("garbage: no error")
	}
}

// criSampleLog has containerd 2.4's CRI lines, as its log writes them.
const criSampleLog = `time="2026-12-02T01:05:08.512554079Z" level=info msg="RunPodSandbox for name:\"pod-kvfs-1\" uid:\"pod-kvfs-1\" namespace:\"default\""
time="2026-12-02T01:05:59.052098476Z" level=info msg="RunPodSandbox for name:\"pod-kvfs-1\" uid:\"pod-kvfs-1\" namespace:\"default\" returns sandbox id \"f8f9\""
time="2026-12-02T01:06:00.848544399Z" level=info msg="StartContainer for \"00f5\""
time="2026-12-02T01:06:19.955960106Z" level=info msg="StartContainer for \"00f5\" returns successfully"
time="2026-12-02T01:07:00Z" level=info msg="RunPodSandbox for name:\"pod-runc-1\" uid:\"pod-runc-1\" namespace:\"default\""
time="2026-12-02T01:07:01Z" level=error msg="RunPodSandbox for name:\"pod-runc-1\" uid:\"pod-runc-1\" namespace:\"default\" failed" error="x"
not a logrus line
time="2026-12-02T01:07:02Z" level=info msg="StartContainer for \"aa11\" returns successfully"
`

func TestParseCRIEvents(t *testing.T) {
	ev, err := ParseCRIEvents(criSampleLog)
	if err != nil {
		t.Fatal(err)
	}
	if len(ev.RunPodSandbox) != 2 || len(ev.StartContainer) != 2 {
		t.Fatalf("events %+v", ev)
	}
	if got := ev.StartContainer["00f5"].Sub(ev.RunPodSandbox["pod-kvfs-1"]); got != 71443406027*time.Nanosecond {
		t.Errorf("kvfs: runp received → start returned %v", got)
	}
	if got := ev.RunPodSandbox["pod-runc-1"]; !got.Equal(time.Date(2026, 12, 2, 1, 7, 0, 0, time.UTC)) {
		t.Errorf("runc's RunPodSandbox at %v: the failed line counted", got)
	}
	if _, err := ParseCRIEvents(`time="later" level=info msg="StartContainer for \"x\" returns successfully"`); err == nil {
		t.Error("a bad time: no error")
	}
}

func TestParseCPUTicks(t *testing.T) {
	stat := "4242 (qemu (x) y) S 4200 4242 1 0 -1 4194560 100 0 0 0 150 50 7 3 20 0 5 0 12345 0 0"
	if n, err := ParseCPUTicks(stat); err != nil || n != 210 {
		t.Errorf("got %d, %v; want 210", n, err)
	}
	if _, err := ParseCPUTicks("42 (x) S 1 2 3"); err == nil {
		t.Error("short: no error")
	}
	if _, err := ParseCPUTicks("42 (x) S 1 2 3 4 5 6 7 8 9 10 u 12 13 14"); err == nil {
		t.Error("not a number: no error")
	}
}

// TestCRIRuntime: the kvfs handler merges into the CRI config beside runc.
func TestCRIRuntime(t *testing.T) {
	b, err := ctrdconf.Config("/tmp/kvfspb-x", "info", true, nil, ctrdconf.KvfsRuntime(HandlerKvfs, "/tmp/kvfspb-x/kvfs.toml", "podsandbox"))
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Plugins map[string]struct {
			Containerd struct {
				Runtimes map[string]struct {
					RuntimeType string `toml:"runtime_type"`
					Sandboxer   string
					Options     map[string]any
				}
			}
		}
	}
	if err := toml.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	rts := m.Plugins["io.containerd.cri.v1.runtime"].Containerd.Runtimes
	k := rts[HandlerKvfs]
	if k.RuntimeType != RuntimeKvfs || k.Sandboxer != "podsandbox" || k.Options["ConfigPath"] != "/tmp/kvfspb-x/kvfs.toml" {
		t.Errorf("kvfs handler %+v", k)
	}
	if rts[HandlerRunc].RuntimeType != RuntimeRunc {
		t.Errorf("runc handler %+v", rts[HandlerRunc])
	}
}

func TestCRISection(t *testing.T) {
	kvfs := CRIRound{RunP: 10 * time.Second, Create: time.Second, Start: 3 * time.Second, FirstLine: 15 * time.Second,
		LogStart: 13 * time.Second, LogLine: 14 * time.Second, StopP: 4 * time.Second, RmP: time.Second,
		Shim: Mem{StatusRSS: 20480, RSS: 20480, PSS: 18432}, Server: Mem{StatusRSS: 32768, RSS: 32768, PSS: 14336},
		VMM:      Mem{StatusRSS: 327680, RSS: 327680, PSS: 307200, Memfd: 153600},
		StartCPU: 20 * time.Second, IdleCPU: 0.2}
	runc := CRIRound{RunP: time.Second, Create: 500 * time.Millisecond, Start: 500 * time.Millisecond, FirstLine: 2500 * time.Millisecond,
		LogStart: 2 * time.Second, LogLine: 2 * time.Second, StopP: time.Second, RmP: time.Second,
		Shim: Mem{StatusRSS: 18432, RSS: 18432, PSS: 16384}, Others: Mem{StatusRSS: 2048, RSS: 2048, PSS: 1024},
		StartCPU: 500 * time.Millisecond, IdleCPU: 0.004}
	kvfs2 := kvfs
	kvfs2.FirstLine = 25 * time.Second
	rep := &CRIReport{
		Config: Config{Runs: 2, Memory: "512M", VCPUs: 1, Settle: 2 * time.Second, Idle: 5 * time.Second, CRI: true, Command: "kvfspodbench -cri -runs 2"},
		Accel:  "tcg", AccelWhy: "no usable /dev/kvm",
		Rounds: map[string][]CRIRound{HandlerKvfs: {kvfs, kvfs2}, HandlerRunc: {runc, runc}},
	}
	s := CRISection(rep)
	for _, want := range []string{
		CRISectionHeading + "\n",
		"`kvfspodbench -cri -runs 2`",
		"/dev/kvm would cut the VM boot 5–20×",
		"| **pod start: `runp` run → the first log line** (polled) | 20.000 (15.000–25.000) | 2.500 | 8.0 (6.0–10.0) |",
		"| containerd's log: RunPodSandbox received → StartContainer returned | 13.000 | 2.000 | 6.5 |",
		"| **total PSS** (shared pages counted once, split) | 332.0 | 17.0 | 19.5 |",
		"| kvfsd (confined: its supervisor and server) RSS | 32.0 | 0.0 | – |",
		"| pause and the container's process on the host, RSS | 0.0 | 2.0 | – |",
		"| CPU used while the pod idles (over 5s), millicores | 200 | 4 | 50.0 |",
		"Pod start (`runp` + `create` + `start` to the container's first log line): 20.00 s with kvfs against 2.50 s with runc, 8.0×",
		"Teardown (`stopp` + `rmp`): 5.00 s against 2.00 s, 2.5×.",
		// 332 − 17 = 315 MiB, rounded up to 16 MiB.
		"is 315 MiB PSS by the medians (315 at most in these rounds), so `memory: 320Mi`",
		"CPU: 196 millicores idle above runc's",
		"agreed within 5% for every process read",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("section lacks %q:\n%s", want, s)
		}
	}
	// The CRI section and the ctr section replace only themselves.
	doc := report.Splice(report.Splice("# Benchmarks\n", SectionHeading, SectionHeading+"\n\nctr\n"), CRISectionHeading, s)
	if again := report.Splice(doc, CRISectionHeading, s); again != doc || !strings.Contains(doc, SectionHeading+"\n\nctr\n\n"+CRISectionHeading) {
		t.Errorf("spliced:\n%s", again)
	}
}
