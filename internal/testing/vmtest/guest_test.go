package vmtest

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// guestChecks are the checks guestcheck.sh must report, in order. A check
// that disappears from the script, or a new one not listed here, fails the
// test.
var guestChecks = []string{
	"create", "write_read", "append", "rename", "unlink", "mkdir_rmdir",
	"symlink", "hardlink", "chmod", "chown", "utimes", "truncate_shrink",
	"truncate_grow", "fifo", "mmap", "fsync", "xattr", "killpriv", "big_file", "readdir_2000",
	"statfs", "submount", "remount",
}

// TestGuestConformance boots a Linux guest against the server under test
// (serverBinary) and runs guestcheck.sh inside the mounted share: with kvfsd's
// defaults, and with the command line Kata passes (an inherited listening fd,
// a thread pool of 1, submounts announced; --xattr as Kata adds it for guest
// SELinux; and spelled out, the sandbox and seccomp filter of kvfsd's and
// virtiofsd's defaults), under QEMU 7.2 and again under QEMU 10. A server given
// in $KVFS_SERVER runs with the C virtiofsd's options.
func TestGuestConformance(t *testing.T) {
	g := Image(t)
	server := serverBinary(t)
	type variant struct {
		name      string
		submounts bool   // the server announces submounts
		qemu      string // "" for DefaultQEMU
		start     func(t *testing.T, share string) string
	}
	variants := []variant{{"defaults", false, "", func(t *testing.T, share string) string {
		socket, _ := StartServer(t, server, "-o", "source="+share, "-o", "cache=auto", "-o", "xattr")
		return socket
	}}}
	if os.Getenv("KVFS_SERVER") == "" {
		kata := func(t *testing.T, share string) string {
			socket, _ := StartServerWithListener(t, server, "--syslog", "--cache=auto", "--shared-dir="+share,
				"--fd=3", "--thread-pool-size=1", "--announce-submounts", "--xattr",
				"--sandbox=namespace", "--seccomp=kill")
			return socket
		}
		variants = append(variants, variant{"kata-argv", true, "", kata}, variant{"kata-argv-qemu10", true, QEMU10(t), kata})
	}
	for _, v := range variants {
		t.Run(v.name, func(t *testing.T) {
			share := t.TempDir()
			bindSubmount(t, share, v.submounts)
			if os.Getenv("KVFS_SERVER") != "" {
				// Another server: the C virtiofsd keeps set-id bits on an unprivileged
				// open(O_TRUNC) (see t_killpriv in guestcheck.sh).
				if err := os.WriteFile(filepath.Join(share, "killpriv-otrunc.known"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			runGuestChecks(t, g, share, v.start(t, share), v.qemu)
		})
	}
}

// bindSubmount bind-mounts a directory holding inside.txt at share/submnt, as a sandbox binds a
// volume into its share, and tells the guest script what to expect of it.
func bindSubmount(t *testing.T, share string, announced bool) {
	t.Helper()
	src, dst := t.TempDir(), filepath.Join(share, "submnt")
	if err := os.WriteFile(filepath.Join(src, "inside.txt"), []byte("inside\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount at %s: %v", dst, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dst, unix.MNT_DETACH|unix.UMOUNT_NOFOLLOW); err != nil {
			t.Errorf("unmounting %s: %v", dst, err)
		}
	})
	expect := "plain"
	if announced {
		expect = "announced"
	}
	if err := os.WriteFile(filepath.Join(share, "submount.expect"), []byte(expect+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
}

// checkBoot logs how a boot went, has the QEMU command line, its stderr and the whole console
// logged if the test fails, and ends the test if the boot itself failed.
func checkBoot(t *testing.T, res *Result, err error, start time.Time) {
	t.Helper()
	if res != nil {
		t.Logf("boot: %v under %s (%s), whole test %v",
			res.Duration.Round(time.Millisecond), res.Accel, res.AccelReason, time.Since(start).Round(time.Millisecond))
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("QEMU: %s\nQEMU stderr:\n%s\nguest console:\n%s", strings.Join(res.Args, " "), res.Stderr, res.Console)
			}
		})
	}
	if err != nil {
		t.Fatalf("boot: %v", err)
	}
}

// runGuestChecks runs guestcheck.sh in a guest of g, booted by qemu ("" for DefaultQEMU),
// with the server on socket serving share.
func runGuestChecks(t *testing.T, g Guest, share, socket, qemu string) {
	start := time.Now()
	script, err := os.ReadFile("guestcheck.sh")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(share, "guestcheck.sh"), script, 0o755); err != nil {
		t.Fatal(err)
	}

	res, err := Boot(t.Context(), g, Options{Socket: socket, Run: "guestcheck.sh", Timeout: 5 * time.Minute, QEMU: qemu})
	checkBoot(t, res, err, start)
	if qemu != "" {
		t.Logf("under %s", qemuVersion(t, qemu))
	}

	rep := parseGuestChecks(res.Console)
	t.Logf("check times (s): %s", rep.timesLine())
	for _, name := range guestChecks {
		detail, ok := rep.results[name]
		switch {
		case !ok:
			t.Errorf("check %s: not reported", name)
		case detail != "":
			t.Errorf("check %s failed: %s", name, detail)
		}
	}
	for _, name := range rep.order {
		if !slices.Contains(guestChecks, name) {
			t.Errorf("check %s: reported but not in guestChecks", name)
		}
	}
	if !rep.haveSummary {
		t.Errorf("no CHECK-SUMMARY line")
	} else if rep.passed != len(guestChecks) || rep.failed != 0 {
		t.Errorf("CHECK-SUMMARY passed=%d failed=%d, want passed=%d failed=0", rep.passed, rep.failed, len(guestChecks))
	}
	if res.ExitStatus != 0 {
		t.Errorf("guest exit status %d, want 0", res.ExitStatus)
	}

	// What the guest wrote must be on the host.
	work := filepath.Join(share, "work")
	if err := verifySHA256File(filepath.Join(work, "big.bin.sha256"), work); err != nil {
		t.Errorf("64 MiB file: %v", err)
	}
	buf := make([]byte, 64)
	if n, err := unix.Getxattr(filepath.Join(work, "xattr.txt"), "user.kvfs", buf); err != nil || string(buf[:n]) != "hello-xattr" {
		t.Errorf("host sees user.kvfs=%q on work/xattr.txt (%v), want hello-xattr", buf[:max(n, 0)], err)
	}
	if entries, err := os.ReadDir(filepath.Join(work, "many")); err != nil {
		t.Errorf("readdir: %v", err)
	} else if len(entries) != 2000 {
		t.Errorf("host sees %d entries in work/many, want 2000", len(entries))
	}
}

