// Package cmdline turns a virtiofsd-style command line into the configuration of a kvfs server
// and sets up what the kvfsd process needs before serving: the vhost-user listening socket, its
// pidfile lock, the file descriptor limit and logging.
//
// Both virtiofsd dialects are accepted, in any mix: the C one from QEMU (-o source=DIR,cache=auto,
// --socket-path=PATH, ...) and the Rust one (--shared-dir DIR --cache auto, ...), so kvfsd can be
// dropped in where Kata Containers, QEMU's documentation or a hand-written script starts
// virtiofsd. An option kvfsd knows but does not implement is refused with an error wrapping
// [ErrNotSupported]; it is never accepted and ignored, because a caller that asks for, say, a
// read-only export or live migration must not believe it got one.
//
// Nothing here keeps package-level flag state, prints, or exits: [Parse] returns an [Options] and
// the command decides what to do with it.
package cmdline

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/confine"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// Capabilities is what kvfsd --print-capabilities prints: the vhost-user.json description of a
// virtio-fs back-end, as the C virtiofsd prints it.
const Capabilities = `{"type":"fs"}`

// Log levels of Options.LogLevel: logrus level names, plus LogOff.
const (
	LogError = "error"
	LogWarn  = "warn"
	LogInfo  = "info"
	LogDebug = "debug"
	LogTrace = "trace"
	// LogOff disables logging altogether (Rust virtiofsd's --log-level off).
	LogOff = "off"
)

// Options is a parsed kvfsd command line.
type Options struct {
	// Server is the file server's configuration.
	Server virtiofs.Config

	// SocketPath is the vhost-user socket kvfsd creates and listens on (--socket-path).
	SocketPath string
	// FD is an inherited, already listening socket to serve on (--fd); -1 when not given.
	// Exactly one of SocketPath and FD is set.
	FD int
	// SocketGroup is the group given access to the socket at SocketPath (--socket-group).
	SocketGroup string

	// Tag is --tag: the tag virtiofsd 1.13 would offer in the device's configuration space.
	// kvfsd takes it (1 to 36 bytes) but offers no configuration space: QEMU 7.1 to 8.0 crash
	// on the CONFIG protocol feature, and QEMU takes the tag from its own tag= property.
	Tag string

	// Syslog sends the log to syslog instead of stderr.
	Syslog bool
	// LogLevel is one of LogError, LogWarn, LogInfo (the default), LogDebug, LogTrace, LogOff.
	LogLevel string

	// RlimitNofile is the RLIMIT_NOFILE asked for with --rlimit-nofile, valid when
	// RlimitNofileSet; 0 leaves the limit alone. Without the option kvfsd raises the limit to
	// min(1,000,000, fs.nr_open) if it is lower: see SetNofileLimit.
	RlimitNofile    uint64
	RlimitNofileSet bool

	// Sandbox is --sandbox (-o sandbox=): how kvfsd confines itself before serving (see package
	// confine). DefaultSandbox without the option.
	Sandbox confine.Mode
	// Seccomp is --seccomp: what kvfsd's seccomp filter does with a system call outside its
	// allowlist, or SeccompNone for no filter. DefaultSeccomp without the option.
	Seccomp confine.Action
	// Modcaps is --modcaps (-o modcaps=): changes to the capabilities a --sandbox=namespace
	// server keeps (see ServerCapabilities).
	Modcaps []confine.CapabilityChange
	// UIDMap and GIDMap are --uid-map and --gid-map (each given as :INSIDE:OUTSIDE:COUNT:,
	// repeatable): the mappings of a user namespace the --sandbox=namespace server runs in.
	// Both or neither.
	UIDMap, GIDMap []syscall.SysProcIDMap

	// Foreground is -f. kvfsd always runs in the foreground; the flag is kept for compatibility.
	Foreground bool

	// PrintCapabilities, Help and Version ask for Capabilities, Usage() or the version to be
	// printed instead of serving. With any of them set, Parse does not require a socket or a
	// shared directory.
	PrintCapabilities bool
	Help              bool
	Version           bool
}

