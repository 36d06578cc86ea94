package deploy

import (
	"bytes"
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/internal/ociimage"
)

// PayloadDir is where the image keeps what it installs: bin/ (the binaries, this command's
// among them), guest/ (the guest image) and install.sh.
const PayloadDir = "/opt/kvfs-deploy"

// Binaries are the kvfs binaries the image carries and install.sh installs.
var Binaries = []string{"containerd-shim-kvfs-v2", "kvfsd", "kvfsctl"}

// Command is this command's name: the image's entrypoint, PayloadDir/bin/Command.
const Command = "kvfs-deploy"

// guestFiles are the guest image's files, as packaging/guest/build.sh --agent writes them.
var guestFiles = []string{guestimage.KernelFile, guestimage.RootfsFile, guestimage.DescriptionFile, guestimage.SumsFile}

// Sources are the files an install image is made of, on the machine that builds it.
type Sources struct {
	// Bin holds Binaries and Command, each statically linked (CGO_ENABLED=0): the image has
	// no C library for them.
	Bin string
	// Guest is a guest image directory (packaging/guest/build.sh --agent DIR).
	Guest string
	// Installer is packaging/install.sh.
	Installer string
	// Busybox is a statically linked busybox (ociimage.BusyboxPath): the image's sh and the
	// tools install.sh runs besides bash.
	Busybox string
	// Bash is the bash install.sh runs under; it goes into the image with the shared
	// libraries ldd lists for it, at the same paths.
	Bash string
}

// Image is the node-install image named name: busybox's tools (ociimage.Busybox), bash and
// its libraries, and under PayloadDir the binaries, the guest image and install.sh. Its
// entrypoint is PayloadDir/bin/Command, its command "install". The same Sources give the
// same archive bytes (package ociimage).
func Image(name string, src Sources) (*ociimage.Image, error) {
	img, err := ociimage.Busybox(name, src.Busybox)
	if err != nil {
		return nil, err
	}
	add := func(f ociimage.File) error {
		for _, g := range img.Files {
			if g.Path == f.Path {
				return fmt.Errorf("deploy: %s is in the image twice", f.Path)
			}
		}
		img.Files = append(img.Files, f)
		return nil
	}
	for _, b := range append(append([]string{}, Binaries...), Command) {
		p := filepath.Join(src.Bin, b)
		if err := checkStatic(p); err != nil {
			return nil, err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("deploy: %w", err)
		}
		if err := add(ociimage.File{Path: rel(PayloadDir, "bin", b), Mode: 0o755, Data: data}); err != nil {
			return nil, err
		}
	}
	for _, g := range guestFiles {
		data, err := os.ReadFile(filepath.Join(src.Guest, g))
		if err != nil {
			return nil, fmt.Errorf("deploy: the guest image: %w (packaging/guest/build.sh --agent %s)", err, src.Guest)
		}
		if err := add(ociimage.File{Path: rel(PayloadDir, "guest", g), Mode: 0o644, Data: data}); err != nil {
			return nil, err
		}
	}
	data, err := os.ReadFile(src.Installer)
	if err != nil {
		return nil, fmt.Errorf("deploy: the installer: %w", err)
	}
	if err := add(ociimage.File{Path: rel(PayloadDir, "install.sh"), Mode: 0o755, Data: data}); err != nil {
		return nil, err
	}
	bash, err := withLibraries(src.Bash)
	if err != nil {
		return nil, err
	}
	for p, data := range bash {
		if err := add(ociimage.File{Path: strings.TrimPrefix(p, "/"), Mode: 0o755, Data: data}); err != nil {
			return nil, err
		}
	}
	img.Config = ocispec.ImageConfig{
		Env:        []string{"PATH=" + ociimage.DefaultPath},
		Entrypoint: []string{path.Join(PayloadDir, "bin", Command)},
		Cmd:        []string{"install"},
		Labels:     map[string]string{"org.opencontainers.image.title": "kvfs node installer"},
	}
	return img, nil
}

func rel(elem ...string) string {
	return strings.TrimPrefix(path.Join(elem...), "/")
}

// checkStatic fails unless the ELF executable p is statically linked (no program
// interpreter).
func checkStatic(p string) error {
	f, err := elf.Open(p)
	if err != nil {
		return fmt.Errorf("deploy: %s: %w (want a statically linked executable)", p, err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		if prog.Type == elf.PT_INTERP {
			return fmt.Errorf("deploy: %s is dynamically linked: the image has no C library for it (build it with CGO_ENABLED=0)", p)
		}
	}
	return nil
}

// withLibraries reads the executable bin (as /bin/bash in the image) and the shared libraries
// and program interpreter that ldd lists for it (at their paths), symbolic links followed.
func withLibraries(bin string) (map[string][]byte, error) {
	files := map[string][]byte{}
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, fmt.Errorf("deploy: bash: %w", err)
	}
	files["/bin/"+filepath.Base(bin)] = data
	var stderr bytes.Buffer
	cmd := exec.Command("ldd", bin)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil && strings.Contains(string(out)+stderr.String(), "not a dynamic executable") {
		return files, nil // a static bash (Debian's bash-static) needs nothing more
	}
	if err != nil {
		return nil, fmt.Errorf("deploy: ldd %s: %w: %s", bin, err, strings.TrimSpace(stderr.String()))
	}
	for _, line := range strings.Split(string(out), "\n") {
		fields := strings.Fields(line)
		var lib string
		switch {
		case len(fields) >= 3 && fields[1] == "=>" && strings.HasPrefix(fields[2], "/"):
			lib = fields[2] // libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)
		case len(fields) >= 1 && strings.HasPrefix(fields[0], "/"):
			lib = fields[0] // /lib64/ld-linux-x86-64.so.2 (0x...)
		case len(fields) >= 3 && fields[1] == "=>" && fields[2] == "not":
			return nil, fmt.Errorf("deploy: ldd %s: %s", bin, strings.TrimSpace(line))
		default:
			continue // linux-vdso.so.1 (0x...)
		}
		if path.Clean(lib) != lib {
			return nil, fmt.Errorf("deploy: ldd %s: library path %q is not clean", bin, lib)
		}
		data, err := os.ReadFile(lib)
		if err != nil {
			return nil, fmt.Errorf("deploy: %s's library: %w", bin, err)
		}
		files[lib] = data
	}
	return files, nil
}
