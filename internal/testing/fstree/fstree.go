// Package fstree lists a directory tree as text, for the tests that check what an install, an
// uninstall or a cleanup changed under a root.
package fstree

import (
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// List maps every file and directory under root, by its path relative to root, to what it
// is: "dir PERM", "-> TARGET" for a symbolic link, "MODE SHA256" for a regular file. It fails
// the test if the tree cannot be read.
func List(t testing.TB, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			out[rel] = "dir " + info.Mode().Perm().String()
		case d.Type()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			out[rel] = "-> " + target
		default:
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s := sha256.Sum256(data)
			out[rel] = info.Mode().String() + " " + hex.EncodeToString(s[:])
		}
		return nil
	})
	if err != nil {
		t.Fatalf("fstree: %v", err)
	}
	return out
}

// Diff says how the listing got differs from want, a line a path: "+ PATH WHAT" for a new one,
// "~ PATH WAS → NOW" for a changed one, "- PATH WHAT" for one gone; "" when they are the same.
func Diff(got, want map[string]string) string {
	var diff []string
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if w, ok := want[k]; !ok {
			diff = append(diff, "+ "+k+" "+got[k])
		} else if w != got[k] {
			diff = append(diff, "~ "+k+" "+w+" → "+got[k])
		}
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if _, ok := got[k]; !ok {
			diff = append(diff, "- "+k+" "+want[k])
		}
	}
	return strings.Join(diff, "\n")
}

// Same fails the test, saying what, if the listings got and want differ, with their Diff.
func Same(t testing.TB, what string, got, want map[string]string) {
	t.Helper()
	if d := Diff(got, want); d != "" {
		t.Errorf("%s:\n%s", what, d)
	}
}
