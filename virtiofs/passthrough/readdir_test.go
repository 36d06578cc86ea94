package passthrough

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

func makeEntries(t *testing.T, dir string, n int) []string {
	t.Helper()
	var names []string
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("entry-%03d-with-a-longer-name", i)
		must(t, os.WriteFile(filepath.Join(dir, name), nil, 0o644))
		names = append(names, name)
	}
	must(t, os.Mkdir(filepath.Join(dir, "sub"), 0o755))
	names = append(names, "sub")
	sort.Strings(names)
	return names
}

// listAll reads a whole directory in calls of size bytes, following the cookies.
func listAll(t *testing.T, s *server, node, fh uint64, size uint32, plus bool) (all []dirent, calls int) {
	t.Helper()
	return listFrom(t, s, node, fh, 0, size, plus)
}

// listFrom is listAll from cookie on.
func listFrom(t *testing.T, s *server, node, fh, cookie uint64, size uint32, plus bool) (all []dirent, calls int) {
	t.Helper()
	for {
		ents, errno := s.readdir(t, node, fh, cookie, size, plus)
		if errno != 0 {
			t.Fatalf("READDIR at cookie %d: %v", cookie, errno)
		}
		if len(ents) == 0 {
			return all, calls
		}
		calls++
		if calls > 1000 {
			t.Fatalf("READDIR does not end")
		}
		all = append(all, ents...)
		cookie = ents[len(ents)-1].off
	}
}

func names(ents []dirent) (dots map[string]dirent, others []string) {
	dots = map[string]dirent{}
	for _, d := range ents {
		if d.name == "." || d.name == ".." {
			dots[d.name] = d
			continue
		}
		others = append(others, d.name)
	}
	sort.Strings(others)
	return dots, others
}

func TestReadDir(t *testing.T) {
	e := newEnv(t, Options{CacheDir: true})
	want := makeEntries(t, e.share, 40)
	s := newServer(t, e.fs)
	var open fuse.OpenOut
	if errno := e.fs.OpenDir(rootCtx, 1, &fuse.OpenIn{}, &open); errno != 0 {
		t.Fatal(errno)
	}
	if open.OpenFlags != fuse.FopenCacheDir|fuse.FopenKeepCache {
		t.Errorf("opendir flags %#x", open.OpenFlags)
	}
	fh := open.Fh

	all, calls := listAll(t, s, 1, fh, 200, false)
	if calls < 10 {
		t.Errorf("a 200-byte buffer took only %d calls", calls)
	}
	dots, got := names(all)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("listed %v\nwant %v", got, want)
	}
	rootIno := lstat(t, e.share).Ino
	if dots["."].ino != rootIno || dots[".."].ino != rootIno || dots[".."].typ != unix.DT_DIR {
		t.Errorf("dots %+v: want the root's ino %d for both", dots, rootIno)
	}
	for _, d := range all {
		if d.name == "sub" && d.typ != unix.DT_DIR || d.name != "sub" && d.name[0] != '.' && d.typ != unix.DT_REG {
			t.Errorf("%s: type %d", d.name, d.typ)
		}
		if d.name[0] != '.' && d.ino != lstat(t, e.path(d.name)).Ino {
			t.Errorf("%s: ino %d", d.name, d.ino)
		}
	}
	// READDIR takes no references.
	if st := e.fs.Stats(); st.CachedInodes != 1 {
		t.Errorf("READDIR cached %d inodes", st.CachedInodes)
	}

	// Restart from 0, and resume from an old cookie.
	first, _ := s.readdir(t, 1, fh, 0, 4096, false)
	if len(first) != len(all) {
		t.Fatalf("one 4 KiB call: %d entries, want %d", len(first), len(all))
	}
	for i := range first {
		if first[i].name != all[i].name || first[i].off != all[i].off {
			t.Fatalf("entry %d: %+v then %+v", i, all[i], first[i])
		}
	}
	again, _ := s.readdir(t, 1, fh, all[2].off, 100, false)
	if len(again) == 0 || again[0].name != all[3].name {
		t.Errorf("resume after the third entry: %+v, want %s", again, all[3].name)
	}
	// Nothing fits: an empty answer.
	if ents, errno := s.readdir(t, 1, fh, 0, 16, false); errno != 0 || len(ents) != 0 {
		t.Errorf("16-byte READDIR: %v %v", ents, errno)
	}
	// A cookie the guest made up: answered, but no crash; a negative one: EINVAL.
	s.readdir(t, 1, fh, 0xdeadbeef, 4096, false)
	if _, errno := s.readdir(t, 1, fh, 1<<63, 4096, false); errno != unix.EINVAL {
		t.Errorf("cookie 1<<63: %v", errno)
	}

	// ".." of a subdirectory is its real parent.
	sub := e.lookup(t, 1, "sub").NodeID
	sfh := e.openDir(t, sub)
	subAll, _ := listAll(t, s, sub, sfh, 4096, false)
	subDots, subNames := names(subAll)
	if len(subNames) != 0 || subDots["."].ino != lstat(t, e.path("sub")).Ino || subDots[".."].ino != rootIno {
		t.Errorf("sub listing %+v", subAll)
	}

	// Handles are checked: another node's, a file's, unknown, released.
	if _, errno := s.readdir(t, sub, fh, 0, 4096, false); errno != unix.EBADF {
		t.Errorf("READDIR with another node's handle: %v", errno)
	}
	f := e.lookup(t, 1, want[0]).NodeID
	ffh := e.open(t, f, unix.O_RDONLY)
	if _, errno := s.readdir(t, f, ffh, 0, 4096, false); errno != unix.EBADF {
		t.Errorf("READDIR with a file handle: %v", errno)
	}
	if _, errno := s.readdir(t, 1, 777, 0, 4096, false); errno != unix.EBADF {
		t.Errorf("READDIR with an unknown handle: %v", errno)
	}
	wantErrno(t, "ReleaseDir", e.fs.ReleaseDir(rootCtx, 1, &fuse.ReleaseIn{Fh: fh}), 0)
	if _, errno := s.readdir(t, 1, fh, 0, 4096, false); errno != unix.EBADF {
		t.Errorf("READDIR after RELEASEDIR: %v", errno)
	}
	var out fuse.OpenOut
	wantErrno(t, "OpenDir of a file", e.fs.OpenDir(rootCtx, f, &fuse.OpenIn{}, &out), unix.ENOTDIR)
}

