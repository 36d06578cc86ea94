package control_test

import (
	"bytes"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestGeneratedUpToDate regenerates the API's Go code (scripts/gen-api.sh) into a temporary
// directory and compares it with the committed files: a .proto changed without regenerating,
// or a generated file edited by hand, fails here. scripts/deps.sh installs protoc, so CI runs
// it; gen-api.sh installs the plugins at go.mod's versions.
func TestGeneratedUpToDate(t *testing.T) {
	if _, err := exec.LookPath("protoc"); err != nil {
		t.Skip("protoc is not installed (scripts/deps.sh installs it: apt-get install -y protobuf-compiler)")
	}
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	cmd := exec.Command("bash", filepath.Join(root, "scripts", "gen-api.sh"), out)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gen-api.sh: %v\n%s", err, b)
	}
	generated := pbFiles(t, out)
	committed := pbFiles(t, root)
	if len(generated) == 0 {
		t.Fatal("gen-api.sh generated nothing")
	}
	for path, want := range generated {
		got, ok := committed[path]
		switch {
		case !ok:
			t.Errorf("%s: generated but not committed (run make generate)", path)
		case !bytes.Equal(got, want):
			t.Errorf("%s: differs from what the .proto generates (run make generate)", path)
		}
	}
	for path := range committed {
		if _, ok := generated[path]; !ok {
			t.Errorf("%s: committed but no .proto generates it", path)
		}
	}
}

// pbFiles reads the generated files (*.pb.go) under dir/api, by path relative to dir.
func pbFiles(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	files := make(map[string][]byte)
	err := filepath.WalkDir(filepath.Join(dir, "api"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".pb.go") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		files[rel] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}
