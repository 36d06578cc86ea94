package virtiofs_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
	"golang.org/x/sys/unix"
)

// TestCacheModeWire checks, through the vhost-user front-end as a Linux guest sees it, what each
// cache mode and the -o timeout=, --writeback and readdirplus settings put on the wire: the INIT
// flags, the entry and attribute timeouts and the FOPEN flags of files and directories.
func TestCacheModeWire(t *testing.T) {
	const (
		fileDirect = fuse.FopenDirectIO
		fileKeep   = fuse.FopenKeepCache
		dirCache   = fuse.FopenCacheDir | fuse.FopenKeepCache
		rdplus     = fuse.InitDoReaddirplus | fuse.InitReaddirplusAuto
	)
	tests := []struct {
		name          string
		cfg           virtiofs.Config
		timeout       time.Duration
		fileFl, dirFl uint32
		init          uint64 // of rdplus|InitWritebackCache, the flags granted
	}{
		{name: "never", cfg: virtiofs.Config{Cache: virtiofs.CacheNever}, timeout: 0, fileFl: fileDirect},
		{name: "metadata", cfg: virtiofs.Config{Cache: virtiofs.CacheMetadata}, timeout: 24 * time.Hour, fileFl: fileDirect, dirFl: dirCache, init: rdplus},
		{name: "auto", cfg: virtiofs.Config{Cache: virtiofs.CacheAuto}, timeout: time.Second, init: rdplus},
		{name: "always", cfg: virtiofs.Config{Cache: virtiofs.CacheAlways}, timeout: 24 * time.Hour, fileFl: fileKeep, dirFl: dirCache, init: rdplus},
		{name: "auto timeout=2.5", cfg: virtiofs.Config{Timeout: new(2500 * time.Millisecond)}, timeout: 2500 * time.Millisecond, init: rdplus},
		{name: "always timeout=0", cfg: virtiofs.Config{Cache: virtiofs.CacheAlways, Timeout: new(time.Duration(0))}, timeout: 0, fileFl: fileKeep, dirFl: dirCache, init: rdplus},
		{name: "never timeout=1", cfg: virtiofs.Config{Cache: virtiofs.CacheNever, Timeout: new(time.Second)}, timeout: time.Second, fileFl: fileDirect},
		{name: "auto writeback", cfg: virtiofs.Config{Writeback: true}, timeout: time.Second, init: rdplus | fuse.InitWritebackCache},
		{name: "auto no_readdirplus", cfg: virtiofs.Config{Readdirplus: new(false)}, timeout: time.Second},
		{name: "never readdirplus", cfg: virtiofs.Config{Cache: virtiofs.CacheNever, Readdirplus: new(true)}, timeout: 0, fileFl: fileDirect, init: rdplus},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dir := shareDir(t)
			if err := os.WriteFile(filepath.Join(dir, "f"), []byte("data"), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Mkdir(filepath.Join(dir, "d"), 0o755); err != nil {
				t.Fatal(err)
			}
			cfg := tt.cfg
			cfg.SharedDir = dir
			sock, _, _ := startServer(t, cfg)
			fe, err := frontend.Dial(ctx, sock, frontend.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer fe.Close()
			c := fuseclient.New(fe)
			out, err := c.Init(ctx, fuseclient.LinuxInitFlags)
			if err != nil {
				t.Fatalf("INIT: %v", err)
			}
			granted := (uint64(out.Flags) | uint64(out.Flags2)<<32) & (rdplus | fuse.InitWritebackCache)
			if granted != tt.init {
				t.Errorf("INIT grants %#x of readdirplus|writeback, want %#x", granted, tt.init)
			}

			sec, nsec := uint64(tt.timeout/time.Second), uint32(tt.timeout%time.Second)
			for _, name := range []string{"f", "d"} {
				e, err := c.Lookup(ctx, 1, name)
				if err != nil {
					t.Fatalf("LOOKUP %s: %v", name, err)
				}
				if e.EntryValid != sec || e.EntryValidNsec != nsec || e.AttrValid != sec || e.AttrValidNsec != nsec {
					t.Errorf("LOOKUP %s: entry %d.%09d s, attr %d.%09d s, want %v for both",
						name, e.EntryValid, e.EntryValidNsec, e.AttrValid, e.AttrValidNsec, tt.timeout)
				}
				a, err := c.Getattr(ctx, e.NodeID, 0)
				if err != nil {
					t.Fatalf("GETATTR %s: %v", name, err)
				}
				if a.AttrValid != sec || a.AttrValidNsec != nsec {
					t.Errorf("GETATTR %s: attr %d.%09d s, want %v", name, a.AttrValid, a.AttrValidNsec, tt.timeout)
				}
				var o *fuse.OpenOut
				want := tt.fileFl
				if name == "f" {
					o, err = c.Open(ctx, e.NodeID, unix.O_RDONLY)
				} else {
					o, err = c.Opendir(ctx, e.NodeID)
					want = tt.dirFl
				}
				if err != nil {
					t.Fatalf("open %s: %v", name, err)
				}
				if o.OpenFlags != want {
					t.Errorf("open %s: FOPEN flags %#x, want %#x", name, o.OpenFlags, want)
				}
			}
		})
	}
}

