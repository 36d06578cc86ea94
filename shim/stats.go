package shim

import (
	"context"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/anypb"
)

// Stats on a budget. containerd's task Metrics (what CRI's stats, and so the kubelet's
// summaries, come from) asks every task of the node for its Stats one after another, with no
// deadline of its own: a guest that answers slowly, just inside the door's Query deadline,
// would add seconds to every node-wide stats call, for ever, without ever being cut off for
// it. So a container's Stats are served from the guest's last answer, refreshed on demand:
//   - an answer younger than statsFresh is served as it is;
//   - an older one starts a refresh (one at a time per container) and waits for it at most
//     GuestLimits.StatsWait, then serves the older answer: a slow guest costs containerd at
//     most StatsWait per call, and its numbers lag by the time it takes to answer;
//   - with no answer yet, the call waits for the refresh, which the door bounds by the Query
//     deadline (so a pod's first Stats can cost one deadline, as before).
//
// Why not cut a slow guest off instead (late answers counted in a time window): a loaded node,
// a TCG one above all, slows healthy guests too, and killing pods for the node's load is worse
// than serving their numbers a little late. A guest that misses deadlines is still cut off by
// the door (missLimit).

// statsFresh is how long a guest's Stats answer is served without asking again: under the
// kubelet's and cAdvisor's intervals (10 s and more), so each of their calls asks the guest.
const statsFresh = time.Second

// statsCache is one container's (or the pod's) last Stats answer and its refresh.
type statsCache struct {
	mu      sync.Mutex
	last    *anypb.Any    // guarded by mu: the guest's last answer, checked by the door
	at      time.Time     // guarded by mu: when it came
	refresh *statsRefresh // guarded by mu: the refresh under way, nil if none
}

// statsRefresh is one call for a Stats answer; v and err are set before done is closed.
type statsRefresh struct {
	done chan struct{}
	v    *anypb.Any
	err  error
}

// get serves the Stats answer as described above. fetch asks the guest; it runs with runCtx
// (the pod's run, not the caller's, whose call may end first) and the door's deadline.
func (sc *statsCache) get(ctx, runCtx context.Context, wait time.Duration, fetch func(context.Context) (*anypb.Any, error)) (*anypb.Any, error) {
	sc.mu.Lock()
	if sc.last != nil && time.Since(sc.at) < statsFresh {
		v := sc.last
		sc.mu.Unlock()
		return v, nil
	}
	r := sc.refresh
	if r == nil {
		r = &statsRefresh{done: make(chan struct{})}
		sc.refresh = r
		go func() {
			r.v, r.err = fetch(runCtx)
			sc.mu.Lock()
			if r.err == nil {
				sc.last, sc.at = r.v, time.Now()
			}
			sc.refresh = nil
			sc.mu.Unlock()
			close(r.done)
		}()
	}
	stale := sc.last
	sc.mu.Unlock()

	var late <-chan time.Time
	if stale != nil {
		t := time.NewTimer(wait)
		defer t.Stop()
		late = t.C
	}
	select {
	case <-r.done:
		return r.v, r.err
	case <-late:
		return stale, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}
