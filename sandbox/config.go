package sandbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/kvfs/kvfs/virtiofs"
)

// Values of server.daemon besides an external daemon's path: kvfsd's own server, which is the
// same code in both.
const (
	// Confined, the default, runs kvfsd in a process of its own started from the owner's
	// executable and confined as kvfsd --sandbox=namespace --seccomp=kill is, with only the
	// capabilities it needs (package sandbox/serverproc). The owning binary must call
	// serverproc.Init first thing in main.
	Confined = "confined"
	// InProcessUnconfined runs kvfsd inside the owning process as a library, with all of its
	// privileges: an explicit opt-in, logged as a warning at every start.
	InProcessUnconfined = "in-process-unconfined"
	// legacyInProcess was the unconfined in-process server's name and default; it is refused
	// with a message saying what replaced it.
	legacyInProcess = "in-process"
)

// unconfinedWarning is logged at every start of an in-process server.
const unconfinedWarning = `the virtio-fs server runs unconfined inside this process (server.daemon = "in-process-unconfined"): ` +
	`a guest that exploits a bug in it gets this process's privileges; the default, "confined", runs the same server ` +
	`in new namespaces with the shared directory as its root, a seccomp allowlist and only the capabilities it needs`

// isKvfsd says whether daemon is kvfsd's own server (confined or in-process) rather than an
// external daemon.
func isKvfsd(daemon string) bool { return daemon == Confined || daemon == InProcessUnconfined }

// Failure policies: what a sandbox does when its virtio-fs server dies while the VM runs.
const (
	// PolicyStop kills the VM and reports why (Kata's behaviour).
	PolicyStop = "stop"
	// PolicyRestart starts a new server on the same socket path. QEMU 7.2 does not reconnect a
	// vhost-user-fs device, so the guest's share stays dead until the VM restarts; see the
	// package documentation.
	PolicyRestart = "restart"
)

// Memory placements: how the shared memory backend becomes the guest's RAM.
const (
	// PlacementNUMA adds one NUMA node backed by it (-numa node,memdev=ID).
	PlacementNUMA = "numa"
	// PlacementMachine makes it the machine's RAM (-machine ...,memory-backend=ID).
	PlacementMachine = "machine"
)

// Config is the sandbox configuration: a TOML file (see LoadConfig and testdata/defaults.toml)
// with per-pod overrides from annotations where [annotations] enabled allows them. The zero
// value is not useful; start from DefaultConfig.
type Config struct {
	// BaseDir holds one directory per sandbox.
	BaseDir     string           `toml:"base_dir" json:"base_dir"`
	Server      ServerConfig     `toml:"server" json:"server"`
	Device      DeviceConfig     `toml:"device" json:"device"`
	VM          VMConfig         `toml:"vm" json:"vm"`
	Agent       AgentConfig      `toml:"agent" json:"agent"`
	Annotations AnnotationConfig `toml:"annotations" json:"annotations"`
}

// ServerConfig is the [server] table: the virtio-fs server of each pod.
type ServerConfig struct {
	// Daemon is Confined (the default), InProcessUnconfined, or the absolute path of a
	// virtiofsd-compatible binary.
	Daemon string `toml:"daemon" json:"daemon"`
	// ValidDaemonPaths are the values an annotation may give Daemon. The configured Daemon
	// itself need not be listed.
	ValidDaemonPaths []string `toml:"valid_daemon_paths" json:"valid_daemon_paths"`
	// Cache is auto, always, metadata or never.
	Cache string `toml:"cache" json:"cache"`
	// PosixLock asks for remote POSIX locks (-o posix_lock: guest fcntl locks become host OFD
	// locks); false is no_posix_lock, the default of every virtiofsd.
	PosixLock bool `toml:"posix_lock" json:"posix_lock"`
	// ThreadPoolSize is the number of request workers; 0 serves requests on the queue's thread.
	ThreadPoolSize int `toml:"thread_pool_size" json:"thread_pool_size"`
	// AnnounceSubmounts reports mounts inside the share to the guest as submounts (distinct
	// st_dev per mount: no inode number collisions between container root filesystems).
	AnnounceSubmounts bool `toml:"announce_submounts" json:"announce_submounts"`
	// Xattr enables extended attributes.
	Xattr bool `toml:"xattr" json:"xattr"`
	// ExtraArgs are appended to an external daemon's arguments. They may not set the socket,
	// the descriptor or the shared directory, which the sandbox decides.
	ExtraArgs []string `toml:"extra_args" json:"extra_args"`
	// OnFailure is PolicyStop or PolicyRestart.
	OnFailure string `toml:"on_failure" json:"on_failure"`
	// MaxRestarts bounds PolicyRestart; once reached, the next failure stops the VM.
	MaxRestarts int `toml:"max_restarts" json:"max_restarts"`
}

