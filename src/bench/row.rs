//! One CSV schema for every kernel (docs/measurement.md): [`Row`].
//!
//! Units: times in microseconds; `bytes` = bytes the kernel must move to/from HBM (read + written);
//! `flops` = arithmetic operations (a multiply-add counts 2); `gbps` = 1e9 bytes/s; `tflops` =
//! 1e12 flops/s; `pct_*` in percent of the limit measured in the same run.
//!
//! Derived columns and their identities (us = microseconds = 1e-6 s):
//! - `gbps = bytes / (us_median * 1e-6) / 1e9 = bytes / us_median / 1e3`
//! - `tflops = flops / (us_median * 1e-6) / 1e12 = flops / us_median / 1e6`
//! - `pct_copy_bw = gbps / copy_bw_gbps * 100`, `pct_matmul = tflops / matmul_tflops * 100`
//! - `speedup_vs_baseline = us_median(baseline variant) / us_median(this row)` (> 1 = faster)

use std::collections::HashMap;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::limits::{Limits, MatmulKind};
use super::stats::Summary;
use super::telemetry::Telemetry;

/// One measurement: a kernel variant on one shape, with its timing, work, accuracy, limits,
/// telemetry and provenance. Serialises to CSV in exactly the order of [`Row::COLUMNS`];
/// `None` becomes an empty cell.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Kernel family entry point, e.g. `nvfp4_quantize_rows`.
    pub kernel: String,
    /// Implementation variant, e.g. `fused`, `unfused`, `cublaslt`.
    pub variant: String,
    /// Human-readable shape, e.g. `rows=4096,cols=7168`; rows with equal kernel and shape are raced.
    pub shape: String,
    pub rows: Option<u64>,
    pub cols: Option<u64>,
    pub tokens: Option<u64>,
    pub batch: Option<u64>,
    pub ctx: Option<u64>,
    pub us_median: Option<f64>,
    pub us_p10: Option<f64>,
    pub us_p90: Option<f64>,
    /// Timed repetitions behind the statistics.
    pub reps: Option<u64>,
    pub bytes: Option<u64>,
    pub flops: Option<u64>,
    pub gbps: Option<f64>,
    pub pct_copy_bw: Option<f64>,
    pub tflops: Option<f64>,
    pub pct_matmul: Option<f64>,
    /// Variant name this row is raced against (same kernel and shape).
    pub baseline: Option<String>,
    pub speedup_vs_baseline: Option<f64>,
    /// Largest absolute difference from the CPU reference.
    pub max_abs_err: Option<f64>,
    /// Largest relative difference from the CPU reference (definition is the kernel's; see its test).
    pub max_rel_err: Option<f64>,
    /// GPU name; empty when unknown.
    pub gpu: String,
    pub sm_clock_mhz: Option<u64>,
    pub mem_clock_mhz: Option<u64>,
    pub power_w: Option<f64>,
    pub temp_c: Option<u64>,
    pub copy_bw_gbps: Option<f64>,
    pub bf16_tflops: Option<f64>,
    pub fp8_tflops: Option<f64>,
    pub git_commit: String,
    /// RFC 3339 UTC time the row was created.
    pub timestamp: String,
}

/// Names a numeric column of [`Row`] for plots and reports; see [`Row::numeric`].
pub const NUMERIC_COLUMNS: [&str; 25] = [
    "rows",
    "cols",
    "tokens",
    "batch",
    "ctx",
    "us_median",
    "us_p10",
    "us_p90",
    "reps",
    "bytes",
    "flops",
    "gbps",
    "pct_copy_bw",
    "tflops",
    "pct_matmul",
    "speedup_vs_baseline",
    "max_abs_err",
    "max_rel_err",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "power_w",
    "temp_c",
    "copy_bw_gbps",
    "bf16_tflops",
    "fp8_tflops",
];

/// The problem-size columns a sweep can run along, in the order a report prefers them as x axis.
pub const DIMENSION_COLUMNS: [&str; 6] = ["tokens", "rows", "batch", "ctx", "cols", "bytes"];

