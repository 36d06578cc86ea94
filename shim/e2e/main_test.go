package e2e

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kvfs/kvfs/internal/vmtest"
)

// binDir holds the binaries under test, built once by TestMain: containerd-shim-kvfs-v2
// (containerd finds it on its PATH), kvfsd (the external server of TestServerKilled) and
// kvfsctl.
var binDir string

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "kvfs-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := 1
	if err := build(dir); err != nil {
		fmt.Fprintln(os.Stderr, err)
	} else {
		binDir = dir
		code = m.Run()
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func build(dir string) error {
	root, err := vmtest.RepoRoot()
	if err != nil {
		return err
	}
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/containerd-shim-kvfs-v2", "./cmd/kvfsd", "./cmd/kvfsctl")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %v\n%s", err, out)
	}
	for _, b := range []string{"containerd-shim-kvfs-v2", "kvfsd", "kvfsctl"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return err
		}
	}
	return nil
}
