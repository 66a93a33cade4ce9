//! Sweep adapter of the indexer family (bench-configs/indexer.toml): one point = one (format, batch, ctx,
//! next_n, k); num_valid = ctx / 4 (CSA, m = 4). Each variant emits three rows: `indexer` (logits + top-k back to
//! back), `indexer_logits` and `indexer_topk`, so the speed-up over the baseline is given for each part.
//! `indexer_logits` bytes are the key cache + q + w + scores: its `pct_copy_bw` is the "key bytes / time vs copy
//! bandwidth" target (keys dominate: >= 97% of those bytes at ctx >= 16K). The measurement hooks are in
//! `ops::indexer::bench`.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::indexer::bench::{bench_inputs, time_variant, traffic_bytes, VARIANTS};
use crate::ops::indexer::{KeyFormat, HEAD_DIM, NUM_HEADS};

/// The indexer's targets (results/h200/NOTES.md): logits + top-k <= 30 us at 1M context / batch 1, >= 70% of
/// copy bandwidth at batch >= 16 from 64K context, >= 10x the fp32 baseline at 1M.
const TARGETS: &[PlotTarget] = &[
    PlotTarget {
        metric: "us_median",
        value: 30.0,
        label: "target: logits + top-k <= 30 us at 1M ctx, batch 1",
    },
    PlotTarget {
        metric: "pct_copy_bw",
        value: 70.0,
        label: "target: >= 70% of copy BW at batch >= 16, ctx >= 64K",
    },
    PlotTarget {
        metric: "speedup_vs_baseline",
        value: 10.0,
        label: "target: >= 10x the fp32 baseline at 1M ctx",
    },
];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "indexer",
        variants: VARIANTS,
        matmul: MatmulKind::NotMatmul,
        run_point: indexer_point,
        params: &["ctx", "batch", "next_n", "k", "format"],
        check_point: None,
        headline: &["fused", "graph_fused", "baseline"],
        targets: TARGETS,
    }]
}

fn param_or(s: &Sweep, name: &str, default: u64) -> Result<u64> {
    if s.has_param(name) {
        s.param_u64(name)
    } else {
        Ok(default)
    }
}

fn indexer_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, value: u64) -> Result<Vec<Row>> {
    let (batch, context) = match s.axis.as_str() {
        "ctx" => (param_or(s, "batch", 1)?, value),
        "batch" => (value, s.param_u64("ctx")?),
        a => bail!(
            "{}: indexer sweeps run over `ctx` or `batch`, not `{a}`",
            s.name()
        ),
    };
    let next_n = param_or(s, "next_n", 1)? as usize;
    let k = param_or(s, "k", 512)? as usize;
    let format = if s.has_param("format") {
        KeyFormat::parse(s.param_str("format")?)?
    } else {
        KeyFormat::Fp8
    };
    let num_valid = (context / 4).max(1) as usize;
    let inp = bench_inputs(ctx.gpu, format, batch as usize, next_n, num_valid, ctx.seed)?;
    let (logits_bytes, topk_bytes) = traffic_bytes(&inp, k);
    let plan = ctx.plan(logits_bytes);
    let samples = time_variant(ctx.gpu, variant, &inp, k, plan)?;
    let rows = batch as usize * next_n;
    let flops = (rows * num_valid * NUM_HEADS * HEAD_DIM * 2) as u64;
    let shape = s.shape_label(value);
    let row = |kernel: &str, samples: &[f64], bytes: u64, flops: Option<u64>| -> Result<Row> {
        let sum = Summary::of(samples)?;
        Ok(Row::new(kernel, variant, &shape)
            .with_batch(batch)
            .with_ctx(context)
            .with_tokens(rows as u64)
            .with_timing(&sum, samples.len() as u64)
            .with_work(Some(bytes), flops))
    };
    let mut out = vec![
        row(
            "indexer",
            &samples.total,
            logits_bytes + topk_bytes,
            Some(flops),
        )?,
        row("indexer_logits", &samples.logits, logits_bytes, Some(flops))?,
        row("indexer_topk", &samples.topk, topk_bytes, None)?,
    ];
    if variant != "baseline" {
        out = out
            .into_iter()
            .map(|r| r.with_baseline("baseline"))
            .collect();
    }
    Ok(out)
}
