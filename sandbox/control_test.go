package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	control "github.com/kvfs/kvfs/api/control/v1"
	"github.com/kvfs/kvfs/internal/rpcedge"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

func TestCheckPeer(t *testing.T) {
	for _, tc := range []struct {
		uid  uint32
		self int
		ok   bool
	}{
		{0, 0, true},
		{0, 1000, true},
		{1000, 1000, true},
		{65534, 0, false},
		{65534, 1000, false},
	} {
		err := checkPeer(&unix.Ucred{Pid: 1, Uid: tc.uid, Gid: tc.uid}, tc.self)
		if (err == nil) != tc.ok {
			t.Errorf("checkPeer(uid %d, self %d) = %v", tc.uid, tc.self, err)
		}
		if err != nil && !errors.Is(err, unix.EPERM) {
			t.Errorf("checkPeer: %v, want EPERM", err)
		}
	}
}

func TestControlValidation(t *testing.T) {
	svc := NewControlService(nil, nil)
	ctx := context.Background()
	code := func(err error) codes.Code { return status.Code(rpcedge.Status(err)) }

	for _, id := range []string{"", "../x", "a/b", strings.Repeat("a", 129)} {
		if _, err := svc.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: id}); code(err) != codes.InvalidArgument {
			t.Errorf("SandboxStatus(%q): %v", id, err)
		}
		if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: id}); code(err) != codes.InvalidArgument {
			t.Errorf("StopSandbox(%q): %v", id, err)
		}
	}
	if _, err := svc.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: "nope"}); code(err) != codes.NotFound {
		t.Errorf("SandboxStatus(nope): %v", err)
	}
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "nope"}); code(err) != codes.NotFound {
		t.Errorf("StopSandbox(nope): %v", err)
	}

	for _, tc := range []struct {
		req  *control.UpdateDAXPolicyRequest
		want codes.Code
	}{
		{&control.UpdateDAXPolicyRequest{Id: "nope"}, codes.InvalidArgument},
		{&control.UpdateDAXPolicyRequest{Id: "nope", Policy: 42}, codes.InvalidArgument},
		{&control.UpdateDAXPolicyRequest{Id: "nope", Policy: control.DAXPolicy_DAX_POLICY_ALWAYS, WindowBytes: 4096}, codes.InvalidArgument},
		{&control.UpdateDAXPolicyRequest{Id: "", Policy: control.DAXPolicy_DAX_POLICY_ALWAYS}, codes.InvalidArgument},
		{&control.UpdateDAXPolicyRequest{Id: "nope", Policy: control.DAXPolicy_DAX_POLICY_ALWAYS, WindowBytes: 8 << 30}, codes.NotFound},
	} {
		if _, err := svc.UpdateDAXPolicy(ctx, tc.req); code(err) != tc.want {
			t.Errorf("UpdateDAXPolicy(%v): %v, want %v", tc.req, err, tc.want)
		}
	}

	prev := log.GetLevel()
	t.Cleanup(func() { log.L.Logger.SetLevel(prev) })
	for _, bad := range []string{"", "loud", "fatal", "panic"} {
		if _, err := svc.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: bad}); code(err) != codes.InvalidArgument {
			t.Errorf("SetLogLevel(%q): %v", bad, err)
		}
	}
	resp, err := svc.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: "DEBUG"})
	if err != nil || resp.GetLevel() != "debug" || log.GetLevel() != log.DebugLevel {
		t.Errorf("SetLogLevel(DEBUG) = %v, %v; level now %v", resp, err, log.GetLevel())
	}
	resp, err = svc.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: "warning"})
	if err != nil || resp.GetPreviousLevel() != "debug" || resp.GetLevel() != "warn" {
		t.Errorf("SetLogLevel(warning) = %v, %v", resp, err)
	}
}

