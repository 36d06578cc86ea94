// Package fuseclient plays the guest kernel's FUSE layer: it encodes requests, sends them
// through a Transport (the FUSE server in-process, or a virtio-fs device behind the in-repo
// front-end) and decodes the replies. Tests, the differential suite and the benchmarks use it to
// speak to kvfsd and to the C virtiofsd alike.
package fuseclient

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// Transport delivers one request and returns the reply. queue is 0 for the high-priority queue
// (FORGET), 1 for the request queue; replyCap is the writable space offered (0: no reply).
type Transport interface {
	RoundTrip(ctx context.Context, queue int, req []byte, replyCap int) ([]byte, error)
}

// Client issues FUSE requests as the guest kernel would. Errors returned by the server come back
// as unix.Errno values; anything else is a transport or protocol failure.
type Client struct {
	t      Transport
	unique atomic.Uint64
	// UID, GID and PID are put in every request header.
	UID, GID, PID uint32
}

// New returns a client speaking through t.
func New(t Transport) *Client { return &Client{t: t} }

const (
	inHeaderSize  = int(unsafe.Sizeof(fuse.InHeader{}))
	outHeaderSize = int(unsafe.Sizeof(fuse.OutHeader{}))
	// DefaultReplyCap is the writable space offered for replies without data.
	DefaultReplyCap = 4096
)

// ErrProtocol marks a reply that does not follow the protocol.
var ErrProtocol = errors.New("fuse protocol violation")

// Encode builds the bytes of a request with a fresh unique.
func (c *Client) Encode(op fuse.Opcode, node uint64, args ...[]byte) []byte {
	n := inHeaderSize
	for _, a := range args {
		n += len(a)
	}
	h := fuse.InHeader{Len: uint32(n), Opcode: uint32(op), Unique: c.unique.Add(1), NodeID: node,
		UID: c.UID, GID: c.GID, PID: c.PID}
	b := make([]byte, 0, n)
	b = append(b, fuse.AsBytes(&h)...)
	for _, a := range args {
		b = append(b, a...)
	}
	return b
}

// Do sends an encoded request and returns the reply body, or the server's errno.
func (c *Client) Do(ctx context.Context, req []byte, replyCap int) ([]byte, error) {
	var h fuse.InHeader
	copy(fuse.AsBytes(&h), req)
	reply, err := c.t.RoundTrip(ctx, 1, req, replyCap)
	if err != nil {
		return nil, err
	}
	return checkReply(reply, h.Unique)
}

func checkReply(reply []byte, unique uint64) ([]byte, error) {
	if len(reply) < outHeaderSize {
		return nil, fmt.Errorf("%w: reply of %d bytes", ErrProtocol, len(reply))
	}
	var out fuse.OutHeader
	copy(fuse.AsBytes(&out), reply)
	if int(out.Len) != len(reply) {
		return nil, fmt.Errorf("%w: header length %d, %d bytes written", ErrProtocol, out.Len, len(reply))
	}
	if out.Unique != unique {
		return nil, fmt.Errorf("%w: reply unique %d for request %d", ErrProtocol, out.Unique, unique)
	}
	if out.Error > 0 {
		return nil, fmt.Errorf("%w: positive error %d", ErrProtocol, out.Error)
	}
	if out.Error != 0 {
		if len(reply) != outHeaderSize {
			return nil, fmt.Errorf("%w: error reply with a body", ErrProtocol)
		}
		return nil, unix.Errno(-out.Error)
	}
	return reply[outHeaderSize:], nil
}

// call sends op with args and decodes a fixed-size reply into out (nil: expect no body).
func call[T any](ctx context.Context, c *Client, op fuse.Opcode, node uint64, out *T, args ...[]byte) error {
	body, err := c.Do(ctx, c.Encode(op, node, args...), DefaultReplyCap)
	if err != nil {
		return err
	}
	return decode(body, out)
}

func decode[T any](body []byte, out *T) error {
	if out == nil {
		if len(body) != 0 {
			return fmt.Errorf("%w: unexpected %d-byte body", ErrProtocol, len(body))
		}
		return nil
	}
	b := fuse.AsBytes(out)
	if len(body) != len(b) {
		return fmt.Errorf("%w: body of %d bytes, want %d", ErrProtocol, len(body), len(b))
	}
	copy(b, body)
	return nil
}

func cstr(s string) []byte { return append([]byte(s), 0) }

// none is the nil reply type of calls that answer with a header only.
type none struct{}

var noBody *none

