package fuse

import (
	"bytes"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// handler serves one opcode: it decodes r.args, calls the file system and leaves the reply body
// in r.body (or r.direct).
type handler func(s *Server, r *request) Errno

// handlers is the dispatch table; opcodes without an entry answer ENOSYS. The lock opcodes
// (GETLK, SETLK, SETLKW) answer ENOSYS too unless the guest negotiated the kind of lock they
// are about (InitPosixLocks, InitFlockLocks), which happens only if Options.InitFlags offered
// it: by default locks stay local to the guest kernel and it never sends them. SETUPMAPPING
// and REMOVEMAPPING answer ENOSYS unless DAX was negotiated (see dax.go).
var handlers = [opcodeLimit]handler{
	OpInit:          doInit,
	OpDestroy:       doDestroy,
	OpLookup:        doLookup,
	OpForget:        doForget,
	OpBatchForget:   doBatchForget,
	OpGetattr:       doGetattr,
	OpSetattr:       inOut(FileSystem.SetAttr),
	OpReadlink:      doReadlink,
	OpSymlink:       doSymlink,
	OpMknod:         doMknod,
	OpMkdir:         doMkdir,
	OpUnlink:        doUnlink,
	OpRmdir:         doRmdir,
	OpRename:        doRename,
	OpRename2:       doRename2,
	OpLink:          doLink,
	OpOpen:          inOut(FileSystem.Open),
	OpRead:          doRead,
	OpWrite:         doWrite,
	OpStatfs:        outOnly(FileSystem.StatFs),
	OpRelease:       inOnly(FileSystem.Release),
	OpFsync:         inOnly(FileSystem.Fsync),
	OpFlush:         inOnly(FileSystem.Flush),
	OpOpendir:       inOut(FileSystem.OpenDir),
	OpReaddir:       doReaddir,
	OpReaddirplus:   doReaddir,
	OpReleasedir:    inOnly(FileSystem.ReleaseDir),
	OpFsyncdir:      inOnly(FileSystem.FsyncDir),
	OpCreate:        doCreate,
	OpFallocate:     inOnly(FileSystem.Fallocate),
	OpLseek:         inOut(FileSystem.Lseek),
	OpCopyFileRange: inOut(FileSystem.CopyFileRange),
	OpSyncfs:        doSyncfs,
	OpAccess:        doAccess,
	OpTmpfile:       doTmpfile,
	OpSetxattr:      doSetxattr,
	OpGetxattr:      doGetxattr,
	OpListxattr:     doListxattr,
	OpRemovexattr:   doRemovexattr,
	OpInterrupt:     doInterrupt,
	OpGetlk:         doGetlk,
	OpSetlk:         doSetlk,
	OpSetlkw:        doSetlk,
	OpSetupmapping:  doSetupmapping,
	OpRemovemapping: doRemovemapping,
}

// inOnly is the handler of an operation that takes one argument struct and answers with the
// header alone.
func inOnly[In any](op func(FileSystem, *Context, uint64, *In) Errno) handler {
	return func(s *Server, r *request) Errno {
		in := scratchIn[In](r)
		if !arg(r, in) {
			return unix.EINVAL
		}
		return op(s.fs, &r.Context, r.NodeID, in)
	}
}

// inOut is the handler of an operation that takes one argument struct and answers with one.
func inOut[In, Out any](op func(FileSystem, *Context, uint64, *In, *Out) Errno) handler {
	return func(s *Server, r *request) Errno {
		in := scratchIn[In](r)
		if !arg(r, in) {
			return unix.EINVAL
		}
		out := scratchOut[Out](r)
		if e := op(s.fs, &r.Context, r.NodeID, in, out); e != OK {
			return e
		}
		setBody(r, out)
		return OK
	}
}

// outOnly is the handler of an operation without arguments that answers with one struct.
func outOnly[Out any](op func(FileSystem, *Context, uint64, *Out) Errno) handler {
	return func(s *Server, r *request) Errno {
		out := scratchOut[Out](r)
		if e := op(s.fs, &r.Context, r.NodeID, out); e != OK {
			return e
		}
		setBody(r, out)
		return OK
	}
}

// scratchSize is the room for one argument or reply struct in a request's scratch space.
const scratchSize = 256

// scratchIn and scratchOut return a zeroed T in r's scratch space for an argument and a reply
// struct (a new one if T does not fit). Only wire structs, which hold no pointers, may live
// there: the scratch space is not scanned for pointers. The handler's use ends with the request.
func scratchIn[T any](r *request) *T  { return scratchAt[T](&r.scratch.in) }
func scratchOut[T any](r *request) *T { return scratchAt[T](&r.scratch.out) }

func scratchAt[T any](s *[scratchSize / 8]uint64) *T {
	var zero T
	if unsafe.Sizeof(zero) > unsafe.Sizeof(*s) || unsafe.Alignof(zero) > unsafe.Alignof(*s) {
		return new(T)
	}
	p := (*T)(unsafe.Pointer(s))
	*p = zero
	return p
}

// arg copies the next fixed-size argument out of r.args.
func arg[T any](r *request, v *T) bool {
	b := AsBytes(v)
	if len(r.args) < len(b) {
		return false
	}
	copy(b, r.args)
	r.args = r.args[len(b):]
	return true
}

// strErrs are what Linux answers for a string argument it cannot use: an empty one, one
// longer than its limit.
type strErrs struct{ empty, tooLong Errno }

var (
	// A file name or a symlink target: the path walk's ENOENT and ENAMETOOLONG.
	pathErrs = strErrs{empty: unix.ENOENT, tooLong: unix.ENAMETOOLONG}
	// An extended attribute name: ERANGE for both (XATTR_NAME_MAX).
	xattrNameErrs = strErrs{empty: unix.ERANGE, tooLong: unix.ERANGE}
)

// cstring takes the next NUL-terminated string of at most max bytes from r.args. A string
// without a terminator is a malformed request: EINVAL. The string is not copied: it is in r's
// argument buffer, the server's own copy of the request (the guest cannot change it), and so is
// valid only until the request is answered, as FileSystem says of every name.
func (r *request) cstring(max int, errs strErrs) (string, Errno) {
	i := bytes.IndexByte(r.args, 0)
	switch {
	case i < 0:
		return "", unix.EINVAL
	case i == 0:
		return "", errs.empty
	case i > max:
		return "", errs.tooLong
	}
	s := unsafe.String(&r.args[0], i)
	r.args = r.args[i+1:]
	return s, OK
}

// name takes the next file name: a NUL-terminated component of 1 to NAME_MAX bytes without
// '/'. A '/' cannot be in a name Linux sends; virtiofsd answers it with EINVAL, and so do we.
func (r *request) name() (string, Errno) {
	s, e := r.cstring(maxNameLen, pathErrs)
	if e == OK && strings.IndexByte(s, '/') >= 0 {
		return "", unix.EINVAL
	}
	return s, e
}

// setBody makes v the reply body.
func setBody[T any](r *request, v *T) {
	r.body = append(r.bodyBuf[:0], AsBytes(v)...)
	r.bodyBuf = r.body
}

// outSpace is how many body bytes the writable buffers can take.
func (r *request) outSpace() int { return max(r.outCap-outHeaderSize, 0) }

func doInit(s *Server, r *request) Errno {
	var in InitIn
	b := AsBytes(&in)
	if len(r.args) < initInCompatSize {
		return unix.EINVAL
	}
	copy(b, r.args) // 16 bytes from older guests, 64 from 7.36+
	out := InitOut{Major: KernelVersion, Minor: KernelMinorVersion}
	if in.Major < KernelVersion {
		return unix.EPROTO
	}
	if in.Major > KernelVersion {
		// The guest retries with our major; answer only the version.
		setBody(r, &out)
		r.body = r.body[:8]
		return OK
	}
	if in.Minor < MinKernelMinorVersion {
		return unix.EPROTO
	}
	kernel := uint64(in.Flags)
	if in.Flags&InitInitExt != 0 && len(r.args) >= int(unsafe.Sizeof(in)) {
		kernel |= uint64(in.Flags2) << 32
	}
	granted := kernel & s.flags &^ (InitMapAlignment | InitHasInodeDAX)
	daxFlags, mapAlign := s.daxInit(kernel)
	granted |= daxFlags

	s.initMu.Lock()
	defer s.initMu.Unlock()
	if s.inited.Load() {
		// A second INIT comes from a rebooted guest: forget the old session.
		s.CancelWaiting()
		s.fs.Destroy()
	}
	s.fs.Init(granted)
	s.mapAlign.Store(uint32(mapAlign))
	s.granted.Store(granted)
	s.inited.Store(true)

	out.MaxReadahead = in.MaxReadahead
	out.Flags = uint32(granted)
	out.Flags2 = uint32(granted >> 32)
	out.MaxBackground = 1<<16 - 1
	out.CongestionThreshold = (1<<16 - 1) * 3 / 4
	out.MaxWrite = MaxWrite
	out.TimeGran = 1
	out.MaxPages = MaxPages
	if granted&InitMapAlignment != 0 {
		out.MapAlignment = mapAlign
	}
	setBody(r, &out)
	return OK
}

func doDestroy(s *Server, r *request) Errno {
	s.initMu.Lock()
	defer s.initMu.Unlock()
	if s.inited.Load() {
		s.CancelWaiting()
		s.fs.Destroy()
		s.inited.Store(false)
		s.granted.Store(0)
	}
	return OK
}

func doLookup(s *Server, r *request) Errno {
	name, e := r.name()
	if e != OK {
		return e
	}
	out := &r.hot.entry
	if e := s.fs.Lookup(&r.Context, r.NodeID, name, out); e != OK {
		return e
	}
	setBody(r, out)
	return OK
}

func doForget(s *Server, r *request) Errno {
	var in ForgetIn
	if arg(r, &in) {
		s.fs.Forget(r.NodeID, in.Nlookup)
	}
	return OK
}

func doBatchForget(s *Server, r *request) Errno {
	var in BatchForgetIn
	if !arg(r, &in) {
		return OK
	}
	// The count is the guest's word; the entries actually present bound the loop.
	for i := uint32(0); i < in.Count; i++ {
		var one ForgetOne
		if !arg(r, &one) {
			break
		}
		s.fs.Forget(one.NodeID, one.Nlookup)
	}
	return OK
}

func doGetattr(s *Server, r *request) Errno {
	in, out := &r.hot.getattr, &r.hot.attr
	arg(r, in) // absent before 7.9; zero means no handle
	if e := s.fs.GetAttr(&r.Context, r.NodeID, in, out); e != OK {
		return e
	}
	setBody(r, out)
	return OK
}

func doReadlink(s *Server, r *request) Errno {
	target, e := s.fs.Readlink(&r.Context, r.NodeID, r.bodyBuf[:0])
	if e != OK {
		return e
	}
	r.body = target
	r.bodyBuf = target[:0]
	return OK
}

// entry answers a creating operation.
func entry(r *request, out *EntryOut, e Errno) Errno {
	if e != OK {
		return e
	}
	setBody(r, out)
	return OK
}

func doSymlink(s *Server, r *request) Errno {
	name, e := r.name()
	if e != OK {
		return e
	}
	target, e := r.cstring(maxSymlinkLen, pathErrs)
	if e != OK {
		return e
	}
	if !s.secctx(r) {
		return unix.EINVAL
	}
	var out EntryOut
	return entry(r, &out, s.fs.Symlink(&r.Context, r.NodeID, name, target, &out))
}

func doMknod(s *Server, r *request) Errno {
	var in MknodIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	name, e := r.name()
	if e != OK {
		return e
	}
	if !s.secctx(r) {
		return unix.EINVAL
	}
	var out EntryOut
	return entry(r, &out, s.fs.Mknod(&r.Context, r.NodeID, name, &in, &out))
}

func doMkdir(s *Server, r *request) Errno {
	var in MkdirIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	name, e := r.name()
	if e != OK {
		return e
	}
	if !s.secctx(r) {
		return unix.EINVAL
	}
	var out EntryOut
	return entry(r, &out, s.fs.Mkdir(&r.Context, r.NodeID, name, &in, &out))
}

func doUnlink(s *Server, r *request) Errno {
	name, e := r.name()
	if e != OK {
		return e
	}
	return s.fs.Unlink(&r.Context, r.NodeID, name)
}

func doRmdir(s *Server, r *request) Errno {
	name, e := r.name()
	if e != OK {
		return e
	}
	return s.fs.Rmdir(&r.Context, r.NodeID, name)
}

func doRename(s *Server, r *request) Errno {
	var in RenameIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	return rename(s, r, in.Newdir, 0)
}

func doRename2(s *Server, r *request) Errno {
	var in Rename2In
	if !arg(r, &in) {
		return unix.EINVAL
	}
	return rename(s, r, in.Newdir, in.Flags)
}

func rename(s *Server, r *request, newDir uint64, flags uint32) Errno {
	oldName, e := r.name()
	if e != OK {
		return e
	}
	newName, e := r.name()
	if e != OK {
		return e
	}
	return s.fs.Rename(&r.Context, r.NodeID, oldName, newDir, newName, flags)
}

func doLink(s *Server, r *request) Errno {
	var in LinkIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	name, e := r.name()
	if e != OK {
		return e
	}
	var out EntryOut
	return entry(r, &out, s.fs.Link(&r.Context, in.Oldnodeid, r.NodeID, name, &out))
}

func doCreate(s *Server, r *request) Errno {
	in := scratchIn[CreateIn](r)
	if !arg(r, in) {
		return unix.EINVAL
	}
	name, e := r.name()
	if e != OK {
		return e
	}
	if !s.secctx(r) {
		return unix.EINVAL
	}
	return create(r, func(e *EntryOut, o *OpenOut) Errno {
		return s.fs.Create(&r.Context, r.NodeID, name, in, e, o)
	})
}

func doTmpfile(s *Server, r *request) Errno {
	in := scratchIn[CreateIn](r)
	if !arg(r, in) {
		return unix.EINVAL
	}
	return create(r, func(e *EntryOut, o *OpenOut) Errno {
		return s.fs.Tmpfile(&r.Context, r.NodeID, in, e, o)
	})
}

// maxNrSecctx is FUSE_MAX_NR_SECCTX: a request extension whose type is at most this is the
// security contexts (its "type" is SecctxHeader.NrSecctx); larger types are other extensions.
const maxNrSecctx = 31

// secctx takes the security contexts (SecctxHeader) of a create-type request once SECURITY_CTX
// is negotiated, and puts its context in r.Context.SecCtx. Guests before 7.38 append them after
// the names; 7.38 guests send them as a request extension (total_extlen), one record of the
// extension area. It reports whether they were well formed.
func (s *Server) secctx(r *request) bool {
	if s.Flags()&InitSecurityCtx == 0 {
		return true
	}
	if r.hdr.TotalExtlen == 0 {
		return r.parseSecctx()
	}
	for ext := r.ext; len(ext) > 0; {
		var h SecctxHeader // a record header: {size, type}
		if len(ext) < int(unsafe.Sizeof(h)) {
			return false
		}
		copy(AsBytes(&h), ext)
		if h.Size < uint32(unsafe.Sizeof(h)) || h.Size%8 != 0 || int(h.Size) > len(ext) {
			return false
		}
		rec := ext[:h.Size]
		ext = ext[h.Size:]
		if h.NrSecctx > maxNrSecctx {
			continue // another kind of extension
		}
		args := r.args
		r.args = rec
		ok := r.parseSecctx()
		r.args = args
		return ok
	}
	return true
}

// parseSecctx reads a SecctxHeader and its context from the front of r.args. Linux sends at
// most one context; more are refused.
func (r *request) parseSecctx() bool {
	var h SecctxHeader
	if !arg(r, &h) {
		return false
	}
	switch {
	case h.NrSecctx == 0:
		return true
	case h.NrSecctx > 1:
		return false
	}
	var c Secctx
	if !arg(r, &c) {
		return false
	}
	name, e := r.cstring(maxNameLen, xattrNameErrs)
	if e != OK || c.Size > maxXattrSize || int(c.Size) > len(r.args) {
		return false
	}
	r.Context.SecCtx = &SecurityContext{Name: name, Value: r.args[:c.Size]}
	r.args = r.args[c.Size:]
	return true
}

// create answers CREATE and TMPFILE: an entry followed by an open handle.
func create(r *request, op func(*EntryOut, *OpenOut) Errno) Errno {
	out := scratchOut[struct {
		Entry EntryOut
		Open  OpenOut
	}](r)
	if e := op(&out.Entry, &out.Open); e != OK {
		return e
	}
	setBody(r, out)
	return OK
}

func doRead(s *Server, r *request) Errno {
	in := &r.hot.read
	if !arg(r, in) {
		return unix.EINVAL
	}
	size := min(int(in.Size), MaxWrite, r.outSpace())
	in.Size = uint32(size)
	dst := subIovecs(r.iovBuf[:0], r.out, outHeaderSize, size)
	r.iovBuf = dst
	n, e := s.fs.Read(&r.Context, r.NodeID, in, dst)
	if e != OK {
		return e
	}
	if n < 0 || n > size {
		return unix.EIO
	}
	r.direct = n
	s.stats.bytesRead.Add(uint64(n))
	return OK
}

func doWrite(s *Server, r *request) Errno {
	in := &r.hot.write
	if !arg(r, in) {
		return unix.EINVAL
	}
	n, e := s.fs.Write(&r.Context, r.NodeID, in, r.payload)
	if e != OK {
		return e
	}
	if n < 0 || n > int(in.Size) {
		return unix.EIO
	}
	s.stats.bytesWritten.Add(uint64(n))
	out := WriteOut{Size: uint32(n)}
	setBody(r, &out)
	return OK
}

func doReaddir(s *Server, r *request) Errno {
	var in ReadIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	size := min(int(in.Size), maxReaddirSize, r.outSpace())
	if cap(r.bodyBuf) < size {
		r.bodyBuf = make([]byte, 0, size)
	}
	dl := NewDirList(r.bodyBuf, size, r.Opcode == OpReaddirplus)
	if e := s.fs.ReadDir(&r.Context, r.NodeID, &in, dl.Plus(), dl); e != OK {
		return e
	}
	r.body = dl.bytes()
	r.bodyBuf = r.body[:0]
	return OK
}

func doSyncfs(s *Server, r *request) Errno {
	return s.fs.SyncFs(&r.Context, r.NodeID)
}

func doAccess(s *Server, r *request) Errno {
	var in AccessIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	return s.fs.Access(&r.Context, r.NodeID, in.Mask)
}

func doSetxattr(s *Server, r *request) Errno {
	var in SetxattrIn
	b := AsBytes(&in)
	size := setxattrInCompatSize
	if s.Flags()&InitSetxattrExt != 0 {
		size = len(b)
	}
	if len(r.args) < size {
		return unix.EINVAL
	}
	copy(b[:size], r.args)
	r.args = r.args[size:]
	name, e := r.cstring(maxNameLen, xattrNameErrs)
	if e != OK {
		return e
	}
	if in.Size > maxXattrSize {
		return unix.E2BIG // as setxattr(2) answers a value beyond XATTR_SIZE_MAX
	}
	if int(in.Size) != len(r.args) {
		return unix.EINVAL
	}
	if ext, ok := s.fs.(SetxattrExter); ok && size > setxattrInCompatSize {
		return ext.SetXattrExt(&r.Context, r.NodeID, name, r.args, in.Flags, in.SetxattrFlags)
	}
	return s.fs.SetXattr(&r.Context, r.NodeID, name, r.args, in.Flags)
}

func doGetxattr(s *Server, r *request) Errno {
	var in GetxattrIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	name, e := r.cstring(maxNameLen, xattrNameErrs)
	if e != OK {
		return e
	}
	return xattrReply(r, in.Size, func(dst []byte) (int, Errno) {
		return s.fs.GetXattr(&r.Context, r.NodeID, name, dst)
	})
}

func doListxattr(s *Server, r *request) Errno {
	var in GetxattrIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	return xattrReply(r, in.Size, func(dst []byte) (int, Errno) {
		return s.fs.ListXattr(&r.Context, r.NodeID, dst)
	})
}

// xattrReply answers GETXATTR and LISTXATTR: the size alone when the guest asked with size 0,
// the value otherwise.
func xattrReply(r *request, size uint32, op func([]byte) (int, Errno)) Errno {
	if size == 0 {
		n, e := op(nil)
		if e != OK {
			return e
		}
		out := GetxattrOut{Size: uint32(n)}
		setBody(r, &out)
		return OK
	}
	size = min(size, maxXattrSize, uint32(r.outSpace()))
	if cap(r.bodyBuf) < int(size) {
		r.bodyBuf = make([]byte, 0, size)
	}
	dst := r.bodyBuf[:size]
	n, e := op(dst)
	if e != OK {
		return e
	}
	if n < 0 || n > len(dst) {
		return unix.EIO
	}
	r.body = dst[:n]
	return OK
}

func doRemovexattr(s *Server, r *request) Errno {
	name, e := r.cstring(maxNameLen, xattrNameErrs)
	if e != OK {
		return e
	}
	return s.fs.RemoveXattr(&r.Context, r.NodeID, name)
}

// doInterrupt cancels the request named by INTERRUPT if it is waiting (SETLKW): it is then
// answered EINTR. Any other request is not cancellable once started, and its own reply answers
// the INTERRUPT; an unknown unique is ignored (FUSE allows answering EAGAIN to have it sent
// again, but Linux's virtio-fs driver does not send INTERRUPT at all, and nothing would read
// that answer). INTERRUPT itself has no reply (dispatch).
func doInterrupt(s *Server, r *request) Errno {
	var in InterruptIn
	if arg(r, &in) {
		s.interrupt(in.Unique)
	}
	return OK
}

func doGetlk(s *Server, r *request) Errno {
	if s.Flags()&InitPosixLocks == 0 {
		return unix.ENOSYS
	}
	var in LkIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	var out LkOut
	if e := s.fs.GetLk(&r.Context, r.NodeID, &in, &out); e != OK {
		return e
	}
	setBody(r, &out)
	return OK
}

// doSetlk serves SETLK and SETLKW. A SETLKW that has to wait leaves its Waiter in r.waiter and
// is deferred by HandleAsync.
func doSetlk(s *Server, r *request) Errno {
	var in LkIn
	if !arg(r, &in) {
		return unix.EINVAL
	}
	need := uint64(InitPosixLocks)
	if in.LkFlags&LkFlock != 0 {
		need = InitFlockLocks
	}
	if s.Flags()&need == 0 {
		return unix.ENOSYS
	}
	wait := r.Opcode == OpSetlkw
	if wait && s.Waiting() >= maxWaiting {
		// No room to wait: one try, and "no locks available" if it is taken.
		if _, e := s.fs.SetLk(&r.Context, r.NodeID, &in, false); e != unix.EAGAIN {
			return e
		}
		return unix.ENOLCK
	}
	w, e := s.fs.SetLk(&r.Context, r.NodeID, &in, wait)
	if w != nil {
		if !wait {
			// A file system bug: SETLK never waits. Stop the wait rather than leak it.
			w.Start(func(Errno) {})
			w.Cancel()
			return unix.EIO
		}
		r.waiter = w
		return OK
	}
	return e
}
