//! norm_quant: CPU checks of the reference, and GPU checks of the kernels against it (skipped loudly
//! without a GPU). Seeds are fresh per run and printed; set NORM_QUANT_SEED to replay one.

use megamoe::formats::{bf16, e2m1, e4m3, ue8m0};
use megamoe::gpu::gpu_for_test;
use megamoe::ops::norm_quant::reference::{self as r, MhcParams};
use megamoe::ops::norm_quant::{
    self as nq, HostQuant, MhcPreOutputs, MhcWeights, NormOutputs, OutFormat, RowsIn,
};

/// Xorshift64 (13, 7, 17) from `seed | 1`: the cheap, reproducible bit stream of the exhaustive encoder sweeps and
/// the synthetic rows (any seed works; `| 1` keeps the state non-zero).
fn xorshift64(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

fn fresh_seed(test: &str) -> u64 {
    megamoe::ops::inputs::fresh_seed(test, "NORM_QUANT_SEED")
}

const ROWS: &[usize] = &[1, 2, 3, 7, 64, 127, 129, 4096];
const DS: &[usize] = &[4096, 7168];
/// Token counts of the mHC GPU tests (mhc_pre, mhc_post, hc_head, post+pre), each at every D of `DS`: the
/// row counts of issue #3 (1 token; partial 32-token mix tiles at 1, 2, 3, 7, 127, 129; full tiles at 64; a
/// prefill-sized 4096, 128 tiles). The CPU side of the 4096-token cases (inputs, reference, checks) measured
/// on the 2-core dev box (test profile, opt-level 2): mhc_pre ~14 s at D 4096 and ~25 s at D 7168 (three
/// output formats), post+pre ~15 s, mhc_post ~9 s, hc_head ~6 s at D 7168 (the last three estimated from
/// the measured reference pieces): each under 30 s, so both D run at 4096 tokens. Batches above one launch
/// (65535 tokens) are checked in gpu_mhc_launchers_split_batches_above_65535_tokens.
const MHC_TOKENS: &[usize] = ROWS;
const FORMATS: [OutFormat; 3] = [OutFormat::Nvfp4, OutFormat::Fp8, OutFormat::Bf16];

// ---- CPU: the reference itself --------------------------------------------------------------------------

#[test]
fn rmsnorm_reference_matches_f64_formula() {
    let seed = fresh_seed("rmsnorm_reference_matches_f64_formula");
    for &(rows, d) in &[(5usize, 256usize), (3, 4096)] {
        let x = nq::random_rows(rows, d, seed);
        let w = nq::random_weight(d, seed ^ 7);
        let (y, rstd) = r::rmsnorm_rows(&x, rows, d, &w, r::RMS_EPS).unwrap();
        let mut off_by_one = 0;
        for row in 0..rows {
            let xr = &x[row * d..(row + 1) * d];
            let ms: f64 = xr.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / d as f64;
            let rstd64 = 1.0 / (ms + f64::from(r::RMS_EPS)).sqrt();
            // 4 f32 operations after an (almost) exact sum: within 3 ulp relative.
            let rel = (f64::from(rstd[row]) - rstd64).abs() / rstd64;
            assert!(
                rel < 3.0 * 2f64.powi(-24),
                "seed {seed} row {row}: rstd {} vs f64 {rstd64} (rel {rel:e})",
                rstd[row]
            );
            for c in 0..d {
                let exact = f64::from(w[c]) * f64::from(xr[c]) * rstd64;
                let got = f64::from(y[row * d + c]);
                // y is BF16: within half a BF16 ulp of the exact value, plus the f32 steps (one BF16 ulp).
                let ulp = 2f64.powi(exact.abs().log2().floor() as i32 - 7);
                assert!(
                    (got - exact).abs() <= ulp,
                    "seed {seed} [{row},{c}]: y {got} vs exact {exact}"
                );
                if (got - exact).abs() > ulp / 2.0 {
                    off_by_one += 1;
                }
            }
        }
        // Past half an ulp only when the exact value sits within ~2^-22 relative of a BF16 midpoint.
        assert!(
            off_by_one * 1000 <= rows * d,
            "seed {seed}: {off_by_one} values past half a BF16 ulp"
        );
    }
}

#[test]
fn nvfp4_reference_follows_the_rule_and_bounds_the_error() {
    let seed = fresh_seed("nvfp4_reference_follows_the_rule_and_bounds_the_error");
    let (rows, d) = (9, 512);
    let mut y = nq::random_rows(rows, d, seed);
    y[3 * d..4 * d].iter_mut().for_each(|v| *v = 0.0); // an all-zero row: gs = 1, all codes 0
    let q = r::quantize_nvfp4_rows(&y, rows, d).unwrap();
    for row in 0..rows {
        let yr = &y[row * d..(row + 1) * d];
        let amax = yr.iter().fold(0f32, |m, v| m.max(v.abs()));
        let gs = q.global_scale[row];
        assert_eq!(
            gs,
            if amax == 0.0 { 1.0 } else { amax / 2688.0 },
            "row {row}"
        );
        for b in 0..d / 16 {
            let s = e4m3::decode(q.scales[row * d / 16 + b]);
            let scale = s * gs;
            let bamax = yr[b * 16..(b + 1) * 16]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            // The block scale maps the block amax to ~6 (e4m3 rounding: within 1/16 relative).
            if bamax > 0.0 && s >= 2f32.powi(-6) {
                assert!(
                    (bamax / scale - 6.0).abs() <= 6.0 / 15.0,
                    "row {row} block {b}: amax/scale {}",
                    bamax / scale
                );
            }
            for i in 0..16 {
                let c = b * 16 + i;
                let byte = q.data[row * d / 2 + c / 2];
                let code = if c % 2 == 0 {
                    e2m1::unpack(byte).0
                } else {
                    e2m1::unpack(byte).1
                };
                let deq = e2m1::decode(code) * scale;
                // e2m1 steps are at most 2 (between 4 and 6): error <= 1 scale unit (+ saturation of the
                // e4m3-rounded scale: amax/scale can reach 6.4, still within 1 unit of 6).
                assert!(
                    (deq - yr[c]).abs() <= scale * 1.0 + 1e-30,
                    "[{row},{c}] {} -> {deq}",
                    yr[c]
                );
            }
        }
    }
    assert!(q.data[3 * d / 2..4 * d / 2].iter().all(|&b| b == 0));
}

#[test]
fn fp8_reference_uses_pow2_scales() {
    let seed = fresh_seed("fp8_reference_uses_pow2_scales");
    let (rows, d) = (6, 1024);
    let mut y = nq::random_rows(rows, d, seed);
    y[..128].iter_mut().for_each(|v| *v *= 1e-7); // a block below the 1e-4 amax floor
    let q = r::quantize_fp8_rows(&y, rows, d).unwrap();
    for (b, &code) in q.scales.iter().enumerate() {
        let block = &y[b * 128..(b + 1) * 128];
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-4);
        let scale = ue8m0::decode(code);
        // smallest power of two with amax / scale <= 448
        assert!(
            amax / scale <= 448.0 && amax / (scale / 2.0) > 448.0,
            "block {b}: amax {amax} scale {scale}"
        );
        for (i, &v) in block.iter().enumerate() {
            let deq = e4m3::decode(q.data[b * 128 + i]) * scale;
            let tol = (v.abs() / 16.0).max(scale * 2f32.powi(-10));
            assert!((deq - v).abs() <= tol, "block {b} [{i}]: {v} -> {deq}");
        }
    }
}

/// Rust mirror of `sinkhorn_lanes` (kernels/norm_quant.cu): lane l of 16 holds C[l / 4][l % 4]; `xor(v, m)`
/// is `__shfl_xor_sync(v, m)`; `quad_sum(v, m)` = (v + xor(v, m)) + (xor(v, 2m) + xor(v, 3m)). Every lane does
/// exactly the device's operations in the device's order.
fn sinkhorn_lanes_mirror(z: &[f32; 16]) -> [f32; 16] {
    let xor = |v: &[f32; 16], m: usize| -> [f32; 16] { std::array::from_fn(|l| v[l ^ m]) };
    let quad_sum = |v: &[f32; 16], m: usize| -> [f32; 16] {
        let (a, b, d) = (xor(v, m), xor(v, 2 * m), xor(v, 3 * m));
        std::array::from_fn(|l| (v[l] + a[l]) + (b[l] + d[l]))
    };
    let (z1, z2, z3) = (xor(z, 1), xor(z, 2), xor(z, 3));
    let e: [f32; 16] =
        std::array::from_fn(|l| (z[l] - z[l].max(z1[l]).max(z2[l].max(z3[l]))).exp());
    let se = quad_sum(&e, 1);
    let mut c: [f32; 16] = std::array::from_fn(|l| e[l] * (1.0 / se[l]) + r::HC_EPS);
    let norm = |c: &mut [f32; 16], m: usize| {
        let s = quad_sum(c, m);
        for l in 0..16 {
            c[l] *= 1.0 / (s[l] + r::HC_EPS);
        }
    };
    norm(&mut c, 4);
    for _ in 1..r::SINKHORN_ITERS {
        norm(&mut c, 1);
        norm(&mut c, 4);
    }
    c
}

/// The 16-lane Sinkhorn's identity: the quad sums (c0 + c1) + (c2 + c3), (c1 + c0) + (c3 + c2),
/// (c2 + c3) + (c0 + c1), (c3 + c2) + (c1 + c0) are the same bits (IEEE addition commutes), so the lane
/// version equals the reference (and the one-thread kernel) bit for bit. 100k random logit sets.
#[test]
fn lane_sinkhorn_mirror_equals_the_reference_bitwise() {
    let seed = fresh_seed("lane_sinkhorn_mirror_equals_the_reference_bitwise");
    let mut bits = xorshift64(seed);
    let mut next = move || (bits() >> 40) as f32 / (1u64 << 24) as f32; // U(0, 1)
    for spread in [0.01f32, 1.5, 3.0, 20.0, 80.0] {
        for case in 0..20_000 {
            let logits: [f32; 16] = std::array::from_fn(|_| (next() * 2.0 - 1.0) * spread);
            let (want, got) = (r::sinkhorn(&logits), sinkhorn_lanes_mirror(&logits));
            if let Some(i) = (0..16).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                panic!(
                    "seed {seed} spread {spread} case {case}: C[{i}] lanes {} vs reference {} ({logits:?})",
                    got[i], want[i]
                );
            }
        }
    }
}

#[test]
fn sinkhorn_is_doubly_stochastic() {
    let seed = fresh_seed("sinkhorn_is_doubly_stochastic");
    let mut bits = xorshift64(seed);
    let mut next = move || (bits() >> 40) as f32 / (1u64 << 24) as f32; // U(0, 1)
                                                                        // Columns are normalized last, so they sum to 1 - eps/colsum; rows converge geometrically with a rate
                                                                        // set by the logit spread: 20 iterations give 1e-5 for logits within +-1.5 (the mixes of the test
                                                                        // parameters). For +-3 no useful rate is guaranteed (entry ratios up to e^12 within a cross ratio:
                                                                        // Birkhoff's contraction tanh(12/4) = 0.995 per normalization), and DSV4's fixed 20 iterations leave row
                                                                        // sums off by up to 1.2e-2 over random seeds (seen on the H200 run of session 3, seed 1796349619050610169,
                                                                        // case 141): the 5e-2 bound there only catches a broken row normalization.
    for (spread, row_tol) in [(1.5f32, 1e-5f32), (3.0, 5e-2)] {
        for case in 0..200 {
            let logits: [f32; 16] = std::array::from_fn(|_| (next() * 2.0 - 1.0) * spread);
            let c = r::sinkhorn(&logits);
            for i in 0..4 {
                let row: f32 = (0..4).map(|k| c[4 * i + k]).sum();
                let col: f32 = (0..4).map(|j| c[4 * j + i]).sum();
                assert!(
                    (row - 1.0).abs() < row_tol,
                    "case {case} seed {seed}: row {i} sums to {row} ({logits:?})"
                );
                assert!(
                    (col - 1.0).abs() < 1e-5,
                    "case {case} seed {seed}: col {i} sums to {col} ({logits:?})"
                );
            }
            assert!(c.iter().all(|&v| v > 0.0 && v < 1.0));
        }
    }
}

#[test]
fn mhc_reference_matches_f64_formulas() {
    let seed = fresh_seed("mhc_reference_matches_f64_formulas");
    let d = 256;
    let x = nq::random_rows(4, d, seed);
    let p = nq::random_mhc_params(d, r::HC_MIX, seed ^ 1);
    let (c, u) = r::mhc_pre_token(&x, &p);
    // f64 version of pre/post
    let ms: f64 = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / (4 * d) as f64;
    let rho = 1.0 / (ms + 1e-6).sqrt();
    let m: Vec<f64> = (0..24)
        .map(|j| {
            rho * (0..4 * d)
                .map(|i| f64::from(p.mix_fn[j * 4 * d + i]) * f64::from(x[i]))
                .sum::<f64>()
        })
        .collect();
    let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
    for i in 0..4 {
        let pre = sig(m[i] * f64::from(p.scale[0]) + f64::from(p.base[i])) + 1e-6;
        let post = 2.0 * sig(m[4 + i] * f64::from(p.scale[1]) + f64::from(p.base[4 + i]));
        assert!(
            (f64::from(c.pre[i]) - pre).abs() < 1e-6,
            "seed {seed} pre[{i}] {} vs {pre}",
            c.pre[i]
        );
        assert!(
            (f64::from(c.post[i]) - post).abs() < 2e-6,
            "seed {seed} post[{i}] {} vs {post}",
            c.post[i]
        );
    }
    for col in 0..d {
        let exact: f64 = (0..4)
            .map(|i| f64::from(c.pre[i]) * f64::from(x[i * d + col]))
            .sum();
        let ulp = 2f64.powi(exact.abs().log2().floor() as i32 - 7);
        assert!(
            (f64::from(u[col]) - exact).abs() <= ulp,
            "seed {seed} u[{col}] {} vs {exact}",
            u[col]
        );
    }
    // post: X' = post (x) y + C^T X, and the head
    let y = nq::random_rows(1, d, seed ^ 2);
    let xo = r::mhc_post_token(&y, &x, &c.post, &c.comb);
    for k in 0..4 {
        for col in 0..d {
            let exact = f64::from(c.post[k]) * f64::from(y[col])
                + (0..4)
                    .map(|j| f64::from(c.comb[4 * j + k]) * f64::from(x[j * d + col]))
                    .sum::<f64>();
            let ulp = 2f64.powi(exact.abs().log2().floor() as i32 - 7);
            assert!(
                (f64::from(xo[k * d + col]) - exact).abs() <= ulp,
                "seed {seed} X'[{k},{col}]"
            );
        }
    }
    // The test parameters' Sinkhorn outputs (what the GPU tests see): columns sum to 1 within 1e-5 (they
    // are normalized last), rows within 1e-4 (20 iterations, logits up to ~+-3 here; see
    // sinkhorn_is_doubly_stochastic for the 1e-5 regime).
    for t in 0..16u64 {
        let xt = nq::random_rows(4, d, seed ^ (100 + t));
        let (ct, _) = r::mhc_pre_token(&xt, &p);
        for i in 0..4 {
            let row: f32 = (0..4).map(|k| ct.comb[4 * i + k]).sum();
            let col: f32 = (0..4).map(|j| ct.comb[4 * j + i]).sum();
            assert!(
                (row - 1.0).abs() < 1e-4 && (col - 1.0).abs() < 1e-5,
                "seed {seed} token {t}: sums {row} / {col}"
            );
        }
    }
    let hp = nq::random_mhc_params(d, r::HC_HEAD_MIX, seed ^ 3);
    let (pre, hu) = r::hc_head_token(&x, &hp.mix_fn, 0.8, &[0.1, -0.2, 0.3, 0.0]);
    assert!(pre.iter().all(|&p| p > 1e-6 && p < 1.0 + 2e-6));
    assert_eq!(hu, r::mhc_apply_pre(&x, &pre));
}

#[test]
fn launcher_rejects_bad_shapes() {
    assert!(nq::check_rows(0, 4096).is_err());
    assert!(nq::check_rows(4, 100).is_err());
    assert!(nq::check_rows(4, nq::MAX_D + 128).is_err());
    assert!(nq::check_rows(4, 7168).is_ok());
    assert_eq!(nq::row_block_threads(4096), 128);
    assert_eq!(nq::row_block_threads(7168), 224);
    assert_eq!(nq::row_block_threads(128), 32);
    assert!(OutFormat::parse("int4").is_err());
}

// ---- GPU ------------------------------------------------------------------------------------------------

