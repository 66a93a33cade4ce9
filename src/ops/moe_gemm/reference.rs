//! CPU reference of the NVFP4 MoE grouped GEMM, written for clarity.
//!
//! `D[m, n] = gsa[m] * gsb[e, n] * sum_k A[m, k] * B[e, n, k]` for every row `m` that expert `e` owns.
//! Every NVFP4 element value `e2m1 * s_e4m3` is exact in f32 (and in BF16), every product of two such values
//! (or of one and a BF16 activation) is exact in f64, and a K <= 2^20 sum of them in f64 is exact to ~2^-53
//! relative, so the f64 results here are "the exact answer" that the GPU's fp32 accumulation is compared to.
//!
//! [`quantize_rows_nvfp4`] is `formats::nvfp4::quantize_rows` in this module's row type (field names that
//! say what the kernel reads); it builds test weights/activations and checks the L1 epilogue bit for bit.

use std::ops::Range;

use anyhow::{bail, ensure, Result};
use half::bf16;

use crate::formats::mxfp4::{self, ConversionReport, Mxfp4Matrix};
use crate::formats::{e2m1, e4m3, nvfp4};

/// Block size of NVFP4 along K.
pub const NVFP4_BLOCK: usize = 16;
/// Largest |value| an NVFP4 element can represent relative to its global scale: 6 (e2m1) * 448 (e4m3).
pub const NVFP4_RANGE: f32 = 6.0 * 448.0;
/// DSV4 SwiGLU clamp (`swiglu_limit`): gate <= 10 (above only), up in [-10, 10].
pub const SWIGLU_LIMIT: f32 = 10.0;

/// Rows of NVFP4 values: two e2m1 codes per byte (lower K index in the low nibble), one e4m3 scale per 16
/// along K, one fp32 global scale per row. Value = (e2m1 * e4m3) * global, with `e2m1 * e4m3` exact.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Rows {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes.
    pub codes: Vec<u8>,
    /// `rows * cols / 16` e4m3 codes.
    pub scales: Vec<u8>,
    /// `rows` fp32 global scales.
    pub global: Vec<f32>,
}

impl Nvfp4Rows {
    /// `e2m1 * s_e4m3` of element (r, c): the part the GEMM multiplies (exact in f32 and BF16).
    pub fn unscaled(&self, r: usize, c: usize) -> f32 {
        let byte = self.codes[(r * self.cols + c) / 2];
        let code = if c.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        };
        e2m1::decode(code) * e4m3::decode(self.scales[(r * self.cols + c) / NVFP4_BLOCK])
    }

    /// Full value `(e2m1 * s) * global` of every element (f32, row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for c in 0..self.cols {
                out.push(self.unscaled(r, c) * self.global[r]);
            }
        }
        out
    }
}

/// The NVFP4 quantization rule ([`crate::formats::nvfp4::quantize_rows`], mirrored by `nvfp4_*` in
/// kernels/common/formats.cuh): per row `gs = amax / 2688` (1 for an all-zero row); per 16-block
/// `s = e4m3(amax_b / (6 * gs))`, `scale = s * gs`, `code = e2m1(x / scale)` (0 when scale is 0).
pub fn quantize_rows_nvfp4(x: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Rows> {
    Ok(nvfp4::quantize_rows(x, rows, cols)?.into())
}

impl From<nvfp4::Nvfp4Rows> for Nvfp4Rows {
    fn from(q: nvfp4::Nvfp4Rows) -> Nvfp4Rows {
        Nvfp4Rows {
            rows: q.rows,
            cols: q.cols,
            codes: q.data,
            scales: q.scales,
            global: q.global_scale,
        }
    }
}

/// NVFP4 expert weights `B[e, n, k]`: `experts * n` rows of `k` columns, global scale per (expert, row).
/// A per-expert global scale is the special case where all rows of an expert carry the same value.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertWeights {
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    /// Row `e * n + r` of the stacked matrix is weight row `r` of expert `e`.
    pub rows: Nvfp4Rows,
}

