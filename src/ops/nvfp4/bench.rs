//! Measurement hooks of the nvfp4 family: the copy reference (`cuMemcpyDtoD` and the 16-byte copy kernel), BF16
//! rows -> NVFP4 and NVFP4 -> BF16 rows. Each sets up its inputs, times the launches on the GPU's stream with
//! the plan its working set asks for, and returns the samples with the bytes moved. The sweep adapter that
//! turns these into CSV rows is `bench::kernels::nvfp4`.

use anyhow::Result;
use half::bf16;

use super::{copy_u128, dequantize_rows_into, quantize_rows_into, Nvfp4Device, RowsInput};
use crate::gpu::timing::TimingPlan;
use crate::gpu::{drv, Gpu};
use crate::ops::inputs;

/// One measured point: per-repetition device times and the bytes one repetition reads plus writes.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// How a copy of `bytes` bytes is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// `cuMemcpyDtoDAsync`.
    Memcpy,
    /// The `copy_u128` kernel.
    Kernel,
}

/// Copy `bytes` (rounded up to 16) from one device buffer to another; bytes moved = read + written.
/// `plan` gives the timing plan for a working set of that many bytes.
pub fn copy(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    method: CopyMethod,
    bytes: u64,
) -> Result<Measured> {
    let n = (bytes as usize).div_ceil(16) * 16;
    let mut src = gpu.zeros::<u8>(n)?;
    gpu.fill_bytes(&mut src, 0x3C)?;
    let mut dst = gpu.zeros::<u8>(n)?;
    let moved = 2 * n as u64;
    let samples_us = match method {
        CopyMethod::Memcpy => gpu.time_us(plan(moved), || {
            drv(gpu.stream.memcpy_dtod(&src, &mut dst), "memcpy_dtod")
        })?,
        CopyMethod::Kernel => {
            gpu.time_us(plan(moved), || copy_u128(gpu, &gpu.stream, &src, &mut dst))?
        }
    };
    Ok(Measured {
        samples_us,
        bytes: moved,
    })
}

/// Bytes one quantize or dequantize of `rows x cols` moves: the BF16 rows plus the NVFP4 representation.
pub fn rows_bytes(rows: usize, cols: usize) -> u64 {
    (rows * cols * 2 + Nvfp4Device::bytes(rows, cols)) as u64
}

/// Quantize `rows x cols` BF16 activation-like rows (seeded) to NVFP4.
pub fn quantize_bf16_rows(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Measured> {
    let x: Vec<bf16> = inputs::activation_rows(rows, cols, seed)
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    let dx = gpu.upload(&x)?;
    let mut q = Nvfp4Device::alloc(gpu, rows, cols)?;
    let bytes = rows_bytes(rows, cols);
    let samples_us = gpu.time_us(plan(bytes), || {
        quantize_rows_into(gpu, &gpu.stream, RowsInput::Bf16(&dx), &mut q)
    })?;
    Ok(Measured { samples_us, bytes })
}

/// Dequantize `rows x cols` NVFP4 rows (the CPU codec's quantization of seeded activation-like rows) to BF16.
pub fn dequantize_to_bf16(
    gpu: &Gpu,
    plan: impl Fn(u64) -> TimingPlan,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Measured> {
    let x = inputs::activation_rows(rows, cols, seed);
    let q = crate::formats::nvfp4::quantize_rows(&x, rows, cols)?;
    let dq = Nvfp4Device::upload(gpu, &q)?;
    let mut out = gpu.zeros::<bf16>(rows * cols)?;
    let bytes = rows_bytes(rows, cols);
    let samples_us = gpu.time_us(plan(bytes), || {
        dequantize_rows_into(gpu, &gpu.stream, &dq, &mut out)
    })?;
    Ok(Measured { samples_us, bytes })
}
