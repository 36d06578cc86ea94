package vhostuser

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/fuzzseed"
)

// FuzzSession plays a front-end whose messages are the fuzz input against a Backend serving
// the fake device. The input is a stream of messages, each a 12-byte header followed by as many
// payload bytes as its size field says (the last one may be cut short: the front-end then
// disconnects inside it). Each message carries the fds its header and payload call for, of the
// right kind (memfds for memory regions, eventfds for the vring notifiers, a socket for
// SET_BACKEND_REQ_FD). After the stream the front-end asks GET_FEATURES and disconnects.
//
// Invariants: Serve never panics or hangs and returns once the front-end is gone; every reply is
// one QEMU would accept (flags 0x5, 8 bytes, no fds) and answers, in order, a request that has a
// reply or asked for an acknowledgement; GET_* replies carry the values the back-end offers;
// when Serve reports a clean disconnect every request with a reply was answered; and no fd or
// memory mapping outlives the session.
func FuzzSession(f *testing.F) {
	// The seeds are the files in testdata/fuzz/FuzzSession (TestFuzzSessionSeedCorpus).
	// The first socket creates process-wide fds (the netpoller's) that stay.
	a, b := socketPair(f)
	a.Close()
	b.Close()
	f.Fuzz(func(t *testing.T, data []byte) { newSessionRun(t).run(t, data) })
}

// sessionMsg is one message of a session seed.
type sessionMsg struct {
	req   Request
	flags uint32
	p     Payload
}

type sessionSeed []sessionMsg

func (s sessionSeed) encode() []byte {
	var b []byte
	for _, m := range s {
		b = append(b, Encode(m.req, m.flags, m.p)...)
	}
	return b
}

// Guest memory of the seeds: one 1 MiB region at gpa 0, front-end address fuzzUser, rings at
// 64 KiB steps.
const (
	fuzzUser      = 0x7f0000000000
	fuzzRegion    = 1 << 20
	fuzzMaxMemfd  = 4 << 20 // a region's memfd is as large as the region, up to this
	fuzzSessionTO = 10 * time.Second
)

func fuzzRingAddr(q uint32) VringAddr {
	base := uint64(fuzzUser) + 0x10000*uint64(q+1)
	return VringAddr{Index: q, Desc: base, Avail: base + 0x4000, Used: base + 0x8000}
}

