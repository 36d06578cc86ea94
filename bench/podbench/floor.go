package podbench

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kvfs/kvfs/sandbox"
)

// floorInit is the trivial /init of the floor boot: it powers the VM off as soon as the
// kernel has started it.
const floorInit = "#!/bin/busybox sh\n/bin/busybox poweroff -f\n"

// floorMark is what the floor's console must not lack: the kernel ran /init (a kernel that
// panics also ends QEMU, under -no-reboot and panic=-1).
const floorMark = "reboot: Power down"

// writeFloorInitrd writes a gzipped newc archive holding floorInit and the host's static
// busybox (busybox-static, which scripts/deps.sh installs) to path.
func writeFloorInitrd(path string) error {
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return fmt.Errorf("the floor's /init needs the host's static busybox: %w", err)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	zw := gzip.NewWriter(f)
	entries := []struct {
		name string
		mode uint32
		data []byte
	}{
		{"bin", 0o040755, nil},
		{"bin/busybox", 0o100755, bb},
		{"dev", 0o040755, nil},
		{"init", 0o100755, []byte(floorInit)},
		{"TRAILER!!!", 0, nil},
	}
	for i, e := range entries {
		if err := writeNewc(zw, i+1, e.name, e.mode, e.data); err != nil {
			f.Close()
			return err
		}
	}
	return errors.Join(zw.Close(), f.Close())
}

// writeNewc writes one entry of a cpio archive in the newc format the kernel unpacks: a
// header of hexadecimal fields, the name and the data, each padded to 4 bytes.
func writeNewc(w io.Writer, ino int, name string, mode uint32, data []byte) error {
	nlink := 1
	if mode&0o040000 != 0 {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
	rec := []byte(hdr + name + "\x00")
	rec = append(rec, make([]byte, (4-len(rec)%4)%4)...)
	rec = append(rec, data...)
	rec = append(rec, make([]byte, (4-len(data)%4)%4)...)
	_, err := w.Write(rec)
	return err
}

// floorBoot boots kernel in cfg's QEMU as the kvfs shim's VM is booted (the default machine and
// CPU, cfg's memory and vCPUs, the guest's RAM a shared memfd, the same kernel command line) with
// initrd, whose /init powers off at once, and answers QEMU's wall time: what no pod start with
// that QEMU and kernel can go under. The console is kept in dir.
func floorBoot(ctx context.Context, cfg Config, accel, kernel, initrd, dir string) (time.Duration, error) {
	vm := sandbox.DefaultConfig().VM
	console := filepath.Join(dir, "floor-console.log")
	args := []string{"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-machine", vm.Machine + ",accel=" + accel, "-cpu", vm.CPU, "-smp", fmt.Sprint(cfg.VCPUs), "-m", cfg.Memory,
		"-object", "memory-backend-memfd,id=mem,size=" + cfg.Memory + ",share=on", "-numa", "node,memdev=mem",
		"-kernel", kernel, "-initrd", initrd, "-append", "console=ttyS0 quiet panic=-1",
		"-serial", "file:" + console}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, cfg.QEMU, args...).CombinedOutput()
	took := time.Since(start)
	if err != nil {
		return 0, fmt.Errorf("the floor boot: %v: %s", err, out)
	}
	log, err := os.ReadFile(console)
	if err != nil {
		return 0, err
	}
	if !strings.Contains(string(log), floorMark) {
		return 0, fmt.Errorf("the floor boot did not power off from /init; its console:\n%s", log)
	}
	return took, nil
}
