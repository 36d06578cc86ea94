package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/internal/testing/nettest"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox/network"
)

// agentGuest returns the guest image with the agent (vmtest.AgentImage builds it when its
// inputs changed) and the accelerator to boot it with.
func agentGuest(t *testing.T) (g vmtest.Guest, accel string) {
	t.Helper()
	if testing.Short() {
		t.Skip("boots a VM (-short)")
	}
	g = vmtest.AgentImage(t)
	accel, why := vmtest.Accel(context.Background(), vmtest.Image(t))
	t.Logf("accelerator %s: %s", accel, why)
	return g, accel
}

// realPod is what a test of a real pod starts from: a directory, a configuration in it that
// boots guest g with accel (512 MiB, sandboxes under the directory), and the pod's owner and
// services with StartQEMUVM, whose events rec records.
func realPod(t *testing.T, g vmtest.Guest, accel string) (dir, cfg string, ctx context.Context, svc services, rec *recorder) {
	dir = shortTempDir(t)
	cfg = filepath.Join(dir, "kvfs.toml")
	os.WriteFile(cfg, []byte(`base_dir = "`+dir+`/sb"
[vm]
accel = "`+accel+`"
memory = "512M"
kernel = "`+g.Kernel+`"
rootfs = "`+g.Root+`"
initrd = "`+g.Initrd+`"
`), 0o644)
	rec = newRecorder()
	ctx = namespaces.WithNamespace(context.Background(), "kvfs-test")
	svc = newServices(NewPod(ctx, Options{Publisher: rec, Shutdown: &fakeShutdown{done: make(chan struct{})}, StartVM: StartQEMUVM}))
	t.Cleanup(func() { svc.Close(context.Background()) })
	return dir, cfg, ctx, svc, rec
}

// busyboxBundle writes a bundle whose rootfs is a static busybox, whose network namespace is
// netns and whose process is args.
func busyboxBundle(t *testing.T, dir, netns string, args ...string) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Fatalf("busybox (Debian's busybox-static, installed by scripts/deps.sh): %v", err)
	}
	b := filepath.Join(dir, "bundle")
	root := filepath.Join(b, "rootfs")
	for _, d := range []string{"bin", "proc", "dev", "sys", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755)
	for _, a := range []string{"sh", "echo", "cat", "ip", "grep"} {
		os.Symlink("busybox", filepath.Join(root, "bin", a))
	}
	spec := specs.Spec{
		Version: specs.Version,
		Root:    &specs.Root{Path: "rootfs"},
		Process: &specs.Process{Args: args, Cwd: "/", Env: []string{"PATH=/bin"}},
		Mounts: []specs.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
			{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.UTSNamespace},
			{Type: specs.MountNamespace}, {Type: specs.NetworkNamespace, Path: netns},
		}},
	}
	js, _ := json.Marshal(&spec)
	if err := os.WriteFile(filepath.Join(b, "config.json"), js, 0o644); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestVMPod boots a real pod: the guest image with the agent under QEMU, behind the task
