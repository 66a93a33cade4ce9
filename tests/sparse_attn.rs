//! sparse_attn: CPU tests of the reference (entry codec, candidate sets, RoPE, attention with sink, FP8 vs
//! BF16 precision), of the split plans, routing and bench config, of `megamoe exec`; GPU tests of every kernel
//! against the reference (`#[ignore]`d: run with `--include-ignored` on an H100/H200).
//!
//! One file over 800 lines because it is one test crate: the CPU mirrors of the kernels' identities, the
//! routing pins and the GPU checks share the fixtures of `tests/common/sparse_attn.rs` and one build.

mod common;

use common::sparse_attn::{
    assert_bf16_within_reference, assert_same_bits, check_path, fixed_rng as seeded, normal,
    run_poisoned, DataGen, DeviceProblem, HostProblem, REPLAY_VAR,
};
use half::bf16;
use megamoe::formats::{e4m3, ue8m0};
use megamoe::gpu::timing::capture_on;
use megamoe::gpu::{fill_bytes_on, Gpu};
use megamoe::ops::sparse_attn::bench::{baseline_plan, Variant};
use megamoe::ops::sparse_attn::reference::{
    self, build_candidates, decode_attention, decode_entry, encode_entry, precision_per_head,
    rope_freqs, rope_rotate, visible_compressed, window_positions, CompressedSelection,
    DecodeProblem, QueryPrecision, SequenceLayout,
};
use megamoe::ops::sparse_attn::{
    check_write_indices, decode, write_entries, DecodeShape, DecodeWorkspace, KvSource, Path,
    PlanCosts, SplitPlan, ENTRY_BYTES, HEAD_DIM, NOPE_DIM, ROPE_DIM, WINDOW,
};
use rand::Rng;

/// The routed path as a bench variant (what the fixtures run).
const FP8: Variant = Variant::Path(Path::Fp8);

// =========================================================================================================
// CPU tests
// =========================================================================================================

#[test]
fn entry_codec_layout_and_rounding() {
    let mut rng = seeded("entry_codec_layout_and_rounding", 0xC0DEC);
    for case in 0..200 {
        let mag = f32::powi(2.0, rng.random_range(-12..12));
        let x: Vec<f32> = (0..HEAD_DIM).map(|_| normal(&mut rng) * mag).collect();
        let e = encode_entry(&x).unwrap();
        assert_eq!(e[ENTRY_BYTES - 1], 0, "pad byte");
        let y = decode_entry(&e).unwrap();
        for t in 0..7 {
            let tile = &x[t * 64..(t + 1) * 64];
            let amax = tile.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-4);
            let scale = ue8m0::decode(e[576 + t]);
            // the smallest power of two that brings amax under 448
            assert!(
                amax / scale <= 448.0 && amax / scale > 224.0,
                "case {case} tile {t}: amax {amax} scale {scale}"
            );
            for d in 0..64 {
                let (xi, yi) = (tile[d] / scale, y[t * 64 + d] / scale);
                assert_eq!(
                    e[t * 64 + d],
                    e4m3::encode_rne(xi),
                    "case {case} dim {}",
                    t * 64 + d
                );
                // within half an e4m3 step: 2^-4 relative for normals, 2^-10 absolute for subnormals
                let bound = (xi.abs() * f32::powi(2.0, -4)).max(f32::powi(2.0, -10));
                assert!(
                    (xi - yi).abs() <= bound,
                    "case {case} dim {}: {xi} -> {yi}",
                    t * 64 + d
                );
            }
        }
        for r in 0..ROPE_DIM {
            let bits = u16::from_le_bytes([e[448 + 2 * r], e[449 + 2 * r]]);
            assert_eq!(
                bits,
                bf16::from_f32(x[NOPE_DIM + r]).to_bits(),
                "case {case} rope {r}"
            );
            assert_eq!(y[NOPE_DIM + r], bf16::from_f32(x[NOPE_DIM + r]).to_f32());
        }
    }
    // A hand-checked entry: tile 0 amax exactly 448 -> scale 2^0 (code 127), 1.0 -> e4m3 0x38.
    let mut x = vec![0f32; HEAD_DIM];
    x[0] = 448.0;
    x[1] = 1.0;
    x[64] = -0.5; // tile 1 amax 0.5 -> scale 2^ceil(log2(0.5/448)) = 2^-9 (code 118); -0.5/2^-9 = -256 -> 0xF8
    let e = encode_entry(&x).unwrap();
    assert_eq!((e[0], e[1], e[576], e[577]), (0x7E, 0x38, 127, 118));
    assert_eq!(e[64], 0xF8);
    assert!(encode_entry(&[0.0; 511]).is_err());
    let mut bad = vec![0f32; HEAD_DIM];
    bad[3] = f32::NAN;
    assert!(encode_entry(&bad).is_err());
}

#[test]
fn candidate_sets_match_visibility_rule() {
    let layout = SequenceLayout {
        window_base: 1000,
        compressed_base: 5000,
    };
    for m in [4usize, 128] {
        for t in (0..2000).chain([4095, 4096, 65_535]) {
            // brute force over token coverage: entry j is visible iff every token it covers is <= t
            let visible: Vec<usize> = (0..(t + 1) / m + 2)
                .filter(|&j| (j * m..(j + 1) * m).all(|tok| tok <= t))
                .collect();
            assert_eq!(visible_compressed(t, m), visible.len(), "m {m} t {t}");
            let sel = if m == 128 {
                CompressedSelection::All { ratio: m }
            } else {
                // an indexer top-k: every third visible entry, newest first, capped at 512
                let picked: Vec<usize> =
                    visible.iter().rev().step_by(3).take(512).cloned().collect();
                let c = build_candidates(
                    t,
                    layout,
                    CompressedSelection::TopK {
                        ratio: m,
                        selected: &picked,
                    },
                )
                .unwrap();
                let expect_window: Vec<i32> = window_positions(t)
                    .map(|p| 1000 + (p % 128) as i32)
                    .collect();
                assert_eq!(&c[..expect_window.len()], &expect_window[..], "m {m} t {t}");
                assert_eq!(c.len(), expect_window.len() + picked.len());
                continue;
            };
            let c = build_candidates(t, layout, sel).unwrap();
            let win = t.min(127) + 1;
            assert_eq!(c.len(), win + visible.len(), "m {m} t {t}");
            for (k, p) in window_positions(t).enumerate() {
                assert_eq!(c[k], 1000 + (p % 128) as i32);
            }
            for (k, &j) in visible.iter().enumerate() {
                assert_eq!(c[win + k], 5000 + j as i32);
            }
        }
    }
    // boundaries by hand: t=126 -> 127 window tokens, t=127 -> 128 and HCA entry 0 becomes visible.
    let hca = |t| build_candidates(t, layout, CompressedSelection::All { ratio: 128 }).unwrap();
    assert_eq!(hca(126).len(), 127);
    assert_eq!(hca(127).len(), 129);
    assert_eq!(hca(128).len(), 129);
    assert_eq!(*window_positions(200).start(), 73);
    // CSA at t=3: entry 0 (tokens 0..3) visible, entry 1 not; both window and compressed cover tokens 0..3.
    assert_eq!(visible_compressed(2, 4), 0);
    assert_eq!(visible_compressed(3, 4), 1);
    let c = build_candidates(
        3,
        layout,
        CompressedSelection::TopK {
            ratio: 4,
            selected: &[0],
        },
    )
    .unwrap();
    assert_eq!(c, vec![1000, 1001, 1002, 1003, 5000]);
    assert!(build_candidates(
        3,
        layout,
        CompressedSelection::TopK {
            ratio: 4,
            selected: &[1]
        }
    )
    .is_err());
    assert!(build_candidates(
        6,
        layout,
        CompressedSelection::TopK {
            ratio: 4,
            selected: &[0, 0]
        }
    )
    .is_err());
    assert_eq!(
        build_candidates(5, layout, CompressedSelection::None)
            .unwrap()
            .len(),
        6
    );
}

