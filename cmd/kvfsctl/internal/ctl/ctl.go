// Package ctl is kvfsctl: the command line of the control API (api/control/v1). Run parses
// the arguments, calls the API over the control socket and prints the answer as aligned
// tables, as JSON (--json; the field names are part of the interface: see json.go), or, for
// metrics, in Prometheus's text exposition format.
package ctl

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/containerd/ttrpc"
	"google.golang.org/grpc/status"

	control "github.com/kvfs/kvfs/api/control/v1"
	"github.com/kvfs/kvfs/sandbox"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// Exit codes of Run.
const (
	exitOK    = 0
	exitError = 1 // the call failed
	exitUsage = 2 // bad arguments
)

const usage = `Usage: kvfsctl [--address PATH | --base-dir DIR] [--json] [--timeout DURATION] COMMAND [ARGS]

Without --address, kvfsctl talks to every shim it finds, each serving its pod's sandbox at
DIR/<id>/` + sandbox.ControlSocketName + ` (DIR: --base-dir). list merges their sandboxes;
status, metrics, stop and dax-policy go to the one that has the sandbox; log-level goes to
every one. A socket that does not answer is skipped with a note on stderr.

Commands:
  list                              list the sandboxes
  status ID                         a sandbox's state and its server's statistics
  metrics ID                        the same statistics in Prometheus text format
  stop ID                           end a sandbox's pod (through the shim that owns it:
                                    its tasks exit as when the VM dies)
  log-level LEVEL                   set the log level (trace, debug, info, warn, error)
  dax-policy [--rules RULES] [--window BYTES] ID POLICY
                                    set the DAX policy (never, always, inode) of a
                                    sandbox's kvfsd (not an external daemon); RULES as kvfsd's
                                    --dax-rules ("on glob=*.so; on size>=2M")

Local commands (no socket):
  config default [--guest DIR]      print the default sandbox configuration, every key
                                    documented; with the guest image in DIR
  image info [--config PATH | --kernel FILE --initrd FILE]
                                    which guest image this host has: checksums (and
                                    whether SHA256SUMS beside it agrees), kernel version,
                                    what the image was built from

Options:
`

// options are the global flags.
type options struct {
	address string // the one socket to talk to; "" to find them
	baseDir string // where shims' sockets are found
	json    bool
	timeout time.Duration
}

// usageError is a bad command line: Run prints it with the usage and exits 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// Run runs kvfsctl with args (without the program name) and returns the exit code: 0, 1 if
// the call failed, 2 for bad arguments.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvfsctl", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var opts options
	fs.StringVar(&opts.address, "address", "", "the one control socket to talk to (default: every one found)")
	fs.StringVar(&opts.baseDir, "base-dir", DefaultBaseDir, "where to find the shims' sockets, DIR/<id>/"+sandbox.ControlSocketName)
	fs.BoolVar(&opts.json, "json", false, "print JSON")
	fs.DurationVar(&opts.timeout, "timeout", 30*time.Second, "how long a call may take")
	printUsage := func(w io.Writer) {
		fmt.Fprint(w, usage)
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(stdout)
			return exitOK
		}
		fmt.Fprintf(stderr, "kvfsctl: %v\n", err)
		printUsage(stderr)
		return exitUsage
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	if set["address"] && set["base-dir"] {
		err = usagef("--address and --base-dir exclude each other: --base-dir says where to find sockets")
	} else {
		err = run(ctx, opts, fs.Args(), stdout, stderr)
	}
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintf(stderr, "kvfsctl: %v\n", err)
		printUsage(stderr)
		return exitUsage
	default:
		fmt.Fprintf(stderr, "kvfsctl: %s\n", describe(err))
		return exitError
	}
}

// describe says what went wrong, with the status code the server answered if it did.
func describe(err error) string {
	if st, ok := status.FromError(err); ok {
		return fmt.Sprintf("%s (%s)", st.Message(), st.Code())
	}
	if errors.Is(err, ttrpc.ErrClosed) {
		return err.Error() + " (the server closed the connection: only root and the server's own user may use the control socket)"
	}
	return err.Error()
}

