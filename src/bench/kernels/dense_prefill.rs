//! Sweep adapter of the FP8 dense linear at prefill sizes (`dense_prefill`: axis `tokens`, parameters `n`, `k` and
//! `linear`, the name of the model's weight for the label). One point = `y[m, n] = x[m, k] . W[n, k]^T`, BF16 out.
//! Variants:
//! * `cublaslt_block_scaled`: the routed path, [`fp8_linear_prefill`] (the 1x128 activation-scale conversion plus
//!   cuBLASLt's block-scaled FP8 GEMM, 128x128 f32 weight scales converted at load), plain stream launches.
//! * `cublaslt_bf16`: weights and activations dequantized to BF16 beforehand (not timed: an optimistic baseline)
//!   and one cuBLASLt BF16 GEMM.
//! * `cublaslt_fp8_tensorwide`: the same FP8 codes with per-tensor scales, one cuBLASLt FP8 GEMM: what FP8 costs
//!   without block scales (the kind of GEMM the limits probe times).
//!
//! The kernel is held to the FP8 matmul rate measured in the same run (`pct_matmul`; target >= 70% at >= 4096
//! tokens) and raced against `cublaslt_bf16` (the `speedup` column). Inputs are random codes of the point's seed
//! (ue8m0 scales near 1, no NaN codes): timing does not depend on the values.

use anyhow::{bail, Result};
use half::bf16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::bench::config::Sweep;
use crate::bench::hook::{BenchCtx, BenchKernel, PlotTarget};
use crate::bench::{MatmulKind, Row, Summary};
use crate::gpu::arena::Arena;
use crate::gpu::blas::{Blas, BlockScaledShape, GemmInput};
use crate::model::weights::fp8_code;
use crate::ops::dense::prefill::{fp8_linear_prefill, DeviceFp8Weight, Fp8LinearWorkspace};

const VARIANTS: &[&str] = &[
    "cublaslt_block_scaled",
    "cublaslt_bf16",
    "cublaslt_fp8_tensorwide",
];

/// The routed path and the baseline its speed-up is read against.
const HEADLINE: &[&str] = &["cublaslt_block_scaled", "cublaslt_bf16"];

const TARGETS: &[PlotTarget] = &[PlotTarget {
    metric: "pct_matmul",
    value: 70.0,
    label: "target: prefill >= 4096 tokens >= 70% of the FP8 rate",
}];

pub fn kernels() -> Vec<BenchKernel> {
    vec![BenchKernel {
        name: "dense_prefill",
        variants: VARIANTS,
        matmul: MatmulKind::Fp8,
        run_point: point,
        headline: HEADLINE,
        targets: TARGETS,
        params: &["tokens", "n", "k", "linear"],
        check_point: Some(check),
    }]
}

fn shape(s: &Sweep, tokens: u64) -> Result<(usize, usize, usize)> {
    if s.axis != "tokens" {
        bail!(
            "the axis must be `tokens` (with `n`, `k` and `linear` in [sweep.params]), not `{}`",
            s.axis
        );
    }
    s.param_str("linear")?;
    let (m, n, k) = (
        tokens as usize,
        s.param_u64("n")? as usize,
        s.param_u64("k")? as usize,
    );
    if m == 0 {
        bail!("tokens = 0");
    }
    // The GEMM's rules on n and k (and on the in-place rows; the tail is staged).
    BlockScaledShape { m: 4, n, k }.check()?;
    Ok((m, n, k))
}

fn check(s: &Sweep, tokens: u64) -> Result<()> {
    shape(s, tokens).map(|_| ())
}

/// `len` random e4m3 codes (NaN codes replaced as the synthetic checkpoint does).
fn fp8_codes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rng.fill_bytes(&mut v);
    for b in &mut v {
        *b = fp8_code(*b);
    }
    v
}

/// `len` ue8m0 codes of 2^-2 .. 2^2.
fn scale_codes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.random_range(125u8..=129)).collect()
}

/// `len` BF16 values in [-1, 1), as bytes.
fn bf16_bytes(rng: &mut ChaCha8Rng, len: usize) -> Vec<u8> {
    (0..len)
        .flat_map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())
        .collect()
}

fn point(ctx: &BenchCtx<'_>, s: &Sweep, variant: &str, tokens: u64) -> Result<Vec<Row>> {
    let (m, n, k) = shape(s, tokens)?;
    let gpu = ctx.gpu;
    let mut rng = ChaCha8Rng::seed_from_u64(ctx.seed);
    let blas = Blas::new(gpu)?;
    let flops = (2 * m * n * k) as u64;
    let (samples, bytes) = match variant {
        "cublaslt_block_scaled" => {
            let w = DeviceFp8Weight::upload(
                gpu,
                &fp8_codes(&mut rng, n * k),
                &scale_codes(&mut rng, n.div_ceil(128) * (k / 128)),
                n,
                k,
            )?;
            let x = gpu.upload(&fp8_codes(&mut rng, m * k))?;
            let xs = gpu.upload(&scale_codes(&mut rng, m * (k / 128)))?;
            let y = gpu.zeros::<bf16>(m * n)?;
            let cub = Fp8LinearWorkspace::cublas_bytes_for(&blas, n, k, &[m])?;
            let mut arena = Arena::for_layout(gpu, &Fp8LinearWorkspace::layout(m, n, k, cub))?;
            let ws = Fp8LinearWorkspace::carve(&mut arena, m, n, k, cub)?;
            let view = w.view();
            // Codes and scales read, BF16 written.
            let bytes = m * k + m * (k / 128) + n * k + 4 * w.scales.len() + 2 * m * n;
            let samples = gpu.time_us(ctx.plan(bytes as u64), || {
                fp8_linear_prefill(gpu, &gpu.stream, &blas, m, &x, &xs, &view, &ws, &y)
            })?;
            (samples, bytes)
        }
        "cublaslt_bf16" | "cublaslt_fp8_tensorwide" => {
            let kind = if variant == "cublaslt_bf16" {
                GemmInput::Bf16
            } else {
                GemmInput::Fp8E4m3
            };
            let (a, b) = match kind {
                GemmInput::Bf16 => (bf16_bytes(&mut rng, m * k), bf16_bytes(&mut rng, n * k)),
                GemmInput::Fp8E4m3 => (fp8_codes(&mut rng, m * k), fp8_codes(&mut rng, n * k)),
            };
            let a = gpu.upload(&a)?;
            let b = gpu.upload(&b)?;
            let mut y = gpu.zeros::<bf16>(m * n)?;
            let bytes = (m * k + n * k) * kind.bytes() + 2 * m * n;
            let samples = gpu.time_us(ctx.plan(bytes as u64), || {
                blas.gemm_tn_on(&gpu.stream, kind, m, n, k, &a, &b, &mut y, 1.0)
            })?;
            (samples, bytes)
        }
        v => bail!("dense_prefill: unknown variant `{v}`"),
    };
    let sum = Summary::of(&samples)?;
    let row = Row::new("dense_prefill", variant, &s.shape_label(tokens))
        .with_tokens(tokens)
        .with_rows(m as u64)
        .with_cols(n as u64)
        .with_timing(&sum, samples.len() as u64)
        .with_work(Some(bytes as u64), Some(flops));
    Ok(vec![if variant == "cublaslt_bf16" {
        row
    } else {
        row.with_baseline("cublaslt_bf16")
    }])
}
