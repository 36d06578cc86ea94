package passthrough

import (
	"sync/atomic"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// The lookup path, all in this file but for the table: LOOKUP (node_ops.go) asks lookupName,
// READDIRPLUS (dir_ops.go) lookupEntry; each reaches the entry by lookupKnown or lookupAt;
// addNode makes or finds its node in the table (inode.go), with a file handle when handles
// are on (filehandle.go), and fillEntry answers it.

// addNode makes a node of fd (O_PATH|O_NOFOLLOW, reached from parent p through its descriptor
// dirfd), taking one lookup reference, and answers out; existed says the node was in the table
// already. It takes fd: it either keeps or closes it.
func (fs *FS) addNode(p *inode, dirfd, fd int, out *fuse.EntryOut) (id uint64, existed bool, e fuse.Errno) {
	var st unix.Statx_t
	if err := statxFd(fd, &st); err != nil {
		unix.Close(fd)
		return 0, false, errno(err)
	}
	k := keyOf(&st)
	mode := uint32(st.Mode) & unix.S_IFMT
	if mode == unix.S_IFDIR && (k.mnt != p.key.mnt || k.dev != p.key.dev) {
		mode |= modeSubmount
	}
	// fd is still ours to use here: once in the table, a FORGET racing us could close it.
	dax := fs.daxAttr(int32(fd), &st)
	fh, e := fs.handleFor(dirfd, fd, mode&unix.S_IFMT, k)
	if e != fuse.OK {
		unix.Close(fd)
		return 0, false, e
	}
	nodeFd := fd
	if fh != nil {
		nodeFd = -1
	}
	id, n, took, e := fs.nodes.insert(k, nodeFd, fh, mode)
	if !took || fh != nil {
		unix.Close(fd)
	}
	if e != fuse.OK {
		return 0, false, e
	}
	fs.fillEntry(out, id, n.mode, dax, &st)
	return id, !took, fuse.OK
}

// lookupAt looks name up in directory dirfd, a descriptor of node p, taking a reference: it
// opens the entry (O_PATH|O_NOFOLLOW) and makes a node of it, or finds the node it already is
// (existed). See lookupKnown for the way without an open.
func (fs *FS) lookupAt(p *inode, dirfd int, name string, out *fuse.EntryOut) (id uint64, existed bool, e fuse.Errno) {
	fd, err := openat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, false, errno(err)
	}
	return fs.addNode(p, dirfd, fd, out)
}

// fillEntry answers the entry of node id, whose inode.mode is mode, from its attributes st;
// dax is daxAttr's verdict.
func (fs *FS) fillEntry(out *fuse.EntryOut, id uint64, mode uint32, dax bool, st *unix.Statx_t) {
	out.NodeID = id
	out.Generation = 0
	out.EntryValid, out.EntryValidNsec = fs.entrySec, fs.entryNsec
	out.AttrValid, out.AttrValidNsec = fs.attrSec, fs.attrNsec
	fillAttr(&out.Attr, st)
	fs.guestOwner(&out.Attr)
	out.Attr.Flags = fs.attrFlags(mode, dax)
}

// Looking up an entry whose inode is a node already.
//
// lookupAt reaches an entry as the C and the Rust virtiofsd do: it opens it
// (O_PATH|O_NOFOLLOW), stats the descriptor and finds the node of the key it read, and when
// the inode is a node already it closes the new descriptor again. Three system calls, where
// the answer needs only the key and the attributes; and guests look up many entries whose
// inodes the table holds: a LOOKUP that revalidates a name whose entry timeout ran out (1 s
// with cache=auto, on every component of every path the guest walks again), a READDIRPLUS of a
// directory whose files the guest has open or cached. lookupKnown answers those with one statx
// of the name: a node that keeps its descriptor keeps its inode alive, so no other file can
// have its inode number, and the node of the key statx finds is the inode the name names at
// that moment, as lookupAt's open would have found it (nodeTable.ref). Nothing is opened, so
// the threat model's rules hold as they are: one *at() call on the parent's descriptor with a
// checked name, the entry itself (AT_SYMLINK_NOFOLLOW), never a host path.
//
// An entry that is no node yet costs lookupAt all the same, after the statx: three calls
// instead of lookupAt's two (the open and its statx; the descriptor stays with the new node).
// READDIRPLUS knows beforehand, nearly always: getdents gave the entry's inode number, and the
// table answers whether it holds that inode without a system call (lookupEntry). LOOKUP has
// only a name, so it steers by what its recent lookups found (knownSteer).

// knownScoreMax bounds knownSteer's score: from either end it turns within 16 lookups that
// find their node or 33 that make one.
const knownScoreMax = 32