// DefaultSandbox and DefaultSeccomp are what kvfsd does without --sandbox and --seccomp: the
// defaults of the C and Rust virtiofsd (namespace, kill), which is what Kata gets when it starts
// virtiofsd (it passes neither option), and which the tests prove for kvfsd (cmd/kvfsd, and the
// guest checks of internal/testing/vmtest). The seccomp default is none on architectures kvfsd
// has no allowlist for (all but amd64).
const (
	DefaultSandbox = confine.SandboxNamespace
	DefaultSeccomp = confine.DefaultAction
)

// ErrNotSupported is wrapped by the error for an option (or option value) that virtiofsd has
// and kvfsd does not implement yet.
var ErrNotSupported = errors.New("not supported yet")

// ErrUnknownOption is wrapped by the error for an option neither kvfsd nor virtiofsd knows.
var ErrUnknownOption = errors.New("unknown option")

// OptionError is the error Parse returns for an option it cannot accept.
type OptionError struct {
	// Option is the option as written, without its value: "--cache", "-o posix_lock", "-x".
	Option string
	Err    error
}

func (e *OptionError) Error() string { return e.Option + ": " + e.Err.Error() }
func (e *OptionError) Unwrap() error { return e.Err }

// Parse parses the arguments that follow the program name. When an option is given more than
// once, the last one wins (virtiofsd's --thread-pool-size included, which the Rust virtiofsd
// refuses to see twice).
func Parse(args []string) (*Options, error) {
	o := &Options{FD: -1, LogLevel: LogInfo, Sandbox: DefaultSandbox, Seccomp: DefaultSeccomp}
	for i := 0; i < len(args); i++ {
		arg := args[i]
		// next returns the argument after arg as the value of the option named name.
		next := func(name string) (string, error) {
			if i+1 >= len(args) || isOption(args[i+1]) {
				return "", &OptionError{name, errors.New("missing value")}
			}
			i++
			return args[i], nil
		}
		var err error
		switch {
		case arg == "-o":
			var list string
			if list, err = next("-o"); err == nil {
				err = o.applySubOptions(list)
			}
		case strings.HasPrefix(arg, "-o"):
			// -oLIST, the attached form fuse's option parser accepts.
			err = o.applySubOptions(arg[len("-o"):])
		case strings.HasPrefix(arg, "--") && len(arg) > 2:
			err = o.applyLong(arg, next)
		case isOption(arg):
			err = o.applyShort(arg)
		default:
			err = fmt.Errorf("unexpected argument %q: kvfsd takes options only", arg)
		}
		if err != nil {
			return nil, err
		}
	}
	if err := o.check(); err != nil {
		return nil, err
	}
	return o, nil
}

// isOption says whether arg is an option rather than a value. "-" alone is a value.
func isOption(arg string) bool { return len(arg) > 1 && arg[0] == '-' }

// applyLong applies a --name or --name=value argument, taking the value from the next argument
// when it is not attached.
func (o *Options) applyLong(arg string, next func(string) (string, error)) error {
	name, value, hasValue := strings.Cut(arg, "=")
	opt, ok := longOptions[strings.TrimPrefix(name, "--")]
	if !ok {
		return &OptionError{name, ErrUnknownOption}
	}
	if opt.refused != "" {
		return &OptionError{name, fmt.Errorf("%w: %s", ErrNotSupported, opt.refused)}
	}
	if opt.value == "" {
		if hasValue {
			return &OptionError{name, errors.New("takes no value")}
		}
		return opt.apply(o, "")
	}
	if !hasValue {
		var err error
		if value, err = next(name); err != nil {
			return err
		}
	}
	if value == "" {
		return &OptionError{name, errors.New("empty value")}
	}
	if err := opt.apply(o, value); err != nil {
		return &OptionError{name, err}
	}
	return nil
}

func (o *Options) applyShort(arg string) error {
	switch arg {
	case "-h":
		o.Help = true
	case "-V":
		o.Version = true
	case "-f":
		o.Foreground = true
	case "-d":
		// Debug output; virtiofsd adds "implies -f", and kvfsd is always in the foreground.
		o.LogLevel = LogDebug
		o.Foreground = true
	default:
		return &OptionError{arg, ErrUnknownOption}
	}
	return nil
}

