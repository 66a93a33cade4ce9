//! The model's numeric building blocks: Hadamard, RoPE/YaRN, simulated FP8/FP4 quantization, the
//! parallel map the reference runs its independent outputs on.

use megamoe::formats::{e2m1, e4m3};
use megamoe::model::config::YarnScaling;
use megamoe::model::numerics::{
    dot, fp4_sim_inplace, fp8_sim_inplace, hadamard_inplace, par_map, RopeTable,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rng(label: &str) -> ChaCha8Rng {
    let seed = std::env::var("MEGAMOE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("{label}: seed {seed} (set MEGAMOE_SEED to replay)");
    ChaCha8Rng::seed_from_u64(seed)
}

#[test]
fn hadamard_is_orthonormal_and_self_inverse() {
    let mut r = rng("inputs");
    let x: Vec<f32> = (0..128).map(|_| r.random_range(-3.0..3.0)).collect();
    let y0: Vec<f32> = (0..128).map(|_| r.random_range(-3.0..3.0)).collect();
    let (mut hx, mut hy) = (x.clone(), y0.clone());
    hadamard_inplace(&mut hx);
    hadamard_inplace(&mut hy);
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(p, q)| *p as f64 * *q as f64)
            .sum::<f64>()
    };
    assert!(
        (dot(&hx, &hy) - dot(&x, &y0)).abs() < 1e-3,
        "inner products preserved"
    );
    // Natural (Sylvester) order: row 1 alternates signs, so hx[1] = Σ (-1)^i x_i / sqrt(128).
    let want: f64 = x
        .iter()
        .enumerate()
        .map(|(i, v)| if i % 2 == 0 { *v as f64 } else { -(*v as f64) })
        .sum::<f64>()
        / 128f64.sqrt();
    assert!((hx[1] as f64 - want).abs() < 1e-4);
    hadamard_inplace(&mut hx);
    for (a, b) in hx.iter().zip(&x) {
        assert!((a - b).abs() < 1e-5);
    }
}

#[test]
fn yarn_table_and_inverse_rope() {
    let plain = RopeTable::new(64, 160000.0, None);
    let yarn = RopeTable::new(64, 160000.0, Some(&YarnScaling::dsv4()));
    // Arch §3.1: for θ = 160000, low = 15, high = 25: pairs 0..=15 unchanged, 25..31 divided by 16.
    for i in 0..32 {
        let ratio = yarn.freqs[i] / plain.freqs[i];
        if i <= 15 {
            assert!((ratio - 1.0).abs() < 1e-12, "pair {i}");
        } else if i >= 25 {
            assert!((ratio - 1.0 / 16.0).abs() < 1e-12, "pair {i}");
        } else {
            assert!(ratio < 1.0 && ratio > 1.0 / 16.0, "pair {i} blends");
        }
    }
    let swa = RopeTable::new(64, 10000.0, None);
    assert!((swa.freqs[1] - 10000f64.powf(-2.0 / 64.0)).abs() < 1e-15);
    let mut r = rng("inputs");
    let x: Vec<f32> = (0..64).map(|_| r.random_range(-2.0..2.0)).collect();
    let mut y = x.clone();
    let pos = r.random_range(0..1_000_000usize);
    yarn.apply(&mut y, pos, false);
    assert!(y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3));
    yarn.apply(&mut y, pos, true);
    for (a, b) in y.iter().zip(&x) {
        assert!((a - b).abs() < 1e-4, "inverse rotation undoes the rotation");
    }
    // Pair 0 at position 1 rotates by exactly freq 1 rad (θ^0 = 1).
    let mut v = vec![1.0f32, 0.0];
    RopeTable::new(2, 10000.0, None).apply(&mut v, 1, false);
    assert!((v[0] - 1f32.cos()).abs() < 1e-6 && (v[1] - 1f32.sin()).abs() < 1e-6);
}

#[test]
fn simulated_quantization_lands_on_the_grid_with_pow2_scales() {
    let mut r = rng("inputs");
    let x: Vec<f32> = (0..448)
        .map(|_| r.random_range(-5.0..5.0) * if r.random_bool(0.1) { 40.0 } else { 1.0 })
        .collect();
    let mut q = x.clone();
    fp8_sim_inplace(&mut q, 64).unwrap();
    for (b, (xs, qs)) in x.chunks(64).zip(q.chunks(64)).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = 2f32.powi((amax / 448.0).log2().ceil() as i32);
        for (xv, qv) in xs.iter().zip(qs) {
            let code = e4m3::encode_rne(xv / scale);
            assert_eq!(*qv, e4m3::decode(code) * scale, "block {b}");
            assert!(
                (qv - xv).abs() <= 0.0625 * xv.abs() + scale * 2f32.powi(-9),
                "rel error within half an e4m3 ulp"
            );
        }
    }
    let mut q4 = x[..128].to_vec();
    fp4_sim_inplace(&mut q4, 32).unwrap();
    for (xs, qs) in x[..128].chunks(32).zip(q4.chunks(32)) {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = 2f32.powi((amax / 6.0).log2().ceil() as i32);
        for (xv, qv) in xs.iter().zip(qs) {
            assert_eq!(*qv, e2m1::decode(e2m1::encode_rne(xv / scale)) * scale);
        }
    }
}

#[test]
fn par_map_is_bit_identical_to_the_sequential_map_nested_or_not() {
    // Mat-vec rows (each an f32 reduction) inside an outer loop over "tokens": the shape of the reference's
    // parallel loops. Every output must equal the sequential computation bit for bit, in index order.
    let mut r = rng("par_map");
    let (tokens, rows, cols) = (13, 97, 300);
    let w: Vec<Vec<f32>> = (0..rows)
        .map(|_| (0..cols).map(|_| r.random_range(-1.0f32..1.0)).collect())
        .collect();
    let xs: Vec<Vec<f32>> = (0..tokens)
        .map(|_| (0..cols).map(|_| r.random_range(-1.0f32..1.0)).collect())
        .collect();
    let sequential: Vec<Vec<u32>> = xs
        .iter()
        .map(|x| w.iter().map(|row| dot(row, x).to_bits()).collect())
        .collect();
    let parallel: Vec<Vec<u32>> =
        par_map(tokens, |t| par_map(rows, |i| dot(&w[i], &xs[t]).to_bits()));
    assert_eq!(parallel, sequential);
    assert!(par_map(0, |i| i).is_empty());
    assert_eq!(par_map(1, |i| i + 7), [7]);
}
