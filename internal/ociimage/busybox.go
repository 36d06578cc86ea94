package ociimage

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// BusyboxName is the name of the busybox test image.
const BusyboxName = "localhost/busybox:latest"

// BusyboxPath is where Debian's busybox-static installs its binary.
const BusyboxPath = "/bin/busybox"

// DefaultPath is the image's PATH.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Busybox is an image named name made from a statically linked busybox binary (Debian's
// busybox-static at BusyboxPath): /bin/busybox, a symbolic link in /bin for each applet it
// lists (busybox --list), /etc/passwd and /etc/group with root and nobody, and the empty
// directories a runtime mounts on (/proc, /sys, /dev, /run, /tmp). Its command is sh.
func Busybox(name, busybox string) (*Image, error) {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return nil, fmt.Errorf("ociimage: busybox: %w (Debian's busybox-static installs it at %s)", err, BusyboxPath)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(busybox, "--list")
	cmd.Stderr = &stderr
	list, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("ociimage: %s --list: %w: %s", busybox, err, strings.TrimSpace(stderr.String()))
	}
	files := []File{
		{Path: "bin", Mode: fs.ModeDir | 0o755},
		{Path: "bin/busybox", Mode: 0o755, Data: bin},
		{Path: "dev", Mode: fs.ModeDir | 0o755},
		{Path: "etc", Mode: fs.ModeDir | 0o755},
		{Path: "etc/group", Mode: 0o644, Data: []byte("root:x:0:\nnogroup:x:65534:\n")},
		{Path: "etc/passwd", Mode: 0o644, Data: []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")},
		{Path: "proc", Mode: fs.ModeDir | 0o555},
		{Path: "root", Mode: fs.ModeDir | 0o700},
		{Path: "run", Mode: fs.ModeDir | 0o755},
		{Path: "sys", Mode: fs.ModeDir | 0o555},
		{Path: "tmp", Mode: fs.ModeDir | fs.ModeSticky | 0o777},
	}
	applets := strings.Fields(string(list))
	if len(applets) == 0 {
		return nil, fmt.Errorf("ociimage: %s --list printed no applets", busybox)
	}
	for _, a := range applets {
		if a == "busybox" {
			continue
		}
		if strings.Contains(a, "/") || path.Clean(a) != a || a == ".." {
			return nil, fmt.Errorf("ociimage: %s --list: applet name %q is not a file name", busybox, a)
		}
		files = append(files, File{Path: "bin/" + a, Mode: fs.ModeSymlink | 0o777, Link: "busybox"})
	}
	return &Image{
		Name:  name,
		Files: files,
		Config: ocispec.ImageConfig{
			Env: []string{"PATH=" + DefaultPath},
			Cmd: []string{"sh"},
		},
	}, nil
}