// applySubOptions applies the comma-separated list of a -o argument. A backslash makes the next
// character literal, so "-o source=/a\,b" names the directory "/a,b".
func (o *Options) applySubOptions(list string) error {
	items, err := splitSubOptions(list)
	if err != nil {
		return &OptionError{"-o", err}
	}
	if len(items) == 0 {
		return &OptionError{"-o", errors.New("missing value")}
	}
	for _, item := range items {
		name, value, hasValue := strings.Cut(item, "=")
		display := "-o " + name
		opt, ok := subOptions[name]
		switch {
		case !ok:
			return &OptionError{display, ErrUnknownOption}
		case opt.refused != "":
			return &OptionError{display, fmt.Errorf("%w: %s", ErrNotSupported, opt.refused)}
		case opt.value == "" && hasValue:
			return &OptionError{display, errors.New("takes no value")}
		case opt.value != "" && !hasValue:
			return &OptionError{display, fmt.Errorf("missing value (-o %s=%s)", name, opt.value)}
		case opt.value != "" && value == "":
			return &OptionError{display, errors.New("empty value")}
		}
		if err := opt.apply(o, value); err != nil {
			return &OptionError{display, err}
		}
	}
	return nil
}

// splitSubOptions splits a -o list at unescaped commas and removes the escapes. Empty items are
// dropped.
func splitSubOptions(list string) ([]string, error) {
	var items []string
	var cur strings.Builder
	for i := 0; i < len(list); i++ {
		switch c := list[i]; c {
		case '\\':
			if i+1 == len(list) {
				return nil, errors.New("trailing backslash")
			}
			i++
			cur.WriteByte(list[i])
		case ',':
			if cur.Len() > 0 {
				items = append(items, cur.String())
			}
			cur.Reset()
		default:
			cur.WriteByte(c)
		}
	}
	if cur.Len() > 0 {
		items = append(items, cur.String())
	}
	return items, nil
}

// check validates the option combination.
func (o *Options) check() error {
	if o.Help || o.Version || o.PrintCapabilities {
		return nil
	}
	switch {
	case o.SocketPath != "" && o.FD >= 0:
		return errors.New("--socket-path and --fd are mutually exclusive")
	case o.SocketPath == "" && o.FD < 0:
		return errors.New("no vhost-user socket: give --socket-path=PATH or --fd=FD")
	case o.SocketGroup != "" && o.SocketPath == "":
		return errors.New("--socket-group applies only to a socket kvfsd creates (--socket-path)")
	case o.Server.SharedDir == "":
		return errors.New("no shared directory: give --shared-dir=DIR or -o source=DIR")
	case o.Modcaps != nil && o.Sandbox != confine.SandboxNamespace:
		return fmt.Errorf("--modcaps: kvfsd drops capabilities only with --sandbox=namespace (not %s)", o.Sandbox)
	}
	if err := o.Server.CheckIDTranslation(); err != nil {
		return err
	}
	return o.checkUserNamespace()
}

// checkUserNamespace accepts --uid-map and --gid-map: both or neither, with
// --sandbox=namespace, whose user namespace they map, and not with
// --inode-file-handles=mandatory (open_by_handle_at needs CAP_DAC_READ_SEARCH in the host's
// user namespace).
func (o *Options) checkUserNamespace() error {
	switch {
	case o.UIDMap == nil && o.GIDMap == nil:
		return nil
	case o.UIDMap == nil || o.GIDMap == nil:
		return errors.New("--uid-map and --gid-map go together: a user namespace needs both")
	case o.Sandbox != confine.SandboxNamespace:
		return fmt.Errorf("--uid-map and --gid-map map the user namespace of --sandbox=namespace, not --sandbox=%s", o.Sandbox)
	case o.Server.InodeFileHandles == passthrough.FileHandlesMandatory:
		return errors.New("--uid-map with --inode-file-handles=mandatory: opening file handles needs CAP_DAC_READ_SEARCH in the host's user namespace")
	case !mapsZero(o.UIDMap) || !mapsZero(o.GIDMap):
		return errors.New("--uid-map and --gid-map must each map id 0 inside: kvfsd runs as root of its user namespace")
	}
	return nil
}

