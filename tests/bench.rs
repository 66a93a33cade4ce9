//! Public-API tests of the measurement harness (`megamoe::bench`): CSV round trip, plots, report,
//! sweep configs. No GPU involved: timing samples are made up on the CPU.

use std::fs;
use std::path::{Path, PathBuf};

use megamoe::bench::config::{default_config, SweepConfig};
use megamoe::bench::csv_out::{append_rows, read_rows, write_rows};
use megamoe::bench::plot::{
    plot_rows, plot_rows_with, plot_series, plot_timeline, timeline_lanes, PlotSelection, Series,
    Target, TimelineBar,
};
use megamoe::bench::report::{report_from_csv_dir, write_report, ReportSection};
use megamoe::bench::{fill_speedups, Limits, MatmulKind, Row, Summary, Telemetry};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "megamoe-bench-{name}-{}-{nanos}",
            std::process::id()
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn seeded_rng() -> ChaCha8Rng {
    let seed = rand::rng().random::<u64>();
    println!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn limits() -> Limits {
    Limits {
        copy_bw_gbps: 4300.0,
        bf16_tflops: Some(780.0),
        fp8_tflops: Some(1450.0),
    }
}

fn telemetry() -> Telemetry {
    Telemetry {
        gpu: "NVIDIA H200".into(),
        sm_clock_mhz: Some(1980),
        mem_clock_mhz: Some(3201),
        power_w: Some(402.25),
        temp_c: Some(44),
    }
}

/// A realistic row for `variant` at `rows` x `cols`, timed from random samples.
fn measured_row(rng: &mut ChaCha8Rng, kernel: &str, variant: &str, rows: u64, cols: u64) -> Row {
    let base_us = 2.0 + rows as f64 * cols as f64 / 2e6;
    let samples: Vec<f64> = (0..20)
        .map(|_| base_us * rng.random_range(0.9..1.3))
        .collect();
    let summary = Summary::of(&samples).unwrap();
    let bytes = rows * cols * 2 + rows * cols / 2;
    Row::new(kernel, variant, &format!("rows={rows},cols={cols}"))
        .with_rows(rows)
        .with_cols(cols)
        .with_timing(&summary, samples.len() as u64)
        .with_work(Some(bytes), Some(rows * cols * 4))
        .with_limits(&limits(), MatmulKind::NotMatmul)
        .with_telemetry(&telemetry())
        .with_baseline("unfused")
        .with_errors(rng.random_range(0.0..1e-3), rng.random_range(0.0..1e-2))
}

fn sweep_rows(rng: &mut ChaCha8Rng) -> Vec<Row> {
    let mut rows = Vec::new();
    for cols in [4096, 7168] {
        for m in [1u64, 3, 129, 4096, 65536] {
            for variant in ["fused", "unfused"] {
                rows.push(measured_row(rng, "nvfp4_quantize_rows", variant, m, cols));
            }
        }
    }
    fill_speedups(&mut rows);
    rows
}

#[test]
fn row_pipeline_fills_derived_columns() {
    let mut rng = seeded_rng();
    let rows = sweep_rows(&mut rng);
    for row in &rows {
        let us = row.us_median.unwrap();
        let gbps = row.bytes.unwrap() as f64 / us / 1e3;
        assert!((row.gbps.unwrap() - gbps).abs() <= 1e-12 * gbps);
        let pct = gbps / 4300.0 * 100.0;
        assert!((row.pct_copy_bw.unwrap() - pct).abs() <= 1e-12 * pct);
        assert_eq!(row.pct_matmul, None, "NotMatmul leaves pct_matmul empty");
        assert!(row.us_p10.unwrap() <= us && us <= row.us_p90.unwrap());
        assert_eq!(row.gpu, "NVIDIA H200");
        assert!(!row.git_commit.is_empty() && row.timestamp.ends_with('Z'));
        // Speedup = baseline median / own median, baseline found by kernel + shape.
        let base = rows
            .iter()
            .find(|b| b.variant == "unfused" && b.shape == row.shape)
            .unwrap();
        assert_eq!(row.speedup_vs_baseline, Some(base.us_median.unwrap() / us));
    }
}

#[test]
fn csv_round_trip_and_append() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("csv");
    let rows = sweep_rows(&mut rng);
    let mut sparse = Row::empty("copy", "d2d", "bytes=1048576");
    sparse.bytes = Some(2 << 20);
    sparse.shape = "needs \"quoting\", really".into();
    let path = dir.path().join("nested/dir/quant.csv");

    write_rows(&path, &rows[..7]).unwrap();
    append_rows(&path, &rows[7..]).unwrap();
    append_rows(&path, std::slice::from_ref(&sparse)).unwrap();
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(
        text.matches("kernel,variant,shape").count(),
        1,
        "header written once"
    );
    assert_eq!(text.lines().count(), 1 + rows.len() + 1);

    let back = read_rows(&path).unwrap();
    let mut want = rows.clone();
    want.push(sparse);
    assert_eq!(
        back, want,
        "every field, floats bit for bit, None as empty cells"
    );

    // Appending to a missing file creates it with a header; an empty write still has the header.
    let fresh = dir.path().join("fresh.csv");
    append_rows(&fresh, &rows[..1]).unwrap();
    assert_eq!(read_rows(&fresh).unwrap(), rows[..1].to_vec());
    let empty = dir.path().join("empty.csv");
    write_rows(&empty, &[]).unwrap();
    assert_eq!(read_rows(&empty).unwrap(), vec![]);
}

