package passthrough

import (
	"os"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// lookupKnown answers from the table exactly when the entry's inode is a node, by the key statx
// reads now, and ENOENT for a name that is not there.
func TestLookupKnown(t *testing.T) {
	e := newEnv(t, Options{})
	for _, name := range []string{"f", "g", "h"} {
		must(t, os.WriteFile(e.path(name), []byte(name), 0o644))
	}
	must(t, os.Symlink("/etc", e.path("link")))
	rootfd := int(e.fs.nodes.root.fd.Load())

	var out fuse.EntryOut
	if _, r := e.fs.lookupKnown(rootfd, "f", &out); r != knownMiss {
		t.Fatalf("lookupKnown of a file that is no node: %d, want knownMiss", r)
	}
	if _, r := e.fs.lookupKnown(rootfd, "missing", &out); r != knownAbsent {
		t.Fatalf("lookupKnown of a missing name: %d, want knownAbsent", r)
	}
	if st := e.fs.Stats(); st.CachedInodes != 1 {
		t.Fatalf("lookupKnown that answered nothing left %d nodes", st.CachedInodes)
	}

	f := e.lookup(t, 1, "f")
	fds := e.fs.Stats().Fds
	out = fuse.EntryOut{}
	id, r := e.fs.lookupKnown(rootfd, "f", &out)
	if r != knownHit || id != f.NodeID || out.NodeID != f.NodeID {
		t.Fatalf("lookupKnown of node %d: id %d, result %d, entry %+v", f.NodeID, id, r, out)
	}
	if out.Attr != f.Attr || out.EntryValid != f.EntryValid || out.AttrValid != f.AttrValid {
		t.Errorf("lookupKnown answered %+v, LOOKUP %+v", out, f)
	}
	if refs := e.fs.nodes.refs(f.NodeID); refs != 2 {
		t.Errorf("node %d has %d references after two lookups", f.NodeID, refs)
	}
	if st := e.fs.Stats(); st.Fds != fds || st.CachedInodes != 2 {
		t.Errorf("lookupKnown of a node: %+v, want %d fds and 2 nodes as before", st, fds)
	}

	// A symlink is the link's own inode, never its target's.
	l := e.lookup(t, 1, "link")
	if id, r := e.fs.lookupKnown(rootfd, "link", &out); r != knownHit || id != l.NodeID ||
		out.Attr.Mode&unix.S_IFMT != unix.S_IFLNK || out.Attr.Ino != lstat(t, e.path("link")).Ino {
		t.Errorf("lookupKnown of the symlink node %d: id %d, result %d, attr %+v", l.NodeID, id, r, out.Attr)
	}

	// A name that now leads to another inode: the node of that inode if there is one...
	g := e.lookup(t, 1, "g")
	must(t, os.Rename(e.path("g"), e.path("f")))
	if id, r := e.fs.lookupKnown(rootfd, "f", &out); r != knownHit || id != g.NodeID || out.Attr.Ino != g.Attr.Ino {
		t.Errorf("f renamed over by g (node %d): id %d, result %d, ino %d", g.NodeID, id, r, out.Attr.Ino)
	}
	// ...and none when that inode is no node: f's old node, whose descriptor keeps the
	// replaced inode, is not it.
	must(t, os.Rename(e.path("h"), e.path("f")))
	if id, r := e.fs.lookupKnown(rootfd, "f", &out); r != knownMiss {
		t.Errorf("f renamed over by h, no node: id %d, result %d, want knownMiss", id, r)
	}
	h := e.lookup(t, 1, "f")
	if h.NodeID == f.NodeID || h.NodeID == g.NodeID || h.Attr.Ino != lstat(t, e.path("f")).Ino {
		t.Errorf("LOOKUP of f after h replaced it: %+v (f was %d, g %d)", h, f.NodeID, g.NodeID)
	}
}

// LOOKUP answers the same whichever way knownSteer sends it, and the score follows what the
// lookups find.
func TestLookupSteer(t *testing.T) {
	e := newEnv(t, Options{})
	const n = 2 * knownScoreMax
	names := make([]string, n)
	for i := range names {
		names[i] = "file" + string(rune('a'+i/26)) + string(rune('a'+i%26))
		must(t, os.WriteFile(e.path(names[i]), nil, 0o644))
	}
	if !e.fs.known.preferKnown() {
		t.Fatal("a new FS does not try the table first")
	}
	ids := map[string]uint64{}
	for _, name := range names { // every one a new node
		out := e.lookup(t, 1, name)
		if out.Attr.Ino != lstat(t, e.path(name)).Ino {
			t.Fatalf("LOOKUP %s: ino %d", name, out.Attr.Ino)
		}
		ids[name] = out.NodeID
	}
	if e.fs.known.preferKnown() || e.fs.known.score.Load() != -knownScoreMax {
		t.Fatalf("after %d lookups that made nodes: score %d", n, e.fs.known.score.Load())
	}
	fds := e.fs.Stats().Fds
	for i, name := range names { // every one a node now, found through lookupAt, then the table
		if out := e.lookup(t, 1, name); out.NodeID != ids[name] {
			t.Fatalf("second LOOKUP %s: node %d, first %d", name, out.NodeID, ids[name])
		}
		if i == knownScoreMax/2 && !e.fs.known.preferKnown() {
			t.Errorf("after %d lookups that found their node: score %d", i+1, e.fs.known.score.Load())
		}
	}
	if got := e.fs.known.score.Load(); got != knownScoreMax {
		t.Errorf("score %d after lookups that found their nodes, want %d", got, knownScoreMax)
	}
	for _, name := range names {
		if refs := e.fs.nodes.refs(ids[name]); refs != 2 {
			t.Errorf("%s: %d references after two lookups", name, refs)
		}
	}
	if st := e.fs.Stats(); st.Fds != fds || st.CachedInodes != 1+n {
		t.Errorf("after the second lookups: %+v, want %d fds, %d nodes", st, fds, 1+n)
	}
	// A missing name moves nothing, either way.
	for _, prefer := range []int32{knownScoreMax, -knownScoreMax} {
		e.fs.known.score.Store(prefer)
		var out fuse.EntryOut
		wantErrno(t, "LOOKUP missing", e.fs.Lookup(rootCtx, 1, "missing", &out), unix.ENOENT)
		if got := e.fs.known.score.Load(); got != prefer {
			t.Errorf("a missing name moved the score from %d to %d", prefer, got)
		}
	}
}

func TestKnownSteerBounds(t *testing.T) {
	var s knownSteer
	for range 3 * knownScoreMax {
		s.note(false)
	}
	if got := s.score.Load(); got != -knownScoreMax || s.preferKnown() {
		t.Fatalf("after many misses: %d", got)
	}
	for i := 1; ; i++ {
		s.note(true)
		if s.preferKnown() {
			if i != knownScoreMax/2 {
				t.Errorf("turned after %d hits, want %d", i, knownScoreMax/2)
			}
			break
		}
	}
	for range 3 * knownScoreMax {
		s.note(true)
	}
	if got := s.score.Load(); got != knownScoreMax {
		t.Errorf("after many hits: %d", got)
	}
}

// With file handles the nodes need not keep their inodes alive, and with DAX per inode an
// entry's flag is read through a descriptor of it: the table is never asked.
func TestLookupKnownUnusable(t *testing.T) {
	needRoot(t)
	d := newEnv(t, Options{})
	if !d.fs.knownUsable() {
		t.Fatal("not knownUsable by default")
	}
	d.fs.Init(fuse.InitHasInodeDAX)
	if d.fs.knownUsable() {
		t.Error("knownUsable with DAX per inode")
	}
	e := newEnv(t, Options{FileHandles: FileHandlesMandatory})
	if e.fs.knownUsable() {
		t.Error("knownUsable with file handles")
	}
	must(t, os.WriteFile(e.path("f"), nil, 0o644))
	a, b := e.lookup(t, 1, "f"), e.lookup(t, 1, "f")
	if a.NodeID != b.NodeID || e.fs.nodes.refs(a.NodeID) != 2 {
		t.Errorf("two lookups of f: nodes %d and %d, %d references", a.NodeID, b.NodeID, e.fs.nodes.refs(a.NodeID))
	}
}
