//! Line plots (PNG + SVG) with plotters, using an embedded font so no system font library is needed.
//!
//! The bitmap backend cannot draw text without a registered font (it panics), and plotters' default
//! font support links fontconfig/freetype, which the GPU machine may lack. So the crate embeds
//! DejaVu Sans (`assets/DejaVuSans.ttf`, freely redistributable) and registers it as "sans-serif",
//! the family plotters uses for captions, tick labels and legends.
//!
//! Every plot reads on its own: each series has its own colour and marker (no repeat within a plot),
//! target values are dashed horizontal lines with their labels, and the legend sits in a panel right of
//! the data area so it never covers a point. [`plot_rows_with`] draws one plot per geometry (model shape)
//! of a kernel, named for people: `DSV4-Flash` / `DSV4-Pro` where the shape's model dimensions are those
//! of [`ModelConfig::flash`] / [`ModelConfig::pro`], else the shape itself (`D 1000`).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, ensure, Context, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::row::{Row, DIMENSION_COLUMNS};
use crate::model::config::ModelConfig;

/// One line of a plot: a legend name and its (x, y) points, drawn in the order given.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A horizontal line across a plot at `value` on the y axis, labelled on the line and in the legend.
#[derive(Clone, Debug, PartialEq)]
pub struct TargetLine {
    pub value: f64,
    pub label: String,
}

/// A target stated in one CSV column: drawn on the plots whose y column is `metric`.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    pub metric: String,
    pub value: f64,
    pub label: String,
}

/// What [`plot_rows_with`] draws of a kernel's rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlotSelection {
    /// Variants drawn, in legend order; empty: every variant (legend in name order).
    pub variants: Vec<String>,
    /// Target lines; each goes on the plots of its metric.
    pub targets: Vec<Target>,
}

/// Everything one plot shows.
#[derive(Clone, Copy, Debug)]
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: &'a [Series],
    pub targets: &'a [TargetLine],
    pub log_x: bool,
    pub log_y: bool,
}

/// Size of the data area's side of every plot (PNG pixels and SVG canvas); the legend panel is added
/// to the right, and the height grows when the legend needs more rows.
const PLOT_SIZE: (u32, u32) = (960, 640);

/// Legend panel: row height, marker sample width, and the width of one character of the legend font
/// (DejaVu Sans at 15 px averages about 8 px; the estimate only sizes the panel).
const LEGEND_ROW: u32 = 22;
const LEGEND_SAMPLE: i32 = 30;
const LEGEND_CHAR_PX: f64 = 8.2;

/// An axis spanning at least this ratio between its largest and smallest (positive) value is drawn
/// logarithmic by [`plot_rows`]; below it a linear axis reads better.
const AUTO_LOG_RATIO: f64 = 32.0;

/// Series colours: Tableau 10 followed by ten darker or lighter companions, all distinguishable on white.
/// A plot with more series takes evenly spaced hues instead, so no two series of a plot share a colour.
const COLORS: [RGBColor; 20] = [
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
    RGBColor(16, 60, 110),
    RGBColor(166, 86, 0),
    RGBColor(0, 100, 40),
    RGBColor(130, 10, 20),
    RGBColor(80, 40, 120),
    RGBColor(230, 171, 2),
    RGBColor(102, 194, 165),
    RGBColor(0, 0, 0),
    RGBColor(250, 100, 120),
    RGBColor(80, 120, 220),
];

/// Colour of target lines and their labels.
const TARGET_COLOR: RGBColor = RGBColor(60, 60, 60);

/// Marker shapes, cycled per series (a second cue besides colour, for greyscale print).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Cross,
    HollowCircle,
    HollowSquare,
}

const MARKERS: [Marker; 8] = [
    Marker::Circle,
    Marker::Square,
    Marker::TriangleUp,
    Marker::Diamond,
    Marker::TriangleDown,
    Marker::Cross,
    Marker::HollowCircle,
    Marker::HollowSquare,
];

/// The colour of series `i` of `n`: the palette while it lasts, else hues stepped by the golden ratio
/// (neighbouring series far apart on the colour wheel, never the same hue) at three lightness levels.
fn series_color(i: usize, n: usize) -> RGBColor {
    if n <= COLORS.len() {
        return COLORS[i];
    }
    let hue = (i as f64 * 0.618_033_988_749_895).fract();
    let light = [0.33, 0.48, 0.62][i % 3];
    hsl_to_rgb(hue, 0.8, light)
}

