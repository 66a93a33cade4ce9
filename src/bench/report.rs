//! `REPORT.md` for one GPU's results directory: provenance, the limits measured in the run, and one
//! section per kernel with a table of its rows and its plots.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::csv_out::read_rows;
use super::plot::{format_number, plot_rows_with, shape_pairs, PlotSelection, Target};
use super::row::{fill_speedups, Row, DIMENSION_COLUMNS};

/// One part of a report: a heading, free text, a table of rows and plot files.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReportSection {
    pub title: String,
    /// Markdown shown under the heading (may be empty).
    pub notes: String,
    pub rows: Vec<Row>,
    /// PNG files are embedded as images, anything else (SVG) is linked. Paths inside the report's
    /// directory are written relative to it.
    pub plots: Vec<PathBuf>,
}

/// Table columns in display order, with their headers. A column appears in a section's table only
/// when at least one of its rows has a value there.
const TABLE_COLUMNS: [(&str, &str); 14] = [
    ("rows", "rows"),
    ("cols", "cols"),
    ("tokens", "tokens"),
    ("batch", "batch"),
    ("ctx", "ctx"),
    ("us_median", "median us"),
    ("us_p10", "p10 us"),
    ("us_p90", "p90 us"),
    ("gbps", "GB/s"),
    ("pct_copy_bw", "% copy BW"),
    ("tflops", "TFLOP/s"),
    ("pct_matmul", "% matmul"),
    ("speedup_vs_baseline", "speedup"),
    ("max_abs_err", "max abs err"),
];

