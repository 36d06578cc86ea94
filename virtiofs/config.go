package virtiofs

import (
	"errors"
	"fmt"
	"time"
)

// CacheMode says how long the guest may trust what it cached about the shared directory.
type CacheMode int

const (
	// CacheAuto: attributes and entries valid for 1 s; file data cached until the file changes on
	// the host (the guest re-checks size and mtime at open). The default.
	CacheAuto CacheMode = iota
	// CacheNever: nothing cached; every access goes to the host (FOPEN_DIRECT_IO).
	CacheNever
	// CacheMetadata: attributes and entries cached for a day, file data never.
	CacheMetadata
	// CacheAlways: attributes, entries and data cached for a day (KEEP_CACHE, CACHE_DIR).
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
}

// Validate reports the first thing wrong with c.
func (c *Config) Validate() error {
	if c.SharedDir == "" {
		return errors.New("no shared directory given")
	}
	if _, ok := cacheModeNames[c.Cache]; !ok {
		return fmt.Errorf("invalid cache mode %v", c.Cache)
	}
	if c.ThreadPoolSize < 0 {
		return fmt.Errorf("invalid thread pool size %d", c.ThreadPoolSize)
	}
	if c.ThreadPoolSize > maxThreadPoolSize {
		return fmt.Errorf("thread pool size %d is larger than %d", c.ThreadPoolSize, maxThreadPoolSize)
	}
	return nil
}