fn hsl_to_rgb(h: f64, s: f64, l: f64) -> RGBColor {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let hp = (h.rem_euclid(1.0)) * 6.0;
    let x = c * (1.0 - (hp % 2.0 - 1.0).abs());
    let (r, g, b) = match hp as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let q = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    RGBColor(q(r), q(g), q(b))
}

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
    plot_chart(
        path_stem,
        &Chart {
            title,
            x_label,
            y_label,
            series,
            targets: &[],
            log_x,
            log_y,
        },
    )
}

/// [`plot_series`] with target lines: each is a dashed horizontal line, labelled above it at the left of
/// the data area and listed under the series in the legend; the y axis is widened to show it.
///
/// Errors: those of [`plot_series`], and a non-finite target (or one `<= 0` on a logarithmic y axis).
pub fn plot_chart(path_stem: &Path, chart: &Chart) -> Result<(PathBuf, PathBuf)> {
    validate_series(chart.series, chart.log_x, chart.log_y)
        .with_context(|| format!("plot `{}`", chart.title))?;
    for t in chart.targets {
        if !t.value.is_finite() || (chart.log_y && t.value <= 0.0) {
            bail!(
                "plot `{}`: target `{}` at {} cannot be drawn on this y axis",
                chart.title,
                t.label,
                t.value
            );
        }
    }
    ensure_font()?;
    let png = with_suffix(path_stem, ".png");
    let svg = with_suffix(path_stem, ".svg");
    if let Some(dir) = png.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating directory {}", dir.display()))?;
    }
    let spec = ChartSpec {
        chart,
        x_range: axis_range(
            chart
                .series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0)),
            chart.log_x,
            false,
        ),
        y_range: axis_range(
            chart
                .series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.1))
                .chain(chart.targets.iter().map(|t| t.value)),
            chart.log_y,
            true,
        ),
    };
    let size = canvas_size(chart);
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        render(root, &spec).with_context(|| format!("drawing {}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        render(root, &spec).with_context(|| format!("drawing {}", svg.display()))?;
    }
    Ok((png, svg))
}

/// Width of the legend panel: enough for the longest entry.
fn legend_width(chart: &Chart) -> u32 {
    let longest = chart
        .series
        .iter()
        .map(|s| s.name.chars().count())
        .chain(chart.targets.iter().map(|t| t.label.chars().count()))
        .max()
        .unwrap_or(0);
    (LEGEND_SAMPLE as f64 + 40.0 + longest as f64 * LEGEND_CHAR_PX).clamp(160.0, 560.0) as u32
}

/// The canvas: data side + legend panel, tall enough for every legend row.
fn canvas_size(chart: &Chart) -> (u32, u32) {
    let rows = chart.series.len() + chart.targets.len() + 2;
    let height = PLOT_SIZE.1.max(90 + rows as u32 * LEGEND_ROW);
    (PLOT_SIZE.0 + legend_width(chart), height)
}

/// Plot `y_column` against `x_column` for the rows of `kernel`, every variant, one plot per geometry
/// (see [`plot_rows_with`]). Returns the written paths, (png, svg) per geometry.
pub fn plot_rows(
    out_dir: &Path,
    kernel: &str,
    x_column: &str,
    y_column: &str,
    rows: &[Row],
) -> Result<Vec<PathBuf>> {
    plot_rows_with(
        out_dir,
        kernel,
        x_column,
        y_column,
        rows,
        &PlotSelection::default(),
    )
}

