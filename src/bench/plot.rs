//! Line plots (PNG + SVG) with plotters, using an embedded font so no system font library is needed.
//!
//! The bitmap backend cannot draw text without a registered font (it panics), and plotters' default
//! font support links fontconfig/freetype, which the GPU machine may lack. So the crate embeds
//! DejaVu Sans (`assets/DejaVuSans.ttf`, freely redistributable) and registers it as "sans-serif",
//! the family plotters uses for captions, tick labels and legends.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::row::{Row, DIMENSION_COLUMNS};

/// One line of a plot: a legend name and its (x, y) points, drawn in the order given.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Pixel size of every plot (PNG) and its SVG canvas.
const PLOT_SIZE: (u32, u32) = (1000, 640);

/// An axis spanning at least this ratio between its largest and smallest (positive) value is drawn
/// logarithmic by [`plot_rows`]; below it a linear axis reads better.
const AUTO_LOG_RATIO: f64 = 32.0;

/// Line colours, chosen to stay distinguishable on white and in greyscale print.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 102, 178),
    RGBColor(222, 110, 20),
    RGBColor(40, 150, 60),
    RGBColor(200, 35, 45),
    RGBColor(130, 90, 180),
    RGBColor(120, 80, 60),
    RGBColor(215, 100, 180),
    RGBColor(100, 100, 100),
    RGBColor(170, 170, 30),
    RGBColor(20, 170, 190),
];

static FONT_BYTES: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Register the embedded font once per process; every later call returns the first outcome.
fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font("sans-serif", FontStyle::Normal, FONT_BYTES)
                .map_err(|_| "the embedded DejaVuSans.ttf is not a valid font".to_string())
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

/// Draw `series` as a line plot into `<path_stem>.png` and `<path_stem>.svg` (the suffix is
/// appended, so a stem may contain dots), creating parent directories. Returns (png, svg).
///
/// Errors: no series, a series without points, a non-finite coordinate, or a coordinate `<= 0` on a
/// logarithmic axis (each naming the series and point).
pub fn plot_series(
    path_stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    log_x: bool,
    log_y: bool,
) -> Result<(PathBuf, PathBuf)> {
    validate_series(series, log_x, log_y).with_context(|| format!("plot `{title}`"))?;
    ensure_font()?;
    let png = with_suffix(path_stem, ".png");
    let svg = with_suffix(path_stem, ".svg");
    if let Some(dir) = png.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating directory {}", dir.display()))?;
    }
    let spec = ChartSpec {
        title,
        x_label,
        y_label,
        series,
        x_range: axis_range(
            series.iter().flat_map(|s| s.points.iter().map(|p| p.0)),
            log_x,
            false,
        ),
        y_range: axis_range(
            series.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
            log_y,
            true,
        ),
        log_x,
        log_y,
    };
    {
        let root = BitMapBackend::new(&png, PLOT_SIZE).into_drawing_area();
        render(root, &spec).with_context(|| format!("drawing {}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, PLOT_SIZE).into_drawing_area();
        render(root, &spec).with_context(|| format!("drawing {}", svg.display()))?;
    }
    Ok((png, svg))
}

/// Plot `y_column` against `x_column` for the rows of `kernel`, one line per variant, into
/// `out_dir/<kernel>__<y_column>_vs_<x_column>.{png,svg}`. Returns the two written paths.
///
/// Column names are those of [`Row::numeric`]. Rows missing either value are skipped. When rows of
/// one variant share an x value but differ in another dimension column (e.g. a sweep over `rows`
/// run at `cols` = 4096 and 7168), that variant is split into one line per such combination, named
/// like `fused (cols=4096)`, so a line never zigzags between shapes. An axis is logarithmic when
/// all its values are positive and they span at least a factor of 32.
pub fn plot_rows(
    out_dir: &Path,
    kernel: &str,
    x_column: &str,
    y_column: &str,
    rows: &[Row],
) -> Result<Vec<PathBuf>> {
    let points = collect_points(kernel, x_column, y_column, rows)?;
    if points.is_empty() {
        bail!("no `{kernel}` row has both `{x_column}` and `{y_column}` to plot");
    }
    let split_dims = dims_that_vary_at_fixed_x(x_column, &points)?;
    // BTreeMap: legend order is the sorted series name, stable from run to run.
    let mut by_series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (row, x, y) in &points {
        let mut name = row.variant.clone();
        let dims: Vec<String> = split_dims
            .iter()
            .map(|d| Ok(format!("{d}={}", format_cell(row.numeric(d)?))))
            .collect::<Result<_>>()?;
        if !dims.is_empty() {
            name = format!("{name} ({})", dims.join(", "));
        }
        by_series.entry(name).or_default().push((*x, *y));
    }
    let series: Vec<Series> = by_series
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name, points }
        })
        .collect();
    let xs: Vec<f64> = points.iter().map(|p| p.1).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.2).collect();
    let gpus: BTreeSet<&str> = points
        .iter()
        .map(|p| p.0.gpu.as_str())
        .filter(|g| !g.is_empty())
        .collect();
    let mut title = format!("{kernel}: {y_column} vs {x_column}");
    if gpus.len() == 1 {
        title = format!("{title} ({})", gpus.iter().next().unwrap_or(&""));
    }
    let stem = out_dir.join(format!("{}__{y_column}_vs_{x_column}", file_safe(kernel)));
    let (png, svg) = plot_series(
        &stem,
        &title,
        &column_label(x_column),
        &column_label(y_column),
        &series,
        wants_log(&xs),
        wants_log(&ys),
    )?;
    Ok(vec![png, svg])
}

