//! Lightning indexer: CPU reference checks and models of the kernels' algorithms (always run), and GPU checks
//! (`#[ignore = "needs an H100/H200"]`: run with `--include-ignored` on a GPU machine).
//! One file for the family: the CPU models of the top-k (radix, threshold, rank-by-counting, multi-CTA, slot
//! allocation) are what the GPU tests' row classes and tolerances refer to; shared fixtures live in
//! tests/common/indexer.rs.

mod common;

use common::indexer::*;
use common::POISON;
use megamoe::formats::{e2m1, e4m3, ue8m0};
use megamoe::gpu::arena::Arena;
use megamoe::gpu::timing::TimingPlan;
use megamoe::ops::indexer::reference::{
    self, IndexerShape, KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS,
};
use megamoe::ops::indexer::{self, stress, KeyCacheGpu, QueryBatch, TopkOutput, TopkPath};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

// ---------------------------------------------------------------------------------------------------------
// CPU
// ---------------------------------------------------------------------------------------------------------

#[test]
fn hadamard_scale_is_f32_of_inverse_sqrt_128() {
    assert_eq!(reference::hadamard_scale(), (1.0f64 / 128f64.sqrt()) as f32);
}

#[test]
fn hadamard_matches_the_sylvester_matrix_and_is_orthonormal() {
    let (_, mut rng) = seeded("hadamard");
    for _ in 0..20 {
        let x = random_key(&mut rng, 5.0);
        let mut y = x;
        reference::hadamard_128(&mut y);
        // Natural-order Sylvester matrix: H[i][j] = (-1)^popcount(i & j) / sqrt(128).
        for (i, &yi) in y.iter().enumerate() {
            let want: f64 = (0..HEAD_DIM)
                .map(|j| {
                    if (i & j).count_ones() % 2 == 0 {
                        x[j] as f64
                    } else {
                        -(x[j] as f64)
                    }
                })
                .sum::<f64>()
                / 128f64.sqrt();
            // 7 f32 additions of magnitude <= sum|x| plus one multiply: error <= 8 ulp of sum|x|/sqrt(128).
            let bound = 8.0 * f32::EPSILON as f64 * x.iter().map(|v| v.abs() as f64).sum::<f64>()
                / 128f64.sqrt();
            assert!((yi as f64 - want).abs() <= bound, "dim {i}: {yi} vs {want}");
        }
        let mut z = y;
        reference::hadamard_128(&mut z);
        for d in 0..HEAD_DIM {
            assert!(
                (z[d] - x[d]).abs() <= 1e-5 * 5.0,
                "H(H(x)) != x at {d}: {} vs {}",
                z[d],
                x[d]
            );
        }
    }
}

#[test]
fn fp8_key_codec_follows_the_scale_rule_and_error_bound() {
    let (_, mut rng) = seeded("fp8_codec");
    for case in 0..200 {
        let amp = [1e-6f32, 1e-3, 1.0, 300.0][case % 4];
        let x = random_key(&mut rng, amp);
        let (codes, scale) = reference::quantize_key_fp8(&x).unwrap();
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(scale, amax.max(1e-4) / 448.0);
        for d in 0..HEAD_DIM {
            let deq = e4m3::decode(codes[d]) as f64 * scale as f64;
            // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, abs <= 2^-10 * scale below 2^-6.
            let bound =
                (x[d].abs() as f64 * 0.0625).max(f64::powi(2.0, -10) * scale as f64) * 1.0001;
            assert!(
                (deq - x[d] as f64).abs() <= bound,
                "case {case} dim {d}: {} -> {deq}",
                x[d]
            );
        }
    }
}

#[test]
fn mxfp4_key_codec_picks_the_smallest_pow2_scale() {
    let (_, mut rng) = seeded("mxfp4_codec");
    for case in 0..200 {
        let amp = [1e-3f32, 0.7, 6.0, 90.0][case % 4];
        let x = random_key(&mut rng, amp);
        let (packed, scales) = reference::quantize_key_mxfp4(&x).unwrap();
        for blk in 0..4 {
            let amax = x[blk * 32..(blk + 1) * 32]
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()));
            let s = ue8m0::decode(scales[blk]);
            assert!(
                amax / s <= 6.0 && amax / (s * 0.5) > 6.0,
                "block {blk}: amax {amax} scale {s}"
            );
        }
        for d in 0..HEAD_DIM {
            let deq = reference::mxfp4_value(&packed, &scales, d);
            let s = ue8m0::decode(scales[d / 32]) as f64;
            // e2m1 spacing is at most 2 (between 4 and 6): error <= 1 * s, and <= 0.25 * s below 2.
            let bound = if (x[d].abs() as f64) < 2.0 * s {
                0.25 * s
            } else {
                1.0 * s
            };
            assert!(
                (deq - x[d] as f64).abs() <= bound,
                "case {case} dim {d}: {} -> {deq}",
                x[d]
            );
            let (lo, hi) = e2m1::unpack(packed[d / 2]);
            let code = if d.is_multiple_of(2) { lo } else { hi };
            assert_eq!(code, e2m1::encode_rne(x[d] / s as f32));
        }
    }
}

#[test]
fn entry_sizes_are_132_and_68_bytes() {
    assert_eq!(KeyFormat::Fp8.entry_bytes(), 132);
    assert_eq!(KeyFormat::Mxfp4.entry_bytes(), 68);
}

#[test]
fn reference_topk_order_ties_padding_and_specials() {
    assert_eq!(reference::topk(&[], 3), vec![-1, -1, -1]);
    assert_eq!(reference::topk(&[1.0, 3.0, 3.0, 2.0], 3), vec![1, 2, 3]);
    assert_eq!(
        reference::topk(&[0.0, -0.0, 0.0], 2),
        vec![0, 1],
        "-0 ties with +0"
    );
    assert_eq!(
        reference::topk(&[f32::NAN, f32::NEG_INFINITY, -1.0], 3),
        vec![2, 0, 1],
        "NaN ranks as -inf, lower index first"
    );
    assert_eq!(
        reference::topk(&[1.0, f32::INFINITY], 4),
        vec![1, 0, -1, -1]
    );
    let (_, mut rng) = seeded("topk_ref");
    let s: Vec<f32> = (0..1000).map(|_| rng.random_range(0..50) as f32).collect();
    let t = reference::topk(&s, 100);
    for p in 1..100 {
        let (a, b) = (t[p - 1] as usize, t[p] as usize);
        assert!(
            s[a] > s[b] || (s[a] == s[b] && a < b),
            "order broken at {p}"
        );
    }
    let kth = s[t[99] as usize];
    assert!(s.iter().filter(|&&v| v > kth).count() < 100);
}

#[test]
fn reference_logits_match_a_direct_dequantized_formula() {
    let (_, mut rng) = seeded("logits_ref");
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        let mut cache = KeyCacheHost::new(format, 2, 5);
        for s in 0..10 {
            cache.write_key(s, &random_key(&mut rng, 2.0)).unwrap();
        }
        let shape = IndexerShape {
            batch: 2,
            next_n: 2,
            num_valid: vec![4, 5, 0, 3],
        };
        let q: Vec<u8> = (0..4 * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..4 * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let out = reference::logits(&shape, &q, &w, &cache);
        assert_eq!(
            out.iter().map(|r| r.len()).collect::<Vec<_>>(),
            vec![4, 5, 0, 3]
        );
        for (row, scores) in out.iter().enumerate() {
            for (j, &s) in scores.iter().enumerate() {
                let k = cache.key_f64(cache.slot(row / 2, j));
                let mut want = 0.0f64;
                for h in 0..NUM_HEADS {
                    let dot: f64 = (0..HEAD_DIM)
                        .map(|d| {
                            e4m3::decode(q[(row * NUM_HEADS + h) * HEAD_DIM + d]) as f64 * k[d]
                        })
                        .sum();
                    if dot > 0.0 {
                        want += w[row * NUM_HEADS + h] as f64 * dot;
                    }
                }
                assert_eq!(s, want as f32, "{format:?} row {row} j {j}");
            }
        }
    }
}

#[test]
fn launcher_input_policy_rejects_bad_queries() {
    let q = vec![0x38u8; NUM_HEADS * HEAD_DIM];
    let w = vec![0.5f32; NUM_HEADS];
    assert!(indexer::validate_queries(1, 1, &q, &w, &[10]).is_ok());
    assert!(
        indexer::validate_queries(1, 3, &q, &w, &[10]).is_err(),
        "next_n = 3"
    );
    assert!(
        indexer::validate_queries(1, 1, &q[1..], &w, &[10]).is_err(),
        "short q"
    );
    assert!(
        indexer::validate_queries(1, 1, &q, &w, &[-1]).is_err(),
        "negative num_valid"
    );
    let mut qn = q.clone();
    qn[77] = 0xFF;
    let e = indexer::validate_queries(1, 1, &qn, &w, &[10])
        .unwrap_err()
        .to_string();
    assert!(e.contains("NaN"), "{e}");
    let mut wn = w.clone();
    wn[3] = f32::NAN;
    assert!(
        indexer::validate_queries(1, 1, &q, &wn, &[10]).is_err(),
        "NaN w"
    );
}

