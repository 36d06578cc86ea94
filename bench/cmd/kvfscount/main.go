// Command kvfscount runs a fixed number of operations of one server-level workload against one
// server, started under any wrapper (strace, valgrind), for per-request counts that the load of
// a shared machine does not distort (see package bench/serverbench, CountMain).
package main

import (
	"os"

	"github.com/kvfs/kvfs/bench/serverbench"
)

func main() { os.Exit(serverbench.CountMain(os.Args, os.Stdout, os.Stderr)) }
