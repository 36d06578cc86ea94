package virtiofs_test

// Hostile front-ends at the vhost-user level: malformed messages, and a front-end that hangs
// up inside every message and comes back.

import (
	"context"
	"encoding/binary"
	"math"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/testing/frontend"
	"github.com/kvfs/kvfs/virtiofs/vhostuser"
)

// ---------------------------------------------------------------------------------------------
// vhost-user level: malformed messages from the front-end, each on a fresh server.

// countMemfdMappings counts the memfd mappings of the process: guest memory mapped by the
// back-end and the front-end.
func countMemfdMappings(t *testing.T) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(maps), "/memfd:")
}

func countOpenFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func vringStatePayload(idx, num uint32) []byte {
	return vhostuser.VringState{Index: idx, Num: num}.Append(nil)
}

func memTablePayload(n uint32, rs ...vhostuser.MemoryRegion) []byte {
	b := binary.LittleEndian.AppendUint32(nil, n)
	b = binary.LittleEndian.AppendUint32(b, 0)
	for _, r := range rs {
		b = r.Append(b)
	}
	return b
}

// vuOutcome is how a hostile message must end.
type vuOutcome int

const (
	vuClosed vuOutcome = iota // Serve returns an error and the connection is gone
	vuNacked                  // the message is answered with a failure ack; the connection works
)

type vuCase struct {
	name string
	want vuOutcome
	// send sends the hostile message and returns the raw reply, if any was read.
	send func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error)
}

func rawMsg(req vhostuser.Request, flags uint32, payload []byte, fds ...int) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
		return g.fe.Client().Raw(uint32(req), flags, payload, fds)
	}
}

// rawBytes writes bytes on the socket as they are, and half-closes it if eof.
func rawWire(b []byte, eof bool) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
		uc := g.fe.Client().Conn().UnixConn()
		if _, err := uc.Write(b); err != nil {
			return nil, err
		}
		if eof {
			return nil, uc.CloseWrite()
		}
		return nil, nil
	}
}

func wireHeader(req vhostuser.Request, flags, size uint32) []byte {
	return vhostuser.Header{Request: req, Flags: flags, Size: size}.Append(nil)
}

