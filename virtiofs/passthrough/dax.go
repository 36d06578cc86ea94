package passthrough

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"os"
	"path"
	"strconv"
	"strings"
	"unsafe"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// DAX: with a front-end that has a DAX window (the DAX-capable QEMU Kata ships, cache-size=N),
// the guest maps 2 MiB ranges of files straight into its address space instead of reading and
// writing through the queues. Which files it maps is decided per file by FUSE_ATTR_DAX when it
// mounted with dax=inode (the default mode of a Linux guest), and that flag comes from the
// host's DAX policy, which the guest cannot see or change.
//
// # The policy
//
// A DAXPolicy has a mode and, for mode inode, rules:
//
//   - never: no file is DAX, and DAX is not even negotiated at the next INIT.
//   - always: every regular file is DAX.
//   - inode (the default): a regular file is DAX when, in this order,
//     1. its host attribute DAXXattr is "1" ("0" says no; other values are ignored),
//     2. otherwise the first matching rule says so (DAXRule),
//     3. otherwise when it carries FS_XFLAG_DAX on the host (FS_IOC_FSGETXATTR, on file
//     systems that support it: ext4, xfs).
//
// Only regular files are ever DAX (Linux maps nothing else), and only once the guest
// negotiated FUSE_HAS_INODE_DAX; without it nothing of this costs anything. With it, mode inode
// costs each LOOKUP, GETATTR, CREATE and READDIRPLUS entry of a regular file a getxattr, a
// readlink when a rule has a Glob, and an open, ioctl and close for FS_XFLAG_DAX when neither
// the attribute nor a rule decided.
//
// The policy can be replaced at run time (FS.SetDAXPolicy): it is swapped atomically (one
// pointer), so each request sees the old or the new policy whole. A change reaches the
// guest as its attribute timeout expires; mappings the guest already holds stay valid, and
// SETUPMAPPING keeps being served while DAX is negotiated, whatever the policy says later
// (a guest mounted with dax=always maps every file it opens; what the guest may map is what it
// may read and write anyway). A change of mode to or from never takes effect at the next INIT.
//
// # SETUPMAPPING and REMOVEMAPPING
//
// Linux sends SETUPMAPPING with fh = fuse.SetupmappingNoFh: a mapping belongs to the inode,
// not to an open file. The node is then opened through /proc/self/fd for the mapping, read-only
// or read-write for a write mapping (the guest checked permissions at open, as for OPEN), and
// the descriptor is closed once the front-end has mapped it. A real fh must be an open file
// handle of the node; it must be open for reading (every mapping is readable) and for writing
// too for a write mapping, else EBADF. Ranges beyond the end of the file are allowed: Linux
// always maps whole 2 MiB ranges, whatever the file's size, and never touches a page past
// i_size (a growing write goes through FUSE_WRITE); a hostile guest that touches one hurts only
// its own VM (the front-end's access to it faults), as does a host process that truncates a file
// the guest has mapped. The server checks alignment and overflow; the window bounds are the front-end's
// (QEMU refuses a range outside its window, and so does frontend), whose refusal is passed on as
// its errno, else EIO.

// DAXXattr is the host attribute that sets a file's DAX state in mode inode. The guest can never
// read, list, set or remove it, whatever --xattr and --xattrmap say.
const DAXXattr = "trusted.kvfs.dax"

// DAXMode is the mode of a DAX policy.
type DAXMode int

const (
	// DAXInode: per file, from DAXXattr, the rules and FS_XFLAG_DAX. The zero value.
	DAXInode DAXMode = iota
	// DAXNever: no DAX at all.
	DAXNever
	// DAXAlways: every regular file.
	DAXAlways
)

var daxModeNames = map[DAXMode]string{DAXInode: "inode", DAXNever: "never", DAXAlways: "always"}

func (m DAXMode) String() string {
	if s, ok := daxModeNames[m]; ok {
		return s
	}
	return fmt.Sprintf("DAXMode(%d)", int(m))
}

