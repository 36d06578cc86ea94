package virtiofs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
	"github.com/kvfs/kvfs/virtiofs/testing/conformance"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"
)

// startServer serves dir with kvfsd in-process on a fresh socket and returns the socket path
// and a channel that yields Serve's result.
func startServer(t testing.TB, cfg virtiofs.Config) (string, *virtiofs.Server, <-chan error) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "vhost-fs.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	s, err := virtiofs.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(context.Background(), l) }()
	t.Cleanup(func() { s.Close() })
	return sock, s, done
}

// shareDir makes an empty shared directory with a sibling the suite watches.
func shareDir(t testing.TB) string {
	dir := filepath.Join(t.TempDir(), "share")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

func dial(t testing.TB, sock string) (*frontend.Frontend, *fuseclient.Client) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	fe, err := frontend.Dial(ctx, sock, frontend.Options{})
	if err != nil {
		t.Fatal(err)
	}
	c := fuseclient.New(fe)
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
		fe.Close()
		t.Fatalf("INIT: %v", err)
	}
	return fe, c
}

func runSuite(t *testing.T, c *fuseclient.Client, dir string) []conformance.Result {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	return conformance.Run(ctx, c, dir)
}

// TestConformance runs the FUSE operation suite against kvfsd through the in-repo front-end,
// which speaks vhost-user to it over its real socket exactly as QEMU 7.2 does: in the default
// configuration, and with inodes kept as file handles (--inode-file-handles=mandatory).
func TestConformance(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root (file ownership, per-request credentials)")
	}
	t.Run("default", func(t *testing.T) { conformance1(t, virtiofs.Config{}) })
	t.Run("inode-file-handles=mandatory", func(t *testing.T) {
		conformance1(t, virtiofs.Config{InodeFileHandles: passthrough.FileHandlesMandatory})
	})
}

// conformance1 runs the suite against a server configured as cfg, on a fresh share.
func conformance1(t *testing.T, cfg virtiofs.Config) {
	dir := shareDir(t)
	cfg.SharedDir = dir
	sock, s, done := startServer(t, cfg)
	fe, c := dial(t, sock)
	for _, r := range runSuite(t, c, dir) {
		if !r.OK() {
			t.Errorf("%s: got %q, want %q; host: %v", r.Step, r.Outcome, r.Want, r.HostErr)
		}
	}
	st := s.Stats()
	if st.FUSE.Ops["LOOKUP"].Count == 0 || st.FUSE.BytesWritten == 0 || st.FUSE.Panics != 0 {
		t.Errorf("stats: %+v", st.FUSE)
	}
	// With handles the cached inodes hold no descriptors, except those whose last link the
	// guest removed: besides the root, /proc/self/fd, the share's mount and the open files,
	// the suite's cached inodes, most of them still linked, hold far fewer than one each.
	if nodeFds := st.FS.Fds - 3 - st.FS.OpenFiles; cfg.InodeFileHandles == passthrough.FileHandlesMandatory &&
		(st.FS.CachedInodes < 5 || nodeFds < 0 || 2*nodeFds >= st.FS.CachedInodes-1) {
		t.Errorf("with file handles: %+v", st.FS)
	}
	t.Logf("after the suite: %+v", st.FS)
	// The front-end goes away: Serve returns cleanly, as virtiofsd exits.
	fe.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve after disconnect: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after the front-end disconnected")
	}
}

