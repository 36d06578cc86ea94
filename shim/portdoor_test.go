package shim

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	agent "github.com/kvfs/kvfs/api/agent/v1"
)

// lyingPorts answers the port calls as a hostile guest may: more bytes than asked, more taken
// than sent, or not at all.
type lyingPorts struct {
	*fakeAgent
	silent chan struct{} // OpenPort and WritePort wait for it when set
}

func (l *lyingPorts) ReadPort(_ context.Context, r *agent.ReadPortRequest) (*agent.ReadPortResponse, error) {
	return &agent.ReadPortResponse{Data: make([]byte, r.Max+1)}, nil
}

func (l *lyingPorts) WritePort(ctx context.Context, r *agent.WritePortRequest) (*agent.WritePortResponse, error) {
	if l.silent != nil {
		select {
		case <-l.silent:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &agent.WritePortResponse{Written: uint32(len(r.Data)) + 1}, nil
}

// TestDoorPortAnswers: a read answer longer than asked and a write that took more than it was
// sent are violations, the third cuts the guest off; a write the agent does not answer misses
// its deadline (PortWriteWait and Query).
func TestDoorPortAnswers(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var failed error
	l := &lyingPorts{fakeAgent: newFakeAgent()}
	d := newAgentDoor(ctx, ctx, l, GuestLimits{Query: 100 * time.Millisecond}.withDefaults(), &guestLogger{}, func(why error) { failed = why })

	if _, err := d.ReadPort(ctx, &agent.ReadPortRequest{Id: 1, Max: 8}); err == nil || !strings.Contains(err.Error(), "9 bytes, more than the 8 asked") {
		t.Errorf("a read of 9 bytes when 8 were asked: %v", err)
	}
	if _, err := d.WritePort(ctx, &agent.WritePortRequest{Id: 1, Data: []byte("abc")}); err == nil || !strings.Contains(err.Error(), "4 bytes taken of the 3 sent") {
		t.Errorf("a write that took 4 bytes of 3: %v", err)
	}
	if failed != nil {
		t.Fatalf("cut off after two violations: %v", failed)
	}

	l.silent = make(chan struct{})
	start := time.Now()
	_, err := d.WritePort(ctx, &agent.WritePortRequest{Id: 1, Data: []byte("abc")})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a write the agent does not answer: %v, want a missed deadline", err)
	}
	if took, want := time.Since(start), agent.PortWriteWait+100*time.Millisecond; took < want || took > want+2*time.Second {
		t.Errorf("the write's deadline came after %v, want %v", took, want)
	}
	close(l.silent)

	if _, err := d.ReadPort(ctx, &agent.ReadPortRequest{Id: 1, Max: 8}); err == nil {
		t.Error("a third lie was taken")
	}
	if failed == nil {
		t.Fatal("three violations did not cut the guest off")
	}
	if _, err := d.ClosePort(ctx, &agent.ClosePortRequest{Id: 1}); !errdefs.IsUnavailable(err) {
		t.Errorf("ClosePort after the guest was cut off: %v, want Unavailable", err)
	}
}
