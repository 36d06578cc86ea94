package podbench

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestFloorInitrd: the floor's archive is one GNU cpio reads as the kernel would (newc, its
// names, modes and contents).
func TestFloorInitrd(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "floor.gz")
	if err := writeFloorInitrd(path); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	if err := os.Mkdir(out, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", "-c", "gzip -dc "+path+" | cpio -idmv --quiet 2>&1")
	cmd.Dir = out
	list, err := cmd.Output()
	if err != nil {
		t.Fatalf("cpio: %v: %s", err, list)
	}
	if got := strings.Fields(string(list)); strings.Join(got, " ") != "bin bin/busybox dev init" {
		t.Errorf("the archive holds %q", got)
	}
	init, err := os.ReadFile(filepath.Join(out, "init"))
	if err != nil || string(init) != floorInit {
		t.Errorf("/init: %q, %v", init, err)
	}
	st, err := os.Stat(filepath.Join(out, "bin", "busybox"))
	host, herr := os.Stat("/bin/busybox")
	if err != nil || herr != nil || st.Size() != host.Size() || st.Mode().Perm() != 0o755 {
		t.Errorf("bin/busybox: %v, %v (host's: %v, %v)", st, err, host, herr)
	}
}