/// One row's outputs as the reference encodes them from BF16-rounded `y`.
fn encode_row(format: OutFormat, y: &[f32]) -> (Vec<u8>, Vec<u8>, f32) {
    let d = y.len();
    match format {
        OutFormat::Nvfp4 => {
            let (mut data, mut scales) = (vec![0; d / 2], vec![0; d / 16]);
            let gs = r::quantize_nvfp4_row(y, &mut data, &mut scales);
            (data, scales, gs)
        }
        OutFormat::Fp8 => {
            let (mut data, mut scales) = (vec![0; d], vec![0; d / 128]);
            r::quantize_fp8_row(y, &mut data, &mut scales);
            (data, scales, 0.0)
        }
        OutFormat::Bf16 => (
            y.iter()
                .flat_map(|v| bf16::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            vec![],
            0.0,
        ),
    }
}

/// The GPU's outputs of one row, in the same shape as [`encode_row`].
fn gpu_row(q: &HostQuant, row: usize, d: usize) -> (Vec<u8>, Vec<u8>, f32) {
    match q {
        HostQuant::Nvfp4(n) => (
            n.data[row * d / 2..(row + 1) * d / 2].to_vec(),
            n.scales[row * d / 16..(row + 1) * d / 16].to_vec(),
            n.global_scale[row],
        ),
        HostQuant::Fp8(f) => (
            f.data[row * d..(row + 1) * d].to_vec(),
            f.scales[row * d / 128..(row + 1) * d / 128].to_vec(),
            0.0,
        ),
        HostQuant::Bf16(y) => (
            y[row * d..(row + 1) * d]
                .iter()
                .flat_map(|v| bf16::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            vec![],
            0.0,
        ),
    }
}

fn first_diff(a: &[u8], b: &[u8]) -> Option<(usize, u8, u8)> {
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| (i, *x, *y))
}

/// Check RMSNorm(+quant) outputs of `rows` rows of `x` (f32 values; BF16-representable when the input was
/// BF16). Exact equality given the GPU's rstd; the GPU rstd within 4 ulp of the reference; code
/// differences against the all-CPU reference only in rows whose rstd differs (counted, printed).
fn check_norm_outputs(
    label: &str,
    x: &[f32],
    w: &[f32],
    rows: usize,
    d: usize,
    format: OutFormat,
    got: &nq::HostNormOutputs,
) {
    let mut rstd_diff_rows = 0;
    let mut max_ulps = 0;
    let mut code_diffs_cpu_rstd = 0usize;
    for row in 0..rows {
        let xr = &x[row * d..(row + 1) * d];
        let rg = got.rstd[row];
        assert!(rg.is_finite(), "{label}: rstd[{row}] not written ({rg})");
        let rc = r::row_rstd(xr, r::RMS_EPS);
        let ulps = r::ulp_distance(rg, rc);
        max_ulps = max_ulps.max(ulps);
        assert!(
            ulps <= 4,
            "{label}: rstd[{row}] GPU {rg:e} vs CPU {rc:e} ({ulps} ulp)"
        );
        let want = encode_row(format, &r::rmsnorm_row_with_rstd(xr, w, rg));
        let have = gpu_row(&got.q, row, d);
        if let Some((i, a, b)) = first_diff(&have.0, &want.0) {
            panic!("{label}: row {row} data byte {i}: GPU {a:#04x} vs reference {b:#04x} (same rstd {rg:e})");
        }
        if let Some((i, a, b)) = first_diff(&have.1, &want.1) {
            panic!("{label}: row {row} scale {i}: GPU {a:#04x} vs reference {b:#04x}");
        }
        assert_eq!(
            have.2.to_bits(),
            want.2.to_bits(),
            "{label}: row {row} global scale GPU {} vs {}",
            have.2,
            want.2
        );
        if ulps != 0 {
            rstd_diff_rows += 1;
            let cpu = encode_row(format, &r::rmsnorm_row_with_rstd(xr, w, rc));
            code_diffs_cpu_rstd += have.0.iter().zip(&cpu.0).filter(|(a, b)| a != b).count();
            code_diffs_cpu_rstd += have.1.iter().zip(&cpu.1).filter(|(a, b)| a != b).count();
        }
    }
    eprintln!(
        "{label}: exact given GPU rstd; rstd differs from the CPU in {rstd_diff_rows}/{rows} rows (max {max_ulps} ulp), \
         {code_diffs_cpu_rstd} output bytes differ from the all-CPU reference (all in those rows)"
    );
    // A 1-ulp rstd change moves a value across a rounding boundary rarely: bound the damage to 1% of a row.
    assert!(
        code_diffs_cpu_rstd <= rstd_diff_rows * d / 100 + 8,
        "{label}: too many differences vs the CPU rstd"
    );
}

#[test]
fn gpu_rmsnorm_quant_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_rmsnorm_quant_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_rmsnorm_quant_matches_reference");
    for &d in DS {
        let w = nq::random_weight(d, seed ^ d as u64);
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for &rows in ROWS {
            for f32_input in [false, true] {
                if f32_input && rows == 4096 && d == 7168 {
                    continue; // the largest case once (BF16 input) keeps the test fast
                }
                let mut x = nq::random_rows(rows, d, seed ^ (rows as u64 * 31 + d as u64));
                if f32_input {
                    // full f32 mantissas, not BF16-representable
                    x.iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v *= 1.0 + (i % 97) as f32 * 1.37e-5);
                }
                let dx16 = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
                let dx32 = nq::upload_checked_f32(&gpu, "x", &x).unwrap();
                for format in FORMATS {
                    let label = format!(
                        "rmsnorm->{} {}x{d} {} in, seed {seed}",
                        format.name(),
                        rows,
                        if f32_input { "f32" } else { "bf16" }
                    );
                    let mut out = NormOutputs::alloc_poisoned(&gpu, format, rows, d).unwrap();
                    let input = if f32_input {
                        RowsIn::F32(&dx32)
                    } else {
                        RowsIn::Bf16(&dx16)
                    };
                    nq::rmsnorm_quant(&gpu, input, &dw, r::RMS_EPS, &mut out).unwrap();
                    let got = out.download(&gpu).unwrap();
                    check_norm_outputs(&label, &x, &w, rows, d, format, &got);
                }
            }
        }
    }
}

/// BF16 rows through the fused kernel (rmsnorm_quant) and through the unfused chain (RMSNorm -> BF16 staging ->
/// quantize), every output poisoned first: (fused, unfused, staging) as downloaded.
fn fused_and_unfused(
    gpu: &megamoe::gpu::Gpu,
    dx: &cudarc::driver::CudaSlice<half::bf16>,
    dw: &cudarc::driver::CudaSlice<half::bf16>,
    format: OutFormat,
    rows: usize,
    d: usize,
) -> (
    nq::HostNormOutputs,
    nq::HostNormOutputs,
    nq::HostNormOutputs,
) {
    let mut fused = NormOutputs::alloc_poisoned(gpu, format, rows, d).unwrap();
    let mut staging = NormOutputs::alloc_poisoned(gpu, OutFormat::Bf16, rows, d).unwrap();
    let mut unfused = NormOutputs::alloc_poisoned(gpu, format, rows, d).unwrap();
    nq::rmsnorm_quant(gpu, RowsIn::Bf16(dx), dw, r::RMS_EPS, &mut fused).unwrap();
    nq::rmsnorm_then_quant(
        gpu,
        RowsIn::Bf16(dx),
        dw,
        r::RMS_EPS,
        &mut staging,
        &mut unfused,
    )
    .unwrap();
    (
        fused.download(gpu).unwrap(),
        unfused.download(gpu).unwrap(),
        staging.download(gpu).unwrap(),
    )
}

#[test]
fn gpu_unfused_chain_equals_fused() {
    let Some(gpu) = gpu_for_test("gpu_unfused_chain_equals_fused") else {
        return;
    };
    let seed = fresh_seed("gpu_unfused_chain_equals_fused");
    for &(rows, d) in &[(3usize, 4096usize), (129, 7168), (4096, 4096)] {
        let x = nq::random_rows(rows, d, seed ^ rows as u64);
        let w = nq::random_weight(d, seed);
        let dx = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for format in [OutFormat::Nvfp4, OutFormat::Fp8] {
            let (a, b, st) = fused_and_unfused(&gpu, &dx, &dw, format, rows, d);
            // The unfused chain's rstd is written by its first kernel, into the staging outputs; the second
            // (quantize-only) kernel has none. Check the chain's codes against the rstd it really used.
            let b = nq::HostNormOutputs {
                rstd: st.rstd.clone(),
                ..b
            };
            assert_eq!(
                a.rstd,
                st.rstd,
                "{rows}x{d} {}: rstd of the two paths",
                format.name()
            );
            assert!(
                a.q == b.q,
                "{rows}x{d} {} seed {seed}: fused and unfused outputs differ",
                format.name()
            );
            check_norm_outputs(
                &format!("unfused {} {rows}x{d} seed {seed}", format.name()),
                &x,
                &w,
                rows,
                d,
                format,
                &b,
            );
        }
    }
}

// ---- row-looping v4p NVFP4 kernels (the BF16 -> NVFP4 path) ----------------------------------------------

/// The packed NVFP4 encoder of the v4p kernels (packed BF16 pairs, 16-bit integer compares, thermometer
/// logic, FMA thresholds; Rust mirror of the device code, both code placements) equals `formats::e2m1` of the IEEE quotient for EVERY finite BF16 value (and +-inf), at
/// scales made as the kernel makes them (e4m3 code x global scale, global scales from subnormal to huge)
/// plus every e4m3 code at power-of-two global scales; random per-element signs. Also the chunk amax.
#[test]
fn v4_packed_e2m1_encoder_equals_the_reference_for_every_bf16() {
    use megamoe::ops::norm_quant::reference::packed_e2m1_mirror as pm;
    let seed = fresh_seed("v4_packed_e2m1_encoder_equals_the_reference_for_every_bf16");
    let mut next = xorshift64(seed);
    let mut scales = Vec::new();
    for code in 1u8..0x7F {
        for k in [-130i32, -100, -20, 0, 20, 100] {
            scales.push(e4m3::decode(code) * 2f32.powi(k));
        }
    }
    for _ in 0..300 {
        let code = (next() % 0x7E) as u8 + 1;
        // global scale bits: any exponent field 0..=253 (subnormal included), random mantissa
        let gs = f32::from_bits(((next() % 254) as u32) << 23 | (next() as u32 & 0x7F_FFFF));
        scales.push(e4m3::decode(code) * gs);
    }
    scales.retain(|s| s.is_finite() && *s > 0.0);
    // every non-NaN BF16 magnitude: 0 ..= 0x7F80 (+inf)
    let mags: Vec<u16> = (0u16..=0x7F80).collect();
    let mut checked = 0u64;
    for &scale in &scales {
        let keys: [u32; 7] = pm::thresholds(scale).map(pm::key_ru_x2);
        assert_eq!(
            pm::thresholds_fma(scale).map(f32::to_bits),
            pm::thresholds(scale).map(f32::to_bits),
            "v4p FMA thresholds vs the FP64 form at scale {scale:e} ({:#010x}), seed {seed}",
            scale.to_bits()
        );
        for chunk in mags.chunks(8) {
            let mut bits = [0u16; 8];
            let signs = next();
            for (e, b) in bits.iter_mut().enumerate() {
                let m = chunk[e % chunk.len()];
                *b = m | if (signs >> e) & 1 == 1 { 0x8000 } else { 0 };
            }
            let pk = pm::pair_up(&bits);
            let got = pm::codes8(&pk, &keys);
            let got_prmt = pm::codes8_prmt(&pk, &keys);
            assert_eq!(
                got_prmt, got,
                "v4p (prmt placement) vs v4 codes of {bits:04x?} at scale {scale:e} (seed {seed})"
            );
            let ys = bits.map(|b| f32::from_bits(u32::from(b) << 16));
            for (e, &y) in ys.iter().enumerate() {
                let want = e2m1::encode_rne(y / scale);
                let have = ((got >> (4 * e)) & 0xF) as u8;
                assert_eq!(
                    have, want,
                    "v4 encoder: y {y:e} (bf16 {:#06x}) scale {scale:e} ({:#010x}): code {have:#x} vs reference {want:#x} \
                     (element {e} of chunk {bits:04x?}, seed {seed})",
                    bits[e],
                    scale.to_bits()
                );
                checked += 1;
            }
            let amax = ys.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                pm::chunk_amax(&pk).to_bits(),
                amax.to_bits(),
                "v4 chunk amax of {bits:04x?} (seed {seed})"
            );
        }
    }
    eprintln!(
        "v4 packed e2m1 encoder: {checked} codes agree ({} scales x all BF16 magnitudes)",
        scales.len()
    );
}

#[test]
fn mhc_pre_takes_pdl_pair_then_two_launches_then_tensor_mix() {
    assert_eq!(nq::MHC_PDL_MAX_TOKENS, 8);
    assert_eq!(nq::MHC_TENSOR_MIX_MIN_TOKENS, 128);
    let want = [
        (&[1usize, 2, 7, 8][..], nq::MhcPrePath::PdlPair),
        (&[9, 16, 64, 127][..], nq::MhcPrePath::TwoLaunch),
        (
            &[128, 129, 8192, 65536, 65539][..],
            nq::MhcPrePath::TensorMix,
        ),
    ];
    for (counts, path) in want {
        for &tokens in counts {
            assert_eq!(nq::mhc_pre_auto_path(tokens), path, "T={tokens}");
        }
    }
}

#[test]
fn v4_grid_is_one_full_wave_or_one_cta_per_row() {
    for (rows, resident) in [
        (1, 528),
        (527, 528),
        (528, 528),
        (529, 528),
        (4096, 792),
        (65536, 924),
        (7, 1),
        (5, 0),
    ] {
        let g = nq::v4_grid(rows, resident);
        assert_eq!(
            g,
            rows.min(resident.max(1)),
            "rows {rows} resident {resident}"
        );
        // CTA b runs rows b, b + g, ...: the longest CTA runs ceil(rows / resident) rows
        assert_eq!(
            rows.div_ceil(g),
            rows.div_ceil(resident.max(1)),
            "rows {rows} resident {resident}: grid {g}"
        );
    }
}

/// The BF16 -> NVFP4 path of `rmsnorm_quant` (the row-looping v4p kernel) against the CPU reference, exact
/// given the GPU rstd (this replaced the session-3 bit-for-bit comparison with the removed one-CTA-per-row
/// kernel, which matched the same reference). Row counts include ones above one resident wave (at D = 4096
/// ~800-900 CTAs): 4096 and 9000 rows are ~5 and ~10 rows per CTA, with the next row's loads in flight.
/// Then the quantize-only v4p kernel (`quantize_bf16_rows`) at exact e2m1 decision points (ties included),
/// 2000 rows so CTAs loop, bit for bit against the CPU encoder.
#[test]
fn gpu_rmsnorm_nvfp4_v4p_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_rmsnorm_nvfp4_v4p_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_rmsnorm_nvfp4_v4p_matches_reference");
    for &d in DS {
        let w = nq::random_weight(d, seed ^ d as u64);
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for rows in [1usize, 7, 129, 4096, 9000] {
            let x = nq::random_rows(rows, d, seed ^ (rows as u64 * 41 + d as u64));
            let dx = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
            let label = format!("v4p rmsnorm->nvfp4 {rows}x{d}, seed {seed}");
            let mut out = NormOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, rows, d).unwrap();
            nq::rmsnorm_quant(&gpu, RowsIn::Bf16(&dx), &dw, r::RMS_EPS, &mut out).unwrap();
            let got = out.download(&gpu).unwrap();
            // every row's rstd and global scale written (poisoned before: NaN), then a row subset vs the CPU
            if let Some(i) = (0..rows).find(|&i| !got.rstd[i].is_finite()) {
                panic!("{label}: rstd[{i}] not written ({})", got.rstd[i]);
            }
            let HostQuant::Nvfp4(q) = &got.q else {
                panic!("{label}: not an NVFP4 download")
            };
            if let Some(i) = (0..rows).find(|&i| !q.global_scale[i].is_finite()) {
                panic!(
                    "{label}: global scale [{i}] not written ({})",
                    q.global_scale[i]
                );
            }
            // the last rows too (the highest rows of the CTAs' loops), when the first 600 do not cover them
            let first = rows.saturating_sub(64).max(600).min(rows);
            if first < rows {
                let tail = rows - first;
                let tail_out = nq::HostNormOutputs {
                    rstd: got.rstd[first..].to_vec(),
                    q: HostQuant::Nvfp4(r::Nvfp4Rows {
                        rows: tail,
                        cols: d,
                        data: q.data[first * d / 2..].to_vec(),
                        scales: q.scales[first * d / 16..].to_vec(),
                        global_scale: q.global_scale[first..].to_vec(),
                    }),
                };
                check_norm_outputs(
                    &format!("{label} (rows {first}..{rows})"),
                    &x[first * d..],
                    &w,
                    tail,
                    d,
                    OutFormat::Nvfp4,
                    &tail_out,
                );
            }
            let check_rows = rows.min(600);
            let sub = nq::HostNormOutputs {
                rstd: got.rstd[..check_rows].to_vec(),
                ..got
            };
            check_norm_outputs(
                &label,
                &x[..check_rows * d],
                &w,
                check_rows,
                d,
                OutFormat::Nvfp4,
                &sub,
            );
        }
        // exact e2m1 decision points (ties included), quantize-only v4p kernel vs the CPU reference
        let rows = 2000;
        let y = boundary_rows(rows, d, seed ^ 0xb0 ^ d as u64);
        assert!(y.iter().all(|v| v.is_finite() && bf16::round(*v) == *v));
        let dy = nq::upload_checked_bf16(&gpu, "y", &y).unwrap();
        let label = format!("v4p quant->nvfp4 boundary rows {rows}x{d}, seed {seed}");
        let want = HostQuant::encode(OutFormat::Nvfp4, &y, rows, d).unwrap();
        let mut out = NormOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, rows, d).unwrap();
        nq::quantize_bf16_rows(&gpu, &dy, &mut out).unwrap();
        assert_same_nvfp4(&label, &out.download(&gpu).unwrap().q, &want, d);
        eprintln!("{label}: kernel and CPU reference bit-identical");
    }
}

