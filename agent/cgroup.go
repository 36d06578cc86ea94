package agent

import (
	"context"
	"fmt"

	"github.com/containerd/cgroups/v3/cgroup2"
	"github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/sirupsen/logrus"
)

// DefaultCgroupRoot is where the agent mounts the cgroup2 hierarchy.
const DefaultCgroupRoot = "/sys/fs/cgroup"

// Cgroups reads containers' cgroups: their metrics and their OOM kills.
type Cgroups interface {
	// Stats answers the metrics of the cgroup at group (a path below the hierarchy's root,
	// the spec's linux.cgroupsPath).
	Stats(group string) (*stats.Metrics, error)
	// WatchOOM calls onOOM for each OOM kill in group until ctx ends or the group is empty
	// or removed.
	WatchOOM(ctx context.Context, group string, onOOM func())
}

// Cgroup2 is Cgroups on a cgroup2 hierarchy mounted at Root.
type Cgroup2 struct {
	Root string
	Log  *logrus.Entry
}

func (g Cgroup2) load(group string) (*cgroup2.Manager, error) {
	return cgroup2.Load(group, cgroup2.WithMountpoint(g.Root))
}

// Stats reads the group's metrics.
func (g Cgroup2) Stats(group string) (*stats.Metrics, error) {
	m, err := g.load(group)
	if err != nil {
		return nil, err
	}
	return m.Stat()
}

// WatchOOM follows memory.events of the group (inotify, through the cgroup2 manager) and calls
// onOOM each time its oom_kill count grows.
func (g Cgroup2) WatchOOM(ctx context.Context, group string, onOOM func()) {
	log := g.Log.WithField("cgroup", group)
	m, err := g.load(group)
	if err != nil {
		log.WithError(err).Warn("OOM events not watched")
		return
	}
	events, errs := m.EventChan()
	var kills uint64
	count := func(e cgroup2.Event) {
		for ; kills < e.OOMKill; kills++ {
			onOOM()
		}
	}
	for {
		select {
		case e := <-events:
			count(e)
		case err, ok := <-errs:
			if ok && err != nil {
				log.WithError(fmt.Errorf("memory.events: %w", err)).Debug("OOM watch ended")
			}
			// The manager ends after its last event (the kill that emptied the group may
			// be it), which can still wait in the channel.
			select {
			case e := <-events:
				count(e)
			default:
			}
			return
		case <-ctx.Done():
			// The manager's reader ends with the group (emptied or removed); nobody needs
			// its events any more.
			go drain(events, errs)
			return
		}
	}
}

func drain(events <-chan cgroup2.Event, errs <-chan error) {
	for {
		select {
		case <-events:
		case <-errs:
			return
		}
	}
}
