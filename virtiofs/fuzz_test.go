package virtiofs_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestFuzzScriptListsEveryTarget keeps scripts/fuzz.sh (what `make fuzz` and `make test` run)
// in step with the fuzz targets in the repository: each one listed once, with its package.
func TestFuzzScriptListsEveryTarget(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	script, err := os.ReadFile(filepath.Join(root, "scripts", "fuzz.sh"))
	if err != nil {
		t.Fatal(err)
	}
	var listed []string
	for _, m := range regexp.MustCompile(`(?m)^(\./\S+) (Fuzz\w+)$`).FindAllStringSubmatch(string(script), -1) {
		listed = append(listed, m[1]+" "+m[2])
	}
	var found []string
	fuzzFunc := regexp.MustCompile(`(?m)^func (Fuzz\w+)\(\w+ \*testing\.F\)`)
	err = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(p))
		if err != nil {
			return err
		}
		for _, m := range fuzzFunc.FindAllStringSubmatch(string(src), -1) {
			found = append(found, "./"+filepath.ToSlash(rel)+" "+m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(listed)
	slices.Sort(found)
	if len(found) == 0 || !slices.Equal(listed, found) {
		t.Errorf("scripts/fuzz.sh lists\n  %s\nthe repository has\n  %s", strings.Join(listed, "\n  "), strings.Join(found, "\n  "))
	}
}
