package passthrough

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/fuse"
)

func TestIDTranslation(t *testing.T) {
	tr, err := NewIDTranslation([]IDRule{
		{Kind: IDMap, From: 0, To: 100000, Count: 1000},
		{Kind: IDForbidGuest, From: 1000, Count: 10},
		{Kind: IDSquashGuest, From: 2000, To: 65534, Count: 100},
		{Kind: IDSquashHost, From: 500000, To: 99, Count: 1 << 16},
		{Kind: IDGuest, From: 4294967290, To: 7, Count: 6}, // up to the last id
		{Kind: IDHost, From: 7, To: 17, Count: 1},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		guest, host uint32
		ok          bool
	}{
		{0, 100000, true}, {999, 100999, true}, {1000, 0, false}, {1009, 0, false}, {1010, 1010, true},
		{2000, 65534, true}, {2099, 65534, true}, {2100, 2100, true}, {4294967290, 7, true}, {4294967295, 12, true},
	} {
		if host, ok := tr.ToHost(tc.guest); host != tc.host || ok != tc.ok {
			t.Errorf("ToHost(%d) = %d, %v; want %d, %v", tc.guest, host, ok, tc.host, tc.ok)
		}
	}
	for host, guest := range map[uint32]uint32{100000: 0, 100999: 999, 101000: 101000, 500000: 99, 565535: 99, 565536: 565536, 7: 17, 0: 0} {
		if got := tr.ToGuest(host); got != guest {
			t.Errorf("ToGuest(%d) = %d, want %d", host, got, guest)
		}
	}
	var none *IDTranslation
	if h, ok := none.ToHost(5); h != 5 || !ok || none.ToGuest(6) != 6 || !none.Empty() {
		t.Error("a nil translation translates")
	}

	for _, tc := range []struct {
		rules []IDRule
		want  string
	}{
		{[]IDRule{{Kind: IDGuest, From: 10, To: 0, Count: 10}, {Kind: IDForbidGuest, From: 19, Count: 1}}, "forbid-guest:19:1: its range meets that of guest:10:0:10"},
		{[]IDRule{{Kind: IDHost, From: 10, To: 0, Count: 10}, {Kind: IDMap, From: 100, To: 5, Count: 6}}, "map:100:5:6: its range meets that of host:10:0:10"},
		{[]IDRule{{Kind: IDSquashHost, From: 10, To: 0, Count: 0}}, "an empty range"},
		{[]IDRule{{Kind: IDMap, From: 0, To: 4294967295, Count: 2}}, "past the last id"},
		{[]IDRule{{Kind: "swap", Count: 1}}, `unknown kind "swap"`},
	} {
		if _, err := NewIDTranslation(tc.rules); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.rules, err, tc.want)
		}
	}
	// A map refused on its host side leaves its guest side out too.
	tr2, _ := NewIDTranslation([]IDRule{{Kind: IDHost, From: 50, To: 0, Count: 1}})
	if err := tr2.Add(IDRule{Kind: IDMap, From: 0, To: 50, Count: 1}); err == nil {
		t.Fatal("a map meeting a host rule was added")
	}
	if h, _ := tr2.ToHost(0); h != 0 {
		t.Errorf("a refused map's guest side stayed: 0 → %d", h)
	}
}

func TestParseIDRule(t *testing.T) {
	for s, want := range map[string]IDRule{
		"map:0:100000:65536":        {Kind: IDMap, From: 0, To: 100000, Count: 65536},
		"forbid-guest:5:4294967290": {Kind: IDForbidGuest, From: 5, Count: 4294967290},
		"squash-host:1:2:3":         {Kind: IDSquashHost, From: 1, To: 2, Count: 3},
	} {
		if r, err := ParseIDRule(s); err != nil || r != want || r.String() != s {
			t.Errorf("ParseIDRule(%q) = %+v (%v), %v; want %+v", s, r, r, err, want)
		}
	}
	for s, want := range map[string]string{
		"map:0:1":              "want map:FROM:TO:COUNT",
		"forbid-guest:0:1:1":   "want forbid-guest:FROM:COUNT",
		"guest:0:-1:1":         `"-1" is not an id`,
		"guest:0:4294967296:1": `"4294967296" is not an id`,
		"":                     "unknown kind",
	} {
		if _, err := ParseIDRule(s); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseIDRule(%q): %v, want %q", s, err, want)
		}
	}
}

