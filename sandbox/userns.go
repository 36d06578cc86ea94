package sandbox

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// IDMapping maps Size ids from ContainerID up, in a user namespace, to host ids from HostID
// up: a line of /proc/PID/uid_map.
type IDMapping struct {
	ContainerID, HostID, Size uint32
}

// UserNamespace returns a new user namespace of the mappings uids and gids, open, for
// BindIDMapped. It is made by a child started in it (this program, stopped by ptrace before
// it runs any of itself), which is killed and reaped before UserNamespace returns: the
// descriptor alone holds the namespace.
func UserNamespace(uids, gids []IDMapping) (*os.File, error) {
	cmd := exec.Command("/proc/self/exe")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWUSER, UidMappings: sysIDMap(uids), GidMappings: sysIDMap(gids),
		Ptrace: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("a process in a new user namespace of uids %v and gids %v: %w", uids, gids, err)
	}
	// The child is not reaped until the namespace is open: its pid names it.
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid))
	if err != nil {
		return nil, fmt.Errorf("opening the user namespace: %w", err)
	}
	return f, nil
}

func sysIDMap(m []IDMapping) []syscall.SysProcIDMap {
	out := make([]syscall.SysProcIDMap, len(m))
	for i, e := range m {
		out[i] = syscall.SysProcIDMap{ContainerID: int(e.ContainerID), HostID: int(e.HostID), Size: int(e.Size)}
	}
	return out
}