// TestGuestReboot stops and restarts the device as QEMU does when the guest reboots, and checks
// that the new driver's INIT starts a fresh session that works.
func TestGuestReboot(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	dir := shareDir(t)
	if err := os.WriteFile(filepath.Join(dir, "a"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	sock, s, _ := startServer(t, virtiofs.Config{SharedDir: dir})
	fe, c := dial(t, sock)
	defer fe.Close()
	ctx := context.Background()
	if _, err := c.Lookup(ctx, 1, "a"); err != nil {
		t.Fatal(err)
	}
	if got := s.Stats().FS.CachedInodes; got < 2 {
		t.Fatalf("cached inodes before reboot: %d", got)
	}
	for i := range 3 {
		if err := fe.Stop(ctx); err != nil {
			t.Fatalf("stop %d: %v", i, err)
		}
		if err := fe.Start(ctx); err != nil {
			t.Fatalf("start %d: %v", i, err)
		}
		if _, err := c.Init(ctx, fuseclient.LinuxInitFlags); err != nil {
			t.Fatalf("INIT after restart %d: %v", i, err)
		}
		if got := s.Stats().FS.CachedInodes; got != 1 {
			t.Errorf("restart %d: %d cached inodes after the new INIT, want only the root", i, got)
		}
		if _, err := c.Lookup(ctx, 1, "a"); err != nil {
			t.Fatalf("LOOKUP after restart %d: %v", i, err)
		}
	}
}

// cVirtiofsd is the reference peer: the C virtiofsd from Debian's qemu-system-common.
const cVirtiofsd = "/usr/lib/qemu/virtiofsd"

// knownDifferences are steps where the C virtiofsd 7.2 answers differently from kvfsd, with the
// reason. The differential test fails on any difference not listed here, and on a listed one
// that has disappeared.
var knownDifferences = map[string]string{
	"lookup dot-dot": "C virtiofsd resolves '..' (clamped at the root) for NFS export; kvfsd refuses to look up " +
		"'.' and '..': the Linux guest resolves them itself and kvfsd does not offer NFS export",
	"lookup dot": "as for '..'",
	"mkdir dot-dot": "C virtiofsd refuses '.' and '..' with EINVAL in every call; kvfsd answers what the host's " +
		"mkdir(2) does for them (EEXIST), as for each call that creates or removes an entry",
	"unlink missing": "C virtiofsd looks the victim up first and turns a failed lookup into EIO; kvfsd passes " +
		"unlinkat's ENOENT through, which is what the guest's unlink(2) should see",
	"tmpfile":                  "C virtiofsd 7.2 speaks FUSE 7.36 and has no TMPFILE (7.37)",
	"access read":              "C virtiofsd has no ACCESS (ENOSYS); kvfsd asks the host with the caller's ids",
	"access write as uid 1000": "as for access read",
	"open a symlink": "C virtiofsd refuses to open anything but regular files and directories with EBADF; " +
		"kvfsd answers ELOOP, as open(O_NOFOLLOW) of a symlink does",
	"flock without flock": "C virtiofsd 7.2 serves a flock request even when it did not grant FLOCK_LOCKS (a Linux " +
		"guest sends none then); kvfsd answers ENOSYS for any lock kind it did not grant, as C does for POSIX locks",
	"over-forget pre/data": "C virtiofsd aborts on an assertion (unref_inode: nlookup >= n) when the guest " +
		"forgets more lookups than it holds: a guest can kill it; kvfsd clamps the count at zero",
}

// TestDifferentialAgainstCVirtiofsd runs the same suite through the same front-end against the
// C virtiofsd and compares every step's answer with kvfsd's.
func TestDifferentialAgainstCVirtiofsd(t *testing.T) {
	if _, err := os.Stat(cVirtiofsd); err != nil {
		t.Skipf("the C virtiofsd is not installed (%v); scripts/deps.sh installs it", err)
	}
	differential(t, "C virtiofsd", knownDifferences, func(sock, dir string) *exec.Cmd {
		return exec.Command(cVirtiofsd, "--socket-path="+sock, "-o", "source="+dir, "-o", "cache=auto")
	})
}

// knownRustDifferences are steps where the Rust virtiofsd 1.13 answers differently from
// kvfsd, with the reason, as knownDifferences for the C one.
var knownRustDifferences = map[string]string{
	"lookup dot-dot": "the Rust virtiofsd resolves '..' (clamped at the root), as the C one; kvfsd refuses to look up " +
		"'.' and '..': the Linux guest resolves them itself",
	"lookup dot": "as for '..'",
	"tmpfile":    "the Rust virtiofsd 1.13 has no TMPFILE (ENOSYS): a guest's O_TMPFILE then fails; kvfsd serves it",
	"open a symlink": "the Rust virtiofsd refuses to open anything but regular files and directories with EBADF, as " +
		"the C one; kvfsd answers ELOOP, as open(O_NOFOLLOW) of a symlink does",
	"name with slash": "the Rust virtiofsd 1.13 looks a name with a '/' up as a path below the directory (openat " +
		"resolves it); kvfsd refuses it (EINVAL): a FUSE name is one component, and a Linux guest never sends such a name",
}

// TestDifferentialAgainstRustVirtiofsd runs the same suite through the same front-end against
// the Rust virtiofsd 1.13 and compares every step's answer with kvfsd's.
func TestDifferentialAgainstRustVirtiofsd(t *testing.T) {
	if _, err := os.Stat(conformance.RustVirtiofsd); err != nil {
		t.Skipf("the Rust virtiofsd is not installed (%v); scripts/deps.sh installs it", err)
	}
	differential(t, "Rust virtiofsd", knownRustDifferences, func(sock, dir string) *exec.Cmd {
		return exec.Command(conformance.RustVirtiofsd, "--socket-path="+sock, "--shared-dir="+dir, "--cache=auto")
	})
}

// differential runs the suite against kvfsd and against the peer command makes (serving dir
// on the socket sock), and fails on every step whose answers differ unless known lists it,
// and on every listed step whose answers no longer differ.
func differential(t *testing.T, peer string, known map[string]string, command func(sock, dir string) *exec.Cmd) {
	if os.Getuid() != 0 {
		t.Skip("both servers need root")
	}
	kdir := shareDir(t)
	ksock, _, _ := startServer(t, virtiofs.Config{SharedDir: kdir})
	kfe, kc := dial(t, ksock)
	defer kfe.Close()
	kres := runSuite(t, kc, kdir)

	pdir := shareDir(t)
	psock := filepath.Join(t.TempDir(), "peer.sock")
	cmd := command(psock, pdir)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("%s stderr:\n%s", peer, stderr.String())
		}
	})
	waitSocket(t, psock)
	pfe, pc := dial(t, psock)
	defer pfe.Close()
	pres := runSuite(t, pc, pdir)

	listed := map[string]bool{}
	for i, k := range kres {
		p := pres[i]
		if k.Outcome == p.Outcome {
			continue
		}
		reason, ok := known[k.Step]
		if !ok {
			t.Errorf("%s: kvfsd %q, %s %q: an unexplained difference", k.Step, k.Outcome, peer, p.Outcome)
			continue
		}
		listed[k.Step] = true
		t.Logf("known difference %s: kvfsd %q, %s %q (%s)", k.Step, k.Outcome, peer, p.Outcome, reason)
		if p.HostErr != nil {
			t.Logf("  %s host check: %v", peer, p.HostErr)
		}
	}
	for step := range known {
		if !listed[step] {
			t.Errorf("%s is listed as a known difference but both servers now agree: remove it", step)
		}
	}
}