func TestReadDirPlus(t *testing.T) {
	e := newEnv(t, Options{})
	want := makeEntries(t, e.share, 30)
	s := newServer(t, e.fs)
	fh := e.openDir(t, 1)

	// The first call: room for three entries (at most 184 bytes each) and a bit more that
	// does not fit a fourth (at least 160 bytes).
	size := uint32(3*184 + 100)
	ents, errno := s.readdir(t, 1, fh, 0, size, true)
	if errno != 0 || len(ents) != 3 {
		t.Fatalf("first READDIRPLUS: %d entries, %v", len(ents), errno)
	}
	_, firstNames := names(ents)
	if st := e.fs.Stats(); st.CachedInodes != 1+len(firstNames) {
		t.Errorf("after listing %v: %d inodes cached, want %d", firstNames, st.CachedInodes, 1+len(firstNames))
	}

	all, _ := listAll(t, s, 1, fh, size, true)
	dots, got := names(all)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("listed %v\nwant %v", got, want)
	}
	if dots["."].entry != (fuse.EntryOut{}) || dots[".."].entry != (fuse.EntryOut{}) {
		t.Errorf("dots carry entries: %+v", dots)
	}
	// The first listing took one reference per entry, the second another.
	listed := map[uint64]int{}
	for _, d := range append(ents, all...) {
		if d.name == "." || d.name == ".." {
			continue
		}
		if d.entry.NodeID == 0 || d.entry.NodeID == 1 || d.entry.Attr.Ino != d.ino || d.ino != lstat(t, e.path(d.name)).Ino {
			t.Errorf("%s: entry %+v ino %d", d.name, d.entry, d.ino)
		}
		if d.typ != d.entry.Attr.Mode>>12 {
			t.Errorf("%s: type %d mode %o", d.name, d.typ, d.entry.Attr.Mode)
		}
		listed[d.entry.NodeID]++
	}
	if len(listed) != len(want) {
		t.Errorf("%d distinct nodes, want %d", len(listed), len(want))
	}
	for id, n := range listed {
		if refs := e.fs.nodes.refs(id); refs != uint64(n) {
			t.Errorf("node %d listed %d times has %d refs", id, n, refs)
		}
	}
	if st := e.fs.Stats(); st.CachedInodes != 1+len(want) {
		t.Errorf("%d inodes cached, want %d", st.CachedInodes, 1+len(want))
	}
	// The guest forgets what it was given: back to the root alone.
	for id, n := range listed {
		e.fs.Forget(id, uint64(n))
	}
	if st := e.fs.Stats(); st.CachedInodes != 1 || st.Fds != 3 {
		t.Errorf("after forgetting: %+v", st)
	}
	// Entries removed after getdents read them ahead, before their lookup, are skipped.
	fh2 := e.openDir(t, 1)
	head, errno := s.readdir(t, 1, fh2, 0, size, true)
	if errno != 0 || len(head) != 3 {
		t.Fatalf("READDIRPLUS: %d entries, %v", len(head), errno)
	}
	removed := map[string]bool{}
	_, listedFirst := names(head)
	for i, name := range want {
		if i%2 == 0 && name != "sub" && !slices.Contains(listedFirst, name) {
			must(t, os.Remove(e.path(name)))
			removed[name] = true
		}
	}
	tail, _ := listFrom(t, s, 1, fh2, head[2].off, size, true)
	rest := append(head, tail...)
	_, got = names(rest)
	if len(got) != len(want)-len(removed) {
		t.Errorf("listed %d after removing %d of %d", len(got), len(removed), len(want))
	}
	for _, name := range got {
		if removed[name] {
			t.Errorf("removed %s listed", name)
		}
	}
	if st := e.fs.Stats(); st.CachedInodes != 1+len(got) {
		t.Errorf("%d inodes cached, want %d", st.CachedInodes, 1+len(got))
	}
}

