package vhostuser

import (
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// backendPeer hands the back-end a fresh back-end channel and returns the front-end's end.
func (r *rig) backendPeer(t *testing.T) *Conn {
	t.Helper()
	a, b := socketPair(t)
	f, err := b.File()
	must(t, err)
	b.Close()
	must(t, r.c.SetBackendReqFD(int(f.Fd())))
	f.Close()
	return NewConn(a)
}

// serveOne reads one back-end request on peer, writes what answer returns for it (nothing for
// nil) and hands the request over.
func serveOne(t *testing.T, peer *Conn, answer func(m *Message) []byte) <-chan *Message {
	got := make(chan *Message, 1)
	go func() {
		m, err := peer.ReadMessage()
		if err != nil {
			got <- nil
			return
		}
		if b := answer(m); b != nil {
			peer.write(b, nil)
		}
		got <- m
	}()
	return got
}

var negEINVAL = ^uint64(unix.EINVAL) + 1 // -EINVAL

func reply(req BackendRequest, flags uint32, payload []byte) []byte {
	return append(Header{Request: Request(req), Flags: flags, Size: uint32(len(payload))}.Append(nil), payload...)
}

func TestBackendFSMap(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t, WithBackendTimeout(300*time.Millisecond))
	must(t, r.c.SetProtocolFeatures(qemuProtocol))
	msg := &FSMapMsg{}
	msg.FDOffset[0], msg.CacheOffset[0], msg.Len[0], msg.Flags[0] = 1<<21, 2<<21, 1<<21, FSMapRead|FSMapWrite
	file, err := os.CreateTemp(t.TempDir(), "map")
	must(t, err)
	defer file.Close()

	// No channel yet.
	if r.b.FSMapAvailable() {
		t.Fatal("FS map available without a channel")
	}
	if err := r.b.FSMap(msg, int(file.Fd())); !errors.Is(err, ErrNoBackendChannel) {
		t.Fatalf("FSMap without a channel: %v", err)
	}

	peer := r.backendPeer(t)
	defer peer.Close()
	if !r.b.FSMapAvailable() {
		t.Fatal("FS map not available with REPLY_ACK and BACKEND_SEND_FD negotiated")
	}
	ok := func(m *Message) []byte { return reply(BackendRequest(m.Request), ReplyFlags, U64(0).Append(nil)) }
	got := serveOne(t, peer, ok)
	must(t, r.b.FSMap(msg, int(file.Fd())))
	m := <-got
	if m.Request != Request(BackendFSMap) || m.Flags != Version|FlagNeedReply || len(m.FDs) != 1 {
		t.Fatalf("FS_MAP sent as %+v with %d fds", m.Header, len(m.FDs))
	}
	var st1, st2 unix.Stat_t
	must(t, unix.Fstat(m.FDs[0], &st1))
	must(t, unix.Fstat(int(file.Fd()), &st2))
	if st1.Ino != st2.Ino {
		t.Error("FS_MAP carries another file")
	}
	if back, err := ParseFSMapMsg(m.Payload); err != nil || *back != *msg {
		t.Errorf("payload %+v, %v; want %+v", back, err, msg)
	}
	m.Close()

	// A refusal with a negated errno, as the DAX-capable QEMU sends it.
	got = serveOne(t, peer, func(m *Message) []byte {
		return reply(BackendFSUnmap, ReplyFlags, U64(negEINVAL).Append(nil))
	})
	err = r.b.FSUnmap(msg)
	if !errors.Is(err, ErrBackendNack) || !errors.Is(err, unix.EINVAL) {
		t.Fatalf("refused FS_UNMAP: %v", err)
	}
	if m := <-got; m.Request != Request(BackendFSUnmap) || len(m.FDs) != 0 || len(m.Payload) != FSMapMsgSize {
		t.Fatalf("FS_UNMAP sent as %+v with %d fds", m.Header, len(m.FDs))
	}
	if !r.b.FSMapAvailable() {
		t.Fatal("a refusal broke the channel")
	}

	// Malformed replies break the channel; later requests fail at once.
	for name, bad := range map[string]func(m *Message) []byte{
		"wrong flags": func(m *Message) []byte { return reply(BackendFSUnmap, Version, U64(0).Append(nil)) },
		"wrong id":    func(m *Message) []byte { return reply(BackendFSMap, ReplyFlags, U64(0).Append(nil)) },
		"short":       func(m *Message) []byte { return reply(BackendFSUnmap, ReplyFlags, []byte{0, 0, 0, 0}) },
		"hang-up":     func(m *Message) []byte { peer.Close(); return nil },
		"silence":     func(m *Message) []byte { return nil }, // the timeout ends the wait
	} {
		peer.Close()
		peer = r.backendPeer(t)
		got := serveOne(t, peer, bad)
		if err := r.b.FSUnmap(msg); err == nil || errors.Is(err, ErrBackendNack) {
			t.Errorf("%s: FSUnmap: %v, want a broken channel", name, err)
		}
		<-got
		if r.b.FSMapAvailable() {
			t.Errorf("%s: channel still available", name)
		}
		if err := r.b.FSUnmap(msg); !errors.Is(err, ErrNoBackendChannel) {
			t.Errorf("%s: FSUnmap after the break: %v", name, err)
		}
	}
	peer.Close()

	if _, err := ParseFSMapMsg(make([]byte, FSMapMsgSize-8)); !errors.Is(err, ErrInvalid) {
		t.Errorf("short FS map message: %v", err)
	}
	if BackendFSMap.String() != "BACKEND_FS_MAP" || BackendFSUnmap.String() != "BACKEND_FS_UNMAP" {
		t.Error(BackendFSMap, BackendFSUnmap)
	}
	r.c.Close()
	if err := r.wait(); err != nil {
		t.Fatal(err)
	}
}

// TestBackendFSMapNeedsAck: without REPLY_ACK (or BACKEND_SEND_FD) a channel is not usable for
// DAX: there would be no way to learn whether a mapping happened.
func TestBackendFSMapNeedsAck(t *testing.T) {
	checkNoLeak(t)
	r := newRig(t)
	must(t, r.c.SetProtocolFeatures(ProtocolBackendReq|ProtocolBackendSendFD))
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	must(t, err)
	defer unix.Close(sp[0])
	must(t, r.c.SetBackendReqFD(sp[1]))
	unix.Close(sp[1])
	r.sync()
	if r.b.BackendChannel() == nil || r.b.FSMapAvailable() {
		t.Fatal("channel missing, or usable for DAX without REPLY_ACK")
	}
	if err := r.b.FSUnmap(&FSMapMsg{}); !errors.Is(err, ErrNoBackendChannel) {
		t.Fatalf("FSUnmap: %v", err)
	}
	var b [8]byte
	unix.SetNonblock(sp[0], true)
	if n, _ := unix.Read(sp[0], b[:]); n > 0 {
		t.Fatal("a request was sent anyway")
	}
}
