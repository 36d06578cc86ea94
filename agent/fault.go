//go:build kvfsfaults

package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/containerd/ttrpc"
	"github.com/sirupsen/logrus"

	apiv1 "github.com/kvfs/kvfs/api/agent/v1"
)

// Fault injection, for tests of the host against a hostile guest: compiled only with the
// kvfsfaults build tag, into a test image of its own (packaging/guest/build.sh
// --agent-faults), never into the shipped agent, which refuses kvfs.fault= (fault_off.go).
// The mode comes from the kernel command line (kvfs.fault=MODE), so a test picks it per pod
// through the sandbox configuration's vm.kernel_params. Each mode makes one part of the API
// misbehave as a hostile agent could; the rest of the API works. A request held unanswered
// ignores the host's deadline (ttrpc passes it in the request's context) and ends only when
// the agent shuts down.
const (
	// faultStatsSilent: Stats never answers.
	faultStatsSilent = "stats-silent"
	// faultCreateSilent: CreateContainer never answers (and creates nothing); Ping answers.
	faultCreateSilent = "create-silent"
	// faultKillNoExit: SignalProcess is acknowledged but the signal is not delivered, and
	// WaitProcess of a process signalled (or of any process of a container signalled with
	// all) never answers, even once the process has exited.
	faultKillNoExit = "kill-noexit"
	// faultOOMFlood: GetOOMEvent answers at once, every time, with the id of a container
	// that exists (waiting only until one does).
	faultOOMFlood = "oom-flood"
)

// faultModes are the modes kvfs.fault= takes.
var faultModes = []string{faultStatsSilent, faultCreateSilent, faultKillNoExit, faultOOMFlood}

// faultPoll is how often oom-flood looks for a container while there is none.
const faultPoll = 10 * time.Millisecond

// methodPrefix starts the full method name of every agent request ("/kvfs.agent.v1.Agent/Stats").
const methodPrefix = "/kvfs.agent.v1.Agent/"

// faults carries out one fault mode on a service.
type faults struct {
	mode string
	svc  *Service
	log  *logrus.Entry

	mu sync.Mutex
	// signalled are the processes SignalProcess was asked to signal (kill-noexit); a
	// container signalled with all is there with execAll. Guarded by mu.
	signalled map[procKey]bool
}

type procKey struct{ cid, eid string }

// execAll stands for every process of a container in faults.signalled: not a valid exec id.
const execAll = "/all"

// faultInterceptor returns the interceptor that carries out mode on svc, nil for no mode; an
// unknown mode is an error naming it.
func faultInterceptor(mode string, svc *Service, log *logrus.Entry) (ttrpc.UnaryServerInterceptor, error) {
	if mode == "" {
		return nil, nil
	}
	if !slices.Contains(faultModes, mode) {
		return nil, fmt.Errorf("%s=%s: want one of %s", apiv1.CmdlineFault, mode, strings.Join(faultModes, ", "))
	}
	f := &faults{mode: mode, svc: svc, log: log.WithField("fault", mode), signalled: map[procKey]bool{}}
	f.log.Warn("fault injection armed: this agent misbehaves on purpose")
	return f.intercept, nil
}

func (f *faults) intercept(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, m ttrpc.Method) (any, error) {
	method := strings.TrimPrefix(info.FullMethod, methodPrefix)
	switch {
	case f.mode == faultStatsSilent && method == "Stats",
		f.mode == faultCreateSilent && method == "CreateContainer":
		return nil, f.silence(method)
	case f.mode == faultKillNoExit && method == "SignalProcess":
		var req apiv1.SignalProcessRequest
		if err := unmarshal(&req); err != nil {
			return nil, err
		}
		eid := req.ExecId
		if req.All {
			eid = execAll
		}
		f.mu.Lock()
		f.signalled[procKey{req.ContainerId, eid}] = true
		f.mu.Unlock()
		f.log.WithFields(logrus.Fields{"container": req.ContainerId, "exec": req.ExecId, "signal": req.Signal,
			"all": req.All}).Warn("signal acknowledged, not delivered")
		return &apiv1.SignalProcessResponse{}, nil
	case f.mode == faultKillNoExit && method == "WaitProcess":
		return f.waitUnlessSignalled(ctx, unmarshal, m)
	case f.mode == faultOOMFlood && method == "GetOOMEvent":
		return f.floodOOM(ctx)
	}
	return m(ctx, unmarshal)
}

// silence holds a request unanswered until the agent shuts down.
func (f *faults) silence(method string) error {
	f.log.WithField("method", method).Warn("not answering")
	<-f.svc.Done()
	return errShuttingDown
}

// waitUnlessSignalled is WaitProcess, silenced for a process that was signalled, before the
// wait or while it waited.
func (f *faults) waitUnlessSignalled(ctx context.Context, unmarshal ttrpc.Unmarshaler, m ttrpc.Method) (any, error) {
	var req apiv1.WaitProcessRequest
	if err := unmarshal(&req); err != nil {
		return nil, err
	}
	if f.signalledProcess(&req) {
		return nil, f.silence("WaitProcess")
	}
	resp, err := m(ctx, unmarshal)
	if f.signalledProcess(&req) {
		return nil, f.silence("WaitProcess")
	}
	return resp, err
}

// signalledProcess says whether SignalProcess was asked to signal the process req waits for.
func (f *faults) signalledProcess(req *apiv1.WaitProcessRequest) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.signalled[procKey{req.ContainerId, req.ExecId}] || f.signalled[procKey{req.ContainerId, execAll}]
}

// floodOOM answers GetOOMEvent with a container's id as soon as there is a container.
func (f *faults) floodOOM(ctx context.Context) (any, error) {
	for {
		if id := f.svc.someContainer(); id != "" {
			return &apiv1.GetOOMEventResponse{ContainerId: id}, nil
		}
		select {
		case <-time.After(faultPoll):
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-f.svc.Done():
			return nil, errShuttingDown
		}
	}
}

// someContainer is the id of a container of s (the first by id), "" when there is none.
func (s *Service) someContainer() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	first := ""
	for id := range s.containers {
		if first == "" || id < first {
			first = id
		}
	}
	return first
}