/// A sequential model of the kernel's block_select + block_collect (kernels/indexer.cu), same digits, same
/// early exit, same selection predicate: checks the algorithm (not the CUDA code) against the reference.
fn model_radix_topk(scores: &[f32], k: usize) -> Vec<i32> {
    let comp = |i: usize| ((reference::order_key(scores[i]) as u64) << 32) | (!(i as u32)) as u64;
    let m = scores.len();
    let kk = k.min(m);
    if kk == 0 {
        return vec![-1; k];
    }
    let (mut prefix, mut rem, mut shift, all) = (0u64, kk as u32, 64u32, kk >= m);
    if !all {
        for pass in 0..8u32 {
            let sd = 56 - 8 * pass;
            let mut hist = [0u32; 256];
            for i in 0..m {
                let c = comp(i);
                if pass == 0 || (c >> (sd + 8)) == (prefix >> (sd + 8)) {
                    hist[((c >> sd) & 0xFF) as usize] += 1;
                }
            }
            let (mut incl, mut found) = (0u32, None);
            for t in 0..256 {
                let v = hist[255 - t];
                let excl = incl;
                incl += v;
                if excl < rem && incl >= rem {
                    assert!(found.is_none(), "two buckets chosen");
                    found = Some((255 - t, rem - excl, v));
                }
            }
            let (bucket, new_rem, count) = found.expect("no bucket holds the rem-th element");
            prefix |= (bucket as u64) << sd;
            rem = new_rem;
            shift = sd;
            if count == rem {
                break;
            }
            assert!(pass < 7, "radix select did not terminate");
        }
    }
    let mut sel: Vec<u64> = (0..m)
        .map(comp)
        .filter(|&c| all || (c >> shift) >= (prefix >> shift))
        .collect();
    assert_eq!(sel.len(), kk, "selected {} elements, want {kk}", sel.len());
    sel.sort_unstable_by(|a, b| b.cmp(a));
    let mut out: Vec<i32> = sel.iter().map(|&c| !(c as u32) as i32).collect();
    out.resize(k, -1);
    out
}

#[test]
fn radix_select_model_matches_reference_topk() {
    let (_, mut rng) = seeded("radix_model");
    for case in 0..300 {
        let n =
            [0usize, 1, 2, 7, 100, 511, 512, 513, 1000, 3000][case % 10] + rng.random_range(0..3);
        let k = [1usize, 5, 512, 1024, 2048][rng.random_range(0..5)];
        let scores: Vec<f32> = (0..n)
            .map(|_| match (case / 10) % 4 {
                0 => rng.random_range(-1.0f32..1.0),
                1 => 3.5,
                2 => [0.0f32, -0.0, 1.0, f32::NAN, f32::NEG_INFINITY][rng.random_range(0..5)],
                _ => rng.random_range(0..4) as f32,
            })
            .collect();
        assert_eq!(
            model_radix_topk(&scores, k),
            reference::topk(&scores, k),
            "case {case}: n {n} k {k}"
        );
    }
}

/// A sequential model of the top-k (kernels/indexer.cu "Top-k"): 4096-bin histogram of order_key >> 20,
/// the threshold bin from the top-down scan (excl < kk <= incl), entries above it taken whole, the rem
/// largest composites of the threshold bin taken by the radix model, then sorted. Checks the identity the
/// kernels rely on (bin is monotone in the composite, so this is exactly the kk largest composites).
fn model_threshold_topk(scores: &[f32], k: usize) -> Vec<i32> {
    let n = scores.len();
    let kk = k.min(n);
    if kk == 0 {
        return vec![-1; k];
    }
    let key = |i: usize| reference::order_key(scores[i]);
    let mut hist = vec![0u32; 4096];
    for i in 0..n {
        hist[(key(i) >> 20) as usize] += 1;
    }
    let (mut excl, mut thr) = (0u32, None);
    for bin in (0..4096).rev() {
        if excl < kk as u32 && excl + hist[bin] >= kk as u32 {
            thr = Some((bin as u32, excl));
            break;
        }
        excl += hist[bin];
    }
    let (b, above) = thr.expect("threshold bin exists when kk <= n");
    let mut out: Vec<u64> = (0..n)
        .filter(|&i| key(i) >> 20 > b)
        .map(|i| ((key(i) as u64) << 32) | (!(i as u32)) as u64)
        .collect();
    assert_eq!(out.len() as u32, above, "entries above the threshold bin");
    assert!(out.len() < kk, "above count must be < kk");
    let in_bin: Vec<usize> = (0..n).filter(|&i| key(i) >> 20 == b).collect();
    let rem = kk - out.len();
    assert!(rem >= 1 && rem <= in_bin.len(), "1 <= rem <= bucket count");
    // The radix model over the bucket's own scores selects by (score, position in the bucket list); map back
    // through in_bin, which is increasing, so "lower position" == "lower index".
    let sub: Vec<f32> = in_bin.iter().map(|&i| scores[i]).collect();
    for p in model_radix_topk(&sub, rem) {
        let i = in_bin[p as usize];
        out.push(((key(i) as u64) << 32) | (!(i as u32)) as u64);
    }
    out.sort_unstable_by(|a, b| b.cmp(a));
    let mut idx: Vec<i32> = out.iter().map(|&c| !(c as u32) as i32).collect();
    idx.resize(k, -1);
    idx
}

