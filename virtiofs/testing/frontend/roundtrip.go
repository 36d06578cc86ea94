package frontend

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvfs/kvfs/virtiofs/virtq"
)

// Sizes of the FUSE headers, which the Linux driver puts in buffers of their own.
const (
	fuseInHeaderSize  = 40
	fuseOutHeaderSize = 16
)

// RoundTrip sends one FUSE request on queue q and returns the reply, laid out in guest memory
// as Linux's virtio-fs driver lays it out: the request header, then the arguments, in separate
// readable buffers; the reply header, then room for the rest (replyCap bytes in all), in
// separate writable buffers. With replyCap 0 there is no writable part (FORGET on hiprio).
// It implements fuseclient.Transport.
func (f *Frontend) RoundTrip(ctx context.Context, q int, req []byte, replyCap int) ([]byte, error) {
	if replyCap < 0 || replyCap > 0 && replyCap < fuseOutHeaderSize {
		return nil, fmt.Errorf("frontend: reply capacity %d", replyCap)
	}
	size := uint64(len(req) + replyCap)
	gpa, buf := f.Alloc(size)
	if buf == nil {
		return nil, errors.New("frontend: guest memory exhausted")
	}
	defer f.Free(gpa)
	copy(buf, req)
	readable := splitBuf(nil, gpa, len(req), fuseInHeaderSize)
	writable := splitBuf(nil, gpa+uint64(len(req)), replyCap, fuseOutHeaderSize)
	n, err := f.Submit(ctx, q, readable, writable)
	if err != nil {
		return nil, err
	}
	if int(n) > replyCap {
		return nil, fmt.Errorf("frontend: device claims %d bytes written into %d", n, replyCap)
	}
	return append([]byte(nil), buf[len(req):len(req)+int(n)]...), nil
}

// splitBuf appends the buffers for n bytes at gpa: the first head bytes, then the rest.
func splitBuf(dst []virtq.Buf, gpa uint64, n, head int) []virtq.Buf {
	if n == 0 {
		return dst
	}
	if n <= head {
		return append(dst, virtq.Buf{Addr: gpa, Len: uint32(n)})
	}
	return append(dst, virtq.Buf{Addr: gpa, Len: uint32(head)},
		virtq.Buf{Addr: gpa + uint64(head), Len: uint32(n - head)})
}