impl ExpertWeights {
    /// Quantize dense f32 weights `[experts, n, k]` with one global scale per (expert, row).
    pub fn quantize_per_row(
        w: &[f32],
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<ExpertWeights> {
        let rows = quantize_rows_nvfp4(w, experts * n, k)?;
        Ok(ExpertWeights {
            experts,
            n,
            k,
            rows,
        })
    }

    /// Quantize with one global scale per expert (`amax over the expert / 2688`, 1 for an all-zero expert).
    pub fn quantize_per_expert(
        w: &[f32],
        experts: usize,
        n: usize,
        k: usize,
    ) -> Result<ExpertWeights> {
        ensure!(
            w.len() == experts * n * k,
            "quantize_per_expert: {} values for {experts} x {n} x {k}",
            w.len()
        );
        let gs: Vec<f32> = (0..experts)
            .flat_map(|e| {
                let amax = w[e * n * k..(e + 1) * n * k]
                    .iter()
                    .fold(0.0f32, |m, v| m.max(v.abs()));
                let g = if amax == 0.0 { 1.0 } else { amax / NVFP4_RANGE };
                std::iter::repeat_n(g, n)
            })
            .collect();
        let rows = nvfp4::quantize_rows_with_global(w, experts * n, k, &gs)?.into();
        Ok(ExpertWeights {
            experts,
            n,
            k,
            rows,
        })
    }

    /// Weight preparation from the checkpoint's MXFP4 experts (`[experts * n, k]` rows, 32-blocks with ue8m0
    /// scales) through the lossless MXFP4 -> NVFP4 converter (per-row power-of-two global scale). The report
    /// lists any 16-block that could not be represented exactly (the caller decides whether that is fatal).
    pub fn from_mxfp4(
        m: &Mxfp4Matrix,
        experts: usize,
        n: usize,
    ) -> Result<(ExpertWeights, ConversionReport)> {
        ensure!(
            m.rows == experts * n,
            "from_mxfp4: {} rows, expected {experts} x {n}",
            m.rows
        );
        let (q, report) = mxfp4::to_nvfp4(m);
        let w = ExpertWeights {
            experts,
            n,
            k: m.cols,
            rows: q.into(),
        };
        w.validate()?;
        Ok((w, report))
    }

    /// `e2m1 * s` of `B[e, n, k]` (exact).
    pub fn unscaled(&self, e: usize, n: usize, k: usize) -> f32 {
        self.rows.unscaled(e * self.n + n, k)
    }

    /// Global scale of (expert, row).
    pub fn global(&self, e: usize, n: usize) -> f32 {
        self.rows.global[e * self.n + n]
    }

    /// Load-time checks: buffer sizes, no NaN block scale (e4m3 0x7F/0xFF), finite positive global scales.
    pub fn validate(&self) -> Result<()> {
        let r = &self.rows;
        ensure!(
            r.rows == self.experts * self.n && r.cols == self.k,
            "expert weights: rows/cols do not match E*N x K"
        );
        ensure!(
            r.codes.len() == r.rows * r.cols / 2,
            "expert weights: {} code bytes, expected {}",
            r.codes.len(),
            r.rows * r.cols / 2
        );
        ensure!(
            r.scales.len() == r.rows * r.cols / NVFP4_BLOCK,
            "expert weights: {} scales, expected {}",
            r.scales.len(),
            r.rows * r.cols / 16
        );
        ensure!(
            r.global.len() == r.rows,
            "expert weights: {} global scales, expected {}",
            r.global.len(),
            r.rows
        );
        if let Some(i) = r.scales.iter().position(|&s| s & 0x7F == 0x7F) {
            bail!("expert weights: NaN e4m3 block scale at index {i}");
        }
        if let Some(i) = r.global.iter().position(|g| !g.is_finite() || *g <= 0.0) {
            bail!(
                "expert weights: global scale {} at row {i} is not finite and positive",
                r.global[i]
            );
        }
        Ok(())
    }
}

/// The A operand: BF16 rows (gsa = 1) or NVFP4 rows with a per-row global scale `gsa[m]`.
#[derive(Debug, Clone, PartialEq)]
pub enum Activations {
    Bf16 {
        rows: usize,
        k: usize,
        data: Vec<bf16>,
    },
    Nvfp4(Nvfp4Rows),
}

impl Activations {
    pub fn rows(&self) -> usize {
        match self {
            Activations::Bf16 { rows, .. } => *rows,
            Activations::Nvfp4(q) => q.rows,
        }
    }
    pub fn k(&self) -> usize {
        match self {
            Activations::Bf16 { k, .. } => *k,
            Activations::Nvfp4(q) => q.cols,
        }
    }
    /// The part of A[m, k] that enters the K sum (BF16 value, or e2m1 * s for NVFP4): exact in f32.
    pub fn unscaled(&self, m: usize, k: usize) -> f32 {
        match self {
            Activations::Bf16 { k: cols, data, .. } => data[m * cols + k].to_f32(),
            Activations::Nvfp4(q) => q.unscaled(m, k),
        }
    }
    /// gsa[m] (1 for BF16).
    pub fn global(&self, m: usize) -> f32 {
        match self {
            Activations::Bf16 { .. } => 1.0,
            Activations::Nvfp4(q) => q.global[m],
        }
    }
}

/// How rows of A are grouped by expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grouping {
    /// Decode: expert `e` owns slots `[e * capacity, e * capacity + counts[e])`; rows_total = experts * capacity.
    Masked { capacity: usize, counts: Vec<i32> },
    /// Prefill: tokens sorted by expert; expert `e` owns rows `[offsets[e], offsets[e + 1])`.
    Contiguous { offsets: Vec<i32> },
}

