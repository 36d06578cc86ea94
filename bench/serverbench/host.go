package serverbench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// hostDriver is the "limit" target: the system calls a passthrough server makes for each
// request, made directly by this process on the shared directory, with no FUSE, no virtqueue
// and no server in between.
type hostDriver struct {
	names     []string
	filesFD   int // files/, O_PATH
	createFD  int // the create directory, O_PATH
	dataFD    int // the data file, read-write
	dataSize  int64
	cursor    int
	heldFD    int      // held/, O_PATH
	heldNames []string // the files in held/
	held      []int    // their O_PATH descriptors, opened with the driver (relookup)
	seq       atomic.Int64
	dirents   []byte
}

func openHost(sh *share, createDir string) (_ *hostDriver, err error) {
	h := &hostDriver{names: sh.names, heldNames: sh.held, dataSize: sh.dataSize, filesFD: -1, heldFD: -1, createFD: -1, dataFD: -1,
		dirents: make([]byte, 32<<10)}
	defer func() {
		if err != nil {
			h.close()
		}
	}()
	if h.filesFD, err = unix.Open(filepath.Join(sh.dir, filesDir), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	if h.heldFD, err = unix.Open(filepath.Join(sh.dir, heldDir), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	for _, name := range h.heldNames {
		fd, err := unix.Openat(h.heldFD, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		h.held = append(h.held, fd)
	}
	if h.createFD, err = unix.Open(filepath.Join(sh.dir, createDir), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	if h.dataFD, err = unix.Open(filepath.Join(sh.dir, dataFile), unix.O_RDWR|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	return h, nil
}

func (h *hostDriver) usage() (usage, error) { return processUsage(os.Getpid()) }

func (h *hostDriver) close() error {
	for _, fd := range append([]int{h.filesFD, h.heldFD, h.createFD, h.dataFD}, h.held...) {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	return nil
}

// lookupGetattr: openat(O_PATH) and fstatat for the LOOKUP, fstatat for the GETATTR, and the
// close a server makes when the node is forgotten.
func (h *hostDriver) lookupGetattr(_ context.Context, m *meter) error {
	defer m.stop()
	var st unix.Stat_t
	for {
		name := h.names[h.cursor]
		h.cursor = (h.cursor + 1) % len(h.names)
		start := time.Now()
		fd, err := unix.Openat(h.filesFD, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("openat %s: %w", name, err)
		}
		err = unix.Fstatat(fd, "", &st, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
		if err == nil {
			err = unix.Fstatat(fd, "", &st, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
		}
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("fstatat %s: %w", name, err)
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// relookup: what a server must do for a LOOKUP of an inode it holds, an fstatat of the name to
// learn which inode it leads to now, and for the GETATTR an fstatat of the descriptor it holds.
func (h *hostDriver) relookup(_ context.Context, m *meter) error {
	defer m.stop()
	var st unix.Stat_t
	for i := 0; ; i++ {
		name := h.heldNames[i%len(h.held)]
		start := time.Now()
		err := unix.Fstatat(h.heldFD, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err == nil {
			err = unix.Fstatat(h.held[i%len(h.held)], "", &st, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
		}
		if err != nil {
			return fmt.Errorf("fstatat %s: %w", name, err)
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// lookupForget: lookupGetattr's calls on a random file.
func (h *hostDriver) lookupForget(_ context.Context, m *meter, seed uint64, depth int) error {
	defer m.stop()
	if depth > 1 {
		rngs := make([]*rand.Rand, depth)
		for w := range rngs {
			rngs[w] = nameRNG(seed + uint64(w)<<32)
		}
		return parallel(m, depth, 0, func(w int) error {
			return h.lookupOne(h.names[rngs[w].IntN(len(h.names))], true)
		})
	}
	rng := nameRNG(seed)
	for {
		start := time.Now()
		if err := h.lookupOne(h.names[rng.IntN(len(h.names))], true); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// lookupOne: openat(O_PATH) and fstatat for the LOOKUP, another fstatat for a GETATTR if
// getattr, close for the FORGET.
func (h *hostDriver) lookupOne(name string, getattr bool) error {
	var st unix.Stat_t
	fd, err := unix.Openat(h.filesFD, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("openat %s: %w", name, err)
	}
	err = unix.Fstatat(fd, "", &st, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
	if err == nil && getattr {
		err = unix.Fstatat(fd, "", &st, unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW)
	}
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("fstatat %s: %w", name, err)
	}
	return nil
}

// ioForgets: io, and lookupOne of random files in a goroutine alongside.
func (h *hostDriver) ioForgets(ctx context.Context, m *meter, p ioParams, seed uint64) error {
	var side []time.Duration
	var over atomic.Bool // the I/O is done (it may end before the deadline: meter.maxOps)
	done := make(chan error, 1)
	go func() {
		rng := nameRNG(^seed)
		for {
			start := time.Now()
			if err := h.lookupOne(h.names[rng.IntN(len(h.names))], false); err != nil {
				done <- err
				return
			}
			now := time.Now()
			side = append(side, now.Sub(start))
			if !now.Before(m.deadline) || over.Load() {
				done <- nil
				return
			}
		}
	}()
	err := h.ioLoop(m, p, seed)
	over.Store(true)
	if serr := <-done; err == nil {
		err = serr
	}
	m.merge(side, 0)
	m.stop()
	return err
}

// createReleaseUnlink: openat(O_CREAT|O_EXCL) and fstat for the CREATE, close for the RELEASE,
// unlinkat for the UNLINK; depth goroutines at once.
func (h *hostDriver) createReleaseUnlink(_ context.Context, m *meter, depth int) error {
	defer m.stop()
	if depth > 1 {
		return parallel(m, depth, 0, func(int) error { return h.createOne() })
	}
	for {
		start := time.Now()
		if err := h.createOne(); err != nil {
			return err
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

func (h *hostDriver) createOne() error {
	var st unix.Stat_t
	name := "c" + strconv.FormatInt(h.seq.Add(1), 10)
	fd, err := unix.Openat(h.createFD, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return fmt.Errorf("openat %s: %w", name, err)
	}
	err = unix.Fstat(fd, &st)
	unix.Close(fd)
	if err != nil {
		return err
	}
	if err := unix.Unlinkat(h.createFD, name, 0); err != nil {
		return fmt.Errorf("unlinkat %s: %w", name, err)
	}
	return nil
}

// readdirplus: open the directory, getdents64 until the end, fstatat of every entry.
func (h *hostDriver) readdirplus(_ context.Context, m *meter) error {
	defer m.stop()
	var st unix.Stat_t
	names := make([]string, 0, len(h.names)+2)
	for {
		start := time.Now()
		fd, err := unix.Openat(h.filesFD, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		n := 0
		for {
			k, err := unix.Getdents(fd, h.dirents)
			if err != nil {
				unix.Close(fd)
				return fmt.Errorf("getdents: %w", err)
			}
			if k <= 0 {
				break
			}
			_, _, names = unix.ParseDirent(h.dirents[:k], -1, names[:0]) // skips . and ..
			for _, name := range names {
				if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
					unix.Close(fd)
					return fmt.Errorf("fstatat %s: %w", name, err)
				}
				n++
			}
		}
		unix.Close(fd)
		if n != len(h.names) {
			return fmt.Errorf("listed %d entries, want %d", n, len(h.names))
		}
		if !m.done(start, 0) {
			return nil
		}
	}
}

// readdirPages: depth goroutines each listing files/ over and over, one getdents64 per
// operation with a buffer that holds about as many entries as a 4 KiB READDIRPLUS reply
// (fuse_direntplus is 152 bytes and the name, linux_dirent64 19 and the name), and fstatat of
// each entry.
func (h *hostDriver) readdirPages(_ context.Context, m *meter, depth int) error {
	defer m.stop()
	nameLen := len(h.names[0])
	perPage := readdirBuf / ((152 + nameLen + 7) &^ 7)
	bufSize := perPage * ((19 + nameLen + 1 + 7) &^ 7)
	type stream struct {
		fd, n int
		buf   []byte
		names []string
	}
	streams := make([]stream, depth)
	for i := range streams {
		streams[i] = stream{fd: -1, buf: make([]byte, bufSize)}
	}
	defer func() {
		for _, st := range streams {
			if st.fd >= 0 {
				unix.Close(st.fd)
			}
		}
	}()
	return parallel(m, depth, 0, func(w int) error {
		st := &streams[w]
		var stat unix.Stat_t
		for {
			if st.fd < 0 {
				fd, err := unix.Openat(h.filesFD, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
				if err != nil {
					return err
				}
				st.fd, st.n = fd, 0
			}
			k, err := unix.Getdents(st.fd, st.buf)
			if err != nil {
				return fmt.Errorf("getdents: %w", err)
			}
			if k > 0 {
				_, _, st.names = unix.ParseDirent(st.buf[:k], -1, st.names[:0]) // skips . and ..
				for _, name := range st.names {
					if err := unix.Fstatat(st.fd, name, &stat, unix.AT_SYMLINK_NOFOLLOW); err != nil {
						return fmt.Errorf("fstatat %s: %w", name, err)
					}
				}
				st.n += len(st.names)
				if len(st.names) > 0 {
					return nil
				}
				continue
			}
			unix.Close(st.fd)
			st.fd = -1
			if st.n != len(h.names) {
				return fmt.Errorf("listed %d entries, want %d", st.n, len(h.names))
			}
		}
	})
}

// io: pread or pwrite of the same sizes at the same offsets; a queue depth of d is d goroutines
// each making one call at a time.
func (h *hostDriver) io(_ context.Context, m *meter, p ioParams, seed uint64) error {
	defer m.stop()
	return h.ioLoop(m, p, seed)
}

// ioLoop is io without the meter's stop.
func (h *hostDriver) ioLoop(m *meter, p ioParams, seed uint64) error {
	buf := func() []byte {
		b := make([]byte, p.Size)
		for i := range b {
			b[i] = byte(i * 7)
		}
		return b
	}
	call := func(b []byte, off int64) error {
		var n int
		var err error
		if p.Write {
			n, err = unix.Pwrite(h.dataFD, b, off)
		} else {
			n, err = unix.Pread(h.dataFD, b, off)
		}
		if err == nil && n != len(b) {
			err = fmt.Errorf("%d bytes of %d at %d", n, len(b), off)
		}
		return err
	}
	if p.Depth == 1 {
		b, offs := buf(), newOffsets(p, h.dataSize, seed)
		for {
			off := offs.get()
			start := time.Now()
			if err := call(b, off); err != nil {
				return err
			}
			if !m.done(start, int64(p.Size)) {
				return nil
			}
		}
	}
	bufs := make([][]byte, p.Depth)
	offs := make([]*offsets, p.Depth)
	for w := range bufs {
		bufs[w], offs[w] = buf(), newOffsets(p, h.dataSize, seed+uint64(w))
	}
	return parallel(m, p.Depth, int64(p.Size), func(w int) error { return call(bufs[w], offs[w].get()) })
}
