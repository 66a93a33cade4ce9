//! NVFP4 rows: e2m1 elements, one e4m3 block scale per 16 elements along K, one f32 global scale per row.
//!
//! # Layout ([`Nvfp4Rows`])
//! Row-major `rows x cols`, `cols % 16 == 0`.
//! - `data`: `rows * cols / 2` bytes; row `r` occupies `data[r*cols/2 .. (r+1)*cols/2]`; byte `j` of a row
//!   holds element `2j` in its low nibble and element `2j+1` in its high nibble ([`e2m1::pack`]).
//! - `scales`: `rows * cols / 16` e4m3 codes; `scales[r*cols/16 + b]` is the scale of elements
//!   `16b .. 16b+16` of row `r`. Quantization only produces non-negative scales.
//! - `global_scale`: `rows` f32 values, the dequantization global scale of each row.
//!
//! Value of element `(r, k)`: `(e2m1(code) * e4m3(scale)) * global_scale[r]`, evaluated in f32 in that
//! order. `e2m1 * e4m3` has at most 5 significant bits and an exponent inside BF16's range, so it is exact
//! in f32 *and* in BF16 (proved over all code pairs in tests/formats.rs); the only rounding of the
//! dequantization is the final multiplication by the global scale. A GEMM can therefore run on the exact
//! BF16 values `e2m1 * e4m3` and apply the (constant along K) global scale once in its epilogue.
//!
//! # Quantization rule (the contract the GPU kernels mirror bit for bit)
//! All operations are IEEE f32 with round-to-nearest-even, in exactly this order (GPU kernels: no fast
//! math, no flush-to-zero, `__fdiv_rn` divisions):
//! 1. per row: `amax_row = max |x|`; `gs = amax_row / 2688.0` (2688 = 6 * 448, so the largest block
//!    scale lands near e4m3's maximum 448); `gs = 1.0` when `amax_row == 0`
//!    ([`row_global_scale`]). [`quantize_rows_with_global`] takes `gs` from the caller instead.
//! 2. per block of 16: `amax_b = max |x|`; `s_code = e4m3::encode_rne(amax_b / (6.0 * gs))` with
//!    `6.0 * gs` rounded to f32 first, then the division ([`block_scale_code`]);
//!    `s = e4m3::decode(s_code)`.
//! 3. `scale = s * gs` (one f32 multiplication); element code `= e2m1::encode_rne(x / scale)` when
//!    `scale != 0`, else code 0 (+0) ([`quantize_block`]).
//!
//! Rounding points: the e4m3 rounding of the block scale (step 2) and the e2m1 rounding of each element
//! (step 3, saturating at 6); the f32 divisions and multiplications round too, which is why their order is
//! part of the contract. Caveat: when `amax_row < 2688 * 2^-126` (about 3.2e-35) `gs` is an f32 subnormal
//! and the block scales lose precision; such rows are still encoded deterministically by the same rule.

use anyhow::{bail, Result};

use super::bf16::bf16;
use super::{amax, check_block_shape, check_input, check_packed_e2m1, e2m1, e4m3};

/// Elements per block scale.
pub const BLOCK: usize = 16;
/// `e2m1::MAX * e4m3::MAX`: the row global scale is `amax_row / GLOBAL_DIVISOR`.
pub const GLOBAL_DIVISOR: f32 = 2688.0;

/// A row-major NVFP4 matrix with a per-row global scale (layout in the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Rows {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes of packed e2m1 codes, low nibble = lower K index.
    pub data: Vec<u8>,
    /// `rows * cols / 16` e4m3 block-scale codes, row-major.
    pub scales: Vec<u8>,
    /// One dequantization global scale per row.
    pub global_scale: Vec<f32>,
}

impl Nvfp4Rows {
    /// Assemble from raw parts (e.g. tensors a user supplied), checking every length, that no block scale
    /// is an e4m3 NaN code and that every global scale is finite.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scales: Vec<u8>,
        global_scale: Vec<f32>,
    ) -> Result<Self> {
        let q = Self {
            rows,
            cols,
            data,
            scales,
            global_scale,
        };
        q.validate()?;
        Ok(q)
    }

    /// Check the invariants [`Self::from_parts`] checks.
    pub fn validate(&self) -> Result<()> {
        check_packed_e2m1(
            "nvfp4",
            self.rows,
            self.cols,
            BLOCK,
            self.data.len(),
            self.scales.len(),
        )?;
        if self.global_scale.len() != self.rows {
            bail!(
                "nvfp4: global_scale has {} values, needs one per row ({})",
                self.global_scale.len(),
                self.rows
            );
        }
        if let Some(i) = self.scales.iter().position(|&c| c & 0x7F == e4m3::NAN_CODE) {
            bail!(
                "nvfp4: block scale {i} is an e4m3 NaN code ({:#04x})",
                self.scales[i]
            );
        }
        if let Some(r) = self.global_scale.iter().position(|g| !g.is_finite()) {
            bail!("nvfp4: global scale of row {r} is not finite");
        }
        Ok(())
    }

    /// Block scales per row (`cols / 16`).
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

    /// The e4m3 block-scale code of element `(row, k)`.
    #[inline]
    pub fn scale_code(&self, row: usize, k: usize) -> u8 {
        self.scales[row * self.blocks_per_row() + k / BLOCK]
    }
}

/// Step 1 of the rule: `amax_row / 2688.0`, or 1.0 for an all-zero row.
pub fn row_global_scale(row: &[f32]) -> f32 {
    let a = amax(row);
    if a == 0.0 {
        1.0
    } else {
        a / GLOBAL_DIVISOR
    }
}

