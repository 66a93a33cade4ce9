//! Exact CPU codecs for every storage format the kernels read or write (docs/numerics.md).
//!
//! Scalar codecs: [`e2m1`], [`e4m3`], [`ue8m0`], [`bf16`]. Every GPU kernel that rounds to one of these
//! formats implements the same rule, and the tests compare GPU and CPU bit for bit.
//!
//! Block formats built on them:
//! - [`nvfp4`]: e2m1 elements, e4m3 scale per 16 along K, f32 global scale per row.
//! - [`mxfp4`]: e2m1 elements, ue8m0 scale per 32 along K (the DSV4 checkpoint experts), the DSV4 FP4
//!   simulation, and the MXFP4 -> NVFP4 converter with its exactness report.
//! - [`fp8`]: e4m3 with power-of-two (ue8m0) scales: 1x128 activations, 128x128 weights, the DSV4 FP8
//!   simulation.
//! - [`kv`]: the 584-byte DSV4 "MODEL1" KV-cache entry.
//! - [`indexer_key`]: the 132-byte FP8 and 68-byte MXFP4 lightning-indexer key entries.
//!
//! Common input rules: quantizers take row-major f32, reject a length that does not match the shape and
//! reject non-finite values or values with `|x| > 2^127` ([`MAX_INPUT_MAGNITUDE`]): above that the
//! largest dequantized value of a block (e.g. `6 * 2^126` for MXFP4) could overflow f32. Functions that
//! take a format struct assume it is well formed: build it with the quantizer or with the struct's
//! `from_parts`, both of which check every length and code.

pub mod bf16;
pub mod e2m1;
pub mod e4m3;
pub mod fp8;
pub mod indexer_key;
pub mod kv;
pub mod mxfp4;
pub mod nvfp4;
pub mod ue8m0;

use anyhow::{bail, Result};

/// Largest input magnitude the quantizers accept: 2^127.
pub const MAX_INPUT_MAGNITUDE: f32 = f32::from_bits(254 << 23);

/// `Ok` when `x.len() == rows * cols` (without overflow) and every value is finite with
/// `|x| <= MAX_INPUT_MAGNITUDE`; otherwise an error naming `what` and the first bad (row, col).
pub(crate) fn check_input(what: &str, x: &[f32], rows: usize, cols: usize) -> Result<()> {
    let Some(n) = rows.checked_mul(cols) else {
        bail!("{what}: shape {rows}x{cols} overflows usize");
    };
    if x.len() != n {
        bail!(
            "{what}: input has {} values, shape {rows}x{cols} needs {n}",
            x.len()
        );
    }
    check_values(what, x, cols.max(1))
}

/// `Ok` when `cols` is a positive multiple of the format's `block` and `rows * cols` does not overflow.
pub(crate) fn check_block_shape(fmt: &str, rows: usize, cols: usize, block: usize) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(block) {
        bail!("{fmt}: cols = {cols} must be a positive multiple of {block}");
    }
    if rows.checked_mul(cols).is_none() {
        bail!("{fmt}: shape {rows}x{cols} overflows usize");
    }
    Ok(())
}

/// The length checks every packed e2m1 format shares: a valid block shape, two codes per data byte and one
/// scale code per `block` elements.
pub(crate) fn check_packed_e2m1(
    fmt: &str,
    rows: usize,
    cols: usize,
    block: usize,
    data_len: usize,
    scales_len: usize,
) -> Result<()> {
    check_block_shape(fmt, rows, cols, block)?;
    let n = rows * cols;
    if data_len != n / 2 {
        bail!(
            "{fmt}: data has {data_len} bytes, {rows}x{cols} needs {}",
            n / 2
        );
    }
    if scales_len != n / block {
        bail!(
            "{fmt}: scales has {scales_len} codes, {rows}x{cols} needs {}",
            n / block
        );
    }
    Ok(())
}

/// Every value finite and within [`MAX_INPUT_MAGNITUDE`]; errors name the (row, col) for a row length
/// `cols`.
pub(crate) fn check_values(what: &str, x: &[f32], cols: usize) -> Result<()> {
    if let Some(i) = x
        .iter()
        .position(|v| !v.is_finite() || v.abs() > MAX_INPUT_MAGNITUDE)
    {
        bail!(
            "{what}: value {} at (row {}, col {}) is not finite or exceeds 2^127 in magnitude",
            x[i],
            i / cols,
            i % cols
        );
    }
    Ok(())
}

/// Largest magnitude of a slice of finite values (0 for an empty slice).
#[inline]
pub(crate) fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The exact f32 value 2^n for n in [-149, 127] (subnormals included); 0 below -149, +Inf above 127.
#[inline]
pub fn pow2_f32(n: i32) -> f32 {
    if n > 127 {
        f32::INFINITY
    } else if n >= -126 {
        f32::from_bits(((n + 127) as u32) << 23)
    } else if n >= -149 {
        f32::from_bits(1u32 << (n + 149))
    } else {
        0.0
    }
}
