package sandbox

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/containerd/errdefs"
)

// Manager holds the sandboxes of one process by id. It is safe for concurrent use. Its lock
// guards only the map: it is never held while a sandbox is asked anything (Stats, Stop), so a
// slow Stop of one sandbox delays no other request.
type Manager struct {
	mu        sync.Mutex
	sandboxes map[string]*Sandbox // guarded by mu
}

// NewManager returns an empty Manager.
func NewManager() *Manager {
	return &Manager{sandboxes: make(map[string]*Sandbox)}
}

// Add registers s under its id; another sandbox with that id is an errdefs.ErrAlreadyExists.
func (m *Manager) Add(s *Sandbox) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.sandboxes[s.ID()]; ok {
		return fmt.Errorf("sandbox %q: %w", s.ID(), errdefs.ErrAlreadyExists)
	}
	m.sandboxes[s.ID()] = s
	return nil
}

// Get returns the sandbox id, or an errdefs.ErrNotFound.
func (m *Manager) Get(id string) (*Sandbox, error) {
	m.mu.Lock()
	s, ok := m.sandboxes[id]
	m.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	return s, nil
}

// List returns the sandboxes ordered by id.
func (m *Manager) List() []*Sandbox {
	m.mu.Lock()
	list := make([]*Sandbox, 0, len(m.sandboxes))
	for _, s := range m.sandboxes {
		list = append(list, s)
	}
	m.mu.Unlock()
	slices.SortFunc(list, func(a, b *Sandbox) int { return strings.Compare(a.ID(), b.ID()) })
	return list
}

// Remove forgets the sandbox id and returns it, without stopping it; an unknown id is an
// errdefs.ErrNotFound.
func (m *Manager) Remove(id string) (*Sandbox, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.sandboxes[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	delete(m.sandboxes, id)
	return s, nil
}

// Stop stops the sandbox id and, once it is stopped, forgets it. A sandbox whose Stop returns
// an error stays listed (in phase stopped, its failure visible in Stats) until a later Stop,
// which returns nil for it, forgets it. Concurrent Stops of one sandbox are serialised by the
// sandbox itself (Stop is idempotent).
func (m *Manager) Stop(ctx context.Context, id string) error {
	s, err := m.Get(id)
	if err != nil {
		return err
	}
	if err := s.Stop(ctx); err != nil {
		return fmt.Errorf("stop sandbox %q: %w", id, err)
	}
	m.mu.Lock()
	if m.sandboxes[id] == s {
		delete(m.sandboxes, id)
	}
	m.mu.Unlock()
	return nil
}
