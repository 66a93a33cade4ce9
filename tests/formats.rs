//! Proofs of the DESIGN §3 format facts and checks of every block codec in `megamoe::formats`.
//!
//! Exhaustive where the space is small (all e2m1 x e4m3 code pairs, all e2m1 codes x powers of two,
//! every f32 in [1/8, 8] for e2m1 rounding); otherwise millions of fresh seeded random values plus every
//! rounding boundary +- a few ulp. Each randomized test prints its seed; set FORMATS_SEED=<seed> to
//! replay one.

mod common;

use megamoe::formats::{bf16, e2m1, e4m3, fp8, indexer_key, kv, mxfp4, nvfp4, pow2_f32, ue8m0};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------------------------------------------
// helpers

fn seeded(test: &str) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(megamoe::ops::inputs::fresh_seed(test, "FORMATS_SEED"))
}

/// A random finite f32 with |x| in [2^lo, 2^hi): uniform exponent, uniform mantissa, random sign.
fn log_uniform(rng: &mut ChaCha8Rng, lo: i32, hi: i32) -> f32 {
    let e = rng.random_range(lo..hi);
    let m = 1.0 + rng.random::<u32>() as f32 / 4294967296.0 * 0.999_999;
    let v = m * pow2_f32(e);
    if rng.random::<bool>() {
        -v
    } else {
        v
    }
}

/// A random finite f32 bit pattern (every exponent, subnormals included).
fn random_finite_bits(rng: &mut ChaCha8Rng) -> f32 {
    loop {
        let v = f32::from_bits(rng.random::<u32>());
        if v.is_finite() {
            return v;
        }
    }
}

fn next_up(x: f32, n: i32) -> f32 {
    // Step n ulps along the bit pattern of a non-negative x.
    f32::from_bits((x.to_bits() as i64 + n as i64) as u32)
}

/// Largest error, in units of the block scale, of rounding `v = x / scale` to e2m1 (nearest):
/// half the gap of the interval holding |v|, or |v| - 6 beyond the largest value.
fn e2m1_max_err_units(v: f64) -> f64 {
    let a = v.abs();
    if a > 6.0 {
        a - 6.0
    } else if a > 4.0 {
        1.0
    } else if a > 2.0 {
        0.5
    } else {
        0.25
    }
}

/// Largest error of rounding `v` to e4m3 (nearest): half the local spacing, or |v| - 448 above it.
fn e4m3_max_err(v: f64) -> f64 {
    let a = v.abs();
    if a > 448.0 {
        return a - 448.0;
    }
    // values in [2^e, 2^(e+1)) are 2^(e-3) apart; below 2^-6 the subnormal spacing 2^-9 continues
    let e = if a > 0.0 { a.log2().floor() as i32 } else { -6 }.max(-6);
    0.5 * 2f64.powi(e - 3)
}

