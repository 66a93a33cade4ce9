//! NVFP4 MoE grouped GEMM: CPU checks of the numerics the kernel relies on and of the reference, and GPU checks
//! of the kernels against the f64 reference (skipped loudly without a GPU).
//!
//! Tolerance (GPU vs f64 reference). Every product A*B is exact (NVFP4 and BF16 values are exact in BF16, their
//! product exact in fp32), so the only error of the accumulator is fp32 summation order. Per element we use the
//! order-independent bound |acc - exact| <= (K + splits + 16) * 2u * sum_k |A*B| (u = 2^-24; 2u per addition
//! covers a tensor core that truncates instead of rounding), and over the whole output
//! ||acc - exact|| / ||exact|| <= 8 sqrt(K) u + (K / 16) u (random-walk rounding plus a possible one-sided
//! truncation per 16-deep MMA step). A wrong index, a lost block scale or a wrong K permutation gives O(1)
//! relative errors, orders of magnitude above both. BF16 outputs add half a bf16 ulp (2^-9 relative).

use half::bf16;
use megamoe::formats::{e2m1, e4m3};
use megamoe::gpu::Gpu;
use megamoe::ops::moe_gemm::reference::{
    apply_global_scales, combine_l2_f64, dequant_pair_like_kernel, dequant_word_like_kernel_f16,
    grouped_gemm_acc_f64, quantize_rows_nvfp4, swiglu_l1_f64, Activations, ExpertWeights, Grouping,
    Nvfp4Rows,
};
use megamoe::ops::moe_gemm::{
    self as mg, DeviceExpertWeights, DeviceGrouping, GemmConfig, L1Output, RoutedBatch,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod common;
use common::assert_bit_identical;
use common::moe::{gathered_activations, quantized_weights, random_rows, seeded, DevA, Ws, U};

// ------------------------------------------------------------------------------------------------- CPU checks

/// The CPU model of the L2 combine's f32 order (`combine_l2_like_kernel`): valid slots in routing order, a -1 slot
/// and a padding row skipped (its NaN partials never read), splits summed, scaled by gsa * gsb, and the shared
/// addend added in f32 after the routed sum, before the one BF16 rounding: 1 + 2^-20 - 1 keeps 2^-20, where a
/// BF16 rounding of the routed sum first would leave 0.
#[test]
fn l2_combine_model_adds_the_addend_to_the_f32_routed_sum() {
    // Experts 0 and 1, capacity 2, one row each: rows 0 (e0) and 2 (e1) owned, rows 1 and 3 padding.
    let g = Grouping::Masked {
        capacity: 2,
        counts: vec![1, 1],
    };
    let (splits, n, rows) = (2usize, 1usize, 4usize);
    let mut partial = vec![f32::NAN; splits * rows * n];
    // Row 2: 0.75 + 0.25 = 1.0; row 0: 2^-21 + 2^-21 = 2^-20.
    partial[2] = 0.75;
    partial[rows + 2] = 0.25;
    partial[0] = 2f32.powi(-21);
    partial[rows] = 2f32.powi(-21);
    let gsa = [0.5f32, 1.0, 2.0, 1.0];
    let gsb = [2.0f32, 0.5];
    let token_rows = [2, 1, -1, 0];
    let y = |add: Option<&[bf16]>| {
        mg::reference::combine_l2_like_kernel(
            &partial,
            splits,
            n,
            Some(&gsa),
            &gsb,
            &token_rows,
            4,
            &g,
            add,
        )
    };
    assert_eq!(y(None), vec![bf16::from_f32(1.0 + 2f32.powi(-20))]);
    assert_eq!(
        y(Some(&[bf16::from_f32(-1.0)])),
        vec![bf16::from_f32(2f32.powi(-20))]
    );
    assert_ne!(
        bf16::from_f32(1.0 + 2f32.powi(-20)).to_f32() - 1.0,
        2f32.powi(-20)
    );
}

#[test]
fn nvfp4_element_times_block_scale_is_exact_in_bf16() {
    // DESIGN §3: e2m1 * e4m3 has <= 5 significant bits and lies in [2^-10, 2688]: exact in BF16.
    for c in 0u8..16 {
        for s in (0u8..=255).filter(|s| s & 0x7F != 0x7F) {
            let v = e2m1::decode(c) * e4m3::decode(s);
            assert_eq!(
                bf16::from_f32(v).to_f32(),
                v,
                "e2m1 code {c} x e4m3 code {s:#x}"
            );
        }
    }
}

#[test]
fn kernel_register_dequant_is_exact_for_every_code_and_scale() {
    // The shift/mask + one bf16 multiply of kernels/moe_gemm.cu, on every nibble pair, position and scale.
    for lo in 0u32..16 {
        for hi in 0u32..16 {
            for i in 0..4u32 {
                // Put lo at nibble i and hi at nibble i + 4; fill the other nibbles with a different pattern.
                let mut word = 0x9E3A_7B51u32;
                word &= !(0xF << (4 * i)) & !(0xF << (4 * (i + 4)));
                word |= (lo << (4 * i)) | (hi << (4 * (i + 4)));
                for s in (0u8..=255).filter(|s| s & 0x7F != 0x7F && s & 0x80 == 0) {
                    let (a, b) = dequant_pair_like_kernel(word, i, s);
                    let sv = e4m3::decode(s);
                    assert_eq!(
                        a,
                        e2m1::decode(lo as u8) * sv,
                        "lo code {lo} nibble {i} scale {s:#x}"
                    );
                    assert_eq!(
                        b,
                        e2m1::decode(hi as u8) * sv,
                        "hi code {hi} nibble {} scale {s:#x}",
                        i + 4
                    );
                }
            }
        }
    }
}

#[test]
fn kernel_register_dequant_f16_is_exact_for_every_code_and_scale() {
    // The f16 form of the F16-operand decode mainloop (e2m1_word_to_f16x2_tiny + scale_f16x2), on every code at every
    // nibble position (the other nibbles a fixed pattern, so a mask that lets a neighbour leak in shows) and every
    // finite positive scale.
    for c in 0u32..16 {
        for pos in 0..8u32 {
            let word = (0x9E3A_7B51u32 & !(0xF << (4 * pos))) | (c << (4 * pos));
            for s in (0u8..=255).filter(|s| s & 0x7F != 0x7F && s & 0x80 == 0) {
                let got = dequant_word_like_kernel_f16(word, s);
                let sv = e4m3::decode(s);
                for (q, &g) in got.iter().enumerate() {
                    let code = (word >> (4 * q)) & 0xF;
                    assert_eq!(
                        g,
                        e2m1::decode(code as u8) * sv,
                        "code {code} at nibble {q} (word {word:#010x}) scale {s:#x}"
                    );
                }
            }
        }
    }
}

#[test]
fn quantizer_follows_the_nvfp4_rule_and_bounds_the_error() {
    let mut rng = seeded("quantizer_follows_the_nvfp4_rule_and_bounds_the_error");
    let (rows, cols) = (37, 256);
    let mut x = random_rows(&mut rng, rows, cols, 1.0);
    x[5 * cols..6 * cols].fill(0.0); // an all-zero row: gs = 1, codes 0
    let q = quantize_rows_nvfp4(&x, rows, cols).unwrap();
    assert_eq!(q.global[5], 1.0);
    let deq = q.dequantize();
    for r in 0..rows {
        let amax = x[r * cols..(r + 1) * cols]
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        if amax > 0.0 {
            assert_eq!(q.global[r], amax / 2688.0, "row {r}");
        }
        for b in 0..cols / 16 {
            let scale = e4m3::decode(q.scales[r * cols / 16 + b]) as f64 * q.global[r] as f64;
            for i in 0..16 {
                let idx = r * cols + b * 16 + i;
                // Half the largest e2m1 gap (2, between 4 and 6) times the scale, plus the e4m3 rounding of the
                // block scale that can push the block max past 6 * scale (saturation): <= 1.07 * scale.
                let err = (x[idx] as f64 - deq[idx] as f64).abs();
                assert!(
                    err <= 1.07 * scale + 1e-30,
                    "row {r} block {b} elem {i}: x {} deq {} scale {scale}",
                    x[idx],
                    deq[idx]
                );
            }
        }
    }
    assert!(quantize_rows_nvfp4(&[f32::NAN; 16], 1, 16).is_err());
    assert!(quantize_rows_nvfp4(&[1.0; 8], 1, 8).is_err());
}

#[test]
fn reference_gemm_matches_a_dense_f64_product_of_dequantized_operands() {
    // The grouped reference against an independent formulation: dequantize everything to f64 and multiply
    // row by row through the token -> expert map, for both layouts, with empty experts and per-expert scales.
    let mut rng = seeded("reference_gemm_matches_a_dense_f64_product_of_dequantized_operands");
    let (e, n, k, tokens, topk) = (9, 32, 64, 13, 3);
    let wf = random_rows(&mut rng, e * n, k, 0.05);
    for per_expert in [false, true] {
        let w = if per_expert {
            ExpertWeights::quantize_per_expert(&wf, e, n, k).unwrap()
        } else {
            ExpertWeights::quantize_per_row(&wf, e, n, k).unwrap()
        };
        w.validate().unwrap();
        if per_expert {
            assert!((0..e).all(|x| (0..n).all(|r| w.global(x, r) == w.global(x, 0))));
        }
        let wdeq = w.rows.dequantize();
        for cap in [Some(16), None] {
            // Experts 0 and 4 never chosen: empty groups.
            let choices: Vec<usize> = (0..tokens * topk)
                .map(|i| [1, 2, 3, 5, 6, 7, 8][(i * 5 + i / 3) % 7])
                .collect();
            let choices = fix_distinct(choices, tokens, topk, &[1, 2, 3, 5, 6, 7, 8]);
            let rb = RoutedBatch::from_choices(tokens, e, topk, choices, cap).unwrap();
            let xf = random_rows(&mut rng, tokens, k, 1.0);
            let rows = rb.grouping.rows_total();
            let gathered: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let t = rb.row_token[r];
                    (0..k).map(move |kk| (t, kk))
                })
                .map(|(t, kk)| if t >= 0 { xf[t as usize * k + kk] } else { 0.5 })
                .collect();
            let a = Activations::Nvfp4(quantize_rows_nvfp4(&gathered, rows, k).unwrap());
            let adeq = match &a {
                Activations::Nvfp4(q) => q.dequantize(),
                _ => unreachable!(),
            };
            let (acc, _) = grouped_gemm_acc_f64(&w, &a, &rb.grouping).unwrap();
            let d = apply_global_scales(&acc, &w, &a, &rb.grouping);
            for t in 0..tokens {
                for j in 0..topk {
                    let (row, ex) = (rb.token_rows[t * topk + j] as usize, rb.expert(t, j));
                    for nn in 0..n {
                        let terms = (0..k).map(|kk| {
                            adeq[row * k + kk] as f64 * wdeq[(ex * n + nn) * k + kk] as f64
                        });
                        let (dense, dense_abs) =
                            terms.fold((0.0, 0.0), |(s, a), p| (s + p, a + p.abs()));
                        let got = d[row * n + nn];
                        // dequantize() rounds each (e2m1 * s) * gs to f32 (2^-24 relative) on both operands.
                        let tol = 3.0 * U * dense_abs + 1e-30;
                        assert!(
                            (got - dense).abs() <= tol,
                            "token {t} j {j} n {nn}: {got} vs {dense} (tol {tol:e})"
                        );
                    }
                }
            }
            if let Grouping::Masked { capacity, counts } = &rb.grouping {
                for (ex, &c) in counts.iter().enumerate() {
                    for slot in c as usize..*capacity {
                        assert!(
                            d[(ex * capacity + slot) * n..(ex * capacity + slot + 1) * n]
                                .iter()
                                .all(|v| *v == 0.0)
                        );
                    }
                }
            }
        }
    }
}

/// Make every token's choices distinct by walking a fixed pool (deterministic, keeps empty experts empty).
fn fix_distinct(mut c: Vec<usize>, tokens: usize, topk: usize, pool: &[usize]) -> Vec<usize> {
    for t in 0..tokens {
        for j in 0..topk {
            let mut p = pool.iter().position(|&x| x == c[t * topk + j]).unwrap();
            while c[t * topk..t * topk + j].contains(&c[t * topk + j]) {
                p = (p + 1) % pool.len();
                c[t * topk + j] = pool[p];
            }
        }
    }
    c
}

#[test]
fn swiglu_reference_applies_the_dsv4_clamp() {
    let g = Grouping::Contiguous {
        offsets: vec![0, 1],
    };
    // gate 20 -> 10 (clamped above), up 20 -> 10; gate -20 stays (no clamp below), up -20 -> -10.
    let d = vec![20.0, -20.0, 0.5, 20.0, -20.0, 3.0];
    let h = swiglu_l1_f64(&d, 3, &[2.0], &g);
    let silu = |x: f64| x / (1.0 + (-x).exp());
    assert!((h[0] - silu(10.0) * 10.0 * 2.0).abs() < 1e-12);
    assert!((h[1] - silu(-20.0) * -10.0 * 2.0).abs() < 1e-12);
    assert!((h[2] - silu(0.5) * 3.0 * 2.0).abs() < 1e-12);
}

