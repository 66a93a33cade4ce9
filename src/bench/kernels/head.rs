//! Sweep adapter of the head family: `head` (axis `tokens`, parameters `vocab` and `d`), variants `embed` (the
//! token-id -> 4-stream embedding) and `final_norm` (hc_head + RMSNorm, the LM head's input), each one call per
//! point as a replayed graph (`ops::head::bench`). Bytes: the table rows read + the streams written (embed), X +
//! weights read + outputs written (final_norm), so `pct_copy_bw` is the fraction of a device copy.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::head::bench::{self as hooks, VARIANTS};
use crate::ops::head::EmbedShape;

const TARGETS: &[PlotTarget] = &[];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "head",
        variants: VARIANTS,
        matmul: MatmulKind::NotMatmul,
        run_point: head_point,
        headline: VARIANTS,
        targets: TARGETS,
        params: &["tokens", "vocab", "d"],
        check_point: Some(check_head),
    }]
}

fn shape(s: &Sweep, tokens: u64) -> Result<EmbedShape> {
    if s.axis != "tokens" {
        bail!(
            "the axis must be `tokens` (with `vocab` and `d` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    let shape = EmbedShape {
        tokens: tokens as usize,
        vocab: s.param_u64("vocab")? as usize,
        dim: s.param_u64("d")? as usize,
    };
    shape.check()?;
    Ok(shape)
}

fn check_head(s: &Sweep, tokens: u64) -> Result<()> {
    shape(s, tokens).map(|_| ())
}

fn head_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    let sh = shape(s, tokens)?;
    let bytes = match variant {
        "embed" => hooks::embed_bytes(&sh),
        _ => hooks::final_norm_bytes(sh.tokens, sh.dim),
    };
    let m = hooks::measure(
        ctx.gpu,
        ctx.plan(bytes),
        variant,
        sh.tokens,
        sh.vocab,
        sh.dim,
        ctx.seed,
    )?;
    let sum = Summary::of(&m.samples_us)?;
    Ok(vec![Row::new("head", variant, &s.shape_label(tokens))
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(Some(m.bytes), None)
        .with_tokens(tokens)])
}