/// Brute-force e2m1 reference: the nearest of the 8 magnitudes, ties to the even code, sign kept.
fn e2m1_reference(x: f32) -> u8 {
    if x.is_nan() {
        return 7;
    }
    let sign = if x.is_sign_negative() { 8 } else { 0 };
    let a = x.abs() as f64;
    if a >= 6.0 {
        // saturation: 6 is the nearest value. (Checked up front because for huge |x| the f64
        // distances to 4 and 6 round to the same number and would fake a tie.)
        return sign | 7;
    }
    let mut best = 0u8;
    for c in 1u8..8 {
        let d = (e2m1::MAGNITUDES[c as usize] as f64 - a).abs();
        let db = (e2m1::MAGNITUDES[best as usize] as f64 - a).abs();
        if d < db || (d == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best
}

/// The 127 non-negative finite e4m3 magnitudes, indexed by code 0x00..=0x7E.
fn e4m3_magnitudes() -> Vec<f64> {
    (0u8..=0x7E).map(|c| e4m3::decode(c) as f64).collect()
}

/// Brute-force e4m3 reference: the nearest of the 127 finite magnitudes, ties to the even code, so
/// values above 448 saturate; sign kept; Inf -> +-448; NaN -> 0x7F.
fn e4m3_reference(x: f32, mags: &[f64]) -> u8 {
    if x.is_nan() {
        return e4m3::NAN_CODE;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs() as f64;
    if a >= 448.0 {
        // saturation (satfinite): 448 is the nearest value. (Checked up front because for huge |x|
        // the f64 distances to the top codes round to the same number and would fake a tie.)
        return sign | 0x7E;
    }
    let mut best = 0u8;
    let mut best_d = a;
    for (c, &m) in mags.iter().enumerate().skip(1) {
        let d = (m - a).abs();
        if d < best_d || (d == best_d && c % 2 == 0) {
            best = c as u8;
            best_d = d;
        }
    }
    sign | best
}

fn finite_e4m3_codes() -> impl Iterator<Item = u8> {
    (0u8..=255).filter(|&c| c & 0x7F != e4m3::NAN_CODE)
}

// ---------------------------------------------------------------------------------------------------
// scalar codecs (replaces tests/formats_scalar_smoke.rs)

#[test]
fn scalar_codes_round_trip() {
    for c in finite_e4m3_codes() {
        let v = e4m3::decode(c);
        assert_eq!(e4m3::encode_rne(v), c, "e4m3 code {c:#04x} = {v}");
    }
    assert!(e4m3::decode(0x7F).is_nan() && e4m3::decode(0xFF).is_nan());
    assert_eq!(e4m3::decode(0x7E), 448.0);
    assert_eq!(e4m3::decode(0x01), pow2_f32(-9));
    for c in 0u8..16 {
        assert_eq!(e2m1::encode_rne(e2m1::decode(c)), c, "e2m1 code {c}");
        let (lo, hi) = e2m1::unpack(e2m1::pack(c, 15 - c));
        assert_eq!((lo, hi), (c, 15 - c));
    }
    for c in 0u8..255 {
        let v = ue8m0::decode(c);
        assert_eq!(v as f64, 2f64.powi(c as i32 - 127), "ue8m0 code {c}");
        assert_eq!(ue8m0::encode_exact(v), Some(c));
    }
    assert!(ue8m0::decode(0xFF).is_nan());
    assert_eq!(ue8m0::encode_exact(3.0), None);
    for n in -149..=127 {
        assert_eq!(pow2_f32(n) as f64, 2f64.powi(n), "pow2_f32({n})");
    }
}

// ---------------------------------------------------------------------------------------------------
// (a) e2m1 x e4m3 is exact in BF16

#[test]
fn e2m1_times_e4m3_is_exact_in_bf16() {
    let mut pairs = 0;
    let (mut smallest, mut largest) = (f32::INFINITY, 0f32);
    for a in 0u8..16 {
        for b in finite_e4m3_codes() {
            let (x, y) = (e2m1::decode(a), e4m3::decode(b));
            let p = x * y;
            assert_eq!(
                p as f64,
                x as f64 * y as f64,
                "f32 product {a:#x} x {b:#04x}"
            );
            assert_eq!(
                bf16::round(p).to_bits(),
                p.to_bits(),
                "bf16 round trip of {x} * {y} = {p}"
            );
            // at most 5 significant bits: the low 18 of f32's 23 mantissa bits are zero
            assert_eq!(
                p.to_bits() & 0x3FFFF,
                0,
                "{p} has more than 5 significant bits"
            );
            if p != 0.0 {
                smallest = smallest.min(p.abs());
                largest = largest.max(p.abs());
            }
            pairs += 1;
        }
    }
    assert_eq!(pairs, 16 * 254);
    // the whole range sits inside BF16's normal range [2^-126, 3.4e38]
    assert_eq!((smallest, largest), (pow2_f32(-10), 2688.0));
}

// ---------------------------------------------------------------------------------------------------
// (b) e2m1 x 2^k is exact in e4m3 while in range

#[test]
fn e2m1_times_pow2_is_exact_in_e4m3_in_range() {
    let mut exact = 0;
    for c in 0u8..16 {
        for k in -24..=12 {
            let v = e2m1::decode(c) * pow2_f32(k);
            // e2m1 values have at most 2 significant bits, e4m3 has 4 (normal) and a grid of 2^-9
            // (subnormal): exact iff zero, or |v| <= 448 and v is a multiple of 2^-9.
            let in_range =
                v == 0.0 || (v.abs() <= 448.0 && (v.abs() as f64 * 512.0).fract() == 0.0);
            let back = e4m3::decode(e4m3::encode_rne(v));
            if in_range {
                assert_eq!(back.to_bits(), v.to_bits(), "e2m1 {c} * 2^{k} = {v}");
                exact += 1;
            } else {
                assert_ne!(
                    back, v,
                    "e2m1 {c} * 2^{k} = {v} should not be representable"
                );
            }
        }
    }
    // the DSV4 use: every nonzero e2m1 value times 2^k for k in [-8, 6] is exact
    for c in (1u8..8).chain(9..16) {
        for k in -8..=6 {
            let v = e2m1::decode(c) * pow2_f32(k);
            assert_eq!(e4m3::decode(e4m3::encode_rne(v)), v);
        }
    }
    assert!(exact > 16 * 15, "only {exact} exact cases");
}

// ---------------------------------------------------------------------------------------------------
// (c) e2m1 rounding: nearest, ties to even, saturation at 6, sign kept

#[test]
fn e2m1_rounding_exhaustive_in_range_and_at_midpoints() {
    // every f32 in [1/8, 8], both signs: all thresholds of e2m1 lie in here
    let (lo, hi) = (0.125f32.to_bits(), 8.0f32.to_bits());
    for bits in lo..=hi {
        let x = f32::from_bits(bits);
        assert_eq!(e2m1::encode_rne(x), e2m1_reference(x), "x = {x:e}");
        assert_eq!(e2m1::encode_rne(-x), e2m1_reference(-x), "x = {:e}", -x);
    }
    // every 97th bit pattern over all f32 (all exponents, subnormals, Inf, NaN)
    for bits in (0..=u32::MAX).step_by(97) {
        let x = f32::from_bits(bits);
        assert_eq!(e2m1::encode_rne(x), e2m1_reference(x), "bits {bits:#010x}");
    }
    // midpoints and their neighbours, with the documented tie winners
    let ties = [
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),
    ];
    for (m, even) in ties {
        assert_eq!(e2m1::encode_rne(m), even, "tie at {m}");
        assert_eq!(e2m1::encode_rne(-m), even | 8, "tie at -{m}");
        for d in 1..=3 {
            assert_eq!(
                e2m1::encode_rne(next_up(m, -d)),
                e2m1_reference(next_up(m, -d))
            );
            assert_eq!(
                e2m1::encode_rne(next_up(m, d)),
                e2m1_reference(next_up(m, d))
            );
            assert_ne!(
                e2m1::encode_rne(next_up(m, -d)),
                e2m1::encode_rne(next_up(m, d)),
                "{m} is a threshold"
            );
        }
    }
    // saturation, signed zero, NaN/Inf policy
    assert_eq!(e2m1::encode_rne(6.0), 7);
    assert_eq!(e2m1::encode_rne(1e30), 7);
    assert_eq!(e2m1::encode_rne(-7.5), 15);
    assert_eq!(e2m1::encode_rne(f32::INFINITY), 7);
    assert_eq!(e2m1::encode_rne(f32::NEG_INFINITY), 15);
    assert_eq!(e2m1::encode_rne(f32::NAN), 7);
    assert_eq!(e2m1::encode_rne(-0.0), 8);
    assert_eq!(e2m1::encode_rne(-0.1), 8);
    assert_eq!(e2m1::decode(8).to_bits(), (-0.0f32).to_bits());
}

#[test]
fn e2m1_rounding_random() {
    let mut rng = seeded("e2m1_rounding_random");
    for _ in 0..1_000_000 {
        let x = random_finite_bits(&mut rng);
        assert_eq!(e2m1::encode_rne(x), e2m1_reference(x), "x = {x:e}");
        let y = rng.random_range(-7.0f32..7.0);
        assert_eq!(e2m1::encode_rne(y), e2m1_reference(y), "y = {y:e}");
    }
}

// ---------------------------------------------------------------------------------------------------
// (d) e4m3 rounding vs brute force over all codes

#[test]
fn e4m3_rounding_matches_brute_force() {
    let mut rng = seeded("e4m3_rounding_matches_brute_force");
    let table = e4m3_magnitudes();
    let check = |x: f32| {
        let want = e4m3_reference(x, &table);
        assert_eq!(
            e4m3::encode_rne(x),
            want,
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    };
    // every representable value, every midpoint between neighbours, +- 3 ulp
    let mags: Vec<f32> = table.iter().map(|&m| m as f32).collect();
    for w in mags.windows(2) {
        let mid = ((w[0] as f64 + w[1] as f64) / 2.0) as f32; // exact: 5 significant bits
        assert_eq!(mid as f64, (w[0] as f64 + w[1] as f64) / 2.0);
        for base in [w[0], mid] {
            for d in -3..=3 {
                if base == 0.0 && d < 0 {
                    continue;
                }
                let x = next_up(base, d);
                check(x);
                check(-x);
            }
        }
    }
    // above the top: the would-be midpoint 464 and beyond, Inf, NaN, zeros, every f32 subnormal step
    for x in [
        448.0,
        449.0,
        463.9,
        464.0,
        464.1,
        480.0,
        1e6,
        f32::MAX,
        f32::INFINITY,
    ] {
        check(x);
        check(-x);
    }
    assert_eq!(e4m3::encode_rne(f32::NAN), e4m3::NAN_CODE);
    assert_eq!(e4m3::encode_rne(0.0), 0x00);
    assert_eq!(e4m3::encode_rne(-0.0), 0x80);
    for bits in (1u32..0x0080_0000).step_by(4099) {
        check(f32::from_bits(bits));
    }
    // random: all bit patterns, the e4m3 range, and log-uniform across it
    for _ in 0..1_000_000 {
        check(random_finite_bits(&mut rng));
        check(rng.random_range(-480.0f32..480.0));
        check(log_uniform(&mut rng, -13, 9));
    }
}

// ---------------------------------------------------------------------------------------------------
// (e) ue8m0 power-of-two scale vs an f64 reference

/// Smallest k with 2^k >= r (r > 0), by exact f64 comparisons.
fn ceil_log2(r: f64) -> i32 {
    let mut k = r.log2().floor() as i32 - 1;
    while 2f64.powi(k) < r {
        k += 1;
    }
    k
}

#[test]
fn ue8m0_pow2_scale_matches_f64_reference() {
    let mut rng = seeded("ue8m0_pow2_scale_matches_f64_reference");
    let mut division_rounded_onto_pow2 = 0;
    for qmax in [e2m1::MAX, e4m3::MAX] {
        let mut check = |amax: f32| {
            let code = ue8m0::pow2_scale_for(amax, qmax);
            // the documented rule: ceil(log2) of the f32 quotient
            let r32 = (amax / qmax) as f64;
            assert_eq!(
                code as i32,
                ceil_log2(r32) + 127,
                "amax {amax:e} qmax {qmax}"
            );
            // against exact math the only difference is an f32 quotient that rounded down onto 2^k
            let exact = ceil_log2(amax as f64 / qmax as f64) + 127;
            if code as i32 != exact {
                assert_eq!(exact, code as i32 + 1);
                assert_eq!(ue8m0::encode_exact(amax / qmax), Some(code));
                division_rounded_onto_pow2 += 1;
            }
            // scale property: amax / scale <= qmax (up to that rounding) and > qmax / 2
            let q = amax as f64 / ue8m0::decode(code) as f64;
            assert!(
                q <= qmax as f64 * (1.0 + 1e-7) && q > qmax as f64 / 2.0,
                "amax/scale = {q}"
            );
        };
        for k in -120..=118 {
            let p = qmax * pow2_f32(k); // finite for qmax <= 448
            for d in -2..=2 {
                check(next_up(p, d));
            }
        }
        for _ in 0..300_000 {
            check(log_uniform(&mut rng, -116, 126).abs());
        }
    }
    println!("f32 quotient rounded onto a power of two: {division_rounded_onto_pow2} cases");
    // the floors keep the quotient normal
    assert_eq!(mxfp4::scale_code(0.0), 1);
    assert_eq!(fp8::scale_code(0.0), ue8m0::pow2_scale_for(1e-4, 448.0));
    assert_eq!(fp8::scale_code(0.0), 127 - 22); // 1e-4 / 448 = 2.2e-7 in (2^-23, 2^-22]
}

// ---------------------------------------------------------------------------------------------------
// (f) NVFP4 rows

/// Random rows with a wide spread of row and block magnitudes, a few exact zeros and all-zero blocks.
fn nvfp4_test_rows(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let row_mag = pow2_f32(rng.random_range(-20..20));
        for _ in 0..cols / nvfp4::BLOCK {
            let kind = rng.random_range(0..20);
            let block_mag = row_mag * pow2_f32(rng.random_range(-14..=0));
            for _ in 0..nvfp4::BLOCK {
                let v = match kind {
                    0 => 0.0,                                 // all-zero block
                    1 => block_mag * 6.0 * pow2_f32(-10),     // constant block
                    _ if rng.random_range(0..50) == 0 => 0.0, // scattered zeros
                    _ => rng.random_range(-1.0f32..1.0) * block_mag,
                };
                x.push(v);
            }
        }
        // Every row keeps at least one nonzero value (a 16-column row is one block, and 1 block in 20 is
        // all zero): the checks need a row amax > 0. All-zero blocks still occur inside longer rows.
        let row_start = x.len() - cols;
        if x[row_start..].iter().all(|&v| v == 0.0) {
            x[row_start] = row_mag;
        }
    }
    x
}

fn check_nvfp4(x: &[f32], q: &nvfp4::Nvfp4Rows, expect_gs: Option<&[f32]>) {
    let (rows, cols) = (q.rows, q.cols);
    q.validate().unwrap();
    let deq = nvfp4::dequantize_rows(q);
    let deq_bf16 = nvfp4::dequantize_rows_bf16(q);
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let amax_row = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let gs = q.global_scale[r];
        match expect_gs {
            Some(g) => assert_eq!(gs, g[r]),
            None if amax_row == 0.0 => assert_eq!(gs, 1.0),
            None => assert_eq!(gs, amax_row / 2688.0, "row {r}"),
        }
        let unscaled = nvfp4::dequantize_row_unscaled_bf16(q, r).unwrap();
        let row_bf16 = nvfp4::dequantize_row_bf16(q, r).unwrap();
        for b in 0..cols / 16 {
            let s = e4m3::decode(q.scales[r * cols / 16 + b]);
            assert!(s >= 0.0, "negative or NaN block scale {s}");
            let scale = s * gs;
            let block = &row[b * 16..(b + 1) * 16];
            let amax_b = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (j, &xv) in block.iter().enumerate() {
                let k = b * 16 + j;
                let i = r * cols + k;
                let c = q.code(r, k);
                // dequantization: (e2m1 * s) exact in BF16, then one f32 multiplication by gs
                let exact = e2m1::decode(c) * s;
                assert_eq!(unscaled[k].to_f32().to_bits(), exact.to_bits());
                assert_eq!(deq[i].to_bits(), (unscaled[k].to_f32() * gs).to_bits());
                assert_eq!(deq_bf16[i], row_bf16[k]);
                assert_eq!(row_bf16[k].to_f32(), bf16::round(deq[i]));
                // error bound: the e2m1 rounding error at this block's scale, plus f32 slack for
                // the division x / scale and the final multiplication
                let err = (xv as f64 - deq[i] as f64).abs();
                let slack = 2f64.powi(-21) * (xv.abs() as f64 + deq[i].abs() as f64);
                if scale == 0.0 {
                    assert_eq!(c, 0);
                    // the block scale rounded to zero: only possible for a block far below the row
                    assert!(amax_b as f64 <= 6.0 * gs as f64 * 2f64.powi(-10) * (1.0 + 1e-6));
                    continue;
                }
                let v = xv as f64 / scale as f64;
                let bound = e2m1_max_err_units(v) * scale as f64 + slack;
                assert!(
                    err <= bound,
                    "({r},{k}): x {xv:e} deq {:e} err {err:e} > {bound:e}",
                    deq[i]
                );
                if s >= pow2_f32(-6) {
                    // normal block scale: e4m3 rounding of the scale is within 2^-4 relative, so
                    // the block never saturates by more than 6 / (1 - 2^-4) - 6 = 0.4 units ...
                    assert!(v.abs() <= 6.4 + 1e-5, "({r},{k}): x/scale = {v}");
                    // ... and the block's largest element always lands on the top code (|v| >= 5.6)
                    if xv.abs() == amax_b {
                        assert_eq!(c & 7, 7, "({r},{k}): block max got code {c}");
                    }
                }
            }
        }
    }
}

#[test]
fn nvfp4_quantize_dequantize_error_bound() {
    let mut rng = seeded("nvfp4_quantize_dequantize_error_bound");
    for rows in [1usize, 3, 127, 129] {
        for cols in [16usize, 48, 4096] {
            let x = nvfp4_test_rows(&mut rng, rows, cols);
            assert!(x.iter().any(|&v| v != 0.0));
            let q = nvfp4::quantize_rows(&x, rows, cols).unwrap();
            assert_eq!(
                (q.data.len(), q.scales.len()),
                (rows * cols / 2, rows * cols / 16)
            );
            check_nvfp4(&x, &q, None);
            // a caller-given global scale follows the same rule: here at least twice the row's own and,
            // for small rows, far larger (so tiny, subnormal and zero block scales are exercised too)
            let gs: Vec<f32> = (0..rows)
                .map(|_| pow2_f32(rng.random_range(-10..10)))
                .collect();
            let gs: Vec<f32> = x
                .chunks(cols)
                .zip(&gs)
                .map(|(r, g)| nvfp4::row_global_scale(r) * 2.0 + g * 1e-3)
                .collect();
            let qg = nvfp4::quantize_rows_with_global(&x, rows, cols, &gs).unwrap();
            check_nvfp4(&x, &qg, Some(&gs));
        }
    }
}

#[test]
fn nvfp4_golden_example() {
    // row amax 2688 -> gs = 1; block 0 amax 2688 -> s = 448 (0x7E); block 1 amax 6 -> s = 1 (0x38)
    let mut x = vec![0f32; 32];
    x[0] = 2688.0;
    x[1] = 1344.0; // 3.0 * 448 -> code 5
    x[2] = -448.0; // -1.0 -> code 0xA
    x[3] = 112.0; // 0.25 * 448: tie between 0 and 0.5 -> even code 0
    x[16] = 6.0;
    x[17] = 0.75; // tie between 0.5 and 1.0 -> code 2
    x[18] = -2.5; // tie between 2 and 3 -> code 0xC (-2)
    x[19] = 5.0; // tie between 4 and 6 -> code 6 (4)
    let q = nvfp4::quantize_rows(&x, 1, 32).unwrap();
    assert_eq!(q.global_scale, vec![1.0]);
    assert_eq!(q.scales, vec![0x7E, 0x38]);
    assert_eq!(&q.data[..2], &[0x57, 0x0A]);
    assert_eq!(&q.data[8..10], &[0x27, 0x6C]);
    let d = nvfp4::dequantize_rows(&q);
    assert_eq!(&d[..4], &[2688.0, 1344.0, -448.0, 0.0]);
    assert_eq!(&d[16..20], &[6.0, 1.0, -2.0, 4.0]);
    // all-zero row: gs = 1, every scale and code 0
    let z = nvfp4::quantize_rows(&[0.0; 16], 1, 16).unwrap();
    assert_eq!((z.global_scale[0], z.scales[0]), (1.0, 0));
    assert!(z.data.iter().all(|&b| b == 0));
}

#[test]
fn nvfp4_rejects_bad_input() {
    let x = vec![1.0f32; 48];
    let e = |r: anyhow::Result<nvfp4::Nvfp4Rows>| format!("{:#}", r.unwrap_err());
    assert!(e(nvfp4::quantize_rows(&x, 2, 24)).contains("multiple of 16"));
    assert!(e(nvfp4::quantize_rows(&x, 2, 32)).contains("48 values"));
    let mut y = x.clone();
    y[20] = f32::NAN;
    assert!(e(nvfp4::quantize_rows(&y, 3, 16)).contains("row 1, col 4"));
    y[20] = f32::INFINITY;
    assert!(nvfp4::quantize_rows(&y, 3, 16).is_err());
    assert!(e(nvfp4::quantize_rows_with_global(&x, 3, 16, &[1.0])).contains("global scales"));
    assert!(nvfp4::quantize_rows_with_global(&x, 3, 16, &[1.0, 0.0, 1.0]).is_err());
    assert!(nvfp4::Nvfp4Rows::from_parts(1, 16, vec![0; 8], vec![0x7F], vec![1.0]).is_err());
    assert!(nvfp4::Nvfp4Rows::from_parts(1, 16, vec![0; 7], vec![0], vec![1.0]).is_err());
    let ok = nvfp4::Nvfp4Rows::from_parts(1, 16, vec![0; 8], vec![0], vec![1.0]).unwrap();
    assert!(nvfp4::dequantize_row_bf16(&ok, 1).is_err());
}

// ---------------------------------------------------------------------------------------------------
// MXFP4 and FP4 simulation

#[test]
fn mxfp4_quantize_follows_dsv4_rule() {
    let mut rng = seeded("mxfp4_quantize_follows_dsv4_rule");
    for (rows, cols) in [(1usize, 32usize), (3, 96), (65, 2048)] {
        let x: Vec<f32> = (0..rows * cols / 32)
            .flat_map(|_| {
                let mag = pow2_f32(rng.random_range(-30..30));
                (0..32)
                    .map(|_| rng.random_range(-1.0f32..1.0) * mag)
                    .collect::<Vec<_>>()
            })
            .collect();
        let m = mxfp4::quantize(&x, rows, cols).unwrap();
        let d = mxfp4::dequantize(&m);
        let mut sim = x.clone();
        mxfp4::fp4_sim(&mut sim, 32).unwrap();
        for (bi, block) in x.chunks(32).enumerate() {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
            let scale = ue8m0::decode(m.scales[bi]) as f64;
            // scale = 2^ceil(log2(amax / 6)): amax / scale in (3, 6]
            let q = amax / scale;
            assert!(
                q > 3.0 && q <= 6.0 * (1.0 + 1e-7),
                "block {bi}: amax/scale = {q}"
            );
            for j in 0..32 {
                let i = bi * 32 + j;
                let err = (x[i] as f64 - d[i] as f64).abs();
                assert!(
                    err <= e2m1_max_err_units(x[i] as f64 / scale) * scale,
                    "elem {i}"
                );
                assert_eq!(sim[i].to_bits(), d[i].to_bits(), "fp4_sim differs at {i}");
            }
        }
    }
    assert!(mxfp4::quantize(&[1.0; 48], 1, 48).is_err());
    let mut big = vec![1.0f32; 32];
    big[3] = 2e38; // above 2^127
    assert!(mxfp4::quantize(&big, 1, 32).is_err());
    assert!(mxfp4::fp4_sim(&mut [1.0; 40], 32).is_err());
    assert!(mxfp4::Mxfp4Matrix::from_parts(1, 32, vec![0; 16], vec![0xFF]).is_err());
}

// ---------------------------------------------------------------------------------------------------
// (g) MXFP4 -> NVFP4

#[test]
fn mxfp4_to_nvfp4_is_lossless_within_17_binades() {
    let mut rng = seeded("mxfp4_to_nvfp4_is_lossless_within_17_binades");
    for (rows, cols) in [(1usize, 32usize), (7, 64), (129, 2048)] {
        let m = common::random_mxfp4(&mut rng, rows, cols, mxfp4::MAX_EXACT_GAP);
        let (q, report) = mxfp4::to_nvfp4(&m);
        q.validate().unwrap();
        assert!(report.is_lossless(), "{:?}", &report.inexact_blocks[..1]);
        let (a, b) = (mxfp4::dequantize(&m), nvfp4::dequantize_rows(&q));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "element {i}: mxfp4 {x:e} nvfp4 {y:e}"
            );
        }
        // the global scale is a power of two, and block scales are e4m3 powers of two or zero
        for g in &q.global_scale {
            assert!(ue8m0::encode_exact(*g).is_some() || *g < f32::MIN_POSITIVE);
        }
    }
    // a realistic matrix: quantized from smooth random rows
    let x: Vec<f32> = (0..64 * 1024)
        .map(|_| rng.random_range(-0.05f32..0.05))
        .collect();
    let m = mxfp4::quantize(&x, 64, 1024).unwrap();
    let (q, report) = mxfp4::to_nvfp4(&m);
    assert!(report.is_lossless());
    assert_eq!(mxfp4::dequantize(&m), nvfp4::dequantize_rows(&q));
}

