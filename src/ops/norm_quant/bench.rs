//! Bench hooks of the norm_quant family: `rmsnorm_quant` (axis `rows`, param `d`) and `mhc` (axis
//! `tokens`, param `d`). Each fused variant names the unfused chain it is raced against (same run, same
//! inputs); the runner adds the measured copy bandwidth, so `pct_copy_bw` is a side-by-side ratio.
//! `rmsnorm_quant` `fused_<fmt>` measures `rmsnorm_quant` as called, i.e. its kernel choice by shape
//! (`rows_path`: from 4096 rows when D is a multiple of 1024, BF16 -> NVFP4 v6 (D <= 8192) and BF16 -> FP8
//! v5, otherwise the v4p row loop / one CTA per row); `mhc` `fused_*` / `graph_fused_*` / `graph16_fused_*` measure
//! `mhc_pre`'s automatic launch-path choice (PDL pair up to 8 tokens, two launches up to 127, the tensor-core
//! mix from 128), `*_fused_pdl_*`, `*_fused_twolaunch_*` (the FFMA mix) and `fused_tc_*` (`MhcPrePath::TensorMix`,
//! kernels/mhc_mix_tc.cu) one path each (see `MHC_VARIANTS`).

use anyhow::Result;

use super::{bench_mhc, bench_rows, BenchPoint};
use crate::bench::config::Sweep;
use crate::bench::runner::{BenchCtx, BenchKernel};
use crate::bench::{MatmulKind, Row, Summary};

pub fn kernels() -> Vec<BenchKernel> {
    vec![
        BenchKernel {
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
            headline: &[],
            targets: &[],
            params: &[],
            check_point: None,
        },
        BenchKernel {
            name: "mhc",
            variants: super::MHC_VARIANTS,
            matmul: MatmulKind::NotMatmul,
            run_point: mhc_point,
            headline: &[],
            targets: &[],
            params: &[],
            check_point: None,
        },
    ]
}

fn to_row(p: BenchPoint, s: &Sweep, axis_value: u64) -> Result<Vec<Row>> {
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

fn mhc_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    let d = s.param_u64("d")? as usize;
    let bytes = (tokens as usize * d * 12 + 24 * 4 * d * 4) as u64;
    let p = bench_mhc(
        ctx.gpu,
        variant,
        tokens as usize,
        d,
        ctx.seed,
        ctx.plan(bytes),
    )?;
    to_row(p, s, tokens)
}
