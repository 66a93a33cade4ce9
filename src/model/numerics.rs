//! Scalar and vector numerics shared by the reference decode: BF16 rounding, RMSNorm, the simulated
//! FP8/FP4 quantization of arch §2, the Walsh-Hadamard transform, RoPE/YaRN tables, and a threaded
//! mat-vec. Every function states the rounding it performs.

use anyhow::Result;
use half::bf16;

/// Rounds an f32 to the nearest BF16 (ties to even) and back: the reference's BF16 storage points.
#[inline]
pub fn bf16_round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Rounds every element to BF16 in place.
pub fn bf16_round_slice(x: &mut [f32]) {
    for v in x {
        *v = bf16_round(*v);
    }
}

/// RMSNorm in FP32: y = w * x / sqrt(mean(x^2) + eps), then rounded to BF16 (the input dtype).
pub fn rms_norm_bf16(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    rms_scale_bf16(x, weight, inv_rms(x, eps))
}

/// The scaling step of [`rms_norm_bf16`] with the factor `inv` given: `bf16(w * (x * inv))`, two f32 products.
pub fn rms_scale_bf16(x: &[f32], weight: &[f32], inv: f32) -> Vec<f32> {
    x.iter()
        .zip(weight)
        .map(|(&v, &w)| bf16_round(w * (v * inv)))
        .collect()
}

/// 1 / sqrt(mean(x^2) + eps), accumulated in f64 so the value does not depend on summation order at f32
/// precision (the GPU's order differs anyway; this is the most faithful scalar).
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / ((ss / x.len() as f64) + eps as f64).sqrt()) as f32
}

/// Rounds an f64 to the nearest BF16 (ties to even) in one step, returned as f32. (`half::bf16::from_f64` drops
/// the f64's low 32 mantissa bits before it rounds, so a value just above a BF16 midpoint would round as a tie.)
/// The f64 goes to f32 by round-to-odd first: f32 keeps 16 more bits than BF16, so the second rounding sees the
/// same side of every BF16 midpoint as the exact value does, and is the correct one.
pub fn bf16_round_f64(x: f64) -> f32 {
    let t = x as f32;
    if t as f64 == x || x.is_nan() {
        return bf16_round(t);
    }
    // Inexact: the f32 truncation of x (toward zero), then its last bit set.
    let trunc = if t.is_infinite() {
        f32::MAX.copysign(t)
    } else if (t as f64).abs() > x.abs() {
        f32::from_bits(t.to_bits() - 1)
    } else {
        t
    };
    bf16_round(f32::from_bits(trunc.to_bits() | 1))
}

/// `1 / sqrt(x)` correctly rounded to f32 (round to nearest even; CUDA's `__frsqrt_rn`) for `x` a BF16 value at
/// least 2^-126: computed as f64 square root and division, then rounded to f32. The f64 value is within 2^-52
/// relative of the exact one, and no such `x` has `1 / sqrt(x)` that close to an f32 midpoint (checked for every
/// positive normal BF16 value in tests/model_numerics.rs).
pub fn rsqrt_f32_rn(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

/// The RMS factor of one attention query head in DeepSeek-V4's own operation order: the official code runs
/// `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)` on a BF16 head `q`, and PyTorch computes each op
/// on a BF16 tensor in f32 and rounds its result to BF16. So, for the head `x` (BF16 values):
/// 1. `s_i = bf16(x_i * x_i)` (the f32 product of two BF16 values is exact: one rounding);
/// 2. `m = bf16(sum(s) / n)`: the sum in f64 (exact while the squares span fewer than 36 binades), divided by
///    `n` (exact for a power of two such as 512) and rounded once ([`bf16_round_f64`]). PyTorch accumulates in
///    f32 in its own order: with at most k roundings on any term's path that sum is within k 2^-24 relative of
///    the exact one (all terms are >= 0), so its BF16 mean differs from this one only where the exact sum lies
///    within k 2^-24 relative of a BF16 rounding midpoint (BF16 steps are 2^-8 to 2^-7 relative apart);
/// 3. `e = bf16(m + eps)`, the sum in f32 (eps as f32);
/// 4. `r = bf16(rsqrt(e))`, the reciprocal square root correctly rounded to f32 ([`rsqrt_f32_rn`]), then BF16.
///
/// Returns `r` (a BF16 value). The head is then `bf16(x_i * r)`: one rounding, since the f32 product of two BF16
/// values is exact. Against the f64 factor [`inv_rms`], `r` moves a query value by about one BF16 step on some
/// inputs; this order is the one the official inference code computes.
pub fn head_rms_scale_bf16(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| bf16_round(v * v) as f64).sum();
    let m = bf16_round_f64(ss / x.len() as f64);
    let e = bf16_round(m + eps);
    bf16_round(rsqrt_f32_rn(e))
}

