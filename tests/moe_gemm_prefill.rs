//! NVFP4 MoE grouped GEMM, wgmma PREFILL mainloop (kernels/moe_gemm_prefill.cu, src/ops/moe_gemm/prefill.rs):
//! GPU checks against the f64 CPU reference (skipped loudly without a GPU). The seed is printed by `fresh_seed`;
//! replay a failure with MOE_GEMM_SEED=<seed>.
//!
//! Tolerance (same argument as tests/moe_gemm.rs): every product A*B is exact (NVFP4 and BF16 values are exact in
//! BF16, their product exact in fp32, the kernel's power-of-two pre/post scaling is exact), so the accumulator
//! differs from the exact sum only by fp32 summation order. Per element:
//! |acc - exact| <= (K + 17) * 2u * sum_k |A*B| (u = 2^-24; 2u per addition covers a tensor core that truncates),
//! and over the whole output ||acc - exact|| / ||exact|| <= 8 sqrt(K) u + (K / 16) u. A wrong swizzle, descriptor,
//! fragment index, lost block scale or K-order mistake gives O(1) errors, orders of magnitude above both.

use half::bf16;
use megamoe::gpu::Gpu;
use megamoe::ops::moe_gemm::prefill;
use megamoe::ops::moe_gemm::reference::{
    apply_global_scales, grouped_gemm_acc_f64, Activations, ExpertWeights, Nvfp4Rows,
};
use megamoe::ops::moe_gemm::{
    self as mg, DeviceExpertWeights, DeviceGrouping, GemmConfig, RoutedBatch,
};
use rand::Rng;

mod common;
use common::moe::{gathered_activations, quantized_weights, seeded, DevA, Ws, U};

/// Top-1 routing giving expert i exactly `counts[i]` rows (contiguous layout).
fn batch_with_counts(counts: &[usize]) -> RoutedBatch {
    let tokens: usize = counts.iter().sum();
    let choices = counts
        .iter()
        .enumerate()
        .flat_map(|(ex, &c)| std::iter::repeat_n(ex, c))
        .collect();
    RoutedBatch::from_choices(tokens, counts.len(), 1, choices, None).unwrap()
}

/// Compare the fp32 accumulator with the f64 reference. On failure: the number of bad elements, the first bad
/// (row, col, expert) with both values and the bound, and the max errors, so a blind run pinpoints the fault.
fn check_accumulator(
    label: &str,
    rb: &RoutedBatch,
    got: &[f32],
    exact: &[f64],
    abs: &[f64],
    n: usize,
    k: usize,
) {
    let per_elem = (k + 17) as f64 * 2.0 * U;
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    let mut bad = 0usize;
    let mut first_bad: Option<String> = None;
    for i in 0..exact.len() {
        let g = got[i] as f64;
        let err = (g - exact[i]).abs();
        let bound = per_elem * abs[i] + 1e-30;
        // NaN (an unwritten element) must count as bad: compare with is_some_and, not a negated <=.
        if !err.partial_cmp(&bound).is_some_and(|o| o.is_le()) {
            bad += 1;
            if first_bad.is_none() {
                let (r, c) = (i / n, i % n);
                first_bad = Some(format!(
                    "row {r} (expert {:?}, row {} of its tile of 128) col {c} (n tile {}, col {} in tile): gpu {g:e} \
                     (bits {:#010x}) exact {:e} |err| {err:e} > bound {bound:e}",
                    rb.grouping.expert_of_row(r),
                    r - rb.grouping.expert_of_row(r).map(|e| rb.grouping.expert_rows(e).start).unwrap_or(0),
                    c / 128,
                    c % 128,
                    got[i].to_bits(),
                    exact[i]
                ));
            }
        }
        if err.is_finite() {
            num += err * err;
            max_abs = max_abs.max(err);
        }
        den += exact[i] * exact[i];
    }
    let rel = if den > 0.0 { (num / den).sqrt() } else { 0.0 };
    let rel_bound = 8.0 * (k as f64).sqrt() * U + (k as f64 / 16.0) * U;
    eprintln!(
        "{label}: {} elements, bad {bad}, max |err| {max_abs:e}, rel L2 {rel:e} (bound {rel_bound:e})",
        exact.len()
    );
    assert!(
        bad == 0,
        "{label}: {bad} of {} accumulator elements out of bound; first: {}",
        exact.len(),
        first_bad.unwrap()
    );
    assert!(
        rel <= rel_bound,
        "{label}: relative L2 error {rel:e} > {rel_bound:e}"
    );
}

