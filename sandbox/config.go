package sandbox

import (
	"bytes"
	"errors"
	"fmt"
	"os"
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
