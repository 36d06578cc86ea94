package agent

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
	"time"
)

// What the host and the guest agent agree on besides the RPCs: where the share is mounted, how
// the agent is reached, and the kernel command line that tells the agent both.
const (
	// SharedDir is where the agent mounts the pod's virtio-fs share in the guest. A
	// container's root filesystem, bound at mounts/NAME on the host, is SharedDir/NAME here.
	SharedDir = "/run/kvfs/shared"

	// PodTmpfsDir is where the agent mounts the pod's tmpfs volumes
	// (CreateContainerRequest.pod_tmpfs), each at PodTmpfsDir/NAME: a container's spec binds
	// them from there.
	PodTmpfsDir = "/run/kvfs/pod-tmpfs"

	// MirrorDir is where the agent keeps its copies of the share's binds that the kubelet
	// updates in place (CreateContainerRequest.mirrored), each at MirrorDir/NAME: a
	// container's spec binds them from there.
	MirrorDir = "/run/kvfs/mirrored"

	// PodPIDNamespace, as the path of the PID namespace of a container's spec, is the pod's
	// shared PID namespace (Kubernetes' shareProcessNamespace): the agent makes it at first
	// use, with an init of its own as the pause container is a runc pod's, and has runc join
	// it. The shim names it where the host's spec joins another container's PID namespace.
	PodPIDNamespace = "kvfs:pod-pid-namespace"

	// PodUserNamespace, as the path of the user namespace of a container's spec, is the pod's
	// user namespace (the CRI's user namespace mode POD, Kubernetes' hostUsers: false): the
	// agent makes it at first use with the spec's linux.uidMappings and linux.gidMappings,
	// which every container of the pod then gives alike, and has runc join it. The pod's PID
	// namespace is made inside it. The shim names it where the host's spec joins another
	// container's user namespace.
	PodUserNamespace = "kvfs:pod-user-namespace"

	// ContainersCgroup is the guest cgroup (below the cgroup2 root) that holds every
	// container's, each at ContainersCgroup/ID: the agent makes it at boot, and its metrics
	// are the pod's (Stats without a container id).
	ContainersCgroup = "/kvfs"

	// SerialPortName is the name of the virtio-serial port that carries the API
	// (-device virtserialport,name=io.kvfs.agent.0); the guest finds it in
	// /sys/class/virtio-ports/*/name.
	SerialPortName = "io.kvfs.agent.0"

	// DefaultVsockPort is the vsock port the agent listens on with the vsock transport.
	DefaultVsockPort = 1024

	// CmdlineTag (kvfs.tag=TAG) is the virtio-fs tag the agent mounts at SharedDir.
	CmdlineTag = "kvfs.tag"
	// CmdlineTransport (kvfs.agent=serial or kvfs.agent=vsock:PORT) chooses the transport;
	// serial is the default.
	CmdlineTransport = "kvfs.agent"
	// CmdlineDebug (kvfs.debug=1) makes the agent log at debug level on the console.
	CmdlineDebug = "kvfs.debug"
	// CmdlineHostname (kvfs.hostname=NAME) is the guest's hostname: the pod's, which its
	// containers share with the guest's UTS namespace. A valid one (CheckHostname).
	CmdlineHostname = "kvfs.hostname"
	// CmdlineFault (kvfs.fault=MODE) makes an agent built for tests (the kvfsfaults build
	// tag) misbehave as MODE says, to test the host against a hostile guest; the agent of a
	// shipped image, built without the tag, refuses to boot with it.
	CmdlineFault = "kvfs.fault"
)

// The per-boot secret the host proves it holds before the agent serves it. The host makes
// SecretLen random bytes for each boot and gives them to QEMU in a file QEMU inherits, never on
// its command line; QEMU offers them to the guest as an SMBIOS OEM string (type 11),
// SecretOEMPrefix followed by the bytes in lower-case hex, which the agent reads at boot from
// the kernel's copy of the SMBIOS tables (/sys/firmware/dmi/tables/DMI, root's only). Every
// connection then begins with Hello(secret), before any ttrpc.
const (
	SecretLen       = 32
	SecretOEMPrefix = "io.kvfs.agent.secret="
	// HelloLen is the length of Hello's answer.
	HelloLen = helloHeaderLen + SecretLen
	// helloHeaderLen is ttrpc's message header: length, stream id, type, flags.
	helloHeaderLen = 10
)