#[test]
fn mxfp4_to_nvfp4_reports_wider_spans() {
    let mut rng = seeded("mxfp4_to_nvfp4_reports_wider_spans");
    let (rows, cols) = (33usize, 1024usize);
    let m = common::random_mxfp4(&mut rng, rows, cols, 26);
    let (q, report) = mxfp4::to_nvfp4(&m);
    // expected: exactly the nonzero 16-halves more than 17 binades below the row's top nonzero one
    let mut expected = Vec::new();
    for r in 0..rows {
        let nonzero = |h: usize| (h * 16..h * 16 + 16).any(|k| m.code(r, k) & 7 != 0);
        let e_max = (0..cols / 16)
            .filter(|&h| nonzero(h))
            .map(|h| m.block_exponent(r, h / 2))
            .max();
        for h in 0..cols / 16 {
            let e = m.block_exponent(r, h / 2);
            if nonzero(h) && e_max.unwrap() - e > 17 {
                expected.push(mxfp4::InexactBlock {
                    row: r,
                    block: h,
                    exponent: e,
                    gap: e_max.unwrap() - e,
                });
            }
        }
    }
    assert!(
        !expected.is_empty(),
        "the generator should produce spans > 17"
    );
    assert_eq!(report.inexact_blocks, expected);
    // unreported blocks are still exact; reported ones are re-rounded onto the 2^-9 * G grid
    let (a, b) = (mxfp4::dequantize(&m), nvfp4::dequantize_rows(&q));
    for r in 0..rows {
        let unit = pow2_f32(-9) as f64 * q.global_scale[r] as f64;
        for k in 0..cols {
            let i = r * cols + k;
            let reported = report
                .inexact_blocks
                .iter()
                .any(|ib| ib.row == r && ib.block == k / 16);
            if reported {
                let v = a[i] as f64 / unit;
                assert!(v.abs() <= 3.0);
                let err = (a[i] as f64 - b[i] as f64).abs();
                assert!(err <= e2m1_max_err_units(v) * unit, "({r},{k})");
            } else {
                assert_eq!(a[i].to_bits(), b[i].to_bits(), "({r},{k})");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// FP8 activations, weights, simulation

fn check_fp8_block(x: &[f32], d: &[f32], scale_code: u8, what: &str) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = ue8m0::decode(scale_code) as f64;
    assert_eq!(scale_code, fp8::scale_code(amax), "{what}");
    let q = amax.max(1e-4) as f64 / scale;
    assert!(
        q > 224.0 * (1.0 - 1e-7) && q <= 448.0 * (1.0 + 1e-7),
        "{what}: amax/scale {q}"
    );
    for (xv, dv) in x.iter().zip(d) {
        let err = (*xv as f64 - *dv as f64).abs();
        assert!(
            err <= e4m3_max_err(*xv as f64 / scale) * scale,
            "{what}: x {xv:e} deq {dv:e}"
        );
    }
}

fn fp8_test_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mag = pow2_f32(rng.random_range(-16..16));
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * mag)
        .collect()
}

#[test]
fn fp8_activation_1x128() {
    let mut rng = seeded("fp8_activation_1x128");
    for (rows, cols) in [(1usize, 128usize), (3, 200), (17, 4096), (2, 7)] {
        let x: Vec<f32> = (0..rows)
            .flat_map(|_| fp8_test_values(&mut rng, cols))
            .collect();
        let a = fp8::quantize_act_1x128(&x, rows, cols).unwrap();
        assert_eq!(a.scales.len(), rows * cols.div_ceil(128));
        let d = fp8::dequantize_act_1x128(&a);
        for r in 0..rows {
            for (b, start) in (0..cols).step_by(128).enumerate() {
                let end = (start + 128).min(cols);
                let s = a.scales[r * a.blocks_per_row() + b];
                let range = r * cols + start..r * cols + end;
                check_fp8_block(&x[range.clone()], &d[range], s, &format!("act ({r},{b})"));
            }
        }
        if cols % 128 == 0 {
            let mut sim = x.clone();
            fp8::fp8_sim(&mut sim, 128).unwrap();
            assert_eq!(sim, d);
        }
    }
    assert!(fp8::quantize_act_1x128(&[1.0; 10], 3, 4).is_err());
    assert!(fp8::quantize_act_1x128(&[f32::NAN; 4], 1, 4).is_err());
    assert!(fp8::fp8_sim(&mut [1.0; 100], 64).is_err());
    assert!(fp8::Fp8Act::from_parts(1, 4, vec![0; 4], vec![0xFF]).is_err());
}

#[test]
fn fp8_weight_128x128() {
    let mut rng = seeded("fp8_weight_128x128");
    for (rows, cols) in [(1usize, 1usize), (128, 256), (300, 200), (129, 385)] {
        // per-block magnitudes differ, so a wrong block mapping would break the bound
        let mags: Vec<f32> = (0..rows.div_ceil(128) * cols.div_ceil(128))
            .map(|_| pow2_f32(rng.random_range(-12..12)))
            .collect();
        let cb = cols.div_ceil(128);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| {
                rng.random_range(-1.0f32..1.0) * mags[(i / cols / 128) * cb + (i % cols) / 128]
            })
            .collect();
        let w = fp8::quantize_weight_128x128(&x, rows, cols).unwrap();
        assert_eq!(w.scales.len(), w.row_blocks() * w.col_blocks());
        let d = fp8::dequantize_weight_128x128(&w);
        for bi in 0..w.row_blocks() {
            for bj in 0..cb {
                let (mut xb, mut db) = (Vec::new(), Vec::new());
                for r in bi * 128..((bi + 1) * 128).min(rows) {
                    for c in bj * 128..((bj + 1) * 128).min(cols) {
                        xb.push(x[r * cols + c]);
                        db.push(d[r * cols + c]);
                    }
                }
                check_fp8_block(
                    &xb,
                    &db,
                    w.scales[bi * cb + bj],
                    &format!("weight ({bi},{bj})"),
                );
            }
        }
        let again = fp8::Fp8BlockWeight::from_parts(rows, cols, w.data.clone(), w.scales.clone());
        assert_eq!(again.unwrap(), w);
    }
    assert!(fp8::Fp8BlockWeight::from_parts(130, 2, vec![0; 260], vec![0]).is_err());
}