// service with StartQEMUVM. The pod's network namespace (a veth, eth0, to a client namespace)
// is joined to the VM, whose QEMU runs in that namespace: the container sees eth0's address,
// and the client's ping reaches the guest. The container's process, in the VM, reads its
// stdin and writes to its stdout fifo, exits 3; the last Delete powers the VM off and
// removes the sandbox, the tap and the filter.
func TestVMPod(t *testing.T) {
	g, accel := agentGuest(t)
	podNS, clientNS := nettest.New(t, "kvfs-shimpod"), nettest.New(t, "kvfs-shimclient")
	nettest.Veth(t, podNS, "eth0", []netip.Prefix{netip.MustParsePrefix("10.77.3.2/24")},
		clientNS, "veth-pod", []netip.Prefix{netip.MustParsePrefix("10.77.3.1/24")})
	dir, cfg, ctx, svc, rec := realPod(t, g, accel)

	bundle := busyboxBundle(t, dir, podNS.Path, "sh", "-c",
		"echo hello from the VM; ip -4 addr show eth0 | grep -o 'inet [0-9./]*'; read x; echo got $x; exit 3")
	in := filepath.Join(dir, "in")
	unix.Mkfifo(in, 0o600)
	out := filepath.Join(dir, "out")
	unix.Mkfifo(out, 0o600)
	outFd, err := unix.Open(out, unix.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(outFd)
	opts, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: cfg})
	start := time.Now()
	cr, err := svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: "t1", Bundle: bundle, Stdin: in, Stdout: out, Options: opts})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Create (boot included, %s): %v", accel, time.Since(start).Round(time.Millisecond))
	// The task's pid is QEMU's, which runs in the pod's network namespace, not the shim's.
	var qemuNS, want, own unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/proc/%d/ns/net", cr.Pid), &qemuNS); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(podNS.Path, &want); err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat("/proc/self/ns/net", &own); err != nil {
		t.Fatal(err)
	}
	if qemuNS.Dev != want.Dev || qemuNS.Ino != want.Ino {
		t.Errorf("QEMU (pid %d) is in network namespace %d, want the pod's %d (the shim's is %d)", cr.Pid, qemuNS.Ino, want.Ino, own.Ino)
	}
	if cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", cr.Pid)); !strings.Contains(string(cmdline), "qemu-system") {
		t.Errorf("the task's pid %d is not QEMU: %q", cr.Pid, cmdline)
	}
	sbDir := filepath.Join(dir, "sb", "t1")
	for _, f := range []string{"agent.sock", "control.sock"} {
		if _, err := os.Stat(filepath.Join(sbDir, f)); err != nil {
			t.Errorf("sandbox %s: %v", f, err)
		}
	}
	if _, err := svc.Start(ctx, &taskAPI.StartRequest{ID: "t1"}); err != nil {
		t.Fatal(err)
	}
	var ping []byte
	err = clientNS.Do(func() error {
		var err error
		ping, err = exec.Command("busybox", "ping", "-c", "2", "-W", "5", "10.77.3.2").CombinedOutput()
		return err
	})
	if err != nil {
		t.Errorf("ping the pod from the client namespace: %v\n%s", err, ping)
	}
	w, err := os.OpenFile(in, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	w.Write([]byte("input\n"))
	w.Close()
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	wr, err := svc.Wait(wctx, &taskAPI.WaitRequest{ID: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := drain(outFd); string(got) != "hello from the VM\ninet 10.77.3.2/24\ngot input\n" || wr.ExitStatus != 3 {
		t.Errorf("output %q, exit %d", got, wr.ExitStatus)
	}
	if _, err := svc.Delete(ctx, &taskAPI.DeleteRequest{ID: "t1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sbDir); !os.IsNotExist(err) {
		t.Errorf("the sandbox directory is left: %v", err)
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), dir) {
		t.Errorf("mounts left under %s", dir)
	}
	h := podNS.Handle()
	if _, err := h.LinkByName(network.TapName("t1")); err == nil {
		t.Errorf("the tap is left after the pod's end")
	}
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	qs, err := h.QdiscList(eth0)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range qs {
		if q.Type() == "ingress" {
			t.Errorf("eth0 keeps its ingress qdisc after the pod's end: %v", q)
		}
	}
	if got := strings.Join(eventTypes(rec.all()), " "); got != "Create Start exit:t1 Delete" {
		t.Errorf("events %q", got)
	}
	for _, e := range rec.all() {
		if x, ok := e.(*eventstypes.TaskExit); ok && x.ExitStatus != 3 {
			t.Errorf("TaskExit %+v", x)
		}
	}
	t.Logf("the whole run: %v", time.Since(start).Round(time.Millisecond))
}

// TestVMPodCutOff: the host's answer to a guest it no longer trusts, on a real pod. Two
// containers run; the door cuts the guest off (as three missed deadlines, or a SIGKILL the
// guest does not confirm, would): the VM is killed at once, the container the host was asked
// to kill exits 137 and the other 255, and their Deletes leave nothing: no QEMU, no sandbox
// directory, no mount.
func TestVMPodCutOff(t *testing.T) {
	g, accel := agentGuest(t)
	dir, cfg, ctx, svc, _ := realPod(t, g, accel)
	opts, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: cfg})
	for _, id := range []string{"t1", "t2"} {
		b := busyboxBundle(t, filepath.Join(dir, id), "", "sh", "-c", "while :; do sleep 1; done")
		spec, _ := os.ReadFile(filepath.Join(b, "config.json"))
		var s specs.Spec
		json.Unmarshal(spec, &s)
		s.Annotations = map[string]string{AnnotationSandboxID: "pod"}
		spec, _ = json.Marshal(&s)
		os.WriteFile(filepath.Join(b, "config.json"), spec, 0o644)
		if _, err := svc.Create(ctx, &taskAPI.CreateTaskRequest{ID: id, Bundle: b, Options: opts}); err != nil {
			t.Fatal(err)
		}
		if _, err := svc.Start(ctx, &taskAPI.StartRequest{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	run, err := svc.currentRun()
	if err != nil {
		t.Fatal(err)
	}
	qemu := run.vm.Pid()
	_, p, err := svc.getProcess("t1", "")
	if err != nil {
		t.Fatal(err)
	}
	p.markKilled()
	run.door.cutOff(errors.New("the test cuts the guest off"))
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for id, want := range map[string]uint32{"t1": exitKilled, "t2": exitVMDied} {
		w, err := svc.Wait(wctx, &taskAPI.WaitRequest{ID: id})
		if err != nil {
			t.Fatalf("Wait %s: %v", id, err)
		}
		if w.ExitStatus != want {
			t.Errorf("%s exited %d, want %d", id, w.ExitStatus, want)
		}
	}
	if err := syscall.Kill(int(qemu), 0); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("QEMU (pid %d) after the cut-off: %v, want gone", qemu, err)
	}
	for _, id := range []string{"t1", "t2"} {
		if _, err := svc.Delete(ctx, &taskAPI.DeleteRequest{ID: id}); err != nil {
			t.Fatalf("Delete %s: %v", id, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(dir, "sb", "pod")); !os.IsNotExist(err) {
		t.Errorf("the sandbox directory is left: %v", err)
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), dir) {
		t.Errorf("mounts left under %s", dir)
	}
}
