//! FP8 e4m3 with power-of-two (ue8m0) block scales, as DSV4 uses them: 1x128 activations, 128x128
//! weight blocks, and the in-place FP8 simulation ([`fp8_sim`], block 64 on the KV nope dims).
//!
//! # DSV4 FP8 quantization rule (every function here)
//! Per block: `amax = max |x|` floored at `1e-4` ([`AMAX_FLOOR`]); scale code
//! `= ue8m0::pow2_scale_for(amax, 448)`, i.e. `scale = 2^ceil(log2(amax / 448))` with `amax / 448`
//! rounded to f32 first ([`scale_code`]); element code `= e4m3::encode_rne(x / scale)`.
//!
//! The one rounding point is the e4m3 rounding (nearest, ties to even, saturating at 448). Division by
//! the power-of-two scale is exact except where the quotient is an f32 subnormal, and those quotients
//! are far below e4m3's smallest rounding threshold (2^-10), so the code is unaffected. Dequantization
//! `e4m3 * scale` is exact in f32 (at most 4 significant bits; with the 1e-4 floor the scale is at
//! least 2^-22, so the smallest nonzero product is 2^-31, a normal f32).
//!
//! # Layouts
//! - [`Fp8Act`]: `data` row-major `rows x cols` e4m3 codes; `scales[r * ceil(cols/128) + b]` is the scale
//!   of columns `128b .. min(128b+128, cols)` of row `r` (the last block may be partial).
//! - [`Fp8BlockWeight`]: `data` row-major `rows x cols` (the checkpoint's `[out, in]`); `scales` row-major
//!   `[ceil(rows/128), ceil(cols/128)]` (the checkpoint's `<name>.scale`); edge blocks may be partial,
//!   their amax is over the elements that exist.

use anyhow::{bail, Result};

use super::{amax, check_input, check_values, e4m3, ue8m0};

/// Activation block length along K.
pub const ACT_BLOCK: usize = 128;
/// Weight block edge (128 x 128).
pub const WEIGHT_BLOCK: usize = 128;
/// DSV4 floor on a block's amax before the scale is computed (as an f32 literal).
pub const AMAX_FLOOR: f32 = 1e-4;

/// The DSV4 FP8 ue8m0 scale code for a block with largest magnitude `amax`:
/// `2^ceil(log2(max(amax, 1e-4) / 448))`.
#[inline]
pub fn scale_code(amax: f32) -> u8 {
    ue8m0::pow2_scale_for(amax.max(AMAX_FLOOR), e4m3::MAX)
}

/// Quantize one block of values (any length): writes one e4m3 code per value, returns the ue8m0 code.
pub fn quantize_block(values: &[f32], codes: &mut [u8]) -> u8 {
    debug_assert_eq!(values.len(), codes.len());
    let s_code = scale_code(amax(values));
    let scale = ue8m0::decode(s_code);
    for (c, &x) in codes.iter_mut().zip(values) {
        *c = e4m3::encode_rne(x / scale);
    }
    s_code
}

/// FP8 activations with one ue8m0 scale per (row, 128-column block) (layout in the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Act {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols` e4m3 codes, row-major.
    pub data: Vec<u8>,
    /// `rows * ceil(cols / 128)` ue8m0 codes.
    pub scales: Vec<u8>,
}

impl Fp8Act {
    /// Scale blocks per row (`ceil(cols / 128)`).
    pub fn blocks_per_row(&self) -> usize {
        self.cols.div_ceil(ACT_BLOCK)
    }

    /// Assemble from raw parts, checking lengths and that no code is an e4m3 or ue8m0 NaN.
    pub fn from_parts(rows: usize, cols: usize, data: Vec<u8>, scales: Vec<u8>) -> Result<Self> {
        let Some(n) = rows.checked_mul(cols) else {
            bail!("fp8 act: shape {rows}x{cols} overflows usize");
        };
        let q = Self {
            rows,
            cols,
            data,
            scales,
        };
        check_parts("fp8 act", &q.data, n, &q.scales, rows * q.blocks_per_row())?;
        Ok(q)
    }
}

/// FP8 weights with one ue8m0 scale per 128x128 block (layout in the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8BlockWeight {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols` e4m3 codes, row-major.
    pub data: Vec<u8>,
    /// `ceil(rows/128) * ceil(cols/128)` ue8m0 codes, row-major.
    pub scales: Vec<u8>,
}

impl Fp8BlockWeight {
    /// Scale blocks along the columns (`ceil(cols / 128)`).
    pub fn col_blocks(&self) -> usize {
        self.cols.div_ceil(WEIGHT_BLOCK)
    }

    /// Scale blocks along the rows (`ceil(rows / 128)`).
    pub fn row_blocks(&self) -> usize {
        self.rows.div_ceil(WEIGHT_BLOCK)
    }

    /// Assemble from raw parts (e.g. checkpoint tensors), checking lengths and that no code is an e4m3
    /// or ue8m0 NaN.
    pub fn from_parts(rows: usize, cols: usize, data: Vec<u8>, scales: Vec<u8>) -> Result<Self> {
        let Some(n) = rows.checked_mul(cols) else {
            bail!("fp8 weight: shape {rows}x{cols} overflows usize");
        };
        let w = Self {
            rows,
            cols,
            data,
            scales,
        };
        let nscales = w.row_blocks() * w.col_blocks();
        check_parts("fp8 weight", &w.data, n, &w.scales, nscales)?;
        Ok(w)
    }
}

