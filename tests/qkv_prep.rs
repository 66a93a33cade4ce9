//! qkv_prep: the attention-side prep kernels against the model's own per-token steps (`model::reference`),
//! and the host glue (entry = the model's FP8-simulated KV, the indexer query encoding, the ring slot rule).
//!
//! Exactness: RoPE, the BF16 roundings, the Hadamard, the FP8 / FP4 simulations and the encodings are
//! order-free, so the kernels' outputs are compared bit for bit with the model's steps run with the kernel's own
//! RMS factor (`rstd`, an output). The one sum (the RMS over 512 values) is checked on its own. The query heads'
//! factor is a BF16 value (the official BF16 op order): it equals the model's except where the mean of squares
//! sits at a BF16 rounding midpoint within the f32 sum's error, so q is compared with the model bit for bit and
//! those heads are counted. The KV factor is f32: the kernel's f32 sum vs the model's f64 `inv_rms`, and the
//! outputs against the model's full steps within the bound that one factor difference allows (stated beside each
//! check).

mod common;

use common::{assert_bit_identical, gpu, seeded, POISON};
use half::bf16;
use megamoe::formats::{bf16 as fbf16, e4m3, fp8, kv, ue8m0};
use megamoe::gpu::Gpu;
use megamoe::model::config::ModelConfig;
use megamoe::model::numerics::{
    bf16_round_f64, fp8_sim_inplace, head_rms_scale_bf16, inv_rms, rms_scale_bf16, RopeTable,
};
use megamoe::model::reference::{indexer_weight_scale, layer_rope, window_kv_rope};
use megamoe::ops::inputs::activation_rows;
use megamoe::ops::norm_quant::{HostQuant, NormOutputs, OutFormat};
use megamoe::ops::qkv_prep::{
    self, bench::Problem, check_ring, check_rows_heads, reference as r, WindowRing, ENTRY_BYTES,
    HEAD_DIM, INDEX_HEAD_DIM, NOPE_DIM,
};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

const REPLAY_VAR: &str = "QKV_PREP_SEED";
const EPS: f32 = 1e-6;
const WINDOW: usize = 128;
/// Positions every GPU test includes: 0, window - 1, window, and 2^20 - 1 (where an f32 angle would be off by
/// up to 2^-5 rad); -1 marks an empty row.
const EDGE_POSITIONS: [i32; 5] = [0, 127, 128, (1 << 20) - 1, -1];

/// The RoPE tables of a sliding-window layer (θ 10000) and a compressed layer (θ 160000 + YaRN).
fn ropes() -> [RopeTable; 2] {
    let cfg = ModelConfig::flash();
    let compressed = cfg.compress_ratios.iter().position(|&m| m > 0).unwrap();
    let swa = cfg.compress_ratios.iter().position(|&m| m == 0).unwrap();
    [layer_rope(&cfg, swa), layer_rope(&cfg, compressed)]
}

/// BF16-representable activation-like values (per-16 block scales spread over 2^±3, rows over 2^±6).
fn bf16_rows(rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    activation_rows(rows, cols, rng.random())
        .into_iter()
        .map(fbf16::round)
        .collect()
}

/// `rows` positions: the edge positions first (as many as fit), then random ones below 2^20.
fn positions(rows: usize, rng: &mut ChaCha8Rng) -> Vec<i32> {
    (0..rows)
        .map(|i| {
            EDGE_POSITIONS
                .get(i)
                .copied()
                .unwrap_or_else(|| rng.random_range(0..1 << 20))
        })
        .collect()
}

fn bf16_upload(gpu: &Gpu, v: &[f32]) -> cudarc::driver::CudaSlice<bf16> {
    gpu.upload(&fbf16::to_bf16_vec(v)).unwrap()
}

/// |rstd / inv_rms - 1| <= 2e-6 for the 512-value RMS: the kernel's f32 sum of squares (16 fused multiply-adds
/// per lane, then a 5-level tree) has a relative error below (16 + 5) * 2^-24 = 1.25e-6 (all terms positive);
/// the square root halves it, the divide, add, sqrt and reciprocal add 2 * 2^-24 after that, and the model's f64
/// value rounded to f32 another 2^-24: 1.25e-6 / 2 + 3 * 6e-8 < 1e-6, checked at 2e-6.
const RSTD_512_BOUND: f64 = 2e-6;

