package serverbench

import (
	"math"
	"testing"
)

func TestLogAxis(t *testing.T) {
	a := NewLogAxis(100, 400, []float64{0.3, 1.5, math.NaN(), math.Inf(1), 0, -2})
	if a.Span != 2 { // 0.3 needs 2^-2; the others are left out
		t.Fatalf("span %v, want 2", a.Span)
	}
	for _, c := range []struct {
		r float64
		x int
	}{{1, 300}, {4, 500}, {0.25, 100}, {2, 400}, {1000, 500}, {0.001, 100}} {
		if x := a.X(c.r); x != c.x {
			t.Errorf("X(%v) = %d, want %d", c.r, x, c.x)
		}
	}
	if s := NewLogAxis(0, 1, []float64{1e9}).Span; s != 4 {
		t.Errorf("span for 1e9: %v, want the cap 4", s)
	}
	if s := NewLogAxis(0, 1, nil).Span; s != 1 {
		t.Errorf("span without ratios: %v, want 1", s)
	}
}
