//! Sweep adapter of the sampler family: `sampler` (axis `batch`, parameter `vocab`), one sampling step of the
//! whole batch per point as a replayed graph (`ops::sampler::bench`), every sequence with the variant's options
//! (`greedy`, `temperature`, `top_k50`, `top_p0.9`, `penalty`). Bytes: the logits and seen-token counts read
//! once (the full-vocab variants read them once per descent pass: `pct_copy_bw` is a floor, not a utilisation).

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::sampler::bench::{self as hooks, VARIANTS};
use crate::ops::sampler::SamplerShape;

const TARGETS: &[PlotTarget] = &[];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "sampler",
        variants: VARIANTS,
        matmul: MatmulKind::NotMatmul,
        run_point: sampler_point,
        headline: &["greedy", "temperature"],
        targets: TARGETS,
        params: &["batch", "vocab"],
        check_point: Some(check_sampler),
    }]
}

fn shape(s: &Sweep, batch: u64) -> Result<SamplerShape> {
    if s.axis != "batch" {
        bail!(
            "the axis must be `batch` (with `vocab` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    let shape = SamplerShape {
        batch: batch as usize,
        vocab: s.param_u64("vocab")? as usize,
        ring_cap: 256,
    };
    shape.check()?;
    Ok(shape)
}

fn check_sampler(s: &Sweep, batch: u64) -> Result<()> {
    shape(s, batch).map(|_| ())
}

fn sampler_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, batch: u64) -> Result<Vec<Row>> {
    let sh = shape(s, batch)?;
    let plan = ctx.plan(hooks::step_bytes(&sh));
    let m = hooks::measure(ctx.gpu, plan, variant, sh.batch, sh.vocab, ctx.seed)?;
    let sum = Summary::of(&m.samples_us)?;
    Ok(vec![Row::new("sampler", variant, &s.shape_label(batch))
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(Some(m.bytes), None)
        .with_tokens(batch)])
}
