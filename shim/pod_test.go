package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	runcopts "github.com/containerd/containerd/api/types/runc/options"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	"github.com/containerd/containerd/v2/pkg/protobuf/proto"
	cshim "github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"github.com/opencontainers/runtime-spec/specs-go/features"
	"golang.org/x/sys/unix"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/guestimage"
	"github.com/kvfs/kvfs/sandbox"
)

func shortTempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("/tmp", "kvfs-shim-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// TestStartVMPodBootFailure starts a pod whose "QEMU" writes a console line and QEMU's own
// complaint of a PVM host, then exits: the pod's start fails with an error that quotes both
// (the console sanitized) and not the path of a console.log that is gone by then.
func TestStartVMPodBootFailure(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the sandbox bind-mounts its directories")
	}
	dir := shortTempDir(t)
	qemu := filepath.Join(dir, "qemu")
	// The console's pipe is descriptor 3: the pod has no NIC.
	script := `#!/bin/sh
printf '\033[31mLinux version 6.1\r\nKernel panic - not syncing: no init\r\n' >&3
echo 'qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69' >&2
exit 1
`
	if err := os.WriteFile(qemu, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := sandbox.DefaultConfig()
	cfg.BaseDir, cfg.VM.QEMU, cfg.VM.Accel, cfg.VM.Memory = filepath.Join(dir, "sb"), qemu, sandbox.AccelTCG, "512M"
	cfg.VM.Rootfs = "" // the fake QEMU boots nothing
	_, err := StartQEMUVM(context.Background(), PodRequest{ID: "bootfail", Config: cfg})
	if err == nil {
		t.Fatal("the pod started")
	}
	msg := err.Error()
	t.Logf("%s", msg)
	for _, want := range []string{
		"the guest agent of sandbox bootfail: the VM exited before the agent answered",
		"QEMU exited (exit status 1)",
		"QEMU's output, last lines:\n    qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69",
		"the guest's console, last lines:\n    \\x1b[31mLinux version 6.1\n    Kernel panic - not syncing: no init",
	} {
		if !strings.Contains(msg, want) {
			t.Errorf("the error lacks %q", want)
		}
	}
	if strings.Contains(msg, "console.log") {
		t.Error("the error names console.log, which is gone")
	}
	if _, err := os.Stat(filepath.Join(dir, "sb", "bootfail")); !os.IsNotExist(err) {
		t.Errorf("the sandbox directory is left: %v", err)
	}
}

// TestConnectAgent dials an agent that starts serving late, as a booting guest does: the
// connection is retried until Ping answers; a VM that exits first ends the wait with that
// reason; no answer within the timeout is an error naming it.
func TestConnectAgent(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "agent.sock")
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Error(err)
			return
		}
		srv, _ := ttrpc.NewServer()
		agent.RegisterAgentService(srv, newFakeAgent())
		t.Cleanup(func() { srv.Close() })
		srv.Serve(context.Background(), l)
	}()
	var closed atomic.Int32
	start := time.Now()
	client, wire, pong, err := connectAgent(context.Background(), dial, nil, 10*time.Second, func(error) { closed.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	if wire == nil {
		t.Error("no filter below the client")
	}
	if pong.Version != "fake" || time.Since(start) < 300*time.Millisecond {
		t.Errorf("Ping %+v after %v", pong, time.Since(start))
	}
	if _, err := agent.NewAgentClient(client).Ping(context.Background(), &agent.PingRequest{}); err != nil {
		t.Errorf("the returned client: %v", err)
	}
	client.Close()
	waitUntil(t, "onClose runs for the accepted connection", func() bool { return closed.Load() == 1 })

	exited := make(chan struct{})
	close(exited)
	never := func(context.Context) (net.Conn, error) { return nil, syscall.ENOENT }
	if _, _, _, err := connectAgent(context.Background(), never, exited, 10*time.Second, nil); err == nil || !strings.Contains(err.Error(), "the VM exited") {
		t.Errorf("with the VM gone: %v", err)
	}
	if _, _, _, err := connectAgent(context.Background(), never, nil, 300*time.Millisecond, nil); err == nil ||
		!strings.Contains(err.Error(), "agent.boot_timeout 300ms") || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("with no agent: %v", err)
	}

	// A peer that accepts but never answers (a guest that has not opened its port yet,
	// forever): the timeout still ends it.
	sock2 := filepath.Join(shortTempDir(t), "mute.sock")
	l, err := net.Listen("unix", sock2)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	mute := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock2)
	}
	if _, _, _, err := connectAgent(context.Background(), mute, nil, 300*time.Millisecond, nil); err == nil || !strings.Contains(err.Error(), "no answer") {
		t.Errorf("with a mute agent: %v", err)
	}
}

