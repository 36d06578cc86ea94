package guestbench

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"
)

// The real code base of the "luabuild" workload: Lua 5.4.4, unmodified, from Debian's archive
// (the lua5.4 source package's upstream tarball, byte for byte lua.org's lua-5.4.4.tar.gz). It
// is 34 C files and 27 headers with a plain Makefile (no configure step, which would run for
// minutes under TCG), and it builds with tcc: `make posix CC=tcc` with tcc's own archiver.
const (
	LuaURL    = "http://deb.debian.org/debian/pool/main/l/lua5.4/lua5.4_5.4.4.orig.tar.gz"
	LuaSHA256 = "164c7849653b80ae67bec4b7473b884bf5cc8d2dca05653475ec2ed27b9ebf61"
	// LuaTop is the tarball's top directory.
	LuaTop = "lua-5.4.4"
	// LuaMake is the build's make arguments after -jN, as guest.sh runs them in the top
	// directory: upstream's POSIX target with tcc as compiler, linker and archiver (the guest
	// has no binutils; tcc indexes the archive itself, so ranlib has nothing to do).
	LuaMake = "posix CC=tcc AR='tcc -ar rcu' RANLIB=true"
	// LuaCheck is the Lua chunk the built interpreter runs, LuaCheckOut what it must print.
	LuaCheck    = `local t = {} for i = 1, 10 do t[#t + 1] = i * i end print(string.format("%s %d %s", _VERSION, 6 * 7, table.concat(t, ",")))`
	LuaCheckOut = "Lua 5.4 42 1,4,9,16,25,36,49,64,81,100"
)

// luaTarball returns the path of the Lua tarball in dir, downloading it from LuaURL the first
// time. The file, kept or fetched, must have the checksum LuaSHA256.
func luaTarball(ctx context.Context, dir string) (string, error) {
	return fetchPinned(ctx, dir, LuaURL, LuaSHA256)
}

// fetchPinned returns dir/NAME, NAME the last element of url: the file already there, or
// downloaded to it. A file whose SHA-256 is not sum is an error naming it, and a download that
// does not match is not kept.
func fetchPinned(ctx context.Context, dir, url, sum string) (string, error) {
	dst := filepath.Join(dir, path.Base(url))
	if got, err := sha256File(dst); err == nil {
		if got != sum {
			return "", fmt.Errorf("%s: SHA-256 %s, want %s (remove it to fetch %s again)", dst, got, sum, url)
		}
		return dst, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("downloading %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("downloading %s: %s", url, resp.Status)
	}
	tmp, err := os.CreateTemp(dir, path.Base(url)+".*.part")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	h := sha256.New()
	_, err = io.Copy(io.MultiWriter(tmp, h), resp.Body)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", fmt.Errorf("downloading %s: %w", url, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sum {
		return "", fmt.Errorf("%s as downloaded from %s: SHA-256 %s, want %s", dst, url, got, sum)
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", err
	}
	return dst, nil
}

func sha256File(name string) (string, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("reading %s: %w", name, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// untar unpacks the gzipped tarball into dir, which must not exist yet, keeping the files'
// modes and modification times (so that make in the guest, whose clock may differ from the
// host's, sees sources older than the objects it writes). Only directories and regular files
// are accepted; a name that is absolute or leaves dir is an error.
func untar(tarball, dir string) error {
	f, err := os.Open(tarball)
	if err != nil {
		return err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return fmt.Errorf("%s: %w", tarball, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	type dirTime struct {
		path string
		mod  time.Time
	}
	var dirs []dirTime
	tr := tar.NewReader(zr)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("%s: %w", tarball, err)
		}
		name := path.Clean(hdr.Name)
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("%s: entry %q is outside the tree", tarball, hdr.Name)
		}
		dst := filepath.Join(dir, filepath.FromSlash(name))
		mode := os.FileMode(hdr.Mode).Perm()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o755); err != nil {
				return err
			}
			if err := os.Chmod(dst, mode|0o700); err != nil {
				return err
			}
			dirs = append(dirs, dirTime{dst, hdr.ModTime})
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return err
			}
			out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
			if err != nil {
				return err
			}
			_, err = io.Copy(out, tr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("%s: %s: %w", tarball, hdr.Name, err)
			}
			if err := os.Chtimes(dst, hdr.ModTime, hdr.ModTime); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%s: entry %q has type %q, want a directory or a regular file", tarball, hdr.Name, hdr.Typeflag)
		}
	}
	// Directories last: creating their files changed their times.
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := os.Chtimes(dirs[i].path, dirs[i].mod, dirs[i].mod); err != nil {
			return err
		}
	}
	return nil
}
