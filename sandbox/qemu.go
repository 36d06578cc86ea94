package sandbox

import (
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// Accelerators.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// Fixed QEMU object ids. They contain no comma, but go through qemuOpt like every other value.
const (
	memID       = "kvfs-mem0"
	fsCharID    = "kvfs-fs0-chr"
	fsDeviceID  = "kvfs-fs0"
	consoleID   = "kvfs-console0"
	serialID    = "kvfs-serial0"
	agentCharID = "kvfs-agent0"
	balloonID   = "kvfs-balloon0"
	rootMemID   = "kvfs-root0-mem"
	rootID      = "kvfs-root0"
	// netdevID and nicID, followed by the NIC's index, name its tap back end and its device.
	netdevID = "kvfs-net"
	nicID    = "kvfs-nic"
	// firstNICFd is the descriptor number of NIC 0's tap in QEMU: the first of
	// exec.Cmd.ExtraFiles. The console's pipe comes after the taps, the agent's secret last.
	firstNICFd = 3
	// maxNICs bounds VM.NICs.
	maxNICs = 8
	// minMTU and maxMTU bound NIC.MTU: IPv4's minimum, and the largest virtio-net takes.
	minMTU      = 68
	maxMTU      = 65535
	minMemBytes = 128 << 20
	// maxSocketPath is the longest path connect(2) takes: sun_path holds 108 bytes with the NUL.
	maxSocketPath = 107
	// maxRequestQueues is QEMU's bound: VIRTIO_QUEUE_MAX (1024) queues, one of them hiprio.
	maxRequestQueues = 1023
	// maxTCGTBSize is QEMU's bound on tb-size on x86-64 hosts, in MiB: 2 GiB.
	maxTCGTBSize = 2048
)

// VM describes one guest as QEMU runs it. It is pure data: Args turns it into QEMU's arguments
// and starts nothing. Sandbox.DefaultVM fills it from the configuration.
type VM struct {
	// Name identifies the guest in ps and QEMU's messages (-name); optional.
	Name string
	// Machine is the machine type: q35, pc, pc-q35-7.2, ...
	Machine string
	// Accel is AccelKVM or AccelTCG.
	Accel string
	// TCGTBSize, under TCG, bounds QEMU's buffer of translated code, in MiB (-accel
	// tcg,tb-size=); when it is full QEMU drops every translation and starts again. 0 leaves
	// QEMU's own bound, an eighth of the host's RAM up to 1 GiB, which a long-lived guest
	// fills as it runs new code. Ignored under KVM.
	TCGTBSize int
	// CPU is the -cpu model, passed as is.
	CPU string
	// VCPUs is the number of virtual CPUs, at least 1.
	VCPUs int
	// Memory is the guest RAM and how it is shared with the virtio-fs server.
	Memory Memory
	// Kernel, Initrd and Cmdline boot the guest directly. Kernel may be empty (firmware boot);
	// Initrd and Cmdline need a Kernel.
	Kernel, Initrd, Cmdline string
	// Root is a file system image QEMU maps into the guest read-only, as a virtio-pmem device:
	// the guest's /dev/pmem0, its root when Cmdline says so (RootCmdline: the kernel mounts it
	// with DAX, its pages the host's page cache of the file, shared by every VM that maps it,
	// never copied into guest RAM). What the guest writes to it is dropped: one image serves
	// every pod. Its size must be a positive multiple of 2 MiB (QEMU maps the whole file; the
	// guest maps it in 2 MiB sections). It needs a Kernel. Empty: none.
	Root string
	// FS is the virtio-fs device. Sandbox.Start sets it to the sandbox's device.
	FS FSDevice
	// Console is the write end of a pipe that receives the guest's serial console, or nil for
	// no serial port. QEMU inherits it after the NICs' taps (Files) and writes to it through
	// /proc/self/fd: the file chardev, which cannot be capped, never writes a file. Sandbox.Start
	// sets it to the sandbox's and drains the other end.
	Console *os.File
	// Agent is the channel to the guest agent; the zero value adds none.
	Agent AgentDevice
	// AgentSecret, if not nil, is a file holding the SMBIOS OEM string (type 11) that gives the
	// guest agent its per-boot secret (agent.SecretOEMString). QEMU inherits it after the
	// console (Files) and reads it at start through /proc/self/fd (-smbios type=11,path=):
	// the secret is on no command line. It needs an agent channel. Sandbox.Start sets it.
	AgentSecret *os.File
	// FreePageReporting adds a virtio-balloon device with free page reporting: QEMU gives the
	// host back the guest memory the guest reports free.
	FreePageReporting bool
	// NICs are virtio-net NICs backed by taps whose descriptors QEMU inherits: NIC i's is
	// descriptor 3+i (Files gives them in that order; the runner passes them).
	NICs []NIC
	// NetNS is the path of the network namespace QEMU is started in (the pod's, where its
	// NICs' taps are); empty: the owner's. It is no argument of QEMU's: the runner joins it.
	NetNS string
	// ExtraArgs are appended as they are: more devices, -d flags, ...
	ExtraArgs []string
}

// Memory is the guest RAM. vhost-user needs it shared with the server: always share=on.
type Memory struct {
	// Size is the amount, in QEMU's syntax ("2G", "512M"); at least 128 MiB, a whole number
	// of MiB.
	Size string
	// Hugepages backs the RAM with a file in Path, preallocated (prealloc=on): Path must be a
	// hugetlbfs mount.
	Hugepages bool
	// Path, without Hugepages, backs the RAM with a shared file in this directory (a tmpfs).
	// Empty: an anonymous memfd, the default (not limited by /dev/shm's size).
	Path string
	// Placement is PlacementNUMA (default when empty) or PlacementMachine.
	Placement string
}

// FSDevice is the vhost-user-fs-pci device and its socket.
type FSDevice struct {
	// Socket is the vhost-user socket, where the server listens.
	Socket string
	// Tag is what the guest mounts: 1 to 36 bytes.
	Tag string
	// QueueSize is the size of each request queue: a power of two, at most 1024.
	QueueSize int
	// NumRequestQueues is the number of request queues, at least 1.
	NumRequestQueues int
}

// NIC is a virtio-net NIC on a tap QEMU is given the descriptor of (-netdev tap,fd=N,
// vhost=off: QEMU moves the frames itself, no /dev/vhost-net needed).
type NIC struct {
	// Tap is the tap's queue, opened IFF_TAP|IFF_NO_PI (IFF_VNET_HDR lets QEMU offload).
	Tap *os.File
	// MAC is the guest NIC's address: a unicast Ethernet address.
	MAC net.HardwareAddr
	// MTU, if not 0, is announced to the guest's driver (host_mtu, VIRTIO_NET_F_MTU): 68 to
	// 65535.
	MTU int
}

// Files are the descriptors QEMU inherits for vm, in order from descriptor 3: the NICs'
// taps, then the console's pipe, then the agent's secret.
func (vm *VM) Files() []*os.File {
	files := make([]*os.File, 0, len(vm.NICs)+2)
	for _, n := range vm.NICs {
		files = append(files, n.Tap)
	}
	if vm.Console != nil {
		files = append(files, vm.Console)
	}
	if vm.AgentSecret != nil {
		files = append(files, vm.AgentSecret)
	}
	return files
}

// Agent transports: how the shim reaches the guest agent (api/agent/v1).
const (
	// AgentSerial is a virtio-serial port named agent.SerialPortName whose host side is a
	// unix socket QEMU listens on (server=on,wait=off): the shim connects to it.
	AgentSerial = "serial"
	// AgentVsock is a vhost-vsock-pci device; the agent listens on agent.DefaultVsockPort.
	// It needs /dev/vhost-vsock on the host.
	AgentVsock = "vsock"
)

// AgentDevice is the channel between the host and the guest agent.
type AgentDevice struct {
	// Transport is AgentSerial, AgentVsock, or empty for no agent channel.
	Transport string
	// Socket is the unix socket of the serial port (AgentSerial).
	Socket string
	// GuestCID is the guest's vsock context id (AgentVsock): 3 to 2^32-2, unique on the host.
	GuestCID uint32
}

// Args returns QEMU's arguments for vm, without the binary, or what is wrong with vm.
func (vm *VM) Args() ([]string, error) {
	if err := vm.validate(); err != nil {
		return nil, err
	}
	size, _ := ParseMemorySize(vm.Memory.Size)
	mem := strconv.FormatUint(size>>20, 10) + "M"

	machine := vm.Machine
	accel := []string{}
	if vm.Accel == AccelTCG && vm.TCGTBSize > 0 {
		accel = []string{"-accel", "tcg,tb-size=" + strconv.Itoa(vm.TCGTBSize)}
	} else {
		machine += ",accel=" + vm.Accel
	}
	placement := vm.Memory.Placement
	if placement == "" {
		placement = PlacementNUMA
	}
	if placement == PlacementMachine {
		machine += ",memory-backend=" + qemuOpt(memID)
	}
	args := []string{"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"}
	if vm.Name != "" {
		args = append(args, "-name", qemuOpt(vm.Name))
	}
	args = append(args, "-machine", machine)
	args = append(args, accel...)
	var rootSize int64
	if vm.Root != "" {
		var err error
		if rootSize, err = rootImageSize(vm.Root); err != nil {
			return nil, err
		}
	}
	memArg := mem
	if rootSize > 0 {
		// A memory device (the root's virtio-pmem) goes in the region above the RAM that
		// maxmem sizes.
		memArg += ",maxmem=" + strconv.FormatUint(size>>20+uint64(rootSize>>20), 10) + "M"
	}
	args = append(args,
		"-cpu", vm.CPU,
		"-smp", strconv.Itoa(vm.VCPUs),
		"-m", memArg,
	)

	var backend string
	switch {
	case vm.Memory.Hugepages:
		backend = fmt.Sprintf("memory-backend-file,id=%s,size=%s,mem-path=%s,share=on,prealloc=on",
			qemuOpt(memID), mem, qemuOpt(vm.Memory.Path))
	case vm.Memory.Path != "":
		backend = fmt.Sprintf("memory-backend-file,id=%s,size=%s,mem-path=%s,share=on",
			qemuOpt(memID), mem, qemuOpt(vm.Memory.Path))
	default:
		backend = fmt.Sprintf("memory-backend-memfd,id=%s,size=%s,share=on", qemuOpt(memID), mem)
	}
	args = append(args, "-object", backend)
	if placement == PlacementNUMA {
		args = append(args, "-numa", "node,memdev="+qemuOpt(memID))
	}

	dev := fmt.Sprintf("vhost-user-fs-pci,id=%s,chardev=%s,tag=%s,queue-size=%d",
		qemuOpt(fsDeviceID), qemuOpt(fsCharID), qemuOpt(vm.FS.Tag), vm.FS.QueueSize)
	if vm.FS.NumRequestQueues > 1 {
		dev += ",num-request-queues=" + strconv.Itoa(vm.FS.NumRequestQueues)
	}
	if isQ35(vm.Machine) {
		dev += ",bus=pcie.0"
	}
	args = append(args,
		"-chardev", "socket,id="+qemuOpt(fsCharID)+",path="+qemuOpt(vm.FS.Socket),
		"-device", dev,
	)

	switch vm.Agent.Transport {
	case AgentSerial:
		args = append(args,
			"-device", "virtio-serial-pci,id="+serialID,
			"-chardev", "socket,id="+agentCharID+",path="+qemuOpt(vm.Agent.Socket)+",server=on,wait=off",
			"-device", "virtserialport,bus="+serialID+".0,chardev="+agentCharID+",name="+agent.SerialPortName,
		)
	case AgentVsock:
		args = append(args, "-device", "vhost-vsock-pci,guest-cid="+strconv.FormatUint(uint64(vm.Agent.GuestCID), 10))
	}
	if vm.FreePageReporting {
		dev := "virtio-balloon-pci,id=" + balloonID + ",free-page-reporting=on"
		if isQ35(vm.Machine) {
			dev += ",bus=pcie.0"
		}
		args = append(args, "-device", dev)
	}
	for i, n := range vm.NICs {
		netdev := netdevID + strconv.Itoa(i)
		dev := fmt.Sprintf("virtio-net-pci,id=%s%d,netdev=%s,mac=%s", nicID, i, netdev, n.MAC)
		if n.MTU != 0 {
			dev += ",host_mtu=" + strconv.Itoa(n.MTU)
		}
		// No option ROM: the guest boots its kernel directly, never from the network.
		dev += ",romfile="
		if isQ35(vm.Machine) {
			dev += ",bus=pcie.0"
		}
		args = append(args,
			"-netdev", fmt.Sprintf("tap,id=%s,fd=%d,vhost=off", netdev, firstNICFd+i),
			"-device", dev,
		)
	}
	if rootSize > 0 {
		// readonly=on: QEMU opens the file read-only and the guest's writes to the range are
		// dropped; the image, shared by every pod, is never the guest's to change.
		dev := "virtio-pmem-pci,id=" + rootID + ",memdev=" + rootMemID
		if isQ35(vm.Machine) {
			dev += ",bus=pcie.0"
		}
		args = append(args,
			"-object", fmt.Sprintf("memory-backend-file,id=%s,mem-path=%s,size=%d,readonly=on,share=off", rootMemID, qemuOpt(vm.Root), rootSize),
			"-device", dev,
		)
	}
	if vm.Kernel != "" {
		args = append(args, "-kernel", vm.Kernel)
		if vm.Initrd != "" {
			args = append(args, "-initrd", vm.Initrd)
		}
		if vm.Cmdline != "" {
			args = append(args, "-append", vm.Cmdline)
		}
	}
	if vm.Console != nil {
		// QEMU opens the path as a file: through /proc, a new open of the inherited pipe, which
		// QEMU makes non-blocking. (QEMU 7.2's file chardev refuses the /dev/fdset/ of
		// -add-fd with EINVAL.)
		fd := firstNICFd + len(vm.NICs)
		args = append(args,
			"-chardev", fmt.Sprintf("file,id=%s,path=/proc/self/fd/%d,append=on", consoleID, fd),
			"-serial", "chardev:"+consoleID,
		)
	}
	if vm.AgentSecret != nil {
		fd := firstNICFd + len(vm.NICs)
		if vm.Console != nil {
			fd++
		}
		args = append(args, "-smbios", fmt.Sprintf("type=11,path=/proc/self/fd/%d", fd))
	}
	return append(args, vm.ExtraArgs...), nil
}

// validate reports the first thing wrong with vm.
func (vm *VM) validate() error {
	checks := []struct {
		what string
		err  error
	}{
		{"machine " + strconv.Quote(vm.Machine), checkMachine(vm.Machine)},
		{"accel " + strconv.Quote(vm.Accel), checkAccel(vm.Accel)},
		{"tcg tb-size " + strconv.Itoa(vm.TCGTBSize), checkTCGTBSize(vm.TCGTBSize)},
		{"cpu", nonEmpty(vm.CPU)},
		{"vcpus " + strconv.Itoa(vm.VCPUs), checkVCPUs(vm.VCPUs)},
		{"memory size " + strconv.Quote(vm.Memory.Size), memErr(vm.Memory.Size)},
		{"memory placement " + strconv.Quote(vm.Memory.Placement), checkPlacementOrEmpty(vm.Memory.Placement)},
		{"memory path " + strconv.Quote(vm.Memory.Path), checkMemPath(vm.Memory)},
		{"virtio-fs socket " + strconv.Quote(vm.FS.Socket), checkSocketPath(vm.FS.Socket)},
		{"virtio-fs tag " + strconv.Quote(vm.FS.Tag), checkTag(vm.FS.Tag)},
		{"virtio-fs queue size " + strconv.Itoa(vm.FS.QueueSize), checkQueueSize(vm.FS.QueueSize)},
		{"virtio-fs num-request-queues " + strconv.Itoa(vm.FS.NumRequestQueues), checkNumRequestQueues(vm.FS.NumRequestQueues)},
		{"kernel", checkBoot(vm)},
		{"agent transport " + strconv.Quote(vm.Agent.Transport), checkAgentDevice(vm.Agent)},
		{"agent secret", checkAgentSecret(vm)},
		{"nics", checkNICs(vm.NICs)},
		{"network namespace " + strconv.Quote(vm.NetNS), checkNetNSPath(vm.NetNS)},
	}
	for _, c := range checks {
		if c.err != nil {
			return fmt.Errorf("qemu: %s: %w", c.what, c.err)
		}
	}
	return nil
}

// qemuOpt escapes a value inside a QEMU option string (key=value,key=value): a comma is
// doubled.
func qemuOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

func isQ35(machine string) bool {
	return machine == "q35" || strings.HasPrefix(machine, "pc-q35-")
}

var machineRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*$`)

func checkMachine(m string) error {
	if !machineRE.MatchString(m) {
		return errors.New("want a machine type name such as q35 or pc (lower-case letters, digits, '.', '_', '-')")
	}
	return nil
}

func checkAccel(a string) error {
	if a != AccelKVM && a != AccelTCG {
		return fmt.Errorf("want %s or %s", AccelKVM, AccelTCG)
	}
	return nil
}

func checkTCGTBSize(n int) error {
	if n < 0 || n > maxTCGTBSize {
		return fmt.Errorf("want 0 (QEMU's default) to %d MiB", maxTCGTBSize)
	}
	return nil
}

func checkVCPUs(n int) error {
	if n < 1 || n > maxVCPUs {
		return fmt.Errorf("want 1 to %d", maxVCPUs)
	}
	return nil
}

func checkPlacement(p string) error {
	if p != PlacementNUMA && p != PlacementMachine {
		return fmt.Errorf("want %s or %s", PlacementNUMA, PlacementMachine)
	}
	return nil
}

func checkPlacementOrEmpty(p string) error {
	if p == "" {
		return nil
	}
	return checkPlacement(p)
}

func checkMemPath(m Memory) error {
	if m.Hugepages && m.Path == "" {
		return errors.New("hugepages need the path of a hugetlbfs mount")
	}
	return checkNoNUL(m.Path)
}

func checkTag(tag string) error {
	if len(tag) < 1 || len(tag) > maxTagLen {
		return fmt.Errorf("want 1 to %d bytes, not %d", maxTagLen, len(tag))
	}
	return checkNoNUL(tag)
}

func checkQueueSize(n int) error {
	if n < 1 || n > maxQueueSize || n&(n-1) != 0 {
		return fmt.Errorf("want a power of two no larger than %d", maxQueueSize)
	}
	return nil
}

func checkNumRequestQueues(n int) error {
	if n < 1 || n > maxRequestQueues {
		return fmt.Errorf("want 1 to %d", maxRequestQueues)
	}
	return nil
}

func checkSocketPath(p string) error {
	switch {
	case p == "":
		return errors.New("empty")
	case len(p) > maxSocketPath:
		return fmt.Errorf("%d bytes, longer than the %d a Unix socket address holds", len(p), maxSocketPath)
	}
	return checkNoNUL(p)
}

func checkBoot(vm *VM) error {
	if vm.Kernel == "" && (vm.Initrd != "" || vm.Cmdline != "" || vm.Root != "") {
		return errors.New("an initrd, a root image or a command line needs a kernel")
	}
	if err := checkNoNUL(vm.Root); err != nil {
		return err
	}
	if err := checkNoNUL(vm.Kernel); err != nil {
		return err
	}
	if err := checkNoNUL(vm.Initrd); err != nil {
		return err
	}
	return checkNoNUL(vm.Cmdline)
}

// rootImageAlign is what VM.Root's size must be a multiple of.
const rootImageAlign = 2 << 20

// rootImageSize answers the size of the root image at path, or why it cannot be the root.
func rootImageSize(path string) (int64, error) {
	st, err := os.Stat(path)
	if err != nil {
		return 0, fmt.Errorf("root image: %w", err)
	}
	switch {
	case !st.Mode().IsRegular():
		return 0, fmt.Errorf("root image %s: not a regular file", path)
	case st.Size() == 0 || st.Size()%rootImageAlign != 0:
		return 0, fmt.Errorf("root image %s: %d bytes, not a positive multiple of 2 MiB (packaging/guest/build.sh pads its image)", path, st.Size())
	}
	return st.Size(), nil
}

func checkAgentDevice(a AgentDevice) error {
	switch a.Transport {
	case "":
		return nil
	case AgentSerial:
		if err := checkSocketPath(a.Socket); err != nil {
			return fmt.Errorf("socket %q: %w", a.Socket, err)
		}
		return nil
	case AgentVsock:
		// 0, 1 and 2 are the hypervisor, the loopback and the host; 2^32-1 is VMADDR_CID_ANY.
		if a.GuestCID < 3 || a.GuestCID == math.MaxUint32 {
			return fmt.Errorf("guest CID %d: want 3 to %d", a.GuestCID, uint32(math.MaxUint32-1))
		}
		return nil
	}
	return fmt.Errorf("want %s, %s or empty", AgentSerial, AgentVsock)
}

func checkAgentSecret(vm *VM) error {
	if vm.AgentSecret != nil && vm.Agent.Transport == "" {
		return errors.New("a secret without an agent channel")
	}
	return nil
}

func checkNICs(nics []NIC) error {
	if len(nics) > maxNICs {
		return fmt.Errorf("%d NICs, more than %d", len(nics), maxNICs)
	}
	seen := map[string]bool{}
	for i, n := range nics {
		switch {
		case n.Tap == nil:
			return fmt.Errorf("NIC %d: no tap descriptor", i)
		case len(n.MAC) != 6:
			return fmt.Errorf("NIC %d: MAC %q is not a 6-byte Ethernet address", i, n.MAC)
		case n.MAC[0]&1 != 0:
			return fmt.Errorf("NIC %d: MAC %s is a multicast address", i, n.MAC)
		case string(n.MAC) == "\x00\x00\x00\x00\x00\x00":
			return fmt.Errorf("NIC %d: MAC %s is all zeros", i, n.MAC)
		case seen[string(n.MAC)]:
			return fmt.Errorf("NIC %d: MAC %s is another NIC's", i, n.MAC)
		case n.MTU != 0 && (n.MTU < minMTU || n.MTU > maxMTU):
			return fmt.Errorf("NIC %d: MTU %d: want %d to %d (or 0: not announced)", i, n.MTU, minMTU, maxMTU)
		}
		seen[string(n.MAC)] = true
	}
	return nil
}

func checkNetNSPath(p string) error {
	if p != "" && !filepath.IsAbs(p) {
		return errors.New("want an absolute path (or empty: the owner's)")
	}
	return checkNoNUL(p)
}

func checkNoNUL(s string) error {
	if strings.ContainsAny(s, "\x00\n") {
		return errors.New("contains a NUL or newline")
	}
	return nil
}

func nonEmpty(s string) error {
	if s == "" {
		return errors.New("empty")
	}
	return nil
}

func memErr(s string) error { _, err := ParseMemorySize(s); return err }

// ParseMemorySize parses a memory size in QEMU's syntax — digits and a unit K, M, G or T
// (powers of 1024; "Mi", "MiB" and "MB" mean the same) — into bytes. A size without a unit is
// in bytes. It must be a whole number of MiB and at least 128 MiB.
func ParseMemorySize(s string) (uint64, error) {
	t := strings.TrimSpace(s)
	i := 0
	for i < len(t) && t[i] >= '0' && t[i] <= '9' {
		i++
	}
	if i == 0 {
		return 0, errors.New(`want a whole number and a unit, such as "512M" or "2G"`)
	}
	n, err := strconv.ParseUint(t[:i], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%q is too large", t[:i])
	}
	unit := strings.ToUpper(strings.TrimSpace(t[i:]))
	unit = strings.TrimSuffix(strings.TrimSuffix(unit, "B"), "I")
	var shift uint
	switch unit {
	case "":
		shift = 0
	case "K":
		shift = 10
	case "M":
		shift = 20
	case "G":
		shift = 30
	case "T":
		shift = 40
	default:
		return 0, fmt.Errorf("unknown unit %q: want K, M, G or T", strings.TrimSpace(t[i:]))
	}
	if n > math.MaxUint64>>shift {
		return 0, errors.New("too large")
	}
	b := n << shift
	switch {
	case b < minMemBytes:
		return 0, fmt.Errorf("%d bytes is less than the minimum of 128 MiB (a size without a unit is in bytes)", b)
	case b%(1<<20) != 0:
		return 0, errors.New("not a whole number of MiB")
	}
	return b, nil
}
