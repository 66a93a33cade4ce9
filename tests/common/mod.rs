//! The shared home of the integration tests: seeds, the GPU fixture, poisoned outputs and the assertions every
//! family's checks use. Each `tests/<family>.rs` is its own crate and uses a subset, hence `dead_code`.
//! Family fixtures live beside this file (`tests/common/<family>.rs`), declared below.
#![allow(dead_code)]

pub mod dense;
pub mod engine;
pub mod head;
pub mod indexer;
pub mod moe;
pub mod norm;
pub mod router;

use megamoe::gpu::Gpu;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub mod sparse_attn;

/// The byte that poisons outputs before a launch: NaN in f32, bf16 and e4m3, an impossible index in i32.
pub const POISON: u8 = 0xFF;

/// The GPU for a GPU test. Every GPU test is `#[ignore = "needs an H100/H200"]`, so a CPU machine reports it as
/// ignored; run with `--include-ignored` on a GPU machine. Without a GPU this panics: an ignored test that was
/// asked to run must not pass by skipping.
pub fn gpu(test: &str) -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("{test}: needs a GPU: {e:#}"))
}

/// A fresh seeded RNG for `test` (the seed is printed; `replay_var` replays it).
pub fn seeded(test: &str, replay_var: &str) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(megamoe::ops::inputs::fresh_seed(test, replay_var))
}

/// How many elements of two equally long f32 slices differ in their bits (NaN payloads and signed zeros included).
pub fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len(), "differing_bits: lengths differ");
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// Assert two buffers are equal bit for bit (kernels compared this way do the same exact operations in the
/// same order). `what` names the pair in the message.
pub fn assert_bit_identical<T: Copy + PartialEq + std::fmt::Debug>(
    label: &str,
    what: &str,
    want: &[T],
    got: &[T],
) {
    assert_eq!(want.len(), got.len(), "{label}: {what}: lengths differ");
    let bits_eq = |a: &T, b: &T| {
        // Compare the bytes, so that NaN == NaN with the same payload and -0 != +0.
        let sa = unsafe {
            std::slice::from_raw_parts(a as *const T as *const u8, std::mem::size_of::<T>())
        };
        let sb = unsafe {
            std::slice::from_raw_parts(b as *const T as *const u8, std::mem::size_of::<T>())
        };
        sa == sb
    };
    let bad: Vec<usize> = (0..want.len())
        .filter(|&i| !bits_eq(&want[i], &got[i]))
        .collect();
    assert!(
        bad.is_empty(),
        "{label}: {what} differ in {} of {} elements; first at {}: want {:?}, got {:?}",
        bad.len(),
        want.len(),
        bad[0],
        want[bad[0]],
        got[bad[0]]
    );
}

/// Assert every value is finite: a poisoned output (NaN) that a kernel failed to write shows up here.
pub fn assert_all_written(label: &str, got: &[f32]) {
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{label}: element {i} of {} is {} (not written, or not finite)",
            got.len(),
            got[i]
        );
    }
}

/// ||got - want|| / ||want|| and the largest absolute difference with its index, in f64.
pub fn rel_l2_and_max_abs(got: &[f32], want: &[f64]) -> (f64, f64, usize) {
    assert_eq!(got.len(), want.len(), "rel_l2_and_max_abs: lengths differ");
    let (mut num, mut den, mut max, mut at) = (0.0f64, 0.0f64, 0.0f64, 0usize);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let d = g as f64 - w;
        num += d * d;
        den += w * w;
        if d.abs() > max || d.is_nan() {
            max = d.abs();
            at = i;
        }
    }
    ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max, at)
}

/// Assert `||got - want|| / ||want|| <= tol` (tol justified at the call site), printing the error either way.
pub fn assert_rel_l2(label: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_all_written(label, got);
    let (rel, max, at) = rel_l2_and_max_abs(got, want);
    println!("{label}: rel L2 {rel:.3e}, max abs {max:.3e} at {at} (tolerance {tol:.1e})");
    assert!(
        rel <= tol,
        "{label}: rel L2 error {rel:.3e} > {tol:.1e} (max abs {max:.3e} at {at}: got {}, want {})",
        got[at],
        want[at]
    );
}

/// A random MXFP4 matrix whose nonzero blocks span `span` binades per row (at most), with some all-zero
/// 16-halves and all-zero 32-blocks at wild exponents (which must not matter).
pub fn random_mxfp4(
    rng: &mut ChaCha8Rng,
    rows: usize,
    cols: usize,
    span: i32,
) -> megamoe::formats::mxfp4::Mxfp4Matrix {
    let mut data = vec![0u8; rows * cols / 2];
    let mut scales = Vec::new();
    for r in 0..rows {
        let top = rng.random_range(-100..100);
        for b in 0..cols / 32 {
            let kind = rng.random_range(0..10);
            let e = if kind == 0 {
                rng.random_range(-127..=125) // an all-zero block: any exponent
            } else {
                top - rng.random_range(0..=span)
            };
            scales.push((e + 127) as u8);
            for j in 0..32 {
                let zero_half = kind == 1 && j < 16;
                let code: u8 = if kind == 0 || zero_half {
                    rng.random_range(0..2) * 8 // +0 or -0
                } else {
                    rng.random_range(0..16)
                };
                let k = b * 32 + j;
                data[(r * cols + k) / 2] |= if k % 2 == 0 { code } else { code << 4 };
            }
        }
    }
    megamoe::formats::mxfp4::Mxfp4Matrix::from_parts(rows, cols, data, scales).unwrap()
}