/// Plot `y_column` against `x_column` for the rows of `kernel` whose variant `selection` names (all
/// when it names none), with the selection's targets for `y_column`. Returns the written paths, (png,
/// svg) per geometry.
///
/// Column names are those of [`Row::numeric`]; rows missing either value are skipped. The `shape` of a
/// row (`key=value,...`) says its geometry: every key except the x column and the workload sizes
/// (`tokens`, `rows`, `batch`, `ctx`, `bytes`, `next_n`). Each geometry gets its own plot,
/// `out_dir/<kernel>__<y_column>_vs_<x_column>__<geometry>.{png,svg}` (no `__<geometry>` part when
/// the shapes have no geometry key), titled with [`geometry_label`]. Within a plot, one line per
/// variant; when rows of one variant share an x value but differ in a workload size (e.g. a ctx sweep
/// at batch 1 and 16), that variant is split into one line per value, named like
/// `fused (batch=16)`, so a line never zigzags between shapes. An axis is logarithmic when all its
/// values (targets included) are positive and they span at least a factor of 32.
pub fn plot_rows_with(
    out_dir: &Path,
    kernel: &str,
    x_column: &str,
    y_column: &str,
    rows: &[Row],
    selection: &PlotSelection,
) -> Result<Vec<PathBuf>> {
    let mut points = collect_points(kernel, x_column, y_column, rows)?;
    if points.is_empty() {
        bail!("no `{kernel}` row has both `{x_column}` and `{y_column}` to plot");
    }
    if !selection.variants.is_empty() {
        let present: BTreeSet<&str> = points.iter().map(|p| p.0.variant.as_str()).collect();
        points.retain(|p| selection.variants.contains(&p.0.variant));
        if points.is_empty() {
            bail!(
                "`{kernel}` has no `{y_column}` rows of the variants {:?} (variants present: {})",
                selection.variants,
                present.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
    }
    let targets: Vec<TargetLine> = selection
        .targets
        .iter()
        .filter(|t| t.metric == y_column)
        .map(|t| TargetLine {
            value: t.value,
            label: t.label.clone(),
        })
        .collect();

    // Group by geometry (BTreeMap: files in a stable order).
    let mut groups: BTreeMap<Vec<(String, String)>, Vec<Point>> = BTreeMap::new();
    for p in points {
        let geometry = geometry_of(&p.0.shape, x_column);
        groups.entry(geometry).or_default().push(p);
    }
    let mut out = Vec::new();
    let mut stems = BTreeSet::new();
    for (geometry, points) in &groups {
        let series = series_of(x_column, points, &selection.variants)?;
        let xs: Vec<f64> = points.iter().map(|p| p.1).collect();
        let ys: Vec<f64> = points
            .iter()
            .map(|p| p.2)
            .chain(targets.iter().map(|t| t.value))
            .collect();
        let gpus: BTreeSet<&str> = points
            .iter()
            .map(|p| p.0.gpu.as_str())
            .filter(|g| !g.is_empty())
            .collect();
        let y_label = column_label(y_column);
        let mut title = if geometry.is_empty() {
            format!("{kernel}: {y_label} vs {x_column}")
        } else {
            format!(
                "{kernel}, {}: {y_label} vs {x_column}",
                geometry_label(geometry)
            )
        };
        if gpus.len() == 1 {
            title = format!("{title} ({})", gpus.iter().next().unwrap_or(&""));
        }
        let mut stem = format!("{}__{y_column}_vs_{x_column}", file_safe(kernel));
        if !geometry.is_empty() {
            stem = format!("{stem}__{}", geometry_slug(geometry));
        }
        // Two geometries whose slugs coincide (only by odd characters) must not overwrite each other.
        while !stems.insert(stem.clone()) {
            stem.push('_');
        }
        let (png, svg) = plot_chart(
            &out_dir.join(stem),
            &Chart {
                title: &title,
                x_label: &column_label(x_column),
                y_label: &y_label,
                series: &series,
                targets: &targets,
                log_x: wants_log(&xs),
                log_y: wants_log(&ys),
            },
        )?;
        out.push(png);
        out.push(svg);
    }
    Ok(out)
}

/// Workload sizes: shape keys that say how much work a point does, not what model it belongs to.
const WORKLOAD_KEYS: [&str; 6] = ["tokens", "rows", "batch", "ctx", "bytes", "next_n"];

/// The `key=value` pairs of a shape, or none when any part is not of that form.
pub(crate) fn shape_pairs(shape: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for part in shape.split(',') {
        match part.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                out.push((k.trim().to_string(), v.trim().to_string()))
            }
            _ => return Vec::new(),
        }
    }
    out
}

/// The geometry part of a shape: its keys other than the x column and the workload sizes, sorted.
fn geometry_of(shape: &str, x_column: &str) -> Vec<(String, String)> {
    let mut g: Vec<(String, String)> = shape_pairs(shape)
        .into_iter()
        .filter(|(k, _)| k != x_column && !WORKLOAD_KEYS.contains(&k.as_str()))
        .collect();
    g.sort();
    g
}

/// The model dimensions a shape key may name, for `cfg`; `None` for a key that is not a model dimension.
/// `topk` is the routed experts per token in MoE shapes and the indexer's selection in attention shapes.
fn model_values(key: &str, cfg: &ModelConfig) -> Option<Vec<usize>> {
    Some(match key {
        "d" | "dim" | "hidden" | "cols" => vec![cfg.dim],
        "inter" => vec![cfg.moe_inter_dim],
        "experts" => vec![cfg.n_routed_experts],
        "heads" => vec![cfg.n_heads],
        "index_heads" => vec![cfg.index_n_heads],
        "topk" => vec![cfg.n_activated_experts, cfg.index_topk],
        "k" => vec![cfg.index_topk],
        _ => return None,
    })
}

