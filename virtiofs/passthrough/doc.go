// Package passthrough serves a host directory to a guest as a FUSE file system: it implements
// fuse.FileSystem on top of O_PATH file descriptors, the job virtiofsd's passthrough does.
//
// # Threat model
//
// The guest is hostile. Every node id, file handle, name, flag, offset and size it sends is
// checked before use, and nothing it sends may reach outside the shared directory or open a host
// device:
//
//   - Node ids and file handles are our own numbers, looked up in tables; an id we never handed
//     out, or one already forgotten or released, answers EBADF. A handle is also checked against
//     the node id of the request (and against its kind: file or directory).
//   - Every node holds an O_PATH|O_NOFOLLOW descriptor (or a file handle it is reopened from,
//     see "File handles") and every operation is an *at() call relative to one, with
//     AT_SYMLINK_NOFOLLOW or AT_EMPTY_PATH. Host paths are never built from
//     guest names, and symbolic links are never followed on the host: a symlink node is reached
//     but never resolved, so a link to "/etc" or "../.." in the share is inert.
//   - Names "." and ".." are refused by every operation taking a name: LOOKUP answers EINVAL
//     (the Linux guest resolves them itself and only sends them for NFS export, which this
//     server does not offer), the others what the host kernel answers for them as the last
//     component of the same call (EEXIST for MKDIR, EISDIR for UNLINK, EBUSY for RENAME...),
//     without ever passing them to it. So ".." can never climb above the root, or above any
//     node. An empty name answers ENOENT and one longer than 255 bytes ENAMETOOLONG, as on the
//     host.
//   - Re-opening a node for I/O goes through /proc/self/fd/N (a directory descriptor opened once
//     in New and checked to be procfs), which follows the magic link to exactly the inode we hold.
//     O_NOFOLLOW does not apply there, so the node's file type, fixed for an inode's life, is
//     checked first: only regular files are opened by OPEN and CREATE, only directories by
//     OPENDIR. A FIFO, socket or device node in the share is never opened on the host: the guest
//     kernel serves special files itself (init_special_inode) and never sends OPEN for them, so
//     such a request comes from a broken or hostile guest and answers ENXIO ("no such device or
//     address": nothing behind it on this side). OPEN of a symlink answers ELOOP, as
//     open(O_NOFOLLOW) would, and of a directory EISDIR.
//   - CREATE never opens an existing entry by name: it creates with O_CREAT|O_EXCL, and when the
//     guest did not ask for O_EXCL and the name exists, it takes an O_PATH descriptor first and
//     opens that through /proc only if it is a regular file (with the caller's credentials).
//   - Creating operations (CREATE, MKNOD, MKDIR, SYMLINK, TMPFILE) run with the caller's
//     fsuid/fsgid on a locked OS thread, so files get the guest caller's owner and the host kernel
//     checks permissions as that user. The process keeps running as its own user everywhere else:
//     the guest mounts virtio-fs with default_permissions and checks permissions itself.
//   - With id translation (Options.UIDs and GIDs, idmap.go) the caller's ids and a SETATTR's
//     new owner are the host's translation of the guest's before anything is done: a forbidden
//     one answers EPERM with nothing changed, so a guest caller can never be, or give a file
//     to, a host id the rules keep from it. The owners in replies are translated back; the
//     ids inside POSIX ACLs are not, so the two do not go together.
//   - LINK of a directory is refused (EPERM); renames and links only ever name nodes we hold,
//     which are all inside the share; RENAME2 flags other than NOREPLACE, EXCHANGE and WHITEOUT
//     answer EINVAL.
//   - Host errnos are passed through (the guest is Linux too); anything else becomes EIO.
//   - DAX (dax.go): which files are DAX is the host's policy; its attribute DAXXattr
//     (trusted.kvfs.dax) can never be read, listed, set or removed by the guest, whatever
//     Options.Xattr and Options.XattrMap say (a guest name mapped onto it is refused with EPERM,
//     the host's list never shows it). SETUPMAPPING maps only regular files the guest could
//     open anyway, through a handle of the same node opened for reading (and writing, for a
//     write mapping) or through a descriptor opened for the request; its ranges are checked for
//     alignment and overflow, and the front-end bounds them by its window. A mapping gives the
//     guest the access READ and WRITE would, nothing more.
//
// Out of scope: host processes changing the shared tree concurrently (a directory moved out of
// the share by the host while we hold it is followed, as in virtiofsd), and resource exhaustion
// by a guest that looks up very many files (each node holds one host fd: raise RLIMIT_NOFILE,
// or use file handles), beyond the inode table's bound of 2^26 nodes (see "Node ids and
// lifetimes"; some 100-200 bytes of kvfsd memory each).
//
// # File handles
//
// With Options.FileHandles (kvfsd --inode-file-handles=prefer|mandatory) a node other than the
// root keeps the host file handle of its inode (name_to_handle_at with AT_EMPTY_PATH on the
// O_PATH descriptor of the lookup, which is then closed) instead of the descriptor, so a guest
// that looks up a million files does not pin a million host descriptors (their struct file in
// host kernel memory, and the dentries and inodes the host kernel could otherwise evict). Each request that needs the node opens an
// O_PATH descriptor from the handle (open_by_handle_at on the descriptor of the node's mount)
// and closes it when done: one more syscall pair per request, no cache. Open files and
// directories keep their descriptors as always. Identity is unchanged: a node is keyed by
// (st_dev, st_ino, mount id). The handle is one Go allocation of 5 bytes plus the handle (8
// bytes on ext4, 12 on tmpfs): 16 or 24 bytes with its size class.
//
//   - Threat model: open_by_handle_at opens any inode of a file system, wherever it is, which
//     is why it needs CAP_DAC_READ_SEARCH. So handles come only from our own name_to_handle_at
//     on descriptors of nodes reached inside the share, and live only in the inode table:
//     nothing the guest sends is ever used as a handle. A handle names an inode, not a path,
//     so following it never walks through names the host may have changed.
//   - Mounts: open_by_handle_at needs a descriptor of the mount (not an O_PATH one). The mount
//     table opens one per mount id the first time a node on it gets a handle, from the node's
//     parent directory when it is on that mount, else from the node itself when it is a
//     directory or regular file (a bind-mounted special file cannot serve: no handle). Mount
//     descriptors stay open until Close, so those mounts stay busy on the host. The mount id of
//     name_to_handle_at must equal statx's, else the node gets no handle.
//   - Prefer: a node whose file system has no handles (procfs, say, or a FUSE mount), or whose
//     mount cannot get a descriptor, keeps a descriptor. New turns handles off altogether when
//     it cannot open a handle of the root again (no CAP_DAC_READ_SEARCH). Mandatory: such a
//     lookup fails with EOPNOTSUPP ("not supported": the file exists, the server cannot hold
//     it), and New fails when the shared directory's file system has no handles or the
//     handle of the root cannot be opened, with the reason (CAP_DAC_READ_SEARCH for EPERM).
//   - A node with a handle does not keep its inode alive. Some file systems (ext4, xfs) also
//     refuse handles of inodes that are unlinked, even while open. So when the guest removes
//     the last link of a file it holds as a handle (UNLINK, RMDIR, or RENAME onto it), the
//     node first takes an O_PATH descriptor, kept until FORGET: an open, unlinked file keeps
//     working for fstat and the like, as without handles. Requests that come with an open
//     handle (READ, WRITE, GETATTR and SETATTR with a file handle, locks) go through its
//     descriptor anyway.
//   - When the file is gone otherwise (removed by a host process), requests on the node
//     answer ESTALE, as NFS does: the guest kernel then revalidates the dentry with a new
//     LOOKUP (its VFS retries a path walk that failed with ESTALE once with LOOKUP_REVAL),
//     which finds the new file or answers ENOENT. ENOENT on the node itself would be wrong:
//     the node id is still valid until FORGET, and ENOENT from GETATTR would not make the
//     guest look again.
//   - The inode number of a gone file can be reused at once (ext4 does): a lookup that finds
//     a node with the same key but another handle (another generation) makes a new node, and
//     the key moves to it; the stale node answers ESTALE until the guest forgets it. Hard
//     links share one node as before (one inode, one handle); a rename keeps the node.
//
// # Node ids and lifetimes
//
// Node 1 is the root; other ids are allocated by the inode table and never reused while the FS
// lives, so generation numbers are always 0. An id is the index of the node's slot in a shard
// of the table (a slot map with a free list, as in the C virtiofsd), with the shard in its low
// bits and the slot's generation in its high 32: a slot freed by FORGET or DESTROY is reused
// under the next generation, a slot whose generations are all used is retired, and every
// lookup by id checks the generation, so an old id answers EBADF even when its slot holds
// another node. No id is 0 or 1 (generations start at 1). The table holds at most 2^26 nodes
// (2^22 per shard, see maxSlots): a request that would add a node beyond that (LOOKUP, the
// creating operations, a READDIRPLUS entry) answers ENFILE, until FORGETs make room.
//
// A node is keyed by (st_dev, st_ino, mount id), so hard links and repeated lookups share one
// node; while we hold its fd the inode cannot be freed, so its number cannot be reused by
// another file (with file handles, see above). That is what lets a lookup of an entry whose
// inode is a node already answer from a statx of the name alone, opening nothing (lookup.go).
// Each node counts the guest's lookups (LOOKUP,
// CREATE, MKNOD, MKDIR, SYMLINK, LINK, TMPFILE and each READDIRPLUS entry but "." and "..");
// FORGET subtracts (never below zero) and at zero the node leaves the table.
//
// A descriptor is closed only when nothing uses it any more: nodes and handles carry a pin count
// (one pin for being in the table, one per request using the descriptor), and the last unpin
// closes it. So a FORGET or RELEASE racing a request cannot make that request use a descriptor
// number the kernel has already reused for something else.
//
// # Locks
//
// Lock order, outermost first:
//
//  1. dirStream.mu, per directory handle: serialises READDIR on one handle; held across
//     getdents and the READDIRPLUS lookups.
//  2. shard.mu (inode table shards: their slots, free list and key index, and the lookup
//     counts of their nodes), handleShard.mu (handle table shards) and mountTable.mu:
//     leaves. No shard lock is held while another is taken or while a syscall runs;
//     mountTable.mu is held while a mount descriptor is opened (readers take no lock: the
//     table is copied on write).
//  3. nodeLocks.mu, per node with remote POSIX locks: a leaf. Held only around its owner table,
//     and across the non-blocking F_OFD_GETLK probes of GETLK (see below); never while opening
//     a descriptor or waiting.
//
// Everything else is immutable after creation or atomic.
//
// # Remote file locks (posix_lock, flock)
//
// By default the guest is offered no remote locks and keeps POSIX and flock(2) locks in its own
// kernel: processes in the guest see each other's locks, the host and other guests do not. With
// remote locks negotiated (kvfsd -o posix_lock, -o flock) lock requests come here and become
// host locks on the shared file, so a guest process and a host process locking the same file
// exclude each other.
//
// POSIX record locks are owned, in the guest, by a process (its file table: FUSE's lock_owner),
// whatever descriptor it locks through; two guest processes sharing one open file (after fork)
// are distinct owners, and one process locking through two handles of the same file is one.
// Host OFD locks are owned by an open file description instead, so a lock cannot simply be
// taken on the FUSE handle's descriptor: the two processes sharing it would share their locks.
// Each (node, lock_owner) pair therefore gets a descriptor of its own, opened afresh through
// /proc/self/fd on the first lock request of that owner (read-write, or with the handle's mode
// if the file cannot be opened read-write), and all of the owner's locks on the node are OFD
// locks on it (F_OFD_GETLK, F_OFD_SETLK): the owner's own locks merge and split as POSIX
// locks do, and conflict with every other owner's, in the guest or on the host. Classic POSIX
// locks would not do: the host kernel would see every guest owner as this one process.
// The descriptor lives until the owner's FLUSH (the guest sends one on every close(2), and
// closing any descriptor of a file releases all of the process's locks on it), the node's
// last reference (FORGET, DESTROY, a new INIT), or the FS's Close; closing it releases its
// locks. A SETLK or SETLKW that fails or is cancelled before the owner ever held a lock closes
// the descriptor it opened. As with close(2), a process that closes one of several descriptors
// of the file loses all its locks on it. At most maxLockOwners owners per node: more answer
// ENOLCK.
//
// GETLK tests on the owner's descriptor, so the owner's own locks never conflict; an owner
// without a descriptor holds no lock, and tests on the handle's. The host reports an OFD lock's
// pid as -1 and a classic lock's as a host pid, neither of which means anything to the guest:
// when the conflicting lock is another guest owner's, GETLK answers the guest pid that took it
// (found by asking each owner of the node whether the range holds anything but its own locks),
// otherwise pid 0, which the guest shows as a lock with no local process behind it.
//
// flock(2) locks belong to an open file, which in the guest is one FUSE handle: they are taken
// with flock on the handle's descriptor, and go with it (RELEASE with FLOCK_UNLOCK releases
// them at once).
//
// SETLKW never blocks a queue. When the lock is taken, SetLk returns a fuse.Waiter whose
// goroutine retries the non-blocking F_OFD_SETLK (or flock with LOCK_NB) after 1 ms, then at
// doubling intervals up to 50 ms, until it gets the lock, fails otherwise, or is cancelled
// (EINTR). A blocking F_OFD_SETLKW in a goroutine of its own would wake up exactly when the lock
// is released, but nothing could get it out otherwise: Go installs its signal handlers with
// SA_RESTART, so a signal sent to its thread only restarts the call, and a cancelled wait would
// keep a thread, a descriptor and possibly, later, a lock that nobody asked for. Retrying costs a
// release being noticed up to 50 ms late and no FIFO order among waiters (a newcomer can take a
// lock a long-time waiter was about to get); neither POSIX nor flock promises an order. There
// is no deadlock detection (EDEADLK) with OFD locks. A guest process waiting in F_SETLKW cannot
// be interrupted from the guest side: Linux's virtio-fs driver does not send FUSE INTERRUPT
// (the request ends when the lock is granted, or on DESTROY, reset or disconnect).
//
// # Decisions
//
//   - ACCESS is checked by the host with the caller's fsuid/fsgid (the C virtiofsd answers
//     ENOSYS); the guest mounts with default_permissions and rarely asks.
//   - Special files: see above (ENXIO on OPEN, ELOOP for symlinks). MKNOD of device nodes is passed
//     to the host with the caller's credentials (a non-root caller gets EPERM from the host).
//   - Unknown, forgotten or destroyed node ids and handles answer EBADF (never a panic);
//     FORGET of an unknown node is ignored.
//   - SETATTR on a symlink: mode answers EOPNOTSUPP (as Linux does for lchmod); owner and times
//     apply to the link itself (fchownat/utimensat with AT_EMPTY_PATH|AT_SYMLINK_NOFOLLOW; a
//     kernel whose utimensat does not take AT_EMPTY_PATH answers EINVAL); size answers EINVAL.
//     Size is only changed on regular files. FATTR_CTIME and FATTR_LOCKOWNER are ignored.
//   - Set-id bits: the guest's FATTR_KILL_SUIDGID, FUSE_WRITE_KILL_SUIDGID and
//     FUSE_OPEN_KILL_SUIDGID (sent once it negotiated HANDLE_KILLPRIV_V2) are honoured with an
//     explicit chmod, since the host kernel does not clear the bits for us (we hold CAP_FSETID).
//     security.capability needs nothing: the host kernel removes it on every write and
//     truncate, whoever the writer, as on a local file system.
//   - Extended attributes go through the path "/proc/self/fd/N" (Options.ProcSelfFd+"/N": "./N"
//     in a sandboxed kvfsd, whose working directory is its /proc/self/fd) with the following variants
//     (getxattr, not lgetxattr): that follows the magic link to the inode itself, a symlink's own
//     inode included, never the link's target; the l-variants would act on the /proc link.
//     With Options.Xattr off the four xattr operations answer ENOSYS. With it on, a guest root
//     can set trusted.* and security.* attributes (security.capability included) on shared
//     files, as with virtiofsd -o xattr.
//   - O_DIRECT is dropped from open flags (guest buffers need not be aligned for the host); with
//     a writeback cache O_WRONLY becomes O_RDWR and O_APPEND is dropped, since the guest then
//     reads and writes at offsets of its choosing.
//   - New sets the process umask to 0, as virtiofsd does: the guest's umask is applied to every
//     create request, and the host's must not apply again. With Options.PosixACL (the guest
//     then negotiated DONT_MASK and sends its umask unapplied) a create in a directory with a
//     default ACL ignores the umask, as a local create does; the check of the directory's
//     system.posix_acl_default and the create are not atomic.
//   - Options.SecurityLabel: the security context the guest sends with a create is set as an
//     attribute on the new file right after creating it (not atomically: a host process may
//     see the file unlabelled for a moment); if that fails the file is removed and the create
//     fails. TMPFILE carries no context.
//   - DAX: see dax.go for the policy (never, always, inode with the host attribute, rules and
//     FS_XFLAG_DAX), its run-time replacement (an atomic pointer swap) and the treatment of
//     ranges beyond the end of the file (allowed, as Linux maps whole 2 MiB ranges).
//   - Options.XattrMap renames attributes between guest and host (virtiofsd's xattrmap rules).
//     Our own uses of attribute names (system.posix_acl_default above) are host names and
//     are not mapped.
package passthrough