/// Reduce the split-K partials (`[T][nmix+1][S]`) exactly as `reduce_partials` in the .cu does: warp w
/// takes 32-wide split blocks w, w+nw, ...; in a block, lane l holds split 32b+l (0 past S), an xor
/// butterfly sums the lanes, blocks accumulate in order from 0; then warps add up in order from 0.
fn reduce_like_gpu(
    part: &[f32],
    splits: usize,
    nwarps: usize,
    t: usize,
    j: usize,
    nmix: usize,
) -> f32 {
    let base = (t * (nmix + 1) + j) * splits;
    let mut total = 0f32;
    for w in 0..nwarps {
        let mut acc = 0f32;
        let mut sb = w;
        while sb * 32 < splits {
            let mut lanes: [f32; 32] = std::array::from_fn(|l| {
                let s = sb * 32 + l;
                if s < splits {
                    part[base + s]
                } else {
                    0.0
                }
            });
            let mut o = 16;
            while o > 0 {
                let prev = lanes;
                for l in 0..32 {
                    lanes[l] = prev[l] + prev[l ^ o];
                }
                o >>= 1;
            }
            acc += lanes[0];
            sb += nwarps;
        }
        total += acc;
    }
    total
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> (f32, usize) {
    a.iter()
        .zip(b)
        .enumerate()
        .fold((0f32, 0), |(m, mi), (i, (x, y))| {
            let e = (x - y).abs();
            if e > m || e.is_nan() {
                (if e.is_nan() { f32::INFINITY } else { e }, i)
            } else {
                (m, mi)
            }
        })
}

struct MhcCase {
    tokens: usize,
    d: usize,
    x: Vec<f32>,
    p: MhcParams,
    nw: Vec<f32>,
}

fn mhc_case(tokens: usize, d: usize, seed: u64) -> MhcCase {
    MhcCase {
        tokens,
        d,
        x: nq::random_rows(tokens * 4, d, seed),
        p: nq::random_mhc_params(d, r::HC_MIX, seed ^ 0xabc),
        nw: nq::random_weight(d, seed ^ 0xdef),
    }
}

/// Checks shared by the fused and unfused mHC paths. `gpu_dots`: the mixes as the fused kernel reduced
/// them ([T][25], last = sum of squares), when available: then pre/post/C must match to a few f32 ulp
/// (only expf differs from Rust's exp); otherwise they are compared with the all-CPU reference under a
/// bound for the fp32 reduction.
#[allow(clippy::too_many_arguments)]
fn check_mhc(
    label: &str,
    c: &MhcCase,
    pre: &[f32],
    post: &[f32],
    comb: &[f32],
    u: &[f32],
    normed: &nq::HostNormOutputs,
    format: OutFormat,
    gpu_dots: Option<&[f32]>,
    dot_bounds: Option<&[f64]>,
) {
    let (t_n, d) = (c.tokens, c.d);
    let mut worst = (0f32, String::new());
    for t in 0..t_n {
        let xt = &c.x[t * 4 * d..(t + 1) * 4 * d];
        let (rho_cpu, dots_cpu) = r::mhc_dots(xt, &c.p.mix_fn, r::HC_MIX);
        let (coef, tol) = match gpu_dots {
            Some(gd) => {
                let row = &gd[t * 25..(t + 1) * 25];
                // The GPU's fp32 dots against the f64 ones. FFMA mixes (dot_bounds None): a reduction of
                // depth <= 48 -> 48 eps sum|terms|. Tensor-core mix: the per-dot bounds of tc_dot_bounds.
                for j in 0..24 {
                    let bound = match dot_bounds {
                        Some(b) => b[t * 24 + j],
                        None => {
                            let abs_sum: f64 = (0..4 * d)
                                .map(|i| {
                                    (f64::from(c.p.mix_fn[j * 4 * d + i]) * f64::from(xt[i])).abs()
                                })
                                .sum();
                            48.0 * 2f64.powi(-24) * abs_sum + 1e-30
                        }
                    };
                    let e = (f64::from(row[j]) - f64::from(dots_cpu[j])).abs();
                    assert!(
                        e <= bound,
                        "{label}: token {t} dot {j}: GPU {} vs f64 {} (bound {bound:e})",
                        row[j],
                        dots_cpu[j]
                    );
                }
                let rho = r::rstd_from_sum_sq(row[24], 4 * d, r::RMS_EPS);
                assert!(
                    r::ulp_distance(rho, rho_cpu) <= 8,
                    "{label}: token {t} rho {rho} vs {rho_cpu}"
                );
                (
                    r::mhc_coefficients(rho, &row[..24], &c.p.scale, &c.p.base),
                    4e-6f32,
                )
            }
            None => (
                r::mhc_coefficients(rho_cpu, &dots_cpu, &c.p.scale, &c.p.base),
                2e-4f32,
            ),
        };
        let cmp = |what: &str, got: &[f32], want: &[f32], worst: &mut (f32, String)| {
            let (e, i) = max_abs_diff(got, want);
            assert!(
                e <= tol,
                "{label}: token {t} {what}[{i}] GPU {} vs reference {} (tol {tol:e})",
                got[i],
                want[i]
            );
            if e > worst.0 {
                *worst = (e, format!("token {t} {what}[{i}]"));
            }
        };
        cmp("pre", &pre[t * 4..t * 4 + 4], &coef.pre, &mut worst);
        cmp("post", &post[t * 4..t * 4 + 4], &coef.post, &mut worst);
        cmp("comb", &comb[t * 16..t * 16 + 16], &coef.comb, &mut worst);
        let gc = &comb[t * 16..t * 16 + 16];
        for i in 0..4 {
            let col: f32 = (0..4).map(|j| gc[4 * j + i]).sum();
            let row: f32 = (0..4).map(|k| gc[4 * i + k]).sum();
            assert!(
                (col - 1.0).abs() < 1e-5 && (row - 1.0).abs() < 1e-2,
                "{label}: token {t} C row/col {i} sums {row} / {col}"
            );
        }
        // u exactly from the GPU's pre
        let gp: [f32; 4] = pre[t * 4..t * 4 + 4].try_into().unwrap();
        let want_u = r::mhc_apply_pre(xt, &gp);
        let ut = &u[t * d..(t + 1) * d];
        if let Some(i) = (0..d).find(|&i| ut[i].to_bits() != want_u[i].to_bits()) {
            panic!(
                "{label}: token {t} u[{i}] GPU {} vs reference {} (from the GPU's pre)",
                ut[i], want_u[i]
            );
        }
    }
    eprintln!(
        "{label}: pre/post/C max abs diff {:e} at {} (tol {})",
        worst.0,
        worst.1,
        if gpu_dots.is_some() { "4e-6" } else { "2e-4" }
    );
    check_norm_outputs(
        &format!("{label} RMSNorm(u)"),
        u,
        &c.nw,
        t_n,
        d,
        format,
        normed,
    );
}

fn download_f32(gpu: &megamoe::gpu::Gpu, s: &cudarc::driver::CudaSlice<f32>) -> Vec<f32> {
    gpu.download(s).unwrap()
}

#[test]
fn gpu_mhc_pre_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_mhc_pre_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pre_matches_reference");
    for &d in DS {
        // MHC_TOKENS, plus 8, 9 and 128: both sides of each of mhc_pre's automatic path choices (PDL pair <= 8
        // tokens, two launches up to 127, the tensor-core mix from 128: its dots checked under tc_dot_bounds)
        for tokens in MHC_TOKENS.iter().copied().chain([8, 9, 128]) {
            let c = mhc_case(tokens, d, seed ^ (tokens as u64 * 131 + d as u64));
            let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
            let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();
            for format in FORMATS {
                let label = format!(
                    "mhc_pre->{} T={tokens} D={d} ({:?}) seed {seed}",
                    format.name(),
                    nq::mhc_pre_auto_path(tokens)
                );
                let mut out = MhcPreOutputs::alloc_poisoned(&gpu, format, tokens, d).unwrap();
                out.poison_partials(&gpu).unwrap();
                nq::mhc_pre(&gpu, &dx, &w, r::RMS_EPS, &mut out).unwrap();
                let snap = MhcSnapshot::take(&gpu, &out);
                assert_partials_written(&label, &snap, tokens);
                let dots = gpu_dots(&snap.partials, snap.splits, tokens, d);
                let bounds = (nq::mhc_pre_auto_path(tokens) == nq::MhcPrePath::TensorMix)
                    .then(|| tc_dot_bounds(&c, snap.splits));
                check_mhc(
                    &label,
                    &c,
                    &snap.pre,
                    &snap.post,
                    &snap.comb,
                    &snap.u,
                    &snap.normed,
                    format,
                    Some(&dots),
                    bounds.as_deref(),
                );
            }
        }
    }
}

// ---- tensor-core mix (session 13: kernels/mhc_mix_tc.cu, MhcPrePath::TensorMix) ---------------------------------

/// The three BF16 planes of the mix weights sum to F exactly (f64 sum of the three), for the random weights of
/// the GPU tests and for edge values: ties of the BF16 rounding (F = 1 + 2^-8 + k 2^-23), values rounding up into
/// the next binade (1.999...), all-ones significands, both signs, 2^126 and 2^-100 with a full significand, and
/// zero (|F| >= 2^127 (2 - 2^-8) would round f1 to infinity: no mix weight is near that). Why it holds: mix_fn_bf16_planes (src/ops/norm_quant/mod.rs).
#[test]
fn mix_fn_bf16_planes_sum_to_f_exactly() {
    let seed = fresh_seed("mix_fn_bf16_planes_sum_to_f_exactly");
    let d = 4096;
    let mut f = nq::random_mhc_params(d, r::HC_MIX, seed).mix_fn;
    let mut rnd = xorshift64(seed);
    let mut edge = vec![
        0.0f32,
        1.0,
        -1.0,
        2f32.powi(126) * 1.999_999_9,
        -(2f32.powi(-100) * 1.999_999_9),
    ];
    for k in 0..64u32 {
        edge.push(1.0 + 2f32.powi(-8) + k as f32 * 2f32.powi(-23)); // ties and neighbours of bf16 rounding
        edge.push(f32::from_bits(0x3FFF_FFFF - k)); // rounds up to 2.0
        edge.push(-f32::from_bits(0x3F7F_FF00 | k)); // long significands below 1
    }
    // Random full-significand values over the exponent range the planes must cover exactly.
    edge.extend((0..100_000).map(|_| {
        let bits = rnd();
        let exp = 127 - 100 + (bits % 200) as u32; // 2^-100 .. 2^99
        f32::from_bits(
            ((bits >> 32) as u32 & 0x8000_0000) | (exp << 23) | ((bits >> 8) as u32 & 0x7F_FFFF),
        )
    }));
    f.extend_from_slice(&edge);
    let planes = nq::mix_fn_bf16_planes(&f);
    assert_eq!(planes.len(), 3 * f.len());
    let n = f.len();
    for i in 0..n {
        let sum = f64::from(planes[i].to_f32())
            + f64::from(planes[n + i].to_f32())
            + f64::from(planes[2 * n + i].to_f32());
        assert!(
            sum == f64::from(f[i]),
            "seed {seed}: F[{i}] = {:e} ({:#010x}): f1 + f2 + f3 = {sum:e} ({:?})",
            f[i],
            f[i].to_bits(),
            [planes[i], planes[n + i], planes[2 * n + i]]
        );
    }
}

/// The tensor-core mix's K splits: fill ~2 CTAs per SM (264 CTAs on 132 SMs), divide the 4D/64 k-blocks, stay
/// within the workspace (4D/128 splits), 1 at large prefill.
#[test]
fn tc_mix_splits_fill_the_gpu_and_divide_k() {
    for d in [128usize, 1024, 4096, 7168, nq::MHC_MAX_D] {
        for tokens in [
            1usize, 2, 64, 127, 128, 129, 512, 2048, 4096, 8192, 16384, 33792, 33793, 65535, 65539,
        ] {
            let s = nq::tc_mix_splits(tokens, d);
            let tiles = tokens.div_ceil(128);
            assert!(s.is_power_of_two() && s <= 64, "T={tokens} D={d}: {s}");
            assert_eq!((4 * d / 64) % s, 0, "T={tokens} D={d}: {s} splits");
            assert!(s <= nq::mix_splits(d), "T={tokens} D={d}: {s} splits");
            assert!(s == 1 || tiles * s <= 264, "T={tokens} D={d}: {s} splits");
        }
    }
    for d in [4096usize, 7168] {
        assert_eq!(nq::tc_mix_splits(1, d), 64);
        assert_eq!(nq::tc_mix_splits(4096, d), 8);
        assert_eq!(nq::tc_mix_splits(16384, d), 2);
        assert_eq!(nq::tc_mix_splits(65536, d), 1);
    }
}

/// Bound on |GPU dot - f64 dot| for the tensor-core mix, per (token, mix) `[T][24]`, for partials over `splits`
/// K splits. Derivation, from the kernel's structure (kernels/mhc_mix_tc.cu):
/// * Products f_p[k] x[k] (BF16 x BF16) are exact. Each k16 wgmma step adds 16 of them to the fp32
///   accumulator c as a fused block. Model (Fasi et al. 2021 for V100/A100, Khattak & Mikaitis 2025 for H100):
///   the addends (c and the products) are aligned to the largest exponent e among them, their bits below
///   2^(e-23) dropped (toward zero), the exact sum of what is left normalized to fp32 with truncation. With
///   `step = |c| + sum |step's products|` (>= every addend, >= |sum|): a block of n addends loses < 2^(e-23) <=
///   2^-23 step on each of its n - 1 non-largest addends and < 2^-23 step in the normalization, so <= n 2^-23
///   step. (Not n 2^-23 M with M the largest addend: the normalized sum can be ~n M.) One 17-addend block per
///   k16 step: 17; two 9-addend blocks (the A100's 8-product granularity): 18; four 5-addend blocks: 20.
///   The bound takes 20 2^-23 step per step, with step summed from the exact prefix: `acc`.
/// * Second order: the kernel's c is the exact prefix plus the error so far, so step k's error is <= 20 2^-23
///   (|P_k-1| + E_k-1 + sum|p|), and after n steps E_n <= (1 + 20 2^-23)^n 20 2^-23 acc: the factor is 1.0024 at
///   n = 1024 (S = 1, D 4096) and 1.0043 at D 7168, more than the (1 + 2^-10) that covers the other terms.
/// * dot_s = (a3 + a2) + a1: two fp32 roundings, <= 2 2^-24 sum |terms of split s|.
/// * The finish (reduce_partials) adds <= 64 partials: depth <= 5 (xor tree) + 1 (block) + 7 (warps) = 13.
/// * The reference's own f64 -> f32 rounding: 2^-24 |dot| <= 2^-24 sum |terms|.
///
/// Bound = (20 2^-23 acc (1 + 20 2^-23)^steps + 16 2^-24 sum |terms|) x (1 + 2^-10), steps = 4D / (16 S).
/// tc_dot_bounds_hold_for_emulated_tensor_cores checks it against bit-level emulations of those models (worst
/// ~0.005 of it on the tests' random inputs, ~0.31 on all-positive ones) and shows that it rejects a dropped
/// plane f2 or k-block. Only 24-bit alignment is assumed: with 18 bits kept the random inputs reach ~0.3.
fn tc_dot_bounds(c: &MhcCase, splits: usize) -> Vec<f64> {
    let (t_n, k) = (c.tokens, 4 * c.d);
    let planes: Vec<f64> = nq::mix_fn_bf16_planes(&c.p.mix_fn)
        .iter()
        .map(|v| f64::from(v.to_f32()))
        .collect();
    let kp = k / splits;
    // (1 + 20 2^-23)^(k16 steps of a split): the errors of earlier steps sit in the accumulator that later
    // steps align to (second order; see the doc).
    let chain = (1.0 + 20.0 * 2f64.powi(-23)).powi((kp / 16) as i32);
    let one = |t: usize| -> Vec<f64> {
        let x: Vec<f64> = c.x[t * k..(t + 1) * k]
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        (0..24)
            .map(|j| {
                let (mut acc, mut abs_all) = (0f64, 0f64);
                for p in 0..3 {
                    let fp = &planes[(p * 24 + j) * k..(p * 24 + j + 1) * k];
                    for s in 0..splits {
                        let mut prefix = 0f64;
                        for step in (s * kp..(s + 1) * kp).step_by(16) {
                            let (mut sum, mut abs) = (0f64, 0f64);
                            for i in step..step + 16 {
                                let pr = fp[i] * x[i];
                                sum += pr;
                                abs += pr.abs();
                            }
                            acc += prefix.abs() + abs;
                            abs_all += abs;
                            prefix += sum;
                        }
                    }
                }
                (20.0 * 2f64.powi(-23) * acc * chain + 16.0 * 2f64.powi(-24) * abs_all)
                    * (1.0 + 2f64.powi(-10))
                    + 1e-30
            })
            .collect()
    };
    // Two threads (the dev box's cores): ~3 x the work of one f64 dot per (token, mix).
    let half = t_n.div_ceil(2);
    let (a, b) = std::thread::scope(|sc| {
        let h = sc.spawn(|| (half..t_n).flat_map(one).collect::<Vec<f64>>());
        let a: Vec<f64> = (0..half).flat_map(one).collect();
        (a, h.join().unwrap())
    });
    a.into_iter().chain(b).collect()
}

/// fp32 nearest to `v` toward zero (truncation of the significand to 24 bits).
fn f32_toward_zero(v: f64) -> f32 {
    let f = v as f32; // round to nearest even
    if f64::from(f).abs() > v.abs() {
        f32::from_bits(f.to_bits() - 1) // one ulp smaller in magnitude (same sign; f != 0 here)
    } else {
        f
    }
}

/// One fused block of a tensor-core accumulation, as tc_dot_bounds models it: the fp32 accumulator and the
/// exact products aligned to the largest exponent e among them, bits below 2^(e-23) dropped toward zero, the
/// exact sum (integers of 2^(e-23) below 2^29: exact in f64) truncated to fp32.
fn tc_block(acc: f32, prods: &[f64]) -> f32 {
    let addends = || std::iter::once(f64::from(acc)).chain(prods.iter().copied());
    let Some(e) = addends()
        .filter(|v| *v != 0.0)
        .map(|v| ((v.abs().to_bits() >> 52) as i32) - 1023)
        .max()
    else {
        return 0.0;
    };
    let unit = 2f64.powi(e - 23);
    f32_toward_zero(addends().map(|v| (v / unit).trunc() * unit).sum())
}

