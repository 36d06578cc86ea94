package fuse

import (
	"math/bits"
	"sync/atomic"
	"time"
)

// LatencyBuckets is the number of latency histogram buckets: bucket i counts requests that took
// less than 2^i microseconds (the last one also counts everything slower).
const LatencyBuckets = 24

// OpStats are the counters of one opcode.
type OpStats struct {
	Count   uint64
	Errors  uint64
	Latency [LatencyBuckets]uint64
	// TotalTime is the summed handling time.
	TotalTime time.Duration
}

// Stats is a snapshot of a server's counters.
type Stats struct {
	// Ops maps opcode names to their counters; only opcodes seen are present.
	Ops map[string]OpStats
	// BytesRead and BytesWritten count file data moved by READ and WRITE.
	BytesRead, BytesWritten uint64
	// Malformed counts requests too short to answer; Panics, handlers recovered from.
	Malformed, Panics uint64
	// Waiting is the number of requests waiting now (SETLKW); each is counted in Ops when it
	// is answered.
	Waiting int
}

type opCounters struct {
	count, errors, nanos atomic.Uint64
	latency              [LatencyBuckets]atomic.Uint64
}

type stats struct {
	ops                     [opcodeLimit + 1]opCounters // the last slot counts unknown opcodes
	bytesRead, bytesWritten atomic.Uint64
	malformed, panics       atomic.Uint64
}

func (s *stats) record(op Opcode, errno Errno, d time.Duration) {
	c := &s.ops[min(op, opcodeLimit)]
	c.count.Add(1)
	if errno != OK {
		c.errors.Add(1)
	}
	c.nanos.Add(uint64(d))
	b := bits.Len64(uint64(d.Microseconds()))
	c.latency[min(b, LatencyBuckets-1)].Add(1)
}

// Stats returns a snapshot of the counters.
func (s *Server) Stats() Stats {
	st := Stats{
		Ops:          make(map[string]OpStats),
		BytesRead:    s.stats.bytesRead.Load(),
		BytesWritten: s.stats.bytesWritten.Load(),
		Malformed:    s.stats.malformed.Load(),
		Panics:       s.stats.panics.Load(),
		Waiting:      s.Waiting(),
	}
	for i := range s.stats.ops {
		c := &s.stats.ops[i]
		n := c.count.Load()
		if n == 0 {
			continue
		}
		o := OpStats{Count: n, Errors: c.errors.Load(), TotalTime: time.Duration(c.nanos.Load())}
		for j := range o.Latency {
			o.Latency[j] = c.latency[j].Load()
		}
		name := "UNKNOWN"
		if i < opcodeLimit {
			name = Opcode(i).String()
		}
		st.Ops[name] = o
	}
	return st
}
