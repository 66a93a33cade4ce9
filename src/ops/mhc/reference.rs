//! CPU reference of the mHC boundary of DSV4 (reference/dsv4-architecture.md §3.4, §3.5): `hc_pre` (mixes,
//! Sinkhorn, `u`), `hc_post` and `hc_head`. The sub-layer RMSNorm + quantization that follows `hc_pre` is
//! `ops::norm_quant::reference`.
//!
//! Written for clarity; every rounding point is the kernels' (kernels/mhc.cu): mixes `m = rho * (F . x)` with
//! the dot in f64 here (fp32 split-K on the GPU: the only order-dependent step, compared with a tolerance);
//! every later step in f32 with the kernel's order.

use crate::formats::bf16;
use crate::ops::norm_quant::reference::{row_rstd, RMS_EPS};

/// DSV4 `hc_eps`.
pub const HC_EPS: f32 = 1e-6;
/// DSV4 `hc_sinkhorn_iters` (the first iteration is the softmax + column normalization).
pub const SINKHORN_ITERS: usize = 20;
/// Residual streams (`hc_mult`).
pub const HC: usize = 4;
/// Mixes of a sub-layer boundary: 4 pre + 4 post + 16 combination logits.
pub const HC_MIX: usize = 24;
/// Mixes of the final head: 4 pre.
pub const HC_HEAD_MIX: usize = 4;

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// `rho = 1/sqrt(mean(x^2) + eps)` over all 4D values and the raw dots `F . x` (f64 sums rounded to f32).
/// `x` is the token's residual `[4, D]` flattened stream-major, `f` is `[nmix, 4D]`.
pub fn mhc_dots(x: &[f32], f: &[f32], nmix: usize) -> (f32, Vec<f32>) {
    let n = x.len();
    let rho = row_rstd(x, RMS_EPS);
    let dots = (0..nmix)
        .map(|j| {
            f[j * n..(j + 1) * n]
                .iter()
                .zip(x)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum::<f64>() as f32
        })
        .collect();
    (rho, dots)
}

/// 4x4 Sinkhorn of DSV4 (§3.4), in the kernel's order: row softmax + eps, column normalization, then 19
/// rounds of (row, column) normalization. Sums are pairwise, `(a+b)+(c+d)`. Each normalization
/// `c / (sum + eps)` is computed as `c * (1 / (sum + eps))` with a correctly rounded reciprocal (so the
/// kernel needs 4 reciprocals instead of 16 divisions per step, on its latency-critical path); that is at
/// most one extra rounding per step against a true division. `logits` is row-major `[j][k]`.
pub fn sinkhorn(logits: &[f32; 16]) -> [f32; 16] {
    let mut c = [0f32; 16];
    for j in 0..4 {
        let row = &logits[4 * j..4 * j + 4];
        let mx = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let e: Vec<f32> = row.iter().map(|&v| (v - mx).exp()).collect();
        let r = 1.0 / ((e[0] + e[1]) + (e[2] + e[3]));
        for k in 0..4 {
            c[4 * j + k] = e[k] * r + HC_EPS;
        }
    }
    let normalize_cols = |c: &mut [f32; 16]| {
        for k in 0..4 {
            let r = 1.0 / ((c[k] + c[4 + k]) + (c[8 + k] + c[12 + k]) + HC_EPS);
            for j in 0..4 {
                c[4 * j + k] *= r;
            }
        }
    };
    let normalize_rows = |c: &mut [f32; 16]| {
        for j in 0..4 {
            let r = 1.0 / ((c[4 * j] + c[4 * j + 1]) + (c[4 * j + 2] + c[4 * j + 3]) + HC_EPS);
            for k in 0..4 {
                c[4 * j + k] *= r;
            }
        }
    };
    normalize_cols(&mut c);
    for _ in 1..SINKHORN_ITERS {
        normalize_rows(&mut c);
        normalize_cols(&mut c);
    }
    c
}

