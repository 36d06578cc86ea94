package agent

import (
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// The pod's shared PID namespace (Kubernetes' shareProcessNamespace: the CRI's namespace mode
// POD for PID). Under runc the pod's containers join the pause container's: they see each
// other's processes, and the pause process as PID 1, nothing of the node's. In the guest
// they join one the agent makes at first use (the shim names it apiv1.PodPIDNamespace in a
// spec), so that they do not see the agent and the guest's other processes, or signal them.
// Its init is PodInit, a small C program (packaging/guest/pod-init.c) that reaps the orphans
// of the namespace and keeps every other signal's default action, so that nothing inside the
// namespace can end it. The agent holds the namespace open by a descriptor, and runc joins it
// through /proc/<agent>/fd/N: a path that never names another namespace, even once PodInit is
// gone and its pid reused (runc then fails to fork in the dead namespace, and says so).

// PodInit is the init of the pod's shared PID namespace, in the agent's image.
const PodInit = "/bin/kvfs-pod-init"

// podPIDNamespace makes the pod's shared PID namespace at first use.
type podPIDNamespace struct {
	init string // PodInit, or a stand-in in tests

	mu   sync.Mutex
	path string // guarded by mu; "" until made
}

// Path returns the path runc joins the namespace by, making it if it is not made yet.
func (n *podPIDNamespace) Path() (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.path != "" {
		return n.path, nil
	}
	cmd := exec.Command(n.init)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("starting the init of the pod's PID namespace: %w", err)
	}
	pid := cmd.Process.Pid
	// The reaper collects it, if it ever exits.
	_ = cmd.Process.Release()
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/pid", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		_ = unix.Kill(pid, unix.SIGKILL)
		return "", fmt.Errorf("opening the pod's PID namespace: %w", err)
	}
	n.path = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
	return n.path, nil
}