/// Which launch a check uses (both run the activation pre-pass and the RS mainloop on the tiled weights).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// `mg::launch_partial` with a config it must route to the prefill kernel.
    Routed,
    /// `prefill::launch_partial_prefill` (the prefill path forced, whatever the routing rule says).
    Forced,
}

/// Run the prefill mainloop (forced, or through `launch_partial`'s routing), check the accumulator, then the
/// plain BF16 finish on top of it.
#[allow(clippy::too_many_arguments)]
fn check_prefill(
    gpu: &Gpu,
    label: &str,
    w: &ExpertWeights,
    dw: &DeviceExpertWeights,
    rb: &RoutedBatch,
    nvfp4: bool,
    mode: Mode,
    rng: &mut impl Rng,
) {
    let a = gathered_activations(rng, rb, w.k, nvfp4);
    let da = DevA::upload(gpu, &a);
    let dg = DeviceGrouping::upload(gpu, &rb.grouping).unwrap();
    let rows = rb.grouping.rows_total();
    let label = format!(
        "{label} [{} A, {} experts, rows {rows}, N {}, K {}, {}]",
        if nvfp4 { "NVFP4" } else { "BF16" },
        w.experts,
        w.n,
        w.k,
        match mode {
            Mode::Routed => "via launch_partial",
            Mode::Forced => "forced",
        }
    );
    let ws = Ws::prefill(gpu, rows, w.n, w.k); // poisoned: an unwritten element cannot pass
    if mode == Mode::Routed {
        let cfg = GemmConfig {
            token_tile: 64,
            splits: 1,
            ctas: gpu.info.sm_count as u32,
        };
        assert!(
            prefill::routes_here(dw, &dg, &cfg),
            "{label}: launch_partial would not route to the prefill kernel"
        );
        mg::launch_partial(gpu, &gpu.stream, dw, &da.view(), &dg, &cfg, &ws).unwrap();
    } else {
        prefill::launch_partial_prefill(gpu, &gpu.stream, dw, &da.view(), &dg, &ws).unwrap();
    }
    let mut out = gpu.poisoned::<bf16>((rows * w.n).max(1), 0xFF).unwrap();
    mg::launch_finish_bf16(gpu, &gpu.stream, &ws, &dg, dw, &da.view(), &mut out).unwrap();
    gpu.synchronize().unwrap();
    let (exact, abs) = grouped_gemm_acc_f64(w, &a, &rb.grouping).unwrap();
    let got = ws.partial_host(gpu);
    check_accumulator(&label, rb, &got[..rows * w.n], &exact, &abs, w.n, w.k);
    // BF16 output: the scaled reference, one bf16 rounding (2^-9 relative) plus the scaled accumulator bound.
    let d = apply_global_scales(&exact, w, &a, &rb.grouping);
    let out = gpu.download(&out).unwrap();
    let per_elem = (w.k + 17) as f64 * 2.0 * U;
    for r in 0..rows {
        let e = rb.grouping.expert_of_row(r).unwrap();
        for nn in 0..w.n {
            let i = r * w.n + nn;
            let o = out[i].to_f32() as f64;
            let scale = a.global(r) as f64 * w.global(e, nn) as f64;
            let tol = d[i].abs() / 256.0 + 2.0 * scale * per_elem * abs[i] + 1e-30;
            assert!(
                (o - d[i]).abs() <= tol,
                "{label}: BF16 out row {r} (expert {e}) col {nn}: gpu {o} ref {} tol {tol:e}",
                d[i]
            );
        }
    }
}

