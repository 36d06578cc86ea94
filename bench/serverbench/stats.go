package serverbench

import (
	"math"
	"slices"
	"time"
)

// Percentile returns the p-th percentile (0 < p <= 100) of sorted by the nearest-rank method:
// the smallest sample with at least p% of the samples at or below it. It returns 0 for no
// samples.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := int(math.Ceil(p/100*float64(n) - 1e-9))
	return sorted[min(max(rank, 1), n)-1]
}

// span returns the smallest and largest of xs.
func span(xs []float64) (lo, hi float64) {
	if len(xs) == 0 {
		return math.NaN(), math.NaN()
	}
	return slices.Min(xs), slices.Max(xs)
}