// Init negotiates the session, offering flags (as a Linux guest: see LinuxInitFlags).
func (c *Client) Init(ctx context.Context, flags uint64) (*fuse.InitOut, error) {
	in := fuse.InitIn{Major: fuse.KernelVersion, Minor: fuse.KernelMinorVersion,
		MaxReadahead: 128 << 10, Flags: uint32(flags) | fuse.InitInitExt, Flags2: uint32(flags >> 32)}
	var out fuse.InitOut
	return &out, call(ctx, c, fuse.OpInit, 0, &out, fuse.AsBytes(&in))
}

// LinuxInitFlags are the INIT flags a Linux 6.1 virtio-fs guest offers.
const LinuxInitFlags = fuse.InitAsyncRead | fuse.InitPosixLocks | fuse.InitAtomicOTrunc |
	fuse.InitExportSupport | fuse.InitBigWrites | fuse.InitDontMask | fuse.InitSpliceWrite |
	fuse.InitSpliceMove | fuse.InitSpliceRead | fuse.InitFlockLocks | fuse.InitHasIoctlDir |
	fuse.InitAutoInvalData | fuse.InitDoReaddirplus | fuse.InitReaddirplusAuto | fuse.InitAsyncDIO |
	fuse.InitWritebackCache | fuse.InitNoOpenSupport | fuse.InitParallelDirops |
	fuse.InitHandleKillpriv | fuse.InitPosixACL | fuse.InitAbortError | fuse.InitMaxPages |
	fuse.InitCacheSymlinks | fuse.InitNoOpendirSupport | fuse.InitExplicitInvalData |
	fuse.InitSubmounts | fuse.InitHandleKillprivV2 | fuse.InitSetxattrExt | fuse.InitInitExt |
	fuse.InitSecurityCtx | fuse.InitCreateSuppGroup

// Destroy ends the session.
func (c *Client) Destroy(ctx context.Context) error {
	return call(ctx, c, fuse.OpDestroy, 0, noBody)
}

// Lookup looks name up in parent.
func (c *Client) Lookup(ctx context.Context, parent uint64, name string) (*fuse.EntryOut, error) {
	var out fuse.EntryOut
	return &out, call(ctx, c, fuse.OpLookup, parent, &out, cstr(name))
}

// Forget drops n lookups of node, on the high-priority queue. It has no reply.
func (c *Client) Forget(ctx context.Context, node, n uint64) error {
	in := fuse.ForgetIn{Nlookup: n}
	_, err := c.t.RoundTrip(ctx, 0, c.Encode(fuse.OpForget, node, fuse.AsBytes(&in)), 0)
	return err
}

// BatchForget drops several lookups at once; it has no reply.
func (c *Client) BatchForget(ctx context.Context, items []fuse.ForgetOne) error {
	in := fuse.BatchForgetIn{Count: uint32(len(items))}
	args := [][]byte{fuse.AsBytes(&in)}
	for i := range items {
		args = append(args, fuse.AsBytes(&items[i]))
	}
	_, err := c.t.RoundTrip(ctx, 0, c.Encode(fuse.OpBatchForget, 0, args...), 0)
	return err
}

// Getattr returns node's attributes; fh is used when non-zero.
func (c *Client) Getattr(ctx context.Context, node, fh uint64) (*fuse.AttrOut, error) {
	in := fuse.GetattrIn{Fh: fh}
	if fh != 0 {
		in.Flags = fuse.GetattrFh
	}
	var out fuse.AttrOut
	return &out, call(ctx, c, fuse.OpGetattr, node, &out, fuse.AsBytes(&in))
}

// Setattr changes the attributes selected by in.Valid.
func (c *Client) Setattr(ctx context.Context, node uint64, in *fuse.SetattrIn) (*fuse.AttrOut, error) {
	var out fuse.AttrOut
	return &out, call(ctx, c, fuse.OpSetattr, node, &out, fuse.AsBytes(in))
}

// Readlink returns the target of a symlink.
func (c *Client) Readlink(ctx context.Context, node uint64) (string, error) {
	body, err := c.Do(ctx, c.Encode(fuse.OpReadlink, node), DefaultReplyCap+16)
	return string(body), err
}

// Symlink creates name in parent pointing at target.
func (c *Client) Symlink(ctx context.Context, parent uint64, name, target string) (*fuse.EntryOut, error) {
	var out fuse.EntryOut
	return &out, call(ctx, c, fuse.OpSymlink, parent, &out, cstr(name), cstr(target))
}

// Mknod creates a special file.
func (c *Client) Mknod(ctx context.Context, parent uint64, name string, mode, rdev uint32) (*fuse.EntryOut, error) {
	in := fuse.MknodIn{Mode: mode, Rdev: rdev}
	var out fuse.EntryOut
	return &out, call(ctx, c, fuse.OpMknod, parent, &out, fuse.AsBytes(&in), cstr(name))
}

