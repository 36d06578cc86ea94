package podbench

import (
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseLogLine(t *testing.T) {
	got, err := ParseLogLine(`time="2026-12-01T22:36:22.117209323Z" level=info msg="the guest agent answers" boot_qemu=9.542s x="a \"q\" b"`)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"time": "2026-12-01T22:36:22.117209323Z", "level": "info", "msg": "the guest agent answers",
		"boot_qemu": "9.542s", "x": `a "q" b`}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	for _, bad := range []string{`msg="unterminated`, `no pairs here`, `=x`} {
		if _, err := ParseLogLine(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

const sampleLog = `time="2026-12-01T22:36:35.280317225Z" level=info msg="connecting to shim run-kvfs-1" address="unix:///run/containerd/s/3f" namespace=ns protocol=ttrpc version=3
some line that is not logrus
time="2026-12-01T22:36:57.934738942Z" level=info msg="the guest agent answers" agent=0.1.0 boot=22.432s boot_agent=1.274s boot_kernel=7.163s boot_qemu=14.021s boot_total=22.458s kernel=6.1.0-57-amd64 runtime=io.containerd.kvfs.v2 sandbox=run-kvfs-1
time="2026-12-01T22:37:08.805332356Z" level=info msg="shim disconnected" id=run-kvfs-1 namespace=ns
time="2026-12-01T22:37:08.805376501Z" level=info msg="cleaning up after shim disconnected" id=run-kvfs-1 namespace=ns
time="2026-12-01T22:37:09Z" level=info msg="connecting to shim run-runc-1" namespace=ns
time="2026-12-01T22:37:09.5Z" level=info msg="shim disconnected" id=run-runc-1 namespace=ns
`

func TestParseEvents(t *testing.T) {
	ev, err := ParseEvents(sampleLog)
	if err != nil {
		t.Fatal(err)
	}
	k := ev["run-kvfs-1"]
	if k == nil || len(ev) != 2 {
		t.Fatalf("events %v", ev)
	}
	if got, want := k.Span(), 33525015131*time.Nanosecond; got != want {
		t.Errorf("span %v, want %v", got, want)
	}
	wantBoot := map[string]time.Duration{"total": 22458 * time.Millisecond, "qemu": 14021 * time.Millisecond,
		"kernel": 7163 * time.Millisecond, "agent": 1274 * time.Millisecond}
	if !reflect.DeepEqual(k.Boot, wantBoot) || k.Answer.IsZero() {
		t.Errorf("boot %v at %v, want %v", k.Boot, k.Answer, wantBoot)
	}
	r := ev["run-runc-1"]
	if r.Span() != 500*time.Millisecond || r.Boot != nil {
		t.Errorf("runc: span %v, boot %v", r.Span(), r.Boot)
	}
	if _, err := ParseEvents(`time="yesterday" level=info msg="shim disconnected" id=x`); err == nil {
		t.Error("a bad time: no error")
	}
}

func TestParseMem(t *testing.T) {
	status := "Name:\tqemu\nVmHWM:\t  400 kB\nVmRSS:\t  331612 kB\nThreads:\t5\n"
	rollup := "5555-7777 ---p 00000000 00:00 0   [rollup]\nRss:              331600 kB\nPss:              313000 kB\nPss_Anon:   1 kB\n"
	m, err := ParseMem(status, rollup)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Mem{StatusRSS: 331612, RSS: 331600, PSS: 313000}); m != want {
		t.Errorf("got %+v, want %+v", m, want)
	}
	if got := m.Add(Mem{1, 2, 3, 4}); got != (Mem{331613, 331602, 313003, 4}) {
		t.Errorf("Add: %+v", got)
	}
	if _, err := ParseMem("VmRSS: 12 MB\n", rollup); err == nil {
		t.Error("MB: no error")
	}
	if _, err := ParseMem(status, "Rss: 1 kB\n"); err == nil {
		t.Error("no Pss: no error")
	}
}

func TestParseMemfdRss(t *testing.T) {
	smaps := `55d0c0000000-55d0c0100000 r-xp 00000000 08:01 1234                       /usr/bin/qemu-system-x86_64
Size:               1024 kB
Rss:                 900 kB
7f0000000000-7f0020000000 rw-s 00000000 00:01 5678                       /memfd:memory-backend-memfd (deleted)
Size:             524288 kB
Rss:              300000 kB
Pss:              150000 kB
7f0030000000-7f0030001000 rw-p 00000000 00:00 0
Rss:                   4 kB
7f0040000000-7f0040100000 rw-s 00000000 00:01 5679                       /memfd:other
Rss:                  16 kB
`
	got, err := ParseMemfdRss(smaps)
	if err != nil || got != 300016 {
		t.Errorf("got %d, %v; want 300016", got, err)
	}
}

func TestParseStat(t *testing.T) {
	pid, ppid, comm, err := ParseStat("4242 (qemu (x) y) S 4200 4242 1 0 -1")
	if err != nil || pid != 4242 || ppid != 4200 || comm != "qemu (x) y" {
		t.Errorf("got %d %d %q %v", pid, ppid, comm, err)
	}
	if _, _, _, err := ParseStat("42 noparens S 1"); err == nil {
		t.Error("no comm: no error")
	}
}

func TestFindShimAndDescendants(t *testing.T) {
	procs := []proc{
		{pid: 10, ppid: 1, cmdline: []string{"/bin/containerd-shim-kvfs-v2", "-namespace", "ns", "-id", "a", "-address", "/x"}},
		{pid: 11, ppid: 1, cmdline: []string{"containerd-shim-kvfs-v2", "-namespace", "ns", "-address", "/x", "-publish-binary", "c", "-id", "a", "start"}},
		{pid: 12, ppid: 1, cmdline: []string{"/bin/containerd-shim-kvfs-v2", "-namespace", "other", "-id", "a"}},
		{pid: 13, ppid: 1, cmdline: []string{"/bin/containerd-shim-runc-v2", "-namespace", "ns", "-id", "a"}},
		{pid: 20, ppid: 10, comm: "qemu-system-x86"},
		{pid: 21, ppid: 20, comm: "child"},
		{pid: 30, ppid: 13, comm: "sleep"},
	}
	pid, err := FindShim(procs, "containerd-shim-kvfs-v2", "ns", "a")
	if err != nil || pid != 10 {
		t.Errorf("kvfs: %d, %v; want 10", pid, err)
	}
	if _, err := FindShim(procs, "containerd-shim-kvfs-v2", "ns", "b"); err == nil {
		t.Error("no such shim: no error")
	}
	var got []int
	for _, p := range Descendants(procs, 10) {
		got = append(got, p.pid)
	}
	if !reflect.DeepEqual(got, []int{20, 21}) {
		t.Errorf("descendants of 10: %v", got)
	}
}

func TestSummarize(t *testing.T) {
	s := Summarize([]float64{3, 1, math.NaN(), 2, 10})
	if s != (Summary{Med: 2.5, Lo: 1, Hi: 10, N: 4}) {
		t.Errorf("got %+v", s)
	}
	if got := s.Format("%.1f"); got != "2.5 (1.0–10.0)" {
		t.Errorf("Format: %q", got)
	}
	if got := Summarize([]float64{2}).Format("%.1f"); got != "2.0" {
		t.Errorf("one: %q", got)
	}
	if got := Summarize(nil).Format("%.1f"); got != "–" {
		t.Errorf("none: %q", got)
	}
	if got := Ratios([]float64{10, 4, 6, 0}, []float64{2, 0, 3, 9}); !reflect.DeepEqual(got, []float64{5, 2}) {
		t.Errorf("Ratios: %v", got)
	}
}

func TestSection(t *testing.T) {
	boot := map[string]time.Duration{"total": 20 * time.Second, "qemu": 12 * time.Second, "kernel": 7 * time.Second, "agent": time.Second}
	rep := &Report{
		Config: Config{Runs: 2, Memory: "512M", VCPUs: 1, Settle: 2 * time.Second, Command: "kvfspodbench -runs 2"},
		Accel:  "tcg", AccelWhy: "no usable /dev/kvm",
		Teardown: []string{"round 2 kvfs: ctr tasks delete -f mem-kvfs-2: no answer within 1m30s; ended by killing QEMU"},
		Density: map[string]Density{
			// 4 pods: 4 × (shim 10 MiB, kvfsd 8, QEMU 100) PSS; runc 4 × (shim 4, container 0.5).
			RuntimeKvfs: {Pods: 4, PodMem: PodMem{Shim: Mem{RSS: 4 * 20480, PSS: 4 * 10240}, Server: Mem{RSS: 4 * 16384, PSS: 4 * 8192}, VMM: Mem{RSS: 4 * 204800, PSS: 4 * 102400}}, HostUsed: 4 * 131072},
			RuntimeRunc: {Pods: 4, PodMem: PodMem{Shim: Mem{RSS: 4 * 18432, PSS: 4 * 4096}, Container: Mem{RSS: 4 * 1024, PSS: 4 * 512}}, HostUsed: 4 * 8192},
		},
		Rounds: map[string][]Round{
			RuntimeKvfs: {
				{Run: 30 * time.Second, RunSpan: 29 * time.Second, PodMem: PodMem{Shim: Mem{StatusRSS: 20480, RSS: 20480, PSS: 18432}, Server: Mem{StatusRSS: 32768, RSS: 32768, PSS: 14336}, VMM: Mem{StatusRSS: 327680, RSS: 327680, PSS: 307200}}, Boot: boot},
				{Run: 34 * time.Second, RunSpan: 33 * time.Second, PodMem: PodMem{Shim: Mem{StatusRSS: 20480, RSS: 20480, PSS: 18432}, Server: Mem{StatusRSS: 32768, RSS: 32768, PSS: 14336}, VMM: Mem{StatusRSS: 327680, RSS: 327680, PSS: 307200}}, Boot: boot},
			},
			RuntimeRunc: {
				{Run: time.Second, RunSpan: 500 * time.Millisecond, PodMem: PodMem{Shim: Mem{StatusRSS: 18432, RSS: 18432, PSS: 16384}, Container: Mem{StatusRSS: 1024, RSS: 1024, PSS: 512}}},
				{Run: time.Second, RunSpan: 500 * time.Millisecond, PodMem: PodMem{Shim: Mem{StatusRSS: 18432, RSS: 18432, PSS: 16384}, Container: Mem{StatusRSS: 1024, RSS: 1024, PSS: 512}}},
			},
		},
	}
	s := Section(rep)
	for _, want := range []string{
		SectionHeading + "\n",
		"`kvfspodbench -runs 2`",
		"/dev/kvm would cut the VM boot 5–20×",
		"| `ctr run --rm … true`, s (wall time) | 32.000 (30.000–34.000) | 1.000 | 32.0 (30.0–34.0) |",
		"| **total RSS** (shim + kvfsd + QEMU + container; pages shared between them counted in each) | 372.0 | 19.0 | 19.6 |",
		"| kvfsd (confined: its supervisor and server) RSS | 32.0 | 0.0 | – |",
		"| QEMU + firmware (host time − guest uptime at the answer) — QEMU | 12.000 | 38% |",
		"vm.memory 512M",
		"### Teardown failures\n",
		"- round 2 kvfs: ctr tasks delete -f mem-kvfs-2: no answer within 1m30s; ended by killing QEMU\n",
		"did not end normally 1 times in 2 rounds",
		"### 4 pods of each runtime at once, MiB per pod\n",
		"| QEMU PSS | 100.0 | 0.0 | – |",
		"| **total PSS** | 118.0 | 4.5 | 26 |",
		"a kvfs pod then costs 118 MiB PSS (332 alone), a runc pod 4.5 MiB: 26×. The host's MemAvailable fell by 128 MiB per kvfs pod (8.0 per runc pod).",
		"| the host's MemAvailable, fallen from before the first pod (the second reading: the kernel's memory for the pods included, and whatever else the machine did meanwhile) | 128.0 | 8.0 | – |",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("section lacks %q:\n%s", want, s)
		}
	}
}
