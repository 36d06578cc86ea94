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
	"time"
)

// CountMain is kvfscount: it runs a fixed number of operations of one workload against one
// server and prints what the server consumed per operation. Unlike kvfsbench it measures no
// throughput, which a shared machine distorts; it exists to count per request what the load
// does not change (system calls with strace -c, instructions with valgrind, allocations and
// profiles from the server's own output), with the server started under any wrapper:
//
//	kvfscount -run 'READ 4 KiB random QD1$' -n 20000 -- strace -f -c -o /tmp/s.txt bin/kvfsd
//
// runs "strace -f -c -o /tmp/s.txt bin/kvfsd --socket-path=S -o source=DIR" on a fresh shared
// directory (as kvfsbench makes it), connects the in-repo front-end, runs -warmup operations,
// then -n measured ones, and disconnects, which ends the server (and writes strace's summary).
// The server CPU (and its system part) and switches it prints are of the process tree it
// started, the wrapper included; the front-end's are kvfscount's own (getrusage).
func CountMain(argv []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvfscount", flag.ContinueOnError)
	fs.SetOutput(stderr)
	only := fs.String("run", "", "the workload: a `regexp` matching exactly one workload name of kvfsbench")
	n := fs.Int("n", 20000, "measured `operations`")
	warm := fs.Int("warmup", 1000, "unmeasured `operations` before them")
	files := fs.Int("files", 10000, "`files` in the LOOKUP and READDIRPLUS directory")
	mib := fs.Int("data-mib", 64, "size of the data file in `MiB`")
	dir := fs.String("dir", "", "make the shared directory under `DIR` (default: /dev/shm if it is tmpfs, else $TMPDIR)")
	if err := fs.Parse(argv[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kvfscount: %v\n", err)
		return 1
	}
	if fs.NArg() == 0 {
		return fail(errors.New("no server command after the flags (… -- bin/kvfsd)"))
	}
	if *n < 1 || *warm < 0 || *files < 1 || *mib < 1 {
		return fail(errors.New("-n, -files and -data-mib must be positive, -warmup not negative"))
	}
	re, err := regexp.Compile(*only)
	if err != nil {
		return fail(fmt.Errorf("-run: %w", err))
	}
	var w *workload
	for _, x := range workloads(*files) {
		if re.MatchString(x.Name) {
			if w != nil {
				return fail(fmt.Errorf("-run %q matches %q and %q", *only, w.Name, x.Name))
			}
			w = &x
		}
	}
	if w == nil || w.Xattr {
		return fail(fmt.Errorf("-run %q matches no workload (the xattr one is not counted)", *only))
	}
	base := *dir
	if base == "" {
		base = defaultDir()
	}
	tmp, err := os.MkdirTemp(base, "kvfscount-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(tmp)
	shareDir := filepath.Join(tmp, "share")
	if err := os.Mkdir(shareDir, 0o755); err != nil {
		return fail(err)
	}
	sh, err := makeShare(shareDir, *files, int64(*mib)<<20)
	if err != nil {
		return fail(err)
	}
	const cdir = "create"
	if err := os.Mkdir(filepath.Join(shareDir, cdir), 0o755); err != nil {
		return fail(err)
	}
	sock := filepath.Join(tmp, "s.sock")
	args := append(fs.Args(), "--socket-path="+sock, "-o", "source="+shareDir)
	d, err := startDaemon(args, filepath.Join(tmp, "server.log"))
	if err != nil {
		return fail(err)
	}
	defer d.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	if err := d.waitSocket(ctx, sock); err != nil {
		return fail(fmt.Errorf("%w; its output:\n%s", err, d.logTail()))
	}
	s, err := dialServer(ctx, d, sock, sh, cdir)
	if err != nil {
		return fail(fmt.Errorf("%w; its output:\n%s", err, d.logTail()))
	}
	var fe0, fe1 usage // this process's: the front-end's
	run := func(ops int) (*meter, error) {
		m := newMeter(24*time.Hour, s.usage, nil)
		m.maxOps = ops
		err := w.run(ctx, s, m, 1)
		m.stop()
		if err == nil {
			err = m.err
		}
		return m, err
	}
	if *warm > 0 {
		if _, err := run(*warm); err != nil {
			s.fe.Close()
			return fail(fmt.Errorf("warm-up: %w", err))
		}
	}
	fe0 = selfUsage()
	m, err := run(*n)
	fe1 = selfUsage()
	s.fe.Close()
	if err != nil {
		return fail(err)
	}
	d.stop()
	ops := float64(m.ops)
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / ops }
	su, fu := m.u1.sub(m.u0), fe1.sub(fe0)
	fmt.Fprintf(stdout, "%s: %d operations in %v; server CPU %.2f µs/op (system %.2f), %.2f switches/op (its process tree, wrapper included); front-end CPU %.2f µs/op (system %.2f), %.2f switches/op (this process)\n",
		w.Name, m.ops, m.end.Sub(m.begin).Round(time.Millisecond),
		us(su.CPU), us(su.System), float64(su.Switches)/ops, us(fu.CPU), us(fu.System), float64(fu.Switches)/ops)
	return 0
}