func mapsZero(m []syscall.SysProcIDMap) bool {
	return slices.ContainsFunc(m, func(e syscall.SysProcIDMap) bool { return e.ContainerID == 0 })
}

// UserNamespace is the user namespace --uid-map and --gid-map ask for, or nil.
func (o *Options) UserNamespace() *confine.UserNamespace {
	if o.UIDMap == nil {
		return nil
	}
	return &confine.UserNamespace{UIDs: o.UIDMap, GIDs: o.GIDMap}
}

// ServerCapabilities are the capabilities the server of a --sandbox=namespace kvfsd keeps:
// confine.ServerCapabilities, and CAP_DAC_READ_SEARCH when its inodes keep file handles, for
// open_by_handle_at (which opens any file of the file system from a handle, around the root: the
// price of --inode-file-handles, as with virtiofsd); then --modcaps. Without CAP_SYS_ADMIN,
// trusted.* attributes (trusted.kvfs.dax among them) are out of the server's reach.
func (o *Options) ServerCapabilities() []confine.Capability {
	keep := confine.ServerCapabilities
	if o.Server.InodeFileHandles != passthrough.FileHandlesNever {
		keep = append(slices.Clone(keep), unix.CAP_DAC_READ_SEARCH)
	}
	return confine.ModifyCapabilities(keep, o.Modcaps)
}

// option describes one --name (or -o name) option.
type option struct {
	// value is the placeholder of the option's value in messages; "" for a switch.
	value string
	// apply records the option in o; value is "" for a switch.
	apply func(o *Options, value string) error
	// refused, when set, makes the option an error wrapping ErrNotSupported; it says why.
	refused string
}

// Reasons for refusing options, shared by both dialects' spellings.
const (
	whyDirectIO  = "kvfsd does not make O_DIRECT configurable"
	whyMigration = "kvfsd does not support live migration"
)