#[test]
fn bad_groupings_and_shapes_are_errors() {
    assert!(Grouping::Masked {
        capacity: 4,
        counts: vec![1, 5]
    }
    .validate()
    .is_err());
    assert!(Grouping::Masked {
        capacity: 4,
        counts: vec![-1]
    }
    .validate()
    .is_err());
    assert!(Grouping::Contiguous {
        offsets: vec![0, 5, 3]
    }
    .validate()
    .is_err());
    assert!(Grouping::Contiguous {
        offsets: vec![1, 5]
    }
    .validate()
    .is_err());
    assert!(Grouping::Contiguous {
        offsets: vec![0, 0, 7]
    }
    .validate()
    .is_ok());
    assert!(mg::check_gemm_shape(100, 512).is_err());
    assert!(mg::check_gemm_shape(128, 100).is_err());
    assert!(mg::check_gemm_shape(4096, 7168).is_ok());
    // N % 256 == 0 (the weights' 256-row tiling): N = 128 or 384 is refused with a message that says why.
    for n in [128, 384] {
        let err = mg::check_gemm_shape(n, 512).unwrap_err();
        assert!(format!("{err:#}").contains("256"), "{err:#}");
    }
    assert!(mg::check_gemm_shape(256, 512).is_ok());
    // Every DSV4 expert shape qualifies: W13 (N = 2 x moe_inter_dim, K = dim) and W2 (N = dim, K = moe_inter_dim).
    for cfg in [
        megamoe::model::config::ModelConfig::flash(),
        megamoe::model::config::ModelConfig::pro(),
    ] {
        mg::check_gemm_shape(2 * cfg.moe_inter_dim, cfg.dim).unwrap();
        mg::check_gemm_shape(cfg.dim, cfg.moe_inter_dim).unwrap();
    }
    let mut w = ExpertWeights::quantize_per_row(&[0.25f32; 2 * 16], 1, 2, 16).unwrap();
    w.rows.scales[1] = 0x7F;
    assert!(w.validate().is_err());
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    assert!(RoutedBatch::random(&mut rng, 10, 4, 5, None).is_err());
    assert!(RoutedBatch::random(&mut rng, 10, 4, 4, Some(3)).is_err());
}

#[test]
fn config_heuristic_splits_k_only_when_the_grid_would_be_underfilled() {
    let c = GemmConfig::choose(132, 1.0, 6, 4096, 4096);
    assert_eq!(c.token_tile, 8);
    assert!(
        c.splits >= 2 && 4096 % (c.splits * mg::STAGE_K) == 0,
        "{c:?}"
    );
    let c = GemmConfig::choose(132, 384.0, 256, 4096, 4096);
    assert_eq!((c.token_tile, c.splits), (64, 1));
}

// ------------------------------------------------------------------------------------------------- GPU checks

/// Sum the workspace splits in the finish kernels' order (fixed, fp32).
fn gpu_accumulator(gpu: &Gpu, ws: &Ws) -> Vec<f64> {
    let p = ws.partial_host(gpu);
    let len = ws.rows_total * ws.n;
    (0..len)
        .map(|i| (0..ws.splits).fold(0f32, |a, s| a + p[s * len + i]) as f64)
        .collect()
}

/// Check the fp32 accumulator against the f64 reference (bounds in the file header). Returns max abs error.
#[allow(clippy::too_many_arguments)]
fn check_accumulator(
    label: &str,
    got: &[f64],
    exact: &[f64],
    abs: &[f64],
    k: usize,
    splits: usize,
    owned: &dyn Fn(usize) -> bool,
    n: usize,
) -> f64 {
    let per_elem = (k + splits + 16) as f64 * 2.0 * U;
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    for i in 0..exact.len() {
        if !owned(i / n) {
            continue;
        }
        let err = (got[i] - exact[i]).abs();
        assert!(
            err <= per_elem * abs[i] + 1e-30,
            "{label}: accumulator row {} col {}: gpu {} exact {} |err| {err:e} > bound {:e}",
            i / n,
            i % n,
            got[i],
            exact[i],
            per_elem * abs[i]
        );
        num += err * err;
        den += exact[i] * exact[i];
        max_abs = max_abs.max(err);
    }
    let rel = if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    let bound = 8.0 * (k as f64).sqrt() * U + (k as f64 / 16.0) * U;
    eprintln!("{label}: accumulator max |err| {max_abs:e}, rel L2 {rel:e} (bound {bound:e})");
    assert!(
        rel <= bound,
        "{label}: relative L2 error {rel:e} > {bound:e}"
    );
    max_abs
}

#[allow(clippy::too_many_arguments)]
fn check_plain(
    gpu: &Gpu,
    label: &str,
    w: &ExpertWeights,
    dw: &DeviceExpertWeights,
    rb: &RoutedBatch,
    nvfp4: bool,
    cfgs: &[GemmConfig],
    rng: &mut impl Rng,
) {
    let a = gathered_activations(rng, rb, w.k, nvfp4);
    let da = DevA::upload(gpu, &a);
    let dg = DeviceGrouping::upload(gpu, &rb.grouping).unwrap();
    let rows = rb.grouping.rows_total();
    let (exact, abs) = grouped_gemm_acc_f64(w, &a, &rb.grouping).unwrap();
    let d = apply_global_scales(&exact, w, &a, &rb.grouping);
    for &cfg in cfgs {
        let ws = Ws::for_launch(gpu, dw, &dg, &cfg);
        let mut out = gpu.poisoned::<bf16>((rows * w.n).max(1), 0xFF).unwrap();
        mg::grouped_gemm_bf16(gpu, &gpu.stream, dw, &da.view(), &dg, &cfg, &ws, &mut out).unwrap();
        gpu.synchronize().unwrap();
        let label = format!(
            "{label} [{} A, {cfg:?}, rows {rows}]",
            if nvfp4 { "NVFP4" } else { "BF16" }
        );
        // The mma.sync mainloop forced on the same inputs: `grouped_gemm_bf16` above routes large contiguous
        // groupings to the wgmma prefill kernel (checked against the reference below and in moe_gemm_prefill.rs),
        // so this keeps the mma.sync kernel checked at every grouping and config, including the few-CTA grids
        // where each persistent CTA walks many items (prefetch across items).
        let ws_mma = Ws::new(gpu, cfg.splits, rows, w.n);
        ws_mma.poison(gpu);
        mg::launch_partial_mma(gpu, &gpu.stream, dw, &da.view(), &dg, &cfg, &ws_mma).unwrap();
        gpu.synchronize().unwrap();
        let owned = |r: usize| rb.grouping.expert_of_row(r).is_some();
        check_accumulator(
            &format!("{label} mma.sync mainloop"),
            &gpu_accumulator(gpu, &ws_mma),
            &exact,
            &abs,
            w.k,
            cfg.splits,
            &owned,
            w.n,
        );
        // Rows owned by no expert are never written by the mainloop (stores are guarded by the tile's token
        // count), so they keep the 0xFF fill in every split.
        let partial_mma = ws_mma.partial_host(gpu);
        if let Some(i) = (0..partial_mma.len())
            .find(|&i| !owned((i / w.n) % rows) && partial_mma[i].to_bits() != u32::MAX)
        {
            panic!(
                "{label}: mma.sync mainloop wrote unowned row {} (split {}, col {}): {}",
                (i / w.n) % rows,
                i / (rows * w.n),
                i % w.n,
                partial_mma[i]
            );
        }
        let got = gpu_accumulator(gpu, &ws);
        check_accumulator(&label, &got, &exact, &abs, w.k, cfg.splits, &owned, w.n);
        let out = gpu.download(&out).unwrap();
        let per_elem = (w.k + cfg.splits + 16) as f64 * 2.0 * U;
        for r in 0..rows {
            let e = rb.grouping.expert_of_row(r);
            for nn in 0..w.n {
                let i = r * w.n + nn;
                let o = out[i].to_f32() as f64;
                match e {
                    None => assert!(
                        out[i].to_bits() == 0,
                        "{label}: unowned row {r} col {nn} = {o} (must be written as 0)"
                    ),
                    Some(e) => {
                        let scale = a.global(r) as f64 * w.global(e, nn) as f64;
                        let tol =
                            d[i].abs() * (1.0 / 256.0) + 2.0 * scale * per_elem * abs[i] + 1e-30;
                        assert!((o - d[i]).abs() <= tol, "{label}: out row {r} (expert {e}) col {nn}: gpu {o} ref {} tol {tol:e}", d[i]);
                    }
                }
            }
        }
    }
}

/// The decode-mainloop comparisons' inputs: experts of 0..65 rows (two empty), N = 512 (two 256-row tiles, so a
/// CTA's 128 rows sit in either half of a tile block), K = 2048; the weights uploaded (tiled at upload) and a set
/// whose tiling buffer is too short (the decode mainloop must refuse it); the routing as a masked (capacity 65) and
/// as a contiguous grouping.
struct DecodeFixture {
    w: ExpertWeights,
    short_tiling: DeviceExpertWeights,
    tiled: DeviceExpertWeights,
    batches: Vec<(Option<usize>, RoutedBatch)>,
}

impl DecodeFixture {
    fn new(gpu: &Gpu, rng: &mut impl Rng) -> DecodeFixture {
        let counts = [0usize, 1, 2, 3, 7, 8, 16, 33, 64, 65, 0];
        let e = counts.len();
        let w = quantized_weights(rng, e, 512, 2048);
        let tiled = DeviceExpertWeights::upload(gpu, &w).unwrap();
        let short_tiling = DeviceExpertWeights {
            experts: w.experts,
            n: w.n,
            k: w.k,
            tiled: gpu.zeros::<u8>(16).unwrap(),
            global: gpu.upload(&w.rows.global).unwrap(),
        };
        let tokens: usize = counts.iter().sum();
        let choices: Vec<usize> = counts
            .iter()
            .enumerate()
            .flat_map(|(ex, &c)| std::iter::repeat_n(ex, c))
            .collect();
        let batches = [Some(65), None]
            .into_iter()
            .map(|cap| {
                let rb = RoutedBatch::from_choices(tokens, e, 1, choices.clone(), cap).unwrap();
                (cap, rb)
            })
            .collect();
        DecodeFixture {
            w,
            short_tiling,
            tiled,
            batches,
        }
    }

    /// Every token tile (1, 2, 4, 8 mma columns), K splits 1 / 2 / 4, the persistent grid of the launcher and
    /// few CTAs walking many items.
    fn configs(gpu: &Gpu) -> Vec<GemmConfig> {
        let sms = gpu.info.sm_count as u32;
        [
            (8, 1, 3 * sms),
            (8, 4, 3 * sms),
            (16, 2, 3 * sms),
            (32, 4, 2 * sms),
            (64, 1, 5),
        ]
        .into_iter()
        .map(|(token_tile, splits, ctas)| GemmConfig {
            token_tile,
            splits,
            ctas,
        })
        .collect()
    }
}

