// Package agent is kvfs-agent, the init of a kvfs pod's VM: it serves the agent API
// (api/agent/v1) to the host's shim over ttrpc and runs the pod's containers with crun in the
// guest.
//
// # What it does
//
// As PID 1 (Main) it leaves the initramfs for a bind mount of it (the runtime's pivot_root refuses
// the initial rootfs), mounts /proc, /sys, /dev, /dev/pts (its own instance, ptmxmode=0666),
// /dev/shm, /dev/mqueue, /run, /tmp and cgroup2 at /sys/fs/cgroup with every controller enabled for
// the containers, loads the modules in /etc/kvfs/modules (finit_module), mounts the virtio-fs tag
// of the kernel command line (kvfs.tag=) at /run/kvfs/shared, brings lo up (the containers share
// the VM's network namespace) and serves, on the virtio-serial port io.kvfs.agent.0 or a vsock port
// (kvfs.agent=), to the host that proves this boot's secret (see Transport). Every line it logs on
// the console starts with "kvfs-agent:". Shutdown kills every process of the machine but the agent
// (the container runtime is not run: its state ends with the machine); Main then lets the answer
// leave, syncs, unmounts the share and powers off. Outside PID 1 only the service runs (as a child
// subreaper, so the container processes still come back to it), and Shutdown kills and deletes each
// container through the runtime.
//
// [Service] implements the API on a [Runtime] ([OCIRuntime]: crun create, start, exec, kill,
// delete, ps, pause, resume, update through go-runc) and [Cgroups] ([Cgroup2]: metrics and OOM
// kills from the container's cgroup), a file per job: containers.go (create, stats, resources,
// pause, OOM events), processes.go (execs, signals, waits, deletes and the exits the reaper
// reports), stdio.go (a process's streams and terminal), podns.go (the pod's namespaces),
// ports.go (port-forward's connections to the guest's localhost), network.go, sysctl.go, and
// service.go (its state, lookups, errors and Shutdown). Adding an RPC
// touches the proto, the file of its job, the shim's door and its caller. Each container's bundle
// is /run/kvfs/containers/<id>/config.json, written from the request's spec. A process's stdio are
// pipes the agent holds the other ends of, /dev/null for a stream the host did not ask for, or a
// pty whose master the runtime passes back over a console socket. Its output is read into a bounded
// buffer (1 MiB; past it the process blocks on write) that ReadStdout and ReadStderr drain, so what
// a process wrote is still there after it exited: WaitProcess answers after the exit, the reads
// answer the rest and then eof. A pipe that a child left behind still holds open is read out and
// ended 2 s after the process exited (Config.OutputGrace; containerd's runc shim waits as long for
// an exec's output), so the host's wait for eof ends; a pty is not (its end comes when the last
// process holding the terminal goes).
//
// Before the runtime creates a container, the agent walks into the share's submounts the
// container's root and binds cross, and those the host names below them, so that its own mount
// namespace holds them until the last container using them is deleted (submounts.go): the exit of a
// container's last process then never tears a virtio-fs superblock down, which Debian's 6.1 kernel
// can do with an inode still busy and stop on, and a bind carries the host's mounts inside it with
// their own flags. A spec whose PID namespace is apiv1.PodPIDNamespace joins the pod's shared one,
// and one whose user namespace is apiv1.PodUserNamespace the pod's user namespace, both made at
// first use with an init of their own, kvfs-pod-init (podns.go). The pod's tmpfs volumes a
// container names (Kubernetes' emptyDir of medium Memory) are mounted at first use under
// apiv1.PodTmpfsDir and kept for the pod's life, so that its containers share each
// (podtmpfs.go). The volumes the kubelet updates in place (CreateContainerRequest.mirrored:
// configMap, secret, projected, downward API) are copied from the share into the guest's
// tmpfs and kept in step by polling, each update replayed in the kubelet's order, so that an
// inotify watch in the container sees it (mirror.go). A kill that the runtime refuses
// because the init has exited, not yet reaped, answers NotFound once the reaper reports the exit.
//
// ConfigureNetwork gives the guest the pod's network: each NIC, found by the MAC the host
// gave QEMU, is renamed, given its MTU and addresses and brought up, then the routes are
// added, all through netlink ([Netlink]; vishvananda/netlink, pure Go, so the agent stays a
// static binary). The whole request is checked before anything changes
// ([ParseNetworkRequest]: bad input is InvalidArgument naming the field). lo is up from boot
// whether or not a network comes. SetSysctls writes the pod's sysctls below /proc/sys, checked
// whole first (names as sysctl(8) takes them, through an os.Root).
//
// For port-forward, OpenPort connects to a TCP port of the guest's localhost, 127.0.0.1 then
// [::1] as containerd's CRI dials a runc pod's, in the agent's network namespace, which the
// containers share: a server bound to the guest's loopback only is reached. ReadPort,
// WritePort and ClosePort carry the host's client's bytes, its half-close (shutdown of the
// write side) included (ports.go).
//
// The service's errors are of errdefs kinds (errf), as the shim's are; [Interceptor] wraps
// every request with the policy of every kvfs ttrpc server (internal/rpcedge): a kind leaves as
// its gRPC code, a panic answers Internal with a logged stack instead of ending PID 1 (and
// the VM), and kvfs.debug=1 logs each request with its duration and error.
// An agent built with the kvfsfaults tag, for the tests of the host against a hostile guest
// only (packaging/guest/build.sh --agent-faults), chains a second one that misbehaves as
// kvfs.fault=MODE on the kernel command line says (fault.go); the agent built without it, the
// one images ship, links none of that code and refuses to boot with a kvfs.fault=.
//
// The [Reaper] reaps every child with wait4(-1) on SIGCHLD and is go-runc's process monitor,
// so runc's own commands get their exits and every other exit reaches
// [Service.ProcessExited]. A process can exit before runc has told its pid; while a create or
// exec is in flight, exits of unknown pids are kept and matched when the pid is known.
//
// # Transport
//
// A virtio-serial port is one byte stream for the VM's whole life; the host's sessions on it
// (each connection to QEMU's chardev socket) are not framed. While no host is connected, a
// read answers end of file at once and poll reports POLLHUP; when one connects, both stop. The
// serial listener (ListenSerial) therefore looks every 10 ms whether a host is there while
// none is (Accept); each session is one net.Conn handed to ttrpc, and a session ends when the
// host goes away (POLLHUP, or a read's end of file), leaving the port open for the next.
// While a session lasts, one goroutine, the port's pump, does every wait, read and write of
// the port, with poll(2) and no timeout; the connection's Read and Write only exchange bytes
// with it, and an eventfd wakes it for output and for the end. One poller is what keeps a
// wake-up from being lost: a poll of the port takes a buffer the host just filled off the
// virtqueue, and if that comes before the buffer's interrupt is handled, the handler finds no
// work and wakes nobody. A reader parked in Go's edge-triggered poller slept so with a request
// in the port (the shim hung waiting for its answer), and a reader and a writer polling at
// once could each take the other's; the pump sees in its own poll's answer whatever that poll
// took, and what comes later wakes it (the data's interrupt; the host's coming and going,
// whose control messages wake the port's waiters; room for output). An idle pod's agent thus
// sleeps until spoken to.
// The kernel keeps no trace of a disconnection followed at once by a reconnection, so the
// connection also follows ttrpc's framing of what the host sends: a request whose stream id
// does not grow starts a new session (a new client counts from 1 again), and the bytes from
// its header on go to the next connection. What still fails is a host that vanished in the
// middle of a message and a new one that came before the pump saw it go: the new session's
// first bytes are taken as the rest of the old message. Seen with QEMU 7.2 and the 6.1
// guest (TestAgentInGuest): a host that leaves and comes back half a second later ends the
// session by POLLHUP, and Accept then waits without spinning; one that redials at once is
// told apart only by its stream ids (the hello's is 0, below). vsock (ListenVsock) has real
// connections and none of this.
//
// Both transports serve only the host that proves this boot's secret (secretListener). The
// host makes 32 random bytes for each boot and gives them to QEMU in a sealed memfd QEMU
// inherits (-smbios type=11,path=/proc/self/fd/N: the bytes are on no command line, and in no
// file); QEMU offers them to the guest as an SMBIOS OEM string, io.kvfs.agent.secret=<hex>,
// which the agent reads once at boot from /sys/firmware/dmi/tables/DMI (ReadSecret: the
// kernel's copy, root's only; the kvfs guest kernel has neither the fw_cfg sysfs driver nor
// ioperm(2), so fw_cfg is out of reach without a new kernel). Without it the agent serves
// nothing: it logs why and powers the machine off. Each connection must begin with the hello
// (apiv1.Hello: the secret in a message of ttrpc's shape, stream id 0), read off it before
// ttrpc has a byte: a connection whose hello is wrong (the secret compared in constant time),
// short, or not there within 5 s is closed, and counted and logged at most once a second (a
// peer can connect in a loop). Connections wait for their hellos each in a goroutine, at most
// 8 at once (more are closed at once), so a silent peer does not hold up the host. One host
// connection is served at a time: one that proves the secret replaces the one being served,
// which is closed. Only the host has the secret, so the newer connection is the host's,
// reconnected (after a Ping that went unanswered, say), and the older one is dead to it even
// when the guest cannot tell; refusing the newer one would leave the host on a dead one.
// Over serial, "closing" a refused session cannot hang up on the host (the port stays
// open): the agent reads on for the next hello, and drops what comes before it, so that what
// a refused host sent does not hide the next host's hello; when the port shows that a host
// left, the bytes it read from a hello on are kept (a new host's, read before the departure
// was seen).
//
// A vsock port, unlike the serial port, is open to more than the shim: to any host process
// that knows the guest's CID (it is on QEMU's command line) and, through a loopback
// transport, to the guest's own processes. Before the secret, the agent serves only the host
// (CID 2, VMADDR_CID_HOST) connecting from a port up to 1023: the host's kernel lets a
// process bind such a vsock port only with CAP_NET_BIND_SERVICE in the initial user
// namespace, and gives any other a port above 1023, also when connect binds one. The shim
// binds one before it connects. Every other connection is closed before a byte of it is
// read, and logged at most once a second, the next line counting those not logged.
//
// # Threat model
//
// The guest is hostile to the host, not the other way round: the host (the shim) is trusted,
// it owns the VM. The agent still checks what it is asked, so that a confused or buggy host
// gets an error rather than a broken guest: ids are one path component (no "/", no "." or
// "..", no leading "-" that runc would parse as a flag, no control characters, at most 255
// bytes), a spec's root must be below the share and its only hooks are createContainer and
// startContainer (runc runs them; the other phases are the host's), JSON documents are
// bounded (4 MiB), a read answers at most 1 MiB, signals are 1 to 64, a network request's
// names, MACs, addresses and routes parse and are bounded in number, at most
// apiv1.MaxPortStreams port connections are open at once (ResourceExhausted beyond), each
// write to one carries at most apiv1.MaxPortWrite bytes and waits at most
// apiv1.PortWriteWait, each dial at most apiv1.PortDialTimeout. The containers are not
// trusted: what they write reaches the host only as stream data, bounded by the host's reads.
// A host that vanishes (a shim restart) costs its connection, never the agent: the next
// connection on the port is served.
//
// The host is told from others by the boot's secret (see Transport), which only the shim
// and QEMU hold: a host process that can connect, over vsock a container without a user
// namespace that keeps CAP_NET_BIND_SERVICE and opens an AF_VSOCK socket (no seccomp
// profile, Kubernetes' default, or a 32-bit process under containerd's and Docker's default
// profiles, which filter socket(2) for AF_VSOCK but not socketcall(2)), gets its connection
// closed and nothing served. The privileged-port rule still keeps unprivileged host users,
// other VMs and the guest's containers from even making the agent wait for a hello. What
// such a process can still do is deny service: connect in a loop to keep the 8 waits for a
// hello full, and the host's connections are closed at once meanwhile. The secret is not
// the guest's to keep: root in the guest can read it (it is no use to it but to speak to its
// own agent), and a new boot has a new one.
//
// # Lock order
//
// container.op, then Service.mu. container.op serialises the runtime calls that change one
// container (create, start, exec start, pause, resume, update, delete) and is held across
// them; Service.mu guards the maps and every process's state and is never held across a
// runtime call, a cgroup read or a wait. Reaper.mu, outStream.mu, serialConn.mu,
// refusalLog.mu, secretListener.mu, submounts.mu, podTmpfs.mu and portStreams.mu are leaves;
// portStream.readMu and portStream.writeMu are held across one port connection's read or
// write, with no other lock.
// ProcessExited takes Service.mu only.
package agent
