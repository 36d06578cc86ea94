package serverbench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// Config is what Run measures and where it writes the results.
type Config struct {
	Kvfsd     string        // the kvfsd binary
	Virtiofsd string        // the C virtiofsd binary
	Dir       string        // where to make the shared directory ("": tmpfs /dev/shm if present)
	Rounds    int           // interleaved rounds
	Duration  time.Duration // measured time of one workload on one target in one round
	Slices    int           // the measured time is cut into this many slices, alternating between a pair
	Warmup    time.Duration // unmeasured time before each measurement
	Files     int           // files in the lookup and readdir directory
	DataSize  int64         // bytes of the data file
	Only      string        // a regular expression: run only the workloads whose names match
	Out       string        // the Markdown report ("" for none)
	Chart     string        // the PNG chart ("" for none)
	Invoked   string        // how the benchmark was started, recorded in the report
	Command   string        // this program's command line, recorded in the report
	Rev       string        // kvfsd's source revision, recorded in the report
	Log       io.Writer     // progress

	// MemoryFiles is how many files the memory measurement looks up; it runs when Only
	// matches "memory" (memoryName).
	MemoryFiles int

	// ProfileTime is how long kvfsd runs each profiled workload under a CPU profile, after
	// the rounds (0: no profile); ProfileDir, if set, keeps the raw profiles there.
	ProfileTime time.Duration
	ProfileDir  string
}

// ParseFlags parses the command line of kvfsbench (argv[0] is the program) into a Config.
func ParseFlags(argv []string, stderr io.Writer) (*Config, error) {
	args := argv[1:]
	c := &Config{Log: stderr}
	fs := flag.NewFlagSet("kvfsbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.Kvfsd, "kvfsd", "bin/kvfsd", "the kvfsd `binary`")
	fs.StringVar(&c.Virtiofsd, "virtiofsd", "/usr/lib/qemu/virtiofsd", "the C virtiofsd `binary`")
	fs.StringVar(&c.Dir, "dir", "", "make the shared directory under `DIR` (default: /dev/shm if it is tmpfs, else $TMPDIR)")
	fs.IntVar(&c.Rounds, "rounds", 8, "interleaved `rounds`")
	fs.DurationVar(&c.Duration, "duration", 750*time.Millisecond, "measured time of one workload on one server per round")
	fs.IntVar(&c.Slices, "slices", 6, "alternate kvfsd and the C virtiofsd this many times within a measurement")
	fs.DurationVar(&c.Warmup, "warmup", 150*time.Millisecond, "unmeasured time before each measurement")
	fs.IntVar(&c.Files, "files", 10000, "`files` in the LOOKUP and READDIRPLUS directory")
	mib := fs.Int("data-mib", 64, "size of the data file in `MiB`")
	fs.DurationVar(&c.ProfileTime, "profile", 5*time.Second, "after the rounds, run kvfsd under a CPU profile for this `long` per profiled workload (0: none)")
	fs.StringVar(&c.ProfileDir, "profile-dir", "", "keep kvfsd's raw CPU profiles in `dir` (for go tool pprof)")
	fs.StringVar(&c.Only, "run", "", "run only the workloads matching `regexp` (the memory measurement is named \"memory\": -run memory runs only it)")
	fs.IntVar(&c.MemoryFiles, "memory-files", 100_000, "`files` the memory measurement looks up")
	fs.StringVar(&c.Out, "out", "", "write the Markdown report to `file`")
	fs.StringVar(&c.Chart, "chart", "", "write the PNG chart of the ratios to `file`")
	fs.StringVar(&c.Invoked, "invoked", "", "how the benchmark was started (`command`), recorded in the report")
	fs.StringVar(&c.Rev, "rev", "", "kvfsd's source `revision`, recorded in the report")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() != 0 {
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	c.DataSize = int64(*mib) << 20
	c.Command = shellJoin(argv)
	switch {
	case c.Rounds < 1:
		return nil, errors.New("-rounds must be at least 1")
	case c.Duration <= 0:
		return nil, errors.New("-duration must be positive")
	case c.Slices < 1 || c.Duration/time.Duration(c.Slices) < time.Millisecond:
		return nil, errors.New("-slices must be at least 1, and the slices at least 1ms long")
	case c.Files < 1:
		return nil, errors.New("-files must be at least 1")
	case c.MemoryFiles < 1:
		return nil, errors.New("-memory-files must be at least 1")
	case c.DataSize < 1<<20:
		return nil, errors.New("-data-mib must be at least 1")
	}
	if _, err := regexp.Compile(c.Only); err != nil {
		return nil, fmt.Errorf("-run: %w", err)
	}
	return c, nil
}

// shellJoin quotes argv for a shell where needed.
func shellJoin(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		if a == "" || strings.ContainsAny(a, " \t\n'\"\\$`|&;<>()*?[]{}~#!") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		q[i] = a
	}
	return strings.Join(q, " ")
}

// Main is kvfsbench: it parses argv (argv[0] is the program), runs the benchmark and writes
// the report.
func Main(argv []string, stdout, stderr io.Writer) int {
	if os.Getenv(floorEchoEnv) != "" {
		return floorEcho()
	}
	cfg, err := ParseFlags(argv, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "kvfsbench: %v\n", err)
		return 2
	}
	res, err := Run(context.Background(), cfg)
	if err != nil {
		fmt.Fprintf(stderr, "kvfsbench: %v\n", err)
		return 1
	}
	if cfg.Chart != "" {
		png, err := Chart(res)
		if err == nil {
			err = os.WriteFile(cfg.Chart, png, 0o644)
		}
		if err != nil {
			fmt.Fprintf(stderr, "kvfsbench: %v\n", err)
			return 1
		}
	}
	report := Report(res, chartRef(cfg))
	if cfg.Out == "" {
		io.WriteString(stdout, report)
	} else if err := os.WriteFile(cfg.Out, []byte(report), 0o644); err != nil {
		fmt.Fprintf(stderr, "kvfsbench: %v\n", err)
		return 1
	}
	if res.Failed() {
		fmt.Fprintln(stderr, "kvfsbench: some measurements failed; see the report")
		return 1
	}
	return 0
}

// chartRef is the chart's path as the report links it: relative to the report.
func chartRef(cfg *Config) string {
	if cfg.Chart == "" {
		return ""
	}
	if cfg.Out != "" {
		if rel, err := filepath.Rel(filepath.Dir(cfg.Out), cfg.Chart); err == nil {
			return rel
		}
	}
	return cfg.Chart
}
