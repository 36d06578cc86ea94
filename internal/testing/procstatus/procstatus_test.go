package procstatus

import (
	"os"
	"strconv"
	"testing"
)

func TestParse(t *testing.T) {
	s := Parse("Name:\tkvfsd\nVmRSS:\t    1234 kB\nNSpid:\t812\t1\nbad line\n")
	if s["Name"] != "kvfsd" || s["NSpid"] != "812\t1" {
		t.Errorf("fields %q", s)
	}
	if n, err := s.Bytes("VmRSS"); err != nil || n != 1234<<10 {
		t.Errorf("VmRSS = %d, %v; want %d", n, err, 1234<<10)
	}
	if _, err := s.Bytes("RssAnon"); err == nil {
		t.Error("a missing field has a size")
	}
	if _, err := s.Bytes("Name"); err == nil {
		t.Error("Name has a size")
	}
}

// TestReadSelf reads this process's own status, by PID and as self.
func TestReadSelf(t *testing.T) {
	for _, who := range []string{"self", strconv.Itoa(os.Getpid())} {
		s, err := Read(who)
		if err != nil {
			t.Fatal(err)
		}
		if s["Pid"] != strconv.Itoa(os.Getpid()) {
			t.Errorf("%s: Pid %q, want %d", who, s["Pid"], os.Getpid())
		}
		if n, err := s.Bytes("VmRSS"); err != nil || n <= 0 {
			t.Errorf("%s: VmRSS %d, %v", who, n, err)
		}
	}
	if _, err := ReadPID(-1); err == nil {
		t.Error("PID -1 has a status")
	}
}
