//go:build !amd64

package confine

// auditArch 0 means there is no allowlist for this architecture: InstallSeccomp fails with
// ErrArch.
const auditArch = 0

var allowlist []Syscall

// DefaultAction is kvfsd's default --seccomp: none, as there is no allowlist here.
const DefaultAction = SeccompNone
