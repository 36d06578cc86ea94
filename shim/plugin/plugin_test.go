package plugin

import (
	"slices"
	"testing"

	cshim "github.com/containerd/containerd/v2/pkg/shim"
	"github.com/containerd/containerd/v2/plugins"
	"github.com/containerd/plugin"
	"github.com/containerd/plugin/registry"
)

// TestGraph: the shim's parts load in an order that gives each what it requires (the pod
// owner before the services that share it), and the error edge is a ttrpc interceptor, as
// pkg/shim.RunShim looks for one.
func TestGraph(t *testing.T) {
	var order []string
	for _, r := range registry.Graph(func(*plugin.Registration) bool { return false }) {
		order = append(order, r.URI())
	}
	pod := slices.Index(order, string(PodPlugin)+"."+podPluginID)
	task := slices.Index(order, string(plugins.TTRPCPlugin)+".task")
	sandbox := slices.Index(order, string(plugins.TTRPCPlugin)+".sandbox")
	edge := slices.Index(order, string(plugins.InternalPlugin)+".kvfs.errors")
	if pod < 0 || task < pod || sandbox < pod || edge < 0 {
		t.Errorf("load order %q: want the pod owner before the task and sandbox services, and the error edge", order)
	}
	for _, r := range registry.Graph(func(*plugin.Registration) bool { return false }) {
		if r.URI() != string(plugins.InternalPlugin)+".kvfs.errors" {
			continue
		}
		inst, err := r.Init(plugin.NewContext(t.Context(), plugin.NewPluginSet(), nil)).Instance()
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := inst.(cshim.TTRPCServerUnaryOptioner); !ok {
			t.Errorf("the error edge %T is not a ttrpc server interceptor", inst)
		}
	}
}
