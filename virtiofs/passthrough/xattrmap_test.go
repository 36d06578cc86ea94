package passthrough

import (
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

func TestParseXattrMap(t *testing.T) {
	for _, tc := range []struct {
		rules string
		want  []xattrRule
		err   string
	}{
		{rules: ":prefix:all::user.virtiofs.::bad:all:::", want: []xattrRule{
			{xattrPrefix, true, true, "", "user.virtiofs."},
			{xattrBad, true, true, "", ""},
		}},
		{rules: "  /prefix/all/trusted./user.virtiofs./\n /bad/server//trusted./\n\t/bad/client/user.virtiofs.//\n /ok/all/// ", want: []xattrRule{
			{xattrPrefix, true, true, "trusted.", "user.virtiofs."},
			{xattrBad, false, true, "", "trusted."},
			{xattrBad, true, false, "user.virtiofs.", ""},
			{xattrOK, true, true, "", ""},
		}},
		{rules: ":ok:client:user.:x:", want: []xattrRule{{xattrOK, true, false, "user.", "x"}}},
		{rules: "", err: "no rules"},
		{rules: "   ", err: "no rules"},
		{rules: ":ok:all::", err: "rule 1: want :type:scope:key:prepend:"},
		{rules: ":ok:all:::/bad", err: "rule 2: want /type/scope/key/prepend/"},
		{rules: ":nope:all:::", err: `unknown rule type "nope"`},
		{rules: ":ok:guest:::", err: `unknown scope "guest"`},
		{rules: ":map:user.:trusted.:", err: `rule type not supported yet: "map"`},
		{rules: ":ok:all::::unsupported:all:::", err: `rule 2: xattrmap rule type not supported yet: "unsupported"`},
	} {
		m, err := ParseXattrMap(tc.rules)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseXattrMap(%q) = %v, want error containing %q", tc.rules, err, tc.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("ParseXattrMap(%q): %v", tc.rules, err)
			continue
		}
		if !slices.Equal(m.rules, tc.want) {
			t.Errorf("ParseXattrMap(%q) = %+v, want %+v", tc.rules, m.rules, tc.want)
		}
	}
}

func TestXattrMapNames(t *testing.T) {
	// The second example of virtiofsd's documentation: the guest's trusted.* live under
	// user.virtiofs.trusted.* on the host; the host's own trusted.* are hidden.
	m, err := ParseXattrMap("/prefix/all/trusted./user.virtiofs./ /bad/server//trusted./ /bad/client/user.virtiofs.// /ok/all///")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		guest, host string
		errno       fuse.Errno
	}{
		{"trusted.overlay.opaque", "user.virtiofs.trusted.overlay.opaque", 0},
		{"user.color", "user.color", 0},
		{"security.selinux", "security.selinux", 0},
		{"user.virtiofs.trusted.x", "", unix.EPERM}, // the guest may not name the mapped space
	} {
		host, errno := m.toHost(tc.guest)
		if host != tc.host || errno != tc.errno {
			t.Errorf("toHost(%q) = %q, %v; want %q, %v", tc.guest, host, errno, tc.host, tc.errno)
		}
	}
	for _, tc := range []struct {
		host, guest string
		ok          bool
	}{
		{"user.virtiofs.trusted.overlay.opaque", "trusted.overlay.opaque", true},
		{"trusted.host.secret", "", false},
		{"user.color", "user.color", true},
	} {
		guest, ok := m.toGuest(tc.host)
		if guest != tc.guest || ok != tc.ok {
			t.Errorf("toGuest(%q) = %q, %v; want %q, %v", tc.host, guest, ok, tc.guest, tc.ok)
		}
	}
	list := m.listToGuest([]byte("user.virtiofs.trusted.a\x00trusted.b\x00user.c\x00"))
	if string(list) != "trusted.a\x00user.c\x00" {
		t.Errorf("listToGuest = %q", list)
	}

	// No rule matches: refused, and hidden.
	m, err = ParseXattrMap(":ok:client:user.::")
	if err != nil {
		t.Fatal(err)
	}
	if _, errno := m.toHost("security.selinux"); errno != unix.EPERM {
		t.Errorf("unmatched toHost errno %v, want EPERM", errno)
	}
	if _, ok := m.toGuest("user.a"); ok {
		t.Errorf("a client-only rule matched a host name")
	}
	var none *XattrMap
	if h, errno := none.toHost("user.a"); h != "user.a" || errno != 0 {
		t.Errorf("nil map toHost = %q, %v", h, errno)
	}
}

func TestXattrMapPassthrough(t *testing.T) {
	needRoot(t)
	m, err := ParseXattrMap(":prefix:all::user.virtiofs.::bad:all:::")
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, Options{Xattr: true, XattrMap: m})
	must(t, os.WriteFile(e.path("f"), nil, 0o644))
	must(t, unix.Setxattr(e.path("f"), "user.host", []byte("h"), 0))
	f := e.lookup(t, 1, "f").NodeID
	wantErrno(t, "SetXattr", e.fs.SetXattr(rootCtx, f, "trusted.x", []byte("1"), 0), 0)
	buf := make([]byte, 16)
	if n, err := unix.Getxattr(e.path("f"), "user.virtiofs.trusted.x", buf); err != nil || string(buf[:n]) != "1" {
		t.Errorf("host user.virtiofs.trusted.x = %q, %v", buf[:max(n, 0)], err)
	}
	if n, errno := e.fs.GetXattr(rootCtx, f, "trusted.x", buf); errno != 0 || string(buf[:n]) != "1" {
		t.Errorf("GetXattr trusted.x = %q, %v", buf[:max(n, 0)], errno)
	}
	n, errno := e.fs.ListXattr(rootCtx, f, nil)
	if errno != 0 || n != len("trusted.x\x00") {
		t.Errorf("ListXattr size = %d, %v; want %d (user.host hidden)", n, errno, len("trusted.x\x00"))
	}
	_, errno = e.fs.ListXattr(rootCtx, f, make([]byte, 3))
	wantErrno(t, "ListXattr small", errno, unix.ERANGE)
	n, errno = e.fs.ListXattr(rootCtx, f, buf)
	if errno != 0 || string(buf[:n]) != "trusted.x\x00" {
		t.Errorf("ListXattr = %q, %v", buf[:n], errno)
	}
	wantErrno(t, "RemoveXattr", e.fs.RemoveXattr(rootCtx, f, "trusted.x"), 0)
	if _, err := unix.Getxattr(e.path("f"), "user.virtiofs.trusted.x", nil); err != unix.ENODATA {
		t.Errorf("host attribute after RemoveXattr: %v", err)
	}
}