// Mkdir creates a directory.
func (c *Client) Mkdir(ctx context.Context, parent uint64, name string, mode uint32) (*fuse.EntryOut, error) {
	in := fuse.MkdirIn{Mode: mode}
	var out fuse.EntryOut
	return &out, call(ctx, c, fuse.OpMkdir, parent, &out, fuse.AsBytes(&in), cstr(name))
}

// Unlink removes a file.
func (c *Client) Unlink(ctx context.Context, parent uint64, name string) error {
	return call(ctx, c, fuse.OpUnlink, parent, noBody, cstr(name))
}

// Rmdir removes a directory.
func (c *Client) Rmdir(ctx context.Context, parent uint64, name string) error {
	return call(ctx, c, fuse.OpRmdir, parent, noBody, cstr(name))
}

// Rename moves parent/name to newParent/newName (RENAME2 when flags are given).
func (c *Client) Rename(ctx context.Context, parent uint64, name string, newParent uint64, newName string, flags uint32) error {
	if flags == 0 {
		in := fuse.RenameIn{Newdir: newParent}
		return call(ctx, c, fuse.OpRename, parent, noBody, fuse.AsBytes(&in), cstr(name), cstr(newName))
	}
	in := fuse.Rename2In{Newdir: newParent, Flags: flags}
	return call(ctx, c, fuse.OpRename2, parent, noBody, fuse.AsBytes(&in), cstr(name), cstr(newName))
}

// Link makes newParent/newName another name of node.
func (c *Client) Link(ctx context.Context, node, newParent uint64, newName string) (*fuse.EntryOut, error) {
	in := fuse.LinkIn{Oldnodeid: node}
	var out fuse.EntryOut
	return &out, call(ctx, c, fuse.OpLink, newParent, &out, fuse.AsBytes(&in), cstr(newName))
}

// Open opens a file with open(2) flags.
func (c *Client) Open(ctx context.Context, node uint64, flags uint32) (*fuse.OpenOut, error) {
	in := fuse.OpenIn{Flags: flags}
	var out fuse.OpenOut
	return &out, call(ctx, c, fuse.OpOpen, node, &out, fuse.AsBytes(&in))
}

// Opendir opens a directory.
func (c *Client) Opendir(ctx context.Context, node uint64) (*fuse.OpenOut, error) {
	in := fuse.OpenIn{Flags: unix.O_RDONLY | unix.O_DIRECTORY}
	var out fuse.OpenOut
	return &out, call(ctx, c, fuse.OpOpendir, node, &out, fuse.AsBytes(&in))
}

// CreateOut is the reply of CREATE and TMPFILE.
type CreateOut struct {
	Entry fuse.EntryOut
	Open  fuse.OpenOut
}

// Create creates and opens name in parent.
func (c *Client) Create(ctx context.Context, parent uint64, name string, flags, mode uint32) (*CreateOut, error) {
	in := fuse.CreateIn{Flags: flags, Mode: mode}
	var out CreateOut
	return &out, call(ctx, c, fuse.OpCreate, parent, &out, fuse.AsBytes(&in), cstr(name))
}

// Tmpfile creates an unnamed file in parent.
func (c *Client) Tmpfile(ctx context.Context, parent uint64, flags, mode uint32) (*CreateOut, error) {
	in := fuse.CreateIn{Flags: flags, Mode: mode}
	var out CreateOut
	return &out, call(ctx, c, fuse.OpTmpfile, parent, &out, fuse.AsBytes(&in))
}

// Read reads up to size bytes at off.
func (c *Client) Read(ctx context.Context, node, fh, off uint64, size uint32) ([]byte, error) {
	in := fuse.ReadIn{Fh: fh, Offset: off, Size: size}
	return c.Do(ctx, c.Encode(fuse.OpRead, node, fuse.AsBytes(&in)), outHeaderSize+int(size))
}

// Write writes data at off and returns how many bytes the server took.
func (c *Client) Write(ctx context.Context, node, fh, off uint64, data []byte, flags uint32) (uint32, error) {
	in := fuse.WriteIn{Fh: fh, Offset: off, Size: uint32(len(data)), WriteFlags: flags}
	var out fuse.WriteOut
	err := call(ctx, c, fuse.OpWrite, node, &out, fuse.AsBytes(&in), data)
	return out.Size, err
}