/// The tensor-core mix kernel's dots for one token, emulated: per split and plane an fp32 accumulator over the
/// k16 steps (`block` products per fused block: 16, or 8 = two blocks per step), dot_s = (a3 + a2) + a1, the
/// splits reduced in the finish's order. `keep(p, k)`: whether plane p's column k takes part (wrong kernels).
fn emulated_tc_dots(
    c: &MhcCase,
    planes: &[f64],
    t: usize,
    splits: usize,
    block: usize,
    keep: &dyn Fn(usize, usize) -> bool,
) -> Vec<f32> {
    let k = 4 * c.d;
    let kp = k / splits;
    let x = &c.x[t * k..(t + 1) * k];
    let mut part = vec![0f32; 25 * splits];
    for j in 0..24 {
        for s in 0..splits {
            let mut a = [0f32; 3];
            for (p, ap) in a.iter_mut().enumerate() {
                let fp = &planes[(p * 24 + j) * k..(p * 24 + j + 1) * k];
                for b0 in (s * kp..(s + 1) * kp).step_by(block) {
                    let prods: Vec<f64> = (b0..b0 + block)
                        .map(|i| {
                            if keep(p, i) {
                                fp[i] * f64::from(x[i])
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    *ap = tc_block(*ap, &prods);
                }
            }
            part[j * splits + s] = (a[2] + a[1]) + a[0];
        }
    }
    let nwarps = nq::row_block_threads(c.d) as usize / 32;
    (0..24)
        .map(|j| reduce_like_gpu(&part, splits, nwarps, 0, j, 24))
        .collect()
}

/// tc_dot_bounds against bit-level emulations of the tensor-core models it is derived from (fused blocks of
/// 16 and of 8 products; alignment and normalization by truncation): every dot of a correct kernel must lie
/// within it (on the GPU tests' random inputs, at the splits they use, and on all-positive inputs, where the
/// truncations all push the same way), and it must reject a kernel that drops plane f2 or one 64-column
/// k-block of a split (so the GPU test can fail). A dropped f3 (2^-16 of F) is below any tensor-core bound.
#[test]
fn tc_dot_bounds_hold_for_emulated_tensor_cores() {
    let seed = fresh_seed("tc_dot_bounds_hold_for_emulated_tensor_cores");
    let tokens = 3;
    for d in [4096usize, 7168] {
        // S of the GPU tests: 64 (up to 129 tokens), 8 (4096 tokens), 1 (the 65539-token split test).
        for splits in [64usize, 8, 1] {
            for positive in [false, true] {
                let mut c = mhc_case(tokens, d, seed ^ (d as u64 * 31 + splits as u64));
                if positive {
                    c.x.iter_mut().for_each(|v| *v = v.abs());
                    c.p.mix_fn.iter_mut().for_each(|v| *v = v.abs());
                }
                let planes: Vec<f64> = nq::mix_fn_bf16_planes(&c.p.mix_fn)
                    .iter()
                    .map(|v| f64::from(v.to_f32()))
                    .collect();
                let bounds = tc_dot_bounds(&c, splits);
                let kp = 4 * d / splits;
                let label = format!("D={d} S={splits} positive={positive} seed {seed}");
                let worst = |dots: &dyn Fn(usize) -> Vec<f32>| -> f64 {
                    let mut worst = 0f64;
                    for t in 0..tokens {
                        let (_, want) =
                            r::mhc_dots(&c.x[t * 4 * d..(t + 1) * 4 * d], &c.p.mix_fn, 24);
                        let got = dots(t);
                        for j in 0..24 {
                            let e = (f64::from(got[j]) - f64::from(want[j])).abs();
                            worst = worst.max(e / bounds[t * 24 + j]);
                        }
                    }
                    worst
                };
                for block in [16usize, 8] {
                    let w =
                        worst(&|t| emulated_tc_dots(&c, &planes, t, splits, block, &|_, _| true));
                    eprintln!("{label} block {block}: worst |dot - f64| = {w:.3} of the bound");
                    assert!(
                        w <= 1.0,
                        "{label} block {block}: a correct kernel exceeds the bound ({w})"
                    );
                }
                let no_f2 =
                    worst(&|t| emulated_tc_dots(&c, &planes, t, splits, 16, &|p, _| p != 1));
                // The last k-block of split 0 missing (every plane).
                let no_kblock = worst(&|t| {
                    emulated_tc_dots(&c, &planes, t, splits, 16, &|_, i| {
                        !(kp - 64..kp).contains(&i)
                    })
                });
                eprintln!("{label}: without f2 {no_f2:.1} x the bound, without a k-block {no_kblock:.1} x");
                // The power that matters is on the GPU tests' inputs (random signs); on all-positive ones the
                // prefixes grow linearly and so does the bound, so a dropped f2, or at S = 1 one 64-column
                // k-block of 4D (0.2-0.4% of the dot against a bound of ~0.4% over 1024-1792 k16 steps), can
                // hide there (seen in CI: D 7168, S 1, positive, a missing k-block at 0.57 of the bound).
                if !positive {
                    assert!(
                        no_f2 > 1.0,
                        "{label}: a kernel without plane f2 passes ({no_f2})"
                    );
                    assert!(
                        no_kblock > 1.0,
                        "{label}: a kernel missing a k-block passes ({no_kblock})"
                    );
                }
            }
        }
    }
}

/// Every partial of the last launch (`[T, 25, S]`, the workspace having been poisoned with NaN) was written.
fn assert_partials_written(label: &str, snap: &MhcSnapshot, tokens: usize) {
    let n = tokens * 25 * snap.splits;
    if let Some(i) = (0..n).find(|&i| !snap.partials[i].is_finite()) {
        let (t, rest) = (i / (25 * snap.splits), i % (25 * snap.splits));
        panic!(
            "{label}: partial [{t}][{}][{}] not written ({})",
            rest / snap.splits,
            rest % snap.splits,
            snap.partials[i]
        );
    }
}

/// The tensor-core mix path (MhcPrePath::TensorMix, forced) at the issue's token counts (partial 128-token tiles
/// at 1, 2, 3, 7, 64, 127; two tiles at 129; 32 tiles x 8 splits at 4096), both D, all three formats: outputs
/// and the split-K workspace poisoned (NaN) before each launch, every partial checked written, the dots checked
/// against f64 under tc_dot_bounds, then pre/post/C (from the kernel's own reduced dots), u and RMSNorm(u)
/// through check_mhc exactly as the FFMA path.
#[test]
fn gpu_mhc_pre_tensor_mix_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_mhc_pre_tensor_mix_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pre_tensor_mix_matches_reference");
    for &d in DS {
        for &tokens in MHC_TOKENS {
            let c = mhc_case(tokens, d, seed ^ (tokens as u64 * 977 + d as u64));
            let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
            let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();
            let splits = nq::tc_mix_splits(tokens, d);
            let bounds = tc_dot_bounds(&c, splits);
            for format in FORMATS {
                let label = format!(
                    "mhc_pre TensorMix->{} T={tokens} D={d} S={splits} seed {seed}",
                    format.name()
                );
                let mut out = MhcPreOutputs::alloc_poisoned(&gpu, format, tokens, d).unwrap();
                out.poison_partials(&gpu).unwrap();
                nq::mhc_pre_with(
                    &gpu,
                    &dx,
                    &w,
                    r::RMS_EPS,
                    &mut out,
                    nq::MhcPrePath::TensorMix,
                )
                .unwrap();
                let snap = MhcSnapshot::take(&gpu, &out);
                assert_eq!(snap.splits, splits, "{label}");
                assert_partials_written(&label, &snap, tokens);
                let dots = gpu_dots(&snap.partials, snap.splits, tokens, d);
                check_mhc(
                    &label,
                    &c,
                    &snap.pre,
                    &snap.post,
                    &snap.comb,
                    &snap.u,
                    &snap.normed,
                    format,
                    Some(&dots),
                    Some(&bounds),
                );
                // Deterministic: a second launch on poisoned buffers gives the same bits.
                out.poison(&gpu).unwrap();
                out.poison_partials(&gpu).unwrap();
                nq::mhc_pre_with(
                    &gpu,
                    &dx,
                    &w,
                    r::RMS_EPS,
                    &mut out,
                    nq::MhcPrePath::TensorMix,
                )
                .unwrap();
                MhcSnapshot::take(&gpu, &out).assert_same(&snap, &format!("{label} relaunch"));
            }
            // How close the tensor-core dots are to the FFMA path's (information for the A/B, not asserted
            // beyond the bounds above): max |tc - ffma| / sum|terms| over the batch.
            let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Bf16, tokens, d).unwrap();
            nq::mhc_pre_with(
                &gpu,
                &dx,
                &w,
                r::RMS_EPS,
                &mut out,
                nq::MhcPrePath::TwoLaunch,
            )
            .unwrap();
            let ffma = MhcSnapshot::take(&gpu, &out);
            nq::mhc_pre_with(
                &gpu,
                &dx,
                &w,
                r::RMS_EPS,
                &mut out,
                nq::MhcPrePath::TensorMix,
            )
            .unwrap();
            let tc = MhcSnapshot::take(&gpu, &out);
            let (a, b) = (
                gpu_dots(&ffma.partials, ffma.splits, tokens, d),
                gpu_dots(&tc.partials, tc.splits, tokens, d),
            );
            let worst = (0..tokens * 25)
                .filter(|i| i % 25 < 24)
                .map(|i| ((a[i] - b[i]).abs() / bounds[i / 25 * 24 + i % 25] as f32, i))
                .fold((0f32, 0), |m, v| if v.0 > m.0 { v } else { m });
            eprintln!(
                "T={tokens} D={d}: max |tc dot - ffma dot| = {:.3e} of the tc bound (token {}, mix {})",
                worst.0,
                worst.1 / 25,
                worst.1 % 25
            );
        }
    }
}

/// The 24 mixes and the sum of squares per token ([T][25]), reduced from the split-K partials in the finish
/// kernel's order.
fn gpu_dots(partials: &[f32], splits: usize, tokens: usize, d: usize) -> Vec<f32> {
    let nwarps = nq::row_block_threads(d) as usize / 32;
    (0..tokens)
        .flat_map(|t| (0..25).map(move |j| (t, j)))
        .map(|(t, j)| reduce_like_gpu(partials, splits, nwarps, t, j, 24))
        .collect()
}

/// Every output of one mHC boundary launch, downloaded.
struct MhcSnapshot {
    /// S of the partials (`out.partial_splits()`: 4D/128 for the FFMA mixes, nq::tc_mix_splits for the
    /// tensor-core mix); `partials` is the whole workspace, of which `[T, 25, S]` is this launch's.
    splits: usize,
    partials: Vec<f32>,
    pre: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
    u: Vec<f32>,
    normed: nq::HostNormOutputs,
}

impl MhcSnapshot {
    fn take(gpu: &megamoe::gpu::Gpu, out: &MhcPreOutputs) -> MhcSnapshot {
        MhcSnapshot {
            splits: out.partial_splits(),
            partials: download_f32(gpu, out.partials()),
            pre: download_f32(gpu, &out.pre),
            post: download_f32(gpu, &out.post),
            comb: download_f32(gpu, &out.comb),
            u: gpu
                .download(&out.u)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            normed: out.normed.download(gpu).unwrap(),
        }
    }

    /// Bitwise equality of every output, with the first differing index on failure.
    fn assert_same(&self, want: &MhcSnapshot, label: &str) {
        assert_eq!(self.splits, want.splits, "{label}: partial splits");
        for (what, a, b) in [
            ("partials", &self.partials, &want.partials),
            ("pre", &self.pre, &want.pre),
            ("post", &self.post, &want.post),
            ("comb", &self.comb, &want.comb),
            ("u", &self.u, &want.u),
            ("rstd", &self.normed.rstd, &want.normed.rstd),
        ] {
            assert_eq!(a.len(), b.len(), "{label}: {what} lengths");
            if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
                panic!("{label}: {what}[{i}] = {} vs first launch {}", a[i], b[i]);
            }
        }
        assert!(
            self.normed.q == want.normed.q,
            "{label}: quantized RMSNorm(u) differs from the first launch"
        );
    }
}

#[test]
fn gpu_mhc_pre_unfused_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_mhc_pre_unfused_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pre_unfused_matches_reference");
    for &(tokens, d) in &[(1usize, 4096usize), (7, 7168), (64, 4096)] {
        let c = mhc_case(tokens, d, seed ^ tokens as u64);
        let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
        let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();
        for format in FORMATS {
            let label = format!(
                "mhc_pre_unfused->{} T={tokens} D={d} seed {seed}",
                format.name()
            );
            let mut out = MhcPreOutputs::alloc_poisoned(&gpu, format, tokens, d).unwrap();
            let mut scratch = nq::MhcUnfusedScratch::alloc(&gpu, tokens).unwrap();
            let mut staging =
                NormOutputs::alloc_poisoned(&gpu, OutFormat::Bf16, tokens, d).unwrap();
            nq::mhc_pre_unfused(
                &gpu,
                &dx,
                &w,
                r::RMS_EPS,
                &mut scratch,
                &mut staging,
                &mut out,
            )
            .unwrap();
            let u: Vec<f32> = gpu
                .download(&out.u)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let normed = out.normed.download(&gpu).unwrap();
            check_mhc(
                &label,
                &c,
                &download_f32(&gpu, &out.pre),
                &download_f32(&gpu, &out.post),
                &download_f32(&gpu, &out.comb),
                &u,
                &normed,
                format,
                None,
                None,
            );
        }
    }
}

#[test]
fn gpu_mhc_pre_graph_replay_is_deterministic() {
    let Some(gpu) = gpu_for_test("gpu_mhc_pre_graph_replay_is_deterministic") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pre_graph_replay_is_deterministic");
    // The decode boundary runs as a replayed CUDA graph: 5 replays (outputs poisoned before each), each
    // compared bit for bit with the direct launch.
    for (tokens, d) in [(4usize, 4096usize), (1, 7168), (129, 4096)] {
        let c = mhc_case(tokens, d, seed ^ tokens as u64);
        let w = MhcWeights::upload(&gpu, &c.p, &c.nw, c.d).unwrap();
        let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();
        let label = format!("graph replay T={tokens} D={d} seed {seed}");
        let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, c.tokens, c.d).unwrap();
        nq::mhc_pre(&gpu, &dx, &w, r::RMS_EPS, &mut out).unwrap();
        let first = MhcSnapshot::take(&gpu, &out);
        let g = gpu
            .capture(|| nq::mhc_pre(&gpu, &dx, &w, r::RMS_EPS, &mut out))
            .unwrap();
        for rep in 0..5 {
            out.poison(&gpu).unwrap();
            g.launch().unwrap();
            gpu.synchronize().unwrap();
            MhcSnapshot::take(&gpu, &out).assert_same(&first, &format!("{label} replay {rep}"));
        }
    }
}

#[test]
fn gpu_mhc_post_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_mhc_post_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_post_matches_reference");
    for &d in DS {
        for &tokens in MHC_TOKENS {
            let c = mhc_case(tokens, d, seed ^ tokens as u64);
            let y = nq::random_rows(tokens, d, seed ^ 0x77);
            // real coefficients from the reference (so C is doubly stochastic, post in (0, 2))
            let coefs: Vec<r::MhcPre> = (0..tokens)
                .map(|t| r::mhc_pre_token(&c.x[t * 4 * d..(t + 1) * 4 * d], &c.p).0)
                .collect();
            let post: Vec<f32> = coefs.iter().flat_map(|k| k.post).collect();
            let comb: Vec<f32> = coefs.iter().flat_map(|k| k.comb).collect();
            let (dy, dx) = (
                nq::upload_checked_bf16(&gpu, "y", &y).unwrap(),
                nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap(),
            );
            let (dp, dc) = (gpu.upload(&post).unwrap(), gpu.upload(&comb).unwrap());
            let mut xo = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
            nq::mhc_post(&gpu, &dy, &dx, &dp, &dc, tokens, d, &mut xo).unwrap();
            let got: Vec<f32> = gpu
                .download(&xo)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            for t in 0..tokens {
                let want = r::mhc_post_token(
                    &y[t * d..(t + 1) * d],
                    &c.x[t * 4 * d..(t + 1) * 4 * d],
                    &coefs[t].post,
                    &coefs[t].comb,
                );
                let g = &got[t * 4 * d..(t + 1) * 4 * d];
                if let Some(i) = (0..4 * d).find(|&i| g[i].to_bits() != want[i].to_bits()) {
                    panic!("mhc_post T={tokens} D={d} seed {seed}: token {t} X'[{},{}] GPU {} vs reference {}", i / d, i % d, g[i], want[i]);
                }
            }
        }
    }
}

#[test]
fn gpu_hc_head_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_hc_head_matches_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_hc_head_matches_reference");
    for &d in DS {
        for &tokens in MHC_TOKENS {
            let x = nq::random_rows(tokens * 4, d, seed ^ tokens as u64);
            let hp = nq::random_mhc_params(d, r::HC_HEAD_MIX, seed ^ 5);
            let (scale, base) = (0.9f32, [0.1f32, -0.3, 0.2, 0.05]);
            let nw = nq::random_weight(d, seed ^ 6);
            let w = MhcWeights::upload_head(&gpu, &hp.mix_fn, scale, &base, &nw, d).unwrap();
            let dx = nq::upload_checked_bf16(&gpu, "X", &x).unwrap();
            let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Bf16, tokens, d).unwrap();
            nq::hc_head(&gpu, &dx, &w, r::RMS_EPS, &mut out).unwrap();
            let pre = download_f32(&gpu, &out.pre);
            let u: Vec<f32> = gpu
                .download(&out.u)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let label = format!("hc_head T={tokens} D={d} seed {seed}");
            for t in 0..tokens {
                let xt = &x[t * 4 * d..(t + 1) * 4 * d];
                check_hc_head_token(&label, t, xt, &hp.mix_fn, scale, &base, &pre, &u);
            }
            let normed = out.normed.download(&gpu).unwrap();
            check_norm_outputs(&label, &u, &nw, tokens, d, OutFormat::Bf16, &normed);
        }
    }
}

