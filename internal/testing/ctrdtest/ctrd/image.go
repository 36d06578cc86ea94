package ctrd

import (
	"context"
	"path/filepath"

	"github.com/kvfs/kvfs/internal/ociimage"
)

// ImportBusybox imports the busybox test image (ociimage.Busybox, from Debian's
// busybox-static) into the containerd's namespace as ociimage.BusyboxName, unpacked for the
// default snapshotter, and returns that name.
func (c *Containerd) ImportBusybox() (string, error) {
	if c.image == "" {
		img, err := ociimage.Busybox(ociimage.BusyboxName, ociimage.BusyboxPath)
		if err != nil {
			return "", err
		}
		archive := filepath.Join(c.dir, "busybox.tar")
		if err := img.WriteFile(archive); err != nil {
			return "", err
		}
		c.image = archive
	}
	if _, err := c.Ctr(context.Background(), "images", "import", c.image); err != nil {
		return "", err
	}
	return ociimage.BusyboxName, nil
}
