//! Sweep adapter of the weights family: `weights_fill` (one synthetic tensor of `bytes` bytes written on the
//! GPU; one variant per bulk (init, dtype) kind of the checkpoint, axis `bytes`), through the hook of
//! `ops::weights::bench`.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget, MAX_SIZE};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::weights::bench::{self as hooks, FillCase};

/// The engine fills the whole model (~150 GB of DSV4-Flash stored bytes at most, one GPU) before its first
/// decode step; at 1 TB/s written that is seconds. A fill writes and reads nothing, so the copy rate of the
/// same run (read + written) is no ceiling to state it against: the target is on the written rate itself.
const TARGETS: &[PlotTarget] = &[PlotTarget {
    metric: "gbps",
    value: 1000.0,
    label: "target: >= 1 TB/s written",
}];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "weights_fill",
        variants: &[
            "fp4_codes",
            "fp8_codes",
            "ue8m0_scale",
            "bf16_uniform",
            "f32_uniform",
        ],
        matmul: MatmulKind::NotMatmul,
        run_point,
        headline: &["fp4_codes", "fp8_codes", "bf16_uniform"],
        targets: TARGETS,
        params: &["bytes"],
        check_point: Some(check_bytes),
    }]
}

/// The axis is `bytes`, at least 1 and no more than [`MAX_SIZE`].
fn check_bytes(s: &Sweep, bytes: u64) -> Result<()> {
    if s.axis != "bytes" {
        bail!("the axis must be `bytes`, not `{}`", s.axis);
    }
    if bytes == 0 || bytes > MAX_SIZE {
        bail!("a fill of {bytes} bytes: need 1..={MAX_SIZE}");
    }
    Ok(())
}

fn run_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, bytes: u64) -> Result<Vec<Row>> {
    let case = FillCase::from_name(variant)?;
    let m = hooks::fill_tensor(ctx.gpu, |b| ctx.plan(b), case, bytes, ctx.seed)?;
    let sum = Summary::of(&m.samples_us)?;
    Ok(vec![Row::new(
        "weights_fill",
        variant,
        &s.shape_label(bytes),
    )
    .with_timing(&sum, m.samples_us.len() as u64)
    .with_work(Some(m.bytes), None)])
}
