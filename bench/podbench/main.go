package podbench

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox"
)

// Main is the command line of bench/cmd/kvfspodbench; it returns the exit status.
func Main(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := Config{Command: strings.Join(args, " ")}
	fs.IntVar(&cfg.Runs, "runs", 10, "rounds; each runs kvfs then runc")
	fs.StringVar(&cfg.ShimDir, "shim-dir", "bin", "directory holding containerd-shim-kvfs-v2")
	fs.StringVar(&cfg.BinDir, "bin-dir", "/var/cache/kvfs/bin", "containerd, ctr, containerd-shim-runc-v2 and crictl (scripts/deps.sh)")
	fs.StringVar(&cfg.GuestDir, "guest", "/var/cache/kvfs/agent-guest", "the agent guest image (packaging/guest/build.sh --agent)")
	fs.StringVar(&cfg.Accel, "accel", "", "QEMU accelerator: kvm, tcg, or empty for kvm if a probe boot of -probe-guest under KVM works")
	fs.StringVar(&cfg.ProbeGuest, "probe-guest", vmtest.DefaultCacheDir, "the test guest (packaging/guest/build.sh DIR) the KVM probe boots")
	fs.StringVar(&cfg.Memory, "mem", "512M", "the guest's memory (vm.memory)")
	fs.IntVar(&cfg.VCPUs, "vcpus", 1, "the guest's vCPUs (vm.vcpus)")
	fs.StringVar(&cfg.QEMU, "qemu", sandbox.DefaultConfig().VM.QEMU, "the QEMU binary the pods and the floor boot run (vm.qemu)")
	fs.StringVar(&cfg.VMTOML, "vm-toml", "", "TOML lines added to the kvfs configuration's [vm] table, e.g. 'free_page_reporting = false'")
	fs.DurationVar(&cfg.Settle, "settle", 2*time.Second, "wait after a sleep container started before its memory is read")
	fs.IntVar(&cfg.Density, "density", 10, "with ctr: pods of each runtime run at once after the rounds, for the memory per pod (0: none)")
	fs.BoolVar(&cfg.CRI, "cri", false, "run pods through containerd's CRI with crictl (runtime handlers kvfs and runc) and write the CRI section, instead of ctr's")
	fs.DurationVar(&cfg.Idle, "idle", 5*time.Second, "with -cri: how long a running pod's CPU use is measured for")
	userns := fs.Bool("userns", false, "with -cri: run a metadata workload in a kvfs pod with a user namespace and one without, and write the user-namespace section, instead of the CRI's")
	fs.StringVar(&cfg.KeepLog, "keep-log", "", "copy containerd's log (its shims' lines included) here at the end")
	fs.StringVar(&cfg.Invoked, "invoked", "", "how the benchmark was started, for the report")
	fs.StringVar(&cfg.Rev, "rev", "", "kvfs's source revision, for the report")
	out := fs.String("out", "docs/measurements/benchmarks.md", "document whose pod-level section (ctr's, or with -cri the CRI's) is written (replaced, or appended); - for stdout")
	quiet := fs.Bool("q", false, "do not print each round's figures")
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvfspodbench: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if cfg.Runs < 1 || cfg.VCPUs < 1 {
		fmt.Fprintln(stderr, "kvfspodbench: -runs and -vcpus must be at least 1")
		return 2
	}
	if cfg.Density < 0 {
		fmt.Fprintln(stderr, "kvfspodbench: -density must not be negative")
		return 2
	}
	if cfg.Idle <= 0 {
		fmt.Fprintln(stderr, "kvfspodbench: -idle must be positive")
		return 2
	}
	if !*quiet {
		cfg.Progress = stderr
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *userns && !cfg.CRI {
		fmt.Fprintln(stderr, "kvfspodbench: -userns needs -cri")
		return 2
	}
	heading, section := SectionHeading, ""
	switch {
	case *userns:
		rep, err := RunUserns(ctx, cfg)
		if err != nil {
			fmt.Fprintf(stderr, "kvfspodbench: %v\n", err)
			return 1
		}
		heading, section = UsernsSectionHeading, UsernsSection(rep)
	case cfg.CRI:
		rep, err := RunCRI(ctx, cfg)
		if err != nil {
			fmt.Fprintf(stderr, "kvfspodbench: %v\n", err)
			return 1
		}
		heading, section = CRISectionHeading, CRISection(rep)
	default:
		rep, err := Run(ctx, cfg)
		if err != nil {
			fmt.Fprintf(stderr, "kvfspodbench: %v\n", err)
			return 1
		}
		section = Section(rep)
	}
	if err := report.WriteSection(*out, heading, section, stdout); err != nil {
		fmt.Fprintf(stderr, "kvfspodbench: %v\n", err)
		return 1
	}
	return 0
}