fn assert_rstd_close(label: &str, gpu_rstd: f32, cpu_inv: f32) {
    assert_rstd_within(label, gpu_rstd, cpu_inv, RSTD_512_BOUND);
}

fn assert_rstd_within(label: &str, gpu_rstd: f32, cpu_inv: f32, bound: f64) {
    let rel = (gpu_rstd as f64 / cpu_inv as f64 - 1.0).abs();
    assert!(
        rel <= bound,
        "{label}: rstd {gpu_rstd} vs the model's inv_rms {cpu_inv} (rel {rel:.2e})"
    );
}

/// The bound between the model's value and the kernel's value of one output of `bf16(v * inv)` computed with
/// two factors within 2e-6 of each other (`assert_rstd_close`). The products differ by < 2^-18 relative, so their
/// BF16 roundings differ by at most one step: one BF16 ulp <= 2^-7 * max(|model|, |kernel|). Rope dims then
/// rotate a pair whose inputs are each off by <= 2^-7 of the input pair's largest element (<= sqrt(2) * M, M the
/// larger |output| of the model's pair): the rotation moves an output by <= 2 * 2^-7 * sqrt(2) M, and the two
/// final BF16 roundings may differ by one more ulp (<= 2^-7 * sqrt(2) M): in all < 0.034 M, checked at 2^-4 M.
fn bf16_step_bound(d: usize, model: &[f32], got: &[f32], i: usize) -> f32 {
    if d >= NOPE_DIM {
        let j = i - i % 2;
        (2.0f32).powi(-4) * model[j].abs().max(model[j + 1].abs())
    } else {
        (2.0f32).powi(-7) * model[i].abs().max(got[i].abs())
    }
}

// ---------------------------------------------------------------------------------------------------------
// CPU: the host glue
// ---------------------------------------------------------------------------------------------------------

/// An encoded entry of the model's window KV (before its FP8 simulation) decodes exactly to the model's stored
/// KV (`fp8_sim` per 64 of the nope dims, BF16 rope dims): the entry is the model's cache value.
#[test]
fn kv_entry_decodes_to_the_models_fp8_kv() {
    let test = "kv_entry_decodes_to_the_models_fp8_kv";
    let mut rng = seeded(test, REPLAY_VAR);
    for rope in &ropes() {
        let raw = bf16_rows(16, HEAD_DIM, &mut rng);
        let w: Vec<f32> = bf16_rows(1, HEAD_DIM, &mut rng);
        for (i, row) in raw.chunks_exact(HEAD_DIM).enumerate() {
            let t = positions(16, &mut rng)[i].max(0) as usize;
            let mut model = window_kv_rope(row, &w, NOPE_DIM, rope, t, EPS);
            fp8_sim_inplace(&mut model[..NOPE_DIM], 64).unwrap();
            let entry = r::kv_entry_row(row, &w, t, rope, EPS).unwrap();
            let decoded = kv::decode_entry(&entry).unwrap();
            assert_bit_identical(test, "decoded entry vs the model's kv", &model, &decoded);
        }
    }
}