// TestUpdateDAXPolicy: the policy reaches the in-process server at once and the state file;
// bad rules, a window size and an external daemon are refused with their codes. (The confined
// server's half is TestConfinedServer's.)
func TestUpdateDAXPolicy(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	c := testConfig(base)
	c.Server.Daemon = InProcessUnconfined
	sb, err := Create(context.Background(), "dax", Options{Config: c})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, sb)
	ext, err := Create(context.Background(), "daxext", Options{Config: externalConfig(t, base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, ext)
	svc, extSvc := NewControlService(sb, nil), NewControlService(ext, nil)
	ctx := context.Background()
	req := &control.UpdateDAXPolicyRequest{Id: "dax", Policy: control.DAXPolicy_DAX_POLICY_INODE,
		Rules: []*control.DAXRule{{Glob: "*.so", Dax: true}, {MinSize: 1 << 20}}}
	if _, err := svc.UpdateDAXPolicy(ctx, req); err != nil {
		t.Fatalf("UpdateDAXPolicy: %v", err)
	}
	want := passthrough.DAXPolicy{Mode: passthrough.DAXInode,
		Rules: []passthrough.DAXRule{{Glob: "*.so", DAX: true}, {MinSize: 1 << 20}}}
	sb.mu.Lock()
	got := sb.srv.(*inProcServer).srv.DAXPolicy()
	sb.mu.Unlock()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("server policy %+v, want %+v", got, want)
	}
	st, err := readState(sb.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if p, err := st.DAX.policy(); err != nil || p == nil || !reflect.DeepEqual(*p, want) {
		t.Errorf("recorded policy %+v, %v; want %+v", p, err, want)
	}

	for _, tc := range []struct {
		req  *control.UpdateDAXPolicyRequest
		want codes.Code
		msg  string
	}{
		{&control.UpdateDAXPolicyRequest{Id: "dax", Policy: control.DAXPolicy_DAX_POLICY_INODE,
			Rules: []*control.DAXRule{{Glob: "["}}}, codes.InvalidArgument, "syntax error in pattern"},
		{&control.UpdateDAXPolicyRequest{Id: "dax", Policy: control.DAXPolicy_DAX_POLICY_ALWAYS, WindowBytes: 2 << 20},
			codes.Unimplemented, "fixed when the VM starts"},
		{&control.UpdateDAXPolicyRequest{Id: "daxext", Policy: control.DAXPolicy_DAX_POLICY_NEVER},
			codes.FailedPrecondition, "external daemon"},
	} {
		s := svc
		if tc.req.GetId() == "daxext" {
			s = extSvc
		}
		_, err := s.UpdateDAXPolicy(ctx, tc.req)
		st, _ := status.FromError(rpcedge.Status(err))
		if st.Code() != tc.want || !strings.Contains(st.Message(), tc.msg) {
			t.Errorf("UpdateDAXPolicy(%v): %v, want %v with %q", tc.req, err, tc.want, tc.msg)
		}
	}
	// The refused requests changed nothing, and a restarted server gets the policy again.
	sb.opMu.Lock()
	sb.mu.Lock()
	old := sb.srv
	sb.mu.Unlock()
	err = sb.restartServerLocked(old, &ServerError{Server: old.describe(), Err: errors.New("test restart")})
	sb.opMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	sb.mu.Lock()
	got = sb.srv.(*inProcServer).srv.DAXPolicy()
	replaced := sb.srv != old
	sb.mu.Unlock()
	if !replaced || !reflect.DeepEqual(got, want) {
		t.Errorf("restarted server's policy %+v, want %+v", got, want)
	}
}

// TestDAXRecord: the recorded policy round-trips, and a damaged record is refused.
func TestDAXRecord(t *testing.T) {
	p := &passthrough.DAXPolicy{Mode: passthrough.DAXAlways, Rules: []passthrough.DAXRule{{Glob: "a/*", MinSize: 5, DAX: true}}}
	got, err := recordDAX(p).policy()
	if err != nil || !reflect.DeepEqual(got, p) {
		t.Errorf("round trip: %+v, %v", got, err)
	}
	if got, err := (*daxRecord)(nil).policy(); got != nil || err != nil || recordDAX(nil) != nil {
		t.Errorf("nil record: %+v, %v", got, err)
	}
	for _, bad := range []*daxRecord{{Mode: "sometimes"}, {Mode: "inode", Rules: []daxRuleRecord{{Glob: "/abs"}}}} {
		if _, err := bad.policy(); err == nil {
			t.Errorf("record %+v accepted", bad)
		}
	}
}

// TestErrorInterceptor: the ttrpc edge turns error kinds into codes and a handler's panic
// into Internal.
func TestErrorInterceptor(t *testing.T) {
	info := &ttrpc.UnaryServerInfo{FullMethod: "/kvfs.control.v1.Control/Test"}
	noop := func(any) error { return nil }
	_, err := ErrorInterceptor(context.Background(), noop, info, func(context.Context, func(any) error) (any, error) {
		return nil, fmt.Errorf("sandbox x: %w", errdefs.ErrNotFound)
	})
	if status.Code(err) != codes.NotFound {
		t.Errorf("not found: %v", err)
	}
	_, err = ErrorInterceptor(context.Background(), noop, info, func(context.Context, func(any) error) (any, error) {
		panic("boom")
	})
	if status.Code(err) != codes.Internal {
		t.Errorf("panic: %v", err)
	}
	resp, err := ErrorInterceptor(context.Background(), noop, info, func(context.Context, func(any) error) (any, error) {
		return "ok", nil
	})
	if resp != "ok" || err != nil {
		t.Errorf("success: %v, %v", resp, err)
	}
}

// TestControlServerSocket: the socket is made 0600 in a directory made 0700, and Close (even
// without Serve) removes it.
func TestControlServerSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "kvfs.sock")
	cs, err := NewControlServer(nil, path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket: %v, %v", fi, err)
	}
	if fi, err := os.Stat(filepath.Dir(path)); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("socket directory: %v, %v", fi, err)
	}
	if err := cs.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("socket after Close: %v", err)
	}
	if err := cs.Serve(context.Background()); err != nil {
		t.Errorf("Serve after Close: %v", err)
	}
	// A file that is not a socket is never replaced.
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := NewControlServer(nil, path, nil); err == nil || !strings.Contains(err.Error(), "refusing to replace") {
		t.Errorf("over a regular file: %v", err)
	}
}

