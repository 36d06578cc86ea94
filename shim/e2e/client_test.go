package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	cgroupstats "github.com/containerd/cgroups/v3/cgroup2/stats"
	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
	"github.com/containerd/typeurl/v2"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kvfs/kvfs/internal/testing/shimtest"
)

// TestCloseIO: through the containerd Go client, stdin's EOF comes from CloseIO: `cat` copies
// its input and exits only once the client closes it. (ctr itself never closes a task's
// stdin, with any runtime.) Meanwhile, Update sets a memory limit the task's metrics show.
func TestCloseIO(t *testing.T) {
	e := newEnv(t, "")
	cl := e.C.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	img, err := cl.GetImage(ctx, e.Image)
	if err != nil {
		t.Fatal(err)
	}
	ctn, err := cl.NewContainer(ctx, "cat",
		client.WithImage(img),
		client.WithNewSnapshot("cat-snapshot", img),
		client.WithRuntime(shimtest.RuntimeType, &runtimeoptions.Options{ConfigPath: e.Config}),
		client.WithNewSpec(oci.WithImageConfig(img), oci.WithProcessArgs("cat")),
	)
	if err != nil {
		t.Fatal(err)
	}
	defer ctn.Delete(context.Background(), client.WithSnapshotCleanup)

	const input = "through stdin\nand EOF by CloseIO\n"
	var stdout, stderr strings.Builder
	task, err := ctn.NewTask(ctx, cio.NewCreator(
		cio.WithStreams(strings.NewReader(input), &stdout, &stderr),
		cio.WithFIFODir(e.C.FIFODir()),
	))
	if err != nil {
		t.Fatal(err)
	}
	defer task.Delete(context.Background(), client.WithProcessKill)
	exited, err := task.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := task.Start(ctx); err != nil {
		t.Fatal(err)
	}
	// cat is still running: its stdin is open.
	select {
	case st := <-exited:
		t.Fatalf("cat exited (%d) before its stdin was closed", st.ExitCode())
	case <-time.After(2 * time.Second):
	}

	// Update reaches the container's cgroup in the guest, as its metrics show.
	limit := int64(96 << 20)
	if err := task.Update(ctx, client.WithResources(&specs.LinuxResources{Memory: &specs.LinuxMemory{Limit: &limit}})); err != nil {
		t.Fatal(err)
	}
	m, err := task.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	v, err := typeurl.UnmarshalAny(m.Data)
	if err != nil {
		t.Fatal(err)
	}
	metrics, ok := v.(*cgroupstats.Metrics)
	if !ok {
		t.Fatalf("metrics are a %T, want cgroup v2 metrics", v)
	}
	if got := metrics.GetMemory().GetUsageLimit(); got != uint64(limit) {
		t.Errorf("memory limit in the guest after Update: %d, want %d", got, limit)
	}
	if metrics.GetMemory().GetUsage() == 0 || metrics.GetPids().GetCurrent() == 0 {
		t.Errorf("metrics: memory usage %d, pids %d; want both non-zero", metrics.GetMemory().GetUsage(), metrics.GetPids().GetCurrent())
	}
	if err := task.CloseIO(ctx, client.WithStdinCloser); err != nil {
		t.Fatal(err)
	}
	select {
	case st := <-exited:
		if st.ExitCode() != 0 {
			t.Errorf("cat exited %d, want 0", st.ExitCode())
		}
	case <-ctx.Done():
		t.Fatal("cat did not exit after CloseIO")
	}
	if _, err := task.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	if stdout.String() != input || stderr.String() != "" {
		t.Errorf("cat's stdout %q, stderr %q; want %q and nothing", stdout.String(), stderr.String(), input)
	}
}