// command is one subcommand. Its arguments are checked before anything is dialled.
type command struct {
	usage string
	check func(o options, args []string) error
	run   func(ctx context.Context, c control.ControlService, o options, args []string, w io.Writer) error
	// sandbox, for a command on one sandbox, is the sandbox's ID in the (checked) arguments:
	// without --address the command goes to the socket that has it.
	sandbox func(args []string) string
}

var commands = map[string]command{
	"list":       {"list", nargs(0), runList, nil},
	"status":     {"status ID", nargs(1), runStatus, firstArg},
	"metrics":    {"metrics ID", checkMetrics, runMetrics, firstArg},
	"stop":       {"stop ID", nargs(1), runStop, firstArg},
	"log-level":  {"log-level LEVEL", nargs(1), runLogLevel, nil},
	"dax-policy": {daxUsage, checkDAX, runDAXPolicy, daxSandbox},
}

func firstArg(args []string) string { return args[0] }

func daxSandbox(args []string) string {
	req, _ := parseDAXArgs(args) // checked by checkDAX
	return req.GetId()
}

func nargs(n int) func(options, []string) error {
	return func(_ options, args []string) error {
		if len(args) != n {
			return errWrongArgs
		}
		return nil
	}
}

// errWrongArgs makes run print the command's usage.
var errWrongArgs = errors.New("wrong number of arguments")

func checkMetrics(o options, args []string) error {
	if o.json {
		return usagef("metrics prints Prometheus text format; --json does not apply")
	}
	return nargs(1)(o, args)
}

func checkDAX(_ options, args []string) error {
	_, err := parseDAXArgs(args)
	return err
}

func run(ctx context.Context, opts options, args []string, w, stderr io.Writer) error {
	if opts.timeout <= 0 {
		return usagef("--timeout must be positive")
	}
	if len(args) == 0 {
		return usagef("no command")
	}
	name := args[0]
	if lc, ok := localCommands[name]; ok {
		err := lc.run(opts, args[1:], w)
		if errors.Is(err, errWrongArgs) {
			return usagef("usage: kvfsctl %s", lc.usage)
		}
		return err
	}
	cmd, ok := commands[name]
	if !ok {
		return usagef("unknown command %q", name)
	}
	args = args[1:]
	if err := cmd.check(opts, args); err != nil {
		if errors.Is(err, errWrongArgs) {
			return usagef("usage: kvfsctl %s", cmd.usage)
		}
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, opts.timeout)
	defer cancel()
	address := opts.address
	switch {
	case address != "":
	case cmd.sandbox != nil:
		e, err := owner(ctx, opts, cmd.sandbox(args), stderr)
		if err != nil {
			return err
		}
		defer e.close()
		return cmd.run(ctx, e.client, opts, args, w)
	case name == "list":
		return printList(w, opts, listAll(ctx, opts, stderr))
	case name == "log-level":
		return logLevelAll(ctx, opts, args[0], w, stderr)
	}
	c, closer, err := dial(ctx, address)
	if err != nil {
		return err
	}
	defer closer()
	return cmd.run(ctx, c, opts, args, w)
}

// dial connects to the control socket.
func dial(ctx context.Context, address string) (control.ControlService, func(), error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", address)
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to the control socket: %w", err)
	}
	client := ttrpc.NewClient(conn)
	return control.NewControlClient(client), func() { client.Close() }, nil
}

func runList(ctx context.Context, c control.ControlService, o options, _ []string, w io.Writer) error {
	resp, err := c.ListSandboxes(ctx, &control.ListSandboxesRequest{})
	if err != nil {
		return err
	}
	return printList(w, o, resp)
}

func printList(w io.Writer, o options, resp *control.ListSandboxesResponse) error {
	if o.json {
		return writeJSON(w, listJSON(resp))
	}
	return writeList(w, resp)
}

