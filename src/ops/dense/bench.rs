//! Measurement hooks of the dense family: one decode linear of M rows at a DSV4 shape, timed as plain launches on the
//! GPU's stream. Variants: `dense` (this family's launcher), `cublaslt_bf16` (cuBLASLt BF16 GEMMs on weights
//! dequantized to BF16 beforehand, outside the timing: the baseline a dequantize-then-GEMM path would run per
//! call) and `cublaslt_block_scaled` (cuBLASLt's block-scaled FP8 GEMM on the same FP8 bytes through
//! [`fp8_linear_prefill`], the library baseline #24 names; FP8-activation linears only: fp8, swiglu) and
//! `dense_tensor_cores` (this family's launcher on its tensor-core route, forced: `DenseRoute::TensorCores`, the
//! route's whole cost at every M, scale conversion and tail staging included; fp8 and bf16 only). Both rows carry the bytes the decode op must move (FP8 or BF16 weight + scales, x, y), so `pct_copy_bw`
//! reads as "fraction of copy bandwidth for this op". The sweep adapter is `bench::kernels::dense`.

use anyhow::{bail, Result};
use cudarc::driver::CudaSlice;
use half::bf16;
use rand::Rng;

use super::prefill::{fp8_linear_prefill, weight_scales_f32, DeviceFp8Weight, Fp8LinearWorkspace};
use super::route::{with_route, DenseRoute};
use super::{
    bf16_linear, fp8_linear, plan as dense_plan, swiglu_fp8, wo_a_grouped, Bf16Job, DenseKind,
    DenseShape, DenseWorkspace, Fp8Rows, Fp8Weight, Fp8Weight as W,
};
use crate::gpu::arena::Arena;
use crate::gpu::blas::{Blas, GemmInput};
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::model::weights::fp8_code;
use crate::ops::inputs;

/// Every variant a point can run.
pub const VARIANTS: &[&str] = &[
    "dense",
    "cublaslt_bf16",
    "cublaslt_block_scaled",
    "dense_tensor_cores",
];

/// Whether `variant` can run `linear`: cuBLASLt's block-scaled FP8 GEMM takes FP8 activations and FP8 weights, so
/// not wo_a's BF16 o nor the BF16 weights.
/// `dense_tensor_cores`: the linears that have a tensor-core route (fp8, bf16; not the SwiGLU half nor wo_a).
pub fn variant_applies(linear: Linear, variant: &str) -> bool {
    match variant {
        "cublaslt_block_scaled" => matches!(linear, Linear::Fp8 { .. } | Linear::Swiglu { .. }),
        "dense_tensor_cores" => matches!(linear, Linear::Fp8 { .. } | Linear::Bf16 { .. }),
        _ => true,
    }
}

/// One decode linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linear {
    /// [`fp8_linear`]: FP8 W `[n, k]`.
    Fp8 { n: usize, k: usize },
    /// [`wo_a_grouped`]: `groups` x FP8 `[r, k]` on BF16 o.
    WoA { groups: usize, r: usize, k: usize },
    /// [`swiglu_fp8`]: w1 and w3 `[inter, dim]` (the shared expert's gate/up half).
    Swiglu { inter: usize, dim: usize },
    /// [`bf16_linear`]: `jobs` BF16 W `[n, k]` sharing x.
    Bf16 { n: usize, k: usize, jobs: usize },
}

impl Linear {
    /// Bytes one call must move: weights (+ scales), x read, y written.
    pub fn bytes(&self, m: usize) -> u64 {
        let b = match *self {
            Linear::Fp8 { n, k } => n * k + n * k / 16384 + m * k * 129 / 128 + 2 * m * n,
            Linear::WoA { groups, r, k } => {
                groups * (r * k + r * k / 16384) + 2 * m * groups * k + 2 * m * groups * r
            }
            Linear::Swiglu { inter, dim } => {
                2 * (inter * dim + inter * dim / 16384)
                    + m * dim * 129 / 128
                    + m * inter * 129 / 128
            }
            Linear::Bf16 { n, k, jobs } => jobs * 2 * n * k + 2 * m * k + jobs * 4 * m * n,
        };
        b as u64
    }
    /// The launcher's shape at `m` rows.
    pub fn shape(&self, m: usize) -> DenseShape {
        let (kind, n, k, jobs) = match *self {
            Linear::Fp8 { n, k } => (DenseKind::Fp8, n, k, 1),
            Linear::WoA { groups, r, k } => (DenseKind::Fp8Bf16x, r, k, groups),
            Linear::Swiglu { inter, dim } => (DenseKind::Swiglu, inter, dim, 1),
            Linear::Bf16 { n, k, jobs } => (DenseKind::Bf16, n, k, jobs),
        };
        DenseShape::new(kind, m, n, k, jobs)
    }
}

/// One measured point.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

fn fp8_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut r = inputs::rng(seed);
    (0..n).map(|_| fp8_code(r.random::<u8>())).collect()
}