#[test]
fn csv_errors_name_the_problem() {
    let dir = TempDir::new("csv-err");
    let foreign = dir.path().join("foreign.csv");
    fs::write(&foreign, "a,b\n1,2\n").unwrap();
    let err = format!("{:#}", read_rows(&foreign).unwrap_err());
    assert!(
        err.contains("does not have the megamoe row header"),
        "{err}"
    );
    let err = format!(
        "{:#}",
        append_rows(&foreign, &[Row::empty("k", "v", "s")]).unwrap_err()
    );
    assert!(err.contains("header"), "{err}");

    let bad = dir.path().join("bad.csv");
    write_rows(&bad, &[Row::empty("k", "v", "s")]).unwrap();
    let mut text = fs::read_to_string(&bad).unwrap();
    text.push_str("k,v,s,notanumber,,,,,,,,,,,,,,,,,,,,,,,,,,,,\n");
    fs::write(&bad, text).unwrap();
    let err = format!("{:#}", read_rows(&bad).unwrap_err());
    assert!(err.contains("line 3"), "{err}");

    let err = format!(
        "{:#}",
        read_rows(&dir.path().join("missing.csv")).unwrap_err()
    );
    assert!(err.contains("missing.csv"), "{err}");
}

fn assert_png_and_svg(png: &Path, svg: &Path) {
    let png_bytes = fs::read(png).unwrap();
    assert!(
        png_bytes.len() > 1000,
        "{} is {} bytes",
        png.display(),
        png_bytes.len()
    );
    assert_eq!(
        &png_bytes[..8],
        b"\x89PNG\r\n\x1a\n",
        "PNG signature of {}",
        png.display()
    );
    let svg_text = fs::read_to_string(svg).unwrap();
    assert!(
        svg_text.contains("<svg") && svg_text.trim_end().ends_with("</svg>"),
        "{}",
        svg.display()
    );
}

