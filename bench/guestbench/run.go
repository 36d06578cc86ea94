package guestbench

import (
	"bytes"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/bench/report"
	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/cmdline"
)

//go:embed guest.sh
var guestScript []byte

// The mounts, each a share on a directory of its own and its tag in the guest.
const (
	MountKvfsd     = "kvfsd"
	MountVirtiofsd = "virtiofsd"
	Mount9p        = "9p"
	MountKP2       = "kvfsd-kp2"   // kvfsd --xattr, killpriv_v2 offered (its default)
	MountNoKP2     = "kvfsd-nokp2" // kvfsd --xattr -o no_killpriv_v2
	mountCtl       = "kvfs"        // the control share /init mounts: script and config
)

// Mounts are the compared mounts, kvfsd first.
var Mounts = []string{MountKvfsd, MountVirtiofsd, Mount9p}

// ServerArgs are the options both virtio-fs servers run with, after --socket-path and
// -o source: what Kata passes (cache=auto; no_posix_lock as Kata passed it to the C virtiofsd;
// the thread pool of the C virtiofsd's default, 0).
var ServerArgs = []string{"-o", "cache=auto", "-o", "no_posix_lock", "--thread-pool-size=0"}

// NinePOptions are the guest's 9p mount options: msize 512000 (close to the largest a virtio
// transport carries), cache=mmap as Kata used for 9p (loose caching would not see host changes;
// cache=none has no shared writable mmap, which fio's mmap engine needs).
const NinePOptions = "trans=virtio,version=9p2000.L,msize=512000,cache=mmap"

// Config is one benchmark run.
type Config struct {
	Kvfsd, Virtiofsd, QEMU string
	// ImageDir is where packaging/guest/build.sh --bench keeps the bench image.
	ImageDir string
	// Runs is how often the guest runs every workload on every mount.
	Runs int
	// FioRuntime is each fio job's length, whole seconds.
	FioRuntime int
	// FioMiB, MetaFiles, DDMiB and CFiles size the workloads: fio's file, the files created,
	// dd's file, the C sources compiled.
	FioMiB, MetaFiles, DDMiB, CFiles int
	// BuildJobs is make's -j for the Lua build; 0 for SMP.
	BuildJobs int
	// SrcCache is where the Lua tarball is kept once downloaded; empty for ImageDir/src.
	SrcCache string
	// Run, if not nil, selects the workloads whose test names it matches (Selected).
	Run *regexp.Regexp
	// MemSize and SMP are the guest's.
	MemSize string
	SMP     int
	// Timeout bounds the guest.
	Timeout time.Duration
	// Invoked is how the benchmark was started (for the report), Rev kvfsd's source revision.
	Invoked, Rev string
	// Command is this program's own command line.
	Command string
	// Progress receives the guest's result lines as they arrive; nil for none.
	Progress io.Writer
}

// KillprivCounts are the killpriv_v2 pair's FUSE counters over the measurements.
type KillprivCounts struct {
	Writes, Getxattrs uint64
}

// PerWrite is GETXATTRs per WRITE, NaN without writes.
func (k KillprivCounts) PerWrite() float64 {
	if k.Writes == 0 {
		return nan()
	}
	return float64(k.Getxattrs) / float64(k.Writes)
}

// Report is everything the report needs.
type Report struct {
	Config   Config
	Results  *Results
	Killpriv map[string]KillprivCounts // by mount
	Machine  Machine
	Accel    string
	Boot     time.Duration
	Started  time.Time
	Finished time.Time
}