// TestWritebackOpenFlags checks what a guest with a writeback cache needs from the host: its
// page cache reads from files opened write-only, and writes at offsets it chose itself, so
// O_APPEND must not move them to the end of the file. Without writeback, O_APPEND holds.
func TestWritebackOpenFlags(t *testing.T) {
	for _, wb := range []bool{false, true} {
		name := map[bool]string{false: "no_writeback", true: "writeback"}[wb]
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			dir := shareDir(t)
			p := filepath.Join(dir, "f")
			if err := os.WriteFile(p, []byte("0123456789"), 0o644); err != nil {
				t.Fatal(err)
			}
			sock, _, _ := startServer(t, virtiofs.Config{SharedDir: dir, Writeback: wb})
			fe, c := dial(t, sock)
			defer fe.Close()
			e, err := c.Lookup(ctx, 1, "f")
			if err != nil {
				t.Fatal(err)
			}
			o, err := c.Open(ctx, e.NodeID, unix.O_WRONLY|unix.O_APPEND)
			if err != nil {
				t.Fatal(err)
			}
			got, rerr := c.Read(ctx, e.NodeID, o.Fh, 0, 4)
			if _, err := c.Write(ctx, e.NodeID, o.Fh, 2, []byte("ab"), 0); err != nil {
				t.Fatalf("WRITE: %v", err)
			}
			if err := c.Release(ctx, e.NodeID, o.Fh); err != nil {
				t.Fatal(err)
			}
			host, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			// The same through FUSE_CREATE: two writes at offset 0 of a new O_APPEND file.
			cr, err := c.Create(ctx, 1, "g", unix.O_WRONLY|unix.O_APPEND, 0o644)
			if err != nil {
				t.Fatalf("CREATE: %v", err)
			}
			for _, b := range []string{"xy", "z"} {
				if _, err := c.Write(ctx, cr.Entry.NodeID, cr.Open.Fh, 0, []byte(b), 0); err != nil {
					t.Fatalf("WRITE: %v", err)
				}
			}
			if err := c.Release(ctx, cr.Entry.NodeID, cr.Open.Fh); err != nil {
				t.Fatal(err)
			}
			created, err := os.ReadFile(filepath.Join(dir, "g"))
			if err != nil {
				t.Fatal(err)
			}
			if want := map[bool]string{false: "xyz", true: "zy"}[wb]; string(created) != want {
				t.Errorf("created file %q, want %q", created, want)
			}
			if wb {
				if rerr != nil || string(got) != "0123" {
					t.Errorf("READ on a write-only open: %q, %v; want \"0123\"", got, rerr)
				}
				if string(host) != "01ab456789" {
					t.Errorf("host file %q after a write at offset 2, want \"01ab456789\" (O_APPEND dropped)", host)
				}
			} else {
				if rerr == nil {
					t.Errorf("READ on a write-only open without writeback succeeded (%q)", got)
				}
				if string(host) != "0123456789ab" {
					t.Errorf("host file %q after an O_APPEND write, want \"0123456789ab\"", host)
				}
			}
		})
	}
}

// TestConfigCacheSettings checks the defaults and overrides of the timeout and readdirplus
// settings, and the timeout's bounds.
func TestConfigCacheSettings(t *testing.T) {
	for _, tt := range []struct {
		cfg     virtiofs.Config
		timeout time.Duration
		rdplus  bool
	}{
		{virtiofs.Config{Cache: virtiofs.CacheNever}, 0, false},
		{virtiofs.Config{Cache: virtiofs.CacheMetadata}, 24 * time.Hour, true},
		{virtiofs.Config{Cache: virtiofs.CacheAuto}, time.Second, true},
		{virtiofs.Config{Cache: virtiofs.CacheAlways}, 24 * time.Hour, true},
		{virtiofs.Config{Cache: virtiofs.CacheNever, Readdirplus: new(true), Timeout: new(3 * time.Second)}, 3 * time.Second, true},
		{virtiofs.Config{Cache: virtiofs.CacheAlways, Readdirplus: new(false), Timeout: new(time.Duration(0))}, 0, false},
	} {
		if got := tt.cfg.EntryAttrTimeout(); got != tt.timeout {
			t.Errorf("%+v: EntryAttrTimeout %v, want %v", tt.cfg, got, tt.timeout)
		}
		if got := tt.cfg.ReaddirplusEnabled(); got != tt.rdplus {
			t.Errorf("%+v: ReaddirplusEnabled %v, want %v", tt.cfg, got, tt.rdplus)
		}
	}
	for _, d := range []time.Duration{-time.Nanosecond, 366 * 24 * time.Hour} {
		cfg := virtiofs.Config{SharedDir: "/s", Timeout: &d}
		if err := cfg.Validate(); err == nil {
			t.Errorf("Validate accepts timeout %v", d)
		}
	}
	for _, d := range []time.Duration{0, 365 * 24 * time.Hour} {
		cfg := virtiofs.Config{SharedDir: "/s", Timeout: &d}
		if err := cfg.Validate(); err != nil {
			t.Errorf("Validate refuses timeout %v: %v", d, err)
		}
	}
}
