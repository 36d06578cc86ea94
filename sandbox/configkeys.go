package sandbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The configuration's keys, one table (allKeys): each leaf key's check, how it shows, and how an
// annotation sets it if pods may; Validate and Resolve (a pod's annotations applied) walk it.

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
