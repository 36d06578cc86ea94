package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	control "github.com/kvfs/kvfs/api/control/v1"
	"github.com/kvfs/kvfs/sandbox"
)

// DefaultBaseDir is where kvfsctl looks for shims' control sockets without --base-dir: the
// sandboxes' default base directory.
var DefaultBaseDir = sandbox.DefaultConfig().BaseDir

// probeTimeout bounds the listing kvfsctl asks of each socket it found: one that does not
// answer within it is skipped.
const probeTimeout = 5 * time.Second

// sockets are the control sockets found without --address: BASE/<id>/control.sock for each
// sandbox directory that has one (a shim serves its sandbox's control API there). first, if
// not empty, is put first when found: the likely owner of a sandbox. A base directory that
// cannot be read is noted on stderr.
func sockets(o options, first string, stderr io.Writer) []string {
	var found []string
	ents, err := os.ReadDir(o.baseDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(stderr, "kvfsctl: skipping the shims' sockets: %v\n", err)
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if p := filepath.Join(o.baseDir, e.Name(), sandbox.ControlSocketName); isSocket(p) {
			found = append(found, p)
		}
	}
	if i := slices.Index(found, first); first != "" && i > 0 {
		found = append(append([]string{first}, found[:i]...), found[i+1:]...)
	}
	return found
}

func isSocket(p string) bool {
	fi, err := os.Lstat(p)
	return err == nil && fi.Mode().Type() == fs.ModeSocket
}

// where says where kvfsctl looked, for messages.
func where(o options) string {
	return filepath.Join(o.baseDir, "*", sandbox.ControlSocketName)
}

// endpoint is a control socket connected to, with the sandboxes it has.
type endpoint struct {
	address   string
	client    control.ControlService
	close     func()
	sandboxes []*control.SandboxSummary
}

// probe connects to address and lists its sandboxes.
func probe(ctx context.Context, o options, address string) (*endpoint, error) {
	ctx, cancel := context.WithTimeout(ctx, min(o.timeout, probeTimeout))
	defer cancel()
	c, closer, err := dial(ctx, address)
	if err != nil {
		return nil, err
	}
	resp, err := c.ListSandboxes(ctx, &control.ListSandboxesRequest{})
	if err != nil {
		closer()
		return nil, err
	}
	return &endpoint{address: address, client: c, close: closer, sandboxes: resp.GetSandboxes()}, nil
}

// skip notes on stderr a socket that did not answer.
func skip(stderr io.Writer, address string, err error) {
	fmt.Fprintf(stderr, "kvfsctl: skipping %s: %s\n", address, describe(err))
}

// listAll merges the sandboxes of every socket found, sorted by ID.
func listAll(ctx context.Context, o options, stderr io.Writer) *control.ListSandboxesResponse {
	found := sockets(o, "", stderr)
	if len(found) == 0 {
		fmt.Fprintf(stderr, "kvfsctl: no control socket found (looked at %s)\n", where(o))
	}
	resp := &control.ListSandboxesResponse{}
	for _, a := range found {
		e, err := probe(ctx, o, a)
		if err != nil {
			skip(stderr, a, err)
			continue
		}
		e.close()
		resp.Sandboxes = append(resp.Sandboxes, e.sandboxes...)
	}
	slices.SortStableFunc(resp.Sandboxes, func(a, b *control.SandboxSummary) int { return strings.Compare(a.GetId(), b.GetId()) })
	return resp
}

// logLevelAll sets the log level of every shim found (each its own process's and its
// sandbox's server's) and prints each answer, named by its sandbox.
func logLevelAll(ctx context.Context, o options, level string, w, stderr io.Writer) error {
	found := sockets(o, "", stderr)
	if len(found) == 0 {
		return fmt.Errorf("no control socket found (looked at %s)", where(o))
	}
	var out []logLevelJSON
	var errs []error
	for _, a := range found {
		e, err := probe(ctx, o, a)
		if err != nil {
			skip(stderr, a, err)
			continue
		}
		resp, err := e.client.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: level})
		e.close()
		name := a
		if len(e.sandboxes) > 0 {
			name = e.sandboxes[0].GetId()
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			continue
		}
		out = append(out, logLevelJSON{ID: name, PreviousLevel: resp.GetPreviousLevel(), Level: resp.GetLevel()})
	}
	if o.json {
		if err := writeJSON(w, out); err != nil {
			return err
		}
	} else {
		for _, l := range out {
			if _, err := fmt.Fprintf(w, "%s: log level %s (was %s)\n", l.ID, l.Level, l.PreviousLevel); err != nil {
				return err
			}
		}
	}
	return errors.Join(errs...)
}

// owner finds the socket that has sandbox id: its own shim's socket is asked first. The caller
// closes the endpoint.
func owner(ctx context.Context, o options, id string, stderr io.Writer) (*endpoint, error) {
	first := ""
	if id != "" && id != "." && id != ".." && !strings.Contains(id, "/") {
		first = filepath.Join(o.baseDir, id, sandbox.ControlSocketName)
	}
	found := sockets(o, first, stderr)
	for _, a := range found {
		e, err := probe(ctx, o, a)
		if err != nil {
			skip(stderr, a, err)
			continue
		}
		if slices.ContainsFunc(e.sandboxes, func(s *control.SandboxSummary) bool { return s.GetId() == id }) {
			return e, nil
		}
		e.close()
	}
	return nil, status.Errorf(codes.NotFound, "sandbox %q: not found in any of the %d control sockets found (looked at %s)",
		id, len(found), where(o))
}
