package sandbox

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func mustMAC(s string) net.HardwareAddr {
	m, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return m
}

// tapFile stands for a tap's descriptor, consoleFile for the console's pipe: Args only needs
// them to be there.
var tapFile, consoleFile = os.Stdin, os.Stdout

// baseVM is a valid VM that the cases below modify.
func baseVM() VM {
	return VM{
		Machine: "q35", Accel: AccelTCG, CPU: "max", VCPUs: 1,
		Memory: Memory{Size: "512M"},
		Kernel: "/g/vmlinuz", Initrd: "/g/initrd", Cmdline: "console=ttyS0 quiet",
		FS: FSDevice{Socket: "/run/kvfs/sandboxes/p1/vhost-fs.sock", Tag: "kataShared", QueueSize: 1024, NumRequestQueues: 1},
	}
}

func TestVMArgs(t *testing.T) {
	head := []string{"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"}
	boot := []string{"-kernel", "/g/vmlinuz", "-initrd", "/g/initrd", "-append", "console=ttyS0 quiet"}
	chardev := []string{"-chardev", "socket,id=kvfs-fs0-chr,path=/run/kvfs/sandboxes/p1/vhost-fs.sock"}
	memfd := []string{"-object", "memory-backend-memfd,id=kvfs-mem0,size=512M,share=on"}
	numa := []string{"-numa", "node,memdev=kvfs-mem0"}
	cpu := func(machine string) []string {
		return []string{"-machine", machine, "-cpu", "max", "-smp", "1", "-m", "512M"}
	}
	dev := func(opts string) []string {
		return []string{"-device", "vhost-user-fs-pci,id=kvfs-fs0,chardev=kvfs-fs0-chr," + opts}
	}

	tests := []struct {
		name   string
		modify func(vm *VM)
		want   []string
	}{
		{
			name:   "memfd and numa on q35 (the default)",
			modify: func(*VM) {},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name:   "memfd as the machine's memory backend",
			modify: func(vm *VM) { vm.Memory.Placement = PlacementMachine },
			want: slices.Concat(head, cpu("q35,accel=tcg,memory-backend=kvfs-mem0"), memfd, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name:   "file backend on a tmpfs directory",
			modify: func(vm *VM) { vm.Memory.Path = "/dev/shm" },
			want: slices.Concat(head, cpu("q35,accel=tcg"),
				[]string{"-object", "memory-backend-file,id=kvfs-mem0,size=512M,mem-path=/dev/shm,share=on"}, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name: "hugepages: file backend, preallocated, machine placement",
			modify: func(vm *VM) {
				vm.Memory = Memory{Size: "2G", Hugepages: true, Path: "/dev/hugepages", Placement: PlacementMachine}
			},
			want: slices.Concat(head,
				[]string{"-machine", "q35,accel=tcg,memory-backend=kvfs-mem0", "-cpu", "max", "-smp", "1", "-m", "2048M"},
				[]string{"-object", "memory-backend-file,id=kvfs-mem0,size=2048M,mem-path=/dev/hugepages,share=on,prealloc=on"},
				chardev, dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name:   "tcg with a bounded translation buffer: -accel, not the machine's accel=",
			modify: func(vm *VM) { vm.TCGTBSize, vm.Memory.Placement = 32, PlacementMachine },
			want: slices.Concat(head,
				[]string{"-machine", "q35,memory-backend=kvfs-mem0", "-accel", "tcg,tb-size=32", "-cpu", "max", "-smp", "1", "-m", "512M"},
				memfd, chardev, dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name:   "kvm: no translation buffer to bound",
			modify: func(vm *VM) { vm.TCGTBSize, vm.Accel = 32, AccelKVM },
			want: slices.Concat(head, cpu("q35,accel=kvm"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name:   "two request queues, queue size 128, kvm",
			modify: func(vm *VM) { vm.FS.NumRequestQueues, vm.FS.QueueSize, vm.Accel = 2, 128, AccelKVM },
			want: slices.Concat(head, cpu("q35,accel=kvm"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=128,num-request-queues=2,bus=pcie.0"), boot),
		},
		{
			name:   "free page reporting: a balloon device on pcie.0",
			modify: func(vm *VM) { vm.FreePageReporting = true },
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{"-device", "virtio-balloon-pci,id=kvfs-balloon0,free-page-reporting=on,bus=pcie.0"}, boot),
		},
		{
			name:   "pc machine: no pcie bus",
			modify: func(vm *VM) { vm.Machine = "pc" },
			want: slices.Concat(head, cpu("pc,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024"), boot),
		},
		{
			name:   "versioned q35 gets the pcie bus",
			modify: func(vm *VM) { vm.Machine = "pc-q35-7.2" },
			want: slices.Concat(head, cpu("pc-q35-7.2,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name: "commas in paths, tag and name are doubled",
			modify: func(vm *VM) {
				vm.Name = "pod,1"
				vm.FS.Socket = "/run/a,b/vhost-fs.sock"
				vm.FS.Tag = "tag,x"
				vm.Memory.Path = "/mnt/tmp,fs"
			},
			want: slices.Concat(head, []string{"-name", "pod,,1"}, cpu("q35,accel=tcg"),
				[]string{"-object", "memory-backend-file,id=kvfs-mem0,size=512M,mem-path=/mnt/tmp,,fs,share=on"}, numa,
				[]string{"-chardev", "socket,id=kvfs-fs0-chr,path=/run/a,,b/vhost-fs.sock"},
				dev("tag=tag,,x,queue-size=1024,bus=pcie.0"), boot),
		},
		{
			name: "no direct boot, extra devices appended",
			modify: func(vm *VM) {
				vm.Kernel, vm.Initrd, vm.Cmdline = "", "", ""
				vm.ExtraArgs = []string{"-device", "virtio-serial-pci"}
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), []string{"-device", "virtio-serial-pci"}),
		},
		{
			name: "agent over a virtio-serial port, before the boot arguments",
			modify: func(vm *VM) {
				vm.Agent = AgentDevice{Transport: AgentSerial, Socket: "/run/kvfs/sandboxes/p1/agent.sock"}
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{
					"-device", "virtio-serial-pci,id=kvfs-serial0",
					"-chardev", "socket,id=kvfs-agent0,path=/run/kvfs/sandboxes/p1/agent.sock,server=on,wait=off",
					"-device", "virtserialport,bus=kvfs-serial0.0,chardev=kvfs-agent0,name=io.kvfs.agent.0",
				}, boot),
		},
		{
			name:   "agent serial socket with a comma",
			modify: func(vm *VM) { vm.Agent = AgentDevice{Transport: AgentSerial, Socket: "/run/a,b/agent.sock"} },
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{
					"-device", "virtio-serial-pci,id=kvfs-serial0",
					"-chardev", "socket,id=kvfs-agent0,path=/run/a,,b/agent.sock,server=on,wait=off",
					"-device", "virtserialport,bus=kvfs-serial0.0,chardev=kvfs-agent0,name=io.kvfs.agent.0",
				}, boot),
		},
		{
			name:   "agent over vsock",
			modify: func(vm *VM) { vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: 1234} },
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{"-device", "vhost-vsock-pci,guest-cid=1234"}, boot),
		},
		{
			name: "a NIC on q35: the tap's descriptor is 3, the device on pcie.0, no option ROM; the pod's network namespace is no argument",
			modify: func(vm *VM) {
				vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: 1234}
				vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:42:0a:4d:00:02"), MTU: 1400}}
				vm.NetNS = "/var/run/netns/cni-1234"
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{"-device", "vhost-vsock-pci,guest-cid=1234"},
				[]string{
					"-netdev", "tap,id=kvfs-net0,fd=3,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic0,netdev=kvfs-net0,mac=02:42:0a:4d:00:02,host_mtu=1400,romfile=,bus=pcie.0",
				}, boot),
		},
		{
			name: "two NICs on pc: descriptors 3 and 4, no MTU announced for the second",
			modify: func(vm *VM) {
				vm.Machine = "pc"
				vm.NICs = []NIC{
					{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01"), MTU: 9000},
					{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:02")},
				}
			},
			want: slices.Concat(head, cpu("pc,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024"),
				[]string{
					"-netdev", "tap,id=kvfs-net0,fd=3,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic0,netdev=kvfs-net0,mac=02:00:00:00:00:01,host_mtu=9000,romfile=",
					"-netdev", "tap,id=kvfs-net1,fd=4,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic1,netdev=kvfs-net1,mac=02:00:00:00:00:02,romfile=",
				}, boot),
		},
		{
			name:   "a console: the pipe is descriptor 3, opened through /proc",
			modify: func(vm *VM) { vm.Console = consoleFile },
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot,
				[]string{"-chardev", "file,id=kvfs-console0,path=/proc/self/fd/3,append=on", "-serial", "chardev:kvfs-console0"}),
		},
		{
			name: "a console after two NICs: descriptor 5",
			modify: func(vm *VM) {
				vm.Console = consoleFile
				vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01")}, {Tap: tapFile, MAC: mustMAC("02:00:00:00:00:02")}}
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{
					"-netdev", "tap,id=kvfs-net0,fd=3,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic0,netdev=kvfs-net0,mac=02:00:00:00:00:01,romfile=,bus=pcie.0",
					"-netdev", "tap,id=kvfs-net1,fd=4,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic1,netdev=kvfs-net1,mac=02:00:00:00:00:02,romfile=,bus=pcie.0",
				}, boot,
				[]string{"-chardev", "file,id=kvfs-console0,path=/proc/self/fd/5,append=on", "-serial", "chardev:kvfs-console0"}),
		},
		{
			name: "the agent's secret after the console and a NIC: descriptor 5, read through /proc as an SMBIOS OEM string",
			modify: func(vm *VM) {
				vm.Agent = AgentDevice{Transport: AgentSerial, Socket: "/run/kvfs/sandboxes/p1/agent.sock"}
				vm.AgentSecret = consoleFile
				vm.Console = consoleFile
				vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01")}}
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{
					"-device", "virtio-serial-pci,id=kvfs-serial0",
					"-chardev", "socket,id=kvfs-agent0,path=/run/kvfs/sandboxes/p1/agent.sock,server=on,wait=off",
					"-device", "virtserialport,bus=kvfs-serial0.0,chardev=kvfs-agent0,name=io.kvfs.agent.0",
					"-netdev", "tap,id=kvfs-net0,fd=3,vhost=off",
					"-device", "virtio-net-pci,id=kvfs-nic0,netdev=kvfs-net0,mac=02:00:00:00:00:01,romfile=,bus=pcie.0",
				}, boot,
				[]string{"-chardev", "file,id=kvfs-console0,path=/proc/self/fd/4,append=on", "-serial", "chardev:kvfs-console0"},
				[]string{"-smbios", "type=11,path=/proc/self/fd/5"}),
		},
		{
			name: "the agent's secret over vsock without a console: descriptor 3",
			modify: func(vm *VM) {
				vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: 1234}
				vm.AgentSecret = consoleFile
			},
			want: slices.Concat(head, cpu("q35,accel=tcg"), memfd, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"),
				[]string{"-device", "vhost-vsock-pci,guest-cid=1234"}, boot,
				[]string{"-smbios", "type=11,path=/proc/self/fd/3"}),
		},
		{
			name:   "memory units: 1G, 1024MiB and 1073741824 are the same",
			modify: func(vm *VM) { vm.Memory.Size = "1024MiB" },
			want: slices.Concat(head, []string{"-machine", "q35,accel=tcg", "-cpu", "max", "-smp", "1", "-m", "1024M"},
				[]string{"-object", "memory-backend-memfd,id=kvfs-mem0,size=1024M,share=on"}, numa, chardev,
				dev("tag=kataShared,queue-size=1024,bus=pcie.0"), boot),
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := baseVM()
			tt.modify(&vm)
			got, err := vm.Args()
			if err != nil {
				t.Fatalf("Args: %v", err)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("Args:\n got %q\nwant %q", got, tt.want)
			}
		})
	}
}

// rootImage makes a root image of size bytes in a directory of t's.
func rootImage(t *testing.T, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "rootfs.erofs")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestVMArgsRoot: a root image is a read-only file backend on a virtio-pmem device in the
// memory device region maxmem makes room for, the size of the file.
func TestVMArgsRoot(t *testing.T) {
	vm := baseVM()
	vm.Initrd, vm.Root = "", rootImage(t, 4<<20)
	args, err := vm.Args()
	if err != nil {
		t.Fatal(err)
	}
	joined := strings.Join(args, " ")
	for _, want := range []string{
		"-m 512M,maxmem=516M",
		"-object memory-backend-file,id=kvfs-root0-mem,mem-path=" + vm.Root + ",size=4194304,readonly=on,share=off",
		"-device virtio-pmem-pci,id=kvfs-root0,memdev=kvfs-root0-mem,bus=pcie.0",
		"-kernel /g/vmlinuz -append",
	} {
		if !strings.Contains(joined, want) {
			t.Errorf("no %q in %s", want, joined)
		}
	}
	if strings.Contains(joined, "-initrd") {
		t.Errorf("an -initrd beside the root image: %s", joined)
	}
}

func TestVMArgsErrors(t *testing.T) {
	unaligned, empty := rootImage(t, 3<<20), rootImage(t, 0)
	tests := []struct {
		name   string
		modify func(vm *VM)
		want   string // substring of the error
	}{
		{"queue size not a power of two", func(vm *VM) { vm.FS.QueueSize = 1000 }, "queue size 1000: want a power of two"},
		{"queue size above 1024", func(vm *VM) { vm.FS.QueueSize = 2048 }, "queue size 2048"},
		{"queue size zero", func(vm *VM) { vm.FS.QueueSize = 0 }, "queue size 0"},
		{"empty tag", func(vm *VM) { vm.FS.Tag = "" }, `tag "": want 1 to 36 bytes`},
		{"tag of 37 bytes", func(vm *VM) { vm.FS.Tag = strings.Repeat("t", 37) }, "want 1 to 36 bytes, not 37"},
		{"memory below 128 MiB", func(vm *VM) { vm.Memory.Size = "64M" }, "less than the minimum of 128 MiB"},
		{"memory without unit is bytes", func(vm *VM) { vm.Memory.Size = "2048" }, "2048 bytes is less than"},
		{"memory unparseable", func(vm *VM) { vm.Memory.Size = "lots" }, `memory size "lots"`},
		{"memory fraction", func(vm *VM) { vm.Memory.Size = "1.5G" }, `unknown unit ".5G"`},
		{"memory not whole MiB", func(vm *VM) { vm.Memory.Size = "200000K" }, "not a whole number of MiB"},
		{"memory overflow", func(vm *VM) { vm.Memory.Size = "99999999999T" }, "too large"},
		{"zero request queues", func(vm *VM) { vm.FS.NumRequestQueues = 0 }, "num-request-queues 0: want 1 to"},
		{"zero vcpus", func(vm *VM) { vm.VCPUs = 0 }, "vcpus 0"},
		{"unknown accelerator", func(vm *VM) { vm.Accel = "hvf" }, `accel "hvf": want kvm or tcg`},
		{"negative tb-size", func(vm *VM) { vm.TCGTBSize = -1 }, "tcg tb-size -1: want 0"},
		{"tb-size beyond QEMU's bound", func(vm *VM) { vm.TCGTBSize = 4096 }, "tcg tb-size 4096: want 0 (QEMU's default) to 2048 MiB"},
		{"machine with options", func(vm *VM) { vm.Machine = "q35,accel=kvm" }, `machine "q35,accel=kvm"`},
		{"unknown placement", func(vm *VM) { vm.Memory.Placement = "both" }, `memory placement "both"`},
		{"hugepages without path", func(vm *VM) { vm.Memory.Hugepages = true }, "hugepages need the path"},
		{"socket path too long", func(vm *VM) { vm.FS.Socket = "/" + strings.Repeat("s", 110) }, "longer than the 107"},
		{"no socket", func(vm *VM) { vm.FS.Socket = "" }, `virtio-fs socket "": empty`},
		{"initrd without kernel", func(vm *VM) { vm.Kernel = "" }, "needs a kernel"},
		{"root image without kernel", func(vm *VM) { vm.Kernel, vm.Initrd, vm.Cmdline, vm.Root = "", "", "", "/g/rootfs.erofs" }, "needs a kernel"},
		{"missing root image", func(vm *VM) { vm.Initrd, vm.Root = "", "/nonexistent/rootfs.erofs" }, "root image: stat /nonexistent/rootfs.erofs"},
		{"root image not 2 MiB aligned", func(vm *VM) { vm.Initrd, vm.Root = "", unaligned }, "not a positive multiple of 2 MiB"},
		{"empty root image", func(vm *VM) { vm.Initrd, vm.Root = "", empty }, "0 bytes, not a positive multiple"},
		{"root image a directory", func(vm *VM) { vm.Initrd, vm.Root = "", os.TempDir() }, "not a regular file"},
		{"newline in command line", func(vm *VM) { vm.Cmdline = "a\nb" }, "NUL or newline"},
		{"unknown agent transport", func(vm *VM) { vm.Agent.Transport = "tcp" }, `agent transport "tcp": want serial, vsock or empty`},
		{"serial agent without a socket", func(vm *VM) { vm.Agent.Transport = AgentSerial }, `socket "": empty`},
		{"serial agent socket too long", func(vm *VM) {
			vm.Agent = AgentDevice{Transport: AgentSerial, Socket: "/" + strings.Repeat("s", 110)}
		}, "longer than the 107"},
		{"a secret without an agent channel", func(vm *VM) { vm.AgentSecret = os.Stdin }, "agent secret: a secret without an agent channel"},
		{"vsock CID of the host", func(vm *VM) { vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: 2} }, "guest CID 2: want 3 to"},
		{"NIC without a tap", func(vm *VM) { vm.NICs = []NIC{{MAC: mustMAC("02:00:00:00:00:01")}} }, "nics: NIC 0: no tap descriptor"},
		{"NIC with an 8-byte MAC", func(vm *VM) {
			vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:00:00:01")}}
		}, "is not a 6-byte Ethernet address"},
		{"NIC with a multicast MAC", func(vm *VM) {
			vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("01:00:5e:00:00:01")}}
		}, "MAC 01:00:5e:00:00:01 is a multicast address"},
		{"NIC with a zero MAC", func(vm *VM) { vm.NICs = []NIC{{Tap: tapFile, MAC: make(net.HardwareAddr, 6)}} }, "all zeros"},
		{"two NICs with one MAC", func(vm *VM) {
			vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01")}, {Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01")}}
		}, "NIC 1: MAC 02:00:00:00:00:01 is another NIC's"},
		{"NIC MTU too small", func(vm *VM) {
			vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01"), MTU: 67}}
		}, "MTU 67: want 68 to 65535"},
		{"NIC MTU too large", func(vm *VM) {
			vm.NICs = []NIC{{Tap: tapFile, MAC: mustMAC("02:00:00:00:00:01"), MTU: 65536}}
		}, "MTU 65536"},
		{"relative network namespace path", func(vm *VM) { vm.NetNS = "netns/cni-1" }, `network namespace "netns/cni-1": want an absolute path`},
		{"NUL in the network namespace path", func(vm *VM) { vm.NetNS = "/run/netns/a\x00b" }, "NUL or newline"},
		{"vsock CID any", func(vm *VM) { vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: 1<<32 - 1} }, "guest CID 4294967295"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			vm := baseVM()
			tt.modify(&vm)
			args, err := vm.Args()
			if err == nil {
				t.Fatalf("Args succeeded: %q", args)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q does not contain %q", err, tt.want)
			}
		})
	}
}