/// The F16-operand decode mainloop (`DecodeOperands::F16`) on NVFP4 activations: checked against the f64
/// reference under the accumulator bounds (its products are the same exact values, scaled by 2^-14 instead of 2^-9),
/// and compared bit for bit with the BF16-operand mainloop on the same tiled weights: the order of the MMAs is the same,
/// so the partials are expected to be identical; the test asserts that. Masked and contiguous groupings
/// ([`DecodeFixture`]), every token tile, split counts 1 / 2 / 4, empty experts, experts of 1..65 rows; the partials
/// NaN-poisoned before each launch. Also: BF16 activations and weights with a too short tiling are refused before
/// any launch.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_f16_operands_match_the_reference_and_bf16_operands() {
    let name = "gpu_decode_f16_operands_match_the_reference_and_bf16_operands";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    let fx = DecodeFixture::new(&gpu, &mut rng);
    let (w, dw, dw_short) = (&fx.w, &fx.tiled, &fx.short_tiling);
    let (n, k) = (w.n, w.k);
    let sms = gpu.info.sm_count as u32;
    for (cap, rb) in &fx.batches {
        let dg = DeviceGrouping::upload(&gpu, &rb.grouping).unwrap();
        let rows = rb.grouping.rows_total();
        let a = gathered_activations(&mut rng, rb, k, true);
        let da = DevA::upload(&gpu, &a);
        let (exact, abs) = grouped_gemm_acc_f64(w, &a, &rb.grouping).unwrap();
        let owned = |r: usize| rb.grouping.expert_of_row(r).is_some();
        for cfg in DecodeFixture::configs(&gpu) {
            let splits = cfg.splits;
            let label = format!("cap {cap:?}, NVFP4 A, {cfg:?}");
            let mut got = Vec::new();
            let mut acc = Vec::new();
            for operands in [mg::DecodeOperands::Bf16, mg::DecodeOperands::F16] {
                let ws = Ws::new(&gpu, splits, rows, n);
                ws.poison(&gpu);
                mg::launch_partial_mma_with(
                    &gpu,
                    &gpu.stream,
                    dw,
                    &da.view(),
                    &dg,
                    &cfg,
                    &ws,
                    operands,
                )
                .unwrap();
                gpu.synchronize().unwrap();
                got.push(ws.partial_host(&gpu));
                acc.push(gpu_accumulator(&gpu, &ws));
            }
            check_accumulator(
                &format!("{label} F16 operands"),
                &acc[1],
                &exact,
                &abs,
                k,
                splits,
                &owned,
                n,
            );
            assert_bit_identical(
                &label,
                "F16 operands differ from BF16 operands",
                &got[0],
                &got[1],
            );
        }
        // Refused before any launch: BF16 activations, and weights with a too short tiling.
        let cfg = GemmConfig {
            token_tile: 8,
            splits: 1,
            ctas: sms,
        };
        let ws = Ws::new(&gpu, 1, rows, n);
        let a16 = gathered_activations(&mut rng, rb, k, false);
        let da16 = DevA::upload(&gpu, &a16);
        let err = mg::launch_partial_mma_with(
            &gpu,
            &gpu.stream,
            dw,
            &da16.view(),
            &dg,
            &cfg,
            &ws,
            mg::DecodeOperands::F16,
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("NVFP4"), "{err:#}");
        let err = mg::launch_partial_mma_with(
            &gpu,
            &gpu.stream,
            dw_short,
            &da.view(),
            &dg,
            &cfg,
            &ws,
            mg::DecodeOperands::F16,
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("tiled"), "{err:#}");
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_masked_and_contiguous_token_counts_both_a_formats() {
    let gpu = common::gpu("gpu_masked_and_contiguous_token_counts_both_a_formats");
    let mut rng = seeded("gpu_masked_and_contiguous_token_counts_both_a_formats");
    // One expert per count in the issue's list (4096 gets its own smaller-K check below); two empty experts.
    let counts = [0usize, 1, 2, 3, 7, 8, 16, 63, 64, 65, 127, 256, 0];
    let (e, n, k) = (counts.len(), 256, 1024);
    let w = quantized_weights(&mut rng, e, n, k);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let choices_for = |counts: &[usize]| -> (usize, Vec<usize>) {
        // top-1 routing so each expert gets exactly its count.
        let tokens: usize = counts.iter().sum();
        (
            tokens,
            counts
                .iter()
                .enumerate()
                .flat_map(|(ex, &c)| std::iter::repeat_n(ex, c))
                .collect(),
        )
    };
    let (tokens, choices) = choices_for(&counts);
    for cap in [Some(256), None] {
        let rb = RoutedBatch::from_choices(tokens, e, 1, choices.clone(), cap).unwrap();
        let sms = gpu.info.sm_count as u32;
        let small_tile_grid = sms * mg::MAINLOOP_CTAS_PER_SM_SMALL_TILE as u32;
        // Tiles <= 16 on the default 3-CTAs-per-SM grid, larger tiles on 2 x SMs (more CTAs than fit: they run
        // in waves). The last three: a few persistent CTAs walk many work items each, so the prefetch of the next
        // item's weights and activation tile (cp.async across items) is exercised.
        let cfgs: Vec<GemmConfig> = [
            (8, 1, small_tile_grid),
            (16, 2, small_tile_grid),
            (32, 1, 2 * sms),
            (64, 2, 2 * sms),
            (8, 2, 7),
            (8, 2, 9),
            (32, 1, 3),
        ]
        .iter()
        .map(|&(token_tile, splits, ctas)| GemmConfig {
            token_tile,
            splits,
            ctas,
        })
        .collect();
        for nvfp4 in [false, true] {
            check_plain(
                &gpu,
                &format!("counts {counts:?} cap {cap:?}"),
                &w,
                &dw,
                &rb,
                nvfp4,
                &cfgs,
                &mut rng,
            );
        }
    }
    // 4096 rows for one expert (contiguous, prefill tile), small N and K to keep the CPU reference fast.
    let (e, n, k) = (3, 256, 512);
    let w = quantized_weights(&mut rng, e, n, k);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let (tokens, choices) = choices_for(&[4096, 0, 5]);
    let rb = RoutedBatch::from_choices(tokens, e, 1, choices, None).unwrap();
    let cfg = GemmConfig::choose(gpu.info.sm_count as usize, 2050.0, 2, n, k);
    check_plain(&gpu, "4096 rows", &w, &dw, &rb, true, &[cfg], &mut rng);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routings_6_of_256_and_6_of_384_with_the_default_config() {
    let gpu = common::gpu("gpu_routings_6_of_256_and_6_of_384_with_the_default_config");
    let mut rng = seeded("gpu_routings_6_of_256_and_6_of_384_with_the_default_config");
    for (experts, tokens) in [(256usize, 1usize), (256, 37), (384, 64)] {
        let (n, k) = (256, 512);
        let w = quantized_weights(&mut rng, experts, n, k);
        let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
        for cap in [Some(tokens), None] {
            let rb = RoutedBatch::random(&mut rng, tokens, experts, 6, cap).unwrap();
            let active = (0..experts)
                .filter(|&x| !rb.grouping.expert_rows(x).is_empty())
                .count();
            let cfg = GemmConfig::choose(
                gpu.info.sm_count as usize,
                (tokens * 6) as f64 / active as f64,
                active,
                n,
                k,
            );
            for nvfp4 in [false, true] {
                check_plain(
                    &gpu,
                    &format!("6 of {experts}, {tokens} tokens"),
                    &w,
                    &dw,
                    &rb,
                    nvfp4,
                    &[cfg],
                    &mut rng,
                );
            }
        }
    }
}

/// The L1 results of one call against the f64 reference: the accumulator in `ws1`, h (fp32, `l1.h_f32`) under the
/// bound of the SwiGLU of the bounded accumulator, and the NVFP4 quantization of h bit for bit against the CPU
/// quantizer applied to the GPU's own h. Returns the GPU's quantized h (the L2 input).
#[allow(clippy::too_many_arguments)]
fn check_l1_against_reference(
    gpu: &Gpu,
    label: &str,
    w13: &ExpertWeights,
    a: &Activations,
    g: &Grouping,
    routing: &[f32],
    ws1: &Ws,
    l1: &L1Output,
) -> Nvfp4Rows {
    let (hidden, inter, splits) = (w13.k, w13.n / 2, ws1.splits);
    let rows = g.rows_total();
    let (exact, abs) = grouped_gemm_acc_f64(w13, a, g).unwrap();
    let owned = |r: usize| g.expert_of_row(r).is_some();
    let got = gpu_accumulator(gpu, ws1);
    check_accumulator(
        &format!("{label} L1 (splits {splits})"),
        &got,
        &exact,
        &abs,
        hidden,
        splits,
        &owned,
        2 * inter,
    );
    let d = apply_global_scales(&exact, w13, a, g);
    let h_ref = swiglu_l1_f64(&d, inter, routing, g);
    let h_gpu = gpu.download(l1.h_f32.as_ref().unwrap()).unwrap();
    let per_elem = (hidden + splits + 16) as f64 * 2.0 * U;
    for r in 0..rows {
        let Some(e) = g.expert_of_row(r) else {
            assert!(
                h_gpu[r * inter..(r + 1) * inter].iter().all(|v| *v == 0.0),
                "{label}: padding row {r} h not 0"
            );
            continue;
        };
        for j in 0..inter {
            let (gi, ui) = (r * 2 * inter + j, r * 2 * inter + inter + j);
            let sc = |c: usize| a.global(r) as f64 * w13.global(e, c) as f64;
            // |dh| <= rw * (1.1 |u| |dg| + |silu(g)| |du|) + fp32 rounding of the epilogue (~8 ulp incl. expf).
            let dg_ = 1.5 * sc(j) * per_elem * abs[gi];
            let du = 1.5 * sc(inter + j) * per_elem * abs[ui];
            let g = d[gi].min(10.0);
            let u = d[ui].clamp(-10.0, 10.0);
            let silu = g / (1.0 + (-g).exp());
            let tol = routing[r] as f64 * (1.1 * u.abs() * dg_ + silu.abs() * du)
                + 8.0 * U * 2.0 * h_ref[r * inter + j].abs()
                + 1e-30;
            let (hg, hr) = (h_gpu[r * inter + j] as f64, h_ref[r * inter + j]);
            assert!(
                (hg - hr).abs() <= tol,
                "{label}: h row {r} (expert {e}) col {j}: gpu {hg} ref {hr} tol {tol:e}"
            );
        }
    }
    // NVFP4 quantization of h: bit-exact against the CPU quantizer applied to the GPU's own fp32 h.
    let q_cpu = quantize_rows_nvfp4(&h_gpu, rows, inter).unwrap();
    let q_gpu = Nvfp4Rows {
        rows,
        cols: inter,
        codes: gpu.download(&l1.codes).unwrap(),
        scales: gpu.download(&l1.scales).unwrap(),
        global: gpu.download(&l1.global).unwrap(),
    };
    for r in 0..rows {
        assert_eq!(
            q_gpu.global[r].to_bits(),
            q_cpu.global[r].to_bits(),
            "{label}: h global scale row {r}"
        );
    }
    if let Some(i) = (0..q_cpu.scales.len()).find(|&i| q_cpu.scales[i] != q_gpu.scales[i]) {
        panic!(
            "{label}: h block scale {i} (row {}): gpu {:#x} cpu {:#x}",
            i / (inter / 16),
            q_gpu.scales[i],
            q_cpu.scales[i]
        );
    }
    if let Some(i) = (0..q_cpu.codes.len()).find(|&i| q_cpu.codes[i] != q_gpu.codes[i]) {
        panic!(
            "{label}: h code byte {i} (row {}): gpu {:#x} cpu {:#x}",
            i / (inter / 2),
            q_gpu.codes[i],
            q_cpu.codes[i]
        );
    }
    q_gpu
}

/// The L2 results of one call against the f64 reference on the GPU's own L1 output `a2` (so L1 rounding does not
/// enter): the accumulator in `ws2`, then the combined BF16 output `y` `[tokens, N]` (one bf16 rounding plus the
/// scaled accumulator bound of every routed row; -1 entries of `token_rows` add nothing).
#[allow(clippy::too_many_arguments)]
fn check_l2_against_reference(
    gpu: &Gpu,
    label: &str,
    w2: &ExpertWeights,
    a2: &Activations,
    g: &Grouping,
    ws2: &Ws,
    token_rows: &[i32],
    topk: usize,
    y: &cudarc::driver::CudaSlice<bf16>,
) {
    let (hidden, inter, splits) = (w2.n, w2.k, ws2.splits);
    let tokens = token_rows.len() / topk;
    let (exact2, abs2) = grouped_gemm_acc_f64(w2, a2, g).unwrap();
    let owned = |r: usize| g.expert_of_row(r).is_some();
    let got2 = gpu_accumulator(gpu, ws2);
    check_accumulator(
        &format!("{label} L2 (splits {splits})"),
        &got2,
        &exact2,
        &abs2,
        inter,
        splits,
        &owned,
        hidden,
    );
    let d2v = apply_global_scales(&exact2, w2, a2, g);
    let y_ref = combine_l2_f64(&d2v, hidden, token_rows, topk, g);
    let y = gpu.download(y).unwrap();
    let per2 = (inter + splits + 16) as f64 * 2.0 * U;
    for t in 0..tokens {
        for nn in 0..hidden {
            let mut tol = 1e-30;
            for j in 0..topk {
                let Ok(r) = usize::try_from(token_rows[t * topk + j]) else {
                    continue;
                };
                let e = g
                    .expert_of_row(r)
                    .expect("a routed row belongs to an expert");
                tol += 2.0
                    * a2.global(r) as f64
                    * w2.global(e, nn) as f64
                    * per2
                    * abs2[r * hidden + nn]
                    + 8.0 * U * d2v[r * hidden + nn].abs();
            }
            let (o, rf) = (y[t * hidden + nn].to_f32() as f64, y_ref[t * hidden + nn]);
            tol += rf.abs() / 256.0;
            assert!(
                (o - rf).abs() <= tol,
                "{label}: L2 out token {t} col {nn}: gpu {o} ref {rf} tol {tol:e}"
            );
        }
    }
}

/// L1 (W13, SwiGLU + NVFP4) then L2 (W2, combine) on DSV4 shapes with a few physical experts, masked layout, the
/// routed path on the tiled weights; every L1 finish and L2 combine kernel on the same partials bit for bit
/// against the routed one.
fn check_l1_l2(
    gpu: &Gpu,
    label: &str,
    hidden: usize,
    inter: usize,
    experts: usize,
    tokens: usize,
    rng: &mut impl Rng,
) {
    let topk = 6.min(experts);
    let w13 = quantized_weights(rng, experts, 2 * inter, hidden);
    let w2 = quantized_weights(rng, experts, hidden, inter);
    let d13 = DeviceExpertWeights::upload(gpu, &w13).unwrap();
    let d2 = DeviceExpertWeights::upload(gpu, &w2).unwrap();
    let rb = RoutedBatch::random(rng, tokens, experts, topk, Some(tokens)).unwrap();
    let rows = rb.grouping.rows_total();
    let active = (0..experts)
        .filter(|&x| !rb.grouping.expert_rows(x).is_empty())
        .count();
    let rpe = (tokens * topk) as f64 / active as f64;
    let routing: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05f32..1.5)).collect();
    let dg = DeviceGrouping::upload(gpu, &rb.grouping).unwrap();
    let droute = gpu.upload(&routing).unwrap();

    // L1
    let a = gathered_activations(rng, &rb, hidden, true);
    let da = DevA::upload(gpu, &a);
    let cfg1 = GemmConfig::choose(gpu.info.sm_count as usize, rpe, active, 2 * inter, hidden);
    let ws1 = Ws::for_launch(gpu, &d13, &dg, &cfg1);
    let mut l1 = L1Output::new(gpu, rows, inter, true).unwrap();
    mg::launch_partial(gpu, &gpu.stream, &d13, &da.view(), &dg, &cfg1, &ws1).unwrap();
    mg::launch_finish_l1(
        gpu,
        &gpu.stream,
        &ws1,
        &dg,
        &d13,
        &da.view(),
        &droute,
        &mut l1,
    )
    .unwrap();
    // Every other L1 finish kernel on the same partials: bit-identical outputs to the routed one (the CPU checks
    // below then cover all of them).
    let routed = mg::FinishL1Kernel::for_grouping(&dg, inter);
    for &kernel in mg::FinishL1Kernel::ALL.iter().filter(|&&k| k != routed) {
        let mut l1_k = L1Output::new(gpu, rows, inter, true).unwrap();
        mg::launch_finish_l1_with(
            gpu,
            &gpu.stream,
            &ws1,
            &dg,
            &d13,
            &da.view(),
            &droute,
            &mut l1_k,
            kernel,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        assert_l1_outputs_bit_equal(gpu, &format!("{label} L1 finish {kernel:?}"), &l1_k, &l1);
    }
    let q_gpu = check_l1_against_reference(gpu, label, &w13, &a, &rb.grouping, &routing, &ws1, &l1);

    // L2 on the GPU's NVFP4 h.
    let a2 = Activations::Nvfp4(q_gpu);
    let cfg2 = GemmConfig::choose(gpu.info.sm_count as usize, rpe, active, hidden, inter);
    let ws2 = Ws::for_launch(gpu, &d2, &dg, &cfg2);
    let dtr = gpu.upload(&rb.token_rows).unwrap();
    let mut y = gpu.poisoned::<bf16>(tokens * hidden, 0xFF).unwrap();
    let l1a = l1.as_activations();
    mg::launch_partial(gpu, &gpu.stream, &d2, &l1a, &dg, &cfg2, &ws2).unwrap();
    mg::launch_finish_l2(
        gpu,
        &gpu.stream,
        &ws2,
        &dg,
        &d2,
        &l1a,
        &dtr,
        topk,
        None,
        &mut y,
    )
    .unwrap();
    // Every L2 combine kernel on the same partials, into its own poisoned output: bit-identical to the routed
    // launch_finish_l2 (which picks one of them by the token count).
    for &kernel in mg::FinishL2Kernel::ALL {
        let mut y_k = gpu.poisoned::<bf16>(tokens * hidden, 0xA5).unwrap();
        mg::launch_finish_l2_with(
            gpu,
            &gpu.stream,
            &ws2,
            &dg,
            &d2,
            &l1a,
            &dtr,
            topk,
            None,
            &mut y_k,
            kernel,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        let (gk, gd) = (gpu.download(&y_k).unwrap(), gpu.download(&y).unwrap());
        if let Some(i) = (0..gd.len()).find(|&i| gk[i].to_bits() != gd[i].to_bits()) {
            panic!(
                "{label}: L2 {kernel:?} token {} col {}: {:#06x}, routed {:#06x}",
                i / hidden,
                i % hidden,
                gk[i].to_bits(),
                gd[i].to_bits()
            );
        }
    }
    check_ep_partial_finish(gpu, label, (&ws2, &dg, &d2, &l1a, &dtr), topk, &y, rng);
    gpu.synchronize().unwrap();
    check_l2_against_reference(
        gpu,
        label,
        &w2,
        &a2,
        &rb.grouping,
        &ws2,
        &rb.token_rows,
        topk,
        &y,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_swiglu_nvfp4_and_l2_combine_flash_shapes() {
    let gpu = common::gpu("gpu_l1_swiglu_nvfp4_and_l2_combine_flash_shapes");
    let mut rng = seeded("gpu_l1_swiglu_nvfp4_and_l2_combine_flash_shapes");
    check_l1_l2(
        &gpu,
        "Flash 4096/2048, 8 experts, 3 tokens",
        4096,
        2048,
        8,
        3,
        &mut rng,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_swiglu_nvfp4_and_l2_combine_pro_shapes() {
    let gpu = common::gpu("gpu_l1_swiglu_nvfp4_and_l2_combine_pro_shapes");
    let mut rng = seeded("gpu_l1_swiglu_nvfp4_and_l2_combine_pro_shapes");
    check_l1_l2(
        &gpu,
        "Pro 7168/3072, 6 experts, 1 token",
        7168,
        3072,
        6,
        1,
        &mut rng,
    );
}

/// The inputs of one decode step that stay at fixed addresses: W13 and W2 weights, the grouping, the routing
/// weights and the token -> slot table.
type StepBuffers<'a> = (
    &'a DeviceExpertWeights,
    &'a DeviceExpertWeights,
    &'a DeviceGrouping,
    &'a cudarc::driver::CudaSlice<f32>,
    &'a cudarc::driver::CudaSlice<i32>,
);

/// One MoE decode step on `stream`: L1 mainloop + finish into `l1`, L2 mainloop + combine into `y`.
#[allow(clippy::too_many_arguments)]
fn decode_step(
    gpu: &Gpu,
    stream: &megamoe::gpu::launch::Stream,
    (d13, d2, dg, droute, dtr): StepBuffers,
    a: &mg::DeviceActivations,
    (cfg1, cfg2): (&GemmConfig, &GemmConfig),
    (ws1, ws2): (&mg::Workspace, &mg::Workspace),
    topk: usize,
    l1: &mut L1Output,
    y: &mut cudarc::driver::CudaSlice<bf16>,
) -> anyhow::Result<()> {
    mg::launch_partial(gpu, stream, d13, a, dg, cfg1, ws1)?;
    mg::launch_finish_l1(gpu, stream, ws1, dg, d13, a, droute, l1)?;
    let h = l1.as_activations();
    mg::launch_partial(gpu, stream, d2, &h, dg, cfg2, ws2)?;
    mg::launch_finish_l2(gpu, stream, ws2, dg, d2, &h, dtr, topk, None, y)
}

/// Top-`topk` choices giving expert e exactly `counts[e]` of `tokens * topk` pairs, each token `topk` distinct
/// experts: pairs listed expert by expert go to tokens round-robin (an expert's <= tokens consecutive pairs land
/// on distinct tokens).
fn choices_with_counts(counts: &[usize], tokens: usize, topk: usize) -> Vec<usize> {
    assert_eq!(counts.iter().sum::<usize>(), tokens * topk);
    assert!(counts.iter().all(|&c| c <= tokens));
    let mut per_token: Vec<Vec<usize>> = vec![Vec::new(); tokens];
    let pairs = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e, c));
    for (i, e) in pairs.enumerate() {
        per_token[i % tokens].push(e);
    }
    per_token.concat()
}

/// One decode step of the MoE layer (L1 mainloop + SwiGLU/NVFP4 finish, L2 mainloop + combine; masked layout, the
/// routed F16-operand decode mainloop on tiled weights) captured once in a CUDA graph on its own stream, then
/// replayed with new device-side inputs written between replays: per-expert counts (an expert with 0 rows, counts
/// of 1..8 that are not multiples of the 8-token tile, a full expert), the slots' activations, routing weights and
/// the token -> slot table. The grid and config come from the capacity only, so every replay must follow the new
/// counts. Every replay's outputs and workspaces are NaN-poisoned before it and checked against the f64 reference
/// (accumulators, h, its NVFP4 bits, the combined output). Flash-like with reduced dims: hidden 1024, inter 512.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_step_replays_as_a_graph_with_new_device_counts() {
    let name = "gpu_decode_step_replays_as_a_graph_with_new_device_counts";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    let (experts, hidden, inter, cap, tokens, topk) = (4usize, 1024, 512, 8, 8, 2);
    let rows = experts * cap;
    let w13 = quantized_weights(&mut rng, experts, 2 * inter, hidden);
    let w2 = quantized_weights(&mut rng, experts, hidden, inter);
    let d13 = DeviceExpertWeights::upload(&gpu, &w13).unwrap();
    let d2 = DeviceExpertWeights::upload(&gpu, &w2).unwrap();
    // Replay 0 is the eager run (and the capture's inputs); 1.. replay the graph.
    let count_sets: [[usize; 4]; 4] = [[4, 4, 4, 4], [0, 8, 3, 5], [7, 0, 8, 1], [2, 6, 0, 8]];
    let batch = |counts: &[usize; 4]| {
        let choices = choices_with_counts(counts, tokens, topk);
        RoutedBatch::from_choices(tokens, experts, topk, choices, Some(cap)).unwrap()
    };
    // Device inputs, fixed addresses for the whole test.
    let rb0 = batch(&count_sets[0]);
    let mut dg = DeviceGrouping::upload(&gpu, &rb0.grouping).unwrap();
    let Activations::Nvfp4(q0) = gathered_activations(&mut rng, &rb0, hidden, true) else {
        unreachable!()
    };
    let (mut a_codes, mut a_scales, mut a_global) = (
        gpu.upload(&q0.codes).unwrap(),
        gpu.upload(&q0.scales).unwrap(),
        gpu.upload(&q0.global).unwrap(),
    );
    let mut droute = gpu.zeros::<f32>(rows).unwrap();
    let mut dtr = gpu.upload(&rb0.token_rows).unwrap();
    // Config and workspaces from the capacity: what the host knows when it captures a decode step.
    let cfg1 = GemmConfig::choose(
        gpu.info.sm_count as usize,
        cap as f64,
        experts,
        2 * inter,
        hidden,
    );
    let cfg2 = GemmConfig::choose(
        gpu.info.sm_count as usize,
        cap as f64,
        experts,
        hidden,
        inter,
    );
    let ws1 = Ws::for_launch(&gpu, &d13, &dg, &cfg1);
    let ws2 = Ws::for_launch(&gpu, &d2, &dg, &cfg2);
    let mut l1 = L1Output::new(&gpu, rows, inter, true).unwrap();
    let mut y = gpu.poisoned::<bf16>(tokens * hidden, 0xFF).unwrap();
    let stream = gpu.new_stream().unwrap();
    gpu.synchronize().unwrap();
    let mut graph = None;
    for (replay, counts) in count_sets.iter().enumerate() {
        let rb = batch(counts);
        let a = gathered_activations(&mut rng, &rb, hidden, true);
        let Activations::Nvfp4(q) = &a else {
            unreachable!()
        };
        let routing: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05f32..1.5)).collect();
        // Poison every output and workspace, then write the new inputs into the captured buffers.
        ws1.poison(&gpu);
        ws2.poison(&gpu);
        for b in [&mut l1.codes, &mut l1.scales] {
            gpu.fill_bytes(b, common::POISON).unwrap();
        }
        gpu.fill_bytes(&mut l1.global, common::POISON).unwrap();
        gpu.fill_bytes(l1.h_f32.as_mut().unwrap(), common::POISON)
            .unwrap();
        gpu.fill_bytes(&mut y, common::POISON).unwrap();
        gpu.synchronize().unwrap();
        let Grouping::Masked { counts: c, .. } = &rb.grouping else {
            unreachable!()
        };
        gpu.write(&stream, &mut dg.group, c).unwrap();
        gpu.write(&stream, &mut a_codes, &q.codes).unwrap();
        gpu.write(&stream, &mut a_scales, &q.scales).unwrap();
        gpu.write(&stream, &mut a_global, &q.global).unwrap();
        gpu.write(&stream, &mut droute, &routing).unwrap();
        gpu.write(&stream, &mut dtr, &rb.token_rows).unwrap();
        if replay == 0 {
            let a = mg::DeviceActivations::Nvfp4 {
                rows,
                k: hidden,
                codes: &a_codes,
                scales: &a_scales,
                global: &a_global,
            };
            let w = (&d13, &d2, &dg, &droute, &dtr);
            let (c, ws) = ((&cfg1, &cfg2), (&*ws1, &*ws2));
            // The eager run resolves the kernels (module load, attributes) outside the capture; the capture
            // enqueues the same work without running it, so the eager run's outputs are what is checked below.
            decode_step(&gpu, &stream, w, &a, c, ws, topk, &mut l1, &mut y).unwrap();
            stream.synchronize().unwrap();
            graph = Some(
                megamoe::gpu::timing::capture_on(&stream, || {
                    decode_step(&gpu, &stream, w, &a, c, ws, topk, &mut l1, &mut y)
                })
                .unwrap(),
            );
        } else {
            graph.as_ref().unwrap().launch().unwrap();
        }
        stream.synchronize().unwrap();
        let label = format!("replay {replay}, counts {counts:?}");
        let q_gpu =
            check_l1_against_reference(&gpu, &label, &w13, &a, &rb.grouping, &routing, &ws1, &l1);
        check_l2_against_reference(
            &gpu,
            &label,
            &w2,
            &Activations::Nvfp4(q_gpu),
            &rb.grouping,
            &ws2,
            &rb.token_rows,
            topk,
            &y,
        );
    }
}

