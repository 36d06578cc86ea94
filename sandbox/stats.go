package sandbox

import (
	"fmt"
	"time"

	"github.com/kvfs/kvfs/virtiofs"
)

// What a sandbox reports about itself (Stats): its phase, its server's counters, its VM.

// Stats is what a sandbox reports about itself.
type Stats struct {
	ID    string
	Phase Phase
	// Server is the current server.
	Server ServerStats
	// VM is nil before Start.
	VM *VMStats
	// Failure is why the sandbox failed, if it did.
	Failure string
}

// ServerStats describes the virtio-fs server.
type ServerStats struct {
	// Daemon is Confined, InProcessUnconfined or the external daemon's path.
	Daemon string
	// PID is the server's process: the owner's own for the in-process server; for a confined
	// server, its supervisor's (PID 1 of its namespaces; the serving process is its child).
	PID     int
	Started time.Time
	Uptime  time.Duration
	Running bool
	// Restarts counts restarts by the restart policy; LastFailure is the last server failure.
	Restarts    int
	LastFailure string
	// FS holds kvfsd's counters (requests per opcode, errors, latency, bytes, inodes, open
	// files), asked over its channel for a confined server; nil for an external daemon, of
	// which only the above is known, and for a confined server that did not answer.
	FS *virtiofs.Stats
}

// VMStats describes the VM's process.
type VMStats struct {
	PID     int
	Started time.Time
	Uptime  time.Duration
	Running bool
	// Exit is how it exited, once it has.
	Exit string
}

// Stats returns a snapshot of the sandbox's state and its server's counters.
func (s *Sandbox) Stats() Stats {
	s.mu.Lock()
	srv, vm, rec := s.srv, s.vm, s.vmRec
	st := Stats{ID: s.id, Phase: s.phase}
	restarts := s.restarts
	if s.failure != nil {
		st.Failure = s.failure.Error()
	}
	var last string
	if s.lastFailure != nil {
		last = s.lastFailure.Error()
	}
	s.mu.Unlock()
	if srv != nil {
		st.Server = srv.info()
	}
	st.Server.Restarts, st.Server.LastFailure = restarts, last
	if vm != nil {
		v := &VMStats{PID: vm.Pid(), Running: !isClosed(vm.Exited())}
		if rec != nil {
			v.Started, v.Uptime = rec.Started, time.Since(rec.Started)
		}
		if !v.Running {
			v.Exit = fmt.Sprint(vm.ExitErr())
		}
		st.VM = v
	}
	return st
}
