// Package report holds what the benchmarks' reports (bench/serverbench, bench/guestbench,
// bench/podbench) share: the machine they ran on (Host), the lines every report starts with,
// medians, figures in seconds and MiB, a section spliced into docs/measurements/benchmarks.md, and
// the chart of ratios (RatioChart, drawn with gonum.org/v1/plot).
package report

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"time"
)

// Median returns the median of xs: the middle value, or the mean of the two middle values for an
// even count. It returns NaN for no values and leaves xs unchanged.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Command is a report's Command line: the command line the benchmark ran, and how that was
// started (invoked: scripts/bench.sh, make bench) if known.
func Command(invoked, command string) string {
	if invoked != "" {
		return fmt.Sprintf("- **Command:** `%s`, which ran `%s`\n", invoked, command)
	}
	return fmt.Sprintf("- **Command:** `%s`\n", command)
}

// Date is a report's Date line: when the run started, in UTC, and how long it took, with more
// (", the guest 5m2s") after that in the brackets.
func Date(started, finished time.Time, more string) string {
	return fmt.Sprintf("- **Date:** %s (the run took %s%s)\n", started.UTC().Format("2006-01-02 15:04 MST"), finished.Sub(started).Round(time.Second), more)
}

// Machine is a report's Machine line: the host, its load average before and after the run,
// and what of the machine's sharing the report knows (note, after "a shared machine": ": other
// jobs were running").
func Machine(h Host, loadBefore, loadAfter, note string) string {
	return fmt.Sprintf("- **Machine:** %d CPUs (nproc), %s, %s RAM, %s; load average %s before the run and %s after it (a shared machine%s)\n",
		h.CPUs, h.CPUModel, h.MemTotal, h.Kernel, loadBefore, loadAfter, note)
}

// Secs is d in seconds, NaN for zero: a figure the round does not have, which the summaries
// leave out.
func Secs(d time.Duration) float64 {
	if d == 0 {
		return math.NaN()
	}
	return d.Seconds()
}

// MiB is kib KiB in MiB.
func MiB(kib int64) float64 { return float64(kib) / 1024 }

// Each is f of each round.
func Each[R any](rs []R, f func(R) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

// Seconds is f of each round in seconds (Secs).
func Seconds[R any](rs []R, f func(R) time.Duration) []float64 {
	return Each(rs, func(r R) float64 { return Secs(f(r)) })
}

// MiBs is f of each round, in KiB, in MiB.
func MiBs[R any](rs []R, f func(R) int64) []float64 {
	return Each(rs, func(r R) float64 { return MiB(f(r)) })
}

// Splice puts section into doc in place of an existing section that starts with heading
// (from it to the next "## " heading or the end), or appends it.
func Splice(doc, heading, section string) string {
	start := -1
	if strings.HasPrefix(doc, heading+"\n") {
		start = 0
	} else if i := strings.Index(doc, "\n"+heading+"\n"); i >= 0 {
		start = i + 1
	}
	if start < 0 {
		if doc != "" && !strings.HasSuffix(doc, "\n\n") {
			doc = strings.TrimRight(doc, "\n") + "\n\n"
		}
		return doc + section
	}
	rest := doc[start+len(heading)+1:]
	tail := ""
	if j := strings.Index(rest, "\n## "); j >= 0 {
		tail = rest[j+1:]
	}
	head := doc[:start]
	if !strings.HasSuffix(section, "\n\n") && tail != "" {
		section = strings.TrimRight(section, "\n") + "\n\n"
	}
	return head + section + tail
}

// WriteSection splices section, which starts with heading, into the document out (Splice),
// or writes it to stdout if out is "-".
func WriteSection(out, heading, section string, stdout io.Writer) error {
	if out == "-" {
		_, err := io.WriteString(stdout, section)
		return err
	}
	doc, err := os.ReadFile(out)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	tmp := out + ".tmp"
	if err := os.WriteFile(tmp, []byte(Splice(string(doc), heading, section)), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}
