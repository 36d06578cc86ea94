package serverbench

import (
	"image"
	"image/color"
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
