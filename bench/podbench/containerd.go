package podbench

import (
	"errors"
	"os"
	"path/filepath"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrd"
	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
	"github.com/kvfs/kvfs/shim"
)

// containerd is the benchmark's private containerd, as the tests run one (package ctrd: its
// own directory under /tmp, namespace, mount namespace and cgroup; with the CRI on, a network
// namespace of its own where the CNI network's bridge is), and a directory of the
// benchmark's own for the kvfs shim: its configuration and its sandboxes.
type containerd struct {
	*ctrd.Containerd
	kvfsConfig string
	logf       func(format string, args ...any)
}

// startContainerd starts the containerd, cfg.ShimDir first on its PATH, and writes the kvfs
// shim's configuration (kvfsConfig). With cri, the containerd's CRI is on, with the runtime
// handler HandlerKvfs as the installed one: without options, the shim finds its
// configuration by $KVFS_CONFIG_FILE.
func startContainerd(cfg Config, p prepared, cri bool) (*containerd, error) {
	// Short: the kvfs shim's sockets are in sb/SANDBOX_ID, and the CRI's sandbox ids are 64
	// characters (a Unix socket's path holds 107 bytes).
	dir, err := os.MkdirTemp("/tmp", "kvfspb-")
	if err != nil {
		return nil, err
	}
	kcfg, sandboxes := filepath.Join(dir, "kvfs.toml"), filepath.Join(dir, "sb")
	err = os.Mkdir(sandboxes, 0o700)
	if err == nil {
		err = os.WriteFile(kcfg, []byte(p.kvfsConfig(sandboxes, cfg)), 0o644)
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	opts := ctrd.Options{ShimDirs: []string{cfg.ShimDir}, BinDir: cfg.BinDir, LeakDirs: []string{sandboxes}, CRI: cri, Logf: cfg.logf}
	if cri {
		opts.Config = ctrdconf.KvfsRuntime(HandlerKvfs, "", "podsandbox")
		opts.Env = []string{shim.ConfigFileEnv + "=" + kcfg}
	}
	c, err := ctrd.Start(opts)
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return &containerd{Containerd: c, kvfsConfig: kcfg, logf: cfg.logf}, nil
}

// stop stops the containerd (ctrd.Containerd.Stop: what is left in it removed, what outlived
// it taken back, each said to logf), keeps its log (its shims' lines included) at keepLog if
// that is not empty, and removes its directory and the benchmark's.
func (c *containerd) stop(keepLog string) error {
	leaks, err := c.Stop()
	for _, l := range leaks {
		c.logf("outlived containerd, taken back: %s", l)
	}
	errs := []error{err}
	if keepLog != "" {
		log, err := c.Log()
		if err == nil {
			err = os.WriteFile(keepLog, []byte(log), 0o644)
		}
		errs = append(errs, err)
	}
	errs = append(errs, c.Remove(), os.RemoveAll(filepath.Dir(c.kvfsConfig)))
	return errors.Join(errs...)
}
