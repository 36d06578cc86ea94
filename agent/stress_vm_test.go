package agent_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/internal/testing/vmtest"
	"github.com/kvfs/kvfs/sandbox"
)

// TestAgentStress (KVFS_STRESS=N) runs N container lifecycles in one guest, as the shim
// does them (a GetOOMEvent always pending). A call unanswered for 20 s is reported with the
// console; a Ping then tells a lost request (the Ping's bytes wake the agent's reader and
// the stuck call is answered) from a blocked agent (it is not).
func TestAgentStress(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("KVFS_STRESS"))
	if n == 0 {
		t.Skip("KVFS_STRESS=N")
	}
	g := vmtest.AgentImage(t)
	ctx := context.Background()
	s := newSandbox(t, "stress", nil)
	root := busyboxRoot(t)
	vm := s.DefaultVM()
	vm.Accel, vm.Kernel, vm.Initrd, vm.Root = sandbox.AccelTCG, g.Kernel, g.Initrd, g.Root
	vm.Cmdline += " kvfs.debug=1"
	ag, diag := bootAgent(t, s, vm)
	octx, ocancel := context.WithCancel(ctx)
	defer ocancel()
	go func() {
		for octx.Err() == nil {
			ag.GetOOMEvent(octx, &apiv1.GetOOMEventRequest{})
		}
	}()
	call := func(i int, what string, f func(context.Context) error) {
		t.Helper()
		res := make(chan error, 1)
		go func() {
			cctx, cancel := context.WithTimeout(ctx, 120*time.Second)
			defer cancel()
			res <- f(cctx)
		}()
		select {
		case err := <-res:
			if err != nil {
				t.Fatalf("cycle %d: %s: %v\n%s", i, what, err, diag())
			}
			return
		case <-time.After(20 * time.Second):
		}
		t.Logf("cycle %d: %s: no answer in 20s; console now:\n%s", i, what, diag())
		pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
		_, perr := ag.Ping(pctx, &apiv1.PingRequest{})
		pcancel()
		t.Logf("cycle %d: a Ping sent now: %v", i, perr)
		select {
		case err := <-res:
			t.Fatalf("cycle %d: %s answered (%v) once the Ping was sent: a lost wakeup\n%s", i, what, err, diag())
		case <-time.After(10 * time.Second):
			t.Fatalf("cycle %d: %s still unanswered after the Ping\n%s", i, what, diag())
		}
	}
	start := time.Now()
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("s%d", i)
		if err := s.Bind(root, id, 0); err != nil {
			t.Fatal(err)
		}
		call(i, "create", func(c context.Context) error {
			_, err := ag.CreateContainer(c, &apiv1.CreateContainerRequest{ContainerId: id,
				Spec: specJSON(t, id, "true"), Stdio: &apiv1.Stdio{Stdout: true, Stderr: true}})
			return err
		})
		var wg sync.WaitGroup
		for _, rd := range []readFunc{ag.ReadStdout, ag.ReadStderr} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					cctx, cancel := context.WithTimeout(ctx, 60*time.Second)
					r, err := rd(cctx, &apiv1.ReadStreamRequest{ContainerId: id, Max: 4096})
					cancel()
					if err != nil {
						t.Errorf("cycle %d: read: %v", i, err)
						return
					}
					if r.Eof {
						return
					}
				}
			}()
		}
		call(i, "start", func(c context.Context) error {
			_, err := ag.StartProcess(c, &apiv1.StartProcessRequest{ContainerId: id})
			return err
		})
		call(i, "wait", func(c context.Context) error {
			_, err := ag.WaitProcess(c, &apiv1.WaitProcessRequest{ContainerId: id})
			return err
		})
		wg.Wait()
		call(i, "delete", func(c context.Context) error {
			_, err := ag.DeleteProcess(c, &apiv1.DeleteProcessRequest{ContainerId: id})
			return err
		})
		s.Unbind(id)
		if i%20 == 0 {
			t.Logf("cycle %d after %v", i, time.Since(start).Round(time.Second))
		}
	}
	t.Logf("%d cycles in %v", n, time.Since(start).Round(time.Second))
}
