//! Sweep adapter of the moe_gemm family: bench-config parameters (`hidden`, `inter`, `experts`, `topk`; axis
//! `tokens`) into the family's measurement hook ([`crate::ops::moe_gemm::bench::measure`]) and its result into
//! CSV rows. Variants and what each measures: `ops::moe_gemm::bench`.

use anyhow::Result;

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::moe_gemm::bench::{measure, Layer, Measured, ModelShape, VARIANTS};

/// The routed path and the baseline its prefill target is stated against.
const HEADLINE: &[&str] = &["nvfp4", "cublaslt_bf16"];

/// Decode (1-64 Flash tokens): bytes / time >= 80% of copy bandwidth; prefill (>= 4096 tokens): >= 60% of the
/// BF16 dense rate (and >= 1.5x `cublaslt_bf16`, read from the speed-up column).
const TARGETS: &[PlotTarget] = &[
    PlotTarget {
        metric: "pct_copy_bw",
        value: 80.0,
        label: "target: decode >= 80% of copy BW",
    },
    PlotTarget {
        metric: "pct_matmul",
        value: 60.0,
        label: "target: prefill >= 60% of the BF16 rate",
    },
];

pub fn kernels() -> Vec<BenchKernel> {
    vec![
        BenchKernel {
            name: "moe_gemm_l1",
            variants: VARIANTS,
            matmul: MatmulKind::Bf16,
            run_point: l1_point,
            params: &["tokens", "hidden", "inter", "experts", "topk"],
            check_point: None,
            headline: HEADLINE,
            targets: TARGETS,
        },
        BenchKernel {
            name: "moe_gemm_l2",
            variants: VARIANTS,
            matmul: MatmulKind::Bf16,
            run_point: l2_point,
            params: &["tokens", "hidden", "inter", "experts", "topk"],
            check_point: None,
            headline: HEADLINE,
            targets: TARGETS,
        },
    ]
}

fn l1_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    point(ctx, s, "moe_gemm_l1", Layer::L1, variant, tokens)
}

fn l2_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    point(ctx, s, "moe_gemm_l2", Layer::L2, variant, tokens)
}

fn point(
    ctx: &BenchCtx<'_>,
    s: &Sweep,
    kernel: &str,
    layer: Layer,
    variant: &str,
    tokens: u64,
) -> Result<Vec<Row>> {
    let shape = ModelShape {
        hidden: s.param_u64("hidden")? as usize,
        inter: s.param_u64("inter")? as usize,
        experts: s.param_u64("experts")? as usize,
        topk: s.param_u64("topk")? as usize,
    };
    let plan = |bytes: u64| ctx.plan(bytes);
    let Some(m) = measure(
        ctx.gpu,
        layer,
        &shape,
        tokens as usize,
        ctx.seed,
        variant,
        &plan,
    )?
    else {
        return Ok(vec![]);
    };
    Ok(vec![row(kernel, variant, s, &m)?])
}

fn row(kernel: &str, variant: &str, s: &Sweep, m: &Measured) -> Result<Row> {
    let sum = Summary::of(&m.samples)?;
    let r = Row::new(kernel, variant, &s.shape_label(m.tokens as u64))
        .with_tokens(m.tokens as u64)
        .with_rows(m.pairs as u64)
        .with_cols(m.n as u64)
        .with_timing(&sum, m.samples.len() as u64)
        .with_work(Some(m.bytes), Some(m.flops));
    Ok(if variant == "cublaslt_bf16" {
        r
    } else {
        r.with_baseline("cublaslt_bf16")
    })
}
