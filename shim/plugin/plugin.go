// Package plugin registers the kvfs shim's parts with containerd's shim framework
// (pkg/shim.RunShim loads them in the order of what they require): importing it is what a
// shim binary does. The parts:
//
//   - "pod" (of the shim's own type, PodPlugin): the Pod, the pod's state and life,
//     which the two services share; stopped by the shim's shutdown.
//   - "task" and "sandbox" (ttrpc): containerd's task API and Sandbox API on that pod.
//   - "kvfs.errors" (internal): ErrorEdge, the ttrpc server interceptor that translates the
//     services' errors for containerd.
package plugin

import (
	cshim "github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/pkg/shutdown"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"

	"github.com/kvfs/kvfs/shim"
)

// PodPlugin is the type of the Pod's plugin. It is a type of its own because a plugin may
// not require its own type, and the owner requires the internal shutdown plugin.
const PodPlugin plugin.Type = "io.kvfs.pod.v1"

// podPluginID is the Pod's plugin.
const podPluginID = "pod"

func init() {
	registry.Register(&plugin.Registration{
		Type: plugins.InternalPlugin,
		ID:   "kvfs.errors",
		InitFn: func(*plugin.InitContext) (any, error) {
			return shim.ErrorEdge{}, nil
		},
	})
	registry.Register(&plugin.Registration{
		Type:     PodPlugin,
		ID:       podPluginID,
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
			o := shim.NewPod(ic.Context, shim.Options{
				Publisher: pp.(cshim.Publisher),
				Shutdown:  sd.(shutdown.Service),
				StartVM:   shim.StartQEMUVM,
			})
			sd.(shutdown.Service).RegisterCallback(o.Close)
			return o, nil
		},
	})
	for id, service := range map[string]func(*shim.Pod) any{
		"task":    func(o *shim.Pod) any { return shim.NewTaskService(o) },
		"sandbox": func(o *shim.Pod) any { return shim.NewSandboxService(o) },
	} {
		registry.Register(&plugin.Registration{
			Type:     plugins.TTRPCPlugin,
			ID:       id,
			Requires: []plugin.Type{PodPlugin},
			InitFn: func(ic *plugin.InitContext) (any, error) {
				o, err := ic.GetByID(PodPlugin, podPluginID)
				if err != nil {
					return nil, err
				}
				return service(o.(*shim.Pod)), nil
			},
		})
	}
}