#[test]
fn plot_series_writes_png_and_svg_on_every_axis_kind() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("plot");
    let series: Vec<Series> = ["fused", "unfused"]
        .iter()
        .map(|name| Series {
            name: name.to_string(),
            points: (0..12)
                .map(|i| ((1u64 << (2 * i)) as f64, rng.random_range(1.0..5000.0)))
                .collect(),
        })
        .collect();
    for (log_x, log_y) in [(false, false), (true, false), (false, true), (true, true)] {
        let stem = dir.path().join(format!("sub/plot.lx{log_x}.ly{log_y}"));
        let (png, svg) = plot_series(
            &stem,
            "quantize",
            "rows",
            "median time (us)",
            &series,
            log_x,
            log_y,
        )
        .unwrap();
        assert_eq!(
            png,
            dir.path().join(format!("sub/plot.lx{log_x}.ly{log_y}.png"))
        );
        assert_png_and_svg(&png, &svg);
        let svg_text = fs::read_to_string(&svg).unwrap();
        assert!(svg_text.contains("unfused"), "legend text is in the SVG");
    }
    // A point at 0 cannot go on a log axis.
    let zero = [Series {
        name: "z".into(),
        points: vec![(0.0, 1.0), (1.0, 2.0)],
    }];
    let err = plot_series(&dir.path().join("z"), "t", "x", "y", &zero, true, false).unwrap_err();
    assert!(format!("{err:#}").contains("logarithmic"), "{err:#}");
}

/// A kernel timeline: overlapping bars (a PDL kernel that starts before its predecessor ends) take a second lane,
/// a bar that starts when or after a lane's last bar ends reuses it; the plot names every group in its legend;
/// empty and inverted bars are refused.
#[test]
fn timeline_stacks_overlaps_in_lanes_and_plots_every_group() {
    let bar = |g: &str, a: f64, b: f64| TimelineBar {
        group: g.into(),
        start_us: a,
        end_us: b,
    };
    let bars = [
        bar("dense", 0.0, 10.0),
        bar("qkv_prep", 9.0, 12.0), // starts inside the GEMV: lane 1
        bar("dense", 10.0, 20.0),   // starts when the first ends: lane 0 again
        bar("mhc", 11.0, 11.5),     // lane 0 busy until 20, lane 1 until 12: a third lane
        bar("mhc", 12.0, 13.0),     // lane 1 is free at 12
    ];
    assert_eq!(timeline_lanes(&bars), vec![0, 1, 0, 2, 1]);
    let dir = TempDir::new("timeline");
    let (png, svg) = plot_timeline(&dir.path().join("t"), "one layer", &bars).unwrap();
    assert_png_and_svg(&png, &svg);
    let texts = svg_texts(&fs::read_to_string(&svg).unwrap());
    for g in ["dense", "qkv_prep", "mhc"] {
        assert!(texts.iter().any(|t| t == g), "legend lacks {g}: {texts:?}");
    }
    assert!(plot_timeline(&dir.path().join("e"), "empty", &[]).is_err());
    let err = plot_timeline(&dir.path().join("b"), "bad", &[bar("x", 2.0, 1.0)]).unwrap_err();
    assert!(format!("{err:#}").contains("not an interval"), "{err:#}");
}

/// The text of every `<text>` element of an SVG, trimmed and unescaped.
fn svg_texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| {
            let body = &t[t.find('>')? + 1..];
            let text = body[..body.find("</text>")?].trim();
            Some(
                text.replace("&lt;", "<")
                    .replace("&gt;", ">")
                    .replace("&quot;", "\"")
                    .replace("&amp;", "&"),
            )
        })
        .collect()
}

