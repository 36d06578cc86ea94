// Command kvfsctl talks to the control sockets of the kvfs shims (each serving its pod's
// sandbox, found without being told): it lists and stops sandboxes, shows their virtio-fs
// servers' statistics (as tables, JSON or Prometheus text), and sets the shims' log level.
// See kvfsctl --help.
package main

import (
	"context"
	"os"

	"github.com/kvfs/kvfs/cmd/kvfsctl/internal/ctl"
)

func main() {
	os.Exit(ctl.Run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}
