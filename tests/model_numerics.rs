//! The model's numeric building blocks: Hadamard, RoPE/YaRN, simulated FP8/FP4 quantization, the per-head query
//! RMS factor in BF16 operation order, the parallel map the reference runs its independent outputs on.

use megamoe::formats::{e2m1, e4m3};
use megamoe::model::config::YarnScaling;
use megamoe::model::numerics::{
    bf16_round, bf16_round_f64, dot, fp4_sim_inplace, fp8_sim_inplace, hadamard_inplace,
    head_rms_scale_bf16, inv_rms, par_map, rsqrt_f32_rn, RopeTable,
};
use megamoe::model::reference::q_heads_finish;
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

const NORM_EPS: f32 = 1e-6;

/// The per-head q RMS factor by hand, every rounding step visible.
/// `[3, -3, ...]` x 512: squares 9 (exact), mean 9, `bf16(9 + 1e-6)` = 9, rsqrt 1/3 -> f32 0.33333334 -> BF16
/// 171/512 = 0.333984375 (1/3 = 1.0101010|10.. x 2^-2 rounds up at the 8th significant bit). The f64 factor
/// `inv_rms` keeps 0.3333333.
/// All zeros: mean 0, `e = bf16(1e-6)` = 1.046875 x 2^-20, rsqrt = 1024 / sqrt(1.046875) = 1000.8 -> BF16 1000
/// (steps of 4 in [512, 1024)).
#[test]
fn head_rms_scale_bf16_by_hand() {
    let alternating: Vec<f32> = (0..512)
        .map(|i| if i % 2 == 0 { 3.0 } else { -3.0 })
        .collect();
    assert_eq!(head_rms_scale_bf16(&alternating, NORM_EPS), 171.0 / 512.0);
    assert_eq!(inv_rms(&alternating, NORM_EPS), 0.333_333_3);
    assert_eq!(bf16_round(1e-6), 1.046875 * 2f32.powi(-20));
    assert_eq!(head_rms_scale_bf16(&[0.0; 512], NORM_EPS), 1000.0);
}

/// A head where the BF16 order moves q by one BF16 step against the f64 factor (the 1 ulp):
/// `[1.03125, 0 x 511]`. The square 1.0634765625 rounds to BF16 1.0625 (steps of 2^-7 in [1, 2)); the mean
/// 1.0625 x 2^-9 is a BF16 value; + 1e-6 is below half its step (2^-17) and leaves it; rsqrt =
/// sqrt(512 / 1.0625) = 21.952 -> BF16 22 (steps of 1/8 in [16, 32)). Then q = bf16(1.03125 x 22 = 22.6875), a
/// tie between 22.625 and 22.75 that goes to the even 22.75; the f64 factor 21.93646 gives bf16(22.622) =
/// 22.625. `q_heads_finish` (the model's query path) computes the BF16 order per head.
#[test]
fn head_rms_scale_bf16_is_one_bf16_step_from_the_f64_factor_on_a_head() {
    let mut head = vec![0.0f32; 512];
    head[0] = 1.03125;
    let r = head_rms_scale_bf16(&head, NORM_EPS);
    assert_eq!(r, 22.0);
    assert_eq!(bf16_round(1.03125 * r), 22.75);
    let inv = inv_rms(&head, NORM_EPS);
    assert!((inv - 21.93646).abs() < 1e-4, "inv_rms {inv}");
    assert_eq!(bf16_round(1.03125 * inv), 22.625);

    // Two heads through the model's query finish: head 0 as above, head 1 = [3, -3, ...] (r = 171/512, so
    // q = bf16(+-1.001953125) = +-1). Dims 0..448 carry no RoPE.
    let mut q = head.clone();
    q.extend((0..512).map(|i| if i % 2 == 0 { 3.0f32 } else { -3.0 }));
    let rope = RopeTable::new(64, 10000.0, None);
    q_heads_finish(&mut q, 512, 448, &rope, 77, NORM_EPS);
    assert_eq!(q[0], 22.75);
    assert!(q[1..448].iter().all(|&v| v == 0.0));
    assert!(
        q[448..512].iter().all(|&v| v == 0.0),
        "zeros rotate to zeros"
    );
    assert_eq!((q[512], q[513], q[959]), (1.0, -1.0, -1.0));
}

