//! Fixtures of the head tests (tests/head.rs) and of the sampler's graph test, which feeds the embedding.

use cudarc::driver::CudaSlice;
use half::bf16;
use megamoe::gpu::Gpu;
use megamoe::ops::head::STREAMS;
use rand::Rng;

/// A random BF16 embedding table `[vocab, d]`.
pub fn random_table(rng: &mut impl Rng, vocab: usize, d: usize) -> Vec<bf16> {
    (0..vocab * d)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// The embedding's outputs for `tokens` rows of `d`: X `[T, 4, D]` poisoned, the error word zeroed.
pub fn embed_outputs(gpu: &Gpu, tokens: usize, d: usize) -> (CudaSlice<bf16>, CudaSlice<u32>) {
    (
        gpu.poisoned::<bf16>(tokens * STREAMS * d, super::POISON)
            .unwrap(),
        gpu.zeros::<u32>(1).unwrap(),
    )
}

/// Every row t of `x` `[T, 4, D]` holds `table[ids[t]]` in its 4 streams, zeros for an id < 0.
pub fn assert_rows_are_table_rows(label: &str, ids: &[i32], table: &[bf16], d: usize, x: &[bf16]) {
    for (t, &id) in ids.iter().enumerate() {
        for s in 0..STREAMS {
            let got = &x[(t * STREAMS + s) * d..(t * STREAMS + s + 1) * d];
            if id < 0 {
                assert!(
                    got.iter().all(|v| v.to_bits() == 0),
                    "{label}: row {t} not empty"
                );
            } else {
                let want = &table[id as usize * d..(id as usize + 1) * d];
                assert_eq!(got, want, "{label}: row {t} (id {id}) stream {s}");
            }
        }
    }
}