#[test]
fn rope_frequencies_and_inverse() {
    let f = rope_freqs(160_000.0, true);
    let plain = rope_freqs(160_000.0, false);
    for i in 0..32 {
        if i <= 15 {
            assert_eq!(
                f[i], plain[i],
                "pair {i} below YaRN's low bound is unchanged"
            );
        } else if i >= 25 {
            assert!(
                (f[i] / (plain[i] / 16.0) - 1.0).abs() < 1e-6,
                "pair {i} above high is divided by 16"
            );
        } else {
            assert!(f[i] < plain[i] && f[i] > plain[i] / 16.0, "pair {i} blends");
        }
    }
    assert_eq!(rope_freqs(10_000.0, false)[0], 1.0);
    let mut rng = seeded("rope_frequencies_and_inverse", 0x2071);
    for _ in 0..100 {
        let t: i32 = rng.random_range(0..1_048_576);
        let v: Vec<f64> = (0..ROPE_DIM).map(|_| normal(&mut rng) as f64).collect();
        let mut w = v.clone();
        rope_rotate(&mut w, t, &f, false);
        rope_rotate(&mut w, t, &f, true);
        for i in 0..ROPE_DIM {
            assert!(
                (w[i] - v[i]).abs() < 1e-12,
                "t {t} dim {i}: {} vs {}",
                w[i],
                v[i]
            );
        }
    }
}

/// One candidate, sink -inf: the output is that entry, its rope dims rotated back by the QUERY position:
/// the entry was rotated by its own position p, so the result is R(p - t) v (rotation by the relative offset).
#[test]
fn inverse_rope_uses_the_query_position() {
    let mut rng = seeded("inverse_rope_uses_the_query_position", 0x1A4);
    let freqs = rope_freqs(160_000.0, true);
    let (p_entry, t) = (300i32, 345i32);
    let v: Vec<f32> = (0..HEAD_DIM).map(|_| normal(&mut rng)).collect();
    let mut rotated: Vec<f64> = v.iter().map(|&x| bf16::from_f32(x).to_f64()).collect();
    let base = rotated.clone();
    rope_rotate(&mut rotated[NOPE_DIM..], p_entry, &freqs, false);
    let entry_in: Vec<f32> = rotated.iter().map(|&x| x as f32).collect();
    let pool = encode_entry(&entry_in).unwrap().to_vec();
    let stored = decode_entry(&pool).unwrap();
    let q: Vec<bf16> = (0..64 * HEAD_DIM)
        .map(|_| bf16::from_f32(normal(&mut rng)))
        .collect();
    let sinks = vec![f32::NEG_INFINITY; 64];
    let p = DecodeProblem {
        batch: 1,
        heads: 64,
        q: &q,
        pool: &pool,
        candidates: &[0],
        stride: 1,
        lengths: &[1],
        positions: &[t],
        sinks: &sinks,
        freqs: &freqs,
    };
    let r = decode_attention(&p, QueryPrecision::Fp8Tiles).unwrap();
    for h in [0usize, 63] {
        let o = &r.out[h * HEAD_DIM..(h + 1) * HEAD_DIM];
        for d in 0..NOPE_DIM {
            assert_eq!(
                o[d], stored[d] as f64,
                "head {h} nope dim {d}: p = 1, the entry itself"
            );
        }
        // Exactly the stored (BF16) rope dims rotated by -t ...
        let mut by_query: Vec<f64> = stored[NOPE_DIM..].iter().map(|&v| v as f64).collect();
        rope_rotate(&mut by_query, t, &freqs, true);
        // ... and not by the entry's position.
        let mut by_entry: Vec<f64> = stored[NOPE_DIM..].iter().map(|&v| v as f64).collect();
        rope_rotate(&mut by_entry, p_entry, &freqs, true);
        let mut entry_gap = 0f64;
        for i in 0..ROPE_DIM {
            assert!(
                (o[NOPE_DIM + i] - by_query[i]).abs() < 1e-12,
                "head {h} rope dim {i}: {} vs {}",
                o[NOPE_DIM + i],
                by_query[i]
            );
            entry_gap = entry_gap.max((o[NOPE_DIM + i] - by_entry[i]).abs());
        }
        assert!(
            entry_gap > 0.1,
            "rotating back by the entry position would give the same output"
        );
        for i in 0..32 {
            // R(p) then R(-t) = R(p - t): the relative offset. Bound: BF16 storage of the rotated pair (2^-9
            // relative per component) plus the f32 angle rounding (|angle| <= 345 rad: ~2^-15 rad).
            let (x, y) = (base[NOPE_DIM + 2 * i], base[NOPE_DIM + 2 * i + 1]);
            let a = (p_entry - t) as f64 * freqs[i] as f64;
            let (sn, cs) = a.sin_cos();
            let want = [x * cs - y * sn, x * sn + y * cs];
            let norm = (x * x + y * y).sqrt();
            let err = (o[NOPE_DIM + 2 * i] - want[0])
                .abs()
                .max((o[NOPE_DIM + 2 * i + 1] - want[1]).abs());
            assert!(
                err <= norm * (f64::powi(2.0, -8) + 1e-4) + 1e-6,
                "head {h} pair {i}: {:?} vs {want:?}",
                &o[NOPE_DIM + 2 * i..NOPE_DIM + 2 * i + 2]
            );
        }
    }
}

#[test]
fn attention_with_sink_by_hand() {
    // Two entries whose scores are known exactly: q = 16 e_0, K_0 = e_0, K_1 = 0 -> s = (16/sqrt(512), 0).
    let mut x0 = vec![0f32; HEAD_DIM];
    x0[0] = 1.0;
    let x1 = vec![0f32; HEAD_DIM];
    let mut pool = encode_entry(&x0).unwrap().to_vec();
    pool.extend_from_slice(&encode_entry(&x1).unwrap());
    let mut q = vec![bf16::ZERO; 64 * HEAD_DIM];
    for h in 0..64 {
        q[h * HEAD_DIM] = bf16::from_f32(16.0); // exact in BF16 and in the FP8 tile code (256 * 2^-4)
    }
    let s0 = 16.0f64 / 512f64.sqrt();
    let sinks: Vec<f32> = (0..64).map(|h| h as f32 * 0.1 - 3.0).collect();
    let freqs = rope_freqs(10_000.0, false);
    let p = DecodeProblem {
        batch: 2,
        heads: 64,
        q: &[q.clone(), q].concat(),
        pool: &pool,
        candidates: &[0, 1, -1, 1, 0, 0],
        stride: 3,
        lengths: &[2, 0],
        positions: &[5, 5],
        sinks: &sinks,
        freqs: &freqs,
    };
    for prec in [QueryPrecision::Fp8Tiles, QueryPrecision::Bf16] {
        let r = decode_attention(&p, prec).unwrap();
        for (h, &sink) in sinks.iter().enumerate() {
            // M = s0; p_0 = 1 (exact in BF16), V_1 = 0, so o[0] = 1 / (1 + e^(0 - s0) + e^(sink - s0)).
            let m = s0;
            let want = 1.0 / (1.0 + (0.0 - m).exp() + (sink as f64 - m).exp());
            assert!(
                (r.out[h * HEAD_DIM] - want).abs() < 1e-12,
                "{prec:?} head {h}: {} vs {want}",
                r.out[h * HEAD_DIM]
            );
            assert!(r.out[h * HEAD_DIM + 1..(h + 1) * HEAD_DIM]
                .iter()
                .all(|&v| v == 0.0));
            // sequence 1 has no candidates: o = 0
            assert!(r.out[(64 + h) * HEAD_DIM..(65 + h) * HEAD_DIM]
                .iter()
                .all(|&v| v == 0.0));
        }
    }
    let mut bad = p;
    bad.candidates = &[0, 2, -1, 1, 0, 0];
    assert!(
        decode_attention(&bad, QueryPrecision::Bf16).is_err(),
        "index 2 is outside a 2-entry pool"
    );
    bad.candidates = &[0, -2, -1, 1, 0, 0];
    assert!(
        decode_attention(&bad, QueryPrecision::Bf16).is_err(),
        "-2 is not the invalid marker"
    );
    bad = p;
    bad.lengths = &[4, 0];
    assert!(
        decode_attention(&bad, QueryPrecision::Bf16).is_err(),
        "length above stride"
    );
}

