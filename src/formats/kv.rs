//! The DSV4 "MODEL1" FP8 KV-cache entry: one 512-dim latent (448 "nope" dims + 64 rope dims) in 584
//! bytes (dsv4-architecture §4.2).
//!
//! # Byte layout of one entry
//! | bytes | content |
//! |---|---|
//! | `[0, 448)` | nope dims 0..448 as e4m3 codes, in 7 tiles of 64 dims |
//! | `[448, 576)` | rope dims 448..512 as 64 BF16 values, little-endian |
//! | `[576, 583)` | 7 ue8m0 scale codes, tile `i` covers nope dims `64i .. 64i+64` |
//! | `583` | pad, written as 0 (ignored on decode) |
//!
//! A paged cache may split an entry: the first 576 bytes ("record", token stride 576) of every token of a
//! page first, then the 8 scale bytes of every token (FlashMLA's paged layout). [`decode_record`] takes
//! the two pieces separately; [`encode_entry`] / [`decode_entry`] use the contiguous form above.
//!
//! # Rounding
//! Nope tiles use the DSV4 FP8 rule ([`super::fp8`], amax floored at 1e-4, power-of-two scale
//! `2^ceil(log2(amax / 448))`, e4m3 round to nearest even); a decoded nope dim is `e4m3 * scale`, exact
//! in f32, identical to `fp8::fp8_sim` with block 64. Rope dims are rounded to BF16 (nearest even) and
//! decode exactly to that BF16 value.

use anyhow::{bail, Result};

use super::bf16::bf16;
use super::{check_values, e4m3, fp8, ue8m0};

/// Latent dims per entry.
pub const DIMS: usize = 512;
/// FP8 ("nope") dims: the first 448.
pub const NOPE_DIMS: usize = 448;
/// BF16 rope dims: the last 64.
pub const ROPE_DIMS: usize = 64;
/// Dims per FP8 scale tile.
pub const TILE: usize = 64;
/// Scale tiles per entry.
pub const TILES: usize = NOPE_DIMS / TILE;
/// Bytes of fp8 nope + bf16 rope (the per-token record of a paged cache).
pub const RECORD_BYTES: usize = NOPE_DIMS + 2 * ROPE_DIMS;
/// Bytes of scales + pad.
pub const SCALE_BYTES: usize = TILES + 1;
/// Bytes of one entry.
pub const ENTRY_BYTES: usize = RECORD_BYTES + SCALE_BYTES;

const _: () = assert!(ENTRY_BYTES == 584 && RECORD_BYTES == 576 && TILES == 7);

/// Encode one latent (dims 0..448 nope, 448..512 rope). Errors on non-finite or `|x| > 2^127` values.
pub fn encode_entry(x: &[f32; DIMS]) -> Result<[u8; ENTRY_BYTES]> {
    check_values("kv::encode_entry", x, DIMS)?;
    let mut out = [0u8; ENTRY_BYTES];
    for t in 0..TILES {
        let dims = t * TILE..(t + 1) * TILE;
        out[RECORD_BYTES + t] = fp8::quantize_block(&x[dims.clone()], &mut out[dims]);
    }
    for (i, &v) in x[NOPE_DIMS..].iter().enumerate() {
        let o = NOPE_DIMS + 2 * i;
        out[o..o + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes());
    }
    out[ENTRY_BYTES - 1] = 0;
    Ok(out)
}

/// Decode a contiguous 584-byte entry. Errors on a wrong length, an e4m3 NaN code, a ue8m0 NaN scale
/// (0xFF) or a non-finite BF16 rope value.
pub fn decode_entry(entry: &[u8]) -> Result<[f32; DIMS]> {
    if entry.len() != ENTRY_BYTES {
        bail!(
            "kv::decode_entry: entry has {} bytes, expected {ENTRY_BYTES}",
            entry.len()
        );
    }
    decode_record(&entry[..RECORD_BYTES], &entry[RECORD_BYTES..])
}

/// Decode an entry stored as its 576-byte record and its 8 (or 7: the pad is not read) scale bytes,
/// as a paged cache keeps them. Errors as [`decode_entry`].
pub fn decode_record(record: &[u8], scales: &[u8]) -> Result<[f32; DIMS]> {
    if record.len() != RECORD_BYTES {
        bail!(
            "kv::decode_record: record has {} bytes, expected {RECORD_BYTES}",
            record.len()
        );
    }
    if scales.len() != SCALE_BYTES && scales.len() != TILES {
        bail!(
            "kv::decode_record: {} scale bytes, expected {SCALE_BYTES} (or {TILES} without the pad)",
            scales.len()
        );
    }
    let mut out = [0f32; DIMS];
    for (d, (&c, v)) in record[..NOPE_DIMS].iter().zip(&mut out).enumerate() {
        let s = scales[d / TILE];
        if s == 0xFF {
            bail!("kv: scale of tile {} is the ue8m0 NaN code 0xff", d / TILE);
        }
        if c & 0x7F == e4m3::NAN_CODE {
            bail!("kv: nope dim {d} is an e4m3 NaN code ({c:#04x})");
        }
        *v = e4m3::decode(c) * ue8m0::decode(s);
    }
    for i in 0..ROPE_DIMS {
        let o = NOPE_DIMS + 2 * i;
        let v = bf16::from_le_bytes([record[o], record[o + 1]]).to_f32();
        if !v.is_finite() {
            bail!("kv: rope dim {} is not finite", NOPE_DIMS + i);
        }
        out[NOPE_DIMS + i] = v;
    }
    Ok(out)
}