#[test]
fn weights_from_mxfp4_keep_every_value_exactly() {
    // Checkpoint path: MXFP4 experts -> lossless NVFP4 (per-row power-of-two global scale).
    let mut rng = seeded("weights_from_mxfp4_keep_every_value_exactly");
    let (experts, n, k) = (3, 16, 256);
    let wf = random_rows(&mut rng, experts * n, k, 0.05);
    let m = megamoe::formats::mxfp4::quantize(&wf, experts * n, k).unwrap();
    let (w, report) = ExpertWeights::from_mxfp4(&m, experts, n).unwrap();
    assert!(
        report.is_lossless(),
        "random rows within 10^4 of each other must convert exactly: {:?}",
        report.inexact_blocks.first()
    );
    let mx = megamoe::formats::mxfp4::dequantize(&m);
    for e in 0..experts {
        for r in 0..n {
            for kk in 0..k {
                let v = w.unscaled(e, r, kk) * w.global(e, r);
                assert_eq!(v, mx[(e * n + r) * k + kk], "expert {e} row {r} k {kk}");
            }
        }
    }
    assert!(ExpertWeights::from_mxfp4(&m, experts, n + 1).is_err());
}

#[test]
fn bench_config_parses_and_names_known_kernels_and_params() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/moe_gemm.toml"
    ))
    .unwrap();
    let cfg = megamoe::bench::config::SweepConfig::from_toml_str(&text).unwrap();
    let registry = megamoe::bench::kernels::all();
    assert!(!cfg.sweeps.is_empty());
    for s in &cfg.sweeps {
        let k = registry
            .iter()
            .find(|k| k.name == s.kernel)
            .unwrap_or_else(|| panic!("unknown kernel {}", s.kernel));
        // The main sweeps race against cublaslt_bf16; the short A/B sweeps (one variant) have no baseline.
        if let Some(b) = s.baseline.as_deref() {
            assert!(
                k.variants.contains(&b),
                "{}: baseline not a variant",
                s.kernel
            );
        } else {
            assert_eq!(
                s.variants.as_ref().map(|v| v.len()),
                Some(1),
                "{}: sweep without a baseline",
                s.kernel
            );
        }
        for v in s.variants.iter().flatten() {
            assert!(
                k.variants.contains(&v.as_str()),
                "{}: unknown variant {v}",
                s.kernel
            );
        }
        for p in ["hidden", "inter", "experts", "topk"] {
            s.param_u64(p).unwrap();
        }
        let (h, i) = (
            s.param_u64("hidden").unwrap() as usize,
            s.param_u64("inter").unwrap() as usize,
        );
        mg::check_gemm_shape(2 * i, h).unwrap();
        mg::check_gemm_shape(h, i).unwrap();
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_weights_prepared_from_mxfp4() {
    let gpu = common::gpu("gpu_weights_prepared_from_mxfp4");
    let mut rng = seeded("gpu_weights_prepared_from_mxfp4");
    let (experts, n, k, tokens) = (8, 256, 1024, 5);
    let wf = random_rows(&mut rng, experts * n, k, 0.05);
    let m = megamoe::formats::mxfp4::quantize(&wf, experts * n, k).unwrap();
    let (w, report) = ExpertWeights::from_mxfp4(&m, experts, n).unwrap();
    assert!(report.is_lossless());
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let rb = RoutedBatch::random(&mut rng, tokens, experts, 6, Some(tokens)).unwrap();
    let cfg = GemmConfig::choose(gpu.info.sm_count as usize, 4.0, 8, n, k);
    check_plain(
        &gpu,
        "MXFP4-prepared weights",
        &w,
        &dw,
        &rb,
        true,
        &[cfg],
        &mut rng,
    );
}

#[test]
fn exec_cpu_reference_on_a_safetensors_file() {
    use megamoe::ops::exec::{self, HostTensor, TensorMap};
    use safetensors::Dtype;
    let mut rng = seeded("exec_cpu_reference_on_a_safetensors_file");
    let (e, n, k) = (3, 256, 512);
    let w = quantized_weights(&mut rng, e, n, k);
    let rb = RoutedBatch::from_choices(5, e, 1, vec![0, 2, 2, 0, 2], None).unwrap();
    let a = gathered_activations(&mut rng, &rb, k, true);
    let Activations::Nvfp4(q) = &a else {
        unreachable!()
    };
    let Grouping::Contiguous { offsets } = &rb.grouping else {
        unreachable!()
    };
    let mut m = TensorMap::new();
    m.insert(
        "w_codes".into(),
        HostTensor::from_u8(Dtype::U8, vec![e, n, k / 2], w.rows.codes.clone()),
    );
    m.insert(
        "w_scales".into(),
        HostTensor::from_u8(Dtype::U8, vec![e, n, k / 16], w.rows.scales.clone()),
    );
    m.insert(
        "w_global".into(),
        HostTensor::from_f32(vec![e, n], &w.rows.global),
    );
    m.insert(
        "offsets".into(),
        HostTensor::from_u8(
            Dtype::I32,
            vec![e + 1],
            offsets.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    );
    m.insert(
        "a_codes".into(),
        HostTensor::from_u8(Dtype::U8, vec![q.rows, k / 2], q.codes.clone()),
    );
    m.insert(
        "a_scales".into(),
        HostTensor::from_u8(Dtype::U8, vec![q.rows, k / 16], q.scales.clone()),
    );
    m.insert(
        "a_global".into(),
        HostTensor::from_f32(vec![q.rows], &q.global),
    );
    let dir = std::env::temp_dir().join(format!("moe_gemm_exec_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (inp, outp) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
    exec::write_safetensors(&inp, &m).unwrap();
    megamoe::ops::registry::run_exec("moe_gemm_grouped", &inp, &outp, None).unwrap();
    let out = exec::read_safetensors(&outp).unwrap();
    let d = out["d"].to_f32().unwrap();
    let (acc, _) = grouped_gemm_acc_f64(&w, &a, &rb.grouping).unwrap();
    let want = apply_global_scales(&acc, &w, &a, &rb.grouping);
    assert_eq!(out["d"].shape, vec![5, n]);
    for (i, (g, r)) in d.iter().zip(&want).enumerate() {
        assert_eq!(*g, *r as f32, "element {i}");
    }
    // A missing tensor is a clear error.
    m.remove("offsets");
    exec::write_safetensors(&inp, &m).unwrap();
    let err = megamoe::ops::registry::run_exec("moe_gemm_grouped", &inp, &outp, None).unwrap_err();
    assert!(format!("{err:#}").contains("offsets"), "{err:#}");
    std::fs::remove_dir_all(&dir).ok();
}

// ------------------------ L1 finish kernels: Rows against PerRow bit for bit, PerRow against the CPU reference

/// First difference between two L1 outputs of the same rows, bit for bit: codes, block scales, global scales and
/// (when both kept it) the fp32 h.
fn assert_l1_outputs_bit_equal(gpu: &Gpu, label: &str, got: &L1Output, want: &L1Output) {
    let (rows, inter) = (want.rows, want.i_dim);
    for (what, per_row, g, w) in [
        (
            "code byte",
            inter / 2,
            gpu.download(&got.codes).unwrap(),
            gpu.download(&want.codes).unwrap(),
        ),
        (
            "block scale",
            inter / 16,
            gpu.download(&got.scales).unwrap(),
            gpu.download(&want.scales).unwrap(),
        ),
    ] {
        assert_eq!(g.len(), w.len(), "{label}: {what} buffer sizes differ");
        if let Some(i) = (0..g.len()).find(|&i| g[i] != w[i]) {
            panic!(
                "{label}: {what} {i} (row {} of {rows}, index {}) = {:#04x}, default {:#04x}; {} of {} differ",
                i / per_row.max(1),
                i % per_row.max(1),
                g[i],
                w[i],
                (0..g.len()).filter(|&j| g[j] != w[j]).count(),
                g.len()
            );
        }
    }
    let (g, w) = (
        gpu.download(&got.global).unwrap(),
        gpu.download(&want.global).unwrap(),
    );
    if let Some(r) = (0..g.len()).find(|&r| g[r].to_bits() != w[r].to_bits()) {
        panic!(
            "{label}: global scale row {r} = {} ({:#010x}), default {} ({:#010x})",
            g[r],
            g[r].to_bits(),
            w[r],
            w[r].to_bits()
        );
    }
    if let (Some(hg), Some(hw)) = (&got.h_f32, &want.h_f32) {
        let (g, w) = (gpu.download(hg).unwrap(), gpu.download(hw).unwrap());
        if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
            panic!(
                "{label}: h row {} col {} = {} ({:#010x}), default {} ({:#010x})",
                i / inter,
                i % inter,
                g[i],
                g[i].to_bits(),
                w[i],
                w[i].to_bits()
            );
        }
    }
}

/// Synthetic inputs of the L1 finish (it reads only these): split partials `[splits, rows, 2I]`, per-(expert,
/// column) global scales, per-row gsa (None = BF16 A, gsa = 1) and routing weights.
struct FinishInputs {
    rb: RoutedBatch,
    experts: usize,
    inter: usize,
    splits: usize,
    partial: Vec<f32>,
    gsb: Vec<f32>,
    gsa: Option<Vec<f32>>,
    routing: Vec<f32>,
}

/// Top-6 routing of `tokens` tokens over the first `experts - 2` experts (the last two stay empty); masked with
/// `most + p` slots per expert when `padding` is `Some(p)` (so some slots are padding), contiguous when `None`.
fn routed_top6_two_empty_experts(
    rng: &mut impl Rng,
    tokens: usize,
    experts: usize,
    padding: Option<usize>,
) -> RoutedBatch {
    let rb0 = RoutedBatch::random(rng, tokens, experts - 2, 6, None).unwrap();
    let most = (0..experts - 2)
        .map(|e| rb0.grouping.expert_rows(e).len())
        .max()
        .unwrap_or(0);
    RoutedBatch::from_choices(
        tokens,
        experts,
        6,
        rb0.experts_of,
        padding.map(|p| most + p),
    )
    .unwrap()
}
/// Top-6 routing of `tokens` over all experts but the last two (those stay empty); `padding`: Some(p) = masked
/// layout with p padding slots per expert beyond the largest count, None = contiguous. Owned rows get partials
/// whose scaled sums have a per-row magnitude of 10^[-1.5, 1] with 1-in-64 outliers x30 (past the +-10 clamps),
/// one all-zero 16-block of gate columns when I >= 256 (h = +-0 there: scale byte 0, codes 0), the first owned row
/// gets routing weight 0 (an all-zero h row: gs = 1). Unowned rows hold NaN partials, as the mainloop leaves its
/// 0xFF-poisoned workspace there: the finish must not read them.
fn finish_inputs(
    rng: &mut impl Rng,
    inter: usize,
    experts: usize,
    tokens: usize,
    splits: usize,
    padding: Option<usize>,
    nvfp4_a: bool,
) -> FinishInputs {
    let rb = routed_top6_two_empty_experts(rng, tokens, experts, padding);
    let (n, rows) = (2 * inter, rb.grouping.rows_total());
    let gsb: Vec<f32> = (0..experts * n)
        .map(|_| 2f32.powf(rng.random_range(-9.0f32..-3.0)))
        .collect();
    let gsa = nvfp4_a.then(|| {
        (0..rows)
            .map(|_| rng.random_range(0.5f32..2.0))
            .collect::<Vec<f32>>()
    });
    let mut routing: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05f32..1.5)).collect();
    let mut partial = vec![f32::from_bits(u32::MAX); splits * rows * n];
    let mut zero_row_done = false;
    for r in 0..rows {
        let Some(e) = rb.grouping.expert_of_row(r) else {
            continue;
        };
        if !zero_row_done {
            routing[r] = 0.0;
            zero_row_done = true;
        }
        let sa = gsa.as_ref().map_or(1.0, |g| g[r]);
        let mag = 10f32.powf(rng.random_range(-1.5f32..1.0)) / splits as f32;
        // (Only when a row has >= 16 blocks: at tiny I it would zero most of the row.)
        let zero_block = (inter >= 256).then(|| rng.random_range(0..inter / 16));
        for c in 0..n {
            let zero = c < inter && Some(c / 16) == zero_block;
            for s in 0..splits {
                let v = if zero {
                    0.0
                } else {
                    let b: u32 = rng.random();
                    let tri = ((b & 0x7FFF) as f32 + ((b >> 15) & 0x7FFF) as f32) / 32768.0 - 1.0;
                    let x = tri * mag;
                    if b >> 26 == 0 {
                        x * 30.0
                    } else {
                        x
                    }
                };
                partial[(s * rows + r) * n + c] = v / (sa * gsb[e * n + c]);
            }
        }
    }
    FinishInputs {
        rb,
        experts,
        inter,
        splits,
        partial,
        gsb,
        gsa,
        routing,
    }
}

/// The device side of [`FinishInputs`]: everything an L1 finish launch reads (the finish reads only the global
/// scales of W13: its codes and block scales are placeholders of the right size).
struct FinishDevice {
    rows: usize,
    inter: usize,
    dg: DeviceGrouping,
    d13: DeviceExpertWeights,
    ws: Ws,
    a_codes: cudarc::driver::CudaSlice<u8>,
    a_scales: cudarc::driver::CudaSlice<u8>,
    a_bf16: cudarc::driver::CudaSlice<bf16>,
    a_global: cudarc::driver::CudaSlice<f32>,
    nvfp4_a: bool,
    droute: cudarc::driver::CudaSlice<f32>,
}

impl FinishDevice {
    fn upload(gpu: &Gpu, inp: &FinishInputs) -> FinishDevice {
        let (inter, splits) = (inp.inter, inp.splits);
        let (n, rows) = (2 * inter, inp.rb.grouping.rows_total());
        let k = mg::STAGE_K;
        // Device buffers hold at least one element (a zero-byte allocation is an error).
        let at_least_one = |v: &[f32]| -> Vec<f32> {
            if v.is_empty() {
                vec![0.0]
            } else {
                v.to_vec()
            }
        };
        FinishDevice {
            rows,
            inter,
            dg: DeviceGrouping::upload(gpu, &inp.rb.grouping).unwrap(),
            d13: DeviceExpertWeights {
                experts: inp.experts,
                n,
                k,
                tiled: gpu.zeros::<u8>(1).unwrap(),
                global: gpu.upload(&inp.gsb).unwrap(),
            },
            ws: {
                let ws = Ws::new(gpu, splits, rows, n);
                ws.write_partial(gpu, &inp.partial);
                ws
            },
            a_codes: gpu.zeros::<u8>((rows * k / 2).max(1)).unwrap(),
            a_scales: gpu.zeros::<u8>((rows * k / 16).max(1)).unwrap(),
            a_bf16: gpu.zeros::<bf16>((rows * k).max(1)).unwrap(),
            a_global: gpu
                .upload(&at_least_one(
                    inp.gsa.as_deref().unwrap_or(&vec![1.0; rows]),
                ))
                .unwrap(),
            nvfp4_a: inp.gsa.is_some(),
            droute: gpu.upload(&at_least_one(&inp.routing)).unwrap(),
        }
    }

    fn activations(&self) -> mg::DeviceActivations<'_> {
        let k = mg::STAGE_K;
        if self.nvfp4_a {
            mg::DeviceActivations::Nvfp4 {
                rows: self.rows,
                k,
                codes: &self.a_codes,
                scales: &self.a_scales,
                global: &self.a_global,
            }
        } else {
            mg::DeviceActivations::Bf16 {
                rows: self.rows,
                k,
                data: &self.a_bf16,
            }
        }
    }

    /// `launch` into fresh 0xFF-poisoned outputs (with the fp32 h when `keep_h`), synchronized.
    fn run_launch(
        &self,
        gpu: &Gpu,
        keep_h: bool,
        launch: impl FnOnce(&mg::DeviceActivations, &mut L1Output) -> anyhow::Result<()>,
    ) -> L1Output {
        let mut out = L1Output::new(gpu, self.rows, self.inter, keep_h).unwrap();
        launch(&self.activations(), &mut out).unwrap();
        gpu.synchronize().unwrap();
        out
    }

    /// `kernel` into fresh 0xFF-poisoned outputs (with the fp32 h when `keep_h`).
    fn run(&self, gpu: &Gpu, kernel: mg::FinishL1Kernel, keep_h: bool) -> L1Output {
        self.run_launch(gpu, keep_h, |a, out| {
            mg::launch_finish_l1_with(
                gpu,
                &gpu.stream,
                &self.ws,
                &self.dg,
                &self.d13,
                a,
                &self.droute,
                out,
                kernel,
            )
        })
    }

    /// The rows kernel with `rows_per_cta` rows per CTA, into fresh 0xFF-poisoned outputs.
    fn run_rows(&self, gpu: &Gpu, rows_per_cta: usize, keep_h: bool) -> L1Output {
        self.run_launch(gpu, keep_h, |a, out| {
            mg::launch_finish_l1_rows_with(
                gpu,
                &gpu.stream,
                &self.ws,
                &self.dg,
                &self.d13,
                a,
                &self.droute,
                out,
                rows_per_cta,
            )
        })
    }
}