fn check_parts(what: &str, data: &[u8], n: usize, scales: &[u8], nscales: usize) -> Result<()> {
    if data.len() != n {
        bail!("{what}: data has {} codes, needs {n}", data.len());
    }
    if scales.len() != nscales {
        bail!("{what}: scales has {} codes, needs {nscales}", scales.len());
    }
    if let Some(i) = data.iter().position(|&c| c & 0x7F == e4m3::NAN_CODE) {
        bail!("{what}: element {i} is an e4m3 NaN code ({:#04x})", data[i]);
    }
    if let Some(i) = scales.iter().position(|&c| c == 0xFF) {
        bail!("{what}: scale {i} is the ue8m0 NaN code 0xff");
    }
    Ok(())
}

/// Quantize activations per (row, 128-column block) with the DSV4 FP8 rule. `cols` need not be a
/// multiple of 128 (the last block of each row is then partial). Errors: wrong length, non-finite or
/// `|x| > 2^127` input.
pub fn quantize_act_1x128(x: &[f32], rows: usize, cols: usize) -> Result<Fp8Act> {
    check_input("fp8::quantize_act_1x128", x, rows, cols)?;
    let blocks = cols.div_ceil(ACT_BLOCK);
    let mut data = vec![0u8; rows * cols];
    let mut scales = Vec::with_capacity(rows * blocks);
    if cols > 0 {
        for (xr, dr) in x.chunks_exact(cols).zip(data.chunks_exact_mut(cols)) {
            for (xb, db) in xr.chunks(ACT_BLOCK).zip(dr.chunks_mut(ACT_BLOCK)) {
                scales.push(quantize_block(xb, db));
            }
        }
    }
    Ok(Fp8Act {
        rows,
        cols,
        data,
        scales,
    })
}

/// Dequantize activations to f32 (exact): `e4m3 * scale`.
pub fn dequantize_act_1x128(q: &Fp8Act) -> Vec<f32> {
    let bpr = q.blocks_per_row();
    (0..q.rows * q.cols)
        .map(|i| {
            let (r, k) = (i / q.cols, i % q.cols);
            e4m3::decode(q.data[i]) * ue8m0::decode(q.scales[r * bpr + k / ACT_BLOCK])
        })
        .collect()
}

/// Quantize a row-major `rows x cols` weight per 128x128 block with the DSV4 FP8 rule (edge blocks may
/// be partial). Errors: wrong length, non-finite or `|x| > 2^127` input.
pub fn quantize_weight_128x128(x: &[f32], rows: usize, cols: usize) -> Result<Fp8BlockWeight> {
    check_input("fp8::quantize_weight_128x128", x, rows, cols)?;
    let (rb, cb) = (rows.div_ceil(WEIGHT_BLOCK), cols.div_ceil(WEIGHT_BLOCK));
    let mut scales = Vec::with_capacity(rb * cb);
    let mut data = vec![0u8; rows * cols];
    for bi in 0..rb {
        let r_range = bi * WEIGHT_BLOCK..((bi + 1) * WEIGHT_BLOCK).min(rows);
        for bj in 0..cb {
            let c_range = bj * WEIGHT_BLOCK..((bj + 1) * WEIGHT_BLOCK).min(cols);
            let block_amax = r_range
                .clone()
                .map(|r| amax(&x[r * cols + c_range.start..r * cols + c_range.end]))
                .fold(0.0f32, f32::max);
            let s_code = scale_code(block_amax);
            let scale = ue8m0::decode(s_code);
            scales.push(s_code);
            for r in r_range.clone() {
                for c in c_range.clone() {
                    data[r * cols + c] = e4m3::encode_rne(x[r * cols + c] / scale);
                }
            }
        }
    }
    Ok(Fp8BlockWeight {
        rows,
        cols,
        data,
        scales,
    })
}

/// Dequantize a block-scaled weight to f32 (exact): `e4m3 * scale`.
pub fn dequantize_weight_128x128(w: &Fp8BlockWeight) -> Vec<f32> {
    let cb = w.col_blocks();
    (0..w.rows * w.cols)
        .map(|i| {
            let (r, c) = (i / w.cols, i % w.cols);
            let s = ue8m0::decode(w.scales[(r / WEIGHT_BLOCK) * cb + c / WEIGHT_BLOCK]);
            e4m3::decode(w.data[i]) * s
        })
        .collect()
}

/// DSV4 FP8 simulation: quantize -> dequantize in place with the DSV4 FP8 rule, one scale per `block`
/// contiguous values (DSV4 uses 64 for the KV nope dims, 128 for activations). This is the real e4m3
/// round trip (see dsv4-architecture §2 on the version caveat). Errors: `block == 0`,
/// `!x.len().is_multiple_of(block)`, non-finite or `|x| > 2^127` input (x is then unchanged).
pub fn fp8_sim(x: &mut [f32], block: usize) -> Result<()> {
    if block == 0 || !x.len().is_multiple_of(block) {
        bail!(
            "fp8::fp8_sim: length {} is not a positive multiple of block {block}",
            x.len()
        );
    }
    check_values("fp8::fp8_sim", x, block)?;
    let mut codes = vec![0u8; block];
    for b in x.chunks_exact_mut(block) {
        let scale = ue8m0::decode(quantize_block(b, &mut codes));
        for (v, &c) in b.iter_mut().zip(&codes) {
            *v = e4m3::decode(c) * scale;
        }
    }
    Ok(())
}
