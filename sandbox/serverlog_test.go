package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestServerLogBounded runs a server (an external daemon: a shell script) that writes four
// times serverLogLimit of log lines before it says it is ready, and its own last line after:
// server.log and server.log.1 each stay within serverLogLimit, and the end of server.log is
// the server's last line, readable, its escape sanitized.
func TestServerLogBounded(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	daemon := filepath.Join(t.TempDir(), "flood-daemon")
	script := fmt.Sprintf(`#!/bin/sh
yes 'panic: a request panicked, goroutine 7 [running]: stack frame' | head -c %d >&2
echo '%s...' >&2
printf 'the last line \033[31m\n' >&2
exec sleep 600
`, 4*serverLogLimit, readyLine)
	if err := os.WriteFile(daemon, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	c := testConfig(base)
	c.Server.Daemon = daemon
	s, err := Create(context.Background(), "srvlog", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	path := filepath.Join(s.Dir(), serverLogName)
	const last = `the last line \x1b[31m`
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(string(b), "\n"+last+"\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("server.log does not end with %q after 30 s; it ends with %q", last, b[max(0, len(b)-200):])
		}
		time.Sleep(20 * time.Millisecond)
	}
	var total int64
	for _, name := range []string{serverLogName, serverLogName + ".1"} {
		fi, err := os.Stat(filepath.Join(s.Dir(), name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() > serverLogLimit {
			t.Errorf("%s holds %d bytes, more than its limit %d", name, fi.Size(), serverLogLimit)
		}
		total += fi.Size()
	}
	t.Logf("%d bytes written, %d kept on disk", 4*serverLogLimit, total)
}