/// The indexer query encoding: per head, the codes times the folded power of two are the model's FP4-simulated
/// q exactly, the weight is the model's weight times that power of two exactly, and the folded scale is the
/// largest one with every code <= 384 (the head's largest block reaches [192, 384]).
#[test]
fn indexer_query_is_the_models_query_with_the_scale_folded() {
    let test = "indexer_query_is_the_models_query_with_the_scale_folded";
    let mut rng = seeded(test, REPLAY_VAR);
    for heads in [64usize, 4] {
        let scale = indexer_weight_scale(INDEX_HEAD_DIM, heads);
        for rope in &ropes() {
            for t in [
                0usize,
                127,
                128,
                (1 << 20) - 1,
                rng.random_range(0..1 << 20),
            ] {
                let qi = bf16_rows(heads, INDEX_HEAD_DIM, &mut rng);
                let w: Vec<f32> = (0..heads)
                    .map(|_| fbf16::round(rng.random_range(-4.0f32..4.0)))
                    .collect();
                let (model_q, model_w) = r::indexer_model_row(&qi, &w, t, rope, scale).unwrap();
                let (codes, w_out) = r::indexer_query_row(&qi, &w, t, rope, scale).unwrap();
                for h in 0..heads {
                    let fold = w_out[h] / model_w[h];
                    assert!(
                        model_w[h] == 0.0 || (fold.is_finite() && fold.log2().fract() == 0.0),
                        "{test}: head {h}: w {} is not the model's {} times a power of two",
                        w_out[h],
                        model_w[h]
                    );
                    let hq = &codes[h * INDEX_HEAD_DIM..(h + 1) * INDEX_HEAD_DIM];
                    let mq = &model_q[h * INDEX_HEAD_DIM..(h + 1) * INDEX_HEAD_DIM];
                    let decoded: Vec<f32> = hq.iter().map(|&c| e4m3::decode(c) * fold).collect();
                    assert_bit_identical(test, "codes x fold vs the model's q", mq, &decoded);
                    let top = hq
                        .iter()
                        .map(|&c| e4m3::decode(c).abs())
                        .fold(0.0, f32::max);
                    assert!(
                        (192.0..=384.0).contains(&top),
                        "{test}: head {h}: largest code {top} outside [192, 384]"
                    );
                }
            }
        }
    }
}

#[test]
fn ring_slot_rule() {
    let base = [0, 128, -1, 1000];
    // One token per sequence: slot = base + position % 128.
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 2048, 0, 0), Some(0));
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 2048, 0, 127), Some(127));
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 2048, 1, 128), Some(128));
    assert_eq!(
        r::ring_slot(&base, 1, WINDOW, 2048, 3, (1 << 20) - 1),
        Some(1127)
    );
    // Empty row, skipped sequence, entry outside the pool.
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 2048, 1, -1), None);
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 2048, 2, 5), None);
    assert_eq!(r::ring_slot(&base, 1, WINDOW, 1100, 3, 127), None);
    // Two tokens per sequence: rows 2, 3 belong to sequence 1.
    assert_eq!(r::ring_slot(&base, 2, WINDOW, 2048, 3, 129), Some(129));
}

#[test]
fn launcher_shape_rules() {
    assert!(check_rows_heads(1, 64).is_ok());
    assert!(check_rows_heads(65_535, 128).is_ok());
    let e = check_rows_heads(0, 64).unwrap_err().to_string();
    assert!(e.contains("rows = 0"), "{e}");
    assert!(check_rows_heads(65_536, 64).is_err());
    assert!(check_rows_heads(1, 0).is_err());
    assert!(check_ring(64, 1, 128).is_ok());
    assert!(check_ring(64, 2, 128).is_ok());
    let e = check_ring(64, 3, 128).unwrap_err().to_string();
    assert!(e.contains("not a multiple"), "{e}");
    let e = check_ring(256, 256, 128).unwrap_err().to_string();
    assert!(e.contains("share ring slots"), "{e}");
    assert!(check_ring(1, 1, 0).is_err());
}

// ---------------------------------------------------------------------------------------------------------
// GPU
// ---------------------------------------------------------------------------------------------------------

