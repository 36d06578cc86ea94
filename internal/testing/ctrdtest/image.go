package ctrdtest

import (
	"path/filepath"
	"testing"

	"github.com/kvfs/kvfs/internal/ociimage"
)

// ImportBusybox imports the busybox test image (ociimage.Busybox, from Debian's
// busybox-static) into c's namespace as ociimage.BusyboxName, unpacked for the default
// snapshotter, and returns that name.
func ImportBusybox(t testing.TB, c *Containerd) string {
	t.Helper()
	if c.image == "" {
		img, err := ociimage.Busybox(ociimage.BusyboxName, ociimage.BusyboxPath)
		if err != nil {
			t.Fatal(err)
		}
		archive := filepath.Join(c.dir, "busybox.tar")
		if err := img.WriteFile(archive); err != nil {
			t.Fatal(err)
		}
		c.image = archive
	}
	c.Ctr(t, "images", "import", c.image)
	return ociimage.BusyboxName
}
