//! FP8 E4M3 in its "FN" form (bias 7, no Inf, NaN = S.1111.111, largest finite 448): the FP8 type of the
//! Hopper tensor cores, of NVFP4 block scales and of the DSV4 FP8 weights, activations and KV cache.

/// Largest finite value.
pub const MAX: f32 = 448.0;
/// Canonical NaN code (positive).
pub const NAN_CODE: u8 = 0x7F;

/// Exact value of a code. Every E4M3 value is exactly representable in f32 (and in BF16).
#[inline]
pub fn decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 7) as f32;
    let mag = if e == 0 {
        // subnormal: m * 2^-9
        m * f32::powi(2.0, -9)
    } else if e == 15 && code & 7 == 7 {
        return f32::NAN;
    } else {
        (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
    };
    sign * mag
}

/// Round to the nearest E4M3 value, ties to even, saturating finite values and +-Inf to +-448 (the
/// semantics of `cvt.rn.satfinite.e4m3x2.f32` on sm_89+). NaN gives [`NAN_CODE`].
///
/// Why this is exact: with `e = max(floor(log2|x|), -6)` the representable values in [2^e, 2^(e+1)) are
/// spaced `q = 2^(e-3)` apart (below 2^-6 the subnormal spacing 2^-9 continues the same rule), so
/// `round_ties_even(|x| / q) * q` is the correctly rounded value; division and multiplication by a power of
/// two are exact in f32 for these ranges.
pub fn encode_rne(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= MAX {
        return sign | 0x7E;
    }
    if a == 0.0 {
        return sign;
    }
    let e = (a.log2().floor() as i32).max(-6);
    // log2 of values just below a power of two can round up; correct the exponent exactly.
    let e = if f32::powi(2.0, e) > a { e - 1 } else { e };
    let e = e.max(-6);
    let q = f32::powi(2.0, e - 3);
    let r = (a / q).round_ties_even() * q;
    if r >= MAX {
        return sign | 0x7E;
    }
    sign | encode_exact_magnitude(r)
}

/// Bits of a non-negative value that is exactly representable (and <= 448).
fn encode_exact_magnitude(r: f32) -> u8 {
    let min_normal = f32::powi(2.0, -6);
    if r < min_normal {
        let m = (r / f32::powi(2.0, -9)) as u8; // 0..7, exact
        return m;
    }
    let bits = r.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127; // -6..=8
    let mant = (bits >> 20) & 7; // top 3 mantissa bits; the rest are zero for representable values
    (((e + 7) as u8) << 3) | mant as u8
}
