package ctl

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
	"time"

	control "github.com/kvfs/kvfs/api/control/v1"
)

func table(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
}

func writeList(w io.Writer, r *control.ListSandboxesResponse) error {
	tw := table(w)
	fmt.Fprintln(tw, "ID\tPHASE\tSERVER\tVM\tFAILURE")
	for _, s := range r.GetSandboxes() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", s.GetId(), s.GetPhase(), serverWord(s.GetDaemon(), s.GetServerRunning()),
			vmWord(s.GetVmPid(), s.GetVmRunning()), dash(s.GetFailure()))
	}
	return tw.Flush()
}

func serverWord(daemon string, running bool) string {
	state := "stopped"
	if running {
		state = "running"
	}
	return daemon + " (" + state + ")"
}

func vmWord(pid int64, running bool) string {
	switch {
	case pid == 0:
		return "-"
	case running:
		return "pid " + strconv.FormatInt(pid, 10)
	default:
		return "exited"
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func writeStatus(w io.Writer, r *control.SandboxStatusResponse) error {
	s, srv := r.GetSandbox(), r.GetServer()
	tw := table(w)
	fmt.Fprintf(tw, "Sandbox:\t%s\n", s.GetId())
	fmt.Fprintf(tw, "Phase:\t%s\n", s.GetPhase())
	if s.GetFailure() != "" {
		fmt.Fprintf(tw, "Failure:\t%s\n", s.GetFailure())
	}
	fmt.Fprintf(tw, "Server:\t%s, pid %d, up %s, %d restarts\n", serverWord(srv.GetDaemon(), srv.GetRunning()),
		srv.GetPid(), duration(srv.GetUptimeNano()), srv.GetRestarts())
	if srv.GetLastFailure() != "" {
		fmt.Fprintf(tw, "Last server failure:\t%s\n", srv.GetLastFailure())
	}
	if vm := r.GetVm(); vm != nil {
		state := "running"
		if !vm.GetRunning() {
			state = "exited: " + vm.GetExit()
		}
		fmt.Fprintf(tw, "VM:\tpid %d, up %s, %s\n", vm.GetPid(), duration(vm.GetUptimeNano()), state)
	} else {
		fmt.Fprintf(tw, "VM:\tnot started\n")
	}
	st := srv.GetStats()
	if st == nil {
		fmt.Fprintf(tw, "Statistics:\tnone (an external server's counters are not visible to this process)\n")
		return tw.Flush()
	}
	fmt.Fprintf(tw, "Bytes read:\t%d\n", st.GetBytesRead())
	fmt.Fprintf(tw, "Bytes written:\t%d\n", st.GetBytesWritten())
	fmt.Fprintf(tw, "Cached inodes:\t%d\n", st.GetCachedInodes())
	fmt.Fprintf(tw, "Open handles:\t%d\n", st.GetOpenHandles())
	fmt.Fprintf(tw, "Open fds:\t%d\n", st.GetOpenFds())
	fmt.Fprintf(tw, "Queue depth:\t%d (taken from the virtqueues, not yet answered)\n", st.GetQueueDepth())
	fmt.Fprintf(tw, "Blocked requests:\t%d (waiting for a lock)\n", st.GetBlockedRequests())
	fmt.Fprintf(tw, "Malformed requests:\t%d\n", st.GetMalformed())
	fmt.Fprintf(tw, "Handler panics:\t%d\n", st.GetPanics())
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	tw = table(w)
	fmt.Fprintln(tw, "OPCODE\tCOUNT\tERRORS\tMEAN\tP50\tP99")
	bounds := st.GetLatencyBucketBoundsSeconds()
	for _, o := range st.GetOps() {
		mean := "-"
		if o.GetCount() > 0 {
			mean = time.Duration(o.GetTotalTimeNano() / o.GetCount()).String()
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\n", o.GetOpcode(), o.GetCount(), o.GetErrors(), mean,
			quantile(o.GetLatencyBuckets(), bounds, 0.50), quantile(o.GetLatencyBuckets(), bounds, 0.99))
	}
	return tw.Flush()
}

// quantile is the upper bound of the bucket holding the q-quantile, as "<BOUND" (">LAST" for
// the unbounded bucket).
func quantile(buckets []uint64, bounds []float64, q float64) string {
	var total uint64
	for _, n := range buckets {
		total += n
	}
	if total == 0 {
		return "-"
	}
	rank := uint64(q*float64(total) + 0.5)
	rank = max(rank, 1)
	var seen uint64
	for i, n := range buckets {
		seen += n
		if seen >= rank {
			if i < len(bounds) {
				return "<" + secondsString(bounds[i])
			}
			break
		}
	}
	if len(bounds) == 0 {
		return "-"
	}
	return ">" + secondsString(bounds[len(bounds)-1])
}

func secondsString(s float64) string {
	return time.Duration(s * float64(time.Second)).String()
}

func duration(ns int64) string {
	return time.Duration(ns).Round(time.Millisecond).String()
}
