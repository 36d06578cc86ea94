package guestbench

import (
	"bufio"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/kvfs/kvfs/bench/report"
)

// Results are what the guest reported: every value by mount, test and run.
type Results struct {
	// Config holds the fields of the GB-CONFIG line.
	Config map[string]string
	// Values maps mount → test → run → value.
	Values map[string]map[string]map[int]float64
	// Errors are the GB-ERR and GB-FATAL lines, as printed.
	Errors []string
	// Ready and Done say whether the GB-READY and GB-DONE lines were seen.
	Ready, Done bool
}

// Parse reads the guest's console and collects the GB lines; everything else on the console is
// ignored. A malformed GB line, or a value reported twice, is an error.
func Parse(console string) (*Results, error) {
	r := &Results{Config: map[string]string{}, Values: map[string]map[string]map[int]float64{}}
	sc := bufio.NewScanner(strings.NewReader(console))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		word, rest, _ := strings.Cut(line, " ")
		switch word {
		case "GB":
			if err := r.add(rest); err != nil {
				return nil, fmt.Errorf("console line %d %q: %w", n, line, err)
			}
		case "GB-CONFIG":
			kv, err := fields(rest)
			if err != nil {
				return nil, fmt.Errorf("console line %d %q: %w", n, line, err)
			}
			for k, v := range kv {
				r.Config[k] = v
			}
		case "GB-ERR", "GB-FATAL":
			r.Errors = append(r.Errors, line)
		case "GB-READY":
			r.Ready = true
		case "GB-DONE":
			r.Done = true
		}
	}
	return r, sc.Err()
}

func (r *Results) add(s string) error {
	kv, err := fields(s)
	if err != nil {
		return err
	}
	for _, k := range []string{"run", "mount", "test", "value"} {
		if kv[k] == "" {
			return fmt.Errorf("no %s", k)
		}
	}
	run, err := strconv.Atoi(kv["run"])
	if err != nil || run < 1 {
		return fmt.Errorf("bad run %q", kv["run"])
	}
	v, err := strconv.ParseFloat(kv["value"], 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return fmt.Errorf("bad value %q", kv["value"])
	}
	m, t := kv["mount"], kv["test"]
	if r.Values[m] == nil {
		r.Values[m] = map[string]map[int]float64{}
	}
	if r.Values[m][t] == nil {
		r.Values[m][t] = map[int]float64{}
	}
	if _, dup := r.Values[m][t][run]; dup {
		return fmt.Errorf("%s on %s in run %d reported twice", t, m, run)
	}
	r.Values[m][t][run] = v
	return nil
}

// fields splits "k=v k=v" into a map.
func fields(s string) (map[string]string, error) {
	kv := map[string]string{}
	for _, f := range strings.Fields(s) {
		k, v, ok := strings.Cut(f, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("field %q is not key=value", f)
		}
		kv[k] = v
	}
	return kv, nil
}

// Median is the median over the runs of test on mount, and how many runs reported it.
func (r *Results) Median(mount, test string) (float64, int) {
	vs := r.Values[mount][test]
	xs := make([]float64, 0, len(vs))
	for _, v := range vs {
		xs = append(xs, v)
	}
	return report.Median(xs), len(xs)
}

// Ratio is the median of per-run ratios and their range over the runs.
type Ratio struct {
	Med, Lo, Hi float64
	N           int // runs in which both mounts reported the test
}

// OK reports whether there was at least one run to compare.
func (q Ratio) OK() bool { return q.N > 0 }

func (q Ratio) String() string {
	switch {
	case !q.OK():
		return "–"
	case q.N == 1:
		return fmt.Sprintf("%.2f", q.Med)
	}
	return fmt.Sprintf("%.2f (%.2f–%.2f)", q.Med, q.Lo, q.Hi)
}

// Speedup compares mount a with mount b on test run by run, so that above 1 is better for a:
// a's value ÷ b's for rates, b's ÷ a's for times. Runs in which either mount has no value, or
// the divisor is zero, are left out.
func (r *Results) Speedup(a, b string, t Test) Ratio {
	av, bv := r.Values[a][t.Name], r.Values[b][t.Name]
	runs := make([]int, 0, len(av))
	for run := range av {
		runs = append(runs, run)
	}
	slices.Sort(runs)
	var xs []float64
	for _, run := range runs {
		x, ok := bv[run]
		if !ok {
			continue
		}
		num, den := av[run], x
		if !t.Unit.HigherIsBetter() {
			num, den = den, num
		}
		if den > 0 {
			xs = append(xs, num/den)
		}
	}
	if len(xs) == 0 {
		return Ratio{Med: math.NaN(), Lo: math.NaN(), Hi: math.NaN()}
	}
	return Ratio{Med: report.Median(xs), Lo: slices.Min(xs), Hi: slices.Max(xs), N: len(xs)}
}
