package report

import (
	"image/color"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"testing"
)

func TestLogSpan(t *testing.T) {
	if s := logSpan([]float64{0.3, 1.5, math.NaN(), math.Inf(1), 0, -2}); s != 2 { // 0.3 needs 2^-2; the others are left out
		t.Errorf("span %v, want 2", s)
	}
	if s := logSpan([]float64{1e9}); s != 4 {
		t.Errorf("span for 1e9: %v, want the cap 4", s)
	}
	if s := logSpan(nil); s != 1 {
		t.Errorf("span without ratios: %v, want 1", s)
	}
	for e, want := range map[float64]string{-3: "1/8", -1: "1/2", 0: "1", 1: "2", 4: "16"} {
		if got := powerLabel(e); got != want {
			t.Errorf("powerLabel(%v) = %q, want %q", e, got, want)
		}
	}
}

// TestRatioChart draws a chart of fixed rows (two groups, a pale row, ratios beyond the scale
// and missing) into a file and reads it back as a PNG.
func TestRatioChart(t *testing.T) {
	c := RatioChart{
		Title:  "kvfsd ÷ another server",
		XLabel: "ratio, log scale: right of 1 is better for kvfsd",
		Series: []Series{
			{Name: "ops/s", Color: color.RGBA{50, 105, 190, 255}, PaleName: "ops/s, † rows", PaleColor: color.RGBA{160, 185, 225, 255}},
			{Name: "CPU per operation", Color: color.RGBA{230, 135, 30, 255}},
		},
		Rows: []Row{
			{Label: "LOOKUP+GETATTR, pool 0, cache auto", Values: []float64{1.77, 1.51}},
			{Label: "LOOKUP+GETATTR, pool 4, cache auto †", Values: []float64{0.88, 0.53}, Pale: true},
			{Label: "WRITE 4 KiB random QD1, xattr, pool 0, cache auto, -o xattr -o killpriv_v2", Values: []float64{4.54, 4.22}, NewGroup: true},
			{Label: "beyond the scale and missing", Values: []float64{1e6, math.NaN()}},
			{Label: "one value only", Values: []float64{0.01}},
		},
	}
	b, err := c.PNG()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "chart.png")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	// Wide enough for the labels and the scale; 20 points (30 pixels at 110 dpi) for each row.
	if r := img.Bounds(); r.Dx() < 800 || r.Dx() > 2000 || r.Dy() < len(c.Rows)*30 || r.Dy() > 1000 {
		t.Errorf("chart is %v", r)
	}
}
