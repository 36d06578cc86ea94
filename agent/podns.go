package agent

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"syscall"

	"github.com/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// The pod's shared namespaces, those a runc pod's containers join from its pause container:
//
//   - The PID namespace (Kubernetes' shareProcessNamespace: the CRI's namespace mode POD for
//     PID). Under runc the pod's containers see each other's processes, and the pause process
//     as PID 1, nothing of the node's. In the guest they join one the agent makes at first use
//     (the shim names it apiv1.PodPIDNamespace in a spec), so that they do not see the agent
//     and the guest's other processes, or signal them.
//   - The user namespace (Kubernetes' hostUsers: false: the CRI's user namespace mode POD).
//     The shim names it apiv1.PodUserNamespace, with the pod's one uid and one gid mapping,
//     the same for every container of the pod; container root is then the mapped id, a
//     guest id without privilege over the guest, the agent or the share's other files.
//
// Both are those of PodInit, a small C program (packaging/guest/pod-init.c) that reaps the
// orphans of its PID namespace and keeps every other signal's default action, so that nothing
// inside the namespace can end it. A pod with a user namespace has PodInit started in it, and
// its PID namespace in it too: a container can mount /proc only for a PID namespace its own
// user namespace owns. The agent holds each namespace open by a descriptor, and runc joins it
// through /proc/<agent>/fd/N: a path that never names another namespace, even once PodInit is
// gone and its pid reused (runc then fails to fork in the dead namespace, and says so).

// PodInit is the init of the pod's shared namespaces, in the agent's image.
const PodInit = "/bin/kvfs-pod-init"

// podNamespaces makes the pod's shared namespaces at first use.
type podNamespaces struct {
	init string // PodInit, or a stand-in in tests

	mu             sync.Mutex
	pid, user      string                 // guarded by mu; their paths, "" until made
	uidMap, gidMap []specs.LinuxIDMapping // guarded by mu; the user namespace's
}

// PID returns the path runc joins the pod's PID namespace by, making it (outside any user
// namespace) if it is not made yet.
func (n *podNamespaces) PID() (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.pid == "" {
		if err := n.startLocked(nil, nil); err != nil {
			return "", err
		}
	}
	return n.pid, nil
}

// User returns the path runc joins the pod's user namespace by, making it with the mappings
// uids and gids (and the pod's PID namespace with it) if it is not made yet. Every container
// of the pod must ask for the same mappings, and a pod whose PID namespace is already made
// has no user namespace.
func (n *podNamespaces) User(uids, gids []specs.LinuxIDMapping) (string, error) {
	if len(uids) == 0 || len(gids) == 0 {
		return "", fmt.Errorf("the pod's user namespace needs the spec's uid and gid mappings")
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	switch {
	case n.user != "":
		if !slices.Equal(uids, n.uidMap) || !slices.Equal(gids, n.gidMap) {
			return "", fmt.Errorf("the pod's user namespace maps uids %v and gids %v, not %v and %v", n.uidMap, n.gidMap, uids, gids)
		}
		return n.user, nil
	case n.pid != "":
		return "", fmt.Errorf("the pod's PID namespace was made without a user namespace: its containers cannot have one")
	}
	if err := n.startLocked(uids, gids); err != nil {
		return "", err
	}
	return n.user, nil
}

// startLocked starts the namespaces' init in a new PID namespace, and a new user namespace
// with uids and gids if they are given, and opens them.
func (n *podNamespaces) startLocked(uids, gids []specs.LinuxIDMapping) error {
	cmd := exec.Command(n.init)
	attr := &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID, Setsid: true}
	if uids != nil {
		attr.Cloneflags |= syscall.CLONE_NEWUSER
		attr.UidMappings, attr.GidMappings = sysIDMap(uids), sysIDMap(gids)
		// runc sets the containers' groups in it.
		attr.GidMappingsEnableSetgroups = true
	}
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting the init of the pod's namespaces: %w", err)
	}
	pid := cmd.Process.Pid
	// The reaper collects it, if it ever exits.
	_ = cmd.Process.Release()
	pidFD, err := openNamespace(pid, "pid")
	userFD := -1
	if err == nil && uids != nil {
		if userFD, err = openNamespace(pid, "user"); err != nil {
			unix.Close(pidFD)
		}
	}
	if err != nil {
		_ = unix.Kill(pid, unix.SIGKILL)
		return err
	}
	n.pid = agentFDPath(pidFD)
	if userFD >= 0 {
		n.user = agentFDPath(userFD)
	}
	n.uidMap, n.gidMap = slices.Clone(uids), slices.Clone(gids)
	return nil
}

func openNamespace(pid int, ns string) (int, error) {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, ns), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening the pod's %s namespace: %w", ns, err)
	}
	return fd, nil
}

// agentFDPath is the path of the agent's descriptor fd, as another process opens it.
func agentFDPath(fd int) string { return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd) }

func sysIDMap(m []specs.LinuxIDMapping) []syscall.SysProcIDMap {
	out := make([]syscall.SysProcIDMap, len(m))
	for i, e := range m {
		out[i] = syscall.SysProcIDMap{ContainerID: int(e.ContainerID), HostID: int(e.HostID), Size: int(e.Size)}
	}
	return out
}

// joinPodNamespaces replaces the names of the pod's shared namespaces in l
// (apiv1.PodUserNamespace, apiv1.PodPIDNamespace) with the paths runc joins them by, the user
// namespace first: the pod's PID namespace is made in it.
func (s *Service) joinPodNamespaces(l *specs.Linux) error {
	for _, t := range []specs.LinuxNamespaceType{specs.UserNamespace, specs.PIDNamespace} {
		for i, ns := range l.Namespaces {
			var p string
			var err error
			switch {
			case t == specs.UserNamespace && ns.Type == t && ns.Path == apiv1.PodUserNamespace:
				p, err = s.podNS.User(l.UIDMappings, l.GIDMappings)
			case t == specs.PIDNamespace && ns.Type == t && ns.Path == apiv1.PodPIDNamespace:
				p, err = s.podNS.PID()
			default:
				continue
			}
			if err != nil {
				return errf(errdefs.ErrFailedPrecondition, "spec: %v", err)
			}
			l.Namespaces[i].Path = p
		}
	}
	return nil
}