/// The q_lora RMSNorm (norm_quant's FP8 row kernel) at the Flash and Pro q_lora ranks: the FP8 1x128 codes and
/// scales are the model's `fp8_act_quant(rms_norm_bf16(qa, q_norm))` input to wq_b, run with the kernel's rstd,
/// bit for bit; the rstd within 4e-6 of the model's f64 `inv_rms` (the CTA of roundup32(d / 32) threads sums 32
/// products per thread, then a 5-level warp tree and 1 or 2 warp partials: (32 + 5 + 2) * 2^-24 = 2.3e-6 before
/// the square root halves it, plus 3 * 2^-24 of the final operations: < 1.4e-6, checked at 4e-6).
#[test]
#[ignore = "needs an H100/H200"]
fn q_lora_norm_is_the_models_wq_b_input() {
    let test = "q_lora_norm_is_the_models_wq_b_input";
    let gpu = gpu(test);
    let mut rng = seeded(test, REPLAY_VAR);
    for d in [
        ModelConfig::flash().q_lora_rank,
        ModelConfig::pro().q_lora_rank,
    ] {
        for rows in [1usize, 2, 64] {
            let label = format!("{test} q_lora {d} rows {rows}");
            let qa = bf16_rows(rows, d, &mut rng);
            let w = bf16_rows(1, d, &mut rng);
            let (dqa, dw) = (bf16_upload(&gpu, &qa), bf16_upload(&gpu, &w));
            let out = NormOutputs::alloc_poisoned(&gpu, OutFormat::Fp8, rows, d).unwrap();
            qkv_prep::q_lora_norm(&gpu, &gpu.stream, &dqa, &dw, EPS, &out.view()).unwrap();
            let h = out.download(&gpu).unwrap();
            let HostQuant::Fp8(got) = h.q else {
                panic!("{label}: not FP8 output")
            };
            let mut y = Vec::with_capacity(rows * d);
            for (row, x) in qa.chunks_exact(d).enumerate() {
                assert_rstd_within(&label, h.rstd[row], inv_rms(x, EPS), 4e-6);
                y.extend(rms_scale_bf16(x, &w, h.rstd[row]));
            }
            let want = fp8::quantize_act_1x128(&y, rows, d).unwrap();
            assert_bit_identical(&label, "fp8 codes", &want.data, &got.data);
            assert_bit_identical(&label, "ue8m0 scales", &want.scales, &got.scales);
        }
    }
}

/// The kernel's f32 sum of a head's 512 BF16 squares against the model's f64 sum: at most 20 roundings on any
/// term's path (15 sequential adds per lane after the exact first, then 5 butterfly levels) and all terms >= 0,
/// so the sums are within 20 * 2^-24 relative to first order; 21 * 2^-24 also covers the second-order term and
/// the f64 sum's own 511 * 2^-53. Scaling by 1/512 is exact.
const Q_MEAN_SUM_BOUND: f64 = 21.0 / (1u64 << 24) as f64;

/// Heads (of the ~25,300 `q_heads_match_the_model` checks) whose mean may round to the other BF16 neighbour than
/// the model's. Each needs the exact mean within `Q_MEAN_SUM_BOUND` of a BF16 midpoint, about 4e-4 of random
/// heads, and then the f32 sum's actual error (typically a few 2^-24) must reach across it: a host emulation of
/// the kernel's order found none in 16,000 activation-like heads. 8 is a cap against a systematic difference;
/// each such head is checked on its own (near a midpoint, r one BF16 step away).
const MAX_Q_MEAN_FLIPS: usize = 8;

/// Whether the exact mean of the head's BF16 squares lies within `Q_MEAN_SUM_BOUND` (relative) of a BF16 rounding
/// midpoint: only then may the kernel's f32 mean round to another BF16 value than the model's f64 one.
fn q_mean_near_bf16_midpoint(head: &[f32]) -> bool {
    let ss: f64 = head.iter().map(|&v| fbf16::round(v * v) as f64).sum();
    let mean = ss / head.len() as f64;
    bf16_round_f64(mean * (1.0 - Q_MEAN_SUM_BOUND))
        != bf16_round_f64(mean * (1.0 + Q_MEAN_SUM_BOUND))
}

