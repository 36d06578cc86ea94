package agent

import (
	"bytes"
	"context"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestReaper runs the reaper in the test process: a command started through it (as go-runc
// starts runc) gets its own exit and all of its output; a child started otherwise is reported
// to the handler, a killed one as 128 + the signal.
func TestReaper(t *testing.T) {
	r := NewReaper()
	type exit struct{ pid, status int }
	exits := make(chan exit, 10)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		r.Run(ctx, func(pid, status int, _ time.Time) { exits <- exit{pid, status} })
		close(done)
	}()
	defer func() { cancel(); <-done }()

	var out bytes.Buffer
	cmd := exec.Command("sh", "-c", "echo from-runc; exit 7")
	cmd.Stdout = &out
	ch, err := r.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	st, err := r.Wait(cmd, ch)
	if err != nil || st != 7 || out.String() != "from-runc\n" {
		t.Errorf("monitored command: status %d, %v, output %q", st, err, out.String())
	}

	other := exec.Command("sleep", "100")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	if err := other.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-exits:
		if e.pid != other.Process.Pid || e.status != 128+int(syscall.SIGTERM) {
			t.Errorf("handler got %+v, want pid %d status %d", e, other.Process.Pid, 128+int(syscall.SIGTERM))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler never heard of the child's exit")
	}
	select {
	case e := <-exits:
		t.Errorf("the monitored command's exit reached the handler too: %+v", e)
	default:
	}
}
