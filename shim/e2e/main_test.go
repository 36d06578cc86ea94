package e2e

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

func TestMain(m *testing.M) { os.Exit(shimtest.Main(m)) }