/// Axis label with unit for a column name; unknown names are returned as they are.
pub fn column_label(column: &str) -> String {
    let label = match column {
        "us_median" => "median time (us)",
        "us_p10" => "p10 time (us)",
        "us_p90" => "p90 time (us)",
        "gbps" => "bandwidth (GB/s)",
        "pct_copy_bw" => "% of measured copy bandwidth",
        "tflops" => "TFLOP/s",
        "pct_matmul" => "% of measured matmul rate",
        "speedup_vs_baseline" => "speedup vs baseline (x)",
        "bytes" => "bytes",
        other => other,
    };
    label.to_string()
}

/// A compact number for tick labels and table cells: integers below 10 000 000 as they are,
/// other values with 4 significant digits, in scientific notation (trailing zeros of the mantissa
/// dropped, `1e7`, `2.5e-5`) outside `[0.001, 100 000)`.
pub fn format_number(v: f64) -> String {
    if !v.is_finite() {
        return v.to_string();
    }
    let a = v.abs();
    if a == 0.0 {
        "0".to_string()
    } else if v.fract() == 0.0 && a < 1e7 {
        format!("{v:.0}")
    } else if !(1e-3..1e5).contains(&a) {
        let sci = format!("{v:.3e}");
        match sci.split_once('e') {
            Some((mantissa, exp)) if mantissa.contains('.') => {
                format!(
                    "{}e{exp}",
                    mantissa.trim_end_matches('0').trim_end_matches('.')
                )
            }
            _ => sci,
        }
    } else {
        // Enough decimals for 4 significant digits: 1234 -> 0, 12.34 -> 2, 0.001234 -> 6.
        let decimals = (3 - a.log10().floor() as i32).max(0) as usize;
        let s = format!("{v:.decimals$}");
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
}

fn format_cell(v: Option<f64>) -> String {
    v.map(format_number).unwrap_or_else(|| "-".to_string())
}

struct ChartSpec<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    x_range: (f64, f64),
    y_range: (f64, f64),
    log_x: bool,
    log_y: bool,
}

/// plotters gives each axis kind its own type, so the four linear/log combinations are spelled out.
fn render<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, spec: &ChartSpec) -> Result<()> {
    let (x0, x1) = spec.x_range;
    let (y0, y1) = spec.y_range;
    match (spec.log_x, spec.log_y) {
        (false, false) => draw_chart(root, spec, x0..x1, y0..y1),
        (true, false) => draw_chart(root, spec, (x0..x1).log_scale(), y0..y1),
        (false, true) => draw_chart(root, spec, x0..x1, (y0..y1).log_scale()),
        (true, true) => draw_chart(root, spec, (x0..x1).log_scale(), (y0..y1).log_scale()),
    }
}

fn draw_chart<DB, X, Y>(root: DrawingArea<DB, Shift>, spec: &ChartSpec, x: X, y: Y) -> Result<()>
where
    DB: DrawingBackend,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    // Backend errors carry the backend's own error type; flatten them to text for anyhow.
    let e = |err: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{err:?}");
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(spec.title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(e)?;
    let tick = |v: &f64| format_number(*v);
    chart
        .configure_mesh()
        .x_desc(spec.x_label)
        .y_desc(spec.y_label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(e)?;
    for (i, s) in spec.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(s.name.as_str())
            .legend(move |(lx, ly)| {
                PathElement::new(vec![(lx, ly), (lx + 20, ly)], color.stroke_width(2))
            });
        // Markers make single-point series visible and show where the measurements are.
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(())
}

fn validate_series(series: &[Series], log_x: bool, log_y: bool) -> Result<()> {
    if series.is_empty() {
        bail!("nothing to plot: no series");
    }
    for s in series {
        if s.points.is_empty() {
            bail!("series `{}` has no points", s.name);
        }
        for (i, &(x, y)) in s.points.iter().enumerate() {
            if !x.is_finite() || !y.is_finite() {
                bail!(
                    "series `{}` point {i} is ({x}, {y}); coordinates must be finite",
                    s.name
                );
            }
            if (log_x && x <= 0.0) || (log_y && y <= 0.0) {
                bail!(
                    "series `{}` point {i} is ({x}, {y}); a logarithmic axis needs values > 0",
                    s.name
                );
            }
        }
    }
    Ok(())
}

/// Axis range around the data with a little air. Linear y axes start at 0 when all values are
/// non-negative, so heights compare honestly. A single value gets a range around it.
fn axis_range(values: impl Iterator<Item = f64>, log: bool, is_y: bool) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if log {
        // Validated: lo > 0. A factor of 1.25 on each side keeps end markers off the frame.
        return (lo / 1.25, hi * 1.25);
    }
    let lo = if is_y && lo >= 0.0 { 0.0 } else { lo };
    let span = hi - lo;
    let pad = if span > 0.0 {
        0.05 * span
    } else {
        hi.abs().max(1.0) * 0.1
    };
    let lo = if is_y && lo == 0.0 { 0.0 } else { lo - pad };
    (lo, hi + pad)
}