impl Row {
    /// CSV header, in field order. A unit test checks it against what serde writes.
    pub const COLUMNS: [&'static str; 32] = [
        "kernel",
        "variant",
        "shape",
        "rows",
        "cols",
        "tokens",
        "batch",
        "ctx",
        "us_median",
        "us_p10",
        "us_p90",
        "reps",
        "bytes",
        "flops",
        "gbps",
        "pct_copy_bw",
        "tflops",
        "pct_matmul",
        "baseline",
        "speedup_vs_baseline",
        "max_abs_err",
        "max_rel_err",
        "gpu",
        "sm_clock_mhz",
        "mem_clock_mhz",
        "power_w",
        "temp_c",
        "copy_bw_gbps",
        "bf16_tflops",
        "fp8_tflops",
        "git_commit",
        "timestamp",
    ];

    /// A row with only its identity and provenance: `git_commit` from [`super::env::git_commit`]
    /// (looked up once per process) and `timestamp` = now. Everything else is empty.
    pub fn new(kernel: &str, variant: &str, shape: &str) -> Row {
        Row {
            git_commit: cached_git_commit().to_string(),
            timestamp: super::env::timestamp_utc(),
            ..Row::empty(kernel, variant, shape)
        }
    }

    /// A row with only its identity; provenance left empty (for tests and for rebuilding rows).
    pub fn empty(kernel: &str, variant: &str, shape: &str) -> Row {
        Row {
            kernel: kernel.to_string(),
            variant: variant.to_string(),
            shape: shape.to_string(),
            rows: None,
            cols: None,
            tokens: None,
            batch: None,
            ctx: None,
            us_median: None,
            us_p10: None,
            us_p90: None,
            reps: None,
            bytes: None,
            flops: None,
            gbps: None,
            pct_copy_bw: None,
            tflops: None,
            pct_matmul: None,
            baseline: None,
            speedup_vs_baseline: None,
            max_abs_err: None,
            max_rel_err: None,
            gpu: String::new(),
            sm_clock_mhz: None,
            mem_clock_mhz: None,
            power_w: None,
            temp_c: None,
            copy_bw_gbps: None,
            bf16_tflops: None,
            fp8_tflops: None,
            git_commit: String::new(),
            timestamp: String::new(),
        }
    }

    pub fn with_rows(mut self, rows: u64) -> Row {
        self.rows = Some(rows);
        self
    }
    pub fn with_cols(mut self, cols: u64) -> Row {
        self.cols = Some(cols);
        self
    }
    pub fn with_tokens(mut self, tokens: u64) -> Row {
        self.tokens = Some(tokens);
        self
    }
    pub fn with_batch(mut self, batch: u64) -> Row {
        self.batch = Some(batch);
        self
    }
    pub fn with_ctx(mut self, ctx: u64) -> Row {
        self.ctx = Some(ctx);
        self
    }

    /// Timing columns from a summary of per-rep microseconds; recomputes GB/s, TFLOP/s and
    /// `pct_copy_bw` when work and limits are already known.
    pub fn with_timing(mut self, summary: &Summary, reps: u64) -> Row {
        self.us_median = Some(summary.median);
        self.us_p10 = Some(summary.p10);
        self.us_p90 = Some(summary.p90);
        self.reps = Some(reps);
        self.refresh_rates();
        self
    }

    /// Work columns (bytes moved, flops done); fills `gbps` / `tflops` from `us_median` when timed.
    pub fn with_work(mut self, bytes: Option<u64>, flops: Option<u64>) -> Row {
        self.bytes = bytes;
        self.flops = flops;
        self.refresh_rates();
        self
    }

    /// Limit columns measured in this run, and the percentages against them. `kind` picks which
    /// matmul rate `pct_matmul` uses. Call after [`Row::with_timing`] and [`Row::with_work`]:
    /// `pct_matmul` is computed here only (the kind is not stored in the row), while `pct_copy_bw`
    /// is also refreshed by the other two.
    pub fn with_limits(mut self, limits: &Limits, kind: MatmulKind) -> Row {
        self.copy_bw_gbps = Some(limits.copy_bw_gbps);
        self.bf16_tflops = limits.bf16_tflops;
        self.fp8_tflops = limits.fp8_tflops;
        self.refresh_rates();
        self.pct_matmul = match (self.tflops, limits.matmul_tflops(kind)) {
            (Some(t), Some(limit)) if limit > 0.0 => Some(t / limit * 100.0),
            _ => None,
        };
        self
    }

    /// GPU name, clocks, power, temperature read next to the measurement.
    pub fn with_telemetry(mut self, telemetry: &Telemetry) -> Row {
        self.gpu = telemetry.gpu.clone();
        self.sm_clock_mhz = telemetry.sm_clock_mhz.map(u64::from);
        self.mem_clock_mhz = telemetry.mem_clock_mhz.map(u64::from);
        self.power_w = telemetry.power_w;
        self.temp_c = telemetry.temp_c.map(u64::from);
        self
    }