#[test]
fn plot_rows_one_plot_per_geometry_one_line_per_variant() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("plot-rows");
    let rows = sweep_rows(&mut rng);
    let files = plot_rows(
        dir.path(),
        "nvfp4_quantize_rows",
        "rows",
        "us_median",
        &rows,
    )
    .unwrap();
    // cols is the hidden size: 4096 is DeepSeek-V4 Flash's, 7168 Pro's; one plot (png + svg) each.
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "nvfp4_quantize_rows__us_median_vs_rows__dsv4-flash.png",
            "nvfp4_quantize_rows__us_median_vs_rows__dsv4-flash.svg",
            "nvfp4_quantize_rows__us_median_vs_rows__dsv4-pro.png",
            "nvfp4_quantize_rows__us_median_vs_rows__dsv4-pro.svg",
        ]
    );
    for pair in files.chunks(2) {
        assert_png_and_svg(&pair[0], &pair[1]);
        let texts = svg_texts(&fs::read_to_string(&pair[1]).unwrap());
        for name in ["fused", "unfused"] {
            assert!(
                texts.iter().any(|t| t == name),
                "legend entry {name} in {texts:?}"
            );
        }
        assert!(
            !texts.iter().any(|t| t.contains("cols=")),
            "one geometry per plot: no line split by cols"
        );
    }
    let flash = svg_texts(&fs::read_to_string(&files[1]).unwrap());
    let title = "nvfp4_quantize_rows, DSV4-Flash: median time (us) vs rows (NVIDIA H200)";
    assert!(flash.iter().any(|t| t == title), "{flash:?}");

    // Rows of one variant at the same x that differ in a workload size (batch) become separate lines.
    let mut split = Vec::new();
    for batch in [1u64, 16] {
        for ctx in [4096u64, 65536] {
            let mut r = Row::new("attn", "fp8", &format!("batch={batch},ctx={ctx},heads=64"))
                .with_timing(&Summary::of(&[10.0 + batch as f64]).unwrap(), 1);
            r.batch = Some(batch);
            r.ctx = Some(ctx);
            split.push(r);
        }
    }
    let files = plot_rows(dir.path(), "attn", "ctx", "us_median", &split).unwrap();
    assert_eq!(files.len(), 2);
    assert!(files[0].ends_with("attn__us_median_vs_ctx__dsv4-flash.png"));
    let texts = svg_texts(&fs::read_to_string(&files[1]).unwrap());
    for name in ["fp8 (batch=1)", "fp8 (batch=16)"] {
        assert!(
            texts.iter().any(|t| t == name),
            "legend entry {name} in {texts:?}"
        );
    }

    let err = plot_rows(dir.path(), "nvfp4_quantize_rows", "rows", "nonsense", &rows).unwrap_err();
    assert!(err.to_string().contains("not a numeric column"), "{err}");
    let err = plot_rows(dir.path(), "no_such_kernel", "rows", "us_median", &rows).unwrap_err();
    assert!(err.to_string().contains("no_such_kernel"), "{err}");
}

#[test]
fn default_plot_draws_only_the_selected_variants_and_the_target_line() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("plot-headline");
    let rows = sweep_rows(&mut rng);
    let target_label = "target: >= 80% of copy BW";
    let selection = PlotSelection {
        variants: vec!["fused".to_string()],
        targets: vec![Target {
            metric: "pct_copy_bw".into(),
            value: 80.0,
            label: target_label.into(),
        }],
    };
    let files = plot_rows_with(
        dir.path(),
        "nvfp4_quantize_rows",
        "rows",
        "pct_copy_bw",
        &rows,
        &selection,
    )
    .unwrap();
    assert_eq!(files.len(), 4, "two geometries, png + svg each");
    for pair in files.chunks(2) {
        assert_png_and_svg(&pair[0], &pair[1]);
        let texts = svg_texts(&fs::read_to_string(&pair[1]).unwrap());
        assert!(
            texts.iter().any(|t| t == "fused"),
            "the headline variant is drawn"
        );
        assert!(
            !texts.iter().any(|t| t == "unfused"),
            "a variant outside the headline is not"
        );
        // The label appears twice: on the line and in the legend.
        assert_eq!(
            texts.iter().filter(|t| *t == target_label).count(),
            2,
            "target line label in {texts:?}"
        );
    }
    // A target goes on the plots of its metric only.
    let files = plot_rows_with(
        dir.path(),
        "nvfp4_quantize_rows",
        "rows",
        "us_median",
        &rows,
        &selection,
    )
    .unwrap();
    let texts = svg_texts(&fs::read_to_string(&files[1]).unwrap());
    assert!(!texts.iter().any(|t| t == target_label), "{texts:?}");
    // Asking for a variant the rows do not have is an error naming the ones present.
    let missing = PlotSelection {
        variants: vec!["nope".into()],
        targets: Vec::new(),
    };
    let err = plot_rows_with(
        dir.path(),
        "nvfp4_quantize_rows",
        "rows",
        "us_median",
        &rows,
        &missing,
    )
    .unwrap_err();
    assert!(err.to_string().contains("fused, unfused"), "{err}");
}

