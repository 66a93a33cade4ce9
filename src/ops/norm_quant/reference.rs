//! CPU reference of the `norm_quant` family: RMSNorm and its NVFP4 / FP8 1x128 / BF16 outputs
//! (reference/dsv4-architecture.md §2). The mHC boundary's reference is `ops::mhc::reference`.
//!
//! Written for clarity; every rounding point is the kernel's (kernels/norm_quant.cu), so the GPU tests can
//! compare codes exactly:
//!
//! * RMSNorm (DSV4 `RMSNorm.forward`): `ss = sum x^2`, `rstd = 1 / sqrt(ss / D + eps)` (each an IEEE f32
//!   operation), `t = x * rstd` (f32), `y = w * t` (f32), then `y` is rounded to BF16. The sum of squares
//!   is the one step whose order differs: here it is exact-ish (f64, then rounded to f32), on the GPU a
//!   fp32 tree. [`rmsnorm_row_with_rstd`] takes `rstd` as an argument so a test can feed the GPU's value
//!   and demand equality code for code.
//! * Quantizers see the BF16-rounded `y` (DSV4 casts the RMSNorm output to BF16 and the next linear
//!   quantizes that). So "fused norm -> quant" and "norm kernel -> BF16 -> quant kernel" agree bit for bit.

use anyhow::{bail, Result};

use crate::formats::{bf16, e2m1, fp8, nvfp4};

/// DSV4 `rms_norm_eps`.
pub const RMS_EPS: f32 = 1e-6;
/// NVFP4 block length along a row.
pub const NVFP4_BLOCK: usize = 16;
/// FP8 activation block length along a row.
pub const FP8_BLOCK: usize = 128;

/// `rstd = 1 / sqrt(sum(x^2) / D + eps)`: the sum in f64 rounded once to f32, the rest one f32 op each.
pub fn row_rstd(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    rstd_from_sum_sq(ss as f32, x.len(), eps)
}

/// The f32 steps after the sum of squares (the kernel does exactly these).
pub fn rstd_from_sum_sq(ss: f32, n: usize, eps: f32) -> f32 {
    1.0 / ((ss / n as f32) + eps).sqrt()
}

/// `y = bf16(w * (x * rstd))`, returned as f32 values (exactly representable in BF16).
pub fn rmsnorm_row_with_rstd(x: &[f32], w: &[f32], rstd: f32) -> Vec<f32> {
    x.iter()
        .zip(w)
        .map(|(&v, &wv)| bf16::round(wv * (v * rstd)))
        .collect()
}

/// RMSNorm of `rows` rows of length `d`: (y as BF16-rounded f32 [rows*d], rstd [rows]).
pub fn rmsnorm_rows(
    x: &[f32],
    rows: usize,
    d: usize,
    w: &[f32],
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    if x.len() != rows * d || w.len() != d {
        bail!(
            "rmsnorm_rows: x has {} values, w {}; expected {rows}x{d} and {d}",
            x.len(),
            w.len()
        );
    }
    let mut y = Vec::with_capacity(rows * d);
    let mut rstd = Vec::with_capacity(rows);
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let s = row_rstd(row, eps);
        y.extend(rmsnorm_row_with_rstd(row, w, s));
        rstd.push(s);
    }
    Ok((y, rstd))
}

pub use crate::formats::fp8::Fp8Act as Fp8Rows;
pub use crate::formats::nvfp4::Nvfp4Rows;

/// NVFP4 quantization of one row with the codec's rule (`formats::nvfp4`: `gs = amax_row / 2688`,
/// e4m3 block scales per 16, e2m1 codes of `x / (decode(s) * gs)`); returns the row's global scale.
pub fn quantize_nvfp4_row(y: &[f32], data: &mut [u8], scales: &mut [u8]) -> f32 {
    let gs = nvfp4::row_global_scale(y);
    let mut codes = [0u8; NVFP4_BLOCK];
    for (b, block) in y.chunks_exact(NVFP4_BLOCK).enumerate() {
        scales[b] = nvfp4::quantize_block(block, gs, &mut codes);
        for (p, pair) in codes.chunks_exact(2).enumerate() {
            data[b * NVFP4_BLOCK / 2 + p] = e2m1::pack(pair[0], pair[1]);
        }
    }
    gs
}

