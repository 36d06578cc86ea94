package sandbox

import (
	"context"
	"crypto/rand"
	"fmt"
	"hash/fnv"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// The VM's life in a sandbox: its default shape (DefaultVM), its start with the per-boot agent
// secret, its watch until it exits, and the error that quotes what QEMU said.

// fsDevice is the VM's virtio-fs device: the server's socket, the tag and the queues.
func (s *Sandbox) fsDevice() FSDevice {
	return FSDevice{
		Socket:           s.SocketPath(),
		Tag:              s.cfg.Device.Tag,
		QueueSize:        s.cfg.Device.QueueSize,
		NumRequestQueues: s.cfg.RequestQueues(),
	}
}

// DefaultVM returns the VM the configuration describes, connected to this sandbox (Start adds
// the serial console, kept in ConsolePath), with the configured guest kernel and root image or
// initrd, the agent channel of agent.transport, and the kernel command line the guest agent
// reads:
//
//	console=ttyS0 quiet panic=-1 kvfs.tag=<device.tag> kvfs.agent=serial|vsock:1024 [RootCmdline] [vm.kernel_params]
func (s *Sandbox) DefaultVM() VM {
	c := s.cfg.VM
	accel := c.Accel
	if accel == "" {
		accel = DetectAccel()
	}
	vm := VM{
		Name: "kvfs-" + s.id, Machine: c.Machine, Accel: accel, CPU: c.CPU, VCPUs: c.VCPUs,
		Memory:            Memory{Size: c.Memory, Hugepages: c.Hugepages, Path: c.FileMemPath, Placement: c.MemoryPlacement},
		FS:                s.fsDevice(),
		FreePageReporting: c.FreePageReporting,
		TCGTBSize:         c.TCGTBSize,
	}
	if c.Hugepages {
		vm.Memory.Path = c.HugepagePath
	}
	vm.Kernel, vm.Initrd, vm.Root = c.Kernel, c.Initrd, c.Rootfs
	transport := agent.CmdlineTransport + "=" + AgentSerial
	switch s.cfg.Agent.Transport {
	case AgentVsock:
		vm.Agent = AgentDevice{Transport: AgentVsock, GuestCID: GuestCID(s.id)}
		transport = fmt.Sprintf("%s=%s:%d", agent.CmdlineTransport, AgentVsock, agent.DefaultVsockPort)
	default:
		vm.Agent = AgentDevice{Transport: AgentSerial, Socket: s.AgentSocketPath()}
	}
	vm.Cmdline = fmt.Sprintf("console=ttyS0 quiet panic=-1 %s=%s %s", agent.CmdlineTag, s.cfg.Device.Tag, transport)
	if vm.Root != "" {
		vm.Cmdline += " " + RootCmdline
	}
	if c.KernelParams != "" {
		vm.Cmdline += " " + c.KernelParams
	}
	return vm
}

// GuestCID is the vsock context id DefaultVM gives the guest of sandbox id: a hash of the id
// in 3 to 2^31-1, so that sandboxes on one host rarely collide (QEMU refuses a CID in use, and
// the start then fails with that error).
func GuestCID(id string) uint32 {
	h := fnv.New32a()
	h.Write([]byte(id))
	return 3 + h.Sum32()%(1<<31-4)
}

// DetectAccel returns AccelKVM if /dev/kvm can be opened, else AccelTCG.
func DetectAccel() string {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return AccelTCG
	}
	f.Close()
	return AccelKVM
}

