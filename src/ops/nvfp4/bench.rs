//! Bench hooks of the nvfp4 family (default suite): `copy` (the bandwidth reference, memcpy and a 16-byte
//! copy kernel), `nvfp4_quantize_rows` (BF16 rows in) and `nvfp4_dequantize_rows` (BF16 rows out).

use anyhow::Result;
use half::bf16;

use super::{copy_u128, dequantize_rows_into, quantize_rows_into, Nvfp4Device, RowsInput};
use crate::bench::config::Sweep;
use crate::bench::runner::{BenchCtx, BenchKernel};
use crate::bench::{MatmulKind, Row, Summary};
use crate::gpu::drv;
use crate::ops::inputs;

pub fn kernels() -> Vec<BenchKernel> {
    vec![
        BenchKernel {
            name: "copy",
            variants: &["memcpy", "kernel"],
            matmul: MatmulKind::NotMatmul,
            run_point: copy_point,
            headline: &[],
            targets: &[],
        },
        BenchKernel {
            name: "nvfp4_quantize_rows",
            variants: &["bf16_in"],
            matmul: MatmulKind::NotMatmul,
            run_point: quantize_point,
            headline: &[],
            targets: &[],
        },
        BenchKernel {
            name: "nvfp4_dequantize_rows",
            variants: &["bf16_out"],
            matmul: MatmulKind::NotMatmul,
            run_point: dequantize_point,
            headline: &[],
            targets: &[],
        },
    ]
}

fn copy_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, bytes: u64) -> Result<Vec<Row>> {
    let gpu = ctx.gpu;
    let n = (bytes as usize).div_ceil(16) * 16;
    let mut src = gpu.zeros::<u8>(n)?;
    gpu.fill_bytes(&mut src, 0x3C)?;
    let mut dst = gpu.zeros::<u8>(n)?;
    let plan = ctx.plan(2 * n as u64);
    let samples = match variant {
        "memcpy" => gpu.time_us(plan, || {
            drv(gpu.stream.memcpy_dtod(&src, &mut dst), "memcpy_dtod")
        })?,
        _ => gpu.time_us(plan, || copy_u128(gpu, &src, &mut dst))?,
    };
    let sum = Summary::of(&samples)?;
    Ok(vec![Row::new("copy", variant, &s.shape_label(bytes))
        .with_timing(&sum, samples.len() as u64)
        .with_work(Some(2 * n as u64), None)])
}

fn quantize_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let gpu = ctx.gpu;
    let cols = s.param_u64("cols")? as usize;
    let rows_u = rows as usize;
    let x: Vec<bf16> = inputs::activation_rows(rows_u, cols, ctx.seed)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let dx = gpu.upload(&x)?;
    let mut q = Nvfp4Device::alloc(gpu, rows_u, cols)?;
    let bytes = (rows_u * cols * 2 + Nvfp4Device::bytes(rows_u, cols)) as u64;
    let samples = gpu.time_us(ctx.plan(bytes), || {
        quantize_rows_into(gpu, RowsInput::Bf16(&dx), &mut q)
    })?;
    let sum = Summary::of(&samples)?;
    Ok(vec![Row::new(
        "nvfp4_quantize_rows",
        variant,
        &s.shape_label(rows),
    )
    .with_rows(rows)
    .with_cols(cols as u64)
    .with_timing(&sum, samples.len() as u64)
    .with_work(Some(bytes), None)])
}

fn dequantize_point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, rows: u64) -> Result<Vec<Row>> {
    let gpu = ctx.gpu;
    let cols = s.param_u64("cols")? as usize;
    let rows_u = rows as usize;
    let x = inputs::activation_rows(rows_u, cols, ctx.seed);
    let q = crate::formats::nvfp4::quantize_rows(&x, rows_u, cols)?;
    let dq = Nvfp4Device::upload(gpu, &q)?;
    let mut out = gpu.zeros::<bf16>(rows_u * cols)?;
    let bytes = (rows_u * cols * 2 + Nvfp4Device::bytes(rows_u, cols)) as u64;
    let samples = gpu.time_us(ctx.plan(bytes), || dequantize_rows_into(gpu, &dq, &mut out))?;
    let sum = Summary::of(&samples)?;
    Ok(vec![Row::new(
        "nvfp4_dequantize_rows",
        variant,
        &s.shape_label(rows),
    )
    .with_rows(rows)
    .with_cols(cols as u64)
    .with_timing(&sum, samples.len() as u64)
    .with_work(Some(bytes), None)])
}