// longOptions are the --name options of both dialects.
var longOptions = map[string]option{
	"help":               {apply: setFlag(func(o *Options) { o.Help = true })},
	"version":            {apply: setFlag(func(o *Options) { o.Version = true })},
	"print-capabilities": {apply: setFlag(func(o *Options) { o.PrintCapabilities = true })},
	"syslog":             {apply: setFlag(func(o *Options) { o.Syslog = true })},

	"socket-path":        {value: "PATH", apply: setSocketPath},
	"socket":             {value: "PATH", apply: setSocketPath}, // the Rust virtiofsd's deprecated name
	"fd":                 {value: "FD", apply: setFD},
	"socket-group":       {value: "GROUP", apply: func(o *Options, v string) error { o.SocketGroup = v; return nil }},
	"shared-dir":         {value: "DIR", apply: setSharedDir},
	"cache":              {value: "MODE", apply: setCache},
	"thread-pool-size":   {value: "N", apply: setThreadPoolSize},
	"log-level":          {value: "LEVEL", apply: setLogLevel},
	"rlimit-nofile":      {value: "N", apply: setRlimitNofile},
	"sandbox":            {value: "MODE", apply: setSandbox},
	"seccomp":            {value: "ACTION", apply: setSeccomp},
	"inode-file-handles": {value: "MODE", apply: setInodeFileHandles},
	"poll-max-ns":        {value: "NS", apply: setPollMaxNS},

	"xattr":                 {apply: setFlag(func(o *Options) { o.Server.Xattr = true })},
	"readonly":              {apply: setFlag(func(o *Options) { o.Server.ReadOnly = true })},
	"tag":                   {value: "TAG", apply: setTag},
	"allow-mmap":            {apply: setFlag(func(o *Options) { o.Server.AllowMmap = true })},
	"preserve-noatime":      {apply: setFlag(func(o *Options) { o.Server.PreserveNoatime = true })},
	"announce-submounts":    {apply: setFlag(func(o *Options) { o.Server.AnnounceSubmounts = true })},
	"no-announce-submounts": {apply: setFlag(func(o *Options) { o.Server.AnnounceSubmounts = false })},
	"killpriv-v2":           {apply: setFlag(func(o *Options) { o.Server.KillprivV2 = new(true) })},
	"posix-acl":             {apply: setFlag(func(o *Options) { o.Server.PosixACL = true })},
	"security-label":        {apply: setFlag(func(o *Options) { o.Server.SecurityLabel = true })},
	"xattrmap":              {value: "RULES", apply: setXattrMap},
	"no-killpriv-v2":        {apply: setFlag(func(o *Options) { o.Server.KillprivV2 = new(false) })},
	"writeback":             {apply: setFlag(func(o *Options) { o.Server.Writeback = true })},
	"no-readdirplus":        {apply: setFlag(func(o *Options) { o.Server.Readdirplus = new(false) })},
	"dax":                   {value: "MODE", apply: setDAXMode},
	"dax-rules":             {value: "RULES", apply: setDAXRules},

	"daemonize":                {refused: "kvfsd always runs in the foreground; let the caller (systemd, the Kata runtime) supervise it"},
	"allow-direct-io":          {refused: whyDirectIO},
	"modcaps":                  {value: "CAPS", apply: setModcaps},
	"uid-map":                  {value: "MAP", apply: addIDMap(func(o *Options) *[]syscall.SysProcIDMap { return &o.UIDMap })},
	"gid-map":                  {value: "MAP", apply: addIDMap(func(o *Options) *[]syscall.SysProcIDMap { return &o.GIDMap })},
	"translate-uid":            {value: "MAP", apply: addIDRule(func(o *Options) *[]passthrough.IDRule { return &o.Server.TranslateUID })},
	"translate-gid":            {value: "MAP", apply: addIDRule(func(o *Options) *[]passthrough.IDRule { return &o.Server.TranslateGID })},
	"migration-mode":           {value: "MODE", refused: whyMigration},
	"migration-on-error":       {value: "MODE", refused: whyMigration},
	"migration-verify-handles": {refused: whyMigration},
	"migration-confirm-paths":  {refused: whyMigration},
}

// subOptions are the names accepted in -o lists: the C virtiofsd's, which the Rust one also
// takes in part.
var subOptions = map[string]option{
	"source":             {value: "DIR", apply: setSharedDir},
	"cache":              {value: "MODE", apply: setCache},
	"log_level":          {value: "LEVEL", apply: setLogLevel},
	"loglevel":           {value: "LEVEL", apply: setLogLevel}, // the Rust virtiofsd's -o spelling
	"debug":              {apply: setFlag(func(o *Options) { o.LogLevel = LogDebug; o.Foreground = true })},
	"sandbox":            {value: "MODE", apply: setSandbox},
	"xattr":              {apply: setFlag(func(o *Options) { o.Server.Xattr = true })},
	"no_xattr":           {apply: setFlag(func(o *Options) { o.Server.Xattr = false })},
	"announce_submounts": {apply: setFlag(func(o *Options) { o.Server.AnnounceSubmounts = true })},
	"posix_lock":         {apply: setFlag(func(o *Options) { o.Server.PosixLock = true })},
	"no_posix_lock":      {apply: setFlag(func(o *Options) { o.Server.PosixLock = false })},
	"flock":              {apply: setFlag(func(o *Options) { o.Server.Flock = true })},
	"no_flock":           {apply: setFlag(func(o *Options) { o.Server.Flock = false })},
	"writeback":          {apply: setFlag(func(o *Options) { o.Server.Writeback = true })},
	"no_writeback":       {apply: setFlag(func(o *Options) { o.Server.Writeback = false })},
	"readdirplus":        {apply: setFlag(func(o *Options) { o.Server.Readdirplus = new(true) })},
	"no_readdirplus":     {apply: setFlag(func(o *Options) { o.Server.Readdirplus = new(false) })},
	"timeout":            {value: "SECONDS", apply: setTimeout},

	"killpriv_v2":       {apply: setFlag(func(o *Options) { o.Server.KillprivV2 = new(true) })},
	"no_killpriv_v2":    {apply: setFlag(func(o *Options) { o.Server.KillprivV2 = new(false) })},
	"posix_acl":         {apply: setFlag(func(o *Options) { o.Server.PosixACL = true })},
	"security_label":    {apply: setFlag(func(o *Options) { o.Server.SecurityLabel = true })},
	"no_security_label": {apply: setFlag(func(o *Options) { o.Server.SecurityLabel = false })},
	"xattrmap":          {value: "RULES", apply: setXattrMap},
	"no_posix_acl":      {apply: setFlag(func(o *Options) { o.Server.PosixACL = false })},
	"dax":               {value: "MODE", apply: setDAXMode},
	"dax_rules":         {value: "RULES", apply: setDAXRules},
	"poll_max_ns":       {value: "NS", apply: setPollMaxNS},

	"allow_direct_io":    {refused: whyDirectIO},
	"no_allow_direct_io": {refused: whyDirectIO},
	"modcaps":            {value: "CAPS", apply: setModcaps},
	"allow_root":         {refused: "kvfsd has no allow_root setting"},
	"max_idle_threads":   {value: "N", refused: "kvfsd has no idle thread limit"},
}

