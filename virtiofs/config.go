package virtiofs

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// CacheMode says how long the guest may trust what it cached about the shared directory, and
// so when a change made on the host reaches the guest. In every mode a file created on the host
// is visible to the guest at once (a failed lookup is answered with ENOENT, never with a
// cacheable negative entry), and a guest that drops its caches sees the host's files as they
// are. internal/testing/vmtest's TestGuestCacheModes checks these promises in a real guest.
type CacheMode int

const (
	// CacheAuto: attributes and entries valid for 1 s; file data cached and dropped at open when
	// the file's size or mtime changed. A host-side change is seen within 1 s (by the first open
	// after the timeout). The default.
	CacheAuto CacheMode = iota
	// CacheNever: nothing cached (timeout 0, FOPEN_DIRECT_IO); every access goes to the host and
	// a host-side change is seen at once.
	CacheNever
	// CacheMetadata: attributes and entries cached for a day, file data never (FOPEN_DIRECT_IO;
	// directory listings are cached, FOPEN_CACHE_DIR). File content changed on the host is read
	// at once, but the size, mtime and other attributes the guest reports may be a day old.
	CacheMetadata
	// CacheAlways: attributes, entries and data cached for a day (FOPEN_KEEP_CACHE,
	// FOPEN_CACHE_DIR). A host-side change to a file the guest has cached, same size or not,
	// may stay unseen until the guest drops its caches or the day is over.
	CacheAlways
)

var cacheModeNames = map[CacheMode]string{
	CacheAuto:     "auto",
	CacheNever:    "never",
	CacheMetadata: "metadata",
	CacheAlways:   "always",
}

func (m CacheMode) String() string {
	if s, ok := cacheModeNames[m]; ok {
		return s
	}
	return fmt.Sprintf("CacheMode(%d)", int(m))
}

// ParseCacheMode accepts the names of both virtiofsd dialects: never (alias none), metadata, auto,
// always.
func ParseCacheMode(s string) (CacheMode, error) {
	switch s {
	case "auto":
		return CacheAuto, nil
	case "never", "none":
		return CacheNever, nil
	case "metadata":
		return CacheMetadata, nil
	case "always":
		return CacheAlways, nil
	}
	return 0, fmt.Errorf("invalid cache mode %q: want never, metadata, auto or always", s)
}

// Timeout is how long the guest may cache entries and attributes in this mode.
func (m CacheMode) Timeout() time.Duration {
	switch m {
	case CacheNever:
		return 0
	case CacheMetadata, CacheAlways:
		return 24 * time.Hour
	default:
		return time.Second
	}
}

// maxThreadPoolSize bounds --thread-pool-size.
const maxThreadPoolSize = 1024

// MaxPollMax bounds Config.PollMax. Sleeping in epoll_wait and being woken costs tens of
// microseconds; a poll longer than 10 ms would only burn the CPU that the sleep saves.
const MaxPollMax = 10 * time.Millisecond

