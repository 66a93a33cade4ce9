//! Glue between the dense launchers and the CPU model (src/model is the oracle): the per-row calls of the model's
//! own functions (`Model::fp8_linear`, `Model::expert`, `Weights::matvec` / `matvec_rows` as `Model::out_proj` uses
//! them), the sums of |terms| the tests' error bounds need, and the checkpoint bytes a GPU call uploads.

use anyhow::Result;

use crate::model::numerics::{bf16_round, bf16_round_slice};
use crate::model::reference::Model;
use crate::model::weights::Weights;

/// f32 unit roundoff (2^-24).
pub const F32_U: f64 = 1.0 / 16_777_216.0;

/// `Model::fp8_linear(name, row)` for each of the `rows` BF16 rows of `x` (`[rows, K]`), concatenated.
pub fn fp8_linear_rows(model: &Model, name: &str, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let k = x.len() / rows;
    let mut y = Vec::new();
    for r in 0..rows {
        y.extend(model.fp8_linear(name, &x[r * k..(r + 1) * k])?);
    }
    Ok(y)
}

/// `Model::out_proj`'s grouped first half for each row of `o` (`[rows, groups * gw]`): group g's rows
/// `g*r .. (g+1)*r` of `name` times `o[g*gw .. (g+1)*gw]`, BF16-rounded; `[rows, groups * r]`.
pub fn wo_a_rows(
    weights: &Weights,
    name: &str,
    o: &[f32],
    rows: usize,
    groups: usize,
    r: usize,
) -> Result<Vec<f32>> {
    let gw = o.len() / rows / groups;
    let mut z = Vec::new();
    for m in 0..rows {
        let om = &o[m * groups * gw..(m + 1) * groups * gw];
        for g in 0..groups {
            let mut zg = weights.matvec_rows(name, g * r, r, &om[g * gw..(g + 1) * gw])?;
            bf16_round_slice(&mut zg);
            z.extend(zg);
        }
    }
    Ok(z)
}

/// `Weights::matvec(name, row)` (f32, unrounded) for each row of `x`.
pub fn matvec_rows(weights: &Weights, name: &str, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let k = x.len() / rows;
    let mut y = Vec::new();
    for r in 0..rows {
        y.extend(weights.matvec(name, &x[r * k..(r + 1) * k])?);
    }
    Ok(y)
}

/// `Model::expert(prefix, fp8_act_quant(row), 1.0)` (the shared expert) for each BF16 row of `x`.
pub fn shared_expert_rows(model: &Model, prefix: &str, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let k = x.len() / rows;
    let mut y = Vec::new();
    for r in 0..rows {
        let xq = crate::model::numerics::fp8_act_quant(&x[r * k..(r + 1) * k])?;
        y.extend(model.expert(prefix, &xq, 1.0)?);
    }
    Ok(y)
}

/// `sum_k |W[r0 + i, k]| * |x[m, k]|` (f64) for rows `r0 .. r0 + n` of `name` and each row of `x` (`[rows, K]`,
/// K = the weight's columns): the scale of a dot product's rounding error. `[rows, n]`. Reads the dequantized
/// matrix through the weights' cache (the CPU oracle's `matvec` cached it already under `CachePolicy::All`).
pub fn abs_term_sums(
    weights: &Weights,
    name: &str,
    r0: usize,
    n: usize,
    x: &[f32],
    rows: usize,
) -> Result<Vec<f64>> {
    let w = weights.matrix(name)?;
    let k = w.cols;
    let mut out = Vec::with_capacity(rows * n);
    for m in 0..rows {
        let xm = &x[m * k..(m + 1) * k];
        for i in 0..n {
            out.push(
                w.row(r0 + i)
                    .iter()
                    .zip(xm)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum(),
            );
        }
    }
    Ok(out)
}

/// One BF16 unit in the last place of `v` (2^(e - 7) for |v| in [2^e, 2^(e+1)); the smallest normal's for 0).
pub fn bf16_ulp(v: f32) -> f64 {
    let a = (v.abs() as f64).max(f32::MIN_POSITIVE as f64);
    2f64.powi(a.log2().floor() as i32 - 7)
}

/// The error bound of one GPU output against the CPU model's: both are f32 sums of the same exact products (e4m3 x
/// e4m3 and BF16 x BF16 products are exact in f32; the power-of-two scales are exact) in different orders. An f32
/// sum of K terms is within (K - 1) u sum|terms| of the exact sum; the GPU's tensor-core block sums may truncate
/// instead of rounding (2u per add): both sides together within 3 K u sum|terms|, doubled for margin, plus one
/// BF16 ulp when the output is BF16-rounded (the two sums may round to neighbouring BF16 values).
pub fn tolerance(want: f32, abs_terms: f64, k: usize, bf16_out: bool) -> f64 {
    let sum_err = 6.0 * k as f64 * F32_U * abs_terms;
    if bf16_out {
        sum_err + bf16_ulp(want)
    } else {
        sum_err
    }
}

/// The first element outside its [`tolerance`] as (index, got, want, bound), or None.
pub fn first_outside(
    got: &[f32],
    want: &[f32],
    abs_terms: &[f64],
    k: usize,
    bf16_out: bool,
) -> Option<(usize, f32, f32, f64)> {
    (0..want.len()).find_map(|i| {
        let tol = tolerance(want[i], abs_terms[i], k, bf16_out);
        let ok = got[i].is_finite() && (got[i] as f64 - want[i] as f64).abs() <= tol;
        (!ok).then_some((i, got[i], want[i], tol))
    })
}

/// BF16 rows as f32 values (the inputs the CPU model reads).
pub fn bf16_values(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16_round(x)).collect()
}