/// hc_head's token t against the CPU reference: pre (4 sigmoids) within 2e-5 (sigmoid' <= 1/4 and the fp32 dot
/// error is far below 1e-4 for these magnitudes), and u = the pre-mix of the 4 streams with the GPU's pre, bit
/// for bit. `xt` = the token's 4 x D residual, `pre` / `u` the whole GPU outputs.
#[allow(clippy::too_many_arguments)]
fn check_hc_head_token(
    label: &str,
    t: usize,
    xt: &[f32],
    mix_fn: &[f32],
    scale: f32,
    base: &[f32; 4],
    pre: &[f32],
    u: &[f32],
) {
    let d = xt.len() / 4;
    let (want_pre, _) = r::hc_head_token(xt, mix_fn, scale, base);
    let (e, i) = max_abs_diff(&pre[t * 4..t * 4 + 4], &want_pre);
    assert!(
        e <= 2e-5,
        "{label}: token {t} pre[{i}] GPU {} vs {}",
        pre[t * 4 + i],
        want_pre[i]
    );
    let gp: [f32; 4] = pre[t * 4..t * 4 + 4].try_into().unwrap();
    let want_u = r::mhc_apply_pre(xt, &gp);
    let ut = &u[t * d..(t + 1) * d];
    if let Some(k) = (0..d).find(|&k| ut[k].to_bits() != want_u[k].to_bits()) {
        panic!("{label}: token {t} u[{k}] GPU {} vs {}", ut[k], want_u[k]);
    }
}

// ---- the kernel's division-free e2m1 encoder, emulated on the CPU --------------------------------------
//
// kernels/norm_quant.cu encodes `e2m1(fl(a / scale))` without dividing: per 16-block it turns the seven
// rounding thresholds of the e2m1 ladder into thresholds on `a` (see `e2m1_thresholds` there). This test
// takes those thresholds from the CPU mirror of that computation (`reference::packed_e2m1_mirror::thresholds`:
// f64 products, directed f64 -> f32 conversions), selects the code the kernel's way, and checks it equals the
// reference encoder on random and adversarial (near-threshold) inputs.

fn e2m1_via_thresholds(y: f32, scale: f32) -> u8 {
    if scale == 0.0 {
        return 0;
    }
    // `a >= b[i]` for every i: the `>` thresholds become `>=` their f32 successor.
    let b = r::packed_e2m1_mirror::thresholds(scale);
    let a = y.abs();
    let p2 = a >= b[3];
    let p1 = a >= if p2 { b[5] } else { b[1] };
    let p0 = a
        >= if p2 {
            if p1 {
                b[6]
            } else {
                b[4]
            }
        } else if p1 {
            b[2]
        } else {
            b[0]
        };
    let m = (u8::from(p2) << 2) | (u8::from(p1) << 1) | u8::from(p0);
    m | if y.is_sign_negative() { 8 } else { 0 }
}

#[test]
fn division_free_e2m1_equals_the_reference_encoder() {
    let seed = fresh_seed("division_free_e2m1_equals_the_reference_encoder");
    let mut next = xorshift64(seed);
    let thresholds = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let mut checked = 0u64;
    for _ in 0..200_000 {
        // a scale as the kernel makes it: e4m3 value times a global scale with a random mantissa
        let s_code = (next() % 0x7E) as u8 + 1;
        let gs = f32::from_bits(((next() % 200 + 20) as u32) << 23 | (next() as u32 & 0x7F_FFFF));
        let scale = e4m3::decode(s_code) * gs;
        if scale == 0.0 || !scale.is_finite() {
            continue;
        }
        // adversarial: a near t * scale, +- a few ulp; and random a in [0, 7 scale]
        let t = thresholds[(next() % 7) as usize];
        let near = t * scale;
        for k in -3i32..=3 {
            let a = f32::from_bits((near.to_bits() as i32 + k) as u32);
            for y in [a, -a] {
                let want = e2m1::encode_rne(y / scale);
                assert_eq!(
                    e2m1_via_thresholds(y, scale),
                    want,
                    "y {y:e} scale {scale:e} (seed {seed})"
                );
                checked += 1;
            }
        }
        let a = (next() >> 40) as f32 / (1u64 << 24) as f32 * 7.0 * scale;
        assert_eq!(
            e2m1_via_thresholds(a, scale),
            e2m1::encode_rne(a / scale),
            "a {a:e} scale {scale:e}"
        );
        checked += 1;
    }
    eprintln!("division-free e2m1: {checked} values agree");
}

#[test]
fn exec_entries_run_the_cpu_reference() {
    use megamoe::ops::exec::{HostTensor, TensorMap};
    let seed = fresh_seed("exec_entries_run_the_cpu_reference");
    let kernels = megamoe::ops::registry::exec_kernels();
    let find = |n: &str| {
        kernels
            .iter()
            .find(|k| k.name == n)
            .unwrap_or_else(|| panic!("exec kernel {n} missing"))
    };
    let (rows, d) = (3, 256);
    let x = nq::random_rows(rows, d, seed);
    let w = nq::random_weight(d, seed ^ 1);
    let mut inp = TensorMap::new();
    inp.insert(
        "x".into(),
        HostTensor::from_bf16(vec![rows, d], &bf16::to_bf16_vec(&x)),
    );
    inp.insert("weight".into(), HostTensor::from_f32(vec![d], &w));
    let out = (find("rmsnorm_fp8").run)(&inp, None).unwrap();
    let (y, rstd) = r::rmsnorm_rows(&x, rows, d, &w, r::RMS_EPS).unwrap();
    let q = r::quantize_fp8_rows(&y, rows, d).unwrap();
    assert_eq!(out["data"].bytes, q.data);
    assert_eq!(out["scales"].bytes, q.scales);
    assert_eq!(out["rstd"].to_f32().unwrap(), rstd);
    // a wrong shape is a clear error
    inp.insert(
        "weight".into(),
        HostTensor::from_f32(vec![d + 1], &nq::random_weight(d + 1, seed)),
    );
    let err = (find("rmsnorm_bf16").run)(&inp, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight"), "{err}");

    let t = 2;
    let xs = nq::random_rows(4 * t, d, seed ^ 2);
    let p = nq::random_mhc_params(d, r::HC_MIX, seed ^ 3);
    let mut inp = TensorMap::new();
    inp.insert(
        "X".into(),
        HostTensor::from_bf16(vec![t, 4, d], &bf16::to_bf16_vec(&xs)),
    );
    inp.insert(
        "hc_fn".into(),
        HostTensor::from_f32(vec![24, 4 * d], &p.mix_fn),
    );
    inp.insert("hc_scale".into(), HostTensor::from_f32(vec![3], &p.scale));
    inp.insert("hc_base".into(), HostTensor::from_f32(vec![24], &p.base));
    inp.insert("weight".into(), HostTensor::from_f32(vec![d], &w));
    let out = (find("mhc_pre_bf16").run)(&inp, None).unwrap();
    let (c1, u1) = r::mhc_pre_token(&xs[4 * d..8 * d], &p);
    assert_eq!(&out["comb"].to_f32().unwrap()[16..32], &c1.comb);
    assert_eq!(&out["u"].to_f32().unwrap()[d..2 * d], &u1[..]);
    assert_eq!(out["y"].shape, vec![t, d]);

    // mhc_post_then_pre_nvfp4 (CPU): X_out as the mhc_post entry, then every output of mhc_pre_nvfp4 on that
    // X_out (the previous boundary's post / comb from p, the next boundary's parameters p2).
    let y = nq::random_rows(t, d, seed ^ 4);
    let (post, comb): (Vec<f32>, Vec<f32>) = {
        let c: Vec<r::MhcPre> = (0..t)
            .map(|k| r::mhc_pre_token(&xs[k * 4 * d..(k + 1) * 4 * d], &p).0)
            .collect();
        (
            c.iter().flat_map(|k| k.post).collect(),
            c.iter().flat_map(|k| k.comb).collect(),
        )
    };
    let p2 = nq::random_mhc_params(d, r::HC_MIX, seed ^ 5);
    inp.insert(
        "y".into(),
        HostTensor::from_bf16(vec![t, d], &bf16::to_bf16_vec(&y)),
    );
    inp.insert("post".into(), HostTensor::from_f32(vec![t, 4], &post));
    inp.insert("comb".into(), HostTensor::from_f32(vec![t, 4, 4], &comb));
    let posted = (find("mhc_post").run)(&inp, None).unwrap();
    inp.insert(
        "hc_fn".into(),
        HostTensor::from_f32(vec![24, 4 * d], &p2.mix_fn),
    );
    inp.insert("hc_scale".into(), HostTensor::from_f32(vec![3], &p2.scale));
    inp.insert("hc_base".into(), HostTensor::from_f32(vec![24], &p2.base));
    let fused = (find("mhc_post_then_pre_nvfp4").run)(&inp, None).unwrap();
    assert_eq!(fused["X_out"], posted["X_out"]);
    let x_out = posted["X_out"].to_f32().unwrap();
    let (c1, u1) = r::mhc_pre_token(&x_out[4 * d..8 * d], &p2);
    assert_eq!(&fused["comb"].to_f32().unwrap()[16..32], &c1.comb);
    assert_eq!(&fused["u"].to_f32().unwrap()[d..2 * d], &u1[..]);
    let mut pre_in = TensorMap::new();
    for n in ["hc_fn", "hc_scale", "hc_base", "weight"] {
        pre_in.insert(n.into(), inp[n].clone());
    }
    pre_in.insert("X".into(), posted["X_out"].clone());
    let pre_out = (find("mhc_pre_nvfp4").run)(&pre_in, None).unwrap();
    for n in [
        "pre",
        "post",
        "comb",
        "u",
        "data",
        "scales",
        "global_scale",
        "rstd",
    ] {
        assert_eq!(fused[n], pre_out[n], "mhc_post_then_pre_nvfp4 `{n}`");
    }
    assert_eq!(
        fused.len(),
        pre_out.len() + 1,
        "X_out plus mhc_pre's outputs"
    );
}

#[test]
fn gpu_fused_post_then_pre_matches_post_and_reference() {
    let Some(gpu) = gpu_for_test("gpu_fused_post_then_pre_matches_post_and_reference") else {
        return;
    };
    let seed = fresh_seed("gpu_fused_post_then_pre_matches_post_and_reference");
    for (d, tokens) in DS
        .iter()
        .flat_map(|&d| MHC_TOKENS.iter().map(move |&t| (d, t)))
    {
        let c = mhc_case(tokens, d, seed ^ tokens as u64);
        let y = nq::random_rows(tokens, d, seed ^ 0x99);
        let coefs: Vec<r::MhcPre> = (0..tokens)
            .map(|t| r::mhc_pre_token(&c.x[t * 4 * d..(t + 1) * 4 * d], &c.p).0)
            .collect();
        let post: Vec<f32> = coefs.iter().flat_map(|k| k.post).collect();
        let comb: Vec<f32> = coefs.iter().flat_map(|k| k.comb).collect();
        let next = nq::random_mhc_params(d, r::HC_MIX, seed ^ 0x55);
        let w = MhcWeights::upload(&gpu, &next, &c.nw, d).unwrap();
        let (dy, dx) = (
            nq::upload_checked_bf16(&gpu, "y", &y).unwrap(),
            nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap(),
        );
        let (dp, dc) = (gpu.upload(&post).unwrap(), gpu.upload(&comb).unwrap());
        // X' of the stand-alone mhc_post kernel (itself checked against the reference above).
        let mut xo_a = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
        nq::mhc_post(&gpu, &dy, &dx, &dp, &dc, tokens, d, &mut xo_a).unwrap();
        // fused
        let mut xo_b = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
        let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, tokens, d).unwrap();
        nq::mhc_post_then_pre(
            &gpu,
            &dy,
            &dx,
            &dp,
            &dc,
            &w,
            r::RMS_EPS,
            &mut xo_b,
            &mut out,
        )
        .unwrap();
        let label = format!("post+pre T={tokens} D={d} seed {seed}");
        let (xa, xb) = (gpu.download(&xo_a).unwrap(), gpu.download(&xo_b).unwrap());
        if let Some(i) = (0..xa.len()).find(|&i| xa[i].to_bits() != xb[i].to_bits()) {
            panic!("{label}: X'[{i}] mhc_post {} vs fused {}", xa[i], xb[i]);
        }
        // The next boundary on X' (the fused mixes sum in mhc_mix_partial's order, the finish is
        // mhc_pre_finish2_*): checked against the CPU reference from the kernel's own reduced mixes, so
        // pre/post/C (the 16-lane Sinkhorn) must match to a few f32 ulp and u/RMSNorm(u) exactly.
        let next_case = MhcCase {
            tokens,
            d,
            x: xb.iter().map(|v| v.to_f32()).collect(),
            p: next,
            nw: c.nw.clone(),
        };
        let snap = MhcSnapshot::take(&gpu, &out);
        let dots = gpu_dots(&snap.partials, snap.splits, tokens, d);
        check_mhc(
            &label,
            &next_case,
            &snap.pre,
            &snap.post,
            &snap.comb,
            &snap.u,
            &snap.normed,
            OutFormat::Nvfp4,
            Some(&dots),
            None,
        );
    }
}

// ---- batches above one launch (MHC_LAUNCH_MAX_TOKENS = 65535 tokens, the grid.y cap) -----------------------

/// The launch chunks cover a batch exactly, in order, each at most MHC_LAUNCH_MAX_TOKENS (the grid.y cap of the
/// post / apply kernels) tokens, one chunk up to the cap.
#[test]
fn mhc_token_chunks_cover_the_batch_in_launches_of_at_most_65535() {
    let cap = nq::MHC_LAUNCH_MAX_TOKENS;
    assert_eq!(cap, 65535);
    for tokens in [
        1usize,
        7,
        4096,
        cap - 1,
        cap,
        cap + 1,
        65536 + 3,
        2 * cap,
        2 * cap + 1,
        300_000,
    ] {
        let chunks: Vec<(usize, usize)> = nq::mhc_token_chunks(tokens).collect();
        assert_eq!(chunks.len(), tokens.div_ceil(cap), "{tokens} tokens");
        let mut next = 0;
        for &(t0, n) in &chunks {
            assert!(
                t0 == next && (1..=cap).contains(&n),
                "{tokens} tokens: chunk ({t0}, {n})"
            );
            next = t0 + n;
        }
        assert_eq!(next, tokens);
    }
    assert_eq!(
        nq::mhc_token_chunks(cap + 1).collect::<Vec<_>>(),
        vec![(0, cap), (cap, 1)]
    );
}

/// Token `t` of a batch as a one-token case (same parameters), for sampled checks of a large batch.
fn mhc_token_case(x: &[f32], p: &MhcParams, nw: &[f32], d: usize, t: usize) -> MhcCase {
    MhcCase {
        tokens: 1,
        d,
        x: x[t * 4 * d..(t + 1) * 4 * d].to_vec(),
        p: p.clone(),
        nw: nw.to_vec(),
    }
}

/// `check_mhc` of token `t` of a downloaded batch (NVFP4 / FP8 outputs), with the kernel's own reduced mixes;
/// `tensor_mix`: the partials came from the tensor-core mix (dots checked under [`tc_dot_bounds`]).
fn check_mhc_token(
    label: &str,
    c: &MhcCase,
    snap: &MhcSnapshot,
    t: usize,
    format: OutFormat,
    tensor_mix: bool,
) {
    let d = c.d;
    let nwarps = nq::row_block_threads(d) as usize / 32;
    let dots: Vec<f32> = (0..25)
        .map(|j| reduce_like_gpu(&snap.partials, snap.splits, nwarps, t, j, 24))
        .collect();
    check_mhc(
        &format!("{label} token {t}"),
        c,
        &snap.pre[t * 4..t * 4 + 4],
        &snap.post[t * 4..t * 4 + 4],
        &snap.comb[t * 16..t * 16 + 16],
        &snap.u[t * d..(t + 1) * d],
        &one_row(&snap.normed, t, d),
        format,
        Some(&dots),
        tensor_mix.then(|| tc_dot_bounds(c, snap.splits)).as_deref(),
    );
}

