package shim

import (
	"context"
	"errors"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestErrorEdgeLogsCalls: at debug level every call is logged with its method and duration,
// and a failed one with its error; at info level, none is. The error still leaves as its gRPC
// code.
func TestErrorEdgeLogsCalls(t *testing.T) {
	logger, hook := test.NewNullLogger()
	ctx := log.WithLogger(context.Background(), logrus.NewEntry(logger))
	edge := ErrorEdge{}.UnaryServerInterceptor()
	call := func(method string, err error) error {
		_, e := edge(ctx, func(any) error { return nil }, &ttrpc.UnaryServerInfo{FullMethod: method},
			func(context.Context, func(any) error) (any, error) { return nil, err })
		return e
	}

	logger.SetLevel(logrus.InfoLevel)
	call("/containerd.task.v3.Task/State", nil)
	if n := len(hook.AllEntries()); n != 0 {
		t.Errorf("%d entries at info level", n)
	}

	logger.SetLevel(logrus.DebugLevel)
	call("/containerd.task.v3.Task/Start", nil)
	err := call("/containerd.task.v3.Task/Kill", errors.Join(errors.New("no such process"), errdefs.ErrNotFound))
	if status.Code(err) != codes.NotFound {
		t.Errorf("Kill's error %v: want NotFound", err)
	}
	entries := hook.AllEntries()
	if len(entries) != 2 {
		t.Fatalf("%d entries, want 2", len(entries))
	}
	for i, want := range []string{"/containerd.task.v3.Task/Start", "/containerd.task.v3.Task/Kill"} {
		e := entries[i]
		if e.Level != logrus.DebugLevel || e.Data["method"] != want || e.Data["took"] == nil {
			t.Errorf("entry %d: %v %v", i, e.Level, e.Data)
		}
	}
	if _, ok := entries[0].Data[logrus.ErrorKey]; ok {
		t.Errorf("Start's entry has an error: %v", entries[0].Data)
	}
	if e, _ := entries[1].Data[logrus.ErrorKey].(error); e == nil || !errdefs.IsNotFound(e) {
		t.Errorf("Kill's entry: error %v", entries[1].Data[logrus.ErrorKey])
	}
}
