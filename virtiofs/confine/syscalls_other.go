//go:build !amd64

package confine

// auditArch 0 means there is no allowlist for this architecture: InstallSeccomp fails with
// ErrArch.
const auditArch = 0

var allowlist []Syscall