/// q heads: Flash (64) and Pro (128) heads, M = 1, 2, 64, both RoPE tables, poisoned outputs. The kernel computes
/// the model's `head_rms_scale_bf16` order; only its sum of squares is in another order (f32 tree vs f64), so
/// the outputs are the model's bit for bit except on heads whose mean sits at a BF16 rounding midpoint (counted,
/// at most `MAX_Q_MEAN_FLIPS`; there the factor r is one BF16 step from the model's and q is the model's steps
/// at the kernel's r, bit for bit).
#[test]
#[ignore = "needs an H100/H200"]
fn q_heads_match_the_model() {
    let test = "q_heads_match_the_model";
    let gpu = gpu(test);
    let mut rng = seeded(test, REPLAY_VAR);
    let (mut heads_checked, mut mean_flips) = (0usize, 0usize);
    for heads in [64usize, 128] {
        for rows in [1usize, 2, 64] {
            for rope in &ropes() {
                let label = format!("{test} heads {heads} rows {rows}");
                let mut q = bf16_rows(rows * heads, HEAD_DIM, &mut rng);
                // Row 0: head 0 the one where the BF16 order and the f64 factor differ by a BF16 step
                // (tests/model_numerics.rs: r = 22, q[0] = 22.75), head 1 all zeros (r = bf16(rsqrt(bf16(eps)))).
                q[..2 * HEAD_DIM].fill(0.0);
                q[0] = 1.03125;
                let pos = positions(rows, &mut rng);
                let dq = bf16_upload(&gpu, &q);
                let (dp, df) = (gpu.upload(&pos).unwrap(), gpu.upload(&rope.freqs).unwrap());
                let dout = gpu
                    .poisoned::<bf16>(rows * heads * HEAD_DIM, POISON)
                    .unwrap();
                let drstd = gpu.poisoned::<f32>(rows * heads, POISON).unwrap();
                qkv_prep::q_heads(
                    &gpu,
                    &gpu.stream,
                    &dq,
                    &dp,
                    &df,
                    rows,
                    heads,
                    EPS,
                    &dout,
                    &drstd,
                )
                .unwrap();
                let out: Vec<bf16> = gpu.download(&dout).unwrap();
                let rstd = gpu.download(&drstd).unwrap();
                let row_len = heads * HEAD_DIM;
                for (row, &p) in pos.iter().enumerate() {
                    let got_bits = &out[row * row_len..(row + 1) * row_len];
                    let got_rstd = &rstd[row * heads..(row + 1) * heads];
                    if p < 0 {
                        assert!(
                            got_bits.iter().all(|v| v.to_bits() == 0xFFFF)
                                && got_rstd.iter().all(|v| v.to_bits() == u32::MAX),
                            "{label}: empty row {row} was written"
                        );
                        continue;
                    }
                    let src = &q[row * row_len..(row + 1) * row_len];
                    let got: Vec<f32> = got_bits.iter().map(|v| v.to_f32()).collect();
                    // Given the factor everything is order-free: bit for bit with the model's steps at the
                    // kernel's r, on every head.
                    let want = r::q_heads_row_with(src, got_rstd, p as usize, rope);
                    assert_bit_identical(
                        &label,
                        "q vs the model's steps at the kernel's r",
                        &want,
                        &got,
                    );
                    // The model's own function: bit for bit on every head whose mean the two sums round alike.
                    let model = r::q_heads_row(src, p as usize, rope, EPS);
                    if row == 0 {
                        assert_eq!(
                            (got[0], got_rstd[0]),
                            (22.75, 22.0),
                            "{label}: the hand head"
                        );
                    }
                    for (h, qh) in src.chunks_exact(HEAD_DIM).enumerate() {
                        let model_r = head_rms_scale_bf16(qh, EPS);
                        heads_checked += 1;
                        if got_rstd[h] == model_r {
                            let d = h * HEAD_DIM..(h + 1) * HEAD_DIM;
                            assert_bit_identical(
                                &label,
                                "q vs the model",
                                &model[d.clone()],
                                &got[d],
                            );
                            continue;
                        }
                        mean_flips += 1;
                        assert!(
                            q_mean_near_bf16_midpoint(qh),
                            "{label}: row {row} head {h}: r {} vs the model's {model_r}, but the mean is not \
                             within the f32 sum's error of a BF16 midpoint",
                            got_rstd[h]
                        );
                        let steps = (fbf16::bf16::from_f32(got_rstd[h]).to_bits() as i32
                            - fbf16::bf16::from_f32(model_r).to_bits() as i32)
                            .abs();
                        assert!(
                            fbf16::round(got_rstd[h]) == got_rstd[h] && steps == 1,
                            "{label}: row {row} head {h}: r {} is not one BF16 step from the model's {model_r}",
                            got_rstd[h]
                        );
                    }
                }
            }
        }
    }
    println!("{test}: {mean_flips} of {heads_checked} heads with the mean on the other side of a BF16 midpoint");
    assert!(
        mean_flips <= MAX_Q_MEAN_FLIPS,
        "{test}: {mean_flips} heads rounded their mean differently from the model (at most {MAX_Q_MEAN_FLIPS})"
    );
}

