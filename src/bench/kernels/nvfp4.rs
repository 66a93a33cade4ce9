//! Sweep adapter of the nvfp4 family: `copy` (the bandwidth reference: `memcpy` and the 16-byte copy `kernel`,
//! axis `bytes`), `nvfp4_quantize_rows` (BF16 rows in, axis `rows`, parameter `cols`) and
//! `nvfp4_dequantize_rows` (BF16 rows out, same axis and parameter), through the hooks of `ops::nvfp4::bench`.

use anyhow::{bail, Result};

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget, MAX_SIZE};
use crate::bench::{MatmulKind, Row, Summary};
use crate::ops::nvfp4::bench::{self as hooks, CopyMethod, Measured};

/// Every one of these kernels is memory-bound: the copy bandwidth measured in the same run is its ceiling.
const COPY_CEILING: &[PlotTarget] = &[PlotTarget {
    metric: "pct_copy_bw",
    value: 100.0,
    label: "ceiling: copy bandwidth of this run",
}];

pub fn kernels() -> Vec<BenchKernel> {
    vec![
        BenchKernel {
            name: "copy",
            variants: &["memcpy", "kernel"],
            matmul: MatmulKind::NotMatmul,
            run_point: copy_point,
            headline: &["memcpy", "kernel"],
            targets: COPY_CEILING,
            params: &["bytes"],
            check_point: Some(check_copy),
        },
        BenchKernel {
            name: "nvfp4_quantize_rows",
            variants: &["bf16_in"],
            matmul: MatmulKind::NotMatmul,
            run_point: quantize_point,
            headline: &["bf16_in"],
            targets: COPY_CEILING,
            params: &["rows", "cols"],
            check_point: Some(check_rows),
        },
        BenchKernel {
            name: "nvfp4_dequantize_rows",
            variants: &["bf16_out"],
            matmul: MatmulKind::NotMatmul,
            run_point: dequantize_point,
            headline: &["bf16_out"],
            targets: COPY_CEILING,
            params: &["rows", "cols"],
            check_point: Some(check_rows),
        },
    ]
}

/// Source and destination of `bytes` each: no more than [`MAX_SIZE`] in all.
fn check_copy(_s: &Sweep, bytes: u64) -> Result<()> {
    if bytes.saturating_mul(2) > MAX_SIZE {
        bail!("a copy of {bytes} bytes needs twice that on the GPU, more than any GPU holds");
    }
    Ok(())
}

/// The axis is `rows`, `cols` an integer, the shape one the launchers accept, and the bytes of one point
/// (BF16 rows + NVFP4 rows) no more than [`MAX_SIZE`].
fn check_rows(s: &Sweep, rows: u64) -> Result<()> {
    if s.axis != "rows" {
        bail!(
            "the axis must be `rows` (with `cols` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    let cols = s.param_u64("cols")?;
    if rows > i32::MAX as u64 || cols > i32::MAX as u64 {
        bail!("rows = {rows}, cols = {cols}: each must fit in i32 (the kernels' index type)");
    }
    crate::ops::nvfp4::check_shape(rows as usize, cols as usize)?;
    let bytes = hooks::rows_bytes(rows as usize, cols as usize);
    if bytes > MAX_SIZE {
        bail!("{rows} x {cols} rows need {bytes} bytes, more than any GPU holds");
    }
    Ok(())
}

/// One CSV row of a measured point.
fn row(kernel: &str, variant: &str, s: &Sweep, value: u64, m: &Measured) -> Result<Row> {
    let sum = Summary::of(&m.samples_us)?;
    Ok(Row::new(kernel, variant, &s.shape_label(value))
        .with_timing(&sum, m.samples_us.len() as u64)
        .with_work(Some(m.bytes), None))
}

fn copy_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, bytes: u64) -> Result<Vec<Row>> {
    let method = match variant {
        "memcpy" => CopyMethod::Memcpy,
        "kernel" => CopyMethod::Kernel,
        v => bail!("copy: unknown variant `{v}`"),
    };
    let m = hooks::copy(ctx.gpu, |b| ctx.plan(b), method, bytes)?;
    Ok(vec![row("copy", variant, s, bytes, &m)?])
}

fn quantize_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let cols = s.param_u64("cols")?;
    let m = hooks::quantize_bf16_rows(
        ctx.gpu,
        |b| ctx.plan(b),
        rows as usize,
        cols as usize,
        ctx.seed,
    )?;
    Ok(vec![row("nvfp4_quantize_rows", variant, s, rows, &m)?
        .with_rows(rows)
        .with_cols(cols)])
}

fn dequantize_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let cols = s.param_u64("cols")?;
    let m = hooks::dequantize_to_bf16(
        ctx.gpu,
        |b| ctx.plan(b),
        rows as usize,
        cols as usize,
        ctx.seed,
    )?;
    Ok(vec![row("nvfp4_dequantize_rows", variant, s, rows, &m)?
        .with_rows(rows)
        .with_cols(cols)])
}
