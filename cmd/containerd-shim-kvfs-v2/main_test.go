package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	bootapi "github.com/containerd/containerd/api/runtime/bootstrap/v1"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v3"
	"github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/pkg/protobuf/proto"
	"github.com/containerd/ttrpc"
	"github.com/containerd/typeurl/v2"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestShimBinary runs the built shim as containerd v2.4 does, without containerd and without
// a VM: the start action answers a bootstrap result and leaves a shim serving the task API
// on it; a Create with a bad configuration fails at the ttrpc edge as InvalidArgument naming
// the key; Shutdown ends the shim; the delete action answers exit status 137.
func TestShimBinary(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "kvfs-shimbin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	bin := filepath.Join(dir, "containerd-shim-kvfs-v2")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	bundle := filepath.Join(dir, "t1")
	os.Mkdir(bundle, 0o755)
	os.WriteFile(filepath.Join(bundle, "config.json"), []byte(`{"ociVersion":"1.2.0","process":{"args":["true"],"cwd":"/"},"root":{"path":"rootfs"}}`), 0o644)
	if err := unix.Mkfifo(filepath.Join(bundle, "log"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The shim's log, as containerd reads it.
	logR, err := os.OpenFile(filepath.Join(bundle, "log"), os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer logR.Close()
	var logBuf bytes.Buffer
	logDone := make(chan struct{})
	go func() {
		defer close(logDone)
		buf := make([]byte, 4096)
		for {
			n, err := logR.Read(buf)
			logBuf.Write(buf[:n])
			if errors.Is(err, os.ErrClosed) {
				return
			}
			if n == 0 {
				time.Sleep(20 * time.Millisecond)
			}
		}
	}()
	// containerd's event socket: accepted, never read (no event is sent here).
	evSock := filepath.Join(dir, "ev.sock")
	evl, err := net.Listen("unix", evSock)
	if err != nil {
		t.Fatal(err)
	}
	defer evl.Close()
	evSrv, _ := ttrpc.NewServer()
	go evSrv.Serve(context.Background(), evl)
	defer evSrv.Close()

	socketDir := filepath.Join(dir, "s")
	params := &bootapi.BootstrapParams{InstanceID: "t1", Namespace: "kvfs-test", ContainerdGrpcAddress: filepath.Join(dir, "ctrd.sock"),
		ContainerdTtrpcAddress: evSock, SocketDir: &socketDir, LogLevel: bootapi.LogLevel_LOG_LEVEL_DEBUG}
	in, _ := proto.Marshal(params)
	run := func(action string, stdin []byte) []byte {
		t.Helper()
		cmd := exec.Command(bin, "-namespace", "kvfs-test", "-id", "t1", "-address", params.ContainerdGrpcAddress, action)
		cmd.Dir = bundle
		cmd.Env = append(os.Environ(), "TTRPC_ADDRESS="+evSock)
		cmd.Stdin = bytes.NewReader(stdin)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v\n%s", action, err, stderr.String())
		}
		return out
	}
	var res bootapi.BootstrapResult
	if err := proto.Unmarshal(run("start", in), &res); err != nil {
		t.Fatal(err)
	}
	if res.Protocol != "ttrpc" || !strings.HasPrefix(res.Address, "unix://"+socketDir+"/") {
		t.Fatalf("bootstrap result %+v", &res)
	}
	if b, _ := os.ReadFile(filepath.Join(bundle, "address")); string(b) != res.Address {
		t.Errorf("address file %q", b)
	}
	conn, err := net.Dial("unix", strings.TrimPrefix(res.Address, "unix://"))
	if err != nil {
		t.Fatalf("the shim does not serve its socket: %v", err)
	}
	client := ttrpc.NewClient(conn)
	defer client.Close()
	task := taskAPI.NewTTRPCTaskClient(client)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := task.Connect(ctx, &taskAPI.ConnectRequest{ID: "t1"})
	if err != nil {
		t.Fatal(err)
	}
	shimPid := int(c.ShimPid)
	if shimPid <= 0 || c.Version == "" {
		t.Errorf("Connect %+v", c)
	}
	t.Cleanup(func() { syscall.Kill(shimPid, syscall.SIGKILL) })

	bad := filepath.Join(dir, "bad.toml")
	os.WriteFile(bad, []byte("[agent]\ntransport = \"carrier-pigeon\"\n"), 0o644)
	opts, _ := typeurl.MarshalAnyToProto(&runtimeoptions.Options{ConfigPath: bad})
	_, err = task.Create(ctx, &taskAPI.CreateTaskRequest{ID: "t1", Bundle: bundle, Options: opts})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `agent.transport = "carrier-pigeon"`) {
		t.Errorf("Create with a bad configuration: %v (%v)", err, status.Code(err))
	}
	if _, err := task.State(ctx, &taskAPI.StateRequest{ID: "t1"}); status.Code(err) != codes.NotFound {
		t.Errorf("State after the failed Create: %v", err)
	}
	if _, err := task.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "t1"}); status.Code(err) != codes.Unimplemented {
		t.Errorf("Checkpoint: %v", err)
	}
	task.Shutdown(ctx, &taskAPI.ShutdownRequest{ID: "t1"})
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(shimPid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if err := syscall.Kill(shimPid, 0); err == nil {
		// A zombie counts as gone: the shim's parent (the start action) has exited.
		if st, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(shimPid), "stat")); !strings.Contains(string(st), ") Z") {
			t.Errorf("the shim (pid %d) still runs after Shutdown", shimPid)
		}
	}
	if _, err := os.Stat(strings.TrimPrefix(res.Address, "unix://")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the shim's socket is left: %v", err)
	}

	var del taskAPI.DeleteResponse
	if err := proto.Unmarshal(run("delete", nil), &del); err != nil {
		t.Fatal(err)
	}
	if del.ExitStatus != 137 {
		t.Errorf("delete answered %+v", &del)
	}
	logR.Close()
	<-logDone
	if !strings.Contains(logBuf.String(), "level=debug") {
		t.Errorf("no debug lines in the shim's log with -debug:\n%s", logBuf.String())
	}
}