fn wants_log(values: &[f64]) -> bool {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    min > 0.0 && max / min >= AUTO_LOG_RATIO
}

type Point<'r> = (&'r Row, f64, f64);

fn collect_points<'r>(
    kernel: &str,
    x_column: &str,
    y_column: &str,
    rows: &'r [Row],
) -> Result<Vec<Point<'r>>> {
    let mut points = Vec::new();
    for row in rows.iter().filter(|r| r.kernel == kernel) {
        if let (Some(x), Some(y)) = (row.numeric(x_column)?, row.numeric(y_column)?) {
            if x.is_finite() && y.is_finite() {
                points.push((row, x, y));
            }
        }
    }
    // Unknown column names must be an error even when no row of this kernel exists.
    let probe = Row::empty(kernel, "", "");
    probe.numeric(x_column)?;
    probe.numeric(y_column)?;
    Ok(points)
}

/// Dimension columns (other than x and the derived `bytes`) that take two values among rows of one
/// variant at the same x: those must label separate lines.
fn dims_that_vary_at_fixed_x(x_column: &str, points: &[Point]) -> Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for dim in DIMENSION_COLUMNS
        .into_iter()
        .filter(|d| *d != x_column && *d != "bytes")
    {
        let mut seen: BTreeMap<(&str, u64), Option<u64>> = BTreeMap::new();
        let mut varies = false;
        for (row, x, _) in points {
            let value = row.numeric(dim)?.map(f64::to_bits);
            let prev = seen
                .entry((row.variant.as_str(), x.to_bits()))
                .or_insert(value);
            varies |= *prev != value;
        }
        if varies {
            out.push(dim);
        }
    }
    Ok(out)
}

fn with_suffix(stem: &Path, suffix: &str) -> PathBuf {
    let mut s: OsString = stem.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Keep letters, digits, `-`, `_`, `.`; replace anything else so a kernel name is a safe file name.
fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formatting() {
        let cases = [
            (0.0, "0"),
            (4096.0, "4096"),
            (65536.0, "65536"),
            (1.0e6, "1000000"),
            (1.0e7, "1e7"),
            (4294967296.0, "4.295e9"),
            (123456.7, "1.235e5"),
            (12.3456, "12.35"),
            (0.5, "0.5"),
            (1234.5, "1234"),
            (0.0012345, "0.001234"),
            (2.5e-5, "2.5e-5"),
            (-1.0e-4, "-1e-4"),
            (-3.25, "-3.25"),
        ];
        for (v, want) in cases {
            assert_eq!(format_number(v), want, "{v}");
        }
    }

    #[test]
    fn ranges() {
        assert_eq!(axis_range([2.0, 8.0].into_iter(), true, false), (1.6, 10.0));
        // A non-negative y axis starts at 0: span 20, 5% air above the top.
        assert_eq!(
            axis_range([10.0, 20.0].into_iter(), false, true),
            (0.0, 21.0)
        );
        assert_eq!(
            axis_range([10.0, 20.0].into_iter(), false, false),
            (9.5, 20.5)
        );
        let (lo, hi) = axis_range([5.0].into_iter(), false, false);
        assert!(lo < 5.0 && hi > 5.0);
        assert!(wants_log(&[1.0, 32.0]) && !wants_log(&[1.0, 31.0]) && !wants_log(&[0.0, 100.0]));
    }

    #[test]
    fn bad_series_are_errors() {
        let s = |pts: Vec<(f64, f64)>| {
            vec![Series {
                name: "a".into(),
                points: pts,
            }]
        };
        assert!(validate_series(&[], false, false).is_err());
        assert!(validate_series(&s(vec![]), false, false).is_err());
        assert!(validate_series(&s(vec![(1.0, f64::NAN)]), false, false).is_err());
        let err = validate_series(&s(vec![(1.0, 1.0), (0.0, 2.0)]), true, false).unwrap_err();
        assert!(err.to_string().contains("point 1"), "{err}");
        assert!(validate_series(&s(vec![(0.0, -1.0)]), false, false).is_ok());
    }

    #[test]
    fn file_names_are_sanitised() {
        assert_eq!(file_safe("fmha/decode v2"), "fmha_decode_v2");
        assert_eq!(
            with_suffix(Path::new("a/b.v1"), ".png"),
            PathBuf::from("a/b.v1.png")
        );
    }
}