/// FP8 e4m3 simulated quantization in place, per `block` contiguous values (arch §2): the DSV4 rule of
/// [`crate::formats::fp8::fp8_sim`] (scale 2^ceil(log2(amax/448)), amax floored at 1e-4, real e4m3
/// round trip). Non-finite input is an error.
pub fn fp8_sim_inplace(x: &mut [f32], block: usize) -> Result<()> {
    crate::formats::fp8::fp8_sim(x, block)
}

/// FP4 e2m1 simulated quantization in place, per `block` values: [`crate::formats::mxfp4::fp4_sim`]
/// (scale 2^ceil(log2(amax/6)), amax floored at 6 * 2^-126).
pub fn fp4_sim_inplace(x: &mut [f32], block: usize) -> Result<()> {
    crate::formats::mxfp4::fp4_sim(x, block)
}

/// The activation side of an FP8 (or FP4-weight) linear: BF16 input quantized per 128 channels to e4m3
/// with a power-of-two scale; returns the dequantized values (exact products code * 2^k).
pub fn fp8_act_quant(x: &[f32]) -> Result<Vec<f32>> {
    let mut q = x.to_vec();
    fp8_sim_inplace(&mut q, 128)?;
    Ok(q)
}

/// Orthonormal Walsh-Hadamard transform in natural (Sylvester) order, scaled by 1/sqrt(n); n a power of
/// two. Computed with the butterfly in f32.
pub fn hadamard_inplace(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    for v in x {
        *v *= s;
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// softplus(x) = ln(1 + e^x), evaluated without overflow.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Dot product with f32 accumulation in index order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    // 8 independent partial sums so the compiler vectorizes; the order differs from a serial sum only
    // at f32 rounding level.
    for i in (0..n8).step_by(8) {
        for k in 0..8 {
            acc[k] += a[i + k] * b[i + k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Cosine similarity in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    if aa == 0.0 && bb == 0.0 {
        return 1.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// Root mean square in f64.
pub fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// Number of worker threads the reference runs on (rayon's global pool: all cores unless
/// `RAYON_NUM_THREADS` says otherwise).
pub fn num_threads() -> usize {
    rayon::current_num_threads()
}

/// `f(i)` for i in 0..n on rayon's pool, results in index order. Every `f(i)` is computed whole by one
/// thread, so the result is bit-identical to the sequential `(0..n).map(f)` whatever the thread count:
/// only independent outputs are spread over threads, never the terms of one reduction. Nested calls (an
/// outer loop over tokens, an inner mat-vec) share the pool by work stealing instead of oversubscribing it.
pub fn par_map<T: Send, F: Fn(usize) -> T + Sync + Send>(n: usize, f: F) -> Vec<T> {
    use rayon::prelude::*;
    (0..n).into_par_iter().map(f).collect()
}

/// RoPE table of one layer: per pair i the angular frequency f_i (arch §3.1).
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub freqs: Vec<f64>,
}

impl RopeTable {
    /// θ^(-2i/dim) for i < dim/2, optionally with the DSV4 YaRN blend (no mscale).
    pub fn new(dim: usize, theta: f64, yarn: Option<&super::config::YarnScaling>) -> Self {
        let half = dim / 2;
        let mut freqs: Vec<f64> = (0..half)
            .map(|i| theta.powf(-(2.0 * i as f64) / dim as f64))
            .collect();
        if let Some(y) = yarn {
            // Correction range: the pair index whose wavelength completes `rot` turns over the original
            // context, i.e. dim * ln(orig / (rot * 2π)) / (2 ln θ).
            let corr = |rot: f64| {
                dim as f64
                    * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let low = corr(y.beta_fast).floor().max(0.0);
            let high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
            let high = if high == low { high + 0.001 } else { high };
            for (i, f) in freqs.iter_mut().enumerate() {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                *f = *f / y.factor * ramp + *f * (1.0 - ramp);
            }
        }
        RopeTable { freqs }
    }

    /// Rotates interleaved pairs (x[2i], x[2i+1]) by +pos·f_i (inverse = rotate by -pos·f_i). The angle is
    /// formed in f64 then cos/sin rounded to f32, like a precomputed f32 complex table.
    pub fn apply(&self, x: &mut [f32], pos: usize, inverse: bool) {
        let sign = if inverse { -1.0 } else { 1.0 };
        for (i, &f) in self.freqs.iter().enumerate() {
            let ang = sign * pos as f64 * f;
            let (s, c) = (ang.sin() as f32, ang.cos() as f32);
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = a * s + b * c;
        }
    }
}
