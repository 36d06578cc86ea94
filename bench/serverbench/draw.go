package serverbench

import (
	"fmt"
	"image"
	"image/color"
	"math"
)

// The chart's drawing primitives, for the other benchmark reports (bench/guestbench) to draw
// charts that look like this one.

// GlyphAdvance and GlyphHeight are the size of a character of DrawText at scale 1, in pixels:
// the advance from one character to the next, and the height.
const (
	GlyphAdvance = glyphA
	GlyphHeight  = glyphH
)

// DrawText draws s in the chart's 5×7 upper-case font with its top left corner at (x, y), each
// font pixel scale×scale; characters the font lacks are drawn as '?'.
func DrawText(img *image.RGBA, x, y, scale int, c color.RGBA, s string) {
	text(img, x, y, scale, c, s)
}

// FillRect fills r, clipped to img, with c.
func FillRect(img *image.RGBA, r image.Rectangle, c color.RGBA) { fill(img, r, c) }

// LogAxis is the charts' horizontal scale: ratios on a log2 axis centred on 1, whole powers of
// two either side, enough for the largest ratio and at most 16×.
type LogAxis struct {
	X0, Width int
	Span      float64 // powers of two either side of 1
}

// NewLogAxis makes the axis that starts at x0 and is width pixels wide for ratios; ratios that
// are not positive finite numbers are left out.
func NewLogAxis(x0, width int, ratios []float64) LogAxis {
	span := 1.0
	for _, x := range ratios {
		if x > 0 && !math.IsInf(x, 0) {
			span = max(span, math.Ceil(math.Abs(math.Log2(x))))
		}
	}
	return LogAxis{X0: x0, Width: width, Span: min(span, 4)}
}

// X is the x of ratio r, clamped to the axis.
func (a LogAxis) X(r float64) int {
	l := math.Max(-a.Span, math.Min(a.Span, math.Log2(r)))
	return a.X0 + int(math.Round((l+a.Span)/(2*a.Span)*float64(a.Width)))
}

// DrawGrid draws a vertical line from top to bottom at every power of two, the one at 1 in
// axis, the others in grid, each labelled (2, 1, 1/2, ...) above and below in ink.
func (a LogAxis) DrawGrid(img *image.RGBA, top, bottom, scale int, grid, axis, ink color.RGBA) {
	for e := -a.Span; e <= a.Span; e++ {
		x := a.X(math.Pow(2, e))
		c := grid
		if e == 0 {
			c = axis
		}
		fill(img, image.Rect(x, top-6, x+1, bottom), c)
		lbl := fmt.Sprintf("%g", math.Pow(2, e))
		if e < 0 {
			lbl = fmt.Sprintf("1/%g", math.Pow(2, -e))
		}
		text(img, x-len(lbl)*glyphA*scale/2, top-26, scale, ink, lbl)
		text(img, x-len(lbl)*glyphA*scale/2, bottom+8, scale, ink, lbl)
	}
}

// DrawBar draws a bar h pixels high at y, from 1 to ratio v; nothing when v is not a positive
// finite number.
func (a LogAxis) DrawBar(img *image.RGBA, v float64, y, h int, c color.RGBA) {
	if !(v > 0) || math.IsInf(v, 0) {
		return
	}
	l, r := a.X(1), a.X(v)
	if r < l {
		l, r = r, l
	}
	fill(img, image.Rect(l, y, max(r, l+1), y+h), c)
}
