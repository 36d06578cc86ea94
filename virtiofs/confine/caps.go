package confine

import (
	"errors"
	"fmt"
	"os/exec"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// Capability is a Linux capability's number (unix.CAP_*).
type Capability int

// ServerCapabilities are the capabilities a confined server keeps: what serving the files of
// guest users of any uid needs (each request runs with the caller's fsuid and fsgid, which takes
// the file-system capabilities away from the thread for the request's duration and gives them
// back after it), and nothing more:
//
//	CAP_CHOWN, CAP_FOWNER, CAP_FSETID  chown, chmod, times and attributes of the guest's files;
//	                                   set-group-ID bits kept as the guest asks
//	CAP_DAC_OVERRIDE                   lookups and opens in the guest's directories, whatever
//	                                   their modes, while serving as root
//	CAP_SETUID, CAP_SETGID             setfsuid and setfsgid to the guest caller's ids
//	CAP_MKNOD                          device nodes the guest creates (container images have them)
//	CAP_SETFCAP                        security.capability attributes (file capabilities)
//
// Everything else is dropped, notably CAP_SYS_ADMIN (so trusted.* attributes, among them the
// DAX policy attribute trusted.kvfs.dax, are neither visible nor settable: DAX rules and
// FS_XFLAG_DAX still work), CAP_DAC_READ_SEARCH (open_by_handle_at opens any file of a file
// system from a handle, around the root the server was confined to: a confined server keeps
// no inode file handles), CAP_SYS_RESOURCE (raise RLIMIT_NOFILE before dropping it) and every
// capability over the network, other processes and the kernel.
var ServerCapabilities = []Capability{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FOWNER, unix.CAP_FSETID,
	unix.CAP_SETUID, unix.CAP_SETGID, unix.CAP_MKNOD, unix.CAP_SETFCAP,
}

// maxCapability bounds the bounding-set loop: the kernel numbers capabilities from 0 to its
// /proc/sys/kernel/cap_last_cap (40 in Linux 6.1) and answers EINVAL above.
const maxCapability = 63

// StartWithCapabilities starts cmd keeping only the capabilities keep, on every thread of the
// new program. Capabilities are per thread and a running Go program has several, which only
// syscall.AllThreadsSyscall reaches, and that only in a binary built without cgo (so neither
// with the race detector nor with Debian's default build of a program that uses package net).
// A new process, though, starts with one thread, whose capabilities every later thread
// inherits, and it gets them from the thread that forked it. So a thread of its own, locked to
// a goroutine that never unlocks it (the thread ends with the goroutine), drops the others from
// its bounding set, clears its ambient and inheritable sets, reduces its permitted and
// effective sets to keep, and starts cmd. For root, a program's capabilities after execve are
// its bounding set: the new program has exactly keep (those of keep this process had) in its
// bounding, permitted and effective sets, and none it could regain. The calling thread, and so
// this process, keeps its own.
func StartWithCapabilities(cmd *exec.Cmd, keep []Capability) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see above
		if err := dropCapabilities(keep); err != nil {
			errc <- err
			return
		}
		errc <- cmd.Start()
	}()
	return <-errc
}

// dropCapabilities reduces the calling thread's capabilities to keep (see
// StartWithCapabilities).
func dropCapabilities(keep []Capability) error {
	var keepMask uint64
	for _, c := range keep {
		if c < 0 || c > maxCapability {
			return fmt.Errorf("capabilities: no capability %d", c)
		}
		keepMask |= 1 << c
	}
	for c := 0; c <= maxCapability; c++ {
		if keepMask&(1<<c) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
			if errors.Is(err, unix.EINVAL) {
				break // beyond the kernel's last capability
			}
			return fmt.Errorf("capabilities: drop capability %d from the bounding set: %w", c, err)
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("capabilities: clear the ambient set: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capabilities: capget: %w", err)
	}
	for i := range data {
		m := uint32(keepMask >> (32 * i))
		data[i].Permitted &= m
		data[i].Effective = data[i].Permitted
		data[i].Inheritable = 0
	}
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capabilities: capset: %w", err)
	}
	return nil
}

// capabilityNames are the kernel's capability names (capabilities(7)) without "CAP_", in
// lower case, by number.
var capabilityNames = []string{
	"chown", "dac_override", "dac_read_search", "fowner", "fsetid", "kill", "setgid", "setuid",
	"setpcap", "linux_immutable", "net_bind_service", "net_broadcast", "net_admin", "net_raw",
	"ipc_lock", "ipc_owner", "sys_module", "sys_rawio", "sys_chroot", "sys_ptrace", "sys_pacct",
	"sys_admin", "sys_boot", "sys_nice", "sys_resource", "sys_time", "sys_tty_config", "mknod",
	"lease", "audit_write", "audit_control", "setfcap", "mac_override", "mac_admin", "syslog",
	"wake_alarm", "block_suspend", "audit_read", "perfmon", "bpf", "checkpoint_restore",
}

// CapabilityChange is one item of virtiofsd's modcaps list: a capability added to the ones a
// confined server keeps, or removed from them.
type CapabilityChange struct {
	Cap Capability
	Add bool
}

// ParseModcaps parses virtiofsd's modcaps list: items separated by ':', each '+' or '-' and a
// capability's name, with or without "cap_", in either case ("+sys_admin:-mknod").
func ParseModcaps(list string) ([]CapabilityChange, error) {
	var changes []CapabilityChange
	for _, item := range strings.Split(list, ":") {
		if len(item) < 2 || item[0] != '+' && item[0] != '-' {
			return nil, fmt.Errorf("%q: want +NAME or -NAME (a capability, e.g. +sys_admin)", item)
		}
		name := strings.TrimPrefix(strings.ToLower(item[1:]), "cap_")
		c := slices.Index(capabilityNames, name)
		if c < 0 {
			return nil, fmt.Errorf("%q: no capability %s", item, item[1:])
		}
		changes = append(changes, CapabilityChange{Cap: Capability(c), Add: item[0] == '+'})
	}
	return changes, nil
}

// ModifyCapabilities applies changes, in order, to a copy of keep.
func ModifyCapabilities(keep []Capability, changes []CapabilityChange) []Capability {
	out := slices.Clone(keep)
	for _, ch := range changes {
		out = slices.DeleteFunc(out, func(c Capability) bool { return c == ch.Cap })
		if ch.Add {
			out = append(out, ch.Cap)
		}
	}
	return out
}
