package sandbox

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// TestBindFlags checks each kind of bind through mounts/ and through shared/ (what the server
// exports) on a source with a tmpfs mounted inside it: which of the two is there and which is
// writable, that the source stays writable, that a source mount's own flags stay, that the
// mounts below a bind are listed (what Submounts answers), and that a mount made under the
// source afterwards stays out.
func TestBindFlags(t *testing.T) {
	requireRoot(t)
	dir := bindDir(t)
	// The source is a shared mount, as on a systemd host, where a bind would join its peer
	// group unless made private.
	src := t.TempDir()
	sharedMount(t, src)
	mustWrite(t, filepath.Join(src, "f"))
	sub := filepath.Join(src, "sub")
	mountTmpfs(t, sub, unix.MS_NOSUID|unix.MS_NODEV)
	mustWrite(t, filepath.Join(sub, "g"))

	// writable says whether a new file can be made in dir: nil or EROFS, anything else fails.
	writable := func(t *testing.T, dir string) bool {
		t.Helper()
		err := os.WriteFile(filepath.Join(dir, "probe"), nil, 0o644)
		if err != nil && !errors.Is(err, syscall.EROFS) {
			t.Fatalf("writing in %s: %v, want success or EROFS", dir, err)
		}
		return err == nil
	}
	tests := []struct {
		name  string
		flags BindFlags
		// whether the tmpfs is in the bind, the top writable, the tmpfs writable
		withSub, top, subRW bool
	}{
		{"rw", 0, false, true, false},
		{"rbind", BindRecursive, true, true, true},
		{"ro", BindReadOnly, false, false, false},
		{"rbind-ro", BindRecursive | BindReadOnly, true, false, true},
		{"rbind-rro", BindRecursive | BindRecursiveReadOnly, true, false, false},
		{"rbind-ro-rro", BindRecursive | BindReadOnly | BindRecursiveReadOnly, true, false, false},
		{"rro", BindRecursiveReadOnly, false, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := bindMount(src, filepath.Join(dir, mountsName), tt.name, tt.flags, -1, here); err != nil {
				t.Fatal(err)
			}
			for _, view := range []string{mountsName, sharedName} {
				b := filepath.Join(dir, view, tt.name)
				l := mountLine(t, b)
				if l == "" {
					t.Fatalf("%s is not a mount point", b)
				}
				if opt := optionalFields(l); opt != "" {
					t.Errorf("%s is not private: %q", b, opt)
				}
				if _, err := os.Stat(filepath.Join(b, "f")); err != nil {
					t.Errorf("the source's file in %s: %v", b, err)
				}
				_, err := os.Stat(filepath.Join(b, "sub", "g"))
				if tt.withSub != (err == nil) {
					t.Errorf("the tmpfs's file in %s: %v, want it there: %v", b, err, tt.withSub)
				}
				if got := writable(t, b); got != tt.top {
					t.Errorf("%s writable: %v, want %v", b, got, tt.top)
				}
				if !tt.withSub {
					continue
				}
				if got := writable(t, filepath.Join(b, "sub")); got != tt.subRW {
					t.Errorf("%s/sub writable: %v, want %v", b, got, tt.subRW)
				}
				l = mountLine(t, filepath.Join(b, "sub"))
				if opts := strings.Split(strings.Fields(l)[5], ","); !slices.Contains(opts, "nosuid") || !slices.Contains(opts, "nodev") {
					t.Errorf("%s/sub lost the tmpfs's nosuid,nodev: %q", b, l)
				}
			}
			below, err := mountsBelow(filepath.Join(dir, mountsName, tt.name))
			if want := []string{"sub"}; err != nil || tt.withSub != slices.Equal(below, want) || !tt.withSub && len(below) > 0 {
				t.Errorf("the mounts below the bind: %q, %v; want the tmpfs's: %v", below, err, tt.withSub)
			}
			if err := unbindMount(dir, tt.name); err != nil {
				t.Fatal(err)
			}
		})
	}
	// The source itself stays writable, its tmpfs too: the flags are the bind's, not the
	// file systems'.
	if !writable(t, src) || !writable(t, sub) {
		t.Error("a read-only bind made its source read-only")
	}

	// A mount made under the source after the bind does not appear in it, unless the bind
	// follows the host; the host's mount stays when that bind goes.
	if err := bindMount(src, filepath.Join(dir, mountsName), "before", BindRecursive, -1, here); err != nil {
		t.Fatal(err)
	}
	if err := bindMount(src, filepath.Join(dir, mountsName), "follows", BindRecursive|BindReadOnly|BindFollowHost, -1, here); err != nil {
		t.Fatal(err)
	}
	later := filepath.Join(src, "later")
	mountTmpfs(t, later, 0)
	for _, view := range []string{mountsName, sharedName} {
		if l := mountLine(t, filepath.Join(dir, view, "before", "later")); l != "" {
			t.Errorf("a mount made under the source later reached %s: %q", view, l)
		}
		b := filepath.Join(dir, view, "follows")
		if l := mountLine(t, filepath.Join(b, "later")); l == "" {
			t.Errorf("a mount made under the source later did not reach %s of a bind that follows the host", view)
		}
		if writable(t, b) || !writable(t, filepath.Join(b, "later")) {
			t.Errorf("%s: the bind that follows the host is not read-only on top, read-write in the later mount", b)
		}
	}
	for _, name := range []string{"before", "follows"} {
		if err := unbindMount(dir, name); err != nil {
			t.Fatal(err)
		}
	}
	if mountLine(t, later) == "" {
		t.Error("unbinding a bind that follows the host unmounted the host's mount")
	}

	if err := bindMount(src, filepath.Join(dir, mountsName), "bad", 1<<7, -1, here); err == nil || !strings.Contains(err.Error(), "unknown flags 0x80") {
		t.Errorf("unknown flags: %v, want a refusal", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, mountsName, "bad")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused bind left its mount point: %v", err)
	}
}

