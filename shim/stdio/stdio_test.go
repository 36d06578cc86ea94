package stdio

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func script(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "logger.sh")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestBinaryReady: binary:// is ready when fd 5 closes; binary-v2:// needs a byte first.
func TestBinaryReady(t *testing.T) {
	ctx := context.Background()
	closes := script(t, "exec 5>&-\ncat <&3 >/dev/null\n")
	writes := script(t, "printf x >&5\nexec 5>&-\ncat <&3 >/dev/null\n")
	for _, tt := range []struct {
		uri, err string
	}{
		{"binary://" + closes, ""},
		{"binary-v2://" + writes, ""},
		{"binary-v2://" + closes, "without signalling ready"},
		{"binary:///no/such/logger", "start the logging binary"},
	} {
		p, err := Open(ctx, Config{Stdout: tt.uri, Stderr: tt.uri, ContainerID: "c", Namespace: "n"})
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("%s: %v, want %q", tt.uri, err, tt.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tt.uri, err)
			continue
		}
		if _, err := p.Stdout.Write([]byte("x\n")); err != nil {
			t.Errorf("%s: write: %v", tt.uri, err)
		}
		if err := p.Close(); err != nil {
			t.Errorf("%s: close: %v", tt.uri, err)
		}
	}
}

func TestOpenErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := Open(ctx, Config{Stdout: "tcp://host:1"}); err == nil || !strings.Contains(err.Error(), `unknown scheme "tcp"`) {
		t.Errorf("tcp: %v", err)
	}
	if _, err := Open(ctx, Config{Stdin: "/no/such/fifo"}); err == nil || !strings.Contains(err.Error(), "stdin /no/such/fifo") {
		t.Errorf("missing stdin fifo: %v", err)
	}
	p, err := Open(ctx, Config{})
	if err != nil || p.Stdin != nil || p.Stdout != nil || p.Stderr != nil {
		t.Errorf("no streams: %+v, %v", p, err)
	}
	// With a terminal, file:// gets stdout only.
	f := filepath.Join(t.TempDir(), "log")
	p, err = Open(ctx, Config{Stdout: "file://" + f, Stderr: "file://" + f, Terminal: true})
	if err != nil || p.Stdout == nil || p.Stderr != nil {
		t.Fatalf("terminal file: %+v, %v", p, err)
	}
	p.Close()
}

// TestFifoReaderRestarts: the reader of an output fifo (containerd) closes it and opens it
// again, as a restarted containerd does; what is written meanwhile waits in the fifo and
// reaches the new reader, and no write fails.
func TestFifoReaderRestarts(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "stdout")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	r1, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Open(ctx, Config{Stdout: path, Terminal: true, ContainerID: "c", Namespace: "n"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if _, err := p.Stdout.Write([]byte("before\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := r1.Read(buf); err != nil || string(buf[:n]) != "before\n" {
		t.Fatalf("the first reader: %q, %v", buf[:n], err)
	}
	r1.Close()
	if _, err := p.Stdout.Write([]byte("while-away\n")); err != nil {
		t.Fatalf("a write with the reader gone: %v, want it kept in the fifo", err)
	}
	r2, err := os.OpenFile(path, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if _, err := p.Stdout.Write([]byte("after\n")); err != nil {
		t.Fatal(err)
	}
	var got []byte
	for !strings.Contains(string(got), "after\n") {
		n, err := r2.Read(buf)
		if err != nil {
			t.Fatalf("the second reader: %q, %v", got, err)
		}
		got = append(got, buf[:n]...)
	}
	if string(got) != "while-away\nafter\n" {
		t.Errorf("the second reader got %q, want what was written while it was away, then after", got)
	}
}

// TestFifoEarlyOutput: output written before containerd's reader has opened the fifo (an
// exec that prints and exits at once) waits for that reader, and reaches it whole, even when
// the process's streams are closed before the reader comes.
func TestFifoEarlyOutput(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stdout")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := Open(context.Background(), Config{Stdout: path, Terminal: true, ContainerID: "c", Namespace: "n"})
	if err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() {
		_, err := p.Stdout.Write([]byte("early\n"))
		p.Close()
		wrote <- err
	}()
	time.Sleep(200 * time.Millisecond) // the reader comes late
	got := make(chan string, 1)
	go func() {
		r, err := os.Open(path)
		if err != nil {
			got <- err.Error()
			return
		}
		defer r.Close()
		b, _ := io.ReadAll(r)
		got <- string(b)
	}()
	select {
	case s := <-got:
		if s != "early\n" {
			t.Errorf("the reader got %q, want %q", s, "early\n")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader got nothing in 10 s: the output went into a pipe nobody else held")
	}
	if err := <-wrote; err != nil {
		t.Errorf("write: %v", err)
	}
}
