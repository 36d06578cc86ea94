package cmdline

// Usage returns the text kvfsd --help prints.
func Usage() string { return usage }

const usage = `Usage: kvfsd [OPTIONS]

kvfsd serves a host directory to a virtual machine as a virtio-fs device, over a
vhost-user socket. It takes the command lines of both the C virtiofsd (QEMU) and
the Rust virtiofsd, in any mix: write --opt=VALUE or --opt VALUE, and give -o a
comma-separated list (a backslash makes the next character literal, as in
-o source=/a\,b). When an option is given more than once the last one wins; this
includes --thread-pool-size, which the Rust virtiofsd refuses to see twice.

Shared directory and socket (one of --socket-path and --fd is required):
  --shared-dir=DIR, -o source=DIR
                        host directory to share (required)
  --socket-path=PATH    create the vhost-user socket at PATH (mode 0600) and
                        lock PATH.pid; a stale socket at PATH is replaced,
                        anything else there is an error. --socket is an alias.
  --socket-group=GROUP  make the socket at --socket-path 0660 and owned by GROUP
  --fd=FD               serve on the inherited listening Unix socket FD
                        (the Kata runtime passes --fd=3)

File system:
  --cache=MODE, -o cache=MODE
                        never (alias none), metadata, auto or always
                        (default auto): how long the guest trusts what it
                        cached about the host's files (docs/kvfsd.md,
                        "Cache modes")
  -o timeout=SECONDS    entry and attribute timeout, fractions allowed; replaces
                        the mode's (never 0, auto 1, metadata and always 86400)
  --writeback, -o writeback
                        writeback cache in the guest: writes gather in its page
                        cache and reach the host later (default off;
                        -o no_writeback)
  -o readdirplus, -o no_readdirplus, --no-readdirplus
                        let the guest read directories with their entries'
                        attributes (default on, except with cache=never)
  --xattr, -o xattr     enable extended attributes (default off; -o no_xattr)
  --readonly            export the shared directory read-only: every request
                        that would change it, and every open for writing,
                        answers EROFS (default off)
  --allow-mmap          let a guest that knows FUSE_DIRECT_IO_ALLOW_MMAP (Linux
                        6.6+) mmap files opened with direct I/O (cache=never,
                        metadata); default off
  --tag=TAG             taken for virtiofsd's command line (1 to 36 bytes); the
                        guest sees the tag the front-end sets (QEMU:
                        -device vhost-user-fs-pci,tag=TAG): kvfsd offers no
                        device configuration space, on which QEMU 7.1 to 8.0
                        crash
  --preserve-noatime    pass the guest's O_NOATIME on to the host's open; by
                        default it is dropped, as an open with it fails unless
                        the opener owns the file
  --uid-map=:INSIDE:OUTSIDE:COUNT:, --gid-map=:INSIDE:OUTSIDE:COUNT:
                        serve from a user namespace with these mappings
                        (repeatable; both, each mapping id 0 inside;
                        --sandbox=namespace; written by kvfsd, which needs
                        CAP_SETUID and CAP_SETGID): the server's privileges
                        reach only the files of ids they map
  --translate-uid=KIND:FROM:TO:COUNT, --translate-gid=KIND:FROM:TO:COUNT
                        translate user (group) ids between guest and host,
                        virtiofsd's rules, repeatable: guest (guest ids to host
                        ids), host (host to guest), squash-guest (guest ids all
                        to the host id TO), squash-host (host ids all to the
                        guest id TO), map (both ways), forbid-guest:FROM:COUNT
                        (EPERM to a guest caller or chown of those ids); ids no
                        rule covers stay as they are; not with --posix-acl
  --killpriv-v2, -o killpriv_v2
                        clear set-id bits and security.capability on the host
                        when a guest user writes, truncates or chowns, so the
                        guest need not read security.capability before each
                        write (FUSE_HANDLE_KILLPRIV_V2; default on with xattr;
                        --no-killpriv-v2, -o no_killpriv_v2)
  --xattrmap=RULES, -o xattrmap=RULES
                        map attribute names between guest and host with
                        virtiofsd's rules (implies xattr): prefix, ok and bad;
                        the map and unsupported rule types are refused
  --security-label, -o security_label
                        set the security context (SELinux label) the guest
                        sends with each create on the new file (implies
                        xattr; default off; -o no_security_label)
  --posix-acl, -o posix_acl
                        POSIX ACLs (implies xattr): the guest leaves its umask
                        to kvfsd, which ignores it in directories with a
                        default ACL (default off; -o no_posix_acl)
  --announce-submounts, -o announce_submounts
                        report mount points inside the shared directory to the
                        guest as submounts (default off)
  --no-announce-submounts
                        do not (the default)
  -o posix_lock         remote POSIX locks (fcntl F_SETLK...): taken on the host
                        as OFD locks, so guest and host processes exclude each
                        other. A waiting F_SETLKW never holds up other requests;
                        the guest cannot interrupt it (Linux's virtio-fs does
                        not send FUSE interrupts). -o no_posix_lock (the
                        default): POSIX locks stay local to the guest kernel
  -o flock              remote flock(2) locks, taken on the host too.
                        -o no_flock (the default): they stay local to the guest
  --inode-file-handles=MODE
                        never (the default): each inode the guest has cached
                        holds an open O_PATH descriptor on the host. prefer:
                        it holds a file handle instead where the file system
                        has them (needs CAP_DAC_READ_SEARCH; else descriptors).
                        mandatory: handles only; a file without one cannot be
                        looked up (EOPNOTSUPP), and kvfsd does not start when
                        the shared directory's file system has none or handles
                        cannot be opened
  --thread-pool-size=N  worker goroutines, shared by all queues; 0 (the
                        default) handles requests on each queue's goroutine
  --poll-max-ns=NS, -o poll_max_ns=NS
                        after serving requests, a request queue keeps looking
                        for the next one, with the guest's notifications
                        off, for up to NS nanoseconds (at most 10000000)
                        before it sleeps: the window grows while requests
                        come within NS and drops to 0 when they do not.
                        Saves a wake-up per request at the price of a
                        spinning CPU; worth it only with CPUs to spare
                        (default 0: no polling)
  --dax=MODE, -o dax=MODE
                        which files a guest whose device has a DAX window
                        (QEMU cache-size=N, Kata's experimental QEMU) maps
                        directly: never, always or inode (default): files
                        whose host attribute trusted.kvfs.dax is "1", else
                        as the first matching --dax-rules rule says, else
                        those with FS_XFLAG_DAX. Without a window (upstream
                        QEMU) nothing DAX is negotiated
  --dax-rules=RULES, -o dax_rules=RULES
                        rules of --dax=inode, separated by ';': "on" or "off"
                        and conditions glob=PATTERN (the file name, or with
                        '/' its path in the shared directory) and size>=N
                        (K, M, G suffixes); e.g. "on glob=*.so; on size>=2M"

Process:
  --sandbox=MODE, -o sandbox=MODE
                        confine kvfsd before it serves: namespace (the
                        default) runs it in new mount, PID, network and IPC
                        namespaces with the shared directory as its root
                        (pivot_root; needs root) and only the capabilities
                        serving needs: chown, dac_override, fowner, fsetid,
                        setuid, setgid, mknod, setfcap (and dac_read_search
                        with inode file handles); chroot chroots into the
                        shared directory (weaker: all capabilities kept);
                        none does not sandbox itself: confine it from
                        outside
  --modcaps=LIST, -o modcaps=LIST
                        change the capabilities the namespace sandbox keeps:
                        +NAME adds, -NAME removes, ':'-separated (e.g.
                        +sys_admin, which trusted.* attributes and
                        trusted.kvfs.dax need)
  --seccomp=ACTION      seccomp allowlist of the system calls kvfsd makes
                        while serving, on all its threads; a call outside it:
                        kill (the default) kills kvfsd, log allows and logs
                        it (dmesg, audit type 1326), trap raises SIGSYS (the
                        Go runtime dies with a trace); none: no filter
  --log-level=LEVEL, -o log_level=LEVEL (or -o loglevel=LEVEL)
                        error (or err), warn, info, debug, trace or off
                        (default info)
  -d, -o debug          same as --log-level=debug
  --syslog              log to syslog, tagged kvfsd, instead of stderr
  --rlimit-nofile=N     set RLIMIT_NOFILE (soft and hard) to N; 0 leaves it
                        unchanged. An N above fs.nr_open, or above the hard
                        limit without CAP_SYS_RESOURCE, is an error. Default:
                        raise the soft limit to min(1000000, fs.nr_open) if
                        lower (without CAP_SYS_RESOURCE, up to the hard limit,
                        with a warning): each inode the guest caches holds a
                        descriptor unless --inode-file-handles says otherwise
  --print-capabilities  print the vhost-user back-end description and exit
  -V, --version         print the version and exit
  -h, --help            print this help and exit

Accepted, and what kvfsd does anyway:
  -f                    run in the foreground (kvfsd always does)

Not supported yet (refused with an error, never ignored):
  -o allow_direct_io, -o no_allow_direct_io,
  --allow-direct-io, -o allow_root,
  -o max_idle_threads=, --daemonize,
  --migration-mode, --migration-on-error, --migration-verify-handles,
  --migration-confirm-paths

kvfsd exits with status 0 when the front-end disconnects, and on SIGTERM,
SIGINT or SIGHUP after closing the connection. With --sandbox=namespace the
process started stays as the sandboxed server's supervisor: it forwards those
signals and exits with the server's status (128+N if signal N killed it).

Environment:
  KVFSD_CPUPROFILE=FILE the serving process (the sandboxed server with
                        --sandbox=namespace) writes a Go CPU profile of its
                        whole run to FILE when it exits (for go tool pprof;
                        the benchmark uses it)
`