/// NVFP4 rows of BF16-rounded normalized values: `formats::nvfp4::quantize_rows`.
pub fn quantize_nvfp4_rows(y: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Rows> {
    nvfp4::quantize_rows(y, rows, cols)
}

/// Mirror of the row-loop kernels' packed-pair NVFP4 encoder (kernels/norm_quant.cu, `e2m1_codes8_keys` and its
/// helpers), operation for operation on u32 words, so a CPU test can check it against `formats::e2m1` for
/// every BF16 value. Not used by the reference itself.
pub mod packed_e2m1_mirror {
    /// Largest f32 <= x (x finite, positive): `__double2float_rd`.
    fn f64_to_f32_rd(x: f64) -> f32 {
        let f = x as f32;
        if f64::from(f) > x {
            f32::from_bits(f.to_bits() - 1)
        } else {
            f
        }
    }

    /// Smallest f32 >= x (x finite, positive): `__double2float_ru`.
    fn f64_to_f32_ru(x: f64) -> f32 {
        let f = x as f32;
        if f64::from(f) < x {
            f32::from_bits(f.to_bits() + 1)
        } else {
            f
        }
    }

    /// `e2m1_thresholds(scale)` of the .cu (scale finite, > 0): code magnitude = #{i : |y| >= b[i]}.
    pub fn thresholds(scale: f32) -> [f32; 7] {
        let s = f64::from(scale);
        let nextup = |x: f32| f32::from_bits(x.to_bits() + 1);
        [
            nextup(f64_to_f32_rd(s * (0.25 + 2f64.powi(-26)))),
            f64_to_f32_ru(s * (0.75 - 2f64.powi(-25))),
            nextup(f64_to_f32_rd(s * (1.25 + 2f64.powi(-24)))),
            f64_to_f32_ru(s * (1.75 - 2f64.powi(-24))),
            nextup(f64_to_f32_rd(s * (2.5 + 2f64.powi(-23)))),
            f64_to_f32_ru(s * (3.5 - 2f64.powi(-23))),
            nextup(f64_to_f32_rd(s * (5.0 + 2f64.powi(-22)))),
        ]
    }

    /// `e2m1_thresholds_fma(scale)` of the .cu (the row loop). `fma_rd/ru(s, t, h)` rounds the exact s*t + h once;
    /// s*t + h = s*(t + 2^-k) has at most 24 + 25 significant bits, so it is exact in f64 and one directed f64
    /// -> f32 rounding of it is the FMA's result. `h` is the f32 product s * 2^-k as the device computes it
    /// (rounded when it is subnormal: the reason for the range guard).
    pub fn thresholds_fma(scale: f32) -> [f32; 7] {
        if !((2f32.powi(-100)..=2f32.powi(100)).contains(&scale)) {
            return thresholds(scale);
        }
        let s = f64::from(scale);
        let h = |k: i32| f64::from(scale * 2f32.powi(-k));
        let nextup = |x: f32| f32::from_bits(x.to_bits() + 1);
        [
            nextup(f64_to_f32_rd(s * 0.25 + h(26))),
            f64_to_f32_ru(s * 0.75 - h(25)),
            nextup(f64_to_f32_rd(s * 1.25 + h(24))),
            f64_to_f32_ru(s * 1.75 - h(24)),
            nextup(f64_to_f32_rd(s * 2.5 + h(23))),
            f64_to_f32_ru(s * 3.5 - h(23)),
            nextup(f64_to_f32_rd(s * 5.0 + h(22))),
        ]
    }

    /// `bf16_key_ru_x2`: the smallest BF16 >= b (0 < b <= +inf) as a 16-bit key in both halves.
    pub fn key_ru_x2(b: f32) -> u32 {
        let k = b.to_bits().wrapping_add(0xFFFF) >> 16;
        k | (k << 16)
    }

    /// `e2m1_codes8_keys`: pk[p] = BF16 bits of (y[p] low half, y[p + 4] high half); nibble e of the
    /// result is the code of y[e].
    pub fn codes8(pk: &[u32; 4], keys: &[u32; 7]) -> u32 {
        let mut out = 0u32;
        for (p, &pair) in pk.iter().enumerate() {
            let a = pair | 0x8000_8000;
            let d: [u32; 7] = std::array::from_fn(|i| a.wrapping_sub(keys[i]));
            let m2 = d[3];
            let m1 = (d[1] & !d[3]) | d[5];
            let m0 = d[0] ^ d[1] ^ d[2] ^ d[3] ^ d[4] ^ d[5] ^ d[6];
            let sh = 4 * p as u32;
            out |= ((m0 >> (15 - sh)) & (0x0001_0001 << sh))
                | ((m1 >> (14 - sh)) & (0x0002_0002 << sh))
                | ((m2 >> (13 - sh)) & (0x0004_0004 << sh))
                | ((pair >> (12 - sh)) & (0x0008_0008 << sh));
        }
        out
    }

    /// `prmt.b32` (default mode) of the .cu: result byte n = byte (nibble n & 7) of {b, a}, sign-replicated
    /// when the nibble's bit 3 is set.
    pub fn prmt_b32(a: u32, b: u32, sel: u32) -> u32 {
        let src = (u64::from(b) << 32) | u64::from(a);
        (0..4).fold(0u32, |acc, n| {
            let nib = (sel >> (4 * n)) & 0xF;
            let byte = ((src >> (8 * (nib & 7))) & 0xFF) as u32;
            let byte = if nib & 8 != 0 {
                if byte & 0x80 != 0 {
                    0xFF
                } else {
                    0
                }
            } else {
                byte
            };
            acc | (byte << (8 * n))
        })
    }

    /// `e2m1_codes8_keys<true>` (prmt placement): same codes as [`codes8`].
    pub fn codes8_prmt(pk: &[u32; 4], keys: &[u32; 7]) -> u32 {
        let mut planes = [[0u32; 4]; 4];
        for (p, &pair) in pk.iter().enumerate() {
            let a = pair | 0x8000_8000;
            let d: [u32; 7] = std::array::from_fn(|i| a.wrapping_sub(keys[i]));
            planes[0][p] = d[0] ^ d[1] ^ d[2] ^ d[3] ^ d[4] ^ d[5] ^ d[6];
            planes[1][p] = (d[1] & !d[3]) | d[5];
            planes[2][p] = d[3];
            planes[3][p] = pair;
        }
        planes.iter().enumerate().fold(0u32, |out, (j, x)| {
            out | (prmt_b32(x[0], x[2], 0xFBD9) & (0x0101_0101 << j))
                | (prmt_b32(x[1], x[3], 0xFBD9) & (0x1010_1010 << j))
        })
    }

    /// `codes8_bsearch` of the .cu (the resident NVFP4 kernels' encoder): per pair, a 3-step binary search over the
    /// sorted keys with per-half LOP3 selects under prmt masks; the difference words carry the code bits in
    /// bits 15 / 31 like the planes of [`codes8_prmt`], whose placement follows. Same word as [`codes8`] when
    /// `keys` is non-decreasing in each half and every key is at most 0x7F80 (tests/norm_quant.rs).
    pub fn codes8_bsearch(pk: &[u32; 4], keys: &[u32; 7]) -> u32 {
        let sel = |m: u32, a: u32, b: u32| (a & m) | (b & !m);
        let mut planes = [[0u32; 4]; 4];
        for (p, &pair) in pk.iter().enumerate() {
            let a = pair | 0x8000_8000;
            let d3 = a.wrapping_sub(keys[3]);
            let m2 = prmt_b32(d3, 0, 0xBB99);
            let d1 = a.wrapping_sub(sel(m2, keys[5], keys[1]));
            let m1 = prmt_b32(d1, 0, 0xBB99);
            let khi = sel(m2, keys[6], keys[2]);
            let klo = sel(m2, keys[4], keys[0]);
            let d0 = a.wrapping_sub(sel(m1, khi, klo));
            planes[0][p] = d0;
            planes[1][p] = d1;
            planes[2][p] = d3;
            planes[3][p] = pair;
        }
        planes.iter().enumerate().fold(0u32, |out, (j, x)| {
            out | (prmt_b32(x[0], x[2], 0xFBD9) & (0x0101_0101 << j))
                | (prmt_b32(x[1], x[3], 0xFBD9) & (0x1010_1010 << j))
        })
    }

    /// `max.u16x2` of the .cu.
    pub fn max_u16x2(a: u32, b: u32) -> u32 {
        (a & 0xFFFF).max(b & 0xFFFF) | (a >> 16).max(b >> 16) << 16
    }

    /// The chunk amax of the row-loop kernel: max of the guarded keys, as an f32.
    pub fn chunk_amax(pk: &[u32; 4]) -> f32 {
        let g = 0x8000_8000;
        let m = max_u16x2(
            max_u16x2(pk[0] | g, pk[1] | g),
            max_u16x2(pk[2] | g, pk[3] | g),
        );
        let key = (m & 0xFFFF).max(m >> 16);
        f32::from_bits((key & 0x7FFF) << 16)
    }

    /// Pairs (p, p + 4) of 8 BF16 bit patterns, as the kernel packs them.
    pub fn pair_up(bits: &[u16; 8]) -> [u32; 4] {
        std::array::from_fn(|p| u32::from(bits[p]) | (u32::from(bits[p + 4]) << 16))
    }
}

/// Mirror of the resident FP8 kernel's division-free ue8m0 scale (kernels/norm_quant.cu,
/// `ue8m0_scale_448_divfree`): for `a = max(block amax, 1e-4)` (never NaN), the code of
/// `formats::ue8m0::pow2_scale_for(a, 448)` is `((bits(a) + 0x1FFFFF) >> 23) - 8` for finite `a` (the exponent
/// field less 8, plus 1 when the mantissa is above 0.75), 254 for `+inf`. The proof is beside the device code;
/// tests/norm_quant.rs checks it for every BF16 amax and a sweep of f32 values. Not used by the reference.
pub fn ue8m0_scale_448_divfree(a: f32) -> u8 {
    debug_assert!(
        a >= 1e-4,
        "ue8m0_scale_448_divfree: amax {a} below the 1e-4 floor"
    );
    let b = a.to_bits();
    if b >= 0x7F80_0000 {
        254
    } else {
        (((b + 0x1F_FFFF) >> 23) - 8) as u8
    }
}

/// DSV4 `act_quant` of one row (`formats::fp8`): per 128-block `scale = 2^ceil(log2(max(amax, 1e-4) /
/// 448))`, `code = e4m3(x / scale)`. The kernel multiplies by the exact reciprocal power of two instead:
/// the same real number, rounded once, so the same code.
pub fn quantize_fp8_row(y: &[f32], data: &mut [u8], scales: &mut [u8]) {
    for (b, block) in y.chunks(FP8_BLOCK).enumerate() {
        let end = (b * FP8_BLOCK + block.len()).min(data.len());
        scales[b] = fp8::quantize_block(block, &mut data[b * FP8_BLOCK..end]);
    }
}

/// FP8 1x128 rows: `formats::fp8::quantize_act_1x128` (cols a multiple of 128 here).
pub fn quantize_fp8_rows(y: &[f32], rows: usize, cols: usize) -> Result<Fp8Rows> {
    if !cols.is_multiple_of(FP8_BLOCK) {
        bail!("quantize_fp8_rows: cols = {cols} must be a multiple of 128");
    }
    fp8::quantize_act_1x128(y, rows, cols)
}

/// Distance of `a` from `b` in f32 units in the last place (both finite, same sign assumed by callers).
pub fn ulp_distance(a: f32, b: f32) -> u32 {
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}
