package serverproc

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// fakeServer answers each connection on a socket with reply, after reading the request line,
// which it sends to got.
func fakeServer(t *testing.T, reply func(c net.Conn)) (path string, got <-chan string) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "ch.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	reqs := make(chan string, 10)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			line, _ := bufio.NewReader(c).ReadString('\n')
			reqs <- line
			reply(c)
			c.Close()
		}
	}()
	return path, reqs
}

// TestClientUntrustedReplies: the owner's end of the channel reads the server's replies as
// untrusted: too long, not JSON, a refusal, no answer at all.
func TestClientUntrustedReplies(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		reply func(c net.Conn)
		want  string
	}{
		{"too long", func(c net.Conn) { io.WriteString(c, `{"error":"`+strings.Repeat("x", maxReply)+`"}`) }, "longer than"},
		{"not json", func(c net.Conn) { io.WriteString(c, "hello\n") }, "not a reply"},
		{"no statistics", func(c net.Conn) { io.WriteString(c, "{}\n") }, "without statistics"},
		{"refused", func(c net.Conn) { io.WriteString(c, `{"error":"no"}`+"\n") }, "stats: no: refused by the server"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path, reqs := fakeServer(t, tc.reply)
			_, err := Client{Path: path}.Stats(ctx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Stats: %v, want %q", err, tc.want)
			}
			if r := <-reqs; r != `{"op":"stats"}`+"\n" {
				t.Errorf("request %q", r)
			}
			if tc.name == "refused" && !errors.Is(err, ErrRefused) {
				t.Errorf("Stats: %v is not ErrRefused", err)
			}
		})
	}
	t.Run("silent", func(t *testing.T) {
		path, _ := fakeServer(t, func(net.Conn) { time.Sleep(2 * time.Second) })
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := Client{Path: path}.SetDAXPolicy(cctx, passthrough.DAXPolicy{Mode: passthrough.DAXAlways})
		if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > time.Second {
			t.Errorf("SetDAXPolicy against a silent server: %v after %v", err, time.Since(start))
		}
	})
	t.Run("no server", func(t *testing.T) {
		err := Client{Path: filepath.Join(t.TempDir(), "none.sock")}.SetLogLevel(ctx, "debug")
		if err == nil || !strings.Contains(err.Error(), "none.sock: log_level") {
			t.Errorf("SetLogLevel without a server: %v", err)
		}
	})
}

// TestFinalStats: the last counters round-trip; nothing, garbage or too much is an error.
func TestFinalStats(t *testing.T) {
	for _, tc := range []struct {
		name, data, want string
	}{
		{"counters", `{"FUSE":{"Ops":{"LOOKUP":{"Count":3}},"BytesRead":7},"InFlight":1}`, ""},
		{"nothing (killed)", "", "final statistics"},
		{"garbage", "{", "final statistics"},
		{"too long", strings.Repeat(" ", maxReply+1), "longer than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			go func() { io.WriteString(w, tc.data); w.Close() }()
			st, err := FinalStats(r)
			if tc.want == "" {
				if err != nil || st.FUSE.Ops["LOOKUP"].Count != 3 || st.FUSE.BytesRead != 7 || st.InFlight != 1 {
					t.Errorf("FinalStats = %+v, %v", st, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("FinalStats: %v, want %q", err, tc.want)
			}
		})
	}
}