/// FP8 path (q quantized per 64-tile) against the all-BF16 computation on the same cache: cosine >= 0.999
/// per head (DSV4 Flash shape: 64 heads, 128 + 512 candidates; and a Pro-like 128 heads).
#[test]
fn fp8_query_precision_against_bf16() {
    let mut rng = seeded("fp8_query_precision_against_bf16", 0xF8F8);
    for (heads, lens) in [(64usize, vec![640usize, 200]), (128, vec![1152])] {
        let hp = HostProblem::random(&mut rng, heads, &lens, false);
        let fp8 = decode_attention(&hp.problem(), QueryPrecision::Fp8Tiles).unwrap();
        let b16 = decode_attention(&hp.problem(), QueryPrecision::Bf16).unwrap();
        let r = precision_per_head(&fp8.out, &b16.out);
        println!(
            "heads {heads} lengths {lens:?}: min cosine {:.6}, max rel err {:.4e} (row {})",
            r.min_cosine, r.max_rel_err, r.worst_row
        );
        assert!(
            r.min_cosine >= 0.999,
            "min cosine {} at row {}",
            r.min_cosine,
            r.worst_row
        );
        assert!(
            r.min_cosine < 1.0,
            "the FP8 query must actually differ from BF16"
        );
    }
}

// =========================================================================================================
// GPU tests: every kernel against the CPU reference with poisoned outputs (run with --include-ignored)
// =========================================================================================================

/// The KV writer quantizes each vector into its device-given slot bit-exactly like the CPU codec; slots of -1
/// (unused) skip their vector, and entries that are no destination keep their poison.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_kv_writer_matches_codec_and_skips_unused_slots() {
    let test = "gpu_kv_writer_matches_codec_and_skips_unused_slots";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let gen = DataGen::new(&mut rng);
    let (n_entries, n) = (300usize, 257usize);
    let mut x: Vec<f32> = Vec::with_capacity(n * HEAD_DIM);
    for i in 0..n {
        // a different magnitude per vector so the tile scales cover a wide exponent range
        let mag = f32::powi(2.0, rng.random_range(-6..6));
        x.extend(gen.kv(&mut rng, i as i32).iter().map(|v| v * mag));
    }
    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    // destinations: a shuffled subset of the pool, every 10th slot unused (-1)
    let mut dst: Vec<i32> = (0..n_entries as i32).collect();
    for i in (1..dst.len()).rev() {
        dst.swap(i, rng.random_range(0..=i));
    }
    dst.truncate(n);
    for (i, d) in dst.iter_mut().enumerate() {
        if i % 10 == 3 {
            *d = -1;
        }
    }
    let used: Vec<i32> = dst.iter().copied().filter(|&d| d >= 0).collect();
    check_write_indices(&used, n_entries).unwrap();
    assert!(check_write_indices(&dst, n_entries).is_err());
    let d_dst = gpu.upload(&dst).unwrap();
    let stream = gpu.stream.clone();
    for use_bf16 in [false, true] {
        let mut pool = gpu
            .poisoned::<u8>(n_entries * ENTRY_BYTES, common::POISON)
            .unwrap();
        let (d_x, d_xb) = (gpu.upload(&x).unwrap(), gpu.upload(&xb).unwrap());
        let src = if use_bf16 {
            KvSource::Bf16(&d_xb)
        } else {
            KvSource::F32(&d_x)
        };
        write_entries(&gpu, &stream, &mut pool, src, &d_dst, n).unwrap();
        let got = gpu.download(&pool).unwrap();
        let mut written = vec![false; n_entries];
        for (i, &d) in dst.iter().enumerate() {
            if d < 0 {
                continue;
            }
            let v: Vec<f32> = if use_bf16 {
                xb[i * 512..(i + 1) * 512]
                    .iter()
                    .map(|b| b.to_f32())
                    .collect()
            } else {
                x[i * 512..(i + 1) * 512].to_vec()
            };
            let want = encode_entry(&v).unwrap();
            let e = d as usize;
            written[e] = true;
            let g = &got[e * ENTRY_BYTES..(e + 1) * ENTRY_BYTES];
            if let Some(k) = (0..ENTRY_BYTES).find(|&k| g[k] != want[k]) {
                panic!("bf16 source {use_bf16}: vector {i} -> entry {e}: first mismatching byte {k}: gpu {:#04x} cpu {:#04x}", g[k], want[k]);
            }
        }
        for (e, w) in written.iter().enumerate() {
            if !w {
                assert!(
                    got[e * ENTRY_BYTES..(e + 1) * ENTRY_BYTES]
                        .iter()
                        .all(|&b| b == common::POISON),
                    "entry {e} was not a destination but changed"
                );
            }
        }
    }
}

/// Tiles per split of [`baseline_plan`] for a host problem on this GPU.
fn auto_tiles_per_split(gpu: &Gpu, hp: &HostProblem) -> usize {
    baseline_plan(gpu.info.sm_count as usize, &hp.shape()).tiles_per_split
}

/// The FP8 path against the reference: lengths 0, 1, 127, 129 (tile edges), 640 (Flash CSA), 1152 (Pro
/// CSA) with -1 holes, 64 and 128 heads, under one split, 1 / 2 tiles per split, its own plan and the baseline's.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_matches_reference() {
    let test = "gpu_decode_fp8_matches_reference";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp64 = HostProblem::random(&mut rng, 64, &[0, 1, 127, 129, 640, 1152], true);
    let hp128 = HostProblem::random(&mut rng, 128, &[1152, 129, 0], true);
    {
        let v = FP8;
        let hp = &hp64;
        check_path("fp8 h64 single-split", &gpu, hp, v, Some(1000));
        check_path("fp8 h64 split by 2 tiles", &gpu, hp, v, Some(2));
        check_path("fp8 h64 own plan", &gpu, hp, v, None);
        check_path("fp8 h64 one tile per split", &gpu, hp, v, Some(1));
        let t = auto_tiles_per_split(&gpu, hp);
        check_path("fp8 h64 baseline plan", &gpu, hp, v, Some(t));
        let hp = &hp128;
        check_path("fp8 h128 single-split", &gpu, hp, v, Some(1000));
        check_path("fp8 h128 own plan", &gpu, hp, v, None);
        let t = auto_tiles_per_split(&gpu, hp);
        check_path("fp8 h128 baseline plan", &gpu, hp, v, Some(t));
    }
}

/// 128 heads with lengths off the tile grid (65, 300) next to the Flash and Pro CSA lengths, under both the
/// kernel's own plan and the baseline's plan.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_h128_mixed_lengths() {
    let test = "gpu_decode_fp8_h128_mixed_lengths";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp = HostProblem::random(&mut rng, 128, &[640, 1152, 65, 300], true);
    {
        let v = FP8;
        check_path("fp8 h128 mixed own plan", &gpu, &hp, v, None);
        let t = auto_tiles_per_split(&gpu, &hp);
        check_path("fp8 h128 mixed baseline plan", &gpu, &hp, v, Some(t));
    }
}

/// HCA at 1M context (128 window + 8192 compressed = 8320 candidates) under split-KV.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_long_hca_split_kv() {
    let test = "gpu_decode_fp8_long_hca_split_kv";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp = HostProblem::random(&mut rng, 64, &[8320], true);
    {
        let v = FP8;
        check_path("fp8 hca 8320 own plan", &gpu, &hp, v, None);
        let t = auto_tiles_per_split(&gpu, &hp);
        check_path("fp8 hca 8320 baseline plan", &gpu, &hp, v, Some(t));
        check_path("fp8 hca 8320 split 16 tiles", &gpu, &hp, v, Some(16));
    }
}

/// The BF16-staging baseline against its reference (BF16 q), and each FP8 path's output within cosine 0.999 of
/// it per head.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_bf16_staging_matches_reference_and_precision() {
    let test = "gpu_decode_bf16_staging_matches_reference_and_precision";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp = HostProblem::random(&mut rng, 64, &[640, 0, 129, 1], true);
    let (b16, _) = check_path("bf16 staging h64", &gpu, &hp, Variant::Bf16Staging, None);
    check_path(
        "bf16 staging h64 split 2",
        &gpu,
        &hp,
        Variant::Bf16Staging,
        Some(2),
    );
    {
        let v = FP8;
        let (fp8, _) = check_path("fp8 h64 (precision)", &gpu, &hp, v, None);
        let r = precision_per_head(&fp8, &b16);
        println!(
            "GPU {v:?} vs GPU BF16 staging per head: min cosine {:.6}, max rel err {:.4e} (row {})",
            r.min_cosine, r.max_rel_err, r.worst_row
        );
        assert!(
            r.min_cosine >= 0.999,
            "{v:?}: per-head cosine {} at row {}",
            r.min_cosine,
            r.worst_row
        );
    }
    let hp = HostProblem::random(&mut rng, 128, &[1152, 300], true);
    check_path("bf16 staging h128", &gpu, &hp, Variant::Bf16Staging, None);
}