// TestManagerStartJoins: a container whose pod's shim already serves gets that shim's
// address, and the bundle's address file; no process is started.
func TestManagerStartJoins(t *testing.T) {
	dir := shortTempDir(t)
	bundle := filepath.Join(dir, "bundle")
	os.Mkdir(bundle, 0o755)
	spec, _ := json.Marshal(map[string]any{"annotations": map[string]string{AnnotationSandboxID: "pod1", AnnotationContainerType: "container"}})
	os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o644)
	t.Chdir(bundle)
	ctx := namespaces.WithNamespace(context.Background(), "k8s.io")
	socketDir := filepath.Join(dir, "s")
	params := &bootapi.BootstrapParams{InstanceID: "app1", Namespace: "k8s.io", ContainerdGrpcAddress: "/run/ctrd.sock", SocketDir: &socketDir}
	addr, err := cshim.CreateSocketAddress(ctx, socketDir, params.ContainerdGrpcAddress, "pod1", false)
	if err != nil {
		t.Fatal(err)
	}
	l, err := cshim.NewSocket(addr)
	if err != nil {
		t.Fatal(err)
	}
	acceptAndClose(t, l)
	res, err := NewManager(RuntimeName).Start(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	if res.Address != addr || res.Protocol != "ttrpc" || res.Version != 3 {
		t.Errorf("result %+v, want address %s", res, addr)
	}
	if b, _ := os.ReadFile(filepath.Join(bundle, "address")); string(b) != addr {
		t.Errorf("address file %q", b)
	}

	// A CRI container naming no sandbox is refused.
	spec, _ = json.Marshal(map[string]any{"annotations": map[string]string{AnnotationContainerType: "container"}})
	os.WriteFile(filepath.Join(bundle, "config.json"), spec, 0o644)
	if _, err := NewManager(RuntimeName).Start(ctx, params); err == nil || !strings.Contains(err.Error(), "without") {
		t.Errorf("Start of a container without its sandbox: %v", err)
	}
}

// TestManagerInfo: -info answers the name, the version and the options it was given, and the
// features of the image the configuration boots: its runc's, less what the guest has no use
// for; without an image description, no features.
func TestManagerInfo(t *testing.T) {
	dir := t.TempDir()
	image := filepath.Join(dir, "image")
	if err := os.Mkdir(image, 0o755); err != nil {
		t.Fatal(err)
	}
	config := func(name, rootfs string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(fmt.Sprintf("[vm]\nrootfs = %q\n", rootfs)), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	crun := `{"ociVersionMin": "1.0.0", "mountOptions": ["bind", "ro", "rro", "rbind"], "hooks": ["prestart"],
		"linux": {"namespaces": ["mount", "user"], "cgroup": {"v1": true, "v2": true, "systemd": true, "systemdUser": true},
			"apparmor": {"enabled": true}, "selinux": {"enabled": true}},
		"annotations": {"run.oci.crun.version": "1.21", "org.opencontainers.runc.checkpoint.enabled": "true",
			"run.oci.crun.checkpoint.enabled": "true", "run.oci.crun.wasm": "true"}}`
	desc := `{"kvfs_version": "devel", "runtime": {"name": "crun", "package_version": "1.21-1", "features": ` + crun + `}}`
	if err := os.WriteFile(filepath.Join(image, guestimage.DescriptionFile), []byte(desc), 0o644); err != nil {
		t.Fatal(err)
	}

	m := Manager{name: RuntimeName, defaultConfig: config("node.toml", filepath.Join(image, guestimage.RootfsFile))}
	info, err := m.Info(context.Background(), bytes.NewReader(nil))
	if err != nil || info.Name != RuntimeName || info.Version.Version != Version || info.Options != nil || info.Features == nil {
		t.Fatalf("Info without options: %+v, %v", info, err)
	}
	v, err := typeurl.UnmarshalAny(info.Features)
	f, ok := v.(*features.Features)
	if err != nil || !ok {
		t.Fatalf("Info's features: %T, %v", v, err)
	}
	l := f.Linux
	switch {
	case !slices.Contains(f.MountOptions, "rro") || !slices.Equal(l.Namespaces, []string{"mount", "user"}):
		t.Errorf("features %+v: want crun's mount options and namespaces", f)
	case *l.Apparmor.Enabled || *l.Selinux.Enabled || *l.IntelRdt.Enabled:
		t.Errorf("features %+v: AppArmor, SELinux or RDT on", l)
	case !*l.MountExtensions.IDMap.Enabled:
		// This host's kernel (6.x) makes idmapped mounts of overlayfs's layers and of the
		// file systems binds come from.
		t.Errorf("features %+v: idmapped mounts off", l)
	case *l.Cgroup.V1 || !*l.Cgroup.V2 || *l.Cgroup.Systemd || *l.Cgroup.SystemdUser:
		t.Errorf("cgroup features %+v: want v2 alone", l.Cgroup)
	case len(f.Annotations) != 1 || f.Annotations["run.oci.crun.version"] != "1.21":
		t.Errorf("annotations %v", f.Annotations)
	}

	// runc's options with IoUid and IoGid (what containerd's CRI gives a user-namespaced
	// pod's tasks under a handler without options, and asks -info with): the node's
	// configuration, as without options.
	ra, _ := typeurl.MarshalAnyToProto(&runcopts.Options{IoUid: 100000, IoGid: 100000})
	rb, _ := proto.Marshal(ra)
	if info, err := m.Info(context.Background(), bytes.NewReader(rb)); err != nil || info.Features == nil {
		t.Errorf("Info with runc's IoUid and IoGid: %+v, %v; want the features of the node's configuration", info, err)
	}

	// The options' configuration boots an image without a description: no features.
	other := config("other.toml", filepath.Join(dir, "none", guestimage.RootfsFile))
	a, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: other})
	b, _ := proto.Marshal(a)
	info, err = m.Info(context.Background(), bytes.NewReader(b))
	if err != nil || info.Features != nil {
		t.Fatalf("Info with an image without description: %+v, %v", info, err)
	}
	v, err = typeurl.UnmarshalAny(info.Options)
	if o, ok := v.(*runtimeoptions.Options); err != nil || !ok || o.ConfigPath != other {
		t.Errorf("Info options %v, %v", v, err)
	}

	// A configuration that cannot be read is an error that names it.
	a, _ = typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: "/nonexistent/kvfs.toml"})
	b, _ = proto.Marshal(a)
	if _, err := m.Info(context.Background(), bytes.NewReader(b)); err == nil || !strings.Contains(err.Error(), "/nonexistent/kvfs.toml") {
		t.Errorf("Info with a missing configuration: %v", err)
	}
}

