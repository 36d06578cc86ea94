// Command kvfspodbench runs the pod-level benchmark: containerd's kvfs shim (a QEMU VM per pod)
// against its runc shim, through ctr; it writes the pod-level section of
// docs/measurements/benchmarks.md (see package bench/podbench, and scripts/bench.sh).
package main

import (
	"os"

	"github.com/kvfs/kvfs/bench/podbench"
)

func main() { os.Exit(podbench.Main(os.Args, os.Stdout, os.Stderr)) }
