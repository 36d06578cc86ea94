// Package kubeletvol writes a volume as the kubelet's atomic writer writes configMap,
// secret, projected and downward API volumes, for tests: the data in a hidden directory
// named by a timestamp, the ..data link to it, a link per key to ..data/key.
package kubeletvol

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// Write gives the volume at dir (made if missing) the content files, by name, as the kubelet
// updates it: the files into a new directory stamp (a name starting with ".."), the ..data
// link swapped to it by a rename of ..data_tmp, a link made for each new key, the links of
// the keys gone removed, then the old directory.
func Write(dir, stamp string, files map[string]string) error {
	if err := os.MkdirAll(filepath.Join(dir, stamp), 0o755); err != nil {
		return err
	}
	for k, v := range files {
		if err := os.WriteFile(filepath.Join(dir, stamp, k), []byte(v), 0o644); err != nil {
			return err
		}
	}
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	if err := os.Symlink(stamp, filepath.Join(dir, "..data_tmp")); err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		return err
	}
	for k := range files {
		if _, err := os.Lstat(filepath.Join(dir, k)); errors.Is(err, fs.ErrNotExist) {
			if err := os.Symlink(filepath.Join("..data", k), filepath.Join(dir, k)); err != nil {
				return err
			}
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if _, ok := files[e.Name()]; !ok && e.Type() == fs.ModeSymlink && e.Name() != "..data" {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	if old != "" && old != stamp {
		return os.RemoveAll(filepath.Join(dir, old))
	}
	return nil
}