func waitSocket(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		} else if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			t.Fatalf("socket %s: %v", path, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Config.PollMax is bounded: 0 (off) to MaxPollMax.
func TestConfigPollMax(t *testing.T) {
	for _, d := range []time.Duration{0, time.Nanosecond, virtiofs.MaxPollMax} {
		cfg := virtiofs.Config{SharedDir: "/s", PollMax: d}
		if err := cfg.Validate(); err != nil {
			t.Errorf("Validate refuses poll limit %v: %v", d, err)
		}
	}
	for _, d := range []time.Duration{-time.Nanosecond, virtiofs.MaxPollMax + 1} {
		cfg := virtiofs.Config{SharedDir: "/s", PollMax: d}
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "invalid poll limit") {
			t.Errorf("Validate of poll limit %v: %v", d, err)
		}
	}
}

// TestConcurrentRequests keeps many requests in flight on the request queue, inline, with a
// worker pool and with adaptive polling, and checks every file's content on the host.
func TestConcurrentRequests(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfsd's passthrough needs root")
	}
	for _, cfg := range []virtiofs.Config{{}, {ThreadPoolSize: 1}, {ThreadPoolSize: 4}, {PollMax: 50 * time.Microsecond}} {
		name := fmt.Sprintf("pool=%d", cfg.ThreadPoolSize)
		if cfg.PollMax > 0 {
			name += fmt.Sprintf(",poll-max=%v", cfg.PollMax)
		}
		t.Run(name, func(t *testing.T) {
			dir := shareDir(t)
			cfg.SharedDir = dir
			sock, _, _ := startServer(t, cfg)
			fe, c := dial(t, sock)
			defer fe.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var g errgroup.Group
			for w := range 16 {
				g.Go(func() error {
					for i := range 20 {
						name := fmt.Sprintf("w%d-%d", w, i)
						out, err := c.Create(ctx, 1, name, unix.O_RDWR|unix.O_CREAT, unix.S_IFREG|0o644)
						if err != nil {
							return fmt.Errorf("create %s: %w", name, err)
						}
						data := bytes.Repeat([]byte(name), 500)
						if _, err := c.Write(ctx, out.Entry.NodeID, out.Open.Fh, 0, data, 0); err != nil {
							return fmt.Errorf("write %s: %w", name, err)
						}
						got, err := c.Read(ctx, out.Entry.NodeID, out.Open.Fh, 0, uint32(len(data)))
						if err != nil || !bytes.Equal(got, data) {
							return fmt.Errorf("read %s: %d bytes, %v", name, len(got), err)
						}
						if err := c.Release(ctx, out.Entry.NodeID, out.Open.Fh); err != nil {
							return err
						}
						host, err := os.ReadFile(filepath.Join(dir, name))
						if err != nil || !bytes.Equal(host, data) {
							return fmt.Errorf("host %s: %d bytes, %v", name, len(host), err)
						}
					}
					return nil
				})
			}
			if err := g.Wait(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestAllowMmap: FUSE_DIRECT_IO_ALLOW_MMAP is granted to a guest that asks for it only with
// Config.AllowMmap (virtiofsd's --allow-mmap).
func TestAllowMmap(t *testing.T) {
	for _, allow := range []bool{false, true} {
		sock, _, _ := startServer(t, virtiofs.Config{SharedDir: shareDir(t), Cache: virtiofs.CacheNever, AllowMmap: allow})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		fe, err := frontend.Dial(ctx, sock, frontend.Options{})
		if err != nil {
			cancel()
			t.Fatal(err)
		}
		out, err := fuseclient.New(fe).Init(ctx, fuseclient.LinuxInitFlags|fuse.InitDirectIOAllowMmap)
		cancel()
		fe.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := (uint64(out.Flags)|uint64(out.Flags2)<<32)&fuse.InitDirectIOAllowMmap != 0; got != allow {
			t.Errorf("AllowMmap %v: DIRECT_IO_ALLOW_MMAP granted %v", allow, got)
		}
	}
}
