// Package guestimage reads what a kvfs guest image says about itself: the kernel's version
// from its banner, the description packaging/guest/build.sh --agent records in the
// initramfs (/etc/kvfs/image.json), and the checksums in the SHA256SUMS file beside it. It
// is what `kvfsctl image info` prints.
//
// The image is the host's own file, not the guest's input, but it may be any file a
// configuration names: every size read from it is bounded before use.
package guestimage

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/opencontainers/runtime-spec/specs-go/features"
)

// An image directory, as packaging/guest/build.sh writes it: the kernel (an ELF, which QEMU
// starts at its PVH entry point), the guest's root — the agent image's erofs image (RootfsFile),
// or an initramfs (InitrdFile: the test guests, and an agent image with Debian's kernel) —,
// the description (also inside the root, at DescriptionPath) and the checksums of the three.
const (
	KernelFile      = "vmlinux"
	RootfsFile      = "rootfs.erofs"
	InitrdFile      = "initramfs.gz"
	DescriptionFile = "image.json"
	SumsFile        = "SHA256SUMS"
	DescriptionPath = "etc/kvfs/image.json"
)

// Description is image.json: what the image was built from.
type Description struct {
	KVFSVersion     string `json:"kvfs_version"`
	SourceDateEpoch int64  `json:"source_date_epoch"`
	Kernel          struct {
		Version        string `json:"version"`
		Package        string `json:"package"`
		PackageVersion string `json:"package_version"`
		SHA256         string `json:"sha256"`
	} `json:"kernel"`
	Agent struct {
		SHA256 string `json:"sha256"`
		Go     string `json:"go"`
		// Tags are the build tags of a test image's agent (build.sh --agent-faults:
		// "kvfsfaults"); a shipped image has none.
		Tags string `json:"tags,omitempty"`
	} `json:"agent"`
	// Runtime is the container runtime in the guest (crun).
	Runtime struct {
		Name           string `json:"name"`
		PackageVersion string `json:"package_version"`
		// Features is what `crun features` says of the image's runtime; nil in an image
		// built before build.sh recorded it.
		Features *features.Features `json:"features,omitempty"`
	} `json:"runtime"`
	Busybox struct {
		PackageVersion string `json:"package_version"`
	} `json:"busybox"`
	Modules []string `json:"modules"`
}

// File is one file of the image.
type File struct {
	Path   string `json:"path"`
	SHA256 string `json:"sha256"`
	// Listed is the checksum SHA256SUMS beside the file gives it; "" when there is none.
	Listed string `json:"listed_sha256,omitempty"`
}

// Matches says whether the file's checksum is the one SHA256SUMS lists.
func (f File) Matches() bool { return f.Listed != "" && f.Listed == f.SHA256 }

// Info is what a host's guest image is.
type Info struct {
	Kernel File `json:"kernel"`
	// KernelVersion is the kernel's release, from its banner (or an older image's bzImage
	// header).
	KernelVersion string `json:"kernel_version"`
	// Root is the guest's root: the erofs image, or the initramfs.
	Root File `json:"root"`
	// Description is the image's image.json (ReadDescription); nil if it has none (an image
	// not built by build.sh --agent).
	Description *Description `json:"description"`
}

// RootIn answers the root of the image in dir, as a configuration names it (vm.rootfs,
// vm.initrd): its erofs image, or, in a directory that has none but an initramfs (an image
// built with Debian's kernel, or before the root was an image), that initramfs. The other is
// "". A directory with neither answers the erofs image, the kind build.sh --agent makes.
func RootIn(dir string) (rootfs, initrd string) {
	rootfs, initrd = filepath.Join(dir, RootfsFile), filepath.Join(dir, InitrdFile)
	if !exists(rootfs) && exists(initrd) {
		return "", initrd
	}
	return rootfs, ""
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// Read describes the image made of kernel and root, its erofs image or initramfs.
func Read(kernel, root string) (*Info, error) {
	var info Info
	var err error
	if info.Kernel, err = checksum(kernel); err != nil {
		return nil, err
	}
	if info.KernelVersion, err = KernelVersion(kernel); err != nil {
		return nil, err
	}
	if info.Root, err = checksum(root); err != nil {
		return nil, err
	}
	d, err := ReadDescription(root)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return nil, err
	default:
		info.Description = d
	}
	return &info, nil
}

