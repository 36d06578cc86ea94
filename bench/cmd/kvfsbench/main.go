// Command kvfsbench runs the server-level benchmark of kvfsd against the C virtiofsd and writes
// the report (see package bench/serverbench, and scripts/bench.sh for how make bench runs it).
package main

import (
	"os"

	"github.com/kvfs/kvfs/bench/serverbench"
)

func main() { os.Exit(serverbench.Main(os.Args, os.Stdout, os.Stderr)) }
