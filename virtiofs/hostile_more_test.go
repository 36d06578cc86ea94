package virtiofs_test

// More hostile guests: a guest that exhausts the host's descriptors, one that races renames
// with lookups to reach outside the share, FORGET storms, lock floods with interrupted waits,
// xattrs at the kernel's size limits, and a front-end that hangs up inside every vhost-user
// message and comes back.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/frontend"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
)

func hostileOpts() frontend.Options {
	return frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize}
}

// TestHostileFdExhaustion: the guest looks up and opens files until kvfsd runs out of
// descriptors (RLIMIT_NOFILE lowered for this process, which is kvfsd's), then keeps asking.
// Every request that needs a descriptor is answered EMFILE or ENFILE, the others are served,
// kvfsd keeps serving, and once the guest releases and forgets what it holds the next requests
// work again.
func TestHostileFdExhaustion(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	const files = 200
	for i := range files {
		hostileMust(t, os.WriteFile(filepath.Join(h.share, "dir", fmt.Sprintf("n%03d", i)), []byte{byte(i)}, 0o644))
	}
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	g.healthy(t)
	dir := g.lookup(t, fuse.RootID, "dir").NodeID
	fdsBefore := hs.srv.Stats().FS.Fds

	var saved unix.Rlimit
	hostileMust(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &saved))
	low := unix.Rlimit{Cur: uint64(countOpenFDs(t) + 48), Max: saved.Max}
	hostileMust(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	restored := false
	restore := func() {
		if !restored {
			restored = true
			hostileMust(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &saved))
		}
	}
	defer restore()

	ctx, cancel := hostileCtx()
	defer cancel()
	exhausted := func(what string, err error) bool {
		t.Helper()
		if err == nil {
			return false
		}
		expectErrno(t, what, err, unix.EMFILE, unix.ENFILE)
		return true
	}
	type open struct{ node, fh uint64 }
	var nodes []uint64
	var opens []open
	failures := 0
	for i := range files {
		name := fmt.Sprintf("n%03d", i)
		e, err := g.c.Lookup(ctx, dir, name)
		if exhausted("LOOKUP "+name, err) {
			failures++
			continue
		}
		nodes = append(nodes, e.NodeID)
		o, err := g.c.Open(ctx, e.NodeID, unix.O_RDONLY)
		if exhausted("OPEN "+name, err) {
			failures++
			continue
		}
		opens = append(opens, open{e.NodeID, o.Fh})
	}
	if failures == 0 {
		t.Fatalf("%d lookups and opens never reached the descriptor limit of %d", 2*files, low.Cur)
	}
	t.Logf("%d nodes, %d open files, %d requests refused at the limit", len(nodes), len(opens), failures)

	// It keeps asking: what needs a descriptor is refused, the rest is served.
	for i := range 50 {
		_, err := g.c.Lookup(ctx, fuse.RootID, "big")
		exhausted(fmt.Sprintf("LOOKUP big at the limit (%d)", i), err)
		if err == nil {
			t.Fatalf("LOOKUP big succeeded at the limit")
		}
		_, err = g.c.Opendir(ctx, fuse.RootID)
		if err == nil {
			t.Fatalf("OPENDIR succeeded at the limit")
		}
		exhausted("OPENDIR at the limit", err)
		if _, err := g.c.Getattr(ctx, fuse.RootID, 0); err != nil {
			t.Errorf("GETATTR of the root at the limit: %v", err)
		}
		if len(opens) > 0 {
			data, err := g.c.Read(ctx, opens[0].node, opens[0].fh, 0, 16)
			if err != nil || len(data) != 1 || data[0] != 0 {
				t.Errorf("READ of an open file at the limit: %q, %v", data, err)
			}
		}
	}
	hs.stillServing(t)

	for _, o := range opens {
		if err := g.c.Release(ctx, o.node, o.fh); err != nil {
			t.Errorf("RELEASE: %v", err)
		}
	}
	for _, n := range nodes {
		if err := g.c.Forget(ctx, n, 1); err != nil {
			t.Errorf("FORGET: %v", err)
		}
	}
	// Still at the lowered limit: what kvfsd gave back is enough for the next requests.
	for i := range 3 {
		e, err := g.c.Lookup(ctx, dir, fmt.Sprintf("n%03d", files-1-i))
		if err != nil {
			t.Fatalf("LOOKUP after the guest let go: %v", err)
		}
		o, err := g.c.Open(ctx, e.NodeID, unix.O_RDONLY)
		if err != nil {
			t.Fatalf("OPEN after the guest let go: %v", err)
		}
		if data, err := g.c.Read(ctx, e.NodeID, o.Fh, 0, 16); err != nil || len(data) != 1 || data[0] != byte(files-1-i) {
			t.Errorf("READ after the guest let go: %q, %v", data, err)
		}
		hostileMust(t, g.c.Release(ctx, e.NodeID, o.Fh))
		hostileMust(t, g.c.Forget(ctx, e.NodeID, 1))
	}
	if fds := hs.srv.Stats().FS.Fds; fds != fdsBefore {
		t.Errorf("kvfsd holds %d descriptors after the guest let go of everything, %d before", fds, fdsBefore)
	}
	restore()
	g.healthy(t)
	hs.stillServing(t)
	h.check(t)
}