// SecretOEMString is the SMBIOS OEM string that carries secret to the guest.
func SecretOEMString(secret []byte) string { return SecretOEMPrefix + hex.EncodeToString(secret) }

// Hello is what the host sends first on each connection to the agent: secret in a message of
// ttrpc's shape (a header of its length, stream id 0, type request, no flags; big-endian),
// so that the agent's serial port, which follows ttrpc's framing, takes it for the start of
// a new host session (no ttrpc client uses stream 0: their ids are odd, from 1).
func Hello(secret []byte) []byte {
	b := make([]byte, helloHeaderLen, helloHeaderLen+len(secret))
	binary.BigEndian.PutUint32(b[0:4], uint32(len(secret)))
	b[8] = 1 // ttrpc's request
	return append(b, secret...)
}

// The bounds of port-forward's connections (OpenPort, ReadPort, WritePort, ClosePort), which
// the agent enforces and the shim's deadlines are made from.
const (
	// MaxPortStreams is how many port connections the agent keeps open at once; OpenPort
	// answers ResourceExhausted beyond.
	MaxPortStreams = 64
	// MaxPortWrite is the most bytes one WritePort carries.
	MaxPortWrite = 1 << 20
	// PortDialTimeout bounds OpenPort's dials, both addresses together: a refusal is
	// immediate, so only a port whose packets the guest drops takes that long.
	PortDialTimeout = 10 * time.Second
	// PortWriteWait is the longest WritePort waits for the guest's side to take the data
	// before it answers what was taken: the guest's server may read slowly, and a write must
	// still answer within the shim's deadline.
	PortWriteWait = time.Second
)

// MaxInterfaceName is the longest network interface name the kernel takes (IFNAMSIZ less the
// NUL).
const MaxInterfaceName = 15

// CheckInterfaceName accepts a network interface name the kernel takes: 1 to MaxInterfaceName
// bytes, not "." or "..", no '/', ':' (alias syntax), white space or character outside
// printable ASCII. The error says why, not which name: the caller names it.
func CheckInterfaceName(name string) error {
	switch {
	case name == "" || len(name) > MaxInterfaceName:
		return fmt.Errorf("want 1 to %d bytes, not %d", MaxInterfaceName, len(name))
	case name == "." || name == "..":
		return errors.New("not a name")
	}
	for _, r := range name {
		if r == '/' || r == ':' || r <= ' ' || r >= 0x7f {
			return errors.New("contains '/', ':', a space or a character outside printable ASCII")
		}
	}
	return nil
}

// CheckHostname accepts a hostname for CmdlineHostname: 1 to 64 bytes (the kernel's limit) of
// letters, digits, '-' and '.', starting and ending with a letter or digit (RFC 1123), so it is
// one word of the kernel command line.
func CheckHostname(name string) error {
	if name == "" || len(name) > 64 {
		return fmt.Errorf("hostname %q: want 1 to 64 bytes", name)
	}
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	for i := 0; i < len(name); i++ {
		if c := name[i]; !alnum(c) && c != '-' && c != '.' {
			return fmt.Errorf("hostname %q: %q is not a letter, a digit, '-' or '.'", name, c)
		}
	}
	if !alnum(name[0]) || !alnum(name[len(name)-1]) {
		return fmt.Errorf("hostname %q: want a letter or digit first and last", name)
	}
	return nil
}

// Bounds of a SetSysctls request.
const (
	maxSysctls        = 256
	maxSysctlName     = 256
	maxSysctlValueLen = 4096
)

// SysctlPath returns the path below /proc/sys of the sysctl name, as sysctl(8) reads it: dots
// separate the components, unless the name has a '/', which then separates them and leaves
// dots alone (net/ipv4/conf/eth0.100/rp_filter). Components are letters, digits, '_', '-'
// (and '.' in the slash form), never empty, "." or "..".
func SysctlPath(name string) (string, error) {
	if name == "" || len(name) > maxSysctlName {
		return "", fmt.Errorf("sysctl %q: want a name of 1 to %d bytes", name, maxSysctlName)
	}
	sep := "."
	if strings.Contains(name, "/") {
		sep = "/"
	}
	parts := strings.Split(name, sep)
	for _, p := range parts {
		if p == "" || p == "." || p == ".." {
			return "", fmt.Errorf("sysctl %q: an empty, \".\" or \"..\" component", name)
		}
		for _, c := range []byte(p) {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-' || c == '.') {
				return "", fmt.Errorf("sysctl %q: %q is not a letter, a digit, '_', '-' or a separator", name, c)
			}
		}
	}
	return strings.Join(parts, "/"), nil
}

