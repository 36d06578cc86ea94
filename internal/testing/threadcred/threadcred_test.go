package threadcred

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRun: f runs as the user asked for, without capabilities, and the test's own thread is
// still root afterwards.
func TestRun(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("switching a thread to another user needs root")
	}
	var uid, gid int
	var caps [2]unix.CapUserData
	var capErr error
	if err := Run(Nobody, Nobody, func() {
		uid, gid = unix.Geteuid(), unix.Getegid()
		capErr = unix.Capget(&unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}, &caps[0])
	}); err != nil {
		t.Fatal(err)
	}
	if uid != Nobody || gid != Nobody {
		t.Errorf("f ran as %d:%d, want %d:%d", uid, gid, Nobody, Nobody)
	}
	if capErr != nil {
		t.Fatal(capErr)
	}
	for i, c := range caps {
		if c.Effective != 0 || c.Permitted != 0 {
			t.Errorf("capabilities word %d: effective %#x, permitted %#x, want none", i, c.Effective, c.Permitted)
		}
	}
	if os.Geteuid() != 0 {
		t.Errorf("the caller's thread is %d after Run, want root", os.Geteuid())
	}
}