// DeviceConfig is the [device] table: the vhost-user-fs device QEMU shows the guest.
type DeviceConfig struct {
	// Tag is what the guest mounts (mount -t virtiofs TAG DIR): 1 to 36 bytes.
	Tag string `toml:"tag" json:"tag"`
	// QueueSize is the size of each request queue: a power of two, at most 1024.
	QueueSize int `toml:"queue_size" json:"queue_size"`
	// NumRequestQueues is the number of request queues: 0 for RequestQueues' choice, one per
	// vCPU when kvfsd serves.
	NumRequestQueues int `toml:"num_request_queues" json:"num_request_queues"`
}

// RequestQueues is the number of request queues the VM's device gets: device.num_request_queues,
// or for 0 one per vCPU (the guest's driver, Linux 6.11 and later, sends each CPU's requests
// down a queue of its own, which kvfsd serves on a thread of its own) when kvfsd serves, at
// most the 16 it serves, and one for an external daemon, which may serve no more (the Rust
// virtiofsd 1.13 serves one, and fails the device when QEMU starts a second).
func (c *Config) RequestQueues() int {
	switch {
	case c.Device.NumRequestQueues > 0:
		return c.Device.NumRequestQueues
	case isKvfsd(c.Server.Daemon):
		return min(max(c.VM.VCPUs, 1), maxKvfsdRequestQueues)
	default:
		return 1
	}
}

// VMConfig is the [vm] table: the defaults of Sandbox.DefaultVM.
type VMConfig struct {
	// QEMU is the emulator binary, looked up in $PATH when it has no slash.
	QEMU string `toml:"qemu" json:"qemu"`
	// Machine is the machine type (q35 gets the device on bus pcie.0).
	Machine string `toml:"machine" json:"machine"`
	// Accel is kvm, tcg, or empty: kvm when /dev/kvm can be opened, else tcg (a failed boot
	// under a KVM chosen so is an error that names it: Sandbox.VMError).
	Accel string `toml:"accel" json:"accel"`
	// TCGTBSize bounds QEMU's buffer of translated code under TCG, in MiB (VM.TCGTBSize); 0
	// is QEMU's own bound, up to 1 GiB.
	TCGTBSize int `toml:"tcg_tb_size" json:"tcg_tb_size"`
	// CPU is the -cpu model.
	CPU string `toml:"cpu" json:"cpu"`
	// VCPUs is the number of virtual CPUs.
	VCPUs int `toml:"vcpus" json:"vcpus"`
	// Memory is the guest RAM ("2G", "512M"; at least 128 MiB).
	Memory string `toml:"memory" json:"memory"`
	// MemoryPlacement is PlacementNUMA or PlacementMachine.
	MemoryPlacement string `toml:"memory_placement" json:"memory_placement"`
	// Hugepages backs the guest RAM with a file in HugepagePath, preallocated.
	Hugepages    bool   `toml:"hugepages" json:"hugepages"`
	HugepagePath string `toml:"hugepage_path" json:"hugepage_path"`
	// FileMemPath, when set and Hugepages is not, backs the guest RAM with a shared file in this
	// directory (a tmpfs) instead of a memfd. The memfd is the default: it is not limited by
	// the size of /dev/shm, whose exhaustion makes a running guest die of SIGBUS.
	FileMemPath string `toml:"file_mem_path" json:"file_mem_path"`
	// Kernel boots the guest; its root is Rootfs, the kvfs guest image's read-only erofs image
	// (mapped, not copied: VM.Root), or Initrd, an initramfs (the image built with Debian's
	// kernel), never both. Either way the agent is /init.
	Kernel string `toml:"kernel" json:"kernel"`
	Rootfs string `toml:"rootfs" json:"rootfs"`
	Initrd string `toml:"initrd" json:"initrd"`
	// KernelParams are appended to the kernel command line DefaultVM builds.
	KernelParams string `toml:"kernel_params" json:"kernel_params"`
	// FreePageReporting gives the guest a virtio-balloon device with free page reporting: the
	// guest kernel reports the memory it frees (in blocks of 2 MiB or more) and QEMU gives it
	// back to the host, so the VM costs what its guest uses now rather than the most it ever
	// touched.
	FreePageReporting bool `toml:"free_page_reporting" json:"free_page_reporting"`
}

