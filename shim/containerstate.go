package shim

// A container's state, as the pod and the container's own methods (container.go) share it:
// its init and execs, and what the host declared of them.

import (
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// Container is one Container of the pod.
type Container struct {
	id, bundle string
	env        *podEnv // the pod's
	init       *process
	// Set by Create before the container is ready, read after: no lock.
	rootfsMounted bool     // <bundle>/rootfs was mounted by us
	binds         []string // names bound in the share, the rootfs (the id) first
	hooks         containerHooks

	lastStats statsCache // the guest's last Stats answer (stats.go)

	mu    sync.Mutex
	ready bool                // guarded by mu; Create has finished
	execs map[string]*process // guarded by mu
	// strays says the host declared an exec of c exited that the guest had not reported
	// (guarded by mu): it may still run there, and the guest may refuse to delete c for it.
	strays bool
}

// endExecByHost declares c's exec p exited without the guest's report (process.endByHost),
// and says whether it did. The stray is recorded under c.mu with the declaration (lock order:
// c.mu, then p.mu): a Wait that returns may be followed at once by the container's Delete,
// which must find it.
func (c *Container) endExecByHost(p *process) bool {
	c.mu.Lock()
	endCalls, ok := p.endByHost()
	if ok {
		c.strays = true
	}
	c.mu.Unlock()
	if endCalls != nil {
		endCalls()
	}
	return ok
}

// hasStrays says whether the host declared an exec of c exited that the guest had not
// reported.
func (c *Container) hasStrays() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.strays
}

// markAllKilled marks every process of cs as killed by the host: those the pod's end that
// follows ends exit with exitKilled.
func markAllKilled(cs []*Container) {
	for _, c := range cs {
		c.init.markKilled()
		c.mu.Lock()
		for _, e := range c.execs {
			e.markKilled()
		}
		c.mu.Unlock()
	}
}

// containerHooks is what a container's host hooks are run with: its spec's hooks and
// annotations. (AdaptSpec gives the guest the container-namespace phases.)
type containerHooks struct {
	hooks       *specs.Hooks
	annotations map[string]string
}

// forgetExec takes exec p out of c's execs.
func (c *Container) forgetExec(p *process) {
	c.mu.Lock()
	delete(c.execs, p.execID)
	c.mu.Unlock()
}

// runningExecs are the ids of c's execs not yet exited.
func (c *Container) runningExecs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var running []string
	for id, e := range c.execs {
		if st, _, _ := e.snapshot(); st != stateStopped && st != stateDeleted {
			running = append(running, id)
		}
	}
	return running
}
