package sandbox

import (
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestRenderConfigKeys checks that the rendered file has every key of configKeys, each
// documented, and nothing else.
func TestRenderConfigKeys(t *testing.T) {
	var fields, known, docs []string
	for _, f := range configFields(DefaultConfig()) {
		fields = append(fields, f.name)
	}
	for _, k := range configKeys {
		known = append(known, k.name)
	}
	for k := range keyDocs {
		docs = append(docs, k)
	}
	slices.Sort(fields)
	slices.Sort(known)
	slices.Sort(docs)
	if !slices.Equal(fields, known) || !slices.Equal(docs, known) {
		t.Errorf("Config's fields %q\n      configKeys %q\n         keyDocs %q", fields, known, docs)
	}
}

// uncomment sets every key of a rendered file: "# key = value" lines lose their "# ".
var commentedKey = regexp.MustCompile(`(?m)^# ([a-z_]+ = )`)

func TestRenderConfigDefaults(t *testing.T) {
	out := RenderConfig(DefaultConfig())
	c, err := ParseConfig(out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !reflect.DeepEqual(normalize(c), normalize(DefaultConfig())) {
		t.Errorf("rendered defaults load as %+v", c)
	}
	// Every key is commented out, with its default.
	for _, line := range strings.Split(string(out), "\n") {
		if line != "" && !strings.HasPrefix(line, "#") && !strings.HasPrefix(line, "[") {
			t.Errorf("default key set: %q", line)
		}
	}
	all := commentedKey.ReplaceAll(out, []byte("$1"))
	if n := len(commentedKey.FindAll(out, -1)); n != len(configKeys) {
		t.Errorf("%d commented keys, want %d:\n%s", n, len(configKeys), out)
	}
	c, err = ParseConfig(all)
	if err != nil {
		t.Fatalf("with every key uncommented: %v\n%s", err, all)
	}
	if !reflect.DeepEqual(normalize(c), normalize(DefaultConfig())) {
		t.Errorf("rendered defaults, uncommented, load as %+v", c)
	}
	if !strings.Contains(string(out), "\n# The guest kernel of the kvfs guest image") ||
		!strings.Contains(string(out), "\n# kernel = \"/usr/share/kvfs/guest/vmlinux\"\n") {
		t.Errorf("vm.kernel not documented with its default:\n%s", out)
	}
}

func TestRenderConfigChanged(t *testing.T) {
	c := DefaultConfig()
	c.BaseDir = "/var/run/x"
	c.Server.Daemon = "/usr/local/bin/kvfsd"
	c.Server.ValidDaemonPaths = []string{"/usr/local/bin/kvfsd", InProcessUnconfined}
	c.Server.ExtraArgs = []string{`--log-level="debug\x"`, "-o", "xattr"}
	c.Server.PosixLock = true
	c.Device.QueueSize = 256
	c.VM.Kernel = "/usr/local/share/kvfs/guest/vmlinuz"
	c.VM.KernelParams = "kvfs.debug=1\tquiet"
	c.Annotations.Enabled = []string{"server.cache"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	out := RenderConfig(c)
	got, err := ParseConfig(out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !reflect.DeepEqual(normalize(got), normalize(c)) {
		t.Errorf("rendered\n%s\nloads as %+v\nwant %+v", out, got, c)
	}
	for _, want := range []string{
		"\nkernel = \"/usr/local/share/kvfs/guest/vmlinuz\"\n",
		"\n# rootfs = \"/usr/share/kvfs/guest/rootfs.erofs\"\n",
		"\nqueue_size = 256\n",
		"\nposix_lock = true\n",
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("no %q in\n%s", want, out)
		}
	}
}

func TestTOMLString(t *testing.T) {
	for in, want := range map[string]string{
		`a`:        `"a"`,
		`a"b\c`:    `"a\"b\\c"`,
		"x\ny\x01": `"x\ny\u0001"`,
		"é":        `"é"`,
	} {
		if got := tomlString(in); got != want {
			t.Errorf("tomlString(%q) = %s, want %s", in, got, want)
		}
	}
}