// AgentConfig is the [agent] table: how the shim reaches the guest agent.
type AgentConfig struct {
	// Transport is AgentSerial (a virtio-serial port, the default) or AgentVsock.
	Transport string `toml:"transport" json:"transport"`
	// BootTimeout bounds the time from starting the VM to the agent's first answer: a
	// duration in Go's syntax ("120s", "2m").
	BootTimeout string `toml:"boot_timeout" json:"boot_timeout"`
}

// BootTimeoutDuration is BootTimeout parsed; 0 if it does not parse (Validate reports that).
func (a AgentConfig) BootTimeoutDuration() time.Duration {
	d, _ := time.ParseDuration(a.BootTimeout)
	return d
}

// AnnotationConfig is the [annotations] table.
type AnnotationConfig struct {
	// Prefix starts every configuration annotation: Prefix + "device.queue_size".
	Prefix string `toml:"prefix" json:"prefix"`
	// Enabled lists the keys ("server.cache", ...) a pod may set through annotations. Exact
	// names only: there are no patterns, so enabling a sensitive key is always deliberate.
	Enabled []string `toml:"enabled" json:"enabled"`
}

// DefaultConfig returns the defaults, which are Kata's for virtio-fs: cache=auto, no remote
// POSIX locks, no thread pool, submounts announced, queue size 1024, tag kataShared; the
// server kvfsd, confined in a process of its own; the VM's memory a shared memfd. No
// annotation is enabled.
// Root is the guest's root, Rootfs or Initrd: one of them is "" (Validate).
func (c *VMConfig) Root() string { return c.Rootfs + c.Initrd }

func DefaultConfig() *Config {
	return &Config{
		BaseDir: "/run/kvfs/sandboxes",
		Server: ServerConfig{
			Daemon:            Confined,
			Cache:             "auto",
			ThreadPoolSize:    0,
			AnnounceSubmounts: true,
			OnFailure:         PolicyStop,
			MaxRestarts:       3,
		},
		Device: DeviceConfig{
			Tag:              "kataShared",
			QueueSize:        1024,
			NumRequestQueues: 0,
		},
		VM: VMConfig{
			QEMU:              "qemu-system-x86_64",
			Machine:           "q35",
			TCGTBSize:         defaultTCGTBSize,
			CPU:               "max",
			VCPUs:             1,
			Memory:            "2G",
			MemoryPlacement:   PlacementNUMA,
			HugepagePath:      "/dev/hugepages",
			Kernel:            "/usr/share/kvfs/guest/vmlinux",
			Rootfs:            "/usr/share/kvfs/guest/rootfs.erofs",
			FreePageReporting: true,
		},
		Agent: AgentConfig{
			Transport: AgentSerial,
			// A boot under TCG takes 10 to 30 s on a loaded machine; KVM boots in about 1 s.
			BootTimeout: "2m0s",
		},
		Annotations: AnnotationConfig{Prefix: "io.kvfs.config."},
	}
}

// ConfigError is a configuration key or annotation that cannot be accepted.
type ConfigError struct {
	// Source is "config file PATH", "config", or "annotation NAME".
	Source string
	// Key is the configuration key ("device.queue_size"); empty for a file that cannot be read
	// or parsed at all.
	Key string
	// Value is the offending value as written, if any.
	Value string
	Err   error
}

func (e *ConfigError) Error() string {
	var b strings.Builder
	b.WriteString(e.Source)
	if e.Key != "" && !strings.HasSuffix(e.Source, e.Key) {
		b.WriteString(": " + e.Key)
	}
	if e.Value != "" {
		b.WriteString(" = " + e.Value)
	}
	b.WriteString(": " + e.Err.Error())
	return b.String()
}

func (e *ConfigError) Unwrap() error { return e.Err }

// LoadConfig reads a TOML configuration file on top of DefaultConfig. Unknown keys are errors.
func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, &ConfigError{Source: "config file " + path, Err: err}
	}
	return parseConfig(data, "config file "+path)
}

// ParseConfig is LoadConfig for a document in memory.
func ParseConfig(data []byte) (*Config, error) {
	return parseConfig(data, "config")
}