// TestBindIDMapped: through an idmapped bind, as in the share, a file of the host's root is
// the mapped id's, a file of another id in the mapping's range is that id's, an id out of it
// is the overflow id; a chown to a mapped id through the bind lands on the source as the id it
// maps back to. The tmpfs inside the source is idmapped only with BindIDMapRecursive.
func TestBindIDMapped(t *testing.T) {
	requireRoot(t)
	dir := bindDir(t)
	src := t.TempDir()
	sub := filepath.Join(src, "sub")
	mountTmpfs(t, sub, 0)
	for owner, f := range map[int]string{0: "root", 7: "seven", 100000: "high"} {
		mustWrite(t, filepath.Join(src, f))
		if err := os.Chown(filepath.Join(src, f), owner, owner); err != nil {
			t.Fatal(err)
		}
	}
	mustWrite(t, filepath.Join(sub, "g"))
	m := []IDMapping{{ContainerID: 0, HostID: 100000, Size: 65536}}
	userns, err := UserNamespace(m, m)
	if err != nil {
		t.Fatal(err)
	}
	defer userns.Close()
	owner := func(p string) uint32 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Uid
	}
	for _, tc := range []struct {
		name    string
		flags   BindFlags
		wantSub uint32
	}{{"top", BindRecursive, 0}, {"all", BindRecursive | BindIDMapRecursive, 100000}} {
		if err := bindMount(src, filepath.Join(dir, mountsName), tc.name, tc.flags, int(userns.Fd()), here); err != nil {
			t.Fatal(err)
		}
		b := filepath.Join(dir, sharedName, tc.name)
		for f, want := range map[string]uint32{"root": 100000, "seven": 100007, "high": 65534} {
			if got := owner(filepath.Join(b, f)); got != want {
				t.Errorf("%s: %s owned by %d through the bind, want %d", tc.name, f, got, want)
			}
		}
		if got := owner(filepath.Join(b, "sub", "g")); got != tc.wantSub {
			t.Errorf("%s: the tmpfs's file owned by %d through the bind, want %d", tc.name, got, tc.wantSub)
		}
		if err := os.Lchown(filepath.Join(b, "root"), 100005, 100005); err != nil {
			t.Fatal(err)
		}
		if got := owner(filepath.Join(src, "root")); got != 5 {
			t.Errorf("%s: a chown to 100005 through the bind left the source owned by %d, want 5", tc.name, got)
		}
		if err := os.Lchown(filepath.Join(src, "root"), 0, 0); err != nil {
			t.Fatal(err)
		}
		if err := unbindMount(dir, tc.name); err != nil {
			t.Fatal(err)
		}
	}
}

// bindDir is a sandbox directory's mounts/ and shared/, set up as Create sets them up and
// torn down at the end of the test.
func bindDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, d := range []string{mountsName, sharedName} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := setupMounts(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := teardown(dir, nil); err != nil {
			t.Error(err)
		}
	})
	return dir
}

// here is bindMount's attach for a test that binds in its own mount namespace.
func here(f func() error) error { return f() }

// optionalFields are the propagation fields of a mountinfo line (shared:N, master:N, ...).
func optionalFields(line string) string {
	f := strings.Fields(line)
	var opt []string
	for _, x := range f[6:] {
		if x == "-" {
			break
		}
		opt = append(opt, x)
	}
	return strings.Join(opt, " ")
}

// sharedMount makes dir a mount of its own (a bind onto itself), shared, as directories are
// on a systemd host; it is unmounted at the test's end, after the cleanups registered later
// (cleanups run last-in first-out).
func sharedMount(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
}

// mountTmpfs makes the directory dir and mounts a small tmpfs on it with flags, unmounted at
// the test's end.
func mountTmpfs(t *testing.T, dir string, flags uintptr) {
	t.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("kvfs-test", dir, "tmpfs", flags, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
}

func mustWrite(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
}
