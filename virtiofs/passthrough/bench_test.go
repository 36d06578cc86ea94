package passthrough

import (
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"golang.org/x/sys/unix"
)

// makeFiles creates n empty files f0 ... f<n-1> in the share.
func makeFiles(tb testing.TB, e *env, n int) []string {
	tb.Helper()
	dirfd, err := unix.Open(e.share, unix.O_PATH|unix.O_DIRECTORY, 0)
	must(tb, err)
	defer unix.Close(dirfd)
	names := make([]string, n)
	for i := range names {
		names[i] = "f" + strconv.Itoa(i)
		must(tb, unix.Mknodat(dirfd, names[i], unix.S_IFREG|0o644, 0))
	}
	return names
}

// raiseFdLimit makes room for n descriptors (each cached inode holds one), or as many as the
// hard limit allows; it returns the soft limit now in force.
func raiseFdLimit(tb testing.TB, n uint64) uint64 {
	tb.Helper()
	var lim syscall.Rlimit
	must(tb, syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim))
	if lim.Cur >= n {
		return lim.Cur
	}
	old := lim
	lim.Cur = n
	if lim.Max < n {
		lim.Max = n
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			lim.Cur, lim.Max = old.Max, old.Max // no CAP_SYS_RESOURCE: up to the hard limit
		}
	}
	must(tb, syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim))
	tb.Cleanup(func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) })
	return lim.Cur
}

