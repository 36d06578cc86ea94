// Package fuzzseed keeps a fuzz target's committed seed corpus (testdata/fuzz/TARGET, in go
// test's corpus file format) in step with the seeds a test generates, for every fuzz target of
// the repository.
package fuzzseed

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// Bytes is the content of a corpus file whose one argument is b ([]byte).
func Bytes(b []byte) string { return fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b) }

// Check fails the test for each of files (a file name in testdata/fuzz/target → its content)
// missing there or different, saying to rerun with update; with update it writes them instead.
// Files there that files does not name (crashers kept as regression seeds) are left alone.
// rerun is the command that updates them ("go test -run TestX -update-fuzz-seeds").
func Check(t testing.TB, target string, files map[string]string, update bool, rerun string) {
	t.Helper()
	dir := filepath.Join("testdata", "fuzz", target)
	for name, want := range files {
		path := filepath.Join(dir, name)
		if update {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		got, err := os.ReadFile(path)
		if err != nil || string(got) != want {
			t.Errorf("%s is missing or stale (%v): run %s", path, err, rerun)
		}
	}
}
