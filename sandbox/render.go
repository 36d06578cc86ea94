package sandbox

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
)

// keyDocs documents every configuration key, for RenderConfig. Each line becomes a comment
// line above the key.
var keyDocs = map[string]string{
	"base_dir": "One directory per sandbox: BASE/<id>/{mounts,shared,private}, vhost-fs.sock, state.json.",

	"server.daemon": `"confined" (kvfsd in a process of its own, started from the owner's binary:
new namespaces, the shared directory as its root, seccomp, only the capabilities it needs),
"in-process-unconfined" (kvfsd inside the owning process, unconfined: logs a warning at every
start), or the absolute path of a virtiofsd-compatible daemon, run as: DAEMON --fd=3
--shared-dir=DIR --cache=MODE [--thread-pool-size=N] [--announce-submounts] [--xattr]
[-o posix_lock] EXTRA_ARGS...`,
	"server.valid_daemon_paths": `The values the annotation for server.daemon may take ("confined" and "in-process-unconfined" may be listed).`,
	"server.cache":              "auto, always, metadata or never.",
	"server.posix_lock":         "false (no_posix_lock): locks stay local to the guest.",
	"server.thread_pool_size":   "Request workers; 0: requests are served on the queue's thread.",
	"server.announce_submounts": "Mounts inside the share appear to the guest as submounts (their own st_dev).",
	"server.xattr":              "Extended attributes.",
	"server.extra_args":         "External daemons only; may not set the socket, fd or directory.",
	"server.on_failure":         "stop: kill the VM (Kata's behaviour); restart: start a new server.",
	"server.max_restarts":       "With on_failure = restart: after this many, the next failure stops the VM.",
	"device.tag":                "What the guest mounts: 1 to 36 bytes.",
	"device.queue_size":         "A power of two, at most 1024.",
	"device.num_request_queues": "0: one per vCPU when kvfsd serves (at most 16), one for an external daemon; else the number, of which kvfsd (confined or in-process) serves at most 16.",
	"vm.qemu":                   "The emulator, looked up in $PATH when it has no slash.",
	"vm.machine":                "QEMU's machine type.",
	"vm.accel":                  `kvm, tcg, or "": kvm if /dev/kvm opens, else tcg; a boot that fails under KVM chosen so is an error saying to set "tcg".`,
	"vm.tcg_tb_size":            "Under TCG, QEMU's buffer of translated code in MiB (-accel tcg,tb-size=): the memory it may take; 0: QEMU's own bound, up to 1 GiB.",
	"vm.cpu":                    "QEMU's -cpu model.",
	"vm.vcpus":                  "Virtual CPUs.",
	"vm.memory":                 `Guest RAM, e.g. "512M", "2G" (at least 128M).`,
	"vm.memory_placement":       "numa: -numa node,memdev=; machine: -machine memory-backend=.",
	"vm.hugepages":              "Back the guest RAM with a file in hugepage_path, preallocated.",
	"vm.hugepage_path":          "The hugetlbfs mount for vm.hugepages.",
	"vm.file_mem_path":          `"": a memfd (default); else a shared file in this tmpfs directory.`,
	"vm.kernel":                 "The guest kernel of the kvfs guest image (packaging/guest/build.sh --agent).",
	"vm.rootfs":                 `The guest image's root (erofs, mapped read-only over virtio-pmem), whose /init is the agent; "": none.`,
	"vm.initrd":                 `The guest image's initramfs instead of vm.rootfs (Debian's kernel); "": none.`,
	"vm.kernel_params":          `Appended to: console=ttyS0 quiet panic=-1 kvfs.tag=<device.tag> kvfs.agent=<transport>; e.g. "kvfs.debug=1".`,
	"vm.free_page_reporting":    "A virtio-balloon device with free page reporting: the memory the guest frees goes back to the host.",
	"agent.transport":           "serial: virtio-serial port on <sandbox>/agent.sock; vsock: vhost-vsock-pci, port 1024 (needs /dev/vhost-vsock).",
	"agent.boot_timeout":        "VM start to the agent's first answer (TCG boots are slow).",
	"annotations.prefix":        "Every configuration annotation starts with this.",
	"annotations.enabled": `Keys a pod may set, e.g. ["server.cache", "device.queue_size"]. Annotations are
written by whoever writes the pod spec: enable only what they may choose.`,
}

// RenderConfig writes c as a configuration file that documents every key: each key with its
// doc as comments, then the key itself, commented out ("# key = default") where c has the
// default, and set where c differs from DefaultConfig. Loading the result gives c back; so
// does loading it with every key uncommented. It is what `kvfsctl config default` prints and
// what the installer puts in /etc/kvfs/configuration.toml.
func RenderConfig(c *Config) []byte {
	var b strings.Builder
	b.WriteString("# The kvfs sandbox configuration. Every key is shown with its doc; a key commented out\n" +
		"# has its default, shown. Uncomment a key to change it; an unknown key is an error.\n")
	def := DefaultConfig()
	table := ""
	for _, f := range configFields(c) {
		name, leaf, _ := strings.Cut(f.name, ".")
		if leaf == "" {
			leaf = name
		} else if name != table {
			table = name
			fmt.Fprintf(&b, "\n[%s]\n", table)
		}
		b.WriteString("\n")
		for _, line := range strings.Split(keyDocs[f.name], "\n") {
			b.WriteString("# " + line + "\n")
		}
		if reflect.DeepEqual(normalizeEmpty(f.value), normalizeEmpty(fieldValue(def, f.name))) {
			b.WriteString("# ")
		}
		b.WriteString(leaf + " = " + tomlValue(f.value) + "\n")
	}
	return []byte(b.String())
}

// configField is one leaf key of a Config and its value.
type configField struct {
	name  string // "server.cache"
	value reflect.Value
}

// configFields lists c's leaf keys in the order of Config's fields, named by their toml tags.
func configFields(c *Config) []configField {
	var out []configField
	var walk func(prefix string, v reflect.Value)
	walk = func(prefix string, v reflect.Value) {
		t := v.Type()
		for i := range t.NumField() {
			name := prefix + strings.Split(t.Field(i).Tag.Get("toml"), ",")[0]
			if fv := v.Field(i); fv.Kind() == reflect.Struct {
				walk(name+".", fv)
			} else {
				out = append(out, configField{name, fv})
			}
		}
	}
	walk("", reflect.ValueOf(c).Elem())
	return out
}

func fieldValue(c *Config, name string) reflect.Value {
	for _, f := range configFields(c) {
		if f.name == name {
			return f.value
		}
	}
	panic("sandbox: no configuration field " + name) // configFields and name come from the same struct
}

// normalizeEmpty makes an empty slice nil, so that [] in a file equals an unset default.
func normalizeEmpty(v reflect.Value) any {
	if v.Kind() == reflect.Slice && v.Len() == 0 {
		return nil
	}
	return v.Interface()
}

// tomlValue formats a string, bool, int or []string field as a TOML value.
func tomlValue(v reflect.Value) string {
	switch v.Kind() {
	case reflect.String:
		return tomlString(v.String())
	case reflect.Bool:
		return strconv.FormatBool(v.Bool())
	case reflect.Int:
		return strconv.FormatInt(v.Int(), 10)
	case reflect.Slice:
		items := make([]string, v.Len())
		for i := range items {
			items[i] = tomlValue(v.Index(i))
		}
		return "[" + strings.Join(items, ", ") + "]"
	}
	panic("sandbox: configuration field of kind " + v.Kind().String()) // TestRenderConfig covers every field
}

// tomlString is s as a TOML basic string.
func tomlString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, `\u%04X`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}