#[test]
fn report_from_csv_dir_writes_tables_and_plots() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("report");
    let quant = sweep_rows(&mut rng);
    let copies: Vec<Row> = [1u64 << 20, 1 << 26, 1 << 30]
        .iter()
        .map(|&b| {
            let us = b as f64 * 2.0 / 4.0e6 * rng.random_range(1.0..1.1);
            Row::new("copy", "d2d", &format!("bytes={b}"))
                .with_timing(&Summary::of(&[us]).unwrap(), 1)
                .with_work(Some(2 * b), None)
                .with_limits(&limits(), MatmulKind::NotMatmul)
                .with_telemetry(&telemetry())
        })
        .collect();
    write_rows(&dir.path().join("a_quant.csv"), &quant).unwrap();
    write_rows(&dir.path().join("b_copy.csv"), &copies).unwrap();
    fs::write(dir.path().join("notes.txt"), "not a csv").unwrap();

    let report = report_from_csv_dir(dir.path()).unwrap();
    assert_eq!(report, dir.path().join("REPORT.md"));
    let md = fs::read_to_string(&report).unwrap();
    assert!(md.contains("| GPU | NVIDIA H200 |"), "{md}");
    assert!(
        md.contains("| HBM copy bandwidth (GB/s, read + write) | 4300 |"),
        "{md}"
    );
    assert!(
        md.contains("## nvfp4_quantize_rows") && md.contains("## copy"),
        "{md}"
    );
    assert!(
        md.contains("Sweep axis: `rows`") && md.contains("Sweep axis: `bytes`"),
        "{md}"
    );
    // One table line per row.
    assert_eq!(
        md.lines()
            .filter(|l| l.starts_with("| fused |") || l.starts_with("| unfused |"))
            .count(),
        quant.len()
    );
    assert_eq!(
        md.lines().filter(|l| l.starts_with("| d2d |")).count(),
        copies.len()
    );
    for plot in [
        "plots/nvfp4_quantize_rows__us_median_vs_rows__dsv4-flash.png",
        "plots/nvfp4_quantize_rows__pct_copy_bw_vs_rows__dsv4-pro.svg",
        "plots/nvfp4_quantize_rows__speedup_vs_baseline_vs_rows__dsv4-flash.png",
        "plots/copy__us_median_vs_bytes.png",
    ] {
        assert!(
            md.contains(&format!("(<{plot}>)")),
            "link to {plot} in\n{md}"
        );
        assert!(
            dir.path().join(plot).metadata().unwrap().len() > 0,
            "{plot} written"
        );
    }
    assert!(
        !md.contains("pct_matmul_vs"),
        "no matmul plot when no row has pct_matmul"
    );

    let empty = TempDir::new("report-empty");
    let err = report_from_csv_dir(empty.path()).unwrap_err();
    assert!(err.to_string().contains("no *.csv"), "{err}");
}

