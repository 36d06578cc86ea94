package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/containerd/errdefs"
)

func createSandbox(t *testing.T, base, id string) *Sandbox {
	t.Helper()
	s, err := Create(context.Background(), id, Options{Config: testConfig(base)})
	if err != nil {
		t.Fatal(err)
	}
	stopOnCleanup(t, s)
	return s
}

func TestManager(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	m := NewManager()
	b := createSandbox(t, base, "b")
	a := createSandbox(t, base, "a")
	for _, s := range []*Sandbox{b, a} {
		if err := m.Add(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Add(a); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("Add twice: %v, want errdefs.ErrAlreadyExists", err)
	}
	if got, err := m.Get("a"); err != nil || got != a {
		t.Errorf("Get(a) = %v, %v", got, err)
	}
	if _, err := m.Get("c"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get(c): %v, want errdefs.ErrNotFound", err)
	}
	if l := m.List(); len(l) != 2 || l[0] != a || l[1] != b {
		t.Errorf("List: %v", l)
	}
	if got, err := m.Remove("b"); err != nil || got != b {
		t.Errorf("Remove(b) = %v, %v", got, err)
	}
	if _, err := m.Remove("b"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Remove(b) again: %v, want errdefs.ErrNotFound", err)
	}
	if b.Phase() != PhaseCreated {
		t.Errorf("Remove stopped the sandbox: %s", b.Phase())
	}
	if err := m.Stop(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if a.Phase() != PhaseStopped {
		t.Errorf("after Stop: %s", a.Phase())
	}
	if len(m.List()) != 0 {
		t.Errorf("Stop did not forget the sandbox")
	}
	if err := m.Stop(context.Background(), "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stop again: %v, want errdefs.ErrNotFound", err)
	}
}

// TestManagerConcurrent runs the Manager's operations from many goroutines (for -race): Stats
// and Stop are called without the Manager's lock.
func TestManagerConcurrent(t *testing.T) {
	requireRoot(t)
	base := testBase(t)
	m := NewManager()
	const n = 4
	for i := range n {
		if err := m.Add(createSandbox(t, base, fmt.Sprintf("s%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	svc := NewControlService(m)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range 20 {
				for _, s := range m.List() {
					_ = s.Stats()
				}
				_, _ = svc.ListSandboxes(context.Background(), nil)
			}
		}()
		go func() {
			defer wg.Done()
			if err := m.Stop(context.Background(), fmt.Sprintf("s%d", i)); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if l := m.List(); len(l) != 0 {
		t.Errorf("left: %d", len(l))
	}
}