// ParseDAXMode accepts never, always and inode.
func ParseDAXMode(s string) (DAXMode, error) {
	for m, name := range daxModeNames {
		if s == name {
			return m, nil
		}
	}
	return 0, fmt.Errorf("invalid DAX policy %q: want never, always or inode", s)
}

// DAXRule is one rule of mode inode. A rule matches a regular file when every condition it
// sets holds; the first matching rule decides.
type DAXRule struct {
	// Glob, when set, is a path.Match pattern. Without '/' it is matched against the file's
	// name ("*.so"), with '/' against its path relative to the shared directory, without a
	// leading '/' ("lib/*/*.so"). A file no longer reachable under the shared directory
	// (deleted, moved out) matches no rule with a Glob.
	Glob string
	// MinSize, when not zero, is the smallest size (bytes) of a matching file.
	MinSize uint64
	// DAX is the verdict of the rule.
	DAX bool
}

// Limits on a policy.
const (
	MaxDAXRules   = 256
	maxDAXGlobLen = 4096
)

// DAXPolicy is a DAX mode and the rules of mode inode.
type DAXPolicy struct {
	Mode  DAXMode
	Rules []DAXRule
}

// Validate reports the first thing wrong with p (rules are numbered from 1).
func (p *DAXPolicy) Validate() error {
	if _, ok := daxModeNames[p.Mode]; !ok {
		return fmt.Errorf("invalid DAX mode %v", p.Mode)
	}
	if len(p.Rules) > MaxDAXRules {
		return fmt.Errorf("%d DAX rules, at most %d", len(p.Rules), MaxDAXRules)
	}
	for i, r := range p.Rules {
		if len(r.Glob) > maxDAXGlobLen {
			return fmt.Errorf("DAX rule %d: glob longer than %d bytes", i+1, maxDAXGlobLen)
		}
		if strings.HasPrefix(r.Glob, "/") {
			return fmt.Errorf("DAX rule %d: glob %q: paths are relative to the shared directory", i+1, r.Glob)
		}
		if _, err := path.Match(r.Glob, ""); err != nil {
			return fmt.Errorf("DAX rule %d: glob %q: %w", i+1, r.Glob, err)
		}
	}
	return nil
}

// daxPolicy is a validated, private copy of a DAXPolicy.
type daxPolicy struct {
	mode     DAXMode
	rules    []DAXRule
	needPath bool // some rule has a Glob
}

func compileDAXPolicy(p DAXPolicy) (*daxPolicy, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	c := &daxPolicy{mode: p.Mode, rules: append([]DAXRule(nil), p.Rules...)}
	for _, r := range c.rules {
		c.needPath = c.needPath || r.Glob != ""
	}
	return c, nil
}

// DAXWindow is the front-end's DAX window, reached through the vhost-user back-end channel.
type DAXWindow interface {
	// Available reports whether the front-end has a window it can be asked to map into. It
	// may ask the front-end (on the back-end channel), so it is only called from requests.
	Available() bool
	// Map maps length bytes of file fd at foffset to moffset of the window, writable if write
	// (readable always). The caller keeps fd.
	Map(fd int, foffset, moffset, length uint64, write bool) error
	// Unmap drops the ranges from the window.
	Unmap(ranges []fuse.RemovemappingOne) error
}

// SetDAXPolicy replaces the DAX policy. Requests already running finish with the old one.
func (fs *FS) SetDAXPolicy(p DAXPolicy) error {
	c, err := compileDAXPolicy(p)
	if err != nil {
		return err
	}
	fs.dax.Store(c)
	return nil
}

// DAXPolicy returns (a copy of) the current DAX policy.
func (fs *FS) DAXPolicy() DAXPolicy {
	c := fs.dax.Load()
	return DAXPolicy{Mode: c.mode, Rules: append([]DAXRule(nil), c.rules...)}
}

var pageShift = uint16(bits.TrailingZeros(uint(os.Getpagesize())))

var _ fuse.DAXFileSystem = (*FS)(nil)