func runStatus(ctx context.Context, c control.ControlService, o options, args []string, w io.Writer) error {
	resp, err := c.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: args[0]})
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(w, statusJSON(resp))
	}
	return writeStatus(w, resp)
}

func runMetrics(ctx context.Context, c control.ControlService, _ options, args []string, w io.Writer) error {
	resp, err := c.SandboxStatus(ctx, &control.SandboxStatusRequest{Id: args[0]})
	if err != nil {
		return err
	}
	return WriteMetrics(w, resp)
}

func runStop(ctx context.Context, c control.ControlService, o options, args []string, w io.Writer) error {
	if _, err := c.StopSandbox(ctx, &control.StopSandboxRequest{Id: args[0]}); err != nil {
		return err
	}
	if o.json {
		return writeJSON(w, stopJSON{ID: args[0], Stopped: true})
	}
	_, err := fmt.Fprintf(w, "sandbox %s stopped\n", args[0])
	return err
}

func runLogLevel(ctx context.Context, c control.ControlService, o options, args []string, w io.Writer) error {
	resp, err := c.SetLogLevel(ctx, &control.SetLogLevelRequest{Level: args[0]})
	if err != nil {
		return err
	}
	if o.json {
		return writeJSON(w, logLevelJSON{PreviousLevel: resp.GetPreviousLevel(), Level: resp.GetLevel()})
	}
	_, err = fmt.Fprintf(w, "log level %s (was %s)\n", resp.GetLevel(), resp.GetPreviousLevel())
	return err
}

const daxUsage = "dax-policy [--rules RULES] [--window BYTES] ID POLICY"

var daxPolicies = map[string]control.DAXPolicy{
	"never":  control.DAXPolicy_DAX_POLICY_NEVER,
	"always": control.DAXPolicy_DAX_POLICY_ALWAYS,
	"inode":  control.DAXPolicy_DAX_POLICY_INODE,
}

func parseDAXArgs(args []string) (*control.UpdateDAXPolicyRequest, error) {
	fs := flag.NewFlagSet("dax-policy", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	window := fs.String("window", "0", "the DAX window's size in bytes (0: unchanged)")
	rulesText := fs.String("rules", "", "rules of policy inode, as kvfsd --dax-rules")
	if err := fs.Parse(args); err != nil {
		return nil, usagef("dax-policy: %v", err)
	}
	if fs.NArg() != 2 {
		return nil, usagef("usage: kvfsctl %s", daxUsage)
	}
	policy, ok := daxPolicies[strings.ToLower(fs.Arg(1))]
	if !ok {
		return nil, usagef("dax-policy: unknown policy %q (want never, always or inode)", fs.Arg(1))
	}
	size, err := strconv.ParseUint(*window, 10, 64)
	if err != nil {
		return nil, usagef("dax-policy: --window %q: want a number of bytes", *window)
	}
	rules, err := passthrough.ParseDAXRules(*rulesText)
	if err != nil {
		return nil, usagef("dax-policy: --rules: %v", err)
	}
	req := &control.UpdateDAXPolicyRequest{Id: fs.Arg(0), Policy: policy, WindowBytes: size}
	for _, r := range rules {
		req.Rules = append(req.Rules, &control.DAXRule{Glob: r.Glob, MinSize: r.MinSize, Dax: r.DAX})
	}
	return req, nil
}

func runDAXPolicy(ctx context.Context, c control.ControlService, o options, args []string, w io.Writer) error {
	req, err := parseDAXArgs(args)
	if err != nil {
		return err
	}
	if _, err := c.UpdateDAXPolicy(ctx, req); err != nil {
		return err
	}
	if o.json {
		return writeJSON(w, daxJSON{ID: req.GetId(), Policy: strings.ToLower(strings.TrimPrefix(req.GetPolicy().String(), "DAX_POLICY_"))})
	}
	_, err = fmt.Fprintf(w, "sandbox %s: DAX policy updated\n", req.GetId())
	return err
}
