// Command kvfs-agent is the init of a kvfs pod's VM: it serves the agent API
// (api/agent/v1) to the host's shim and runs the pod's containers with runc. See package
// agent.
package main

import (
	"os"

	"github.com/kvfs/kvfs/agent"
)

func main() { os.Exit(agent.Main()) }