// serverBinary returns the virtio-fs server under test: $KVFS_SERVER (for
// example /usr/lib/qemu/virtiofsd), else ./cmd/kvfsd built into a temporary
// directory.
func serverBinary(t *testing.T) string {
	t.Helper()
	if b := os.Getenv("KVFS_SERVER"); b != "" {
		return b
	}
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "kvfsd")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/kvfsd")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building ./cmd/kvfsd (set KVFS_SERVER to test another server): %v\n%s", err, out)
	}
	return bin
}

// guestReport is what guestcheck.sh printed.
type guestReport struct {
	order          []string          // check names in the order reported
	results        map[string]string // name → "" if ok, else the failure detail
	times          map[string]string // name → seconds, as printed
	haveSummary    bool
	passed, failed int
}

// parseGuestChecks reads the CHECK, CHECK-TIME and CHECK-SUMMARY lines of a
// console log. A check reported twice keeps its first failure.
func parseGuestChecks(console string) guestReport {
	rep := guestReport{results: map[string]string{}, times: map[string]string{}}
	sc := bufio.NewScanner(strings.NewReader(console))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(line, "CHECK ok "):
			name := strings.TrimSpace(strings.TrimPrefix(line, "CHECK ok "))
			rep.add(name, "")
		case strings.HasPrefix(line, "CHECK FAIL "):
			name, detail, _ := strings.Cut(strings.TrimPrefix(line, "CHECK FAIL "), ":")
			detail = strings.TrimSpace(detail)
			if detail == "" {
				detail = "(no detail)"
			}
			rep.add(strings.TrimSpace(name), detail)
		case strings.HasPrefix(line, "CHECK-TIME "):
			if f := strings.Fields(line); len(f) == 3 {
				rep.times[f[1]] = f[2]
			}
		case strings.HasPrefix(line, "CHECK-SUMMARY "):
			rep.haveSummary = true
			for _, kv := range strings.Fields(strings.TrimPrefix(line, "CHECK-SUMMARY ")) {
				k, v, _ := strings.Cut(kv, "=")
				n, err := strconv.Atoi(v)
				if err != nil {
					n = -1
				}
				switch k {
				case "passed":
					rep.passed = n
				case "failed":
					rep.failed = n
				}
			}
		}
	}
	return rep
}

func (r *guestReport) add(name, detail string) {
	if prev, seen := r.results[name]; seen {
		if prev == "" {
			r.results[name] = detail
		}
		return
	}
	r.order = append(r.order, name)
	r.results[name] = detail
}

func (r *guestReport) timesLine() string {
	var b strings.Builder
	for _, name := range r.order {
		if b.Len() > 0 {
			b.WriteString(" ")
		}
		b.WriteString(name + "=" + r.times[name])
	}
	return b.String()
}

// verifySHA256File checks the files listed in a sha256sum-format file
// against their contents in dir.
func verifySHA256File(sumFile, dir string) error {
	b, err := os.ReadFile(sumFile)
	if err != nil {
		return err
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	for _, line := range lines {
		want, name, ok := strings.Cut(line, "  ")
		if !ok || len(want) != 64 {
			return fmt.Errorf("%s: malformed line %q", sumFile, line)
		}
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		h := sha256.New()
		_, err = io.Copy(h, f)
		f.Close()
		if err != nil {
			return err
		}
		if got := hex.EncodeToString(h.Sum(nil)); got != want {
			return fmt.Errorf("%s: host computes %s, guest wrote %s", name, got, want)
		}
	}
	return nil
}

// qemuVersion is the first line of qemu --version.
func qemuVersion(t *testing.T, qemu string) string {
	out, err := exec.Command(qemu, "--version").Output()
	if err != nil {
		t.Fatalf("%s --version: %v", qemu, err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return first
}