// Start runs the VM vm, its virtio-fs device and its serial console set to the sandbox's
// (vm.FS and vm.Console are replaced): the sandbox drains the console and QEMU's output into
// console.log and qemu.log, each kept bounded. The server is already listening. A sandbox
// runs one VM in its life.
func (s *Sandbox) Start(ctx context.Context, vm VM) error {
	s.opMu.Lock()
	defer s.opMu.Unlock()
	s.mu.Lock()
	phase, srv := s.phase, s.srv
	s.mu.Unlock()
	if phase != PhaseCreated {
		return fmt.Errorf("sandbox %s: cannot start a VM in phase %s", s.id, phase)
	}
	if s.runner == nil {
		return fmt.Errorf("sandbox %s: a recovered sandbox cannot start a VM", s.id)
	}
	select {
	case <-srv.exited():
		return fmt.Errorf("sandbox %s: the virtio-fs server has exited: %v", s.id, srv.exitErr())
	default:
	}
	vm.FS = s.fsDevice()
	out, console, qemuOut, err := newVMOutput(s.ctx, s.dir)
	if err != nil {
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	vm.Console = console
	var secret []byte
	vm.AgentSecret = nil
	if vm.Agent.Transport != "" {
		var f *os.File
		if secret, f, err = newAgentSecret(); err != nil {
			console.Close()
			qemuOut.Close()
			out.close()
			return fmt.Errorf("sandbox %s: %w", s.id, err)
		}
		vm.AgentSecret = f
		defer f.Close() // QEMU has read it once it runs
	}
	args, err := vm.Args()
	if err != nil {
		console.Close()
		qemuOut.Close()
		out.close()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	cmd := VMCommand{Path: s.cfg.VM.QEMU, Args: args, Output: qemuOut, ExtraFiles: vm.Files(), NetNS: vm.NetNS}
	p, err := s.runner.Run(ctx, cmd)
	console.Close()
	qemuOut.Close()
	if err != nil {
		out.close()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	if s.oomAdj != nil && p.Pid() > 0 {
		// Before the guest's first container: the guest runs only the kernel and the agent.
		if err := setOOMScoreAdj(p.Pid(), *s.oomAdj); err != nil {
			_ = kill(p)
			out.close()
			return fmt.Errorf("sandbox %s: the VM: %w", s.id, err)
		}
	}
	out.start()
	rec := &vmRecord{Path: cmd.Path, Args: args, Started: time.Now()}
	if pid := p.Pid(); pid > 0 {
		if id, err := identify(pid); err == nil {
			rec.Process = &id
		}
	}
	exited := make(chan struct{})
	s.mu.Lock()
	s.vm, s.vmRec, s.vmAccel, s.out, s.vmExited, s.phase = p, rec, vm.Accel, out, exited, PhaseRunning
	s.agentSecret = secret
	err = s.persistLocked()
	if err != nil {
		s.vm, s.vmRec, s.vmAccel, s.out, s.vmExited, s.phase = nil, nil, "", nil, nil, PhaseCreated
		s.agentSecret = nil
	}
	s.mu.Unlock()
	if err != nil {
		_ = kill(p)
		out.stop()
		return fmt.Errorf("sandbox %s: %w", s.id, err)
	}
	s.wg.Add(1)
	go s.watchVM(p, out, exited)
	log.G(s.ctx).WithField("pid", p.Pid()).Info("VM started")
	return nil
}

// AgentSecret answers the secret Start gave the VM's guest agent (api/agent/v1: SecretLen
// bytes), which the host sends first on each connection to it (agent.Hello); nil before
// Start, for a VM without an agent channel and for a recovered sandbox. It is kept in memory
// only: nothing of it is on disk or on QEMU's command line.
func (s *Sandbox) AgentSecret() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.agentSecret)
}

// newAgentSecret makes a fresh agent secret and the sealed memfd holding its SMBIOS OEM
// string (agent.SecretOEMString), which QEMU inherits (VM.AgentSecret).
func newAgentSecret() ([]byte, *os.File, error) {
	secret := make([]byte, agent.SecretLen)
	rand.Read(secret) // never fails (crypto/rand)
	fd, err := unix.MemfdCreate("kvfs-agent-secret", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, nil, fmt.Errorf("the agent's secret: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "kvfs-agent-secret")
	if _, err := f.WriteString(agent.SecretOEMString(secret)); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("the agent's secret: %w", err)
	}
	seals := unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, seals); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("the agent's secret: sealing its memfd: %w", err)
	}
	return secret, f, nil
}