/// Step 2 of the rule: the e4m3 block-scale code `encode_rne(amax_b / (6.0 * gs))`.
#[inline]
pub fn block_scale_code(amax_b: f32, gs: f32) -> u8 {
    let six_gs = 6.0f32 * gs;
    e4m3::encode_rne(amax_b / six_gs)
}

/// Steps 2 and 3 for one block: writes one (unpacked) e2m1 code per value into `codes` and returns the
/// block's e4m3 scale code. `codes.len()` must equal `values.len()`.
pub fn quantize_block(values: &[f32], gs: f32, codes: &mut [u8]) -> u8 {
    debug_assert_eq!(values.len(), codes.len());
    let s_code = block_scale_code(amax(values), gs);
    let scale = e4m3::decode(s_code) * gs;
    for (c, &x) in codes.iter_mut().zip(values) {
        *c = if scale != 0.0 {
            e2m1::encode_rne(x / scale)
        } else {
            0
        };
    }
    s_code
}

/// Quantize a row-major `rows x cols` matrix with the per-row global scale of [`row_global_scale`].
/// Errors: `cols` not a positive multiple of 16, wrong length, non-finite or `|x| > 2^127` input.
pub fn quantize_rows(x: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Rows> {
    check_block_shape("nvfp4", rows, cols, BLOCK)?;
    check_input("nvfp4::quantize_rows", x, rows, cols)?;
    let gs: Vec<f32> = x.chunks_exact(cols).map(row_global_scale).collect();
    quantize_rows_with_global(x, rows, cols, &gs)
}

/// Quantize with a caller-given global scale per row (e.g. one shared by a whole expert, or a scale
/// fixed ahead of time for activations). Steps 2 and 3 of the rule as in [`quantize_rows`]. A `gs`
/// smaller than `amax_row / 2688` saturates block scales at 448 and then elements at 6 (clipping);
/// that is the caller's choice and not an error. Errors: as [`quantize_rows`], plus `gs.len() != rows`
/// or a global scale that is not finite and positive.
pub fn quantize_rows_with_global(
    x: &[f32],
    rows: usize,
    cols: usize,
    gs: &[f32],
) -> Result<Nvfp4Rows> {
    check_block_shape("nvfp4", rows, cols, BLOCK)?;
    check_input("nvfp4::quantize_rows_with_global", x, rows, cols)?;
    if gs.len() != rows {
        bail!(
            "nvfp4::quantize_rows_with_global: {} global scales for {rows} rows",
            gs.len()
        );
    }
    if let Some(r) = gs.iter().position(|g| !(g.is_finite() && *g > 0.0)) {
        bail!(
            "nvfp4::quantize_rows_with_global: global scale {} of row {r} must be finite and > 0",
            gs[r]
        );
    }
    let mut data = Vec::with_capacity(rows * cols / 2);
    let mut scales = Vec::with_capacity(rows * cols / BLOCK);
    let mut codes = [0u8; BLOCK];
    for (row, &g) in x.chunks_exact(cols).zip(gs) {
        for block in row.chunks_exact(BLOCK) {
            scales.push(quantize_block(block, g, &mut codes));
            data.extend(codes.chunks_exact(2).map(|p| e2m1::pack(p[0], p[1])));
        }
    }
    Ok(Nvfp4Rows {
        rows,
        cols,
        data,
        scales,
        global_scale: gs.to_vec(),
    })
}

/// `e2m1 * e4m3` of element `(row, k)`: exact in f32 and in BF16.
#[inline]
fn unscaled(q: &Nvfp4Rows, row: usize, k: usize) -> f32 {
    e2m1::decode(q.code(row, k)) * e4m3::decode(q.scale_code(row, k))
}

/// Dequantize to f32: `(e2m1 * s) * gs` per element, row-major.
pub fn dequantize_rows(q: &Nvfp4Rows) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.rows * q.cols);
    for r in 0..q.rows {
        let g = q.global_scale[r];
        out.extend((0..q.cols).map(|k| unscaled(q, r, k) * g));
    }
    out
}

/// Dequantize to BF16: the f32 value of [`dequantize_rows`] rounded to BF16 (nearest, ties to even).
/// This is the one rounding point of the NVFP4 -> BF16 kernel.
pub fn dequantize_rows_bf16(q: &Nvfp4Rows) -> Vec<bf16> {
    dequantize_rows(q).into_iter().map(bf16::from_f32).collect()
}

/// One row of [`dequantize_rows_bf16`]. Errors when `row >= rows`.
pub fn dequantize_row_bf16(q: &Nvfp4Rows, row: usize) -> Result<Vec<bf16>> {
    check_row(q, row)?;
    let g = q.global_scale[row];
    Ok((0..q.cols)
        .map(|k| bf16::from_f32(unscaled(q, row, k) * g))
        .collect())
}

/// One row without its global scale: `e2m1 * s` per element, exact in BF16 (no rounding happens). This
/// is the GEMM operand when the global scale is applied in the epilogue. Errors when `row >= rows`.
pub fn dequantize_row_unscaled_bf16(q: &Nvfp4Rows, row: usize) -> Result<Vec<bf16>> {
    check_row(q, row)?;
    Ok((0..q.cols)
        .map(|k| bf16::from_f32(unscaled(q, row, k)))
        .collect())
}

fn check_row(q: &Nvfp4Rows, row: usize) -> Result<()> {
    if row >= q.rows {
        bail!("nvfp4: row {row} out of range (rows = {})", q.rows);
    }
    Ok(())
}
