package agent

import (
	"fmt"
	"strings"
	"testing"
)

func TestSysctlPath(t *testing.T) {
	for name, want := range map[string]string{
		"kernel.shm_rmid_forced":           "kernel/shm_rmid_forced",
		"net.ipv4.conf.all.rp_filter":      "net/ipv4/conf/all/rp_filter",
		"net/ipv4/conf/eth0.100/rp_filter": "net/ipv4/conf/eth0.100/rp_filter",
		"net.ipv6.conf.veth-a_1.mtu":       "net/ipv6/conf/veth-a_1/mtu",
	} {
		if got, err := SysctlPath(name); err != nil || got != want {
			t.Errorf("SysctlPath(%q) = %q, %v; want %q", name, got, err, want)
		}
	}
	for _, name := range []string{"", "kernel..x", ".kernel", "kernel.", "net/../x", "net/./x", "/kernel/x",
		"kernel.x y", "kernel.x\x00", "kernel.*", strings.Repeat("a", 257)} {
		if got, err := SysctlPath(name); err == nil {
			t.Errorf("SysctlPath(%q) = %q, want an error", name, got)
		}
	}
}

func TestCheckSysctls(t *testing.T) {
	if err := CheckSysctls(map[string]string{"net.ipv4.ping_group_range": "0\t2147483647", "kernel.sem": "250 32000 32 128"}); err != nil {
		t.Error(err)
	}
	many := map[string]string{}
	for i := range maxSysctls + 1 {
		many["kernel.x"+strings.Repeat("y", i)] = "1"
	}
	for what, m := range map[string]map[string]string{
		"a newline":    {"kernel.sem": "1\n2"},
		"a long value": {"kernel.sem": strings.Repeat("1", 4097)},
		"a bad name":   {"kernel..sem": "1"},
		"too many":     many,
	} {
		if err := CheckSysctls(m); err == nil {
			t.Errorf("%s: no error", what)
		}
	}
}

func TestCheckSubmounts(t *testing.T) {
	ok := []string{SharedDir + "/c1/sub", SharedDir + "/c1-0-vol/a b/tmp"}
	if err := CheckSubmounts(ok); err != nil {
		t.Errorf("CheckSubmounts(%q): %v", ok, err)
	}
	for _, bad := range [][]string{
		{SharedDir},
		{SharedDir + "/"},
		{SharedDir + "x/a"},
		{"/etc"},
		{"c1/sub"},
		{SharedDir + "/c1/../../../etc"},
		{SharedDir + "/c1/sub/"},
		{SharedDir + "/c1/\x00"},
		{SharedDir + "/" + strings.Repeat("a", 4096)},
		make([]string, MaxSubmounts+1),
	} {
		if err := CheckSubmounts(bad); err == nil {
			t.Errorf("CheckSubmounts(%.80q) accepted", bad)
		}
	}
}

func TestCheckPodTmpfs(t *testing.T) {
	ok := []*PodTmpfs{{Name: "cache", Size: 8 << 20, Mode: 0o777}, {Name: "a.b_c-1", Mode: 0o2775, Gid: 2000}}
	if err := CheckPodTmpfs(ok); err != nil {
		t.Errorf("CheckPodTmpfs(%v): %v", ok, err)
	}
	many := make([]*PodTmpfs, MaxPodTmpfs+1)
	for i := range many {
		many[i] = &PodTmpfs{Name: fmt.Sprint("v", i)}
	}
	for _, bad := range [][]*PodTmpfs{
		{{Name: ""}},
		{{Name: "."}},
		{{Name: ".."}},
		{{Name: "a/b"}},
		{{Name: "a\x00"}},
		{{Name: "é"}},
		{{Name: strings.Repeat("a", 254)}},
		{{Name: "v"}, {Name: "v"}},
		{{Name: "v", Mode: 0o10777}},
		many,
	} {
		if err := CheckPodTmpfs(bad); err == nil {
			t.Errorf("CheckPodTmpfs(%.80v) accepted", bad)
		}
	}
}

func TestCheckMirrored(t *testing.T) {
	ok := []string{"c1-0-config", "c1-1-a b"}
	if err := CheckMirrored(ok); err != nil {
		t.Errorf("CheckMirrored(%q): %v", ok, err)
	}
	for _, bad := range [][]string{
		{""}, {"."}, {".."}, {"a/b"}, {"a\x00"}, {strings.Repeat("a", 256)}, {"v", "v"}, make([]string, MaxMirrored+1),
	} {
		if err := CheckMirrored(bad); err == nil {
			t.Errorf("CheckMirrored(%.80q) accepted", bad)
		}
	}
}