/// 65536 + 3 tokens at D = 4096: every mHC launcher splits the batch into launches of at most 65535 tokens
/// (nq::mhc_token_chunks: [0, 65535) and [65535, 65539)). The full CPU reference of 65539 tokens would take
/// minutes, so sampled tokens are checked against it (both ends of each chunk, both sides of the boundary,
/// 32-token mix tiles cut by it, random ones); whole outputs are compared bit for bit where two GPU paths
/// must agree (PDL pair vs two launches; the fused post+pre's X' vs mhc_post). One D only: at D = 7168 the
/// inputs alone are 3.8 GB of BF16 X (7.5 GB of f32 on the host), and the chunking does not depend on D.
/// CPU side, estimated from the rates measured for the 4096-token cases on the 2-core dev box: ~35 s to
/// generate X and y (1.07 G + 0.27 G values), plus a few seconds of conversions and whole-output compares;
/// peak host memory ~17 GB.
#[test]
fn gpu_mhc_launchers_split_batches_above_65535_tokens() {
    let Some(gpu) = gpu_for_test("gpu_mhc_launchers_split_batches_above_65535_tokens") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_launchers_split_batches_above_65535_tokens");
    let (tokens, d) = (65536 + 3, 4096);
    let cap = nq::MHC_LAUNCH_MAX_TOKENS;
    assert_eq!(cap, 65535);
    let chunks: Vec<(usize, usize)> = nq::mhc_token_chunks(tokens).collect();
    assert_eq!(chunks, vec![(0, cap), (cap, tokens - cap)]);
    let mut rnd = xorshift64(seed);
    let mut sample = vec![
        0,
        1,
        31,
        32,
        cap - 33,
        cap - 32,
        cap - 1,
        cap,
        cap + 1,
        tokens - 1,
    ];
    sample.extend((0..6).map(|_| (rnd() % tokens as u64) as usize));
    sample.sort_unstable();
    sample.dedup();
    let c = mhc_case(tokens, d, seed);
    let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
    let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();

    // The FFMA mix, two launches per chunk forced, then the PDL pair forced: same bits everywhere.
    let label = format!("mhc_pre T={tokens} D={d} seed {seed}");
    let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, tokens, d).unwrap();
    nq::mhc_pre_with(
        &gpu,
        &dx,
        &w,
        r::RMS_EPS,
        &mut out,
        nq::MhcPrePath::TwoLaunch,
    )
    .unwrap();
    let snap = MhcSnapshot::take(&gpu, &out);
    for &t in &sample {
        check_mhc_token(
            &label,
            &mhc_token_case(&c.x, &c.p, &c.nw, d, t),
            &snap,
            t,
            OutFormat::Nvfp4,
            false,
        );
    }
    out.poison(&gpu).unwrap();
    out.poison_partials(&gpu).unwrap();
    nq::mhc_pre_with(&gpu, &dx, &w, r::RMS_EPS, &mut out, nq::MhcPrePath::PdlPair).unwrap();
    MhcSnapshot::take(&gpu, &out).assert_same(&snap, &format!("{label} PDL pair"));

    // mhc_pre's own path at this size, the tensor-core mix: S = 1 (one 16384-column partial per token, 1024
    // k16 steps: the deepest tensor-core accumulation of any test), two chunks sharing one [T, 25, 1] layout.
    // Not bit-identical to the FFMA path: sampled tokens against the CPU reference under tc_dot_bounds. Its own
    // outputs, so `out` keeps the default path's post / comb, which mhc_post below is checked against (`snap`).
    let mut tout = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, tokens, d).unwrap();
    tout.poison_partials(&gpu).unwrap();
    assert_eq!(nq::mhc_pre_auto_path(tokens), nq::MhcPrePath::TensorMix);
    nq::mhc_pre(&gpu, &dx, &w, r::RMS_EPS, &mut tout).unwrap();
    let tsnap = MhcSnapshot::take(&gpu, &tout);
    drop(tout);
    assert_eq!(tsnap.splits, nq::tc_mix_splits(tokens, d));
    assert_eq!(
        tsnap.splits, 1,
        "{label}: tensor-core mix splits at {tokens} tokens"
    );
    assert_partials_written(&format!("{label} tensor mix"), &tsnap, tokens);
    for &t in &sample {
        check_mhc_token(
            &format!("{label} tensor mix"),
            &mhc_token_case(&c.x, &c.p, &c.nw, d, t),
            &tsnap,
            t,
            OutFormat::Nvfp4,
            true,
        );
    }

    // The unfused chain (its apply kernel is the one with the token on grid.y), FP8 out.
    let label = format!("mhc_pre_unfused->fp8 T={tokens} D={d} seed {seed}");
    let mut uout = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Fp8, tokens, d).unwrap();
    let mut scratch = nq::MhcUnfusedScratch::alloc(&gpu, tokens).unwrap();
    let mut staging = NormOutputs::alloc_poisoned(&gpu, OutFormat::Bf16, tokens, d).unwrap();
    nq::mhc_pre_unfused(
        &gpu,
        &dx,
        &w,
        r::RMS_EPS,
        &mut scratch,
        &mut staging,
        &mut uout,
    )
    .unwrap();
    let usnap = MhcSnapshot::take(&gpu, &uout);
    drop((uout, scratch, staging));
    for &t in &sample {
        check_mhc(
            &format!("{label} token {t}"),
            &mhc_token_case(&c.x, &c.p, &c.nw, d, t),
            &usnap.pre[t * 4..t * 4 + 4],
            &usnap.post[t * 4..t * 4 + 4],
            &usnap.comb[t * 16..t * 16 + 16],
            &usnap.u[t * d..(t + 1) * d],
            &one_row(&usnap.normed, t, d),
            OutFormat::Fp8,
            None,
            None,
        );
    }
    drop(usnap);

    // mhc_post with the boundary's own post / comb (checked above at the samples), bit for bit at the samples.
    let y = nq::random_rows(tokens, d, seed ^ 0x77);
    let dy = nq::upload_checked_bf16(&gpu, "y", &y).unwrap();
    let mut xo_a = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
    nq::mhc_post(&gpu, &dy, &dx, &out.post, &out.comb, tokens, d, &mut xo_a).unwrap();
    let xa = gpu.download(&xo_a).unwrap();
    for &t in &sample {
        let post: [f32; 4] = snap.post[t * 4..t * 4 + 4].try_into().unwrap();
        let comb: [f32; 16] = snap.comb[t * 16..t * 16 + 16].try_into().unwrap();
        let want = r::mhc_post_token(
            &y[t * d..(t + 1) * d],
            &c.x[t * 4 * d..(t + 1) * 4 * d],
            &post,
            &comb,
        );
        let g = &xa[t * 4 * d..(t + 1) * 4 * d];
        if let Some(i) = (0..4 * d).find(|&i| g[i].to_f32().to_bits() != want[i].to_bits()) {
            panic!(
                "mhc_post T={tokens} D={d} seed {seed}: token {t} X'[{i}] GPU {} vs reference {}",
                g[i], want[i]
            );
        }
    }

    // Fused post + next pre: X' bit for bit against mhc_post (every token), the next boundary at the samples.
    let next = nq::random_mhc_params(d, r::HC_MIX, seed ^ 0x55);
    let wn = MhcWeights::upload(&gpu, &next, &c.nw, d).unwrap();
    let mut xo_b = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
    let mut nout = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, tokens, d).unwrap();
    nq::mhc_post_then_pre(
        &gpu,
        &dy,
        &dx,
        &out.post,
        &out.comb,
        &wn,
        r::RMS_EPS,
        &mut xo_b,
        &mut nout,
    )
    .unwrap();
    let label = format!("post+pre T={tokens} D={d} seed {seed}");
    let xb = gpu.download(&xo_b).unwrap();
    if let Some(i) = (0..xa.len()).find(|&i| xa[i].to_bits() != xb[i].to_bits()) {
        panic!(
            "{label}: X'[{i}] (token {}) mhc_post {} vs fused {}",
            i / (4 * d),
            xa[i],
            xb[i]
        );
    }
    drop(xa);
    let xb: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    let nsnap = MhcSnapshot::take(&gpu, &nout);
    drop(nout);
    for &t in &sample {
        check_mhc_token(
            &label,
            &mhc_token_case(&xb, &next, &c.nw, d, t),
            &nsnap,
            t,
            OutFormat::Nvfp4,
            false,
        );
    }
    drop((nsnap, xb, xo_a, xo_b, out));

    // hc_head at the samples.
    let hp = nq::random_mhc_params(d, r::HC_HEAD_MIX, seed ^ 5);
    let (scale, base) = (0.9f32, [0.1f32, -0.3, 0.2, 0.05]);
    let wh = MhcWeights::upload_head(&gpu, &hp.mix_fn, scale, &base, &c.nw, d).unwrap();
    let mut hout = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Bf16, tokens, d).unwrap();
    nq::hc_head(&gpu, &dx, &wh, r::RMS_EPS, &mut hout).unwrap();
    let pre = download_f32(&gpu, &hout.pre);
    let u: Vec<f32> = gpu
        .download(&hout.u)
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect();
    let normed = hout.normed.download(&gpu).unwrap();
    let HostQuant::Bf16(yh) = &normed.q else {
        panic!("hc_head: BF16 output expected")
    };
    let label = format!("hc_head T={tokens} D={d} seed {seed}");
    for &t in &sample {
        let xt = &c.x[t * 4 * d..(t + 1) * 4 * d];
        check_hc_head_token(&label, t, xt, &hp.mix_fn, scale, &base, &pre, &u);
        let ut = &u[t * d..(t + 1) * d];
        let one = nq::HostNormOutputs {
            rstd: vec![normed.rstd[t]],
            q: HostQuant::Bf16(yh[t * d..(t + 1) * d].to_vec()),
        };
        check_norm_outputs(
            &format!("{label} token {t}"),
            ut,
            &c.nw,
            1,
            d,
            OutFormat::Bf16,
            &one,
        );
    }
    eprintln!(
        "{label}: chunks {chunks:?}, {} sampled tokens checked on every launcher",
        sample.len()
    );
}

// ---- A/B (session 3): the PDL pair (mhc_mix_partial24_pdl + mhc_pre_finish_pdl_*) ------------------------
// Same arithmetic as the default two launches, so every output (partials included) must be bit-identical.
// The partials are poisoned (NaN) before each PDL run: a finish that read them before the mixes had
// written them (a broken griddepcontrol.wait) would produce NaN, not the default path's bits.

#[test]
fn gpu_mhc_pre_pdl_pair_equals_two_launch_bitwise() {
    let Some(gpu) = gpu_for_test("gpu_mhc_pre_pdl_pair_equals_two_launch_bitwise") else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pre_pdl_pair_equals_two_launch_bitwise");
    for &(tokens, d) in &[
        (1usize, 4096usize),
        (3, 7168),
        (33, 4096),
        (64, 7168),
        (129, 4096),
    ] {
        let c = mhc_case(tokens, d, seed ^ (tokens as u64 * 977 + d as u64));
        let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
        let dx = nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap();
        for format in FORMATS {
            let label = format!("pdl pair->{} T={tokens} D={d} seed {seed}", format.name());
            let mut out = MhcPreOutputs::alloc_poisoned(&gpu, format, tokens, d).unwrap();
            nq::mhc_pre_with(
                &gpu,
                &dx,
                &w,
                r::RMS_EPS,
                &mut out,
                nq::MhcPrePath::TwoLaunch,
            )
            .unwrap();
            let want = MhcSnapshot::take(&gpu, &out);
            out.poison(&gpu).unwrap();
            out.poison_partials(&gpu).unwrap();
            nq::mhc_pre_with(&gpu, &dx, &w, r::RMS_EPS, &mut out, nq::MhcPrePath::PdlPair).unwrap();
            let got = MhcSnapshot::take(&gpu, &out);
            got.assert_same(&want, &label);
            // And against the CPU reference directly (mhc_pre, both paths, is checked the same way above).
            let dots = gpu_dots(&got.partials, got.splits, tokens, d);
            check_mhc(
                &label,
                &c,
                &got.pre,
                &got.post,
                &got.comb,
                &got.u,
                &got.normed,
                format,
                Some(&dots),
                None,
            );
        }
    }
}

#[test]
fn gpu_mhc_pdl_pair_waits_for_the_producer_of_x_and_replays_in_a_graph() {
    let Some(gpu) =
        gpu_for_test("gpu_mhc_pdl_pair_waits_for_the_producer_of_x_and_replays_in_a_graph")
    else {
        return;
    };
    let seed = fresh_seed("gpu_mhc_pdl_pair_waits_for_the_producer_of_x_and_replays_in_a_graph");
    for &(tokens, d) in &[(1usize, 4096usize), (5, 7168), (64, 4096)] {
        let c = mhc_case(tokens, d, seed ^ tokens as u64);
        let y = nq::random_rows(tokens, d, seed ^ 0x77);
        let post = vec![0.75f32; tokens * 4];
        let comb: Vec<f32> = (0..tokens * 16)
            .map(|i| 0.1 + 0.05 * (i % 7) as f32)
            .collect();
        let w = MhcWeights::upload(&gpu, &c.p, &c.nw, d).unwrap();
        let (dy, dx) = (
            nq::upload_checked_bf16(&gpu, "y", &y).unwrap(),
            nq::upload_checked_bf16(&gpu, "X", &c.x).unwrap(),
        );
        let (dp, dc) = (gpu.upload(&post).unwrap(), gpu.upload(&comb).unwrap());
        let label = format!("pdl after mhc_post T={tokens} D={d} seed {seed}");
        // Reference bits: mhc_post -> X', then the two-launch boundary on X'.
        let mut xo = gpu.poisoned::<half::bf16>(tokens * 4 * d, 0xFF).unwrap();
        let mut out = MhcPreOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, tokens, d).unwrap();
        nq::mhc_post(&gpu, &dy, &dx, &dp, &dc, tokens, d, &mut xo).unwrap();
        nq::mhc_pre_with(
            &gpu,
            &xo,
            &w,
            r::RMS_EPS,
            &mut out,
            nq::MhcPrePath::TwoLaunch,
        )
        .unwrap();
        let want = MhcSnapshot::take(&gpu, &out);
        // The PDL mix reads X' right after the (plain) mhc_post launch that writes it: with X' poisoned
        // first, a mix that read X' before its griddepcontrol.wait would see NaN.
        let run = |xo: &mut cudarc::driver::CudaSlice<half::bf16>, out: &mut MhcPreOutputs| {
            nq::mhc_post(&gpu, &dy, &dx, &dp, &dc, tokens, d, xo)?;
            nq::mhc_pre_with(&gpu, xo, &w, r::RMS_EPS, out, nq::MhcPrePath::PdlPair)
        };
        gpu.fill_bytes(&mut xo, 0xFF).unwrap();
        out.poison(&gpu).unwrap();
        out.poison_partials(&gpu).unwrap();
        run(&mut xo, &mut out).unwrap();
        MhcSnapshot::take(&gpu, &out).assert_same(&want, &format!("{label} direct"));
        // Captured: 4 consecutive (post, PDL boundary) pairs in one graph, as in a decode-step graph.
        let g = gpu
            .capture(|| {
                for _ in 0..4 {
                    run(&mut xo, &mut out)?;
                }
                Ok(())
            })
            .unwrap();
        for rep in 0..3 {
            gpu.fill_bytes(&mut xo, 0xFF).unwrap();
            out.poison(&gpu).unwrap();
            out.poison_partials(&gpu).unwrap();
            g.launch().unwrap();
            gpu.synchronize().unwrap();
            MhcSnapshot::take(&gpu, &out)
                .assert_same(&want, &format!("{label} graph replay {rep}"));
        }
    }
}

#[test]
fn bench_config_names_known_kernels_and_variants() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-configs/norm_quant.toml");
    let cfg = megamoe::bench::config::SweepConfig::from_path(&path).unwrap();
    let kernels = megamoe::bench::kernels::all();
    assert!(!cfg.sweeps.is_empty());
    for s in &cfg.sweeps {
        let k = kernels
            .iter()
            .find(|k| k.name == s.kernel)
            .unwrap_or_else(|| panic!("unknown kernel {}", s.kernel));
        s.variants_from(k.variants).unwrap();
        let d = s.param_u64("d").unwrap() as usize;
        nq::check_rows(1, d).unwrap();
    }
}

// ---- NVFP4 encoder at exact e2m1 decision points ----------------------------------------------------------

/// Compares two NVFP4 downloads byte for byte (codes, scales, global scales) with a precise diagnostic.
fn assert_same_nvfp4(label: &str, got: &HostQuant, want: &HostQuant, d: usize) {
    let (HostQuant::Nvfp4(g), HostQuant::Nvfp4(w)) = (got, want) else {
        panic!("{label}: not NVFP4 outputs");
    };
    if let Some((i, a, b)) = first_diff(&g.data, &w.data) {
        panic!(
            "{label}: code byte {i} (row {}, elements {}..{}): got {a:#04x} vs want {b:#04x}",
            i / (d / 2),
            2 * (i % (d / 2)),
            2 * (i % (d / 2)) + 1
        );
    }
    if let Some((i, a, b)) = first_diff(&g.scales, &w.scales) {
        panic!(
            "{label}: block scale {i} (row {}, block {}): got {a:#04x} vs want {b:#04x}",
            i / (d / 16),
            i % (d / 16)
        );
    }
    if let Some(i) = (0..g.global_scale.len())
        .find(|&i| g.global_scale[i].to_bits() != w.global_scale[i].to_bits())
    {
        panic!(
            "{label}: global scale of row {i}: got {:e} vs want {:e}",
            g.global_scale[i], w.global_scale[i]
        );
    }
}

/// BF16 rows whose values sit at (or one BF16 ulp around) the e2m1 decision points t * scale of their block.
/// Rows with a power-of-two global scale make t * scale exactly BF16 (ties hit exactly); others have random
/// global scales; a few rows have scales below 2^-100 or above 2^100 (far from the usual range).
fn boundary_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut next = xorshift64(seed);
    let thresholds = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let bf = |v: f32| bf16::round(v);
    let mut out = Vec::with_capacity(rows * d);
    for row in 0..rows {
        let k: i32 = match row % 8 {
            6 => -112,
            7 => 110,
            _ => (next() % 40) as i32 - 25,
        };
        let pow2_gs = row % 2 == 0 || row % 8 >= 6;
        let a_row = if pow2_gs {
            2688.0 * 2f32.powi(k)
        } else {
            bf(2688.0 * 2f32.powi(k) * (1.0 + (next() % 128) as f32 / 128.0))
        };
        let gs = a_row / 2688.0;
        let mut y = vec![0f32; d];
        for b in 0..d / 16 {
            // block amax: 6 * gs * (an e4m3 value), BF16-rounded (exact for a power-of-two gs)
            let code = (next() % 0x7E) as u8 + 1;
            let ab = bf(6.0 * gs * e4m3::decode(code)).min(a_row);
            let s = e4m3::decode(e4m3::encode_rne(ab / (6.0 * gs)));
            let scale = s * gs;
            let blk = &mut y[b * 16..(b + 1) * 16];
            blk[0] = if next().is_multiple_of(2) { ab } else { -ab };
            for v in blk.iter_mut().skip(1) {
                let t = thresholds[(next() % 7) as usize];
                let target = bf(t * scale);
                let step = (next() % 5) as i32 - 2; // -2..=2 BF16 ulps around it
                let mut a = f32::from_bits((target.to_bits() as i32 + step * 0x10000) as u32);
                if a.is_nan() || a.abs() > ab {
                    a = ab;
                }
                *v = if next().is_multiple_of(2) { a } else { -a };
            }
        }
        y[(next() as usize) % d] = a_row;
        out.extend_from_slice(&y);
    }
    out
}

