package confine

import "golang.org/x/sys/unix"

// auditArch is the AUDIT_ARCH of the system calls the filter allows.
const auditArch = unix.AUDIT_ARCH_X86_64

// DefaultAction is kvfsd's default --seccomp: kill where there is an allowlist.
const DefaultAction = SeccompKill

// allowlist is every system call kvfsd makes once it serves, by group. Setting up (mounts,
// pivot_root, chroot, creating and binding the socket, the pidfile, opening the shared
// directory) happens before the filter and is not here.
var allowlist = table(
	// The Go runtime: memory, threads (clone/clone3 with the libc's thread setup, as cgo builds
	// create threads through pthread_create), scheduling, signals (preemption sends SIGURG with
	// tgkill), timers and the netpoller.
	"go runtime",
	sc("mmap", unix.SYS_MMAP), sc("munmap", unix.SYS_MUNMAP), sc("mprotect", unix.SYS_MPROTECT),
	sc("madvise", unix.SYS_MADVISE), sc("mremap", unix.SYS_MREMAP), sc("brk", unix.SYS_BRK),
	sc("futex", unix.SYS_FUTEX), sc("clone", unix.SYS_CLONE), sc("clone3", unix.SYS_CLONE3),
	sc("set_robust_list", unix.SYS_SET_ROBUST_LIST), sc("rseq", unix.SYS_RSEQ),
	sc("set_tid_address", unix.SYS_SET_TID_ADDRESS), sc("arch_prctl", unix.SYS_ARCH_PRCTL),
	sc("exit", unix.SYS_EXIT), sc("exit_group", unix.SYS_EXIT_GROUP),
	sc("sched_yield", unix.SYS_SCHED_YIELD), sc("sched_getaffinity", unix.SYS_SCHED_GETAFFINITY),
	sc("nanosleep", unix.SYS_NANOSLEEP), sc("clock_nanosleep", unix.SYS_CLOCK_NANOSLEEP),
	sc("clock_gettime", unix.SYS_CLOCK_GETTIME), sc("gettimeofday", unix.SYS_GETTIMEOFDAY),
	sc("rt_sigaction", unix.SYS_RT_SIGACTION), sc("rt_sigprocmask", unix.SYS_RT_SIGPROCMASK),
	sc("rt_sigreturn", unix.SYS_RT_SIGRETURN), sc("sigaltstack", unix.SYS_SIGALTSTACK),
	sc("restart_syscall", unix.SYS_RESTART_SYSCALL),
	sc("getpid", unix.SYS_GETPID), sc("gettid", unix.SYS_GETTID), sc("tgkill", unix.SYS_TGKILL),
	sc("setitimer", unix.SYS_SETITIMER), sc("timer_create", unix.SYS_TIMER_CREATE),
	sc("timer_settime", unix.SYS_TIMER_SETTIME), sc("timer_delete", unix.SYS_TIMER_DELETE),
	sc("getrandom", unix.SYS_GETRANDOM), sc("getrlimit", unix.SYS_GETRLIMIT),
	sc("prlimit64", unix.SYS_PRLIMIT64),
	sc("epoll_create1", unix.SYS_EPOLL_CREATE1), sc("epoll_ctl", unix.SYS_EPOLL_CTL),
	sc("epoll_wait", unix.SYS_EPOLL_WAIT), sc("epoll_pwait", unix.SYS_EPOLL_PWAIT),
	sc("epoll_pwait2", unix.SYS_EPOLL_PWAIT2), sc("eventfd2", unix.SYS_EVENTFD2),
	sc("pipe2", unix.SYS_PIPE2),

	// Descriptors and I/O common to every layer: the vhost-user socket and eventfds, files,
	// the log on stderr.
	"descriptors and i/o",
	sc("read", unix.SYS_READ), sc("write", unix.SYS_WRITE), sc("readv", unix.SYS_READV),
	sc("writev", unix.SYS_WRITEV), sc("close", unix.SYS_CLOSE), sc("dup", unix.SYS_DUP),
	sc("dup3", unix.SYS_DUP3), sc("fcntl", unix.SYS_FCNTL), sc("poll", unix.SYS_POLL),
	sc("ppoll", unix.SYS_PPOLL),

	// vhost-user: accepting the front-end, messages with descriptors (SCM_RIGHTS), mapping the
	// guest memory the front-end sends.
	"vhost-user",
	sc("accept4", unix.SYS_ACCEPT4), sc("recvmsg", unix.SYS_RECVMSG),
	sc("sendmsg", unix.SYS_SENDMSG), sc("recvfrom", unix.SYS_RECVFROM),
	sc("sendto", unix.SYS_SENDTO), sc("shutdown", unix.SYS_SHUTDOWN),
	sc("getsockopt", unix.SYS_GETSOCKOPT), sc("setsockopt", unix.SYS_SETSOCKOPT),
	sc("getsockname", unix.SYS_GETSOCKNAME), sc("getpeername", unix.SYS_GETPEERNAME),

	// Logging to syslog: a reconnect after syslogd restarted creates an AF_UNIX socket again
	// (only AF_UNIX: the filter checks socket's first argument).
	"syslog",
	scArg("socket", unix.SYS_SOCKET, 0, unix.AF_UNIX), sc("connect", unix.SYS_CONNECT),

	// The passthrough file system: lookups and attributes on O_PATH descriptors, re-opening
	// through /proc/self/fd, directory changes, file data, sync.
	"passthrough",
	sc("openat", unix.SYS_OPENAT), sc("openat2", unix.SYS_OPENAT2),
	sc("name_to_handle_at", unix.SYS_NAME_TO_HANDLE_AT),
	sc("open_by_handle_at", unix.SYS_OPEN_BY_HANDLE_AT),
	sc("statx", unix.SYS_STATX), sc("newfstatat", unix.SYS_NEWFSTATAT), sc("fstat", unix.SYS_FSTAT),
	sc("fstatfs", unix.SYS_FSTATFS), sc("statfs", unix.SYS_STATFS),
	sc("readlinkat", unix.SYS_READLINKAT), sc("getdents64", unix.SYS_GETDENTS64),
	sc("lseek", unix.SYS_LSEEK), sc("faccessat", unix.SYS_FACCESSAT),
	sc("faccessat2", unix.SYS_FACCESSAT2),
	sc("mkdirat", unix.SYS_MKDIRAT), sc("mknodat", unix.SYS_MKNODAT),
	sc("symlinkat", unix.SYS_SYMLINKAT), sc("linkat", unix.SYS_LINKAT),
	sc("unlinkat", unix.SYS_UNLINKAT), sc("renameat2", unix.SYS_RENAMEAT2),
	sc("fchmod", unix.SYS_FCHMOD), sc("fchmodat", unix.SYS_FCHMODAT),
	sc("fchmodat2", unix.SYS_FCHMODAT2),
	sc("fchown", unix.SYS_FCHOWN), sc("fchownat", unix.SYS_FCHOWNAT),
	sc("utimensat", unix.SYS_UTIMENSAT), sc("ftruncate", unix.SYS_FTRUNCATE),
	sc("fallocate", unix.SYS_FALLOCATE), sc("copy_file_range", unix.SYS_COPY_FILE_RANGE),
	sc("pread64", unix.SYS_PREAD64), sc("pwrite64", unix.SYS_PWRITE64),
	sc("preadv", unix.SYS_PREADV), sc("pwritev", unix.SYS_PWRITEV),
	sc("preadv2", unix.SYS_PREADV2), sc("pwritev2", unix.SYS_PWRITEV2),
	sc("fsync", unix.SYS_FSYNC), sc("fdatasync", unix.SYS_FDATASYNC), sc("syncfs", unix.SYS_SYNCFS),

	// DAX, mode inode: a file's FS_XFLAG_DAX, read with this one ioctl request (the filter
	// checks ioctl's second argument; any other request is denied).
	"dax",
	scArg("ioctl", unix.SYS_IOCTL, 1, fsIocFsgetxattr),

	// Locks (-o posix_lock: open file description locks; -o flock).
	"locks",
	sc("flock", unix.SYS_FLOCK),

	// Extended attributes and ACLs (--xattr, --posix-acl, --security-label): the path forms
	// through /proc/self/fd/N, and the descriptor forms.
	"xattrs",
	sc("getxattr", unix.SYS_GETXATTR), sc("setxattr", unix.SYS_SETXATTR),
	sc("listxattr", unix.SYS_LISTXATTR), sc("removexattr", unix.SYS_REMOVEXATTR),
	sc("lgetxattr", unix.SYS_LGETXATTR), sc("lsetxattr", unix.SYS_LSETXATTR),
	sc("llistxattr", unix.SYS_LLISTXATTR), sc("lremovexattr", unix.SYS_LREMOVEXATTR),
	sc("fgetxattr", unix.SYS_FGETXATTR), sc("fsetxattr", unix.SYS_FSETXATTR),
	sc("flistxattr", unix.SYS_FLISTXATTR), sc("fremovexattr", unix.SYS_FREMOVEXATTR),

	// Credentials: each request runs as the guest's caller (per-thread fsuid and fsgid; the
	// umask is set at start). geteuid/getegid are read when a file system starts a session.
	"credentials",
	sc("setfsuid", unix.SYS_SETFSUID), sc("setfsgid", unix.SYS_SETFSGID),
	sc("geteuid", unix.SYS_GETEUID), sc("getegid", unix.SYS_GETEGID),
	sc("getuid", unix.SYS_GETUID), sc("getgid", unix.SYS_GETGID), sc("umask", unix.SYS_UMASK),
)