// sessionSeeds are the seed corpus in testdata/fuzz/FuzzSession, by file name.
func sessionSeeds() map[string][]byte {
	region := MemoryRegion{GuestPhysAddr: 0, Size: fuzzRegion, UserAddr: fuzzUser}
	realize := sessionSeed{
		{GetFeatures, Version, Empty{}},
		{GetProtocolFeatures, Version, Empty{}},
		{SetProtocolFeatures, Version, U64(OfferedProtocolFeatures)},
		{GetQueueNum, Version, Empty{}},
		{GetMaxMemSlots, Version, Empty{}},
		{SetBackendReqFD, Version | FlagNeedReply, Empty{}},
		{SetOwner, Version, Empty{}},
		{GetFeatures, Version, Empty{}},
		{SetVringCall, Version, VringFile{Index: 0}},
		{SetVringErr, Version, VringFile{Index: 0}},
		{SetVringCall, Version, VringFile{Index: 1}},
		{SetVringErr, Version, VringFile{Index: 1}},
	}
	start := func(mem sessionMsg) sessionSeed {
		s := sessionSeed{{SetFeatures, Version, U64(backendFeatures)}, mem}
		for q := uint32(0); q < 2; q++ {
			s = append(s,
				sessionMsg{SetVringNum, Version, VringState{Index: q, Num: 256}},
				sessionMsg{SetVringBase, Version, VringState{Index: q, Num: 0}},
				sessionMsg{SetVringAddr, Version, fuzzRingAddr(q)},
				sessionMsg{SetVringKick, Version, VringFile{Index: uint8(q)}},
				sessionMsg{SetVringEnable, Version, VringState{Index: q, Num: 1}},
				sessionMsg{SetVringCall, Version, VringFile{Index: uint8(q)}})
		}
		return s
	}
	stop := sessionSeed{
		{SetVringEnable, Version, VringState{Index: 0, Num: 0}},
		{GetVringBase, Version, VringState{Index: 0}},
		{SetVringEnable, Version, VringState{Index: 1, Num: 0}},
		{GetVringBase, Version, VringState{Index: 1}},
	}
	cat := func(parts ...sessionSeed) sessionSeed {
		var s sessionSeed
		for _, p := range parts {
			s = append(s, p...)
		}
		return s
	}
	memTable := sessionMsg{SetMemTable, Version | FlagNeedReply, MemoryTable{Regions: []MemoryRegion{region}}}
	addReg := sessionMsg{AddMemReg, Version | FlagNeedReply, SingleRegion{Region: region}}
	remReg := sessionMsg{RemMemReg, Version | FlagNeedReply, SingleRegion{Region: region}}
	cut := cat(realize, start(memTable)).encode()
	seeds := map[string]sessionSeed{
		"realize":              realize,
		"start-mem-table":      cat(realize, start(memTable), stop),
		"start-mem-slots":      cat(realize, start(addReg), stop),
		"restart":              cat(realize, start(memTable), stop, start(memTable), stop),
		"remove-running-rings": cat(realize, start(addReg), sessionSeed{remReg}, stop),
		"reset-running": cat(realize, start(memTable),
			sessionSeed{{ResetOwner, Version, Empty{}}, {ResetDevice, Version, Empty{}}}),
		"kick-polled": cat(realize, sessionSeed{{SetFeatures, Version, U64(backendFeatures)}, addReg,
			{SetVringNum, Version, VringState{Index: 1, Num: 8}}, {SetVringAddr, Version, fuzzRingAddr(1)},
			{SetVringKick, Version, VringFile{Index: 1, NoFD: true}}}),
		"no-protocol-features": {{GetFeatures, Version, Empty{}}, {SetOwner, Version, Empty{}},
			{SetFeatures, Version, U64(backendFeatures &^ FeatureProtocolFeatures)}, memTable},
		"unsupported": cat(realize, sessionSeed{{SetLogBase, Version | FlagNeedReply, LogBase{MmapSize: 4096}},
			{GetConfig, Version, Opaque(make([]byte, 12))}, {Request(99), Version, Empty{}}}),
		"owner-twice": {{SetOwner, Version, Empty{}}, {SetOwner, Version, Empty{}}},
	}
	out := map[string][]byte{"cut-mid-message": cut[:len(cut)-4]}
	for name, s := range seeds {
		out[name] = s.encode()
	}
	return out
}

var updateSessionSeeds = flag.Bool("update-session-seeds", false,
	"rewrite testdata/fuzz/FuzzSession from sessionSeeds")

// TestFuzzSessionSeedCorpus keeps the seed files in testdata in sync with sessionSeeds; run with
// -update-session-seeds to rewrite them. Files not generated (crashers kept as regression
// seeds) are left alone.
func TestFuzzSessionSeedCorpus(t *testing.T) {
	files := map[string]string{}
	for name, b := range sessionSeeds() {
		files[name] = fuzzseed.Bytes(b)
	}
	fuzzseed.Check(t, "FuzzSession", files, *updateSessionSeeds, "go test -run TestFuzzSessionSeedCorpus -update-session-seeds")
}