/// The FP8 paths at the edges of their pipelines: tile edges (0, 1, 127, 129), lists of 4, 10 and 18 tiles, so
/// that the 4-slot candidate-index ring and the two BF16 tiles wrap several times, the register prefetch two tiles
/// ahead runs off the end of a split at every phase (splits of 1, 2 and 3 tiles), and -1 holes; 64 and 128 heads.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_pipeline_edges() {
    let test = "gpu_decode_fp8_pipeline_edges";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp64 = HostProblem::random(&mut rng, 64, &[0, 1, 127, 129, 640, 1152, 200], true);
    let hp128 = HostProblem::random(&mut rng, 128, &[1152, 129, 0, 65, 300, 640], true);
    {
        let v = FP8;
        for (label, t) in [
            ("single-split", Some(1000)),
            ("split by 2 tiles", Some(2)),
            ("split by 3 tiles", Some(3)),
            ("own plan", None),
            ("one tile per split", Some(1)),
        ] {
            check_path(&format!("fp8 h64 {label}"), &gpu, &hp64, v, t);
        }
        check_path("fp8 h128 single-split", &gpu, &hp128, v, Some(1000));
        check_path("fp8 h128 own plan", &gpu, &hp128, v, None);
        let t = auto_tiles_per_split(&gpu, &hp128);
        check_path("fp8 h128 baseline plan", &gpu, &hp128, v, Some(t));
    }
}

// ---------------------------------------------------------------------------------------------------------
// The FP8 path under every split plan, repeated calls on one workspace, both split merges, and CUDA-graph replay
// with device inputs changed between replays: every output within tolerance of the CPU reference, repeats and
// the two merges bit for bit equal.
// ---------------------------------------------------------------------------------------------------------

/// `path` (an FP8 path) `calls` times on one workspace (output and workspace poisoned before every call, so a call
/// can only pass with what it wrote itself): every call's output within tolerance of the CPU reference `r` at
/// every element, and every call after the first bit-identical to the first. Returns the first call's output.
fn check_fp8_calls(
    test: &str,
    gpu: &Gpu,
    path: Path,
    hp: &HostProblem,
    r: &reference::DecodeReference,
    plan: SplitPlan,
    calls: usize,
) -> Vec<bf16> {
    assert!(calls >= 1, "{test}: at least one call");
    let shape = hp.shape();
    let dp = DeviceProblem::upload(gpu, hp);
    let inp = dp.inputs();
    let n = shape.batch * shape.heads * HEAD_DIM;
    let (_arena, ws) = DecodeWorkspace::with_arena(gpu, &shape, plan, false).unwrap();
    let stream = gpu.stream.clone();
    let mut first: Option<Vec<bf16>> = None;
    for call in 0..calls {
        ws.poison(&stream).unwrap();
        let mut out = gpu.poisoned::<bf16>(n, common::POISON).unwrap();
        decode(gpu, &stream, path, &shape, &inp, &ws, &mut out).unwrap();
        let got = gpu.download(&out).unwrap();
        let label = format!(
            "{test}: {path:?} call {call}, shape {shape:?} lengths {:?} plan {plan:?}",
            hp.lengths
        );
        assert_bf16_within_reference(&label, &shape, &got, r);
        match &first {
            None => first = Some(got),
            Some(want) => assert_same_bits(&label, &shape, want, &got),
        }
    }
    println!(
        "{test}: {path:?} within tolerance of the reference and bit-identical over {calls} calls, lengths {:?} heads {} plan {plan:?}",
        hp.lengths, shape.heads
    );
    first.expect("calls >= 1")
}

/// Every split plan a problem can meet: one split, 1 / 2 / 3 tiles per split, the routed FP8 plan, both cost
/// models' plans and the baseline's plan on this GPU.
fn all_plans(gpu: &Gpu, hp: &HostProblem) -> Vec<(String, SplitPlan)> {
    let shape = hp.shape();
    let sms = gpu.info.sm_count as usize;
    let mut plans = vec![
        (
            "single split".to_string(),
            SplitPlan::with_tiles_per_split(&shape, 1000).unwrap(),
        ),
        ("routed fp8".to_string(), SplitPlan::fp8(sms, &shape)),
        (
            "estimated costs".to_string(),
            SplitPlan::by_cost(sms, &shape, &PlanCosts::ESTIMATED),
        ),
        (
            "fitted costs".to_string(),
            SplitPlan::by_cost(sms, &shape, &PlanCosts::FITTED),
        ),
        ("baseline".to_string(), baseline_plan(sms, &shape)),
    ];
    for t in [1, 2, 3] {
        plans.push((
            format!("{t} tiles per split"),
            SplitPlan::with_tiles_per_split(&shape, t).unwrap(),
        ));
    }
    plans
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_every_split_plan() {
    let test = "gpu_decode_fp8_every_split_plan";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    // Tile edges (0, 1, 127, 129), 200, Flash (640) and Pro (1152) lists, -1 holes; 64 and 128 heads.
    let hp64 = HostProblem::random(&mut rng, 64, &[0, 1, 127, 129, 200, 640, 1152], true);
    let hp128 = HostProblem::random(&mut rng, 128, &[1152, 129, 0, 65, 300, 640], true);
    for hp in [&hp64, &hp128] {
        let r = hp.reference(FP8);
        for (name, plan) in all_plans(&gpu, hp) {
            let label = format!("h{} {name}", hp.heads);
            check_fp8_calls(&label, &gpu, Path::Fp8, hp, &r, plan, 2);
        }
    }
}

/// HCA at 1M context (8320 candidates = 130 tiles): 130 splits of one tile (more than 32, so every lane of the
/// combine's statistics loop takes several splits, the last round partial), 16 and 33 tiles per split, the
/// routed plan and the estimated-cost plan; every output of every call within tolerance of the reference, the
/// second call bit-identical to the first.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_fp8_long_hca_many_splits() {
    let test = "gpu_decode_fp8_long_hca_many_splits";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let hp = HostProblem::random(&mut rng, 64, &[8320], true);
    let shape = hp.shape();
    let r = hp.reference(FP8);
    let sms = gpu.info.sm_count as usize;
    {
        let path = Path::Fp8;
        for t in [1usize, 16, 33] {
            let plan = SplitPlan::with_tiles_per_split(&shape, t).unwrap();
            let label = format!("hca 8320 split {t} tiles");
            check_fp8_calls(&label, &gpu, path, &hp, &r, plan, 2);
        }
        let routed = SplitPlan::fp8(sms, &shape);
        check_fp8_calls("hca 8320 routed plan", &gpu, path, &hp, &r, routed, 2);
        let estimated = SplitPlan::by_cost(sms, &shape, &PlanCosts::ESTIMATED);
        let label = "hca 8320 estimated-cost plan";
        check_fp8_calls(label, &gpu, path, &hp, &r, estimated, 2);
    }
}

/// The two split merges (Combine::WarpPerHead, Combine::HeadsPerThread with 1 / 2 / 4 heads per thread) are
/// bit-identical and the routed path equals both, for list lengths 0 / 1 / 127 / 129 / 640 / 1152 / 8320 with
/// -1 holes, 64 and 128 heads, and every plan: one split, 1 / 2 / 3 / 16 / 17 / 26 / 33 / 44 / 65 tiles per split
/// (8320 candidates at one tile per split = 130 splits: 16 full chunks of 8 plus a partial one, and more than 32
/// splits per lane of the lse pass; 65 / 44 / 33 tiles = 2 / 3 / 4 splits, merged by the 4- and 2-heads-per-thread
/// entries), both cost models' plans and the baseline's auto plan; every output within tolerance of the reference.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_combines_bit_identical_and_match_reference() {
    let test = "gpu_combines_bit_identical_and_match_reference";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    let lengths = [0usize, 1, 127, 129, 640, 1152, 8320];
    let sms = gpu.info.sm_count as usize;
    for heads in [64usize, 128] {
        let hp = HostProblem::random(&mut rng, heads, &lengths, true);
        let shape = hp.shape();
        let r = hp.reference(FP8);
        let dp = DeviceProblem::upload(&gpu, &hp);
        let mut plans = vec![
            (
                "estimated costs".to_string(),
                SplitPlan::by_cost(sms, &shape, &PlanCosts::ESTIMATED),
            ),
            (
                "fitted costs".to_string(),
                SplitPlan::by_cost(sms, &shape, &PlanCosts::FITTED),
            ),
            ("routed".to_string(), SplitPlan::fp8(sms, &shape)),
            ("baseline".to_string(), baseline_plan(sms, &shape)),
        ];
        for t in [1usize, 2, 3, 16, 17, 26, 33, 44, 65, 1000] {
            plans.push((
                format!("{t} tiles per split"),
                SplitPlan::with_tiles_per_split(&shape, t).unwrap(),
            ));
        }
        for (name, plan) in plans {
            let label = format!("h{heads} {name} {plan:?}");
            let warp = run_poisoned(
                &gpu,
                &dp,
                &shape,
                plan,
                Variant::Path(Path::Fp8WarpPerHeadCombine),
            );
            let hpt = run_poisoned(
                &gpu,
                &dp,
                &shape,
                plan,
                Variant::Path(Path::Fp8HeadsPerThreadCombine),
            );
            let routed = run_poisoned(&gpu, &dp, &shape, plan, FP8);
            assert_bf16_within_reference(
                &format!("{label}: heads-per-thread merge vs reference"),
                &shape,
                &hpt,
                &r,
            );
            assert_same_bits(
                &format!("{label}: heads-per-thread vs warp-per-head merge"),
                &shape,
                &warp,
                &hpt,
            );
            assert_same_bits(
                &format!("{label}: routed vs warp-per-head merge"),
                &shape,
                &warp,
                &routed,
            );
        }
    }
}

