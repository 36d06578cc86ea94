package cmdline

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// defaultNofile is the file descriptor limit kvfsd raises RLIMIT_NOFILE to by default (capped
// by fs.nr_open), as both virtiofsd do: the guest can keep an open file per inode it looks up.
const defaultNofile = 1_000_000

// NofileChange is what SetNofileLimit did to RLIMIT_NOFILE.
type NofileChange struct {
	Before, After unix.Rlimit
	// Wanted is the soft limit kvfsd aimed for. After.Cur is lower when, by default, the hard
	// limit was lower and could not be raised (that needs CAP_SYS_RESOURCE).
	Wanted uint64
}

// nofileLimit returns the RLIMIT_NOFILE o asks for, given the current one and fs.nr_open, and
// whether it differs from the current one.
//
// --rlimit-nofile=N sets both limits to N, and N=0 leaves them unchanged. By default the soft
// limit is raised to min(defaultNofile, nrOpen), and the hard limit with it if needed; a limit
// already that high is left alone.
func nofileLimit(o *Options, cur unix.Rlimit, nrOpen uint64) (unix.Rlimit, bool) {
	if o.RlimitNofileSet {
		if o.RlimitNofile == 0 {
			return cur, false
		}
		want := unix.Rlimit{Cur: o.RlimitNofile, Max: o.RlimitNofile}
		return want, want != cur
	}
	target := min(uint64(defaultNofile), nrOpen)
	if cur.Cur >= target {
		return cur, false
	}
	return unix.Rlimit{Cur: target, Max: max(cur.Max, target)}, true
}

// SetNofileLimit sets RLIMIT_NOFILE as o asks (see Options.RlimitNofile). An explicit limit that
// cannot be set is an error that says why: above fs.nr_open, or above the hard limit without
// CAP_SYS_RESOURCE. The default limit is best effort: if the hard limit cannot be raised, the
// soft limit is raised to the hard one, and the returned NofileChange shows the shortfall.
func SetNofileLimit(o *Options) (NofileChange, error) {
	var cur unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &cur); err != nil {
		return NofileChange{}, fmt.Errorf("getrlimit RLIMIT_NOFILE: %w", err)
	}
	nrOpen, err := readNrOpen()
	if err != nil && !o.RlimitNofileSet {
		return NofileChange{}, err
	}
	want, change := nofileLimit(o, cur, nrOpen)
	ch := NofileChange{Before: cur, After: cur, Wanted: want.Cur}
	if !change {
		return ch, nil
	}
	if o.RlimitNofileSet && nrOpen > 0 && want.Cur > nrOpen {
		return ch, fmt.Errorf("cannot set RLIMIT_NOFILE to %d: above fs.nr_open (%d), the kernel's ceiling", want.Cur, nrOpen)
	}
	err = unix.Setrlimit(unix.RLIMIT_NOFILE, &want)
	if err != nil && !o.RlimitNofileSet && errors.Is(err, unix.EPERM) && want.Max > cur.Max {
		want = unix.Rlimit{Cur: cur.Max, Max: cur.Max}
		if want == cur {
			return ch, nil
		}
		err = unix.Setrlimit(unix.RLIMIT_NOFILE, &want)
	}
	if err != nil && errors.Is(err, unix.EPERM) && want.Max > cur.Max {
		return ch, fmt.Errorf("cannot set RLIMIT_NOFILE to %d: the hard limit is %d, and raising it needs CAP_SYS_RESOURCE: %w", want.Cur, cur.Max, err)
	}
	if err != nil {
		return ch, fmt.Errorf("set RLIMIT_NOFILE to %d: %w", want.Cur, err)
	}
	ch.After = want
	return ch, nil
}

// readNrOpen reads fs.nr_open, the kernel's ceiling on RLIMIT_NOFILE.
func readNrOpen() (uint64, error) {
	b, err := os.ReadFile("/proc/sys/fs/nr_open")
	if err != nil {
		return 0, fmt.Errorf("read fs.nr_open: %w", err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("read fs.nr_open: %w", err)
	}
	return n, nil
}
