//go:build kvfsfaults

package agent

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// These tests run only with -tags kvfsfaults (make test runs them so); fault_off_test.go
// checks the agent without the tag.

// silent is how long a call waits before the test takes it as unanswered.
const silent = 300 * time.Millisecond

// serveFault serves fx's service over ttrpc on a Unix socket, through the agent's
// interceptors with the fault mode, and returns a client of it.
func serveFault(t *testing.T, fx *fixture, mode string) apiv1.AgentService {
	t.Helper()
	fault, err := faultInterceptor(mode, fx.svc, fx.svc.log)
	if err != nil || fault == nil {
		t.Fatalf("faultInterceptor(%q): %v, %v", mode, fault, err)
	}
	srv, err := ttrpc.NewServer(ttrpc.WithChainUnaryServerInterceptor(Interceptor(fx.svc.log), fault))
	if err != nil {
		t.Fatal(err)
	}
	apiv1.RegisterAgentService(srv, fx.svc)
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "agent.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(context.Background(), l)
	conn, err := net.Dial("unix", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	client := ttrpc.NewClient(conn)
	t.Cleanup(func() {
		client.Close()
		srv.Close()
	})
	return apiv1.NewAgentClient(client)
}

// within is a context that ends after d: the host's deadline, which ttrpc sends with the request.
func within(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// unanswered checks that a call given the silent deadline got no answer: the client's own
// deadline ended it (an answer, even DeadlineExceeded from the agent, is a status).
func unanswered(t *testing.T, what string, err error) {
	t.Helper()
	if _, answered := status.FromError(err); answered || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("%s: %v, want no answer (the host's deadline passing)", what, err)
	}
}

func TestFaultModeUnknown(t *testing.T) {
	fx := newFixture(t)
	if f, err := faultInterceptor("", fx.svc, fx.svc.log); f != nil || err != nil {
		t.Errorf("no mode: %v, %v; want no interceptor", f, err)
	}
	_, err := faultInterceptor("stats-slow", fx.svc, fx.svc.log)
	if err == nil || !strings.Contains(err.Error(), "kvfs.fault=stats-slow: want one of stats-silent, create-silent") {
		t.Errorf("an unknown mode: %v, want an error naming it and the modes", err)
	}
}

// stats-silent: Stats never answers, whatever the deadline; other requests do, even while it
// hangs; Shutdown ends it.
func TestFaultStatsSilent(t *testing.T) {
	fx := newFixture(t)
	c := serveFault(t, fx, faultStatsSilent)
	fx.create(t, "c1", nil, "sleep")
	fx.start(t, "c1", "")

	held := make(chan error, 1)
	go func() {
		_, err := c.Stats(context.Background(), &apiv1.StatsRequest{ContainerId: "c1"})
		held <- err
	}()
	_, err := c.Stats(within(t, silent), &apiv1.StatsRequest{ContainerId: "c1"})
	unanswered(t, "Stats", err)
	_, err = c.Stats(within(t, silent), &apiv1.StatsRequest{})
	unanswered(t, "Stats of the pod", err)
	if _, err := c.Ping(within(t, 5*time.Second), &apiv1.PingRequest{}); err != nil {
		t.Errorf("Ping while Stats hangs: %v", err)
	}
	select {
	case err := <-held:
		t.Fatalf("Stats without a deadline answered %v", err)
	default:
	}
	if _, err := c.Shutdown(within(t, 10*time.Second), &apiv1.ShutdownRequest{}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-held:
		wantCode(t, "Stats held across Shutdown", err, codes.Unavailable, "")
	case <-time.After(5 * time.Second):
		t.Fatal("a held Stats still hangs after Shutdown")
	}
}

// create-silent: Ping answers, CreateContainer never does and creates nothing.
func TestFaultCreateSilent(t *testing.T) {
	fx := newFixture(t)
	c := serveFault(t, fx, faultCreateSilent)
	if _, err := c.Ping(within(t, 5*time.Second), &apiv1.PingRequest{}); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	_, err := c.CreateContainer(within(t, silent), &apiv1.CreateContainerRequest{ContainerId: "c1", Spec: fx.spec("c1", "sleep")})
	unanswered(t, "CreateContainer", err)
	if id := fx.svc.someContainer(); id != "" {
		t.Errorf("container %q exists after a silenced create", id)
	}
	if _, err := c.Stats(within(t, 5*time.Second), &apiv1.StatsRequest{}); err != nil {
		t.Errorf("Stats of the pod while CreateContainer hangs: %v", err)
	}
}

// kill-noexit: a signal is acknowledged and not delivered; the process's WaitProcess, asked
// before or after the signal, never answers, even once the process did exit. A process not
// signalled is waited for as usual.
func TestFaultKillNoExit(t *testing.T) {
	fx := newFixture(t)
	c := serveFault(t, fx, faultKillNoExit)
	for _, id := range []string{"victim", "other", "group"} {
		fx.create(t, id, nil, "sleep")
		fx.start(t, id, "")
	}
	early := make(chan error, 1)
	go func() {
		_, err := c.WaitProcess(context.Background(), &apiv1.WaitProcessRequest{ContainerId: "victim"})
		early <- err
	}()
	for _, req := range []*apiv1.SignalProcessRequest{
		{ContainerId: "victim", Signal: uint32(syscall.SIGKILL)},
		{ContainerId: "group", Signal: uint32(syscall.SIGKILL), All: true},
	} {
		if _, err := c.SignalProcess(within(t, 5*time.Second), req); err != nil {
			t.Fatalf("SignalProcess %v: %v, want it acknowledged", req, err)
		}
	}
	fx.rt.mu.Lock()
	for _, call := range fx.rt.calls {
		if strings.HasPrefix(call, "kill ") || strings.HasPrefix(call, "signal ") {
			t.Errorf("the signal reached the runtime: %s", call)
		}
	}
	fx.rt.mu.Unlock()
	_, err := c.WaitProcess(within(t, silent), &apiv1.WaitProcessRequest{ContainerId: "victim"})
	unanswered(t, "WaitProcess of the signalled process", err)
	_, err = c.WaitProcess(within(t, silent), &apiv1.WaitProcessRequest{ContainerId: "group"})
	unanswered(t, "WaitProcess of a process of a container signalled with all", err)

	// The processes exit after all (the runtime kills them): their waits stay silent.
	for _, id := range []string{"victim", "group", "other"} {
		if err := fx.rt.Kill(fx.ctx, id, syscall.SIGKILL, false); err != nil {
			t.Fatal(err)
		}
	}
	if r, err := c.WaitProcess(within(t, 5*time.Second), &apiv1.WaitProcessRequest{ContainerId: "other"}); err != nil || r.ExitStatus != 137 {
		t.Errorf("WaitProcess of a process not signalled: %v, %v; want its exit status 137", r, err)
	}
	select {
	case err := <-early:
		t.Fatalf("a WaitProcess made before the signal answered %v after the process exited", err)
	case <-time.After(silent):
	}
	_, err = c.WaitProcess(within(t, silent), &apiv1.WaitProcessRequest{ContainerId: "victim"})
	unanswered(t, "WaitProcess of the signalled process after its exit", err)
}

// oom-flood: GetOOMEvent waits while there is no container, then answers a container's id at
// once, every time.
func TestFaultOOMFlood(t *testing.T) {
	fx := newFixture(t)
	c := serveFault(t, fx, faultOOMFlood)
	// The wait follows the host's deadline, as the agent's own GetOOMEvent does.
	r, err := c.GetOOMEvent(within(t, silent), &apiv1.GetOOMEventRequest{})
	if status.Code(err) != codes.DeadlineExceeded && !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("GetOOMEvent with no container: %v, %v; want the deadline to pass", r, err)
	}
	fx.create(t, "c1", nil, "sleep")
	const n = 200
	ctx := within(t, 10*time.Second)
	for i := range n {
		r, err := c.GetOOMEvent(ctx, &apiv1.GetOOMEventRequest{})
		if err != nil || r.ContainerId != "c1" {
			t.Fatalf("GetOOMEvent %d: %v, %v; want c1 at once", i, r, err)
		}
	}
}