/// One `path` call captured in a CUDA graph on a second stream at the capacity shape (`heads`, `stride` = window
/// 128 + the most compressed candidates), replayed `lengths_per_replay.len()` times. Before each replay the device
/// lengths, candidate lists, positions and q are rewritten in place with `Gpu::write`, the output and
/// workspace poisoned; every replay's output is checked against the CPU reference of that replay's inputs.
fn check_graph_replays(
    test: &str,
    gpu: &Gpu,
    rng: &mut rand_chacha::ChaCha8Rng,
    (heads, stride): (usize, usize),
    v: Variant,
    tiles_per_split: Option<usize>,
    lengths_per_replay: &[Vec<usize>],
) {
    let mut hp = HostProblem::with_stride(rng, heads, stride, &lengths_per_replay[0], true);
    let shape = hp.shape();
    let plan = match tiles_per_split {
        Some(t) => SplitPlan::with_tiles_per_split(&shape, t).unwrap(),
        None => v.plan(gpu.info.sm_count as usize, &shape),
    };
    let mut dp = DeviceProblem::upload(gpu, &hp);
    let (_arena, ws) = DecodeWorkspace::with_arena(gpu, &shape, plan, v.staging()).unwrap();
    let n = shape.batch * shape.heads * HEAD_DIM;
    let mut out = gpu.poisoned::<bf16>(n, common::POISON).unwrap();
    gpu.synchronize().unwrap();
    let stream = gpu.new_stream().unwrap();
    let graph = {
        let inp = dp.inputs();
        // One plain call first: it resolves the kernels (module lookups stay out of the capture) and is checked
        // like a replay below (replay 0 reruns the same inputs).
        ws.poison(&stream).unwrap();
        v.run(gpu, &stream, &shape, &inp, &ws, &mut out).unwrap();
        stream.synchronize().unwrap();
        let got = gpu.download(&out).unwrap();
        assert_bf16_within_reference(
            &format!("{test}: {v:?} plain call before capture, plan {plan:?}"),
            &shape,
            &got,
            &hp.reference(v),
        );
        capture_on(&stream, || v.run(gpu, &stream, &shape, &inp, &ws, &mut out)).unwrap()
    };
    for (rep, lengths) in lengths_per_replay.iter().enumerate() {
        if rep > 0 {
            hp.redraw(rng, lengths);
            dp.write_step(gpu, &stream, &hp);
        }
        fill_bytes_on(&stream, &mut out, common::POISON).unwrap();
        ws.poison(&stream).unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        let got = gpu.download(&out).unwrap();
        let label = format!(
            "{test}: {v:?} graph replay {rep}, heads {heads} stride {stride} lengths {lengths:?} plan {plan:?}"
        );
        assert_bf16_within_reference(&label, &shape, &got, &hp.reference(v));
    }
    println!(
        "{test}: {v:?} plan {plan:?}: {} graph replays with changed device inputs match the reference",
        lengths_per_replay.len()
    );
}

/// Every path as one captured graph per plan, replayed with the device-side lengths, candidates, positions and q
/// changed between replays: full lists, lists of the window only (0 compressed candidates: 128, and shorter for
/// an early position), empty lists, and lengths off the 64-entry tile grid. Plans: the routed one, one split,
/// and splits merged by each combine entry (1 tile per split: one head per thread; at stride 640, 3 tiles = 4
/// splits, two heads per thread, and 5 tiles = 2 splits, the warp-per-head merge; half the list per split through
/// the forcing path: four heads per thread), and the baseline under its own plan.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_graph_replays_with_changed_device_inputs() {
    let test = "gpu_decode_graph_replays_with_changed_device_inputs";
    let gpu = common::gpu(test);
    let mut rng = common::seeded(test, REPLAY_VAR);
    // Flash: 128 window + 512 compressed = 640 = 10 tiles; Pro: 128 + 1024 = 1152 = 18 tiles.
    for (heads, stride) in [(64usize, 640usize), (128, 1152)] {
        let replays: Vec<Vec<usize>> = vec![
            vec![stride, WINDOW, 77, 0],
            vec![333, 0, stride - 1, WINDOW],
            vec![1, 65, 200, stride],
            vec![0, 0, 0, 0],
            vec![WINDOW + 1, stride - 63, 64, 129],
        ];
        let runs: [(Variant, Option<usize>); 7] = [
            (FP8, None),
            (FP8, Some(1000)),
            (FP8, Some(1)),
            (FP8, Some(3)),
            (FP8, Some(5)),
            (
                Variant::Path(Path::Fp8HeadsPerThreadCombine),
                Some(stride.div_ceil(128)),
            ),
            (Variant::Bf16Staging, None),
        ];
        for (v, t) in runs {
            check_graph_replays(test, &gpu, &mut rng, (heads, stride), v, t, &replays);
        }
    }
}

/// Mirror of the FP8 q prologue's identity (kernels/sparse_attn.cu, `quantize_lane_pow2_mul`): for every BF16 value
/// x (all 65536 bit patterns, q is BF16) and every UE8M0 scale code c the scale rule can produce (1..=254),
/// the IEEE quotient x / 2^(c-127) equals the IEEE product x * 2^(127-c) bit for bit (NaN: both NaN), and the
/// reciprocal is the kernel's `ue8m0_decode(254 - c)`; so the e4m3 codes (and q's BF16 values) are unchanged.
#[test]
fn pow2_division_equals_reciprocal_product() {
    let decode = |code: u32| -> f32 {
        if code == 0 {
            f32::from_bits(0x0040_0000)
        } else {
            f32::from_bits(code << 23)
        }
    };
    let mut checked = 0u64;
    for c in 1u32..=254 {
        let scale = decode(c);
        let inv = decode(254 - c);
        assert_eq!(
            scale as f64 * inv as f64,
            1.0,
            "code {c}: {inv:e} is not the exact reciprocal of {scale:e}"
        );
        for bits in 0u16..=u16::MAX {
            let x = bf16::from_bits(bits).to_f32();
            let (q, p) = (x / scale, x * inv);
            assert!(
                q.to_bits() == p.to_bits() || (q.is_nan() && p.is_nan()),
                "code {c}, x = {x:e} ({bits:#06x}): x / s = {q:e} ({:#010x}), x * (1/s) = {p:e} ({:#010x})",
                q.to_bits(),
                p.to_bits()
            );
            checked += 1;
        }
    }
    println!("pow2_division_equals_reciprocal_product: {checked} (x, code) pairs identical");
}

