package ctrd

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ContainerdVersion is the containerd the tests run and CrictlVersion their crictl and critest
// (both of cri-tools), installed by scripts/deps.sh (which names the same versions:
// TestDepsVersion checks it).
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
	Critest    string // cri-tools' CRI validation suite
}

// Binaries returns the containerd binaries installed in dir, or with dir empty in
// ${KVFS_CACHE:-/var/cache/kvfs}/bin. When they are missing or of another version its error
// says which command installs them: make test runs that command first, so in CI they are
// there.
func Binaries(dir string) (Bins, error) {
	if dir == "" {
		cache := os.Getenv("KVFS_CACHE")
		if cache == "" {
			cache = DefaultCacheDir
		}
		dir = filepath.Join(cache, "bin")
	}
	b := Bins{
		Dir:        dir,
		Containerd: filepath.Join(dir, "containerd"),
		Ctr:        filepath.Join(dir, "ctr"),
		RuncShim:   filepath.Join(dir, "containerd-shim-runc-v2"),
		Crictl:     filepath.Join(dir, "crictl"),
		Critest:    filepath.Join(dir, "critest"),
	}
	stamp, err := os.ReadFile(filepath.Join(dir, ".containerd-version"))
	if err != nil {
		return b, fmt.Errorf("containerd %s is not installed in %s (%v): run scripts/deps.sh", ContainerdVersion, dir, err)
	}
	if v := strings.TrimSpace(string(stamp)); v != ContainerdVersion {
		return b, fmt.Errorf("%s holds containerd %s, the tests want %s: run scripts/deps.sh", dir, v, ContainerdVersion)
	}
	for _, tool := range []string{"crictl", "critest"} {
		stamp, err = os.ReadFile(filepath.Join(dir, "."+tool+"-version"))
		if err != nil {
			return b, fmt.Errorf("%s %s is not installed in %s (%v): run scripts/deps.sh", tool, CrictlVersion, dir, err)
		}
		if v := strings.TrimSpace(string(stamp)); v != CrictlVersion {
			return b, fmt.Errorf("%s holds %s %s, the tests want %s: run scripts/deps.sh", dir, tool, v, CrictlVersion)
		}
	}
	for _, p := range []string{b.Containerd, b.Ctr, b.RuncShim, b.Crictl, b.Critest} {
		if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
			return b, fmt.Errorf("%s is missing or not executable (%v): run scripts/deps.sh", p, err)
		}
	}
	return b, nil
}