func setFlag(f func(o *Options)) func(*Options, string) error {
	return func(o *Options, _ string) error { f(o); return nil }
}

func setSocketPath(o *Options, v string) error { o.SocketPath = v; return nil }

// setXattrMap takes virtiofsd's xattrmap rules, checked at once.
func setXattrMap(o *Options, v string) error {
	if _, err := passthrough.ParseXattrMap(v); err != nil {
		if errors.Is(err, passthrough.ErrXattrRuleNotSupported) {
			return fmt.Errorf("%w: %v", ErrNotSupported, err)
		}
		return err
	}
	o.Server.XattrMap = v
	return nil
}
func setSharedDir(o *Options, v string) error { o.Server.SharedDir = v; return nil }

// setDAXMode takes the DAX policy mode: never, always or inode.
func setDAXMode(o *Options, v string) error {
	m, err := passthrough.ParseDAXMode(v)
	if err != nil {
		return err
	}
	o.Server.DAX.Mode = m
	return nil
}

// setDAXRules takes the rules of DAX mode inode, checked at once.
func setDAXRules(o *Options, v string) error {
	rules, err := passthrough.ParseDAXRules(v)
	if err != nil {
		return err
	}
	o.Server.DAX.Rules = rules
	return nil
}

func setFD(o *Options, v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > math.MaxInt32 {
		return fmt.Errorf("invalid file descriptor %q", v)
	}
	o.FD = n
	return nil
}

func setCache(o *Options, v string) error {
	m, err := virtiofs.ParseCacheMode(v)
	if err != nil {
		return err
	}
	o.Server.Cache = m
	return nil
}

// setTimeout takes the C virtiofsd's -o timeout=SECONDS: a decimal number of seconds, fractions
// allowed.
func setTimeout(o *Options, v string) error {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(f) || f < 0 || f > maxTimeoutSeconds {
		return fmt.Errorf("invalid timeout %q: want seconds from 0 to %d", v, maxTimeoutSeconds)
	}
	d := time.Duration(f * float64(time.Second))
	o.Server.Timeout = &d
	return nil
}

// maxTimeoutSeconds is the longest -o timeout= (a year; virtiofs.Config.Validate's bound).
const maxTimeoutSeconds = 365 * 24 * 60 * 60

func setThreadPoolSize(o *Options, v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return fmt.Errorf("invalid thread pool size %q: want a number ≥ 0", v)
	}
	o.Server.ThreadPoolSize = n
	return nil
}

// setPollMaxNS takes kvfsd's poll limit in nanoseconds, as QEMU's iothread poll-max-ns.
func setPollMaxNS(o *Options, v string) error {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > int64(virtiofs.MaxPollMax) {
		return fmt.Errorf("invalid poll limit %q: want nanoseconds from 0 to %d", v, int64(virtiofs.MaxPollMax))
	}
	o.Server.PollMax = time.Duration(n)
	return nil
}