#[test]
fn report_gives_the_engine_csvs_their_own_section() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("report-engine");
    write_rows(&dir.path().join("a_quant.csv"), &sweep_rows(&mut rng)).unwrap();
    // decode.csv and parity.csv have their own columns (a subset of decode.csv's here, and a column the
    // report does not show), so the bench rows' header check must not see them.
    fs::write(
        dir.path().join("decode.csv"),
        "model,batch,context,tpot_p50_us,tokens_per_s_total,pct_copy_bw,extra\n\
         flash,1,4096,3412.5,293.04,81.25,x\n\
         flash,64,4096,9876.0,6480.2,55.5,y\n",
    )
    .unwrap();
    fs::write(dir.path().join("parity.csv"), "step,cosine\n0,0.9991\n").unwrap();
    let md = fs::read_to_string(report_from_csv_dir(dir.path()).unwrap()).unwrap();
    assert!(md.contains("## nvfp4_quantize_rows"), "{md}");
    assert!(md.contains("## decode: the whole model on the GPU"), "{md}");
    assert!(
        md.contains("| model | batch | context | TPOT p50 us | tok/s total | % copy bw |"),
        "{md}"
    );
    assert_eq!(md.lines().filter(|l| l.starts_with("| flash |")).count(), 2);
    assert!(
        !md.contains("| x |"),
        "unlisted columns are not shown:\n{md}"
    );
    assert!(
        md.contains("| step | cosine |") && md.contains("| 0 | 0.9991 |"),
        "{md}"
    );

    // A traced step's timeline beside decode.csv is shown under its own heading; without one, no heading.
    assert!(!md.contains("kernel timelines"), "{md}");
    let bar = |g: &str, a: f64, b: f64| TimelineBar {
        group: g.into(),
        start_us: a,
        end_us: b,
    };
    plot_timeline(
        &dir.path().join("timeline-b1-c4096"),
        "step",
        &[bar("dense", 0.0, 2.0), bar("mhc", 2.5, 3.0)],
    )
    .unwrap();
    let md = fs::read_to_string(report_from_csv_dir(dir.path()).unwrap()).unwrap();
    assert!(
        md.contains("### kernel timelines")
            && md.contains("![timeline-b1-c4096.png](<timeline-b1-c4096.png>)"),
        "{md}"
    );

    // The engine's CSVs alone make a report too.
    let only = TempDir::new("report-engine-only");
    fs::copy(
        dir.path().join("decode.csv"),
        only.path().join("decode.csv"),
    )
    .unwrap();
    let md = fs::read_to_string(report_from_csv_dir(only.path()).unwrap()).unwrap();
    assert!(md.contains("## decode: the whole model"), "{md}");
}

#[test]
fn write_report_with_hand_made_sections() {
    let mut rng = seeded_rng();
    let dir = TempDir::new("report-hand");
    let rows = sweep_rows(&mut rng);
    let outside = PathBuf::from("/somewhere/else.svg");
    let section = ReportSection {
        title: "NVFP4 quantize".into(),
        notes: "Fused vs unfused.".into(),
        rows: rows.clone(),
        plots: vec![dir.path().join("plots/q.png"), outside],
    };
    let report = write_report(dir.path(), &[section]).unwrap();
    let md = fs::read_to_string(report).unwrap();
    assert!(
        md.contains("## NVFP4 quantize\n\nFused vs unfused.\n"),
        "{md}"
    );
    assert!(md.contains("![q.png](<plots/q.png>)"), "{md}");
    assert!(md.contains("[else.svg](</somewhere/else.svg>)"), "{md}");
    assert!(
        md.contains("| variant | shape | baseline | rows | cols | median us |"),
        "{md}"
    );
    assert!(!md.contains("| tokens |"), "empty columns are left out");
}