// Config is what a server serves and how. The zero value plus SharedDir is the default
// configuration: cache=auto, no xattrs, guest-local POSIX and flock locks, requests handled
// inline.
type Config struct {
	// SharedDir is the host directory exported to the guest. Required.
	SharedDir string
	// Cache is the cache mode.
	Cache CacheMode
	// Xattr enables the extended attribute operations; without it they answer ENOSYS.
	Xattr bool
	// ReadOnly exports SharedDir read-only (passthrough.Options.ReadOnly): every request
	// that would change it answers EROFS.
	ReadOnly bool
	// AllowMmap offers FUSE_DIRECT_IO_ALLOW_MMAP: a guest that knows it (Linux 6.6+) may
	// mmap files opened with direct I/O (cache=never, metadata), shared mappings included.
	AllowMmap bool
	// PreserveNoatime passes the guest's O_NOATIME on to the host's open
	// (passthrough.Options.PreserveNoatime).
	PreserveNoatime bool
	// KillprivV2, when set, says whether to offer FUSE_HANDLE_KILLPRIV_V2: the guest then
	// leaves clearing set-user-ID, set-group-ID and security.capability on write, truncate
	// and chown to the server, and stops asking for security.capability before every write.
	// Unset (nil) means on whenever extended attributes are (XattrEnabled).
	KillprivV2 *bool
	// TranslateUID and TranslateGID are virtiofsd's --translate-uid and --translate-gid: rules
	// that translate user and group ids between the guest and the host
	// (passthrough.IDTranslation). Not with PosixACL.
	TranslateUID, TranslateGID []passthrough.IDRule
	// PosixACL serves POSIX ACLs, stored as the host's system.posix_acl_* attributes: it
	// implies Xattr and offers POSIX_ACL, DONT_MASK and SETXATTR_EXT, so the guest leaves its
	// umask to the server, which ignores it in directories with a default ACL.
	PosixACL bool
	// XattrMap, when not empty, translates extended attribute names between guest and host
	// with virtiofsd's xattrmap rules (prefix, ok and bad; see passthrough.XattrMap). It
	// implies Xattr.
	XattrMap string
	// SecurityLabel offers SECURITY_CTX: the guest sends the security context (an SELinux
	// label, say) of each file it creates, which is set on the new file as an attribute
	// (mapped by XattrMap) right after the create. It implies Xattr.
	SecurityLabel bool
	// AnnounceSubmounts reports mount points inside SharedDir to the guest as submounts.
	AnnounceSubmounts bool
	// PosixLock offers the guest remote POSIX record locks (fcntl F_SETLK and co.): they become
	// host OFD locks on the shared files and exclude host processes' locks. Without it POSIX
	// locks stay local to the guest kernel.
	PosixLock bool
	// Flock offers the guest remote flock(2) locks, taken on the host too. Without it they stay
	// local to the guest kernel.
	Flock bool
	// ThreadPoolSize is the number of worker goroutines, shared by all queues; 0 handles
	// requests inline on each queue's goroutine.
	ThreadPoolSize int
	// PollMax, when positive, makes each request queue poll its avail ring after a batch, with
	// the guest's kicks suppressed, for a window that adapts to how soon requests come and never
	// exceeds PollMax, before it sleeps (vhostuser.WithAdaptivePolling; QEMU's iothread
	// poll-max-ns). It trades CPU for the wake-up a request costs, which pays only on a host
	// with a CPU to spare for it (docs/measurements/performance.md). 0, the default, never polls.
	// The high-priority queue never polls: nobody waits for the FORGETs it carries.
	PollMax time.Duration
	// Writeback offers the guest a writeback cache (FUSE_WRITEBACK_CACHE): writes collect in the
	// guest's page cache and reach the host later, in pages, and the guest keeps file sizes and
	// times itself while it holds dirty data. Host-side changes to a file the guest is writing
	// may be overwritten. Off by default.
	Writeback bool
	// Readdirplus, when set, says whether the guest may read directories with READDIRPLUS,
	// which returns each entry's attributes and so caches them for the entry timeout. Unset
	// (nil) means on, except with CacheNever.
	Readdirplus *bool
	// Timeout, when set, replaces the mode's entry and attribute timeout (Cache.Timeout):
	// the C virtiofsd's -o timeout=SECONDS. It does not change what file data is cached.
	Timeout *time.Duration
	// DAX is the DAX policy: which files the guest maps through the front-end's DAX window
	// (passthrough's dax.go). The zero value is mode inode without rules: files with the host
	// attribute trusted.kvfs.dax="1" or FS_XFLAG_DAX. DAX is negotiated only with a front-end
	// that has a window and a guest that wants it; with upstream QEMU nothing changes.
	DAX passthrough.DAXPolicy
	// InodeFileHandles says whether cached inodes keep host file handles instead of open
	// O_PATH descriptors (the Rust virtiofsd's --inode-file-handles): with prefer or
	// mandatory, a guest that looks up many files does not hold a host descriptor per file.
	// Handles need CAP_DAC_READ_SEARCH. See passthrough.FileHandleMode.
	InodeFileHandles passthrough.FileHandleMode
	// ProcSelfFd is the path by which the server reaches its /proc/self/fd directory, which it
	// opens once and through which it re-opens nodes and reaches their extended attributes.
	// Empty means "/proc/self/fd". A sandboxed kvfsd, whose root is the shared directory, sets
	// it to "." with its working directory left in /proc/self/fd (see virtiofs/confine).
	ProcSelfFd string
}

