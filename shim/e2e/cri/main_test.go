// Package cri tests containerd-shim-kvfs-v2 as Kubernetes runs it: pods through a real
// containerd v2.4's CRI (a private instance per test, internal/testing/ctrdtest with its CRI
// on), with crictl and Debian's CNI plugins, each pod a real QEMU VM (TCG here). A package of
// its own, beside package e2e's ctr tests, so that the two run at once. Only tests.
package cri

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

func TestMain(m *testing.M) { os.Exit(shimtest.Main(m)) }