/// Every L1 finish kernel on the same synthetic partials into 0xFF-poisoned outputs, with and without the fp32 h
/// output, against PerRow with h bit for bit (codes, block scales, global scales, h); and PerRow against the
/// CPU reference (h against the f64 SwiGLU of the
/// partials' fp32 split sums; codes, block scales and global scales bit-exact against the CPU quantizer applied to
/// the GPU's h, as `check_l1_l2` does).
fn check_finish_l1_kernels(gpu: &Gpu, label: &str, inp: &FinishInputs) {
    let (inter, splits) = (inp.inter, inp.splits);
    let rows = inp.rb.grouping.rows_total();
    let label = format!(
        "{label} [I {inter}, {} tokens, rows {rows}, splits {splits}, {} A]",
        inp.rb.tokens,
        if inp.gsa.is_some() { "NVFP4" } else { "BF16" }
    );
    let dev = FinishDevice::upload(gpu, inp);
    let run = |kernel: mg::FinishL1Kernel, keep_h: bool| dev.run(gpu, kernel, keep_h);
    let per_row_h = run(mg::FinishL1Kernel::PerRow, true);
    let per_row = run(mg::FinishL1Kernel::PerRow, false);
    assert_l1_outputs_bit_equal(
        gpu,
        &format!("{label} PerRow (no h output)"),
        &per_row,
        &per_row_h,
    );
    for &kernel in &mg::FinishL1Kernel::ALL[1..] {
        for keep_h in [true, false] {
            let got = run(kernel, keep_h);
            assert_l1_outputs_bit_equal(
                gpu,
                &format!("{label} {kernel:?} (h kept: {keep_h})"),
                &got,
                &per_row_h,
            );
        }
    }
    if rows == 0 {
        return;
    }

    let h_gpu = gpu.download(per_row_h.h_f32.as_ref().unwrap()).unwrap();
    let max_rel = check_h_against_f64_reference(&label, inp, &h_gpu);
    let q_cpu = quantize_rows_nvfp4(&h_gpu, rows, inter).unwrap();
    let (codes, scales, global) = (
        gpu.download(&per_row.codes).unwrap(),
        gpu.download(&per_row.scales).unwrap(),
        gpu.download(&per_row.global).unwrap(),
    );
    if let Some(r) = (0..rows).find(|&r| global[r].to_bits() != q_cpu.global[r].to_bits()) {
        panic!(
            "{label}: PerRow global scale row {r}: gpu {} cpu {}",
            global[r], q_cpu.global[r]
        );
    }
    if let Some(i) = (0..q_cpu.scales.len()).find(|&i| scales[i] != q_cpu.scales[i]) {
        panic!(
            "{label}: PerRow block scale {i} (row {}): gpu {:#04x} cpu {:#04x}",
            i / (inter / 16),
            scales[i],
            q_cpu.scales[i]
        );
    }
    if let Some(i) = (0..q_cpu.codes.len()).find(|&i| codes[i] != q_cpu.codes[i]) {
        panic!(
            "{label}: PerRow code byte {i} (row {}): gpu {:#04x} cpu {:#04x}",
            i / (inter / 2),
            codes[i],
            q_cpu.codes[i]
        );
    }
    let zero_scales = scales.iter().filter(|&&s| s == 0).count();
    // PerRow's padding-row path runs only on padding rows: every masked batch here has some.
    let padding_rows = (0..rows)
        .filter(|&r| inp.rb.grouping.expert_of_row(r).is_none())
        .count();
    assert!(
        !matches!(inp.rb.grouping, Grouping::Masked { .. }) || padding_rows > 0,
        "{label}: masked batch without padding rows (the PerRow padding-row path would go untested)"
    );
    eprintln!(
        "{label}: {:?} == PerRow bit for bit; {padding_rows} padding rows; h max rel err vs f64 {max_rel:e}; {zero_scales} zero block scales of {}",
        &mg::FinishL1Kernel::ALL[1..],
        scales.len()
    );
}

