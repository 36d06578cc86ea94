package report

import (
	"bytes"
	"fmt"
	"image/color"
	"math"

	xfont "golang.org/x/image/font"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// RatioChart is the benchmarks' chart of ratios: for each row, one horizontal bar per series
// on a log2 scale centred on 1, from 1 to the row's ratio, each ratio oriented so that right
// of 1 is better for kvfsd. The scale has whole powers of two either side of 1, enough for the
// largest ratio and at most 16×; a bar beyond it ends at its edge. Each bar's ratio is written
// at its end.
type RatioChart struct {
	Title  string
	XLabel string // under the scale: what the ratios are
	Series []Series
	Rows   []Row
}

// Series is one bar of every row.
type Series struct {
	Name  string // in the legend
	Color color.Color
	// PaleName, if not empty, is the legend of the series' bars in Pale rows, which are drawn
	// in PaleColor (if not nil).
	PaleName  string
	PaleColor color.Color
}

// Row is a row of bars.
type Row struct {
	Label string
	// Values are the ratios, one per series; one that is not a positive finite number has no
	// bar, and reads "n/a".
	Values []float64
	// NewGroup puts a gap and a line before the row: another workload's rows start there.
	NewGroup bool
	Pale     bool // the bars in the series' PaleColor
}

// The chart's layout.
const (
	chartBarWidth vg.Length = 7   // points, each bar's
	chartRowPitch vg.Length = 20  // points from one row to the next
	chartPlotWide vg.Length = 460 // points of scale, beside the labels
	chartGroupGap           = 0.6 // rows of gap before a new group
	chartDPI                = 110 // pixels per inch of the PNG
)

var (
	chartInk  = color.Gray{Y: 40}
	chartGrid = color.Gray{Y: 225}
	chartAxis = color.Gray{Y: 90}
)

// chartFont is Liberation Mono: the text renderer (golang.org/x/image/font/opentype) applies a
// font's kerning pairs unscaled (go.dev/issue/46727), which makes the letters of pairs
// such as "Ts" or "11" overlap in a proportional font at the chart's sizes; a monospaced font
// has none.
func chartFont(size vg.Length, bold bool) font.Font {
	f := font.Font{Typeface: "Liberation", Variant: "Mono", Size: size}
	if bold {
		f.Weight = xfont.WeightBold
	}
	return f
}

func chartText(size vg.Length, c color.Color) text.Style {
	return text.Style{Color: c, Font: chartFont(size, false), Handler: plot.DefaultTextHandler,
		XAlign: draw.XLeft, YAlign: draw.YCenter}
}

// logSpan is the scale's reach either side of 1, in powers of two: enough for the largest of
// ratios (those that are not positive finite numbers left out), at least 1 and at most 4.
func logSpan(ratios []float64) float64 {
	span := 1.0
	for _, x := range ratios {
		if x > 0 && !math.IsInf(x, 0) {
			span = max(span, math.Ceil(math.Abs(math.Log2(x))))
		}
	}
	return min(span, 4)
}

// powerLabel is 2^e as the scale shows it: 4, 2, 1, 1/2, 1/4.
func powerLabel(e float64) string {
	if e < 0 {
		return fmt.Sprintf("1/%g", math.Exp2(-e))
	}
	return fmt.Sprintf("%g", math.Exp2(e))
}

// PNG draws the chart: the title and the legend above the bars, each row's label left of
// them, the scale below them and once more above.
func (rc RatioChart) PNG() ([]byte, error) {
	var all []float64
	for _, r := range rc.Rows {
		all = append(all, r.Values...)
	}
	span := logSpan(all)
	// Row i is at y[i] (the y axis runs downwards), groups set apart by a gap.
	y := make([]float64, len(rc.Rows))
	end := 0.0
	for i, r := range rc.Rows {
		if r.NewGroup && i > 0 {
			end += chartGroupGap
		}
		y[i] = end
		end++
	}

	p, err := rc.axes(span, y, end)
	if err != nil {
		return nil, err
	}
	legend := plot.NewLegend()
	legend.TextStyle = text.Style{Color: chartInk, Font: chartFont(10, false), Handler: plot.DefaultTextHandler}
	legend.Top, legend.Left = true, true
	legend.ThumbnailWidth = vg.Points(14)
	legend.Padding = 3
	entries, err := rc.bars(p, &legend, span, y)
	if err != nil {
		return nil, err
	}

	// The canvas: the title and the legend, then the plot, whose rows are chartRowPitch apart.
	labelWidth := vg.Length(0)
	for _, r := range rc.Rows {
		labelWidth = max(labelWidth, p.Y.Tick.Label.Width(r.Label))
	}
	title := chartText(13, chartInk)
	title.Font = chartFont(13, true)
	title.YAlign = draw.YTop
	titleHeight := title.Height(rc.Title) + 8
	headHeight := 12 + titleHeight + vg.Length(entries)*(legend.TextStyle.Height("Ag")+legend.Padding) + 4
	w := 16 + labelWidth + chartPlotWide + 48
	h := headHeight + vg.Length(p.Y.Max-p.Y.Min)*chartRowPitch + 48
	img := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(chartDPI), vgimg.UseBackgroundColor(color.White))
	dc := draw.New(img)
	head := draw.Crop(dc, 16, -16, h-headHeight, -12)
	head.FillText(title, vg.Point{X: head.Min.X, Y: head.Max.Y}, rc.Title)
	legend.Draw(draw.Crop(head, 0, 0, 0, -titleHeight))
	p.Draw(draw.Crop(dc, 16, -16, 8, -headHeight))

	var buf bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(&buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// axes makes the plot of rows at y (up to end): the scale of powers of two across span either
// side of 1, drawn below the rows and above them, with a grid line at each power and the axis
// at 1; the rows' labels; a line between groups.
func (rc RatioChart) axes(span float64, y []float64, end float64) (*plot.Plot, error) {
	p := plot.New()
	p.BackgroundColor = color.White
	p.X.Min, p.X.Max = -span, span
	p.Y.Min, p.Y.Max = -1.2, end-0.4
	p.Y.Scale = plot.InvertedScale{Normalizer: plot.LinearScale{}}

	var xTicks []plot.Tick
	top := plotter.XYLabels{}
	for e := -span; e <= span; e++ {
		xTicks = append(xTicks, plot.Tick{Value: e, Label: powerLabel(e)})
		top.XYs = append(top.XYs, plotter.XY{X: e, Y: -0.8})
		top.Labels = append(top.Labels, powerLabel(e))
	}
	p.X.Tick.Marker = plot.ConstantTicks(xTicks)
	p.X.Tick.Label = chartText(10, chartInk)
	p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = draw.XCenter, draw.YTop
	p.X.Label.Text = rc.XLabel
	p.X.Label.TextStyle = chartText(11, chartInk)
	p.X.Label.TextStyle.XAlign, p.X.Label.TextStyle.YAlign = draw.XCenter, draw.YBottom
	p.X.Label.Padding = 6
	p.X.LineStyle.Color, p.X.Tick.LineStyle.Color = chartAxis, chartAxis

	yTicks := make([]plot.Tick, len(rc.Rows))
	for i, r := range rc.Rows {
		yTicks[i] = plot.Tick{Value: y[i], Label: r.Label}
	}
	p.Y.Tick.Marker = plot.ConstantTicks(yTicks)
	p.Y.Tick.Label = chartText(10, chartInk)
	p.Y.Tick.Label.XAlign = draw.XRight
	p.Y.Tick.Length = 0
	p.Y.LineStyle.Width = 0

	grid := plotter.NewGrid()
	grid.Horizontal.Color = nil
	grid.Vertical = draw.LineStyle{Color: chartGrid, Width: vg.Points(0.75)}
	p.Add(grid)
	for i, r := range rc.Rows {
		if r.NewGroup && i > 0 {
			sep := y[i] - (1+chartGroupGap)/2
			p.Add(line(-span, sep, span, sep, chartGrid, 0.75))
		}
	}
	p.Add(line(0, p.Y.Min, 0, p.Y.Max, chartAxis, 1))
	// The scale once more, above the first row: the chart can be taller than a screen.
	topLabels, err := plotter.NewLabels(top)
	if err != nil {
		return nil, err
	}
	for i := range topLabels.TextStyle {
		topLabels.TextStyle[i] = chartText(10, chartInk)
		topLabels.TextStyle[i].XAlign = draw.XCenter
	}
	p.Add(topLabels)
	return p, nil
}

// bars adds to p each series' bars of the rows at y, their ratios written at their ends, and
// to legend an entry for each series (and for its pale bars, if a row has them); it returns
// how many entries it added.
func (rc RatioChart) bars(p *plot.Plot, legend *plot.Legend, span float64, y []float64) (int, error) {
	pale := false
	for _, r := range rc.Rows {
		pale = pale || r.Pale
	}
	entries := 0
	for s, se := range rc.Series {
		// Series 0 is the upper bar of a row.
		offset := (vg.Length(len(rc.Series)-1)/2 - vg.Length(s)) * (chartBarWidth + 1)
		// The ratios' labels, right of bars that go right of 1 and left of the others.
		right := &plotter.Labels{Offset: vg.Point{X: 3, Y: offset}}
		left := &plotter.Labels{Offset: vg.Point{X: -3, Y: offset}}
		for i, r := range rc.Rows {
			v := math.NaN()
			if s < len(r.Values) {
				v = r.Values[s]
			}
			x, label := 0.0, "n/a"
			if v > 0 && !math.IsInf(v, 0) {
				x, label = max(-span, min(span, math.Log2(v))), fmt.Sprintf("%.2f", v)
				clr := se.Color
				if r.Pale && se.PaleColor != nil {
					clr = se.PaleColor
				}
				b, err := plotter.NewBarChart(plotter.Values{x}, chartBarWidth)
				if err != nil {
					return 0, err
				}
				b.Horizontal, b.XMin, b.Offset, b.Color = true, y[i], offset, clr
				b.LineStyle = draw.LineStyle{Color: clr, Width: vg.Points(0.5)}
				p.Add(b)
			}
			l, sty := right, chartText(8, se.Color)
			if x < 0 {
				l, sty.XAlign = left, draw.XRight
			}
			l.XYs = append(l.XYs, plotter.XY{X: x, Y: y[i]})
			l.Labels = append(l.Labels, label)
			l.TextStyle = append(l.TextStyle, sty)
		}
		p.Add(right, left)
		legend.Add(se.Name, thumb(se.Color))
		entries++
		if pale && se.PaleName != "" {
			legend.Add(se.PaleName, thumb(se.PaleColor))
			entries++
		}
	}
	return entries, nil
}

// line is a straight line from (x0, y0) to (x1, y1) in the plot's units.
func line(x0, y0, x1, y1 float64, c color.Color, width float64) *plotter.Line {
	return &plotter.Line{
		XYs:       plotter.XYs{{X: x0, Y: y0}, {X: x1, Y: y1}},
		LineStyle: draw.LineStyle{Color: c, Width: vg.Points(width)},
	}
}

// thumb is a legend's sample of a bar of colour c.
func thumb(c color.Color) plot.Thumbnailer {
	return &plotter.BarChart{Color: c, LineStyle: draw.LineStyle{Color: c, Width: vg.Points(0.5)}}
}
