package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// entry is a tar entry read back.
type entry struct {
	hdr  *tar.Header
	data []byte
}

func readTar(t *testing.T, r io.Reader) ([]string, map[string]entry) {
	t.Helper()
	tr := tar.NewReader(r)
	var names []string
	entries := map[string]entry{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return names, entries
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		entries[h.Name] = entry{h, b}
	}
}

// layout is an archive read back and checked: every reference resolves to a blob of the
// referenced digest and size.
type layout struct {
	index    ocispec.Index
	manifest ocispec.Manifest
	config   ocispec.Image
	layer    []byte // uncompressed
}

func readLayout(t *testing.T, archive []byte) layout {
	t.Helper()
	_, entries := readTar(t, bytes.NewReader(archive))
	var l layout
	if got := string(entries["oci-layout"].data); got != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout: %q", got)
	}
	blob := func(d ocispec.Descriptor) []byte {
		t.Helper()
		e, ok := entries["blobs/sha256/"+d.Digest.Encoded()]
		if !ok {
			t.Fatalf("no blob for %s", d.Digest)
		}
		if digest.FromBytes(e.data) != d.Digest || int64(len(e.data)) != d.Size {
			t.Fatalf("blob %s: digest %s, size %d; descriptor says %d", d.Digest, digest.FromBytes(e.data), len(e.data), d.Size)
		}
		return e.data
	}
	if err := json.Unmarshal(entries["index.json"].data, &l.index); err != nil {
		t.Fatalf("index.json: %v", err)
	}
	if len(l.index.Manifests) != 1 {
		t.Fatalf("index.json: %d manifests", len(l.index.Manifests))
	}
	md := l.index.Manifests[0]
	if md.MediaType != ocispec.MediaTypeImageManifest || md.Platform == nil || md.Platform.OS != "linux" {
		t.Errorf("manifest descriptor: %+v", md)
	}
	if err := json.Unmarshal(blob(md), &l.manifest); err != nil {
		t.Fatal(err)
	}
	if l.manifest.SchemaVersion != 2 || len(l.manifest.Layers) != 1 ||
		l.manifest.Layers[0].MediaType != ocispec.MediaTypeImageLayerGzip ||
		l.manifest.Config.MediaType != ocispec.MediaTypeImageConfig {
		t.Fatalf("manifest: %+v", l.manifest)
	}
	if err := json.Unmarshal(blob(l.manifest.Config), &l.config); err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(bytes.NewReader(blob(l.manifest.Layers[0])))
	if err != nil {
		t.Fatal(err)
	}
	if l.layer, err = io.ReadAll(zr); err != nil {
		t.Fatal(err)
	}
	if want := []digest.Digest{digest.FromBytes(l.layer)}; l.config.RootFS.Type != "layers" || !slices.Equal(l.config.RootFS.DiffIDs, want) {
		t.Errorf("config rootfs %+v, want diff_ids %v", l.config.RootFS, want)
	}
	return l
}

func TestWriteArchive(t *testing.T) {
	img := &Image{
		Name: "localhost/test:1",
		Files: []File{
			{Path: "usr/bin/tool", Mode: 0o755, Data: []byte("#!/bin/sh\n")},
			{Path: "etc", Mode: fs.ModeDir | 0o750},
			{Path: "etc/motd", Mode: 0o644, Data: []byte("hi\n")},
			{Path: "bin", Mode: fs.ModeSymlink | 0o777, Link: "usr/bin"},
			{Path: "tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777},
			{Path: "usr/bin/su", Mode: fs.ModeSetuid | 0o755, Data: []byte("x")},
		},
		Config: ocispec.ImageConfig{Cmd: []string{"tool"}},
	}
	var a, b bytes.Buffer
	if err := img.WriteArchive(&a); err != nil {
		t.Fatal(err)
	}
	if err := img.WriteArchive(&b); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two archives of the same image differ")
	}

	l := readLayout(t, a.Bytes())
	if got := l.index.Manifests[0].Annotations[NameAnnotation]; got != "localhost/test:1" {
		t.Errorf("name annotation %q", got)
	}
	if !slices.Equal(l.config.Config.Cmd, []string{"tool"}) || l.config.OS != "linux" || l.config.Created == nil ||
		!l.config.Created.Equal(modTime) {
		t.Errorf("config: %+v", l.config)
	}

	names, entries := readTar(t, bytes.NewReader(l.layer))
	// Sorted, with the unlisted directories usr and usr/bin added.
	want := []string{"bin", "etc/", "etc/motd", "tmp/", "usr/", "usr/bin/", "usr/bin/su", "usr/bin/tool"}
	if !slices.Equal(names, want) {
		t.Fatalf("layer entries %q, want %q", names, want)
	}
	for _, tc := range []struct {
		name string
		typ  byte
		mode int64
		link string
		data string
	}{
		{"bin", tar.TypeSymlink, 0o777, "usr/bin", ""},
		{"etc/", tar.TypeDir, 0o750, "", ""},
		{"etc/motd", tar.TypeReg, 0o644, "", "hi\n"},
		{"tmp/", tar.TypeDir, 0o1777, "", ""},
		{"usr/", tar.TypeDir, 0o755, "", ""},
		{"usr/bin/su", tar.TypeReg, 0o4755, "", "x"},
		{"usr/bin/tool", tar.TypeReg, 0o755, "", "#!/bin/sh\n"},
	} {
		e := entries[tc.name]
		h := e.hdr
		if h.Typeflag != tc.typ || h.Mode != tc.mode || h.Linkname != tc.link || string(e.data) != tc.data ||
			!h.ModTime.Equal(modTime) || h.Uid != 0 || h.Gid != 0 {
			t.Errorf("%s: type %c mode %o link %q data %q mtime %v owner %d:%d", tc.name, h.Typeflag, h.Mode, h.Linkname,
				e.data, h.ModTime, h.Uid, h.Gid)
		}
	}
}