/// The GPU's fp32 h against the f64 SwiGLU of the partials' fp32 split sums (split order, as the kernels add them).
/// Returns the largest relative error over reference values >= 1e-30 (a diagnostic; smaller ones underflow in fp32).
fn check_h_against_f64_reference(label: &str, inp: &FinishInputs, h_gpu: &[f32]) -> f64 {
    let (inter, splits) = (inp.inter, inp.splits);
    let (n, rows) = (2 * inter, inp.rb.grouping.rows_total());
    let g = &inp.rb.grouping;
    let mut d = vec![0f64; rows * n];
    for r in 0..rows {
        let Some(e) = g.expert_of_row(r) else {
            continue;
        };
        let sa = inp.gsa.as_ref().map_or(1.0, |v| v[r]) as f64;
        for c in 0..n {
            let acc = (0..splits).fold(0f32, |s, sp| s + inp.partial[(sp * rows + r) * n + c]);
            d[r * n + c] = acc as f64 * sa * inp.gsb[e * n + c] as f64;
        }
    }
    let h_ref = swiglu_l1_f64(&d, inter, &inp.routing, g);
    let mut max_rel = 0f64;
    for r in 0..rows {
        if g.expert_of_row(r).is_none() {
            if let Some(j) = (0..inter).find(|&j| h_gpu[r * inter + j].to_bits() != 0) {
                panic!(
                    "{label}: padding row {r} h col {j} = {} (must be +0)",
                    h_gpu[r * inter + j]
                );
            }
            continue;
        }
        for j in 0..inter {
            // The kernel's scaled gate/up carry 2 roundings (acc * fl(sa * sb): 2u + u^2 < 3u relative; the clamps
            // are 1-Lipschitz); silu' <= 1.1; then expf (<= 2 ulp), 1 + ., the division and two products: <= 16u of
            // |h| (as check_l1_l2).
            let (dg_raw, du_raw) = (d[r * n + j], d[r * n + inter + j]);
            let gate = dg_raw.min(10.0);
            let up = du_raw.clamp(-10.0, 10.0);
            let silu = gate / (1.0 + (-gate).exp());
            let hr = h_ref[r * inter + j];
            let tol = inp.routing[r] as f64
                * (1.1 * up.abs() * 3.0 * U * dg_raw.abs() + silu.abs() * 3.0 * U * du_raw.abs())
                + 16.0 * U * hr.abs()
                + 1e-30;
            let hg = h_gpu[r * inter + j] as f64;
            assert!(
                (hg - hr).abs() <= tol,
                "{label}: h row {r} col {j}: gpu {hg} ref {hr} tol {tol:e}"
            );
            if hr.abs() >= 1e-30 {
                max_rel = max_rel.max((hg - hr).abs() / hr.abs());
            }
        }
    }
    max_rel
}

/// The token counts of the brief, one split count each (5 exercises the second 4-split pass of the partial
/// loads), masked with 2 padding slots per expert; plus a contiguous grouping, BF16 A (gsa = 1) and the empty
/// contiguous batch (rows_total = 0: nothing launched, nothing written).
fn check_finish_l1_over_token_counts(gpu: &Gpu, name: &str, inter: usize) {
    let mut rng = seeded(name);
    let experts = 16;
    for (tokens, splits) in [(0usize, 2usize), (1, 4), (2, 3), (7, 5), (64, 1)] {
        let inp = finish_inputs(&mut rng, inter, experts, tokens, splits, Some(2), true);
        check_finish_l1_kernels(gpu, name, &inp);
    }
    let inp = finish_inputs(&mut rng, inter, experts, 7, 2, None, true);
    check_finish_l1_kernels(gpu, &format!("{name} contiguous"), &inp);
    let inp = finish_inputs(&mut rng, inter, experts, 2, 4, Some(1), false);
    check_finish_l1_kernels(gpu, &format!("{name} BF16 A"), &inp);
    let inp = finish_inputs(&mut rng, inter, experts, 0, 1, None, true);
    assert_eq!(inp.rb.grouping.rows_total(), 0);
    check_finish_l1_kernels(gpu, &format!("{name} empty contiguous"), &inp);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_finish_kernels_bit_identical_flash_inter() {
    let name = "gpu_l1_finish_kernels_bit_identical_flash_inter";
    let gpu = common::gpu(name);
    check_finish_l1_over_token_counts(&gpu, name, 2048);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_finish_kernels_bit_identical_pro_inter() {
    let name = "gpu_l1_finish_kernels_bit_identical_pro_inter";
    let gpu = common::gpu(name);
    check_finish_l1_over_token_counts(&gpu, name, 3072);
}

/// Off the DSV4 shapes: I = 16 * odd, so I / 4 is not a multiple of 32 and the last warp of the per-row quantization pass is only
/// partly inside the loop (its shuffle mask names a prefix of the warp); I = 2064 also takes a second pass-1 and
/// pass-2 iteration with a single partly filled warp (I / 4 = 516 chunks for 512 threads).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_finish_kernels_bit_identical_partial_warps() {
    let name = "gpu_l1_finish_kernels_bit_identical_partial_warps";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    for (inter, tokens, splits) in [
        (16usize, 3usize, 2usize),
        (48, 2, 1),
        (2064, 3, 3),
        (1136, 7, 2),
    ] {
        let inp = finish_inputs(&mut rng, inter, 8, tokens, splits, Some(1), true);
        check_finish_l1_kernels(&gpu, name, &inp);
    }
}

// ------------------------------------ The rows L1 finish (FinishL1Kernel::Rows): prefill-sized, forced rows per CTA

/// Overwrites about one in `one_in` partials of owned rows with -0.0, +0.0, subnormals, +-inf, NaN or +-3e38 (inf
/// once scaled): h then holds NaN (silu of -inf), +-inf and signed zeros, which the row amax, the block maxima and
/// the quantizer must treat exactly as PerRow does.
fn sprinkle_special_partials(rng: &mut impl Rng, inp: &mut FinishInputs, one_in: u32) {
    let specials = [
        -0.0f32,
        0.0,
        1e-40,
        -1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        3e38,
        -3e38,
    ];
    let (n, rows) = (2 * inp.inter, inp.rb.grouping.rows_total());
    for r in 0..rows {
        if inp.rb.grouping.expert_of_row(r).is_none() {
            continue;
        }
        for s in 0..inp.splits {
            for c in 0..n {
                if rng.random_range(0..one_in) == 0 {
                    inp.partial[(s * rows + r) * n + c] =
                        specials[rng.random_range(0..specials.len())];
                }
            }
        }
    }
}

/// Replaces about one in `one_in` row scales gsa (if any) and expert column scales gsb with values at and around
/// Rows' fused-product check (sa, gsb >= 2^-64: one FFMA for `(0 + p) * fl(sa * sb)`, splits == 1): +-0,
/// negatives, 2^-64 and its neighbours, products that underflow to 0, +inf, NaN. Wherever the check fails the
/// kernel must take the unfused form; wherever it passes, the FFMA must give the same bits (-0 partials included,
/// from sprinkle_special_partials).
fn perturb_scales_around_fused_check(rng: &mut impl Rng, inp: &mut FinishInputs, one_in: u32) {
    let specials = [
        0.0f32,
        -0.0,
        -0.75,
        2f32.powi(-64),
        f32::from_bits(2f32.powi(-64).to_bits() - 1),
        f32::from_bits(2f32.powi(-64).to_bits() + 1),
        2f32.powi(-70),
        1e-40,
        3e38,
        f32::INFINITY,
        f32::NAN,
    ];
    if let Some(gsa) = inp.gsa.as_mut() {
        for v in gsa.iter_mut() {
            if rng.random_range(0..one_in) == 0 {
                *v = specials[rng.random_range(0..specials.len())];
            }
        }
    }
    for v in inp.gsb.iter_mut() {
        if rng.random_range(0..one_in * 64) == 0 {
            *v = specials[rng.random_range(0..specials.len())];
        }
    }
}

/// Scales the routing weight of about one in `one_in` owned rows by a tiny or huge factor, so whole rows of h sit
/// far from 1: row amax below ~2^-100 (block scales under 2^-100, subnormal h) or above ~2^110 (block scales over
/// 2^100, or inf / NaN scales where h overflows). The rows encoder must take its division fallback exactly there.
fn scale_some_routing_weights(rng: &mut impl Rng, inp: &mut FinishInputs, one_in: u32) {
    let factors = [1e-33f32, 1e-38, 1e-44, 1e33, 1e36, 1e38];
    for r in 0..inp.rb.grouping.rows_total() {
        if inp.rb.grouping.expert_of_row(r).is_some() && rng.random_range(0..one_in) == 0 {
            inp.routing[r] *= factors[rng.random_range(0..factors.len())];
        }
    }
}

/// The rows L1 finish against PerRow bit for bit (codes, block scales, global
/// scales, h) into 0xFF-poisoned outputs: through [`mg::launch_finish_l1_with`] (the launcher's rows per CTA: one
/// wave) and with each forced `rows_per_cta` (the ring wraps, the expert changes inside a CTA, the last CTA owns
/// fewer rows), with and without the fp32 h output.
fn check_rows_finish_against_per_row(
    gpu: &Gpu,
    label: &str,
    inp: &FinishInputs,
    rows_per_cta: &[usize],
) {
    let rows = inp.rb.grouping.rows_total();
    let label = format!(
        "{label} [I {}, {} tokens, rows {rows}, splits {}, {} A]",
        inp.inter,
        inp.rb.tokens,
        inp.splits,
        if inp.gsa.is_some() { "NVFP4" } else { "BF16" }
    );
    let dev = FinishDevice::upload(gpu, inp);
    let want = dev.run(gpu, mg::FinishL1Kernel::PerRow, true);
    {
        let kernel = mg::FinishL1Kernel::Rows;
        for keep_h in [true, false] {
            let got = dev.run(gpu, kernel, keep_h);
            assert_l1_outputs_bit_equal(
                gpu,
                &format!("{label} {kernel:?}, launcher's rows per CTA (h kept: {keep_h})"),
                &got,
                &want,
            );
            for &rpc in rows_per_cta {
                let got = dev.run_rows(gpu, rpc, keep_h);
                assert_l1_outputs_bit_equal(
                    gpu,
                    &format!("{label} {kernel:?}, {rpc} rows per CTA (h kept: {keep_h})"),
                    &got,
                    &want,
                );
            }
        }
    }
    let h = gpu.download(want.h_f32.as_ref().unwrap()).unwrap();
    let (nan, inf, neg_zero) = (
        h.iter().filter(|v| v.is_nan()).count(),
        h.iter().filter(|v| v.is_infinite()).count(),
        h.iter().filter(|v| v.to_bits() == 0x8000_0000).count(),
    );
    eprintln!(
        "{label}: Rows == PerRow bit for bit at rows per CTA {rows_per_cta:?} and the launcher's; h has \
         {nan} NaN, {inf} inf, {neg_zero} -0.0"
    );
}

/// Prefill-sized contiguous batches with one K split (the wgmma mainloop's workspace) and special values in the
/// partials: Flash I = 2048 (kc2) at 4,200 rows (the launcher's one wave is ~11 rows per CTA on 132 SMs), Pro I =
/// 3072 (kc3, BF16 A), I = 4096 (kc4); split-K batches with many rows per CTA, contiguous and masked (padding rows
/// inside a CTA's range); I off the DSV4 shapes (partial warps: I / 4 not a multiple of 32, kc1 and kc3).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_finish_rows_bit_identical_prefill_sized() {
    let name = "gpu_l1_finish_rows_bit_identical_prefill_sized";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    let forced = [1usize, 3, 7, 64, 256];
    let mut inp = finish_inputs(&mut rng, 2048, 40, 700, 1, None, true);
    sprinkle_special_partials(&mut rng, &mut inp, 64);
    check_rows_finish_against_per_row(&gpu, name, &inp, &forced);
    // Rows of tiny / huge h (the rows encoder's out-of-range block scales), with and without special partials.
    let mut inp = finish_inputs(&mut rng, 2048, 20, 300, 1, None, true);
    scale_some_routing_weights(&mut rng, &mut inp, 4);
    check_rows_finish_against_per_row(&gpu, name, &inp, &[3, 256]);
    sprinkle_special_partials(&mut rng, &mut inp, 64);
    check_rows_finish_against_per_row(&gpu, name, &inp, &[7]);
    let mut inp = finish_inputs(&mut rng, 3072, 24, 300, 1, None, false);
    sprinkle_special_partials(&mut rng, &mut inp, 64);
    check_rows_finish_against_per_row(&gpu, name, &inp, &[5, 256]);
    let inp = finish_inputs(&mut rng, 4096, 12, 100, 1, None, true);
    check_rows_finish_against_per_row(&gpu, name, &inp, &[2, 9]);
    for (splits, padding) in [(3usize, None), (2, Some(3)), (5, Some(1))] {
        let mut inp = finish_inputs(&mut rng, 2048, 16, 150, splits, padding, true);
        sprinkle_special_partials(&mut rng, &mut inp, 128);
        check_rows_finish_against_per_row(&gpu, name, &inp, &[1, 6, 31]);
    }
    for (inter, splits) in [(16usize, 1usize), (48, 2), (1136, 1), (2064, 3)] {
        let mut inp = finish_inputs(&mut rng, inter, 10, 90, splits, Some(2), true);
        sprinkle_special_partials(&mut rng, &mut inp, 32);
        scale_some_routing_weights(&mut rng, &mut inp, 8);
        check_rows_finish_against_per_row(&gpu, name, &inp, &[1, 5, 13]);
    }
    // Rows' fused split-0 product: scales at and around its check, one split (fused where the check passes)
    // and two (never fused), contiguous and masked, Flash and Pro I.
    for (inter, splits, padding) in [
        (2048usize, 1usize, None),
        (3072, 1, Some(2)),
        (2048, 2, None),
        (1136, 1, Some(1)),
    ] {
        let mut inp = finish_inputs(&mut rng, inter, 12, 120, splits, padding, true);
        sprinkle_special_partials(&mut rng, &mut inp, 32);
        perturb_scales_around_fused_check(&mut rng, &mut inp, 6);
        check_rows_finish_against_per_row(&gpu, name, &inp, &[1, 4, 37]);
    }
}

