// Command containerd-shim-kvfs-v2 is containerd's runtime io.containerd.kvfs.v2: each pod in
// a QEMU VM whose init is the kvfs guest agent, its containers' files served over virtio-fs
// by the sandbox's kvfsd, confined in a process this binary starts of itself (see package
// github.com/kvfs/kvfs/sandbox/serverproc). See package github.com/kvfs/kvfs/shim.
package main

import (
	"context"

	cshim "github.com/containerd/containerd/v2/pkg/shim"

	"github.com/kvfs/kvfs/sandbox/serverproc"
	"github.com/kvfs/kvfs/shim"
	_ "github.com/kvfs/kvfs/shim/plugin"
)

func main() {
	// A pod's virtio-fs server is this binary run again: it serves from here and never returns.
	serverproc.Init()
	// The containers' processes are the guest's: the shim's only children are QEMU and
	// logging binaries, which their owners wait for. containerd's reaper (wait on every
	// SIGCHLD) would steal their exit statuses, and a subreaper would collect orphans no one
	// waits for.
	cshim.RunShim(context.Background(), shim.NewManager(shim.RuntimeName), func(c *cshim.Config) {
		c.NoReaper, c.NoSubreaper = true, true
	})
}
