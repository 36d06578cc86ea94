package vmtest

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// cacheShare is one extra virtio-fs device of TestGuestCacheModes.
type cacheShare struct {
	mode string   // name in cachecheck.sh: the tag is kvfs-<mode>
	args []string // kvfsd options besides --shared-dir
}

var cacheShares = []cacheShare{
	{"never", []string{"--cache=never"}},
	{"metadata", []string{"--cache=metadata"}},
	{"auto", []string{"--cache=auto"}},
	{"always", []string{"--cache=always"}},
	{"wb", []string{"--cache=auto", "--writeback"}},
}

// The contents of f: before the test, after phase 1 (same size), after phase 2 (grown).
const (
	cacheData0 = "aaaa"
	cacheData1 = "bbbb"
	cacheData2 = "cccccccccccc"
)

// TestGuestCacheModes checks in one boot what each cache mode promises about changes made on
// the host reaching the guest. A kvfsd per mode serves its own share as an extra
// vhost-user-fs device; cachecheck.sh reads f in every share, the host rewrites it (same size,
// then a larger size) and creates a new file, and the guest reports what it sees at once,
// after 1.5 s and after dropping its caches.
func TestGuestCacheModes(t *testing.T) {
	if os.Getenv("KVFS_SERVER") != "" {
		t.Skip("checks kvfsd's cache modes (metadata and --writeback are not in every virtiofsd)")
	}
	start := time.Now()
	g := Image(t)
	server := serverBinary(t)
	script, err := os.ReadFile("cachecheck.sh")
	if err != nil {
		t.Fatal(err)
	}
	ctl, ctlSocket := controlShare(t, server, "cachecheck.sh", script)

	var extra []string
	shares := map[string]string{}
	for i, s := range cacheShares {
		dir := t.TempDir()
		shares[s.mode] = dir
		if err := os.WriteFile(filepath.Join(dir, "f"), []byte(cacheData0), 0o644); err != nil {
			t.Fatal(err)
		}
		socket, _ := StartServer(t, server, append([]string{"--shared-dir=" + dir}, s.args...)...)
		extra = append(extra,
			"-chardev", fmt.Sprintf("socket,id=cache%d,path=%s", i, qemuEscape(socket)),
			"-device", fmt.Sprintf("vhost-user-fs-pci,chardev=cache%d,tag=kvfs-%s", i, s.mode))
	}

	// The host side of the handshake: on PHASE.go, change every f and create new-PHASE.
	ctx, cancel := context.WithCancel(t.Context())
	hostErr := make(chan error, 1)
	go func() {
		hostErr <- hostPhases(ctx, ctl, shares, []string{"p1", "p2"}, []string{cacheData1, cacheData2})
	}()
	res, err := Boot(t.Context(), g, Options{Socket: ctlSocket, Run: "cachecheck.sh", Timeout: 3 * time.Minute, ExtraArgs: extra})
	cancel()
	if herr := <-hostErr; herr != nil {
		t.Errorf("host side: %v", herr)
	}
	checkBoot(t, res, err, start)
	if res.ExitStatus != 0 || !strings.Contains(res.Console, "CACHE-END") {
		t.Fatalf("cachecheck.sh did not finish (exit status %d)", res.ExitStatus)
	}

	seen := parseCacheReport(res.Console)
	for _, line := range seen.lines {
		t.Log(line)
	}
	s1 := fmt.Sprintf("data=%s size=%d new=yes", cacheData1, len(cacheData1))
	s2 := fmt.Sprintf("data=%s size=%d new=yes", cacheData2, len(cacheData2))
	// Every mode: before the change the guest sees the original, and after dropping its caches
	// it sees the host's file. New files are seen at once in every mode: kvfsd answers a failed
	// lookup with ENOENT, never with a cacheable negative entry.
	for _, s := range cacheShares {
		seen.want(t, s.mode, "p0.before", fmt.Sprintf("data=%s size=%d new=no", cacheData0, len(cacheData0)))
		seen.want(t, s.mode, "p1.drop", s1)
		seen.want(t, s.mode, "p2.drop", s2)
		for _, when := range []string{"p1.now", "p1.wait", "p2.now", "p2.wait"} {
			seen.wantContains(t, s.mode, when, "new=yes")
		}
	}
	// never: nothing is cached, every change is seen at once.
	for _, when := range []string{"p1.now", "p1.wait"} {
		seen.want(t, "never", when, s1)
	}
	for _, when := range []string{"p2.now", "p2.wait"} {
		seen.want(t, "never", when, s2)
	}
	// auto: attributes expire after 1 s; the next open sees the new size or mtime and drops the
	// cached data.
	seen.want(t, "auto", "p1.wait", s1)
	seen.want(t, "auto", "p2.wait", s2)
	// metadata: data is never cached (direct I/O, which the guest does not clip at the size it
	// knows), so new content is read at once; the attributes may be a day old, so after the
	// size change only the content is asserted.
	for _, when := range []string{"p1.now", "p1.wait"} {
		seen.want(t, "metadata", when, s1)
	}
	for _, when := range []string{"p2.now", "p2.wait"} {
		seen.wantContains(t, "metadata", when, "data="+cacheData2+" ")
	}
	// always, and auto with --writeback: nothing but dropping the caches (or the timeout) is
	// promised; p1.now/wait and p2.now/wait are logged, not asserted. (Linux 6.1 shows always
	// keeping the old content, and writeback keeping the old size past auto's timeout.)

	// With --writeback, what the guest wrote through O_WRONLY and O_APPEND reached the host.
	if !strings.Contains(res.Console, "WB-DONE") {
		t.Errorf("writeback: the guest did not finish writing")
	} else if b, err := os.ReadFile(filepath.Join(shares["wb"], "w")); err != nil || string(b) != "hello\nworld\n" {
		t.Errorf("writeback: host sees %q (%v), want %q", b, err, "hello\nworld\n")
	}
}

