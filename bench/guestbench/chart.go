package guestbench

import (
	"image/color"

	"github.com/kvfs/kvfs/bench/report"
)

// Chart draws, per workload, two bars on a log2 scale around 1: kvfsd against the C virtiofsd
// and against 9p, oriented so that right of 1 is better for kvfsd, for each of tests. It returns
// the PNG.
func Chart(res *Results, tests []Test) ([]byte, error) {
	c := report.RatioChart{
		Title:  "kvfsd in a QEMU guest against the C virtiofsd and 9p: medians of the per-run ratios",
		XLabel: "ratio, log scale: right of 1 is better for kvfsd\nrates: kvfsd ÷ other; times: other ÷ kvfsd",
		Series: []report.Series{
			{Name: "kvfsd against the C virtiofsd", Color: color.RGBA{50, 105, 190, 255}},
			{Name: "kvfsd against 9p", Color: color.RGBA{60, 160, 90, 255}},
		},
	}
	for _, t := range tests {
		c.Rows = append(c.Rows, report.Row{
			Label:  t.Label,
			Values: []float64{res.Speedup(MountKvfsd, MountVirtiofsd, t).Med, res.Speedup(MountKvfsd, Mount9p, t).Med},
		})
	}
	return c.PNG()
}
