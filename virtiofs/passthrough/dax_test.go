package passthrough

import (
	"reflect"
	"testing"
)

func TestParseDAXRules(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []DAXRule
	}{
		{"", nil},
		{"  ", nil},
		{"on glob=*.so", []DAXRule{{Glob: "*.so", DAX: true}}},
		{"on glob=*.so; on size>=2M; off glob=tmp/* size>=1", []DAXRule{
			{Glob: "*.so", DAX: true}, {MinSize: 2 << 20, DAX: true}, {Glob: "tmp/*", MinSize: 1}}},
		{"off size>=3K;on size>=1G", []DAXRule{{MinSize: 3 << 10}, {MinSize: 1 << 30, DAX: true}}},
		{"on", []DAXRule{{DAX: true}}},
	} {
		got, err := ParseDAXRules(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseDAXRules(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"maybe", "on;;off", "on glob=[", "on glob=/etc/*", "on size>=x",
		"on size>=99999999999999999999", "on size>=17179869184G", "on color=red", "on glob=", ";",
		"on glob=a glob=b", "off size>=1 size>=2M"} {
		if got, err := ParseDAXRules(bad); err == nil {
			t.Errorf("ParseDAXRules(%q) = %+v, want an error", bad, got)
		}
	}
	for _, m := range []DAXMode{DAXNever, DAXAlways, DAXInode} {
		if got, err := ParseDAXMode(m.String()); err != nil || got != m {
			t.Errorf("ParseDAXMode(%v) = %v, %v", m, got, err)
		}
	}
	if _, err := ParseDAXMode("sometimes"); err == nil {
		t.Error("ParseDAXMode accepted sometimes")
	}
}