/// The models a geometry may belong to, with their names in plots.
fn named_models() -> [(&'static str, ModelConfig); 2] {
    [
        ("DSV4-Flash", ModelConfig::flash()),
        ("DSV4-Pro", ModelConfig::pro()),
    ]
}

/// A geometry for people. When its model dimensions (hidden size, expert count, intermediate size,
/// heads, top-k; a value 0 marks a dimension the shape does not use) are all those of exactly one of
/// DeepSeek-V4 Flash / Pro, that model's name followed by the other keys: `DSV4-Flash`,
/// `DSV4-Pro (kind csa)`. Otherwise the keys themselves, model dimensions first: `D 1000`,
/// `K 2048 (format fp8)`.
pub fn geometry_label(geometry: &[(String, String)]) -> String {
    let mut matches = Vec::new();
    for (name, cfg) in named_models() {
        let mut any = false;
        let mut all = true;
        for (k, v) in geometry {
            if let (Some(allowed), Ok(v)) = (model_values(k, &cfg), v.parse::<usize>()) {
                if v != 0 {
                    any = true;
                    all &= allowed.contains(&v);
                }
            }
        }
        if any && all {
            matches.push((name, cfg));
        }
    }
    let pairs = |kv: Vec<&(String, String)>| -> String {
        kv.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let [(name, cfg)] = matches.as_slice() {
        // The model's name stands for its dimensions (and for model keys it leaves unused, value 0).
        let rest: Vec<&(String, String)> = geometry
            .iter()
            .filter(|(k, v)| model_values(k, cfg).is_none() || v.parse::<usize>().is_err())
            .collect();
        if rest.is_empty() {
            name.to_string()
        } else {
            format!("{name} ({})", pairs(rest))
        }
    } else {
        let flash = ModelConfig::flash();
        let is_dim = |k: &str| model_values(k, &flash).is_some();
        let dims: Vec<&(String, String)> = geometry.iter().filter(|(k, _)| is_dim(k)).collect();
        let rest: Vec<&(String, String)> = geometry.iter().filter(|(k, _)| !is_dim(k)).collect();
        let mut text = match (dims.is_empty(), rest.is_empty()) {
            (true, _) => pairs(rest),
            (false, true) => pairs(dims),
            (false, false) => format!("{} ({})", pairs(dims), pairs(rest)),
        };
        if let Some(first) = text.get(..1) {
            text = format!("{}{}", first.to_uppercase(), &text[1..]);
        }
        text
    }
}

/// File-name part for a geometry: its label in lower case, spaces and punctuation folded to `-`.
fn geometry_slug(geometry: &[(String, String)]) -> String {
    let mut slug = String::new();
    for c in geometry_label(geometry).to_lowercase().chars() {
        if c.is_ascii_alphanumeric() || c == '.' {
            slug.push(c);
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
    }
    slug.trim_end_matches('-').to_string()
}

/// The lines of one plot: a line per variant, split by the workload keys (then dimension columns) that
/// take two values among rows of one variant at the same x. Legend order: the order of `variants` when
/// given, else the variant name; then the split values.
fn series_of(x_column: &str, points: &[Point], variants: &[String]) -> Result<Vec<Series>> {
    let workload = |row: &Row| -> Vec<(String, String)> {
        shape_pairs(&row.shape)
            .into_iter()
            .filter(|(k, _)| k != x_column && WORKLOAD_KEYS.contains(&k.as_str()))
            .collect()
    };
    // Workload keys of the shape that vary at fixed (variant, x).
    let mut split_keys: Vec<String> = Vec::new();
    let keys: BTreeSet<String> = points
        .iter()
        .flat_map(|p| workload(p.0).into_iter().map(|(k, _)| k))
        .collect();
    for key in keys {
        let mut seen: BTreeMap<(&str, u64), Option<String>> = BTreeMap::new();
        let mut varies = false;
        for (row, x, _) in points {
            let value = workload(row)
                .into_iter()
                .find(|(k, _)| *k == key)
                .map(|kv| kv.1);
            let prev = seen
                .entry((row.variant.as_str(), x.to_bits()))
                .or_insert_with(|| value.clone());
            varies |= *prev != value;
        }
        if varies {
            split_keys.push(key);
        }
    }
    let label_of = |row: &Row| -> Vec<String> {
        let w = workload(row);
        split_keys
            .iter()
            .map(|key| {
                let v = w.iter().find(|(k, _)| k == key).map(|kv| kv.1.as_str());
                format!("{key}={}", v.unwrap_or("-"))
            })
            .collect()
    };
    // Dimension columns not in the shape (e.g. derived sizes) that still vary at fixed x.
    let split_dims = dims_that_vary_at_fixed_x(x_column, points, &|row| label_of(row).join(","))?;
    // BTreeMap key: (legend rank of the variant, variant, split values) for a stable order.
    let rank = |v: &str| variants.iter().position(|s| s == v).unwrap_or(usize::MAX);
    type LineKey = (usize, String, Vec<String>);
    let mut by_series: BTreeMap<LineKey, Vec<(f64, f64)>> = BTreeMap::new();
    for (row, x, y) in points {
        let mut parts = label_of(row);
        for d in &split_dims {
            parts.push(format!("{d}={}", format_cell(row.numeric(d)?)));
        }
        by_series
            .entry((rank(&row.variant), row.variant.clone(), parts))
            .or_default()
            .push((*x, *y));
    }
    let mut lines: Vec<_> = by_series.into_iter().collect();
    lines.sort_by(|((ra, va, pa), _), ((rb, vb, pb), _)| {
        ra.cmp(rb).then_with(|| va.cmp(vb)).then_with(|| {
            pa.iter()
                .zip(pb)
                .map(|(a, b)| natural_cmp(a, b))
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
        })
    });
    Ok(lines
        .into_iter()
        .map(|((_, variant, parts), mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            let name = if parts.is_empty() {
                variant
            } else {
                format!("{variant} ({})", parts.join(", "))
            };
            Series { name, points }
        })
        .collect())
}

/// Order of two split labels (`batch=16` vs `batch=2`): by key, then numerically when both values are
/// numbers, else as text.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let (ka, va) = a.split_once('=').unwrap_or((a, ""));
    let (kb, vb) = b.split_once('=').unwrap_or((b, ""));
    ka.cmp(kb)
        .then_with(|| match (va.parse::<f64>(), vb.parse::<f64>()) {
            (Ok(x), Ok(y)) => x.total_cmp(&y),
            _ => va.cmp(vb),
        })
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
    chart: &'a Chart<'a>,
    x_range: (f64, f64),
    y_range: (f64, f64),
}

/// plotters gives each axis kind its own type, so the four linear/log combinations are spelled out.
fn render<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, spec: &ChartSpec) -> Result<()> {
    let (x0, x1) = spec.x_range;
    let (y0, y1) = spec.y_range;
    // plotters' own log-axis labels can leave a whole decade unlabelled; ticks are chosen here instead.
    let log = |lo: f64, hi: f64| {
        let (bold, light) = log_ticks(lo, hi);
        (lo..hi)
            .log_scale()
            .with_key_points(bold)
            .with_light_points(light)
    };
    match (spec.chart.log_x, spec.chart.log_y) {
        (false, false) => draw_chart(root, spec, x0..x1, y0..y1),
        (true, false) => draw_chart(root, spec, log(x0, x1), y0..y1),
        (false, true) => draw_chart(root, spec, x0..x1, log(y0, y1)),
        (true, true) => draw_chart(root, spec, log(x0, x1), log(y0, y1)),
    }
}

/// Labelled and grid-only ticks of a logarithmic axis over [lo, hi] (lo > 0): 1..9 x 10^k on an axis
/// spanning about a decade, 1, 2, 5 x 10^k up to three and a half decades, powers of ten beyond; grid
/// lines at every 1..9 x 10^k.
fn log_ticks(lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    let decades = (hi / lo).log10();
    let labelled: &[f64] = if decades <= 1.2 {
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    } else if decades <= 3.5 {
        &[1.0, 2.0, 5.0]
    } else {
        &[1.0]
    };
    let (mut bold, mut light) = (Vec::new(), Vec::new());
    for k in lo.log10().floor() as i32..=hi.log10().ceil() as i32 {
        let p = 10f64.powi(k);
        for m in 1..10 {
            let v = m as f64 * p;
            if v < lo || v > hi {
                continue;
            }
            if labelled.contains(&(m as f64)) {
                bold.push(v);
            } else {
                light.push(v);
            }
        }
    }
    (bold, light)
}

/// One marker of `kind` centred on a point, `r` pixels in radius.
fn marker<'a, DB: DrawingBackend + 'a, C: Clone + 'a>(
    kind: Marker,
    at: C,
    r: i32,
    color: RGBColor,
) -> DynElement<'a, DB, C> {
    let filled = ShapeStyle::from(color).filled();
    let hollow = ShapeStyle::from(color).stroke_width(2);
    let base = EmptyElement::at(at);
    match kind {
        Marker::Circle => (base + Circle::new((0, 0), r, filled)).into_dyn(),
        Marker::HollowCircle => (base + Circle::new((0, 0), r, hollow)).into_dyn(),
        Marker::Square => {
            (base + Rectangle::new([(-r + 1, -r + 1), (r - 1, r - 1)], filled)).into_dyn()
        }
        Marker::HollowSquare => {
            (base + Rectangle::new([(-r + 1, -r + 1), (r - 1, r - 1)], hollow)).into_dyn()
        }
        Marker::TriangleUp => {
            (base + Polygon::new(vec![(0, -r - 1), (r + 1, r), (-r - 1, r)], filled)).into_dyn()
        }
        Marker::TriangleDown => {
            (base + Polygon::new(vec![(0, r + 1), (r + 1, -r), (-r - 1, -r)], filled)).into_dyn()
        }
        Marker::Diamond => (base
            + Polygon::new(
                vec![(0, -r - 1), (r + 1, 0), (0, r + 1), (-r - 1, 0)],
                filled,
            ))
        .into_dyn(),
        Marker::Cross => (base
            + PathElement::new(vec![(-r, -r), (r, r)], hollow)
            + PathElement::new(vec![(-r, r), (r, -r)], hollow))
        .into_dyn(),
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
    let c = spec.chart;
    root.fill(&WHITE).map_err(e)?;
    let body = root
        .margin(10, 0, 0, 0)
        .titled(c.title, ("sans-serif", 22))
        .map_err(e)?;
    let legend_w = legend_width(c);
    let (body_w, _) = body.dim_in_pixel();
    let (data_side, legend) = body.split_horizontally(body_w.saturating_sub(legend_w));
    // The data side keeps the plot's own height; a taller canvas (long legend) leaves white below it.
    let (data_side, _) = data_side.split_vertically(PLOT_SIZE.1.saturating_sub(40));
    let mut chart = ChartBuilder::on(&data_side)
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x, y)
        .map_err(e)?;
    let tick = |v: &f64| format_number(*v);
    chart
        .configure_mesh()
        .x_desc(c.x_label)
        .y_desc(c.y_label)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .max_light_lines(1)
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(210, 210, 210))
        .draw()
        .map_err(e)?;

    // Targets first, so data lines are drawn over them.
    let (x0, x1) = spec.x_range;
    for t in c.targets {
        chart
            .draw_series(DashedLineSeries::new(
                [(x0, t.value), (x1, t.value)],
                10,
                6,
                TARGET_COLOR.stroke_width(2),
            ))
            .map_err(e)?;
        chart
            .draw_series(std::iter::once(
                EmptyElement::at((x0, t.value))
                    + Text::new(
                        t.label.clone(),
                        (8, -20),
                        ("sans-serif", 14).into_font().color(&TARGET_COLOR),
                    ),
            ))
            .map_err(e)?;
    }
    let n = c.series.len();
    for (i, s) in c.series.iter().enumerate() {
        let color = series_color(i, n);
        let kind = MARKERS[i % MARKERS.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(e)?;
        for &p in &s.points {
            chart
                .plotting_area()
                .draw(&marker::<DB, _>(kind, p, 4, color))
                .map_err(e)?;
        }
    }

    // The legend panel: one row per series (line + marker sample, name), then the targets.
    let font = ("sans-serif", 15).into_font();
    let row = LEGEND_ROW as i32;
    let x_text = 8 + LEGEND_SAMPLE + 8;
    let mut y_at = 56;
    for (i, s) in c.series.iter().enumerate() {
        let color = series_color(i, n);
        let kind = MARKERS[i % MARKERS.len()];
        legend
            .draw(&PathElement::new(
                vec![(8, y_at), (8 + LEGEND_SAMPLE, y_at)],
                color.stroke_width(2),
            ))
            .map_err(e)?;
        legend
            .draw(&marker::<DB, _>(
                kind,
                (8 + LEGEND_SAMPLE / 2, y_at),
                4,
                color,
            ))
            .map_err(e)?;
        legend
            .draw(&Text::new(s.name.clone(), (x_text, y_at - 8), font.clone()))
            .map_err(e)?;
        y_at += row;
    }
    if !c.targets.is_empty() {
        y_at += row / 2;
        for t in c.targets {
            for seg in 0..2 {
                let a = 8 + seg * 17;
                legend
                    .draw(&PathElement::new(
                        vec![(a, y_at), (a + 11, y_at)],
                        TARGET_COLOR.stroke_width(2),
                    ))
                    .map_err(e)?;
            }
            legend
                .draw(&Text::new(
                    t.label.clone(),
                    (x_text, y_at - 8),
                    font.clone().color(&TARGET_COLOR),
                ))
                .map_err(e)?;
            y_at += row;
        }
    }
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
/// variant and one `split` label at the same x: those must label separate lines too.
fn dims_that_vary_at_fixed_x(
    x_column: &str,
    points: &[Point],
    split: &dyn Fn(&Row) -> String,
) -> Result<Vec<&'static str>> {
    let mut out = Vec::new();
    for dim in DIMENSION_COLUMNS
        .into_iter()
        .filter(|d| *d != x_column && *d != "bytes")
    {
        let mut seen: BTreeMap<(&str, String, u64), Option<u64>> = BTreeMap::new();
        let mut varies = false;
        for (row, x, _) in points {
            let value = row.numeric(dim)?.map(f64::to_bits);
            let prev = seen
                .entry((row.variant.as_str(), split(row), x.to_bits()))
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

    fn geometry(shape: &str, x: &str) -> Vec<(String, String)> {
        geometry_of(shape, x)
    }

    #[test]
    fn geometries_are_named_after_the_model_they_match() {
        let (flash, pro) = (ModelConfig::flash(), ModelConfig::pro());
        let moe = |c: &ModelConfig| {
            format!(
                "tokens=1,experts={},hidden={},inter={},topk={}",
                c.n_routed_experts, c.dim, c.moe_inter_dim, c.n_activated_experts
            )
        };
        assert_eq!(
            geometry_label(&geometry(&moe(&flash), "tokens")),
            "DSV4-Flash"
        );
        assert_eq!(geometry_label(&geometry(&moe(&pro), "tokens")), "DSV4-Pro");
        assert_eq!(geometry_slug(&geometry(&moe(&pro), "tokens")), "dsv4-pro");
        // One dimension off: the shape itself, first letter capitalised.
        let odd = format!("tokens=1,experts=8,hidden={}", flash.dim);
        assert_eq!(
            geometry_label(&geometry(&odd, "tokens")),
            format!("Experts 8, hidden {}", flash.dim)
        );
        assert_eq!(geometry_label(&geometry("rows=4,d=1000", "rows")), "D 1000");
        // Attention: heads + the indexer's top-k; a 0 marks a dimension the layer kind does not use.
        let csa = format!(
            "batch=4,ctx=65536,heads={},kind=csa,topk={}",
            pro.n_heads, pro.index_topk
        );
        assert_eq!(
            geometry_label(&geometry(&csa, "ctx")),
            "DSV4-Pro (kind csa)"
        );
        let hca = format!("batch=4,ctx=65536,heads={},kind=hca,topk=0", flash.n_heads);
        assert_eq!(
            geometry_label(&geometry(&hca, "ctx")),
            "DSV4-Flash (kind hca)"
        );
        assert_eq!(
            geometry_label(&geometry("batch=3,ctx=8,format=fp8,k=2048,next_n=1", "ctx")),
            "K 2048 (format fp8)"
        );
        // Workload sizes and the x column are not geometry; a shape that is not key=value has none.
        assert!(geometry("tokens=1,rows=6,batch=1,ctx=2,bytes=9,next_n=2", "ctx").is_empty());
        assert!(geometry("cuMemcpyDtoDAsync of 2048 MiB", "bytes").is_empty());
    }

    #[test]
    fn series_styles_never_repeat_within_a_plot() {
        for n in [1, 5, 14, 20, 21, 40, 72] {
            let colors: BTreeSet<(u8, u8, u8)> = (0..n)
                .map(|i| {
                    let c = series_color(i, n);
                    (c.0, c.1, c.2)
                })
                .collect();
            assert_eq!(colors.len(), n, "{n} series, distinct colours");
        }
        let markers: Vec<Marker> = (0..MARKERS.len())
            .map(|i| MARKERS[i % MARKERS.len()])
            .collect();
        for (i, a) in markers.iter().enumerate() {
            assert!(!markers[i + 1..].contains(a), "marker {a:?} listed twice");
        }
        assert!(natural_cmp("batch=2", "batch=16").is_lt());
        assert!(natural_cmp("format=fp8", "format=mxfp4").is_lt());
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

/// One bar of a [`plot_timeline`]: a kernel from `start_us` to `end_us`, coloured by its `group`.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineBar {
    pub group: String,
    pub start_us: f64,
    pub end_us: f64,
}

/// The lane of each bar: the first lane whose last bar ended at or before the bar's start, so bars that overlap
/// in time (a PDL kernel starting before its predecessor ends, a second stream) stack in separate lanes. Bars in
/// start order.
pub fn timeline_lanes(bars: &[TimelineBar]) -> Vec<usize> {
    let mut lane_end: Vec<f64> = Vec::new();
    bars.iter()
        .map(|b| match lane_end.iter().position(|&e| e <= b.start_us) {
            Some(l) => {
                lane_end[l] = b.end_us;
                l
            }
            None => {
                lane_end.push(b.end_us);
                lane_end.len() - 1
            }
        })
        .collect()
}

/// A timeline (PNG + SVG, like [`plot_chart`]): each bar a box on a time axis in its lane ([`timeline_lanes`]),
/// one colour per group (legend in the order groups first appear), so the gaps between kernels and their overlaps
/// read at a glance. Errors: no bars, a non-finite time, or a bar ending before it starts.
pub fn plot_timeline(
    path_stem: &Path,
    title: &str,
    bars: &[TimelineBar],
) -> Result<(PathBuf, PathBuf)> {
    ensure!(!bars.is_empty(), "timeline `{title}`: no bars");
    for b in bars {
        ensure!(
            b.start_us.is_finite() && b.end_us.is_finite() && b.end_us >= b.start_us,
            "timeline `{title}`: bar {b:?} is not an interval"
        );
    }
    ensure_font()?;
    let mut groups: Vec<&str> = Vec::new();
    for b in bars {
        if !groups.contains(&b.group.as_str()) {
            groups.push(&b.group);
        }
    }
    let lanes = timeline_lanes(bars);
    let png = with_suffix(path_stem, ".png");
    let svg = with_suffix(path_stem, ".svg");
    if let Some(dir) = png.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).with_context(|| format!("creating directory {}", dir.display()))?;
    }
    let longest = groups.iter().map(|g| g.chars().count()).max().unwrap_or(0);
    let legend_w =
        (LEGEND_SAMPLE as f64 + 40.0 + longest as f64 * LEGEND_CHAR_PX).clamp(160.0, 560.0) as u32;
    let size = (
        1400 + legend_w,
        (PLOT_SIZE.1 / 2).max(90 + (groups.len() as u32 + 2) * LEGEND_ROW),
    );
    let spec = TimelineSpec {
        title,
        bars,
        lanes: &lanes,
        groups: &groups,
        legend_w,
    };
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_timeline(root, &spec).with_context(|| format!("drawing {}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_timeline(root, &spec).with_context(|| format!("drawing {}", svg.display()))?;
    }
    Ok((png, svg))
}

struct TimelineSpec<'a> {
    title: &'a str,
    bars: &'a [TimelineBar],
    lanes: &'a [usize],
    groups: &'a [&'a str],
    legend_w: u32,
}