// READDIRPLUS of entries that are nodes already takes a reference on those nodes and opens
// nothing (lookupEntry); an entry replaced since getdents read it ahead is looked up by what
// it is now.
func TestReadDirPlusKnownEntries(t *testing.T) {
	e := newEnv(t, Options{})
	want := makeEntries(t, e.share, 30)
	must(t, os.WriteFile(e.path("sub", "replacement"), []byte("new"), 0o644))
	ids := map[string]uint64{}
	for _, name := range want {
		ids[name] = e.lookup(t, 1, name).NodeID
	}
	s := newServer(t, e.fs)
	fh := e.openDir(t, 1)
	fds := e.fs.Stats().Fds

	size := uint32(3*184 + 100) // three entries: the rest stays read ahead
	head, errno := s.readdir(t, 1, fh, 0, size, true)
	if errno != 0 || len(head) != 3 {
		t.Fatalf("first READDIRPLUS: %d entries, %v", len(head), errno)
	}
	_, first := names(head)
	victim := ""
	for _, name := range want {
		if name != "sub" && !slices.Contains(first, name) {
			victim = name
			break
		}
	}
	old := lstat(t, e.path(victim)).Ino
	must(t, os.Rename(e.path("sub", "replacement"), e.path(victim)))
	tail, _ := listFrom(t, s, 1, fh, head[len(head)-1].off, size, true)
	all := append(head, tail...)
	if _, got := names(all); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("listed %v\nwant %v", got, want)
	}
	for _, d := range all {
		if d.name == "." || d.name == ".." {
			continue
		}
		ino := lstat(t, e.path(d.name)).Ino
		if d.entry.Attr.Ino != ino || d.ino != ino {
			t.Errorf("%s: ino %d in the entry, %d in the dirent, %d on the host", d.name, d.entry.Attr.Ino, d.ino, ino)
		}
		switch {
		case d.name == victim:
			if d.entry.NodeID == ids[victim] || ino == old || e.fs.nodes.refs(d.entry.NodeID) != 1 {
				t.Errorf("replaced %s: node %d (was %d), ino %d (was %d), %d references", d.name,
					d.entry.NodeID, ids[victim], ino, old, e.fs.nodes.refs(d.entry.NodeID))
			}
		case d.entry.NodeID != ids[d.name] || e.fs.nodes.refs(d.entry.NodeID) != 2:
			t.Errorf("%s: node %d with %d references, looked up as node %d", d.name, d.entry.NodeID,
				e.fs.nodes.refs(d.entry.NodeID), ids[d.name])
		}
	}
	if refs := e.fs.nodes.refs(ids[victim]); refs != 1 {
		t.Errorf("the replaced entry's old node has %d references", refs)
	}
	if got := e.fs.Stats().Fds; got != fds+1 {
		t.Errorf("the listing left %d descriptors, %d before: only the replacement is a new node", got, fds)
	}
}