// hostPhases answers cachecheck.sh's handshakes: when ctl/PHASE.go appears it writes data[i]
// to f in every share, creates new-PHASE there, and creates ctl/PHASE.done.
func hostPhases(ctx context.Context, ctl string, shares map[string]string, phases, data []string) error {
	for i, phase := range phases {
		for {
			if _, err := os.Stat(filepath.Join(ctl, phase+".go")); err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("phase %s: guest never asked (%w)", phase, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
		for _, dir := range shares {
			if err := os.WriteFile(filepath.Join(dir, "f"), []byte(data[i]), 0o644); err != nil {
				return err
			}
			if err := os.WriteFile(filepath.Join(dir, "new-"+phase), []byte("new\n"), 0o644); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(ctl, phase+".done"), nil, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// cacheReport is what cachecheck.sh printed: "mode when" → the rest of its CACHE line.
type cacheReport struct {
	seen  map[string]string
	lines []string
}

func parseCacheReport(console string) cacheReport {
	r := cacheReport{seen: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(console))
	for sc.Scan() {
		f := strings.SplitN(sc.Text(), " ", 4)
		if len(f) == 4 && f[0] == "CACHE" {
			r.seen[f[1]+" "+f[2]] = f[3]
			r.lines = append(r.lines, sc.Text())
		}
	}
	return r
}

func (r cacheReport) want(t *testing.T, mode, when, want string) {
	t.Helper()
	if got, ok := r.seen[mode+" "+when]; !ok {
		t.Errorf("cache=%s %s: not reported", mode, when)
	} else if got != want {
		t.Errorf("cache=%s %s: guest saw %s, want %s", mode, when, got, want)
	}
}

func (r cacheReport) wantContains(t *testing.T, mode, when, want string) {
	t.Helper()
	if got, ok := r.seen[mode+" "+when]; !ok {
		t.Errorf("cache=%s %s: not reported", mode, when)
	} else if !strings.Contains(got, want) {
		t.Errorf("cache=%s %s: guest saw %s, want %s", mode, when, got, want)
	}
}

// controlShare makes the control share of a kvfsd test guest: a directory holding the guest's
// script name, served by server with cache=never (so that marker files cross at once both
// ways). It answers the directory and the server's socket (Options.Socket).
func controlShare(t *testing.T, server, name string, script []byte) (dir, socket string) {
	t.Helper()
	dir = t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, name), script, 0o755); err != nil {
		t.Fatal(err)
	}
	socket, _ = StartServer(t, server, "--shared-dir="+dir, "--cache=never")
	return dir, socket
}
