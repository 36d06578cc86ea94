package serverbench

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestMemoryReport(t *testing.T) {
	mem := []MemoryResult{
		{Server: "kvfsd --inode-file-handles=never", Files: 1000, Looked: 500, Stopped: "LOOKUP answered EMFILE (too many open files)",
			Idle: memSample{RSS: 4 << 20, Anon: 1 << 20, Fds: 20}, After: memSample{RSS: 4<<20 + 100_000, Anon: 1<<20 + 50_000, Fds: 520}, Nofile: "520"},
		{Server: "kvfsd --inode-file-handles=mandatory", Files: 1000, Looked: 1000,
			Idle: memSample{RSS: 4 << 20, Anon: 1 << 20, Fds: 20}, After: memSample{RSS: 4<<20 + 150_000, Anon: 1<<20 + 120_000, Fds: 20}, Nofile: "520"},
		{Server: "C virtiofsd", Files: 1000, Err: "exited before listening\nits output: ..."},
	}
	res := fakeResults()
	res.Config.MemoryFiles = 1000
	res.Memory = mem
	md := Report(res, "")
	for _, want := range []string{
		"## Memory: RSS idle and with 1000 cached inodes",
		"| kvfsd --inode-file-handles=never | 500 of 1000: LOOKUP answered EMFILE (too many open files) | 4.0 MiB | 4.1 MiB | 200 | 1.0 MiB | 1.0 MiB | 100 | 20 | 520 | 520 |",
		"| kvfsd --inode-file-handles=mandatory | 1000 | 4.0 MiB | 4.1 MiB | 150 | 1.0 MiB | 1.1 MiB | 120 | 20 | 20 | 520 |",
		"| C virtiofsd | n/a (exited before listening) |",
		"### Ratios", // the throughput sections are there too
	} {
		if !strings.Contains(md, want) {
			t.Errorf("report lacks %q", want)
		}
	}

	// -run memory: only the memory section, with how it ran.
	res.Workloads = nil
	res.Config.Command = "kvfsbench -run memory"
	md = Report(res, "")
	if !strings.Contains(md, "## Memory") || !strings.Contains(md, "- **Command:** `kvfsbench -run memory`") || strings.Contains(md, "### Ratios") {
		t.Errorf("memory-only report:\n%s", md)
	}
}

// TestSampleMemory reads a real process: a child that holds a few descriptors and some memory.
func TestSampleMemory(t *testing.T) {
	d, err := startDaemon([]string{"sleep", "30"}, filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		d.cmd.Process.Kill()
		<-d.exited
	}()
	time.Sleep(100 * time.Millisecond) // let it exec
	s, err := sampleMemory(d)
	if err != nil {
		t.Fatal(err)
	}
	// stdin, stdout and stderr at least; a resident sleep is well over 100 KiB and its
	// anonymous memory less than its whole RSS.
	if s.Fds < 3 || s.RSS < 100<<10 || s.Anon <= 0 || s.Anon > s.RSS {
		t.Errorf("sample %+v", s)
	}
	if n := nofileLimit(d); n == "?" {
		t.Error("no RLIMIT_NOFILE read")
	}
}
