package fuse

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"
)

// wireTypes pairs each Go wire struct with its kernel name and the size the kernel's
// <linux/fuse.h> (protocol 7.38) gives it.
var wireTypes = []struct {
	c    string
	size uintptr
	got  uintptr
}{
	{"fuse_in_header", 40, unsafe.Sizeof(InHeader{})},
	{"fuse_out_header", 16, unsafe.Sizeof(OutHeader{})},
	{"fuse_attr", 88, unsafe.Sizeof(Attr{})},
	{"fuse_entry_out", 128, unsafe.Sizeof(EntryOut{})},
	{"fuse_attr_out", 104, unsafe.Sizeof(AttrOut{})},
	{"fuse_init_in", 64, unsafe.Sizeof(InitIn{})},
	{"fuse_init_out", 64, unsafe.Sizeof(InitOut{})},
	{"fuse_getattr_in", 16, unsafe.Sizeof(GetattrIn{})},
	{"fuse_setattr_in", 88, unsafe.Sizeof(SetattrIn{})},
	{"fuse_mknod_in", 16, unsafe.Sizeof(MknodIn{})},
	{"fuse_mkdir_in", 8, unsafe.Sizeof(MkdirIn{})},
	{"fuse_rename_in", 8, unsafe.Sizeof(RenameIn{})},
	{"fuse_rename2_in", 16, unsafe.Sizeof(Rename2In{})},
	{"fuse_link_in", 8, unsafe.Sizeof(LinkIn{})},
	{"fuse_open_in", 8, unsafe.Sizeof(OpenIn{})},
	{"fuse_open_out", 16, unsafe.Sizeof(OpenOut{})},
	{"fuse_create_in", 16, unsafe.Sizeof(CreateIn{})},
	{"fuse_release_in", 24, unsafe.Sizeof(ReleaseIn{})},
	{"fuse_flush_in", 24, unsafe.Sizeof(FlushIn{})},
	{"fuse_read_in", 40, unsafe.Sizeof(ReadIn{})},
	{"fuse_write_in", 40, unsafe.Sizeof(WriteIn{})},
	{"fuse_write_out", 8, unsafe.Sizeof(WriteOut{})},
	{"fuse_statfs_out", 80, unsafe.Sizeof(StatfsOut{})},
	{"fuse_fsync_in", 16, unsafe.Sizeof(FsyncIn{})},
	{"fuse_setxattr_in", 16, unsafe.Sizeof(SetxattrIn{})},
	{"fuse_getxattr_in", 8, unsafe.Sizeof(GetxattrIn{})},
	{"fuse_getxattr_out", 8, unsafe.Sizeof(GetxattrOut{})},
	{"fuse_access_in", 8, unsafe.Sizeof(AccessIn{})},
	{"fuse_forget_in", 8, unsafe.Sizeof(ForgetIn{})},
	{"fuse_batch_forget_in", 8, unsafe.Sizeof(BatchForgetIn{})},
	{"fuse_forget_one", 16, unsafe.Sizeof(ForgetOne{})},
	{"fuse_fallocate_in", 32, unsafe.Sizeof(FallocateIn{})},
	{"fuse_lseek_in", 24, unsafe.Sizeof(LseekIn{})},
	{"fuse_lseek_out", 8, unsafe.Sizeof(LseekOut{})},
	{"fuse_copy_file_range_in", 56, unsafe.Sizeof(CopyFileRangeIn{})},
	{"fuse_syncfs_in", 8, unsafe.Sizeof(SyncfsIn{})},
	{"fuse_interrupt_in", 8, unsafe.Sizeof(InterruptIn{})},
	{"fuse_file_lock", 24, unsafe.Sizeof(FileLock{})},
	{"fuse_lk_in", 48, unsafe.Sizeof(LkIn{})},
	{"fuse_lk_out", 24, unsafe.Sizeof(LkOut{})},
	{"fuse_dirent", 24, unsafe.Sizeof(Dirent{})},
	{"fuse_direntplus", 152, unsafe.Sizeof(DirentPlus{})},
}

func TestWireSizes(t *testing.T) {
	for _, w := range wireTypes {
		if w.got != w.size {
			t.Errorf("struct %s: Go size %d, kernel size %d", w.c, w.got, w.size)
		}
	}
	if initInCompatSize != 16 || setxattrInCompatSize != 8 {
		t.Errorf("compat sizes: init_in %d, setxattr_in %d", initInCompatSize, setxattrInCompatSize)
	}
}

// TestWireSizesAgainstKernelHeader compiles a program against the installed <linux/fuse.h> and
// compares every size with it, so the table above cannot drift from the kernel.
func TestWireSizesAgainstKernelHeader(t *testing.T) {
	const header = "/usr/include/linux/fuse.h"
	if _, err := os.Stat(header); err != nil {
		t.Skipf("kernel header not installed (%v): the size table above is still checked", err)
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler (%v): the size table above is still checked", err)
	}
	var src strings.Builder
	src.WriteString("#include <stdio.h>\n#include <linux/fuse.h>\nint main(void){\n")
	for _, w := range wireTypes {
		src.WriteString("printf(\"" + w.c + " %zu\\n\", sizeof(struct " + w.c + "));\n")
	}
	src.WriteString("printf(\"FUSE_KERNEL_MINOR_VERSION %d\\n\", FUSE_KERNEL_MINOR_VERSION);\nreturn 0;}\n")
	dir := t.TempDir()
	c, bin := filepath.Join(dir, "sizes.c"), filepath.Join(dir, "sizes")
	if err := os.WriteFile(c, []byte(src.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(cc, "-o", bin, c).CombinedOutput(); err != nil {
		t.Fatalf("compiling: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	kernel := map[string]uint64{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		n, _ := strconv.ParseUint(f[1], 10, 64)
		kernel[f[0]] = n
	}
	if kernel["FUSE_KERNEL_MINOR_VERSION"] < KernelMinorVersion {
		t.Skipf("installed header speaks 7.%d, older than ours", kernel["FUSE_KERNEL_MINOR_VERSION"])
	}
	for _, w := range wireTypes {
		if uint64(w.got) != kernel[w.c] {
			t.Errorf("struct %s: Go size %d, <linux/fuse.h> says %d", w.c, w.got, kernel[w.c])
		}
	}
}
