package frontend

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvfs/kvfs/virtiofs/vhostuser"
	"github.com/kvfs/kvfs/virtiofs/virtq"
)

const cVirtiofsd = "/usr/lib/qemu/virtiofsd"

// TestCVirtiofsdHandshake runs the front-end against the reference C virtiofsd (QEMU 7.2's): the
// QEMU handshake, then one FUSE_INIT on the first request queue, encoded here by hand.
func TestCVirtiofsdHandshake(t *testing.T) {
	if _, err := os.Stat(cVirtiofsd); err != nil {
		t.Skipf("C virtiofsd not installed (%v); apt-get install qemu-system-common", err)
	}
	if os.Geteuid() != 0 {
		t.Skip("the C virtiofsd must run as root")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "shared")
	if err := os.Mkdir(src, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "vfs.sock")
	var out bytes.Buffer
	cmd := exec.Command(cVirtiofsd, "--socket-path="+sock, "-o", "source="+src, "-o", "cache=auto")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("virtiofsd output:\n%s", out.String())
		}
	})

	// virtiofsd creates its listening socket after parsing options; wait for it (or its death).
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-exited:
			t.Fatalf("virtiofsd exited before listening: %v", err)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("virtiofsd did not create its socket")
		}
	}

	ctx := testCtx(t)
	f, err := Dial(ctx, sock, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	t.Logf("features %#x, protocol features %#x, queue num %d, mem slots %d",
		f.offered, f.protocol, f.queueNum, f.maxMemSlots)
	if f.protocol&vhostuser.ProtocolConfigureMemSlots == 0 {
		t.Errorf("C virtiofsd offers CONFIGURE_MEM_SLOTS; protocol features %#x", f.protocol)
	}

	// fuse_in_header (40) + fuse_init_in (64), as two readable buffers like Linux's sg list.
	const (
		opInit   = 26
		initFlag = 0xFFFFFFFF &^ (1 << 30) // everything but INIT_EXT: flags2 is not read
	)
	inHdr, inHdrBuf := f.Alloc(40)
	le := binary.LittleEndian
	le.PutUint32(inHdrBuf[0:], 40+64) // len
	le.PutUint32(inHdrBuf[4:], opInit)
	le.PutUint64(inHdrBuf[8:], 1)  // unique
	le.PutUint64(inHdrBuf[16:], 0) // nodeid
	// uid, gid, pid, total_extlen, padding: 0
	initIn, initInBuf := f.Alloc(64)
	le.PutUint32(initInBuf[0:], 7)      // major
	le.PutUint32(initInBuf[4:], 38)     // minor
	le.PutUint32(initInBuf[8:], 131072) // max_readahead
	le.PutUint32(initInBuf[12:], initFlag)
	le.PutUint32(initInBuf[16:], 0) // flags2
	outHdr, outHdrBuf := f.Alloc(16)
	outArgs, outArgsBuf := f.Alloc(4096)

	written, err := f.Submit(ctx, 1,
		[]virtq.Buf{{Addr: inHdr, Len: 40}, {Addr: initIn, Len: 64}},
		[]virtq.Buf{{Addr: outHdr, Len: 16}, {Addr: outArgs, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	outLen := le.Uint32(outHdrBuf[0:])
	errno := int32(le.Uint32(outHdrBuf[4:]))
	unique := le.Uint64(outHdrBuf[8:])
	major, minor := le.Uint32(outArgsBuf[0:]), le.Uint32(outArgsBuf[4:])
	t.Logf("FUSE_INIT: written %d, out len %d, error %d, unique %d, version %d.%d", written, outLen, errno, unique, major, minor)
	if errno != 0 || unique != 1 || major != 7 {
		t.Fatalf("FUSE_INIT reply: error %d, unique %d, major %d", errno, unique, major)
	}
	if outLen < 16 || written != outLen {
		t.Errorf("out header len %d, device wrote %d", outLen, written)
	}

	// virtiofsd exits when its front-end goes away.
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatal(err)
		}
		exited <- err // for the cleanup
	case <-time.After(10 * time.Second):
		t.Fatal("virtiofsd did not exit after the front-end disconnected")
	}
}