// knownSteer decides whether LOOKUP tries lookupKnown before lookupAt. For a name whose inode
// is a node that costs one system call instead of three, for a name that is no node yet one
// more than lookupAt alone, and for a name that does not exist the same (one either way). So
// the statx first pays while more than a third of the lookups that find an entry find its node.
// The score counts them, +2 for a lookup that found its node and -1 for one that made a node,
// within ±knownScoreMax; lookupKnown goes first while it is not negative. Both ways learn
// whether the node existed, so the score moves whichever way is in use. Updates from two
// queues at once may overwrite each other: the score is a hint, and never decides an answer,
// only its cost. A guest decides the score with its lookups, and so which of the two costs its
// own lookups pay.
type knownSteer struct{ score atomic.Int32 }

func (s *knownSteer) preferKnown() bool { return s.score.Load() >= 0 }

// note counts a lookup that found its entry's node (found) or made one.
func (s *knownSteer) note(found bool) {
	old := s.score.Load()
	v := max(old-1, -knownScoreMax)
	if found {
		v = min(old+2, knownScoreMax)
	}
	if v != old { // a saturated score leaves its cache line alone
		s.score.Store(v)
	}
}

// knownUsable says whether lookupKnown may answer at all: not when the nodes keep file
// handles (their inodes may be gone and the numbers reused, and such nodes are not found by
// nodeTable.ref anyway), nor when DAX per inode was negotiated (the entry's DAX flag is read
// through a descriptor of it, daxAttr).
func (fs *FS) knownUsable() bool {
	return (fs.opts.FileHandles == FileHandlesNever || fs.handlesOff) &&
		fs.flags.Load()&fuse.InitHasInodeDAX == 0
}

// knownResult is what lookupKnown made of a lookup.
type knownResult uint8

const (
	// knownMiss: not answered. The entry's inode is no node that keeps its descriptor, or
	// statx failed otherwise than ENOENT; lookupAt answers.
	knownMiss knownResult = iota
	// knownHit: answered from the node of the entry's inode, which took a lookup reference.
	knownHit
	// knownAbsent: there is no such entry; the answer is ENOENT, as lookupAt's open would say.
	knownAbsent
)

// lookupKnown looks name up in directory dirfd with one statx of the name, and answers out from
// the node of the key it reads, taking a reference, if the table has one that keeps its
// descriptor (see the comment at the top of this file).
func (fs *FS) lookupKnown(dirfd int, name string, out *fuse.EntryOut) (uint64, knownResult) {
	var st unix.Statx_t
	if err := statxAt(dirfd, name, &st); err != nil {
		if err == unix.ENOENT {
			return 0, knownAbsent
		}
		return 0, knownMiss
	}
	id, n, ok := fs.nodes.ref(keyOf(&st))
	if !ok {
		return 0, knownMiss
	}
	fs.fillEntry(out, id, n.mode, false, &st) // no DAX flag: knownUsable
	return id, knownHit
}

// lookupName is LOOKUP's lookup of name in dirfd, a descriptor of node p: lookupKnown first
// while fs.known says that pays, and lookupAt when it does not or lookupKnown cannot answer.
func (fs *FS) lookupName(p *inode, dirfd int, name string, out *fuse.EntryOut) fuse.Errno {
	if !fs.knownUsable() {
		_, _, e := fs.lookupAt(p, dirfd, name, out)
		return e
	}
	if fs.known.preferKnown() {
		switch _, r := fs.lookupKnown(dirfd, name, out); r {
		case knownHit:
			fs.known.note(true)
			return fuse.OK
		case knownAbsent:
			return unix.ENOENT
		}
		fs.known.note(false)
		_, _, e := fs.lookupAt(p, dirfd, name, out)
		return e
	}
	_, existed, e := fs.lookupAt(p, dirfd, name, out)
	if e == fuse.OK {
		fs.known.note(existed)
	}
	return e
}

// lookupEntry is READDIRPLUS's lookup of the entry name, inode number ino (getdents' d_ino), in
// dirfd, a descriptor of node p: lookupKnown when the table holds a node of that number on p's
// device and mount, which it tells without a system call, else lookupAt. The number is only a
// hint (the entry may have been replaced since getdents, or be a mount point): lookupKnown
// goes by the key statx reads, and lookupAt answers what it cannot.
func (fs *FS) lookupEntry(p *inode, dirfd int, name string, ino uint64, out *fuse.EntryOut) (uint64, fuse.Errno) {
	if fs.knownUsable() && fs.nodes.held(nodeKey{dev: p.key.dev, ino: ino, mnt: p.key.mnt}) {
		switch id, r := fs.lookupKnown(dirfd, name, out); r {
		case knownHit:
			return id, fuse.OK
		case knownAbsent:
			return 0, unix.ENOENT
		}
	}
	id, _, e := fs.lookupAt(p, dirfd, name, out)
	return id, e
}