    /// Names the variant this row is raced against; see [`fill_speedups`].
    pub fn with_baseline(mut self, baseline_variant: &str) -> Row {
        self.baseline = Some(baseline_variant.to_string());
        self
    }

    /// Accuracy against the CPU reference.
    pub fn with_errors(mut self, max_abs_err: f64, max_rel_err: f64) -> Row {
        self.max_abs_err = Some(max_abs_err);
        self.max_rel_err = Some(max_rel_err);
        self
    }

    /// Recompute the rate columns that depend only on other columns. A zero or negative median
    /// time cannot give a rate, so the rate is left empty rather than infinite.
    fn refresh_rates(&mut self) {
        let us = self.us_median.filter(|&us| us > 0.0);
        self.gbps = match (self.bytes, us) {
            (Some(bytes), Some(us)) => Some(bytes as f64 / us / 1e3),
            _ => None,
        };
        self.tflops = match (self.flops, us) {
            (Some(flops), Some(us)) => Some(flops as f64 / us / 1e6),
            _ => None,
        };
        self.pct_copy_bw = match (self.gbps, self.copy_bw_gbps) {
            (Some(gbps), Some(limit)) if limit > 0.0 => Some(gbps / limit * 100.0),
            _ => None,
        };
    }

    /// The value of a numeric column by its CSV name (`None` = empty cell). Errors on a name that
    /// is not a numeric column, listing the valid ones.
    pub fn numeric(&self, column: &str) -> Result<Option<f64>> {
        let u = |v: Option<u64>| v.map(|x| x as f64);
        Ok(match column {
            "rows" => u(self.rows),
            "cols" => u(self.cols),
            "tokens" => u(self.tokens),
            "batch" => u(self.batch),
            "ctx" => u(self.ctx),
            "us_median" => self.us_median,
            "us_p10" => self.us_p10,
            "us_p90" => self.us_p90,
            "reps" => u(self.reps),
            "bytes" => u(self.bytes),
            "flops" => u(self.flops),
            "gbps" => self.gbps,
            "pct_copy_bw" => self.pct_copy_bw,
            "tflops" => self.tflops,
            "pct_matmul" => self.pct_matmul,
            "speedup_vs_baseline" => self.speedup_vs_baseline,
            "max_abs_err" => self.max_abs_err,
            "max_rel_err" => self.max_rel_err,
            "sm_clock_mhz" => u(self.sm_clock_mhz),
            "mem_clock_mhz" => u(self.mem_clock_mhz),
            "power_w" => self.power_w,
            "temp_c" => u(self.temp_c),
            "copy_bw_gbps" => self.copy_bw_gbps,
            "bf16_tflops" => self.bf16_tflops,
            "fp8_tflops" => self.fp8_tflops,
            other => bail!(
                "`{other}` is not a numeric column; numeric columns are: {}",
                NUMERIC_COLUMNS.join(", ")
            ),
        })
    }
}

fn cached_git_commit() -> &'static str {
    static COMMIT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    COMMIT.get_or_init(super::env::git_commit)
}

