package guestbench

import (
	"bytes"
	"image"
	"image/color"
	"image/png"
	"math"
	"strings"

	sb "github.com/kvfs/kvfs/bench/serverbench"
)

// Chart draws, per workload, two bars on a log2 scale around 1: kvfsd against the C virtiofsd
// and against 9p, oriented so that right of 1 is better for kvfsd, for each of tests. It returns
// the PNG.
func Chart(res *Results, tests []Test) ([]byte, error) {
	const (
		s       = 2
		margin  = 16
		labelW  = 30 * sb.GlyphAdvance * s
		plotW   = 520
		valueW  = 13 * sb.GlyphAdvance * s
		rowH    = 26
		barH    = 8
		headerH = 110
		footerH = 40
	)
	type row struct {
		label  string
		vv, vp float64
	}
	var rs []row
	var ratios []float64
	for _, t := range tests {
		r := row{label: chartLabel(t.Label), vv: res.Speedup(MountKvfsd, MountVirtiofsd, t).Med, vp: res.Speedup(MountKvfsd, Mount9p, t).Med}
		ratios = append(ratios, r.vv, r.vp)
		rs = append(rs, r)
	}
	width := margin + labelW + plotW + valueW + margin
	height := headerH + len(rs)*rowH + footerH
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	sb.FillRect(img, img.Bounds(), color.RGBA{255, 255, 255, 255})
	var (
		ink  = color.RGBA{40, 40, 40, 255}
		grid = color.RGBA{225, 225, 225, 255}
		axis = color.RGBA{90, 90, 90, 255}
		vC   = color.RGBA{50, 105, 190, 255}
		pC   = color.RGBA{60, 160, 90, 255}
	)
	x0 := margin + labelW
	ax := sb.NewLogAxis(x0, plotW, ratios)

	sb.DrawText(img, margin, margin, s, ink, "KVFSD IN A QEMU (TCG) GUEST, MEDIAN OF RUNS (LOG SCALE)")
	sb.FillRect(img, image.Rect(margin, margin+24, margin+14, margin+24+barH), vC)
	sb.DrawText(img, margin+20, margin+22, s, ink, "VS C VIRTIOFSD")
	sb.FillRect(img, image.Rect(margin, margin+44, margin+14, margin+44+barH), pC)
	sb.DrawText(img, margin+20, margin+42, s, ink, "VS 9P")
	sb.DrawText(img, x0, margin+22, s, ink, "RIGHT OF 1 = KVFSD BETTER")
	sb.DrawText(img, x0, margin+42, s, ink, "RATES: KVFSD ÷ OTHER, TIMES: OTHER ÷ KVFSD")

	top, bottom := headerH, height-footerH
	vx := x0 + plotW + 28
	sb.DrawText(img, vx, top-26, s, vC, "VFSD")
	sb.DrawText(img, vx+6*sb.GlyphAdvance*s, top-26, s, pC, "9P")
	ax.DrawGrid(img, top, bottom, s, grid, axis, ink)

	y := top
	for _, r := range rs {
		sb.DrawText(img, margin, y+(rowH-sb.GlyphHeight*s)/2-2, s, ink, r.label)
		ax.DrawBar(img, r.vv, y+3, barH, vC)
		ax.DrawBar(img, r.vp, y+3+barH+2, barH, pC)
		sb.DrawText(img, vx, y+(rowH-sb.GlyphHeight*s)/2-2, s, vC, chartNum(r.vv))
		sb.DrawText(img, vx+6*sb.GlyphAdvance*s, y+(rowH-sb.GlyphHeight*s)/2-2, s, pC, chartNum(r.vp))
		y += rowH
	}
	var buf bytes.Buffer
	if err := png.Encode(&buf, img); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// chartLabel shortens a workload label to the chart's font and width.
func chartLabel(l string) string {
	r := strings.NewReplacer(" KiB", "K", " MiB", "M", ", O_DIRECT", "", "libaio QD16", "LIBAIO16",
		"(buffered)", "", "list the directory", "LIST DIR", "bs=1M ", "", "+ fsync", "",
		"make -j with tcc", "make -j tcc")
	return strings.ToUpper(strings.Join(strings.Fields(r.Replace(l)), " "))
}

// chartNum is ratioNum in the chart's font, which has no en dash.
func chartNum(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return ratioNum(v)
}
