// Package confine is kvfsd's self-confinement: the sandbox it enters before serving
// (--sandbox=namespace|chroot|none) and the seccomp filter it installs on itself
// (--seccomp=kill|log|trap|none), and the capabilities a confined server keeps
// ([ServerCapabilities], [StartWithCapabilities]). The library (package virtiofs) never uses it,
// since confinement is for the whole process: the kvfsd command confines itself, and package
// sandbox/serverproc confines the process a sandbox's default server runs in (the same
// namespaces, [PrepareMounts] and [StartServing] in its PID 1, [EnterRoot] in its server, the
// same allowlist, and only ServerCapabilities on every thread).
//
// # Threat model
//
// The guest is hostile and kvfsd parses everything it sends. Should a bug in kvfsd let the guest
// run code in it anyway, confinement limits what that code reaches: in namespace mode the
// process sees no file outside the shared directory (its mount namespace holds the shared
// directory as its root and nothing else), no network (an empty network namespace), no other
// process (a new PID namespace) and no System V IPC of the host; the seccomp filter then keeps it
// to the system calls serving needs. Neither replaces the path checks of package passthrough:
// they are a second wall.
//
// # Sandbox modes
//
// namespace (what the C and Rust virtiofsd do by default): kvfsd runs itself again as a child in
// new mount, PID, network and IPC namespaces ([Supervise]); Go cannot unshare a mount namespace
// for a process that already runs several threads, so the namespaces come from clone(2). That
// child, PID 1 of the namespaces ([Setup]), makes its mount tree a recursive slave of the host's
// (mounts the host adds below the shared directory later, as Kata does for each container, still
// reach it) and mounts a fresh proc ([PrepareMounts]); it then starts kvfsd a third time as the
// server, with only the capabilities serving needs ([ServerCapabilities], changed by --modcaps),
// dropped from the thread that starts it ([StartWithCapabilities]) so that every thread of the
// server has only those in any build of the binary. The server moves its working directory into
// that proc's /proc/self/fd; PID 1 then bind-mounts the shared directory onto itself,
// pivot_roots into it and detaches the old root ([PivotRoot]), which takes the server's root
// along, and the server checks its root before it serves ([StartServing] and [EnterRoot] are
// the two halves of that handshake). The server serves "/" and reaches /proc/self/fd as "."
// (virtiofs.Config.ProcSelfFd): the detached proc mount stays alive, and reachable, only
// through the working directory. PID 1 keeps its capabilities, but runs none of the server's
// code and reads nothing the guest controls; it forwards SIGTERM, SIGINT and SIGHUP to the
// server and exits as it does, and its death ends the namespace, the server with it. The
// process started stays behind as a small supervisor: it owns the vhost-user socket (it created
// it, and removes it and the pidfile at the end), forwards those signals to PID 1, and exits
// with the server's status; PID 1 gets SIGKILL if the supervisor dies (Pdeathsig), and is then
// reparented, as any orphan, to the nearest child subreaper or to init, which must reap it (as
// with virtiofsd, which forks into its sandbox the same way). Neither PID 1 nor the supervisor
// carries the seccomp filter. kvfsd never forks once serving, so PID 1 has no orphans to reap.
// The mode needs CAP_SYS_ADMIN (root). With a UserNamespace (kvfsd's --uid-map and --gid-map)
// the namespaces are those of a new user namespace of its mappings, which the supervisor
// writes (so it needs CAP_SETUID and CAP_SETGID), and PID 1 and the server run as its root:
// their capabilities then reach only the files of the ids it maps.
//
// Without CAP_SYS_ADMIN the server cannot read trusted.* attributes: the guest sees none even
// with --xattr, and the DAX policy's trusted.kvfs.dax is not read (rules and FS_XFLAG_DAX still
// decide). --modcaps=+sys_admin gives it back, at the price of the capability that most of
// what a namespace keeps out needs.
//
// chroot (for where namespaces are not available, as in an unprivileged container): the process
// chroots into the shared directory ([Chroot]) after moving its working directory into
// /proc/self/fd. This is weaker, as it is in virtiofsd: the working directory and the
// /proc/self/fd descriptor stay outside the root, so code that runs in kvfsd can walk out
// through them with "..". The absolute paths it resolves, and ".." from inside the root, stay in
// the shared directory. kvfsd cannot remove a socket it created with --socket-path, or its
// pidfile, once chrooted; the next kvfsd on that path replaces them. It keeps every capability
// kvfsd was started with (a Go program cannot drop them on all its threads in a cgo build), so
// --modcaps is refused with it.
//
// none: no sandbox; kvfsd relies on whoever starts it.
//
// # Seccomp
//
// [InstallSeccomp] installs an allowlist filter on every thread of the process (TSYNC; threads
// created later inherit it) with no_new_privs set. It must be installed last, after the
// sandbox, the listening socket and the shared directory are set up: the list holds what serving
// needs (the Go runtime, the vhost-user layer, the FUSE passthrough with its thread pool, locks,
// extended attributes and credentials switches, logging), not what setting up needs (mount,
// pivot_root, chroot, bind, listen, ...). A system call outside the list, from a 32-bit or x32
// ABI, or from another architecture, gets the chosen action: kill (the process dies of
// SIGSYS; the supervisor reports it), log (it is allowed and logged by the kernel as an audit
// record of type 1326: read it with dmesg), or trap (SIGSYS is delivered; the Go runtime dies
// printing the goroutine trace of the call). The list is [Syscalls], one table with a comment
// per group (go test -v -run TestAllowlist ./virtiofs/confine/ prints it); it exists for
// linux/amd64 only: elsewhere kvfsd's default is --seccomp=none ([DefaultAction]) and it fails
// to start when asked for a filter. The cmd/kvfsd tests
// prove it: the whole conformance suite, locks, extended attributes and ACLs run against a
// kvfsd with --seccomp=kill, with and without a thread pool, and so does a real guest
// (internal/testing/vmtest).
package confine