func TestVMFiles(t *testing.T) {
	a, b := os.Stdin, os.Stdout
	vm := baseVM()
	if f := vm.Files(); len(f) != 0 {
		t.Errorf("Files without NICs: %v", f)
	}
	vm.NICs = []NIC{{Tap: a, MAC: mustMAC("02:00:00:00:00:01")}, {Tap: b, MAC: mustMAC("02:00:00:00:00:02")}}
	if f := vm.Files(); len(f) != 2 || f[0] != a || f[1] != b {
		t.Errorf("Files: %v, want the taps in the NICs' order (descriptors 3 and 4)", f)
	}
	vm.Console = os.Stderr
	if f := vm.Files(); len(f) != 3 || f[0] != a || f[1] != b || f[2] != os.Stderr {
		t.Errorf("Files: %v, want the taps, then the console (descriptor 5)", f)
	}
	vm.AgentSecret = os.Stdin
	if f := vm.Files(); len(f) != 4 || f[2] != os.Stderr || f[3] != os.Stdin {
		t.Errorf("Files: %v, want the taps, the console, then the agent's secret (descriptor 6)", f)
	}
}

func TestParseMemorySize(t *testing.T) {
	for in, want := range map[string]uint64{
		"128M": 128 << 20, "1G": 1 << 30, "1g": 1 << 30, "2GiB": 2 << 30, "512MB": 512 << 20,
		"1073741824": 1 << 30, "262144K": 256 << 20, "1T": 1 << 40, " 4G ": 4 << 30,
	} {
		got, err := ParseMemorySize(in)
		if err != nil || got != want {
			t.Errorf("ParseMemorySize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "G", "-1G", "127M", "1X", "1GG"} {
		if got, err := ParseMemorySize(in); err == nil {
			t.Errorf("ParseMemorySize(%q) = %d, want an error", in, got)
		}
	}
}