/// Window KV entries: M = 1, 2, 64, one and two tokens per sequence, one skipped sequence (base -1), a pool
/// poisoned with 0xFF: every written entry is the model's, every other byte untouched.
#[test]
#[ignore = "needs an H100/H200"]
fn kv_entries_match_the_model() {
    let test = "kv_entries_match_the_model";
    let gpu = gpu(test);
    let mut rng = seeded(test, REPLAY_VAR);
    for rows in [1usize, 2, 64] {
        for tokens_per_seq in [1usize, 2] {
            if !rows.is_multiple_of(tokens_per_seq) {
                continue;
            }
            for rope in &ropes() {
                let label = format!("{test} rows {rows} tokens/seq {tokens_per_seq}");
                let seqs = rows / tokens_per_seq;
                let kv_in = bf16_rows(rows, HEAD_DIM, &mut rng);
                let w = bf16_rows(1, HEAD_DIM, &mut rng);
                // Consecutive positions per sequence; the edge positions start the first sequences.
                let mut pos: Vec<i32> = Vec::with_capacity(rows);
                for s in 0..seqs {
                    let start = EDGE_POSITIONS
                        .get(s)
                        .copied()
                        .unwrap_or_else(|| rng.random_range(0..1 << 20));
                    for t in 0..tokens_per_seq {
                        pos.push(if start < 0 { -1 } else { start + t as i32 });
                    }
                }
                // Rings in reverse order, sequence 1 skipped (when there is one).
                let n_entries = (seqs + 1) * WINDOW;
                let base: Vec<i32> = (0..seqs)
                    .map(|s| {
                        if s == 1 {
                            -1
                        } else {
                            ((seqs - s) * WINDOW) as i32
                        }
                    })
                    .collect();
                let pool = gpu.poisoned::<u8>(n_entries * ENTRY_BYTES, POISON).unwrap();
                let drstd = gpu.poisoned::<f32>(rows, POISON).unwrap();
                let (dkv, dw) = (bf16_upload(&gpu, &kv_in), bf16_upload(&gpu, &w));
                let (dp, df, db) = (
                    gpu.upload(&pos).unwrap(),
                    gpu.upload(&rope.freqs).unwrap(),
                    gpu.upload(&base).unwrap(),
                );
                let ring = WindowRing {
                    pool: &pool,
                    seq_base: &db,
                    tokens_per_seq,
                    window: WINDOW,
                };
                qkv_prep::kv_entries(
                    &gpu,
                    &gpu.stream,
                    &dkv,
                    &dw,
                    &dp,
                    &df,
                    rows,
                    EPS,
                    &ring,
                    &drstd,
                )
                .unwrap();
                let got = gpu.download(&pool).unwrap();
                let rstd = gpu.download(&drstd).unwrap();
                let mut want = vec![POISON; n_entries * ENTRY_BYTES];
                for (row, &p) in pos.iter().enumerate() {
                    let Some(slot) = r::ring_slot(&base, tokens_per_seq, WINDOW, n_entries, row, p)
                    else {
                        assert_eq!(
                            rstd[row].to_bits(),
                            u32::MAX,
                            "{label}: row {row} wrote rstd"
                        );
                        continue;
                    };
                    let src = &kv_in[row * HEAD_DIM..(row + 1) * HEAD_DIM];
                    assert_rstd_close(&label, rstd[row], inv_rms(src, EPS));
                    let e = r::kv_entry_row_with(src, &w, rstd[row], p as usize, rope).unwrap();
                    want[slot * ENTRY_BYTES..(slot + 1) * ENTRY_BYTES].copy_from_slice(&e);
                    // The model's own factor: the decoded values within one FP8 / BF16 rounding step.
                    let model =
                        kv::decode_entry(&r::kv_entry_row(src, &w, p as usize, rope, EPS).unwrap())
                            .unwrap();
                    let mine = kv::decode_entry(&e).unwrap();
                    for d in 0..HEAD_DIM {
                        let (m, g) = (model[d], mine[d]);
                        let bound = if d < NOPE_DIM {
                            // One BF16 step of the input moves an e4m3 rounding by at most one e4m3 ulp
                            // (<= 2^-3 |v| for normals, 2^-9 * scale for subnormals) and the tile scale by at
                            // most one binade (the coarser grid's ulp is still <= 2^-3 |v|, its subnormal step
                            // 2^-8 * the finer scale).
                            let s = ue8m0::decode(e[kv::RECORD_BYTES + d / kv::TILE]);
                            0.125 * m.abs().max(g.abs()) + s * (2.0f32).powi(-7)
                        } else {
                            bf16_step_bound(d, &model, &mine, d)
                        };
                        assert!(
                            (m - g).abs() <= bound,
                            "{label}: row {row} dim {d}: model {m}, kernel {g}"
                        );
                    }
                }
                assert_bit_identical(&label, "pool bytes", &want, &got);
            }
        }
    }
}