impl Grouping {
    pub fn experts(&self) -> usize {
        match self {
            Grouping::Masked { counts, .. } => counts.len(),
            Grouping::Contiguous { offsets } => offsets.len().saturating_sub(1),
        }
    }

    /// Rows of A (and of the output) the layout spans.
    pub fn rows_total(&self) -> usize {
        match self {
            Grouping::Masked { capacity, counts } => capacity * counts.len(),
            Grouping::Contiguous { offsets } => {
                offsets.last().copied().unwrap_or(0).max(0) as usize
            }
        }
    }

    /// Checks a launcher runs before any launch: counts within [0, capacity], offsets start at 0 and never decrease.
    pub fn validate(&self) -> Result<()> {
        match self {
            Grouping::Masked { capacity, counts } => {
                ensure!(!counts.is_empty(), "masked grouping: no experts");
                if let Some(e) = counts.iter().position(|&c| c < 0 || c as usize > *capacity) {
                    bail!(
                        "masked grouping: counts[{e}] = {} is outside [0, capacity = {capacity}]",
                        counts[e]
                    );
                }
            }
            Grouping::Contiguous { offsets } => {
                ensure!(
                    offsets.len() >= 2,
                    "contiguous grouping: offsets needs experts + 1 >= 2 entries"
                );
                ensure!(
                    offsets[0] == 0,
                    "contiguous grouping: offsets[0] = {} (must be 0)",
                    offsets[0]
                );
                if let Some(e) = offsets.windows(2).position(|w| w[1] < w[0]) {
                    bail!(
                        "contiguous grouping: offsets decrease at expert {e}: {} > {}",
                        offsets[e],
                        offsets[e + 1]
                    );
                }
            }
        }
        Ok(())
    }

    /// Rows owned by expert `e`.
    pub fn expert_rows(&self, e: usize) -> Range<usize> {
        match self {
            Grouping::Masked { capacity, counts } => {
                e * capacity..e * capacity + counts[e].clamp(0, *capacity as i32) as usize
            }
            Grouping::Contiguous { offsets } => offsets[e] as usize..offsets[e + 1] as usize,
        }
    }

    /// The expert that owns `row`, if any (padding slots of the masked layout have none).
    pub fn expert_of_row(&self, row: usize) -> Option<usize> {
        (0..self.experts()).find(|&e| self.expert_rows(e).contains(&row))
    }
}

/// `acc[m, n] = sum_k A[m, k] * B[e(m), n, k]` in f64 (exact products) and `abs[m, n] = sum_k |A * B|` (the
/// scale of fp32 summation error), for every row; rows owned by no expert are 0.
pub fn grouped_gemm_acc_f64(
    w: &ExpertWeights,
    a: &Activations,
    g: &Grouping,
) -> Result<(Vec<f64>, Vec<f64>)> {
    ensure!(a.k() == w.k, "A has K = {}, weights K = {}", a.k(), w.k);
    ensure!(
        g.experts() == w.experts,
        "grouping has {} experts, weights {}",
        g.experts(),
        w.experts
    );
    ensure!(
        a.rows() >= g.rows_total(),
        "A has {} rows, grouping spans {}",
        a.rows(),
        g.rows_total()
    );
    let (rows, n, k) = (g.rows_total(), w.n, w.k);
    let mut acc = vec![0.0f64; rows * n];
    let mut abs = vec![0.0f64; rows * n];
    // A rows decoded once (exact in f64); each weight row decoded once per expert, through an e4m3 table.
    let a_dec: Vec<f64> = (0..rows)
        .flat_map(|m| (0..k).map(move |kk| (m, kk)))
        .map(|(m, kk)| a.unscaled(m, kk) as f64)
        .collect();
    let e4m3_table: Vec<f64> = (0..=255u8).map(|c| e4m3::decode(c) as f64).collect();
    let mut wrow = vec![0.0f64; k];
    for e in 0..w.experts {
        let owned = g.expert_rows(e);
        if owned.is_empty() {
            continue;
        }
        for nn in 0..n {
            let r = e * n + nn;
            for (kk, v) in wrow.iter_mut().enumerate() {
                let byte = w.rows.codes[(r * k + kk) / 2];
                let code = if kk.is_multiple_of(2) {
                    byte & 0xF
                } else {
                    byte >> 4
                };
                *v = e2m1::decode(code) as f64
                    * e4m3_table[w.rows.scales[(r * k + kk) / NVFP4_BLOCK] as usize];
            }
            for m in owned.clone() {
                let arow = &a_dec[m * k..(m + 1) * k];
                let (mut s, mut sa) = (0.0f64, 0.0f64);
                for (x, y) in arow.iter().zip(&wrow) {
                    let p = x * y;
                    s += p;
                    sa += p.abs();
                }
                acc[m * n + nn] = s;
                abs[m * n + nn] = sa;
            }
        }
    }
    Ok((acc, abs))
}