/// CPU mirror of the FP8 kernel's shared-memory addressing (kernels/sparse_attn.cu, `sw_off`,
/// `load_raw_regs` / `dequant_regs`, `softmax_step` with `PSwizzled`): the 128B-swizzled layout is a bijection from
/// (row 0..64, 16-byte chunk 0..64) onto the 64 KiB tile; the dequant's (thread, i) -> chunk map writes every
/// nope chunk of every entry exactly once, with the scale of its own 64-tile; the register staging reads every
/// rope byte once; and the softmax's P stores equal the canonical swizzled P layout, each word once.
#[test]
fn swizzle_layout_mirror() {
    fn sw_off(row: usize, chunk: usize) -> usize {
        (chunk >> 3) * 8192 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)
    }
    let mut seen = vec![false; 65536 / 16];
    for row in 0..64 {
        for chunk in 0..64 {
            let off = sw_off(row, chunk);
            assert_eq!(off % 16, 0);
            assert!(
                !seen[off / 16],
                "offset {off} twice (row {row}, chunk {chunk})"
            );
            seen[off / 16] = true;
        }
    }
    assert!(seen.iter().all(|&v| v));
    // dequant: thread tid -> entry e = tid / 4, q = tid % 4; chunk 8 (i >> 1) + q + 4 ((i & 1) ^ (e & 1)).
    let mut written = vec![0u32; 64 * 56];
    for tid in 0..256usize {
        let (e, q) = (tid >> 2, tid & 3);
        for i in 0..14usize {
            let c = 8 * (i >> 1) + q + 4 * ((i & 1) ^ (e & 1));
            assert_eq!(c / 8, i >> 1, "scale index of chunk {c}");
            written[e * 56 + c] += 1;
        }
    }
    assert!(written.iter().all(|&n| n == 1));
    // register staging: the 4 rope words of thread q are entry bytes 448 + 16q + 8(j & 1) + 64(j >> 1),
    // i.e. 16-byte rope chunks q (words 0, 1) and q + 4 (words 2, 3); over q = 0..3 every rope byte once.
    let mut rope_bytes = [0u32; 128];
    for q in 0..4usize {
        for j in 0..4usize {
            let off = 448 + 16 * q + 8 * (j & 1) + 64 * (j >> 1);
            assert_eq!((off - 448) / 16, if j < 2 { q } else { q + 4 });
            for b in 0..8 {
                rope_bytes[off - 448 + b] += 1;
            }
        }
    }
    assert!(rope_bytes.iter().all(|&n| n == 1));
    // P block: softmax lane (g, tq) of warp (wm, wh), n-tile n writes entries 32wh + 8n + 2tq (+1) of heads
    // row0 = 16wm + g and row0 + 8 at row * 128 + (((4wh + n) ^ g) << 4) + 4tq: equal to the canonical offset
    // row * 128 + (((c >> 3) ^ (row & 7)) << 4) + 2 (c & 7), and all 64 x 32 bf16x2 words written exactly once.
    let mut p_words = vec![0u32; 64 * 32];
    for wm in 0..4usize {
        for wh in 0..2usize {
            for lane in 0..32usize {
                let (g, tq) = (lane >> 2, lane & 3);
                for n in 0..4usize {
                    for row in [16 * wm + g, 16 * wm + g + 8] {
                        let c = 32 * wh + 8 * n + 2 * tq;
                        let kernel = row * 128 + (((4 * wh + n) ^ g) << 4) + 4 * tq;
                        let canonical = row * 128 + (((c >> 3) ^ (row & 7)) << 4) + 2 * (c & 7);
                        assert_eq!(kernel, canonical, "P row {row} entry {c}");
                        p_words[kernel / 4] += 1;
                    }
                }
            }
        }
    }
    assert!(p_words.iter().all(|&n| n == 1));
}

/// `heads_per_thread`: the most heads per thread (1, 2, 4) with heads * n_splits <= 8 (8 loads in flight per
/// thread), one head from 5 splits on; every choice divides 64.
#[test]
fn combine_heads_per_thread_choice() {
    use megamoe::ops::sparse_attn::heads_per_thread;
    for n_splits in 2usize..=200 {
        let (k, hpt) = heads_per_thread(n_splits);
        assert_eq!(
            1 << k,
            hpt,
            "n_splits {n_splits}: entry index {k} vs {hpt} heads"
        );
        assert!(64 % hpt == 0);
        let best = [4usize, 2, 1]
            .into_iter()
            .find(|&h| h * n_splits <= 8)
            .unwrap_or(1);
        assert_eq!(hpt, best, "n_splits {n_splits}");
    }
}

/// The two cost models pick the same plans at every Flash / Pro target point on the H200 (132 SMs); at HCA 1M
/// batch 1 the fitted model cuts 65 splits of two tiles (one wave, 65 CTAs) instead of 33 of four; every plan
/// covers every tile with no empty split.
#[test]
fn cost_models_agree_at_target_shapes_and_cover_every_tile() {
    let shape = |batch, heads, stride| DecodeShape {
        batch,
        heads,
        stride,
        n_entries: 10,
    };
    let est = |s: &DecodeShape| SplitPlan::by_cost(132, s, &PlanCosts::ESTIMATED);
    let fit = |s: &DecodeShape| SplitPlan::by_cost(132, s, &PlanCosts::FITTED);
    for batch in [1usize, 2, 4, 8, 16, 32, 64, 128] {
        for (heads, stride) in [(64usize, 640usize), (128, 1152)] {
            let s = shape(batch, heads, stride);
            assert_eq!(est(&s), fit(&s), "{s:?}");
        }
    }
    let hca1 = shape(1, 64, 8320);
    assert_eq!(est(&hca1).n_splits, 33);
    assert_eq!(
        fit(&hca1),
        SplitPlan {
            n_splits: 65,
            tiles_per_split: 2
        }
    );
    for batch in [1usize, 3, 4, 16, 64, 200] {
        for (heads, stride) in [(64usize, 8320usize), (128, 640), (64, 1), (128, 4000)] {
            let s = shape(batch, heads, stride);
            let tiles = stride.div_ceil(64);
            for p in [est(&s), fit(&s)] {
                assert!(
                    p.n_splits * p.tiles_per_split >= tiles
                        && (p.n_splits - 1) * p.tiles_per_split < tiles,
                    "{s:?} {p:?}"
                );
            }
        }
    }
}

