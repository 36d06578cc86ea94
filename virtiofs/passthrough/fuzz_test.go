package passthrough

import (
	"flag"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/kvfs/kvfs/internal/testing/fuzzseed"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// FuzzXattrMap parses an xattrmap and maps a name and a host list through it. Whatever parses
// must print back (formatXattrMap) to rules that parse to the same map; a guest name must map to
// a host name or EPERM, never to DAXXattr; the guest's view of a host list holds only non-empty
// names without NUL, each the mapping of a listed host name, DAXXattr never among them.
func FuzzXattrMap(f *testing.F) {
	f.Fuzz(func(t *testing.T, rules, name string, list []byte) {
		m, err := ParseXattrMap(rules)
		if err != nil {
			if m != nil {
				t.Fatalf("ParseXattrMap(%q) returned a map and %v", rules, err)
			}
			return
		}
		if len(m.rules) == 0 {
			t.Fatalf("ParseXattrMap(%q): no rules and no error", rules)
		}
		if text, ok := formatXattrMap(m); ok {
			again, err := ParseXattrMap(text)
			if err != nil {
				t.Fatalf("ParseXattrMap(%q) = %+v prints as %q, which does not parse: %v", rules, m.rules, text, err)
			}
			if !reflect.DeepEqual(again.rules, m.rules) {
				t.Fatalf("ParseXattrMap(%q) = %+v prints as %q, which parses to %+v", rules, m.rules, text, again.rules)
			}
		}

		host, e := m.toHost(name)
		switch {
		case e != fuse.OK && e != unix.EPERM:
			t.Errorf("toHost(%q) = %v, want a name or EPERM", name, e)
		case e == fuse.OK && host == DAXXattr:
			t.Errorf("toHost(%q) = %s, the DAX policy attribute", name, DAXXattr)
		case e == fuse.OK && !strings.HasSuffix(host, name):
			t.Errorf("toHost(%q) = %q: a mapping only ever prepends", name, host)
		}

		hostNames := map[string]bool{}
		for _, n := range strings.Split(string(list), "\x00") {
			hostNames[n] = true
		}
		out := m.listToGuest(list)
		if len(out) > 0 && out[len(out)-1] != 0 {
			t.Fatalf("listToGuest(%q) = %q: not NUL-terminated", list, out)
		}
		for _, g := range strings.Split(strings.TrimSuffix(string(out), "\x00"), "\x00") {
			if len(out) == 0 {
				break
			}
			if g == "" {
				t.Fatalf("listToGuest(%q) = %q: an empty name", list, out)
			}
			found := false
			for h := range hostNames {
				if mapped, ok := m.toGuest(h); ok && mapped == g && h != DAXXattr {
					found = true
					break
				}
			}
			if !found {
				t.Fatalf("listToGuest(%q) lists %q, the mapping of no host name", list, g)
			}
		}
	})
}

// formatXattrMap prints m in the rule language, with a separator none of its fields contains;
// false if every candidate separator appears in some field.
func formatXattrMap(m *XattrMap) (string, bool) {
	types := map[xattrRuleType]string{xattrPrefix: "prefix", xattrOK: "ok", xattrBad: "bad"}
	scope := func(r xattrRule) string {
		switch {
		case r.client && r.server:
			return "all"
		case r.client:
			return "client"
		}
		return "server"
	}
	for _, sep := range ":/|,;!#%&=@" {
		s := string(sep)
		clash := false
		for _, r := range m.rules {
			clash = clash || strings.Contains(r.key, s) || strings.Contains(r.prepend, s)
		}
		if clash {
			continue
		}
		var b strings.Builder
		for _, r := range m.rules {
			fmt.Fprintf(&b, "%s%s%s%s%s%s%s%s%s ", s, types[r.typ], s, scope(r), s, r.key, s, r.prepend, s)
		}
		return b.String(), true
	}
	return "", false
}

// FuzzDAXRules parses DAX rules. Whatever parses must be a valid policy, print back
// (formatDAXRules) to text that parses to the same rules, and say for every rule each
// condition it was given exactly once.
func FuzzDAXRules(f *testing.F) {
	f.Fuzz(func(t *testing.T, text string) {
		rules, err := ParseDAXRules(text)
		if err != nil {
			if rules != nil {
				t.Fatalf("ParseDAXRules(%q) returned rules and %v", text, err)
			}
			return
		}
		p := DAXPolicy{Mode: DAXInode, Rules: rules}
		if err := p.Validate(); err != nil {
			t.Fatalf("ParseDAXRules(%q) = %+v, an invalid policy: %v", text, rules, err)
		}
		printed := formatDAXRules(rules)
		again, err := ParseDAXRules(printed)
		if err != nil || !reflect.DeepEqual(again, rules) {
			t.Fatalf("ParseDAXRules(%q) = %+v prints as %q, which parses to %+v, %v", text, rules, printed, again, err)
		}
		// Each rule of the text is one of the result, with its conditions.
		var texts []string
		for _, r := range strings.Split(text, ";") {
			if strings.TrimSpace(r) != "" {
				texts = append(texts, r)
			}
		}
		if len(texts) != len(rules) {
			t.Fatalf("ParseDAXRules(%q): %d rules in the text, %d parsed", text, len(texts), len(rules))
		}
		for i, r := range texts {
			for _, cond := range []string{"glob=", "size>="} {
				if n := strings.Count(" "+strings.Join(strings.Fields(r), " "), " "+cond); n > 1 {
					t.Fatalf("ParseDAXRules(%q): rule %d gives %s %d times, yet parsed to %+v", text, i+1, cond, n, rules[i])
				}
			}
		}
	})
}

// formatDAXRules prints rules in ParseDAXRules' language.
func formatDAXRules(rules []DAXRule) string {
	var parts []string
	for _, r := range rules {
		s := "off"
		if r.DAX {
			s = "on"
		}
		if r.Glob != "" {
			s += " glob=" + r.Glob
		}
		if r.MinSize != 0 {
			s += " size>=" + strconv.FormatUint(r.MinSize, 10)
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

// The seed corpora, by target and file name: each file holds the target's arguments.
func parserSeeds() map[string]map[string][]any {
	return map[string]map[string][]any{
		"FuzzXattrMap": {
			// virtiofsd's documented examples.
			"virtiofsd-prefix-all": {":prefix:all::user.virtiofs.::bad:all:::", "trusted.x", []byte("user.virtiofs.trusted.x\x00user.y\x00")},
			"virtiofsd-trusted": {"/prefix/all/trusted./user.virtiofs./ /bad/server//trusted./ /bad/client/user.virtiofs.// /ok/all///",
				"trusted.overlay.opaque", []byte("user.virtiofs.trusted.overlay.opaque\x00trusted.host\x00security.selinux\x00")},
			"ok-client-only":   {":ok:client:user.::", "user.a", []byte("user.a\x00")},
			"dax-attr-prefix":  {":prefix:all::trusted.kvfs.::ok:all:::", "dax", []byte("trusted.kvfs.dax\x00trusted.kvfs.other\x00")},
			"dax-attr-ok":      {":ok:all:::", DAXXattr, []byte(DAXXattr + "\x00")},
			"empty-after-cut":  {":prefix:server::user.::bad:all:::", "x", []byte("user.\x00user.a")},
			"separator-in-key": {"|ok|all|a:b|c:d| :bad:all:::", "a:bc", []byte{}},
			"whitespace":       {" \t\n:ok:all:::\n", "n", []byte("\x00\x00")},
			"map-type":         {":map:user.:trusted.:", "user.x", []byte{}},
			"unsupported-type": {":ok:all::::unsupported:all:::", "x", []byte{}},
			"truncated":        {":ok:all::", "x", []byte{}},
			"multibyte-sep":    {"éokéallééé", "x", []byte("y\x00")},
		},
		"FuzzDAXRules": {
			"documented":      {"on glob=*.so; on size>=2M; off glob=tmp/*"},
			"sizes":           {"off size>=3K;on size>=1G; on size>=0"},
			"bare":            {"on"},
			"empty":           {""},
			"blank":           {" \t "},
			"empty-rule":      {"on;;off"},
			"bad-glob":        {"on glob=["},
			"absolute":        {"on glob=/etc/*"},
			"overflow":        {"on size>=17179869184G"},
			"unknown":         {"on color=red"},
			"duplicate-glob":  {"on glob=a glob=b"},
			"duplicate-size":  {"off size>=1 size>=2M"},
			"path-glob":       {"on glob=lib/*/*.so size>=4096"},
			"trailing-semi":   {"on glob=*.so;"},
			"glob-of-equals":  {"on glob=glob=x"},
			"max-rules-plus1": {strings.Repeat("on;", MaxDAXRules) + "on"},
		},
	}
}

var updateParserSeeds = flag.Bool("update-fuzz-seeds", false,
	"rewrite testdata/fuzz/FuzzXattrMap and FuzzDAXRules from parserSeeds")

// TestParserSeedCorpus keeps the seed files in testdata in sync with parserSeeds; run with
// -update-fuzz-seeds to rewrite them. Files not generated (crashers kept as regression seeds)
// are left alone.
func TestParserSeedCorpus(t *testing.T) {
	for target, seeds := range parserSeeds() {
		files := map[string]string{}
		for name, args := range seeds {
			want := "go test fuzz v1\n"
			for _, a := range args {
				switch v := a.(type) {
				case string:
					want += fmt.Sprintf("string(%q)\n", v)
				case []byte:
					want += fmt.Sprintf("[]byte(%q)\n", v)
				}
			}
			files[name] = want
		}
		fuzzseed.Check(t, target, files, *updateParserSeeds, "go test -run TestParserSeedCorpus -update-fuzz-seeds")
	}
}
