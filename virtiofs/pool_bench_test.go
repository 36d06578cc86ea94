package virtiofs_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// BenchmarkThreadPool shows where --thread-pool-size pays and where it costs: 16 streams of
// requests in flight on one request queue, each stream a 4 KiB WRITE to its own file, alone
// (fast I/O: the host call takes microseconds) or followed by an FSYNC of that file (slow I/O:
// the host waits for the disk), through the in-repo front-end, at pool 0, 4 and 16. At pool 0
// the queue goroutine makes one host call at a time, so 16 fsyncs wait one after the other; a
// pool has several in the host at once, and the file system can commit them together. The
// share is under $TMPDIR (ext4 on the test machines; on tmpfs fsync costs nothing and the pool
// cannot pay). One op is one stream's WRITE (and FSYNC). docs/measurements/performance.md has
// results.
//
//	go test -run '^$' -bench ThreadPool -benchtime 3s ./virtiofs/
func BenchmarkThreadPool(b *testing.B) {
	const depth = 16
	for _, fsync := range []bool{false, true} {
		for _, pool := range []int{0, 4, 16} {
			name := "write"
			if fsync {
				name = "write+fsync"
			}
			b.Run(fmt.Sprintf("%s/pool=%d", name, pool), func(b *testing.B) {
				dir := shareDir(b)
				sock, _, _ := startServer(b, virtiofs.Config{SharedDir: dir, ThreadPoolSize: pool})
				fe, c := dial(b, sock)
				defer fe.Close()
				ctx := context.Background()
				files := make([]*fuseclient.CreateOut, depth)
				for i := range files {
					f, err := c.Create(ctx, fuse.RootID, fmt.Sprintf("f%d", i), unix.O_RDWR, 0o644)
					if err != nil {
						b.Fatal(err)
					}
					files[i] = f
				}
				buf := make([]byte, 4096)
				var next atomic.Int64
				b.SetBytes(int64(len(buf)))
				b.ResetTimer()
				var g errgroup.Group
				for _, f := range files {
					g.Go(func() error {
						node, fh := f.Entry.NodeID, f.Open.Fh
						for next.Add(1) <= int64(b.N) {
							if _, err := c.Write(ctx, node, fh, 0, buf, 0); err != nil {
								return err
							}
							if fsync {
								if err := c.Fsync(ctx, node, fh, false); err != nil {
									return err
								}
							}
						}
						return nil
					})
				}
				if err := g.Wait(); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}