// Run builds the bench image, starts the servers, boots the guest once and collects its results.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	rep := &Report{Config: cfg, Started: time.Now(), Killpriv: map[string]KillprivCounts{}}
	root, err := vmtest.RepoRoot()
	if err != nil {
		return nil, err
	}
	g, err := buildImage(root, cfg.ImageDir)
	if err != nil {
		return nil, err
	}
	rep.Machine = describeMachine(cfg, g)

	work, err := os.MkdirTemp("", "kvfs-gbench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	// One tmpfs for all shares: no disk in the way, the same file system for every server.
	if err := unix.Mount("tmpfs", work, "tmpfs", 0, "mode=0755,size=4g"); err != nil {
		return nil, fmt.Errorf("mounting a tmpfs on %s: %w", work, err)
	}
	defer unix.Unmount(work, unix.MNT_DETACH)

	dirs := map[string]string{}
	for _, m := range append(append([]string(nil), Mounts...), MountKP2, MountNoKP2, mountCtl) {
		dirs[m] = filepath.Join(work, "share-"+m)
		if err := os.Mkdir(dirs[m], 0o755); err != nil {
			return nil, err
		}
	}
	tests, killpriv := Selected(cfg.Run)
	names := make([]string, 0, len(tests)+1)
	for _, t := range tests {
		names = append(names, t.Name)
	}
	if killpriv {
		names = append(names, KillprivTest.Name)
	}
	var lua string
	if slices.Contains(names, "luabuild") {
		if lua, err = luaTarball(ctx, cfg.srcCache()); err != nil {
			return nil, err
		}
	}
	for _, m := range Mounts {
		if slices.Contains(names, "cbuild") {
			if err := writeCSources(filepath.Join(dirs[m], "cbuild"), cfg.CFiles); err != nil {
				return nil, err
			}
		}
		if lua != "" {
			if err := untar(lua, filepath.Join(dirs[m], "luabuild")); err != nil {
				return nil, err
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dirs[mountCtl], "guest.sh"), guestScript, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dirs[mountCtl], "bench.conf"), []byte(cfg.benchConf(names)), 0o644); err != nil {
		return nil, err
	}

	sockDir, err := os.MkdirTemp("", "kvfs-gbench-sock-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(sockDir)
	sock := func(m string) string { return filepath.Join(sockDir, m+".sock") }

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var procs []*server
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	for _, s := range []struct{ mount, bin string }{{MountKvfsd, cfg.Kvfsd}, {MountVirtiofsd, cfg.Virtiofsd}} {
		p, err := startProcess(s.bin, append([]string{"--socket-path=" + sock(s.mount), "-o", "source=" + dirs[s.mount]}, ServerArgs...))
		if err != nil {
			return nil, err
		}
		procs = append(procs, p)
	}
	inproc := map[string]*virtiofs.Server{}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for m, extra := range map[string][]string{
		mountCtl:   nil,
		MountKP2:   {"--xattr"},
		MountNoKP2: {"--xattr", "-o", "no_killpriv_v2"},
	} {
		args := append([]string{"--socket-path=" + sock(m), "-o", "source=" + dirs[m]}, ServerArgs...)
		srv, err := startInProcess(sctx, &wg, append(args, extra...))
		if err != nil {
			return nil, fmt.Errorf("kvfsd (in process) for %s: %w", m, err)
		}
		inproc[m] = srv
	}

	var extra []string
	for i, m := range []string{MountKvfsd, MountVirtiofsd, MountKP2, MountNoKP2} {
		id := fmt.Sprintf("fs%d", i)
		extra = append(extra,
			"-chardev", "socket,id="+id+",path="+sock(m),
			"-device", fmt.Sprintf("vhost-user-fs-pci,chardev=%s,tag=%s,queue-size=%d", id, m, vmtest.DefaultQueueSize))
	}
	// passthrough: the guest's owners and modes are the host's, as with the virtio-fs servers
	// (mapped would keep them in xattrs and cost 9p extra calls the others do not make).
	extra = append(extra,
		"-fsdev", "local,id=p9,path="+dirs[Mount9p]+",security_model=passthrough",
		"-device", "virtio-9p-pci,fsdev=p9,mount_tag="+Mount9p)

	w := &watcher{progress: cfg.Progress, onReady: func() {
		for _, m := range []string{MountKP2, MountNoKP2} {
			st := inproc[m].Stats().FUSE.Ops
			rep.Killpriv[m] = KillprivCounts{Writes: st["WRITE"].Count, Getxattrs: st["GETXATTR"].Count}
		}
	}}
	res, bootErr := vmtest.Boot(ctx, g, vmtest.Options{
		Socket: sock(mountCtl), Tag: mountCtl, Run: "guest.sh", MemSize: cfg.MemSize, SMP: cfg.SMP,
		Cmdline: "kvfs.timeout=0", Timeout: cfg.Timeout, ExtraArgs: extra, QEMU: cfg.QEMU, Console: w,
	})
	w.mu.Lock()
	ready := w.ready
	w.mu.Unlock()
	for _, m := range []string{MountKP2, MountNoKP2} {
		st := inproc[m].Stats().FUSE.Ops
		before := rep.Killpriv[m]
		if !ready {
			before = KillprivCounts{}
		}
		rep.Killpriv[m] = KillprivCounts{Writes: st["WRITE"].Count - before.Writes, Getxattrs: st["GETXATTR"].Count - before.Getxattrs}
	}
	rep.Finished = time.Now()
	rep.Machine.LoadAfter = report.LoadAvg()
	if res != nil {
		rep.Accel, rep.Boot = res.Accel+" ("+res.AccelReason+")", res.Duration
	}
	if bootErr != nil {
		return nil, bootFailure(bootErr, res)
	}
	if rep.Results, err = Parse(res.Console); err != nil {
		return nil, err
	}
	if !rep.Results.Done {
		return nil, bootFailure(errors.New("the guest did not finish the benchmark (no GB-DONE)"), res)
	}
	return rep, nil
}

// benchConf is guest.sh's configuration, a shell fragment; tests are the test names to run.
func (c *Config) benchConf(tests []string) string {
	var b strings.Builder
	for _, kv := range []struct {
		k string
		v any
	}{
		{"RUNS", c.Runs}, {"FIO_RUNTIME", c.FioRuntime}, {"FIO_MIB", c.FioMiB}, {"META_FILES", c.MetaFiles},
		{"DD_MIB", c.DDMiB}, {"MOUNTS", strings.Join(Mounts, " ")}, {"KP_MOUNTS", MountKP2 + " " + MountNoKP2},
		{"NINEP_TAG", Mount9p}, {"NINEP_OPTS", NinePOptions}, {"TESTS", strings.Join(tests, " ")},
		{"BUILD_JOBS", c.buildJobs()}, {"LUA_TOP", LuaTop}, {"LUA_MAKE", LuaMake},
		{"LUA_CHECK", LuaCheck}, {"LUA_CHECK_OUT", LuaCheckOut},
	} {
		fmt.Fprintf(&b, "%s=%s\n", kv.k, shQuote(fmt.Sprint(kv.v)))
	}
	return b.String()
}

// shQuote quotes s for sh.
func shQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func (c *Config) buildJobs() int {
	if c.BuildJobs > 0 {
		return c.BuildJobs
	}
	return c.SMP
}

func (c *Config) srcCache() string {
	if c.SrcCache != "" {
		return c.SrcCache
	}
	return filepath.Join(c.ImageDir, "src")
}

func bootFailure(err error, res *vmtest.Result) error {
	if res == nil {
		return err
	}
	return fmt.Errorf("%w\nQEMU: %s\nQEMU stderr:\n%s\nguest console (end):\n%s", err,
		strings.Join(res.Args, " "), res.Stderr, tail(res.Console, 60))
}

func tail(s string, lines int) string {
	ls := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(ls[max(0, len(ls)-lines):], "\n")
}

// buildImage runs packaging/guest/build.sh --bench into dir.
func buildImage(root, dir string) (vmtest.Guest, error) {
	script := filepath.Join(root, "packaging", "guest", "build.sh")
	out, err := exec.Command("bash", script, "--bench", dir).CombinedOutput()
	if err != nil {
		return vmtest.Guest{}, fmt.Errorf("building the bench image (bash %s --bench %s): %v\n%s", script, dir, err, out)
	}
	return vmtest.Guest{Kernel: filepath.Join(dir, guestimage.KernelFile), Initrd: filepath.Join(dir, guestimage.InitrdFile)}, nil
}

// watcher receives the console, passes result lines on to progress and calls onReady at the
// GB-READY line (the guest waits a second after it before it measures).
type watcher struct {
	progress io.Writer
	onReady  func()
	mu       sync.Mutex
	line     []byte // guarded by mu
	ready    bool   // guarded by mu
}

func (w *watcher) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.line = append(w.line, p...)
	for {
		i := bytes.IndexByte(w.line, '\n')
		if i < 0 {
			break
		}
		line := strings.TrimRight(string(w.line[:i]), "\r")
		w.line = w.line[i+1:]
		if strings.HasPrefix(line, "GB-READY") && !w.ready {
			w.ready = true
			w.onReady()
		}
		if w.progress != nil && (strings.HasPrefix(line, "GB") || strings.HasPrefix(line, "KVFS")) {
			fmt.Fprintln(w.progress, line)
		}
	}
	return len(p), nil
}