// TestFuzzSessionSeeds checks that the seeds do what they are named after: the complete ones
// end in a clean disconnect with every request answered.
func TestFuzzSessionSeeds(t *testing.T) {
	for name, b := range sessionSeeds() {
		t.Run(name, func(t *testing.T) {
			res := newSessionRun(t).run(t, b)
			clean := map[string]bool{"realize": true, "start-mem-table": true, "start-mem-slots": true,
				"restart": true, "reset-running": true, "kick-polled": true, "no-protocol-features": true}
			if clean[name] && (res.served != nil || res.nacks != 0) {
				t.Errorf("Serve: %v, %d failure acks; want a clean session", res.served, res.nacks)
			}
			if !clean[name] && res.served == nil && res.nacks == 0 {
				t.Errorf("no request failed")
			}
		})
	}
}

// sessionRun is one fuzzed session.
type sessionRun struct {
	dev *fakeDevice
	b   *Backend
}

func newSessionRun(t testing.TB) *sessionRun {
	dev := newFakeDevice(2)
	return &sessionRun{dev: dev, b: NewBackend(dev, WithPollInterval(time.Millisecond))}
}

// sessionResult is what a session ended with.
type sessionResult struct {
	served error // Serve's result
	nacks  int   // failure acknowledgements
}

// sent is a message the front-end sent.
type sent struct {
	h      Header
	answer bool // a reply may come: it has one, or asked for an acknowledgement
}