/// Indexer query: 64 heads (Flash and Pro) and 4 (a partial CTA), M = 1, 2, 64, poisoned outputs; all
/// order-free, so bit for bit with the host encoding of the model's steps (weights_proj's f32 output rounded to BF16
/// by the kernel); and every row's visible key count, idle rows included.
#[test]
#[ignore = "needs an H100/H200"]
fn indexer_q_matches_the_model() {
    let test = "indexer_q_matches_the_model";
    let gpu = gpu(test);
    let mut rng = seeded(test, REPLAY_VAR);
    for heads in [64usize, 4] {
        let scale = indexer_weight_scale(INDEX_HEAD_DIM, heads);
        for rows in [1usize, 2, 64] {
            for rope in &ropes() {
                let label = format!("{test} heads {heads} rows {rows}");
                let qi = bf16_rows(rows * heads, INDEX_HEAD_DIM, &mut rng);
                // weights_proj's f32 output (not BF16 values: the kernel rounds them, as the model's bf16_linear).
                let w_f32: Vec<f32> = (0..rows * heads)
                    .map(|_| rng.random_range(-4.0f32..4.0))
                    .collect();
                let w: Vec<f32> = w_f32.iter().map(|&v| fbf16::round(v)).collect();
                let pos = positions(rows, &mut rng);
                let (dq, dw) = (bf16_upload(&gpu, &qi), gpu.upload(&w_f32).unwrap());
                let ratio = 4;
                let dnv = gpu.poisoned::<i32>(rows, POISON).unwrap();
                let (dp, df) = (gpu.upload(&pos).unwrap(), gpu.upload(&rope.freqs).unwrap());
                let dcodes = gpu
                    .poisoned::<u8>(rows * heads * INDEX_HEAD_DIM, POISON)
                    .unwrap();
                let dwo = gpu.poisoned::<f32>(rows * heads, POISON).unwrap();
                qkv_prep::indexer_q(
                    &gpu,
                    &gpu.stream,
                    &dq,
                    &dw,
                    &dp,
                    &df,
                    rows,
                    heads,
                    scale,
                    &dcodes,
                    &dwo,
                    Some(qkv_prep::VisibleKeys {
                        ratio,
                        num_valid: &dnv,
                    }),
                )
                .unwrap();
                let codes = gpu.download(&dcodes).unwrap();
                let w_out = gpu.download(&dwo).unwrap();
                // Every row's visible key count, idle rows (position < 0) included: (t + 1) / ratio, else 0.
                let want_nv: Vec<i32> = pos
                    .iter()
                    .map(|&t| if t >= 0 { (t + 1) / ratio as i32 } else { 0 })
                    .collect();
                assert_eq!(gpu.download(&dnv).unwrap(), want_nv, "{label}: num_valid");
                let row_len = heads * INDEX_HEAD_DIM;
                let mut want_codes = vec![POISON; rows * row_len];
                let mut want_w = vec![f32::from_bits(u32::MAX); rows * heads];
                for (row, &p) in pos.iter().enumerate().filter(|(_, &p)| p >= 0) {
                    let (c, wo) = r::indexer_query_row(
                        &qi[row * row_len..(row + 1) * row_len],
                        &w[row * heads..(row + 1) * heads],
                        p as usize,
                        rope,
                        scale,
                    )
                    .unwrap();
                    want_codes[row * row_len..(row + 1) * row_len].copy_from_slice(&c);
                    want_w[row * heads..(row + 1) * heads].copy_from_slice(&wo);
                }
                assert_bit_identical(&label, "q codes", &want_codes, &codes);
                assert_bit_identical(&label, "w", &want_w, &w_out);
            }
        }
    }
}

