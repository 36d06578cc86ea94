package shim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/log"
	"github.com/containerd/ttrpc"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// agentShutdownTimeout bounds the agent's Shutdown at the pod's stop; the VM is killed after.
const agentShutdownTimeout = 10 * time.Second

// errStoppedByControl is the end of a pod that kvfsctl stopped (the control API's StopSandbox).
var errStoppedByControl = errors.New("stopped through the sandbox's control API (kvfsctl stop)")

// VM is one pod's running sandbox as its Pod uses it: the agent in the VM, the share its
// containers' files reach the guest through, and its end.
type VM interface {
	// Agent is the guest agent's API. Its answers are untrusted.
	Agent() agent.AgentService
	// Bind puts src at agent.SharedDir/name in the guest (sandbox.Bind); Unbind undoes it.
	Bind(src, name string, flags sandbox.BindFlags) error
	// BindIDMapped is Bind through a mount idmapped by the user namespace userns
	// (sandbox.BindIDMapped).
	BindIDMapped(src, name string, flags sandbox.BindFlags, userns *os.File) error
	Unbind(name string) error
	// Submounts lists the mount points below the bind name, relative to it
	// (sandbox.Submounts).
	Submounts(name string) ([]string, error)
	// RaiseOOMScoreAdj raises the oom_score_adj of the VM and of its server to v, if theirs is
	// lower (sandbox.RaiseOOMScoreAdj): a container's value bounds its whole pod's.
	RaiseOOMScoreAdj(v int) error
	// Done is closed when the pod died: its VM or its virtio-fs server ended (not by Stop).
	Done() <-chan struct{}
	// Err says why Done was closed.
	Err() error
	// Pid is the VM's process id (0 if it has none on this host): every task's pid.
	Pid() uint32
	// ConfigureNetwork gives the guest's NIC, through a (the pod's door to the agent), the
	// pod interface's name, MTU, addresses and routes; nothing for a VM without a NIC.
	ConfigureNetwork(ctx context.Context, a agent.AgentService) error
	// Kill ends the VM at once: the pod is dead, Done closes with why (unless it was being
	// stopped). What is left (the server, the share, the network) goes with Stop.
	Kill(why error)
	// Stop stops the VM: unless it died, shutdown asks its guest to power off (the agent's
	// Shutdown, through the pod's door), and if it agrees the VM is given the time to; then
	// the VM, the server and the network go and the sandbox is removed.
	Stop(ctx context.Context, shutdown func(context.Context) error) error
}

// VMStarter makes and boots a pod; it returns once its agent answers. StartQEMUVM is the
// real one.
type VMStarter func(ctx context.Context, req PodRequest) (VM, error)

// PodRequest is what a pod is made from (newPodRequest): its first container's Create, or the
// Sandbox API's CreateSandbox.
type PodRequest struct {
	// ID is the sandbox id: the CRI sandbox id, or the container's id without one.
	ID string
	// Config is the sandbox configuration (validated).
	Config *sandbox.Config
	// Annotations are the first container's (untrusted; see sandbox.Config.Resolve).
	Annotations map[string]string
	// SandboxTask says the first container is CRI's pod sandbox container: its task is the
	// VM's, answered by the shim (sandboxtask.go).
	SandboxTask bool
	// Hostname is the pod's (the sandbox container's spec), given to the guest, whose UTS
	// namespace the pod's containers share. Empty: none.
	Hostname string
	// NetNS is the pod's network namespace path (the sandbox container's spec, linux.namespaces
	// type network): joined to the VM by a tap. Empty: the VM has no NIC.
	NetNS string
	// Cgroup is the pod's host cgroup, where the pod's shim, kvfsd and QEMU run (cgroup.go):
	// CRI's pod sandbox container's (its spec's linux.cgroupsPath), or under the Sandbox API
	// the same path derived from the pod's cgroup parent (sandboxCgroupPath); a cgroupfs path
	// or a systemd slice:prefix:name one. Empty: none is joined.
	Cgroup string
	// Sysctls are the pod's (CRI's pod sandbox container's spec, the Sandbox API's pod config,
	// or a pod's one container's spec), checked (agent.CheckSysctls), written in the guest's
	// kernel, whose namespaces the pod's containers share.
	Sysctls map[string]string
	// OOMScoreAdj is the oom_score_adj of the pod's QEMU and kvfsd (podOOMScoreAdj): the
	// sandbox container's, or a pod's one container's. Nil: the shim's.
	OOMScoreAdj *int
}