// ---------------------------------------------------------------------------------------------------
// (h) KV entry and indexer keys

fn kv_test_entry(rng: &mut ChaCha8Rng) -> [f32; 512] {
    let mut x = [0f32; 512];
    for t in 0..8 {
        let mag = pow2_f32(rng.random_range(-12..8));
        for v in &mut x[t * 64..(t + 1) * 64] {
            *v = rng.random_range(-1.0f32..1.0) * mag;
        }
    }
    x
}

#[test]
fn kv_entry_round_trip() {
    let mut rng = seeded("kv_entry_round_trip");
    assert_eq!(kv::ENTRY_BYTES, 584);
    assert_eq!(kv::RECORD_BYTES + kv::SCALE_BYTES, 584);
    for _ in 0..2000 {
        let x = kv_test_entry(&mut rng);
        let e = kv::encode_entry(&x).unwrap();
        assert_eq!(e.len(), 584);
        assert_eq!(e[583], 0);
        let y = kv::decode_entry(&e).unwrap();
        // nope: each tile is the DSV4 FP8 simulation with block 64, within its e4m3 rounding error
        let mut sim = x[..448].to_vec();
        fp8::fp8_sim(&mut sim, 64).unwrap();
        for t in 0..7 {
            let r = t * 64..(t + 1) * 64;
            check_fp8_block(
                &x[r.clone()],
                &y[r.clone()],
                e[576 + t],
                &format!("kv tile {t}"),
            );
        }
        assert_eq!(&y[..448], &sim[..]);
        // rope: BF16-rounded, little-endian
        for i in 0..64 {
            assert_eq!(y[448 + i].to_bits(), bf16::round(x[448 + i]).to_bits());
            let b = bf16::bf16::from_f32(x[448 + i]).to_bits().to_le_bytes();
            assert_eq!(&e[448 + 2 * i..450 + 2 * i], &b);
        }
        // split record + scales (paged layout) decodes the same, with or without the pad byte
        assert_eq!(kv::decode_record(&e[..576], &e[576..]).unwrap(), y);
        assert_eq!(kv::decode_record(&e[..576], &e[576..583]).unwrap(), y);
        // QAT-simulated values are reproduced exactly by the cache
        let z = kv::decode_entry(&kv::encode_entry(&y).unwrap()).unwrap();
        assert_eq!(z, y);
    }
    let x = kv_test_entry(&mut rng);
    let mut e = kv::encode_entry(&x).unwrap();
    assert!(kv::decode_entry(&e[..583]).is_err());
    e[576] = 0xFF;
    assert!(kv::decode_entry(&e).is_err());
    e[576] = 120;
    e[5] = 0x7F;
    assert!(kv::decode_entry(&e).is_err());
    let mut bad = x;
    bad[500] = f32::NAN;
    assert!(kv::encode_entry(&bad).is_err());
}

