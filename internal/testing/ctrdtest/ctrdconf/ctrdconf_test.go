package ctrdconf

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"
)

func TestConfig(t *testing.T) {
	parse := func(b []byte) map[string]any {
		t.Helper()
		var m map[string]any
		if err := toml.Unmarshal(b, &m); err != nil {
			t.Fatalf("%v\n%s", err, b)
		}
		return m
	}
	b, err := Config("/tmp/ctrd-x", "debug", false, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	m := parse(b)
	for path, want := range map[string]any{
		"version":     int64(4),
		"root":        "/tmp/ctrd-x/root",
		"state":       "/tmp/ctrd-x/state",
		"debug.level": "debug",
		"plugins.io.containerd.server.v1.grpc.address":  "/tmp/ctrd-x/containerd.sock",
		"plugins.io.containerd.server.v1.ttrpc.address": "/tmp/ctrd-x/containerd.sock.ttrpc",
		"plugins.io.containerd.server.v1.debug.address": "",
	} {
		p := strings.Split(path, ".")
		if p[0] == "plugins" {
			p = []string{"plugins", strings.Join(p[1:len(p)-1], "."), p[len(p)-1]}
		}
		if got := lookup(m, p); got != want {
			t.Errorf("%s = %#v, want %#v", path, got, want)
		}
	}

	if got := lookup(m, []string{"imports"}); fmt.Sprint(got) != "[]" {
		t.Errorf("imports %v, want none", got)
	}
	b, err = Config("/tmp/ctrd-x", "info", false, []string{"/etc/x/conf.d/*.toml"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if got := lookup(parse(b), []string{"imports"}); fmt.Sprint(got) != "[/etc/x/conf.d/*.toml]" {
		t.Errorf("imports: %v", got)
	}
	if _, err := Config("/tmp/ctrd-x", "info", false, []string{"conf.d/*.toml"}, ""); err == nil {
		t.Error("a relative import: no error")
	}
	if _, err := Config("/tmp/ctrd-x", "info", false, nil, "imports = ['/etc/containerd/conf.d/*.toml']"); err == nil {
		t.Error("imports through the extra TOML: no error")
	}

	// Extra TOML: tables merged, values replaced.
	extra := `
disabled_plugins = ["io.containerd.nri.v1.nri"]
[plugins.'io.containerd.server.v1.grpc']
  max_recv_message_size = 1024
[plugins.'io.containerd.runtime.v2.task']
  platforms = ["linux/amd64"]
`
	b, err = Config("/tmp/ctrd-x", "info", false, nil, extra)
	if err != nil {
		t.Fatal(err)
	}
	m = parse(b)
	if got := lookup(m, []string{"plugins", "io.containerd.server.v1.grpc", "address"}); got != "/tmp/ctrd-x/containerd.sock" {
		t.Errorf("merged grpc address %v", got)
	}
	if got := lookup(m, []string{"plugins", "io.containerd.server.v1.grpc", "max_recv_message_size"}); got != int64(1024) {
		t.Errorf("merged max_recv_message_size %v", got)
	}
	if got := lookup(m, []string{"plugins", "io.containerd.runtime.v2.task", "platforms"}); fmt.Sprint(got) != "[linux/amd64]" {
		t.Errorf("added table: %v", got)
	}
	if got := lookup(m, []string{"disabled_plugins"}); fmt.Sprint(got) != "[io.containerd.nri.v1.nri]" {
		t.Errorf("replaced list: %v", got)
	}

	for _, tc := range []struct{ extra, want string }{
		{`root = "/var/lib/containerd"`, "may not set root"},
		{"[plugins.'io.containerd.server.v1.ttrpc']\naddress = '/run/x.sock'", "may not set plugins.io.containerd.server.v1.ttrpc.address"},
		{"version = 3", "may not set version"},
		{"[debug]\nlevel = [", "the extra config"},
		{"debug = 'x'", "debug: a table in one config and a value in the other"},
	} {
		if _, err := Config("/tmp/ctrd-x", "info", false, nil, tc.extra); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error with %q", tc.extra, err, tc.want)
		}
	}
}

// TestCRIConfig: with cri the CRI plugins are on, its network config and crictl's are in the
// directory, and runc is a runtime handler with its state there.
func TestCRIConfig(t *testing.T) {
	b, err := Config("/tmp/ctrd-x", "info", true, nil, "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.kvfs]\nruntime_type = 'io.containerd.kvfs.v2'\n")
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := toml.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(m["disabled_plugins"]); got != "["+NRIPlugin+"]" {
		t.Errorf("disabled_plugins %s", got)
	}
	rt := []string{"plugins", "io.containerd.cri.v1.runtime"}
	for _, tc := range []struct {
		path []string
		want any
	}{
		{append(rt, "cni", "conf_dir"), "/tmp/ctrd-x/cni/net.d"},
		{append(rt, "restrict_oom_score_adj"), true},
		{append(rt, "containerd", "runtimes", "runc", "options", "Root"), "/tmp/ctrd-x/runc"},
		{append(rt, "containerd", "runtimes", "kvfs", "runtime_type"), "io.containerd.kvfs.v2"},
		{[]string{"plugins", "io.containerd.cri.v1.images", "pinned_images", "sandbox"}, PauseImage},
	} {
		if got := lookup(m, tc.path); got != tc.want {
			t.Errorf("%s = %#v, want %#v", strings.Join(tc.path, "."), got, tc.want)
		}
	}

	dir := t.TempDir()
	if err := WriteCRIFiles(dir, 90*time.Second); err != nil {
		t.Fatal(err)
	}
	y, err := os.ReadFile(CrictlConfig(dir))
	if err != nil {
		t.Fatal(err)
	}
	if want := "runtime-endpoint: unix://" + dir + "/containerd.sock\n"; !strings.HasPrefix(string(y), want) || !strings.Contains(string(y), "timeout: 90\n") {
		t.Errorf("crictl.yaml:\n%s", y)
	}
	c, err := os.ReadFile(filepath.Join(dir, "cni/net.d/10-kvfstest.conflist"))
	if err != nil {
		t.Fatal(err)
	}
	var conf struct {
		Plugins []struct {
			Type, Bridge string
			IPAM         struct{ DataDir string }
		}
	}
	if err := json.Unmarshal(c, &conf); err != nil || len(conf.Plugins) != 1 || conf.Plugins[0].Type != "bridge" ||
		conf.Plugins[0].IPAM.DataDir != filepath.Join(dir, "cni/ipam") || !strings.Contains(string(c), PodSubnet) {
		t.Errorf("the CNI config (%v):\n%s", err, c)
	}
}

func TestEnviron(t *testing.T) {
	t.Setenv("PATH", "/opt/x:/usr/bin")
	t.Setenv("TMPDIR", "/elsewhere")
	t.Setenv("CONTAINERD_SNAPSHOTTER", "native")
	env := Environ("/tmp/ctrd-x", []string{"/shims", "/bins"})
	if !slices.Contains(env, "PATH=/shims:/bins:/opt/x:/usr/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/sbin:/bin") {
		t.Errorf("PATH: %q", env)
	}
	if !slices.Contains(env, "TMPDIR=/tmp/ctrd-x/tmp") || slices.Contains(env, "TMPDIR=/elsewhere") {
		t.Errorf("TMPDIR: %q", env)
	}
	for _, kv := range env {
		if strings.HasPrefix(kv, "CONTAINERD_") {
			t.Errorf("kept %s", kv)
		}
	}
}
