package vmtest

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Defaults applied by Boot to zero Options fields.
const (
	DefaultQEMU      = "qemu-system-x86_64"
	DefaultTag       = "kvfs"
	DefaultMemSize   = "1G"
	DefaultSMP       = 2
	DefaultQueueSize = 1024
	DefaultTimeout   = 5 * time.Minute
)

// QEMU10 returns QEMU 10, which scripts/deps.sh unpacks beside the machine's QEMU 7.2 (what
// Kata pins), run by $KVFS_CACHE/bin/qemu-system-x86_64-10 (default /var/cache/kvfs/bin); a
// machine without it fails the test, as one without QEMU 7.2 does.
func QEMU10(t testing.TB) string {
	t.Helper()
	p := filepath.Join(cmp.Or(os.Getenv("KVFS_CACHE"), "/var/cache/kvfs"), "bin", "qemu-system-x86_64-10")
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("QEMU 10: %v (scripts/deps.sh installs it)", err)
	}
	return p
}

// Accelerators Boot knows.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// maxTagLen is the size of the tag field of struct virtio_fs_config.
const maxTagLen = 36

// Options describe one guest boot. Zero fields take the Default* values.
type Options struct {
	// Socket is the vhost-user socket of the virtio-fs server. Empty means
	// no virtio-fs device at all (the guest's mount then fails: KVFS-EXIT 99).
	Socket string
	// Tag is the virtio-fs tag, given to QEMU and to the guest's init.
	Tag string
	// MemSize is the guest memory in QEMU's syntax ("1G", "512M"). The
	// memory is a shared memfd, as vhost-user requires.
	MemSize string
	// SMP is the number of vCPUs.
	SMP int
	// QueueSize is the size of the virtio-fs request queue: a power of two,
	// at most 1024. The guest sends at most QueueSize-4 pages per request.
	QueueSize int
	// Cmdline is appended to the kernel command line.
	Cmdline string
	// Run is a script inside the share, relative to its root, that the
	// guest runs with sh after mounting (kvfs.run=). Empty runs nothing.
	Run string
	// Timeout bounds the whole boot; QEMU is killed when it expires.
	Timeout time.Duration
	// ExtraArgs are appended to QEMU's arguments.
	ExtraArgs []string
	// Accel is AccelKVM, AccelTCG or empty: $KVFS_ACCEL if set, else KVM
	// if a probe boot under KVM works (see the package doc), else TCG.
	Accel string
	// QEMU is the emulator binary.
	QEMU string
	// Console, if set, receives the serial console as it arrives (the
	// Result has it all at the end anyway).
	Console io.Writer
}

// Result is what one boot produced.
type Result struct {
	// Console is everything the guest wrote to its serial console, with
	// carriage returns removed.
	Console string
	// ExitStatus is the status from the guest's last "KVFS-EXIT n" line:
	// the script's exit status, 99 if the share could not be mounted, 98 if
	// the script was not found. -1 if the guest printed none.
	ExitStatus int
	// Stderr is QEMU's own diagnostics.
	Stderr string
	// Accel is the accelerator used, and AccelReason why.
	Accel, AccelReason string
	// Args is QEMU's command line, binary first.
	Args []string
	// Duration is how long QEMU ran.
	Duration time.Duration
}

