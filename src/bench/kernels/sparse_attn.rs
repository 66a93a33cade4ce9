//! Bench adapter of the sparse_attn family: sweep parameters -> `ops::sparse_attn::bench::time_point` -> one CSV
//! row per point. `pct_matmul` is taken against the BF16 rate: P.V and the rope part of QK^T (4.5 of every 8
//! FLOPs) run on BF16 tensor cores, only the nope part of QK^T on FP8 values (held as exact BF16).

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::sparse_attn::bench::{
    time_point, variant_of, work, BenchShape, LayerKind, BASELINE, KERNEL, KERNEL_GRAPH, VARIANTS,
};

/// Drawn by default: the routed path and the baseline its target is stated against.
const HEADLINE: [&str; 2] = ["fp8", BASELINE];
/// The target for sparse decode attention (results/h200/NOTES.md, "sparse FMHA Flash / Pro"): at least
/// 1.5x the BF16-staging baseline at every batch.
const TARGETS: [PlotTarget; 1] = [PlotTarget {
    metric: "speedup_vs_baseline",
    value: 1.5,
    label: "target: >= 1.5x the BF16-staging baseline",
}];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: KERNEL,
        variants: &VARIANTS,
        matmul: MatmulKind::Bf16,
        run_point,
        params: &["ctx", "batch", "kind", "topk", "heads", "graph"],
        check_point: None,
        headline: &HEADLINE,
        targets: &TARGETS,
    }]
}

/// One sweep point: axis `ctx` (params `batch`) or `batch` (params `ctx`); params `kind` ("csa" with `topk`,
/// or "hca") and `heads`; optional `graph` (1: a second row, kernel `sparse_attn_decode_graph`, with the time of
/// the same call replayed from a CUDA graph beside the event-timed `sparse_attn_decode` row).
fn run_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, value: u64) -> Result<Vec<Row>> {
    let kind = match s.param_str("kind")? {
        "csa" => LayerKind::Csa {
            topk: s.param_u64("topk")? as usize,
        },
        "hca" => LayerKind::Hca,
        other => bail!("{}: kind `{other}` is neither `csa` nor `hca`", s.name()),
    };
    let heads = s.param_u64("heads")? as usize;
    let (context, batch) = match s.axis.as_str() {
        "ctx" => (value as usize, s.param_u64("batch")? as usize),
        "batch" => (s.param_u64("ctx")? as usize, value as usize),
        other => bail!("{}: axis `{other}` is neither `ctx` nor `batch`", s.name()),
    };
    let v = variant_of(variant)?;
    let point = BenchShape {
        kind,
        ctx: context,
        batch,
        heads,
    };
    let graph = s.has_param("graph") && s.param_u64("graph")? == 1;
    let (bytes, _) = work(batch, heads, point.candidates(), v);
    let t = time_point(ctx.gpu, variant, point, ctx.plan(bytes), ctx.seed, graph)?;
    // The runner pairs variants through identical shape labels (the sweep's, not the plan's split count).
    let row = |kernel: &str, samples: &[f64]| -> Result<Row> {
        let mut row = Row::new(kernel, variant, &s.shape_label(value))
            .with_batch(batch as u64)
            .with_ctx(context as u64)
            .with_timing(&Summary::of(samples)?, samples.len() as u64)
            .with_work(Some(t.bytes), Some(t.flops));
        if variant != BASELINE {
            row = row.with_baseline(BASELINE);
        }
        Ok(row)
    };
    let mut rows = vec![row(KERNEL, &t.samples_us)?];
    if let Some(g) = &t.graph_samples_us {
        rows.push(row(KERNEL_GRAPH, g)?);
    }
    Ok(rows)
}
