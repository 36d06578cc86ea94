package rpcedge

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/containerd/errdefs"
	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"
	"github.com/sirupsen/logrus/hooks/test"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestStatus: each errdefs kind leaves as its code with the error's text, a status as it is,
// an error of no kind as Internal.
func TestStatus(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("x: %w", errdefs.ErrNotFound), codes.NotFound},
		{fmt.Errorf("x: %w", errdefs.ErrAlreadyExists), codes.AlreadyExists},
		{fmt.Errorf("x: %w", errdefs.ErrInvalidArgument), codes.InvalidArgument},
		{fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition), codes.FailedPrecondition},
		{fmt.Errorf("x: %w", errdefs.ErrNotImplemented), codes.Unimplemented},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{errors.New("disk on fire"), codes.Internal},
		{status.Error(codes.Aborted, "as is"), codes.Aborted},
	} {
		st, _ := status.FromError(Status(tc.err))
		if st.Code() != tc.want || st.Message() != tc.err.Error() && tc.want != codes.Aborted {
			t.Errorf("Status(%v) = %v %q, want %v", tc.err, st.Code(), st.Message(), tc.want)
		}
	}
}

// TestInterceptor: a method's panic answers Internal and logs its stack at error level; an
// error leaves as its status, through adjust; at debug level each request is logged with its
// method, duration and the method's own error.
func TestInterceptor(t *testing.T) {
	logger, hook := test.NewNullLogger()
	logger.SetLevel(logrus.DebugLevel)
	entry := logrus.NewEntry(logger)
	var adjusted []string
	ic := Interceptor(func(context.Context) *logrus.Entry { return entry }, func(method string, err, st error) error {
		adjusted = append(adjusted, method)
		return st
	})
	call := func(method string, m ttrpc.Method) (any, error) {
		return ic(context.Background(), nil, &ttrpc.UnaryServerInfo{FullMethod: method}, m)
	}

	_, err := call("/t/Panic", func(context.Context, func(any) error) (any, error) { panic("boom") })
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "boom") {
		t.Errorf("a panic answered %v, want Internal saying boom", err)
	}
	if e := hook.Entries[0]; e.Level != logrus.ErrorLevel || !strings.Contains(e.Message, "rpcedge") {
		t.Errorf("the panic's log line: %v %q, want an error with the stack", e.Level, e.Message)
	}
	_, err = call("/t/Missing", func(context.Context, func(any) error) (any, error) {
		return nil, fmt.Errorf("x: %w", errdefs.ErrNotFound)
	})
	if status.Code(err) != codes.NotFound {
		t.Errorf("a NotFound error left as %v", err)
	}
	if resp, err := call("/t/OK", func(context.Context, func(any) error) (any, error) { return "ok", nil }); resp != "ok" || err != nil {
		t.Errorf("success: %v, %v", resp, err)
	}
	if want := []string{"/t/Missing"}; !slices.Equal(adjusted, want) {
		t.Errorf("adjust saw %q, want %q", adjusted, want)
	}
	var debug []string
	for _, e := range hook.AllEntries() {
		if e.Level == logrus.DebugLevel && e.Data["took"] != nil {
			debug = append(debug, fmt.Sprint(e.Data["method"]))
			if e.Data["method"] == "/t/Missing" && !errdefs.IsNotFound(e.Data[logrus.ErrorKey].(error)) {
				t.Errorf("the debug line of /t/Missing has the error %v, want the method's own", e.Data[logrus.ErrorKey])
			}
		}
	}
	if want := []string{"/t/Panic", "/t/Missing", "/t/OK"}; !slices.Equal(debug, want) {
		t.Errorf("debug lines for %q, want %q", debug, want)
	}
}