// forbiddenInodes are the inode numbers of what lies outside the share (the share's parent,
// the directory next to it, the canary secret, /etc...): none may ever appear in a reply.
func forbiddenInodes(t *testing.T, h *hostileShare) map[uint64]string {
	t.Helper()
	m := map[uint64]string{}
	for p := range h.before {
		var st unix.Stat_t
		hostileMust(t, unix.Lstat(p, &st))
		m[st.Ino] = p
	}
	return m
}

// TestHostileRenameEscape: guests race renames across directories (subtrees moved back and
// forth, a directory exchanged with a symlink pointing out of the share) with walks down the
// moving subtrees, lookups of "..", opens and listings. No reply may name anything outside
// the share, the canary outside is never read (its atime stays), and nothing outside changes.
func TestHostileRenameEscape(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	for _, d := range []string{"p", "q", "p/t", "p/t/u", "p/t/u/v"} {
		hostileMust(t, os.Mkdir(filepath.Join(h.share, d), 0o755))
	}
	hostileMust(t, os.WriteFile(filepath.Join(h.share, "p/t/u/v/w"), []byte("deep"), 0o644))
	hostileMust(t, os.Symlink("../../outside", filepath.Join(h.share, "q", "t")))
	hostileMust(t, os.Symlink("../../../../outside/secret", filepath.Join(h.share, "p/t/u/v/secret")))
	forbidden := forbiddenInodes(t, h)
	secret := filepath.Join(h.outside, "secret")
	var before unix.Stat_t
	hostileMust(t, unix.Lstat(secret, &before))

	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p := g.lookup(t, fuse.RootID, "p").NodeID
	q := g.lookup(t, fuse.RootID, "q").NodeID

	var escapes atomic.Int64
	check := func(what string, e *fuse.EntryOut) {
		if path, bad := forbidden[e.Attr.Ino]; bad {
			escapes.Add(1)
			t.Errorf("ESCAPE: %s resolved to %s (inode %d), outside the share", what, path, e.Attr.Ino)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// Renamers: t moves between p and q, and is exchanged with q's symlink to the outside.
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				switch (n + i) % 3 {
				case 0:
					g.c.Rename(ctx, p, "t", q, "t", unix.RENAME_EXCHANGE)
				case 1:
					g.c.Rename(ctx, q, "t", p, "t", unix.RENAME_EXCHANGE)
				case 2:
					g.c.Rename(ctx, p, "t", p, "t2", 0)
					g.c.Rename(ctx, p, "t2", p, "t", 0)
				}
			}
		}()
	}
	// Walkers: down whichever of p/t and q/t is a directory now, and up with "..".
	var walks, deep atomic.Int64
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 7))
			for {
				select {
				case <-stop:
					return
				default:
				}
				walks.Add(1)
				node := []uint64{p, q}[rnd.IntN(2)]
				var held []uint64
				for _, name := range []string{"t", "u", "v", []string{"w", "secret", ".."}[rnd.IntN(3)]} {
					e, err := g.c.Lookup(ctx, node, name)
					if err != nil {
						break
					}
					held = append(held, e.NodeID)
					check("LOOKUP "+name, e)
					node = e.NodeID
					if name == "w" {
						deep.Add(1)
					}
				}
				// Up, as far as ".." would lead (outside, were it ever resolved).
				for up := node; ; {
					e, err := g.c.Lookup(ctx, up, "..")
					if err != nil || len(held) > 16 {
						break
					}
					held = append(held, e.NodeID)
					check("LOOKUP ..", e)
					up = e.NodeID
				}
				if o, err := g.c.Open(ctx, node, unix.O_RDONLY); err == nil {
					if data, err := g.c.Read(ctx, node, o.Fh, 0, 4096); err == nil && string(data) != "deep" {
						escapes.Add(1)
						t.Errorf("ESCAPE: read %q through a walk down the share", data)
					}
					g.c.Release(ctx, node, o.Fh)
				}
				if o, err := g.c.Opendir(ctx, node); err == nil {
					ents, _ := g.c.Readdir(ctx, node, o.Fh, 0, 4096, true)
					for _, ent := range ents {
						if ent.Entry.NodeID != 0 {
							held = append(held, ent.Entry.NodeID)
						}
						if ent.Name != "." && ent.Name != ".." {
							check("READDIRPLUS entry "+ent.Name, &ent.Entry)
						}
					}
					g.c.Releasedir(ctx, node, o.Fh)
				}
				for _, n := range held {
					g.c.Forget(ctx, n, 1)
				}
			}
		}()
	}
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	t.Logf("%d walks, %d reached the file at the bottom", walks.Load(), deep.Load())
	if deep.Load() == 0 {
		t.Error("no walk reached p/t/u/v/w: the race tested nothing")
	}
	// ".." is never looked up, wherever the guest stands.
	for _, node := range []uint64{fuse.RootID, p, q} {
		e, err := g.c.Lookup(ctx, node, "..")
		if err == nil {
			check("LOOKUP ..", e)
		}
		expectErrno(t, "LOOKUP ..", err, unix.EINVAL)
	}
	var after unix.Stat_t
	hostileMust(t, unix.Lstat(secret, &after))
	if after.Atim != before.Atim {
		t.Errorf("ESCAPE: the canary %s was read (atime %v, was %v)", secret, after.Atim, before.Atim)
	}
	hs.stillServing(t)
	g.healthy(t)
	h.check(t)
}

