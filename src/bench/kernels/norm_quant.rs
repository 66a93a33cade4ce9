//! Sweep adapter of the norm_quant family: kernel `rmsnorm_quant` (axis `rows`, param `d`). `fused_<fmt>` measures
//! `rmsnorm_quant` as called (its kernel choice by shape, `ops::norm_quant::rows_path`), `unfused_<fmt>` the
//! unfused chain it is raced against (same run, same inputs); the runner adds the measured copy bandwidth, so
//! `pct_copy_bw` is a side-by-side ratio.

use anyhow::Result;

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::norm_quant::bench::{bench_rows, BenchPoint};

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "rmsnorm_quant",
        variants: &[
            "fused_nvfp4",
            "unfused_nvfp4",
            "fused_fp8",
            "unfused_fp8",
            "fused_bf16",
        ],
        matmul: MatmulKind::NotMatmul,
        run_point: rows_point,
        params: &["rows", "d"],
        check_point: None,
        headline: &["fused_nvfp4", "unfused_nvfp4", "fused_fp8", "unfused_fp8"],
        targets: &[PlotTarget {
            metric: "pct_copy_bw",
            value: 85.0,
            label: "target: RMSNorm + quant >= 85% of copy BW",
        }],
    }]
}

/// One CSV row of a measured point (`tokens` for the mHC kernel, `rows` for the row kernels).
pub(super) fn to_row(p: BenchPoint, s: &Sweep, axis_value: u64) -> Result<Vec<Row>> {
    let sum = Summary::of(&p.samples_us)?;
    let mut row = Row::new(p.kernel, &p.variant, &s.shape_label(axis_value))
        .with_cols(p.d as u64)
        .with_timing(&sum, p.samples_us.len() as u64)
        .with_work(Some(p.bytes), None);
    row = if p.kernel == "mhc" {
        row.with_tokens(p.rows as u64)
    } else {
        row.with_rows(p.rows as u64)
    };
    if let Some(b) = &p.baseline {
        row = row.with_baseline(b);
    }
    Ok(vec![row])
}

fn rows_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let d = s.param_u64("d")? as usize;
    let bytes = (rows as usize * d * 4) as u64; // working set ~ in + staging + out
    let p = bench_rows(
        ctx.gpu,
        variant,
        rows as usize,
        d,
        ctx.seed,
        ctx.plan(bytes),
    )?;
    to_row(p, s, rows)
}
