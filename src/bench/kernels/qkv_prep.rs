//! Sweep adapter of the qkv_prep family: `qkv_prep` (axis `tokens`, parameters `heads` and `index_heads`), one
//! decode step's attention-side prep per point through `ops::qkv_prep::bench`, each variant captured in a graph
//! and replayed: `q_heads`, `kv_entries`, `indexer_q` alone, `all` (the three launches in one graph), and
//! `launch_floor` (an empty kernel's replay in the same run: a variant at that time sits at the launch floor).

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::qkv_prep::bench::{self as hooks, VARIANTS};
use crate::ops::qkv_prep::check_rows_heads;

/// These kernels move a few hundred KB at decode batch sizes: the copy-bandwidth share is reported, and the
/// launch floor beside it is the bound that applies (#24 gives these small kernels no separate target).
const TARGETS: &[PlotTarget] = &[];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "qkv_prep",
        variants: VARIANTS,
        matmul: MatmulKind::NotMatmul,
        run_point: qkv_point,
        headline: &["all", "launch_floor"],
        targets: TARGETS,
        params: &["tokens", "heads", "index_heads"],
        check_point: Some(check_qkv),
    }]
}

fn shape(s: &Sweep, tokens: u64) -> Result<(usize, usize, usize)> {
    if s.axis != "tokens" {
        bail!(
            "the axis must be `tokens` (with `heads` and `index_heads` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    let (rows, heads, index_heads) = (
        tokens as usize,
        s.param_u64("heads")? as usize,
        s.param_u64("index_heads")? as usize,
    );
    check_rows_heads(rows, heads)?;
    check_rows_heads(rows, index_heads)?;
    Ok((rows, heads, index_heads))
}

/// The axis is `tokens`, and the shape one the launchers accept.
fn check_qkv(s: &Sweep, tokens: u64) -> Result<()> {
    shape(s, tokens).map(|_| ())
}

fn qkv_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    let (rows, heads, index_heads) = shape(s, tokens)?;
    let m = hooks::measure(
        ctx.gpu,
        |b| ctx.plan(b),
        variant,
        rows,
        heads,
        index_heads,
        ctx.seed,
    )?;
    let sum = Summary::of(&m.samples_us)?;
    let bytes = (m.bytes > 0).then_some(m.bytes);
    Ok(vec![Row::new("qkv_prep", variant, &s.shape_label(tokens))
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(bytes, None)
        .with_tokens(tokens)])
}