/// The routed path at every point of results/h200/archive/session5-ab/sparse_attn_decode.csv (H200, 132 SMs): the plan
/// (`SplitPlan::fp8`) and the merge (`combine_for`) at each measured point, printed and pinned, with the winner
/// the data names (see `HEADS_PER_THREAD_MIN_SPLITS` and `SplitPlan::fp8`): the heads-per-thread merge won at
/// 3+ splits and lost at 2; the fitted plan differs from the estimated one only at HCA 1M batch 1, where it won.
/// The forcing paths run the routed plan with the merge they name.
#[test]
fn fp8_routing_at_measured_points() {
    use megamoe::ops::sparse_attn::{combine_for, Combine, HEADS_PER_THREAD_MIN_SPLITS};
    let shape = |batch, heads, stride| DecodeShape {
        batch,
        heads,
        stride,
        n_entries: 10,
    };
    // (label, batch, heads, candidates, splits, tiles per split, heads-per-thread merge): candidates = CSA 128 +
    // min(topk, ctx/4) (Flash 640, Pro 1152 from 4K context on), HCA 128 + ctx/128.
    let points: Vec<(&str, usize, usize, usize, usize, usize, bool)> = vec![
        ("flash b1", 1, 64, 640, 10, 1, true),
        ("flash b2", 2, 64, 640, 10, 1, true),
        ("flash b4", 4, 64, 640, 10, 1, true),
        ("flash b8", 8, 64, 640, 10, 1, true),
        ("flash b16", 16, 64, 640, 5, 2, true),
        ("flash b32", 32, 64, 640, 4, 3, true),
        ("flash b64", 64, 64, 640, 2, 5, false),
        ("flash b128", 128, 64, 640, 1, 10, false),
        ("pro b1", 1, 128, 1152, 18, 1, true),
        ("pro b2", 2, 128, 1152, 18, 1, true),
        ("pro b4", 4, 128, 1152, 9, 2, true),
        ("pro b8", 8, 128, 1152, 6, 3, true),
        ("pro b16", 16, 128, 1152, 4, 5, true),
        ("pro b32", 32, 128, 1152, 2, 9, false),
        ("pro b64", 64, 128, 1152, 1, 18, false),
        ("pro b128", 128, 128, 1152, 1, 18, false),
        ("hca b8 4K", 8, 64, 160, 3, 1, true),
        ("hca b8 16K", 8, 64, 256, 4, 1, true),
        ("hca b8 64K", 8, 64, 640, 10, 1, true),
        ("hca b8 256K", 8, 64, 2176, 12, 3, true),
        ("hca b8 1M", 8, 64, 8320, 15, 9, true),
        ("hca 1M b1 (fitted plan)", 1, 64, 8320, 65, 2, true),
        ("hca 1M b4", 4, 64, 8320, 33, 4, true),
        ("hca 1M b16", 16, 64, 8320, 8, 17, true),
        ("hca 1M b64", 64, 64, 8320, 2, 65, false),
    ];
    for (label, batch, heads, stride, n_splits, tps, hpt) in points {
        let s = shape(batch, heads, stride);
        let plan = SplitPlan::fp8(132, &s);
        let estimated = SplitPlan::by_cost(132, &s, &PlanCosts::ESTIMATED);
        let ctas = batch * (heads / 64) * plan.n_splits;
        let merge = combine_for(Path::Fp8, plan.n_splits);
        println!(
            "{label}: routed {plan:?} ({ctas} CTAs), estimated {estimated:?}, merge {merge:?}"
        );
        assert_eq!(
            plan,
            SplitPlan {
                n_splits,
                tiles_per_split: tps
            },
            "{label}"
        );
        if plan.n_splits > 1 {
            assert_eq!(merge == Combine::HeadsPerThread, hpt, "{label}");
        }
        // Only HCA 1M batch 1 takes the fitted plan; everywhere else the routed plan is the estimated one.
        assert_eq!(
            plan == estimated,
            label != "hca 1M b1 (fitted plan)",
            "{label}"
        );
        for forcing in [Path::Fp8WarpPerHeadCombine, Path::Fp8HeadsPerThreadCombine] {
            assert_eq!(Variant::Path(forcing).plan(132, &s), plan, "{label}");
        }
    }
    // The rule itself, and the forcing paths at every split count.
    for n in 2usize..=200 {
        let want = if n >= HEADS_PER_THREAD_MIN_SPLITS {
            Combine::HeadsPerThread
        } else {
            Combine::WarpPerHead
        };
        assert_eq!(combine_for(Path::Fp8, n), want);
        assert_eq!(
            combine_for(Path::Fp8HeadsPerThreadCombine, n),
            Combine::HeadsPerThread
        );
        assert_eq!(
            combine_for(Path::Fp8WarpPerHeadCombine, n),
            Combine::WarpPerHead
        );
    }
    assert_eq!(HEADS_PER_THREAD_MIN_SPLITS, 3);
    // The routed plan never trades a 1- or 2-split plan for the fitted one (the 2-split merge is not what FITTED
    // models), and every routed plan covers every tile with no empty split.
    for batch in [1usize, 2, 3, 4, 6, 8, 16, 32, 48, 64, 96, 128] {
        for heads in [64usize, 128] {
            for tiles in (1usize..=40).chain([50, 65, 100, 130, 200, 258, 513]) {
                let s = shape(batch, heads, tiles * 64);
                let p = SplitPlan::fp8(132, &s);
                let estimated = SplitPlan::by_cost(132, &s, &PlanCosts::ESTIMATED);
                assert!(
                    p.n_splits * p.tiles_per_split >= tiles
                        && (p.n_splits - 1) * p.tiles_per_split < tiles,
                    "{s:?} {p:?}"
                );
                if estimated.n_splits < 3 || p.n_splits < 3 {
                    assert_eq!(p, estimated, "{s:?}");
                } else if p != estimated {
                    assert_eq!(p, SplitPlan::by_cost(132, &s, &PlanCosts::FITTED), "{s:?}");
                }
            }
        }
    }
}

/// Workspace bytes: the split partials only when the plan splits (O: batch x splits x heads x 512 f32, lse:
/// batch x splits x heads f32), the staging buffer (batch x stride x 512 BF16) only for the baseline, each
/// rounded to the arena's alignment.
#[test]
fn workspace_bytes_for_a_shape() {
    use megamoe::gpu::arena::ALIGN;
    use megamoe::ops::sparse_attn::workspace_bytes;
    let round = |b: usize| b.div_ceil(ALIGN) * ALIGN;
    let s = DecodeShape::for_capacity(3, 128, 1024, 10);
    assert_eq!(s.stride, 1152, "Pro CSA: 128 window + top-1024");
    let one = SplitPlan::with_tiles_per_split(&s, 1000).unwrap();
    assert_eq!(one.n_splits, 1);
    assert_eq!(workspace_bytes(&s, one, false), 0);
    assert_eq!(workspace_bytes(&s, one, true), round(3 * 1152 * 512 * 2));
    let six = SplitPlan::with_tiles_per_split(&s, 3).unwrap();
    assert_eq!(six.n_splits, 6);
    let rows = 3 * 6 * 128;
    assert_eq!(
        workspace_bytes(&s, six, false),
        round(rows * 512 * 4) + round(rows * 4)
    );
    assert_eq!(
        workspace_bytes(&s, six, true),
        round(rows * 512 * 4) + round(rows * 4) + round(3 * 1152 * 512 * 2)
    );
}

/// The sweep config parses with the bench schema, names only this family's variants, and every point
/// resolves to a candidate count (CSA 128 + min(topk, ctx/4), HCA 128 + ctx/128).
#[test]
fn bench_config_and_split_plans() {
    use megamoe::bench::config::SweepConfig;
    use megamoe::ops::sparse_attn::bench::{
        candidates_per_query, variant_of, LayerKind, BASELINE, KERNEL, VARIANTS,
    };
    for v in VARIANTS {
        variant_of(v).unwrap();
    }
    assert_eq!(variant_of("fp8").unwrap(), FP8);
    assert_eq!(
        variant_of("fp8_combine_warp_per_head").unwrap(),
        Variant::Path(Path::Fp8WarpPerHeadCombine)
    );
    assert_eq!(
        variant_of("fp8_combine_heads_per_thread").unwrap(),
        Variant::Path(Path::Fp8HeadsPerThreadCombine)
    );
    assert_eq!(variant_of(BASELINE).unwrap(), Variant::Bf16Staging);
    assert!(variant_of("fp8_unknown").is_err());
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/sparse_attn.toml"
    );
    let cfg = SweepConfig::from_path(std::path::Path::new(path)).unwrap();
    assert!(!cfg.sweeps.is_empty());
    // The Nsight Compute profile config names only known variants and profiles `fp8`.
    let profile = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/profile/sparse_attn.toml"
    );
    let prof = SweepConfig::from_path(std::path::Path::new(profile)).unwrap();
    for s in &prof.sweeps {
        assert_eq!(s.kernel, KERNEL);
        let v = s.variants_from(&VARIANTS).unwrap();
        assert!(v.iter().any(|x| x.as_str() == "fp8"), "{}: fp8", s.name());
    }
    for s in &cfg.sweeps {
        assert_eq!(s.kernel, KERNEL);
        s.variants_from(&VARIANTS).unwrap();
        let kind = match s.param_str("kind").unwrap() {
            "csa" => LayerKind::Csa {
                topk: s.param_u64("topk").unwrap() as usize,
            },
            "hca" => LayerKind::Hca,
            other => panic!("{}: kind {other}", s.name()),
        };
        s.param_u64("heads").unwrap();
        for &v in &s.values {
            let ctx = if s.axis == "ctx" {
                v
            } else {
                s.param_u64("ctx").unwrap()
            } as usize;
            assert!(candidates_per_query(kind, ctx) >= 128);
        }
    }
    assert_eq!(
        candidates_per_query(LayerKind::Csa { topk: 512 }, 1024),
        128 + 256
    );
    assert_eq!(
        candidates_per_query(LayerKind::Csa { topk: 512 }, 65536),
        640
    );
    assert_eq!(candidates_per_query(LayerKind::Hca, 1 << 20), 8320);
    // split plans cover every tile and keep >= 4 tiles per split when there are that many
    for (batch, heads, stride) in [
        (1usize, 64usize, 8320usize),
        (1, 128, 640),
        (64, 64, 640),
        (128, 128, 1152),
        (3, 64, 1),
    ] {
        let shape = DecodeShape {
            batch,
            heads,
            stride,
            n_entries: 10,
        };
        let p = baseline_plan(132, &shape);
        let tiles = stride.div_ceil(64);
        assert!(
            p.n_splits * p.tiles_per_split >= tiles && (p.n_splits - 1) * p.tiles_per_split < tiles,
            "{shape:?} {p:?}"
        );
        assert!(p.tiles_per_split >= tiles.min(4), "{shape:?} {p:?}");
        // the FP8 plan also covers every tile with no empty split
        let c = SplitPlan::fp8(132, &shape);
        assert!(
            c.n_splits * c.tiles_per_split >= tiles && (c.n_splits - 1) * c.tiles_per_split < tiles,
            "{shape:?} {c:?}"
        );
    }
    // Flash CSA (640 candidates = 10 tiles): batch 1 -> one tile per CTA; batch 32 -> 4 splits of 3 tiles
    // (128 CTAs, one wave) instead of auto's 3 x 4 (96 CTAs); batch 128 -> no split (128 CTAs).
    let flash = |batch| DecodeShape {
        batch,
        heads: 64,
        stride: 640,
        n_entries: 10,
    };
    assert_eq!(SplitPlan::fp8(132, &flash(1)).n_splits, 10);
    assert_eq!(SplitPlan::fp8(132, &flash(32)).tiles_per_split, 3);
    assert_eq!(SplitPlan::fp8(132, &flash(128)).n_splits, 1);
    let pro = |batch| DecodeShape {
        batch,
        heads: 128,
        stride: 1152,
        n_entries: 10,
    };
    assert_eq!(SplitPlan::fp8(132, &pro(1)).n_splits, 18);
    assert!(DecodeShape {
        batch: 1,
        heads: 96,
        stride: 8,
        n_entries: 1
    }
    .validate()
    .is_err());
    assert!(DecodeShape {
        batch: 0,
        heads: 64,
        stride: 8,
        n_entries: 1
    }
    .validate()
    .is_err());
}

