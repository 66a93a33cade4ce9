//! UE8M0: an unsigned power of two, `2^(b - 127)` (0xFF = NaN). The block scale of MXFP4, of the DSV4 FP8
//! weights (128x128 blocks), FP8 activations (1x128) and the KV cache tiles (1x64).

/// Scale value of a code. Code 0 is 2^-127, which is below f32's normal range and becomes a subnormal.
#[inline]
pub fn decode(code: u8) -> f32 {
    if code == 0xFF {
        return f32::NAN;
    }
    // 2^-127 is a subnormal f32; build it directly so decode(0) is exact too.
    if code == 0 {
        return f32::from_bits(0x0040_0000);
    }
    f32::from_bits((code as u32) << 23)
}

/// Code of an exact power of two in [2^-127, 2^127]; `None` for anything else.
pub fn encode_exact(scale: f32) -> Option<u8> {
    if scale == f32::from_bits(0x0040_0000) {
        return Some(0);
    }
    let bits = scale.to_bits();
    if scale <= 0.0 || !scale.is_finite() || bits & 0x007F_FFFF != 0 || (bits >> 23) == 0 {
        return None;
    }
    let code = (bits >> 23) as u8;
    if code == 0xFF {
        None
    } else {
        Some(code)
    }
}

/// The power-of-two scale `2^ceil(log2(amax / qmax))` as a code: the smallest power of two `s` with
/// `amax / s <= qmax` (up to the rounding of the f32 division), the DSV4 rule for FP8 (qmax 448) and FP4
/// (qmax 6) quantization. Callers floor `amax` first (DSV4: 1e-4 for FP8, 6 * 2^-126 for FP4).
///
/// Computed on the bits of `r = amax / qmax` (one IEEE division, the same on the GPU): the exponent
/// field, plus one when any mantissa bit is set. Exact for normal `r`; `r` must be a positive normal f32.
#[inline]
pub fn pow2_scale_for(amax: f32, qmax: f32) -> u8 {
    let r = amax / qmax;
    let bits = r.to_bits();
    let exp_field = (bits >> 23) & 0xFF;
    let up = u32::from(bits & 0x007F_FFFF != 0);
    (exp_field + up).clamp(1, 254) as u8
}