// TestCleanup is the delete action's work: the bundle's rootfs unmounted, the sandbox its
// record names removed (here one a dead owner left without state), the record gone, and
// the exit status 137.
func TestCleanup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root")
	}
	dir := shortTempDir(t)
	base := filepath.Join(dir, "sandboxes")
	left := filepath.Join(base, "pod1")
	if err := os.MkdirAll(filepath.Join(left, "mounts"), 0o700); err != nil {
		t.Fatal(err)
	}
	bundle := filepath.Join(dir, "bundles", "c1")
	rootfs := filepath.Join(bundle, "rootfs")
	os.MkdirAll(rootfs, 0o755)
	src := t.TempDir()
	os.WriteFile(filepath.Join(src, "marker"), nil, 0o644)
	if err := unix.Mount(src, rootfs, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(rootfs, unix.MNT_DETACH) })
	if err := writeBundleRecord(bundle, bundleRecord{SandboxID: "pod1", BaseDir: base}); err != nil {
		t.Fatal(err)
	}
	// The dead shim's socket (nothing listens) goes; a served one would stay.
	dead := filepath.Join(dir, "dead.sock")
	l, err := net.Listen("unix", dead)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()
	os.WriteFile(filepath.Join(bundle, "address"), []byte("unix://"+dead), 0o600)
	other := filepath.Join(dir, "bundles", "other")
	os.MkdirAll(other, 0o755)
	t.Chdir(other)
	st, err := NewManager(RuntimeName).Stop(namespaces.WithNamespace(context.Background(), "default"), "c1")
	if err != nil {
		t.Fatal(err)
	}
	if st.ExitStatus != 137 {
		t.Errorf("exit status %d", st.ExitStatus)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "marker")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the rootfs is still mounted: %v", err)
	}
	if _, err := os.Lstat(left); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the sandbox directory is left: %v", err)
	}
	if _, err := os.Stat(filepath.Join(bundle, bundleRecordName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the record is left: %v", err)
	}
	if _, err := os.Lstat(dead); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the dead shim's socket is left: %v", err)
	}
	live := serveSocket(t, filepath.Join(dir, "live.sock"))
	os.WriteFile(filepath.Join(bundle, "address"), []byte("unix://"+live), 0o600)
	if _, err := NewManager(RuntimeName).Stop(namespaces.WithNamespace(context.Background(), "default"), "c1"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(live); err != nil {
		t.Errorf("a served socket was removed: %v", err)
	}
	// Nothing to do a second time.
	if err := Cleanup(context.Background(), bundle); err != nil {
		t.Errorf("second Cleanup: %v", err)
	}
}

