package cmdline

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestNofileLimit(t *testing.T) {
	const inf = math.MaxUint64
	explicit := func(n uint64) *Options { return &Options{RlimitNofile: n, RlimitNofileSet: true} }
	tests := []struct {
		name       string
		o          *Options
		cur        unix.Rlimit
		nrOpen     uint64
		want       unix.Rlimit
		wantChange bool
	}{
		{"default raises both", &Options{}, unix.Rlimit{Cur: 1024, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 1_000_000, Max: 1_000_000}, true},
		{"default keeps a higher hard limit", &Options{}, unix.Rlimit{Cur: 1024, Max: 2_000_000}, 1 << 20, unix.Rlimit{Cur: 1_000_000, Max: 2_000_000}, true},
		{"default keeps an infinite hard limit", &Options{}, unix.Rlimit{Cur: 1024, Max: inf}, 1 << 20, unix.Rlimit{Cur: 1_000_000, Max: inf}, true},
		{"default capped by nr_open", &Options{}, unix.Rlimit{Cur: 1024, Max: 4096}, 65536, unix.Rlimit{Cur: 65536, Max: 65536}, true},
		{"default never lowers", &Options{}, unix.Rlimit{Cur: 2_000_000, Max: 2_000_000}, 1 << 22, unix.Rlimit{Cur: 2_000_000, Max: 2_000_000}, false},
		{"default already there", &Options{}, unix.Rlimit{Cur: 1_000_000, Max: 1_000_000}, 1 << 20, unix.Rlimit{Cur: 1_000_000, Max: 1_000_000}, false},
		{"0 leaves it alone", explicit(0), unix.Rlimit{Cur: 1024, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 1024, Max: 4096}, false},
		{"explicit raise", explicit(4096), unix.Rlimit{Cur: 1024, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 4096, Max: 4096}, true},
		{"explicit lower", explicit(100), unix.Rlimit{Cur: 1024, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 100, Max: 100}, true},
		{"explicit unchanged", explicit(4096), unix.Rlimit{Cur: 4096, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 4096, Max: 4096}, false},
		{"explicit ignores nr_open", explicit(1 << 30), unix.Rlimit{Cur: 1024, Max: 4096}, 1 << 20, unix.Rlimit{Cur: 1 << 30, Max: 1 << 30}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, change := nofileLimit(tt.o, tt.cur, tt.nrOpen)
			if got != tt.want || change != tt.wantChange {
				t.Errorf("nofileLimit(%+v, %d) = %+v, %v; want %+v, %v", tt.cur, tt.nrOpen, got, change, tt.want, tt.wantChange)
			}
		})
	}
}

// TestSetNofileLimitDefault raises the limit in the test process; by default it never lowers.
func TestSetNofileLimitDefault(t *testing.T) {
	ch, err := SetNofileLimit(&Options{})
	if err != nil {
		t.Fatal(err)
	}
	var now unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &now); err != nil {
		t.Fatal(err)
	}
	if now != ch.After {
		t.Errorf("RLIMIT_NOFILE is %+v, SetNofileLimit says %+v", now, ch.After)
	}
	if ch.After.Cur < ch.Before.Cur || ch.After.Max < ch.Before.Max {
		t.Errorf("default lowered the limit from %+v to %+v", ch.Before, ch.After)
	}
	nrOpen, err := readNrOpen()
	if err != nil {
		t.Fatal(err)
	}
	// kvfsd aims for the default, or keeps a soft limit that is already higher.
	if want := max(min(uint64(defaultNofile), nrOpen), ch.Before.Cur); ch.Wanted != want {
		t.Errorf("wanted %d, want %d", ch.Wanted, want)
	}
	if ch.After.Cur < ch.Wanted && ch.After.Cur != ch.Before.Max {
		t.Errorf("fell short of %d without reaching the hard limit %d: %+v", ch.Wanted, ch.Before.Max, ch.After)
	}
	t.Logf("RLIMIT_NOFILE %+v -> %+v (wanted %d)", ch.Before, ch.After, ch.Wanted)
}

// TestSetNofileLimitExplicit sets limits in children: lowering the hard limit is for good.
func TestSetNofileLimitExplicit(t *testing.T) {
	var cur unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &cur); err != nil {
		t.Fatal(err)
	}
	nrOpen, err := readNrOpen()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		arg  string
		want string
	}{
		{"--rlimit-nofile=1024", "after 1024 1024 now 1024 1024"},
		{"--rlimit-nofile=0", fmt.Sprintf("after %d %d now %d %d", cur.Cur, cur.Max, cur.Cur, cur.Max)},
		{"--rlimit-nofile=" + strconv.FormatUint(nrOpen+1, 10), fmt.Sprintf("error: cannot set RLIMIT_NOFILE to %d: above fs.nr_open (%d), the kernel's ceiling", nrOpen+1, nrOpen)},
	}
	for _, tt := range tests {
		t.Run(tt.arg, func(t *testing.T) {
			c := startChild(t, "rlimit", nil, "--shared-dir=/", "--fd=3", tt.arg)
			if line := c.line(t); line != tt.want {
				t.Errorf("child said %q, want %q", line, tt.want)
			}
			code := c.wait(t)
			if wantCode := map[bool]int{true: 1, false: 0}[strings.HasPrefix(tt.want, "error")]; code != wantCode {
				t.Errorf("child exited with %d, want %d", code, wantCode)
			}
		})
	}
}

// TestSetNofileLimitNoCapability: above the hard limit (1024 in the child), a process without
// CAP_SYS_RESOURCE is told why it cannot have the limit it asked for; by default it gets the
// hard limit.
func TestSetNofileLimitNoCapability(t *testing.T) {
	c := startChild(t, "rlimit-nocap", nil, "--shared-dir=/", "--fd=3", "--rlimit-nofile=2048")
	want := "error: cannot set RLIMIT_NOFILE to 2048: the hard limit is 1024, and raising it needs CAP_SYS_RESOURCE: operation not permitted"
	if line := c.line(t); line != want {
		t.Errorf("child said %q, want %q", line, want)
	}
	if code := c.wait(t); code != 1 {
		t.Errorf("child exited with %d, want 1", code)
	}
	c = startChild(t, "rlimit-nocap", nil, "--shared-dir=/", "--fd=3")
	if line, want := c.line(t), "after 1024 1024 now 1024 1024"; line != want {
		t.Errorf("default without CAP_SYS_RESOURCE: child said %q, want %q", line, want)
	}
	if code := c.wait(t); code != 0 {
		t.Errorf("child exited with %d, want 0", code)
	}
}