/// The main job's suite: the copy denominator first, then a point of every kernel family at DSV4-Flash shapes
/// (hidden 4096, 256 experts, 64 heads), each racing the baseline its target is stated against.
#[test]
fn default_config_covers_every_family_at_flash_shapes() {
    let config = default_config().unwrap();
    let kernels: Vec<&str> = config.sweeps.iter().map(|s| s.kernel.as_str()).collect();
    for k in [
        "copy",
        "rmsnorm_quant",
        "mhc",
        "moe_gemm_l1",
        "moe_gemm_l2",
        "sparse_attn_decode",
        "indexer",
    ] {
        assert!(kernels.contains(&k), "{k} in the default suite");
    }
    let copy = &config.sweeps[0];
    assert_eq!(
        (copy.kernel.as_str(), copy.axis.as_str()),
        ("copy", "bytes")
    );
    for s in &config.sweeps {
        for (param, flash) in [
            ("d", 4096),
            ("hidden", 4096),
            ("experts", 256),
            ("heads", 64),
        ] {
            if s.has_param(param) {
                assert_eq!(s.param_u64(param).unwrap(), flash, "{}: {param}", s.kernel);
            }
        }
    }
    let registry = megamoe::bench::kernels::all();
    megamoe::bench::runner::plan(&config, &registry, &[]).unwrap();
    for s in config.sweeps.iter().filter(|s| s.kernel != "copy") {
        let k = registry.iter().find(|k| k.name == s.kernel).unwrap();
        let variants = s
            .variants
            .as_ref()
            .expect("default sweeps name their variants");
        assert!(
            k.headline.iter().any(|h| variants.iter().any(|v| v == h)),
            "{}: the default suite runs a headline variant",
            s.kernel
        );
    }
    // The file on disk is the one embedded.
    let on_disk = SweepConfig::from_path(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("bench-configs/default.toml")
            .as_path(),
    )
    .unwrap();
    assert_eq!(on_disk, config);
}

#[test]
fn config_settings_params_and_variants() {
    let text = r#"
[defaults]
reps = 20

[[sweep]]
kernel = "nvfp4_quantize_rows"
variants = ["fused", "unfused"]
baseline = "unfused"
axis = "rows"
values = [1, 64]
warmup = 9
[sweep.params]
cols = 4096
eps = 1e-6
mode = "per_row"

[[sweep]]
kernel = "copy"
axis = "bytes"
values = [1048576]
flush_l2 = false
"#;
    let config = SweepConfig::from_toml_str(text).unwrap();
    let (q, c) = (&config.sweeps[0], &config.sweeps[1]);
    let qs = q.settings(&config.defaults);
    assert_eq!((qs.reps, qs.warmup, qs.flush_l2), (20, 9, true));
    assert!(qs.needs_flush(100_000_000) && !qs.needs_flush(200_000_000));
    assert!(!c.settings(&config.defaults).needs_flush(1));
    assert_eq!(q.param_u64("cols").unwrap(), 4096);
    assert_eq!(q.param_f64("cols").unwrap(), 4096.0);
    assert_eq!(q.param_f64("eps").unwrap(), 1e-6);
    assert_eq!(q.param_str("mode").unwrap(), "per_row");
    assert_eq!(
        q.shape_label(64),
        "rows=64,cols=4096,eps=0.000001,mode=per_row"
    );

    let err = q.param_u64("rows_per_block").unwrap_err().to_string();
    assert!(
        err.contains("sweep #1 (kernel `nvfp4_quantize_rows`)") && err.contains("rows_per_block"),
        "{err}"
    );
    let err = q.param_u64("mode").unwrap_err().to_string();
    assert!(
        err.contains("`mode`") && err.contains("expected a non-negative integer"),
        "{err}"
    );
    let err = c.param_str("x").unwrap_err().to_string();
    assert!(
        err.contains("sweep #2 (kernel `copy`)") && err.contains("none"),
        "{err}"
    );

    assert_eq!(
        q.variants_from(&["fused", "unfused", "cublaslt"]).unwrap(),
        vec!["fused", "unfused"]
    );
    assert_eq!(
        c.variants_from(&["d2d", "kernel"]).unwrap(),
        vec!["d2d", "kernel"]
    );
    let err = q.variants_from(&["fused"]).unwrap_err().to_string();
    assert!(err.contains("unknown variant `unfused`"), "{err}");
}

fn config_error(text: &str) -> String {
    format!("{:#}", SweepConfig::from_toml_str(text).unwrap_err())
}