/// Parameters of one mHC boundary (`hc_attn_*` or `hc_ffn_*`).
#[derive(Debug, Clone)]
pub struct MhcParams {
    /// `hc_*_fn`, f32 [24, 4D].
    pub mix_fn: Vec<f32>,
    /// `hc_*_scale`, f32 [3].
    pub scale: [f32; 3],
    /// `hc_*_base`, f32 [24].
    pub base: [f32; 24],
}

/// What `hc_pre` hands on for one token.
#[derive(Debug, Clone, PartialEq)]
pub struct MhcPre {
    pub pre: [f32; 4],
    pub post: [f32; 4],
    /// Row-major [j][k].
    pub comb: [f32; 16],
}

/// pre/post/comb from rho and the raw dots (f32 ops in the kernel's order: `m = rho * dot`,
/// `z = m * s + b`).
pub fn mhc_coefficients(rho: f32, dots: &[f32], scale: &[f32; 3], base: &[f32; 24]) -> MhcPre {
    let z = |j: usize, s: f32| (rho * dots[j]) * s + base[j];
    let mut pre = [0f32; 4];
    let mut post = [0f32; 4];
    for i in 0..4 {
        pre[i] = sigmoid(z(i, scale[0])) + HC_EPS;
        post[i] = 2.0 * sigmoid(z(4 + i, scale[1]));
    }
    let mut logits = [0f32; 16];
    for (i, l) in logits.iter_mut().enumerate() {
        *l = z(8 + i, scale[2]);
    }
    MhcPre {
        pre,
        post,
        comb: sinkhorn(&logits),
    }
}

/// `u = sum_i pre_i X[i]` in the order `((p0 x0 + p1 x1) + p2 x2) + p3 x3` (no FMA), rounded to BF16.
/// `x` is `[4, D]`.
pub fn mhc_apply_pre(x: &[f32], pre: &[f32; 4]) -> Vec<f32> {
    let d = x.len() / HC;
    (0..d)
        .map(|c| {
            let mut acc = pre[0] * x[c];
            for (i, &p) in pre.iter().enumerate().skip(1) {
                acc += p * x[i * d + c];
            }
            bf16::round(acc)
        })
        .collect()
}

/// Full `hc_pre` of one token: coefficients and the BF16 sub-layer input `u`.
pub fn mhc_pre_token(x: &[f32], p: &MhcParams) -> (MhcPre, Vec<f32>) {
    let (rho, dots) = mhc_dots(x, &p.mix_fn, HC_MIX);
    let c = mhc_coefficients(rho, &dots, &p.scale, &p.base);
    let u = mhc_apply_pre(x, &c.pre);
    (c, u)
}

/// `hc_head` of one token (§3.5): `pre_i = sigmoid(rho * dot_i * s + b_i) + eps`, `u = bf16(sum pre_i X_i)`.
pub fn hc_head_token(
    x: &[f32],
    head_fn: &[f32],
    scale: f32,
    base: &[f32; 4],
) -> ([f32; 4], Vec<f32>) {
    let (rho, dots) = mhc_dots(x, head_fn, HC_HEAD_MIX);
    let mut pre = [0f32; 4];
    for i in 0..4 {
        pre[i] = sigmoid((rho * dots[i]) * scale + base[i]) + HC_EPS;
    }
    let u = mhc_apply_pre(x, &pre);
    (pre, u)
}

/// `hc_post` of one token: `X'[k] = post_k y + sum_j C[j][k] X[j]`, in the order
/// `((((post_k y) + C0k X0) + C1k X1) + C2k X2) + C3k X3` (no FMA), rounded to BF16. `x` is `[4, D]`.
pub fn mhc_post_token(y: &[f32], x: &[f32], post: &[f32; 4], comb: &[f32; 16]) -> Vec<f32> {
    let d = y.len();
    let mut out = vec![0f32; HC * d];
    for k in 0..HC {
        for c in 0..d {
            let mut acc = post[k] * y[c];
            for j in 0..HC {
                acc += comb[4 * j + k] * x[j * d + c];
            }
            out[k * d + c] = bf16::round(acc);
        }
    }
    out
}