// CheckSysctls accepts what SetSysctls may carry: at most 256 names SysctlPath takes,
// with values of at most 4096 bytes and no control character but tab.
func CheckSysctls(sysctls map[string]string) error {
	if len(sysctls) > maxSysctls {
		return fmt.Errorf("%d sysctls, more than %d", len(sysctls), maxSysctls)
	}
	for _, name := range slices.Sorted(maps.Keys(sysctls)) {
		if _, err := SysctlPath(name); err != nil {
			return err
		}
		v := sysctls[name]
		if len(v) > maxSysctlValueLen {
			return fmt.Errorf("sysctl %s: a value of %d bytes, more than %d", name, len(v), maxSysctlValueLen)
		}
		for _, c := range []byte(v) {
			if c < ' ' && c != '\t' || c == 0x7f {
				return fmt.Errorf("sysctl %s: value %q has a control character", name, v)
			}
		}
	}
	return nil
}

// MaxSubmounts bounds CreateContainerRequest.submounts.
const MaxSubmounts = 1024

// CheckSubmounts accepts what CreateContainerRequest.submounts may carry: at most
// MaxSubmounts clean absolute paths strictly below SharedDir, without NUL, of at most 4096
// bytes each.
func CheckSubmounts(points []string) error {
	if len(points) > MaxSubmounts {
		return fmt.Errorf("%d submounts, more than %d", len(points), MaxSubmounts)
	}
	for _, p := range points {
		switch {
		case len(p) > 4096:
			return fmt.Errorf("submount %.64q...: longer than 4096 bytes", p)
		case !strings.HasPrefix(p, SharedDir+"/") || path.Clean(p) != p || strings.ContainsRune(p, 0):
			return fmt.Errorf("submount %q: not a clean path below %s", p, SharedDir)
		}
	}
	return nil
}

// MaxPodTmpfs bounds CreateContainerRequest.pod_tmpfs.
const MaxPodTmpfs = 64

// CheckPodTmpfs accepts what CreateContainerRequest.pod_tmpfs may carry: at most MaxPodTmpfs
// tmpfs volumes, each named by one path element of at most 253 bytes of letters, digits, '.',
// '_' and '-' (a Kubernetes volume name is a DNS label), not "." or "..", each name once, a
// mode of permission bits only.
func CheckPodTmpfs(vols []*PodTmpfs) error {
	if len(vols) > MaxPodTmpfs {
		return fmt.Errorf("%d pod tmpfs volumes, more than %d", len(vols), MaxPodTmpfs)
	}
	seen := map[string]bool{}
	for _, v := range vols {
		name := v.GetName()
		switch {
		case name == "" || name == "." || name == ".." || len(name) > 253 ||
			strings.IndexFunc(name, func(r rune) bool { return !isNameRune(r) }) >= 0:
			return fmt.Errorf("pod tmpfs %.64q: not a volume name", name)
		case seen[name]:
			return fmt.Errorf("pod tmpfs %q: given twice", name)
		case v.GetMode()&^0o7777 != 0:
			return fmt.Errorf("pod tmpfs %q: mode %#o has more than permission bits", name, v.GetMode())
		}
		seen[name] = true
	}
	return nil
}

func isNameRune(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
}

// MaxMirrored bounds CreateContainerRequest.mirrored.
const MaxMirrored = 64

// CheckMirrored accepts what CreateContainerRequest.mirrored may carry: at most MaxMirrored
// names of the share's binds, each one path element of at most 255 bytes, not "." or "..",
// without NUL, each once.
func CheckMirrored(names []string) error {
	if len(names) > MaxMirrored {
		return fmt.Errorf("%d mirrored volumes, more than %d", len(names), MaxMirrored)
	}
	seen := map[string]bool{}
	for _, n := range names {
		switch {
		case n == "" || n == "." || n == ".." || len(n) > 255 || strings.ContainsAny(n, "/\x00"):
			return fmt.Errorf("mirrored volume %.64q: not a name in the share", n)
		case seen[n]:
			return fmt.Errorf("mirrored volume %q: given twice", n)
		}
		seen[n] = true
	}
	return nil
}