func parseConfig(data []byte, source string) (*Config, error) {
	c := DefaultConfig()
	dec := toml.NewDecoder(bytes.NewReader(data)).DisallowUnknownFields()
	if err := dec.Decode(c); err != nil {
		return nil, tomlError(source, err)
	}
	if err := c.Validate(); err != nil {
		var ce *ConfigError
		if errors.As(err, &ce) {
			ce.Source = source
		}
		return nil, err
	}
	return c, nil
}

// tomlError names the key and the line of a decoding error.
func tomlError(source string, err error) error {
	var strict *toml.StrictMissingError
	if errors.As(err, &strict) && len(strict.Errors) > 0 {
		var errs []error
		for i := range strict.Errors {
			de := &strict.Errors[i]
			line, col := de.Position()
			errs = append(errs, &ConfigError{Source: source, Key: strings.Join(de.Key(), "."),
				Err: fmt.Errorf("unknown key (line %d, column %d)", line, col)})
		}
		return errors.Join(errs...)
	}
	var de *toml.DecodeError
	if errors.As(err, &de) {
		line, col := de.Position()
		return &ConfigError{Source: source, Key: strings.Join(de.Key(), "."),
			Err: fmt.Errorf("%s (line %d, column %d)", strings.TrimPrefix(de.Error(), "toml: "), line, col)}
	}
	return &ConfigError{Source: source, Err: err}
}

// Clone returns a deep copy of c.
func (c *Config) Clone() *Config {
	d := *c
	d.Server.ValidDaemonPaths = slices.Clone(c.Server.ValidDaemonPaths)
	d.Server.ExtraArgs = slices.Clone(c.Server.ExtraArgs)
	d.Annotations.Enabled = slices.Clone(c.Annotations.Enabled)
	return &d
}

// Validate reports every key of c that is wrong, each as a *ConfigError.
func (c *Config) Validate() error {
	var errs []error
	for _, k := range configKeys {
		if err := k.check(c); err != nil {
			errs = append(errs, &ConfigError{Source: "config", Key: k.name, Value: k.show(c), Err: err})
		}
	}
	return errors.Join(errs...)
}

