//! FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit, bias 1, no Inf/NaN): the element type of NVFP4 and MXFP4.
//!
//! Codes 0..7 are the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign. Two codes share a byte,
//! the element with the lower K index in the low nibble.
//!
//! Rounding (`encode_rne`) is round-to-nearest, ties to the even code (mantissa bit 0), saturating at 6.
//! Hopper has no FP4 pack instruction, so the GPU kernels implement exactly this comparison ladder
//! (kernels/common/formats.cuh) and the tests compare the two bit for bit.
//! NaN policy: NaN encodes as +6 (code 0x7), +-Inf as +-6; launchers reject non-finite inputs before a
//! launch, so this only fixes what the codec does if one slips through.

/// Magnitude of each of the 8 non-negative codes.
pub const MAGNITUDES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
/// Largest finite value.
pub const MAX: f32 = 6.0;

/// Value of a 4-bit code (upper bits of `code` are ignored).
#[inline]
pub fn decode(code: u8) -> f32 {
    let m = MAGNITUDES[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Round `x` to the nearest E2M1 code, ties to even, saturating to +-6. The sign bit is kept for values
/// that round to zero (so -0.1 gives code 8, which decodes to -0.0).
///
/// The thresholds are the midpoints between neighbouring magnitudes. At a midpoint the even code wins:
/// 0.25 -> 0 (code 0), 0.75 -> 1.0 (code 2), 1.25 -> 1.0 (code 2), 1.75 -> 2.0 (code 4), 2.5 -> 2.0
/// (code 4), 3.5 -> 4.0 (code 6), 5.0 -> 4.0 (code 6). Hence `<=` at even-below midpoints, `<` at
/// odd-below ones. Every comparison is false for NaN, which falls through to code 7.
#[inline]
pub fn encode_rne(x: f32) -> u8 {
    let a = x.abs();
    let m = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    if x.is_sign_negative() && !x.is_nan() {
        m | 8
    } else {
        m
    }
}

/// Pack two codes into a byte: `lo` is the element with the lower index.
#[inline]
pub fn pack(lo: u8, hi: u8) -> u8 {
    (lo & 0xF) | ((hi & 0xF) << 4)
}

/// Unpack a byte into (lower-index code, higher-index code).
#[inline]
pub fn unpack(b: u8) -> (u8, u8) {
    (b & 0xF, b >> 4)
}