// TestCleanupJoinedContainer: containerd runs the delete action on the bundle of each task
// whose connection closed, also of a container that joined its pod's shim while that shim
// still serves the pod. Such a bundle has no address file, only containerd's bootstrap.json
// with the pod shim's address. The action leaves the live pod's sandbox alone and ends at
// once: it does not wait for the pod's lock, which the live shim holds, until containerd
// kills it (after 5 s, which made every CRI container's removal 5 s long).
func TestCleanupJoinedContainer(t *testing.T) {
	dir := shortTempDir(t)
	base := filepath.Join(dir, "sandboxes")
	pod := filepath.Join(base, "pod1")
	if err := os.MkdirAll(pod, 0o700); err != nil {
		t.Fatal(err)
	}
	// The pod's owner holds its lock.
	lock, err := os.OpenFile(filepath.Join(pod, "owner.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	live := serveSocket(t, filepath.Join(dir, "pod.sock"))
	bundle := filepath.Join(dir, "bundles", "c2")
	if err := os.MkdirAll(bundle, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := writeBundleRecord(bundle, bundleRecord{SandboxID: "pod1", BaseDir: base}); err != nil {
		t.Fatal(err)
	}
	bootstrap := `{"version":3,"address":"unix://` + live + `","protocol":"ttrpc"}`
	if err := os.WriteFile(filepath.Join(bundle, "bootstrap.json"), []byte(bootstrap), 0o644); err != nil {
		t.Fatal(err)
	}
	if addr, err := bundleShimAddress(bundle); err != nil || addr != "unix://"+live {
		t.Errorf("bundleShimAddress = %q, %v; want the pod shim's", addr, err)
	}
	other := filepath.Join(dir, "bundles", "other")
	os.MkdirAll(other, 0o755)
	t.Chdir(other)
	done := make(chan error, 1)
	go func() {
		_, err := NewManager(RuntimeName).Stop(namespaces.WithNamespace(context.Background(), "default"), "c2")
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second): // containerd's deadline for the delete action
		t.Fatal("the delete action waits for the live pod's lock")
	}
	if _, err := os.Stat(filepath.Join(pod, "owner.lock")); err != nil {
		t.Errorf("the live pod's sandbox was touched: %v", err)
	}
	if _, err := os.Lstat(live); err != nil {
		t.Errorf("the pod shim's socket was removed: %v", err)
	}

	// A bootstrap.json without an address, or not JSON, is an error that names it.
	for _, body := range []string{`{"version":3}`, `{`} {
		os.WriteFile(filepath.Join(bundle, "bootstrap.json"), []byte(body), 0o644)
		if _, err := bundleShimAddress(bundle); err == nil || !strings.Contains(err.Error(), "bootstrap.json") {
			t.Errorf("bootstrap.json %s: %v", body, err)
		}
	}
}

// serveSocket listens on the unix socket path and serves it (acceptAndClose); it returns path.
func serveSocket(t *testing.T, path string) string {
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	acceptAndClose(t, l)
	return path
}

// acceptAndClose accepts and closes l's connections until the test ends, and closes l then.
func acceptAndClose(t *testing.T, l net.Listener) {
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
}

func TestBootSplit(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	for _, tc := range []struct {
		name     string
		total    time.Duration
		init, up uint64
		want     log.Fields
	}{
		{"split", ms(9000), uint64(ms(5000)), uint64(ms(7500)), log.Fields{"boot_total": ms(9000),
			"boot_qemu": ms(1500), "boot_kernel": ms(5000), "boot_agent": ms(2500)}},
		{"no times", ms(9000), 0, 0, log.Fields{"boot_total": ms(9000)}},
		{"uptime beyond total", ms(9000), uint64(ms(5000)), uint64(ms(9001)), log.Fields{"boot_total": ms(9000)}},
		{"init after uptime", ms(9000), uint64(ms(5000)), uint64(ms(4000)), log.Fields{"boot_total": ms(9000)}},
		{"overflow", ms(9000), 1, 1 << 63, log.Fields{"boot_total": ms(9000)}},
	} {
		got := bootSplit(tc.total, &agent.PingResponse{InitStartedNs: tc.init, UptimeNs: tc.up})
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: bootSplit = %v, want %v", tc.name, got, tc.want)
		}
	}
}
