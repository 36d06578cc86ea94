package serverbench

import (
	"image/color"

	"github.com/kvfs/kvfs/bench/report"
)

// Chart draws, for every row of the ratio table, two horizontal bars on a log2 scale around 1:
// kvfsd's ops/s ÷ the C virtiofsd's, and the C virtiofsd's CPU per operation ÷ kvfsd's, so that
// right of 1 is better for kvfsd in both; a workload's rows together. It returns the PNG.
func Chart(res *Results) ([]byte, error) {
	c := report.RatioChart{
		Title:  "kvfsd ÷ the C virtiofsd, server level: medians of the per-round ratios",
		XLabel: "ratio, log scale: right of 1 is better for kvfsd",
		Series: []report.Series{
			{Name: "ops/s: kvfsd ÷ C virtiofsd", Color: color.RGBA{50, 105, 190, 255},
				PaleName: "ops/s, † rows: against the C virtiofsd with pool 0 (it could not run with kvfsd's pool)", PaleColor: color.RGBA{160, 185, 225, 255}},
			{Name: "CPU per operation: C virtiofsd ÷ kvfsd", Color: color.RGBA{230, 135, 30, 255},
				PaleName: "CPU per operation, † rows", PaleColor: color.RGBA{240, 200, 150, 255}},
		},
	}
	rs := rows(res)
	for i, r := range rs {
		label := r.label()
		if r.substitute {
			label += " †"
		}
		c.Rows = append(c.Rows, report.Row{
			Label:    label,
			Values:   []float64{r.ops.med, 1 / r.cpu.med},
			NewGroup: i > 0 && r.w.Name != rs[i-1].w.Name,
			Pale:     r.substitute,
		})
	}
	return c.PNG()
}