// controlSandbox creates sandbox id for a control service's test, stopped at its end.
func controlSandbox(t *testing.T, id string) *Sandbox {
	t.Helper()
	requireRoot(t)
	sb, err := Create(context.Background(), id, Options{Config: testConfig(testBase(t))})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, sb)
	return sb
}

// TestControlServiceStop: the service answers for its sandbox alone (another id is
// NotFound), and StopSandbox stops it and forgets it: it is no longer listed, and a second
// StopSandbox is NotFound.
func TestControlServiceStop(t *testing.T) {
	sb := controlSandbox(t, "a")
	svc := NewControlService(sb, nil)
	ctx := context.Background()
	code := func(err error) codes.Code { return status.Code(rpcedge.Status(err)) }
	if l, err := svc.ListSandboxes(ctx, nil); err != nil || len(l.GetSandboxes()) != 1 || l.GetSandboxes()[0].GetId() != "a" {
		t.Errorf("ListSandboxes: %v, %v", l, err)
	}
	if _, err := svc.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: "b"}); code(err) != codes.NotFound {
		t.Errorf("SandboxStatus(b): %v, want NotFound", err)
	}
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "b"}); code(err) != codes.NotFound || sb.Phase() == PhaseStopped {
		t.Errorf("StopSandbox(b): %v (a is %s), want NotFound and a untouched", err, sb.Phase())
	}
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "a"}); err != nil {
		t.Fatal(err)
	}
	if sb.Phase() != PhaseStopped {
		t.Errorf("after StopSandbox: %s", sb.Phase())
	}
	if l, err := svc.ListSandboxes(ctx, nil); err != nil || len(l.GetSandboxes()) != 0 {
		t.Errorf("ListSandboxes after the stop: %v, %v", l, err)
	}
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "a"}); code(err) != codes.NotFound {
		t.Errorf("StopSandbox again: %v, want NotFound", err)
	}
}

// TestControlStopThroughOwner: a service with its owner's StopFunc ends the pod through it: the
// owner is asked, with the request's context, and the sandbox is left to the owner, not
// stopped behind its back; an owner's refusal is StopSandbox's error.
func TestControlStopThroughOwner(t *testing.T) {
	sb := controlSandbox(t, "a")
	var asked int
	refuse := errors.New("the owner is busy")
	var answer error
	svc := NewControlService(sb, func(context.Context) error {
		asked++
		return answer
	})
	ctx := context.Background()
	answer = refuse
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "a"}); !errors.Is(err, refuse) {
		t.Errorf("StopSandbox with the owner refusing: %v, want its error", err)
	}
	answer = nil
	if _, err := svc.StopSandbox(ctx, &control.StopSandboxRequest{Id: "a"}); err != nil {
		t.Fatal(err)
	}
	if asked != 2 || sb.Phase() == PhaseStopped {
		t.Errorf("the owner was asked %d times, the sandbox is %s; want twice, and the sandbox left to it", asked, sb.Phase())
	}
	if l, err := svc.ListSandboxes(ctx, nil); err != nil || len(l.GetSandboxes()) != 0 {
		t.Errorf("ListSandboxes after the stop: %v, %v", l, err)
	}
}

// TestControlServiceConcurrent lists and stops the sandbox from many goroutines (for -race):
// Stats and Stop are called without the service's lock.
func TestControlServiceConcurrent(t *testing.T) {
	sb := controlSandbox(t, "s")
	svc := NewControlService(sb, nil)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range 20 {
				_, _ = svc.ListSandboxes(context.Background(), nil)
				_, _ = svc.SandboxStatus(context.Background(), &control.SandboxStatusRequest{Id: "s"})
			}
		}()
		go func() {
			defer wg.Done()
			// One of them stops it; the others find it stopped or gone.
			_, err := svc.StopSandbox(context.Background(), &control.StopSandboxRequest{Id: "s"})
			if err != nil && status.Code(rpcedge.Status(err)) != codes.NotFound {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if l, _ := svc.ListSandboxes(context.Background(), nil); len(l.GetSandboxes()) != 0 || sb.Phase() != PhaseStopped {
		t.Errorf("left: %v, phase %s", l, sb.Phase())
	}
}