fn draw_timeline<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, s: &TimelineSpec) -> Result<()> {
    let e = |err: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{err:?}");
    root.fill(&WHITE).map_err(e)?;
    let body = root
        .margin(10, 0, 0, 0)
        .titled(s.title, ("sans-serif", 22))
        .map_err(e)?;
    let (body_w, _) = body.dim_in_pixel();
    let (data_side, legend) = body.split_horizontally(body_w.saturating_sub(s.legend_w));
    let t0 = s
        .bars
        .iter()
        .map(|b| b.start_us)
        .fold(f64::INFINITY, f64::min);
    let t1 = s
        .bars
        .iter()
        .map(|b| b.end_us)
        .fold(f64::NEG_INFINITY, f64::max);
    let lanes = s.lanes.iter().max().map_or(1, |l| l + 1);
    let mut chart = ChartBuilder::on(&data_side)
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d(t0..t1.max(t0 + 1e-3), 0f64..lanes as f64)
        .map_err(e)?;
    let tick = |v: &f64| format_number(*v);
    chart
        .configure_mesh()
        .x_desc("time (us)")
        .y_desc("lane")
        .x_label_formatter(&tick)
        .y_labels(lanes + 1)
        .y_label_formatter(&|v: &f64| format!("{}", *v as usize))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .disable_y_mesh()
        .light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(210, 210, 210))
        .draw()
        .map_err(e)?;
    let n = s.groups.len();
    let color_of = |g: &str| series_color(s.groups.iter().position(|x| *x == g).unwrap_or(0), n);
    chart
        .draw_series(s.bars.iter().zip(s.lanes).map(|(b, &l)| {
            let y = l as f64;
            Rectangle::new(
                [(b.start_us, y + 0.1), (b.end_us, y + 0.9)],
                color_of(&b.group).filled(),
            )
        }))
        .map_err(e)?;
    let font = ("sans-serif", 15).into_font();
    let mut y_at = 56;
    for (i, g) in s.groups.iter().enumerate() {
        legend
            .draw(&Rectangle::new(
                [(8, y_at - 6), (8 + LEGEND_SAMPLE, y_at + 6)],
                series_color(i, n).filled(),
            ))
            .map_err(e)?;
        legend
            .draw(&Text::new(
                g.to_string(),
                (8 + LEGEND_SAMPLE + 8, y_at - 8),
                font.clone(),
            ))
            .map_err(e)?;
        y_at += LEGEND_ROW as i32;
    }
    Ok(())
}