/// For every row that names a `baseline`, set `speedup_vs_baseline = us_median(baseline row) /
/// us_median(row)`, where the baseline row is the first row with the same kernel, shape and GPU
/// whose variant equals that name. Left empty when there is no such row or either time is missing
/// or not positive. Rows without a `baseline` are not touched.
pub fn fill_speedups(rows: &mut [Row]) {
    let mut baseline_us: HashMap<(&str, &str, &str, &str), Option<f64>> = HashMap::new();
    for row in rows.iter() {
        baseline_us
            .entry((&row.kernel, &row.shape, &row.gpu, &row.variant))
            .or_insert(row.us_median);
    }
    let speedups: Vec<Option<f64>> = rows
        .iter()
        .map(|row| {
            let name = row.baseline.as_deref()?;
            let base = (*baseline_us.get(&(&row.kernel, &row.shape, &row.gpu, name))?)?;
            let this = row.us_median?;
            (base > 0.0 && this > 0.0).then(|| base / this)
        })
        .collect();
    for (row, speedup) in rows.iter_mut().zip(speedups) {
        if row.baseline.is_some() {
            row.speedup_vs_baseline = speedup;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(variant: &str, shape: &str, us: f64) -> Row {
        let s = Summary::of(&[us]).unwrap();
        Row::empty("k", variant, shape).with_timing(&s, 1)
    }

    #[test]
    fn header_matches_serde_field_order() {
        let mut w = csv::Writer::from_writer(vec![]);
        w.serialize(Row::empty("k", "v", "s")).unwrap();
        let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
        let header = text.lines().next().unwrap();
        assert_eq!(header, Row::COLUMNS.join(","));
    }

    #[test]
    fn every_numeric_column_is_readable() {
        let row = Row::empty("k", "v", "s");
        for col in NUMERIC_COLUMNS {
            assert!(Row::COLUMNS.contains(&col), "{col}");
            assert_eq!(row.numeric(col).unwrap(), None, "{col}");
        }
        let err = row.numeric("kernel").unwrap_err().to_string();
        assert!(err.contains("not a numeric column"), "{err}");
    }

    #[test]
    fn derived_rates_and_percentages() {
        // 4e9 bytes in 1000 us = 4e12 B/s = 4000 GB/s; 3e12 flops in 1000 us = 3000 TFLOP/s.
        let s = Summary::of(&[900.0, 1000.0, 1100.0]).unwrap();
        let limits = Limits {
            copy_bw_gbps: 5000.0,
            bf16_tflops: Some(6000.0),
            fp8_tflops: Some(12000.0),
        };
        let row = Row::empty("k", "v", "s")
            .with_timing(&s, 3)
            .with_work(Some(4_000_000_000), Some(3_000_000_000_000))
            .with_limits(&limits, MatmulKind::Fp8);
        assert_eq!(row.gbps, Some(4000.0));
        assert_eq!(row.tflops, Some(3000.0));
        assert_eq!(row.pct_copy_bw, Some(80.0));
        assert_eq!(row.pct_matmul, Some(25.0));
        let bf16 = row.clone().with_limits(&limits, MatmulKind::Bf16);
        assert_eq!(bf16.pct_matmul, Some(50.0));
        let not_mm = row.with_limits(&limits, MatmulKind::NotMatmul);
        assert_eq!(not_mm.pct_matmul, None);
        assert_eq!(not_mm.pct_copy_bw, Some(80.0));
    }

    #[test]
    fn limits_before_timing_still_give_copy_percentage() {
        let limits = Limits {
            copy_bw_gbps: 2000.0,
            bf16_tflops: None,
            fp8_tflops: None,
        };
        let row = Row::empty("k", "v", "s")
            .with_limits(&limits, MatmulKind::NotMatmul)
            .with_work(Some(1_000_000), None)
            .with_timing(&Summary::of(&[1.0]).unwrap(), 1);
        assert_eq!(row.gbps, Some(1000.0));
        assert_eq!(row.pct_copy_bw, Some(50.0));
        assert_eq!(row.tflops, None);
    }

    #[test]
    fn telemetry_fills_columns() {
        let t = Telemetry {
            gpu: "NVIDIA H200".into(),
            sm_clock_mhz: Some(1980),
            mem_clock_mhz: Some(3201),
            power_w: Some(412.5),
            temp_c: Some(47),
        };
        let row = Row::empty("k", "v", "s").with_telemetry(&t);
        assert_eq!(row.gpu, "NVIDIA H200");
        assert_eq!(
            (row.sm_clock_mhz, row.mem_clock_mhz, row.temp_c),
            (Some(1980), Some(3201), Some(47))
        );
        assert_eq!(row.power_w, Some(412.5));
    }

    #[test]
    fn speedups_pair_by_kernel_shape_and_variant() {
        let mut rows = vec![
            timed("fused", "m=1", 2.0).with_baseline("unfused"),
            timed("unfused", "m=1", 6.0).with_baseline("unfused"),
            timed("fused", "m=8", 5.0).with_baseline("unfused"),
            timed("unfused", "m=8", 10.0),
            timed("fused", "m=64", 5.0).with_baseline("unfused"), // no baseline row for m=64
            timed("other", "m=1", 3.0),                           // names no baseline
        ];
        rows[5].speedup_vs_baseline = Some(42.0);
        fill_speedups(&mut rows);
        let got: Vec<_> = rows.iter().map(|r| r.speedup_vs_baseline).collect();
        assert_eq!(
            got,
            vec![Some(3.0), Some(1.0), Some(2.0), None, None, Some(42.0)]
        );
    }
}