// server is a server process.
type server struct {
	cmd    *exec.Cmd
	out    bytes.Buffer
	exited chan struct{}
}

// startProcess starts a server and waits for the socket named by its first argument.
func startProcess(bin string, args []string) (*server, error) {
	socket := strings.TrimPrefix(args[0], "--socket-path=")
	s := &server{cmd: exec.Command(bin, args...), exited: make(chan struct{})}
	s.cmd.Stdout, s.cmd.Stderr = &s.out, &s.out
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	go func() { s.cmd.Wait(); close(s.exited) }()
	deadline := time.Now().Add(15 * time.Second)
	for {
		if fi, err := os.Stat(socket); err == nil && fi.Mode()&os.ModeSocket != 0 {
			return s, nil
		}
		select {
		case <-s.exited:
			return nil, fmt.Errorf("%s %v exited before creating its socket:\n%s", bin, args, s.out.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("%s created no socket within 15s", bin)
		}
	}
}

func (s *server) stop() {
	select {
	case <-s.exited:
		return
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

// startInProcess runs kvfsd's server in this process with kvfsd's command line args, so that
// its counters can be read; it serves until ctx ends or the guest disconnects.
func startInProcess(ctx context.Context, wg *sync.WaitGroup, args []string) (*virtiofs.Server, error) {
	opts, err := cmdline.Parse(args)
	if err != nil {
		return nil, err
	}
	srv, err := virtiofs.NewServer(opts.Server)
	if err != nil {
		return nil, err
	}
	l, release, err := cmdline.Listen(opts)
	if err != nil {
		srv.Close()
		return nil, err
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer release()
		defer srv.Close()
		lctx := log.WithLogger(ctx, log.L.WithField("share", opts.Server.SharedDir))
		if err := srv.Serve(lctx, l); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, net.ErrClosed) {
			log.G(lctx).WithError(err).Warn("in-process kvfsd stopped")
		}
	}()
	return srv, nil
}