/// The rows L1 finish after the real prefill mainloop (wgmma, one K split) on a Flash L1 shape (N = 2 * 2048, short
/// K), contiguous rows crossing tile edges with an empty expert: bit-identical to PerRow, and PerRow's h against
/// the f64 reference of the same path is what check_l1_l2 establishes for the default.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l1_finish_rows_after_the_prefill_mainloop() {
    let name = "gpu_l1_finish_rows_after_the_prefill_mainloop";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    let (inter, k) = (2048usize, 512usize);
    let counts = [700usize, 129, 0, 301, 64, 3];
    let experts = counts.len();
    let choices = counts
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e, c))
        .collect();
    let tokens: usize = counts.iter().sum();
    let rb = RoutedBatch::from_choices(tokens, experts, 1, choices, None).unwrap();
    let rows = rb.grouping.rows_total();
    let w13 = quantized_weights(&mut rng, experts, 2 * inter, k);
    let d13 = DeviceExpertWeights::upload(&gpu, &w13).unwrap();
    let dg = DeviceGrouping::upload(&gpu, &rb.grouping).unwrap();
    let a = gathered_activations(&mut rng, &rb, k, true);
    let da = DevA::upload(&gpu, &a);
    let routing: Vec<f32> = (0..rows).map(|_| rng.random_range(0.05f32..1.5)).collect();
    let droute = gpu.upload(&routing).unwrap();
    let ws = Ws::prefill(&gpu, rows, 2 * inter, k);
    mg::prefill::launch_partial_prefill(&gpu, &gpu.stream, &d13, &da.view(), &dg, &ws).unwrap();
    // rows_per_cta 0: through the launcher (its own choice for the rows kernels); else the rows launcher forced.
    let run = |kernel: mg::FinishL1Kernel, rows_per_cta: usize| -> L1Output {
        let mut out = L1Output::new(&gpu, rows, inter, true).unwrap();
        if rows_per_cta == 0 {
            mg::launch_finish_l1_with(
                &gpu,
                &gpu.stream,
                &ws,
                &dg,
                &d13,
                &da.view(),
                &droute,
                &mut out,
                kernel,
            )
        } else {
            mg::launch_finish_l1_rows_with(
                &gpu,
                &gpu.stream,
                &ws,
                &dg,
                &d13,
                &da.view(),
                &droute,
                &mut out,
                rows_per_cta,
            )
        }
        .unwrap();
        gpu.synchronize().unwrap();
        out
    };
    let want = run(mg::FinishL1Kernel::PerRow, 0);
    let got = run(mg::FinishL1Kernel::Rows, 0);
    assert_l1_outputs_bit_equal(&gpu, &format!("{name}: Rows (launcher)"), &got, &want);
    for rpc in [1usize, 5, 7, 100, 256] {
        let got = run(mg::FinishL1Kernel::Rows, rpc);
        assert_l1_outputs_bit_equal(
            &gpu,
            &format!("{name}: Rows, {rpc} rows per CTA"),
            &got,
            &want,
        );
    }
    eprintln!("{name}: {rows} rows, Rows == PerRow bit for bit after the prefill mainloop");
}

// ----------------------------------- L2 combine kernels: each against RowWarps bit for bit, and the CPU reference

/// Every L2 combine kernel on synthetic split partials `[splits, rows, n]` into 0xFF-poisoned outputs, against the
/// first (`RowWarps`) bit for bit, and that one against the f64 combine of the fp32 split sums (tolerance: the
/// bf16 rounding of the output, 2^-8 relative, plus 16 fp32 ulps of the absolute terms). Unowned rows hold NaN
/// partials (as the mainloop's poisoned workspace): a kernel that added one would fail. A few routed slots are
/// replaced by -1 and (masked) by a padding slot: both kernels must skip them. With `shared`, also every kernel
/// with a BF16 addend (the shared expert's output, fresh values of the outputs' size, into 0xFF-poisoned outputs),
/// and without one, bit for bit against `combine_l2_like_kernel`, the CPU model of the kernels' f32 order.
#[allow(clippy::too_many_arguments)]
fn check_l2_combine_kernels(
    gpu: &Gpu,
    label: &str,
    rng: &mut impl Rng,
    n: usize,
    experts: usize,
    tokens: usize,
    splits: usize,
    padding: Option<usize>,
    nvfp4_a: bool,
    shared: bool,
) {
    let topk = 6;
    let rb = routed_top6_two_empty_experts(rng, tokens, experts, padding);
    let g = &rb.grouping;
    let rows = g.rows_total();
    let label = format!(
        "{label} [N {n}, {tokens} tokens, rows {rows}, splits {splits}, {}, {} A]",
        if padding.is_some() {
            "masked"
        } else {
            "contiguous"
        },
        if nvfp4_a { "NVFP4" } else { "BF16" }
    );
    let gsb: Vec<f32> = (0..experts * n)
        .map(|_| 2f32.powf(rng.random_range(-9.0f32..-3.0)))
        .collect();
    let gsa: Vec<f32> = (0..rows.max(1))
        .map(|_| {
            if nvfp4_a {
                rng.random_range(0.5f32..2.0)
            } else {
                1.0
            }
        })
        .collect();
    let mut partial = vec![f32::NAN; (splits * rows * n).max(1)];
    for r in 0..rows {
        if g.expert_of_row(r).is_none() {
            continue;
        }
        let mag = 10f32.powf(rng.random_range(0.0f32..3.0));
        for s in 0..splits {
            for c in 0..n {
                partial[(s * rows + r) * n + c] = rng.random_range(-1.0f32..1.0) * mag;
            }
        }
    }
    // Unrouted slots: -1 for one slot of the first token, a padding row (if any) for one slot of the last.
    let mut token_rows = rb.token_rows.clone();
    token_rows[rng.random_range(0..topk)] = -1;
    if let Some(pad) = (0..rows).find(|&r| g.expert_of_row(r).is_none()) {
        token_rows[(tokens - 1) * topk + rng.random_range(0..topk)] = pad as i32;
    }
    let dg = DeviceGrouping::upload(gpu, g).unwrap();
    let k = mg::STAGE_K;
    let d2 = DeviceExpertWeights {
        experts,
        n,
        k,
        tiled: gpu.zeros::<u8>(1).unwrap(),
        global: gpu.upload(&gsb).unwrap(),
    };
    let ws = Ws::new(gpu, splits, rows, n);
    ws.write_partial(gpu, &partial);
    let a_codes = gpu.zeros::<u8>((rows * k / 2).max(1)).unwrap();
    let a_scales = gpu.zeros::<u8>((rows * k / 16).max(1)).unwrap();
    let a_bf16 = gpu.zeros::<bf16>((rows * k).max(1)).unwrap();
    let a_global = gpu.upload(&gsa).unwrap();
    let a = if nvfp4_a {
        mg::DeviceActivations::Nvfp4 {
            rows,
            k,
            codes: &a_codes,
            scales: &a_scales,
            global: &a_global,
        }
    } else {
        mg::DeviceActivations::Bf16 {
            rows,
            k,
            data: &a_bf16,
        }
    };
    assert!(
        tokens > 0,
        "{label}: the launcher writes nothing for 0 tokens"
    );
    let dtr = gpu.upload(&token_rows).unwrap();
    let run_with = |kernel: mg::FinishL2Kernel,
                    addend: Option<&cudarc::driver::CudaSlice<bf16>>|
     -> Vec<bf16> {
        let mut y = gpu.poisoned::<bf16>(tokens * n, 0xFF).unwrap();
        mg::launch_finish_l2_with(
            gpu,
            &gpu.stream,
            &ws,
            &dg,
            &d2,
            &a,
            &dtr,
            topk,
            addend.map(|b| b as &dyn megamoe::gpu::launch::DeviceBuf<bf16>),
            &mut y,
            kernel,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        gpu.download(&y).unwrap()
    };
    let run = |kernel: mg::FinishL2Kernel| run_with(kernel, None);
    let want = run(mg::FinishL2Kernel::RowWarps);
    for &kernel in &mg::FinishL2Kernel::ALL[1..] {
        let got = run(kernel);
        if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            panic!(
                "{label}: {kernel:?} token {} col {}: {:#06x}, RowWarps {:#06x}; {} of {} differ",
                i / n,
                i % n,
                got[i].to_bits(),
                want[i].to_bits(),
                (0..want.len())
                    .filter(|&j| got[j].to_bits() != want[j].to_bits())
                    .count(),
                want.len()
            );
        }
    }
    let mut max_rel = 0f64;
    for t in 0..tokens {
        for c in 0..n {
            let (mut y_ref, mut abs_sum) = (0f64, 0f64);
            for j in 0..topk {
                let r = token_rows[t * topk + j];
                let Some(e) = (r >= 0).then(|| g.expert_of_row(r as usize)).flatten() else {
                    continue;
                };
                let r = r as usize;
                let acc = (0..splits).fold(0f32, |s, sp| s + partial[(sp * rows + r) * n + c]);
                let term = acc as f64 * gsa[r] as f64 * gsb[e * n + c] as f64;
                y_ref += term;
                abs_sum += term.abs();
            }
            let got = want[t * n + c].to_f32() as f64;
            let tol = y_ref.abs() / 256.0 + 16.0 * U * abs_sum + 1e-30;
            assert!(
                (got - y_ref).abs() <= tol,
                "{label}: token {t} col {c}: gpu {got} ref {y_ref} tol {tol:e}"
            );
            if y_ref.abs() > 1e-30 {
                max_rel = max_rel.max((got - y_ref).abs() / y_ref.abs());
            }
        }
    }
    eprintln!(
        "{label}: {:?} == RowWarps bit for bit; RowWarps vs f64 max rel err {max_rel:e}",
        &mg::FinishL2Kernel::ALL[1..]
    );
    if !shared {
        return;
    }
    // The shared expert's output: BF16 of the routed output's magnitude and either sign, so the add carries
    // and cancels.
    let addend: Vec<bf16> = (0..tokens * n)
        .map(|i| {
            let y = want[i].to_f32();
            let mag = if y.is_finite() && y != 0.0 {
                y.abs()
            } else {
                1.0
            };
            bf16::from_f32(rng.random_range(-2.0f32..2.0) * mag)
        })
        .collect();
    let d_add = gpu.upload(&addend).unwrap();
    let gsa_model = nvfp4_a.then_some(&gsa[..]);
    let model = |add: Option<&[bf16]>| {
        mg::reference::combine_l2_like_kernel(
            &partial,
            splits,
            n,
            gsa_model,
            &gsb,
            &token_rows,
            topk,
            g,
            add,
        )
    };
    let (want_plain, want_shared) = (model(None), model(Some(&addend)));
    for &kernel in mg::FinishL2Kernel::ALL {
        assert_bit_identical(
            &format!("{label} {kernel:?}"),
            "routed only vs the f32 model",
            &want_plain,
            &run(kernel),
        );
        assert_bit_identical(
            &format!("{label} {kernel:?}"),
            "routed + shared vs the f32 model",
            &want_shared,
            &run_with(kernel, Some(&d_add)),
        );
    }
    eprintln!(
        "{label}: every kernel with and without the shared addend == the f32 model bit for bit"
    );
}

