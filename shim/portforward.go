package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/containerd/log"

	agent "github.com/kvfs/kvfs/api/agent/v1"
	"github.com/kvfs/kvfs/sandbox/network"
)

// Port-forward. containerd's CRI serves it itself: in the pod's network namespace it dials
// localhost:PORT (tcp4, then tcp6) and copies the client's stream both ways. For a kvfs pod
// that namespace holds the VM's tap, not its servers, so the pod's run keeps a relay there
// (portRelay): every TCP connection the namespace makes to 127.0.0.1 or ::1 is redirected to
// the relay's listeners (network.RedirectLoopback), and the relay carries each to the same
// port of the guest's localhost through the agent door (OpenPort, ReadPort, WritePort,
// ClosePort), as the agent dials it in the guest's namespace, the pod's: a server bound to
// the guest's 127.0.0.1 alone is reached, as under runc.
//
// A port nothing answers on in the guest gets the client's connection reset (SO_LINGER 0):
// containerd's copy ends with an error, as near as the relay comes to runc's refused dial,
// which containerd reports before it copies anything. A half-close is passed on both ways:
// the client's end of file shuts the guest connection's write side, the guest's shuts the
// client's, so protocols that answer at end of file work. Either side's error (a reset, a
// failed call) resets both. The relay dials nothing in the pod's namespace.
//
// What the guest sends is bounded as a process's output is: each ReadPort asks readMax bytes
// and the door refuses a longer answer; the bytes go to the client and are never logged.
// At most agent.MaxPortStreams connections are relayed at once (the agent holds no more); one
// more is reset at once. A guest write that takes nothing is tried again after portRetry, so a
// guest that answers "nothing taken" at once cannot spin the relay. Every connection ends with
// the pod's run, and the relay with its stop.

// portRetry is the pause before a write the guest took none of is sent again. A healthy
// agent answers so only after agent.PortWriteWait, its server not reading.
const portRetry = 100 * time.Millisecond

// portRelay is one pod's port-forward relay.
type portRelay struct {
	ctx    context.Context // ends every connection: the pod's run's, or the relay's close
	cancel context.CancelFunc
	env    *podEnv
	agent  agent.AgentService // the pod's door
	redir  *network.LoopbackRedirect
	slots  chan struct{} // one per connection relayed
	wg     sync.WaitGroup
}

// startPortRelay redirects the loopback TCP of the pod's namespace netns to a relay through
// a, the pod's door; its connections end with ctx.
func startPortRelay(ctx context.Context, env *podEnv, netns string, a agent.AgentService) (*portRelay, error) {
	redir, err := network.RedirectLoopback(netns)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &portRelay{ctx: ctx, cancel: cancel, env: env, agent: a, redir: redir, slots: make(chan struct{}, agent.MaxPortStreams)}
	for _, ln := range redir.Listeners {
		r.wg.Add(1)
		go r.accept(ln)
	}
	return r, nil
}

// close ends every connection, removes the redirect and waits for the relay's goroutines.
func (r *portRelay) close() error {
	r.cancel()
	err := r.redir.Close()
	r.wg.Wait()
	return err
}

// accept relays each connection of ln, until ln is closed.
func (r *portRelay) accept(ln *net.TCPListener) {
	defer r.wg.Done()
	for {
		c, err := ln.AcceptTCP()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				log.G(r.env.ctx).WithError(err).Error("port-forward: accepting")
			}
			return
		}
		select {
		case r.slots <- struct{}{}:
		default:
			r.warn(fmt.Errorf("%d connections are relayed already, the most the guest holds", agent.MaxPortStreams))
			reset(c)
			continue
		}
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			defer func() { <-r.slots }()
			r.relay(c)
		}()
	}
}

// warn logs a relay's failure, at most one line per guestLogInterval: the guest can cause
// them at will.
func (r *portRelay) warn(err error) {
	r.env.guestLog.warn("port-forward", log.G(r.env.ctx).WithField("error", guestText(err.Error())), "port-forward")
}

// reset closes c with a reset (SO_LINGER 0), which the client reads as an error.
func reset(c *net.TCPConn) {
	_ = c.SetLinger(0)
	c.Close()
}

// relay carries c to the port it was made to, in the guest.
func (r *portRelay) relay(c *net.TCPConn) {
	ctx, cancel := context.WithCancel(r.ctx)
	defer cancel()
	port, err := network.OriginalPort(c)
	if err != nil {
		r.warn(err)
		reset(c)
		return
	}
	open, err := r.agent.OpenPort(ctx, &agent.OpenPortRequest{Port: uint32(port)})
	if err != nil {
		r.warn(fmt.Errorf("port %d: %w", port, err))
		reset(c)
		return
	}
	id := open.Id
	// An error in either direction, or the run's end, resets the client: both copies end.
	aborted := context.AfterFunc(ctx, func() { reset(c) })
	errc := make(chan error, 2)
	go func() { errc <- r.toClient(ctx, id, c) }()
	go func() { errc <- r.toGuest(ctx, id, c) }()
	var failed error
	for range 2 {
		if err := <-errc; err != nil && failed == nil {
			failed = err
			cancel()
		}
	}
	if aborted() {
		c.Close()
	}
	if failed != nil && r.ctx.Err() == nil {
		r.warn(fmt.Errorf("port %d: %w", port, failed))
	}
	if _, err := r.agent.ClosePort(r.ctx, &agent.ClosePortRequest{Id: id}); err != nil && r.ctx.Err() == nil {
		r.warn(fmt.Errorf("port %d: %w", port, err))
	}
}

// toClient copies the guest's side to the client until its end of file, which shuts the
// client's write side.
func (r *portRelay) toClient(ctx context.Context, id uint64, c *net.TCPConn) error {
	for {
		resp, err := r.agent.ReadPort(ctx, &agent.ReadPortRequest{Id: id, Max: readMax})
		if err != nil {
			return err
		}
		if _, err := c.Write(resp.Data); err != nil {
			return err
		}
		if resp.Eof {
			return c.CloseWrite()
		}
	}
}

// toGuest copies the client to the guest's side until the client's end of file, which
// shuts the guest side's write side.
func (r *portRelay) toGuest(ctx context.Context, id uint64, c *net.TCPConn) error {
	buf := make([]byte, readMax)
	for {
		n, err := c.Read(buf)
		for data := buf[:n]; len(data) > 0; {
			resp, werr := r.agent.WritePort(ctx, &agent.WritePortRequest{Id: id, Data: data})
			if werr != nil {
				return werr
			}
			data = data[resp.Written:]
			if resp.Written == 0 {
				select {
				case <-time.After(portRetry):
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		switch {
		case errors.Is(err, io.EOF):
			_, err := r.agent.ClosePort(ctx, &agent.ClosePortRequest{Id: id, WriteOnly: true})
			return err
		case err != nil:
			return err
		}
	}
}