/// `D[m, n] = gsa[m] * gsb[e, n] * acc[m, n]` (f64) from the accumulator of [`grouped_gemm_acc_f64`].
pub fn apply_global_scales(
    acc: &[f64],
    w: &ExpertWeights,
    a: &Activations,
    g: &Grouping,
) -> Vec<f64> {
    let n = w.n;
    let mut d = vec![0.0f64; acc.len()];
    for e in 0..w.experts {
        for m in g.expert_rows(e) {
            for nn in 0..n {
                d[m * n + nn] = acc[m * n + nn] * a.global(m) as f64 * w.global(e, nn) as f64;
            }
        }
    }
    d
}

/// DSV4 L1 epilogue on a `[rows, 2I]` GEMM output whose columns are `[gate | up]` (W13 = [w1; w3] stacked):
/// `h = silu(min(g, 10)) * clamp(u, -10, 10) * routing[m]`, f64. Rows owned by no expert are 0.
pub fn swiglu_l1_f64(d: &[f64], i_dim: usize, routing: &[f32], g: &Grouping) -> Vec<f64> {
    let rows = g.rows_total();
    let mut h = vec![0.0f64; rows * i_dim];
    for m in (0..rows).filter(|&m| g.expert_of_row(m).is_some()) {
        for j in 0..i_dim {
            let gate = d[m * 2 * i_dim + j].min(SWIGLU_LIMIT as f64);
            let up =
                d[m * 2 * i_dim + i_dim + j].clamp(-(SWIGLU_LIMIT as f64), SWIGLU_LIMIT as f64);
            let silu = gate / (1.0 + (-gate).exp());
            h[m * i_dim + j] = silu * up * routing[m] as f64;
        }
    }
    h
}

/// L2 combine: `y[t, n] = sum_j D[token_rows[t, j], n]` over the token's routed rows (`-1` = none), f64.
pub fn combine_l2_f64(
    d: &[f64],
    n: usize,
    token_rows: &[i32],
    topk: usize,
    g: &Grouping,
) -> Vec<f64> {
    let tokens = token_rows.len() / topk;
    let mut y = vec![0.0f64; tokens * n];
    for t in 0..tokens {
        for j in 0..topk {
            let r = token_rows[t * topk + j];
            if r < 0 || g.expert_of_row(r as usize).is_none() {
                continue;
            }
            for nn in 0..n {
                y[t * n + nn] += d[r as usize * n + nn];
            }
        }
    }
    y
}

/// CPU model of the kernel's register dequant (kernels/moe_gemm.cu): nibbles `i` and `i + 4` of `word` become a
/// bf16x2 holding `e2m1 * 2^-126`, then one bf16 multiply by `s_e4m3 * 2^117` gives `e2m1 * s * 2^-9`.
/// Returns the two products as f32 times 2^9, i.e. what the kernel's accumulator sees after its exact `* 512`.
/// The bf16 multiply is modelled as an exact f32 product rounded to bf16 (what `mul.rn.bf16x2` computes,
/// subnormal inputs included); tests check it equals `e2m1 * s` for every code and scale.
pub fn dequant_pair_like_kernel(word: u32, i: u32, scale_code: u8) -> (f32, f32) {
    let v = word << (12 - 4 * i);
    let bits = (v & 0x8000_8000) | ((v >> 6) & 0x01C0_01C0);
    let s = e4m3::decode(scale_code) * f32::powi(2.0, 117);
    let s_bf16 = bf16::from_f32(s);
    assert_eq!(s_bf16.to_f32(), s, "s * 2^117 must be exact in bf16");
    let lo = bf16::from_bits(bits as u16).to_f32();
    let hi = bf16::from_bits((bits >> 16) as u16).to_f32();
    let mul = |x: f32| bf16::from_f32(x * s).to_f32() * 512.0;
    (mul(lo), mul(hi))
}

