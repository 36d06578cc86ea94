package fuse

import "unsafe"

const (
	direntSize     = int(unsafe.Sizeof(Dirent{}))
	direntPlusSize = int(unsafe.Sizeof(DirentPlus{}))
)

// DirList builds the reply of READDIR or READDIRPLUS in a buffer no larger than the guest asked
// for.
type DirList struct {
	buf  []byte
	max  int
	plus bool
}

// NewDirList starts a listing of at most max bytes, reusing buf's storage.
func NewDirList(buf []byte, max int, plus bool) *DirList {
	return &DirList{buf: buf[:0], max: max, plus: plus}
}

// Plus reports whether entries carry an EntryOut (READDIRPLUS).
func (d *DirList) Plus() bool { return d.plus }

// Len is the number of bytes listed so far.
func (d *DirList) Len() int { return len(d.buf) }

func (d *DirList) entrySize(nameLen int) int {
	fixed := direntSize
	if d.plus {
		fixed = direntPlusSize
	}
	return (fixed + nameLen + 7) &^ 7
}

// Fits reports whether an entry with a name of nameLen bytes still fits. With READDIRPLUS call
// it before taking the lookup reference that Add hands to the guest.
func (d *DirList) Fits(nameLen int) bool {
	return len(d.buf)+d.entrySize(nameLen) <= d.max
}

// Add appends an entry: its name, inode number, DT_* type and the cookie (offset) of the entry
// after it. entry is the lookup answer for READDIRPLUS (nil or zero for "." and ".."), ignored
// for READDIR. It reports false, adding nothing, when the entry does not fit.
func (d *DirList) Add(name string, ino uint64, typ uint32, off uint64, entry *EntryOut) bool {
	size := d.entrySize(len(name))
	if len(d.buf)+size > d.max {
		return false
	}
	start := len(d.buf)
	d.buf = append(d.buf, make([]byte, size)...)
	p := d.buf[start:]
	if d.plus {
		var dp DirentPlus
		if entry != nil {
			dp.Entry = *entry
		}
		dp.Dirent = Dirent{Ino: ino, Off: off, Namelen: uint32(len(name)), Type: typ}
		copy(p, AsBytes(&dp))
		copy(p[direntPlusSize:], name)
	} else {
		de := Dirent{Ino: ino, Off: off, Namelen: uint32(len(name)), Type: typ}
		copy(p, AsBytes(&de))
		copy(p[direntSize:], name)
	}
	return true
}

// bytes returns what was listed.
func (d *DirList) bytes() []byte { return d.buf }