// TestTranslatedOwners: with guest ids 0-999 mapped to host ids 100000-100999 and guest ids
// 1000-1009 forbidden, a file a guest root creates is the host's 100000, a host file of 100005
// is the guest's 5 in GETATTR and LOOKUP, a chown to guest 7 lands as host 100007, and a
// forbidden caller or chown is EPERM with nothing changed.
func TestTranslatedOwners(t *testing.T) {
	needRoot(t)
	uids, err := NewIDTranslation([]IDRule{{Kind: IDMap, From: 0, To: 100000, Count: 1000}, {Kind: IDForbidGuest, From: 1000, Count: 10}})
	must(t, err)
	gids, err := NewIDTranslation([]IDRule{{Kind: IDMap, From: 0, To: 200000, Count: 1000}})
	must(t, err)
	e := newEnv(t, Options{UIDs: uids, GIDs: gids})
	must(t, os.Chmod(e.share, 0o777))

	root := &fuse.Context{UID: 0, GID: 0}
	ent, _ := e.create(t, root, fuse.RootID, "made", unix.S_IFREG|0o644)
	if st := lstat(t, e.path("made")); st.Uid != 100000 || st.Gid != 200000 {
		t.Errorf("a file guest root made is the host's %d:%d, want 100000:200000", st.Uid, st.Gid)
	}
	if ent.Attr.UID != 0 || ent.Attr.GID != 0 {
		t.Errorf("its entry says %d:%d, want the guest's 0:0", ent.Attr.UID, ent.Attr.GID)
	}

	must(t, os.WriteFile(e.path("host"), nil, 0o644))
	must(t, os.Chown(e.path("host"), 100005, 300000))
	h := e.lookup(t, fuse.RootID, "host")
	if h.Attr.UID != 5 || h.Attr.GID != 300000 {
		t.Errorf("LOOKUP of the host's 100005:300000: %d:%d, want 5:300000 (the gid out of every rule)", h.Attr.UID, h.Attr.GID)
	}
	var out fuse.AttrOut
	if errno := e.fs.SetAttr(root, h.NodeID, &fuse.SetattrIn{Valid: fuse.FattrUID | fuse.FattrGID, UID: 7, GID: 8}, &out); errno != 0 {
		t.Fatal(errno)
	}
	if st := lstat(t, e.path("host")); st.Uid != 100007 || st.Gid != 200008 || out.Attr.UID != 7 || out.Attr.GID != 8 {
		t.Errorf("chown to guest 7:8: host %d:%d, answer %d:%d; want 100007:200008, 7:8", st.Uid, st.Gid, out.Attr.UID, out.Attr.GID)
	}

	// Forbidden: a chown (the mode with it untouched) and a caller.
	if errno := e.fs.SetAttr(root, h.NodeID, &fuse.SetattrIn{Valid: fuse.FattrMode | fuse.FattrUID, Mode: 0o600, UID: 1003}, &out); errno != unix.EPERM {
		t.Errorf("chown to a forbidden id: %v, want EPERM", errno)
	}
	if st := lstat(t, e.path("host")); st.Uid != 100007 || st.Mode&0o777 != 0o644 {
		t.Errorf("a refused chown changed the file: uid %d, mode %o", st.Uid, st.Mode&0o777)
	}
	var entry fuse.EntryOut
	if errno := e.fs.Mkdir(&fuse.Context{UID: 1009, GID: 0}, fuse.RootID, "d", &fuse.MkdirIn{Mode: 0o755}, &entry); errno != unix.EPERM {
		t.Errorf("mkdir by a forbidden caller: %v, want EPERM", errno)
	}
	if _, err := os.Lstat(e.path("d")); !os.IsNotExist(err) {
		t.Errorf("a forbidden caller's mkdir made it: %v", err)
	}
}
