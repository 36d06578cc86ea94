// Package ociimage writes container images as OCI image layout archives: the test images of
// machines that reach no registry, imported with `ctr image import`.
//
// An archive holds oci-layout, index.json (one manifest, named by the annotation
// io.containerd.image.name), and under blobs/sha256/ the manifest, the image config and one
// gzip-compressed layer. It is deterministic: the same Image gives the same bytes (files
// sorted, fixed modification times, owner root, no gzip header time), so an image's digest
// changes only when its content does.
package ociimage

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	_ "crypto/sha256" // go-digest computes sha256 digests with it
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// NameAnnotation is the annotation of a manifest in index.json that containerd's importer
// takes as the image's name.
const NameAnnotation = "io.containerd.image.name"

// modTime is the modification time of every file in a layer and the image's creation time.
var modTime = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

// File is one entry of an image's layer.
type File struct {
	// Path is relative to the root and slash-separated ("bin/sh"), without "." or ".."
	// elements.
	Path string
	// Mode holds the permission bits (setuid, setgid and sticky included) and the type:
	// fs.ModeDir, fs.ModeSymlink, or none for a regular file.
	Mode fs.FileMode
	// Data is a regular file's content.
	Data []byte
	// Link is a symbolic link's target.
	Link string
}

// Image is an image of one layer.
type Image struct {
	// Name is the image reference the archive's index names ("localhost/busybox:latest").
	Name string
	// Files make the layer. A directory that holds a file but is not listed is added with
	// mode 0755.
	Files []File
	// Config is the container configuration the image suggests (environment, command).
	Config ocispec.ImageConfig
}

// WriteArchive writes img as an OCI image layout tar to w.
func (img *Image) WriteArchive(w io.Writer) error {
	if img.Name == "" {
		return fmt.Errorf("ociimage: the image has no name")
	}
	files, err := complete(img.Files)
	if err != nil {
		return fmt.Errorf("ociimage: image %s: %w", img.Name, err)
	}
	layerTar, err := tarOf(files)
	if err != nil {
		return fmt.Errorf("ociimage: image %s: %w", img.Name, err)
	}
	var layer bytes.Buffer
	zw := gzip.NewWriter(&layer)
	if _, err := zw.Write(layerTar); err != nil {
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}

	platform := ocispec.Platform{Architecture: runtime.GOARCH, OS: "linux"}
	created := modTime
	config, err := json.Marshal(ocispec.Image{
		Created:  &created,
		Platform: platform,
		Config:   img.Config,
		RootFS:   ocispec.RootFS{Type: "layers", DiffIDs: []digest.Digest{digest.FromBytes(layerTar)}},
	})
	if err != nil {
		return err
	}
	layerDesc := descriptor(ocispec.MediaTypeImageLayerGzip, layer.Bytes())
	configDesc := descriptor(ocispec.MediaTypeImageConfig, config)
	manifest, err := json.Marshal(ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    configDesc,
		Layers:    []ocispec.Descriptor{layerDesc},
	})
	if err != nil {
		return err
	}
	manifestDesc := descriptor(ocispec.MediaTypeImageManifest, manifest)
	manifestDesc.Platform = &platform
	manifestDesc.Annotations = map[string]string{NameAnnotation: img.Name}
	index, err := json.Marshal(ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{manifestDesc},
	})
	if err != nil {
		return err
	}
	layout, err := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
	if err != nil {
		return err
	}

	tw := tar.NewWriter(w)
	entries := []File{
		{Path: ocispec.ImageLayoutFile, Mode: 0o644, Data: layout},
		{Path: ocispec.ImageIndexFile, Mode: 0o644, Data: index},
		{Path: "blobs", Mode: fs.ModeDir | 0o755},
		{Path: "blobs/sha256", Mode: fs.ModeDir | 0o755},
	}
	for _, b := range [][]byte{manifest, config, layer.Bytes()} {
		entries = append(entries, File{Path: blobPath(digest.FromBytes(b)), Mode: 0o644, Data: b})
	}
	for _, f := range entries {
		if err := writeEntry(tw, f); err != nil {
			return err
		}
	}
	return tw.Close()
}

