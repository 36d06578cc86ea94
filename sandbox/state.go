package sandbox

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvfs/kvfs/virtiofs/passthrough"
)

// Phase is where a sandbox is in its life.
type Phase string

const (
	// PhaseCreated: layout, socket and server are up; no VM yet.
	PhaseCreated Phase = "created"
	// PhaseRunning: the VM was started (it may have exited since; see Stats).
	PhaseRunning Phase = "running"
	// PhaseFailed: the server died and the stop policy killed the VM; Stop cleans up.
	PhaseFailed Phase = "failed"
	// PhaseStopping: Stop is under way, or was interrupted (Recover finishes it).
	PhaseStopping Phase = "stopping"
	// PhaseStopped: everything is gone.
	PhaseStopped Phase = "stopped"
)

// stateVersion is the version of the state file's format.
const stateVersion = 1

// state is what a sandbox persists in its directory, for Recover.
type state struct {
	Version int       `json:"version"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	Phase   Phase     `json:"phase"`
	// Config is the pod's resolved configuration (annotations applied).
	Config   *Config       `json:"config"`
	Server   *serverRecord `json:"server,omitempty"`
	VM       *vmRecord     `json:"vm,omitempty"`
	Restarts int           `json:"restarts"`
	Failure  string        `json:"failure,omitempty"`
	// DAX is the DAX policy set with SetDAXPolicy, if any.
	DAX *daxRecord `json:"dax,omitempty"`
	// OOMScoreAdj is the oom_score_adj of the VM and the server (Options.OOMScoreAdj, raised by
	// RaiseOOMScoreAdj), if any: a server restarted after an adoption gets it too.
	OOMScoreAdj *int `json:"oom_score_adj,omitempty"`
	// Owner is the process that wrote the file.
	Owner procID `json:"owner"`
}

// daxRecord is the persisted DAX policy of an in-process server.
type daxRecord struct {
	Mode  string          `json:"mode"`
	Rules []daxRuleRecord `json:"rules,omitempty"`
}

type daxRuleRecord struct {
	Glob    string `json:"glob,omitempty"`
	MinSize uint64 `json:"min_size,omitempty"`
	DAX     bool   `json:"dax"`
}

func recordDAX(p *passthrough.DAXPolicy) *daxRecord {
	if p == nil {
		return nil
	}
	r := &daxRecord{Mode: p.Mode.String()}
	for _, rule := range p.Rules {
		r.Rules = append(r.Rules, daxRuleRecord{Glob: rule.Glob, MinSize: rule.MinSize, DAX: rule.DAX})
	}
	return r
}

// policy returns the recorded policy, checked.
func (r *daxRecord) policy() (*passthrough.DAXPolicy, error) {
	if r == nil {
		return nil, nil
	}
	m, err := passthrough.ParseDAXMode(r.Mode)
	if err != nil {
		return nil, err
	}
	p := &passthrough.DAXPolicy{Mode: m}
	for _, rule := range r.Rules {
		p.Rules = append(p.Rules, passthrough.DAXRule{Glob: rule.Glob, MinSize: rule.MinSize, DAX: rule.DAX})
	}
	return p, p.Validate()
}

// vmRecord is the persisted description of the VM.
type vmRecord struct {
	Path    string    `json:"path"`
	Args    []string  `json:"args"`
	Process *procID   `json:"process,omitempty"` // nil when the runner's process is not local
	Started time.Time `json:"started"`
}

// writeState writes st to dir/state.json atomically: a temporary file, fsync, rename, fsync of
// the directory. A crash leaves the old file or the new one, never a mix.
func writeState(dir string, st *state) error {
	b, err := json.MarshalIndent(st, "", "\t")
	if err != nil {
		return err
	}
	b = append(b, '\n')
	tmp := filepath.Join(dir, stateName+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("write state: %w", err)
	}
	_, werr := f.Write(b)
	serr := f.Sync()
	cerr := f.Close()
	if err := firstErr(werr, serr, cerr); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write state: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateName)); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write state: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// readState reads dir/state.json, refusing a symlink.
func readState(dir string) (*state, error) {
	f, err := os.OpenFile(filepath.Join(dir, stateName), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var st state
	dec := json.NewDecoder(f)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		return nil, fmt.Errorf("%s: %w", stateName, err)
	}
	if st.Version != stateVersion {
		return nil, fmt.Errorf("%s: version %d, want %d", stateName, st.Version, stateVersion)
	}
	if st.Config == nil {
		return nil, fmt.Errorf("%s: no config", stateName)
	}
	return &st, nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}
