package report

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{[]float64{3}, 3},
		{[]float64{5, 1, 3}, 3},
		{[]float64{4, 1, 3, 2}, 2.5},
		{[]float64{1, 1, 100, 1, 1}, 1},
	} {
		in := append([]float64(nil), tc.in...)
		if got := Median(in); got != tc.want {
			t.Errorf("Median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		for i := range in {
			if in[i] != tc.in[i] {
				t.Fatalf("Median reordered its input: %v", in)
			}
		}
	}
	if got := Median(nil); !math.IsNaN(got) {
		t.Errorf("Median(nil) = %v, want NaN", got)
	}
}

func TestHeaderLines(t *testing.T) {
	if got, want := Command("scripts/bench.sh", "bin/kvfsbench -rounds 2"), "- **Command:** `scripts/bench.sh`, which ran `bin/kvfsbench -rounds 2`\n"; got != want {
		t.Errorf("Command: %q, want %q", got, want)
	}
	if got, want := Command("", "kvfspodbench -runs 2"), "- **Command:** `kvfspodbench -runs 2`\n"; got != want {
		t.Errorf("Command without invoked: %q, want %q", got, want)
	}
	start := time.Date(2026, 12, 4, 22, 21, 30, 0, time.FixedZone("CET", 3600))
	if got, want := Date(start, start.Add(215400*time.Millisecond), ", the guest 3m2s"), "- **Date:** 2026-12-04 21:21 UTC (the run took 3m35s, the guest 3m2s)\n"; got != want {
		t.Errorf("Date: %q, want %q", got, want)
	}
	h := Host{CPUs: 2, CPUModel: "AMD EPYC", Kernel: "Linux 6.1 x86_64", MemTotal: "23.5 GiB"}
	if got, want := Machine(h, "0.46 1.23 1.58", "1.73 1.62 1.68", ""), "- **Machine:** 2 CPUs (nproc), AMD EPYC, 23.5 GiB RAM, Linux 6.1 x86_64; load average 0.46 1.23 1.58 before the run and 1.73 1.62 1.68 after it (a shared machine)\n"; got != want {
		t.Errorf("Machine: %q, want %q", got, want)
	}
	if got := Machine(h, "1", "2", ": other jobs were running"); !strings.HasSuffix(got, "after it (a shared machine: other jobs were running)\n") {
		t.Errorf("Machine with a note: %q", got)
	}
}

func TestSecondsAndMiBs(t *testing.T) {
	type round struct {
		d   time.Duration
		kib int64
	}
	rs := []round{{1500 * time.Millisecond, 2048}, {0, 512}}
	s := Seconds(rs, func(r round) time.Duration { return r.d })
	if len(s) != 2 || s[0] != 1.5 || !math.IsNaN(s[1]) {
		t.Errorf("Seconds = %v, want [1.5 NaN]: a zero is a figure the round lacks", s)
	}
	if m := MiBs(rs, func(r round) int64 { return r.kib }); len(m) != 2 || m[0] != 2 || m[1] != 0.5 {
		t.Errorf("MiBs = %v, want [2 0.5]", m)
	}
}

func TestSplice(t *testing.T) {
	const heading = "## Guest level: x"
	server := "# Benchmarks\n\n## Server level\n\ntext\n"
	sec := heading + "\n\nnew\n"
	once := Splice(server, heading, sec)
	if once != server+"\n"+sec {
		t.Errorf("appended:\n%q", once)
	}
	old := server + "\n" + heading + "\n\nold\nlines\n"
	if got := Splice(old, heading, sec); got != once {
		t.Errorf("replaced:\n%q\nwant\n%q", got, once)
	}
	if got := Splice("", heading, sec); got != sec {
		t.Errorf("into nothing: %q", got)
	}
	// A section after it (the pod level's after the guest level's) stays.
	pod := "## Pod level: x\n\npod\n"
	if got, want := Splice(old+"\n"+pod, heading, sec), once+"\n"+pod; got != want {
		t.Errorf("before another section:\n%q\nwant\n%q", got, want)
	}
	if got, want := Splice(heading+"\n\nold\n\n"+pod, heading, sec), sec+"\n"+pod; got != want {
		t.Errorf("at the start:\n%q\nwant\n%q", got, want)
	}
}
