//! Lightning-indexer key entries (128 dims), in the two cache formats vLLM offers for DSV4
//! (dsv4-architecture §3.8, §4.2).
//!
//! # FP8 entry, 132 bytes ([`encode_fp8`], [`decode_fp8`])
//! `[0, 128)`: e4m3 codes of dims 0..128; `[128, 132)`: the f32 scale, little-endian.
//! The scale is a plain f32, not a power of two: `scale = max(amax, 1e-4) / 448` (one f32 division);
//! code `= e4m3::encode_rne(x / scale)` (f32 division, then e4m3 rounding: two rounding points, in
//! that order; the largest element lands at 448 or saturates there). Decoded value
//! `= e4m3 * scale`, one f32 multiplication (rounded; not exact in general because the scale is not a
//! power of two).
//!
//! # MXFP4 entry, 68 bytes ([`encode_mxfp4`], [`decode_mxfp4`])
//! `[0, 64)`: packed e2m1 codes, dim `2j` in the low nibble of byte `j`; `[64, 68)`: 4 ue8m0 scales, one
//! per 32 dims. Quantization is the DSV4 FP4 rule of [`super::mxfp4`]; decoding `e2m1 * 2^e` is exact.

use anyhow::{bail, Result};

use super::{amax, check_values, e2m1, e4m3, mxfp4, ue8m0};

/// Dims per key.
pub const DIMS: usize = 128;
/// Bytes of an FP8 entry: 128 codes + f32 scale.
pub const FP8_ENTRY_BYTES: usize = DIMS + 4;
/// Bytes of an MXFP4 entry: 64 packed bytes + 4 ue8m0 scales.
pub const MXFP4_ENTRY_BYTES: usize = DIMS / 2 + DIMS / mxfp4::BLOCK;
/// Floor on amax before the FP8 scale is computed.
pub const FP8_AMAX_FLOOR: f32 = 1e-4;

const _: () = assert!(FP8_ENTRY_BYTES == 132 && MXFP4_ENTRY_BYTES == 68);

/// The FP8 key scale `max(amax, 1e-4) / 448`.
#[inline]
pub fn fp8_scale(amax: f32) -> f32 {
    amax.max(FP8_AMAX_FLOOR) / e4m3::MAX
}

/// Encode a key as a 132-byte FP8 entry. Errors on non-finite or `|x| > 2^127` values.
pub fn encode_fp8(x: &[f32; DIMS]) -> Result<[u8; FP8_ENTRY_BYTES]> {
    check_values("indexer_key::encode_fp8", x, DIMS)?;
    let scale = fp8_scale(amax(x));
    let mut out = [0u8; FP8_ENTRY_BYTES];
    for (c, &v) in out.iter_mut().zip(x) {
        *c = e4m3::encode_rne(v / scale);
    }
    out[DIMS..].copy_from_slice(&scale.to_le_bytes());
    Ok(out)
}

/// Decode a 132-byte FP8 entry. Errors on a wrong length, an e4m3 NaN code or a scale that is not a
/// finite positive f32.
pub fn decode_fp8(entry: &[u8]) -> Result<[f32; DIMS]> {
    if entry.len() != FP8_ENTRY_BYTES {
        bail!(
            "indexer_key::decode_fp8: entry has {} bytes, expected {FP8_ENTRY_BYTES}",
            entry.len()
        );
    }
    let scale = f32::from_le_bytes([entry[128], entry[129], entry[130], entry[131]]);
    if !(scale.is_finite() && scale > 0.0) {
        bail!("indexer_key::decode_fp8: scale {scale} is not finite and positive");
    }
    let mut out = [0f32; DIMS];
    for (d, (&c, v)) in entry[..DIMS].iter().zip(&mut out).enumerate() {
        if c & 0x7F == e4m3::NAN_CODE {
            bail!("indexer_key::decode_fp8: dim {d} is an e4m3 NaN code ({c:#04x})");
        }
        *v = e4m3::decode(c) * scale;
    }
    Ok(out)
}

/// Encode a key as a 68-byte MXFP4 entry. Errors on non-finite or `|x| > 2^127` values.
pub fn encode_mxfp4(x: &[f32; DIMS]) -> Result<[u8; MXFP4_ENTRY_BYTES]> {
    check_values("indexer_key::encode_mxfp4", x, DIMS)?;
    let mut out = [0u8; MXFP4_ENTRY_BYTES];
    let mut codes = [0u8; mxfp4::BLOCK];
    for (b, block) in x.chunks_exact(mxfp4::BLOCK).enumerate() {
        out[DIMS / 2 + b] = mxfp4::quantize_block(block, &mut codes);
        for (j, p) in codes.chunks_exact(2).enumerate() {
            out[b * mxfp4::BLOCK / 2 + j] = e2m1::pack(p[0], p[1]);
        }
    }
    Ok(out)
}

/// Decode a 68-byte MXFP4 entry (exact). Errors on a wrong length or a scale code above
/// [`mxfp4::MAX_SCALE_CODE`] (NaN, or a value that could overflow f32).
pub fn decode_mxfp4(entry: &[u8]) -> Result<[f32; DIMS]> {
    if entry.len() != MXFP4_ENTRY_BYTES {
        bail!(
            "indexer_key::decode_mxfp4: entry has {} bytes, expected {MXFP4_ENTRY_BYTES}",
            entry.len()
        );
    }
    let scales = &entry[DIMS / 2..];
    if let Some(b) = scales.iter().position(|&s| s > mxfp4::MAX_SCALE_CODE) {
        bail!(
            "indexer_key::decode_mxfp4: scale {b} has code {:#04x} > {:#04x}",
            scales[b],
            mxfp4::MAX_SCALE_CODE
        );
    }
    let mut out = [0f32; DIMS];
    for (d, v) in out.iter_mut().enumerate() {
        let (lo, hi) = e2m1::unpack(entry[d / 2]);
        let code = if d % 2 == 0 { lo } else { hi };
        *v = e2m1::decode(code) * ue8m0::decode(scales[d / mxfp4::BLOCK]);
    }
    Ok(out)
}
