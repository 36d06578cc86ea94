package agent_test

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/sandbox/serverproc"
)

// TestMain lets the sandboxes of the VM tests start their confined servers, which are this
// test binary run again.
func TestMain(m *testing.M) {
	serverproc.Init()
	os.Exit(m.Run())
}
