package agent

import (
	"context"
	"errors"
	"io/fs"
	"maps"
	"os"
	"slices"
	"syscall"

	"github.com/containerd/errdefs"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// SetSysctls implements the RPC: the request is checked whole (apiv1.CheckSysctls) before
// anything is written, then each sysctl is written below Config.SysctlDir, in name order,
// through an os.Root (nothing outside it is reached). The guest's kernel is the pod's, and its
// namespaces the containers': what a pod sets here is its own, whatever the host's policy
// calls unsafe (which the kubelet has already applied).
func (s *Service) SetSysctls(ctx context.Context, req *apiv1.SetSysctlsRequest) (*apiv1.SetSysctlsResponse, error) {
	if err := apiv1.CheckSysctls(req.Sysctls); err != nil {
		return nil, errf(errdefs.ErrInvalidArgument, "%v", err)
	}
	s.netMu.Lock()
	defer s.netMu.Unlock()
	root, err := os.OpenRoot(s.cfg.SysctlDir)
	if err != nil {
		return nil, errf(errdefs.ErrInternal, "%v", err)
	}
	defer root.Close()
	for _, name := range slices.Sorted(maps.Keys(req.Sysctls)) {
		p, _ := apiv1.SysctlPath(name) // checked above
		if err := writeSysctl(root, p, req.Sysctls[name]); err != nil {
			switch {
			case errors.Is(err, fs.ErrNotExist):
				return nil, errf(errdefs.ErrNotFound, "sysctl %s: the guest's kernel has none", name)
			case errors.Is(err, syscall.EINVAL), errors.Is(err, syscall.ERANGE):
				return nil, errf(errdefs.ErrInvalidArgument, "sysctl %s: the guest's kernel refuses %q: %v", name, req.Sysctls[name], err)
			}
			return nil, errf(errdefs.ErrInternal, "sysctl %s: %v", name, err)
		}
		s.log.WithField("sysctl", name).WithField("value", req.Sysctls[name]).Info("sysctl set")
	}
	return &apiv1.SetSysctlsResponse{}, nil
}

func writeSysctl(root *os.Root, path, value string) error {
	f, err := root.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0) // as runc writes them
	if err != nil {
		return err
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