// maxTimeout bounds Timeout: the FUSE wire carries seconds as a u64 and nanoseconds as a u32,
// and a longer timeout than a year is indistinguishable from forever to a guest.
const maxTimeout = 365 * 24 * time.Hour

// EntryAttrTimeout is how long the guest may cache entries and attributes: Timeout when set,
// otherwise the cache mode's.
func (c *Config) EntryAttrTimeout() time.Duration {
	if c.Timeout != nil {
		return *c.Timeout
	}
	return c.Cache.Timeout()
}

// XattrEnabled says whether the extended attribute operations are served: Xattr, or
// PosixACL, XattrMap or SecurityLabel, which imply it.
func (c *Config) XattrEnabled() bool {
	return c.Xattr || c.PosixACL || c.XattrMap != "" || c.SecurityLabel
}

// KillprivV2Enabled says whether HANDLE_KILLPRIV_V2 is offered: KillprivV2 when set,
// otherwise XattrEnabled.
func (c *Config) KillprivV2Enabled() bool {
	if c.KillprivV2 != nil {
		return *c.KillprivV2
	}
	return c.XattrEnabled()
}

// ReaddirplusEnabled says whether READDIRPLUS is offered: Readdirplus when set, otherwise on
// except for CacheNever.
func (c *Config) ReaddirplusEnabled() bool {
	if c.Readdirplus != nil {
		return *c.Readdirplus
	}
	return c.Cache != CacheNever
}

// Validate reports the first thing wrong with c.
func (c *Config) Validate() error {
	if c.SharedDir == "" {
		return errors.New("no shared directory given")
	}
	if _, ok := cacheModeNames[c.Cache]; !ok {
		return fmt.Errorf("invalid cache mode %v", c.Cache)
	}
	if c.Timeout != nil && (*c.Timeout < 0 || *c.Timeout > maxTimeout) {
		return fmt.Errorf("invalid timeout %v: want 0 to %v", *c.Timeout, maxTimeout)
	}
	switch c.InodeFileHandles {
	case passthrough.FileHandlesNever, passthrough.FileHandlesPrefer, passthrough.FileHandlesMandatory:
	default:
		return fmt.Errorf("invalid inode file handle mode %v", c.InodeFileHandles)
	}
	if c.ThreadPoolSize < 0 {
		return fmt.Errorf("invalid thread pool size %d", c.ThreadPoolSize)
	}
	if c.ThreadPoolSize > maxThreadPoolSize {
		return fmt.Errorf("thread pool size %d is larger than %d", c.ThreadPoolSize, maxThreadPoolSize)
	}
	if c.PollMax < 0 || c.PollMax > MaxPollMax {
		return fmt.Errorf("invalid poll limit %v: want 0 to %v", c.PollMax, MaxPollMax)
	}
	if c.XattrMap != "" {
		if _, err := passthrough.ParseXattrMap(c.XattrMap); err != nil {
			return err
		}
	}
	if err := c.CheckIDTranslation(); err != nil {
		return err
	}
	return c.DAX.Validate()
}

// CheckIDTranslation accepts TranslateUID and TranslateGID: rules whose ranges do not meet
// in a direction, not with PosixACL.
func (c *Config) CheckIDTranslation() error {
	for _, t := range []struct {
		what  string
		rules []passthrough.IDRule
	}{{"uid", c.TranslateUID}, {"gid", c.TranslateGID}} {
		if len(t.rules) == 0 {
			continue
		}
		if c.PosixACL {
			return fmt.Errorf("%s translation and POSIX ACLs together: the ids inside ACLs would not be translated", t.what)
		}
		if _, err := passthrough.NewIDTranslation(t.rules); err != nil {
			return fmt.Errorf("%s translation: %w", t.what, err)
		}
	}
	return nil
}