/// [`check_prefill`] with BF16 activations, then NVFP4 activations.
#[allow(clippy::too_many_arguments)]
fn check_prefill_both_a_formats(
    gpu: &Gpu,
    label: &str,
    w: &ExpertWeights,
    dw: &DeviceExpertWeights,
    rb: &RoutedBatch,
    mode: Mode,
    rng: &mut impl Rng,
) {
    for nvfp4 in [false, true] {
        check_prefill(gpu, label, w, dw, rb, nvfp4, mode, rng);
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_token_counts_both_a_formats() {
    let gpu = common::gpu("gpu_prefill_token_counts_both_a_formats");
    let mut rng = seeded("gpu_prefill_token_counts_both_a_formats");
    // Tile edges of the 128-row token tile (0, 1, 7, 64, 65, 127, 128, 129, 256, 300) and empty experts
    // first, in the middle and last. K = 1024: 16 stages, several laps of the 4-slot ring.
    let counts = [0usize, 1, 7, 64, 65, 127, 0, 128, 129, 256, 300, 0];
    let (n, k) = (256, 1024);
    let w = quantized_weights(&mut rng, counts.len(), n, k);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let rb = batch_with_counts(&counts);
    // Run this test under compute-sanitizer racecheck for the mainloop's ring protocol.
    check_prefill_both_a_formats(
        &gpu,
        &format!("counts {counts:?}"),
        &w,
        &dw,
        &rb,
        Mode::Forced,
        &mut rng,
    );
    // The shortest K the family accepts (K % 512 == 0, checked at weight upload): 4 stages of 128, one more than
    // the 3 stages the mainloop's prologue puts in flight.
    let k = 512;
    let rb = batch_with_counts(&[130, 0, 5]);
    let w = quantized_weights(&mut rng, 3, n, k);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    check_prefill_both_a_formats(
        &gpu,
        &format!("short K {k}"),
        &w,
        &dw,
        &rb,
        Mode::Forced,
        &mut rng,
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_4096_rows_and_6_of_256_routing_through_launch_partial() {
    let gpu = common::gpu("gpu_prefill_4096_rows_and_6_of_256_routing_through_launch_partial");
    let mut rng = seeded("gpu_prefill_4096_rows_and_6_of_256_routing_through_launch_partial");
    // One expert with 4096 rows (32 token tiles), one tiny, one empty.
    let w = quantized_weights(&mut rng, 3, 256, 512);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let rb = batch_with_counts(&[4096, 5, 0]);
    check_prefill(
        &gpu,
        "4096 rows",
        &w,
        &dw,
        &rb,
        true,
        Mode::Routed,
        &mut rng,
    );
    let w = quantized_weights(&mut rng, 2, 256, 512);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let rb = batch_with_counts(&[200, 70]);
    check_prefill_both_a_formats(&gpu, "routed N 256", &w, &dw, &rb, Mode::Routed, &mut rng);
    // 4096 tokens routed top-6 of 256 (~96 rows per expert, ragged tiles of every narrow width), small N and K for
    // the CPU reference: through launch_partial at N = 256 (one n tile per expert token tile) and forced at N = 512
    // (two); ~256 / ~512 work items, more than the SMs, so every CTA runs several items and its ring counters run on
    // across them.
    let rb = RoutedBatch::random(&mut rng, 4096, 256, 6, None).unwrap();
    for (n, mode) in [(256, Mode::Routed), (512, Mode::Forced)] {
        let w = quantized_weights(&mut rng, 256, n, 512);
        let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
        check_prefill_both_a_formats(&gpu, "4096 tokens, 6 of 256", &w, &dw, &rb, mode, &mut rng);
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_flash_and_pro_shapes() {
    let gpu = common::gpu("gpu_prefill_flash_and_pro_shapes");
    let mut rng = seeded("gpu_prefill_flash_and_pro_shapes");
    // Flash L1 (N = 2 * 2048, K = 4096), Flash L2 (N = 4096, K = 2048), Pro L2 (N = 7168, K = 3072); few rows so
    // the f64 reference stays a few seconds. Row counts cross a tile edge; every shape with both A formats.
    for (label, n, k, counts, nvfp4, mode) in [
        (
            "Flash L1",
            4096usize,
            4096usize,
            vec![3usize, 129],
            true,
            Mode::Forced,
        ),
        ("Flash L1", 4096, 4096, vec![129, 3], false, Mode::Routed),
        ("Flash L2", 4096, 2048, vec![70, 0, 65], false, Mode::Forced),
        ("Flash L2", 4096, 2048, vec![65, 70], true, Mode::Routed),
        ("Pro L2", 7168, 3072, vec![130, 70], true, Mode::Forced),
        ("Pro L2", 7168, 3072, vec![130], false, Mode::Forced),
    ] {
        let w = quantized_weights(&mut rng, counts.len(), n, k);
        let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
        let rb = batch_with_counts(&counts);
        check_prefill(&gpu, label, &w, &dw, &rb, nvfp4, mode, &mut rng);
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_rejects_masked_groupings_and_bad_shapes() {
    let gpu = common::gpu("gpu_prefill_rejects_masked_groupings_and_bad_shapes");
    let mut rng = seeded("gpu_prefill_rejects_masked_groupings_and_bad_shapes");
    let n = 256;
    let w = quantized_weights(&mut rng, 2, n, 512);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let masked = RoutedBatch::from_choices(3, 2, 1, vec![0, 1, 1], Some(4)).unwrap();
    let a = gathered_activations(&mut rng, &masked, 512, false);
    let da = DevA::upload(&gpu, &a);
    let dg = DeviceGrouping::upload(&gpu, &masked.grouping).unwrap();
    let ws = Ws::new(&gpu, 1, masked.grouping.rows_total(), n);
    let err =
        prefill::launch_partial_prefill(&gpu, &gpu.stream, &dw, &da.view(), &dg, &ws).unwrap_err();
    assert!(err.to_string().contains("contiguous"), "{err}");
    let contiguous = batch_with_counts(&[2, 1]);
    let dg = DeviceGrouping::upload(&gpu, &contiguous.grouping).unwrap();
    let ws2 = Ws::new(&gpu, 2, 3, n);
    let err =
        prefill::launch_partial_prefill(&gpu, &gpu.stream, &dw, &da.view(), &dg, &ws2).unwrap_err();
    assert!(err.to_string().contains("workspace"), "{err}");
    assert!(prefill::check_shape(192, 512).is_err());
    assert!(prefill::check_shape(128, 512).is_err());
    assert!(prefill::check_shape(256, 96).is_err());
    // Weights whose N is not a multiple of 256 are refused at upload (no tiling, no launch can see them).
    let w128 = quantized_weights(&mut rng, 2, 128, 512);
    let err = DeviceExpertWeights::upload(&gpu, &w128).err().unwrap();
    assert!(format!("{err:#}").contains("256"), "{err:#}");
}

/// The mainloop's edges in one launch, against the f64 reference: many stages (K 4096: 32 stages, 8 laps of the
/// 4-slot ring), token tiles of every narrow width (1..32, 33..64, 65..96, 97..128 rows: N = 32 / 64 / 96 / 128
/// wgmmas and activation boxes), tile edges, empty experts, two n tiles, both A formats. A block or byte the
/// weights' tiling missed would read as code 0 / scale 0 and give O(1) errors in its rows.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_narrow_token_tiles_and_many_stages() {
    let gpu = common::gpu("gpu_prefill_narrow_token_tiles_and_many_stages");
    let mut rng = seeded("gpu_prefill_narrow_token_tiles_and_many_stages");
    let counts = [
        130usize, 0, 97, 256, 1, 0, 300, 64, 129, 7, 0, 200, 128, 90, 3, 511, 32, 33, 65, 96,
    ];
    let (n, k) = (512, 4096);
    let w = quantized_weights(&mut rng, counts.len(), n, k);
    let dw = DeviceExpertWeights::upload(&gpu, &w).unwrap();
    let rb = batch_with_counts(&counts);
    check_prefill_both_a_formats(
        &gpu,
        "narrow tiles, K 4096",
        &w,
        &dw,
        &rb,
        Mode::Forced,
        &mut rng,
    );
}

/// One check of the RS activation pre-pass (`moe_gemm_prefill_act_rs` via `prefill::permute_activations_for_rs`)
/// against its CPU mirror: fresh random A of `rows + 2` rows (the pass converts the first `rows`), an output
/// buffer of `rows * k + 4096` elements poisoned first with 0xFF bytes (BF16 NaN) and then, in a second run, with
/// 0x00 (+0): every element of the first `rows * k` must hold the mirror's bits after both runs (an unwritten one
/// keeps the poison and fails one of them), the 4096 past it the poison. NVFP4: random code bytes (every e2m1 code),
/// random e4m3 scale bytes, NaN codes 0x7F / 0xFF only with `nan_scales` (then also every 7th block), where the
/// mirror's NaN must be a NaN (any payload). BF16: random 16-bit patterns (NaN, Inf, subnormals: a copy keeps all
/// bits).
fn check_act_rs_prepass(
    gpu: &Gpu,
    rng: &mut impl Rng,
    rows: usize,
    k: usize,
    nvfp4: bool,
    nan_scales: bool,
) {
    let a_rows = rows + 2;
    let slack = 4096usize;
    let label = format!(
        "act_rs pre-pass [{} A, rows {rows}, K {k}{}]",
        if nvfp4 { "NVFP4" } else { "BF16" },
        if nan_scales { ", NaN block scales" } else { "" }
    );
    // Device buffers of the A format under test only (the other format's vectors stay empty).
    let (mut codes, mut scales, mut data) = (Vec::new(), Vec::new(), Vec::new());
    let want = if nvfp4 {
        codes = vec![0u8; a_rows * k / 2];
        scales = vec![0u8; a_rows * k / 16];
        rng.fill_bytes(&mut codes);
        rng.fill_bytes(&mut scales);
        for (i, s) in scales.iter_mut().enumerate() {
            if nan_scales && i % 7 == 3 {
                *s |= 0x7F;
            } else if !nan_scales && *s & 0x7F == 0x7F {
                *s ^= 1; // 0x7E / 0xFE: the largest finite e4m3 magnitude (448)
            }
        }
        prefill::rs_prepass_nvfp4_like_kernel(&codes, &scales, rows, k)
    } else {
        data = (0..a_rows * k)
            .map(|_| bf16::from_bits(rng.random()))
            .collect();
        prefill::rs_prepass_bf16_like_kernel(&data, rows, k)
    };
    let da = raw_activations(gpu, nvfp4, a_rows, k, codes, scales, data);
    let a = da.view();
    // The pre-pass scratch of rows + ceil(slack / k) rows: at least `slack` elements past rows x K.
    let ws = Ws::prefill(gpu, rows + slack.div_ceil(k), 256, k);
    for poison in [0xFFu8, 0x00] {
        megamoe::gpu::arena::fill(&gpu.stream, &ws.act_rs, poison).unwrap();
        prefill::permute_activations_for_rs(gpu, &gpu.stream, &a, rows, k, &ws).unwrap();
        let got = common::moe::download(gpu, &ws.act_rs);
        let poison_bits = u16::from_ne_bytes([poison; 2]);
        let mut bad = 0usize;
        let mut first_bad = None;
        for (i, (g, w)) in got[..rows * k].iter().zip(&want).enumerate() {
            let nan_ok = nvfp4 && bf16::from_bits(*w).is_nan() && g.is_nan();
            if g.to_bits() != *w && !nan_ok {
                bad += 1;
                if first_bad.is_none() {
                    let (r, l) = (i / k, i % k);
                    first_bad = Some(format!(
                        "row {r} K {l} (segment {}, logical {} = physical K {}): gpu {:#06x} want {w:#06x}",
                        l / 128,
                        l % 128,
                        l / 128 * 128 + prefill::rs_activation_physical_k(l % 128),
                        g.to_bits()
                    ));
                }
            }
        }
        assert!(
            bad == 0,
            "{label}, poison {poison:#04x}: {bad} of {} elements differ; first: {}",
            rows * k,
            first_bad.unwrap()
        );
        let past = got[rows * k..]
            .iter()
            .filter(|g| g.to_bits() != poison_bits)
            .count();
        assert_eq!(
            past, 0,
            "{label}, poison {poison:#04x}: {past} elements past rows x K written"
        );
    }
    eprintln!(
        "{label}: {} elements bit-identical to the CPU mirror",
        rows * k
    );
}

/// The RS activation pre-pass writes exactly its CPU mirror's bytes, both A formats. Row counts: 1 and 3 (a warp step
/// of 8 segments only partly used at K 256 / 384), the 128-row tile edges 127 / 129, and 4099 rows (at K 4096 / 7168
/// 131,168 / 229,544 segments: more than one resident wave of 132 SMs x 8 CTAs x 64 segments, so the grid-stride
/// loop runs several laps and ends in a partial step). K: 256 (2 segments per row), 384 (3: odd segment counts, the
/// upper half-warp idle in the last pair), 4096 (Flash L1), 7168 (Pro). Then NaN block scales.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_prefill_act_rs_prepass_bit_identical_to_cpu_mirror() {
    let gpu = common::gpu("gpu_prefill_act_rs_prepass_bit_identical_to_cpu_mirror");
    let mut rng = seeded("gpu_prefill_act_rs_prepass_bit_identical_to_cpu_mirror");
    for (k, row_counts) in [
        (256usize, &[1usize, 3, 127, 129, 4099][..]),
        (384, &[1, 3, 129][..]),
        (4096, &[1, 3, 127, 129, 4099][..]),
        (7168, &[1, 3, 127, 129, 4099][..]),
    ] {
        for &rows in row_counts {
            for nvfp4 in [false, true] {
                check_act_rs_prepass(&gpu, &mut rng, rows, k, nvfp4, false);
            }
        }
    }
    check_act_rs_prepass(&gpu, &mut rng, 3, 256, true, true);
    check_act_rs_prepass(&gpu, &mut rng, 129, 4096, true, true);
}

/// Device activations of the A format under test from raw host vectors (the other format's vectors are empty):
/// NVFP4 codes + block scales with every row's global scale 1, or BF16 data; `a_rows x k`.
fn raw_activations(
    gpu: &Gpu,
    nvfp4: bool,
    a_rows: usize,
    k: usize,
    codes: Vec<u8>,
    scales: Vec<u8>,
    data: Vec<bf16>,
) -> DevA {
    let host = if nvfp4 {
        Activations::Nvfp4(Nvfp4Rows {
            rows: a_rows,
            cols: k,
            codes,
            scales,
            global: vec![1f32; a_rows],
        })
    } else {
        Activations::Bf16 {
            rows: a_rows,
            k,
            data,
        }
    };
    DevA::upload(gpu, &host)
}