// TestHostileForgetStorm: guests flood the hiprio queue with FORGETs and BATCH_FORGETs of
// nodes they hold, nodes they already forgot, unknown ids and the root, while others look the
// same files up again. kvfsd stays consistent: no panic, every LOOKUP answers a node that
// works, and once the guest has forgotten everything the inode table is back to its size
// before the storm.
func TestHostileForgetStorm(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	const files = 64
	for i := range files {
		hostileMust(t, os.WriteFile(filepath.Join(h.share, "dir", fmt.Sprintf("s%02d", i)), nil, 0o644))
	}
	hs := startHostileServer(t, virtiofs.Config{SharedDir: h.share})
	g := dialHostile(t, hs.sock, hostileOpts())
	dir := g.lookup(t, fuse.RootID, "dir").NodeID
	base := hs.srv.Stats().FS.CachedInodes
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// held counts the lookups the guest holds per node, as the Linux guest's inode cache does.
	var mu sync.Mutex
	held := map[uint64]uint64{}
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range 2 {
		wg.Add(1)
		go func() { // lookers
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				name := fmt.Sprintf("s%02d", rnd.IntN(files))
				e, err := g.c.Lookup(ctx, dir, name)
				if err != nil {
					t.Errorf("LOOKUP %s during the storm: %v", name, err)
					return
				}
				if _, err := g.c.Getattr(ctx, e.NodeID, 0); err != nil {
					t.Errorf("GETATTR of node %d just looked up: %v", e.NodeID, err)
					return
				}
				mu.Lock()
				held[e.NodeID]++
				mu.Unlock()
			}
		}()
	}
	for i := range 2 {
		wg.Add(1)
		go func() { // forgetters: the guest's own nodes, partly, and garbage
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(uint64(i), 2))
			for {
				select {
				case <-stop:
					return
				default:
				}
				var items []fuse.ForgetOne
				mu.Lock()
				for n, c := range held {
					if rnd.IntN(3) == 0 && c > 0 {
						k := 1 + uint64(rnd.IntN(int(c)))
						held[n] -= k
						items = append(items, fuse.ForgetOne{NodeID: n, Nlookup: k})
					}
				}
				mu.Unlock()
				for range 8 {
					items = append(items, fuse.ForgetOne{NodeID: rnd.Uint64(), Nlookup: rnd.Uint64()},
						fuse.ForgetOne{NodeID: fuse.RootID, Nlookup: math.MaxUint64},
						fuse.ForgetOne{NodeID: uint64(rnd.IntN(1000)), Nlookup: 0})
				}
				rnd.Shuffle(len(items), func(a, b int) { items[a], items[b] = items[b], items[a] })
				if rnd.IntN(2) == 0 {
					if err := g.c.BatchForget(ctx, items); err != nil {
						t.Errorf("BATCH_FORGET: %v", err)
						return
					}
					continue
				}
				for _, it := range items {
					if err := g.c.Forget(ctx, it.NodeID, it.Nlookup); err != nil {
						t.Errorf("FORGET: %v", err)
						return
					}
				}
			}
		}()
	}
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}
	st := hs.srv.Stats()
	t.Logf("after the storm: %d FORGETs, %d BATCH_FORGETs, %d cached inodes", st.FUSE.Ops["FORGET"].Count,
		st.FUSE.Ops["BATCH_FORGET"].Count, st.FS.CachedInodes)
	if st.FUSE.Ops["BATCH_FORGET"].Count == 0 || st.FUSE.Ops["FORGET"].Count == 0 {
		t.Fatalf("no storm: %+v", st.FUSE.Ops)
	}
	// Every node the guest holds still works; then it forgets them, some twice over.
	var rest []fuse.ForgetOne
	for n, c := range held {
		if c == 0 {
			continue
		}
		if _, err := g.c.Getattr(ctx, n, 0); err != nil {
			t.Errorf("GETATTR of node %d the guest holds %d lookups of: %v", n, c, err)
		}
		rest = append(rest, fuse.ForgetOne{NodeID: n, Nlookup: c})
	}
	hostileMust(t, g.c.BatchForget(ctx, rest))
	hostileMust(t, g.c.BatchForget(ctx, rest))
	if got := hs.srv.Stats().FS.CachedInodes; got != base {
		t.Errorf("%d cached inodes once the guest forgot everything, %d before the storm", got, base)
	}
	if st := hs.srv.Stats().FUSE; st.Panics != 0 {
		t.Errorf("%d handler panics", st.Panics)
	}
	// Later lookups work, and give nodes that work.
	for i := range files {
		e := g.lookup(t, dir, fmt.Sprintf("s%02d", i))
		if _, err := g.c.Getattr(ctx, e.NodeID, 0); err != nil {
			t.Errorf("GETATTR after the storm: %v", err)
		}
		hostileMust(t, g.c.Forget(ctx, e.NodeID, 1))
	}
	hs.stillServing(t)
	g.healthy(t)
	h.check(t)
}