/// `quantize_bf16_rows` NVFP4 (the quantize-only v4p kernel) at exact e2m1 decision points, 64 rows (fewer
/// than one resident wave: one row per CTA); the looping case is in gpu_rmsnorm_nvfp4_v4p_matches_reference.
#[test]
fn gpu_quant_nvfp4_matches_cpu_at_exact_boundaries() {
    let Some(gpu) = gpu_for_test("gpu_quant_nvfp4_matches_cpu_at_exact_boundaries") else {
        return;
    };
    let seed = fresh_seed("gpu_quant_nvfp4_matches_cpu_at_exact_boundaries");
    for &d in DS {
        let rows = 64;
        let y = boundary_rows(rows, d, seed ^ d as u64);
        assert!(y.iter().all(|v| v.is_finite() && bf16::round(*v) == *v));
        let dy = nq::upload_checked_bf16(&gpu, "y", &y).unwrap();
        let label = format!("quant->nvfp4 boundary rows {rows}x{d}, seed {seed}");
        let want = HostQuant::encode(OutFormat::Nvfp4, &y, rows, d).unwrap();
        let mut out = NormOutputs::alloc_poisoned(&gpu, OutFormat::Nvfp4, rows, d).unwrap();
        nq::quantize_bf16_rows(&gpu, &dy, &mut out).unwrap();
        let got = out.download(&gpu).unwrap();
        assert_same_nvfp4(&label, &got.q, &want, d);
        eprintln!("{label}: kernel and CPU reference bit-identical");
    }
}

// ---- the resident-wave row kernels (RowsPath::V5 FP8 / V6 NVFP4 from 4096 rows) and the path rule ------------

/// The v5 FP8 kernel's division-free ue8m0 scale (reference::ue8m0_scale_448_divfree, the mirror of the
/// .cu's ue8m0_scale_448_divfree) against formats::ue8m0::pow2_scale_for(max(amax, 1e-4), 448): every
/// non-negative non-NaN BF16 amax (the kernel's amax is always one, or 0), +inf, the 1e-4 floor, every f32
/// within 64 ulps of each binade's mantissa decision point (1.75 * 2^e) and of each power of two, and a
/// seeded stride through all f32 values from 1e-4 to the largest finite.
#[test]
fn v5_divfree_ue8m0_scale_equals_formats_rule() {
    let seed = fresh_seed("v5_divfree_ue8m0_scale_equals_formats_rule");
    let check = |amax: f32| {
        let a = amax.max(1e-4);
        let want = ue8m0::pow2_scale_for(a, 448.0);
        let got = r::ue8m0_scale_448_divfree(a);
        assert_eq!(
            got,
            want,
            "amax {amax:e} ({:#010x}): division-free {got} vs formats {want} (seed {seed})",
            amax.to_bits()
        );
    };
    for bits in 0u16..=0x7F80 {
        check(bf16::bf16::from_bits(bits).to_f32());
    }
    check(1e-4);
    check(f32::MAX);
    for e in 1u32..255 {
        for center in [e << 23, (e << 23) | 0x60_0000] {
            for d in -64i64..=64 {
                let b = center as i64 + d;
                if (0..0x7F80_0000).contains(&b) {
                    check(f32::from_bits(b as u32));
                }
            }
        }
    }
    let lo = 1e-4f32.to_bits();
    let mut b = lo + (seed % 997) as u32;
    let mut n = 0usize;
    while b < 0x7F80_0000 {
        check(f32::from_bits(b));
        b += 997;
        n += 1;
    }
    eprintln!("division-free ue8m0 scale equals formats::ue8m0 on all BF16 amax values and {n} strided f32 (seed {seed})");
}

/// v5 shape rules: D a multiple of 1024 (else a clear error before any launch), FP8 only (its NVFP4 kernel was
/// removed in session 7); and the v5 / v6 block size equals the default kernels' (the same channel ownership,
/// hence the same sum-of-squares order).
#[test]
fn v5_launcher_rules_and_channel_ownership() {
    for d in (1024..=nq::MAX_D).step_by(nq::V5_D_MULTIPLE) {
        assert_eq!(
            nq::v5_block_threads(d),
            nq::row_block_threads(d),
            "v5 block size differs from the default at D = {d}"
        );
        nq::check_v5(3, d, OutFormat::Fp8).unwrap();
        let e = nq::check_v5(3, d, OutFormat::Nvfp4)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("must be fp8"),
            "nvfp4 D = {d}: unexpected error `{e}`"
        );
    }
    for d in [128usize, 1152, 4096 + 128, 7168 - 512] {
        let e = nq::check_v5(3, d, OutFormat::Fp8).unwrap_err().to_string();
        assert!(
            e.contains("multiple of 1024"),
            "D = {d}: unexpected error `{e}`"
        );
    }
    let e = nq::check_v5(3, 4096, OutFormat::Bf16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("must be fp8"), "bf16: unexpected error `{e}`");
    assert!(nq::check_v5(0, 4096, OutFormat::Fp8).is_err());
}

/// Rows for the resident-wave (v5 / v6) bit-identity tests: the bench generator's rows, with an all-zero row (1), rows scaled by
/// 2^40 (2) and 2^-40 (3) and one whose sum of squares overflows f32 (4: scaled by 2^100, rstd 0) spliced in, and every 5th row replaced by a row of
/// the encoder's exact-decision-point generator (boundary_rows; scales 2^-112..2^110, so some of these rows'
/// sums of squares overflow or underflow f32: both kernels must still agree bit for bit).
fn resident_rows(rows: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut x = nq::random_rows(rows, d, seed);
    let b = boundary_rows(rows.div_ceil(5), d, seed ^ 0xb5);
    for row in (0..rows).step_by(5) {
        x[row * d..(row + 1) * d].copy_from_slice(&b[(row / 5) * d..(row / 5 + 1) * d]);
    }
    let special = [
        (1usize, 0.0f32),
        (2, 2f32.powi(40)),
        (3, 2f32.powi(-40)),
        (4, 2f32.powi(100)),
    ];
    for (row, scale) in special {
        if row < rows {
            for v in &mut x[row * d..(row + 1) * d] {
                *v = bf16::round(*v * scale);
            }
        }
    }
    x
}

/// First differing byte of two downloads, with the row it lies in.
fn assert_same_bytes(label: &str, what: &str, got: &[u8], want: &[u8], row_bytes: usize) {
    assert_eq!(got.len(), want.len(), "{label}: {what} lengths differ");
    if let Some((i, a, b)) = first_diff(got, want) {
        panic!(
            "{label}: {what} byte {i} (row {}, byte {} of the row): got {a:#04x} vs want {b:#04x}",
            i / row_bytes,
            i % row_bytes
        );
    }
}

/// `rows_path` (the kernel rmsnorm_quant takes for BF16 rows): exactly from 4096 rows when D is a multiple of
/// 1024, v5 for FP8 and v6 for NVFP4 up to V6_MAX_D (NVFP4 above it: V4, the v4p row loop, at every row count
/// since the v5 NVFP4 kernel's removal); V4 below 4096 rows, for BF16 output and for every other D; and every
/// shape it sends to v5 / v6 passes that kernel's own shape check.
#[test]
fn rows_path_switches_at_4096_rows_for_d_multiple_of_1024() {
    use nq::RowsPath::{V4, V5, V6};
    assert_eq!(nq::V5_MIN_ROWS, 4096);
    for format in [OutFormat::Nvfp4, OutFormat::Fp8] {
        for d in [1024usize, 2048, 4096, 7168, nq::MAX_D] {
            for (rows, want) in [
                (1usize, V4),
                (64, V4),
                (1024, V4),
                (4095, V4),
                (4096, V5),
                (4097, V5),
                (9000, V5),
                (65536, V5),
            ] {
                // NVFP4: v6 up to V6_MAX_D wherever the resident wave runs; above it v4p (V4) everywhere
                let want = match (format, want) {
                    (OutFormat::Nvfp4, V5) if d <= nq::V6_MAX_D => V6,
                    (OutFormat::Nvfp4, _) => V4,
                    _ => want,
                };
                let got = nq::rows_path(rows, d, format);
                assert_eq!(got, want, "{} {rows}x{d}", format.name());
                match got {
                    V5 => nq::check_v5(rows, d, format).unwrap(),
                    V6 => nq::check_v6(rows, d, format).unwrap(),
                    V4 => {}
                }
            }
        }
        for d in [128usize, 1152, 4096 + 128, 7168 - 512, nq::MAX_D - 128] {
            for rows in [1usize, 4096, 65536] {
                assert_eq!(
                    nq::rows_path(rows, d, format),
                    V4,
                    "{} {rows}x{d}",
                    format.name()
                );
            }
        }
    }
    for d in [1024usize, 4096, 7168] {
        for rows in [1usize, 4096, 65536] {
            assert_eq!(
                nq::rows_path(rows, d, OutFormat::Bf16),
                V4,
                "bf16 {rows}x{d}"
            );
        }
    }
}

/// Bitwise comparison of two downloaded row outputs (rstd, codes, block / global / FP8 scales).
fn assert_same_rows(label: &str, got: &nq::HostNormOutputs, want: &nq::HostNormOutputs, d: usize) {
    let rbits = |v: &[f32]| {
        v.iter()
            .flat_map(|f| f.to_bits().to_le_bytes())
            .collect::<Vec<u8>>()
    };
    assert_same_bytes(label, "rstd", &rbits(&got.rstd), &rbits(&want.rstd), 4);
    match (&got.q, &want.q) {
        (HostQuant::Nvfp4(g), HostQuant::Nvfp4(b)) => {
            assert_same_bytes(label, "codes", &g.data, &b.data, d / 2);
            assert_same_bytes(label, "block scales", &g.scales, &b.scales, d / 16);
            assert_same_bytes(
                label,
                "global scales",
                &rbits(&g.global_scale),
                &rbits(&b.global_scale),
                4,
            );
        }
        (HostQuant::Fp8(g), HostQuant::Fp8(b)) => {
            assert_same_bytes(label, "codes", &g.data, &b.data, d);
            assert_same_bytes(label, "scales", &g.scales, &b.scales, d / 128);
        }
        _ => panic!("{label}: unexpected output formats"),
    }
}

/// Row `row` of a downloaded output as a one-row output (for the CPU reference check).
fn one_row(got: &nq::HostNormOutputs, row: usize, d: usize) -> nq::HostNormOutputs {
    nq::HostNormOutputs {
        rstd: vec![got.rstd[row]],
        q: match &got.q {
            HostQuant::Nvfp4(g) => HostQuant::Nvfp4(r::Nvfp4Rows {
                rows: 1,
                cols: d,
                data: g.data[row * d / 2..(row + 1) * d / 2].to_vec(),
                scales: g.scales[row * d / 16..(row + 1) * d / 16].to_vec(),
                global_scale: vec![g.global_scale[row]],
            }),
            HostQuant::Fp8(g) => HostQuant::Fp8(r::Fp8Rows {
                rows: 1,
                cols: d,
                data: g.data[row * d..(row + 1) * d].to_vec(),
                scales: g.scales[row * d / 128..(row + 1) * d / 128].to_vec(),
            }),
            HostQuant::Bf16(_) => unreachable!("row outputs here are nvfp4 / fp8"),
        },
    }
}

/// A quantize-only NVFP4 kernel (`quantize`: v4p / v6 launcher) on device BF16 rows `dy` [rows, d], into
/// freshly poisoned outputs; returns them downloaded.
fn quantized_nvfp4(
    gpu: &megamoe::gpu::Gpu,
    dy: &cudarc::driver::CudaSlice<half::bf16>,
    rows: usize,
    d: usize,
    quantize: fn(
        &megamoe::gpu::Gpu,
        &cudarc::driver::CudaSlice<half::bf16>,
        &mut NormOutputs,
    ) -> anyhow::Result<()>,
) -> nq::HostNormOutputs {
    let mut out = NormOutputs::alloc_poisoned(gpu, OutFormat::Nvfp4, rows, d).unwrap();
    quantize(gpu, dy, &mut out).unwrap();
    out.download(gpu).unwrap()
}

/// `rmsnorm_quant` on device rows `dx` [rows, d] along `path` (`None`: as called, i.e. `rows_path`'s choice),
/// into freshly poisoned outputs; returns them downloaded.
fn run_rows_path(
    gpu: &megamoe::gpu::Gpu,
    dx: &cudarc::driver::CudaSlice<half::bf16>,
    dw: &cudarc::driver::CudaSlice<half::bf16>,
    format: OutFormat,
    rows: usize,
    d: usize,
    path: Option<nq::RowsPath>,
) -> nq::HostNormOutputs {
    let mut out = NormOutputs::alloc_poisoned(gpu, format, rows, d).unwrap();
    match path {
        Some(p) => nq::rmsnorm_quant_with(gpu, RowsIn::Bf16(dx), dw, r::RMS_EPS, &mut out, p),
        None => nq::rmsnorm_quant(gpu, RowsIn::Bf16(dx), dw, r::RMS_EPS, &mut out),
    }
    .unwrap();
    out.download(gpu).unwrap()
}

/// A resident-wave row path (`resident`: V6 for NVFP4, V5 for FP8) on `resident_rows` data: bit-identical to the
/// V4 kernels and to `rmsnorm_quant`'s own pick, and exact against the CPU reference on the sampled rows
/// ([`check_sampled_rows_vs_cpu`]). Prints what was checked.
#[allow(clippy::too_many_arguments)]
fn check_resident_path(
    gpu: &megamoe::gpu::Gpu,
    dx: &cudarc::driver::CudaSlice<half::bf16>,
    dw: &cudarc::driver::CudaSlice<half::bf16>,
    x: &[f32],
    w: &[f32],
    format: OutFormat,
    rows: usize,
    d: usize,
    resident: nq::RowsPath,
    label: &str,
) {
    let run = |path| run_rows_path(gpu, dx, dw, format, rows, d, path);
    let got = run(Some(resident));
    let default_path = nq::rows_path(rows, d, format);
    let v4 = run(Some(nq::RowsPath::V4));
    assert_same_rows(&format!("{resident:?} vs V4 {label}"), &got, &v4, d);
    assert_same_rows(
        &format!("rmsnorm_quant ({default_path:?}) vs V4 {label}"),
        &run(None),
        &v4,
        d,
    );
    let checked = check_sampled_rows_vs_cpu(
        &format!("{resident:?} {label}"),
        x,
        w,
        rows,
        d,
        format,
        &got,
    );
    eprintln!("{label}: {resident:?}, V4 and rmsnorm_quant ({default_path:?}) bit-identical; {checked} rows exact vs the CPU reference");
}

/// The CPU reference on the random rows of `resident_rows` data (not the boundary / extreme ones, rows 1..=4 and every
/// 5th: their rstd may be far from the CPU's) among the first 300 and the last 64; returns how many were checked.
fn check_sampled_rows_vs_cpu(
    label: &str,
    x: &[f32],
    w: &[f32],
    rows: usize,
    d: usize,
    format: OutFormat,
    got: &nq::HostNormOutputs,
) -> usize {
    let mut checked = 0;
    for row in (0..rows.min(300)).chain(rows.saturating_sub(64).max(300)..rows) {
        if row % 5 == 0 || (1..=4).contains(&row) {
            continue;
        }
        check_norm_outputs(
            &format!("{label} row {row}"),
            &x[row * d..(row + 1) * d],
            w,
            1,
            d,
            format,
            &one_row(got, row, d),
        );
        checked += 1;
    }
    checked
}

