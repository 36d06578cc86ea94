package passthrough

import (
	"errors"
	"fmt"
	"strings"
	"unicode"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// XattrMap translates extended attribute names between the guest and the host, in the rule
// language of virtiofsd's xattrmap option. A rule is
//
//	:type:scope:key:prepend:
//
// where the first character of the rule (here ':') separates its fields; white space may
// surround rules. scope is client (the rule applies to names the guest sends in SETXATTR,
// GETXATTR and REMOVEXATTR, matched when they start with key), server (names the host lists
// for LISTXATTR, matched when they start with prepend) or all (both). type is
//
//   - prefix: a guest name gets prepend put in front of it; a host name loses prepend;
//   - ok: the name passes unchanged;
//   - bad: a guest name is refused with EPERM; a host name is left out of the list.
//
// The first matching rule decides; a name no rule matches is treated as bad. virtiofsd's map
// and unsupported rule types are not implemented and are refused by ParseXattrMap.
type XattrMap struct {
	rules []xattrRule
}

// ErrXattrRuleNotSupported is wrapped by ParseXattrMap's error for the rule types of
// virtiofsd not implemented here.
var ErrXattrRuleNotSupported = errors.New("xattrmap rule type not supported yet")

type xattrRuleType int

const (
	xattrPrefix xattrRuleType = iota
	xattrOK
	xattrBad
)

type xattrRule struct {
	typ            xattrRuleType
	client, server bool // the scope
	key, prepend   string
}

// ParseXattrMap parses rules; see XattrMap.
func ParseXattrMap(rules string) (*XattrMap, error) {
	m := &XattrMap{}
	s := strings.TrimLeftFunc(rules, unicode.IsSpace)
	for s != "" {
		sep := s[:1]
		var f [4]string
		rest := s[1:]
		for i := range f {
			j := strings.Index(rest, sep)
			if j < 0 {
				return nil, fmt.Errorf("xattrmap rule %d: want %stype%sscope%skey%sprepend%s",
					len(m.rules)+1, sep, sep, sep, sep, sep)
			}
			f[i], rest = rest[:j], rest[j+1:]
			if i == 0 && (f[0] == "map" || f[0] == "unsupported") {
				return nil, fmt.Errorf("xattrmap rule %d: %w: %q (prefix, ok and bad are)",
					len(m.rules)+1, ErrXattrRuleNotSupported, f[0])
			}
		}
		r, err := newXattrRule(f)
		if err != nil {
			return nil, fmt.Errorf("xattrmap rule %d: %w", len(m.rules)+1, err)
		}
		m.rules = append(m.rules, r)
		s = strings.TrimLeftFunc(rest, unicode.IsSpace)
	}
	if len(m.rules) == 0 {
		return nil, errors.New("xattrmap: no rules")
	}
	return m, nil
}

func newXattrRule(f [4]string) (xattrRule, error) {
	var r xattrRule
	switch f[0] {
	case "prefix":
		r.typ = xattrPrefix
	case "ok":
		r.typ = xattrOK
	case "bad":
		r.typ = xattrBad
	default:
		return r, fmt.Errorf("unknown rule type %q: want prefix, ok or bad", f[0])
	}
	switch f[1] {
	case "client":
		r.client = true
	case "server":
		r.server = true
	case "all":
		r.client, r.server = true, true
	default:
		return r, fmt.Errorf("unknown scope %q: want client, server or all", f[1])
	}
	r.key, r.prepend = f[2], f[3]
	return r, nil
}

// toHost maps a name from the guest to the host's name, or refuses it with EPERM. The DAX
// policy attribute (DAXXattr) is the host's alone: whatever name maps onto it is refused.
func (m *XattrMap) toHost(name string) (string, fuse.Errno) {
	name, e := m.mapToHost(name)
	if e == fuse.OK && name == DAXXattr {
		return "", unix.EPERM
	}
	return name, e
}

func (m *XattrMap) mapToHost(name string) (string, fuse.Errno) {
	if m == nil {
		return name, fuse.OK
	}
	for _, r := range m.rules {
		if !r.client || !strings.HasPrefix(name, r.key) {
			continue
		}
		switch r.typ {
		case xattrPrefix:
			return r.prepend + name, fuse.OK
		case xattrOK:
			return name, fuse.OK
		}
		return "", unix.EPERM // bad
	}
	return "", unix.EPERM
}

// toGuest maps a name the host listed to the name the guest sees; false hides it. DAXXattr is
// always hidden.
func (m *XattrMap) toGuest(name string) (string, bool) {
	if name == DAXXattr {
		return "", false
	}
	if m == nil {
		return name, true
	}
	for _, r := range m.rules {
		if !r.server || !strings.HasPrefix(name, r.prepend) {
			continue
		}
		switch r.typ {
		case xattrPrefix:
			return name[len(r.prepend):], true
		case xattrOK:
			return name, true
		}
		return "", false // bad
	}
	return "", false
}

// listToGuest maps the NUL-separated host list into the guest's, dropping hidden names and
// any that map to an empty name.
func (m *XattrMap) listToGuest(list []byte) []byte {
	var out []byte
	for len(list) > 0 {
		i := strings.IndexByte(string(list), 0)
		if i < 0 {
			i = len(list) // no final NUL: take the rest
		}
		if name, ok := m.toGuest(string(list[:i])); ok && name != "" {
			out = append(append(out, name...), 0)
		}
		list = list[min(i+1, len(list)):]
	}
	return out
}
