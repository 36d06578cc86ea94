// Package sandbox is the per-pod layer a shim drives: for each pod, a host directory layout, a
// vhost-user socket, a virtio-fs server with Kata's defaults, the QEMU arguments that connect a
// VM to it, and the supervision of the server and the VM.
//
// # Layout
//
// A sandbox lives in BASE/<id>/ (base_dir, default /run/kvfs/sandboxes):
//
//	mounts/         where root filesystems and volumes are bound (Bind); a shared mount
//	shared/         read-only slave bind of mounts/: what the server exports
//	mnt.ns          the sandbox's mount namespace, bound here (below)
//	vhost-fs.sock   the vhost-user socket, created here (mode 0600) and passed to the server
//	state.json      the persisted state (below)
//	owner.lock      flocked by the owning process
//	console.log     the guest's serial console, sanitized, at most 1 MiB; console.log.1 the
//	                MiB before (see "The VM's output" below)
//	qemu.log        QEMU's stdout and stderr, sanitized, at most 256 KiB; qemu.log.1 before
//	server.log      the server's stdout and stderr (confined or external), drained from a pipe,
//	                sanitized, at most 512 KiB; server.log.1 before
//	server.sock     the confined server's channel (statistics, log level, DAX policy), mode 0600
//	control.sock    the control API of the sandbox's owner (a shim), if it serves one
//	agent.sock      the host side of the guest agent's virtio-serial port (DefaultVM with
//	                agent.transport = "serial"): QEMU listens (server=on,wait=off), the shim
//	                connects
//
// shared/ is made as Kata makes it — bind mounts/ to shared/, remount it MS_BIND|MS_REMOUNT|
// MS_RDONLY, make it MS_SLAVE — after first binding mounts/ onto itself and making it
// MS_SHARED: without that, propagation from mounts/ to shared/ depends on the host's mount
// propagation, and on hosts whose / is private (containers, these test machines) a bind made
// later under mounts/ would never reach shared/ and so the guest. Bind makes each bind on a
// detached copy of its source (open_tree), private (mounts later made under the source stay
// out; BindFollowHost makes it a slave of the source instead, so that they come in) and
// read-only as asked before it attaches it in mounts/ (move_mount): a remount to
// read-only would not reach the copy already propagated to shared/, a copy of a read-only
// mount is read-only. A read-only bind is the host's guarantee, not the guest's: the host's
// kernel refuses the server's writes there (EROFS), whatever root in the guest asks for.
// BindReadOnly makes the bind's own mount read-only, BindRecursiveReadOnly every mount
// under it, as runc does with a mount's "ro" and "rro".
//
// # Mount namespace
//
// mounts/, shared/ and the binds are mounted in a mount namespace of the sandbox's own, never
// in the owner's (the host's, or containerd's). A mount the host makes inside a bound
// directory has a copy in the bind; were that copy in the host's namespace, the mount point
// would stay busy there, and the host's rmdir of it fail with EBUSY, as long as the pod runs
// (critest's read-only mount specs: a tmpfs in a hostPath directory, unmounted and removed
// while the pod runs). In another namespace it is no obstacle: the kernel detaches a mount
// whose mount point another namespace removes, as it does for a runc container's. A pod
// never changes what the host can do at a host path.
//
// At Create a goroutine locked to an OS thread (never the process's main thread, which
// /proc/self follows) unshares the namespace, a copy of the owner's whose every mount is made
// a slave (MS_SLAVE|MS_REC): nothing made there reaches the host, and what the host unmounts
// goes from the copy too, so the namespace never keeps a file system mounted that the host let
// go (a private copy would keep, say, a volume's block device mounted for the pod's life). That
// thread makes the layout there and then runs the sandbox's mount work (mountNS.do): Bind's
// attaching (move_mount and the private remount), Unbind, Submounts (its own
// /proc/thread-self/mountinfo) and Stop's unmounts. Bind opens and copies its source
// (open_tree) in the owner's namespace, on the caller's thread, so a source names what the
// owner sees; a detached copy belongs to no namespace until it is attached. A mount that
// follows the host (BindFollowHost) is a slave of its source's peer group from the copy on,
// across the namespaces. Creating and removing mount points are file system operations,
// seen from both.
//
// The servers are started from that thread, so they are born in the namespace (a child is
// born in its forking thread's): the confined server's own namespaces are copies of it, an
// external daemon runs in it, and the in-process server opens its root there (a descriptor
// opened there reaches what is mounted there later, from any thread). QEMU needs nothing of
// the share and runs in the owner's namespace.
//
// The namespace is pinned at mnt.ns in the owner's namespace (a bind of the thread's
// /proc/.../ns/mnt), so that it outlives the owner: an owner that adopts the sandbox after a
// restart joins it from there (setns on a thread of its own). The kernel binds a namespace's
// file only into a namespace with a lower id (no loop), and newer is not enough: Linux 6.18
// hands out namespace ids from per-CPU batches, so a namespace made on another CPU than the
// owner's, later, can have the lower id (under containerd, whose namespace is not the host's,
// the pin then failed with EINVAL in one TestCRIPod run out of a few). The thread checks
// the id it got (NS_GET_MNTNS_ID) and, below the owner's, unshares again on each CPU in turn
// until one is above: on the CPU that made the owner's, every later id is. The pin is bound
// onto a private bind of the file onto itself, since the kernel refuses to propagate a
// namespace's file (a pin on a shared mount, as /run is on a systemd host, fails with EINVAL).
// Stop unmounts the binds there, ends the thread and unmounts the pin; the namespace goes with
// its last process. Cleaning up a sandbox whose owner is gone unmounts the pin after stopping
// its processes, and so lets its namespace go, mounts included, without joining it.
//
// # Lifecycle
//
//	Create   resolve the configuration (file + annotations: all checks before anything is
//	         made), make the layout, the mount namespace and the mounts in it, listen on the
//	         socket, start the server on it, write state.json. The server is listening before
//	         any VM exists, so QEMU's connection is accepted whenever QEMU comes. A failure
//	         undoes every step.
//	Bind     bind a directory or file into mounts/ (appears in the guest at once).
//	Start    run QEMU (through a VMRunner; QEMURunner by default) with VM.Args, and drain
//	         its serial console and its stdout and stderr (below).
//	monitor  a goroutine per server notices its end: for a confined or an external server,
//	         its process exiting (by pidfd or wait, so at once); for the in-process server,
//	         Serve returning. A server that ends while the VM runs (more than a second after,
//	         if the VM ended too) is a failure, handled by server.on_failure:
//	           stop     (default, Kata's behaviour) QEMU is killed, the sandbox goes to
//	                    PhaseFailed, Done is closed and Err says which server died, how, and
//	                    what was done. The owner then calls Stop.
//	           restart  a new server is started on a new socket at the same path, up to
//	                    server.max_restarts times; then stop applies.
//	Stop     in order: QEMU (SIGTERM, SIGKILL after 3 s), the server, the mounts
//	         (MNT_DETACH|UMOUNT_NOFOLLOW), the namespace's thread and pin, the directory.
//	         Idempotent.
//	Recover  after a restart of the owning process: adopt or clean up what it left.
//
// One VM per sandbox: a VM that exits (the guest powered off) ends the server's connection;
// that is not a failure, and the sandbox stays until Stop.
//
// # What the guest sees when the server is restarted (QEMU 7.2)
//
// Observed with the Debian 6.1 guest and QEMU 7.2 (TestVMServerRestart): after kill -9 of the
// server, QEMU prints "Unexpected end-of-file before all data were read" once and keeps
// running; the guest's request in flight never completes, so the process that made it hangs
// in the share (the guest's last console line is the one before its write); nothing serves
// the queue any more, so later requests would wait the same way. The new server listens on the same path but QEMU never
// connects again: its log shows no front-end connection. The guest's share stays dead until
// the VM restarts, which in practice means a new sandbox; the restart policy only helps a VM
// started after it. QEMU's own reconnect option does not help either: with
// "-chardev socket,...,reconnect=1" QEMU 7.2 does not start at all ("Failed to set msg fds.
// vhost_backend_init failed: Protocol error"), because vhost-user-fs needs the connection when
// the device is created. Stop still works at once on such a VM (SIGTERM, ~0.1 s).
//
// # Persisted state
//
// state.json (written to a temporary file, fsynced, renamed, the directory fsynced) holds: the
// format version, the ID, the creation time, the phase, the pod's resolved configuration, the
// server (confined, with its supervisor's pid and start time; in-process; or the daemon's path,
// arguments, pid and start time), the VM (QEMU's
// path and arguments, pid and start time), the restart count, the failure, the DAX policy and
// the oom_score_adj set at run time (see oom.go), and the owner's pid.
// A process is identified by its pid, its start time (field 22 of /proc/PID/stat) and the boot
// ID, so a reused pid is recognised.
//
// Recover (after the owner restarts) goes through the base directory. A sandbox whose lock is
// held by a live owner is skipped. One whose confined or external server still runs — and whose
// VM still runs, if one was started — is adopted (a confined server's channel too: its socket
// is in the sandbox directory): both are held by pidfd (signals cannot reach a
// process that reused the pid; the pidfd is opened first and the start time checked after),
// monitored again with the same policy, and can be stopped; its mount namespace is joined from
// its pin. Everything else is cleaned up: what still runs of it (verified as above) is
// stopped, the namespace's pin unmounted (the namespace and its mounts go with it), the
// directory removed. A sandbox with an in-process server is always cleaned up, VM included: its server
// ended with the previous owner, so its guest's share is dead (see above). An adopted confined
// server reports its counters over its channel, but not the last ones it leaves when it stops
// serving (their pipe was the first owner's). Processes that were
// the previous owner's children are reaped by whoever inherited them; if the new owner is a
// child subreaper, by the new owner.
//
// # Lock order
//
// Sandbox.opMu, then Sandbox.mu. opMu serialises the operations that change what runs or what
// is mounted (Start, Stop, Bind, Unbind and the failure policy) and may be held while a
// process is stopped (seconds); mu guards the fields and is held only to read or write them
// and to write state.json. Nothing is called with mu held that takes opMu. The mount
// namespace's thread takes no lock: the work it is given (with opMu held, for Bind, Unbind and
// a server's start) runs one at a time and returns. Recover holds no lock of any sandbox but
// the one it is working on.
//
// # Threat model
//
// The configuration file is trusted (written by the node's administrator, like the binary).
// Annotations are not: they come from the pod spec, written by the user. So an annotation can
// only set a key listed by exact name in [annotations] enabled (none by default); its value
// passes the same checks as the file's; server.daemon can only take a value from
// server.valid_daemon_paths; server.extra_args is never settable unless listed explicitly,
// and even then (as from the file) may not set the socket, the descriptor or the shared
// directory. Every bad value is an error naming the annotation, the key and the value, before
// anything is created.
//
// The guest is not trusted either, and it can write into read-write binds under the share
// (a container's root filesystem), so it can plant symlinks there. Host-side cleanup never
// follows them: mount points are checked with Lstat and unmounted with UMOUNT_NOFOLLOW, only
// the sandbox's own mount points are unmounted (MNT_DETACH takes what is below), nothing is
// removed while anything under the directory is still mounted (in the sandbox's namespace and
// in the owner's), and the removal works on descriptors opened O_NOFOLLOW and refuses to cross
// into another file system. The removal runs in the owner's namespace, where the binds are not:
// their mount points there are empty. Bind takes
// only a single path component as the name and creates its mount point with O_EXCL.
//
// The base directory is root's (0700); the sockets are 0600, so QEMU must run as root or the
// socket be given to its user by the owner.
//
// What a guest that takes over its server (a bug in the FUSE, ring or vhost-user code, which
// parse what it sends) can reach depends on server.daemon:
//
//	confined (the default)  the server's process only: kvfsd in new mount, PID, network and IPC
//	                        namespaces whose root is the shared directory (nothing else of the
//	                        host's files, no other process, no network, no host IPC), under the
//	                        seccomp allowlist (kill on any other call; no execve, mount, ptrace,
//	                        setns, socket other than AF_UNIX, ...) with no_new_privs, with only
//	                        the capabilities serving needs (confine.ServerCapabilities: no
//	                        CAP_SYS_ADMIN, no CAP_DAC_READ_SEARCH, whose open_by_handle_at would
//	                        reach around the root), on every thread. The share itself, read-write
//	                        where binds are, is what it can damage; the owner's process, its
//	                        other sandboxes and the host are behind those walls. What it answers
//	                        on its channel and leaves on its pipe is untrusted: bounded in size and
//	                        time, decoded only into counters. It holds no host file: its log is a
//	                        pipe the owner drains into server.log, kept bounded as the VM's
//	                        output is (below). See package sandbox/serverproc.
//	in-process-unconfined   everything the owner can: the server is a library in the owner's
//	                        process, as root, in the host's namespaces, without a filter. An
//	                        explicit opt-in, logged as a warning at every start.
//	an external daemon      whatever that daemon confines itself to (kvfsd and virtiofsd:
//	                        --sandbox=namespace and --seccomp=kill by default).
//
// The data path is the same code in every kvfsd mode; confinement adds nothing per request.
//
// # The VM's output
//
// The guest writes its serial console at will and without end, and can make QEMU write to
// its stderr; the sandbox directory is on /run, a tmpfs, where an unbounded file takes the
// host's memory and, once /run is full, breaks containerd and every other pod. So QEMU writes
// no file: the console goes through QEMU's file chardev opened on a pipe QEMU inherits
// (-chardev file,path=/proc/self/fd/N: a new, non-blocking opening of the pipe), QEMU's
// stdout and stderr to another pipe, and the owner drains both for as long as QEMU holds
// them — a console nobody read would fill its pipe and hold the guest's serial port, then
// the guest. What is drained is sanitized (printable ASCII, newline and tab as they are, a
// backslash doubled, carriage returns dropped, every other byte as \xNN: neither an
// operator's terminal nor an error message sees the guest's control bytes) and kept in
// bounds: the last 2 KiB of each in memory, and a file renamed to .1 once a write would take
// it past its limit (console.log 1 MiB, qemu.log 256 KiB): at most 2.5 MiB of a VM's output
// on the host, however much comes. A server's log (confined kvfsd or an external daemon) goes
// the same way, into server.log (512 KiB, then server.log.1): a server a guest took over can
// log a stack trace per request it makes panic, and would otherwise fill /run through it.
// The confined server and kvfsd ignore SIGPIPE, so that an owner's death, which breaks the
// pipe, drops their lines instead of ending them (an adopting owner no longer has their log). The drains poll(2) the pipes and pause 10 ms after a short
// read, so a console flood costs the owner a wakeup per 10 ms, not one per byte (Go's poller
// would wake the runtime at every write into the pipe). If the owner dies, QEMU's writes fail
// with EPIPE (QEMU ignores SIGPIPE) and are dropped; a restarted owner that adopts the VM
// keeps neither stream.
//
// VMExited is closed once QEMU has exited and the drains have read what it left (at most 2 s
// later). Sandbox.VMError turns an owner's "the guest never came up" (or "the VM exited")
// into an error that quotes how QEMU exited and the last lines (at most 20) of QEMU's output
// and of the console, and, when vm.accel = "" chose KVM because /dev/kvm opens, says that KVM
// may not run the guest and that accel = "tcg" runs it under TCG. It is an error, not a fallback to TCG: a
// guest under TCG runs 5 to 20 times slower, which an administrator should choose, not find;
// a failed boot is not always KVM's doing, and a second boot would double the wait for an
// answer that may be the same failure; and one sandbox runs one VM in its life.
//
// # Defaults
//
// DefaultConfig has Kata's virtio-fs defaults: cache=auto, no remote POSIX locks
// (no_posix_lock), thread pool 0, submounts announced, queue size 1024, one request queue,
// tag kataShared, failure policy stop; the server kvfsd, confined. Guest RAM is a shared memfd by
// default (memory-backend-memfd,share=on): Kata's shared file in /dev/shm counts against
// /dev/shm's size, and a full /dev/shm makes a running guest die of SIGBUS.
// testdata/defaults.toml lists every key with its default.
//
// # The guest agent
//
// DefaultVM boots vm.kernel with its root, vm.rootfs or vm.initrd (the kvfs guest image, whose
// /init is the agent; defaults /usr/share/kvfs/guest/vmlinux and rootfs.erofs) with the
// command line "console=ttyS0 quiet panic=-1 kvfs.tag=<device.tag> kvfs.agent=serial" (or
// kvfs.agent=vsock:1024), then RootCmdline for a root image, then vm.kernel_params, and gives
// it the agent channel of agent.transport: a virtio-serial port named io.kvfs.agent.0 whose
// host side is agent.sock (VM.Agent, AgentSerial), or a vhost-vsock-pci device with the
// guest CID GuestCID(id) (AgentVsock; needs /dev/vhost-vsock). agent.boot_timeout bounds
// the owner's wait for the agent's first answer. The agent is as untrusted as the rest of the guest.
// Start gives a VM with an agent channel a fresh secret (AgentSecret: 32 random bytes, kept in
// memory) as an SMBIOS OEM string QEMU reads from a sealed memfd it inherits (VM.AgentSecret,
// -smbios type=11,path=/proc/self/fd/N), never on a command line or in a file: the agent
// serves only a host that sends it first (api/agent/v1's Hello), which the owner's dialer does.
//
// # Network
//
// VM.NICs are virtio-net NICs, each on a tap whose descriptor QEMU inherits (descriptor 3+i
// for NIC i; QEMURunner passes VM.Files as the command's extra files): -netdev
// tap,fd=N,vhost=off and -device virtio-net-pci with the NIC's MAC (on pcie.0 on q35, like
// the virtio-fs device, without an option ROM). Package sandbox/network makes the tap in the
// pod's network namespace; the shim puts it on the VM. VM.NetNS, the path of that namespace,
// is where QEMURunner starts QEMU (network.Do: a locked thread joins it, forks QEMU, and goes
// back), so QEMU is born in the pod's namespace beside its tap; the owner's threads stay in
// their own.
//
// Cleanup(baseDir, id) tears down one sandbox a dead owner left behind, as Recover would,
// without adopting it: the shim's delete action after its long-lived process died.
package sandbox