// DAXMapAlignment is the host page size: the front-end mmaps the ranges, which needs page
// alignment and nothing more. (A Linux guest maps 2 MiB ranges anyway, and accepts any alignment
// up to that.)
func (fs *FS) DAXMapAlignment() (uint16, bool) {
	w := fs.opts.DAXWindow
	if w == nil || !w.Available() || fs.dax.Load().mode == DAXNever {
		return 0, false
	}
	return pageShift, true
}

// SetupMapping maps a range of node's file into the window; see the DAX notes above.
func (fs *FS) SetupMapping(ctx *fuse.Context, nodeID uint64, in *fuse.SetupmappingIn) fuse.Errno {
	w := fs.opts.DAXWindow
	if w == nil {
		return unix.ENOSYS
	}
	n, pfd, e := fs.nodeFd(nodeID)
	if e != fuse.OK {
		return e
	}
	defer fs.putFd(n, pfd)
	write := in.Flags&fuse.SetupmappingFlagWrite != 0
	if write {
		if e := fs.readOnly(); e != fuse.OK {
			return e
		}
	}
	var fd int
	if in.Fh == fuse.SetupmappingNoFh {
		if !n.isRegular() {
			return notRegular(n.typ())
		}
		flags := unix.O_RDONLY
		if write {
			flags = unix.O_RDWR
		}
		var err error
		if fd, err = fs.openProc(int32(pfd), flags|unix.O_NOCTTY|unix.O_NONBLOCK); err != nil {
			return errno(err)
		}
		defer unix.Close(fd)
	} else {
		h, e := fs.handle(in.Fh, nodeID, false)
		if e != fuse.OK {
			return e
		}
		defer fs.handles.put(h)
		fl, err := unix.FcntlInt(uintptr(h.fd), unix.F_GETFL, 0)
		if err != nil {
			return errno(err)
		}
		if acc := fl & unix.O_ACCMODE; acc == unix.O_WRONLY || write && acc != unix.O_RDWR {
			return unix.EBADF
		}
		fd = int(h.fd)
	}
	return windowErrno(w.Map(fd, in.Foffset, in.Moffset, in.Len, write))
}

// RemoveMapping drops ranges from the window.
func (fs *FS) RemoveMapping(ctx *fuse.Context, ranges []fuse.RemovemappingOne) fuse.Errno {
	w := fs.opts.DAXWindow
	if w == nil {
		return unix.ENOSYS
	}
	return windowErrno(w.Unmap(ranges))
}

// windowErrno is the guest's errno for a failed window request: the front-end's errno when it
// sent one, else EIO.
func windowErrno(err error) fuse.Errno {
	if err == nil {
		return fuse.OK
	}
	var e unix.Errno
	if errors.As(err, &e) && e != 0 {
		return e
	}
	return unix.EIO
}

// daxAttr reports whether the regular file behind node descriptor fd gets fuse.AttrDAX.
func (fs *FS) daxAttr(fd int32, st *unix.Statx_t) bool {
	if st.Mode&unix.S_IFMT != unix.S_IFREG || fs.flags.Load()&fuse.InitHasInodeDAX == 0 {
		return false
	}
	p := fs.dax.Load()
	switch p.mode {
	case DAXNever:
		return false
	case DAXAlways:
		return true
	}
	var v [2]byte
	if sz, err := unix.Getxattr(fs.procPathOf(fd), DAXXattr, v[:]); err == nil && sz == 1 {
		switch v[0] {
		case '1':
			return true
		case '0':
			return false
		}
	}
	if len(p.rules) > 0 {
		var rel string
		reachable := false
		if p.needPath {
			rel, reachable = fs.relPath(fd)
		}
		for _, r := range p.rules {
			if r.MinSize != 0 && st.Size < r.MinSize {
				continue
			}
			if r.Glob != "" {
				if !reachable {
					continue
				}
				subject := rel
				if !strings.Contains(r.Glob, "/") {
					subject = path.Base(rel)
				}
				if ok, _ := path.Match(r.Glob, subject); !ok {
					continue
				}
			}
			return r.DAX
		}
	}
	return fs.hasXflagDAX(fd)
}

