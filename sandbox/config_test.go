package sandbox

import (
	"errors"
	"os"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/pelletier/go-toml/v2"
)

// normalize makes empty slices nil, so that a decoded [] equals a default nil.
func normalize(c *Config) *Config {
	c = c.Clone()
	for _, p := range []*[]string{&c.Server.ValidDaemonPaths, &c.Server.ExtraArgs, &c.Annotations.Enabled} {
		if len(*p) == 0 {
			*p = nil
		}
	}
	return c
}

// TestDefaultsFile checks that testdata/defaults.toml, the documented example, spells out
// exactly DefaultConfig and every key.
func TestDefaultsFile(t *testing.T) {
	c, err := LoadConfig("testdata/defaults.toml")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := normalize(c), normalize(DefaultConfig()); !reflect.DeepEqual(got, want) {
		t.Errorf("defaults.toml:\n got %+v\nwant %+v", got, want)
	}

	data, err := os.ReadFile("testdata/defaults.toml")
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := toml.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	var inFile []string
	for k, v := range doc {
		if table, ok := v.(map[string]any); ok {
			for kk := range table {
				inFile = append(inFile, k+"."+kk)
			}
		} else {
			inFile = append(inFile, k)
		}
	}
	var known []string
	for _, k := range configKeys {
		known = append(known, k.name)
	}
	sort.Strings(inFile)
	sort.Strings(known)
	if !slices.Equal(inFile, known) {
		t.Errorf("keys in defaults.toml %q\n         configKeys %q", inFile, known)
	}
}

func TestDefaults(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	// Kata's defaults for virtio-fs.
	s, d := c.Server, c.Device
	if s.Cache != "auto" || s.PosixLock || s.ThreadPoolSize != 0 || !s.AnnounceSubmounts ||
		d.QueueSize != 1024 || d.Tag != "kataShared" || s.OnFailure != PolicyStop || s.Daemon != Confined {
		t.Errorf("defaults %+v %+v", s, d)
	}
	if got := c.daemonArgs("/sb/shared"); !slices.Equal(got, []string{"--fd=3", "--shared-dir=/sb/shared", "--cache=auto", "--announce-submounts"}) {
		t.Errorf("daemon args %q", got)
	}
}

// TestRequestQueues: by default a pod's device has one request queue per vCPU when kvfsd
// serves, at most the 16 it serves, and one for an external daemon; a number configured is
// the number.
func TestRequestQueues(t *testing.T) {
	for _, tc := range []struct {
		daemon        string
		vcpus, queues int
		want          int
	}{
		{Confined, 1, 0, 1},
		{Confined, 4, 0, 4},
		{InProcessUnconfined, 3, 0, 3},
		{Confined, 40, 0, 16},
		{"/usr/libexec/virtiofsd", 4, 0, 1},
		{Confined, 4, 2, 2},
		{"/usr/libexec/virtiofsd", 4, 8, 8},
	} {
		c := DefaultConfig()
		c.Server.Daemon, c.VM.VCPUs, c.Device.NumRequestQueues = tc.daemon, tc.vcpus, tc.queues
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if got := c.RequestQueues(); got != tc.want {
			t.Errorf("%s, %d vCPUs, num_request_queues %d: %d queues, want %d", tc.daemon, tc.vcpus, tc.queues, got, tc.want)
		}
	}
}

