package ctl

import (
	"encoding/json"
	"io"
	"time"

	control "github.com/kvfs/kvfs/api/control/v1"
)

// The JSON output. Its field names are kvfsctl's interface to scripts: they are declared here,
// independently of the protobuf messages, so that renaming a message field cannot change them
// (TestJSONFieldNames pins them). Times are RFC 3339 with nanoseconds; durations are in
// nanoseconds; absent parts are null.

type listOutput struct {
	Sandboxes []sandboxJSON `json:"sandboxes"`
}

type sandboxJSON struct {
	ID            string `json:"id"`
	Phase         string `json:"phase"`
	Daemon        string `json:"daemon"`
	ServerRunning bool   `json:"server_running"`
	VMPID         int64  `json:"vm_pid"`
	VMRunning     bool   `json:"vm_running"`
	Failure       string `json:"failure"`
}

type statusOutput struct {
	Sandbox sandboxJSON `json:"sandbox"`
	Server  serverJSON  `json:"server"`
	VM      *vmJSON     `json:"vm"`
}

type serverJSON struct {
	Daemon      string     `json:"daemon"`
	PID         int64      `json:"pid"`
	Started     *time.Time `json:"started"`
	UptimeNS    int64      `json:"uptime_ns"`
	Running     bool       `json:"running"`
	Restarts    uint32     `json:"restarts"`
	LastFailure string     `json:"last_failure"`
	// Stats is null for an external daemon.
	Stats *statsJSON `json:"stats"`
}

type statsJSON struct {
	BytesRead       uint64 `json:"bytes_read"`
	BytesWritten    uint64 `json:"bytes_written"`
	Malformed       uint64 `json:"malformed"`
	Panics          uint64 `json:"panics"`
	CachedInodes    uint64 `json:"cached_inodes"`
	OpenHandles     uint64 `json:"open_handles"`
	OpenFDs         uint64 `json:"open_fds"`
	BlockedRequests uint64 `json:"blocked_requests"`
	QueueDepth      uint64 `json:"queue_depth"`
	// LatencyBoundsSeconds are the upper bounds of the buckets of every op's histogram; the
	// last bucket (one more than the bounds) is unbounded.
	LatencyBoundsSeconds []float64 `json:"latency_bounds_seconds"`
	Ops                  []opJSON  `json:"ops"`
}

type opJSON struct {
	Opcode         string   `json:"opcode"`
	Count          uint64   `json:"count"`
	Errors         uint64   `json:"errors"`
	TotalTimeNS    uint64   `json:"total_time_ns"`
	LatencyBuckets []uint64 `json:"latency_buckets"`
}

type vmJSON struct {
	PID      int64      `json:"pid"`
	Started  *time.Time `json:"started"`
	UptimeNS int64      `json:"uptime_ns"`
	Running  bool       `json:"running"`
	Exit     string     `json:"exit"`
}

type stopJSON struct {
	ID      string `json:"id"`
	Stopped bool   `json:"stopped"`
}

type logLevelJSON struct {
	// ID names the sandbox whose shim answered, when kvfsctl asked every one it found.
	ID            string `json:"id,omitempty"`
	PreviousLevel string `json:"previous_level"`
	Level         string `json:"level"`
}

type daxJSON struct {
	ID     string `json:"id"`
	Policy string `json:"policy"`
}

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func listJSON(r *control.ListSandboxesResponse) listOutput {
	out := listOutput{Sandboxes: []sandboxJSON{}}
	for _, s := range r.GetSandboxes() {
		out.Sandboxes = append(out.Sandboxes, summaryJSON(s))
	}
	return out
}

func summaryJSON(s *control.SandboxSummary) sandboxJSON {
	return sandboxJSON{
		ID:            s.GetId(),
		Phase:         s.GetPhase(),
		Daemon:        s.GetDaemon(),
		ServerRunning: s.GetServerRunning(),
		VMPID:         s.GetVmPid(),
		VMRunning:     s.GetVmRunning(),
		Failure:       s.GetFailure(),
	}
}

func timeJSON(ns int64) *time.Time {
	if ns == 0 {
		return nil
	}
	t := time.Unix(0, ns).UTC()
	return &t
}

func statusJSON(r *control.SandboxStatusResponse) statusOutput {
	srv := r.GetServer()
	out := statusOutput{
		Sandbox: summaryJSON(r.GetSandbox()),
		Server: serverJSON{
			Daemon:      srv.GetDaemon(),
			PID:         srv.GetPid(),
			Started:     timeJSON(srv.GetStartedUnixNano()),
			UptimeNS:    srv.GetUptimeNano(),
			Running:     srv.GetRunning(),
			Restarts:    srv.GetRestarts(),
			LastFailure: srv.GetLastFailure(),
		},
	}
	if st := srv.GetStats(); st != nil {
		s := &statsJSON{
			BytesRead:            st.GetBytesRead(),
			BytesWritten:         st.GetBytesWritten(),
			Malformed:            st.GetMalformed(),
			Panics:               st.GetPanics(),
			CachedInodes:         st.GetCachedInodes(),
			OpenHandles:          st.GetOpenHandles(),
			OpenFDs:              st.GetOpenFds(),
			BlockedRequests:      st.GetBlockedRequests(),
			QueueDepth:           st.GetQueueDepth(),
			LatencyBoundsSeconds: append([]float64{}, st.GetLatencyBucketBoundsSeconds()...),
			Ops:                  []opJSON{},
		}
		for _, o := range st.GetOps() {
			s.Ops = append(s.Ops, opJSON{
				Opcode:         o.GetOpcode(),
				Count:          o.GetCount(),
				Errors:         o.GetErrors(),
				TotalTimeNS:    o.GetTotalTimeNano(),
				LatencyBuckets: append([]uint64{}, o.GetLatencyBuckets()...),
			})
		}
		out.Server.Stats = s
	}
	if vm := r.GetVm(); vm != nil {
		out.VM = &vmJSON{
			PID:      vm.GetPid(),
			Started:  timeJSON(vm.GetStartedUnixNano()),
			UptimeNS: vm.GetUptimeNano(),
			Running:  vm.GetRunning(),
			Exit:     vm.GetExit(),
		}
	}
	return out
}
