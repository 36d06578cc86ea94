// Package fusecheck checks that a FUSE server's reply to a request is well formed, whatever the
// request was: the fuzz targets of packages virtiofs/fuse and virtiofs/passthrough share it.
package fusecheck

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/fuse"
)

// Reply checks out[:n], what a server wrote into out in answer to req: nothing for a request
// without a whole header, for less room than a reply header, and for a well-formed FORGET,
// BATCH_FORGET or INTERRUPT; otherwise a header whose length is n, whose unique is the
// request's, and whose error is 0 or a negative errno that errnoOK accepts, with no body after
// an error. It returns the reply's body when the request succeeded (nil for no reply or an
// error).
func Reply(req, out []byte, n int, errnoOK func(unix.Errno) bool) ([]byte, error) {
	if n < 0 || n > len(out) {
		return nil, fmt.Errorf("wrote %d into %d bytes", n, len(out))
	}
	var in fuse.InHeader
	if len(req) < len(fuse.AsBytes(&in)) {
		if n != 0 {
			return nil, fmt.Errorf("a %d-byte request (no header) got a %d-byte reply", len(req), n)
		}
		return nil, nil
	}
	copy(fuse.AsBytes(&in), req)
	op := fuse.Opcode(in.Opcode)
	valid := int(in.Len) >= 40 && int(in.Len) <= len(req) && int(in.Len)-int(in.TotalExtlen)*8 >= 40
	switch {
	case len(out) < 16:
		if n != 0 {
			return nil, fmt.Errorf("%v: %d-byte reply into %d bytes of room", op, n, len(out))
		}
		return nil, nil
	case valid && (op == fuse.OpForget || op == fuse.OpBatchForget || op == fuse.OpInterrupt):
		if n != 0 {
			return nil, fmt.Errorf("%v has no reply, got %d bytes", op, n)
		}
		return nil, nil
	case n < 16:
		return nil, fmt.Errorf("%v: %d-byte reply with %d bytes of room", op, n, len(out))
	}
	var h fuse.OutHeader
	copy(fuse.AsBytes(&h), out)
	switch {
	case int(h.Len) != n:
		return nil, fmt.Errorf("%v: reply header says %d bytes, %d written", op, h.Len, n)
	case h.Unique != in.Unique:
		return nil, fmt.Errorf("%v: reply to unique %d for request %d", op, h.Unique, in.Unique)
	case h.Error > 0:
		return nil, fmt.Errorf("%v: positive error %d", op, h.Error)
	case h.Error < 0 && !errnoOK(unix.Errno(-h.Error)):
		return nil, fmt.Errorf("%v: error %d is none the server answers", op, h.Error)
	case h.Error < 0 && n != 16:
		return nil, fmt.Errorf("%v: error %d with a %d-byte body", op, h.Error, n-16)
	case h.Error < 0:
		return nil, nil
	}
	return out[16:n], nil
}
