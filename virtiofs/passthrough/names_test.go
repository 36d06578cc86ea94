package passthrough

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestEntryName checks that the *at() calls get exactly the name given, NAME_MAX bytes at most,
// and that a longer name or one with a NUL is refused rather than cut short into another one.
func TestEntryName(t *testing.T) {
	dir := t.TempDir()
	dirfd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dirfd)

	long := strings.Repeat("n", nameMax)
	if err := mknodat(dirfd, long, unix.S_IFREG|0o600, 0); err != nil {
		t.Fatalf("mknodat of a %d-byte name: %v", nameMax, err)
	}
	if err := mkdirat(dirfd, "d", 0o700); err != nil {
		t.Fatal(err)
	}
	if err := renameat2(dirfd, long, dirfd, "r", unix.RENAME_NOREPLACE); err != nil {
		t.Fatal(err)
	}
	fd, err := openat(dirfd, "r", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	if _, err := openat(dirfd, long, unix.O_RDONLY|unix.O_CLOEXEC, 0); err != unix.ENOENT {
		t.Errorf("openat of the old name after the rename: %v, want ENOENT", err)
	}

	for _, tc := range []struct {
		name string
		want error
	}{
		{long + "n", unix.ENAMETOOLONG},
		{"r\x00", unix.EINVAL},
		{"d\x00x", unix.EINVAL}, // would be "d" if cut at the NUL
	} {
		if _, err := openat(dirfd, tc.name, unix.O_PATH|unix.O_CLOEXEC, 0); err != tc.want {
			t.Errorf("openat %q: %v, want %v", tc.name, err, tc.want)
		}
		if err := unlinkat(dirfd, tc.name, unix.AT_REMOVEDIR); err != tc.want {
			t.Errorf("unlinkat %q: %v, want %v", tc.name, err, tc.want)
		}
		if err := mkdirat(dirfd, tc.name, 0o700); err != tc.want {
			t.Errorf("mkdirat %q: %v, want %v", tc.name, err, tc.want)
		}
		if err := renameat2(dirfd, "r", dirfd, tc.name, 0); err != tc.want {
			t.Errorf("renameat2 to %q: %v, want %v", tc.name, err, tc.want)
		}
	}
	if err := unlinkat(dirfd, "d", unix.AT_REMOVEDIR); err != nil {
		t.Errorf("unlinkat d: %v", err)
	}
	if err := unlinkat(dirfd, "r", 0); err != nil {
		t.Errorf("unlinkat r: %v", err)
	}
}