/// Write `results_dir_for_gpu/REPORT.md` (creating the directory) and return its path.
pub fn write_report(results_dir_for_gpu: &Path, sections: &[ReportSection]) -> Result<PathBuf> {
    fs::create_dir_all(results_dir_for_gpu)
        .with_context(|| format!("creating {}", results_dir_for_gpu.display()))?;
    let all_rows: Vec<&Row> = sections.iter().flat_map(|s| s.rows.iter()).collect();
    let mut md = String::new();
    md.push_str("# megamoe benchmark report\n\n");
    write_header(&mut md, &all_rows);
    for section in sections {
        write_section(&mut md, section, results_dir_for_gpu)?;
    }
    let path = results_dir_for_gpu.join("REPORT.md");
    fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Which variants the plots of a report draw (the tables and CSVs always hold every variant).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PlotVariants {
    /// Each kernel's `headline` variants (the routed kernel and the baselines its targets name, from
    /// [`crate::bench::kernels::all`]); every variant when the kernel names none or none of its headline
    /// variants is among the rows (e.g. CSVs written before a rename).
    #[default]
    Headline,
    /// Every variant.
    All,
    /// These variants, where a kernel has them (a kernel with none of them gets no plot).
    Only(Vec<String>),
}

impl std::str::FromStr for PlotVariants {
    type Err = anyhow::Error;

    /// `headline`, `all`, or a comma-separated list of variant names.
    fn from_str(s: &str) -> Result<PlotVariants> {
        let s = s.trim();
        Ok(match s {
            "headline" => PlotVariants::Headline,
            "all" => PlotVariants::All,
            _ => {
                let names: Vec<String> = s
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .filter(|v| !v.is_empty())
                    .collect();
                if names.is_empty() {
                    bail!("no variant named: give `headline`, `all` or a comma-separated list");
                }
                PlotVariants::Only(names)
            }
        })
    }
}

/// Build the standard report of a results directory with each kernel's headline plots; see
/// [`report_from_csv_dir_with`].
pub fn report_from_csv_dir(dir: &Path) -> Result<PathBuf> {
    report_from_csv_dir_with(dir, &PlotVariants::Headline)
}

/// Build the report of a results directory: read every `*.csv` in `dir` (file name order), fill
/// speedups, group rows by kernel (order of first appearance), plot `us_median` and, where present,
/// `pct_copy_bw`, `pct_matmul` and `speedup_vs_baseline` against the kernel's sweep axis into
/// `dir/plots/` (the `variants` chosen, one plot per geometry, the kernel's targets as lines), and write
/// `dir/REPORT.md` with every row in its tables. Returns the report's path.
pub fn report_from_csv_dir_with(dir: &Path, variants: &PlotVariants) -> Result<PathBuf> {
    let mut csv_files: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading directory {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "csv"))
        .collect();
    // The engine's CSVs have their own columns; they get their own section below.
    csv_files.retain(|p| {
        !ENGINE_CSVS
            .iter()
            .any(|n| p.file_name().is_some_and(|f| f == *n))
    });
    csv_files.sort();
    if csv_files.is_empty() && !ENGINE_CSVS.iter().any(|n| dir.join(n).exists()) {
        bail!("no *.csv files in {}", dir.display());
    }
    let mut rows = Vec::new();
    for file in &csv_files {
        rows.extend(read_rows(file)?);
    }
    fill_speedups(&mut rows);

    let mut kernels: Vec<String> = Vec::new();
    for row in &rows {
        if !kernels.contains(&row.kernel) {
            kernels.push(row.kernel.clone());
        }
    }
    let registry = crate::bench::kernels::all();
    let plot_dir = dir.join("plots");
    let mut sections = Vec::new();
    for kernel in kernels {
        let mut kernel_rows: Vec<Row> = rows
            .iter()
            .filter(|r| r.kernel == kernel)
            .cloned()
            .collect();
        let known = registry.iter().find(|k| k.name == kernel);
        let headline: &[&str] = known.map(|k| k.headline).unwrap_or(&[]);
        let targets: Vec<Target> = known
            .map(|k| {
                k.targets
                    .iter()
                    .map(|t| Target {
                        metric: t.metric.to_string(),
                        value: t.value,
                        label: t.label.to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let (selection, what) = choose_variants(&kernel_rows, headline, variants);
        let sweeps = sweeps_of(&kernel_rows);
        let mut notes = String::new();
        let mut plots = Vec::new();
        if let Some((first, _)) = sweeps.first() {
            sort_rows_along(&mut kernel_rows, first);
            let axes: Vec<String> = sweeps.iter().map(|(a, _)| format!("`{a}`")).collect();
            let word = if axes.len() == 1 { "axis" } else { "axes" };
            let _ = write!(notes, "Sweep {word}: {}. {what}", axes.join(", "));
        } else {
            notes.push_str("No dimension column varies across these rows, so there is no plot.");
        }
        if let Some(chosen) = selection {
            let selection = PlotSelection {
                variants: chosen,
                targets,
            };
            for (axis, sweep_rows) in &sweeps {
                for y in [
                    "us_median",
                    "pct_copy_bw",
                    "pct_matmul",
                    "speedup_vs_baseline",
                ] {
                    let has_points = sweep_rows.iter().any(|r| {
                        (selection.variants.is_empty() || selection.variants.contains(&r.variant))
                            && matches!((r.numeric(axis), r.numeric(y)), (Ok(Some(_)), Ok(Some(_))))
                    });
                    if has_points {
                        plots.extend(plot_rows_with(
                            &plot_dir, &kernel, axis, y, sweep_rows, &selection,
                        )?);
                    }
                }
            }
        }
        sections.push(ReportSection {
            title: kernel,
            notes,
            rows: kernel_rows,
            plots,
        });
    }
    let path = write_report(dir, &sections)?;
    let engine = engine_section(dir)?;
    if !engine.is_empty() {
        let mut md = fs::read_to_string(&path)?;
        md.push_str(&engine);
        fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(path)
}

/// The CSVs `megamoe decode` writes (one row per point, one per parity step).
const ENGINE_CSVS: [&str; 2] = ["decode.csv", "parity.csv"];

/// The columns of decode.csv and parity.csv shown in the report, with their headings.
const DECODE_COLUMNS: &[(&str, &str)] = &[
    ("model", "model"),
    ("batch", "batch"),
    ("context", "context"),
    ("start_position", "first timed position"),
    ("prompt_len", "prompt"),
    ("ttft_s", "TTFT s"),
    ("tpot_p50_us", "TPOT p50 us"),
    ("tpot_p99_us", "TPOT p99 us"),
    ("tokens_per_s_seq", "tok/s per seq"),
    ("tokens_per_s_total", "tok/s total"),
    ("floor_bytes", "floor bytes"),
    ("pct_copy_bw", "% copy bw"),
    ("kernels_per_step", "kernels/step"),
    ("expert_slots", "expert slots"),
    ("dense_route", "dense route"),
    ("gpu", "gpu"),
    ("git_commit", "commit"),
];

/// The engine's section of REPORT.md: decode.csv's rows as a table (the columns of [`DECODE_COLUMNS`] that the
/// file has), the sweep plots `megamoe decode` drew beside it, and parity.csv's rows; empty when neither file
/// exists.
fn engine_section(dir: &Path) -> Result<String> {
    let mut md = String::new();
    let decode = dir.join("decode.csv");
    if decode.exists() {
        md.push_str("\n## decode: the whole model on the GPU (`megamoe decode`)\n\n");
        md.push_str(
            "One row per point. Rows with no prompt started at the end of the context with synthetic caches \
             (`--at-context`, docs/engine.md): their steps read a full context's bytes. `% copy bw` is the step's \
             byte floor over the median step time, against the copy bandwidth measured in the same run.\n\n",
        );
        md.push_str(&csv_table(&decode, DECODE_COLUMNS)?);
        for name in pngs_named(dir, "decode-")? {
            let _ = writeln!(md, "\n![{name}](<{name}>)");
        }
        // The traced steps (and prefill chunks): about two layers each, as the GPU ran them.
        let timelines = pngs_named(dir, "timeline-")?;
        if !timelines.is_empty() {
            md.push_str(
                "\n### kernel timelines (CUPTI: one traced step or prefill chunk, about two layers of it; the CSV \
                 beside each PNG holds every kernel)\n",
            );
        }
        for name in timelines {
            let _ = writeln!(md, "\n![{name}](<{name}>)");
        }
    }
    let parity = dir.join("parity.csv");
    if parity.exists() {
        md.push_str("\n## decode parity: the GPU against the CPU model fed the GPU's tokens\n\n");
        let header = csv::Reader::from_path(&parity)
            .with_context(|| format!("opening {}", parity.display()))?
            .headers()?
            .clone();
        let columns: Vec<(&str, &str)> = header.iter().map(|h| (h, h)).collect();
        md.push_str(&csv_table(&parity, &columns)?);
    }
    Ok(md)
}

/// The names of the PNG files in `dir` that start with `prefix`, sorted.
fn pngs_named(dir: &Path, prefix: &str) -> Result<Vec<String>> {
    let mut names: Vec<String> = fs::read_dir(dir)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.starts_with(prefix) && f.ends_with(".png"))
        .collect();
    names.sort();
    Ok(names)
}

/// A markdown table of the `columns` (name, heading) of a CSV file that the file has, every row.
fn csv_table(path: &Path, columns: &[(&str, &str)]) -> Result<String> {
    let mut reader =
        csv::Reader::from_path(path).with_context(|| format!("opening {}", path.display()))?;
    let header = reader.headers()?.clone();
    let present: Vec<(usize, &str)> = columns
        .iter()
        .filter_map(|(name, heading)| {
            header
                .iter()
                .position(|h| h == *name)
                .map(|i| (i, *heading))
        })
        .collect();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "| {} |",
        present.iter().map(|p| p.1).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(md, "|{}", "---|".repeat(present.len()));
    for record in reader.records() {
        let record = record.with_context(|| format!("reading {}", path.display()))?;
        let cells: Vec<String> = present
            .iter()
            .map(|(i, _)| {
                let cell = record.get(*i).unwrap_or("");
                match cell.parse::<f64>() {
                    Ok(v) if cell.contains('.') => format_number(v),
                    _ => cell.to_string(),
                }
            })
            .collect();
        let _ = writeln!(md, "| {} |", cells.join(" | "));
    }
    Ok(md)
}

/// The variants a kernel's plots draw (empty: all; `None`: no plot) and a sentence for the report saying
/// which and why.
fn choose_variants(
    rows: &[Row],
    headline: &[&str],
    asked: &PlotVariants,
) -> (Option<Vec<String>>, String) {
    let present: BTreeSet<&str> = rows.iter().map(|r| r.variant.as_str()).collect();
    let others = "every variant is in the table and the CSV; `megamoe report --variants all` plots them all.";
    let quoted = |names: &[String]| -> String {
        names
            .iter()
            .map(|v| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match asked {
        PlotVariants::All => (Some(Vec::new()), "Plots: every variant.".to_string()),
        PlotVariants::Headline => {
            let chosen: Vec<String> = headline
                .iter()
                .filter(|v| present.contains(**v))
                .map(|v| v.to_string())
                .collect();
            if chosen.is_empty() {
                let why = if headline.is_empty() {
                    "the kernel names no headline variants"
                } else {
                    "none of its headline variants is among these rows"
                };
                (Some(Vec::new()), format!("Plots: every variant ({why})."))
            } else if chosen.len() == present.len() {
                (Some(chosen), "Plots: every variant.".to_string())
            } else {
                let names = quoted(&chosen);
                (
                    Some(chosen),
                    format!("Plots: the headline variants {names}; {others}"),
                )
            }
        }
        PlotVariants::Only(list) => {
            let chosen: Vec<String> = list
                .iter()
                .filter(|v| present.contains(v.as_str()))
                .cloned()
                .collect();
            if chosen.is_empty() {
                (
                    None,
                    format!(
                        "No plot: none of the variants asked for ({}) is among these rows.",
                        list.join(", ")
                    ),
                )
            } else {
                let names = quoted(&chosen);
                (
                    Some(chosen),
                    format!("Plots: the variants asked for, {names}."),
                )
            }
        }
    }
}

/// Where one GPU's results live: `results_root/<gpu name without the vendor word "NVIDIA", in lowercase,
/// runs of other characters replaced by one '-'>`, e.g. `results/h200`; `results_root/unknown-gpu` for an
/// empty name.
pub fn results_dir_for_gpu(results_root: &Path, gpu: &str) -> PathBuf {
    let mut name = String::new();
    let gpu = gpu.trim();
    let gpu = match gpu.get(..6) {
        Some(v) if v.eq_ignore_ascii_case("nvidia") => &gpu[6..],
        _ => gpu,
    };
    for c in gpu.trim().chars() {
        if c.is_ascii_alphanumeric() {
            name.push(c.to_ascii_lowercase());
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    let name = name.trim_end_matches('-');
    results_root.join(if name.is_empty() { "unknown-gpu" } else { name })
}

/// The sweeps in a kernel's rows, each an axis and the rows of the lines along it. One CSV often holds
/// several sweeps (a ctx sweep at batch 1 and a batch sweep at one ctx). A line is a variant at one shape
/// apart from the axis, with two or more points along it. The dimension columns that vary among the rows
/// not yet on a line are tried as axes, most distinct values first (as in [`sweep_axis`]); the first
/// whose lines take in some of those rows becomes the next sweep, until every row is on a line or no
/// axis forms a new one. A row may be on the lines of two axes (the corner where two sweeps meet). When
/// no axis forms any line (e.g. shapes that are all different), every row goes along [`sweep_axis`].
pub fn sweeps_of(rows: &[Row]) -> Vec<(&'static str, Vec<Row>)> {
    let mut out: Vec<(&'static str, Vec<Row>)> = Vec::new();
    let mut remaining: Vec<usize> = (0..rows.len()).collect();
    'next_sweep: while !remaining.is_empty() {
        let rest: Vec<Row> = remaining.iter().map(|&i| rows[i].clone()).collect();
        let candidates = axis_candidates(&rest);
        for &axis in &candidates {
            if out.iter().any(|(a, _)| *a == axis) {
                continue;
            }
            let taken = rows_on_lines(rows, axis);
            if taken.iter().any(|i| remaining.contains(i)) {
                remaining.retain(|i| !taken.contains(i));
                out.push((axis, taken.iter().map(|&i| rows[i].clone()).collect()));
                continue 'next_sweep;
            }
        }
        if out.is_empty() {
            if let Some(&axis) = candidates.first() {
                let along: Vec<Row> = rows
                    .iter()
                    .filter(|r| matches!(r.numeric(axis), Ok(Some(_))))
                    .cloned()
                    .collect();
                out.push((axis, along));
            }
        }
        break;
    }
    out
}

/// Indices of the rows on a line along `axis` with two or more points. A line is a variant at one shape
/// apart from the axis key (for shapes that are not `key=value` lists: at one value of each other
/// dimension column).
fn rows_on_lines(rows: &[Row], axis: &str) -> Vec<usize> {
    let line_of = |r: &Row| -> (String, Vec<(String, String)>, Vec<u64>) {
        let pairs = shape_pairs(&r.shape);
        if pairs.is_empty() {
            // No key=value shape: the other dimension columns say where the row sits.
            let dims = DIMENSION_COLUMNS
                .iter()
                .filter(|d| **d != axis && **d != "bytes")
                .map(|d| r.numeric(d).ok().flatten().map_or(u64::MAX, f64::to_bits))
                .collect();
            return (
                r.variant.clone(),
                vec![(String::new(), r.shape.clone())],
                dims,
            );
        }
        // The shape's parameters; dimension columns derived from the axis (tokens = batch x next_n)
        // change along a line, so they do not identify it.
        let shape = pairs.into_iter().filter(|(k, _)| k != axis).collect();
        (r.variant.clone(), shape, Vec::new())
    };
    let x_of = |r: &Row| r.numeric(axis).ok().flatten().map(f64::to_bits);
    let mut lines: BTreeMap<_, BTreeSet<u64>> = BTreeMap::new();
    for r in rows {
        if let Some(x) = x_of(r) {
            lines.entry(line_of(r)).or_default().insert(x);
        }
    }
    (0..rows.len())
        .filter(|&i| {
            x_of(&rows[i]).is_some()
                && lines
                    .get(&line_of(&rows[i]))
                    .is_some_and(|xs| xs.len() >= 2)
        })
        .collect()
}

/// The dimension column a set of rows was swept along: among tokens, rows, batch, ctx and cols, the one
/// with the most distinct values (at least two), ties broken in that order; `bytes` only when none of
/// those varies.
pub fn sweep_axis(rows: &[Row]) -> Option<&'static str> {
    axis_candidates(rows).first().copied()
}

/// The dimension columns that vary among `rows` (at least two values), most distinct values first,
/// ties broken in the order tokens, rows, batch, ctx, cols; `bytes` only when none of those varies.
/// `bytes` comes last because it is usually derived from the real axis (and then has even more
/// distinct values when a second dimension varies too).
fn axis_candidates(rows: &[Row]) -> Vec<&'static str> {
    let mut found: Vec<(&'static str, usize)> = Vec::new();
    for dim in DIMENSION_COLUMNS {
        if dim == "bytes" && !found.is_empty() {
            break;
        }
        let distinct: BTreeSet<u64> = rows
            .iter()
            .filter_map(|r| r.numeric(dim).ok().flatten())
            .map(f64::to_bits)
            .collect();
        if distinct.len() >= 2 {
            found.push((dim, distinct.len()));
        }
    }
    // Stable sort: equal counts keep the column order.
    found.sort_by_key(|f| std::cmp::Reverse(f.1));
    found.into_iter().map(|(dim, _)| dim).collect()
}

/// Order rows by the other dimensions, then the axis, then variant, so tables read as sweeps.
fn sort_rows_along(rows: &mut [Row], axis: &str) {
    let key = |r: &Row| -> Vec<f64> {
        let mut k: Vec<f64> = DIMENSION_COLUMNS
            .iter()
            .filter(|d| **d != axis && **d != "bytes")
            .map(|d| r.numeric(d).ok().flatten().unwrap_or(-1.0))
            .collect();
        k.push(r.numeric(axis).ok().flatten().unwrap_or(-1.0));
        k
    };
    rows.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        ka.iter()
            .zip(&kb)
            .map(|(x, y)| x.total_cmp(y))
            .find(|o| o.is_ne())
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| a.variant.cmp(&b.variant))
    });
}

fn write_header(md: &mut String, rows: &[&Row]) {
    let distinct = |f: &dyn Fn(&Row) -> &str| -> String {
        let set: BTreeSet<&str> = rows
            .iter()
            .map(|r| f(r))
            .filter(|s| !s.is_empty())
            .collect();
        if set.is_empty() {
            "unknown".to_string()
        } else {
            set.into_iter().collect::<Vec<_>>().join(", ")
        }
    };
    let stamps: BTreeSet<&str> = rows
        .iter()
        .map(|r| r.timestamp.as_str())
        .filter(|s| !s.is_empty())
        .collect();
    let date = match (stamps.first(), stamps.last()) {
        (Some(a), Some(b)) if a == b => a.to_string(),
        (Some(a), Some(b)) => format!("{a} to {b}"),
        _ => "unknown".to_string(),
    };
    md.push_str("| | |\n|---|---|\n");
    let _ = writeln!(md, "| GPU | {} |", escape(&distinct(&|r| r.gpu.as_str())));
    let _ = writeln!(
        md,
        "| git commit | {} |",
        escape(&distinct(&|r| r.git_commit.as_str()))
    );
    let _ = writeln!(md, "| date (UTC) | {date} |");
    let _ = writeln!(md, "| rows | {} |", rows.len());
    for (column, label) in [
        ("sm_clock_mhz", "SM clock (MHz)"),
        ("mem_clock_mhz", "memory clock (MHz)"),
        ("power_w", "power (W)"),
        ("temp_c", "temperature (C)"),
    ] {
        let _ = writeln!(md, "| {label} | {} |", value_range(rows, column));
    }
    md.push_str("\n## Limits measured in this run\n\n");
    md.push_str("Every row is divided by the limits measured in the same run; the range over all rows is shown.\n\n");
    md.push_str("| limit | measured |\n|---|---|\n");
    for (column, label) in [
        ("copy_bw_gbps", "HBM copy bandwidth (GB/s, read + write)"),
        ("bf16_tflops", "BF16 dense matmul (TFLOP/s)"),
        ("fp8_tflops", "FP8 dense matmul (TFLOP/s)"),
    ] {
        let _ = writeln!(md, "| {label} | {} |", value_range(rows, column));
    }
    md.push('\n');
}

/// `v` when all rows agree, `min – max` otherwise, `not measured` when no row has a value.
fn value_range(rows: &[&Row], column: &str) -> String {
    let values: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.numeric(column).ok().flatten())
        .collect();
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.is_empty() {
        "not measured".to_string()
    } else if min == max {
        format_number(min)
    } else {
        format!("{} – {}", format_number(min), format_number(max))
    }
}

fn write_section(md: &mut String, section: &ReportSection, report_dir: &Path) -> Result<()> {
    let _ = writeln!(md, "## {}\n", section.title);
    if !section.notes.is_empty() {
        let _ = writeln!(md, "{}\n", section.notes.trim_end());
    }
    if section.rows.is_empty() {
        md.push_str("(no rows)\n\n");
    } else {
        write_table(md, &section.rows)?;
    }
    for plot in &section.plots {
        let link = link_path(plot, report_dir);
        let name = plot
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if plot.extension().is_some_and(|e| e == "png") {
            let _ = writeln!(md, "![{name}](<{link}>)\n");
        } else {
            let _ = writeln!(md, "[{name}](<{link}>)\n");
        }
    }
    Ok(())
}

fn write_table(md: &mut String, rows: &[Row]) -> Result<()> {
    let mut columns: Vec<(&str, &str)> = Vec::new();
    for (column, header) in TABLE_COLUMNS {
        let mut any = false;
        for row in rows {
            any |= row.numeric(column)?.is_some();
        }
        if any {
            columns.push((column, header));
        }
    }
    let show_baseline = rows.iter().any(|r| r.baseline.is_some());
    md.push_str("| variant | shape |");
    if show_baseline {
        md.push_str(" baseline |");
    }
    for (_, header) in &columns {
        let _ = write!(md, " {header} |");
    }
    md.push_str("\n|---|---|");
    if show_baseline {
        md.push_str("---|");
    }
    for _ in &columns {
        md.push_str("---:|");
    }
    md.push('\n');
    for row in rows {
        let _ = write!(md, "| {} | {} |", escape(&row.variant), escape(&row.shape));
        if show_baseline {
            let _ = write!(md, " {} |", escape(row.baseline.as_deref().unwrap_or("")));
        }
        for (column, _) in &columns {
            let cell = match row.numeric(column)? {
                None => String::new(),
                // Errors span many decades; scientific notation keeps them comparable.
                Some(v) if *column == "max_abs_err" => format!("{v:.2e}"),
                Some(v) => format_number(v),
            };
            let _ = write!(md, " {cell} |");
        }
        md.push('\n');
    }
    md.push('\n');
    Ok(())
}

/// Path of `plot` as written in the report: relative to `report_dir` when inside it, else as given.
fn link_path(plot: &Path, report_dir: &Path) -> String {
    let shown = plot.strip_prefix(report_dir).unwrap_or(plot);
    shown.to_string_lossy().replace('\\', "/")
}

/// Keep user text from breaking a table row.
fn escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(variant: &str, rows: u64, cols: u64) -> Row {
        let mut r = Row::empty("k", variant, &format!("rows={rows},cols={cols}"));
        r.rows = Some(rows);
        r.cols = Some(cols);
        r
    }

    #[test]
    fn axis_is_the_most_varied_dimension() {
        let rows: Vec<Row> = [1, 64, 4096]
            .iter()
            .flat_map(|&m| [row("a", m, 4096), row("a", m, 7168)])
            .collect();
        assert_eq!(sweep_axis(&rows), Some("rows"));
        assert_eq!(sweep_axis(&rows[..1]), None);
        // Equal counts: the earlier column in DIMENSION_COLUMNS wins (rows before cols).
        assert_eq!(
            sweep_axis(&[row("a", 1, 16), row("a", 2, 32)]),
            Some("rows")
        );
        // `bytes` follows rows x cols and so has more distinct values, but the parameter wins.
        let with_bytes: Vec<Row> = rows
            .iter()
            .cloned()
            .map(|mut r| {
                r.bytes = Some(r.rows.unwrap() * r.cols.unwrap());
                r
            })
            .collect();
        assert_eq!(sweep_axis(&with_bytes), Some("rows"));
        let mut copies = vec![
            Row::empty("copy", "d2d", "1"),
            Row::empty("copy", "d2d", "2"),
        ];
        copies[0].bytes = Some(1);
        copies[1].bytes = Some(2);
        assert_eq!(sweep_axis(&copies), Some("bytes"));
    }

    #[test]
    fn rows_sorted_by_other_dims_then_axis_then_variant() {
        let mut rows = vec![
            row("b", 64, 7168),
            row("a", 64, 4096),
            row("b", 1, 4096),
            row("a", 1, 4096),
        ];
        sort_rows_along(&mut rows, "rows");
        let got: Vec<(String, u64, u64)> = rows
            .iter()
            .map(|r| (r.variant.clone(), r.rows.unwrap(), r.cols.unwrap()))
            .collect();
        let want = [
            ("a", 1, 4096),
            ("b", 1, 4096),
            ("a", 64, 4096),
            ("b", 64, 7168),
        ];
        let want: Vec<(String, u64, u64)> = want
            .iter()
            .map(|(v, m, n)| (v.to_string(), *m, *n))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn plot_variants_follow_the_headline_with_fallbacks() {
        let rows = vec![
            row("routed", 1, 8),
            row("baseline", 1, 8),
            row("loser", 1, 8),
        ];
        let (chosen, note) =
            choose_variants(&rows, &["routed", "baseline"], &PlotVariants::Headline);
        assert_eq!(
            chosen,
            Some(vec!["routed".to_string(), "baseline".to_string()])
        );
        assert!(note.contains("--variants all"), "{note}");
        // Old CSVs whose names match no headline variant, or a kernel without a headline: all variants.
        let (chosen, note) = choose_variants(&rows, &["renamed"], &PlotVariants::Headline);
        assert_eq!(chosen, Some(Vec::new()));
        assert!(note.contains("none of its headline variants"), "{note}");
        assert_eq!(
            choose_variants(&rows, &[], &PlotVariants::Headline).0,
            Some(Vec::new())
        );
        assert_eq!(
            choose_variants(&rows, &["routed"], &PlotVariants::All).0,
            Some(Vec::new())
        );
        let only: PlotVariants = "loser, nope".parse().unwrap();
        assert_eq!(
            only,
            PlotVariants::Only(vec!["loser".into(), "nope".into()])
        );
        assert_eq!(
            choose_variants(&rows, &["routed"], &only).0,
            Some(vec!["loser".to_string()])
        );
        let none: PlotVariants = "nope".parse().unwrap();
        assert_eq!(choose_variants(&rows, &[], &none).0, None);
        assert_eq!("all".parse::<PlotVariants>().unwrap(), PlotVariants::All);
        assert_eq!(
            "headline".parse::<PlotVariants>().unwrap(),
            PlotVariants::Headline
        );
        assert!(" , ".parse::<PlotVariants>().is_err());
    }

    #[test]
    fn one_csv_with_two_sweeps_gives_two_axes() {
        // A ctx sweep at batch 1 and a batch sweep at ctx 65536 (tokens derived from batch).
        let point = |variant: &str, batch: u64, ctx: u64| {
            let mut r = Row::empty("idx", variant, &format!("batch={batch},ctx={ctx},k=512"));
            r.batch = Some(batch);
            r.ctx = Some(ctx);
            r.tokens = Some(batch);
            r
        };
        let mut rows = Vec::new();
        for v in ["a", "b"] {
            for ctx in [4096, 16384, 65536, 262144, 1048576] {
                rows.push(point(v, 1, ctx));
            }
            for batch in [2, 4, 8] {
                rows.push(point(v, batch, 65536));
            }
        }
        let sweeps = sweeps_of(&rows);
        let axes: Vec<&str> = sweeps.iter().map(|(a, _)| *a).collect();
        assert_eq!(axes, ["ctx", "batch"]);
        assert_eq!(sweeps[0].1.len(), 10, "the ctx lines at batch 1");
        // The batch lines include the corner (batch 1, ctx 65536) shared with the ctx sweep.
        assert_eq!(sweeps[1].1.len(), 8);
        assert!(sweeps[1].1.iter().all(|r| r.ctx == Some(65536)));
        // One sweep only: one axis, every row.
        let single: Vec<Row> = rows
            .iter()
            .filter(|r| r.batch == Some(1))
            .cloned()
            .collect();
        let sweeps = sweeps_of(&single);
        assert_eq!(sweeps.len(), 1);
        assert_eq!(sweeps[0].1.len(), single.len());
        assert!(sweeps_of(&rows[..1]).is_empty());
    }

    #[test]
    fn gpu_directory_names() {
        let root = Path::new("results");
        assert_eq!(results_dir_for_gpu(root, "NVIDIA H200"), root.join("h200"));
        assert_eq!(
            results_dir_for_gpu(root, " NVIDIA H100 80GB HBM3 (PCIe) "),
            root.join("h100-80gb-hbm3-pcie")
        );
        assert_eq!(results_dir_for_gpu(root, ""), root.join("unknown-gpu"));
    }

    #[test]
    fn links_are_relative_inside_the_report_dir() {
        let dir = Path::new("/r/h200");
        assert_eq!(
            link_path(Path::new("/r/h200/plots/a.png"), dir),
            "plots/a.png"
        );
        assert_eq!(
            link_path(Path::new("/elsewhere/a.png"), dir),
            "/elsewhere/a.png"
        );
    }
}
