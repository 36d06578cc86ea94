package agent

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/kubeletvol"
)

// inotifyEvents are the names and masks of the events a non-blocking inotify fd has queued.
func inotifyEvents(t *testing.T, fd int) map[string]uint32 {
	t.Helper()
	got := map[string]uint32{}
	buf := make([]byte, 64<<10)
	n, err := unix.Read(fd, buf)
	if err != nil && err != unix.EAGAIN {
		t.Fatal(err)
	}
	for off := 0; off+unix.SizeofInotifyEvent <= n; {
		var ev unix.InotifyEvent
		binary.Read(bytes.NewReader(buf[off:off+unix.SizeofInotifyEvent]), binary.NativeEndian, &ev)
		name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)], "\x00"))
		got[name] |= ev.Mask
		off += unix.SizeofInotifyEvent + int(ev.Len)
	}
	return got
}

// TestMirrorKubeletUpdate: a volume the kubelet writes atomically is copied whole, and its
// update replayed in the copy: an inotify watch on the copy sees the new directory created,
// ..data moved into place, a new key's link created and the old directory and the key gone
// deleted, as a watch on the kubelet's volume does; what the copy holds is then the new
// content, and nothing else.
func TestMirrorKubeletUpdate(t *testing.T) {
	vol, cp := t.TempDir(), filepath.Join(t.TempDir(), "copy")
	if err := os.Chmod(vol, os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	if err := kubeletvol.Write(vol, "..2026_12_07_01", map[string]string{"a": "one", "gone": "soon"}); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(cp, 0o755); err != nil {
		t.Fatal(err)
	}
	m := newMirrorTree(vol, cp)
	if err := m.sync(); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(cp, "a")); err != nil || string(b) != "one" {
		t.Fatalf("the copy's a: %q, %v", b, err)
	}
	if fi, err := os.Stat(cp); err != nil || fi.Mode() != os.ModeDir|os.ModeSticky|0o777 {
		t.Errorf("the copy's root: %v, %v; want the volume's drwxrwxrwt", fi.Mode(), err)
	}
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, err := unix.InotifyAddWatch(fd, cp, unix.IN_ALL_EVENTS); err != nil {
		t.Fatal(err)
	}
	if err := m.sync(); err != nil {
		t.Fatal(err)
	}
	if ev := inotifyEvents(t, fd); len(ev) != 0 {
		t.Errorf("a sync with nothing new: events %v", ev)
	}

	if err := kubeletvol.Write(vol, "..2026_12_07_02", map[string]string{"a": "two", "b": "new"}); err != nil {
		t.Fatal(err)
	}
	if err := m.sync(); err != nil {
		t.Fatal(err)
	}
	ev := inotifyEvents(t, fd)
	for name, mask := range map[string]uint32{
		"..2026_12_07_02": unix.IN_CREATE, "..data": unix.IN_MOVED_TO, "b": unix.IN_CREATE,
		"..2026_12_07_01": unix.IN_DELETE, "gone": unix.IN_DELETE,
	} {
		if ev[name]&mask == 0 {
			t.Errorf("no event %#x for %s in the copy: %v", mask, name, ev)
		}
	}
	for f, want := range map[string]string{"a": "two", "b": "new", "..data/a": "two"} {
		if b, err := os.ReadFile(filepath.Join(cp, f)); err != nil || string(b) != want {
			t.Errorf("the copy's %s: %q, %v; want %q", f, b, err, want)
		}
	}
	var names []string
	entries, _ := os.ReadDir(cp)
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := []string{"..2026_12_07_02", "..data", "a", "b"}; !slices.Equal(names, want) {
		t.Errorf("the copy holds %q, want %q", names, want)
	}
}

// TestMirroredVolumeReadOnly: a container's mount of a mirrored volume binds the agent's copy,
// made before the runtime runs, read-only even if the spec asked it read-write: the copy is
// the mirror's alone to write.
func TestMirroredVolumeReadOnly(t *testing.T) {
	fx := newFixture(t)
	if err := kubeletvol.Write(filepath.Join(fx.root, "c-0-cfg"), "..2026_12_07_01", map[string]string{"key": "one"}); err != nil {
		t.Fatal(err)
	}
	copyDir := filepath.Join(fx.svc.cfg.MirrorDir, "c-0-cfg")
	b, _ := json.Marshal(&specs.Spec{Version: specs.Version, Process: &specs.Process{Args: []string{"sleep"}, Cwd: "/"},
		Root: &specs.Root{Path: fx.root + "/c"}, Linux: &specs.Linux{},
		Mounts: []specs.Mount{{Destination: "/cfg", Type: "bind", Source: copyDir, Options: []string{"rbind", "rw"}}}})
	if _, err := fx.svc.CreateContainer(fx.ctx, &apiv1.CreateContainerRequest{ContainerId: "c", Spec: b, Mirrored: []string{"c-0-cfg"}}); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(copyDir, "key")); err != nil || string(got) != "one" {
		t.Errorf("the copy's key: %q, %v; want one", got, err)
	}
	if m := fx.bundleSpec(t, "c").Mounts; len(m) != 1 || !slices.Equal(m[0].Options, []string{"rbind", "ro"}) {
		t.Errorf("the mount of the copy in runc's bundle: %+v, want read-only", m)
	}
}