// QEMUVM is a pod's VM under QEMU: a sandbox (layout, confined kvfsd, VM) whose guest agent is
// reached over agent.sock (or vsock), and the sandbox's control API on control.sock.
type QEMUVM struct {
	sb     *sandbox.Sandbox
	ctl    *sandbox.ControlServer
	client *ttrpc.Client
	wire   *agentWire // the client's connection: the filter below ttrpc
	agent  agent.AgentService
	net    *podNetwork // nil: no network namespace, no NIC
	cg     *podCgroup  // nil: no host cgroup of the pod's joined

	done     chan struct{}
	doneOnce sync.Once
	mu       sync.Mutex
	err      error // guarded by mu
	stopping bool  // guarded by mu
}

// Dialer connects to the guest agent of a started sandbox.
type Dialer func(ctx context.Context, sb *sandbox.Sandbox) (net.Conn, error)

// DialAgent connects to sb's agent over its configured transport, agent.sock for serial
// (QEMU listens there once it runs), vsock port agent.DefaultVsockPort at the guest's CID from
// a privileged port of the host (the agent serves no other; the shim needs
// CAP_NET_BIND_SERVICE), and sends the agent its boot's secret (agent.Hello with
// sb.AgentSecret), without which it serves nothing.
func DialAgent(ctx context.Context, sb *sandbox.Sandbox) (net.Conn, error) {
	secret := sb.AgentSecret()
	if len(secret) != agent.SecretLen {
		return nil, fmt.Errorf("sandbox %s: no agent secret (the VM is not started)", sb.ID())
	}
	var conn net.Conn
	var err error
	if sb.Config().Agent.Transport == sandbox.AgentVsock {
		conn, err = dialVsock(ctx, sandbox.GuestCID(sb.ID()), agent.DefaultVsockPort)
	} else {
		var d net.Dialer
		conn, err = d.DialContext(ctx, "unix", sb.AgentSocketPath())
	}
	if err != nil {
		return nil, err
	}
	if err := sendHello(ctx, conn, secret); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// sendHello writes agent.Hello(secret) on conn within ctx. The bytes fit in the socket's
// buffer (over serial they wait there until the guest opens its port).
func sendHello(ctx context.Context, conn net.Conn, secret []byte) error {
	if d, ok := ctx.Deadline(); ok {
		if err := conn.SetWriteDeadline(d); err != nil {
			return fmt.Errorf("the agent's hello: %w", err)
		}
		defer conn.SetWriteDeadline(time.Time{})
	}
	if _, err := conn.Write(agent.Hello(secret)); err != nil {
		return fmt.Errorf("the agent's hello: %w", err)
	}
	return nil
}

// StartQEMUVM is the VMStarter of the real shim: QEMUVMStarter(DialAgent).
func StartQEMUVM(ctx context.Context, req PodRequest) (VM, error) {
	return startQEMUVM(ctx, req, DialAgent)
}

// QEMUVMStarter is StartQEMUVM with another way to reach the agent (ttrpc over what dial
// returns).
func QEMUVMStarter(dial Dialer) VMStarter {
	return func(ctx context.Context, req PodRequest) (VM, error) { return startQEMUVM(ctx, req, dial) }
}

func startQEMUVM(ctx context.Context, req PodRequest, dial Dialer) (_ VM, retErr error) {
	// The pod's host cgroup first: its kvfsd and QEMU are born there. One the shim cannot
	// join fails the pod: it never runs outside the cgroup it was given.
	var cg *podCgroup
	if req.Cgroup != "" {
		var err error
		if cg, err = joinPodCgroup(ctx, req.Cgroup); err != nil {
			return nil, fmt.Errorf("pod %s: %w", req.ID, err)
		}
	}
	sb, err := sandbox.Create(ctx, req.ID, sandbox.Options{Config: req.Config, Annotations: req.Annotations,
		OOMScoreAdj: req.OOMScoreAdj})
	if err != nil {
		if cg != nil {
			if err := cg.leave(ctx); err != nil {
				log.G(ctx).WithError(err).Warn("leaving the pod's cgroup")
			}
		}
		return nil, err
	}
	p := &QEMUVM{sb: sb, cg: cg, done: make(chan struct{})}
	defer func() {
		if retErr != nil {
			p.teardown(ctx)
		}
	}()
	// kvfsctl's stop ends the pod as a VM's death does: through this shim, which reports every
	// process exited and removes the sandbox when containerd deletes them.
	stop := func(context.Context) error {
		p.Kill(errStoppedByControl)
		return nil
	}
	if p.ctl, err = sandbox.NewControlServer(sb, filepath.Join(sb.Dir(), sandbox.ControlSocketName), stop); err != nil {
		return nil, err
	}
	go func() {
		if err := p.ctl.Serve(context.WithoutCancel(ctx)); err != nil {
			log.G(ctx).WithError(err).Error("serving the sandbox's control API")
		}
	}()
	vm := sb.DefaultVM()
	if req.Hostname != "" {
		vm.Cmdline += " " + agent.CmdlineHostname + "=" + req.Hostname
	}
	if req.NetNS != "" {
		if p.net, err = attachNetwork(req.NetNS, sb.ID()); err != nil {
			return nil, err
		}
		vm.NICs = p.net.nics()
		vm.NetNS = req.NetNS // QEMU is born in the pod's namespace, beside its tap
	}
	vmStart := time.Now()
	if err := sb.Start(ctx, vm); err != nil {
		return nil, err
	}
	timeout := sb.Config().Agent.BootTimeoutDuration()
	start := time.Now()
	client, wire, pong, err := connectAgent(ctx, func(ctx context.Context) (net.Conn, error) { return dial(ctx, sb) },
		sb.VMExited(), timeout, p.connectionClosed)
	if err != nil {
		// The sandbox directory, console.log with it, is gone once the pod's start has failed:
		// the error itself quotes QEMU and the console.
		return nil, fmt.Errorf("the guest agent of sandbox %s: %w", sb.ID(), sb.VMError(err))
	}
	p.client, p.wire, p.agent = client, wire, agent.NewAgentClient(client)
	fields := log.Fields{"sandbox": sb.ID(), "agent": guestText(pong.GetVersion()), "kernel": guestText(pong.GetKernel()),
		"boot": time.Since(start).Round(time.Millisecond)}
	for k, v := range bootSplit(time.Since(vmStart), pong) {
		fields[k] = v
	}
	log.G(ctx).WithFields(fields).Info("the guest agent answers")
	go p.watch()
	return p, nil
}

// bootSplit splits total, the time from QEMU's start to the agent's answer, with the guest's
// times in pong (untrusted, only logged): boot_total; boot_qemu, QEMU and the firmware (total
// less the guest's uptime at the answer); boot_kernel, the kernel's boot (when the agent
// started); boot_agent, the agent's start-up to its answer. Only boot_total when the agent
// answered no times or times that do not fit in total.
func bootSplit(total time.Duration, pong *agent.PingResponse) log.Fields {
	f := log.Fields{"boot_total": total.Round(time.Millisecond)}
	const maxNs = uint64(1<<63 - 1)
	up, init := pong.GetUptimeNs(), pong.GetInitStartedNs()
	if up == 0 || init == 0 || up > maxNs || init > up || time.Duration(up) > total {
		return f
	}
	f["boot_qemu"] = (total - time.Duration(up)).Round(time.Millisecond)
	f["boot_kernel"] = time.Duration(init).Round(time.Millisecond)
	f["boot_agent"] = time.Duration(up - init).Round(time.Millisecond)
	return f
}

// connectAgent dials until the agent answers Ping, within timeout; the VM's exit ends the
// wait at once. The client it returns runs over the connection's filter, which it returns too
// (agentwire.go). onClose is called if the connection it returns closes later. Over
// virtio-serial, a connection made before the guest opened its port is fine: what is written
// waits in QEMU until it does; so a connection is kept while it lives and Ping waits on it.
func connectAgent(ctx context.Context, dial func(context.Context) (net.Conn, error), vmExited <-chan struct{},
	timeout time.Duration, onClose func(error)) (*ttrpc.Client, *agentWire, *agent.PingResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	go func() {
		select {
		case <-vmExited:
			cancel()
		case <-ctx.Done():
		}
	}()
	var last error
	for {
		conn, err := dial(ctx)
		if err == nil {
			closed := make(chan struct{})
			var accepted atomic.Bool
			wire := newAgentWire(conn)
			client := ttrpc.NewClient(wire, ttrpc.WithUnaryClientInterceptor(wire.intercept), ttrpc.WithOnClose(func() {
				close(closed)
				if accepted.Load() {
					onClose(errors.New("the connection to the guest agent closed"))
				}
			}))
			resp, err := agent.NewAgentClient(client).Ping(ctx, &agent.PingRequest{})
			if err == nil {
				accepted.Store(true)
				return client, wire, resp, nil
			}
			client.Close()
			<-closed
			last = err
		} else {
			last = err
		}
		select {
		case <-ctx.Done():
			if isClosed(vmExited) {
				return nil, nil, nil, fmt.Errorf("the VM exited before the agent answered (last: %v)", last)
			}
			return nil, nil, nil, fmt.Errorf("no answer within agent.boot_timeout %v (last: %v)", timeout, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// died records why the pod ended, unless it is being stopped.
func (p *QEMUVM) died(why error) {
	p.mu.Lock()
	if p.stopping {
		p.mu.Unlock()
		return
	}
	if p.err == nil {
		p.err = why
	}
	p.mu.Unlock()
	p.doneOnce.Do(func() { close(p.done) })
}

// connectionClosed is the agent connection's end. It usually means the VM died: the VM's
// exit, noticed a moment later, is the better reason, so it is given a second to come.
func (p *QEMUVM) connectionClosed(why error) {
	go func() {
		select {
		case <-p.done:
		case <-time.After(time.Second):
			p.died(why)
		}
	}()
}

// watch turns the sandbox's failure or the VM's exit into Done.
func (p *QEMUVM) watch() {
	select {
	case <-p.sb.Done():
		if err := p.sb.Err(); err != nil {
			p.died(err)
		} else {
			p.died(errors.New("the sandbox was stopped"))
		}
	case <-p.sb.VMExited():
		// The error quotes QEMU and the console: their files go with the sandbox.
		p.died(p.sb.VMError(errors.New("the VM exited")))
	case <-p.done:
	}
}

// Kill implements VM: the VM is killed, the pod dead for why.
func (p *QEMUVM) Kill(why error) {
	p.died(why)
	if err := p.sb.KillVM(); err != nil {
		log.L.WithError(err).WithField("sandbox", p.sb.ID()).Error("killing the VM")
	}
}

// Agent implements VM.
func (p *QEMUVM) Agent() agent.AgentService { return p.agent }

// agentWire implements wireFiltered.
func (p *QEMUVM) agentWire() *agentWire { return p.wire }

// Bind implements VM.
func (p *QEMUVM) Bind(src, name string, flags sandbox.BindFlags) error {
	return p.sb.Bind(src, name, flags)
}

// BindIDMapped implements VM.
func (p *QEMUVM) BindIDMapped(src, name string, flags sandbox.BindFlags, userns *os.File) error {
	return p.sb.BindIDMapped(src, name, flags, userns)
}

// Unbind implements VM.
func (p *QEMUVM) Unbind(name string) error { return p.sb.Unbind(name) }

// RaiseOOMScoreAdj implements VM.
func (p *QEMUVM) RaiseOOMScoreAdj(v int) error { return p.sb.RaiseOOMScoreAdj(v) }

// Submounts implements VM.
func (p *QEMUVM) Submounts(name string) ([]string, error) { return p.sb.Submounts(name) }

// Done implements VM.
func (p *QEMUVM) Done() <-chan struct{} { return p.done }

// Pid implements VM: the QEMU process's.
func (p *QEMUVM) Pid() uint32 {
	if vm := p.sb.Stats().VM; vm != nil && vm.PID > 0 {
		return uint32(vm.PID)
	}
	return 0
}

// Err implements VM.
func (p *QEMUVM) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// ConfigureNetwork implements VM.
func (p *QEMUVM) ConfigureNetwork(ctx context.Context, a agent.AgentService) error {
	if p.net == nil {
		return nil
	}
	return p.net.configure(ctx, a)
}

// Stop implements VM: shutdown, the agent's (it powers the guest off), within
// agentShutdownTimeout, then the sandbox's Stop (the VM, the server, the layout), then the
// control socket. The VM's end from the start of Stop is its stop, not its death.
func (p *QEMUVM) Stop(ctx context.Context, shutdown func(context.Context) error) error {
	p.mu.Lock()
	p.stopping = true
	p.mu.Unlock()
	if p.agent != nil && !isClosed(p.done) {
		sctx, cancel := context.WithTimeout(ctx, agentShutdownTimeout)
		if err := shutdown(sctx); err != nil {
			log.G(ctx).WithError(err).Warn("the agent's shutdown")
		} else {
			// Nothing more to ask: hanging up tells the agent that its answer arrived, and it
			// powers off without waiting for that.
			if p.client != nil {
				p.client.Close()
			}
			select {
			case <-p.sb.VMExited():
			case <-sctx.Done():
			}
		}
		cancel()
	}
	return p.teardown(ctx)
}

func (p *QEMUVM) teardown(ctx context.Context) error {
	var errs []error
	if p.client != nil {
		p.client.Close()
	}
	if p.ctl != nil {
		if err := p.ctl.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := p.sb.Stop(ctx); err != nil {
		errs = append(errs, err)
	}
	if p.net != nil {
		if err := p.net.detach(); err != nil {
			errs = append(errs, err)
		}
	}
	if p.cg != nil {
		if err := p.cg.leave(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	p.doneOnce.Do(func() { close(p.done) })
	return errors.Join(errs...)
}