/// The shared expert's BF16 output added in the L2 combine: every combine kernel at Flash (N 4096) and Pro
/// (N 7168) hidden sizes, 1 / 7 / 64 tokens, masked and contiguous, NVFP4 and BF16 activations, with and without
/// the addend, bit for bit against the CPU model of the kernels' f32 order (routed sum in routing order, then the
/// addend, then one BF16 rounding); poisoned outputs.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l2_combine_adds_the_shared_expert() {
    let name = "gpu_l2_combine_adds_the_shared_expert";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    for n in [4096usize, 7168] {
        for (tokens, splits, padding, nvfp4_a) in [
            (1usize, 4usize, Some(2), true),
            (7, 2, None, true),
            (64, 1, Some(2), true),
            (7, 3, Some(1), false),
        ] {
            check_l2_combine_kernels(
                &gpu, name, &mut rng, n, 16, tokens, splits, padding, nvfp4_a, true,
            );
        }
    }
}

/// Flash (N 4096) and Pro (N 7168) hidden sizes, 1 / 2 / 7 / 64 tokens with 1-5 splits (5: a second 4-split pass),
/// masked with padding (the layout the candidate speeds up) and contiguous (its fallback), NVFP4 and BF16 A.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l2_combine_kernels_bit_identical() {
    let name = "gpu_l2_combine_kernels_bit_identical";
    let gpu = common::gpu(name);
    let mut rng = seeded(name);
    for n in [4096usize, 7168] {
        for (tokens, splits) in [(1usize, 4usize), (2, 3), (7, 5), (64, 1)] {
            check_l2_combine_kernels(
                &gpu,
                name,
                &mut rng,
                n,
                16,
                tokens,
                splits,
                Some(2),
                true,
                false,
            );
        }
        check_l2_combine_kernels(&gpu, name, &mut rng, n, 16, 7, 2, None, true, false);
        check_l2_combine_kernels(&gpu, name, &mut rng, n, 16, 2, 4, Some(1), false, false);
    }
}

/// The L2 finish kernels against each other, bit for bit (every FinishL2Kernel vs RowWarps, which the
/// L1/L2 tests above check against the f64 reference), on synthetic split-K partials that reach the corners the
/// model shapes do not: 1-9 splits (RowWarps loads 8 per pass: 9 takes two passes), topk 1, 6, 9 and 13 (two
/// passes of 8 slots), slots that are -1 or point at padding rows, empty experts, N not a multiple of 32 (a
/// partial last column block), per-row gsa or none (BF16 activations), and partials with -0.0, subnormals,
/// +-inf and NaN mixed in. Outputs poisoned (different patterns per kernel), with a poisoned tail past
/// tokens x N that neither kernel may touch.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_l2_finish_kernels_bit_identical_on_edge_partials() {
    let gpu = common::gpu("gpu_l2_finish_kernels_bit_identical_on_edge_partials");
    let seed = megamoe::ops::inputs::fresh_seed(
        "gpu_l2_finish_kernels_bit_identical_on_edge_partials",
        "MOE_GEMM_SEED",
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // (label, masked capacity (0 = contiguous), experts, tokens, topk, splits, n, per-row gsa)
    type Case = (&'static str, usize, usize, usize, usize, usize, usize, bool);
    let cases: &[Case] = &[
        ("masked decode 1 token", 4, 16, 1, 6, 1, 4096, true),
        ("masked 7 tokens, 2 splits", 4, 16, 7, 6, 2, 2080, true),
        (
            "contiguous topk 9, 9 splits, n 200",
            0,
            12,
            5,
            9,
            9,
            200,
            true,
        ),
        (
            "contiguous topk 13, 4 splits, bf16 activations",
            0,
            20,
            3,
            13,
            4,
            96,
            false,
        ),
        ("topk 1, 8 splits", 0, 3, 4, 1, 8, 64, true),
        (
            "masked 3 tokens, N 201 (Cols2 refuses N % 2 != 0)",
            2,
            9,
            3,
            6,
            2,
            201,
            true,
        ),
    ];
    for &(label, capacity, experts, tokens, topk, splits, n, with_gsa) in cases {
        let grouping = if capacity > 0 {
            let counts: Vec<i32> = (0..experts)
                .map(|e| {
                    if e % 5 == 3 {
                        0
                    } else {
                        rng.random_range(0..=capacity as i32)
                    }
                })
                .collect();
            Grouping::Masked { capacity, counts }
        } else {
            let mut offsets = vec![0i32];
            for e in 0..experts {
                let c = if e % 4 == 1 {
                    0
                } else {
                    rng.random_range(0..4)
                };
                offsets.push(offsets[e] + c);
            }
            Grouping::Contiguous { offsets }
        };
        let rows_total = grouping.rows_total();
        let dg = DeviceGrouping::upload(&gpu, &grouping).unwrap();
        // Slots: a routed row, -1, or (masked) a padding row; rows may repeat across tokens.
        let token_rows: Vec<i32> = (0..tokens * topk)
            .map(|_| match rng.random_range(0..10) {
                0 => -1,
                _ if rows_total == 0 => -1,
                _ => rng.random_range(0..rows_total as i32),
            })
            .collect();
        let special = [
            0.0f32,
            -0.0,
            1e-42,
            -3e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let partial: Vec<f32> = (0..splits * rows_total.max(1) * n)
            .map(|_| {
                if rng.random_range(0..64) == 0 {
                    special[rng.random_range(0..special.len())]
                } else {
                    rng.random_range(-4.0f32..4.0) * 2f32.powi(rng.random_range(-20..20))
                }
            })
            .collect();
        let ws = Ws::new(&gpu, splits, rows_total, n);
        ws.write_partial(&gpu, &partial);
        let gsb: Vec<f32> = (0..experts * n)
            .map(|_| rng.random_range(0.01f32..3.0))
            .collect();
        let w2 = DeviceExpertWeights {
            experts,
            n,
            k: 64,
            tiled: gpu.upload(&[0u8; 1]).unwrap(),
            global: gpu.upload(&gsb).unwrap(),
        };
        let gsa: Vec<f32> = (0..rows_total.max(1))
            .map(|_| rng.random_range(0.001f32..2.0))
            .collect();
        let (codes, scales) = (
            gpu.upload(&[0u8; 1]).unwrap(),
            gpu.upload(&[0u8; 1]).unwrap(),
        );
        let (dgsa, bf) = (gpu.upload(&gsa).unwrap(), gpu.zeros::<bf16>(1).unwrap());
        let a = if with_gsa {
            mg::DeviceActivations::Nvfp4 {
                rows: rows_total,
                k: 64,
                codes: &codes,
                scales: &scales,
                global: &dgsa,
            }
        } else {
            mg::DeviceActivations::Bf16 {
                rows: rows_total,
                k: 64,
                data: &bf,
            }
        };
        let dtr = gpu.upload(&token_rows).unwrap();
        let tail = 77;
        let mut outs: Vec<Vec<bf16>> = Vec::new();
        for (i, &kernel) in mg::FinishL2Kernel::ALL.iter().enumerate() {
            let pattern = [0xFFu8, 0x5A, 0xC3, 0x81][i % 4];
            let mut y = gpu.poisoned::<bf16>(tokens * n + tail, pattern).unwrap();
            let res = mg::launch_finish_l2_with(
                &gpu,
                &gpu.stream,
                &ws,
                &dg,
                &w2,
                &a,
                &dtr,
                topk,
                None,
                &mut y,
                kernel,
            );
            let float2_rows = matches!(
                kernel,
                mg::FinishL2Kernel::Cols2 | mg::FinishL2Kernel::Cols2Tok
            );
            if float2_rows && n % 2 != 0 {
                let err = res.expect_err("Cols2 / Cols2Tok must refuse N % 2 != 0");
                assert!(format!("{err:#}").contains("N % 2"), "{label}: `{err:#}`");
                let y = gpu.download(&y).unwrap();
                let poison = u16::from_le_bytes([pattern, pattern]);
                assert!(
                    y.iter().all(|v| v.to_bits() == poison),
                    "{label}: {kernel:?} wrote after refusing"
                );
                outs.push(outs[0].clone()); // keep the indices of ALL
                continue;
            }
            res.unwrap_or_else(|e| panic!("{label} {kernel:?}: {e:#}"));
            gpu.synchronize().unwrap();
            let y = gpu.download(&y).unwrap();
            let poison = u16::from_le_bytes([pattern, pattern]);
            assert!(
                y[tokens * n..].iter().all(|v| v.to_bits() == poison),
                "{label} {kernel:?}: wrote past tokens x N (seed {seed})"
            );
            outs.push(y);
        }
        for (k, got) in outs.iter().enumerate().skip(1) {
            if let Some(i) = (0..tokens * n).find(|&i| got[i].to_bits() != outs[0][i].to_bits()) {
                panic!(
                    "{label}: {:?} vs RowWarps at token {} col {}: {:#06x} vs {:#06x} (seed {seed})",
                    mg::FinishL2Kernel::ALL[k],
                    i / n,
                    i % n,
                    got[i].to_bits(),
                    outs[0][i].to_bits()
                );
            }
        }
        let nan = outs[0][..tokens * n].iter().filter(|v| v.is_nan()).count();
        eprintln!(
            "{label}: {} outputs bit-identical ({nan} NaN), seed {seed}",
            tokens * n
        );
    }
}

/// Expert parallelism's f32 L2 finish (`moe_gemm::finish::launch_finish_l2_partial`, the RowWarps kernel's f32 form) on the partials of a
/// routed L2 launch whose output (no addend) is `y`: rounded to BF16 it is `y` bit for bit; with a random BF16 addend,
/// `ops::ep::combine` of it at W = 1 is `launch_finish_l2`'s output with that addend bit for bit (the single-GPU
/// engine's fused epilogue, which the expert-parallel step at world 1 must reproduce).
fn check_ep_partial_finish(
    gpu: &Gpu,
    label: &str,
    (ws2, dg, d2, l1a, dtr): (
        &mg::Workspace,
        &DeviceGrouping,
        &DeviceExpertWeights,
        &mg::DeviceActivations,
        &cudarc::driver::CudaSlice<i32>,
    ),
    topk: usize,
    y: &cudarc::driver::CudaSlice<bf16>,
    rng: &mut impl Rng,
) {
    let elems = y.len();
    let s = &gpu.stream;
    let partial = gpu.poisoned::<f32>(elems, 0xFF).unwrap();
    megamoe::ops::moe_gemm::finish::launch_finish_l2_partial(
        gpu, s, ws2, dg, d2, l1a, dtr, topk, &partial,
    )
    .unwrap();
    let (p, want) = (gpu.download(&partial).unwrap(), gpu.download(y).unwrap());
    if let Some(i) = (0..elems).find(|&i| bf16::from_f32(p[i]).to_bits() != want[i].to_bits()) {
        panic!(
            "{label}: ep f32 finish element {i}: bf16({}) = {:#06x}, the fused epilogue {:#06x}",
            p[i],
            bf16::from_f32(p[i]).to_bits(),
            want[i].to_bits()
        );
    }
    let add: Vec<bf16> = (0..elems)
        .map(|_| bf16::from_f32(rng.random_range(-2.0f32..2.0)))
        .collect();
    let dadd = gpu.upload(&add).unwrap();
    let mut fused = gpu.poisoned::<bf16>(elems, 0xFF).unwrap();
    mg::launch_finish_l2(gpu, s, ws2, dg, d2, l1a, dtr, topk, Some(&dadd), &mut fused).unwrap();
    let combined = gpu.poisoned::<bf16>(elems, 0xFF).unwrap();
    megamoe::ops::ep::combine(gpu, s, &partial, 1, elems, Some(&dadd), &combined).unwrap();
    let (f, c) = (
        gpu.download(&fused).unwrap(),
        gpu.download(&combined).unwrap(),
    );
    if let Some(i) = (0..elems).find(|&i| f[i].to_bits() != c[i].to_bits()) {
        panic!(
            "{label}: ep combine at W = 1 element {i}: {:#06x}, the fused epilogue with the addend {:#06x}",
            c[i].to_bits(),
            f[i].to_bits()
        );
    }
    println!(
        "{label}: ep f32 finish and W = 1 combine equal the fused L2 epilogue on {elems} elements"
    );
}
