package serverproc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/containerd/log"
	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs"
	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// The channel's messages: on each connection, a request line from the owner, then a reply line
// from the server, which then closes the connection.
type request struct {
	Op    string                 `json:"op"`
	Level string                 `json:"level,omitempty"` // opLogLevel
	DAX   *passthrough.DAXPolicy `json:"dax,omitempty"`   // opDAX
}

type reply struct {
	// Error is why the server refused the request.
	Error string          `json:"error,omitempty"`
	Stats *virtiofs.Stats `json:"stats,omitempty"` // opStats
}

// The requests.
const (
	opStats    = "stats"     // the server's counters
	opLogLevel = "log_level" // set the log level
	opDAX      = "dax"       // replace the DAX policy
)

// Bounds of the channel.
const (
	// maxRequest bounds a request line (a DAX policy with its rules is the longest).
	maxRequest = 1 << 20
	// maxReply bounds a reply: the statistics of every opcode fit many times over; a server
	// that sends more (it is as untrusted as the guest) gets its reply refused.
	maxReply = 1 << 20
	// callTimeout bounds a call whose context has no deadline.
	callTimeout = 5 * time.Second
)

// ErrRefused is the kind of error of a request the server refused (a DAX policy it does not
// take, say), as opposed to a channel that does not work.
var ErrRefused = errors.New("refused by the server")

// serveChannel answers the owner's requests until l is closed.
func serveChannel(l *net.UnixListener, srv *virtiofs.Server) {
	for {
		conn, err := l.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				log.L.WithError(err).Error("channel: accept")
			}
			return
		}
		go serveConn(conn, srv)
	}
}

func serveConn(conn *net.UnixConn, srv *virtiofs.Server) {
	defer conn.Close()
	if err := checkPeer(conn); err != nil {
		log.L.WithError(err).Warn("channel: connection refused")
		return
	}
	conn.SetDeadline(time.Now().Add(callTimeout))
	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 0, 4096), maxRequest)
	if !sc.Scan() {
		return
	}
	var req request
	var rep reply
	if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
		rep.Error = "not a request: " + err.Error()
	} else {
		rep = handle(req, srv)
	}
	b, err := json.Marshal(rep)
	if err == nil {
		_, err = conn.Write(append(b, '\n'))
	}
	if err != nil {
		log.L.WithError(err).WithField("op", req.Op).Warn("channel: reply")
	}
}

func handle(req request, srv *virtiofs.Server) reply {
	switch req.Op {
	case opStats:
		st := srv.Stats()
		return reply{Stats: &st}
	case opLogLevel:
		prev := log.GetLevel()
		if err := log.SetLevel(req.Level); err != nil {
			return reply{Error: fmt.Sprintf("log level %q: %v", req.Level, err)}
		}
		log.L.WithField("previous", prev.String()).Infof("log level set to %s", req.Level)
		return reply{}
	case opDAX:
		if req.DAX == nil {
			return reply{Error: "dax: no policy"}
		}
		if err := srv.SetDAXPolicy(*req.DAX); err != nil {
			return reply{Error: "dax: " + err.Error()}
		}
		log.L.WithField("mode", req.DAX.Mode.String()).WithField("rules", len(req.DAX.Rules)).Info("DAX policy updated")
		return reply{}
	}
	return reply{Error: fmt.Sprintf("unknown request %q", req.Op)}
}

// checkPeer accepts root and the server's own effective uid.
func checkPeer(conn *net.UnixConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("SO_PEERCRED: %w", cerr)
	}
	if cred.Uid != 0 && int64(cred.Uid) != int64(os.Geteuid()) {
		return fmt.Errorf("peer pid %d uid %d: only root or uid %d may use the channel", cred.Pid, cred.Uid, os.Geteuid())
	}
	return nil
}

// Client is the owner's end of a server's channel: the socket at Path (which the owner created
// and passed to Command).
type Client struct {
	Path string
}

// Stats returns the server's counters.
func (c Client) Stats(ctx context.Context) (virtiofs.Stats, error) {
	rep, err := c.call(ctx, request{Op: opStats})
	if err != nil {
		return virtiofs.Stats{}, err
	}
	if rep.Stats == nil {
		return virtiofs.Stats{}, fmt.Errorf("confined server %s: a reply without statistics", c.Path)
	}
	return *rep.Stats, nil
}

// SetLogLevel sets the server's log level (trace, debug, info, warn or error).
func (c Client) SetLogLevel(ctx context.Context, level string) error {
	_, err := c.call(ctx, request{Op: opLogLevel, Level: level})
	return err
}

// SetDAXPolicy replaces the server's DAX policy (virtiofs.Server.SetDAXPolicy).
func (c Client) SetDAXPolicy(ctx context.Context, p passthrough.DAXPolicy) error {
	_, err := c.call(ctx, request{Op: opDAX, DAX: &p})
	return err
}

func (c Client) call(ctx context.Context, req request) (*reply, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, callTimeout)
		defer cancel()
	}
	fail := func(err error) (*reply, error) {
		return nil, fmt.Errorf("confined server channel %s: %s: %w", c.Path, req.Op, err)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.Path)
	if err != nil {
		return fail(err)
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()
	b, err := json.Marshal(req)
	if err != nil {
		return fail(err)
	}
	if _, err := conn.Write(append(b, '\n')); err != nil {
		return fail(err)
	}
	// The server writes one line and closes the connection.
	line, err := io.ReadAll(io.LimitReader(conn, maxReply+1))
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return fail(err)
	}
	if len(line) > maxReply {
		return fail(fmt.Errorf("a reply longer than %d bytes", maxReply))
	}
	var rep reply
	if err := json.Unmarshal(line, &rep); err != nil {
		return fail(fmt.Errorf("not a reply: %w", err))
	}
	if rep.Error != "" {
		return nil, fmt.Errorf("confined server: %s: %s: %w", req.Op, rep.Error, ErrRefused)
	}
	return &rep, nil
}
