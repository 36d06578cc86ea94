package ctrdtest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// ContainerdVersion is the containerd the tests run and CrictlVersion their crictl, installed
// by scripts/deps.sh (which names the same versions: TestDepsVersion checks it).
const (
	ContainerdVersion = "v2.4.2"
	CrictlVersion     = "v1.37.0"
)

// DefaultCacheDir holds the project's installed tools unless $KVFS_CACHE names another.
const DefaultCacheDir = "/var/cache/kvfs"

// Bins are the containerd binaries scripts/deps.sh installs.
type Bins struct {
	// Dir holds them all; it goes on containerd's PATH after Options.ShimDirs, so containerd
	// finds its runc shim there.
	Dir        string
	Containerd string
	Ctr        string
	RuncShim   string // containerd-shim-runc-v2
	Crictl     string
}

// Binaries returns the installed containerd binaries. When they are missing or of another
// version it fails the test, saying which command installs them: make test runs that command
// first, so in CI they are there.
func Binaries(t testing.TB) Bins {
	t.Helper()
	cache := os.Getenv("KVFS_CACHE")
	if cache == "" {
		cache = DefaultCacheDir
	}
	dir := filepath.Join(cache, "bin")
	b := Bins{
		Dir:        dir,
		Containerd: filepath.Join(dir, "containerd"),
		Ctr:        filepath.Join(dir, "ctr"),
		RuncShim:   filepath.Join(dir, "containerd-shim-runc-v2"),
		Crictl:     filepath.Join(dir, "crictl"),
	}
	stamp, err := os.ReadFile(filepath.Join(dir, ".containerd-version"))
	if err != nil {
		t.Fatalf("ctrdtest: containerd %s is not installed in %s (%v): run scripts/deps.sh", ContainerdVersion, dir, err)
	}
	if v := strings.TrimSpace(string(stamp)); v != ContainerdVersion {
		t.Fatalf("ctrdtest: %s holds containerd %s, the tests want %s: run scripts/deps.sh", dir, v, ContainerdVersion)
	}
	stamp, err = os.ReadFile(filepath.Join(dir, ".crictl-version"))
	if err != nil {
		t.Fatalf("ctrdtest: crictl %s is not installed in %s (%v): run scripts/deps.sh", CrictlVersion, dir, err)
	}
	if v := strings.TrimSpace(string(stamp)); v != CrictlVersion {
		t.Fatalf("ctrdtest: %s holds crictl %s, the tests want %s: run scripts/deps.sh", dir, v, CrictlVersion)
	}
	for _, p := range []string{b.Containerd, b.Ctr, b.RuncShim, b.Crictl} {
		if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
			t.Fatalf("ctrdtest: %s is missing or not executable (%v): run scripts/deps.sh", p, err)
		}
	}
	return b
}