/// Scale code 120 = 2^-7: finite products for any codes.
const SCALE_CODE: u8 = 120;

/// Seeded FP8 1x128 activation rows `[m, k]` on the device: (codes, scale codes).
fn fp8_rows(gpu: &Gpu, m: usize, k: usize, seed: u64) -> Result<(CudaSlice<u8>, CudaSlice<u8>)> {
    Ok((
        gpu.upload(&fp8_bytes(m * k, seed ^ 1))?,
        gpu.upload(&vec![SCALE_CODE; m * k / 128])?,
    ))
}

fn bf16_vec(n: usize, seed: u64) -> Vec<bf16> {
    inputs::uniform(n, 0.05, seed)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Time `linear` at `m` rows with `variant` on seeded synthetic data.
pub fn measure(
    gpu: &Gpu,
    plan: &dyn Fn(u64) -> TimingPlan,
    linear: Linear,
    m: usize,
    seed: u64,
    variant: &str,
) -> Result<Measured> {
    let shape = linear.shape(m);
    shape.check()?;
    if !variant_applies(linear, variant) {
        bail!("dense: `{variant}` does not run {linear:?} (cublaslt_block_scaled: fp8 and swiglu only; dense_tensor_cores: fp8 and bf16 only)");
    }
    let bytes = linear.bytes(m);
    let samples_us = match variant {
        "dense" => time_dense(gpu, plan, linear, m, seed, bytes)?,
        "cublaslt_bf16" => time_cublaslt(gpu, plan, linear, m, bytes)?,
        "cublaslt_block_scaled" => time_block_scaled(gpu, plan, linear, m, seed, bytes)?,
        // The launcher on its tensor-core route (ops::dense::route), forced at every M: the workspace is carved
        // inside, so it records the route.
        "dense_tensor_cores" => with_route(DenseRoute::TensorCores, || {
            time_dense(gpu, plan, linear, m, seed, bytes)
        })?,
        v => bail!("dense: unknown variant `{v}` (known: {VARIANTS:?})"),
    };
    Ok(Measured { samples_us, bytes })
}

fn time_dense(
    gpu: &Gpu,
    plan: &dyn Fn(u64) -> TimingPlan,
    linear: Linear,
    m: usize,
    seed: u64,
    bytes: u64,
) -> Result<Vec<f64>> {
    let sms = gpu.info.sm_count as usize;
    let shape = linear.shape(m);
    dense_plan(&shape, sms)?;
    let layout = super::workspace_layout(&[shape], sms)?;
    let mut arena = Arena::for_layout(gpu, &layout)?;
    let ws = DenseWorkspace::carve(&mut arena, &gpu.stream, &[shape], sms)?;
    // The cuBLASLt handle, when the workspace has the tensor-core route, before the timing.
    ws.prepare(gpu)?;
    let scales = |n: usize| gpu.upload(&vec![SCALE_CODE; n]);
    match linear {
        Linear::Fp8 { n, k } => {
            let (wc, ws_) = (gpu.upload(&fp8_bytes(n * k, seed))?, scales(n * k / 16384)?);
            // The f32 scales the tensor-core route reads (the GEMV ignores them).
            let wsf = gpu.upload(&weight_scales_f32(
                &vec![SCALE_CODE; n.div_ceil(128) * k.div_ceil(128)],
                n,
                k,
            )?)?;
            let (xc, xs) = fp8_rows(gpu, m, k, seed)?;
            let y = gpu.zeros::<bf16>(m * n)?;
            let w = W {
                codes: &wc,
                scales: &ws_,
                n,
                k,
                scales_f32: Some(&wsf),
            };
            let x = Fp8Rows {
                codes: &xc,
                scales: &xs,
                rows: m,
                k,
            };
            gpu.time_us(plan(bytes), || {
                fp8_linear(gpu, &gpu.stream, &x, &w, &ws, &y)
            })
        }
        Linear::WoA { groups, r, k } => {
            let n = groups * r;
            let (wc, ws_) = (gpu.upload(&fp8_bytes(n * k, seed))?, scales(n * k / 16384)?);
            let o = gpu.upload(&bf16_vec(m * groups * k, seed ^ 1))?;
            let z = gpu.zeros::<bf16>(m * n)?;
            let w = W {
                codes: &wc,
                scales: &ws_,
                n,
                k,
                scales_f32: None,
            };
            gpu.time_us(plan(bytes), || {
                wo_a_grouped(gpu, &gpu.stream, &o, m, &w, groups, &ws, &z)
            })
        }
        Linear::Swiglu { inter, dim } => {
            let sz = inter * dim;
            let (w1c, w1s) = (gpu.upload(&fp8_bytes(sz, seed))?, scales(sz / 16384)?);
            let (w3c, w3s) = (gpu.upload(&fp8_bytes(sz, seed ^ 2))?, scales(sz / 16384)?);
            let (xc, xs) = fp8_rows(gpu, m, dim, seed)?;
            let hc = gpu.zeros::<u8>(m * inter)?;
            let hs = gpu.zeros::<u8>(m * inter / 128)?;
            let w1 = Fp8Weight {
                codes: &w1c,
                scales: &w1s,
                n: inter,
                k: dim,
                scales_f32: None,
            };
            let w3 = Fp8Weight {
                codes: &w3c,
                scales: &w3s,
                n: inter,
                k: dim,
                scales_f32: None,
            };
            let x = Fp8Rows {
                codes: &xc,
                scales: &xs,
                rows: m,
                k: dim,
            };
            gpu.time_us(plan(bytes), || {
                swiglu_fp8(gpu, &gpu.stream, &x, &w1, &w3, 10.0, &ws, &hc, &hs)
            })
        }
        Linear::Bf16 { n, k, jobs } => {
            let x = gpu.upload(&bf16_vec(m * k, seed ^ 1))?;
            let mut ws_and_ys = Vec::new();
            for j in 0..jobs {
                ws_and_ys.push((
                    gpu.upload(&bf16_vec(n * k, seed + j as u64))?,
                    gpu.zeros::<f32>(m * n)?,
                ));
            }
            let jl: Vec<Bf16Job> = ws_and_ys.iter().map(|(w, y)| Bf16Job { w, n, y }).collect();
            gpu.time_us(plan(bytes), || {
                bf16_linear(gpu, &gpu.stream, &x, m, k, &jl, &ws)
            })
        }
    }
}

/// The GEMMs (m, n, k) a dequantize-then-cuBLASLt path runs for `linear`.
fn gemms(linear: Linear, m: usize) -> Vec<(usize, usize, usize)> {
    match linear {
        Linear::Fp8 { n, k } => vec![(m, n, k)],
        Linear::WoA { groups, r, k } => vec![(m, r, k); groups],
        Linear::Swiglu { inter, dim } => vec![(m, 2 * inter, dim)],
        Linear::Bf16 { n, k, jobs } => vec![(m, n, k); jobs],
    }
}

fn time_cublaslt(
    gpu: &Gpu,
    plan: &dyn Fn(u64) -> TimingPlan,
    linear: Linear,
    m: usize,
    bytes: u64,
) -> Result<Vec<f64>> {
    let blas = Blas::new(gpu)?;
    let mut bufs = Vec::new();
    for (mm, n, k) in gemms(linear, m) {
        bufs.push((
            mm,
            n,
            k,
            gpu.zeros::<u8>(mm * k * 2)?,
            gpu.zeros::<u8>(n * k * 2)?,
            gpu.zeros::<bf16>(mm * n)?,
        ));
    }
    gpu.time_us(plan(bytes), || {
        for (mm, n, k, a, b, d) in bufs.iter_mut() {
            blas.gemm_tn(gpu, GemmInput::Bf16, *mm, *n, *k, a, b, d, 1.0)?;
        }
        Ok(())
    })
}

/// cuBLASLt's block-scaled FP8 GEMM (`dense::prefill`, any M through its 4-row tail) on the FP8 weight(s) of
/// `linear`: one GEMM for fp8, w1 and w3 for swiglu (without the SwiGLU epilogue, which cuBLASLt has not).
fn time_block_scaled(
    gpu: &Gpu,
    plan: &dyn Fn(u64) -> TimingPlan,
    linear: Linear,
    m: usize,
    seed: u64,
    bytes: u64,
) -> Result<Vec<f64>> {
    let (n, k, count) = match linear {
        Linear::Fp8 { n, k } => (n, k, 1u64),
        Linear::Swiglu { inter, dim } => (inter, dim, 2),
        other => bail!("dense: cublaslt_block_scaled does not run {other:?}"),
    };
    let blas = Blas::new(gpu)?;
    let scale_codes = vec![SCALE_CODE; n.div_ceil(128) * k.div_ceil(128)];
    let weights = (0..count)
        .map(|i| {
            DeviceFp8Weight::upload(gpu, &fp8_bytes(n * k, seed ^ (2 * i)), &scale_codes, n, k)
        })
        .collect::<Result<Vec<_>>>()?;
    let cublas = Fp8LinearWorkspace::cublas_bytes_for(&blas, n, k, &[m])?;
    let mut arena = Arena::for_layout(gpu, &Fp8LinearWorkspace::layout(m, n, k, cublas))?;
    let ws = Fp8LinearWorkspace::carve(&mut arena, m, n, k, cublas)?;
    let (xc, xs) = fp8_rows(gpu, m, k, seed)?;
    let ys = (0..count)
        .map(|_| gpu.zeros::<bf16>(m * n))
        .collect::<Result<Vec<_>>>()?;
    let views: Vec<_> = weights.iter().map(|w| w.view()).collect();
    gpu.time_us(plan(bytes), || {
        for (w, y) in views.iter().zip(&ys) {
            fp8_linear_prefill(gpu, &gpu.stream, &blas, m, &xc, &xs, w, &ws, y)?;
        }
        Ok(())
    })
}
