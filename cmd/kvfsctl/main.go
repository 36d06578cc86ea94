// Command kvfsctl talks to a kvfs process's control socket: it lists and stops sandboxes,
// shows their virtio-fs servers' statistics (as tables, JSON or Prometheus text), and sets the
// process's log level. See kvfsctl --help.
package main

import (
	"context"
	"os"

	"github.com/kvfs/kvfs/cmd/kvfsctl/internal/ctl"
)

func main() {
	os.Exit(ctl.Run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
}
