// Command ctrdconf writes the config of a private containerd whose every path is under one
// directory (package ctrdconf, as the tests' containerd has it), for scripts (make demo):
//
//	go run ./internal/testing/ctrdtest/ctrdconf/cmd/ctrdconf -dir DIR [-cri] [-kvfs-config FILE]
//
// It writes DIR/config.toml; with -cri the CRI is on, and the CNI network's config and
// crictl's config (DIR/crictl.yaml) are written too (containerd must then run in a network
// namespace of its own, where the network's bridge goes). -kvfs-config adds the CRI runtime
// handler "kvfs": the kvfs shim with that sandbox configuration, pods by the podsandbox
// sandboxer.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/kvfs/kvfs/internal/testing/ctrdtest/ctrdconf"
)

func main() {
	dir := flag.String("dir", "", "the containerd's directory (required, absolute)")
	cri := flag.Bool("cri", false, "turn the CRI on, with the CNI network and crictl's config")
	kvfs := flag.String("kvfs-config", "", "with -cri: add the runtime handler kvfs with this sandbox configuration")
	flag.Parse()
	if *dir == "" || !filepath.IsAbs(*dir) || flag.NArg() != 0 || (*kvfs != "" && !*cri) {
		fmt.Fprintln(os.Stderr, "usage: ctrdconf -dir ABSDIR [-cri [-kvfs-config FILE]]")
		os.Exit(2)
	}
	if err := write(*dir, *cri, *kvfs); err != nil {
		fmt.Fprintf(os.Stderr, "ctrdconf: %v\n", err)
		os.Exit(1)
	}
}

func write(dir string, cri bool, kvfsConfig string) error {
	extra := ""
	if kvfsConfig != "" {
		extra = ctrdconf.KvfsRuntime("kvfs", kvfsConfig, "podsandbox")
	}
	cfg, err := ctrdconf.Config(dir, "info", cri, nil, extra)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), cfg, 0o600); err != nil {
		return err
	}
	if cri {
		return ctrdconf.WriteCRIFiles(dir, 3*time.Minute)
	}
	return nil
}