func (r *sessionRun) run(t testing.TB, data []byte) sessionResult {
	fdsBefore, mapsBefore := openFDs(t), memfdMappingCount(t)
	fe, be := socketPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- r.b.Serve(ctx, be) }()

	type reply struct {
		m   *Message
		err error
	}
	replies := make(chan reply, 64)
	feConn := NewConn(fe)
	go func() {
		defer close(replies)
		for {
			m, err := feConn.ReadMessage()
			replies <- reply{m, err}
			if err != nil {
				return
			}
		}
	}()

	var msgs []sent
	send := func(h Header, payload []byte) bool {
		fds := sessionFDs(t, h, payload)
		defer closeFDs(fds)
		msgs = append(msgs, sent{h: h, answer: h.Request.HasReply() || h.NeedReply()})
		b := h.Append(nil)
		return feConn.write(append(b, payload...), fds) == nil
	}
	alive := true
	for rest := data; alive && len(rest) > 0; {
		if len(rest) < HeaderSize {
			feConn.write(rest, nil) // a header cut short
			alive = false
			break
		}
		h, _ := ParseHeader(rest[:HeaderSize])
		rest = rest[HeaderSize:]
		if int64(h.Size) > int64(len(rest)) {
			// Cut inside the message: send what there is and hang up.
			b := h.Append(nil)
			feConn.write(append(b, rest...), nil)
			alive = false
			break
		}
		alive = send(h, rest[:h.Size])
		rest = rest[h.Size:]
	}
	if alive {
		send(Header{Request: GetFeatures, Flags: Version}, nil)
	}
	fe.CloseWrite()

	var res sessionResult
	select {
	case res.served = <-served:
	case <-time.After(fuzzSessionTO):
		t.Fatalf("HANG: Serve did not return %v after the front-end hung up", fuzzSessionTO)
	}
	var got []*Message
	for rep := range replies {
		if rep.err != nil {
			if !errors.Is(rep.err, io.EOF) && !errors.Is(rep.err, unix.ECONNRESET) {
				t.Errorf("reading replies: %v", rep.err)
			}
			break
		}
		got = append(got, rep.m)
	}
	fe.Close()

	// Every reply answers, in order, a request that may have one.
	i := 0
	for _, m := range got {
		for i < len(msgs) && !(msgs[i].answer && msgs[i].h.Request == m.Request) {
			if msgs[i].h.Request.HasReply() && res.served == nil {
				t.Errorf("%v got no reply, yet Serve reported a clean disconnect", msgs[i].h.Request)
			}
			i++
		}
		if i == len(msgs) {
			t.Fatalf("reply to %v answers no request sent (requests: %v)", m.Request, sentNames(msgs))
		}
		if err := m.CheckReply(uint32(msgs[i].h.Request)); err != nil {
			t.Errorf("QEMU would refuse this reply: %v", err)
		}
		if len(m.Payload) != 8 || len(m.FDs) != 0 {
			t.Errorf("reply to %v: %d bytes and %d fds, want 8 bytes and none", m.Request, len(m.Payload), len(m.FDs))
		}
		if len(m.Payload) == 8 {
			v := binary.LittleEndian.Uint64(m.Payload)
			want, fixed := map[Request]uint64{
				GetFeatures:         backendFeatures | r.dev.Features()&^transportFeatures,
				GetProtocolFeatures: OfferedProtocolFeatures,
				GetQueueNum:         2,
				GetMaxMemSlots:      MaxMemSlots,
			}[m.Request]
			switch {
			case fixed && v != want:
				t.Errorf("%v answered %#x, want %#x", m.Request, v, want)
			case m.Request == GetVringBase:
				if idx := uint32(v); idx >= 2 {
					t.Errorf("GET_VRING_BASE answered for vring %d", idx)
				}
			case !m.Request.HasReply():
				if v != 0 {
					res.nacks++
				}
			}
		}
		m.Close()
		i++
	}
	if res.served == nil {
		for ; i < len(msgs); i++ {
			if msgs[i].h.Request.HasReply() {
				t.Errorf("%v got no reply, yet Serve reported a clean disconnect", msgs[i].h.Request)
			}
		}
	}
	if n := r.dev.resets.Load(); n == 0 {
		t.Error("the device was not reset when the front-end went away")
	}
	// Serve closed everything before returning; the netpoller may take a moment to let go.
	var fdsAfter int
	for range 50 {
		if fdsAfter = openFDs(t); fdsAfter == fdsBefore {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if fdsAfter != fdsBefore {
		t.Errorf("FD LEAK: %d fds before the session, %d after", fdsBefore, fdsAfter)
	}
	if m := memfdMappingCount(t); m != mapsBefore {
		t.Errorf("MAPPING LEAK: %d memfd mappings before the session, %d after", mapsBefore, m)
	}
	return res
}

func sentNames(msgs []sent) string {
	var names []string
	for _, m := range msgs {
		names = append(names, m.h.Request.String())
	}
	return strings.Join(names, " ")
}

// sessionFDs makes the fds a message calls for: as many as Decode wants (none if it wants none
// or refuses the message whatever the count), of the kind the request takes.
func sessionFDs(t testing.TB, h Header, payload []byte) []int {
	n := 0
	for ; n <= MaxFDs; n++ {
		if _, err := Decode(h.Request, payload, n); err == nil {
			break
		}
	}
	if n > MaxFDs || n == 0 {
		return nil
	}
	fds := make([]int, 0, n)
	for i := range n {
		var fd int
		var err error
		switch h.Request {
		case SetMemTable, AddMemReg:
			off := 8 + regionSize*i
			if h.Request == AddMemReg {
				off = 8
			}
			r := parseRegion(payload[off:])
			fd, err = unix.MemfdCreate("fuzz-region", unix.MFD_CLOEXEC)
			if err == nil {
				size := fuzzMaxMemfd
				if r.MmapOffset < fuzzMaxMemfd && r.Size <= fuzzMaxMemfd-r.MmapOffset {
					size = int(r.MmapOffset + r.Size)
				}
				err = unix.Ftruncate(fd, int64(size))
			}
		case SetBackendReqFD:
			var pair [2]int
			pair, err = unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err == nil {
				unix.Close(pair[1]) // the front-end never reads it: the fake device sends nothing
				fd = pair[0]
			}
		default:
			fd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		}
		if err != nil {
			closeFDs(fds)
			t.Fatalf("making fds for %v: %v", h.Request, err)
		}
		fds = append(fds, fd)
	}
	return fds
}

func memfdMappingCount(t testing.TB) int {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "/memfd:fuzz-region")
}
