package vhostuser

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// socketPair returns two connected unix stream sockets.
func socketPair(t testing.TB) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
	}
	return conns[0], conns[1]
}

// openFDs counts this process's open fds.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents) - 1 // the directory itself
}

// checkNoLeak fails the test if the open fd count at cleanup differs from now.
func checkNoLeak(t *testing.T) {
	t.Helper()
	before := openFDs(t)
	t.Cleanup(func() {
		if after := openFDs(t); after != before {
			t.Errorf("fd leak: %d open fds before, %d after", before, after)
		}
	})
}

func eventfds(t *testing.T, n int) []int {
	t.Helper()
	fds := make([]int, n)
	for i := range fds {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		fds[i] = fd
	}
	t.Cleanup(func() { closeFDs(fds) })
	return fds
}

func inode(t *testing.T, fd int) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatalf("fstat %d: %v", fd, err)
	}
	return st.Ino
}

func TestConnMessageWithFDs(t *testing.T) {
	sent := eventfds(t, 3)
	checkNoLeak(t)
	a, b := socketPair(t)
	ca, cb := NewConn(a), NewConn(b)
	defer ca.Close()
	defer cb.Close()

	payload := MemoryTable{Regions: []MemoryRegion{{Size: 1}, {GuestPhysAddr: 1, Size: 1}, {GuestPhysAddr: 2, Size: 1}}}.Append(nil)
	if err := ca.WriteMessage(Header{Request: SetMemTable, Flags: Version}, payload, sent); err != nil {
		t.Fatal(err)
	}
	m, err := cb.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	if m.Request != SetMemTable || m.Flags != Version || int(m.Size) != len(payload) || string(m.Payload) != string(payload) {
		t.Fatalf("got %+v", m.Header)
	}
	if len(m.FDs) != 3 {
		t.Fatalf("got %d fds", len(m.FDs))
	}
	for i, fd := range m.FDs {
		if inode(t, fd) != inode(t, sent[i]) {
			t.Errorf("fd %d is not the eventfd sent", i)
		}
	}
	kept := m.TakeFD(1)
	if m.TakeFD(1) != -1 || m.TakeFD(7) != -1 {
		t.Error("TakeFD handed out an fd twice or out of range")
	}
	m.Close()
	if inode(t, kept) != inode(t, sent[1]) {
		t.Error("taken fd was closed")
	}
	unix.Close(kept)
}

func TestConnTooManyFDs(t *testing.T) {
	for _, n := range []int{MaxFDs + 1, 20} {
		a, b := socketPair(t)
		ca, cb := NewConn(a), NewConn(b)
		sent := eventfds(t, n)
		before := openFDs(t)
		// WriteMessage refuses more than MaxFDs: send the hostile message raw, the fds on its
		// payload byte.
		if err := ca.write(Header{Request: SetConfig, Flags: Version, Size: 1}.Append(nil), nil); err != nil {
			t.Fatal(err)
		}
		if err := ca.write([]byte{2}, sent); err != nil {
			t.Fatal(err)
		}
		if _, err := cb.ReadMessage(); !errors.Is(err, ErrInvalid) {
			t.Errorf("%d fds: got %v, want ErrInvalid", n, err)
		}
		if after := openFDs(t); after != before {
			t.Errorf("%d fds: leaked %d", n, after-before)
		}
		ca.Close()
		cb.Close()
	}
}

func TestConnFDsOnLaterBytes(t *testing.T) {
	sent := eventfds(t, 2)
	checkNoLeak(t)
	a, b := socketPair(t)
	ca, cb := NewConn(a), NewConn(b)
	defer ca.Close()
	defer cb.Close()
	// Header in one sendmsg, payload in two, with one fd on each part of the payload.
	ca.write(Header{Request: SetMemTable, Flags: Version, Size: 8 + 64}.Append(nil), nil)
	p := MemoryTable{Regions: []MemoryRegion{{Size: 1}, {GuestPhysAddr: 1, Size: 1}}}.Append(nil)
	ca.write(p[:10], sent[:1])
	ca.write(p[10:], sent[1:])
	m, err := cb.ReadMessage()
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if len(m.FDs) != 2 || string(m.Payload) != string(p) {
		t.Fatalf("got %d fds, payload ok %v", len(m.FDs), string(m.Payload) == string(p))
	}
}

func TestConnEOF(t *testing.T) {
	checkNoLeak(t)
	a, b := socketPair(t)
	ca, cb := NewConn(a), NewConn(b)
	ca.Close()
	if _, err := cb.ReadMessage(); err != io.EOF {
		t.Errorf("clean EOF: %v", err)
	}
	cb.Close()

	// Half a header, with an fd, then EOF: unexpected EOF, fd closed.
	a, b = socketPair(t)
	ca, cb = NewConn(a), NewConn(b)
	fds := eventfds(t, 1)
	ca.write([]byte{1, 0, 0, 0, 1}, fds)
	ca.Close()
	if _, err := cb.ReadMessage(); err != io.ErrUnexpectedEOF {
		t.Errorf("EOF in header: %v", err)
	}
	cb.Close()

	// Full header, half the payload, then EOF.
	a, b = socketPair(t)
	ca, cb = NewConn(a), NewConn(b)
	ca.write(append(Header{Request: SetFeatures, Flags: Version, Size: 8}.Append(nil), 1, 2), fds)
	ca.Close()
	if _, err := cb.ReadMessage(); err != io.ErrUnexpectedEOF {
		t.Errorf("EOF in payload: %v", err)
	}
	cb.Close()
}

func TestConnOversizePayload(t *testing.T) {
	fds := eventfds(t, 1)
	checkNoLeak(t)
	a, b := socketPair(t)
	ca, cb := NewConn(a), NewConn(b)
	defer ca.Close()
	defer cb.Close()
	ca.write(Header{Request: SetMemTable, Flags: Version, Size: MaxPayload + 1}.Append(nil), fds)
	if _, err := cb.ReadMessage(); !errors.Is(err, ErrInvalid) {
		t.Errorf("got %v, want ErrInvalid", err)
	}
	if err := ca.WriteMessage(Header{Request: SetConfig}, make([]byte, MaxPayload+1), nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("WriteMessage oversize: %v", err)
	}
}
