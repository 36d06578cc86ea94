package k8stest

import (
	"os"
	"path/filepath"
	"testing"
)

// binaries are the cluster's programs, which build/build.sh builds.
var binaries = []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl"}

// BinDir is where build/build.sh puts the cluster's programs (make k8s):
// ${KVFS_CACHE:-/var/cache/kvfs}/k8s.
func BinDir() string {
	cache := os.Getenv("KVFS_CACHE")
	if cache == "" {
		cache = "/var/cache/kvfs"
	}
	return filepath.Join(cache, "k8s")
}

// Binaries returns BinDir, failing the test, with the command that builds them, when a
// program is missing.
func Binaries(t testing.TB) string {
	t.Helper()
	dir := BinDir()
	for _, b := range binaries {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			t.Fatalf("k8stest: %v: the Kubernetes node's programs are built by `make k8s` (internal/testing/k8stest/build/build.sh %s)", err, dir)
		}
	}
	return dir
}
