package serverbench

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Names in the shared directory.
const (
	filesDir = "files"
	heldDir  = "held" // the relookup workload's files, apart so that no other workload meets their nodes
	dataFile = "data"
)

// share is the shared directory every target works on.
type share struct {
	dir      string
	fsType   string
	names    []string // of the files in files/
	held     []string // of the heldFiles files in held/
	dataSize int64
}

func makeShare(dir string, nFiles int, dataSize int64) (*share, error) {
	sh := &share{dir: dir, dataSize: dataSize, fsType: fsTypeName(dir)}
	if err := os.Mkdir(filepath.Join(dir, filesDir), 0o755); err != nil {
		return nil, err
	}
	width := len(strconv.Itoa(nFiles - 1))
	for i := range nFiles {
		name := fmt.Sprintf("f%0*d", width, i)
		if err := unix.Mknod(filepath.Join(dir, filesDir, name), unix.S_IFREG|0o644, 0); err != nil {
			return nil, err
		}
		sh.names = append(sh.names, name)
	}
	if err := os.Mkdir(filepath.Join(dir, heldDir), 0o755); err != nil {
		return nil, err
	}
	for i := range heldFiles {
		name := fmt.Sprintf("h%03d", i)
		if err := unix.Mknod(filepath.Join(dir, heldDir, name), unix.S_IFREG|0o644, 0); err != nil {
			return nil, err
		}
		sh.held = append(sh.held, name)
	}
	f, err := os.Create(filepath.Join(dir, dataFile))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	chunk := make([]byte, 1<<20)
	for off := int64(0); off < dataSize; off += int64(len(chunk)) {
		for i := 0; i < len(chunk); i += 8 {
			v := rng.Uint64()
			for j := range 8 {
				chunk[i+j] = byte(v >> (8 * j))
			}
		}
		if _, err := f.Write(chunk[:min(int64(len(chunk)), dataSize-off)]); err != nil {
			return nil, err
		}
	}
	return sh, f.Close()
}

func fsTypeName(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "unknown"
	}
	switch st.Type {
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlayfs"
	}
	return fmt.Sprintf("type %#x", st.Type)
}

// defaultDir is tmpfs when there is one, so the numbers measure the servers and not a disk.
func defaultDir() string {
	if fsTypeName("/dev/shm") == "tmpfs" {
		return "/dev/shm"
	}
	return os.TempDir()
}