// lookupMemory looks n distinct files up in a new FS with opts and checks the Go heap each
// cached inode costs, and that the FS then holds base descriptors plus nodeFds per node.
func lookupMemory(t *testing.T, opts Options, n, base, nodeFds int) {
	e := newEnv(t, opts)
	names := makeFiles(t, e, n)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var out fuse.EntryOut
	for _, name := range names {
		if errno := e.fs.Lookup(rootCtx, 1, name, &out); errno != 0 {
			t.Fatalf("Lookup %s: %v", name, errno)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	if s := e.fs.Stats(); s.CachedInodes != n+1 || s.Fds != base+n*nodeFds {
		t.Fatalf("stats %+v, want %d inodes, %d fds", s, n+1, base+n*nodeFds)
	}
	perInode := float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
	t.Logf("%d lookups of distinct files: %.0f bytes of Go heap per cached inode (inode struct %d bytes)",
		n, perInode, inodeSize)
	if perInode > 200 {
		t.Errorf("%.0f bytes per cached inode, want < 200", perInode)
	}
	e.fs.Destroy()
	if s := e.fs.Stats(); s.CachedInodes != 1 || s.Fds != base {
		t.Errorf("stats after Destroy %+v", s)
	}
}

// TestMemoryPerInode reports the Go heap each cached inode costs (the host descriptor it holds
// is kernel memory, not counted): through LOOKUP of up to 100k distinct files (as many as
// RLIMIT_NOFILE allows), of 100k files with file handles, and in the inode table alone for
// 100k nodes.
func TestMemoryPerInode(t *testing.T) {
	if testing.Short() {
		t.Skip("creates up to 100k files")
	}
	const want = 100_000
	t.Run("lookups", func(t *testing.T) {
		n := int(min(raiseFdLimit(t, want+1000), want+1000)) - 1000
		if n < 10_000 {
			t.Skipf("RLIMIT_NOFILE allows only %d nodes", n)
		}
		lookupMemory(t, Options{}, n, 2, 1)
	})
	// With file handles a node holds no descriptor, so RLIMIT_NOFILE does not bound it; the
	// handle itself (20 bytes on ext4, with its type) is Go heap.
	t.Run("lookups with file handles", func(t *testing.T) {
		lookupMemory(t, Options{FileHandles: FileHandlesMandatory}, want, 3, 0)
	})
	t.Run("table", func(t *testing.T) {
		var fds atomic.Int64
		var tab nodeTable
		tab.init(&inode{key: nodeKey{ino: 1}}, &fds)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		for i := 0; i < want; i++ {
			tab.insert(nodeKey{dev: 2049, ino: uint64(1000 + i), mnt: 27}, -1, nil, unix.S_IFREG)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		perInode := float64(after.HeapAlloc-before.HeapAlloc) / want
		t.Logf("%d nodes in the table: %.0f bytes of Go heap each", want, perInode)
		if perInode > 200 {
			t.Errorf("%.0f bytes per cached inode, want < 200", perInode)
		}
		runtime.KeepAlive(&tab)
	})
}

// BenchmarkLookupGetAttr measures a LOOKUP followed by a GETATTR of a file, with the node
// cached already ("warm": the usual case of a guest revalidating) or created and dropped on
// each lookup ("cold": LOOKUP, GETATTR, FORGET); with descriptors and with file handles.
func BenchmarkLookupGetAttr(b *testing.B) {
	const n = 1000
	raiseFdLimit(b, n+1000)
	for _, fh := range []FileHandleMode{FileHandlesNever, FileHandlesMandatory} {
		e := newEnv(b, Options{AttrTimeout: 1e9, EntryTimeout: 1e9, FileHandles: fh})
		names := makeFiles(b, e, n)
		for _, mode := range []string{"warm", "cold"} {
			b.Run("handles="+fh.String()+"/"+mode, func(b *testing.B) {
				if mode == "warm" {
					for _, name := range names {
						e.lookup(b, 1, name)
					}
				}
				var entry fuse.EntryOut
				var attr fuse.AttrOut
				in := &fuse.GetattrIn{}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if errno := e.fs.Lookup(rootCtx, 1, names[i%n], &entry); errno != 0 {
						b.Fatal(errno)
					}
					if errno := e.fs.GetAttr(rootCtx, entry.NodeID, in, &attr); errno != 0 {
						b.Fatal(errno)
					}
					e.fs.Forget(entry.NodeID, 1)
					i++
				}
				b.StopTimer()
				if mode == "warm" {
					e.fs.Destroy()
				}
				if s := e.fs.Stats(); s.CachedInodes != 1 {
					b.Fatal(fmt.Sprintf("stats %+v", s))
				}
			})
		}
	}
}

// BenchmarkRequest measures whole requests as the device hands them over: the bytes of a
// request in guest buffers through fuse.Server (decoding, dispatch, reply) into this file
// system and back, with the allocations each costs.
func BenchmarkRequest(b *testing.B) {
	e := newEnv(b, Options{AttrTimeout: 1e9, EntryTimeout: 1e9})
	names := makeFiles(b, e, 1000)
	srv := fuse.NewServer(e.fs, fuse.Options{})
	out := make([]byte, 16+1<<20)
	outv := [][]byte{out[:16], out[16:]}
	var h fuse.InHeader
	in := make([][]byte, 0, 4)
	// No request here waits, so none is deferred and the Completer is never called; the
	// harness allocates nothing per request, so allocs/op are the server's own.
	do := func(b *testing.B, op fuse.Opcode, node uint64, args ...[]byte) int {
		n := 40
		for _, a := range args {
			n += len(a)
		}
		h = fuse.InHeader{Len: uint32(n), Opcode: uint32(op), Unique: 1, NodeID: node}
		in = append(append(in[:0], fuse.AsBytes(&h)), args...)
		w, deferred := srv.HandleAsync(in, outv, nil, 0)
		if deferred {
			b.Fatalf("%v deferred", op)
		}
		var oh fuse.OutHeader
		copy(fuse.AsBytes(&oh), out)
		if w < 16 || oh.Error != 0 {
			b.Fatalf("%v: %d bytes, error %d", op, w, oh.Error)
		}
		return w
	}
	initIn := fuse.InitIn{Major: fuse.KernelVersion, Minor: fuse.KernelMinorVersion, Flags: uint32(fuse.InitInitExt)}
	do(b, fuse.OpInit, 0, fuse.AsBytes(&initIn))
	name := []byte("f0\x00")
	do(b, fuse.OpLookup, 1, name)
	var entry fuse.EntryOut
	copy(fuse.AsBytes(&entry), out[16:])
	openIn := fuse.OpenIn{Flags: unix.O_RDWR}
	do(b, fuse.OpOpen, entry.NodeID, fuse.AsBytes(&openIn))
	var open fuse.OpenOut
	copy(fuse.AsBytes(&open), out[16:])
	data := make([]byte, 4096)

	b.Run("LOOKUP+GETATTR", func(b *testing.B) {
		getattr := fuse.GetattrIn{}
		ga := fuse.AsBytes(&getattr)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpLookup, 1, name)
			do(b, fuse.OpGetattr, entry.NodeID, ga)
		}
		b.StopTimer()
		f := fuse.ForgetIn{Nlookup: uint64(b.N)}
		h := fuse.InHeader{Len: 48, Opcode: uint32(fuse.OpForget), Unique: 2, NodeID: entry.NodeID}
		srv.Handle([][]byte{fuse.AsBytes(&h), fuse.AsBytes(&f)}, nil)
	})
	// A new inode every time: LOOKUP of another file, GETATTR, FORGET, as a guest walking a
	// large tree and evicting what it walked does; the inode table grows and shrinks by one.
	cnames := make([][]byte, len(names))
	for i, n := range names {
		cnames[i] = append([]byte(n), 0)
	}
	// FORGET has no reply; its buffers are made once, so that allocs/op stay the server's.
	var fh fuse.InHeader
	f := fuse.ForgetIn{Nlookup: 1}
	forget := [][]byte{fuse.AsBytes(&fh), fuse.AsBytes(&f)}
	doForget := func(node uint64) {
		fh = fuse.InHeader{Len: 48, Opcode: uint32(fuse.OpForget), Unique: 2, NodeID: node}
		srv.HandleAsync(forget, nil, nil, 0)
	}
	b.Run("LOOKUP+GETATTR+FORGET", func(b *testing.B) {
		getattr := fuse.GetattrIn{}
		ga := fuse.AsBytes(&getattr)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			do(b, fuse.OpLookup, 1, cnames[i%len(cnames)])
			i++
			var e fuse.EntryOut
			copy(fuse.AsBytes(&e), out[16:])
			do(b, fuse.OpGetattr, e.NodeID, ga)
			doForget(e.NodeID)
		}
	})
	b.Run("CREATE+RELEASE+UNLINK+FORGET", func(b *testing.B) {
		cin := fuse.CreateIn{Flags: unix.O_RDWR | unix.O_CREAT | unix.O_EXCL, Mode: unix.S_IFREG | 0o644}
		cb := fuse.AsBytes(&cin)
		cname := []byte("new\x00")
		var rel fuse.ReleaseIn
		rb := fuse.AsBytes(&rel)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpCreate, 1, cb, cname)
			var e fuse.EntryOut
			copy(fuse.AsBytes(&e), out[16:])
			var o fuse.OpenOut
			copy(fuse.AsBytes(&o), out[16+len(fuse.AsBytes(&e)):])
			rel = fuse.ReleaseIn{Fh: o.Fh}
			do(b, fuse.OpRelease, e.NodeID, rb)
			do(b, fuse.OpUnlink, 1, cname)
			doForget(e.NodeID)
		}
	})
	big := make([]byte, 1<<20)
	b.Run("WRITE 1 MiB", func(b *testing.B) {
		w := fuse.WriteIn{Fh: open.Fh, Size: uint32(len(big))}
		wb := fuse.AsBytes(&w)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpWrite, entry.NodeID, wb, big)
		}
	})
	b.Run("READ 1 MiB", func(b *testing.B) {
		r := fuse.ReadIn{Fh: open.Fh, Size: uint32(len(big))}
		rb := fuse.AsBytes(&r)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpRead, entry.NodeID, rb)
		}
	})
	b.Run("WRITE 4 KiB", func(b *testing.B) {
		w := fuse.WriteIn{Fh: open.Fh, Size: uint32(len(data))}
		wb := fuse.AsBytes(&w)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpWrite, entry.NodeID, wb, data)
		}
	})
	b.Run("READ 4 KiB", func(b *testing.B) {
		r := fuse.ReadIn{Fh: open.Fh, Size: uint32(len(data))}
		rb := fuse.AsBytes(&r)
		b.ReportAllocs()
		for b.Loop() {
			do(b, fuse.OpRead, entry.NodeID, rb)
		}
	})
}

// BenchmarkNodeTable measures the inode table alone as one READDIRPLUS listing of a
// 10 000-entry directory uses it: a new node per entry, then the BATCH_FORGET of each; per node.
func BenchmarkNodeTable(b *testing.B) {
	const n = 10_000
	var fds atomic.Int64
	var tab nodeTable
	tab.init(&inode{key: nodeKey{ino: 1}}, &fds)
	ids := make([]uint64, n)
	b.ReportAllocs()
	for b.Loop() {
		for i := range ids {
			ids[i], _, _, _ = tab.insert(nodeKey{dev: 38, ino: uint64(5000 + i), mnt: 27}, -1, nil, unix.S_IFREG)
		}
		for _, id := range ids {
			tab.forget(id, 1)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/node")
}
