//! Sweep adapter of the compressor family: `compressor_decode` (axis `batch`, parameter `kind` = csa_main |
//! hca_main | csa_index_fp8 | csa_index_mxfp4 and `ratio`), one captured decode step per point through
//! `ops::compressor::bench`: `emit` (every sequence completes a block: pool, finalize, store, reset) and `update`
//! (the state row write only), both on the routed grid (`DecodeGrid::for_batch`), and each also forced onto either
//! grid (`*_cluster`, `*_one_cta`: the points the routing rule rests on). Bytes per point are `ops::compressor::bench::step_bytes`, so `pct_copy_bw` is
//! the step's traffic against the copy bandwidth measured in the same run. No #24 target names the compressor:
//! the rows carry the measured limits only.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::compressor::bench::{self as hooks, StepKind};
use crate::ops::compressor::{CompressorKind, CompressorShape, DecodeGrid};
use crate::ops::indexer::KeyFormat;

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "compressor_decode",
        variants: &[
            "emit",
            "update",
            "emit_cluster",
            "update_cluster",
            "emit_one_cta",
            "update_one_cta",
        ],
        matmul: MatmulKind::NotMatmul,
        run_point: decode_point,
        headline: &["emit"],
        targets: &[],
        params: &["batch", "kind", "ratio"],
        check_point: Some(check_decode),
    }]
}

fn shape(s: &Sweep, batch: u64) -> Result<CompressorShape> {
    if s.axis != "batch" {
        bail!(
            "the axis must be `batch` (with `kind` and `ratio` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    if !(1..=65535).contains(&batch) {
        bail!("batch {batch} (1..=65535)");
    }
    let kind = match s.param_str("kind")? {
        "csa_main" => CompressorKind::CsaMain,
        "hca_main" => CompressorKind::HcaMain,
        "csa_index_fp8" => CompressorKind::CsaIndex(KeyFormat::Fp8),
        "csa_index_mxfp4" => CompressorKind::CsaIndex(KeyFormat::Mxfp4),
        k => bail!(
            "compressor: unknown kind `{k}` (csa_main, hca_main, csa_index_fp8, csa_index_mxfp4)"
        ),
    };
    let shape = CompressorShape {
        kind,
        ratio: s.param_u64("ratio")? as usize,
    };
    shape.check()?;
    Ok(shape)
}

fn check_decode(s: &Sweep, batch: u64) -> Result<()> {
    shape(s, batch).map(|_| ())
}

fn decode_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, batch: u64) -> Result<Vec<Row>> {
    let (step, grid) = match variant {
        "emit" => (StepKind::Emit, None),
        "update" => (StepKind::Update, None),
        "emit_cluster" => (StepKind::Emit, Some(DecodeGrid::Cluster)),
        "update_cluster" => (StepKind::Update, Some(DecodeGrid::Cluster)),
        "emit_one_cta" => (StepKind::Emit, Some(DecodeGrid::OneCta)),
        "update_one_cta" => (StepKind::Update, Some(DecodeGrid::OneCta)),
        v => bail!("compressor_decode: unknown variant `{v}`"),
    };
    let sh = shape(s, batch)?;
    let m = hooks::decode_point(
        ctx.gpu,
        |b| ctx.plan(b),
        &sh,
        batch as usize,
        step,
        grid,
        ctx.seed,
    )?;
    let sum = Summary::of(&m.samples_us)?;
    Ok(vec![Row::new(
        "compressor_decode",
        variant,
        &s.shape_label(batch),
    )
    .with_timing(&sum, m.samples_us.len() as u64)
    .with_work(Some(m.bytes), None)
    .with_tokens(batch)])
}