// Resolve returns the configuration for one pod: c with the annotations under
// c.Annotations.Prefix applied. Annotations are untrusted input: each must name a key listed in
// c.Annotations.Enabled, and its value passes the same checks as the file's plus, for
// server.daemon, membership in server.valid_daemon_paths. Annotations without the prefix are
// ignored. c is not modified.
func (c *Config) Resolve(annotations map[string]string) (*Config, error) {
	r := c.Clone()
	if err := r.Validate(); err != nil {
		return nil, err
	}
	setBy := map[string]string{} // key → annotation that set it
	failed := map[string]bool{}  // keys whose annotation did not parse
	names := make([]string, 0, len(annotations))
	for name := range annotations {
		if strings.HasPrefix(name, c.Annotations.Prefix) && c.Annotations.Prefix != "" {
			names = append(names, name)
		}
	}
	slices.Sort(names) // deterministic errors
	var errs []error
	for _, name := range names {
		value := annotations[name]
		keyName := strings.TrimPrefix(name, c.Annotations.Prefix)
		k := lookupKey(keyName)
		src := "annotation " + name
		switch {
		case k == nil:
			errs = append(errs, &ConfigError{Source: src, Value: strconv.Quote(value),
				Err: fmt.Errorf("no configuration key %q", keyName)})
			continue
		case k.set == nil:
			errs = append(errs, &ConfigError{Source: src, Value: strconv.Quote(value),
				Err: fmt.Errorf("%s cannot be set by annotation", keyName)})
			continue
		case !slices.Contains(c.Annotations.Enabled, keyName):
			errs = append(errs, &ConfigError{Source: src, Value: strconv.Quote(value),
				Err: fmt.Errorf("not enabled: %s is not listed in annotations.enabled", keyName)})
			continue
		}
		setBy[keyName] = name
		if err := k.set(r, value); err != nil {
			errs = append(errs, &ConfigError{Source: src, Key: keyName, Value: strconv.Quote(value), Err: err})
			failed[keyName] = true
		}
	}
	for _, k := range configKeys {
		err := k.check(r)
		if err == nil || failed[k.name] {
			continue
		}
		if ann, ok := setBy[k.name]; ok {
			errs = append(errs, &ConfigError{Source: "annotation " + ann, Key: k.name, Value: strconv.Quote(annotations[ann]), Err: err})
		} else {
			errs = append(errs, &ConfigError{Source: "config (with the pod's annotations)", Key: k.name, Value: k.show(r), Err: err})
		}
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return r, nil
}

// serverConfig returns kvfsd's configuration (confined or in-process) for sharedDir.
func (c *Config) serverConfig(sharedDir string) (virtiofs.Config, error) {
	mode, err := virtiofs.ParseCacheMode(c.Server.Cache)
	if err != nil {
		return virtiofs.Config{}, err
	}
	return virtiofs.Config{
		SharedDir:         sharedDir,
		Cache:             mode,
		Xattr:             c.Server.Xattr,
		AnnounceSubmounts: c.Server.AnnounceSubmounts,
		ThreadPoolSize:    c.Server.ThreadPoolSize,
		PosixLock:         c.Server.PosixLock,
	}, nil
}

// daemonArgs is the command line of an external daemon, after the program name.
func (c *Config) daemonArgs(sharedDir string) []string {
	args := []string{"--fd=3", "--shared-dir=" + sharedDir, "--cache=" + c.Server.Cache}
	if n := c.Server.ThreadPoolSize; n > 0 {
		args = append(args, "--thread-pool-size="+strconv.Itoa(n))
	}
	if c.Server.AnnounceSubmounts {
		args = append(args, "--announce-submounts")
	}
	if c.Server.Xattr {
		args = append(args, "--xattr")
	}
	if c.Server.PosixLock {
		args = append(args, "-o", "posix_lock")
	}
	return append(args, c.Server.ExtraArgs...)
}

// configKey is one leaf key of the configuration: how to check it and, if pods may set it, how
// to parse an annotation's value into it.
type configKey struct {
	name  string
	show  func(*Config) string
	check func(*Config) error
	// set parses an annotation value into the key; nil for keys only the file may set.
	set func(c *Config, v string) error
}

func lookupKey(name string) *configKey {
	for i := range configKeys {
		if configKeys[i].name == name {
			return &configKeys[i]
		}
	}
	return nil
}

// Limits that are policy rather than protocol.
const (
	maxThreadPoolSize = 1024 // kvfsd's own bound
	maxVCPUs          = 288  // QEMU q35's
	// kvfsd serves at most this many request queues; QEMU's bound is higher.
	maxKvfsdRequestQueues = 16
	maxTagLen             = 36 // the tag field of struct virtio_fs_config
	maxQueueSize          = 1024
	maxBootTimeout        = time.Hour
	// defaultTCGTBSize is vm.tcg_tb_size's default, in MiB: a pod's QEMU under TCG holds
	// about this much translated code at most, instead of up to 1 GiB
	// (docs/measurements/benchmarks.md).
	defaultTCGTBSize = 32
)

// configKeys is every leaf key, in file order. It is filled in init because the check of
// annotations.enabled looks keys up in it.
var configKeys []configKey

func init() { configKeys = allKeys() }

func allKeys() []configKey {
	return []configKey{
		{
			name: "base_dir", show: func(c *Config) string { return strconv.Quote(c.BaseDir) },
			check: func(c *Config) error { return checkAbsPath(c.BaseDir) },
		},
		{
			name: "server.daemon", show: func(c *Config) string { return strconv.Quote(c.Server.Daemon) },
			check: func(c *Config) error { return checkDaemon(c.Server.Daemon) },
			set: func(c *Config, v string) error {
				if !slices.Contains(c.Server.ValidDaemonPaths, v) {
					return fmt.Errorf("%q is not in server.valid_daemon_paths %q", v, c.Server.ValidDaemonPaths)
				}
				c.Server.Daemon = v
				return nil
			},
		},
		{
			name: "server.valid_daemon_paths", show: func(c *Config) string { return fmt.Sprintf("%q", c.Server.ValidDaemonPaths) },
			check: func(c *Config) error {
				for _, p := range c.Server.ValidDaemonPaths {
					if err := checkDaemon(p); err != nil {
						return fmt.Errorf("%q: %w", p, err)
					}
				}
				return nil
			},
		},
		{
			name: "server.cache", show: func(c *Config) string { return strconv.Quote(c.Server.Cache) },
			check: func(c *Config) error {
				switch c.Server.Cache {
				case "auto", "always", "metadata", "never":
					return nil
				}
				return errors.New("want auto, always, metadata or never")
			},
			set: func(c *Config, v string) error { c.Server.Cache = v; return nil },
		},
		{
			name: "server.posix_lock", show: func(c *Config) string { return strconv.FormatBool(c.Server.PosixLock) },
			check: func(*Config) error { return nil },
			set:   setBool(func(c *Config) *bool { return &c.Server.PosixLock }),
		},
		{
			name: "server.thread_pool_size", show: func(c *Config) string { return strconv.Itoa(c.Server.ThreadPoolSize) },
			check: func(c *Config) error {
				if n := c.Server.ThreadPoolSize; n < 0 || n > maxThreadPoolSize {
					return fmt.Errorf("want 0 to %d", maxThreadPoolSize)
				}
				return nil
			},
			set: setInt(func(c *Config) *int { return &c.Server.ThreadPoolSize }),
		},
		{
			name: "server.announce_submounts", show: func(c *Config) string { return strconv.FormatBool(c.Server.AnnounceSubmounts) },
			check: func(*Config) error { return nil },
			set:   setBool(func(c *Config) *bool { return &c.Server.AnnounceSubmounts }),
		},
		{
			name: "server.xattr", show: func(c *Config) string { return strconv.FormatBool(c.Server.Xattr) },
			check: func(*Config) error { return nil },
			set:   setBool(func(c *Config) *bool { return &c.Server.Xattr }),
		},
		{
			name: "server.extra_args", show: func(c *Config) string { return fmt.Sprintf("%q", c.Server.ExtraArgs) },
			check: func(c *Config) error {
				if len(c.Server.ExtraArgs) > 0 && isKvfsd(c.Server.Daemon) {
					return fmt.Errorf("extra arguments apply only to an external server.daemon, not to %q", c.Server.Daemon)
				}
				return checkExtraArgs(c.Server.ExtraArgs)
			},
			// A JSON array of strings; pods may set it only if "server.extra_args" is listed in
			// annotations.enabled (the file's operator decides; Kata warns against it too).
			set: func(c *Config, v string) error {
				args, err := parseStringList(v)
				if err != nil {
					return err
				}
				c.Server.ExtraArgs = args
				return nil
			},
		},
		{
			name: "server.on_failure", show: func(c *Config) string { return strconv.Quote(c.Server.OnFailure) },
			check: func(c *Config) error {
				switch c.Server.OnFailure {
				case PolicyStop, PolicyRestart:
					return nil
				}
				return fmt.Errorf("want %s or %s", PolicyStop, PolicyRestart)
			},
			set: func(c *Config, v string) error { c.Server.OnFailure = v; return nil },
		},
		{
			name: "server.max_restarts", show: func(c *Config) string { return strconv.Itoa(c.Server.MaxRestarts) },
			check: func(c *Config) error {
				if n := c.Server.MaxRestarts; n < 0 || n > 100 {
					return errors.New("want 0 to 100")
				}
				return nil
			},
		},
		{
			name: "device.tag", show: func(c *Config) string { return strconv.Quote(c.Device.Tag) },
			check: func(c *Config) error { return checkTag(c.Device.Tag) },
			set:   func(c *Config, v string) error { c.Device.Tag = v; return nil },
		},
		{
			name: "device.queue_size", show: func(c *Config) string { return strconv.Itoa(c.Device.QueueSize) },
			check: func(c *Config) error { return checkQueueSize(c.Device.QueueSize) },
			set:   setInt(func(c *Config) *int { return &c.Device.QueueSize }),
		},
		{
			name: "device.num_request_queues", show: func(c *Config) string { return strconv.Itoa(c.Device.NumRequestQueues) },
			check: func(c *Config) error {
				if c.Device.NumRequestQueues == 0 {
					return nil
				}
				if err := checkNumRequestQueues(c.Device.NumRequestQueues); err != nil {
					return fmt.Errorf("%w, or 0 for one per vCPU", err)
				}
				if isKvfsd(c.Server.Daemon) && c.Device.NumRequestQueues > maxKvfsdRequestQueues {
					return fmt.Errorf("kvfsd (server.daemon = %q) serves at most %d request queues", c.Server.Daemon, maxKvfsdRequestQueues)
				}
				return nil
			},
			set: setInt(func(c *Config) *int { return &c.Device.NumRequestQueues }),
		},
		{
			name: "vm.qemu", show: func(c *Config) string { return strconv.Quote(c.VM.QEMU) },
			check: func(c *Config) error {
				if c.VM.QEMU == "" {
					return errors.New("empty")
				}
				if strings.Contains(c.VM.QEMU, "/") {
					return checkAbsPath(c.VM.QEMU)
				}
				return nil
			},
		},
		{
			name: "vm.machine", show: func(c *Config) string { return strconv.Quote(c.VM.Machine) },
			check: func(c *Config) error { return checkMachine(c.VM.Machine) },
		},
		{
			name: "vm.accel", show: func(c *Config) string { return strconv.Quote(c.VM.Accel) },
			check: func(c *Config) error {
				if c.VM.Accel == "" {
					return nil
				}
				return checkAccel(c.VM.Accel)
			},
		},
		{
			name: "vm.tcg_tb_size", show: func(c *Config) string { return strconv.Itoa(c.VM.TCGTBSize) },
			check: func(c *Config) error { return checkTCGTBSize(c.VM.TCGTBSize) },
			set:   setInt(func(c *Config) *int { return &c.VM.TCGTBSize }),
		},
		{
			name: "vm.cpu", show: func(c *Config) string { return strconv.Quote(c.VM.CPU) },
			check: func(c *Config) error {
				if c.VM.CPU == "" {
					return errors.New("empty")
				}
				return nil
			},
		},
		{
			name: "vm.vcpus", show: func(c *Config) string { return strconv.Itoa(c.VM.VCPUs) },
			check: func(c *Config) error { return checkVCPUs(c.VM.VCPUs) },
			set:   setInt(func(c *Config) *int { return &c.VM.VCPUs }),
		},
		{
			name: "vm.memory", show: func(c *Config) string { return strconv.Quote(c.VM.Memory) },
			check: func(c *Config) error { _, err := ParseMemorySize(c.VM.Memory); return err },
			set:   func(c *Config, v string) error { c.VM.Memory = v; return nil },
		},
		{
			name: "vm.memory_placement", show: func(c *Config) string { return strconv.Quote(c.VM.MemoryPlacement) },
			check: func(c *Config) error { return checkPlacement(c.VM.MemoryPlacement) },
		},
		{
			name: "vm.hugepages", show: func(c *Config) string { return strconv.FormatBool(c.VM.Hugepages) },
			check: func(c *Config) error {
				if c.VM.Hugepages && c.VM.HugepagePath == "" {
					return errors.New("needs vm.hugepage_path")
				}
				return nil
			},
			set: setBool(func(c *Config) *bool { return &c.VM.Hugepages }),
		},
		{
			name: "vm.hugepage_path", show: func(c *Config) string { return strconv.Quote(c.VM.HugepagePath) },
			check: func(c *Config) error {
				if c.VM.HugepagePath == "" {
					return nil
				}
				return checkAbsPath(c.VM.HugepagePath)
			},
		},
		{
			name: "vm.file_mem_path", show: func(c *Config) string { return strconv.Quote(c.VM.FileMemPath) },
			check: func(c *Config) error {
				if c.VM.FileMemPath == "" {
					return nil
				}
				return checkAbsPath(c.VM.FileMemPath)
			},
		},
		{
			name: "vm.kernel", show: func(c *Config) string { return strconv.Quote(c.VM.Kernel) },
			check: func(c *Config) error { return checkAbsPath(c.VM.Kernel) },
		},
		{
			name: "vm.rootfs", show: func(c *Config) string { return strconv.Quote(c.VM.Rootfs) },
			check: func(c *Config) error {
				if c.VM.Rootfs == "" {
					return nil
				}
				return checkAbsPath(c.VM.Rootfs)
			},
		},
		{
			name: "vm.initrd", show: func(c *Config) string { return strconv.Quote(c.VM.Initrd) },
			check: func(c *Config) error {
				if c.VM.Initrd == "" {
					return nil
				}
				if c.VM.Rootfs != "" {
					return fmt.Errorf("vm.rootfs is %q too: the guest's root is one or the other (set the one not used to \"\")", c.VM.Rootfs)
				}
				return checkAbsPath(c.VM.Initrd)
			},
		},
		{
			name: "vm.kernel_params", show: func(c *Config) string { return strconv.Quote(c.VM.KernelParams) },
			check: func(c *Config) error { return checkNoNUL(c.VM.KernelParams) },
		},
		{
			name: "vm.free_page_reporting", show: func(c *Config) string { return strconv.FormatBool(c.VM.FreePageReporting) },
			check: func(*Config) error { return nil },
		},
		{
			name: "agent.transport", show: func(c *Config) string { return strconv.Quote(c.Agent.Transport) },
			check: func(c *Config) error {
				switch c.Agent.Transport {
				case AgentSerial, AgentVsock:
					return nil
				}
				return fmt.Errorf("want %s or %s", AgentSerial, AgentVsock)
			},
		},
		{
			name: "agent.boot_timeout", show: func(c *Config) string { return strconv.Quote(c.Agent.BootTimeout) },
			check: func(c *Config) error {
				d, err := time.ParseDuration(c.Agent.BootTimeout)
				if err != nil {
					return errors.New(`want a duration such as "120s" or "2m"`)
				}
				if d <= 0 || d > maxBootTimeout {
					return fmt.Errorf("want more than 0 and at most %s", maxBootTimeout)
				}
				return nil
			},
		},
		{
			name: "annotations.prefix", show: func(c *Config) string { return strconv.Quote(c.Annotations.Prefix) },
			check: func(c *Config) error {
				if c.Annotations.Prefix == "" && len(c.Annotations.Enabled) > 0 {
					return errors.New("empty, but annotations.enabled is not")
				}
				return nil
			},
		},
		{
			name: "annotations.enabled", show: func(c *Config) string { return fmt.Sprintf("%q", c.Annotations.Enabled) },
			check: func(c *Config) error {
				for _, name := range c.Annotations.Enabled {
					k := lookupKey(name)
					if k == nil {
						return fmt.Errorf("no configuration key %q", name)
					}
					if k.set == nil {
						return fmt.Errorf("%s cannot be set by annotation", name)
					}
				}
				return nil
			},
		},
	}
}

func setBool(field func(*Config) *bool) func(*Config, string) error {
	return func(c *Config, v string) error {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return errors.New("want true or false")
		}
		*field(c) = b
		return nil
	}
}