func vuCases() []vuCase {
	const v, ack = vhostuser.Version, vhostuser.Version | vhostuser.FlagNeedReply
	region := func(gpa, size uint64) vhostuser.MemoryRegion {
		return vhostuser.MemoryRegion{GuestPhysAddr: gpa, Size: size, UserAddr: 0x7000_0000_0000 + gpa}
	}
	nine := make([]vhostuser.MemoryRegion, 9)
	for i := range nine {
		nine[i] = region(uint64(i)<<20, 1<<20)
	}
	memTableWith := func(flags uint32, nfds int, n uint32, rs ...vhostuser.MemoryRegion) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			fds := make([]int, nfds)
			for i := range fds {
				fds[i] = memfd
			}
			return g.fe.Client().Raw(uint32(vhostuser.SetMemTable), flags, memTablePayload(n, rs...), fds)
		}
	}
	withFD := func(req vhostuser.Request, flags uint32, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			return g.fe.Client().Raw(uint32(req), flags, payload, []int{fd})
		}
	}
	threeFDs := func(req vhostuser.Request, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
		return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(req), v, payload, []int{memfd, memfd, memfd})
		}
	}
	u64 := func(x uint64) []byte { return binary.LittleEndian.AppendUint64(nil, x) }
	vringFile := func(idx uint64) []byte { return u64(idx) }
	return []vuCase{
		{"SET_MEM_TABLE claiming 9 regions with 8 fds", vuClosed, memTableWith(v, 8, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with 8 fds, NEED_REPLY", vuNacked, memTableWith(ack, 8, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with 9 fds", vuClosed, memTableWith(ack, 9, 9, nine...)},
		{"SET_MEM_TABLE claiming 9 regions with no fds", vuNacked, memTableWith(ack, 0, 9, nine...)},
		{"SET_MEM_TABLE claiming 2^32-1 regions", vuNacked, memTableWith(ack, 1, math.MaxUint32, nine[0])},
		{"SET_MEM_TABLE claiming 1 region carrying 2", vuNacked, memTableWith(ack, 1, 1, nine[0], nine[1])},
		{"SET_MEM_TABLE region of 2^50 bytes", vuNacked, memTableWith(ack, 1, 1, region(0, 1<<50))},
		{"SET_MEM_TABLE region of 2^50 bytes, no reply asked", vuClosed, memTableWith(v, 1, 1, region(0, 1<<50))},
		{"SET_MEM_TABLE region larger than its memfd", vuNacked, memTableWith(ack, 1, 1, region(0, 2*hostileMemSize))},
		{"SET_MEM_TABLE region of 2^64-1 bytes", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{Size: math.MaxUint64})},
		{"SET_MEM_TABLE region wrapping around 2^64", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{GuestPhysAddr: math.MaxUint64 - 4095, Size: 8192, UserAddr: 1 << 40})},
		{"SET_MEM_TABLE region of 0 bytes", vuNacked, memTableWith(ack, 1, 1, region(0, 0))},
		{"SET_MEM_TABLE overlapping regions", vuNacked, memTableWith(ack, 2, 2, region(0, 1<<20), region(4096, 1<<20))},
		{"SET_MEM_TABLE mmap offset past the memfd", vuNacked, memTableWith(ack, 1, 1,
			vhostuser.MemoryRegion{Size: 1 << 20, UserAddr: 1 << 40, MmapOffset: hostileMemSize})},
		{"ADD_MEM_REG of 2^50 bytes", vuNacked, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack,
				vhostuser.SingleRegion{Region: region(1<<40, 1<<50)}.Append(nil), []int{memfd})
		}},
		{"ADD_MEM_REG overlapping guest memory", vuNacked, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			return g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack,
				vhostuser.SingleRegion{Region: region(4096, 4096)}.Append(nil), []int{memfd})
		}},
		{"REM_MEM_REG of an unknown region", vuNacked, rawMsg(vhostuser.RemMemReg, ack,
			vhostuser.SingleRegion{Region: region(1<<40, 4096)}.Append(nil))},
		{"SET_VRING_NUM 1000 (not a power of two)", vuClosed, rawMsg(vhostuser.SetVringNum, v, vringStatePayload(5, 1000))},
		{"SET_VRING_NUM 1000, NEED_REPLY", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 1000))},
		{"SET_VRING_NUM 0", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 0))},
		{"SET_VRING_NUM 65536", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, 65536))},
		{"SET_VRING_NUM 2^32-1", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(5, math.MaxUint32))},
		{"SET_VRING_NUM on a running vring", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(1, 3))},
		{"SET_VRING_NUM vring 17 (out of range)", vuClosed, rawMsg(vhostuser.SetVringNum, v, vringStatePayload(17, 256))},
		{"SET_VRING_NUM vring 2^32-1", vuNacked, rawMsg(vhostuser.SetVringNum, ack, vringStatePayload(math.MaxUint32, 256))},
		{"SET_VRING_BASE vring 1000", vuNacked, rawMsg(vhostuser.SetVringBase, ack, vringStatePayload(1000, 0))},
		{"SET_VRING_BASE wider than 16 bits", vuNacked, rawMsg(vhostuser.SetVringBase, ack, vringStatePayload(5, 1<<16))},
		{"SET_VRING_ENABLE vring 99", vuNacked, rawMsg(vhostuser.SetVringEnable, ack, vringStatePayload(99, 1))},
		{"SET_VRING_ENABLE value 2", vuNacked, rawMsg(vhostuser.SetVringEnable, ack, vringStatePayload(1, 2))},
		{"GET_VRING_BASE vring 99", vuClosed, rawMsg(vhostuser.GetVringBase, v, vringStatePayload(99, 0))},
		{"SET_VRING_ADDR vring 40", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 40}.Append(nil))},
		{"SET_VRING_ADDR misaligned", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 5, Desc: 8}.Append(nil))},
		{"SET_VRING_ADDR unknown flags", vuNacked, rawMsg(vhostuser.SetVringAddr, ack, vhostuser.VringAddr{Index: 5, Flags: 6}.Append(nil))},
		{"SET_VRING_ADDR outside guest memory, then SET_VRING_KICK", vuClosed, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			c := g.fe.Client()
			if err := c.SetVringNum(5, 256); err != nil {
				return nil, err
			}
			if err := c.SetVringAddr(vhostuser.VringAddr{Index: 5, Desc: 1 << 44, Avail: 1<<44 + 4096, Used: 1<<44 + 8192}); err != nil {
				return nil, err
			}
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			return nil, c.SetVringKick(5, fd)
		}},
		{"SET_VRING_KICK vring 200 with an fd", vuClosed, withFD(vhostuser.SetVringKick, v, vringFile(200))},
		{"SET_VRING_KICK vring 200, NEED_REPLY", vuNacked, withFD(vhostuser.SetVringKick, ack, vringFile(200))},
		{"SET_VRING_CALL vring 255", vuNacked, withFD(vhostuser.SetVringCall, ack, vringFile(255))},
		{"SET_VRING_ERR vring 17", vuNacked, withFD(vhostuser.SetVringErr, ack, vringFile(17))},
		{"SET_VRING_CALL reserved bits", vuNacked, withFD(vhostuser.SetVringCall, ack, vringFile(1|1<<9))},
		{"SET_VRING_KICK announcing an fd but sending none", vuNacked, rawMsg(vhostuser.SetVringKick, ack, vringFile(1))},
		{"SET_VRING_KICK NOFD with an fd attached", vuNacked, withFD(vhostuser.SetVringKick, ack, vringFile(1|1<<8))},
		{"GET_FEATURES with 3 fds attached", vuClosed, threeFDs(vhostuser.GetFeatures, nil)},
		{"SET_FEATURES not offered", vuNacked, rawMsg(vhostuser.SetFeatures, ack, u64(math.MaxUint64))},
		{"SET_PROTOCOL_FEATURES not offered", vuNacked, rawMsg(vhostuser.SetProtocolFeatures, ack, u64(vhostuser.ProtocolConfig))},
		{"SET_OWNER twice", vuNacked, rawMsg(vhostuser.SetOwner, ack, nil)},
		{"SET_LOG_BASE", vuNacked, withFD(vhostuser.SetLogBase, ack, make([]byte, 16))},
		{"unknown request 0", vuClosed, rawMsg(0, v, nil)},
		{"unknown request 41, NEED_REPLY", vuNacked, rawMsg(41, ack, nil)},
		{"unknown request 1000", vuClosed, rawMsg(1000, v, u64(7))},
		{"unknown request 2^32-1", vuClosed, rawMsg(math.MaxUint32, v, nil)},
		{"opaque request with a payload and fds", vuNacked, threeFDsAck(vhostuser.GetInflightFD, make([]byte, 24))},
		{"header flags with the reply bit", vuClosed, rawMsg(vhostuser.GetFeatures, vhostuser.Version|vhostuser.FlagReply, nil)},
		{"header version 2", vuClosed, rawMsg(vhostuser.GetFeatures, 2, nil)},
		{"header unknown flag bits", vuClosed, rawMsg(vhostuser.SetOwner, v|1<<20, nil)},
		{"payload size 2^32-1", vuClosed, rawWire(wireHeader(vhostuser.SetFeatures, v, math.MaxUint32), false)},
		{"payload size 4097", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 4097), make([]byte, 4097)...), false)},
		{"payload shorter than its size, then EOF", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 100), u64(0)...), true)},
		{"header cut short, then EOF", vuClosed, rawWire(wireHeader(vhostuser.SetFeatures, v, 8)[:7], true)},
		{"payload size 4 for a u64", vuClosed, rawWire(append(wireHeader(vhostuser.SetFeatures, v, 4), 0, 0, 0, 0), false)},
		{"payload size 4 for a u64, NEED_REPLY", vuNacked, rawWire(append(wireHeader(vhostuser.SetFeatures, ack, 4), 0, 0, 0, 0), false)},
		{"payload size swallowing the next message", vuClosed, rawWire(append(append(wireHeader(vhostuser.SetVringNum, v, 20),
			vringStatePayload(5, 256)...), wireHeader(vhostuser.GetFeatures, v, 0)...), false)},
		{"payload size 0 for a vring state", vuNacked, rawWire(wireHeader(vhostuser.SetVringNum, ack, 0), false)},
		{"SET_VRING_CALL with 200 fds", vuClosed, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			fds := make([]int, 200)
			for i := range fds {
				fds[i] = fd
			}
			return g.fe.Client().Raw(uint32(vhostuser.SetVringCall), v, vringFile(1), fds)
		}},
		{"fds sent with the header and more with the payload", vuClosed, func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
			uc := g.fe.Client().Conn().UnixConn()
			fds := []int{memfd, memfd, memfd, memfd, memfd}
			if _, _, err := uc.WriteMsgUnix(wireHeader(vhostuser.SetVringCall, v, 8), unix.UnixRights(fds...), nil); err != nil {
				return nil, err
			}
			_, _, err := uc.WriteMsgUnix(vringFile(1), unix.UnixRights(fds...), nil)
			return nil, err
		}},
		{"ADD_MEM_REG beyond the slots", vuNacked, func(t *testing.T, g *hostileGuest, _ int) ([]byte, error) {
			fd, err := unix.MemfdCreate("kvfs-hostile-slot", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			hostileMust(t, unix.Ftruncate(fd, 4096))
			for i := range uint64(vhostuser.MaxMemSlots) {
				r := region(1<<40+i<<20, 4096)
				reply, err := g.fe.Client().Raw(uint32(vhostuser.AddMemReg), ack, vhostuser.SingleRegion{Region: r}.Append(nil), []int{fd})
				if err != nil || binary.LittleEndian.Uint64(reply) != 0 {
					return reply, err // the slot after the last
				}
			}
			t.Fatalf("%d regions accepted, at most %d allowed", vhostuser.MaxMemSlots+1, vhostuser.MaxMemSlots)
			return nil, nil
		}},
	}
}

