//! Sweep adapter of the mHC family: kernel `mhc` (axis `tokens`, param `d`), every variant of
//! `ops::mhc::bench::MHC_VARIANTS`. `fused_*` / `graph_fused_*` / `graph16_fused_*` measure `mhc_pre`'s automatic
//! launch-path choice, the `*_pdl_*` / `*_twolaunch_*` / `*_tc_*` variants force one path (the measurements behind
//! `mhc_pre_auto_path`), and each fused variant names the op-by-op chain it is raced against.

use anyhow::Result;

use super::norm_quant::to_row;
use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row};
use crate::ops::mhc::bench::{bench_mhc, MHC_VARIANTS};

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "mhc",
        variants: MHC_VARIANTS,
        matmul: MatmulKind::NotMatmul,
        run_point: mhc_point,
        params: &["tokens", "d"],
        check_point: None,
        // The decode boundary inside a captured graph (per boundary) and the op-by-op chain it is raced against;
        // plain launches for prefill sizes (the tensor-core mix from 128 tokens).
        headline: &[
            "graph16_fused_nvfp4",
            "graph16_unfused_nvfp4",
            "graph16_fused_fp8",
            "graph16_unfused_fp8",
            "fused_nvfp4",
            "unfused_nvfp4",
        ],
        targets: &[
            PlotTarget {
                metric: "us_median",
                value: 4.0,
                label: "target: decode boundary <= 4 us",
            },
            PlotTarget {
                metric: "speedup_vs_baseline",
                value: 2.0,
                label: "target: >= 2x the unfused chain",
            },
        ],
    }]
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
