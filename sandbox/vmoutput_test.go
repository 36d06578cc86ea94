package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestSanitize(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"plain text 0-9 ~!\n", "plain text 0-9 ~!\n"},
		{"tab\tkept", "tab\tkept"},
		{"line\r\nnext\r\n", "line\nnext\n"},
		{"\x1b[2J\x1b]0;title\x07", `\x1b[2J\x1b]0;title\x07`},
		{"nul\x00del\x7f", `nul\x00del\x7f`},
		{"\xff\xfe high", `\xff\xfe high`},
		{"é", `\xc3\xa9`},
		{`a\x41 is not A`, `a\\x41 is not A`},
		{"", ""},
	} {
		if got := string(sanitize(nil, []byte(tt.in))); got != tt.want {
			t.Errorf("sanitize(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
	// Every byte value: only printable ASCII, newline and tab come out.
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	for _, c := range sanitize(nil, all) {
		if c != '\n' && c != '\t' && (c < 0x20 || c > 0x7e) {
			t.Fatalf("sanitize let byte %#x through", c)
		}
	}
}

// openTestLog opens a boundedLog of limit bytes in a temporary directory.
func openTestLog(t *testing.T, limit int64) *boundedLog {
	t.Helper()
	l, err := openBoundedLog(context.Background(), filepath.Join(t.TempDir(), "console.log"), limit)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.close)
	return l
}

// onDisk returns the two files of l, the older first.
func onDisk(t *testing.T, l *boundedLog) (older, current []byte) {
	t.Helper()
	older, err := os.ReadFile(l.path + ".1")
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	current, err = os.ReadFile(l.path)
	if err != nil {
		t.Fatal(err)
	}
	return older, current
}

// TestBoundedLogFlood floods a log of 64 KiB with 8 MiB of random bytes in the drain's
// reads (up to drainBufSize): after every write each file is within the limit, and at the
// end the older file and the current one are, together, the end of the sanitized stream,
// the memory tail its last tailBytes.
func TestBoundedLogFlood(t *testing.T) {
	const limit = 64 << 10
	l := openTestLog(t, limit)
	rng := rand.New(rand.NewPCG(1, 2))
	var want []byte
	for written := 0; written < 8<<20; {
		p := make([]byte, 1+rng.IntN(drainBufSize))
		for i := range p {
			// Mostly text, with control bytes and high bytes mixed in.
			switch r := rng.IntN(10); {
			case r == 0:
				p[i] = byte(rng.IntN(256))
			case r == 1:
				p[i] = '\n'
			default:
				p[i] = byte('a' + rng.IntN(26))
			}
		}
		if n, err := l.Write(p); n != len(p) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
		written += len(p)
		want = sanitize(want, p)
		for _, name := range []string{l.path, l.path + ".1"} {
			if fi, err := os.Stat(name); err == nil && fi.Size() > limit {
				t.Fatalf("after %d bytes, %s holds %d bytes, more than the limit %d", written, name, fi.Size(), limit)
			}
		}
	}
	older, current := onDisk(t, l)
	if len(older) == 0 {
		t.Fatal("no rotation happened")
	}
	kept := append(older, current...)
	if !bytes.HasSuffix(want, kept) {
		t.Errorf("the files (%d + %d bytes) are not the end of the sanitized stream", len(older), len(current))
	}
	if len(kept) < limit {
		t.Errorf("the files keep %d bytes, less than one limit (%d) of the stream", len(kept), limit)
	}
	if !bytes.Equal(l.tail, want[len(want)-tailBytes:]) {
		t.Errorf("the memory tail is not the last %d bytes of the stream", tailBytes)
	}
	if l.written() != int64(len(want)) {
		t.Errorf("written() = %d, want %d", l.written(), len(want))
	}
}

// TestBoundedLogLargeWrite: one write larger than the limit keeps its end, and the file stays
// within the limit.
func TestBoundedLogLargeWrite(t *testing.T) {
	const limit = 64 << 10
	l := openTestLog(t, limit)
	l.Write([]byte("before\n"))
	big := bytes.Repeat([]byte("0123456789abcde\n"), 3*limit/16)
	l.Write(big)
	older, current := onDisk(t, l)
	if string(older) != "before\n" || len(current) != limit || !bytes.HasSuffix(big, current) {
		t.Errorf("older %q, current %d bytes (end of the write: %v), want the earlier write and the last %d bytes",
			older, len(current), bytes.HasSuffix(big, current), limit)
	}
}

// TestBoundedLogAppends: a log opened again (a recovered sandbox's console) goes on after
// what the file holds, and rotates when that would pass the limit.
func TestBoundedLogAppends(t *testing.T) {
	path := filepath.Join(t.TempDir(), "console.log")
	if err := os.WriteFile(path, bytes.Repeat([]byte("x"), 60), 0o640); err != nil {
		t.Fatal(err)
	}
	l, err := openBoundedLog(context.Background(), path, 100)
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	l.Write([]byte("0123456789\n"))
	if b, _ := os.ReadFile(path); string(b) != strings.Repeat("x", 60)+"0123456789\n" {
		t.Errorf("after reopening: %q", b)
	}
	l.Write(bytes.Repeat([]byte("y"), 40))
	older, current := onDisk(t, l)
	if len(older) != 71 || string(current) != strings.Repeat("y", 40) {
		t.Errorf("older %d bytes, current %q: want a rotation before the write past 100 bytes", len(older), current)
	}
}

// TestBoundedLogFileError: once the file cannot be written, the stream is still taken and its
// tail kept.
func TestBoundedLogFileError(t *testing.T) {
	dir := t.TempDir()
	l, err := openBoundedLog(context.Background(), filepath.Join(dir, "console.log"), 16)
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	l.Write([]byte("first line\n"))
	// The rotation's rename fails: the path names a directory that does not exist.
	l.path = filepath.Join(dir, "gone", "console.log")
	if n, err := l.Write([]byte("second line\n")); n != 12 || err != nil {
		t.Fatalf("Write after a file error = %d, %v", n, err)
	}
	l.Write([]byte("third line\n"))
	if l.f != nil {
		t.Error("the file is still written after an error")
	}
	if got := l.lastLines(10); !slices.Equal(got, []string{"first line", "second line", "third line"}) {
		t.Errorf("lastLines = %q", got)
	}
}

func TestBoundedLogLastLines(t *testing.T) {
	tests := []struct {
		name  string
		write []string
		n     int
		want  []string
	}{
		{"nothing", nil, 5, nil},
		{"only newlines", []string{"\n\n"}, 5, nil},
		{"all lines, trailing newline dropped", []string{"a\nb\n", "c\n"}, 5, []string{"a", "b", "c"}},
		{"an unfinished last line", []string{"a\nb"}, 5, []string{"a", "b"}},
		{"blank lines inside kept", []string{"a\n\nb\n"}, 5, []string{"a", "", "b"}},
		{"the last n", []string{"1\n2\n3\n4\n5\n"}, 2, []string{"4", "5"}},
		{"a line cut by the tail's start is dropped", []string{strings.Repeat("x", tailBytes) + "\nend\n"}, 5, []string{"end"}},
		{"one line longer than the tail is marked", []string{strings.Repeat("x", tailBytes+10)}, 5, []string{"..." + strings.Repeat("x", tailBytes)}},
		{"sanitized", []string{"\x1b[31mred\r\n"}, 5, []string{`\x1b[31mred`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := openTestLog(t, 1<<20)
			for _, w := range tt.write {
				l.Write([]byte(w))
			}
			if got := l.lastLines(tt.n); !slices.Equal(got, tt.want) {
				t.Errorf("lastLines(%d) = %q, want %q", tt.n, got, tt.want)
			}
		})
	}
}

// TestVMOutputFlood plays QEMU's side of the pipes: 16 MiB written to the console as fast as
// it goes, in writes of a line, as QEMU does (non-blocking, each write given 5 s to find
// room). No write waits that long (the drain keeps up: a write that waits stalls the guest),
// the files stay within their limit, nothing but sanitized text reaches them, and the drains
// end once the writers have closed the pipes (QEMU exited).
func TestVMOutputFlood(t *testing.T) {
	o, w, qemu, err := newVMOutput(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	o.start()
	defer o.stop()
	// As QEMU's file chardev does: a new opening through /proc, non-blocking (Go's poller
	// takes a pipe so, and SetWriteDeadline then works).
	console, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", w.Fd()), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	line := []byte("KVFS-FLOOD \x1b[31m\x01\xff the guest writes without end\r\n")
	var sent int
	start := time.Now()
	for sent < 16<<20 {
		console.SetWriteDeadline(time.Now().Add(5 * time.Second))
		n, err := console.Write(line)
		sent += n
		if err != nil {
			t.Fatalf("a console write stalled after %d bytes: %v", sent, err)
		}
	}
	elapsed := time.Since(start)
	qemu.Write([]byte("qemu-system-x86_64: terminating on signal 15\n"))
	console.Close()
	qemu.Close()
	select {
	case <-o.drained:
	case <-time.After(10 * time.Second):
		t.Fatal("the drains did not end when the pipes closed")
	}
	older, current := onDisk(t, o.console.log)
	if len(older) > consoleFileLimit || len(current) > consoleFileLimit || len(older) == 0 {
		t.Errorf("console files of %d and %d bytes, limit %d", len(older), len(current), consoleFileLimit)
	}
	if bytes.ContainsAny(append(older, current...), "\x1b\x01\xff\r") {
		t.Error("a control byte reached the files")
	}
	if got := o.console.log.lastLines(1); len(got) != 1 || got[0] != `KVFS-FLOOD \x1b[31m\x01\xff the guest writes without end` {
		t.Errorf("last console line %q", got)
	}
	if got := o.qemu.log.lastLines(5); !slices.Equal(got, []string{"qemu-system-x86_64: terminating on signal 15"}) {
		t.Errorf("QEMU's lines %q", got)
	}
	t.Logf("drained %d MiB in %v (%.0f MiB/s), %d bytes kept on disk", sent>>20, elapsed.Round(time.Millisecond),
		float64(sent)/(1<<20)/elapsed.Seconds(), len(older)+len(current))
}

// TestVMOutputStop: stop ends the drains while QEMU still holds the pipes (it would not
// exit), and closes the files; what is in memory stays readable.
func TestVMOutputStop(t *testing.T) {
	o, console, qemu, err := newVMOutput(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer console.Close()
	defer qemu.Close()
	o.start()
	console.Write([]byte("still running\n"))
	deadline := time.Now().Add(10 * time.Second)
	for o.console.log.written() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	stopped := make(chan struct{})
	go func() {
		o.stop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not end the drains")
	}
	if o.console.log.f != nil || o.qemu.log.f != nil {
		t.Error("a file is still open after stop")
	}
	if got := o.console.log.lastLines(5); !slices.Equal(got, []string{"still running"}) {
		t.Errorf("lastLines after stop = %q", got)
	}
}