// relPath is the path of fd relative to the shared directory, if it is (still) under it.
func (fs *FS) relPath(fd int32) (string, bool) {
	p, err := os.Readlink(fs.procPathOf(fd))
	if err != nil || fs.rootPath == "" || strings.HasSuffix(p, " (deleted)") {
		return "", false
	}
	prefix := fs.rootPath
	if prefix != "/" {
		prefix += "/"
	}
	rel, ok := strings.CutPrefix(p, prefix)
	return rel, ok && rel != ""
}

// fsxattr is struct fsxattr (FS_IOC_FSGETXATTR).
type fsxattr struct {
	xflags     uint32
	extsize    uint32
	nextents   uint32
	projid     uint32
	cowextsize uint32
	pad        [8]byte
}

// FS_XFLAG_DAX and FS_IOC_FSGETXATTR (_IOR('X', 31, struct fsxattr): the same on amd64 and
// arm64).
const (
	fsXflagDAX      = 0x00008000
	fsIocFsgetxattr = 0x801c581f
)

// hasXflagDAX reports whether the file carries FS_XFLAG_DAX. The ioctl needs an open file, so
// the node is opened read-only for it (no atime change, no side effect on a regular file); a
// file that cannot be opened or a file system without the ioctl says no.
func (fs *FS) hasXflagDAX(fd int32) bool {
	f, err := fs.openProc(fd, unix.O_RDONLY|unix.O_NOCTTY|unix.O_NONBLOCK)
	if err != nil {
		return false
	}
	defer unix.Close(f)
	var x fsxattr
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(f), fsIocFsgetxattr, uintptr(unsafe.Pointer(&x)))
	return e == 0 && x.xflags&fsXflagDAX != 0
}

// ParseDAXRules parses the text form of DAX rules (kvfsd --dax-rules): rules separated by ';',
// each "on" or "off" (the verdict) followed by optional conditions separated by spaces:
// glob=PATTERN (DAXRule.Glob) and size>=N, N in bytes or with a K, M or G suffix (powers of
// 1024), each at most once. For example: "on glob=*.so; on size>=2M; off glob=tmp/*". An empty
// string is no rules.
func ParseDAXRules(s string) ([]DAXRule, error) {
	var rules []DAXRule
	for i, text := range strings.Split(s, ";") {
		fields := strings.Fields(text)
		if len(fields) == 0 {
			if strings.TrimSpace(s) == "" {
				break
			}
			return nil, fmt.Errorf("DAX rule %d: empty", i+1)
		}
		var r DAXRule
		switch fields[0] {
		case "on":
			r.DAX = true
		case "off":
		default:
			return nil, fmt.Errorf("DAX rule %d: %q: want on or off first", i+1, fields[0])
		}
		var haveGlob, haveSize bool
		for _, f := range fields[1:] {
			if g, ok := strings.CutPrefix(f, "glob="); ok && g != "" {
				if haveGlob {
					return nil, fmt.Errorf("DAX rule %d: more than one glob", i+1)
				}
				r.Glob, haveGlob = g, true
				continue
			}
			if v, ok := strings.CutPrefix(f, "size>="); ok {
				if haveSize {
					return nil, fmt.Errorf("DAX rule %d: more than one size", i+1)
				}
				haveSize = true
				n, err := parseSize(v)
				if err != nil {
					return nil, fmt.Errorf("DAX rule %d: %w", i+1, err)
				}
				r.MinSize = n
				continue
			}
			return nil, fmt.Errorf("DAX rule %d: condition %q: want glob=PATTERN or size>=N", i+1, f)
		}
		rules = append(rules, r)
	}
	p := DAXPolicy{Rules: rules}
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return rules, nil
}

func parseSize(v string) (uint64, error) {
	shift := 0
	switch {
	case strings.HasSuffix(v, "K"):
		shift = 10
	case strings.HasSuffix(v, "M"):
		shift = 20
	case strings.HasSuffix(v, "G"):
		shift = 30
	}
	num := v
	if shift != 0 {
		num = v[:len(v)-1]
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil || n > math.MaxUint64>>shift {
		return 0, fmt.Errorf("invalid size %q", v)
	}
	return n << shift, nil
}
