//! BF16 helpers. The codec itself is `half::bf16` (`from_f32` rounds to nearest even, NaN stays NaN).

pub use half::bf16;

/// `x` rounded to the nearest BF16 value (ties to even), returned as f32: the rounding point every
/// "stored as BF16" step in the references goes through.
#[inline]
pub fn round(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// Round a slice to BF16 storage.
pub fn to_bf16_vec(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// Widen BF16 storage to f32 (exact).
pub fn to_f32_vec(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}
