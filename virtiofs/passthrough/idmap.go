package passthrough

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// IDRuleKind is a kind of rule of an IDTranslation, as virtiofsd's --translate-uid and
// --translate-gid name them.
type IDRuleKind string

// The kinds of rule. From is the first id of the range the rule reads from (the guest's for
// guest, squash-guest, forbid-guest and map; the host's for host and squash-host), To the
// first id it gives (or the one id, squashing), Count the length of the range.
const (
	IDGuest       IDRuleKind = "guest"        // guest ids to host ids, 1:1
	IDHost        IDRuleKind = "host"         // host ids to guest ids, 1:1
	IDSquashGuest IDRuleKind = "squash-guest" // guest ids all to the host id To
	IDSquashHost  IDRuleKind = "squash-host"  // host ids all to the guest id To
	IDForbidGuest IDRuleKind = "forbid-guest" // guest ids refused (EPERM); To unused
	IDMap         IDRuleKind = "map"          // guest and host ids 1:1 both ways: guest and host rules
)

// IDRule is one rule of an IDTranslation.
type IDRule struct {
	Kind            IDRuleKind
	From, To, Count uint32
}

func (r IDRule) String() string {
	if r.Kind == IDForbidGuest {
		return fmt.Sprintf("%s:%d:%d", r.Kind, r.From, r.Count)
	}
	return fmt.Sprintf("%s:%d:%d:%d", r.Kind, r.From, r.To, r.Count)
}

// IDTranslation translates user ids, or group ids, between the guest and the host
// (virtiofsd's --translate-uid and --translate-gid): a guest's id, in a request's caller or a
// SETATTR's new owner, becomes a host id before the host sees it, or the request fails with
// EPERM if a forbid-guest rule covers it; a host id becomes a guest id in every attribute
// reply. Each direction is a set of disjoint ranges; an id no range covers is left as it is.
// The two directions need not be inverses. The zero value translates nothing.
type IDTranslation struct {
	toHost, toGuest []idRange // sorted by from, disjoint
}

// idRange maps [from, from+count) (64-bit: a range may end at 2^32): by offset to to, or all
// to to when squash, or nowhere when forbid.
type idRange struct {
	from, end      uint64
	to             uint32
	squash, forbid bool
	rule           IDRule
}

// Add adds r; a range that meets one already in its direction is refused, as is an empty one
// or one past 2^32 on either side.
func (t *IDTranslation) Add(r IDRule) error {
	if r.Count == 0 {
		return fmt.Errorf("%v: an empty range", r)
	}
	from, end := uint64(r.From), uint64(r.From)+uint64(r.Count)
	if end > 1<<32 || r.Kind != IDForbidGuest && !isSquash(r.Kind) && uint64(r.To)+uint64(r.Count) > 1<<32 {
		return fmt.Errorf("%v: the range goes past the last id (%d)", r, uint32(1<<32-1))
	}
	add := func(dir *[]idRange, e idRange) error {
		i := sort.Search(len(*dir), func(i int) bool { return (*dir)[i].from >= e.from })
		switch {
		case i > 0 && (*dir)[i-1].end > e.from:
			return fmt.Errorf("%v: its range meets that of %v", r, (*dir)[i-1].rule)
		case i < len(*dir) && (*dir)[i].from < e.end:
			return fmt.Errorf("%v: its range meets that of %v", r, (*dir)[i].rule)
		}
		*dir = slices.Insert(*dir, i, e)
		return nil
	}
	e := idRange{from: from, end: end, to: r.To, rule: r}
	switch r.Kind {
	case IDGuest:
		return add(&t.toHost, e)
	case IDHost:
		return add(&t.toGuest, e)
	case IDSquashGuest:
		e.squash = true
		return add(&t.toHost, e)
	case IDSquashHost:
		e.squash = true
		return add(&t.toGuest, e)
	case IDForbidGuest:
		e.forbid = true
		return add(&t.toHost, e)
	case IDMap:
		back := idRange{from: uint64(r.To), end: uint64(r.To) + uint64(r.Count), to: r.From, rule: r}
		// Checked both ways before either is added.
		saved := slices.Clone(t.toHost)
		if err := add(&t.toHost, e); err != nil {
			return err
		}
		if err := add(&t.toGuest, back); err != nil {
			t.toHost = saved
			return err
		}
		return nil
	}
	return fmt.Errorf("%v: unknown kind %q: want guest, host, squash-guest, squash-host, forbid-guest or map", r, r.Kind)
}

func isSquash(k IDRuleKind) bool { return k == IDSquashGuest || k == IDSquashHost }

// Empty says whether t translates nothing.
func (t *IDTranslation) Empty() bool { return t == nil || len(t.toHost) == 0 && len(t.toGuest) == 0 }

// ToHost is the host id of the guest's id; ok is false if a forbid-guest rule covers it.
func (t *IDTranslation) ToHost(id uint32) (host uint32, ok bool) {
	if t == nil {
		return id, true
	}
	e, found := lookupID(t.toHost, id)
	switch {
	case !found:
		return id, true
	case e.forbid:
		return 0, false
	}
	return e.apply(id), true
}

// ToGuest is the guest's id of the host id.
func (t *IDTranslation) ToGuest(id uint32) uint32 {
	if t == nil {
		return id
	}
	if e, found := lookupID(t.toGuest, id); found {
		return e.apply(id)
	}
	return id
}

func (e idRange) apply(id uint32) uint32 {
	if e.squash {
		return e.to
	}
	return e.to + uint32(uint64(id)-e.from)
}

func lookupID(rs []idRange, id uint32) (idRange, bool) {
	v := uint64(id)
	// The first range that ends after id: it holds id if it starts at or before it.
	i := sort.Search(len(rs), func(i int) bool { return rs[i].end > v })
	if i < len(rs) && rs[i].from <= v {
		return rs[i], true
	}
	return idRange{}, false
}

// ParseIDRule parses a rule as virtiofsd's --translate-uid and --translate-gid take it:
// KIND:FROM:TO:COUNT, or forbid-guest:FROM:COUNT.
func ParseIDRule(s string) (IDRule, error) {
	f := strings.Split(s, ":")
	r := IDRule{Kind: IDRuleKind(f[0])}
	want := 4
	switch r.Kind {
	case IDGuest, IDHost, IDSquashGuest, IDSquashHost, IDMap:
	case IDForbidGuest:
		want = 3
	default:
		return r, fmt.Errorf("%q: unknown kind %q: want guest, host, squash-guest, squash-host, forbid-guest or map", s, f[0])
	}
	if len(f) != want {
		if want == 3 {
			return r, fmt.Errorf("%q: want forbid-guest:FROM:COUNT", s)
		}
		return r, fmt.Errorf("%q: want %s:FROM:TO:COUNT", s, r.Kind)
	}
	nums := make([]uint32, 0, 3)
	for _, x := range f[1:] {
		n, err := strconv.ParseUint(x, 10, 32)
		if err != nil {
			return r, fmt.Errorf("%q: %q is not an id or count (0 to %d)", s, x, uint32(1<<32-1))
		}
		nums = append(nums, uint32(n))
	}
	if want == 3 {
		r.From, r.Count = nums[0], nums[1]
	} else {
		r.From, r.To, r.Count = nums[0], nums[1], nums[2]
	}
	return r, nil
}

// NewIDTranslation is the translation of rules, added in order (Add).
func NewIDTranslation(rules []IDRule) (*IDTranslation, error) {
	t := &IDTranslation{}
	for _, r := range rules {
		if err := t.Add(r); err != nil {
			return nil, err
		}
	}
	return t, nil
}
