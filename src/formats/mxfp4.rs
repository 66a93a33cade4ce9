//! MXFP4 as the DSV4 checkpoint stores its routed experts: e2m1 elements, one ue8m0 (power-of-two) scale
//! per 32 elements along K, no second-level scale. Also the DSV4 FP4 simulation ([`fp4_sim`]) and the
//! MXFP4 -> NVFP4 converter ([`to_nvfp4`]).
//!
//! # Layout ([`Mxfp4Matrix`])
//! Row-major `rows x cols`, `cols % 32 == 0`.
//! - `data`: `rows * cols / 2` bytes, row `r` at `data[r*cols/2 ..]`, element `2j` in the low nibble of
//!   byte `j`, element `2j+1` in the high nibble (the checkpoint's `I8 [out, in/2]` tensors).
//! - `scales`: `rows * cols / 32` ue8m0 codes, `scales[r*cols/32 + b]` for elements `32b .. 32b+32`
//!   (the checkpoint's `F8_E8M0 [out, in/32]`).
//!
//! Value of element `(r, k)`: `e2m1(code) * 2^(scale - 127)`, exact in f32 (a power-of-two scaling of a
//! value with at most two significant bits) for every scale code up to [`MAX_SCALE_CODE`].
//!
//! # DSV4 FP4 quantization rule
//! Per block of 32: `amax_b = max |x|`, floored at `6 * 2^-126`;
//! `scale = 2^ceil(log2(amax_b / 6))` computed by [`ue8m0::pow2_scale_for`] (one f32 division, then
//! the exponent bits); element code `= e2m1::encode_rne(x / scale)` (division by a power of two: exact
//! except for results in f32's subnormal range, which are far below e2m1's first rounding threshold
//! 0.25, so the code is the same). The one rounding point is the e2m1 rounding (ties to even,
//! saturating at 6; `amax_b / scale <= 6` up to the f32 rounding of `amax_b / 6`, so saturation clips
//! by at most one f32 ulp).

use anyhow::{bail, Result};

use super::nvfp4::{self, Nvfp4Rows};
use super::{
    amax, check_block_shape, check_input, check_packed_e2m1, check_values, e2m1, e4m3, pow2_f32,
    ue8m0,
};

/// Elements per ue8m0 block scale.
pub const BLOCK: usize = 32;
/// Largest accepted ue8m0 scale code: 2^125, so `6 * scale` is finite in f32. [`quantize`] never
/// exceeds it for inputs with `|x| <= 2^127`.
pub const MAX_SCALE_CODE: u8 = 252;
/// DSV4 floor on a block's amax before the scale is computed: `6 * 2^-126`, so the scale is at least
/// 2^-126 (f32's smallest normal).
pub const AMAX_FLOOR: f32 = 6.0 * f32::MIN_POSITIVE;

/// A row-major MXFP4 matrix (layout in the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Mxfp4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes of packed e2m1 codes, low nibble = lower K index.
    pub data: Vec<u8>,
    /// `rows * cols / 32` ue8m0 codes, row-major.
    pub scales: Vec<u8>,
}

impl Mxfp4Matrix {
    /// Assemble from raw parts (e.g. checkpoint tensors), checking every length and that every scale
    /// code is at most [`MAX_SCALE_CODE`] (larger codes are NaN or could dequantize to +-Inf).
    pub fn from_parts(rows: usize, cols: usize, data: Vec<u8>, scales: Vec<u8>) -> Result<Self> {
        let m = Self {
            rows,
            cols,
            data,
            scales,
        };
        m.validate()?;
        Ok(m)
    }

    /// Check the invariants [`Self::from_parts`] checks.
    pub fn validate(&self) -> Result<()> {
        check_packed_e2m1(
            "mxfp4",
            self.rows,
            self.cols,
            BLOCK,
            self.data.len(),
            self.scales.len(),
        )?;
        if let Some(i) = self.scales.iter().position(|&c| c > MAX_SCALE_CODE) {
            bail!(
                "mxfp4: scale {i} has code {:#04x} > {MAX_SCALE_CODE:#04x} (NaN, or 6 * scale overflows f32)",
                self.scales[i]
            );
        }
        Ok(())
    }

    /// Block scales per row (`cols / 32`).
    pub fn blocks_per_row(&self) -> usize {
        self.cols / BLOCK
    }