/// The decode-sized call (Flash, 8 tokens; the three parts in one `prep` launch, as the engine runs them) captured
/// once in a graph, replayed after new positions and ring bases are written to the device: the outputs follow the
/// new positions, each part bit for bit the model's steps.
#[test]
#[ignore = "needs an H100/H200"]
fn graph_replay_follows_device_positions() {
    let test = "graph_replay_follows_device_positions";
    let gpu = gpu(test);
    let mut rng = seeded(test, REPLAY_VAR);
    let (rows, heads, index_heads) = (8usize, 64usize, 64usize);
    let mut p = Problem::new(&gpu, rows, heads, index_heads, rng.random()).unwrap();
    let cfg = ModelConfig::flash();
    let rope = layer_rope(
        &cfg,
        cfg.compress_ratios.iter().position(|&m| m > 0).unwrap(),
    );
    p.run(&gpu, "all").unwrap();
    let graph = gpu.capture(|| p.run(&gpu, "all")).unwrap();
    let host_bf16 = |s: &cudarc::driver::CudaSlice<bf16>| -> Vec<f32> {
        gpu.download(s)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect()
    };
    let (q_in, kv_in, qi_in) = (host_bf16(&p.q_in), host_bf16(&p.kv_in), host_bf16(&p.qi_in));
    // weights_proj's f32 output, as the model rounds it.
    let w_in: Vec<f32> = gpu
        .download(&p.w_in)
        .unwrap()
        .iter()
        .map(|&v| fbf16::round(v))
        .collect();
    let kv_norm = host_bf16(&p.kv_norm);
    for round in 0..3 {
        let pos: Vec<i32> = (0..rows)
            .map(|i| match (round, i) {
                (_, 0) => [0, 127, (1 << 20) - 1][round],
                (1, 5) => -1,
                _ => rng.random_range(0..1 << 20),
            })
            .collect();
        let base: Vec<i32> = (0..rows)
            .map(|i| (((i + round) % rows) * WINDOW) as i32)
            .collect();
        gpu.write(&gpu.stream, &mut p.positions, &pos).unwrap();
        gpu.write(&gpu.stream, &mut p.seq_base, &base).unwrap();
        gpu.fill_bytes(&mut p.pool, POISON).unwrap();
        gpu.fill_bytes(&mut p.q_out, POISON).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let label = format!("{test} round {round}");
        let q_out = host_bf16(&p.q_out);
        let q_rstd = gpu.download(&p.q_rstd).unwrap();
        let kv_rstd = gpu.download(&p.kv_rstd).unwrap();
        let pool = gpu.download(&p.pool).unwrap();
        let codes = gpu.download(&p.q_codes).unwrap();
        let w_out = gpu.download(&p.w_out).unwrap();
        for (row, &t) in pos.iter().enumerate() {
            let ql = heads * HEAD_DIM;
            if t < 0 {
                assert!(
                    q_out[row * ql..(row + 1) * ql].iter().all(|v| v.is_nan()),
                    "{label}: empty row written"
                );
                continue;
            }
            let t = t as usize;
            let want = r::q_heads_row_with(
                &q_in[row * ql..(row + 1) * ql],
                &q_rstd[row * heads..(row + 1) * heads],
                t,
                &rope,
            );
            assert_bit_identical(&label, "q", &want, &q_out[row * ql..(row + 1) * ql]);
            let slot = base[row] as usize + t % WINDOW;
            let e = r::kv_entry_row_with(
                &kv_in[row * HEAD_DIM..(row + 1) * HEAD_DIM],
                &kv_norm,
                kv_rstd[row],
                t,
                &rope,
            )
            .unwrap();
            assert_bit_identical(
                &label,
                "entry",
                &e,
                &pool[slot * ENTRY_BYTES..(slot + 1) * ENTRY_BYTES],
            );
            let il = index_heads * INDEX_HEAD_DIM;
            let (c, wo) = r::indexer_query_row(
                &qi_in[row * il..(row + 1) * il],
                &w_in[row * index_heads..(row + 1) * index_heads],
                t,
                &rope,
                p.w_scale,
            )
            .unwrap();
            assert_bit_identical(&label, "indexer q", &c, &codes[row * il..(row + 1) * il]);
            assert_bit_identical(
                &label,
                "indexer w",
                &wo,
                &w_out[row * index_heads..(row + 1) * index_heads],
            );
        }
    }
}