// ReadDescription reads the description of the image whose root is root: the
// DescriptionFile beside it if there is one, else an initramfs's own; an error wrapping
// os.ErrNotExist if neither exists.
func ReadDescription(root string) (*Description, error) {
	from := filepath.Join(filepath.Dir(root), DescriptionFile)
	data, err := os.ReadFile(from)
	if errors.Is(err, os.ErrNotExist) {
		from = root + ":" + DescriptionPath
		data, err = ReadInitramfsFile(root, DescriptionPath)
		if errors.Is(err, gzip.ErrHeader) {
			// An erofs image: its description is only readable beside it.
			return nil, fmt.Errorf("%s has no %s beside it: %w", root, DescriptionFile, os.ErrNotExist)
		}
	}
	if err != nil {
		return nil, err
	}
	var d Description
	if err := json.Unmarshal(data, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", from, err)
	}
	return &d, nil
}

// checksum hashes path and looks it up in the SHA256SUMS beside it.
func checksum(path string) (File, error) {
	f, err := os.Open(path)
	if err != nil {
		return File{}, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return File{}, fmt.Errorf("reading %s: %w", path, err)
	}
	out := File{Path: path, SHA256: hex.EncodeToString(h.Sum(nil))}
	sums, err := ReadSums(filepath.Join(filepath.Dir(path), SumsFile))
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return File{}, err
	default:
		out.Listed = sums[filepath.Base(path)]
	}
	return out, nil
}

// ReadSums reads a sha256sum file: file name → checksum.
func ReadSums(path string) (map[string]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	sums := map[string]string{}
	for i, line := range strings.Split(strings.TrimRight(string(data), "\n"), "\n") {
		sum, name, ok := strings.Cut(line, "  ")
		if b, err := hex.DecodeString(sum); !ok || err != nil || len(b) != sha256.Size || name == "" {
			return nil, fmt.Errorf("%s line %d: want \"SHA256  NAME\", got %q", path, i+1, line)
		}
		sums[name] = sum
	}
	return sums, nil
}

// KernelVersion reads the release of a guest kernel: an ELF vmlinux (what build.sh ships,
// booted at its PVH entry point) or an x86 bzImage (images built before it did).
func KernelVersion(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var hdr [0x210]byte
	if n, _ := io.ReadFull(f, hdr[:]); n >= 4 && string(hdr[:4]) == "\x7fELF" {
		return elfKernelVersion(path, f)
	} else if n < len(hdr) {
		return "", fmt.Errorf("%s: neither an ELF kernel nor a bzImage: %d bytes", path, n)
	}
	if string(hdr[0x202:0x206]) != "HdrS" {
		return "", fmt.Errorf("%s: neither an ELF kernel nor a bzImage (no HdrS boot header)", path)
	}
	// The boot protocol's kernel_version field: a pointer at 0x20e to a string at that
	// offset + 0x200.
	off := int64(binary.LittleEndian.Uint16(hdr[0x20e:])) + 0x200
	var s [256]byte
	n, err := f.ReadAt(s[:], off)
	if n == 0 {
		return "", fmt.Errorf("%s: kernel version at offset %d: %w", path, off, err)
	}
	v, _, ok := bytes.Cut(s[:n], []byte{0})
	if !ok || len(v) == 0 {
		return "", fmt.Errorf("%s: no kernel version string at offset %d", path, off)
	}
	// "6.1.0-57-amd64 (debian-kernel@lists.debian.org) #1 SMP ...": the release is the first word.
	return string(bytes.Fields(v)[0]), nil
}

// linuxBanner starts the kernel's banner ("Linux version 6.12.117-kvfs (builder@host) #1 ..."),
// a string in its read-only data.
var linuxBanner = []byte("Linux version ")

// elfKernelVersion finds the release in the banner of the ELF kernel f, reading it in chunks
// that overlap by a banner's release.
func elfKernelVersion(path string, f *os.File) (string, error) {
	const chunk, overlap = 1 << 20, 512
	buf := make([]byte, chunk+overlap)
	var off int64
	for {
		n, err := f.ReadAt(buf, off)
		if i := findBanner(buf[:n]); i >= 0 {
			rest := buf[i+len(linuxBanner) : n]
			if end := bytes.IndexAny(rest, " \x00"); end > 0 {
				return string(rest[:end]), nil
			}
		}
		if err == io.EOF || n <= overlap {
			return "", fmt.Errorf("%s: an ELF file without the kernel's %q banner", path, linuxBanner)
		}
		if err != nil {
			return "", fmt.Errorf("%s: %w", path, err)
		}
		off += int64(n - overlap)
	}
}