// KillVM kills the VM at once (SIGKILL) and waits for it, leaving the rest (the server, the
// mounts, the directory) to Stop: what the owner does with a guest it no longer trusts.
func (s *Sandbox) KillVM() error {
	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	if vm == nil {
		return fmt.Errorf("sandbox %s has no VM", s.id)
	}
	return kill(vm)
}

// watchVM waits for the VM's end and for the drains of its output (out, if not nil) to read
// what it left (at most outputDrainGrace), then closes exited and logs the end, with QEMU's
// last lines if it failed.
func (s *Sandbox) watchVM(p Process, out *vmOutput, exited chan struct{}) {
	defer s.wg.Done()
	<-p.Exited()
	if out != nil {
		select {
		case <-out.drained:
		case <-time.After(outputDrainGrace):
		}
	}
	close(exited)
	entry := log.G(s.ctx).WithField("pid", p.Pid()).WithField("exit", exitString(p.ExitErr()))
	if p.ExitErr() != nil && out != nil {
		if qemu, _ := out.lastLines(); len(qemu) > 0 {
			entry = entry.WithField("qemu", strings.Join(qemu, "\n"))
		}
	}
	entry.Info("VM exited")
}

// exitString says how a process exited: "exit status 0" for a nil ExitErr.
func exitString(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

// VMError is a VM that did not come up, or that exited: why its owner gave up on it, and
// what says why — how QEMU exited, the end of QEMU's output and of the guest's console
// (sanitized: the guest wrote them) — and, when KVM was chosen for vm.accel = "", that KVM
// is the suspect.
type VMError struct {
	Sandbox string
	// Err is why the owner gave up: the VM exited, or its guest did not answer in time.
	Err error
	// Exit is how QEMU exited ("exit status 1", "signal: aborted"); empty if it still runs.
	Exit string
	// QEMU and Console are the last lines of QEMU's stdout and stderr and of the guest's
	// serial console, at most 20 each.
	QEMU, Console []string
	// AutoKVM says that vm.accel was "" and KVM was chosen (/dev/kvm opens).
	AutoKVM bool
}

func (e *VMError) Error() string {
	var b strings.Builder
	b.WriteString(e.Err.Error())
	if e.Exit != "" {
		fmt.Fprintf(&b, "; QEMU exited (%s)", e.Exit)
	}
	if e.AutoKVM {
		b.WriteString(`; the VM ran under KVM, which vm.accel = "" chose because /dev/kvm opens, ` +
			`but a host's KVM may not run this guest (QEMU says why below: a PVM host, for one, aborts ` +
			`with "failed to set MSR 0x10a"): if so, set accel = "tcg" in the [vm] section of the configuration`)
	}
	quoteLines(&b, "QEMU's output", e.QEMU)
	quoteLines(&b, "the guest's console", e.Console)
	return b.String()
}

func (e *VMError) Unwrap() error { return e.Err }

// quoteLines appends lines under a heading, indented.
func quoteLines(b *strings.Builder, what string, lines []string) {
	if len(lines) == 0 {
		fmt.Fprintf(b, "\n%s: nothing", what)
		return
	}
	fmt.Fprintf(b, "\n%s, last lines:", what)
	for _, l := range lines {
		b.WriteString("\n    " + l)
	}
}

// VMError wraps err, why the caller gave up on the VM (its guest did not come up in time,
// or the VM exited), in a *VMError that says what QEMU and the guest said last: the sandbox's
// directory, and the logs in it, go with the sandbox. If the VM exited, it first lets the
// drains read what QEMU left (at most outputDrainGrace).
func (s *Sandbox) VMError(err error) error {
	s.mu.Lock()
	vm, out, exited, accel := s.vm, s.out, s.vmExited, s.vmAccel
	s.mu.Unlock()
	e := &VMError{Sandbox: s.id, Err: err, AutoKVM: s.cfg.VM.Accel == "" && accel == AccelKVM}
	if vm != nil && isClosed(vm.Exited()) {
		select {
		case <-exited:
		case <-time.After(outputDrainGrace):
		}
		e.Exit = exitString(vm.ExitErr())
	}
	if out != nil {
		e.QEMU, e.Console = out.lastLines()
	}
	return e
}