    /// The 4-bit code of element `(row, k)`.
    #[inline]
    pub fn code(&self, row: usize, k: usize) -> u8 {
        let byte = self.data[(row * self.cols + k) / 2];
        if k.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        }
    }

    /// The unbiased exponent `e` (scale `2^e`) of 32-block `b` of `row`.
    #[inline]
    pub fn block_exponent(&self, row: usize, b: usize) -> i32 {
        self.scales[row * self.blocks_per_row() + b] as i32 - 127
    }
}

/// The DSV4 FP4 ue8m0 scale code of a block with largest magnitude `amax`:
/// `2^ceil(log2(max(amax, 6 * 2^-126) / 6))`.
#[inline]
pub fn scale_code(amax: f32) -> u8 {
    ue8m0::pow2_scale_for(amax.max(AMAX_FLOOR), e2m1::MAX)
}

/// Quantize one block with the DSV4 FP4 rule: writes one e2m1 code per value, returns the ue8m0 code.
pub fn quantize_block(values: &[f32], codes: &mut [u8]) -> u8 {
    debug_assert_eq!(values.len(), codes.len());
    let s_code = scale_code(amax(values));
    let scale = ue8m0::decode(s_code);
    for (c, &x) in codes.iter_mut().zip(values) {
        *c = e2m1::encode_rne(x / scale);
    }
    s_code
}

/// Quantize a row-major `rows x cols` matrix with the DSV4 FP4 rule. Errors: `cols` not a positive
/// multiple of 32, wrong length, non-finite or `|x| > 2^127` input.
pub fn quantize(x: &[f32], rows: usize, cols: usize) -> Result<Mxfp4Matrix> {
    check_block_shape("mxfp4", rows, cols, BLOCK)?;
    check_input("mxfp4::quantize", x, rows, cols)?;
    let mut data = Vec::with_capacity(rows * cols / 2);
    let mut scales = Vec::with_capacity(rows * cols / BLOCK);
    let mut codes = [0u8; BLOCK];
    for block in x.chunks_exact(BLOCK) {
        scales.push(quantize_block(block, &mut codes));
        data.extend(codes.chunks_exact(2).map(|p| e2m1::pack(p[0], p[1])));
    }
    Ok(Mxfp4Matrix {
        rows,
        cols,
        data,
        scales,
    })
}

/// Dequantize to f32 (exact): `e2m1 * 2^e` per element, row-major.
pub fn dequantize(m: &Mxfp4Matrix) -> Vec<f32> {
    let mut out = Vec::with_capacity(m.rows * m.cols);
    for r in 0..m.rows {
        for k in 0..m.cols {
            let s = ue8m0::decode(m.scales[r * m.blocks_per_row() + k / BLOCK]);
            out.push(e2m1::decode(m.code(r, k)) * s);
        }
    }
    out
}

/// DSV4 FP4 simulation: quantize -> dequantize in place, one scale per `block` contiguous values
/// (DSV4 uses 32). The result of each value is exactly `e2m1 * 2^e` of [`quantize`].
/// Errors: `block == 0`, `!x.len().is_multiple_of(block)`, non-finite or `|x| > 2^127` input (x is then unchanged).
pub fn fp4_sim(x: &mut [f32], block: usize) -> Result<()> {
    if block == 0 || !x.len().is_multiple_of(block) {
        bail!(
            "mxfp4::fp4_sim: length {} is not a positive multiple of block {block}",
            x.len()
        );
    }
    check_values("mxfp4::fp4_sim", x, block)?;
    let mut codes = vec![0u8; block];
    for b in x.chunks_exact_mut(block) {
        let scale = ue8m0::decode(quantize_block(b, &mut codes));
        for (v, &c) in b.iter_mut().zip(&codes) {
            *v = e2m1::decode(c) * scale;
        }
    }
    Ok(())
}

/// A 16-element NVFP4 block that the MXFP4 -> NVFP4 conversion could not represent exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InexactBlock {
    pub row: usize,
    /// Index of the 16-element NVFP4 block within the row (32-block `block / 2`).
    pub block: usize,
    /// The MXFP4 block exponent `e` (scale `2^e`).
    pub exponent: i32,
    /// `E_max - e` for the row's largest exponent `E_max`; inexact exactly when `gap > 17`.
    pub gap: i32,
}