/// The BF16 row kernels, each forced: RowsPath::V4 (v4p NVFP4 / one-CTA-per-row FP8) against the resident-wave
/// kernel of the format (RowsPath::V5 for FP8, RowsPath::V6 for NVFP4), bit for bit on every row (codes, block
/// scales, global scales, FP8 scales, rstd; outputs poisoned before each run), and the resident-wave output
/// against the CPU reference (exact given the GPU rstd) on the random rows among the first 300 and the last 64.
/// The public rmsnorm_quant must give the same bits too, on both sides of its 4096-row switch (4095, 4096, 9000
/// rows). D = 4096, 7168 and 2048, rows from 1 to 9000 (several rows per CTA of the resident wave, and a partial
/// last round of the loop); D = 32768 (the largest: 1024 threads, 128 KB of staged weight) at a few rows: FP8
/// as above; NVFP4 refused with a clear error by V6 (above V6_MAX_D), while V4 (one CTA per row above
/// V4P_NVFP4_MAX_D) and rmsnorm_quant agree bit for bit and with the CPU reference.
#[test]
fn gpu_resident_wave_rows_equal_v4_and_default_bitwise() {
    let Some(gpu) = gpu_for_test("gpu_resident_wave_rows_equal_v4_and_default_bitwise") else {
        return;
    };
    let seed = fresh_seed("gpu_resident_wave_rows_equal_v4_and_default_bitwise");
    let rows_list = [1usize, 2, 3, 7, 64, 127, 129, 4095, 4096, 9000];
    for (d, rows_list) in [
        (4096usize, &rows_list[..]),
        (7168, &rows_list[..9]), // 4096 rows already loop; keep the test short
        (2048, &rows_list[..]),
        (nq::MAX_D, &[1usize, 3, 130][..]),
    ] {
        let w = nq::random_weight(d, seed ^ d as u64);
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for &rows in rows_list {
            let x = resident_rows(rows, d, seed ^ (rows as u64 * 131 + d as u64));
            let dx = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
            for format in [OutFormat::Nvfp4, OutFormat::Fp8] {
                let label = format!("{} {rows}x{d}, seed {seed}", format.name());
                let resident = match format {
                    OutFormat::Nvfp4 => nq::RowsPath::V6,
                    _ => nq::RowsPath::V5,
                };
                let default_path = nq::rows_path(rows, d, format);
                if format == OutFormat::Nvfp4 && d > nq::V6_MAX_D {
                    // V6 refuses this D before any launch (outputs untouched); V4 (above
                    // V4P_NVFP4_MAX_D: one CTA per row) and rmsnorm_quant agree bit for bit and with the CPU.
                    assert_eq!(default_path, nq::RowsPath::V4, "{label}");
                    let mut out = NormOutputs::alloc_poisoned(&gpu, format, rows, d).unwrap();
                    let before = out.download(&gpu).unwrap();
                    let err = nq::rmsnorm_quant_with(
                        &gpu,
                        RowsIn::Bf16(&dx),
                        &dw,
                        r::RMS_EPS,
                        &mut out,
                        nq::RowsPath::V6,
                    )
                    .expect_err("V6 must refuse D above V6_MAX_D");
                    assert!(
                        format!("{err:#}").contains("above 8192"),
                        "{label}: `{err:#}`"
                    );
                    assert_same_rows(
                        &format!("{label} V6: outputs untouched"),
                        &out.download(&gpu).unwrap(),
                        &before,
                        d,
                    );
                    let v4 = run_rows_path(&gpu, &dx, &dw, format, rows, d, Some(nq::RowsPath::V4));
                    let default = run_rows_path(&gpu, &dx, &dw, format, rows, d, None);
                    assert_same_rows(&format!("rmsnorm_quant vs V4 {label}"), &default, &v4, d);
                    let checked = check_sampled_rows_vs_cpu(
                        &format!("V4 {label}"),
                        &x,
                        &w,
                        rows,
                        d,
                        format,
                        &v4,
                    );
                    eprintln!(
                        "{label}: V6 refused; V4 = rmsnorm_quant, {checked} rows exact vs the CPU"
                    );
                    continue;
                }
                check_resident_path(&gpu, &dx, &dw, &x, &w, format, rows, d, resident, &label);
            }
        }
    }
}

/// The largest hidden sizes, where the one-CTA-per-row kernels run 800-1024 threads: D just above the v4p
/// NVFP4 limit (V4P_NVFP4_MAX_D + 128, not a multiple of 1024) and MAX_D, BF16 and f32 input, every output
/// format, against the CPU reference (rmsnorm_quant), and the unfused chain (its NVFP4 quantizer is one CTA per
/// row above the v4p limit too) bit-identical to the fused kernel. Before session 8 BF16 -> NVFP4 was refused at
/// these D, and f32 -> NVFP4 / BF16 failed to launch above D 28,672 (66-68 registers x 1024 threads).
#[test]
fn gpu_rows_at_the_largest_d_every_input_and_format() {
    let Some(gpu) = gpu_for_test("gpu_rows_at_the_largest_d_every_input_and_format") else {
        return;
    };
    let seed = fresh_seed("gpu_rows_at_the_largest_d_every_input_and_format");
    for d in [nq::V4P_NVFP4_MAX_D + 128, nq::MAX_D] {
        let w = nq::random_weight(d, seed ^ d as u64);
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for rows in [1usize, 3, 130] {
            let x = nq::random_rows(rows, d, seed ^ (rows as u64 * 7919 + d as u64));
            // f32 input with full mantissas (not BF16-representable)
            let x32: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1.0 + (i % 89) as f32 * 1.91e-5))
                .collect();
            let dx16 = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
            let dx32 = nq::upload_checked_f32(&gpu, "x", &x32).unwrap();
            for format in FORMATS {
                for f32_input in [false, true] {
                    let label = format!(
                        "rmsnorm->{} {rows}x{d} {} in, seed {seed}",
                        format.name(),
                        if f32_input { "f32" } else { "bf16" }
                    );
                    let (input, xs) = if f32_input {
                        (RowsIn::F32(&dx32), &x32)
                    } else {
                        (RowsIn::Bf16(&dx16), &x)
                    };
                    let mut out = NormOutputs::alloc_poisoned(&gpu, format, rows, d).unwrap();
                    nq::rmsnorm_quant(&gpu, input, &dw, r::RMS_EPS, &mut out)
                        .unwrap_or_else(|e| panic!("{label}: {e:#}"));
                    check_norm_outputs(
                        &label,
                        xs,
                        &w,
                        rows,
                        d,
                        format,
                        &out.download(&gpu).unwrap(),
                    );
                }
                if format == OutFormat::Bf16 {
                    continue;
                }
                let (fused, unfused, _) = fused_and_unfused(&gpu, &dx16, &dw, format, rows, d);
                assert!(
                    fused.q == unfused.q,
                    "{} {rows}x{d} seed {seed}: fused and unfused outputs differ",
                    format.name()
                );
            }
            eprintln!("{rows}x{d}: every input and format exact vs the CPU; unfused = fused");
        }
    }
}

/// Above the 4096-row switch with a D that is not a multiple of 1024 (4096 + 128, 1152), rmsnorm_quant must
/// stay on the V4 kernels (V5 / V6 refuse the shape with a clear error before any launch) and match the CPU
/// reference on every row.
#[test]
fn gpu_rmsnorm_quant_many_rows_with_d_not_multiple_of_1024() {
    let Some(gpu) = gpu_for_test("gpu_rmsnorm_quant_many_rows_with_d_not_multiple_of_1024") else {
        return;
    };
    let seed = fresh_seed("gpu_rmsnorm_quant_many_rows_with_d_not_multiple_of_1024");
    for (rows, d) in [(4096usize, 4096usize + 128), (4100, 1152)] {
        let x = nq::random_rows(rows, d, seed ^ (rows * d) as u64);
        let w = nq::random_weight(d, seed ^ d as u64 ^ 0x77);
        let (dx, dw) = (
            nq::upload_checked_bf16(&gpu, "x", &x).unwrap(),
            nq::upload_checked_bf16(&gpu, "w", &w).unwrap(),
        );
        for format in [OutFormat::Nvfp4, OutFormat::Fp8] {
            let label = format!("{} {rows}x{d}, seed {seed}", format.name());
            assert_eq!(nq::rows_path(rows, d, format), nq::RowsPath::V4, "{label}");
            let mut out = NormOutputs::alloc_poisoned(&gpu, format, rows, d).unwrap();
            let resident = match format {
                OutFormat::Nvfp4 => nq::RowsPath::V6,
                _ => nq::RowsPath::V5,
            };
            let err = nq::rmsnorm_quant_with(
                &gpu,
                RowsIn::Bf16(&dx),
                &dw,
                r::RMS_EPS,
                &mut out,
                resident,
            )
            .expect_err("V5 / V6 must refuse D not a multiple of 1024");
            assert!(
                format!("{err:#}").contains("multiple of 1024"),
                "{label}: unexpected error `{err:#}`"
            );
            nq::rmsnorm_quant(&gpu, RowsIn::Bf16(&dx), &dw, r::RMS_EPS, &mut out).unwrap();
            check_norm_outputs(
                &label,
                &x,
                &w,
                rows,
                d,
                format,
                &out.download(&gpu).unwrap(),
            );
            eprintln!("{label}: rmsnorm_quant (V4) matches the CPU reference");
        }
    }
}

// ---- the v6 NVFP4 row kernels (RowsPath::V6, the NVFP4 default from 4096 rows since session 6) --------------------

/// The v6 binary-search encoder (Rust mirror of v6_codes8_bsearch) gives the same code word as the v4p encoder
/// (codes8 and its prmt placement) for EVERY 16-bit pattern in each half of a pair (both signs, subnormals, +-inf
/// and NaN patterns), against (a) the sorted keys of a sweep of scales made as the kernel makes them, also
/// checked against formats::e2m1 of the IEEE quotient for every non-NaN value, and (b) random non-decreasing key
/// sets anywhere in the key domain [1, 0x7F80], with repeated keys and both ends.
#[test]
fn v6_bsearch_e2m1_encoder_equals_the_v4p_encoder_for_every_bf16_pair() {
    use megamoe::ops::norm_quant::reference::packed_e2m1_mirror as pm;
    let seed = fresh_seed("v6_bsearch_e2m1_encoder_equals_the_v4p_encoder_for_every_bf16_pair");
    let mut next = xorshift64(seed);
    let mut key_sets: Vec<([u32; 7], Option<f32>)> = Vec::new();
    for code in (1u8..0x7F).step_by(3) {
        for k in [-130i32, -20, 0, 100] {
            let s = e4m3::decode(code) * 2f32.powi(k);
            if s.is_finite() && s > 0.0 {
                key_sets.push((pm::thresholds_fma(s).map(pm::key_ru_x2), Some(s)));
            }
        }
    }
    let ends = [
        [1u32; 7],
        [0x7F80; 7],
        [1, 1, 1, 0x7F80, 0x7F80, 0x7F80, 0x7F80],
    ];
    for e in ends {
        key_sets.push((e.map(|k| k | (k << 16)), None));
    }
    for _ in 0..120 {
        let mut k: [u32; 7] = std::array::from_fn(|_| match next() % 8 {
            0 => 1,
            1 => 0x7F80,
            _ => (next() % 0x7F80) as u32 + 1,
        });
        if next().is_multiple_of(3) {
            k[(next() % 6) as usize + 1] = k[0]; // a repeated key
        }
        k.sort_unstable();
        key_sets.push((k.map(|v| v | (v << 16)), None));
    }
    let mut checked = 0u64;
    for (keys, scale) in &key_sets {
        // all 65536 patterns in the low halves; the high halves get a permutation of them (odd multiplier)
        for base in (0u32..0x1_0000).step_by(4) {
            let pk: [u32; 4] = std::array::from_fn(|p| {
                let lo = base + p as u32;
                let hi = (lo.wrapping_mul(40503) ^ (next() as u32 & 0x8000)) & 0xFFFF;
                lo | (hi << 16)
            });
            let want = pm::codes8(&pk, keys);
            let got = pm::codes8_bsearch(&pk, keys);
            assert_eq!(
                got,
                want,
                "v6 bsearch vs v4p codes: pairs {pk:08x?}, keys {:04x?}, scale {scale:?} (seed {seed})",
                keys.map(|k| k & 0xFFFF)
            );
            assert_eq!(
                pm::codes8_prmt(&pk, keys),
                want,
                "v4p placements disagree (seed {seed})"
            );
            if let Some(s) = scale {
                for (e, half) in (0..8).map(|e| (e, (pk[e & 3] >> (16 * (e >> 2))) & 0xFFFF)) {
                    if half & 0x7FFF > 0x7F80 {
                        continue; // NaN: no reference code
                    }
                    let y = f32::from_bits(half << 16);
                    let have = ((got >> (4 * e)) & 0xF) as u8;
                    assert_eq!(
                        have,
                        e2m1::encode_rne(y / s),
                        "v6 code of y {y:e} at scale {s:e} (seed {seed})"
                    );
                }
            }
            checked += 8;
        }
    }
    eprintln!(
        "v6 bsearch encoder: {checked} codes equal to the v4p encoder ({} key sets)",
        key_sets.len()
    );
}

/// check_v6: NVFP4 only, D a multiple of 1024 up to V6_MAX_D; clear errors otherwise.
#[test]
fn v6_launcher_rules() {
    assert_eq!(nq::V6_MAX_D, 8192);
    for d in (1024..=nq::V6_MAX_D).step_by(1024) {
        nq::check_v6(5, d, OutFormat::Nvfp4).unwrap();
    }
    let err = |rows, d, f| nq::check_v6(rows, d, f).unwrap_err().to_string();
    assert!(err(5, 4096, OutFormat::Fp8).contains("nvfp4"));
    assert!(err(5, 4096 + 128, OutFormat::Nvfp4).contains("multiple of 1024"));
    assert!(err(5, 9216, OutFormat::Nvfp4).contains("above 8192"));
    assert!(nq::check_v6(0, 4096, OutFormat::Nvfp4).is_err());
}

/// RowsPath::V6 (rmsnorm_nvfp4_bf16in_v6_w<D/1024>, the NVFP4 default from 4096 rows) bit for bit against
/// RowsPath::V4 (the v4p row loop; until session 7 the removed v5 NVFP4 kernel) and rmsnorm_quant as called,
/// every row (codes, block scales, global scales, rstd; outputs poisoned before each run), on resident_rows (random rows with all-zero, 2^40-, 2^-40- and 2^100-scaled rows and every 5th row
/// at exact e2m1 decision points), D = 4096 and 7168 (NW = 4: ss / D as a multiply; NW = 7: the division),
/// rows 4096, 4097 (one CTA gets one extra row), 8191, and 2048 at D = 1024 / 3072 / 8192 (NW = 1, 3, 8), plus
/// the CPU reference on random rows among the first 300 and the last 64.
#[test]
fn gpu_v6_nvfp4_rows_equal_v4p_bitwise() {
    let Some(gpu) = gpu_for_test("gpu_v6_nvfp4_rows_equal_v4p_bitwise") else {
        return;
    };
    let seed = fresh_seed("gpu_v6_nvfp4_rows_equal_v4p_bitwise");
    let cases: &[(usize, &[usize])] = &[
        (4096, &[4096, 4097, 8191]),
        (7168, &[4096, 4097, 8191]),
        (1024, &[2048]),
        (3072, &[2048]),
        (8192, &[2048]),
    ];
    let format = OutFormat::Nvfp4;
    for &(d, rows_list) in cases {
        let w = nq::random_weight(d, seed ^ d as u64 ^ 0x6);
        let dw = nq::upload_checked_bf16(&gpu, "w", &w).unwrap();
        for &rows in rows_list {
            let x = resident_rows(rows, d, seed ^ (rows as u64 * 977 + d as u64));
            let dx = nq::upload_checked_bf16(&gpu, "x", &x).unwrap();
            let label = format!("nvfp4 v6 {rows}x{d}, seed {seed}");
            check_resident_path(
                &gpu,
                &dx,
                &dw,
                &x,
                &w,
                format,
                rows,
                d,
                nq::RowsPath::V6,
                &label,
            );
        }
    }
}

/// The v6 encoder on the GPU (quant_nvfp4_bf16in_v6_w<D/1024>) at exact e2m1 decision points (ties included,
/// boundary_rows), bit for bit against the CPU reference and the v4p quantize-only kernel (quant_nvfp4_bf16in_v4p);
/// rows 64 and 2000 (one row per CTA, CTAs loop).
#[test]
fn gpu_v6_quant_nvfp4_matches_cpu_at_exact_boundaries() {
    let Some(gpu) = gpu_for_test("gpu_v6_quant_nvfp4_matches_cpu_at_exact_boundaries") else {
        return;
    };
    let seed = fresh_seed("gpu_v6_quant_nvfp4_matches_cpu_at_exact_boundaries");
    for d in [4096usize, 7168] {
        for rows in [64usize, 2000] {
            let y = boundary_rows(rows, d, seed ^ (d as u64 * 3 + rows as u64));
            assert!(y.iter().all(|v| v.is_finite() && bf16::round(*v) == *v));
            let dy = nq::upload_checked_bf16(&gpu, "y", &y).unwrap();
            let label = format!("v6 quant->nvfp4 boundary rows {rows}x{d}, seed {seed}");
            let want = HostQuant::encode(OutFormat::Nvfp4, &y, rows, d).unwrap();
            let got = quantized_nvfp4(&gpu, &dy, rows, d, nq::quantize_bf16_rows_v6);
            assert_same_nvfp4(&label, &got.q, &want, d);
            let v4p = quantized_nvfp4(&gpu, &dy, rows, d, nq::quantize_bf16_rows);
            assert_same_nvfp4(&format!("{label} (vs v4p)"), &got.q, &v4p.q, d);
            eprintln!("{label}: v6, v4p and the CPU reference bit-identical");
        }
        // non-finite input (the noinline per-element fallback of a non-finite block scale): v6 vs v4p only
        // (NaN codes are not defined by the reference); +-inf and NaN spliced into random rows
        let rows = 64;
        let mut y = nq::random_rows(rows, d, seed ^ 0x1f ^ d as u64);
        for (row, v) in [
            (3usize, f32::INFINITY),
            (9, f32::NEG_INFINITY),
            (17, f32::NAN),
        ] {
            y[row * d + (row * 37) % d] = v;
        }
        let dy = gpu.upload(&bf16::to_bf16_vec(&y)).unwrap(); // upload_checked_bf16 refuses non-finite values
        let label = format!("v6 quant->nvfp4 non-finite rows {rows}x{d}, seed {seed}");
        let got = quantized_nvfp4(&gpu, &dy, rows, d, nq::quantize_bf16_rows_v6);
        let v4p = quantized_nvfp4(&gpu, &dy, rows, d, nq::quantize_bf16_rows);
        assert_same_nvfp4(&label, &got.q, &v4p.q, d);
        eprintln!("{label}: v6 and v4p bit-identical");
    }
}

/// The benchmark inputs of the mHC sweeps: the requested number of rows, the first ones equal to `random_rows` of the
/// same seed, the rest repeating them in order (16384 distinct rows).
#[test]
fn timing_rows_repeat_the_drawn_rows() {
    let d = 128;
    for rows in [1usize, 7, 16384, 16385, 40000] {
        let v = nq::timing_rows(rows, d, 9);
        assert_eq!(v.len(), rows * d, "rows {rows}");
        let distinct = rows.min(16384);
        assert_eq!(
            &v[..distinct * d],
            &nq::random_rows(distinct, d, 9)[..],
            "rows {rows}"
        );
        for r in distinct..rows {
            assert_eq!(
                &v[r * d..(r + 1) * d],
                &v[(r % distinct) * d..(r % distinct + 1) * d],
                "rows {rows}, row {r}"
            );
        }
    }
}
