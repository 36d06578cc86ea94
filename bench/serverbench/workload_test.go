package serverbench

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs"
)

// TestWorkloads runs every workload (the xattr one aside) for a fixed number of operations
// through the front-end against kvfs's server in this process, and on the host (the limit
// target): each must count exactly the operations it was asked for (the queue-depth-16 I/O rows
// may finish the requests in flight), time each one, and leave the server's inode and handle
// tables and the create directory as it found them: every LOOKUP forgotten, every handle
// released, every file created unlinked.
func TestWorkloads(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("kvfs's passthrough needs root (file ownership, per-request credentials)")
	}
	const nFiles, createDir = 300, "create"
	dir := t.TempDir()
	sh, err := makeShare(dir, nFiles, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, createDir), 0o755); err != nil {
		t.Fatal(err)
	}
	srv, err := virtiofs.NewServer(virtiofs.Config{SharedDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background(), l) }()
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, err := dialServer(ctx, nil, sock, sh, createDir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.fe.Close()
	h, err := openHost(sh, createDir)
	if err != nil {
		t.Fatal(err)
	}
	defer h.close()
	self := func() (usage, error) { return processUsage(os.Getpid()) }
	base := srv.Stats().FS

	for i, w := range workloads(nFiles) {
		if w.Xattr {
			continue
		}
		for _, tg := range []struct {
			name string
			d    driver
		}{{"kvfs", s}, {"host", h}} {
			t.Run(w.Name+"/"+tg.name, func(t *testing.T) {
				const ops = 40
				m := newMeter(time.Minute, self, nil)
				m.maxOps = ops
				if err := w.run(ctx, tg.d, m, uint64(i)); err != nil {
					t.Fatal(err)
				}
				if !m.stopped || m.err != nil {
					t.Fatalf("meter stopped %v, usage error %v", m.stopped, m.err)
				}
				if m.fe1 <= m.fe0 {
					t.Errorf("this process's CPU went from %v to %v over %d operations", m.fe0, m.fe1, m.ops)
				}
				side := strings.HasSuffix(w.Name, "+ FORGETs") // a second stream's operations count too
				switch {
				case len(m.lat) != m.ops:
					t.Errorf("%d operations, %d latencies", m.ops, len(m.lat))
				case side && m.ops < ops:
					t.Errorf("%d operations, want at least %d", m.ops, ops)
				case !side && w.Depth > 1 && w.Bytes != 0 && (m.ops < ops || m.ops >= ops+w.Depth):
					t.Errorf("%d operations, want %d and at most the %d in flight", m.ops, ops, w.Depth-1)
				case !side && w.Depth <= 1 && m.ops != ops, w.Depth > 1 && w.Bytes == 0 && m.ops != ops:
					t.Errorf("%d operations, want %d", m.ops, ops)
				}
				if tg.d == driver(s) {
					if got := srv.Stats().FS; got.CachedInodes != base.CachedInodes || got.OpenFiles != base.OpenFiles {
						t.Errorf("server tables after the workload: %d inodes, %d handles; before: %d, %d",
							got.CachedInodes, got.OpenFiles, base.CachedInodes, base.OpenFiles)
					}
				}
				if ents, err := os.ReadDir(filepath.Join(dir, createDir)); err != nil || len(ents) != 0 {
					t.Errorf("create directory: %d entries left (%v)", len(ents), err)
				}
			})
		}
	}
	s.fe.Close()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve after the front-end closed: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("Serve did not return after the front-end closed")
	}
}