// TestHostileLockFlood: lock requests from many owners, and interrupted waits. Without
// posix_lock (the default) every lock request of every owner answers ENOSYS at once and nothing
// waits, whatever the guest interrupts. With it, a hundred owners wait for one writer's lock;
// INTERRUPTs (twice each, of unknown uniques too) end exactly the waits they name with EINTR,
// the others are all granted when the writer unlocks, each wait is answered once, the queue
// serves other requests meanwhile, and once the owners let go the host sees no lock and kvfsd
// holds no descriptor for them.
func TestHostileLockFlood(t *testing.T) {
	hostileNeedsRoot(t)
	const owners = 100
	whole := func(typ uint32, owner uint64) fuse.FileLock { return flk(typ, 0, fuse.OffsetMax, uint32(1000+owner)) }

	t.Run("default", func(t *testing.T) {
		r := newLockRig(t, virtiofs.Config{})
		ctx, cancel := ctxT()
		defer cancel()
		for owner := uint64(1); owner <= owners; owner++ {
			req, unique := r.c.EncodeSetlk(r.node, r.fh, owner, whole(unix.F_WRLCK, owner), 0, true)
			if _, err := r.c.Do(ctx, req, 4096); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("SETLKW of owner %d: %v, want ENOSYS", owner, err)
			}
			hostileMust(t, r.c.Interrupt(ctx, unique))
			hostileMust(t, r.c.Interrupt(ctx, unique+1))
			if err := r.c.Setlk(ctx, r.node, r.fh, owner, whole(unix.F_RDLCK, owner), 0, false); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("SETLK of owner %d: %v, want ENOSYS", owner, err)
			}
			if _, err := r.c.Getlk(ctx, r.node, r.fh, owner, whole(unix.F_WRLCK, owner)); !errors.Is(err, unix.ENOSYS) {
				t.Fatalf("GETLK of owner %d: %v, want ENOSYS", owner, err)
			}
		}
		if st := r.s.Stats(); st.FUSE.Waiting != 0 || st.FUSE.Panics != 0 {
			t.Errorf("waiting %d, panics %d", st.FUSE.Waiting, st.FUSE.Panics)
		}
		if _, err := hostOFD(hostOpen(t, r.host), unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
			t.Errorf("host write lock after the flood: %v", err)
		}
	})

	t.Run("posix_lock", func(t *testing.T) {
		r := newLockRig(t, virtiofs.Config{PosixLock: true})
		ctx, cancel := ctxT()
		defer cancel()
		fds := r.s.Stats().FS.Fds
		if err := r.setlk(t, r.fh, 1, whole(unix.F_WRLCK, 1), 0); err != nil {
			t.Fatal(err)
		}
		uniques := make([]uint64, owners+1)
		answers := make([]chan error, owners+1)
		for owner := 2; owner <= owners; owner++ {
			req, unique := r.c.EncodeSetlk(r.node, r.fh, uint64(owner), whole(unix.F_RDLCK, uint64(owner)), 0, true)
			uniques[owner], answers[owner] = unique, make(chan error, 2)
			go func() {
				wctx, cancel := context.WithTimeout(context.Background(), 3*lockTimeout)
				defer cancel()
				_, err := r.c.Do(wctx, req, 4096)
				answers[owner] <- err
			}()
		}
		r.waitWaiting(t, owners-1)
		interrupted := func(owner int) bool { return owner%2 == 1 }
		for owner := 2; owner <= owners; owner++ {
			if interrupted(owner) {
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner]))
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner]))
			}
		}
		for _, bogus := range []uint64{0, 1 << 60, math.MaxUint64} {
			hostileMust(t, r.c.Interrupt(ctx, bogus))
		}
		for owner := 2; owner <= owners; owner++ {
			if interrupted(owner) {
				if err := answer(t, answers[owner]); !errors.Is(err, unix.EINTR) {
					t.Errorf("interrupted SETLKW of owner %d: %v, want EINTR", owner, err)
				}
			}
		}
		r.waitWaiting(t, owners/2)
		if _, err := r.c.Getattr(ctx, r.node, 0); err != nil {
			t.Errorf("GETATTR while %d SETLKW wait: %v", owners/2, err)
		}
		if err := r.setlk(t, r.fh, 1, whole(unix.F_UNLCK, 1), 0); err != nil {
			t.Fatal(err)
		}
		for owner := 2; owner <= owners; owner++ {
			if !interrupted(owner) {
				if err := answer(t, answers[owner]); err != nil {
					t.Errorf("SETLKW of owner %d after the writer unlocked: %v", owner, err)
				}
				hostileMust(t, r.c.Interrupt(ctx, uniques[owner])) // too late: changes nothing
			}
		}
		r.waitWaiting(t, 0)
		for owner := 2; owner <= owners; owner++ {
			select {
			case err := <-answers[owner]:
				t.Errorf("SETLKW of owner %d answered twice (again: %v)", owner, err)
			default:
			}
		}
		f := hostOpen(t, r.host)
		if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); !errors.Is(err, unix.EAGAIN) {
			t.Errorf("host write lock over the granted read locks: %v, want EAGAIN", err)
		}
		for owner := 1; owner <= owners; owner++ {
			in := fuse.FlushIn{Fh: r.fh, LockOwner: uint64(owner)}
			if _, err := r.c.Do(ctx, r.c.Encode(fuse.OpFlush, r.node, fuse.AsBytes(&in)), 4096); err != nil {
				t.Fatalf("FLUSH of owner %d: %v", owner, err)
			}
		}
		if _, err := hostOFD(f, unix.F_OFD_SETLK, unix.F_WRLCK, 0, 0); err != nil {
			t.Errorf("host write lock once every owner let go: %v", err)
		}
		if st := r.s.Stats(); st.FS.Fds != fds || st.FUSE.Panics != 0 {
			t.Errorf("kvfsd holds %d descriptors (%d before the owners), %d panics", st.FS.Fds, fds, st.FUSE.Panics)
		}
	})
}

