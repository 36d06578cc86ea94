package confine

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Action is what the seccomp filter does with a system call outside the allowlist.
type Action string

// The --seccomp actions.
const (
	// SeccompNone installs no filter.
	SeccompNone Action = "none"
	// SeccompKill kills the process (SECCOMP_RET_KILL_PROCESS): it dies of SIGSYS.
	SeccompKill Action = "kill"
	// SeccompLog allows the call and has the kernel log it (SECCOMP_RET_LOG).
	SeccompLog Action = "log"
	// SeccompTrap sends SIGSYS to the calling thread (SECCOMP_RET_TRAP); the Go runtime then
	// dies printing the goroutine trace of the call.
	SeccompTrap Action = "trap"
)

// ParseAction accepts none, kill, log and trap.
func ParseAction(s string) (Action, error) {
	switch a := Action(s); a {
	case SeccompNone, SeccompKill, SeccompLog, SeccompTrap:
		return a, nil
	}
	return "", fmt.Errorf("invalid seccomp action %q: want none, kill, log or trap", s)
}

// Syscall is an allowed system call.
type Syscall struct {
	Name string
	Nr   uintptr
	// Group is the table's group comment: why the call is allowed.
	Group string
	// ArgValue, when not -1, is the only value allowed for argument ArgIndex (counted from 0):
	// socket's address family, ioctl's request. Only the argument's low 32 bits are compared:
	// both are 32-bit in the kernel (int family, unsigned int cmd), which ignores the rest.
	ArgIndex int
	ArgValue int64
}

// Syscalls returns the allowlist, in table order.
func Syscalls() []Syscall { return slices.Clone(allowlist) }

// ErrArch is returned by InstallSeccomp on an architecture kvfsd has no allowlist for.
var ErrArch = errors.New("kvfsd has no seccomp allowlist for this architecture")

// Constants of linux/seccomp.h and linux/filter.h that x/sys/unix does not name.
const (
	retKillProcess = 0x80000000
	retTrap        = 0x00030000
	retLog         = 0x7ffc0000
	retAllow       = 0x7fff0000

	// Offsets in struct seccomp_data.
	offNr   = 0
	offArch = 4
	offArgs = 16 // args[0]; each is 8 bytes, its low 32 bits first on a little-endian machine

	x32SyscallBit = 0x40000000
)

// Filter returns the BPF program for action: the architecture check, the x32 check, then one
// comparison per allowed call.
func Filter(action Action) ([]unix.SockFilter, error) {
	if auditArch == 0 {
		return nil, ErrArch
	}
	var deny uint32
	switch action {
	case SeccompKill:
		deny = retKillProcess
	case SeccompLog:
		deny = retLog
	case SeccompTrap:
		deny = retTrap
	default:
		return nil, fmt.Errorf("no filter for seccomp action %q", action)
	}
	stmt := func(code uint16, k uint32) unix.SockFilter { return unix.SockFilter{Code: code, K: k} }
	jeq := func(k uint32, jt, jf uint8) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: jt, Jf: jf, K: k}
	}
	ret := func(k uint32) unix.SockFilter { return stmt(unix.BPF_RET|unix.BPF_K, k) }
	ldNr := stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, offNr)

	prog := []unix.SockFilter{
		stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, offArch),
		jeq(auditArch, 1, 0),
		ret(deny),
		ldNr,
		// x32 calls have the same numbers plus this bit: same arch, other ABI.
		{Code: unix.BPF_JMP | unix.BPF_JGE | unix.BPF_K, Jt: 0, Jf: 1, K: x32SyscallBit},
		ret(deny),
	}
	for _, s := range allowlist {
		if s.ArgValue < 0 {
			prog = append(prog, jeq(uint32(s.Nr), 0, 1), ret(retAllow))
			continue
		}
		// if nr == s.Nr { if arg == value { allow } else { deny } }; A is reloaded for the rest.
		prog = append(prog,
			jeq(uint32(s.Nr), 0, 4),
			stmt(unix.BPF_LD|unix.BPF_W|unix.BPF_ABS, uint32(offArgs+8*s.ArgIndex)),
			jeq(uint32(s.ArgValue), 0, 1),
			ret(retAllow),
			ret(deny),
		)
	}
	prog = append(prog, ret(deny))
	if len(prog) > unix.BPF_MAXINSNS {
		return nil, fmt.Errorf("seccomp filter has %d instructions, the kernel takes %d", len(prog), unix.BPF_MAXINSNS)
	}
	return prog, nil
}

// InstallSeccomp sets no_new_privs and installs the filter for action on every thread of the
// process; threads created later inherit it. SeccompNone installs nothing. It cannot be undone:
// call it when setting up is over (see the package documentation).
func InstallSeccomp(action Action) error {
	if action == SeccompNone {
		return nil
	}
	prog, err := Filter(action)
	if err != nil {
		return err
	}
	// no_new_privs is per thread: set it on the thread that installs the filter (TSYNC sets it
	// on the others).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: set no_new_privs: %w", err)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	r, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	switch {
	case errno != 0:
		return fmt.Errorf("seccomp: install filter: %w", errno)
	case r != 0:
		return fmt.Errorf("seccomp: thread %d cannot take the filter", r)
	}
	return nil
}