// Statfs reports file-system statistics.
func (c *Client) Statfs(ctx context.Context, node uint64) (*fuse.StatfsOut, error) {
	var out fuse.StatfsOut
	return &out, call(ctx, c, fuse.OpStatfs, node, &out)
}

// Release closes a file handle.
func (c *Client) Release(ctx context.Context, node, fh uint64) error {
	in := fuse.ReleaseIn{Fh: fh}
	return call(ctx, c, fuse.OpRelease, node, noBody, fuse.AsBytes(&in))
}

// Releasedir closes a directory handle.
func (c *Client) Releasedir(ctx context.Context, node, fh uint64) error {
	in := fuse.ReleaseIn{Fh: fh}
	return call(ctx, c, fuse.OpReleasedir, node, noBody, fuse.AsBytes(&in))
}

// Flush is sent on every close(2) of a file.
func (c *Client) Flush(ctx context.Context, node, fh uint64) error {
	in := fuse.FlushIn{Fh: fh}
	return call(ctx, c, fuse.OpFlush, node, noBody, fuse.AsBytes(&in))
}

// Fsync flushes a file (data only with datasync).
func (c *Client) Fsync(ctx context.Context, node, fh uint64, datasync bool) error {
	in := fuse.FsyncIn{Fh: fh}
	if datasync {
		in.FsyncFlags = fuse.FsyncFdatasync
	}
	return call(ctx, c, fuse.OpFsync, node, noBody, fuse.AsBytes(&in))
}

// Fsyncdir flushes a directory.
func (c *Client) Fsyncdir(ctx context.Context, node, fh uint64) error {
	in := fuse.FsyncIn{Fh: fh}
	return call(ctx, c, fuse.OpFsyncdir, node, noBody, fuse.AsBytes(&in))
}

// Fallocate allocates or punches space.
func (c *Client) Fallocate(ctx context.Context, node, fh, off, length uint64, mode uint32) error {
	in := fuse.FallocateIn{Fh: fh, Offset: off, Length: length, Mode: mode}
	return call(ctx, c, fuse.OpFallocate, node, noBody, fuse.AsBytes(&in))
}

// Lseek finds data or holes (SEEK_DATA, SEEK_HOLE).
func (c *Client) Lseek(ctx context.Context, node, fh, off uint64, whence uint32) (uint64, error) {
	in := fuse.LseekIn{Fh: fh, Offset: off, Whence: whence}
	var out fuse.LseekOut
	err := call(ctx, c, fuse.OpLseek, node, &out, fuse.AsBytes(&in))
	return out.Offset, err
}

// CopyFileRange copies between two open files.
func (c *Client) CopyFileRange(ctx context.Context, in *fuse.CopyFileRangeIn, nodeIn uint64) (uint32, error) {
	var out fuse.WriteOut
	err := call(ctx, c, fuse.OpCopyFileRange, nodeIn, &out, fuse.AsBytes(in))
	return out.Size, err
}

// Syncfs flushes the file system holding node.
func (c *Client) Syncfs(ctx context.Context, node uint64) error {
	var in fuse.SyncfsIn
	return call(ctx, c, fuse.OpSyncfs, node, noBody, fuse.AsBytes(&in))
}

// Access checks permissions (mask of R_OK, W_OK, X_OK).
func (c *Client) Access(ctx context.Context, node uint64, mask uint32) error {
	in := fuse.AccessIn{Mask: mask}
	return call(ctx, c, fuse.OpAccess, node, noBody, fuse.AsBytes(&in))
}

// Setxattr sets an extended attribute.
func (c *Client) Setxattr(ctx context.Context, node uint64, name string, value []byte, flags uint32) error {
	in := fuse.SetxattrIn{Size: uint32(len(value)), Flags: flags}
	// Without SETXATTR_EXT negotiated only the first 8 bytes are sent.
	return call(ctx, c, fuse.OpSetxattr, node, noBody, fuse.AsBytes(&in)[:8], cstr(name), value)
}

// Getxattr returns a value; with size 0 it returns only the size (as a nil slice and n).
func (c *Client) Getxattr(ctx context.Context, node uint64, name string, size uint32) ([]byte, uint32, error) {
	in := fuse.GetxattrIn{Size: size}
	return c.xattr(ctx, fuse.OpGetxattr, node, size, fuse.AsBytes(&in), cstr(name))
}

// Listxattr lists names, NUL-separated; with size 0 only the size.
func (c *Client) Listxattr(ctx context.Context, node uint64, size uint32) ([]byte, uint32, error) {
	in := fuse.GetxattrIn{Size: size}
	return c.xattr(ctx, fuse.OpListxattr, node, size, fuse.AsBytes(&in))
}