func TestWriteArchiveBadInput(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files []File
		want  string
	}{
		{"", nil, "no name"},
		{"x", []File{{Path: "/etc", Mode: fs.ModeDir}}, `file path "/etc"`},
		{"x", []File{{Path: "a/../b", Mode: 0o644}}, `file path "a/../b"`},
		{"x", []File{{Path: "../b", Mode: 0o644}}, `file path "../b"`},
		{"x", []File{{Path: "", Mode: 0o644}}, `file path ""`},
		{"x", []File{{Path: "a", Mode: 0o644}, {Path: "a", Mode: 0o600}}, `"a" is listed twice`},
		{"x", []File{{Path: "a", Mode: 0o644}, {Path: "a/b", Mode: 0o644}}, `"a/b" is inside "a", which is not a directory`},
		{"x", []File{{Path: "l", Mode: fs.ModeSymlink}}, "needs a target"},
		{"x", []File{{Path: "d", Mode: fs.ModeDir, Data: []byte("x")}}, "a directory with content"},
		{"x", []File{{Path: "f", Mode: 0o644, Link: "y"}}, "a regular file with a link target"},
		{"x", []File{{Path: "p", Mode: fs.ModeNamedPipe}}, "not supported"},
	} {
		img := &Image{Name: tc.name, Files: tc.files}
		var b bytes.Buffer
		err := img.WriteArchive(&b)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error with %q", tc.files, err, tc.want)
		}
		if b.Len() != 0 {
			t.Errorf("%+v: %d bytes written before the error", tc.files, b.Len())
		}
	}
}

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "img.tar")
	img := &Image{Name: "localhost/a:b", Files: []File{{Path: "f", Mode: 0o644, Data: []byte("1")}}}
	if err := img.WriteFile(out); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	readLayout(t, b)
	bad := &Image{Name: "localhost/a:b", Files: []File{{Path: "/f", Mode: 0o644}}}
	if err := bad.WriteFile(out); err == nil {
		t.Fatal("a bad image was written")
	}
	after, err := os.ReadFile(out)
	if err != nil || !bytes.Equal(after, b) {
		t.Errorf("a failed WriteFile changed the file: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("temporary files left: %v", ents)
	}
}

func TestBusybox(t *testing.T) {
	img, err := Busybox(BusyboxName, BusyboxPath)
	if err != nil {
		t.Fatalf("%v (scripts/deps.sh installs busybox-static)", err)
	}
	var b bytes.Buffer
	if err := img.WriteArchive(&b); err != nil {
		t.Fatal(err)
	}
	l := readLayout(t, b.Bytes())
	if got := l.index.Manifests[0].Annotations[NameAnnotation]; got != BusyboxName {
		t.Errorf("name %q", got)
	}
	if !slices.Equal(l.config.Config.Env, []string{"PATH=" + DefaultPath}) {
		t.Errorf("env %q", l.config.Config.Env)
	}
	_, entries := readTar(t, bytes.NewReader(l.layer))
	bin, err := os.ReadFile(BusyboxPath)
	if err != nil {
		t.Fatal(err)
	}
	if e := entries["bin/busybox"]; !bytes.Equal(e.data, bin) || e.hdr.Mode != 0o755 {
		t.Errorf("bin/busybox: %d bytes, mode %o", len(e.data), e.hdr.Mode)
	}
	for _, applet := range []string{"sh", "echo", "ls", "cat", "sleep"} {
		if e := entries["bin/"+applet]; e.hdr == nil || e.hdr.Typeflag != tar.TypeSymlink || e.hdr.Linkname != "busybox" {
			t.Errorf("bin/%s: %+v", applet, e.hdr)
		}
	}
	for _, d := range []string{"proc/", "sys/", "dev/", "tmp/", "run/", "etc/"} {
		if e := entries[d]; e.hdr == nil || e.hdr.Typeflag != tar.TypeDir {
			t.Errorf("%s missing", d)
		}
	}
	if !strings.HasPrefix(string(entries["etc/passwd"].data), "root:x:0:0:") ||
		!strings.HasPrefix(string(entries["etc/group"].data), "root:x:0:") {
		t.Errorf("passwd %q group %q", entries["etc/passwd"].data, entries["etc/group"].data)
	}

	if _, err := Busybox(BusyboxName, filepath.Join(t.TempDir(), "nope")); err == nil || !strings.Contains(err.Error(), "busybox-static") {
		t.Errorf("missing busybox: %v", err)
	}
}
