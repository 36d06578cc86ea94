// Command kvfsguestbench runs the guest-level benchmark: kvfsd, the C virtiofsd and 9p mounted
// in one QEMU guest, and kvfsd's KILLPRIV_V2 with xattrs on and off; it writes the guest-level
// section of docs/measurements/benchmarks.md (see package bench/guestbench, and scripts/bench.sh).
package main

import (
	"os"

	"github.com/kvfs/kvfs/bench/guestbench"
)

func main() { os.Exit(guestbench.Main(os.Args, os.Stdout, os.Stderr)) }
