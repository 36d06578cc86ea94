// Command kvfsctl talks to the control sockets of kvfs processes (the daemon's and each shim's,
// found without being told): it lists and stops sandboxes, shows their virtio-fs servers'
// statistics (as tables, JSON or Prometheus text), and sets a process's log level. See
// kvfsctl --help.
package main

import (
	"context"
	"os"

	"github.com/kvfs/kvfs/cmd/kvfsctl/internal/ctl"
)

func main() {
	os.Exit(ctl.Run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}