/// `bf16_round_f64` rounds once: an f64 just above a BF16 midpoint rounds up (a conversion that drops the low
/// mantissa bits would see a tie and round to even), exact midpoints go to even, ordinary values to nearest.
#[test]
fn bf16_round_f64_rounds_once() {
    let step = 2f64.powi(-7); // BF16 step in [1, 2)
    assert_eq!(bf16_round_f64(1.0 + step / 2.0 + 2f64.powi(-40)), 1.0078125);
    assert_eq!(bf16_round_f64(1.0 + step / 2.0 - 2f64.powi(-40)), 1.0);
    assert_eq!(bf16_round_f64(1.0 + step / 2.0), 1.0);
    assert_eq!(bf16_round_f64(1.0 + 1.5 * step), 1.015625);
    assert_eq!(
        bf16_round_f64(-(1.0 + step / 2.0 + 2f64.powi(-40))),
        -1.0078125
    );
    assert_eq!(bf16_round_f64(3.0), 3.0);
    assert_eq!(bf16_round_f64(0.0), 0.0);
    assert_eq!(bf16_round_f64(1e300), f32::INFINITY);
    assert!(bf16_round_f64(f64::NAN).is_nan());
    // Every BF16 value and the midpoints beside it, over a sweep of binades.
    for bits in (0x0080u32..0x7F7F).step_by(97) {
        let v = f32::from_bits(bits << 16) as f64;
        let up = f32::from_bits((bits + 1) << 16) as f64;
        let mid = (v + up) / 2.0; // exact in f64
        assert_eq!(bf16_round_f64(v) as f64, v);
        assert_eq!(bf16_round_f64(mid * (1.0 + 2f64.powi(-45))) as f64, up);
        assert_eq!(bf16_round_f64(mid * (1.0 - 2f64.powi(-45))) as f64, v);
    }
}

/// `rsqrt_f32_rn` is the correctly rounded f32 `1 / sqrt(x)` (CUDA's `__frsqrt_rn`) for every positive normal
/// BF16 `x`: with `r = R 2^p` and the f32 midpoints `lo`, `hi` beside it, `lo^2 x < 1 < hi^2 x` in exact integer
/// arithmetic (no `1 / sqrt(x)` of a BF16 `x` is an f32 midpoint: that would need `x` a power of two, whose
/// rsqrt is a power of two or irrational).
#[test]
fn rsqrt_f32_rn_is_correctly_rounded_on_every_bf16() {
    // Sign of (n 2^q)^2 (E 2^k) - 1 for an odd integer n.
    let sq_times_minus_one = |n: u128, q: i32, e_sig: u128, e_exp: i32| -> std::cmp::Ordering {
        let v = n * n * e_sig; // < 2^(2 * 26 + 8)
        let shift = 2 * q + e_exp;
        if shift >= 0 {
            std::cmp::Ordering::Greater
        } else if -shift >= 127 {
            std::cmp::Ordering::Less
        } else {
            v.cmp(&(1u128 << -shift))
        }
    };
    for bits in 0x0080u32..=0x7F7F {
        let x = f32::from_bits(bits << 16);
        let r = rsqrt_f32_rn(x);
        assert!(r.is_normal(), "rsqrt({x}) = {r}");
        let (e_sig, e_exp) = (
            ((bits & 0x7F) | 0x80) as u128,
            ((bits >> 7) & 0xFF) as i32 - 127 - 7,
        );
        let rb = r.to_bits();
        let (r_sig, r_exp) = (
            ((rb & 0x7F_FFFF) | 0x80_0000) as u128,
            ((rb >> 23) & 0xFF) as i32 - 127 - 23,
        );
        let hi = (2 * r_sig + 1, r_exp - 1);
        let lo = if r_sig == 0x80_0000 {
            (4 * r_sig - 1, r_exp - 2) // the f32 below is in the binade below
        } else {
            (2 * r_sig - 1, r_exp - 1)
        };
        assert_eq!(
            sq_times_minus_one(lo.0, lo.1, e_sig, e_exp),
            std::cmp::Ordering::Less,
            "rsqrt({x}) = {r}: too large"
        );
        assert_eq!(
            sq_times_minus_one(hi.0, hi.1, e_sig, e_exp),
            std::cmp::Ordering::Greater,
            "rsqrt({x}) = {r}: too small"
        );
    }
}