func (o Options) withDefaults() Options {
	if o.QEMU == "" {
		o.QEMU = DefaultQEMU
	}
	if o.Tag == "" {
		o.Tag = DefaultTag
	}
	if o.MemSize == "" {
		o.MemSize = DefaultMemSize
	}
	if o.SMP == 0 {
		o.SMP = DefaultSMP
	}
	if o.QueueSize == 0 {
		o.QueueSize = DefaultQueueSize
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	return o
}

// KernelCmdline returns the guest kernel's command line for o (after
// defaults).
func (o Options) KernelCmdline() (string, error) {
	o = o.withDefaults()
	if err := cmdlineWord("tag", o.Tag); err != nil {
		return "", err
	}
	if len(o.Tag) > maxTagLen {
		return "", fmt.Errorf("vmtest: tag %q is longer than %d bytes", o.Tag, maxTagLen)
	}
	words := []string{"console=ttyS0", "quiet", "panic=-1", "kvfs.tag=" + o.Tag}
	if o.Run != "" {
		if err := cmdlineWord("run", o.Run); err != nil {
			return "", err
		}
		words = append(words, "kvfs.run="+o.Run)
	}
	if c := strings.TrimSpace(o.Cmdline); c != "" {
		words = append(words, c)
	}
	return strings.Join(words, " "), nil
}

// cmdlineWord checks that v can be one word of the kernel command line.
func cmdlineWord(what, v string) error {
	if v == "" {
		return fmt.Errorf("vmtest: empty %s", what)
	}
	for _, r := range v {
		if r <= ' ' || r == '"' || r == 0x7f {
			return fmt.Errorf("vmtest: %s %q contains a space, quote or control character", what, v)
		}
	}
	return nil
}

// QEMUArgs returns QEMU's arguments (without the binary) to boot g with o
// under accel. It starts nothing.
func (o Options) QEMUArgs(g Guest, accel string) ([]string, error) {
	o = o.withDefaults()
	switch {
	case accel != AccelKVM && accel != AccelTCG:
		return nil, fmt.Errorf("vmtest: unknown accelerator %q (want %s or %s)", accel, AccelKVM, AccelTCG)
	case g.Kernel == "" || g.Initrd == "":
		return nil, errors.New("vmtest: guest has no kernel or initrd")
	case o.SMP < 1:
		return nil, fmt.Errorf("vmtest: SMP %d < 1", o.SMP)
	case o.QueueSize < 1 || o.QueueSize > 1024 || o.QueueSize&(o.QueueSize-1) != 0:
		return nil, fmt.Errorf("vmtest: queue size %d is not a power of two in [1, 1024]", o.QueueSize)
	case strings.ContainsAny(o.MemSize, ", "):
		return nil, fmt.Errorf("vmtest: bad memory size %q", o.MemSize)
	}
	cmdline, err := o.KernelCmdline()
	if err != nil {
		return nil, err
	}
	args := []string{
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-machine", "q35,accel=" + accel,
		"-cpu", "max",
		"-smp", strconv.Itoa(o.SMP),
		"-m", o.MemSize,
		"-object", "memory-backend-memfd,id=mem,size=" + o.MemSize + ",share=on",
		"-numa", "node,memdev=mem",
	}
	if o.Socket != "" {
		args = append(args,
			"-chardev", "socket,id=vhostfs,path="+qemuEscape(o.Socket),
			"-device", fmt.Sprintf("vhost-user-fs-pci,chardev=vhostfs,tag=%s,queue-size=%d", qemuEscape(o.Tag), o.QueueSize),
		)
	}
	args = append(args,
		"-kernel", g.Kernel,
		"-initrd", g.Initrd,
		"-append", cmdline,
		"-serial", "stdio",
	)
	return append(args, o.ExtraArgs...), nil
}

// qemuEscape escapes a value inside a QEMU option string.
func qemuEscape(s string) string {
	return strings.ReplaceAll(s, ",", ",,")
}

// Boot runs g under QEMU with o until the guest powers off, QEMU fails or
// o.Timeout expires (QEMU is killed then). The Result is returned whenever
// QEMU was started, also with an error, so that callers can show the
// console. It is an error too when the guest printed no KVFS-EXIT line; a
// non-zero ExitStatus is not.
func Boot(ctx context.Context, g Guest, o Options) (*Result, error) {
	o = o.withDefaults()
	accel, why := o.Accel, "Options.Accel"
	if accel == "" {
		accel, why = chooseAccel(ctx, g, o.QEMU)
	}
	args, err := o.QEMUArgs(g, accel)
	if err != nil {
		return nil, err
	}
	res, err := run(ctx, o.QEMU, args, o.Timeout, o.Console)
	if res != nil {
		res.Accel, res.AccelReason = accel, why
	}
	return res, err
}

// run runs QEMU and collects what it printed.
func run(ctx context.Context, qemu string, args []string, timeout time.Duration, console io.Writer) (*Result, error) {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	var out, stderr bytes.Buffer
	cmd := exec.CommandContext(rctx, qemu, args...)
	cmd.Stdout = &out
	if console != nil {
		cmd.Stdout = io.MultiWriter(&out, console)
	}
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second

	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("vmtest: starting %s: %w", qemu, err)
	}
	runErr := cmd.Wait()
	res := &Result{
		Console:  strings.ReplaceAll(out.String(), "\r", ""),
		Stderr:   stderr.String(),
		Args:     append([]string{qemu}, args...),
		Duration: time.Since(start),
	}
	res.ExitStatus = ExitStatus(res.Console)

	switch {
	case ctx.Err() != nil:
		return res, fmt.Errorf("vmtest: boot cancelled after %v: %w", res.Duration.Round(time.Millisecond), ctx.Err())
	case rctx.Err() != nil:
		return res, fmt.Errorf("vmtest: guest still running after %v, killed", timeout)
	case runErr != nil:
		return res, fmt.Errorf("vmtest: %s: %v: %s", qemu, runErr, strings.TrimSpace(res.Stderr))
	case res.ExitStatus < 0:
		return res, errors.New("vmtest: the guest stopped without printing KVFS-EXIT")
	}
	return res, nil
}

// ExitStatus returns the status of the last "KVFS-EXIT n" line in a guest
// console log, or -1 if there is none.
func ExitStatus(console string) int {
	const marker = "KVFS-EXIT "
	for rest := console; ; {
		i := strings.LastIndex(rest, marker)
		if i < 0 {
			return -1
		}
		digits := rest[i+len(marker):]
		if j := strings.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }); j >= 0 {
			digits = digits[:j]
		}
		if n, err := strconv.Atoi(digits); err == nil && len(digits) <= 3 {
			return n
		}
		rest = rest[:i]
	}
}
