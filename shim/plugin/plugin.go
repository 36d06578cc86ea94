// Package plugin registers the kvfs task service, which serves the Sandbox API beside the
// task API, with containerd's shim framework (pkg/shim.RunShim loads TTRPC plugins):
// importing it is what a shim binary does.
package plugin

import (
	cshim "github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"

	"github.com/kvfs/kvfs/shim"
)

func init() {
	registry.Register(&plugin.Registration{
		Type:     plugins.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugins.EventPlugin, plugins.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (any, error) {
			pp, err := ic.GetByID(plugins.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			sd, err := ic.GetByID(plugins.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			publisher := pp.(cshim.Publisher)
			svc := shim.NewService(ic.Context, shim.Options{
				Publisher: publisher,
				Shutdown:  sd.(shutdown.Service),
				StartPod:  shim.StartVMPod,
			})
			sd.(shutdown.Service).RegisterCallback(svc.Close)
			return svc, nil
		},
	})
}
