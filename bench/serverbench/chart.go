package serverbench

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"strings"
	"unicode"
)

// Chart draws, for every row of the ratio table, two horizontal bars on a log2 scale around 1:
// kvfsd's ops/s ÷ the C virtiofsd's, and the C virtiofsd's CPU per operation ÷ kvfsd's, so that
// right of 1 is better for kvfsd in both. It returns the PNG.
func Chart(res *Results) ([]byte, error) {
	rs := rows(res)
	const (
		s       = 2 // text scale
		margin  = 16
		labelW  = 27 * glyphA * s
		plotW   = 520
		valueW  = 13 * glyphA * s
		rowH    = 26
		barH    = 8
		headerH = 110
		footerH = 40
	)
	var ratios []float64
	for _, r := range rs {
		ratios = append(ratios, r.ops.med, 1/r.cpu.med)
	}
	groups := 0
	for i := range rs {
		if i == 0 || rs[i].w.Name != rs[i-1].w.Name {
			groups++
		}
	}
	width := margin + labelW + plotW + valueW + margin
	height := headerH + len(rs)*rowH + groups*6 + footerH
	img := image.NewRGBA(image.Rect(0, 0, width, height))
	fill(img, img.Bounds(), color.RGBA{255, 255, 255, 255})

	var (
		ink    = color.RGBA{40, 40, 40, 255}
		grid   = color.RGBA{225, 225, 225, 255}
		axis   = color.RGBA{90, 90, 90, 255}
		opsC   = color.RGBA{50, 105, 190, 255}
		cpuC   = color.RGBA{230, 135, 30, 255}
		opsSub = color.RGBA{160, 185, 225, 255}
		cpuSub = color.RGBA{240, 200, 150, 255}
	)
	x0 := margin + labelW
	ax := NewLogAxis(x0, plotW, ratios)

	text(img, margin, margin, s, ink, "KVFSD ÷ C VIRTIOFSD, SERVER LEVEL (LOG SCALE)")
	fill(img, image.Rect(margin, margin+24, margin+14, margin+24+barH), opsC)
	text(img, margin+20, margin+22, s, ink, "OPS/S: KVFSD ÷ VIRTIOFSD")
	fill(img, image.Rect(margin, margin+44, margin+14, margin+44+barH), cpuC)
	text(img, margin+20, margin+42, s, ink, "CPU/OP: VIRTIOFSD ÷ KVFSD")
	text(img, margin+labelW+plotW/2, margin+22, s, ink, "RIGHT OF 1 = KVFSD BETTER")
	text(img, margin+labelW+plotW/2, margin+42, s, ink, "† = VS VIRTIOFSD POOL 0")

	top, bottom := headerH, height-footerH
	vx := x0 + plotW + 28
	text(img, vx, top-26, s, opsC, "OPS")
	text(img, vx+6*glyphA*s, top-26, s, cpuC, "CPU")
	ax.DrawGrid(img, top, bottom, s, grid, axis, ink)

	y := top
	for i, r := range rs {
		if i == 0 || r.w.Name != rs[i-1].w.Name {
			if i > 0 {
				fill(img, image.Rect(margin, y+2, width-margin, y+3), grid)
			}
			y += 6
		}
		label := fmt.Sprintf("%s P%d %s", shortName(r.w.Name), r.pool, r.cache)
		if r.substitute {
			label += "†"
		}
		text(img, margin, y+(rowH-glyphH*s)/2-2, s, ink, label)
		oc, cc := opsC, cpuC
		if r.substitute {
			oc, cc = opsSub, cpuSub
		}
		ax.DrawBar(img, r.ops.med, y+3, barH, oc)
		ax.DrawBar(img, 1/r.cpu.med, y+3+barH+2, barH, cc)
		text(img, vx, y+(rowH-glyphH*s)/2-2, s, opsC, ratioText(r.ops.med))
		text(img, vx+6*glyphA*s, y+(rowH-glyphH*s)/2-2, s, cpuC, ratioText(1/r.cpu.med))
		y += rowH
	}

	var buf bytes.Buffer
	if err := png.Encode(&buf, img); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func ratioText(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return fmt.Sprintf("%.2f", v)
}

// shortName abbreviates a workload name for the chart's labels.
func shortName(name string) string {
	r := strings.NewReplacer("CREATE+RELEASE+UNLINK", "CREATE+REL+UNLINK", " KiB", "K", " MiB", "M",
		" random", " RND", " sequential", " SEQ")
	return strings.ToUpper(r.Replace(name))
}

func fill(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	r = r.Intersect(img.Bounds())
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

// text draws s in the 5×7 font at (x, y), its top left corner, each pixel scale×scale.
func text(img *image.RGBA, x, y, scale int, c color.RGBA, s string) {
	for _, ch := range s {
		g, ok := glyphs[unicode.ToUpper(ch)]
		if !ok {
			g = glyphs['?']
		}
		for gy, line := range g {
			for gx, px := range line {
				if px == '#' {
					fill(img, image.Rect(x+gx*scale, y+gy*scale, x+(gx+1)*scale, y+(gy+1)*scale), c)
				}
			}
		}
		x += glyphA * scale
	}
}