#[test]
fn threshold_topk_model_matches_reference_topk() {
    let (seed, mut rng) = seeded("threshold_model");
    for case in 0..300 {
        let n =
            [0usize, 1, 2, 7, 100, 511, 512, 513, 1000, 5000][case % 10] + rng.random_range(0..3);
        let k = [1usize, 5, 512, 1024, 2048][rng.random_range(0..5)];
        let scores: Vec<f32> = (0..n)
            .map(|_| match (case / 10) % 5 {
                0 => rng.random_range(-1.0f32..1.0),
                1 => 3.5,
                2 => [
                    0.0f32,
                    -0.0,
                    1.0,
                    f32::NAN,
                    f32::NEG_INFINITY,
                    f32::INFINITY,
                ][rng.random_range(0..6)],
                3 => rng.random_range(0..4) as f32,
                // Gaussian-like logits (sum of uniforms): the shape the bucket-size estimate assumes.
                _ => (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0,
            })
            .collect();
        assert_eq!(
            model_threshold_topk(&scores, k),
            reference::topk(&scores, k),
            "seed {seed:#x} case {case}: n {n} k {k}"
        );
    }
}

/// The threshold bin of a row for `k` (top-k pass 2's rule): (nb = entries in the bin, rem = kk - entries
/// above it); None when kk = 0.
fn threshold_bucket(scores: &[f32], k: usize) -> Option<(usize, usize)> {
    let kk = k.min(scores.len());
    if kk == 0 {
        return None;
    }
    let mut hist = vec![0usize; 4096];
    for &s in scores {
        hist[(reference::order_key(s) >> 20) as usize] += 1;
    }
    let mut above = 0usize;
    for bin in (0..4096).rev() {
        if above + hist[bin] >= kk {
            return Some((hist[bin], kk - above));
        }
        above += hist[bin];
    }
    unreachable!("the histogram holds n >= kk entries")
}

/// A classifier of row shapes for the final-pass tests: (the threshold bucket holds more than rem and at most
/// 512 entries, kk <= 512), i.e. small / large buckets and k above / below 512, which a one-CTA rank-by-counting
/// pass with a 512-entry shared-memory cap would split into select / sort branches.
fn one_cta_paths(scores: &[f32], k: usize) -> (bool, bool) {
    const RANK_CAP: usize = 512;
    let kk = k.min(scores.len());
    match threshold_bucket(scores, k) {
        None => (false, false),
        Some((nb, rem)) => (rem < nb && nb <= RANK_CAP, kk <= RANK_CAP),
    }
}

/// Whether the multi-CTA final pass (indexer_topk_final) takes its one-CTA fallback on this row: a
/// threshold bucket of more than TOPK_BUCKET_CAP entries with entries still to pick from it.
fn mcta_fallback(scores: &[f32], k: usize) -> bool {
    threshold_bucket(scores, k).is_some_and(|(nb, rem)| rem > 0 && nb > indexer::TOPK_BUCKET_CAP)
}

/// A sequential model of a one-CTA rank-by-counting final pass (the rank identity it checks is the one the
/// multi-CTA pass relies on, see model_mcta_topk): the above-threshold and
/// bucket composites arrive in an arbitrary order (atomics), here a random shuffle; the bucket's rem
/// largest are placed at above_count + rank, rank = #{larger composites in the bucket}; the kk chosen
/// composites are then written to output position #{larger chosen composites}. Checks the identity that
/// rank-by-counting over unique composites is a permutation equal to the descending position.
fn model_rank_topk(scores: &[f32], k: usize, rng: &mut ChaCha8Rng) -> Vec<i32> {
    use rand::seq::SliceRandom;
    let n = scores.len();
    let kk = k.min(n);
    if kk == 0 {
        return vec![-1; k];
    }
    let comp = |i: usize| ((reference::order_key(scores[i]) as u64) << 32) | (!(i as u32)) as u64;
    let mut hist = vec![0usize; 4096];
    for i in 0..n {
        hist[(comp(i) >> 52) as usize] += 1;
    }
    let (mut excl, mut b) = (0usize, 0u64);
    for bin in (0..4096).rev() {
        if excl + hist[bin] >= kk {
            b = bin as u64;
            break;
        }
        excl += hist[bin];
    }
    let mut chosen: Vec<u64> = (0..n).map(comp).filter(|&c| c >> 52 > b).collect();
    let mut bucket: Vec<u64> = (0..n).map(comp).filter(|&c| c >> 52 == b).collect();
    chosen.shuffle(rng);
    bucket.shuffle(rng);
    let (a, rem) = (chosen.len(), kk - chosen.len());
    assert_eq!(a, excl);
    chosen.resize(kk, u64::MAX); // MAX marks "not written"
    for &c in &bucket {
        let rank = bucket.iter().filter(|&&d| d > c).count();
        if rank < rem {
            assert_eq!(
                chosen[a + rank],
                u64::MAX,
                "rank select wrote slot {} twice",
                a + rank
            );
            chosen[a + rank] = c;
        }
    }
    // As the kernel: after a rank select (rem < nb <= 512) only the a above entries are ranked, among
    // themselves; the bucket part already sits at its final positions a + rank.
    let rank_select = rem < bucket.len() && bucket.len() <= 512;
    let msort = if rank_select { a } else { kk };
    let mut out = vec![-1i32; k];
    let mut written = vec![false; kk];
    for (e, &c) in chosen.iter().enumerate() {
        assert_ne!(c, u64::MAX, "rank select left a slot empty");
        let rank = if e < msort {
            chosen[..msort].iter().filter(|&&d| d > c).count()
        } else {
            e
        };
        assert!(!written[rank], "rank sort wrote position {rank} twice");
        written[rank] = true;
        out[rank] = !(c as u32) as i32;
    }
    out
}

#[test]
fn rank_counting_model_matches_reference_topk() {
    let (seed, mut rng) = seeded("rank_model");
    let mut covered = (0usize, 0usize);
    for case in 0..200 {
        let n =
            [0usize, 1, 2, 3, 100, 511, 512, 513, 1000, 3000][case % 10] + rng.random_range(0..3);
        let k = [1usize, 2, 7, 300, 511, 512, 513, 1024][rng.random_range(0..8)];
        let scores: Vec<f32> = (0..n)
            .map(|_| match (case / 10) % 4 {
                0 => rng.random_range(-1.0f32..1.0),
                1 => rng.random_range(0..3) as f32,
                2 => [
                    0.0f32,
                    -0.0,
                    1.0,
                    f32::NAN,
                    f32::NEG_INFINITY,
                    f32::INFINITY,
                ][rng.random_range(0..6)],
                _ => (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0,
            })
            .collect();
        let (sel, sort) = one_cta_paths(&scores, k);
        covered.0 += sel as usize;
        covered.1 += sort as usize;
        assert_eq!(
            model_rank_topk(&scores, k, &mut rng),
            reference::topk(&scores, k),
            "seed {seed:#x} case {case}: n {n} k {k}"
        );
    }
    assert!(
        covered.0 > 0 && covered.1 > 0,
        "seed {seed:#x}: paths covered {covered:?}"
    );
}

/// A sequential model of indexer_topk_final (kernels/indexer.cu "Top-k final pass") with `ctas` CTAs: the
/// above / bucket composites in an arbitrary (shuffled) order as pass 2's atomics leave them; CTA s ranks its
/// slices [s*ceil(a/S), ..) of the above entries (among the above entries) and [s*ceil(nb/S), ..) of the
/// bucket entries (among the bucket; written at a + rank when rank < rem); CTA s writes the -1 tail at
/// a + rem + s*T + t, step S*T. Every position of the row must be written exactly once, by the rule the kernel
/// uses. Rows whose bucket exceeds the kernel's cap take the one-CTA fallback: returned as None.
fn model_mcta_topk(
    scores: &[f32],
    k: usize,
    ctas: usize,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<i32>> {
    use rand::seq::SliceRandom;
    const THREADS: usize = 512; // TKF_THREADS
    let n = scores.len();
    let kk = k.min(n);
    let comp = |i: usize| ((reference::order_key(scores[i]) as u64) << 32) | (!(i as u32)) as u64;
    let mut hist = vec![0usize; 4096];
    for i in 0..n {
        hist[(comp(i) >> 52) as usize] += 1;
    }
    let (mut excl, mut b) = (0usize, None);
    for bin in (0..4096).rev() {
        if excl + hist[bin] >= kk && kk > 0 {
            b = Some(bin as u64);
            break;
        }
        excl += hist[bin];
    }
    let (mut above, mut bucket) = (Vec::new(), Vec::new());
    if let Some(b) = b {
        above = (0..n).map(comp).filter(|&c| c >> 52 > b).collect();
        bucket = (0..n).map(comp).filter(|&c| c >> 52 == b).collect();
    }
    above.shuffle(rng);
    bucket.shuffle(rng);
    let (a, nb) = (above.len(), bucket.len());
    let rem = kk.saturating_sub(a).min(nb);
    if rem > 0 && nb > indexer::TOPK_BUCKET_CAP {
        return None;
    }
    let total = a + rem;
    assert_eq!(total, kk);
    let mb = if rem > 0 { nb } else { 0 };
    let mut out = vec![i32::MIN; k]; // MIN marks "not written"
    let mut put = |pos: usize, v: i32| {
        assert_eq!(out[pos], i32::MIN, "position {pos} written twice");
        out[pos] = v;
    };
    let (per_a, per_b) = (a.div_ceil(ctas), mb.div_ceil(ctas));
    for s in 0..ctas {
        let (a0, b0) = ((s * per_a).min(a), (s * per_b).min(mb));
        for &c in &above[a0..(a0 + per_a).min(a)] {
            put(above.iter().filter(|&&d| d > c).count(), !(c as u32) as i32);
        }
        for &c in &bucket[b0..(b0 + per_b).min(mb)] {
            let r = bucket.iter().filter(|&&d| d > c).count();
            if r < rem {
                put(a + r, !(c as u32) as i32);
            }
        }
        let mut j = total + s * THREADS;
        while j < k {
            for t in 0..THREADS.min(k - j) {
                put(j + t, -1);
            }
            j += ctas * THREADS;
        }
    }
    assert!(
        out.iter().all(|&v| v != i32::MIN),
        "a position was never written"
    );
    Some(out)
}

#[test]
fn multi_cta_model_matches_reference_topk() {
    let (seed, mut rng) = seeded("mcta_model");
    let mut fallbacks = 0;
    for case in 0..160 {
        let n = [0usize, 1, 2, 100, 511, 512, 513, 1000, 3000, 5000][case % 10]
            + rng.random_range(0..3);
        let k = [1usize, 7, 300, 512, 1024, 2048][rng.random_range(0..6)];
        let ctas = [8usize, 13, 16, 32, 64][rng.random_range(0..5)];
        let scores: Vec<f32> = (0..n)
            .map(|_| match (case / 10) % 5 {
                0 => (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0,
                1 => rng.random_range(0..3) as f32,
                4 => 2.5, // all equal: the whole row is the threshold bucket
                2 => [
                    0.0f32,
                    -0.0,
                    1.0,
                    f32::NAN,
                    f32::NEG_INFINITY,
                    f32::INFINITY,
                ][rng.random_range(0..6)],
                _ => rng.random_range(-1.0f32..1.0),
            })
            .collect();
        match model_mcta_topk(&scores, k, ctas, &mut rng) {
            Some(got) => assert_eq!(
                got,
                reference::topk(&scores, k),
                "seed {seed:#x} case {case}: n {n} k {k} ctas {ctas}"
            ),
            None => fallbacks += 1,
        }
    }
    // All-equal rows of 5000 entries put > 4096 entries in one bin: the fallback must be reachable.
    assert!(fallbacks > 0, "seed {seed:#x}: no row took the fallback");
}

/// The slot allocation of indexer_topk_select (CTA-aggregated pass 2), mirrored: 16 warps x 8 steps of
/// random ballots (densities from none to all lanes); warp totals are popcount sums, thread 0's exclusive scan
/// gives each warp's offset, one atomic per CTA gives the base, and lane l of warp w at step r writes slot
/// base + offset[w] + (hits of warp w in steps < r) + popc(ballot_r & lanes below l). The slots of every CTA must
/// be exactly base .. base + its total, once each, and consecutive CTAs must tile the counter's range.
#[test]
fn cta_aggregated_slot_allocation_is_a_dense_permutation() {
    let (seed, mut rng) = seeded("select_agg_slots");
    const WARPS: usize = 16; // TKS_THREADS / 32
    const STEPS: usize = 8; // TKS_PER_THREAD
    for case in 0..300 {
        let density = [0.0f64, 0.001, 0.03, 0.5, 1.0][case % 5];
        let mut counter = 0u32; // the row's global counter
        let mut seen = Vec::new();
        for _cta in 0..3 {
            let ballots: Vec<[u32; STEPS]> = (0..WARPS)
                .map(|_| {
                    std::array::from_fn(|_| {
                        (0..32).fold(0u32, |m, l| m | ((rng.random_bool(density) as u32) << l))
                    })
                })
                .collect();
            let totals: Vec<u32> = ballots
                .iter()
                .map(|b| b.iter().map(|x| x.count_ones()).sum())
                .collect();
            let mut offsets = [0u32; WARPS];
            let mut t = 0;
            for w in 0..WARPS {
                offsets[w] = t;
                t += totals[w];
            }
            let base = counter; // atomicAdd(&cnt, t) returns the old value
            counter += t;
            for w in 0..WARPS {
                let mut run = base + offsets[w];
                for &b in &ballots[w] {
                    for lane in 0..32 {
                        if (b >> lane) & 1 == 1 {
                            seen.push(run + (b & ((1u32 << lane) - 1)).count_ones());
                        }
                    }
                    run += b.count_ones();
                }
            }
        }
        seen.sort_unstable();
        let want: Vec<u32> = (0..counter).collect();
        assert_eq!(
            seen, want,
            "seed {seed:#x} case {case}: slots are not 0..{counter} once each"
        );
    }
}

// ---------------------------------------------------------------------------------------------------------
// Key writer
// ---------------------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_key_writer_is_bit_exact_and_skips_out_of_range_device_slots() {
    let gpu = common::gpu("gpu_key_writer_is_bit_exact_and_skips_out_of_range_device_slots");
    let (_, mut rng) = seeded("gpu_key_writer");
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        let (batch, cap, n) = (3usize, 700usize, 1500usize);
        let mut host = KeyCacheHost::new(format, batch, cap);
        // Distinct random slots; amplitudes from tiny (amax floor) to large.
        let mut all: Vec<usize> = (0..batch * cap).collect();
        for i in 0..n {
            let j = rng.random_range(i..all.len());
            all.swap(i, j);
        }
        let slots: Vec<i32> = all[..n].iter().map(|&s| s as i32).collect();
        let mut raw = Vec::with_capacity(n * HEAD_DIM);
        for (i, &s) in slots.iter().enumerate() {
            let amp = [1e-7f32, 1e-2, 1.0, 1e3][i % 4];
            let key = random_key(&mut rng, amp);
            host.write_key(s as usize, &key).unwrap();
            raw.extend_from_slice(&key);
        }
        let raw_dev = gpu.upload(&raw).unwrap();
        let cb = format.code_bytes();
        let entry = |c: &KeyCacheHost, s: usize| {
            (
                c.codes[s * cb..(s + 1) * cb].to_vec(),
                c.scales[s * 4..s * 4 + 4].to_vec(),
            )
        };

        let mut dev = KeyCacheGpu::filled(&gpu, format, batch, cap, 0).unwrap();
        let slots_dev = dev.upload_slots(&gpu, &slots).unwrap();
        indexer::write_keys(&gpu, &gpu.stream, &mut dev, &raw_dev, &slots_dev).unwrap();
        wait(&gpu, "key writer");
        let got = dev.download(&gpu).unwrap();
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            assert_eq!(
                entry(&got, s),
                entry(&host, s),
                "{format:?} key {i} slot {s}"
            );
        }
        // Host-made slots outside the cache are refused before any launch.
        assert!(dev.upload_slots(&gpu, &[(batch * cap) as i32]).is_err());
        assert!(dev.upload_slots(&gpu, &[-1]).is_err());

        // Device slots (what a graph's slot buffer holds) outside the cache are skipped: every third key has a
        // valid slot, the others -1 - i or batch * capacity + i. Only the valid ones may change the poisoned
        // cache.
        let mut fresh = KeyCacheGpu::filled(&gpu, format, batch, cap, POISON).unwrap();
        let mixed: Vec<i32> = (0..n)
            .map(|i| match i % 3 {
                0 => slots[i],
                1 => -1 - i as i32,
                _ => (batch * cap + i) as i32,
            })
            .collect();
        let mixed_dev = gpu.upload(&mixed).unwrap();
        indexer::write_keys(&gpu, &gpu.stream, &mut fresh, &raw_dev, &mixed_dev).unwrap();
        wait(&gpu, "key writer, out-of-range device slots");
        let got = fresh.download(&gpu).unwrap();
        let written: std::collections::HashSet<usize> =
            (0..n).step_by(3).map(|i| slots[i] as usize).collect();
        for s in 0..batch * cap {
            let (codes, scales) = entry(&got, s);
            if written.contains(&s) {
                assert_eq!((codes, scales), entry(&host, s), "{format:?} slot {s}");
            } else {
                assert!(
                    codes.iter().chain(&scales).all(|&x| x == POISON),
                    "{format:?} slot {s}: written although no valid device slot names it"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Whole calls against the reference
// ---------------------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_logits_and_topk_match_the_reference() {
    let gpu = common::gpu("gpu_logits_and_topk_match_the_reference");
    let (seed, mut rng) = seeded("gpu_logits_topk");
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        for next_n in [1usize, 2] {
            let lens = [0usize, 1, 33, 128, 129, 511, 512, 513, 1000, 2047];
            let (batch, cap) = (lens.len(), 2047usize);
            let host = written_cache(&mut rng, format, &lens, cap);
            let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
            let rows = batch * next_n;
            let (q, w) = random_queries(&mut rng, rows);
            let nv = model_num_valid(&lens, next_n);
            let qb = QueryBatch::upload(&gpu, batch, next_n, &q, &w, &nv).unwrap();
            for k in [512usize, 1024, 2048] {
                let label = format!("seed {seed} {format:?} next_n {next_n} k {k}");
                let mut rig = IndexerRig::new(&gpu, rows, cap, k);
                let (scores, topk) = rig.run(&gpu, &label, TopkPath::Default, &qb, &cache);
                check_logits_rows(&label, &scores, cap, &host, &q, &w, next_n, &nv, 1);
                check_topk_of_scores(&label, &scores, cap, &nv, k, &topk);
                if format == KeyFormat::Fp8 && next_n == 1 {
                    check_baseline(
                        &gpu,
                        &label,
                        &rig,
                        &qb,
                        &cache,
                        &host,
                        (&q, &w, &nv),
                        k,
                        &topk.0,
                    );
                }
            }
        }
    }
}

/// The seeds' baseline on the same inputs: its top-k of the routed call's scores must give the same indices,
/// and its fp32 logits agree with the reference within fp32 rounding.
#[allow(clippy::too_many_arguments)]
fn check_baseline(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    rig: &IndexerRig,
    qb: &QueryBatch,
    cache: &KeyCacheGpu,
    host: &KeyCacheHost,
    (q, w, nv): (&[u8], &[f32], &[i32]),
    k: usize,
    want_idx: &[i32],
) {
    use indexer::bench::{baseline_logits, baseline_topk, BaselineWorkspace};
    let (rows, cap, stream) = (qb.rows(), cache.capacity, &gpu.stream);
    let mut arena =
        Arena::new(gpu, BaselineWorkspace::workspace_bytes(qb.batch, rows, cap)).unwrap();
    let base = BaselineWorkspace::carve(&mut arena, qb.batch, rows, cap).unwrap();
    let out = TopkOutput::new(gpu, rows, k).unwrap();
    baseline_topk(
        gpu,
        stream,
        &rig.ws.scores,
        cap,
        &qb.num_valid,
        rows,
        k,
        &base,
        &out.idx,
        &out.score,
    )
    .unwrap();
    wait(gpu, &format!("{label}: baseline top-k"));
    assert_eq!(
        out.download(gpu).unwrap().0,
        want_idx,
        "{label}: baseline sort top-k differs"
    );
    let bs = gpu.poisoned::<f32>(rows * cap, POISON).unwrap();
    baseline_logits(gpu, stream, qb, cache, &base, &bs, cap).unwrap();
    wait(gpu, &format!("{label}: baseline logits"));
    let bscores = gpu.download(&bs).unwrap();
    let shape = IndexerShape {
        batch: qb.batch,
        next_n: qb.next_n,
        num_valid: nv.to_vec(),
    };
    let want = reference::logits(&shape, q, w, host);
    for r in 0..rows {
        for j in 0..nv[r] as usize {
            let mag = reference::logit_magnitude(&shape, q, w, host, r, j);
            let err = (bscores[r * cap + j] as f64 - want[r][j] as f64).abs();
            assert!(
                // fp32 dequant (1 rounding) + 128-term FMA dot + 64-term head sum, each rounding <= 2^-24 of a
                // running |sum| <= mag: (1+128+64) * 2^-24 < 1.2e-5.
                err <= 1.2e-5 * mag + 1e-30,
                "{label}: baseline logit row {r} j {j}: {} vs {}",
                bscores[r * cap + j],
                want[r][j]
            );
        }
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_indexer_run_along_every_topk_path_matches_the_default_run() {
    let gpu = common::gpu("gpu_indexer_run_along_every_topk_path_matches_the_default_run");
    let (seed, mut rng) = seeded("gpu_run_paths");
    // Whole call (logits, then the top-k; through PDL the histogram launch overlaps the logits' tail): every
    // top-k path gives the default run's indices and scores exactly, eagerly (two calls back to back on the same
    // workspace) and as a replayed CUDA graph. The default run is checked exact against the reference top-k of
    // its own scores, so "equal to the default" is not "equal to a wrong answer".
    let lens = [20_000usize, 513, 7_777, 1, 0];
    let cap = 20_000usize;
    let host = random_fp8_cache(&mut rng, lens.len(), cap);
    let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
    for next_n in [1usize, 2] {
        let rows = lens.len() * next_n;
        let (q, w) = random_queries(&mut rng, rows);
        let nv: Vec<i32> = (0..rows)
            .map(|r| (lens[r / next_n] as i32 - (r % next_n) as i32 * 3).max(0))
            .collect();
        let qb = QueryBatch::upload(&gpu, lens.len(), next_n, &q, &w, &nv).unwrap();
        for k in [512usize, 2048] {
            let label = format!("seed {seed} next_n {next_n} k {k}");
            let mut def = IndexerRig::new(&gpu, rows, cap, k);
            let (scores, want) = def.run(&gpu, &label, TopkPath::Default, &qb, &cache);
            check_topk_of_scores(&label, &scores, cap, &nv, k, &want);
            for path in [TopkPath::Chain, TopkPath::Pdl] {
                let mut rig = IndexerRig::new(&gpu, rows, cap, k);
                for call in 0..2 {
                    let (_, got) = rig.run(&gpu, &label, path, &qb, &cache);
                    assert_same_topk(
                        &format!("{label} {path:?} call {call} vs default"),
                        k,
                        &got,
                        &want,
                    );
                }
                let graph = gpu
                    .capture(|| {
                        indexer::run_with(
                            &gpu,
                            &gpu.stream,
                            path,
                            &qb,
                            &cache,
                            &rig.ws,
                            &rig.out.idx,
                            &rig.out.score,
                        )
                    })
                    .unwrap();
                for replay in 0..3 {
                    rig.poison(&gpu);
                    graph.launch().unwrap();
                    let what = format!("{label} {path:?} graph replay {replay}");
                    wait(&gpu, &what);
                    assert_same_topk(&what, k, &rig.download(&gpu).1, &want);
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_decode_graph_replays_follow_device_num_valid() {
    let gpu = common::gpu("gpu_decode_graph_replays_follow_device_num_valid");
    let (seed, mut rng) = seeded("gpu_decode_graph");
    // The decode-sized call (a few sequences, every key written by the writer) captured ONCE per (format, next_n,
    // k); between replays only the device-side num_valid changes (Gpu::write): 0, lengths below k, lengths not
    // divisible by 128, the capacity, and one above it (clamped to the capacity, the stated contract). Scores
    // and outputs are poisoned before every replay, so each replay must write exactly the visible range and the
    // top-k of it: logits against the f64 reference, top-k exact against the reference top-k of those scores.
    let (batch, cap) = (4usize, 8192usize);
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        let host = written_cache(&mut rng, format, &vec![cap; batch], cap);
        let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
        for next_n in [1usize, 2] {
            let rows = batch * next_n;
            let (q, w) = random_queries(&mut rng, rows);
            let mut qb =
                QueryBatch::upload(&gpu, batch, next_n, &q, &w, &vec![cap as i32; rows]).unwrap();
            for k in [512usize, 1024] {
                let mut rig = IndexerRig::new(&gpu, rows, cap, k);
                // One eager call first: loads the module and sets the kernels' attributes outside the capture.
                rig.run(&gpu, "warm-up", TopkPath::Default, &qb, &cache);
                let graph = gpu
                    .capture(|| {
                        indexer::run(
                            &gpu,
                            &gpu.stream,
                            &qb,
                            &cache,
                            &rig.ws,
                            &rig.out.idx,
                            &rig.out.score,
                        )
                    })
                    .unwrap();
                let cases: [[usize; 4]; 6] = [
                    [0, 0, 0, 0],
                    [1, k - 1, 129, 1000],
                    [cap, 0, 4097, 300],
                    [8191, 5, k, 2 * k + 3],
                    [cap, cap, cap, cap],
                    [cap + 77, 3, 0, 640],
                ];
                for lens in cases {
                    let label =
                        format!("seed {seed} {format:?} next_n {next_n} k {k} lens {lens:?}");
                    let nv = model_num_valid(&lens, next_n);
                    gpu.write(&gpu.stream, &mut qb.num_valid, &nv).unwrap();
                    rig.poison(&gpu);
                    graph.launch().unwrap();
                    wait(&gpu, &label);
                    let (scores, topk) = rig.download(&gpu);
                    let visible: Vec<i32> = nv.iter().map(|&n| n.min(cap as i32)).collect();
                    check_logits_rows(&label, &scores, cap, &host, &q, &w, next_n, &visible, 61);
                    check_topk_of_scores(&label, &scores, cap, &visible, k, &topk);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Top-k
// ---------------------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_long_rows_and_specials() {
    let gpu = common::gpu("gpu_topk_long_rows_and_specials");
    let (seed, mut rng) = seeded("gpu_topk_long");
    let lens = [262_144usize, 32_768, 32_769, 65_535, 100_000, 2049];
    for k in [512usize, 2048] {
        let rows: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                (0..n)
                    .map(|_| match (r, rng.random_range(0..20)) {
                        (1, _) => 7.0, // all equal
                        (_, 0) => f32::NAN,
                        (_, 1) => f32::NEG_INFINITY,
                        (_, 2) => -0.0,
                        (_, v) if v < 8 => (v % 3) as f32, // heavy ties
                        _ => rng.random_range(-100.0f32..100.0),
                    })
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let s = ScoreRows::upload(&gpu, &refs, 0);
        let mut rig = TopkRig::new(&gpu, lens.len(), k, s.stride);
        // Three calls of each path on the same workspace (the histogram and counters must be back to zero after
        // every call: a missing reset shows up as a wrong second answer).
        for path in [TopkPath::Chain, TopkPath::Pdl] {
            for call in 0..3 {
                let label = format!("seed {seed} k {k} {path:?} call {call}");
                let got = rig.run(&gpu, &label, path, &s);
                check_topk_of_scores(&label, &s.flat, s.stride, &s.nv, k, &got);
            }
        }
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_final_branches_match_reference() {
    let gpu = common::gpu("gpu_topk_final_branches_match_reference");
    let (seed, mut rng) = seeded("gpu_topk_final_branches");
    let lens = [
        1usize, 3, 100, 511, 512, 513, 1000, 4097, 20_000, 65_536, 262_144,
    ];
    // Row classes seen: the one-CTA select/sort shapes (rank select, rank sort, select fallback, sort fallback)
    // and the multi-CTA pass's rank path / one-CTA fallback: every class must be exercised.
    let mut cover = [0usize; 6];
    for k in [1usize, 7, 300, 511, 512, 513, 2048] {
        let rows: Vec<Vec<f32>> = (0..lens.len() * 5)
            .map(|r| {
                let (n, pattern) = (lens[r % lens.len()], r / lens.len());
                (0..n)
                    .map(|_| match pattern {
                        // Logit-like (sum of uniforms): threshold buckets of a few hundred entries.
                        0 => (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0,
                        // Log-uniform magnitudes: small buckets at every length.
                        1 => {
                            let m = f32::powf(2.0, rng.random_range(-60.0f32..60.0));
                            if rng.random_range(0..2) == 0 {
                                m
                            } else {
                                -m
                            }
                        }
                        2 => rng.random_range(-10.0f32..10.0),
                        3 => rng.random_range(0..3) as f32, // heavy ties: large buckets (fallback)
                        _ => match rng.random_range(0..10) {
                            0 => f32::NAN,
                            1 => f32::NEG_INFINITY,
                            2 => f32::INFINITY,
                            3 => -0.0,
                            _ => rng.random_range(-1.0f32..1.0),
                        },
                    })
                    .collect()
            })
            .collect();
        for row in &rows {
            let (sel, sort) = one_cta_paths(row, k);
            cover[0] += sel as usize;
            cover[1] += sort as usize;
            cover[2] += (!sel) as usize;
            cover[3] += (!sort) as usize;
            let fallback = mcta_fallback(row, k);
            cover[4] += (!fallback) as usize;
            cover[5] += fallback as usize;
        }
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let s = ScoreRows::upload(&gpu, &refs, 262_144);
        let mut rig = TopkRig::new(&gpu, rows.len(), k, s.stride);
        // Three plain-chain calls on the same workspace (each final pass must leave the histogram and counters
        // zeroed, so every call gives the reference answer), then two through the PDL entry points.
        let calls = [
            TopkPath::Chain,
            TopkPath::Chain,
            TopkPath::Chain,
            TopkPath::Pdl,
            TopkPath::Pdl,
        ];
        for (call, &path) in calls.iter().enumerate() {
            let label = format!("seed {seed} k {k} call {call} ({path:?})");
            let got = rig.run(&gpu, &label, path, &s);
            check_topk_of_scores(&label, &s.flat, s.stride, &s.nv, k, &got);
        }
    }
    assert!(
        cover.iter().all(|&c| c > 0),
        "seed {seed:#x}: rows per class (one-CTA rank select, rank sort, select fallback, sort fallback; \
         multi-CTA rank, multi-CTA fallback) = {cover:?}"
    );
}

/// Rows for the multi-CTA final pass: (scores, label). Lengths around k, multiples of 128 +- 1, the pass-1/2 slice
/// (4096 +- 1), random up to 262,144; patterns: logit-like, all equal, all zero (+-0), NaN / +-inf mixes, three
/// values; and directed rows whose threshold bucket holds exactly TOPK_BUCKET_CAP - 1, CAP, CAP + 1 entries
/// (the edge between the multi-CTA rank path and its one-CTA fallback).
fn mcta_rows(rng: &mut ChaCha8Rng, k: usize) -> Vec<(Vec<f32>, String)> {
    let mut lens = vec![
        0usize,
        1,
        2,
        k - 1,
        k,
        k + 1,
        127,
        129,
        383,
        385,
        4095,
        4097,
        8191,
    ];
    lens.push(rng.random_range(1..=262_144));
    lens.push(262_144);
    let mut rows = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        let patterns: &[usize] = if n >= 100_000 {
            &[0, 3 + i % 2]
        } else {
            &[0, 1, 2, 3, 4]
        };
        for &p in patterns {
            let v: Vec<f32> = (0..n)
                .map(|j| match p {
                    0 => (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0,
                    1 => 1.25,
                    2 => {
                        if j % 3 == 0 {
                            -0.0
                        } else {
                            0.0
                        }
                    }
                    3 => match rng.random_range(0..10) {
                        0 => f32::NAN,
                        1 => f32::NEG_INFINITY,
                        2 => f32::INFINITY,
                        3 => -0.0,
                        _ => rng.random_range(-1.0f32..1.0),
                    },
                    _ => rng.random_range(0..3) as f32,
                })
                .collect();
            rows.push((v, format!("len {n} pattern {p}")));
        }
    }
    // Directed buckets: 100 entries far above (distinct), nb entries in the bin of [1, 1.125) (distinct), the
    // rest at -5; shuffled. Threshold bin = that of 1.0, a = 100, rem = k - 100 < nb.
    let cap = indexer::TOPK_BUCKET_CAP;
    for nb in [cap - 1, cap, cap + 1] {
        let n = 12_000usize;
        let mut v: Vec<f32> = (0..n)
            .map(|j| {
                if j < 100 {
                    1000.0 + j as f32
                } else if j < 100 + nb {
                    1.0 + (j - 100) as f32 * f32::powi(2.0, -20)
                } else {
                    -5.0
                }
            })
            .collect();
        use rand::seq::SliceRandom;
        v.shuffle(rng);
        rows.push((v, format!("bucket of {nb}")));
    }
    rows
}

/// The top-k along `path` on `rows` (`calls` back-to-back calls on the same workspace), each call exact against
/// the reference (indices and score bits): a call that left the histogram, counters or arrival counters dirty
/// makes the next call's threshold (and answer) wrong. A path other than [`TopkPath::Default`] is also compared
/// with one default call bit for bit.
fn check_topk_path(
    gpu: &megamoe::gpu::Gpu,
    seed: u64,
    k: usize,
    rows: &[(Vec<f32>, String)],
    calls: usize,
    path: TopkPath,
) {
    let refs: Vec<&[f32]> = rows.iter().map(|r| r.0.as_slice()).collect();
    let s = ScoreRows::upload(gpu, &refs, 0);
    let label = format!("seed {seed:#x} k {k} ({} rows)", rows.len());
    let default_out = (path != TopkPath::Default).then(|| {
        TopkRig::new(gpu, rows.len(), k, s.stride).run(gpu, &label, TopkPath::Default, &s)
    });
    let mut rig = TopkRig::new(gpu, rows.len(), k, s.stride);
    for call in 0..calls {
        let got = rig.run(gpu, &label, path, &s);
        if let Some(def) = &default_out {
            assert_same_topk(
                &format!("{label} call {call}: {path:?} vs default"),
                k,
                &got,
                def,
            );
        }
        for (r, (v, what)) in rows.iter().enumerate() {
            assert_topk_row(
                &format!("{label} {path:?} call {call} row {r} ({what})"),
                v,
                k,
                &got.0[r * k..(r + 1) * k],
                &got.1[r * k..(r + 1) * k],
            );
        }
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_multi_cta_matches_reference() {
    let gpu = common::gpu("gpu_topk_multi_cta_matches_reference");
    let (seed, mut rng) = seeded("gpu_topk_mcta");
    for k in [512usize, 1024, 2048] {
        let rows = mcta_rows(&mut rng, k);
        // The final pass's CTAs per row depend on the row count (2 * SMs / rows, clamped to 8..=32): all rows
        // in one launch (8 per row), then the last 9 rows alone (the longest rows and the directed buckets;
        // 29 per row on 132 SMs).
        check_topk_path(&gpu, seed, k, &rows, 3, TopkPath::Chain);
        check_topk_path(&gpu, seed, k, &rows[rows.len() - 9..], 2, TopkPath::Chain);
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_pdl_matches_default_and_reference() {
    let gpu = common::gpu("gpu_topk_pdl_matches_default_and_reference");
    let (seed, mut rng) = seeded("gpu_topk_pdl");
    for k in [1usize, 512, 2048] {
        // num_valid 0, 1, 2, k +- 1, 4095 / 4097, 262,144 and more, mixed in one launch; ties, specials,
        // threshold buckets at the multi-CTA cap. Back-to-back calls on the same workspace: a PDL launch that
        // let a kernel touch the histogram / counters before its predecessor finished shows up as a wrong
        // threshold in a later call.
        let rows = mcta_rows(&mut rng, k.max(2));
        let calls = if k == 512 { 3 } else { 2 };
        check_topk_path(&gpu, seed, k, &rows, calls, TopkPath::Pdl);
        // The longest rows and the directed buckets alone (more final-pass CTAs per row).
        check_topk_path(&gpu, seed, k, &rows[rows.len() - 9..], 2, TopkPath::Pdl);
    }
}

/// Graph replays of the top-k along `path` with new scores written into the captured input before each, then an
/// eager call on the same workspace: all exact (a replay that left the protocol buffers dirty shows up in the
/// next replay).
fn check_topk_graph_replays(
    gpu: &megamoe::gpu::Gpu,
    seed: u64,
    rng: &mut ChaCha8Rng,
    path: TopkPath,
) {
    let k = 512usize;
    let lens = [262_144usize, 0, 70_001, 513, 4097];
    let make = |rng: &mut ChaCha8Rng| -> Vec<Vec<f32>> {
        lens.iter()
            .map(|&n| {
                (0..n)
                    .map(|_| (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0)
                    .collect()
            })
            .collect()
    };
    let rows = make(rng);
    let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
    let mut s = ScoreRows::upload(gpu, &refs, 0);
    let mut rig = TopkRig::new(gpu, lens.len(), k, s.stride);
    // One eager call first: loads the module and sets the shared-memory attribute outside the capture (and must
    // itself leave the workspace clean for the first replay).
    let label = format!("seed {seed} {path:?}");
    let got = rig.run(gpu, &label, path, &s);
    check_topk_of_scores(&label, &s.flat, s.stride, &s.nv, k, &got);
    let graph = gpu
        .capture(|| {
            indexer::topk_with(
                gpu,
                &gpu.stream,
                path,
                &s.dev,
                &s.nv_dev,
                &rig.ws,
                &rig.out.idx,
                &rig.out.score,
            )
        })
        .unwrap();
    for replay in 0..4 {
        for (r, row) in make(rng).iter().enumerate() {
            s.flat[r * s.stride..r * s.stride + row.len()].copy_from_slice(row);
        }
        gpu.write(&gpu.stream, &mut s.dev, &s.flat).unwrap();
        rig.out.fill(&gpu.stream, POISON).unwrap();
        graph.launch().unwrap();
        let what = format!("{label} graph replay {replay}");
        wait(gpu, &what);
        check_topk_of_scores(
            &what,
            &s.flat,
            s.stride,
            &s.nv,
            k,
            &rig.out.download(gpu).unwrap(),
        );
    }
    let what = format!("{label}: eager call after the graph replays");
    let got = rig.run(gpu, &what, path, &s);
    check_topk_of_scores(&what, &s.flat, s.stride, &s.nv, k, &got);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_chain_graph_replays_leave_the_workspace_clean() {
    let gpu = common::gpu("gpu_topk_chain_graph_replays_leave_the_workspace_clean");
    let (seed, mut rng) = seeded("gpu_topk_chain_graph");
    check_topk_graph_replays(&gpu, seed, &mut rng, TopkPath::Chain);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_topk_pdl_graph_replays_leave_the_workspace_clean() {
    let gpu = common::gpu("gpu_topk_pdl_graph_replays_leave_the_workspace_clean");
    let (seed, mut rng) = seeded("gpu_topk_pdl_graph");
    check_topk_graph_replays(&gpu, seed, &mut rng, TopkPath::Pdl);
}

// ---------------------------------------------------------------------------------------------------------
// FP8 logits (TMA ring + wgmma)
// ---------------------------------------------------------------------------------------------------------

/// Random queries over `host` with num_valid `nv`, the FP8 logits into a poisoned buffer, checked against the
/// f64 reference at every `ref_step`-th visible entry and every tile edge; nothing past n_seq(b) written.
fn check_fp8_logits(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    host: &KeyCacheHost,
    next_n: usize,
    nv: &[i32],
    ref_step: usize,
    rng: &mut ChaCha8Rng,
) {
    let (q, w) = random_queries(rng, host.batch * next_n);
    let cache = KeyCacheGpu::upload(gpu, host).unwrap();
    let qb = QueryBatch::upload(gpu, host.batch, next_n, &q, &w, nv).unwrap();
    let label = format!(
        "{label} next_n {next_n} (batch {}, capacity {})",
        host.batch, host.capacity
    );
    let (got, stride) = logits_poisoned(gpu, &label, &qb, &cache);
    check_logits_rows(&label, &got, stride, host, &q, &w, next_n, nv, ref_step);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_logits_match_the_reference() {
    let gpu = common::gpu("gpu_fp8_logits_match_the_reference");
    let (seed, mut rng) = seeded("gpu_fp8_logits");
    for next_n in [1usize, 2] {
        // Tile edges; odd capacity 4097 (the per-sequence scale plane is not 16-byte aligned, and the last
        // sequence's last tile runs past the end of both planes: the TMA zero-fills those rows; earlier
        // sequences' tails read the next sequence's poisoned slots). Sequence 0 is empty: the CTAs whose first
        // item lies in it copy and consume that tile but must store nothing.
        let lens = [0usize, 1, 63, 64, 65, 127, 129, 1000, 4033, 4097];
        let cap = 4097usize;
        let mut host = written_cache(&mut rng, KeyFormat::Fp8, &lens, cap);
        poison_cache_tails(&mut host, &lens);
        let nv = model_num_valid(&lens, next_n);
        check_fp8_logits(
            &gpu,
            &format!("seed {seed} tile edges"),
            &host,
            next_n,
            &nv,
            1,
            &mut rng,
        );

        // Long mixed rows: each persistent CTA owns several tiles (the 6-7 stage ring wraps many times),
        // sequence changes inside a CTA's range, empty tiles (sequence 1 has 33 keys of 1094 tiles), the full
        // e4m3 code range, scales over 2^-12 .. 2^4.
        let cap = 70_001usize;
        let lens = [70_001usize, 33, 20_001];
        let mut host = random_fp8_cache(&mut rng, 3, cap);
        poison_cache_tails(&mut host, &lens);
        let nv: Vec<i32> = (0..3 * next_n)
            .map(|r| lens[r / next_n] as i32 - (r % next_n) as i32)
            .collect();
        check_fp8_logits(
            &gpu,
            &format!("seed {seed} long rows"),
            &host,
            next_n,
            &nv,
            61,
            &mut rng,
        );

        // Many short sequences of different lengths (batch 40: q reloaded often, one CTA sees several
        // sequences), capacity a multiple of 64 (tails read the next sequence's slots, the last one ends
        // exactly at the plane's end).
        let cap = 1_536usize;
        let lens: Vec<usize> = (0..40).map(|b| [cap, 1, 64, 700, 1_535][b % 5]).collect();
        let mut host = random_fp8_cache(&mut rng, lens.len(), cap);
        poison_cache_tails(&mut host, &lens);
        let nv: Vec<i32> = (0..lens.len() * next_n)
            .map(|r| lens[r / next_n] as i32)
            .collect();
        check_fp8_logits(
            &gpu,
            &format!("seed {seed} batch 40"),
            &host,
            next_n,
            &nv,
            7,
            &mut rng,
        );
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_logits_nan_policy_and_empty_calls_match_the_reference() {
    let gpu = common::gpu("gpu_fp8_logits_nan_policy_and_empty_calls_match_the_reference");
    let (seed, mut rng) = seeded("gpu_fp8_logits_nan");
    // NaN key codes (0x7F / 0xFF) make every head's dot product NaN -> relu gives 0 -> score 0, as in the
    // reference (compared as values: the top-k ranks -0 as +0). A NaN fp32 key scale gives a NaN score: the kernel applies the scale after
    // relu (NaN x 0 = NaN), which the top-k ranks as -inf (module docs); the reference, which folds the scale
    // into the key values, gives 0 there, so those entries are checked for NaN only. Every other entry is
    // checked against the f64 reference within LOGITS_TOL. A call with every num_valid 0 writes nothing.
    let (cap, n) = (300usize, 300usize);
    let mut host = random_fp8_cache(&mut rng, 2, cap);
    let mut nan_code = vec![];
    let mut nan_scale = vec![];
    for b in 0..2 {
        for j in (0..n).step_by(7) {
            let s = host.slot(b, j);
            host.codes[s * HEAD_DIM + rng.random_range(0..HEAD_DIM)] = [0x7F, 0xFF][j % 2];
            nan_code.push((b, j));
        }
        for j in (3..n).step_by(11) {
            let s = host.slot(b, j);
            host.scales[s * 4..s * 4 + 4].copy_from_slice(&f32::NAN.to_le_bytes());
            nan_scale.push((b, j));
        }
    }
    for next_n in [1usize, 2] {
        let rows = 2 * next_n;
        let (q, w) = random_queries(&mut rng, rows);
        let q_f64 = decode_q(&q);
        let nv = vec![n as i32; rows];
        let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
        let qb = QueryBatch::upload(&gpu, 2, next_n, &q, &w, &nv).unwrap();
        let label = format!("seed {seed} NaN entries next_n {next_n}");
        let (sw, stride) = logits_poisoned(&gpu, &label, &qb, &cache);
        let shape = IndexerShape {
            batch: 2,
            next_n,
            num_valid: nv.clone(),
        };
        let want = reference::logits(&shape, &q, &w, &host);
        for row in 0..rows {
            let b = row / next_n;
            for j in 0..n {
                let got = sw[row * stride + j];
                if nan_scale.contains(&(b, j)) {
                    assert!(
                        got.is_nan(),
                        "seed {seed} next_n {next_n} row {row} j {j} (NaN scale): got {got:e}, want NaN"
                    );
                } else if nan_code.contains(&(b, j)) {
                    assert!(
                        got == 0.0 && want[row][j] == 0.0,
                        "seed {seed} next_n {next_n} row {row} j {j} (NaN code): got {got:e} ({:#010x}), reference \
                         {:e} ({:#010x}), want 0",
                        got.to_bits(),
                        want[row][j],
                        want[row][j].to_bits()
                    );
                } else {
                    let (r, mag) = ref_score(&q_f64, &w, &host, row, host.slot(b, j));
                    let err = (got as f64 - r).abs();
                    assert!(
                        got.is_finite() && err <= LOGITS_TOL * mag + 1e-30,
                        "seed {seed} next_n {next_n} row {row} j {j}: got {got:e} ref {r:e} err {err:e} (mag {mag:e})"
                    );
                }
            }
        }
        // Every num_valid 0: nothing written.
        let qb0 = QueryBatch::upload(&gpu, 2, next_n, &q, &w, &vec![0; rows]).unwrap();
        let (got0, _) = logits_poisoned(&gpu, &format!("{label}, num_valid all 0"), &qb0, &cache);
        assert!(
            got0.iter().all(|v| v.to_bits() == u32::MAX),
            "seed {seed} next_n {next_n}: num_valid all 0 but the logits wrote scores"
        );
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_fp8_indexer_selects_the_reference_topk() {
    let gpu = common::gpu("gpu_fp8_indexer_selects_the_reference_topk");
    let (seed, mut rng) = seeded("gpu_fp8_topk");
    let lens = [20_000usize, 513, 7_777];
    let cap = 20_000usize;
    let host = random_fp8_cache(&mut rng, lens.len(), cap);
    let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
    for next_n in [1usize, 2] {
        let rows = lens.len() * next_n;
        let (q, w) = random_queries(&mut rng, rows);
        let q_f64 = decode_q(&q);
        let nv: Vec<i32> = (0..rows).map(|r| lens[r / next_n] as i32).collect();
        let qb = QueryBatch::upload(&gpu, lens.len(), next_n, &q, &w, &nv).unwrap();
        // Reference scores and error scales per row (the key_f64 values already include the key scale).
        let refs_all: Vec<Vec<(f64, f64)>> = (0..rows)
            .map(|r| {
                (0..nv[r] as usize)
                    .map(|j| ref_score(&q_f64, &w, &host, r, host.slot(r / next_n, j)))
                    .collect()
            })
            .collect();
        for k in [512usize, 2048] {
            let label = format!("seed {seed} next_n {next_n} k {k}");
            let mut rig = IndexerRig::new(&gpu, rows, cap, k);
            let (scores, (idx, _)) = rig.run(&gpu, &label, TopkPath::Default, &qb, &cache);
            let stride = cap;
            for r in 0..rows {
                let n = nv[r] as usize;
                let got = &scores[r * stride..r * stride + n];
                // Exact on the GPU's own scores (the top-k contract).
                if let Err(e) = reference::check_topk_exact(got, k, &idx[r * k..(r + 1) * k]) {
                    panic!("seed {seed} next_n {next_n} k {k} row {r}: {e}");
                }
                // Against the f64 reference: every entry clearly above the reference k-th score (by more than
                // both error bounds) is selected, and nothing clearly below it is.
                let refs = &refs_all[r];
                let kk = k.min(n);
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &c| refs[c].0.total_cmp(&refs[a].0).then(a.cmp(&c)));
                let kth = refs[order[kk - 1]];
                let max_tol = refs.iter().map(|x| x.1).fold(0.0, f64::max) * LOGITS_TOL;
                let selected: std::collections::HashSet<i32> =
                    idx[r * k..r * k + kk].iter().copied().collect();
                for (j, &(s, _)) in refs.iter().enumerate() {
                    let sel = selected.contains(&(j as i32));
                    assert!(
                        s <= kth.0 + 2.0 * max_tol || sel,
                        "seed {seed} next_n {next_n} k {k} row {r}: j {j} (ref {s:e}, gpu {:e}) is above the reference k-th \
                         ({:e}) by more than 2 x {max_tol:e} but not selected",
                        got[j],
                        kth.0
                    );
                    assert!(
                        s >= kth.0 - 2.0 * max_tol || !sel,
                        "seed {seed} next_n {next_n} k {k} row {r}: j {j} (ref {s:e}, gpu {:e}) is below the reference k-th \
                         ({:e}) by more than 2 x {max_tol:e} but selected",
                        got[j],
                        kth.0
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Stress subset and bench hooks
// ---------------------------------------------------------------------------------------------------------

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_stress_quick() {
    let gpu = common::gpu("gpu_stress_quick");
    let (seed, _) = seeded("gpu_stress_quick");
    let rep = stress::run_stress(&gpu, &stress::StressOptions::quick(seed)).unwrap();
    eprintln!("{}", rep.summary());
    if rep.hung.is_some() {
        // A hung kernel cannot be cancelled: report and leave without tearing the context down.
        eprintln!("HANG detected; exiting the test process");
        std::process::exit(3);
    }
    assert!(rep.passed(), "{}", rep.summary());
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_bench_timing_smoke() {
    use indexer::bench::{bench_inputs, time_variant, traffic_bytes, VARIANTS};
    let gpu = common::gpu("gpu_bench_timing_smoke");
    let plan = TimingPlan {
        warmup: 1,
        reps: 3,
        flush_l2: false,
    };
    let inp = bench_inputs(&gpu, KeyFormat::Fp8, 2, 1, 4096, 7).unwrap();
    for &v in VARIANTS {
        let s = time_variant(&gpu, v, &inp, 512, plan).unwrap();
        assert!(
            s.total.len() == 3 && s.total.iter().all(|&t| t > 0.0),
            "{v}: {:?}",
            s.total
        );
    }
    assert_eq!(
        traffic_bytes(&inp, 512).0 as usize,
        2 * 4096 * 132 + 2 * 64 * 132 + 2 * 4096 * 4
    );
}

#[test]
fn bench_config_races_both_top_k_launch_modes() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/indexer.toml"
    ))
    .unwrap();
    let cfg = megamoe::bench::config::SweepConfig::from_toml_str(&text).unwrap();
    assert_eq!(indexer::TopkPath::default(), indexer::TopkPath::Default);
    // The default top-k is the PDL chain for k <= TOPK_PDL_MAX_K, the plain chain above: each sweep races the
    // default against the other launch mode at its k.
    assert_eq!(indexer::TOPK_PDL_MAX_K, 512);
    let races = |axis: &str, value: u64, fixed: (&str, u64), k: u64, pair: (&str, &str)| {
        cfg.sweeps
            .iter()
            .filter(|s| s.kernel == "indexer")
            .any(|s| {
                let vars = s.variants_from(indexer::bench::VARIANTS).unwrap();
                s.axis == axis
                    && s.values.contains(&value)
                    && s.param_u64(fixed.0).unwrap_or(1) == fixed.1
                    && s.param_u64("k").unwrap_or(512) == k
                    && (!s.has_param("format") || s.param_str("format").unwrap() == "fp8")
                    && vars.iter().any(|v| v == pair.0)
                    && vars.iter().any(|v| v == pair.1)
            })
    };
    let (eager, graph) = (
        ("fused", "fused_chain"),
        ("graph_fused", "graph_fused_chain"),
    );
    assert!(races("ctx", 1_048_576, ("batch", 1), 512, eager), "1M b1");
    assert!(races("ctx", 4096, ("batch", 1), 512, graph), "4K b1, graph");
    assert!(
        races("ctx", 1_048_576, ("batch", 1), 512, graph),
        "1M b1, graph"
    );
    assert!(races("batch", 16, ("ctx", 65_536), 512, eager), "64K b16");
    assert!(
        races("batch", 64, ("ctx", 65_536), 512, graph),
        "64K b64, graph"
    );
    let (eager, graph) = (("fused", "fused_pdl"), ("graph_fused", "graph_fused_pdl"));
    assert!(
        races("batch", 16, ("ctx", 1_048_576), 1024, eager),
        "1M b16 k 1024"
    );
    assert!(
        races("batch", 16, ("ctx", 1_048_576), 1024, graph),
        "1M b16 k 1024, graph"
    );
}

#[test]
fn bench_kernel_headline_is_the_routed_call_and_its_baseline() {
    let all = megamoe::bench::kernels::all();
    let k = all.iter().find(|k| k.name == "indexer").unwrap();
    assert_eq!(k.variants, indexer::bench::VARIANTS);
    for v in ["fused", "graph_fused", "baseline"] {
        assert!(k.headline.contains(&v) && k.variants.contains(&v), "{v}");
    }
    let metrics: Vec<&str> = k.targets.iter().map(|t| t.metric).collect();
    assert_eq!(metrics, ["us_median", "pct_copy_bw", "speedup_vs_baseline"]);
}

#[test]
fn bench_config_parses() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/indexer.toml"
    ))
    .unwrap();
    let cfg = megamoe::bench::config::SweepConfig::from_toml_str(&text).unwrap();
    assert!(cfg
        .sweeps
        .iter()
        .any(|s| s.kernel == "indexer" && s.values.contains(&1_048_576)));
}

// ---------------------------------------------------------------------------------------------------------
// `megamoe exec indexer` (CPU path and argument validation; the GPU path is the tested `indexer::run`).
// ---------------------------------------------------------------------------------------------------------

fn exec_inputs(
    rng: &mut ChaCha8Rng,
    format: KeyFormat,
    batch: usize,
    next_n: usize,
    cap: usize,
    k: i32,
) -> (
    megamoe::ops::exec::TensorMap,
    KeyCacheHost,
    Vec<u8>,
    Vec<f32>,
    Vec<i32>,
) {
    use megamoe::ops::exec::HostTensor;
    use safetensors::Dtype;
    let rows = batch * next_n;
    let mut host = KeyCacheHost::new(format, batch, cap);
    for b in 0..batch {
        for j in 0..cap {
            host.write_key(host.slot(b, j), &random_key(rng, 2.0))
                .unwrap();
        }
    }
    let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| reference::random_e4m3(rng))
        .collect();
    let w: Vec<f32> = (0..rows * NUM_HEADS)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let nv: Vec<i32> = (0..rows)
        .map(|_| rng.random_range(0..=cap as i32))
        .collect();
    let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut m = megamoe::ops::exec::TensorMap::new();
    m.insert(
        "q".into(),
        HostTensor::from_u8(Dtype::F8_E4M3, vec![rows, NUM_HEADS, HEAD_DIM], q.clone()),
    );
    m.insert("w".into(), HostTensor::from_f32(vec![rows, NUM_HEADS], &w));
    m.insert(
        "num_valid".into(),
        HostTensor::from_u8(Dtype::I32, vec![rows], i32s(&nv)),
    );
    let cb = format.code_bytes();
    m.insert(
        "key_codes".into(),
        HostTensor::from_u8(Dtype::U8, vec![batch, cap, cb], host.codes.clone()),
    );
    let scales = match format {
        KeyFormat::Fp8 => HostTensor::from_u8(Dtype::F32, vec![batch, cap], host.scales.clone()),
        KeyFormat::Mxfp4 => {
            HostTensor::from_u8(Dtype::U8, vec![batch, cap, 4], host.scales.clone())
        }
    };
    m.insert("key_scales".into(), scales);
    m.insert(
        "k".into(),
        HostTensor::from_u8(Dtype::I32, vec![1], i32s(&[k])),
    );
    (m, host, q, w, nv)
}

#[test]
fn exec_indexer_cpu_matches_reference_and_rejects_bad_arguments() {
    use megamoe::ops::exec::HostTensor;
    use safetensors::Dtype;
    let (seed, mut rng) = seeded("exec_indexer");
    let entry = megamoe::ops::registry::exec_kernels()
        .into_iter()
        .find(|e| e.name == "indexer")
        .expect("exec registry has `indexer`");
    for (format, next_n) in [(KeyFormat::Fp8, 1usize), (KeyFormat::Mxfp4, 2)] {
        let (batch, cap, k) = (2usize, 9usize, 4i32);
        let (m, host, q, w, nv) = exec_inputs(&mut rng, format, batch, next_n, cap, k);
        let out = (entry.run)(&m, None).unwrap();
        let shape = IndexerShape {
            batch,
            next_n,
            num_valid: nv.clone(),
        };
        let want = reference::logits(&shape, &q, &w, &host);
        let scores = out["scores"].to_f32().unwrap();
        let idx: Vec<i32> = out["indices"]
            .bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(out["indices"].shape, vec![batch * next_n, k as usize]);
        for r in 0..batch * next_n {
            let n = nv[r] as usize;
            assert_eq!(
                &scores[r * cap..r * cap + n],
                &want[r][..],
                "seed {seed:#x} row {r}"
            );
            assert!(scores[r * cap + n..(r + 1) * cap]
                .iter()
                .all(|&s| s == f32::NEG_INFINITY));
            assert_eq!(
                &idx[r * k as usize..(r + 1) * k as usize],
                &reference::topk(&want[r], k as usize)[..],
                "seed {seed:#x} {format:?} row {r}"
            );
        }
    }
    // Bad arguments: each must fail with a message naming the problem, before any launch.
    let (good, ..) = exec_inputs(&mut rng, KeyFormat::Fp8, 2, 1, 9, 4);
    let expect_err = |m: &megamoe::ops::exec::TensorMap, what: &str, needle: &str| {
        let e = (entry.run)(m, None).expect_err(what);
        let msg = format!("{e:#}");
        assert!(
            msg.contains(needle),
            "{what}: message `{msg}` lacks `{needle}`"
        );
    };
    let with = |name: &str, t: HostTensor| {
        let mut m = good.clone();
        m.insert(name.into(), t);
        m
    };
    let i32t = |shape: Vec<usize>, v: &[i32]| {
        HostTensor::from_u8(
            Dtype::I32,
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    };
    let mut missing = good.clone();
    missing.remove("w");
    expect_err(&missing, "missing w", "`w`");
    expect_err(&with("k", i32t(vec![1], &[0])), "k = 0", "k = 0");
    expect_err(&with("k", i32t(vec![1], &[2049])), "k = 2049", "k = 2049");
    expect_err(
        &with("num_valid", i32t(vec![2], &[10, 1])),
        "num_valid > capacity",
        "exceeds the cache capacity",
    );
    expect_err(
        &with("num_valid", i32t(vec![2], &[-1, 1])),
        "negative num_valid",
        "negative",
    );
    expect_err(
        &with("num_valid", i32t(vec![3], &[1, 1, 1])),
        "num_valid length",
        "num_valid",
    );
    let mut nanq = good["q"].clone();
    nanq.bytes[77] = 0x7F;
    expect_err(&with("q", nanq), "NaN q code", "NaN");
    let mut infw = good["w"].clone();
    infw.bytes[4..8].copy_from_slice(&f32::INFINITY.to_le_bytes());
    expect_err(&with("w", infw), "infinite w", "not finite");
    // Three query rows for two sequences: next_n would be 1.5.
    let (three, ..) = exec_inputs(&mut rng, KeyFormat::Fp8, 3, 1, 9, 4);
    let mut bad_rows = good.clone();
    bad_rows.insert("q".into(), three["q"].clone());
    bad_rows.insert("w".into(), three["w"].clone());
    bad_rows.insert("num_valid".into(), three["num_valid"].clone());
    expect_err(&bad_rows, "rows not batch x next_n", "next_n");
    expect_err(
        &with(
            "key_codes",
            HostTensor::from_u8(Dtype::U8, vec![2, 9, 100], vec![0; 1800]),
        ),
        "key width",
        "expected 128",
    );
    expect_err(
        &with(
            "key_scales",
            HostTensor::from_u8(Dtype::F32, vec![2, 8], vec![0; 64]),
        ),
        "scales shape",
        "key_scales",
    );
}

// ---------------------------------------------------------------------------------------------------------
// FP8 logits layout identities (CPU)
// ---------------------------------------------------------------------------------------------------------

/// Mirror of the FP8 logits' shared-memory tile layout (kernels/indexer.cu, "FP8 logits, the wgmma pieces"): 16-byte chunk `ch`
/// of tile row `r` goes to byte `r * 128 + ((ch ^ (r & 7)) << 4)` of a 1024-aligned tile.
fn wgmma_tile_offset(r: usize, ch: usize) -> usize {
    r * 128 + ((ch ^ (r & 7)) << 4)
}

#[test]
fn wgmma_tile_store_is_the_128b_swizzle_and_a_bijection() {
    // The hardware's 128B swizzle XORs address bits 4-6 with bits 7-9 (for a 1024-aligned tile); the kernel's
    // store must produce exactly that address for the logical (row, chunk), and fill each 8 KB tile (64 keys)
    // and the 16 KB q tile (128 rows) exactly once.
    for rows in [64usize, 128] {
        let mut seen = vec![false; rows * 128 / 16];
        for r in 0..rows {
            for ch in 0..8 {
                let linear = r * 128 + ch * 16;
                let hw = linear ^ (((linear >> 7) & 7) << 4);
                let off = wgmma_tile_offset(r, ch);
                assert_eq!(off, hw, "row {r} chunk {ch}");
                assert!(off + 16 <= rows * 128 && off.is_multiple_of(16));
                assert!(!seen[off / 16], "row {r} chunk {ch} overlaps");
                seen[off / 16] = true;
            }
        }
        assert!(seen.iter().all(|&x| x));
    }
}

/// The TMA logits' scale box (Rust mirror of the kernel's `slot0 & ~3` / `slot0 & 3`): the TMA faults
/// (CUDA_ERROR_ILLEGAL_INSTRUCTION, seen on the H200 with capacity 4097) unless a box's first element is 16-byte
/// aligned in global memory. Exhaustive over every tile start slot of planes up to 2^20 entries: the box starts
/// 16-byte aligned, holds the tile's 64 scales, and its size is a multiple of 16 bytes. The key-code box starts
/// at slot0 * 128 bytes, always aligned.
#[test]
fn tma_scale_boxes_start_16_byte_aligned_and_hold_the_tile() {
    let box_len = indexer::TMA_SCALE_BOX;
    assert_eq!(box_len * 4 % 16, 0, "scale box of {box_len} floats");
    for slot0 in 0..(1usize << 20) {
        let (start, off) = indexer::tma_scale_box_start(slot0);
        assert!(
            (start * 4).is_multiple_of(16) && start + off == slot0 && off + 64 <= box_len,
            "slot0 {slot0}: box start {start}, offset {off}, box {box_len}"
        );
    }
    // The failing case of the first H200 run: sequence 1 of a capacity-4097 plane starts 4 bytes past a 16-byte
    // boundary, so a box starting at slot0 itself is misaligned.
    assert_ne!((4097 * 4) % 16, 0);
    assert_eq!(indexer::tma_scale_box_start(4097), (4096, 1));
}
