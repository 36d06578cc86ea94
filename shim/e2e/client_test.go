package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	runtimeoptions "github.com/containerd/containerd/api/types/runtimeoptions/v1"
	"github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/pkg/cio"
	"github.com/containerd/containerd/v2/pkg/oci"
)

// TestCloseIO: through the containerd Go client, stdin's EOF comes from CloseIO: `cat` copies
// its input and exits only once the client closes it. (ctr itself never closes a task's
// stdin, with any runtime.)
func TestCloseIO(t *testing.T) {
	e := newEnv(t, "")
	cl := e.c.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	img, err := cl.GetImage(ctx, e.image)
	if err != nil {
		t.Fatal(err)
	}
	ctn, err := cl.NewContainer(ctx, "cat",
		client.WithImage(img),
		client.WithNewSnapshot("cat-snapshot", img),
		client.WithRuntime(runtimeType, &runtimeoptions.Options{ConfigPath: e.config}),
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
		cio.WithFIFODir(e.c.FIFODir()),
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