// tmpfsShare mounts a tmpfs (which holds xattr values up to XATTR_SIZE_MAX, as ext4 without
// ea_inode does not) for the test and returns its path.
func tmpfsShare(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tmpfs")
	hostileMust(t, os.Mkdir(dir, 0o755))
	if err := unix.Mount("kvfs-test", dir, "tmpfs", 0, "size=64m"); err != nil {
		t.Skipf("mounting a tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// TestHostileXattrLimits: xattrs at the kernel's limits, through the front-end. A value of
// XATTR_SIZE_MAX (64 KiB) is stored and read back whole; one byte more is E2BIG; a buffer one
// byte short is ERANGE; a name list longer than the guest's buffer is ERANGE; and a list beyond
// XATTR_LIST_MAX, which the host cannot list at all, is E2BIG, as Linux answers.
func TestHostileXattrLimits(t *testing.T) {
	hostileNeedsRoot(t)
	share := tmpfsShare(t)
	hostileMust(t, os.WriteFile(filepath.Join(share, "file"), []byte(shareFileContent), 0o644))
	hostileMust(t, os.WriteFile(filepath.Join(share, "many"), nil, 0o644))
	hs := startHostileServer(t, virtiofs.Config{SharedDir: share, Xattr: true})
	g := dialHostile(t, hs.sock, hostileOpts())
	file := g.lookup(t, fuse.RootID, "file").NodeID
	many := g.lookup(t, fuse.RootID, "many").NodeID
	const sizeMax = 1 << 16

	setxattr := func(node uint64, name string, value []byte) error {
		in := fuse.SetxattrIn{Size: uint32(len(value))}
		_, err := g.send(t, 1, g.c.Encode(fuse.OpSetxattr, node, fuse.AsBytes(&in)[:8], fuseName(name), value), 4096)
		return err
	}
	getxattr := func(node uint64, name string, size uint32) ([]byte, error) {
		in := fuse.GetxattrIn{Size: size}
		return g.send(t, 1, g.c.Encode(fuse.OpGetxattr, node, fuse.AsBytes(&in), fuseName(name)), 16+int(max(size, 8)))
	}
	listxattr := func(node uint64, size uint32) ([]byte, error) {
		in := fuse.GetxattrIn{Size: size}
		return g.send(t, 1, g.c.Encode(fuse.OpListxattr, node, fuse.AsBytes(&in)), 16+int(max(size, 8)))
	}
	sizeOf := func(what string, body []byte, err error) uint32 {
		t.Helper()
		if err != nil || len(body) != 8 {
			t.Fatalf("%s: %d bytes, %v; want the 8-byte size", what, len(body), err)
		}
		return uint32(body[0]) | uint32(body[1])<<8 | uint32(body[2])<<16 | uint32(body[3])<<24
	}

	value := make([]byte, sizeMax)
	for i := range value {
		value[i] = byte(i * 31)
	}
	expectOK(t, "SETXATTR of 64 KiB", setxattr(file, "user.max", value))
	if v, err := unix.Getxattr(filepath.Join(share, "file"), "user.max", make([]byte, sizeMax)); err != nil || v != sizeMax {
		t.Errorf("on the host: %d bytes, %v", v, err)
	}
	body, err := getxattr(file, "user.max", 0)
	if n := sizeOf("GETXATTR size of the 64 KiB value", body, err); n != sizeMax {
		t.Errorf("GETXATTR size: %d, want %d", n, sizeMax)
	}
	body, err = getxattr(file, "user.max", sizeMax)
	if err != nil || string(body) != string(value) {
		t.Errorf("GETXATTR of the 64 KiB value: %d bytes, %v", len(body), err)
	}
	_, err = getxattr(file, "user.max", sizeMax-1)
	expectErrno(t, "GETXATTR into a buffer one byte short", err, unix.ERANGE)
	expectErrno(t, "SETXATTR of 64 KiB + 1", setxattr(file, "user.over", make([]byte, sizeMax+1)), unix.E2BIG)

	// A list of names that overflows the guest's buffer, then one beyond XATTR_LIST_MAX.
	names := 0
	listLen := 0
	add := func(upTo int) {
		for listLen < upTo {
			name := fmt.Sprintf("user.%04d-%0240d", names, 0)
			hostileMust(t, unix.Setxattr(filepath.Join(share, "many"), name, nil, 0))
			names++
			listLen += len(name) + 1
		}
	}
	add(sizeMax - 1024)
	body, err = listxattr(many, 0)
	if n := sizeOf("LISTXATTR size", body, err); int(n) != listLen {
		t.Errorf("LISTXATTR size: %d, want %d (%d names)", n, listLen, names)
	}
	_, err = listxattr(many, 100)
	expectErrno(t, "LISTXATTR into 100 bytes", err, unix.ERANGE)
	_, err = listxattr(many, uint32(listLen-1))
	expectErrno(t, "LISTXATTR into a buffer one byte short", err, unix.ERANGE)
	body, err = listxattr(many, uint32(listLen))
	if err != nil || len(body) != listLen {
		t.Errorf("LISTXATTR of %d bytes: %d bytes, %v", listLen, len(body), err)
	}
	add(sizeMax + 1024)
	if _, err := unix.Listxattr(filepath.Join(share, "many"), make([]byte, sizeMax)); !errors.Is(err, unix.E2BIG) {
		t.Fatalf("the host lists %d bytes of names: %v, want E2BIG", listLen, err)
	}
	_, err = listxattr(many, sizeMax)
	expectErrno(t, "LISTXATTR of a list beyond XATTR_LIST_MAX", err, unix.E2BIG)
	// Its size cannot be told either: the host cannot list it, so its guest view is unknown.
	_, err = listxattr(many, 0)
	expectErrno(t, "LISTXATTR size of a list beyond XATTR_LIST_MAX", err, unix.E2BIG)
	hs.stillServing(t)
	if _, err := getxattr(file, "user.max", sizeMax); err != nil {
		t.Errorf("GETXATTR after the big list: %v", err)
	}
}

// midMessagePayload is a well-formed payload of req (8 bytes for those that take none or whose
// layout kvfsd does not read), with the fd it carries, if any.
func midMessagePayload(t *testing.T, req vhostuser.Request) ([]byte, int) {
	t.Helper()
	region := vhostuser.MemoryRegion{Size: 1 << 20, UserAddr: 0x7000_0000_0000}
	var p []byte
	switch req {
	case vhostuser.SetMemTable:
		p = vhostuser.MemoryTable{Regions: []vhostuser.MemoryRegion{region}}.Append(nil)
	case vhostuser.AddMemReg, vhostuser.RemMemReg:
		p = vhostuser.SingleRegion{Region: region}.Append(nil)
	case vhostuser.SetVringAddr:
		p = vhostuser.VringAddr{Index: 1, Desc: 0x1000, Avail: 0x2000, Used: 0x3000}.Append(nil)
	case vhostuser.SetLogBase:
		p = vhostuser.LogBase{MmapSize: 4096}.Append(nil)
	case vhostuser.SetVringKick, vhostuser.SetVringCall, vhostuser.SetVringErr:
		p = vhostuser.VringFile{Index: 1}.Append(nil)
	default:
		p = vhostuser.VringState{Index: 1, Num: 1}.Append(nil) // any 8 bytes
	}
	switch req {
	case vhostuser.SetMemTable, vhostuser.AddMemReg, vhostuser.RemMemReg, vhostuser.SetVringKick,
		vhostuser.SetVringCall, vhostuser.SetVringErr, vhostuser.SetLogBase, vhostuser.SetLogFD,
		vhostuser.SetBackendReqFD, vhostuser.SetInflightFD:
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		hostileMust(t, err)
		return p, fd
	}
	return p, -1
}

// TestHostileDisconnectMidMessage: a running front-end hangs up inside a message, for every
// vhost-user request: after part of the header, and after the header and part of the payload
// (with the message's fd attached). Serve returns, nothing the session held stays open or
// mapped, and the same server accepts the next front-end and serves it.
func TestHostileDisconnectMidMessage(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	s, err := virtiofs.NewServer(virtiofs.Config{SharedDir: h.share})
	hostileMust(t, err)
	t.Cleanup(func() { s.Close() })
	serve := func(t *testing.T) (string, chan error) {
		sock := filepath.Join(t.TempDir(), "vhost-fs.sock")
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		hostileMust(t, err)
		done := make(chan error, 1)
		go func() { done <- s.Serve(context.Background(), l) }()
		return sock, done
	}
	served := func(t *testing.T, done chan error) error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(hostileTimeout):
			t.Fatal("HANG: Serve did not return after the front-end hung up")
			return nil
		}
	}
	// Warm up: the first session creates process-wide fds (the netpoller's) that stay.
	sock, done := serve(t)
	g := dialHostile(t, sock, hostileOpts())
	g.healthy(t)
	g.fe.Close()
	served(t, done)

	var reqs []vhostuser.Request
	for r := vhostuser.Request(1); r < 64; r++ {
		if !strings.HasPrefix(r.String(), "REQUEST_") {
			reqs = append(reqs, r)
		}
	}
	if len(reqs) < 30 {
		t.Fatalf("only %d vhost-user requests known", len(reqs))
	}
	for _, req := range reqs {
		for _, cut := range []string{"header", "payload"} {
			t.Run(req.String()+"/"+cut, func(t *testing.T) {
				fdsBefore, mapsBefore := countOpenFDs(t), countMemfdMappings(t)
				sock, done := serve(t)
				g := dialHostile(t, sock, hostileOpts())
				g.healthy(t)
				payload, fd := midMessagePayload(t, req)
				msg := vhostuser.Header{Request: req, Flags: vhostuser.Version, Size: uint32(len(payload))}.Append(nil)
				msg = append(msg, payload...)
				uc := g.fe.Client().Conn().UnixConn()
				var werr error
				if cut == "header" {
					_, werr = uc.Write(msg[:5])
				} else {
					var oob []byte
					if fd >= 0 {
						oob = unix.UnixRights(fd)
					}
					_, _, werr = uc.WriteMsgUnix(msg[:vhostuser.HeaderSize+len(payload)/2], oob, nil)
				}
				if fd >= 0 {
					unix.Close(fd)
				}
				hostileMust(t, werr)
				g.fe.Close()
				if err := served(t, done); err == nil {
					t.Error("Serve returned nil for a front-end that hung up inside a message")
				}
				var after int
				for range 50 {
					if after = countOpenFDs(t); after == fdsBefore {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				if after != fdsBefore {
					t.Errorf("FD LEAK: %d fds open before the session, %d after", fdsBefore, after)
				}
				if m := countMemfdMappings(t); m != mapsBefore {
					t.Errorf("MAPPING LEAK: %d memfd mappings before, %d after", mapsBefore, m)
				}
				// The same server serves the next front-end.
				sock, done = serve(t)
				g = dialHostile(t, sock, hostileOpts())
				g.healthy(t)
				g.fe.Close()
				if err := served(t, done); err != nil {
					t.Errorf("Serve after the next front-end's clean disconnect: %v", err)
				}
			})
		}
	}
	h.check(t)
}
