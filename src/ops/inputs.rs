//! Random inputs for checks and benchmarks: seeded, never all zero, with a heavy-ish tail so quantizers see
//! blocks of very different magnitudes (per-row and per-block scales then matter).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded generator (ChaCha8: reproducible across platforms).
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Approximately standard normal (sum of 4 uniforms, rescaled): cheap and bounded.
pub fn normalish(r: &mut impl Rng) -> f32 {
    let s: f32 = (0..4).map(|_| r.random::<f32>()).sum::<f32>() - 2.0;
    s * 1.732
}

/// `rows x cols` values: each row has its own magnitude (2^-6 .. 2^6), each 16-block a further factor
/// (2^-3 .. 2^3), elements normal-ish. Never all zero.
pub fn activation_rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    let mut v = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let row_scale = (2.0f32).powf(r.random_range(-6.0..6.0));
        let mut block_scale = 1.0;
        for c in 0..cols {
            if c % 16 == 0 {
                block_scale = (2.0f32).powf(r.random_range(-3.0..3.0));
            }
            v.push(normalish(&mut r) * row_scale * block_scale);
        }
    }
    v
}

/// Uniform values in [-a, a).
pub fn uniform(n: usize, a: f32, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.random_range(-a..a)).collect()
}

/// A fresh seed for one check: `$replay_var` when set (to replay a failure), else drawn from the clock. It is
/// printed with the variable that replays it, so every random check can be reproduced from its log.
pub fn fresh_seed(test: &str, replay_var: &str) -> u64 {
    let seed = std::env::var(replay_var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            t.as_nanos() as u64 ^ (std::process::id() as u64).rotate_left(32)
        });
    eprintln!("{test}: seed {seed} (replay with {replay_var}={seed})");
    seed
}
