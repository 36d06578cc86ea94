package guestbench

import (
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const console = `KVFS: booted 6.1.0-57-amd64
GB-CONFIG runs=3 fio_runtime=2 fio_mib=64 meta_files=2000 dd_mib=64
GB-READY
GB-RUN run=1 order=kvfsd,virtiofsd,9p t=16.39
GB run=1 mount=kvfsd test=randread-psync-4k value=1200.0
GB run=1 mount=virtiofsd test=randread-psync-4k value=1000.0
GB run=1 mount=9p test=randread-psync-4k value=600.0
GB run=2 mount=kvfsd test=randread-psync-4k value=900
GB run=2 mount=virtiofsd test=randread-psync-4k value=1000
GB run=2 mount=9p test=randread-psync-4k value=300
GB run=3 mount=kvfsd test=randread-psync-4k value=3000
GB run=3 mount=virtiofsd test=randread-psync-4k value=2000
GB run=1 mount=kvfsd test=cbuild value=2.0
GB run=1 mount=virtiofsd test=cbuild value=3.0
GB run=2 mount=kvfsd test=cbuild value=4.0
GB run=2 mount=virtiofsd test=cbuild value=2.0
GB-ERR run=3 mount=9p test=randread-psync-4k fio: something broke
GB-DONE t=191.55
KVFS-EXIT 0
`

func TestParse(t *testing.T) {
	r, err := Parse(console)
	if err != nil {
		t.Fatal(err)
	}
	if !r.Ready || !r.Done {
		t.Errorf("Ready %v Done %v, want both", r.Ready, r.Done)
	}
	if r.Config["runs"] != "3" || r.Config["meta_files"] != "2000" {
		t.Errorf("Config = %v", r.Config)
	}
	if got := r.Values["9p"]["randread-psync-4k"]; len(got) != 2 || got[1] != 600 || got[2] != 300 {
		t.Errorf("9p randread values = %v", got)
	}
	if len(r.Errors) != 1 || !strings.Contains(r.Errors[0], "something broke") {
		t.Errorf("Errors = %q", r.Errors)
	}
}

func TestParseIncomplete(t *testing.T) {
	r, err := Parse("GB-READY\nGB run=1 mount=kvfsd test=create value=1\n")
	if err != nil {
		t.Fatal(err)
	}
	if r.Done {
		t.Error("Done without a GB-DONE line")
	}
}

func TestParseRejects(t *testing.T) {
	for _, line := range []string{
		"GB run=1 mount=kvfsd test=create",                 // no value
		"GB run=0 mount=kvfsd test=create value=1",         // runs count from 1
		"GB run=x mount=kvfsd test=create value=1",         // not a number
		"GB run=1 mount=kvfsd test=create value=-1",        // negative
		"GB run=1 mount=kvfsd test=create value=NaN",       // not a figure
		"GB run=1 mount=kvfsd test=create value=1 garbage", // not key=value
		"GB-CONFIG runs",
	} {
		if _, err := Parse(line + "\n"); err == nil {
			t.Errorf("Parse(%q) succeeded", line)
		}
	}
	dup := "GB run=1 mount=kvfsd test=create value=1\nGB run=1 mount=kvfsd test=create value=2\n"
	if _, err := Parse(dup); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("a value reported twice: err = %v", err)
	}
}

func TestMedian(t *testing.T) {
	r, err := Parse(console)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		mount, test string
		want        float64
		n           int
	}{
		{"kvfsd", "randread-psync-4k", 1200, 3},
		{"9p", "randread-psync-4k", 450, 2},
		{"kvfsd", "cbuild", 3, 2},
	} {
		got, n := r.Median(c.mount, c.test)
		if got != c.want || n != c.n {
			t.Errorf("Median(%s, %s) = %v over %d runs, want %v over %d", c.mount, c.test, got, n, c.want, c.n)
		}
	}
	if got, n := r.Median("kvfsd", "no-such-test"); !math.IsNaN(got) || n != 0 {
		t.Errorf("Median of nothing = %v over %d, want NaN over 0", got, n)
	}
}

func TestSpeedup(t *testing.T) {
	r, err := Parse(console)
	if err != nil {
		t.Fatal(err)
	}
	rate := Test{Name: "randread-psync-4k", Unit: IOPS}
	// Per run kvfsd ÷ virtiofsd: 1.2, 0.9, 1.5.
	q := r.Speedup("kvfsd", "virtiofsd", rate)
	if q.N != 3 || !near(q.Med, 1.2) || !near(q.Lo, 0.9) || !near(q.Hi, 1.5) {
		t.Errorf("rate ratio = %+v, want 1.2 (0.9–1.5) over 3 runs", q)
	}
	if s := q.String(); s != "1.20 (0.90–1.50)" {
		t.Errorf("String() = %q", s)
	}
	// Only the runs both reported: 2 and 3 against 9p.
	if q := r.Speedup("kvfsd", "9p", rate); q.N != 2 || !near(q.Med, 2.5) {
		t.Errorf("against 9p = %+v, want 2.5 over 2 runs", q)
	}
	// Times are inverted: virtiofsd ÷ kvfsd per run = 1.5, 0.5.
	q = r.Speedup("kvfsd", "virtiofsd", Test{Name: "cbuild", Unit: Seconds})
	if q.N != 2 || !near(q.Med, 1.0) || !near(q.Lo, 0.5) || !near(q.Hi, 1.5) {
		t.Errorf("time ratio = %+v, want 1.0 (0.5–1.5) over 2 runs", q)
	}
	if q := r.Speedup("kvfsd", "nobody", rate); q.OK() || q.String() != "–" {
		t.Errorf("ratio without a partner = %+v %q", q, q.String())
	}
}

func TestKillprivPerWrite(t *testing.T) {
	if got := (KillprivCounts{Writes: 400, Getxattrs: 401}).PerWrite(); !near(got, 1.0025) {
		t.Errorf("PerWrite = %v", got)
	}
	if got := (KillprivCounts{}).PerWrite(); !math.IsNaN(got) {
		t.Errorf("PerWrite without writes = %v, want NaN", got)
	}
}

// TestCSources compiles and runs the C build workload's program on the host with gcc: the
// sources must build and the program must find its own checksum.
func TestCSources(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cbuild")
	if err := writeCSources(dir, 5); err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.c"))
	if len(files) != 6 {
		t.Fatalf("%d C files, want 6", len(files))
	}
	prog := filepath.Join(dir, "prog")
	if out, err := exec.Command("gcc", append([]string{"-std=c99", "-Wall", "-Werror", "-o", prog}, files...)...).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	out, err := exec.Command(prog).CombinedOutput()
	if err != nil || string(out) != "cbuild ok\n" {
		t.Fatalf("program: %v, output %q", err, out)
	}
	if err := writeCSources(filepath.Join(t.TempDir(), "x"), 0); err == nil {
		t.Error("no source files accepted")
	}
}

func TestGuestScriptTestsMatch(t *testing.T) {
	script, err := os.ReadFile("guest.sh")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{KillprivTest.Name, "read-psync-1m", "cbuild", "luabuild", "dd-write", "dd-read"} {
		if !strings.Contains(string(script), want) {
			t.Errorf("guest.sh does not report %s", want)
		}
	}
	fio := 0
	for _, tt := range Tests {
		if strings.HasSuffix(tt.Name, "-4k") {
			fio++
		}
	}
	if fio != 12 {
		t.Errorf("%d fio 4 KiB tests, want 4 patterns × 3 engines", fio)
	}
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
