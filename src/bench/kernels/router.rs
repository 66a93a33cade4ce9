//! Sweep adapter of the router family: `router` (axis `tokens`, parameters `experts` and `d`), one routing call
//! (logits + select-and-group) per point through `ops::router::bench`, as a replayed graph (`graph`, the decode
//! step's form) and as plain stream launches (`stream`).

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::router::bench::{self as hooks, RouterLaunch};
use crate::ops::router::RouterShape;

const TARGETS: &[PlotTarget] = &[PlotTarget {
    metric: "us_median",
    value: 5.0,
    label: "target: router + grouping at batch 1 <= 5 us",
}];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "router",
        variants: &["graph", "stream"],
        matmul: MatmulKind::NotMatmul,
        run_point: router_point,
        headline: &["graph"],
        targets: TARGETS,
        params: &["tokens", "experts", "d"],
        check_point: Some(check_router),
    }]
}

fn shape(s: &Sweep, tokens: u64) -> Result<RouterShape> {
    if s.axis != "tokens" {
        bail!(
            "the axis must be `tokens` (with `experts` and `d` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    let shape = RouterShape::identity(
        tokens as usize,
        s.param_u64("experts")? as usize,
        s.param_u64("d")? as usize,
        tokens as usize,
    );
    shape.check()?;
    Ok(shape)
}

/// The axis is `tokens`, and the shape one the launcher accepts.
fn check_router(s: &Sweep, tokens: u64) -> Result<()> {
    shape(s, tokens).map(|_| ())
}

fn router_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    let how = match variant {
        "graph" => RouterLaunch::Graph,
        "stream" => RouterLaunch::Stream,
        v => bail!("router: unknown variant `{v}`"),
    };
    let sh = shape(s, tokens)?;
    let m = hooks::route_tokens(
        ctx.gpu,
        |b| ctx.plan(b),
        how,
        sh.tokens,
        sh.experts,
        sh.dim,
        ctx.seed,
    )?;
    let sum = Summary::of(&m.samples_us)?;
    Ok(vec![Row::new("router", variant, &s.shape_label(tokens))
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(Some(m.bytes), None)
        .with_tokens(tokens)])
}