func (c *Client) xattr(ctx context.Context, op fuse.Opcode, node uint64, size uint32, args ...[]byte) ([]byte, uint32, error) {
	body, err := c.Do(ctx, c.Encode(op, node, args...), outHeaderSize+max(int(size), 8))
	if err != nil {
		return nil, 0, err
	}
	if size == 0 {
		var out fuse.GetxattrOut
		if err := decode(body, &out); err != nil {
			return nil, 0, err
		}
		return nil, out.Size, nil
	}
	return body, uint32(len(body)), nil
}

// Removexattr removes an extended attribute.
func (c *Client) Removexattr(ctx context.Context, node uint64, name string) error {
	return call(ctx, c, fuse.OpRemovexattr, node, noBody, cstr(name))
}

// Getlk asks which lock would conflict with lk taken by owner through handle fh; the answer has
// type F_UNLCK when none would.
func (c *Client) Getlk(ctx context.Context, node, fh, owner uint64, lk fuse.FileLock) (*fuse.FileLock, error) {
	in := fuse.LkIn{Fh: fh, Owner: owner, Lk: lk}
	var out fuse.LkOut
	err := call(ctx, c, fuse.OpGetlk, node, &out, fuse.AsBytes(&in))
	return &out.Lk, err
}

// Setlk takes, changes or releases (F_UNLCK) lk for owner through handle fh; flags is
// fuse.LkFlock for a flock(2) lock. With wait it sends SETLKW, whose reply comes only once the
// lock is taken (or the wait is interrupted).
func (c *Client) Setlk(ctx context.Context, node, fh, owner uint64, lk fuse.FileLock, flags uint32, wait bool) error {
	req, _ := c.EncodeSetlk(node, fh, owner, lk, flags, wait)
	body, err := c.Do(ctx, req, DefaultReplyCap)
	if err != nil {
		return err
	}
	return decode(body, noBody)
}

// EncodeSetlk builds the request Setlk sends, without sending it, and returns its unique: a
// caller that wants to interrupt a SETLKW sends it with Do and names it to Interrupt.
func (c *Client) EncodeSetlk(node, fh, owner uint64, lk fuse.FileLock, flags uint32, wait bool) ([]byte, uint64) {
	in := fuse.LkIn{Fh: fh, Owner: owner, Lk: lk, LkFlags: flags}
	op := fuse.OpSetlk
	if wait {
		op = fuse.OpSetlkw
	}
	req := c.Encode(op, node, fuse.AsBytes(&in))
	var h fuse.InHeader
	copy(fuse.AsBytes(&h), req)
	return req, h.Unique
}

// Interrupt asks the server to interrupt request unique. It goes on the high-priority queue and
// has no reply: the interrupted request's own reply (EINTR) answers it.
func (c *Client) Interrupt(ctx context.Context, unique uint64) error {
	in := fuse.InterruptIn{Unique: unique}
	_, err := c.t.RoundTrip(ctx, 0, c.Encode(fuse.OpInterrupt, 0, fuse.AsBytes(&in)), 0)
	return err
}

// DAXInitFlags are the INIT flags a Linux guest adds when its device has a DAX window:
// MAP_ALIGNMENT, and HAS_INODE_DAX in its dax=inode modes (the default).
const DAXInitFlags = fuse.InitMapAlignment | fuse.InitHasInodeDAX

// SetupMapping asks for length bytes of node's file at foffset to be mapped at moffset of the
// DAX window; flags are fuse.SetupmappingFlagRead and fuse.SetupmappingFlagWrite. Linux sends
// fh = fuse.SetupmappingNoFh and 2 MiB ranges.
func (c *Client) SetupMapping(ctx context.Context, node, fh, foffset, length, flags, moffset uint64) error {
	in := fuse.SetupmappingIn{Fh: fh, Foffset: foffset, Len: length, Flags: flags, Moffset: moffset}
	return call(ctx, c, fuse.OpSetupmapping, node, noBody, fuse.AsBytes(&in))
}

// RemoveMapping drops ranges of the DAX window, as Linux sends it: the count, then the
// entries (node is the inode the ranges belonged to; the server ignores it).
func (c *Client) RemoveMapping(ctx context.Context, node uint64, ranges []fuse.RemovemappingOne) error {
	in := fuse.RemovemappingIn{Count: uint32(len(ranges))}
	args := [][]byte{fuse.AsBytes(&in)}
	for i := range ranges {
		args = append(args, fuse.AsBytes(&ranges[i]))
	}
	return call(ctx, c, fuse.OpRemovemapping, node, noBody, args...)
}