#[test]
fn indexer_key_round_trips() {
    let mut rng = seeded("indexer_key_round_trips");
    assert_eq!(
        (indexer_key::FP8_ENTRY_BYTES, indexer_key::MXFP4_ENTRY_BYTES),
        (132, 68)
    );
    for _ in 0..5000 {
        let mut x = [0f32; 128];
        let mag = pow2_f32(rng.random_range(-16..16));
        for v in &mut x {
            *v = rng.random_range(-1.0f32..1.0) * mag;
        }
        // FP8: plain f32 scale max(amax, 1e-4) / 448
        let e = indexer_key::encode_fp8(&x).unwrap();
        assert_eq!(e.len(), 132);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = f32::from_le_bytes(e[128..132].try_into().unwrap());
        assert_eq!(scale.to_bits(), (amax.max(1e-4) / 448.0).to_bits());
        let y = indexer_key::decode_fp8(&e).unwrap();
        for (xv, yv) in x.iter().zip(&y) {
            let v = *xv as f64 / scale as f64;
            // e4m3 rounding of v (computed in f32: one extra rounding) and one rounding of the product
            let bound = e4m3_max_err(v) * scale as f64 + 2f64.powi(-22) * xv.abs() as f64;
            assert!(
                ((*xv - *yv) as f64).abs() <= bound,
                "fp8 key: x {xv:e} y {yv:e}"
            );
        }
        // MXFP4: the DSV4 FP4 rule per 32, same bytes as the matrix codec
        let f = indexer_key::encode_mxfp4(&x).unwrap();
        assert_eq!(f.len(), 68);
        let m = mxfp4::quantize(&x, 1, 128).unwrap();
        assert_eq!(&f[..64], &m.data[..]);
        assert_eq!(&f[64..], &m.scales[..]);
        assert_eq!(
            indexer_key::decode_mxfp4(&f).unwrap().to_vec(),
            mxfp4::dequantize(&m)
        );
    }
    assert!(indexer_key::decode_fp8(&[0u8; 131]).is_err());
    assert!(indexer_key::decode_fp8(&[0u8; 132]).is_err()); // scale 0
    assert!(indexer_key::decode_mxfp4(&[0xFFu8; 68]).is_err());
    assert!(indexer_key::encode_fp8(&[f32::INFINITY; 128]).is_err());
}
