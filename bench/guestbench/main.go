package guestbench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/log"
	"github.com/sirupsen/logrus"

	"github.com/kvfs/kvfs/bench/report"
)

// Main is the command line of bench/cmd/kvfsguestbench; it returns the exit status.
func Main(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := Config{Command: strings.Join(args, " ")}
	fs.StringVar(&cfg.Kvfsd, "kvfsd", "bin/kvfsd", "kvfsd binary")
	fs.StringVar(&cfg.Virtiofsd, "virtiofsd", "/usr/lib/qemu/virtiofsd", "the C virtiofsd")
	fs.StringVar(&cfg.QEMU, "qemu", "", "QEMU binary (default "+"qemu-system-x86_64"+")")
	fs.StringVar(&cfg.ImageDir, "image", defaultImageDir(), "directory of the bench image (packaging/guest/build.sh --bench)")
	fs.IntVar(&cfg.Runs, "runs", 3, "runs of every workload on every mount")
	fs.IntVar(&cfg.FioRuntime, "fio-runtime", 2, "seconds per fio job")
	fs.IntVar(&cfg.FioMiB, "fio-mib", 64, "size of fio's file, MiB")
	fs.IntVar(&cfg.MetaFiles, "files", 2000, "files the metadata workload creates, stats, lists and deletes")
	fs.IntVar(&cfg.DDMiB, "dd-mib", 64, "size of dd's file, MiB")
	fs.IntVar(&cfg.CFiles, "c-files", 24, "C files of the build workload")
	fs.IntVar(&cfg.BuildJobs, "build-jobs", 0, "make -j of the Lua build (default: -smp)")
	fs.StringVar(&cfg.SrcCache, "src-cache", "", "directory the Lua source tarball is downloaded to once (default: IMAGE/src)")
	run := fs.String("run", "", "run only the workloads whose test names (workloads.go: read-psync-4k, create, cbuild, luabuild, killpriv-randwrite-psync-4k, ...) match this regular expression")
	fs.StringVar(&cfg.MemSize, "mem", "2G", "guest memory")
	fs.IntVar(&cfg.SMP, "smp", 2, "guest vCPUs")
	fs.DurationVar(&cfg.Timeout, "timeout", 30*time.Minute, "limit for the guest")
	fs.StringVar(&cfg.Invoked, "invoked", "", "how the benchmark was started, for the report")
	fs.StringVar(&cfg.Rev, "rev", "", "kvfsd's source revision, for the report")
	out := fs.String("out", "docs/measurements/benchmarks.md", "document whose guest-level section is written (replaced, or appended); - for stdout")
	chart := fs.String("chart", "docs/measurements/benchmarks-guest.png", "chart PNG; empty for none")
	quiet := fs.Bool("q", false, "do not print the guest's result lines as they arrive")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvfsguestbench: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if *run != "" {
		re, err := regexp.Compile(*run)
		if err != nil {
			fmt.Fprintf(stderr, "kvfsguestbench: -run: %v\n", err)
			return 2
		}
		cfg.Run = re
	}
	if err := cfg.check(); err != nil {
		fmt.Fprintf(stderr, "kvfsguestbench: %v\n", err)
		return 2
	}
	if !*quiet {
		cfg.Progress = stderr
	}
	// The in-process servers log connects and disconnects at info level.
	log.L.Logger.SetOutput(stderr)
	log.L.Logger.SetLevel(logrus.WarnLevel)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	rep, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "kvfsguestbench: %v\n", err)
		return 1
	}
	if err := write(rep, *out, *chart, stdout); err != nil {
		fmt.Fprintf(stderr, "kvfsguestbench: %v\n", err)
		return 1
	}
	if len(rep.Results.Errors) > 0 {
		fmt.Fprintf(stderr, "kvfsguestbench: %d workloads failed in the guest:\n%s\n", len(rep.Results.Errors), strings.Join(rep.Results.Errors, "\n"))
		return 1
	}
	return 0
}

// defaultImageDir is $KVFS_CACHE/guest-bench, else /var/cache/kvfs/guest-bench.
func defaultImageDir() string {
	if d := os.Getenv("KVFS_CACHE"); d != "" {
		return filepath.Join(d, "guest-bench")
	}
	return "/var/cache/kvfs/guest-bench"
}

func (c *Config) check() error {
	switch {
	case c.Runs < 1:
		return errors.New("-runs must be at least 1")
	case c.FioRuntime < 1:
		return errors.New("-fio-runtime must be at least 1 s")
	case c.FioMiB < 1 || c.DDMiB < 1 || c.MetaFiles < 1 || c.CFiles < 1:
		return errors.New("-fio-mib, -dd-mib, -files and -c-files must be at least 1")
	case c.SMP < 1:
		return errors.New("-smp must be at least 1")
	case c.BuildJobs < 0:
		return errors.New("-build-jobs must not be negative")
	}
	if tests, killpriv := Selected(c.Run); len(tests) == 0 && !killpriv {
		return fmt.Errorf("-run %q matches no workload", c.Run)
	}
	for _, b := range []string{c.Kvfsd, c.Virtiofsd} {
		if _, err := os.Stat(b); err != nil {
			return err
		}
	}
	return nil
}

func write(rep *Report, out, chart string, stdout io.Writer) error {
	rel := ""
	if chart != "" {
		tests, _ := Selected(rep.Config.Run)
		png, err := Chart(rep.Results, tests)
		if err != nil {
			return err
		}
		if err := os.WriteFile(chart, png, 0o644); err != nil {
			return err
		}
		rel = chart
		if out != "-" {
			if r, err := filepath.Rel(filepath.Dir(out), chart); err == nil {
				rel = r
			}
		}
	}
	return report.WriteSection(out, SectionHeading, Section(rep, rel), stdout)
}
