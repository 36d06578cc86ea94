package ctl

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"

	control "github.com/kvfs/kvfs/api/control/v1"
)

// WriteMetrics writes a sandbox's status in Prometheus's text exposition format (version
// 0.0.4): one family per counter, labelled with the sandbox and, for the per-opcode ones, the
// opcode; the request latencies as a histogram in seconds. An external daemon's sandbox has
// only the server's up and restart metrics.
func WriteMetrics(w io.Writer, r *control.SandboxStatusResponse) error {
	bw := bufio.NewWriter(w)
	p := &promWriter{w: bw, sandbox: r.GetSandbox().GetId()}
	srv := r.GetServer()

	p.family("kvfs_server_up", "gauge", "Whether the sandbox's virtio-fs server is running (1) or not (0).")
	p.sample("kvfs_server_up", nil, boolValue(srv.GetRunning()))
	p.family("kvfs_server_restarts_total", "counter", "Restarts of the virtio-fs server by its restart policy.")
	p.sample("kvfs_server_restarts_total", nil, float64(srv.GetRestarts()))

	if st := srv.GetStats(); st != nil {
		ops := st.GetOps()
		p.family("kvfs_fuse_requests_total", "counter", "FUSE requests answered, by opcode.")
		for _, o := range ops {
			p.sample("kvfs_fuse_requests_total", opLabel(o), float64(o.GetCount()))
		}
		p.family("kvfs_fuse_request_errors_total", "counter", "FUSE requests answered with an error, by opcode.")
		for _, o := range ops {
			p.sample("kvfs_fuse_request_errors_total", opLabel(o), float64(o.GetErrors()))
		}
		p.family("kvfs_fuse_request_duration_seconds", "histogram", "Time to handle a FUSE request, by opcode.")
		bounds := st.GetLatencyBucketBoundsSeconds()
		for _, o := range ops {
			var cum uint64
			buckets := o.GetLatencyBuckets()
			for i, le := range bounds {
				if i < len(buckets) {
					cum += buckets[i]
				}
				p.sample("kvfs_fuse_request_duration_seconds_bucket", append(opLabel(o), "le", formatFloat(le)), float64(cum))
			}
			for i := len(bounds); i < len(buckets); i++ {
				cum += buckets[i]
			}
			p.sample("kvfs_fuse_request_duration_seconds_bucket", append(opLabel(o), "le", "+Inf"), float64(cum))
			p.sample("kvfs_fuse_request_duration_seconds_sum", opLabel(o), float64(o.GetTotalTimeNano())/1e9)
			p.sample("kvfs_fuse_request_duration_seconds_count", opLabel(o), float64(cum))
		}
		p.counter("kvfs_fuse_read_bytes_total", "File data read by FUSE READ requests, in bytes.", st.GetBytesRead())
		p.counter("kvfs_fuse_written_bytes_total", "File data written by FUSE WRITE requests, in bytes.", st.GetBytesWritten())
		p.counter("kvfs_fuse_malformed_requests_total", "FUSE requests too short to answer.", st.GetMalformed())
		p.counter("kvfs_fuse_handler_panics_total", "FUSE request handlers that panicked (answered EIO).", st.GetPanics())
		p.gauge("kvfs_cached_inodes", "Inodes in the server's inode table, the root included.", st.GetCachedInodes())
		p.gauge("kvfs_open_handles", "Open file and directory handles.", st.GetOpenHandles())
		p.gauge("kvfs_open_fds", "Host file descriptors the server holds for the guest.", st.GetOpenFds())
		p.gauge("kvfs_fuse_blocked_requests", "FUSE requests waiting now for a lock (SETLKW).", st.GetBlockedRequests())
		p.gauge("kvfs_queue_depth", "Requests taken from the virtqueues and not yet answered.", st.GetQueueDepth())
	}
	if p.err != nil {
		return p.err
	}
	return bw.Flush()
}

// promWriter writes families and samples, keeping the first error.
type promWriter struct {
	w       *bufio.Writer
	sandbox string
	err     error
}

func (p *promWriter) printf(format string, args ...any) {
	if p.err == nil {
		_, p.err = fmt.Fprintf(p.w, format, args...)
	}
}

func (p *promWriter) family(name, typ, help string) {
	p.printf("# HELP %s %s\n# TYPE %s %s\n", name, escapeHelp(help), name, typ)
}

// sample writes one sample; labels are name, value pairs after the sandbox label.
func (p *promWriter) sample(name string, labels []string, v float64) {
	var b strings.Builder
	b.WriteString(name)
	b.WriteString(`{sandbox="`)
	b.WriteString(escapeLabel(p.sandbox))
	b.WriteByte('"')
	for i := 0; i+1 < len(labels); i += 2 {
		fmt.Fprintf(&b, `,%s="%s"`, labels[i], escapeLabel(labels[i+1]))
	}
	b.WriteString("} ")
	b.WriteString(formatFloat(v))
	p.printf("%s\n", b.String())
}

func (p *promWriter) counter(name, help string, v uint64) {
	p.family(name, "counter", help)
	p.sample(name, nil, float64(v))
}

func (p *promWriter) gauge(name, help string, v uint64) {
	p.family(name, "gauge", help)
	p.sample(name, nil, float64(v))
}

func opLabel(o *control.OpStats) []string { return []string{"opcode", o.GetOpcode()} }

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func formatFloat(v float64) string {
	switch {
	case math.IsInf(v, 1):
		return "+Inf"
	case math.IsInf(v, -1):
		return "-Inf"
	case math.IsNaN(v):
		return "NaN"
	}
	return strconv.FormatFloat(v, 'g', -1, 64)
}

// escapeLabel escapes a label value: backslash, double quote and line feed.
func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`).Replace(s)
}

// escapeHelp escapes a HELP text: backslash and line feed.
func escapeHelp(s string) string {
	return strings.NewReplacer(`\`, `\\`, "\n", `\n`).Replace(s)
}