// WriteFile writes the archive to a temporary file beside name and renames it to name, so
// that name is either what it was or the whole new archive.
func (img *Image) WriteFile(name string) error {
	f, err := os.CreateTemp(filepath.Dir(name), ".ociimage-*")
	if err != nil {
		return fmt.Errorf("ociimage: %w", err)
	}
	defer os.Remove(f.Name())
	bw := bufio.NewWriter(f)
	err = img.WriteArchive(bw)
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return fmt.Errorf("ociimage: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("ociimage: %w", err)
	}
	if err := os.Rename(f.Name(), name); err != nil {
		return fmt.Errorf("ociimage: %w", err)
	}
	return nil
}

func descriptor(mediaType string, b []byte) ocispec.Descriptor {
	return ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
}

func blobPath(d digest.Digest) string {
	return path.Join("blobs", d.Algorithm().String(), d.Encoded())
}

// complete checks the files and returns them sorted by path, with the directories that hold
// them and are not listed added.
func complete(files []File) ([]File, error) {
	byPath := make(map[string]File, len(files))
	for _, f := range files {
		if err := check(f); err != nil {
			return nil, err
		}
		if _, dup := byPath[f.Path]; dup {
			return nil, fmt.Errorf("%q is listed twice", f.Path)
		}
		byPath[f.Path] = f
	}
	for _, f := range files {
		for dir := path.Dir(f.Path); dir != "."; dir = path.Dir(dir) {
			d, ok := byPath[dir]
			if !ok {
				byPath[dir] = File{Path: dir, Mode: fs.ModeDir | 0o755}
				continue
			}
			if !d.Mode.IsDir() {
				return nil, fmt.Errorf("%q is inside %q, which is not a directory", f.Path, dir)
			}
		}
	}
	out := make([]File, 0, len(byPath))
	for _, f := range byPath {
		out = append(out, f)
	}
	slices.SortFunc(out, func(a, b File) int { return strings.Compare(a.Path, b.Path) })
	return out, nil
}

func check(f File) error {
	if f.Path == "" || path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == ".." ||
		strings.HasPrefix(f.Path, "../") {
		return fmt.Errorf("file path %q: want a clean relative path inside the image", f.Path)
	}
	switch t := f.Mode.Type(); t {
	case 0:
		if f.Link != "" {
			return fmt.Errorf("%q: a regular file with a link target", f.Path)
		}
	case fs.ModeDir:
		if f.Data != nil || f.Link != "" {
			return fmt.Errorf("%q: a directory with content or a link target", f.Path)
		}
	case fs.ModeSymlink:
		if f.Link == "" || f.Data != nil {
			return fmt.Errorf("%q: a symbolic link needs a target and no content", f.Path)
		}
	default:
		return fmt.Errorf("%q: file type %v is not supported (regular files, directories, symbolic links)", f.Path, t)
	}
	return nil
}

// tarOf is the uncompressed layer: its digest is the image's diff ID.
func tarOf(files []File) ([]byte, error) {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, f := range files {
		if err := writeEntry(tw, f); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

func writeEntry(tw *tar.Writer, f File) error {
	h := &tar.Header{
		Name:    f.Path,
		Mode:    int64(f.Mode.Perm()),
		ModTime: modTime,
		Uname:   "root",
		Gname:   "root",
	}
	if f.Mode&fs.ModeSetuid != 0 {
		h.Mode |= 0o4000
	}
	if f.Mode&fs.ModeSetgid != 0 {
		h.Mode |= 0o2000
	}
	if f.Mode&fs.ModeSticky != 0 {
		h.Mode |= 0o1000
	}
	switch f.Mode.Type() {
	case fs.ModeDir:
		h.Typeflag, h.Name = tar.TypeDir, f.Path+"/"
	case fs.ModeSymlink:
		h.Typeflag, h.Linkname = tar.TypeSymlink, f.Link
	default:
		h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
	}
	if err := tw.WriteHeader(h); err != nil {
		return fmt.Errorf("%s: %w", f.Path, err)
	}
	if h.Typeflag == tar.TypeReg {
		if _, err := tw.Write(f.Data); err != nil {
			return fmt.Errorf("%s: %w", f.Path, err)
		}
	}
	return nil
}