// =========================================================================================================
// `megamoe exec sparse_attn_decode` (CPU path: argument validation and the reference output)
// =========================================================================================================

fn exec_inputs(p: &HostProblem) -> megamoe::ops::exec::TensorMap {
    use megamoe::ops::exec::{HostTensor, TensorMap};
    use safetensors::Dtype;
    let i32_tensor = |shape: Vec<usize>, v: &[i32]| {
        HostTensor::from_u8(
            Dtype::I32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    };
    let mut m = TensorMap::new();
    m.insert(
        "q".into(),
        HostTensor::from_bf16(vec![p.batch, p.heads, HEAD_DIM], &p.q),
    );
    m.insert(
        "pool".into(),
        HostTensor::from_u8(
            Dtype::U8,
            vec![p.pool.len() / ENTRY_BYTES, ENTRY_BYTES],
            p.pool.clone(),
        ),
    );
    m.insert(
        "candidates".into(),
        i32_tensor(vec![p.batch, p.stride], &p.candidates),
    );
    m.insert("lengths".into(), i32_tensor(vec![p.batch], &p.lengths));
    m.insert("positions".into(), i32_tensor(vec![p.batch], &p.positions));
    m.insert(
        "sinks".into(),
        HostTensor::from_f32(vec![p.heads], &p.sinks),
    );
    m.insert(
        "freqs".into(),
        HostTensor::from_f32(vec![ROPE_DIM / 2], &p.freqs),
    );
    m
}

#[test]
fn exec_entry_validates_arguments_and_matches_reference() {
    use megamoe::ops::exec::{HostTensor, TensorMap};
    use megamoe::ops::registry::exec_kernels as kernels;
    use safetensors::Dtype;
    let mut rng = seeded(
        "exec_entry_validates_arguments_and_matches_reference",
        0xE7EC,
    );
    let p = HostProblem::random(&mut rng, 64, &[70, 5], true);
    let all = kernels();
    let k = all
        .iter()
        .find(|k| k.name == "sparse_attn_decode")
        .expect("exec registry has sparse_attn_decode");
    let good = exec_inputs(&p);

    // The valid call: output tensor name, dtype, shape and the reference values rounded to BF16.
    let out = (k.run)(&good, None).expect("valid inputs run on the CPU");
    let o = out.get("out").expect("output tensor `out`");
    assert_eq!(o.dtype, Dtype::BF16);
    assert_eq!(o.shape, vec![p.batch, p.heads, HEAD_DIM]);
    let want = decode_attention(&p.problem(), QueryPrecision::Fp8Tiles).unwrap();
    let got = o.to_f32().unwrap();
    assert!(
        got.iter().any(|&v| v != 0.0),
        "output is all zero: the test data is degenerate"
    );
    for (i, (&g, &w)) in got.iter().zip(&want.out).enumerate() {
        assert_eq!(
            g.to_bits(),
            bf16::from_f64(w).to_f32().to_bits(),
            "out[{i}]: {g} vs reference {w}"
        );
    }

    // Each broken variant must fail with a message naming the problem.
    fn i32_tensor(shape: Vec<usize>, v: &[i32]) -> HostTensor {
        HostTensor::from_u8(
            Dtype::I32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }
    type Edit = Box<dyn Fn(&mut TensorMap)>;
    let n_entries = p.pool.len() / ENTRY_BYTES;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "missing sinks",
            Box::new(|m: &mut TensorMap| {
                m.remove("sinks");
            }),
            "needs an input tensor `sinks`",
        ),
        (
            "q as F32",
            Box::new(|m: &mut TensorMap| {
                let q = m["q"].to_f32().unwrap();
                let shape = m["q"].shape.clone();
                m.insert("q".into(), HostTensor::from_f32(shape, &q));
            }),
            "tensor `q` has dtype",
        ),
        (
            "32 heads",
            Box::new(|m: &mut TensorMap| {
                let q = m["q"].clone();
                let half = q.bytes.len() / 2;
                m.insert(
                    "q".into(),
                    HostTensor::from_u8(
                        Dtype::BF16,
                        vec![2, 32, HEAD_DIM],
                        q.bytes[..half].to_vec(),
                    ),
                );
                m.insert("sinks".into(), HostTensor::from_f32(vec![32], &[0.0; 32]));
            }),
            "multiple of 64",
        ),
        (
            "pool rows of 583 bytes",
            Box::new(|m: &mut TensorMap| {
                let b = m["pool"].bytes[..583 * 4].to_vec();
                m.insert(
                    "pool".into(),
                    HostTensor::from_u8(Dtype::U8, vec![4, 583], b),
                );
            }),
            "tensor `pool` has shape",
        ),
        (
            "candidates for 3 sequences",
            Box::new(|m: &mut TensorMap| {
                m.insert("candidates".into(), i32_tensor(vec![3, 4], &[0; 12]));
            }),
            "tensor `candidates` has shape",
        ),
        (
            "length above the stride",
            Box::new(|m: &mut TensorMap| {
                m.insert("lengths".into(), i32_tensor(vec![2], &[71, 5]));
            }),
            "length 71 outside",
        ),
        (
            "candidate past the pool",
            Box::new(move |m: &mut TensorMap| {
                let mut c = m["candidates"].bytes.clone();
                // sequence 1, candidate 2 (inside its length 5)
                let at = 4 * (70 + 2);
                c[at..at + 4].copy_from_slice(&(n_entries as i32).to_le_bytes());
                m.insert(
                    "candidates".into(),
                    HostTensor::from_u8(Dtype::I32, vec![2, 70], c),
                );
            }),
            "candidate 2: pool index",
        ),
        (
            "negative position",
            Box::new(|m: &mut TensorMap| {
                m.insert("positions".into(), i32_tensor(vec![2], &[5, -3]));
            }),
            "negative position",
        ),
        (
            "NaN sink",
            Box::new(|m: &mut TensorMap| {
                let mut s = m["sinks"].to_f32().unwrap();
                s[7] = f32::NAN;
                m.insert("sinks".into(), HostTensor::from_f32(vec![64], &s));
            }),
            "sink of head 7 is NaN",
        ),
        (
            "31 freqs",
            Box::new(|m: &mut TensorMap| {
                m.insert("freqs".into(), HostTensor::from_f32(vec![31], &[0.5; 31]));
            }),
            "tensor `freqs` has shape",
        ),
        (
            "infinite freq",
            Box::new(|m: &mut TensorMap| {
                let mut f = m["freqs"].to_f32().unwrap();
                f[3] = f32::INFINITY;
                m.insert("freqs".into(), HostTensor::from_f32(vec![32], &f));
            }),
            "freqs[3]",
        ),
        (
            "infinite q",
            Box::new(|m: &mut TensorMap| {
                let mut q = m["q"].clone();
                q.bytes[10..12].copy_from_slice(&bf16::INFINITY.to_bits().to_le_bytes());
                m.insert("q".into(), q);
            }),
            "q element 5 is not finite",
        ),
    ];
    for (what, edit, expect) in cases {
        let mut m = good.clone();
        edit(&mut m);
        let err = match (k.run)(&m, None) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains(expect),
            "{what}: error `{err}` does not mention `{expect}`"
        );
    }
}