/// CPU model of the f16 register dequant of the F16-operand decode mainloop (`moe_gemm_decode_f16_operands_nt*`) (kernels/common/nvfp4_dequant.cuh,
/// `e2m1_word_to_f16x2_tiny` + `scales_f16x2`): the 8 nibbles of `word` become four f16x2 whose halves are the f16
/// whose high byte is `s << 7 | e1 e0 m << 1` (= `e2m1 * 2^-14`), pair `i` = (nibble `i`, nibble `i + 4`); one f16
/// multiply by the block scale as f16 (e4m3 -> f16 is exact) gives `e2m1 * s * 2^-14`. Returns the 8 products in
/// nibble order as f32 times 2^14, i.e. what the accumulator sees after the kernel's exact `* 16384`. The f16
/// multiply is modelled as an exact f32 product rounded to f16 (`mul.rn.f16x2`, subnormals kept); tests check it
/// equals `e2m1 * s` for every code and scale.
pub fn dequant_word_like_kernel_f16(word: u32, scale_code: u8) -> [f32; 8] {
    let e = ((word & 0x0707_0707) << 1) | ((word & 0x0808_0808) << 4);
    let o = (word & 0x8080_8080) | ((word >> 3) & 0x0E0E_0E0E);
    let byte = |x: u32, b: u32| (x >> (8 * b)) & 0xFF;
    // __byte_perm(x, 0, 0x2404): byte 1 <- x.b0, byte 3 <- x.b2; x & 0xFF00FF00 keeps bytes 1 and 3.
    let pairs = [
        (byte(e, 0) << 8) | (byte(e, 2) << 24),
        (byte(o, 0) << 8) | (byte(o, 2) << 24),
        e & 0xFF00_FF00,
        o & 0xFF00_FF00,
    ];
    let s = e4m3::decode(scale_code);
    let s_f16 = half::f16::from_f32(s);
    assert_eq!(s_f16.to_f32(), s, "an e4m3 scale must be exact in f16");
    let mul = |bits: u32| {
        half::f16::from_f32(half::f16::from_bits(bits as u16).to_f32() * s).to_f32() * 16384.0
    };
    let mut out = [0f32; 8];
    for (i, p) in pairs.iter().enumerate() {
        out[i] = mul(p & 0xFFFF);
        out[i + 4] = mul(p >> 16);
    }
    out
}

/// The L2 combine as the kernels compute it, in f32 and in their order (kernels/moe_gemm.cu, "L2 epilogue"), so a
/// kernel's output must equal it bit for bit: for each valid slot j of token t in routing order (`token_rows[t, j]
/// >= 0` and owned by an expert e) `acc = +0.0 + partial[0, r, n] + partial[1, r, n] + ...` (split order),
/// `y = fma(acc, fl(gsa[r] * gsb[e, n]), y)` from `y = +0.0` (`gsa` 1 when `None`: BF16 activations); then with an
/// `addend` (BF16 `[tokens, n]`, the shared expert's output) `y = fl(y + addend[t, n])`; `out = bf16(y)` (RNE).
/// `partial` is `[splits, rows, n]` with `rows = g.rows_total()`, `gsb` `[experts, n]`.
#[allow(clippy::too_many_arguments)]
pub fn combine_l2_like_kernel(
    partial: &[f32],
    splits: usize,
    n: usize,
    gsa: Option<&[f32]>,
    gsb: &[f32],
    token_rows: &[i32],
    topk: usize,
    g: &Grouping,
    addend: Option<&[bf16]>,
) -> Vec<bf16> {
    let rows = g.rows_total();
    let tokens = token_rows.len() / topk;
    let mut out = Vec::with_capacity(tokens * n);
    for t in 0..tokens {
        // The valid slots (row, expert) in routing order.
        let valid: Vec<(usize, usize)> = token_rows[t * topk..(t + 1) * topk]
            .iter()
            .filter_map(|&r| {
                let r = usize::try_from(r).ok()?;
                Some((r, g.expert_of_row(r)?))
            })
            .collect();
        for c in 0..n {
            let mut y = 0f32;
            for &(r, e) in &valid {
                let acc = (0..splits).fold(0f32, |s, sp| s + partial[(sp * rows + r) * n + c]);
                let sa = gsa.map_or(1.0, |v| v[r]);
                y = acc.mul_add(sa * gsb[e * n + c], y);
            }
            if let Some(a) = addend {
                y += a[t * n + c].to_f32();
            }
            out.push(bf16::from_f32(y));
        }
    }
    out
}