// findBanner returns the index of the banner in b, followed by a release (a digit); -1 if none.
func findBanner(b []byte) int {
	for at := 0; ; {
		i := bytes.Index(b[at:], linuxBanner)
		if i < 0 {
			return -1
		}
		at += i
		if r := b[at+len(linuxBanner):]; len(r) > 0 && r[0] >= '0' && r[0] <= '9' {
			return at
		}
		at += len(linuxBanner)
	}
}

// Entry is one member of a newc cpio archive.
type Entry struct {
	Name  string // without a leading "./"
	Mode  uint32
	Mtime int64
	Size  int64
}

// maxMemberSize bounds a member ReadInitramfsFile reads into memory.
const maxMemberSize = 1 << 20

// ReadInitramfsFile returns the contents of the member name ("etc/kvfs/image.json") of a
// gzip-compressed newc cpio archive; an error wrapping os.ErrNotExist if it has none.
func ReadInitramfsFile(path, name string) ([]byte, error) {
	var data []byte
	found := false
	err := WalkInitramfs(path, func(e Entry, body io.Reader) error {
		if e.Name != name || found {
			return nil
		}
		if e.Size > maxMemberSize {
			return fmt.Errorf("%s is %d bytes, more than %d", name, e.Size, maxMemberSize)
		}
		found = true
		var err error
		data, err = io.ReadAll(body)
		return err
	})
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, fmt.Errorf("%s: no %s in the archive: %w", path, name, os.ErrNotExist)
	}
	return data, nil
}

// WalkInitramfs calls fn for each member of a gzip-compressed newc cpio archive, in archive
// order, with a reader of its contents (valid until fn returns).
func WalkInitramfs(path string, fn func(Entry, io.Reader) error) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	zr, err := gzip.NewReader(bufio.NewReader(f))
	if err != nil {
		return fmt.Errorf("%s: not a gzip-compressed initramfs: %w", path, err)
	}
	if err := walkCPIO(bufio.NewReader(zr), fn); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// newc header: the magic and 13 fields of 8 hex digits.
const (
	newcMagic      = "070701"
	newcHeaderSize = 110
	maxNameSize    = 4096
)

func walkCPIO(r *bufio.Reader, fn func(Entry, io.Reader) error) error {
	var offset int64 // for alignment: headers and contents start at multiples of 4
	for {
		var hdr [newcHeaderSize]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return fmt.Errorf("cpio header at %d: %w", offset, err)
		}
		if string(hdr[:6]) != newcMagic {
			return fmt.Errorf("cpio header at %d: magic %q, want %q (newc)", offset, hdr[:6], newcMagic)
		}
		field := func(i int) (uint64, error) {
			return strconv.ParseUint(string(hdr[6+8*i:14+8*i]), 16, 32)
		}
		var v [13]uint64
		for i := range v {
			var err error
			if v[i], err = field(i); err != nil {
				return fmt.Errorf("cpio header at %d: field %d: %w", offset, i, err)
			}
		}
		mode, mtime, size, nameSize := v[1], v[5], v[6], v[11]
		if nameSize == 0 || nameSize > maxNameSize {
			return fmt.Errorf("cpio header at %d: name size %d", offset, nameSize)
		}
		offset += newcHeaderSize
		name := make([]byte, pad4(offset+int64(nameSize))-offset)
		if _, err := io.ReadFull(r, name); err != nil {
			return fmt.Errorf("cpio name at %d: %w", offset, err)
		}
		offset += int64(len(name))
		n := string(bytes.TrimRight(name[:nameSize], "\x00"))
		if n == "TRAILER!!!" {
			return nil
		}
		e := Entry{Name: strings.TrimPrefix(n, "./"), Mode: uint32(mode), Mtime: int64(mtime), Size: int64(size)}
		body := &io.LimitedReader{R: r, N: e.Size}
		if err := fn(e, body); err != nil {
			return fmt.Errorf("%s: %w", e.Name, err)
		}
		// What fn left of the contents, and the padding after them.
		end := pad4(offset + e.Size)
		if _, err := io.CopyN(io.Discard, r, body.N+end-offset-e.Size); err != nil {
			return fmt.Errorf("cpio member %s: truncated: %w", e.Name, err)
		}
		offset = end
	}
}

func pad4(n int64) int64 { return (n + 3) &^ 3 }
