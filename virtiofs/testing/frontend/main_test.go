package frontend

import (
	"flag"
	"io"
	"os"
	"testing"

	"github.com/containerd/log"
)

func TestMain(m *testing.M) {
	flag.Parse()
	// The hostile-input tests make the back-end log errors by design; show them only with -v.
	if !testing.Verbose() {
		log.L.Logger.SetOutput(io.Discard)
	}
	os.Exit(m.Run())
}
