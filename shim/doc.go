// Package shim is containerd-shim-kvfs-v2 (runtime io.containerd.kvfs.v2): containerd's task
// API (v3, over ttrpc) for the containers of one pod, run by the kvfs guest agent in the pod's
// QEMU VM, their files served to the guest over virtio-fs by the sandbox's kvfsd, confined in
// a process of its own (package sandbox/serverproc: the shim's main calls serverproc.Init
// first).
//
// # Pieces
//
//   - Manager is the bootstrap side (containerd v2.4's pkg/shim.Shim, driven by RunShim): the
//     start action groups containers by pod (SandboxID: CRI's io.kubernetes.cri.sandbox-id,
//     or the container's own id for ctr and nerdctl) into one long-lived shim process per pod,
//     on a socket named after the pod; the delete action (Cleanup) undoes what a dead shim
//     left: the rootfs mount and the sandbox (VM killed, mounts detached, directory removed).
//   - Pod (pod.go) owns the pod: its containers, its run (podRun, podrun.go: the VM, the
//     door to its agent, agentdoor.go, with the failure policy, and the context the calls end
//     with), its OOM event stream and the Sandbox API's sandbox. What the pod and its
//     containers share for the shim's life (the shim's context, the event publisher, the
//     guest logger, the limits) is a podEnv (podenv.go). The pod's containers come and go
//     through it (podcontainers.go): a container listed, the pod acquired (booted for the
//     first), the container created in it; deleted, and the pod ended with the last.
//   - Container (containerstate.go) is one container: its init and execs (process.go, the
//     state table) and what the host declared of them. Its life is its own (container.go):
//     create (its files into the share, containerfiles.go, the agent's container, its hooks,
//     hooks.go), start, exec, kill (a SIGKILL the host finishes), pause, resume, stats,
//     update, and the host's side undone at its Delete; each process's output, stdin and exit
//     sequence (watch.go). Each call takes the pod's run it is made in.
//   - TaskService (taskservice.go) and SandboxService (sandboxservice.go) are containerd's two
//     APIs, thin adapters holding the Pod: each call finds its container or process, turns
//     the request into the Pod's or the Container's terms and the answer back. Each is a
//     plugin of its own (package shim/plugin); ErrorEdge (interceptor.go), a ttrpc server
//     interceptor, is the one place their errors become gRPC codes. A task Create is checked
//     whole first (newContainerRequest, containerrequest.go); either API's pod request is made
//     in one place (newPodRequest, podrequest.go): one set of checks, one sizing of the VM.
//   - The task API's pod: the first Create makes and boots it (a VMStarter: StartQEMUVM in
//     production), the last Delete stops it (without deleting the container in the guest
//     first: the agent's Shutdown ends it there), Shutdown with no container left ends the
//     shim. That is the pod's life with CRI's default sandboxer "podsandbox".
//   - The Sandbox API's pod (containerd.runtime.sandbox.v1; podsandbox.go, its life in
//     sandboxlife.go) is the pod's life with CRI's sandboxer "shim": CreateSandbox takes the
//     pod's CRI config and network namespace (the configuration from the runtime options the
//     start action kept in the bundle), StartSandbox boots the pod, with no pause container;
//     the containers, created through the task API, join it. StopSandbox kills what still
//     runs (SIGKILL, which the host finishes) and stops the pod, WaitSandbox returns at its
//     end (0 when stopped, 255 when its VM died), SandboxMetrics is the pod's host cgroup
//     parent's metrics (as podsandbox reads them; the guest's cgroup metrics for a pod
//     without a cgroup parent), ShutdownSandbox ends the shim. Such a pod outlives its last
//     container.
//   - The pod sandbox's task (sandboxtask.go): with CRI's podsandbox sandboxer the first
//     container is the pause container. The VM is the pod, so it runs nothing: its Create
//     boots the pod, sized by CRI's resource annotations (sizePod), named by its hostname (the
//     guest's, kvfs.hostname=), with the network of its namespace; a sandboxAgent in front of
//     the guest agent answers every call about it (the VM's pid, the pause process's exits,
//     the pod's stats), so its task runs through the same state machine as any. Its Delete
//     (after CRI's StopPodSandbox, or in its cleanup) ends the pod, as the last container's
//     does: its VM stopped, whatever container is left ended by the host (its processes exit
//     137) and deletable after.
//   - VM (vm.go) is the narrow interface to the pod's VM: the agent (api/agent/v1), the
//     share's Bind and Unbind, the VM's death, and Kill, the host's last word. QEMUVM is the
//     real one: a sandbox.Sandbox booted with sandbox.DefaultVM, the agent dialled on
//     agent.sock (virtio-serial) or vsock until it answers Ping within agent.boot_timeout,
//     and the sandbox's control API served on control.sock in the sandbox directory.
//   - The pod's network (network.go): the sandbox container's network namespace path
//     (PodRequest.NetNS) is joined to the VM by package sandbox/network before the VM starts
//     (a tap and tc redirects beside the pod's veth, the tap a virtio-net NIC with the veth's
//     MAC), the agent's ConfigureNetwork gives the guest's NIC the veth's name, MTU, addresses
//     and routes once it answers, and the tap and filters are removed after the VM stops.
//     QEMU is started in that namespace (sandbox.VM.NetNS: from a thread that joins it and
//     goes back), as Kata starts its hypervisor. A network namespace entry without a path is
//     a VM without a NIC; none at all is the host's network (hostNetwork), refused at Create,
//     like a path that is the host's namespace.
//   - Port-forward (portforward.go): containerd's CRI dials localhost in the pod's network
//     namespace itself. Once the guest is configured, the pod's run redirects the
//     namespace's TCP to 127.0.0.1 and ::1 to a relay of its own listening there (package
//     sandbox/network's RedirectLoopback: nftables rules made over netlink), which reads
//     each connection's original port (SO_ORIGINAL_DST) and carries it to that port of the
//     guest's localhost through the door (OpenPort, ReadPort, WritePort, ClosePort), half-
//     closes both ways, and resets the client's connection where the guest refuses. The
//     rules and listeners go at the run's stop.
//   - AdaptSpec turns a container's OCI spec into the guest's: its root under
//     /run/kvfs/shared/<id>, host-only parts dropped, host bind mounts bound into the share.
//   - Package stdio opens containerd's stdio (fifos, file://, binary://). An output fifo keeps
//     a read side of the shim's own, so that a restarted containerd finds what was written
//     while it was away.
//   - The pod's host cgroup (cgroup.go): with CRI's podsandbox, the pause container's
//     linux.cgroupsPath; with the Sandbox API, the same path derived from the pod's cgroup
//     parent (CRI's linux.cgroup_parent: parent/id, or slice:cri-containerd:id under a systemd
//     slice, as podsandbox makes it). The shim joins it before it starts the pod's kvfsd and
//     QEMU (a systemd one as a scope systemd makes in the slice), so that the pod's stats
//     (crictl statsp, read from the cgroup parent) are the VM's, and the kubelet's pod cgroup
//     bounds the VM.
//
// # Restarts and crashes
//
// containerd restarted reconnects to the pod's shim by the address each container's bundle
// keeps, and the pod goes on. A shim that dies (SIGKILL) is noticed by containerd, which runs
// the delete action (Manager.Stop) in each of its containers' bundles, all at once: the first
// to lock the sandbox kills the VM and kvfsd, detaches the mounts and removes the directory,
// the others wait for it; the pod's cgroup is removed after (a systemd scope stopped); the
// tasks are reported exited with 137.
//
// # Processes and exits
//
// A process (a container's init, or an exec) is a state machine (process.go): created,
// starting, running, paused, stopped, deleted; an operation in a state that does not allow it
// is errdefs.ErrFailedPrecondition, except a Kill of a finished process, which is
// errdefs.ErrNotFound as in runc's shim (containerd's callers take it as "already dead").
// Each process's exit follows one order on every path (normal exit, kill, the VM's death):
// its output read from the agent to EOF and written to containerd's streams, the streams
// closed, the exit recorded, TaskExit published, then Wait returns. An init's TaskExit comes
// after its execs': once the init has exited, its running execs get execsTimeout to exit, then
// every exec the guest has not reported is declared exited by the host with status 137 (the
// init's end kills its PID namespace in the guest; an exec the guest does not report then is
// not the host's to wait on), so that the container's Delete finds none running. A process
// the host declares exited (this, or an exec's SIGKILL the guest does not finish: see the
// threat model) has its calls to the agent ended and its output cut, then the same order
// follows; the guest may still run it, and its refusal to delete it (or its container) is
// logged, not returned: it stays in the VM until the pod ends. If the VM or the virtio-fs
// server dies, every process ends with exit status 255 and a TaskExit, and the log says why.
// Events are published in the order the API promises: TaskCreate before TaskStart before
// TaskExit before TaskDelete.
//
// # Hooks
//
// A container's OCI hooks run as the runtime spec says, for every container the shim creates
// (a CRI sandbox's too). The host phases run on the host (package hooks), with the shim's
// context and no lock held, the state's pid the VM's (a host process of the pod): prestart then
// createRuntime once the agent has created the container, before Create returns (state
// "creating"); a failure fails Create with the hook's error and output and undoes it all, the
// guest's container included, then runs the poststop hooks. Poststart runs once the agent has
// started the init, before Start returns; poststop at the init's Delete, once the guest has
// deleted the container and its binds and rootfs are gone. Their failures are logged, not
// returned. createContainer and startContainer stay in the guest's spec (AdaptSpec): crun, the
// guest's runtime, runs them in the container's namespaces, with guest paths.
//
// # Locks
//
// Pod.mu guards the container map, the pod's run and the Sandbox API's sandbox (its
// phase, pid and exit); Container.mu a container's execs and its strays; process.mu a
// process's state; agentDoor.mu the door's counts. Order: Pod.mu, then Container.mu, then
// process.mu; none is held across a call to the agent, the VM, the sandbox, a mount or the
// publisher. The first Create (or StartSandbox) boots the pod with no lock held; concurrent
// Creates wait on a channel.
//
// # Threat model
//
// The guest is hostile to the host: root in the VM controls the agent, so everything it answers is
// untrusted, and the shim treats it as kvfsd treats the guest's driver. Every call to it goes
// through one door (agentDoor), which gives it a deadline by kind (GuestLimits: queries 5 s,
// signals 5 s, lifecycle calls 60 s; only the streams, the waits for exits, OOM events and output,
// have none, and they end with the pod), checks the answer (an exit status a process can have, no
// more output than asked, metrics of a bounded size that decode as what containerd's CRI decodes),
// rebuilds the guest's errors from their code and a printable text of at most 1 KiB (their details
// dropped), and counts misbehaviour: three missed deadlines in a row, one missed lifecycle deadline
// or three broken answers and the guest is cut off, its VM killed, every process reported exited
// once (137 if the host was asked to kill it, 255 otherwise), and containerd's Deletes then leave
// nothing. A SIGKILL (of an init, an exec, or all of a container's processes) is the host's to
// finish, whatever the agent answers (a refusal, such as NotFound for a process the guest says has
// exited, also goes to containerd): unless the guest reports each exit within
// GuestLimits.KillGrace, the host ends the process. An init is ended by killing the VM, which ends
// every container of the pod (the guest cannot be trusted to have killed one and not the others).
// An exec is declared exited (137: output cut, TaskExit, Wait and Delete work) and the pod goes on:
// a healthy guest's exec can outlive a SIGKILL while it sleeps uninterruptibly, which must not take
// the pod down, and a guest that keeps one running on purpose keeps a process of its own VM, which
// root in it could start anyway; so it is not counted as misbehaviour. A pod's end, StopSandbox or
// the Delete of its last container or of CRI's pod sandbox container, always stops the VM, and
// every Delete after it works.
//
// Below ttrpc, the agent connection is filtered (agentwire.go): ttrpc's client, which trusts its
// server and logs every frame it did not wait for, gets only the answers to the requests it has
// outstanding, each a response of at most 256 KiB that decodes as one. Any other frame (on a stream
// with no request outstanding, of another type, malformed) is dropped and counts as a broken
// answer; a longer frame ends the connection and cuts the guest off at once. A call whose caller
// gave up is answered by the filter, and the agent's late answer dropped without a word (it is no
// violation: the missed deadline is counted). Nothing the guest sends is logged but through the
// pod's one rate-limited guest logger, its text escaped and cut (guestText).
//
// What the guest can send at will is capped: at most one TaskOOM per container per second, its
// answers taken at most one per 10 ms; the log lines it can cause, one per kind per 10 s (20,000
// frames on streams the shim never opened make three lines, and cut the guest off). A slow guest's
// Stats are served from its last answer after GuestLimits.StatsWait (stats.go), so containerd's
// node-wide metrics never wait seconds on one pod.
//
// The task API's pids, Pids' too, are the VM's (as Kata gives its hypervisor's): a pid the guest
// names is never shown to containerd, which reads them as host processes (CRI's metrics open
// /proc/<pid>/fd). The shim copies the guest's output (bounded per read), and bounds every wait on
// it (the drain of a process's output after its exit, the execs' exits before an init's, the boot,
// the stop).
//
// The guest never names a host path: the shim decides every bind (AdaptSpec), and the sandbox
// package never follows the guest's symlinks when it unbinds and cleans up. What a container's spec
// makes read-only (a mount's ro or rro, root.readonly) is bound read-only on the host, so root in
// the guest cannot write there through the server either; the mount points the guest's runtime
// would make in a read-only root the shim makes first, inside the root whatever its symlinks say
// (makeMountPoints). containerd, its requests and the configuration file are trusted; a pod's
// annotations are not (see sandbox.Config.Resolve).
//
// Port-forward's relay is bounded as a process's output is: each read asks 32 KiB and the
// door refuses a longer answer, or an empty one without end of file; a write answer may not
// say more was taken than sent, and one that took nothing is retried after a pause, so the
// guest cannot spin the relay; at most 64 connections are relayed at once (more are reset).
// OpenPort and WritePort have the door's deadline of the agent's own bound plus Query's; the
// read has none and ends with its client's connection or the pod. The bytes carried are never
// logged. The relay listens on the pod namespace's loopback only, and dials nothing there.
//
// The network namespace path comes from containerd and is trusted; root in the guest can write any
// frame to its NIC, but only those from the NIC's MAC and the pod's own addresses pass the guard on
// the tap, to the pod's veth and nowhere else, whatever capabilities the pod's spec drops (see
// package sandbox/network).
//
// The files the shim writes for a Sandbox-API pod's containers (/etc/hostname, /etc/hosts,
// /etc/resolv.conf) are bound read-write, as runc binds them, so the guest can write them through
// kvfsd: they live on a tmpfs of 256 KiB of their own in the sandbox's bundle (podFilesSize), not
// on the /run of containerd's state directory, and the tmpfs goes with ShutdownSandbox or the
// delete action.
//
// QEMU, whose device emulation is what a guest escape goes through, is born in the pod's
// network namespace (its interfaces the pod's veth, the tap and lo) and in the pod's host
// cgroup, under the kubelet's pod cgroup and its limits, when the pod has a cgroup parent: a
// cgroupfs one, or a systemd slice, in which the pod's scope is made through systemd. A cgroup
// the shim cannot join (a systemd one where systemd is not running) fails the pod's start:
// the VM never runs outside the pod's limits in the shim's cgroup. None of its
// devices needs the host's network namespace: its sockets (vhost-user, the agent's serial port)
// are path-based Unix sockets, and AF_VSOCK knows no network namespaces in Linux 6.1, Debian
// 12's (the vsock path is not tested here: no /dev/vhost-vsock). That keeps QEMU's own network
// use to the pod's, and its CPU and memory to the pod's account. It is not yet a wall against
// an escape: QEMU runs as root with every capability, in the shim's mount, PID and user
// namespaces, so code running in it can reach the host's files and Unix sockets (containerd's
// among them), or setns(2) back into the host's network namespace through /proc/1/ns/net.
// Confining QEMU as kvfsd is (capabilities dropped, a seccomp filter, a user or mount namespace
// of its own) is what makes these namespaces hold.
//
// QEMU and kvfsd hold the pod's memory, so the host's OOM killer weighs them as the pod, not as
// the shim, which keeps containerd's oom_score_adj (containerd's own plus one, -998 typically):
// they start with the sandbox container's process.oomScoreAdj (or a lone container's), and each
// CRI container's raises theirs to its own before the container is made (podOOMScoreAdj,
// sandbox.RaiseOOMScoreAdj). CRI gives the QoS class's value (Guaranteed -997, BestEffort 1000,
// Burstable between) only to containers: the pause container gets -998 whatever the class and
// the Sandbox API's pod config carries none, so a pod's VM is at -998 until its first
// container, while the guest runs only its kernel and the agent. A BestEffort pod's VM is then
// at 1000, never better protected than a runc container of its class. A value that cannot be
// written fails the Create, as in runc (a value below containerd's own may need
// CAP_SYS_RESOURCE; containerd's restrict_oom_score_adj keeps the values at or above its own
// where that is withheld).
//
// The guest agent serves only the host that proves the boot's secret: sandbox.Start makes 32
// random bytes for each boot and gives them to QEMU in a sealed memfd QEMU inherits (an SMBIOS
// OEM string, -smbios type=11,path=/proc/self/fd/N: on no command line, in no file), and
// DialAgent sends them first on each connection (agent.Hello), before any ttrpc; a connection
// without them is closed by the agent unserved (see package agent). With agent.transport =
// "vsock" the agent also serves only the host connecting from a privileged port, one up to
// 1023: DialAgent binds the highest free one before it connects, so the shim needs
// CAP_NET_BIND_SERVICE (it has it as root), and each vsock pod's connection holds one of the
// host's 1023 while it lasts. The port keeps an unprivileged host user, who can read the
// guest's CID on QEMU's command line, from even connecting; the secret keeps out a process
// with that capability too, such as a root container without a user namespace that can open
// an AF_VSOCK socket (no seccomp profile, Kubernetes' default, or a 32-bit process under
// containerd's and Docker's default profiles, which filter socket(2) for AF_VSOCK but allow
// socketcall(2)): it can connect, and make the agent wait up to 5 s for its hello, but is
// served nothing. Reading the secret needs ptrace access to QEMU or the shim (root with every
// capability) or root in the guest, which controls the agent anyway.
package shim
