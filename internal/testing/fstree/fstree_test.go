package fstree

import (
	"os"
	"path/filepath"
	"testing"
)

// TestDiff: a file added, one changed, one removed, a symlink and a directory's mode each show.
func TestDiff(t *testing.T) {
	root := t.TempDir()
	write := func(name, data string) {
		if err := os.WriteFile(filepath.Join(root, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("same", "s")
	write("changed", "a")
	write("gone", "g")
	before := List(t, root)
	if d := Diff(List(t, root), before); d != "" {
		t.Fatalf("a tree differs from itself: %s", d)
	}
	write("changed", "b")
	write("new", "n")
	if err := os.Remove(filepath.Join(root, "gone")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("same", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(root, 0o700); err != nil {
		t.Fatal(err)
	}
	after := List(t, root)
	if after["link"] != "-> same" || after["."] != "dir -rwx------" {
		t.Errorf("listing %q", after)
	}
	want := "~ . dir " + before["."][4:] + " → dir -rwx------\n" +
		"~ changed " + before["changed"] + " → " + after["changed"] + "\n" +
		"+ link -> same\n" +
		"+ new " + after["new"] + "\n" +
		"- gone " + before["gone"]
	if d := Diff(after, before); d != want {
		t.Errorf("Diff:\n%s\nwant:\n%s", d, want)
	}
}
