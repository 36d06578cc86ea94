package fuseclient

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
)

// DirEntry is one decoded READDIR or READDIRPLUS entry.
type DirEntry struct {
	Name string
	Ino  uint64
	Off  uint64
	Type uint32
	// Entry is the lookup answer of READDIRPLUS (zero for "." and "..", and for READDIR).
	Entry fuse.EntryOut
}

// Readdir lists entries of an open directory after cookie off, in a reply of at most size
// bytes.
func (c *Client) Readdir(ctx context.Context, node, fh, off uint64, size uint32, plus bool) ([]DirEntry, error) {
	op := fuse.OpReaddir
	if plus {
		op = fuse.OpReaddirplus
	}
	in := fuse.ReadIn{Fh: fh, Offset: off, Size: size}
	body, err := c.Do(ctx, c.Encode(op, node, fuse.AsBytes(&in)), outHeaderSize+int(size))
	if err != nil {
		return nil, err
	}
	return ParseDirents(body, plus)
}

// ParseDirents decodes a READDIR or READDIRPLUS reply body.
func ParseDirents(b []byte, plus bool) ([]DirEntry, error) {
	var out []DirEntry
	for len(b) > 0 {
		var e DirEntry
		var d fuse.Dirent
		fixed := int(unsafe.Sizeof(d))
		if plus {
			var dp fuse.DirentPlus
			fixed = int(unsafe.Sizeof(dp))
			if len(b) < fixed {
				return nil, fmt.Errorf("%w: truncated direntplus", ErrProtocol)
			}
			copy(fuse.AsBytes(&dp), b)
			d, e.Entry = dp.Dirent, dp.Entry
		} else {
			if len(b) < fixed {
				return nil, fmt.Errorf("%w: truncated dirent", ErrProtocol)
			}
			copy(fuse.AsBytes(&d), b)
		}
		size := (fixed + int(d.Namelen) + 7) &^ 7
		if d.Namelen == 0 || d.Namelen > 255 || size > len(b) {
			return nil, fmt.Errorf("%w: bad dirent name length %d", ErrProtocol, d.Namelen)
		}
		e.Name = string(b[fixed : fixed+int(d.Namelen)])
		e.Ino, e.Off, e.Type = d.Ino, d.Off, d.Type
		out = append(out, e)
		b = b[size:]
	}
	return out, nil
}