#[test]
fn config_errors_are_clear() {
    let ok_sweep = "[[sweep]]\nkernel = \"copy\"\naxis = \"bytes\"\nvalues = [1]\n";

    let err = config_error(&format!("{ok_sweep}values = [2\n"));
    assert!(err.contains("line 5"), "syntax error names the line: {err}");

    let err = config_error(&format!("sweeps_typo = 1\n{ok_sweep}"));
    assert!(
        err.contains("unknown field `sweeps_typo`") && err.contains("line 1"),
        "{err}"
    );

    let err = config_error(&format!("{ok_sweep}rep = 3\n"));
    assert!(err.contains("unknown field `rep`"), "{err}");

    let err = config_error("[defaults]\nwarmpu = 1\n");
    assert!(err.contains("unknown field `warmpu`"), "{err}");

    let err = config_error("[[sweep]]\naxis = \"rows\"\nvalues = [1]\n");
    assert!(err.contains("missing field `kernel`"), "{err}");

    let err = config_error(&format!(
        "{ok_sweep}[[sweep]]\nkernel = \"q\"\naxis = \"rows\"\nvalues = []\n"
    ));
    assert!(
        err.contains("sweep #2 (kernel `q`)") && err.contains("`values` is empty"),
        "{err}"
    );

    let err = config_error("[[sweep]]\nkernel = \"q\"\naxis = \"rows\"\nvalues = [-1]\n");
    assert!(err.contains("line 4"), "negative value: {err}");

    let err = config_error("[defaults]\nreps = 5\n");
    assert!(err.contains("no [[sweep]]"), "{err}");

    let err = config_error(&format!("{ok_sweep}variants = [\"a\"]\nbaseline = \"b\"\n"));
    assert!(err.contains("baseline `b` is not among"), "{err}");

    let err = config_error(&format!("{ok_sweep}[sweep.params]\nbytes = 4\n"));
    assert!(err.contains("both the axis and a fixed parameter"), "{err}");

    let err = config_error(&format!("{ok_sweep}[sweep.params]\nshape = [1, 2]\n"));
    assert!(err.contains("parameter `shape` is an array"), "{err}");

    let missing = Path::new("/nonexistent/megamoe/sweep.toml");
    let err = format!("{:#}", SweepConfig::from_path(missing).unwrap_err());
    assert!(
        err.contains("cannot read sweep config /nonexistent/megamoe/sweep.toml"),
        "{err}"
    );
}

/// Every committed sweep config (bench-configs/*.toml, the A/B configs in bench-configs/ab/ and the ncu points in
/// bench-configs/profile/) parses and passes the registry check of `megamoe bench` (registered kernels and
/// variants, known axis and parameter names, sizes), so a renamed variant fails here and not on the GPU machine. Profile configs also name the kernels Nsight Compute collects (`# ncu-kernels:`).
#[test]
fn every_committed_config_names_registered_kernels_and_variants() {
    let registry = megamoe::bench::kernels::all();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-configs");
    let mut checked = 0;
    for dir in [root.clone(), root.join("profile"), root.join("ab")] {
        // bench-configs/ab/ holds A/B configs only while a decision is open.
        if !dir.is_dir() {
            continue;
        }
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        for path in files {
            let config = SweepConfig::from_path(&path).unwrap();
            // The same check `megamoe bench` makes before it opens the GPU: kernels, variants, baselines, the
            // axis and parameter names a kernel lists, and every point's sizes.
            megamoe::bench::runner::plan(&config, &registry, &[])
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            if dir.ends_with("profile") {
                let text = std::fs::read_to_string(&path).unwrap();
                assert!(
                    text.lines().any(|l| l.starts_with("# ncu-kernels: ^")),
                    "{}: no `# ncu-kernels: ^...` line",
                    path.display()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 9,
        "only {checked} configs found under {}",
        root.display()
    );
}