func setInt(field func(*Config) *int) func(*Config, string) error {
	return func(c *Config, v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return errors.New("want a decimal integer")
		}
		*field(c) = n
		return nil
	}
}

// parseStringList parses a JSON array of strings, the format of list annotations.
func parseStringList(v string) ([]string, error) {
	var list []string
	if err := json.Unmarshal([]byte(v), &list); err != nil {
		return nil, fmt.Errorf(`want a JSON array of strings, e.g. ["--xattr"]: %v`, err)
	}
	return list, nil
}

// checkDaemon checks a value of server.daemon.
func checkDaemon(d string) error {
	switch {
	case isKvfsd(d):
		return nil
	case d == legacyInProcess:
		return fmt.Errorf("the unconfined in-process server is now an explicit opt-in: use %q (the default: the same server, "+
			"confined in a process of its own) or %q", Confined, InProcessUnconfined)
	case !strings.HasPrefix(d, "/"):
		return fmt.Errorf("want %q, %q or the absolute path of a virtiofsd-compatible daemon", Confined, InProcessUnconfined)
	}
	return checkAbsPath(d)
}

func checkAbsPath(p string) error {
	switch {
	case p == "":
		return errors.New("empty path")
	case !filepath.IsAbs(p):
		return errors.New("not an absolute path")
	case filepath.Clean(p) != p:
		return fmt.Errorf("not a clean path (want %s)", filepath.Clean(p))
	case strings.ContainsAny(p, "\x00\n"):
		return errors.New("contains a NUL or newline")
	}
	return nil
}

// checkExtraArgs refuses arguments that would take over what the sandbox decides: the socket,
// the descriptor, the exported directory; and daemonizing, which would hide the daemon's death.
func checkExtraArgs(args []string) error {
	refused := []string{"--fd", "--socket-path", "--socket", "--socket-group", "--shared-dir", "--daemonize"}
	for i, a := range args {
		name, _, _ := strings.Cut(a, "=")
		if slices.Contains(refused, name) {
			return fmt.Errorf("argument %q is set by the sandbox, not by extra arguments", a)
		}
		var list string
		switch {
		case a == "-o" && i+1 < len(args):
			list = args[i+1]
		case strings.HasPrefix(a, "-o") && a != "-o":
			list = a[2:]
		default:
			continue
		}
		for _, item := range strings.Split(list, ",") {
			if item == "source" || strings.HasPrefix(item, "source=") {
				return fmt.Errorf("argument %q sets the shared directory, which the sandbox decides", list)
			}
		}
	}
	return nil
}
