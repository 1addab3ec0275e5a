//! Line charts as PNG files: several series, each a line with an optional
//! shaded band (the spread over seeds, say), axes with ticks and labels, a
//! legend. Drawn with plotters into a buffer, text from an embedded font
//! (DejaVu Sans, assets/fonts) so that no system font is needed, and
//! encoded with png.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::io::write_atomic;

const WIDTH: u32 = 800;
const HEIGHT: u32 = 480;
const FONT: &str = "sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans-subset.ttf");

/// One line of a chart.
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub label: String,
    /// (x, y), drawn in order; non-finite points are left out.
    pub points: Vec<(f64, f64)>,
    /// (x, low, high): a shaded band around the line.
    pub band: Vec<(f64, f64, f64)>,
    /// Thin pale lines drawn behind it (one per seed, say), where a band
    /// cannot show the spread (x not increasing).
    pub traces: Vec<Vec<(f64, f64)>>,
}

/// A chart: its title, axis labels and series.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// Colours that stay apart from one another (Tableau 10).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is compiled in and valid; a failure would show as missing text.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES);
    });
}

impl Chart {
    /// Draws the chart and writes it to `path` as a PNG.
    pub fn write_png(&self, path: &Path) -> Result<()> {
        register_font();
        let mut rgb = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
        self.draw(&mut rgb).map_err(|e| Error::Invalid(format!("cannot draw {}: {e}", path.display())))?;
        let mut bytes = Vec::new();
        let mut encoder = png::Encoder::new(&mut bytes, WIDTH, HEIGHT);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let encoded = encoder.write_header().and_then(|mut w| w.write_image_data(&rgb));
        encoded.map_err(|e| Error::Invalid(format!("cannot encode {}: {e}", path.display())))?;
        write_atomic(path, &bytes)
    }

    fn draw(&self, rgb: &mut [u8]) -> std::result::Result<(), Box<dyn std::error::Error + '_>> {
        let (x_range, y_range) = self.ranges();
        let root = BitMapBackend::with_buffer(rgb, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, (FONT, 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x_range, y_range)?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FONT, 13))
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .axis_desc_style((FONT, 15))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()?;
        for (i, s) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let band: Vec<(f64, f64, f64)> = s
                .band
                .iter()
                .copied()
                .filter(|(x, lo, hi)| x.is_finite() && lo.is_finite() && hi.is_finite())
                .collect();
            if band.len() > 1 {
                // The band's outline: the lows forward, the highs back.
                let outline: Vec<(f64, f64)> = band
                    .iter()
                    .map(|&(x, lo, _)| (x, lo))
                    .chain(band.iter().rev().map(|&(x, _, hi)| (x, hi)))
                    .collect();
                chart.draw_series(std::iter::once(Polygon::new(outline, color.mix(0.18).filled())))?;
            }
            for trace in &s.traces {
                chart.draw_series(LineSeries::new(finite(trace), color.mix(0.35).stroke_width(1)))?;
            }
            chart
                .draw_series(LineSeries::new(finite(&s.points), color.stroke_width(2)))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        if self.series.iter().any(|s| !s.label.is_empty()) {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .label_font((FONT, 13))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .draw()?;
        }
        root.present()?;
        Ok(())
    }

    /// The x and y extents of every finite point and band, padded; a unit
    /// range around a single value.
    fn ranges(&self) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for s in &self.series {
            for &(x, y) in s.points.iter().chain(s.traces.iter().flatten()) {
                xs.push(x);
                ys.push(y);
            }
            for &(x, lo, hi) in &s.band {
                xs.extend([x, x]);
                ys.extend([lo, hi]);
            }
        }
        let extent = |v: &[f64], pad: f64| {
            let finite = v.iter().copied().filter(|v| v.is_finite());
            let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| (a.min(v), b.max(v)));
            match (lo.is_finite(), hi - lo) {
                (false, _) => 0.0..1.0,
                (true, d) if d < 1e-12 => lo - 0.5..hi + 0.5,
                (true, d) => lo - pad * d..hi + pad * d,
            }
        };
        (extent(&xs, 0.0), extent(&ys, 0.05))
    }
}

fn finite(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()).collect()
}

/// A tick label: whole numbers without decimals ("1000", not "1000.0"),
/// others to at most three decimals without trailing zeros.
fn tick(v: &f64) -> String {
    if v.fract() == 0.0 {
        return format!("{v:.0}");
    }
    let text = format!("{v:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_with_bands_and_a_legend_is_a_png_with_ink_in_each_series_colour() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.png");
        let line = |label: &str, slope: f64| Series {
            label: label.into(),
            points: (0..20).map(|i| (i as f64, slope * i as f64)).collect(),
            band: (0..20).map(|i| (i as f64, slope * i as f64 - 1.0, slope * i as f64 + 1.0)).collect(),
            traces: vec![],
        };
        let chart = Chart {
            title: "reward by episode".into(),
            x_label: "episode".into(),
            y_label: "reward".into(),
            series: vec![line("rloo", 1.0), line("ppo", 0.5), Series { label: "empty".into(), ..Series::default() }],
        };
        chart.write_png(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (WIDTH, HEIGHT));
        let pixels: Vec<[u8; 3]> = buf[..info.buffer_size()].chunks(3).map(|p| [p[0], p[1], p[2]]).collect();
        for color in &PALETTE[..2] {
            let ink = pixels.iter().filter(|p| **p == [color.0, color.1, color.2]).count();
            assert!(ink > 100, "{color:?} drawn on {ink} pixels");
        }
        // Text was drawn: dark pixels of the title, labels and ticks.
        assert!(pixels.iter().filter(|p| p.iter().all(|&c| c < 60)).count() > 500);
    }

    #[test]
    fn ticks_drop_needless_decimals() {
        let ticks: Vec<String> = [1000.0, -2.0, 0.25, 0.1 + 0.2, 1e-4].iter().map(tick).collect();
        assert_eq!(ticks, ["1000", "-2", "0.25", "0.3", "0"]);
    }
}