/// What [`to_nvfp4`] could not convert exactly.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConversionReport {
    /// Every re-rounded 16-block, in row-major order.
    pub inexact_blocks: Vec<InexactBlock>,
}

impl ConversionReport {
    /// True when every value converted exactly (the NVFP4 dequantization equals the MXFP4 one bit for
    /// bit).
    pub fn is_lossless(&self) -> bool {
        self.inexact_blocks.is_empty()
    }
}

/// Largest gap `E_max - e` that converts exactly: e4m3's powers of two run from 2^-9 (subnormal) to 2^8.
pub const MAX_EXACT_GAP: i32 = 17;

/// Convert to NVFP4 with a per-row power-of-two global scale, exactly where possible.
///
/// Per row, `E_max` = the largest exponent among 16-blocks that hold a nonzero code (magnitude bits
/// nonzero); the global scale is `G = 2^(E_max - 8)` (`G = 1.0` for a row without nonzero codes). Each
/// 16-half of a 32-block keeps its e2m1 codes unchanged and gets the e4m3 scale `2^t`, `t = e - E_max + 8`
/// (<= 8), so `e2m1 * 2^t * G = e2m1 * 2^e` exactly, whenever `t >= -9` (e4m3's smallest subnormal),
/// i.e. when the gap `E_max - e <= 17`. A 16-block whose codes are all zero gets scale 0 and stays exact
/// (signs of zero are kept too).
///
/// A nonzero 16-block with gap > 17 cannot be exact. It is listed in the report and re-rounded onto
/// the finest NVFP4 grid available: block scale 2^-9 (code 0x01), each element becomes
/// `e2m1::encode_rne(value / (2^-9 * G))`, the nearest multiple representable (ties to even), so
/// elements below `2^-10 * G` flush to (signed) zero.
pub fn to_nvfp4(m: &Mxfp4Matrix) -> (Nvfp4Rows, ConversionReport) {
    let halves = m.cols / nvfp4::BLOCK;
    let mut data = m.data.clone();
    let mut scales = Vec::with_capacity(m.rows * halves);
    let mut global_scale = Vec::with_capacity(m.rows);
    let mut report = ConversionReport::default();
    let half_is_zero = |r: usize, h: usize| {
        (h * nvfp4::BLOCK..(h + 1) * nvfp4::BLOCK).all(|k| m.code(r, k) & 7 == 0)
    };
    let smallest_e4m3 = e4m3::encode_rne(pow2_f32(-9));
    for r in 0..m.rows {
        let e_max = (0..halves)
            .filter(|&h| !half_is_zero(r, h))
            .map(|h| m.block_exponent(r, h / 2))
            .max();
        let Some(e_max) = e_max else {
            global_scale.push(1.0);
            scales.extend(std::iter::repeat_n(0u8, halves));
            continue;
        };
        global_scale.push(pow2_f32(e_max - 8));
        for h in 0..halves {
            if half_is_zero(r, h) {
                scales.push(0);
                continue;
            }
            let e = m.block_exponent(r, h / 2);
            let t = e - e_max + 8;
            if t >= -9 {
                scales.push(e4m3::encode_rne(pow2_f32(t)));
                continue;
            }
            report.inexact_blocks.push(InexactBlock {
                row: r,
                block: h,
                exponent: e,
                gap: e_max - e,
            });
            scales.push(smallest_e4m3);
            // value / (2^-9 * G) = e2m1 * 2^(e - (E_max - 17)) = e2m1 * 2^(t + 9): exact unless it is
            // below f32's subnormal range, where it is far below 0.25 and encodes to zero either way.
            let factor = pow2_f32(t + 9);
            for k in h * nvfp4::BLOCK..(h + 1) * nvfp4::BLOCK {
                let code = e2m1::encode_rne(e2m1::decode(m.code(r, k)) * factor);
                let byte = &mut data[(r * m.cols + k) / 2];
                *byte = if k.is_multiple_of(2) {
                    (*byte & 0xF0) | code
                } else {
                    (*byte & 0x0F) | (code << 4)
                };
            }
        }
    }
    let q = Nvfp4Rows {
        rows: m.rows,
        cols: m.cols,
        data,
        scales,
        global_scale,
    };
    (q, report)
}