func threeFDsAck(req vhostuser.Request, payload []byte) func(*testing.T, *hostileGuest, int) ([]byte, error) {
	return func(t *testing.T, g *hostileGuest, memfd int) ([]byte, error) {
		return g.fe.Client().Raw(uint32(req), vhostuser.Version|vhostuser.FlagNeedReply, payload, []int{memfd, memfd, memfd})
	}
}

// readAck reads the REPLY_ACK the back-end owes for a message sent with rawBytes.
func readAck(g *hostileGuest) ([]byte, error) {
	m, err := g.fe.Client().Conn().ReadMessage()
	if err != nil {
		return nil, err
	}
	defer m.Close()
	return m.Payload, nil
}

// TestHostileVhostUser sends malformed vhost-user messages, each on a fresh connection to a
// fresh server. Each must be refused (a failure ack, the connection still usable) or end the
// connection (Serve returns an error); never a panic, a hang or a leaked fd, and a new server
// on a new connection must work afterwards.
func TestHostileVhostUser(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	cfg := virtiofs.Config{SharedDir: h.share}
	opts := frontend.Options{MemSize: hostileMemSize, QueueSize: hostileQueueSize}

	// Warm up: the first connection creates process-wide fds (the netpoller's) that stay.
	func() {
		hs := startHostileServer(t, cfg)
		g := dialHostile(t, hs.sock, opts)
		g.healthy(t)
		g.fe.Close()
		hs.served(t)
		hs.srv.Close()
	}()

	for _, vc := range vuCases() {
		t.Run(vc.name, func(t *testing.T) {
			before, mapsBefore := countOpenFDs(t), countMemfdMappings(t)
			func() {
				hs := startHostileServer(t, cfg)
				g := dialHostile(t, hs.sock, opts)
				memfd := frontendMemfd(t, g.fe)
				reply, err := vc.send(t, g, memfd)
				switch vc.want {
				case vuClosed:
					serr := hs.served(t)
					if serr == nil {
						t.Errorf("Serve returned nil; want an error (send: %v)", err)
					} else {
						t.Logf("Serve: %v", serr)
					}
				case vuNacked:
					if reply == nil && err == nil {
						reply, err = readAck(g)
					}
					if err != nil {
						t.Fatalf("want a failure ack, got %v (Serve: %v)", err, func() error {
							select {
							case e := <-hs.done:
								return e
							case <-time.After(time.Second):
								return nil
							}
						}())
					}
					if len(reply) != 8 || binary.LittleEndian.Uint64(reply) == 0 {
						t.Fatalf("want a failure ack, got reply %x", reply)
					}
					hs.stillServing(t)
					g.healthy(t)
				}
				g.fe.Close()
				if vc.want != vuClosed {
					if err := hs.served(t); err != nil {
						t.Errorf("Serve after a clean disconnect: %v", err)
					}
				}
				if c, err := net.Dial("unix", hs.sock); err == nil {
					c.Close()
					t.Error("the listener still accepts connections after Serve returned")
				}
				hs.srv.Close()
			}()
			var after int
			for range 50 { // closes are synchronous; retry only to ride out a stray runtime fd
				if after = countOpenFDs(t); after == before {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if after != before {
				t.Errorf("FD LEAK: %d fds open before, %d after", before, after)
			}
			if m := countMemfdMappings(t); m != mapsBefore {
				t.Errorf("MAPPING LEAK: %d memfd mappings before, %d after", mapsBefore, m)
			}
			// A new server on a new connection works.
			hs := startHostileServer(t, cfg)
			g := dialHostile(t, hs.sock, opts)
			g.healthy(t)
			g.fe.Close()
			hs.served(t)
			h.check(t)
		})
	}
}

// midMessagePayload is a well-formed payload of req (8 bytes for those that take none or whose
// layout kvfsd does not read), with the fd it carries, if any.
func midMessagePayload(t *testing.T, req vhostuser.Request) ([]byte, int) {
	t.Helper()
	region := vhostuser.MemoryRegion{Size: 1 << 20, UserAddr: 0x7000_0000_0000}
	var p []byte
	switch req {
	case vhostuser.SetMemTable:
		p = vhostuser.MemoryTable{Regions: []vhostuser.MemoryRegion{region}}.Append(nil)
	case vhostuser.AddMemReg, vhostuser.RemMemReg:
		p = vhostuser.SingleRegion{Region: region}.Append(nil)
	case vhostuser.SetVringAddr:
		p = vhostuser.VringAddr{Index: 1, Desc: 0x1000, Avail: 0x2000, Used: 0x3000}.Append(nil)
	case vhostuser.SetLogBase:
		p = vhostuser.LogBase{MmapSize: 4096}.Append(nil)
	case vhostuser.SetVringKick, vhostuser.SetVringCall, vhostuser.SetVringErr:
		p = vhostuser.VringFile{Index: 1}.Append(nil)
	default:
		p = vhostuser.VringState{Index: 1, Num: 1}.Append(nil) // any 8 bytes
	}
	switch req {
	case vhostuser.SetMemTable, vhostuser.AddMemReg, vhostuser.RemMemReg, vhostuser.SetVringKick,
		vhostuser.SetVringCall, vhostuser.SetVringErr, vhostuser.SetLogBase, vhostuser.SetLogFD,
		vhostuser.SetBackendReqFD, vhostuser.SetInflightFD:
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
		hostileMust(t, err)
		return p, fd
	}
	return p, -1
}

// TestHostileDisconnectMidMessage: a running front-end hangs up inside a message, for every
// vhost-user request: after part of the header, and after the header and part of the payload
// (with the message's fd attached). Serve returns, nothing the session held stays open or
// mapped, and the same server accepts the next front-end and serves it.
func TestHostileDisconnectMidMessage(t *testing.T) {
	hostileNeedsRoot(t)
	h := newHostileShare(t)
	s, err := virtiofs.NewServer(virtiofs.Config{SharedDir: h.share})
	hostileMust(t, err)
	t.Cleanup(func() { s.Close() })
	serve := func(t *testing.T) (string, chan error) {
		sock := filepath.Join(t.TempDir(), "vhost-fs.sock")
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		hostileMust(t, err)
		done := make(chan error, 1)
		go func() { done <- s.Serve(context.Background(), l) }()
		return sock, done
	}
	served := func(t *testing.T, done chan error) error {
		t.Helper()
		select {
		case err := <-done:
			return err
		case <-time.After(hostileTimeout):
			t.Fatal("HANG: Serve did not return after the front-end hung up")
			return nil
		}
	}
	// Warm up: the first session creates process-wide fds (the netpoller's) that stay.
	sock, done := serve(t)
	g := dialHostile(t, sock, hostileOpts())
	g.healthy(t)
	g.fe.Close()
	served(t, done)

	var reqs []vhostuser.Request
	for r := vhostuser.Request(1); r < 64; r++ {
		if !strings.HasPrefix(r.String(), "REQUEST_") {
			reqs = append(reqs, r)
		}
	}
	if len(reqs) < 30 {
		t.Fatalf("only %d vhost-user requests known", len(reqs))
	}
	for _, req := range reqs {
		for _, cut := range []string{"header", "payload"} {
			t.Run(req.String()+"/"+cut, func(t *testing.T) {
				fdsBefore, mapsBefore := countOpenFDs(t), countMemfdMappings(t)
				sock, done := serve(t)
				g := dialHostile(t, sock, hostileOpts())
				g.healthy(t)
				payload, fd := midMessagePayload(t, req)
				msg := vhostuser.Header{Request: req, Flags: vhostuser.Version, Size: uint32(len(payload))}.Append(nil)
				msg = append(msg, payload...)
				uc := g.fe.Client().Conn().UnixConn()
				var werr error
				if cut == "header" {
					_, werr = uc.Write(msg[:5])
				} else {
					var oob []byte
					if fd >= 0 {
						oob = unix.UnixRights(fd)
					}
					_, _, werr = uc.WriteMsgUnix(msg[:vhostuser.HeaderSize+len(payload)/2], oob, nil)
				}
				if fd >= 0 {
					unix.Close(fd)
				}
				hostileMust(t, werr)
				g.fe.Close()
				if err := served(t, done); err == nil {
					t.Error("Serve returned nil for a front-end that hung up inside a message")
				}
				var after int
				for range 50 {
					if after = countOpenFDs(t); after == fdsBefore {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				if after != fdsBefore {
					t.Errorf("FD LEAK: %d fds open before the session, %d after", fdsBefore, after)
				}
				if m := countMemfdMappings(t); m != mapsBefore {
					t.Errorf("MAPPING LEAK: %d memfd mappings before, %d after", mapsBefore, m)
				}
				// The same server serves the next front-end.
				sock, done = serve(t)
				g = dialHostile(t, sock, hostileOpts())
				g.healthy(t)
				g.fe.Close()
				if err := served(t, done); err != nil {
					t.Errorf("Serve after the next front-end's clean disconnect: %v", err)
				}
			})
		}
	}
	h.check(t)
}
