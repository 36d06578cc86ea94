package fuse_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/fuse"
	"github.com/kvfs/kvfs/virtiofs/testing/fuseclient"
)

// daxFS is a fakeFS that can map, with a map alignment of its choosing.
type daxFS struct {
	fakeFS
	shift   uint16
	ok      bool
	setups  []fuse.SetupmappingIn
	removes [][]fuse.RemovemappingOne
}

func (f *daxFS) DAXMapAlignment() (uint16, bool) { return f.shift, f.ok }

func (f *daxFS) SetupMapping(ctx *fuse.Context, node uint64, in *fuse.SetupmappingIn) fuse.Errno {
	f.setups = append(f.setups, *in)
	return fuse.OK
}

func (f *daxFS) RemoveMapping(ctx *fuse.Context, ranges []fuse.RemovemappingOne) fuse.Errno {
	f.removes = append(f.removes, ranges)
	return fuse.OK
}

// TestDAXNegotiation: DAX flags only when the guest asks for MAP_ALIGNMENT and the file system
// can map with an alignment the guest accepts; the mapping opcodes answer ENOSYS otherwise.
func TestDAXNegotiation(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		what   string
		fs     fuse.FileSystem
		guest  uint64
		grant  uint64
		align  uint16
		mapErr error
	}{
		{"mapping file system", &daxFS{shift: 16, ok: true}, fuseclient.DAXInitFlags, fuseclient.DAXInitFlags, 16, nil},
		{"guest in dax=always", &daxFS{shift: 12, ok: true}, fuse.InitMapAlignment, fuse.InitMapAlignment, 12, nil},
		{"guest without a window", &daxFS{shift: 12, ok: true}, fuse.InitHasInodeDAX, 0, 0, unix.ENOSYS},
		{"no window", &daxFS{shift: 12}, fuseclient.DAXInitFlags, 0, 0, unix.ENOSYS},
		{"alignment beyond 2 MiB", &daxFS{shift: 22, ok: true}, fuseclient.DAXInitFlags, 0, 0, unix.ENOSYS},
		{"no DAX side", &fakeFS{}, fuseclient.DAXInitFlags, 0, 0, unix.ENOSYS},
	} {
		s := fuse.NewServer(tc.fs, fuse.Options{})
		c := fuseclient.New(&splitTransport{s: s, rnd: rand.New(rand.NewPCG(3, 4))})
		out, err := c.Init(ctx, fuseclient.LinuxInitFlags|tc.guest)
		if err != nil {
			t.Fatalf("%s: INIT: %v", tc.what, err)
		}
		got := (uint64(out.Flags) | uint64(out.Flags2)<<32) & fuseclient.DAXInitFlags
		if got != tc.grant || out.MapAlignment != tc.align || s.Flags()&fuseclient.DAXInitFlags != tc.grant {
			t.Errorf("%s: granted %#x, alignment %d; want %#x, %d", tc.what, got, out.MapAlignment, tc.grant, tc.align)
		}
		err = c.SetupMapping(ctx, 2, fuse.SetupmappingNoFh, 1<<21, 1<<21, fuse.SetupmappingFlagRead, 0)
		if err != tc.mapErr {
			t.Errorf("%s: SETUPMAPPING: %v, want %v", tc.what, err, tc.mapErr)
		}
		err = c.RemoveMapping(ctx, 2, []fuse.RemovemappingOne{{Moffset: 0, Len: 1 << 21}, {Moffset: 1 << 22, Len: 1 << 21}})
		if err != tc.mapErr {
			t.Errorf("%s: REMOVEMAPPING: %v, want %v", tc.what, err, tc.mapErr)
		}
		if d, ok := tc.fs.(*daxFS); ok && tc.mapErr == nil {
			if len(d.setups) != 1 || d.setups[0].Foffset != 1<<21 || len(d.removes) != 1 || len(d.removes[0]) != 2 ||
				d.removes[0][1].Moffset != 1<<22 {
				t.Errorf("%s: the file system got %+v, %+v", tc.what, d.setups, d.removes)
			}
		}
	}
	// A 64 KiB alignment refuses 4 KiB-aligned ranges before the file system sees them.
	d := &daxFS{shift: 16, ok: true}
	c := fuseclient.New(&splitTransport{s: fuse.NewServer(d, fuse.Options{}), rnd: rand.New(rand.NewPCG(5, 6))})
	if _, err := c.Init(ctx, fuseclient.LinuxInitFlags|fuseclient.DAXInitFlags); err != nil {
		t.Fatal(err)
	}
	if err := c.SetupMapping(ctx, 2, fuse.SetupmappingNoFh, 0, 4096, fuse.SetupmappingFlagRead, 0); err != unix.EINVAL {
		t.Errorf("SETUPMAPPING of 4 KiB at 64 KiB alignment: %v", err)
	}
	if err := c.RemoveMapping(ctx, 2, []fuse.RemovemappingOne{{Moffset: 4096, Len: 1 << 16}}); err != unix.EINVAL {
		t.Errorf("REMOVEMAPPING at 4 KiB with 64 KiB alignment: %v", err)
	}
	if len(d.setups) != 0 || len(d.removes) != 0 {
		t.Errorf("refused requests reached the file system: %+v %+v", d.setups, d.removes)
	}
}