func TestDaemonArgs(t *testing.T) {
	c := DefaultConfig()
	c.Server.Daemon = "/usr/libexec/virtiofsd"
	c.Server.Cache = "never"
	c.Server.ThreadPoolSize = 4
	c.Server.AnnounceSubmounts = false
	c.Server.Xattr = true
	c.Server.PosixLock = true
	c.Server.ExtraArgs = []string{"--log-level=debug"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	want := []string{"--fd=3", "--shared-dir=/d", "--cache=never", "--thread-pool-size=4", "--xattr", "-o", "posix_lock", "--log-level=debug"}
	if got := c.daemonArgs("/d"); !slices.Equal(got, want) {
		t.Errorf("daemon args\n got %q\nwant %q", got, want)
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name, doc string
		key       string   // the ConfigError's key
		want      []string // substrings of the message
	}{
		{"unknown key", "[server]\ncahce = \"auto\"\n", "server.cahce", []string{"server.cahce", "unknown key (line 2"}},
		{"unknown table", "[servers]\ncache = \"auto\"\n", "servers", []string{"servers", "unknown key"}},
		{"wrong type", "[device]\nqueue_size = \"big\"\n", "device.queue_size", []string{"device.queue_size", "line 2"}},
		{"bad cache", "[server]\ncache = \"fast\"\n", "server.cache", []string{`server.cache = "fast": want auto, always, metadata or never`}},
		{"bad queue size", "[device]\nqueue_size = 1000\n", "device.queue_size", []string{"device.queue_size = 1000: want a power of two"}},
		{"long tag", "[device]\ntag = \"" + strings.Repeat("x", 37) + "\"\n", "device.tag", []string{"want 1 to 36 bytes"}},
		{"bad policy", "[server]\non_failure = \"explode\"\n", "server.on_failure", []string{`"explode": want stop or restart`}},
		{"relative daemon", "[server]\ndaemon = \"kvfsd\"\n", "server.daemon",
			[]string{`server.daemon = "kvfsd": want "confined", "in-process-unconfined" or the absolute path of a virtiofsd-compatible daemon`}},
		{"unclean daemon path", "[server]\ndaemon = \"/usr//bin/kvfsd\"\n", "server.daemon", []string{"not a clean path (want /usr/bin/kvfsd)"}},
		{"the old in-process name", "[server]\ndaemon = \"in-process\"\n", "server.daemon",
			[]string{`server.daemon = "in-process": the unconfined in-process server is now an explicit opt-in: use "confined"`, `or "in-process-unconfined"`}},
		{"in-process as a valid daemon path", "[server]\nvalid_daemon_paths = [\"in-process\"]\n", "server.valid_daemon_paths",
			[]string{`"in-process": the unconfined in-process server is now an explicit opt-in`}},
		{"negative pool", "[server]\nthread_pool_size = -1\n", "server.thread_pool_size", []string{"= -1: want 0 to 1024"}},
		{"small memory", "[vm]\nmemory = \"100M\"\n", "vm.memory", []string{`vm.memory = "100M"`, "minimum of 128 MiB"}},
		{"tb-size too large", "[vm]\ntcg_tb_size = 4096\n", "vm.tcg_tb_size", []string{"vm.tcg_tb_size = 4096: want 0 (QEMU's default) to 2048 MiB"}},
		{"negative request queues", "[device]\nnum_request_queues = -1\n", "device.num_request_queues", []string{"= -1: want 1 to", "or 0 for one per vCPU"}},
		{"extra args confined", "[server]\nextra_args = [\"-d\"]\n", "server.extra_args", []string{`only to an external server.daemon, not to "confined"`}},
		{"extra args in-process", "[server]\ndaemon = \"in-process-unconfined\"\nextra_args = [\"-d\"]\n", "server.extra_args",
			[]string{`not to "in-process-unconfined"`}},
		{"too many queues confined", "[device]\nnum_request_queues = 17\n", "device.num_request_queues",
			[]string{`kvfsd (server.daemon = "confined") serves at most 16 request queues`}},
		{"extra args set the directory", "[server]\ndaemon = \"/bin/true\"\nextra_args = [\"-o\", \"source=/\"]\n",
			"server.extra_args", []string{"sets the shared directory"}},
		{"extra args set the fd", "[server]\ndaemon = \"/bin/true\"\nextra_args = [\"--fd=4\"]\n",
			"server.extra_args", []string{`"--fd=4" is set by the sandbox`}},
		{"enable an unknown annotation", "[annotations]\nenabled = [\"server.cahce\"]\n", "annotations.enabled", []string{`no configuration key "server.cahce"`}},
		{"enable a file-only key", "[annotations]\nenabled = [\"base_dir\"]\n", "annotations.enabled", []string{"base_dir cannot be set by annotation"}},
		{"syntax", "[server\n", "", []string{"config: ", "line 1"}},
		{"relative kernel", "[vm]\nkernel = \"vmlinuz\"\n", "vm.kernel", []string{`vm.kernel = "vmlinuz": not an absolute path`}},
		{"no kernel", "[vm]\nkernel = \"\"\n", "vm.kernel", []string{`vm.kernel = "": empty path`}},
		{"relative initrd", "[vm]\nrootfs = \"\"\ninitrd = \"x/initramfs.gz\"\n", "vm.initrd", []string{`vm.initrd = "x/initramfs.gz": not an absolute path`}},
		{"relative rootfs", "[vm]\nrootfs = \"x/rootfs.erofs\"\n", "vm.rootfs", []string{`vm.rootfs = "x/rootfs.erofs": not an absolute path`}},
		{"rootfs and initrd", "[vm]\ninitrd = \"/g/initramfs.gz\"\n", "vm.initrd", []string{`vm.initrd = "/g/initramfs.gz": vm.rootfs is "/usr/share/kvfs/guest/rootfs.erofs" too: the guest's root is one or the other`}},
		{"newline in kernel params", "[vm]\nkernel_params = \"a\\nb\"\n", "vm.kernel_params", []string{"vm.kernel_params", "NUL or newline"}},
		{"unknown agent transport", "[agent]\ntransport = \"tcp\"\n", "agent.transport", []string{`agent.transport = "tcp": want serial or vsock`}},
		{"unknown agent key", "[agent]\ntimeout = \"1s\"\n", "agent.timeout", []string{"agent.timeout", "unknown key"}},
		{"boot timeout not a duration", "[agent]\nboot_timeout = \"soon\"\n", "agent.boot_timeout", []string{"agent.boot_timeout", "want a duration"}},
		{"boot timeout a number", "[agent]\nboot_timeout = 120\n", "agent.boot_timeout", []string{"agent.boot_timeout"}},
		{"boot timeout zero", "[agent]\nboot_timeout = \"0s\"\n", "agent.boot_timeout", []string{`agent.boot_timeout = "0s": want more than 0`}},
		{"boot timeout too long", "[agent]\nboot_timeout = \"2h\"\n", "agent.boot_timeout", []string{"at most 1h0m0s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tt.doc))
			if err == nil {
				t.Fatalf("ParseConfig succeeded: %+v", c)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("error %v (%T) is not a *ConfigError", err, err)
			}
			if ce.Key != tt.key {
				t.Errorf("key %q, want %q (error %v)", ce.Key, tt.key, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestParseConfigAgent(t *testing.T) {
	c, err := ParseConfig([]byte("[vm]\nkernel = \"/g/vmlinuz\"\ninitrd = \"\"\nkernel_params = \"kvfs.debug=1\"\n" +
		"[agent]\ntransport = \"vsock\"\nboot_timeout = \"30s\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.VM.Kernel != "/g/vmlinuz" || c.VM.Initrd != "" || c.VM.KernelParams != "kvfs.debug=1" ||
		c.Agent.Transport != AgentVsock || c.Agent.BootTimeoutDuration() != 30*time.Second {
		t.Errorf("got %+v %+v", c.VM, c.Agent)
	}
}

func TestLoadConfigFile(t *testing.T) {
	path := t.TempDir() + "/kvfs.toml"
	if err := os.WriteFile(path, []byte("[server]\ncache = \"never\"\n[device]\nqueue_size = 7\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadConfig(path)
	if err == nil || !strings.Contains(err.Error(), "config file "+path+": device.queue_size = 7") {
		t.Errorf("LoadConfig: %v", err)
	}
	if _, err := LoadConfig(path + ".missing"); err == nil || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("LoadConfig of a missing file: %v", err)
	}
}

func TestResolveAnnotations(t *testing.T) {
	const p = "io.kvfs.config."
	base := func() *Config {
		c := DefaultConfig()
		c.Server.ValidDaemonPaths = []string{"/usr/libexec/kvfsd", InProcessUnconfined}
		c.Annotations.Enabled = []string{"server.cache", "server.daemon", "device.queue_size", "device.tag",
			"server.thread_pool_size", "server.announce_submounts", "device.num_request_queues"}
		return c
	}
	tests := []struct {
		name   string
		config func(c *Config)
		ann    map[string]string
		check  func(t *testing.T, c *Config)
		errs   []string // substrings of the error; none: success
	}{
		{
			name: "no annotations: the configuration as is",
			ann:  nil,
			check: func(t *testing.T, c *Config) {
				if !reflect.DeepEqual(c, base()) {
					t.Errorf("got %+v", c)
				}
			},
		},
		{
			name: "enabled keys are applied; other prefixes ignored",
			ann: map[string]string{p + "server.cache": "never", p + "device.queue_size": "128",
				p + "server.announce_submounts": "false", "io.kubernetes.cri.sandbox-id": "x", "io.katacontainers.config.x": "y"},
			check: func(t *testing.T, c *Config) {
				if c.Server.Cache != "never" || c.Device.QueueSize != 128 || c.Server.AnnounceSubmounts {
					t.Errorf("got %+v %+v", c.Server, c.Device)
				}
			},
		},
		{
			name: "daemon from the allow-list",
			ann:  map[string]string{p + "server.daemon": "/usr/libexec/kvfsd"},
			check: func(t *testing.T, c *Config) {
				if c.Server.Daemon != "/usr/libexec/kvfsd" {
					t.Errorf("daemon %q", c.Server.Daemon)
				}
			},
		},
		{
			name: "daemon not in the allow-list",
			ann:  map[string]string{p + "server.daemon": "/tmp/evil"},
			errs: []string{`annotation io.kvfs.config.server.daemon = "/tmp/evil": "/tmp/evil" is not in server.valid_daemon_paths`},
		},
		{
			name: "key not enabled",
			ann:  map[string]string{p + "server.xattr": "true"},
			errs: []string{`annotation io.kvfs.config.server.xattr = "true": not enabled: server.xattr is not listed in annotations.enabled`},
		},
		{
			name: "extra args never from annotations unless enabled",
			config: func(c *Config) {
				c.Server.Daemon = "/usr/libexec/kvfsd"
			},
			ann:  map[string]string{p + "server.extra_args": `["--xattr"]`},
			errs: []string{"server.extra_args is not listed in annotations.enabled"},
		},
		{
			name: "extra args enabled explicitly, still may not redirect the export",
			config: func(c *Config) {
				c.Server.Daemon = "/usr/libexec/kvfsd"
				c.Annotations.Enabled = append(c.Annotations.Enabled, "server.extra_args")
			},
			ann:  map[string]string{p + "server.extra_args": `["--shared-dir=/"]`},
			errs: []string{`annotation io.kvfs.config.server.extra_args = "[\"--shared-dir=/\"]": argument "--shared-dir=/" is set by the sandbox`},
		},
		{
			name: "extra args enabled explicitly and accepted",
			config: func(c *Config) {
				c.Server.Daemon = "/usr/libexec/kvfsd"
				c.Annotations.Enabled = append(c.Annotations.Enabled, "server.extra_args")
			},
			ann: map[string]string{p + "server.extra_args": `["--xattr"]`},
			check: func(t *testing.T, c *Config) {
				if !slices.Equal(c.Server.ExtraArgs, []string{"--xattr"}) {
					t.Errorf("extra args %q", c.Server.ExtraArgs)
				}
			},
		},
		{
			name: "extra args not JSON",
			config: func(c *Config) {
				c.Server.Daemon = "/usr/libexec/kvfsd"
				c.Annotations.Enabled = append(c.Annotations.Enabled, "server.extra_args")
			},
			ann:  map[string]string{p + "server.extra_args": `--xattr`},
			errs: []string{"want a JSON array of strings"},
		},
		{
			name: "bad values name the annotation and the value",
			ann: map[string]string{p + "device.queue_size": "1000", p + "server.cache": "fast",
				p + "server.thread_pool_size": "many", p + "device.tag": ""},
			errs: []string{
				`annotation io.kvfs.config.device.queue_size = "1000": want a power of two no larger than 1024`,
				`annotation io.kvfs.config.server.cache = "fast": want auto, always, metadata or never`,
				`annotation io.kvfs.config.server.thread_pool_size = "many": want a decimal integer`,
				`annotation io.kvfs.config.device.tag = "": want 1 to 36 bytes, not 0`,
			},
		},
		{
			name: "unknown key under the prefix",
			ann:  map[string]string{p + "server.cahce": "auto"},
			errs: []string{`annotation io.kvfs.config.server.cahce = "auto": no configuration key "server.cahce"`},
		},
		{
			name: "file-only key under the prefix",
			ann:  map[string]string{p + "base_dir": "/"},
			errs: []string{"base_dir cannot be set by annotation"},
		},
		{
			name: "a valid annotation that conflicts with the file",
			config: func(c *Config) {
				c.Server.Daemon = "/usr/libexec/kvfsd"
				c.Device.NumRequestQueues = 32 // fine for an external daemon
			},
			ann:  map[string]string{p + "server.daemon": InProcessUnconfined},
			errs: []string{`config (with the pod's annotations): device.num_request_queues = 32: kvfsd (server.daemon = "in-process-unconfined") serves at most 16`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := base()
			if tt.config != nil {
				tt.config(c)
			}
			before := c.Clone()
			got, err := c.Resolve(tt.ann)
			if !reflect.DeepEqual(c, before) {
				t.Errorf("Resolve modified its receiver")
			}
			if len(tt.errs) > 0 {
				if err == nil {
					t.Fatalf("Resolve succeeded: %+v", got)
				}
				for _, w := range tt.errs {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q\ndoes not contain %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Resolve: %v", err)
			}
			tt.check(t, got)
		})
	}
}