func setRlimitNofile(o *Options, v string) error {
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return fmt.Errorf("invalid file descriptor limit %q: want a number ≥ 0", v)
	}
	o.RlimitNofile, o.RlimitNofileSet = n, true
	return nil
}

// setLogLevel takes the level names of both dialects.
func setLogLevel(o *Options, v string) error {
	switch v {
	case "err", LogError:
		o.LogLevel = LogError
	case LogWarn, LogInfo, LogDebug, LogTrace, LogOff:
		o.LogLevel = v
	default:
		return fmt.Errorf("invalid log level %q: want error, warn, info, debug, trace or off", v)
	}
	return nil
}

func setSandbox(o *Options, v string) error {
	m, err := confine.ParseMode(v)
	if err != nil {
		return err
	}
	o.Sandbox = m
	return nil
}

func setSeccomp(o *Options, v string) error {
	a, err := confine.ParseAction(v)
	if err != nil {
		return err
	}
	o.Seccomp = a
	return nil
}

func setModcaps(o *Options, v string) error {
	changes, err := confine.ParseModcaps(v)
	if err != nil {
		return err
	}
	o.Modcaps = changes
	return nil
}

func setInodeFileHandles(o *Options, v string) error {
	m, err := passthrough.ParseFileHandleMode(v)
	if err != nil {
		return err
	}
	o.Server.InodeFileHandles = m
	return nil
}

// maxTag is the longest virtio-fs tag (the device configuration's tag field).
const maxTag = 36

func setTag(o *Options, v string) error {
	if v == "" || len(v) > maxTag {
		return fmt.Errorf("invalid tag %q: want 1 to %d bytes", v, maxTag)
	}
	o.Tag = v
	return nil
}

// addIDRule appends a --translate-uid or --translate-gid rule to the list field names.
func addIDRule(field func(*Options) *[]passthrough.IDRule) func(*Options, string) error {
	return func(o *Options, v string) error {
		r, err := passthrough.ParseIDRule(v)
		if err != nil {
			return err
		}
		*field(o) = append(*field(o), r)
		return nil
	}
}

// addIDMap appends a --uid-map or --gid-map mapping to the list field names.
func addIDMap(field func(*Options) *[]syscall.SysProcIDMap) func(*Options, string) error {
	return func(o *Options, v string) error {
		m, err := parseIDMap(v)
		if err != nil {
			return err
		}
		*field(o) = append(*field(o), m)
		return nil
	}
}

// parseIDMap parses a mapping as virtiofsd takes it: INSIDE, OUTSIDE and COUNT, each preceded
// by the same one-character delimiter, its first character, and followed by it
// (":0:100000:65536:").
func parseIDMap(v string) (syscall.SysProcIDMap, error) {
	var m syscall.SysProcIDMap
	if len(v) < 2 {
		return m, fmt.Errorf("%q: want :INSIDE:OUTSIDE:COUNT:", v)
	}
	d := v[:1]
	if !strings.HasSuffix(v, d) {
		return m, fmt.Errorf("%q: want :INSIDE:OUTSIDE:COUNT: (the delimiter %q first and last)", v, d)
	}
	f := strings.Split(v[1:len(v)-1], d)
	if len(f) != 3 {
		return m, fmt.Errorf("%q: want :INSIDE:OUTSIDE:COUNT:", v)
	}
	var n [3]uint64
	for i, x := range f {
		var err error
		if n[i], err = strconv.ParseUint(x, 10, 32); err != nil {
			return m, fmt.Errorf("%q: %q is not an id or count (0 to %d)", v, x, uint32(math.MaxUint32))
		}
	}
	if n[2] == 0 || n[0]+n[2] > 1<<32 || n[1]+n[2] > 1<<32 {
		return m, fmt.Errorf("%q: want a count of at least 1 that stays within 32-bit ids", v)
	}
	return syscall.SysProcIDMap{ContainerID: int(n[0]), HostID: int(n[1]), Size: int(n[2])}, nil
}
