package shim

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/sandbox/serverproc"
)

// TestMain lets the pods of the VM tests (StartQEMUVM) start their sandboxes' confined servers,
// which are this test binary run again.
func TestMain(m *testing.M) {
	serverproc.Init()
	os.Exit(m.Run())
}
