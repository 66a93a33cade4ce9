//! Lightning indexer: CPU reference checks (always run) and GPU checks (skip loudly without a GPU).

use megamoe::formats::{e2m1, e4m3, ue8m0};
use megamoe::gpu::{gpu_for_test, timing::TimingPlan};
use megamoe::ops::indexer::reference::{
    self, IndexerShape, KeyCacheHost, KeyFormat, HEAD_DIM, NUM_HEADS,
};
use megamoe::ops::indexer::{self, stress, IndexerBuffers, KeyCacheGpu, QueryBatch, TopkBuffers};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn seeded(test: &str) -> (u64, ChaCha8Rng) {
    let seed = megamoe::ops::inputs::fresh_seed(test, "SEED");
    (seed, ChaCha8Rng::seed_from_u64(seed))
}

fn random_key(rng: &mut ChaCha8Rng, amp: f32) -> [f32; HEAD_DIM] {
    std::array::from_fn(|_| rng.random_range(-amp..amp))
}

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

/// A sequential model of top-k v2 (kernels/indexer.cu "Top-k v2"): 4096-bin histogram of order_key >> 20,
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

/// Which exact-pass branches of the removed one-CTA final pass (indexer_topk3_final, "v3") a row takes:
/// (rank select, rank sort), with a consistent state. Kept as a classifier of row shapes (small / large
/// buckets, k above / below 512) for the tests of the default final pass and of the CPU rank model.
fn v3_paths(scores: &[f32], k: usize) -> (bool, bool) {
    const RANK_CAP: usize = 512; // v3's TK3_RANK_CAP
    let kk = k.min(scores.len());
    match threshold_bucket(scores, k) {
        None => (false, false),
        Some((nb, rem)) => (rem < nb && nb <= RANK_CAP, kk <= RANK_CAP),
    }
}

/// Whether the multi-CTA final pass (indexer_topk4_final_mcta) takes its one-CTA fallback on this row: a
/// threshold bucket of more than TOPK4_BUCKET_CAP entries with entries still to pick from it.
fn mcta_fallback(scores: &[f32], k: usize) -> bool {
    threshold_bucket(scores, k).is_some_and(|(nb, rem)| rem > 0 && nb > indexer::TOPK4_BUCKET_CAP)
}

/// A sequential model of the removed one-CTA final pass indexer_topk3_final (the rank identity it checks is
/// the one the multi-CTA pass relies on, see model_mcta_topk): the above-threshold and
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
        let (sel, sort) = v3_paths(&scores, k);
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

/// A sequential model of indexer_topk4_final_mcta (kernels/indexer.cu "Top-k v4") with `ctas` CTAs: the
/// above / bucket composites in an arbitrary (shuffled) order as pass 2's atomics leave them; CTA s ranks its
/// slices [s*ceil(a/S), ..) of the above entries (among the above entries) and [s*ceil(nb/S), ..) of the
/// bucket entries (among the bucket; written at a + rank when rank < rem); CTA s writes the -1 tail at
/// a + rem + s*T + t, step S*T. Every position of the row must be written exactly once, by the rule the kernel
/// uses. Rows whose bucket exceeds the kernel's cap take the one-CTA fallback (v3's code): returned as None.
fn model_mcta_topk(
    scores: &[f32],
    k: usize,
    ctas: usize,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<i32>> {
    use rand::seq::SliceRandom;
    const THREADS: usize = 512; // TK4_THREADS
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
    if rem > 0 && nb > indexer::TOPK4_BUCKET_CAP {
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

/// The slot allocation of indexer_topk5_select_agg (CTA-aggregated pass 2), mirrored: 16 warps x 8 steps of
/// random ballots (densities from none to all lanes); warp totals are popcount sums, thread 0's exclusive scan
/// gives each warp's offset, one atomic per CTA gives the base, and lane l of warp w at step r writes slot
/// base + offset[w] + (hits of warp w in steps < r) + popc(ballot_r & lanes below l). The slots of every CTA must
/// be exactly base .. base + its total, once each, and consecutive CTAs must tile the counter's range.
#[test]
fn cta_aggregated_slot_allocation_is_a_dense_permutation() {
    let (seed, mut rng) = seeded("select_agg_slots");
    const WARPS: usize = 16; // TK2_THREADS / 32
    const STEPS: usize = 8; // TK2_PER_THREAD
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
// GPU
// ---------------------------------------------------------------------------------------------------------

#[test]
fn gpu_key_writer_is_bit_exact() {
    let Some(gpu) = gpu_for_test("gpu_key_writer_is_bit_exact") else {
        return;
    };
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
        let mut dev = KeyCacheGpu::filled(&gpu, format, batch, cap, 0).unwrap();
        let raw_dev = gpu.upload(&raw).unwrap();
        indexer::write_keys(&gpu, &mut dev, &raw_dev, &slots).unwrap();
        let got = dev.download(&gpu).unwrap();
        let cb = format.code_bytes();
        for (i, &s) in slots.iter().enumerate() {
            let s = s as usize;
            for d in 0..cb {
                assert_eq!(
                    got.codes[s * cb + d],
                    host.codes[s * cb + d],
                    "{format:?} key {i} slot {s} code byte {d}"
                );
            }
            assert_eq!(
                got.scales[s * 4..s * 4 + 4],
                host.scales[s * 4..s * 4 + 4],
                "{format:?} key {i} slot {s} scales"
            );
        }
        assert!(
            indexer::write_keys(&gpu, &mut dev, &raw_dev, &vec![(batch * cap) as i32; n]).is_err(),
            "out-of-range slot must be rejected"
        );
    }
}

#[test]
fn gpu_logits_and_topk_match_the_reference() {
    let Some(gpu) = gpu_for_test("gpu_logits_and_topk_match_the_reference") else {
        return;
    };
    let (_, mut rng) = seeded("gpu_logits_topk");
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        for next_n in [1usize, 2] {
            let lens = [0usize, 1, 33, 128, 129, 511, 512, 513, 1000, 2047];
            let (batch, cap) = (lens.len(), 2047usize);
            let mut host = KeyCacheHost::new(format, batch, cap);
            for (b, &n) in lens.iter().enumerate() {
                for j in 0..n {
                    let amp = [0.05f32, 1.0, 20.0][rng.random_range(0..3)];
                    host.write_key(host.slot(b, j), &random_key(&mut rng, amp))
                        .unwrap();
                }
            }
            let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
            let rows = batch * next_n;
            let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
                .map(|_| reference::random_e4m3(&mut rng))
                .collect();
            let w: Vec<f32> = (0..rows * NUM_HEADS)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            let nv: Vec<i32> = (0..rows)
                .map(|r| (lens[r / next_n] as i32 - (next_n - 1 - r % next_n) as i32).max(0))
                .collect();
            let qb = QueryBatch::upload(&gpu, batch, next_n, &q, &w, &nv).unwrap();
            for k in [512usize, 1024, 2048] {
                let mut bufs = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
                indexer::run(&gpu, &qb, &cache, &mut bufs).unwrap();
                let scores = gpu.download(&bufs.scores).unwrap();
                let idx = gpu.download(&bufs.topk.out_idx).unwrap();
                let shape = IndexerShape {
                    batch,
                    next_n,
                    num_valid: nv.clone(),
                };
                let want = reference::logits(&shape, &q, &w, &host);
                let stride = bufs.score_stride;
                for r in 0..rows {
                    let n = nv[r] as usize;
                    let got = &scores[r * stride..r * stride + n];
                    for j in 0..n {
                        let mag = reference::logit_magnitude(&shape, &q, &w, &host, r, j);
                        let err = (got[j] as f64 - want[r][j] as f64).abs();
                        assert!(
                            err <= f64::powi(2.0, -9) * mag + 1e-30,
                            "{format:?} next_n {next_n} row {r} j {j}: gpu {:e} ref {:e} err {err:e} (magnitude {mag:e})",
                            got[j],
                            want[r][j]
                        );
                    }
                    if let Err(e) = reference::check_topk_exact(got, k, &idx[r * k..(r + 1) * k]) {
                        panic!("{format:?} next_n {next_n} k {k} row {r}: {e}");
                    }
                }
                // The scores alongside the indices: the canonical score of each selected entry, -inf on
                // padding, bit for bit.
                let out_sc = gpu.download(&bufs.topk.out_score).unwrap();
                for r in 0..rows {
                    let got = &scores[r * stride..r * stride + nv[r] as usize];
                    for p in 0..k {
                        let i = idx[r * k + p];
                        let want = if i >= 0 {
                            reference::canonical_score(got[i as usize])
                        } else {
                            f32::NEG_INFINITY
                        };
                        assert_eq!(
                            out_sc[r * k + p].to_bits(),
                            want.to_bits(),
                            "{format:?} next_n {next_n} k {k} row {r} position {p}: score {:e} want {want:e}",
                            out_sc[r * k + p]
                        );
                    }
                }
                if format == KeyFormat::Fp8 && next_n == 1 {
                    // The seeds' baseline on the same inputs: its top-k of our scores must be identical.
                    let mut base = indexer::BaselineBuffers::new(&gpu, batch, rows, cap).unwrap();
                    let mut bt = TopkBuffers::new(&gpu, rows, k, cap).unwrap();
                    indexer::baseline_topk(&gpu, &bufs.scores, stride, &qb, &mut base, &mut bt)
                        .unwrap();
                    assert_eq!(
                        gpu.download(&bt.out_idx).unwrap(),
                        idx,
                        "baseline sort top-k differs (k {k})"
                    );
                    let mut bs = gpu.poisoned::<f32>(rows * stride, 0xFF).unwrap();
                    indexer::baseline_logits(&gpu, &qb, &cache, &mut base, &mut bs, stride)
                        .unwrap();
                    let bscores = gpu.download(&bs).unwrap();
                    for r in 0..rows {
                        for j in 0..nv[r] as usize {
                            let mag = reference::logit_magnitude(&shape, &q, &w, &host, r, j);
                            let err = (bscores[r * stride + j] as f64 - want[r][j] as f64).abs();
                            assert!(
                                // fp32 dequant (1 rounding) + 128-term FMA dot + 64-term head sum, each
                                // rounding <= 2^-24 of a running |sum| <= mag: (1+128+64) * 2^-24 < 1.2e-5.
                                err <= 1.2e-5 * mag + 1e-30,
                                "baseline logit row {r} j {j}: {} vs {}",
                                bscores[r * stride + j],
                                want[r][j]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_topk_long_rows_and_specials() {
    let Some(gpu) = gpu_for_test("gpu_topk_long_rows_and_specials") else {
        return;
    };
    let (_, mut rng) = seeded("gpu_topk_long");
    let lens = [262_144usize, 32_768, 32_769, 65_535, 100_000, 2049];
    let stride = 262_144usize;
    for k in [512usize, 2048] {
        let mut flat = vec![0f32; lens.len() * stride];
        for (r, &n) in lens.iter().enumerate() {
            for j in 0..n {
                flat[r * stride + j] = match (r, rng.random_range(0..20)) {
                    (1, _) => 7.0, // all equal
                    (_, 0) => f32::NAN,
                    (_, 1) => f32::NEG_INFINITY,
                    (_, 2) => -0.0,
                    (_, v) if v < 8 => (v % 3) as f32, // heavy ties
                    _ => rng.random_range(-100.0f32..100.0),
                };
            }
        }
        let nv: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
        let sd = gpu.upload(&flat).unwrap();
        let nvd = gpu.upload(&nv).unwrap();
        let mut bufs = TopkBuffers::new(&gpu, lens.len(), k, stride).unwrap();
        // Three calls of each path on the same buffers (the chain's histogram and counters must be back to
        // zero after every call: a missing reset shows up as a wrong second answer).
        for path in [indexer::TopkPath::Chain, indexer::TopkPath::Pdl] {
            for pass in 0..3 {
                gpu.fill_bytes(&mut bufs.out_idx, 0xFF).unwrap();
                indexer::topk_with(&gpu, path, &sd, stride, &nvd, &nv, &mut bufs).unwrap();
                assert!(
                    stress::wait_watched(&gpu, std::time::Duration::from_secs(5)).unwrap(),
                    "top-k ({path:?}) did not finish within 5 s (k {k}, call {pass})"
                );
                let idx = gpu.download(&bufs.out_idx).unwrap();
                for (r, &n) in lens.iter().enumerate() {
                    if let Err(e) = reference::check_topk_exact(
                        &flat[r * stride..r * stride + n],
                        k,
                        &idx[r * k..(r + 1) * k],
                    ) {
                        panic!("k {k} {path:?} call {pass} row {r} (num_valid {n}): {e}");
                    }
                }
            }
        }
    }
}

#[test]
fn gpu_topk_final_branches_match_reference() {
    let Some(gpu) = gpu_for_test("gpu_topk_final_branches_match_reference") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_topk_final_branches");
    let lens = [
        1usize, 3, 100, 511, 512, 513, 1000, 4097, 20_000, 65_536, 262_144,
    ];
    let stride = 262_144usize;
    let rows = lens.len() * 5;
    // Row classes seen: v3's (rank select, rank sort, select fallback, sort fallback) shapes, and the default
    // multi-CTA pass's rank path / one-CTA fallback: every class must be exercised.
    let mut cover = [0usize; 6];
    for k in [1usize, 7, 300, 511, 512, 513, 2048] {
        let mut flat = vec![f32::NAN; rows * stride];
        let mut nv = vec![0i32; rows];
        for r in 0..rows {
            let (n, pattern) = (lens[r % lens.len()], r / lens.len());
            nv[r] = n as i32;
            for x in &mut flat[r * stride..r * stride + n] {
                *x = match pattern {
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
                };
            }
            let (sel, sort) = v3_paths(&flat[r * stride..r * stride + n], k);
            cover[0] += sel as usize;
            cover[1] += sort as usize;
            cover[2] += (!sel) as usize;
            cover[3] += (!sort) as usize;
            let fallback = mcta_fallback(&flat[r * stride..r * stride + n], k);
            cover[4] += (!fallback) as usize;
            cover[5] += fallback as usize;
        }
        let sd = gpu.upload(&flat).unwrap();
        let nvd = gpu.upload(&nv).unwrap();
        let mut bufs = TopkBuffers::new(&gpu, rows, k, stride).unwrap();
        // Three chain calls on the same buffers: each final pass must leave the histogram and counters zeroed,
        // so every call gives the reference answer (indices exactly, scores bit for bit). Then two calls through
        // the PDL entry points on the same buffers.
        let wants: Vec<Vec<i32>> = (0..rows)
            .map(|r| reference::topk(&flat[r * stride..r * stride + nv[r] as usize], k))
            .collect();
        let calls = [
            indexer::TopkPath::Chain,
            indexer::TopkPath::Chain,
            indexer::TopkPath::Chain,
            indexer::TopkPath::Pdl,
            indexer::TopkPath::Pdl,
        ];
        for (call, &path) in calls.iter().enumerate() {
            gpu.fill_bytes(&mut bufs.out_idx, 0xFF).unwrap();
            gpu.fill_bytes(&mut bufs.out_score, 0xFF).unwrap();
            indexer::topk_with(&gpu, path, &sd, stride, &nvd, &nv, &mut bufs).unwrap();
            assert!(
                stress::wait_watched(&gpu, std::time::Duration::from_secs(5)).unwrap(),
                "seed {seed:#x}: top-k ({path:?}) did not finish within 5 s (k {k}, call {call})"
            );
            let idx = gpu.download(&bufs.out_idx).unwrap();
            let sc = gpu.download(&bufs.out_score).unwrap();
            for r in 0..rows {
                let n = nv[r] as usize;
                let row = &flat[r * stride..r * stride + n];
                let want = &wants[r];
                // want is padded with -1 up to k (reference::topk).
                for (j, &wi) in want.iter().enumerate() {
                    let ws = if wi >= 0 {
                        reference::canonical_score(row[wi as usize])
                    } else {
                        f32::NEG_INFINITY
                    };
                    let p = r * k + j;
                    assert!(
                        idx[p] == wi && sc[p].to_bits() == ws.to_bits(),
                        "seed {seed:#x} k {k} call {call} ({path:?}) row {r} (num_valid {n}, v3 row class (rank \
                         select, rank sort) {:?}) position {j}: got ({}, {:e}) want ({wi}, {ws:e})",
                        v3_paths(row, k),
                        idx[p],
                        sc[p]
                    );
                }
            }
        }
    }
    assert!(
        cover.iter().all(|&c| c > 0),
        "seed {seed:#x}: rows per class (v3 rank select, rank sort, select fallback, sort fallback; mcta rank, \
         mcta fallback) = {cover:?}"
    );
    println!("seed {seed:#x}: rows per class (v3 rank select, rank sort, select fallback, sort fallback; mcta rank, \
         mcta fallback) = {cover:?}");
}

/// Rows for the multi-CTA final pass: (scores, label). Lengths around k, multiples of 128 +- 1, the pass-1/2 slice
/// (4096 +- 1), random up to 262,144; patterns: logit-like, all equal, all zero (+-0), NaN / +-inf mixes, three
/// values; and directed rows whose threshold bucket holds exactly TOPK4_BUCKET_CAP - 1, CAP, CAP + 1 entries
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
    let cap = indexer::TOPK4_BUCKET_CAP;
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

/// Download a top-k result.
fn topk_result(gpu: &megamoe::gpu::Gpu, bufs: &TopkBuffers) -> (Vec<i32>, Vec<f32>) {
    (
        gpu.download(&bufs.out_idx).unwrap(),
        gpu.download(&bufs.out_score).unwrap(),
    )
}

/// The top-k along `path` on `rows` (one launch group, `calls` back-to-back calls on the same buffers), each
/// call against the reference: indices exactly, scores bit for bit. The chain's calls must each leave the
/// histogram, counters and arrival counters zeroed, or the next call's threshold (and answer) is wrong. A path
/// other than [`indexer::TopkPath::Default`] is also compared with one default call (on its own buffers) bit
/// for bit, indices and scores.
fn check_topk_path(
    gpu: &megamoe::gpu::Gpu,
    seed: u64,
    k: usize,
    rows: &[(Vec<f32>, String)],
    calls: usize,
    path: indexer::TopkPath,
) {
    let stride = rows
        .iter()
        .map(|r| r.0.len())
        .max()
        .unwrap()
        .next_multiple_of(4)
        .max(4);
    let mut flat = vec![f32::NAN; rows.len() * stride];
    for (r, (v, _)) in rows.iter().enumerate() {
        flat[r * stride..r * stride + v.len()].copy_from_slice(v);
    }
    let nv: Vec<i32> = rows.iter().map(|r| r.0.len() as i32).collect();
    let sd = gpu.upload(&flat).unwrap();
    let nvd = gpu.upload(&nv).unwrap();
    let mut bufs = TopkBuffers::new(gpu, rows.len(), k, stride).unwrap();
    let wants: Vec<Vec<i32>> = rows.iter().map(|(v, _)| reference::topk(v, k)).collect();
    let default_out = (path != indexer::TopkPath::Default).then(|| {
        let mut def = TopkBuffers::new(gpu, rows.len(), k, stride).unwrap();
        indexer::topk(gpu, &sd, stride, &nvd, &nv, &mut def).unwrap();
        assert!(stress::wait_watched(gpu, std::time::Duration::from_secs(5)).unwrap());
        topk_result(gpu, &def)
    });
    for call in 0..calls {
        gpu.fill_bytes(&mut bufs.out_idx, 0xFF).unwrap();
        gpu.fill_bytes(&mut bufs.out_score, 0xFF).unwrap();
        indexer::topk_with(gpu, path, &sd, stride, &nvd, &nv, &mut bufs).unwrap();
        assert!(
            stress::wait_watched(gpu, std::time::Duration::from_secs(5)).unwrap(),
            "seed {seed:#x}: top-k ({path:?}) did not finish within 5 s (k {k}, {} rows, call {call})",
            rows.len()
        );
        let got = topk_result(gpu, &bufs);
        if let Some((di, ds)) = &default_out {
            for p in 0..got.0.len() {
                assert!(
                    got.0[p] == di[p] && got.1[p].to_bits() == ds[p].to_bits(),
                    "seed {seed:#x} k {k} ({} rows) call {call} row {} ({}) position {}: {path:?} ({}, {:#010x}) \
                     vs default ({}, {:#010x})",
                    rows.len(),
                    p / k,
                    rows[p / k].1,
                    p % k,
                    got.0[p],
                    got.1[p].to_bits(),
                    di[p],
                    ds[p].to_bits()
                );
            }
        }
        for (r, (v, label)) in rows.iter().enumerate() {
            for (j, &wi) in wants[r].iter().enumerate() {
                let ws = if wi >= 0 {
                    reference::canonical_score(v[wi as usize])
                } else {
                    f32::NEG_INFINITY
                };
                let p = r * k + j;
                assert!(
                    got.0[p] == wi && got.1[p].to_bits() == ws.to_bits(),
                    "seed {seed:#x} k {k} ({} rows, {path:?}) call {call} row {r} ({label}) position {j}: got ({}, \
                     {:e} = {:#010x}) want ({wi}, {ws:e} = {:#010x})",
                    rows.len(),
                    got.0[p],
                    got.1[p],
                    got.1[p].to_bits(),
                    ws.to_bits()
                );
            }
        }
    }
}

#[test]
fn gpu_topk_multi_cta_matches_reference() {
    let Some(gpu) = gpu_for_test("gpu_topk_multi_cta_matches_reference") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_topk_mcta");
    for k in [512usize, 1024, 2048] {
        let rows = mcta_rows(&mut rng, k);
        // The final pass's CTAs per row depend on the row count (2 * SMs / rows, clamped to 8..=32): all rows
        // in one launch (8 per row), then the last 9 rows alone (the longest rows and the directed buckets;
        // 29 per row on 132 SMs).
        let chain = indexer::TopkPath::Chain;
        check_topk_path(&gpu, seed, k, &rows, 3, chain);
        check_topk_path(&gpu, seed, k, &rows[rows.len() - 9..], 2, chain);
    }
}

#[test]
fn gpu_topk_multi_cta_graph_replay_leaves_buffers_clean() {
    let Some(gpu) = gpu_for_test("gpu_topk_multi_cta_graph_replay_leaves_buffers_clean") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_topk_mcta_graph");
    check_topk_graph_replays(&gpu, seed, &mut rng, indexer::TopkPath::Chain);
}

/// Graph replays of `path` with new scores each time, then an eager call on the same buffers: all exact.
fn check_topk_graph_replays(
    gpu: &megamoe::gpu::Gpu,
    seed: u64,
    rng: &mut ChaCha8Rng,
    path: indexer::TopkPath,
) {
    let k = 512usize;
    let lens = [262_144usize, 0, 70_001, 513, 4097];
    let stride = 262_144usize;
    let make = |rng: &mut ChaCha8Rng| -> Vec<f32> {
        let mut flat = vec![f32::NAN; lens.len() * stride];
        for (r, &n) in lens.iter().enumerate() {
            for x in &mut flat[r * stride..r * stride + n] {
                *x = (0..8).map(|_| rng.random_range(-1.0f32..1.0)).sum::<f32>() * 3.0;
            }
        }
        flat
    };
    let nv: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
    let mut flat = make(rng);
    let mut sd = gpu.upload(&flat).unwrap();
    let nvd = gpu.upload(&nv).unwrap();
    let mut bufs = TopkBuffers::new(gpu, lens.len(), k, stride).unwrap();
    // One eager call first: loads the module and sets the shared-memory attribute outside the capture (and
    // must itself leave the buffers clean for the first replay).
    indexer::topk_with(gpu, path, &sd, stride, &nvd, &nv, &mut bufs).unwrap();
    assert!(stress::wait_watched(gpu, std::time::Duration::from_secs(5)).unwrap());
    let graph = gpu
        .capture(|| indexer::topk_with(gpu, path, &sd, stride, &nvd, &nv, &mut bufs))
        .unwrap();
    // Replays with new scores written into the captured input buffer: a replay that left the histogram,
    // counters or arrival counters dirty makes the next replay's answer wrong.
    for replay in 0..4 {
        if replay > 0 {
            flat = make(rng);
            gpu.stream.memcpy_htod(&flat, &mut sd).unwrap();
        }
        gpu.fill_bytes(&mut bufs.out_idx, 0xFF).unwrap();
        gpu.fill_bytes(&mut bufs.out_score, 0xFF).unwrap();
        graph.launch().unwrap();
        assert!(
            stress::wait_watched(gpu, std::time::Duration::from_secs(5)).unwrap(),
            "seed {seed:#x}: graph replay {replay} ({path:?}) did not finish within 5 s"
        );
        let (idx, sc) = topk_result(gpu, &bufs);
        for (r, &n) in lens.iter().enumerate() {
            let row = &flat[r * stride..r * stride + n];
            if let Err(e) = reference::check_topk_exact(row, k, &idx[r * k..(r + 1) * k]) {
                panic!("seed {seed:#x} ({path:?}) replay {replay} row {r} (num_valid {n}): {e}");
            }
            for j in 0..k {
                let i = idx[r * k + j];
                let want = if i >= 0 {
                    reference::canonical_score(row[i as usize])
                } else {
                    f32::NEG_INFINITY
                };
                assert_eq!(
                    sc[r * k + j].to_bits(),
                    want.to_bits(),
                    "seed {seed:#x} ({path:?}) replay {replay} row {r} position {j}: score {:e} want {want:e}",
                    sc[r * k + j]
                );
            }
        }
    }
    // After the replays an eager call on the same buffers must still be exact (clean buffers).
    indexer::topk_with(gpu, path, &sd, stride, &nvd, &nv, &mut bufs).unwrap();
    assert!(stress::wait_watched(gpu, std::time::Duration::from_secs(5)).unwrap());
    let (idx, _) = topk_result(gpu, &bufs);
    for (r, &n) in lens.iter().enumerate() {
        if let Err(e) = reference::check_topk_exact(
            &flat[r * stride..r * stride + n],
            k,
            &idx[r * k..(r + 1) * k],
        ) {
            panic!("seed {seed:#x} ({path:?}): eager call after the graph replays, row {r}: {e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// PDL top-k (`TopkPath::Pdl`: the default kernels through their PDL entry points; kernels/indexer.cu "Top-k
// PDL entry points"). Same kernel bodies, so the outputs must be bit-identical to the default path's.
// ---------------------------------------------------------------------------------------------------------

#[test]
fn gpu_topk_pdl_matches_default_and_reference() {
    let Some(gpu) = gpu_for_test("gpu_topk_pdl_matches_default_and_reference") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_topk_pdl");
    println!("seed {seed:#x}");
    for k in [1usize, 512, 2048] {
        // num_valid 0, 1, 2, k +- 1, 4095 / 4097, 262,144 and more, mixed in one launch; ties, specials,
        // threshold buckets at the multi-CTA cap. Back-to-back calls on the same buffers: a PDL launch that
        // let a kernel touch the histogram / counters before its predecessor finished shows up as a wrong
        // threshold in a later call.
        let rows = mcta_rows(&mut rng, k.max(2));
        check_topk_path(
            &gpu,
            seed,
            k,
            &rows,
            if k == 512 { 3 } else { 2 },
            indexer::TopkPath::Pdl,
        );
        // The longest rows and the directed buckets alone (more final-pass CTAs per row).
        check_topk_path(
            &gpu,
            seed,
            k,
            &rows[rows.len() - 9..],
            2,
            indexer::TopkPath::Pdl,
        );
    }
}

#[test]
fn gpu_topk_pdl_graph_replay_is_exact() {
    let Some(gpu) = gpu_for_test("gpu_topk_pdl_graph_replay_is_exact") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_topk_pdl_graph");
    println!("seed {seed:#x}");
    check_topk_graph_replays(&gpu, seed, &mut rng, indexer::TopkPath::Pdl);
}

#[test]
fn gpu_pdl_indexer_run_matches_the_default_run() {
    let Some(gpu) = gpu_for_test("gpu_pdl_indexer_run_matches_the_default_run") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_pdl_run");
    println!("seed {seed:#x}");
    // Whole call (logits, then the PDL top-k whose histogram launch overlaps the logits' tail): the same
    // indices and scores as the default run, eagerly (two calls back to back on the same buffers) and as a
    // replayed CUDA graph (bench variant graph_fused_pdl).
    let lens = [20_000usize, 513, 7_777, 1, 0];
    let cap = 20_000usize;
    let host = random_fp8_cache(&mut rng, lens.len(), cap);
    let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
    let pdl_paths = indexer::IndexerPaths {
        topk: indexer::TopkPath::Pdl,
        ..Default::default()
    };
    let bits =
        |(i, s): (Vec<i32>, Vec<f32>)| (i, s.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    for next_n in [1usize, 2] {
        let rows = lens.len() * next_n;
        let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..rows * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let nv: Vec<i32> = (0..rows)
            .map(|r| lens[r / next_n] as i32 - (r % next_n) as i32 * 3)
            .map(|n| n.max(0))
            .collect();
        let qb = QueryBatch::upload(&gpu, lens.len(), next_n, &q, &w, &nv).unwrap();
        for k in [512usize, 2048] {
            let mut def = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
            indexer::run(&gpu, &qb, &cache, &mut def).unwrap();
            assert!(stress::wait_watched(&gpu, std::time::Duration::from_secs(5)).unwrap());
            let want = bits(topk_result(&gpu, &def.topk));
            // The default run's top-k against the reference on its own scores (so "equal to the default" is
            // not "equal to a wrong answer").
            let def_scores = gpu.download(&def.scores).unwrap();
            let stride = def.score_stride;
            for r in 0..rows {
                let n = nv[r] as usize;
                if let Err(e) = reference::check_topk_exact(
                    &def_scores[r * stride..r * stride + n],
                    k,
                    &want.0[r * k..(r + 1) * k],
                ) {
                    panic!("seed {seed:#x} next_n {next_n} k {k} row {r}: default run top-k: {e}");
                }
            }
            let mut pdl = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
            for call in 0..2 {
                gpu.fill_bytes(&mut pdl.topk.out_idx, 0xFF).unwrap();
                gpu.fill_bytes(&mut pdl.topk.out_score, 0xFF).unwrap();
                indexer::run_with(&gpu, pdl_paths, &qb, &cache, &mut pdl).unwrap();
                assert!(
                    stress::wait_watched(&gpu, std::time::Duration::from_secs(5)).unwrap(),
                    "seed {seed:#x} next_n {next_n} k {k} call {call}: PDL run did not finish within 5 s"
                );
                let got = bits(topk_result(&gpu, &pdl.topk));
                if let Some(p) =
                    (0..got.0.len()).find(|&p| got.0[p] != want.0[p] || got.1[p] != want.1[p])
                {
                    panic!(
                        "seed {seed:#x} next_n {next_n} k {k} call {call}: row {} rank {}: PDL run ({}, {:#010x}) \
                         vs default run ({}, {:#010x})",
                        p / k,
                        p % k,
                        got.0[p],
                        got.1[p],
                        want.0[p],
                        want.1[p]
                    );
                }
            }
            let graph = gpu
                .capture(|| indexer::run_with(&gpu, pdl_paths, &qb, &cache, &mut pdl))
                .unwrap();
            for replay in 0..3 {
                gpu.fill_bytes(&mut pdl.topk.out_idx, 0xFF).unwrap();
                gpu.fill_bytes(&mut pdl.topk.out_score, 0xFF).unwrap();
                graph.launch().unwrap();
                assert!(
                    stress::wait_watched(&gpu, std::time::Duration::from_secs(5)).unwrap(),
                    "seed {seed:#x} next_n {next_n} k {k}: PDL graph replay {replay} did not finish within 5 s"
                );
                let got = bits(topk_result(&gpu, &pdl.topk));
                if let Some(p) =
                    (0..got.0.len()).find(|&p| got.0[p] != want.0[p] || got.1[p] != want.1[p])
                {
                    panic!(
                        "seed {seed:#x} next_n {next_n} k {k} graph replay {replay}: row {} rank {}: PDL ({}, \
                         {:#010x}) vs default run ({}, {:#010x})",
                        p / k,
                        p % k,
                        got.0[p],
                        got.1[p],
                        want.0[p],
                        want.1[p]
                    );
                }
            }
        }
    }
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
                let vars = s.variants_from(indexer::VARIANTS).unwrap();
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
fn gpu_stress_quick() {
    let Some(gpu) = gpu_for_test("gpu_stress_quick") else {
        return;
    };
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
fn gpu_bench_timing_smoke() {
    let Some(gpu) = gpu_for_test("gpu_bench_timing_smoke") else {
        return;
    };
    let plan = TimingPlan {
        warmup: 1,
        reps: 3,
        flush_l2: false,
    };
    let inp = indexer::bench_inputs(&gpu, KeyFormat::Fp8, 2, 1, 4096, 7).unwrap();
    for &v in indexer::VARIANTS {
        let s = indexer::time_variant(&gpu, v, &inp, 512, plan).unwrap();
        assert!(
            s.total.len() == 3 && s.total.iter().all(|&t| t > 0.0),
            "{v}: {:?}",
            s.total
        );
    }
    assert_eq!(
        indexer::traffic_bytes(&inp, 512).0 as usize,
        2 * 4096 * 132 + 2 * 64 * 132 + 2 * 4096 * 4
    );
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
// FP8 logits on native wgmma through `indexer::logits` (the default FP8 kernel: indexer_logits_fp8tma_n1 / _n2
// since session 6; the cp.async-rounds kernel indexer_logits_fp8w3_n1 / _n2 has the same tile layout and math).
// ---------------------------------------------------------------------------------------------------------

/// Mirror of the wgmma logits' shared-memory store (kernels/indexer.cu, logits_wgmma_body): 16-byte chunk `ch`
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

/// Tolerance of the wgmma logits against the f64 reference, as a fraction of
/// `mag = scale_j * sum_h |w_h| sum_d |q_hd c_jd|` (c = the key's e4m3 code values).
/// Products of two e4m3 values are exact. The FP8 tensor core's accumulation is not documented; the measured
/// behaviour (DeepSeek-V3 on H800: ~14 significant bits) is modelled as: per k32 step, the 32 products and the
/// accumulator are aligned to the largest exponent and everything below ~2^-13 of the largest term is dropped.
/// Worst case that is 33 x 2^-13 of the largest term per step (products of one sign whose dropped tails all
/// add up); with independent signs (all test data) the dropped tails partly cancel, ~sqrt(33) x 2^-13 of the
/// largest term, so over 4 steps ~2^-9.5 of max |term| <= 2^-9.5 of sum_d |q_hd c_jd|, and in practice far less
/// (the largest term is a small part of the sum). relu is 1-Lipschitz; the fp32 epilogue (per row: 4 lanes x
/// 2 chains of 8 fma, 3 adds, the scale multiply) adds < 20 x 2^-24 of mag. The test allows 2^-9 x mag (the
/// bound gpu_logits_and_topk_match_the_reference uses too) and prints the largest observed err / mag so the
/// margin is visible.
const WGMMA_TOL: f64 = 1.0 / 512.0;

/// The f64 score of key `slot` for query row `row` and its error scale `mag` (see WGMMA_TOL).
fn wgmma_ref_score(
    q_f64: &[f64],
    w: &[f32],
    host: &KeyCacheHost,
    row: usize,
    slot: usize,
) -> (f64, f64) {
    let k = host.key_f64(slot);
    let (mut s, mut mag) = (0.0f64, 0.0f64);
    for h in 0..NUM_HEADS {
        let qh = &q_f64[(row * NUM_HEADS + h) * HEAD_DIM..(row * NUM_HEADS + h + 1) * HEAD_DIM];
        let (mut dot, mut abs) = (0.0f64, 0.0f64);
        for d in 0..HEAD_DIM {
            dot += qh[d] * k[d];
            abs += (qh[d] * k[d]).abs();
        }
        let wh = w[row * NUM_HEADS + h] as f64;
        s += wh * reference::relu(dot);
        mag += wh.abs() * abs;
    }
    (s, mag)
}

/// A key cache with arbitrary non-NaN e4m3 codes (the whole code range, subnormals included) and positive
/// fp32 scales spread over 2^-12 .. 2^4.
fn random_fp8_cache(rng: &mut ChaCha8Rng, batch: usize, cap: usize) -> KeyCacheHost {
    let mut host = KeyCacheHost::new(KeyFormat::Fp8, batch, cap);
    for c in host.codes.iter_mut() {
        *c = loop {
            let v: u8 = rng.random();
            if v & 0x7F != 0x7F {
                break v;
            }
        };
    }
    for s in host.scales.chunks_exact_mut(4) {
        let v = f32::powf(2.0, rng.random_range(-12.0f32..4.0));
        s.copy_from_slice(&v.to_le_bytes());
    }
    host
}

/// Runs the default logits (FP8 keys: the wgmma kernel) on a poisoned buffer and checks every j < n_seq(b) (the
/// longest row of sequence b: the kernel writes the whole sequence range for each of its rows) against the f64
/// reference within WGMMA_TOL, and everything past n_seq(b) still poisoned. Prints the max err / mag.
fn check_wgmma_logits(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    host: &KeyCacheHost,
    next_n: usize,
    nv: &[i32],
    rng: &mut ChaCha8Rng,
) {
    let batch = host.batch;
    let rows = batch * next_n;
    let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| reference::random_e4m3(rng))
        .collect();
    let w: Vec<f32> = (0..rows * NUM_HEADS)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let q_f64: Vec<f64> = q.iter().map(|&c| e4m3::decode(c) as f64).collect();
    let cache = KeyCacheGpu::upload(gpu, host).unwrap();
    let qb = QueryBatch::upload(gpu, batch, next_n, &q, &w, nv).unwrap();
    let stride = host.capacity.next_multiple_of(4) + 4; // room past the capacity: must stay poisoned
    let mut out = gpu.poisoned::<f32>(rows * stride, 0xFF).unwrap();
    indexer::logits(gpu, &qb, &cache, &mut out, stride).unwrap();
    let got = gpu.download(&out).unwrap();
    let mut worst_ref = 0.0f64;
    for b in 0..batch {
        let n_seq = (0..next_n)
            .map(|t| nv[b * next_n + t].max(0) as usize)
            .max()
            .unwrap()
            .min(host.capacity);
        for t in 0..next_n {
            let row = b * next_n + t;
            for j in 0..stride {
                let gw = got[row * stride + j];
                if j >= n_seq {
                    assert_eq!(
                        gw.to_bits(),
                        u32::MAX,
                        "{label} next_n {next_n} row {row} (n_seq {n_seq}) j {j}: wrote {gw:e} past the visible entries"
                    );
                    continue;
                }
                let (want, mag) = wgmma_ref_score(&q_f64, &w, host, row, host.slot(b, j));
                let err = (gw as f64 - want).abs();
                assert!(
                    gw.is_finite() && err <= WGMMA_TOL * mag + 1e-30,
                    "{label} next_n {next_n} row {row} (n_seq {n_seq}) j {j}: wgmma {gw:e} ref {want:e} \
                     err {err:e} = {:.3e} x mag (mag {mag:e}, tol {WGMMA_TOL:e} x mag)",
                    err / mag.max(1e-300)
                );
                if mag > 0.0 {
                    worst_ref = worst_ref.max(err / mag);
                }
            }
        }
    }
    println!(
        "{label} next_n {next_n}: max |wgmma - ref| / mag = {worst_ref:.3e} (2^{:.2})",
        worst_ref.max(1e-300).log2()
    );
}

#[test]
fn gpu_wgmma_logits_match_the_reference() {
    let Some(gpu) = gpu_for_test("gpu_wgmma_logits_match_the_reference") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_wgmma_logits");
    println!("seed {seed}");
    for next_n in [1usize, 2] {
        // Writer-made keys (amplitudes 0.05 .. 20), lengths around the 64-key tile; capacity 4097 (odd: the
        // per-sequence scale plane is not 16-byte aligned).
        let lens = [0usize, 1, 63, 65, 127, 129, 1000, 4097];
        let cap = 4097usize;
        let mut host = KeyCacheHost::new(KeyFormat::Fp8, lens.len(), cap);
        for (b, &n) in lens.iter().enumerate() {
            for j in 0..n {
                let amp = [0.05f32, 1.0, 20.0][rng.random_range(0..3)];
                host.write_key(host.slot(b, j), &random_key(&mut rng, amp))
                    .unwrap();
            }
        }
        // next_n = 2: the first token sees one entry fewer (as in the model), so n_seq(b) = lens[b].
        let nv: Vec<i32> = (0..lens.len() * next_n)
            .map(|r| (lens[r / next_n] as i32 - (next_n - 1 - r % next_n) as i32).max(0))
            .collect();
        check_wgmma_logits(&gpu, "tile edges", &host, next_n, &nv, &mut rng);

        // Long mixed rows: many tiles per persistent CTA (the ring wraps), sequence changes inside a CTA's
        // range, empty tiles (sequence 1 has 33 keys of 1094 tiles), the full e4m3 code range.
        let cap = 70_001usize;
        let host = random_fp8_cache(&mut rng, 3, cap);
        let lens = [70_001usize, 33, 20_001];
        let nv: Vec<i32> = (0..3 * next_n)
            .map(|r| lens[r / next_n] as i32 - (r % next_n) as i32)
            .collect();
        check_wgmma_logits(&gpu, "long rows", &host, next_n, &nv, &mut rng);
    }
}

#[test]
fn gpu_wgmma_logits_nan_policy_matches_the_reference() {
    let Some(gpu) = gpu_for_test("gpu_wgmma_logits_nan_policy_matches_the_reference") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_wgmma_nan");
    println!("seed {seed}");
    // NaN key codes (0x7F / 0xFF) make every head's dot product NaN -> relu gives 0 -> score 0, as in the
    // reference (compared as values: the top-k ranks -0 as +0). A NaN fp32 key scale gives a NaN score: the kernel applies the scale after
    // relu (NaN x 0 = NaN), which the top-k ranks as -inf (module docs); the reference, which folds the scale
    // into the key values, gives 0 there, so those entries are checked for NaN only. Every other entry is
    // checked against the f64 reference within WGMMA_TOL.
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
        let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..rows * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let q_f64: Vec<f64> = q.iter().map(|&c| e4m3::decode(c) as f64).collect();
        let nv = vec![n as i32; rows];
        let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
        let qb = QueryBatch::upload(&gpu, 2, next_n, &q, &w, &nv).unwrap();
        let mut out = gpu.poisoned::<f32>(rows * cap, 0xFF).unwrap();
        indexer::logits(&gpu, &qb, &cache, &mut out, cap).unwrap();
        let sw = gpu.download(&out).unwrap();
        let shape = IndexerShape {
            batch: 2,
            next_n,
            num_valid: nv.clone(),
        };
        let want = reference::logits(&shape, &q, &w, &host);
        for row in 0..rows {
            let b = row / next_n;
            for j in 0..n {
                let got = sw[row * cap + j];
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
                    let (r, mag) = wgmma_ref_score(&q_f64, &w, &host, row, host.slot(b, j));
                    let err = (got as f64 - r).abs();
                    assert!(
                        got.is_finite() && err <= WGMMA_TOL * mag + 1e-30,
                        "seed {seed} next_n {next_n} row {row} j {j}: got {got:e} ref {r:e} err {err:e} (mag {mag:e})"
                    );
                }
            }
        }
    }
}

#[test]
fn gpu_wgmma_indexer_selects_the_reference_topk() {
    let Some(gpu) = gpu_for_test("gpu_wgmma_indexer_selects_the_reference_topk") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_wgmma_topk");
    println!("seed {seed}");
    let lens = [20_000usize, 513, 7_777];
    let cap = 20_000usize;
    let host = random_fp8_cache(&mut rng, lens.len(), cap);
    let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
    for next_n in [1usize, 2] {
        let rows = lens.len() * next_n;
        let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..rows * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let q_f64: Vec<f64> = q.iter().map(|&c| e4m3::decode(c) as f64).collect();
        let nv: Vec<i32> = (0..rows).map(|r| lens[r / next_n] as i32).collect();
        let qb = QueryBatch::upload(&gpu, lens.len(), next_n, &q, &w, &nv).unwrap();
        // Reference scores and error scales per row (the key_f64 values already include the key scale).
        let refs_all: Vec<Vec<(f64, f64)>> = (0..rows)
            .map(|r| {
                (0..nv[r] as usize)
                    .map(|j| wgmma_ref_score(&q_f64, &w, &host, r, host.slot(r / next_n, j)))
                    .collect()
            })
            .collect();
        for k in [512usize, 2048] {
            let mut bufs = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
            indexer::run(&gpu, &qb, &cache, &mut bufs).unwrap();
            let scores = gpu.download(&bufs.scores).unwrap();
            let idx = gpu.download(&bufs.topk.out_idx).unwrap();
            let stride = bufs.score_stride;
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
                let max_tol = refs.iter().map(|x| x.1).fold(0.0, f64::max) * WGMMA_TOL;
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
// FP8 logits v6 (TMA ring, `Fp8LogitsKernel::TmaRing`, the default since session 6): same wgmma sequence and
// epilogue as the cp.async-rounds kernel (bench `*_rounds*`), so their scores must be bit-identical; also
// checked against the f64 reference (WGMMA_TOL) so the two cannot be wrong together unnoticed.
// ---------------------------------------------------------------------------------------------------------

/// Logits of `kernel` on a buffer poisoned with 0xFF (stride = capacity rounded up + 4, so the columns past the
/// capacity must stay poisoned too). Prints `label` and the kernel before the launch and synchronizes right
/// after it, so a device fault (which kills the context for every later test) names its case.
fn logits_of(
    gpu: &megamoe::gpu::Gpu,
    label: &str,
    qb: &QueryBatch,
    cache: &KeyCacheGpu,
    kernel: indexer::Fp8LogitsKernel,
) -> (Vec<f32>, usize) {
    let stride = cache.capacity.next_multiple_of(4) + 4;
    let mut out = gpu.poisoned::<f32>(qb.rows() * stride, 0xFF).unwrap();
    println!("launch {kernel:?}: {label}");
    indexer::logits_with(gpu, qb, cache, &mut out, stride, kernel)
        .unwrap_or_else(|e| panic!("{label}: {kernel:?} launch: {e:#}"));
    gpu.synchronize()
        .unwrap_or_else(|e| panic!("{label}: {kernel:?} kernel failed on the device: {e:#}"));
    (gpu.download(&out).unwrap(), stride)
}

/// Runs both FP8 logits kernels and requires the whole output buffers (poisoned columns included) to be
/// bit-identical (two NaNs count as equal: the top-k ranks every NaN as -inf), then checks the TMA kernel's
/// scores against the f64 reference at every `ref_step`-th visible entry and at every tile edge, and that
/// nothing past n_seq(b) was written. Prints the largest err / mag seen.
#[allow(clippy::too_many_arguments)]
fn check_tma_logits(
    gpu: &megamoe::gpu::Gpu,
    seed: u64,
    label: &str,
    host: &KeyCacheHost,
    next_n: usize,
    nv: &[i32],
    ref_step: usize,
    rng: &mut ChaCha8Rng,
) {
    let batch = host.batch;
    let rows = batch * next_n;
    let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
        .map(|_| reference::random_e4m3(rng))
        .collect();
    let w: Vec<f32> = (0..rows * NUM_HEADS)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let q_f64: Vec<f64> = q.iter().map(|&c| e4m3::decode(c) as f64).collect();
    let cache = KeyCacheGpu::upload(gpu, host).unwrap();
    let qb = QueryBatch::upload(gpu, batch, next_n, &q, &w, nv).unwrap();
    let ctx = format!(
        "seed {seed} {label} next_n {next_n} (batch {batch}, capacity {})",
        host.capacity
    );
    let (want, stride) = logits_of(
        gpu,
        &ctx,
        &qb,
        &cache,
        indexer::Fp8LogitsKernel::CpAsyncRounds,
    );
    let (got, _) = logits_of(gpu, &ctx, &qb, &cache, indexer::Fp8LogitsKernel::TmaRing);
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    if let Some(i) = (0..got.len()).find(|&i| !same(got[i], want[i])) {
        let mismatches = (0..got.len()).filter(|&i| !same(got[i], want[i])).count();
        panic!(
            "{ctx}: TMA logits differ from the cp.async kernel at row {} j {}: tma {:e} ({:#010x}) vs {:e} \
             ({:#010x}); {mismatches} mismatching floats of {}",
            i / stride,
            i % stride,
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits(),
            got.len()
        );
    }
    let mut worst = 0.0f64;
    let mut checked = 0usize;
    for b in 0..batch {
        let n_seq = (0..next_n)
            .map(|t| nv[b * next_n + t].max(0) as usize)
            .max()
            .unwrap()
            .min(host.capacity);
        for t in 0..next_n {
            let row = b * next_n + t;
            for j in 0..stride {
                let g = got[row * stride + j];
                if j >= n_seq {
                    assert_eq!(
                        g.to_bits(),
                        u32::MAX,
                        "{ctx} row {row} (n_seq {n_seq}) j {j}: wrote {g:e} past the visible entries"
                    );
                    continue;
                }
                let edge = j % 64 == 0 || j % 64 == 63 || j + 1 == n_seq;
                if !(edge || j % ref_step == 0) {
                    continue;
                }
                let (r, mag) = wgmma_ref_score(&q_f64, &w, host, row, host.slot(b, j));
                let err = (g as f64 - r).abs();
                assert!(
                    g.is_finite() && err <= WGMMA_TOL * mag + 1e-30,
                    "{ctx} row {row} (n_seq {n_seq}) j {j}: tma {g:e} ref {r:e} err {err:e} = {:.3e} x mag \
                     (mag {mag:e}, tol {WGMMA_TOL:e} x mag)",
                    err / mag.max(1e-300)
                );
                if mag > 0.0 {
                    worst = worst.max(err / mag);
                }
                checked += 1;
            }
        }
    }
    println!(
        "{ctx}: bit-identical to the cp.async kernel; {checked} entries vs the reference, max err / mag = {worst:.3e}"
    );
}

/// Fill every cache slot at or past `lens[b]` of sequence b with NaN codes and NaN scales (0xFF bytes): the TMA
/// kernel copies whole 64-row tiles, so the rows past num_valid it loads must never reach a stored score.
fn poison_cache_tails(host: &mut KeyCacheHost, lens: &[usize]) {
    for (b, &n) in lens.iter().enumerate() {
        for j in n..host.capacity {
            let s = host.slot(b, j);
            host.codes[s * HEAD_DIM..(s + 1) * HEAD_DIM].fill(0xFF);
            host.scales[s * 4..s * 4 + 4].fill(0xFF);
        }
    }
}

#[test]
fn gpu_tma_logits_are_bit_identical_to_the_default_and_match_the_reference() {
    let Some(gpu) =
        gpu_for_test("gpu_tma_logits_are_bit_identical_to_the_default_and_match_the_reference")
    else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_tma_logits");
    println!("seed {seed}");
    for next_n in [1usize, 2] {
        // Tile edges; odd capacity 4097 (the last sequence's last tile runs past the end of both planes: the
        // TMA zero-fills those rows; earlier sequences' tails read the next sequence's poisoned slots). Sequence
        // 0 is empty: the CTAs whose first item lies in it copy and consume that tile but must store nothing.
        let lens = [0usize, 1, 63, 64, 65, 127, 129, 1000, 4033, 4097];
        let cap = 4097usize;
        let mut host = KeyCacheHost::new(KeyFormat::Fp8, lens.len(), cap);
        for (b, &n) in lens.iter().enumerate() {
            for j in 0..n {
                let amp = [0.05f32, 1.0, 20.0][rng.random_range(0..3)];
                host.write_key(host.slot(b, j), &random_key(&mut rng, amp))
                    .unwrap();
            }
        }
        poison_cache_tails(&mut host, &lens);
        // next_n = 2: the first token sees one entry fewer, so n_seq(b) = lens[b].
        let nv: Vec<i32> = (0..lens.len() * next_n)
            .map(|r| (lens[r / next_n] as i32 - (next_n - 1 - r % next_n) as i32).max(0))
            .collect();
        check_tma_logits(&gpu, seed, "tile edges", &host, next_n, &nv, 1, &mut rng);

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
        check_tma_logits(&gpu, seed, "long rows", &host, next_n, &nv, 61, &mut rng);

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
        check_tma_logits(&gpu, seed, "batch 40", &host, next_n, &nv, 7, &mut rng);
    }
}

#[test]
fn gpu_tma_logits_nan_entries_and_empty_calls_match_the_default() {
    let Some(gpu) = gpu_for_test("gpu_tma_logits_nan_entries_and_empty_calls_match_the_default")
    else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_tma_logits_nan");
    println!("seed {seed}");
    // NaN key codes (score 0) and NaN key scales (NaN score) inside the visible range: both kernels apply the
    // same operations to them, so the outputs agree bit for bit (NaN counted equal to NaN).
    let (cap, n) = (300usize, 300usize);
    let mut host = random_fp8_cache(&mut rng, 2, cap);
    for b in 0..2 {
        for j in (0..n).step_by(7) {
            let s = host.slot(b, j);
            host.codes[s * HEAD_DIM + rng.random_range(0..HEAD_DIM)] = [0x7F, 0xFF][j % 2];
        }
        for j in (3..n).step_by(11) {
            let s = host.slot(b, j);
            host.scales[s * 4..s * 4 + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    for next_n in [1usize, 2] {
        let nv = vec![n as i32; 2 * next_n];
        let rows = 2 * next_n;
        let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..rows * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
        let qb = QueryBatch::upload(&gpu, 2, next_n, &q, &w, &nv).unwrap();
        let ctx = format!("seed {seed} NaN entries next_n {next_n} (batch 2, capacity {cap})");
        let (want, stride) = logits_of(
            &gpu,
            &ctx,
            &qb,
            &cache,
            indexer::Fp8LogitsKernel::CpAsyncRounds,
        );
        let (got, _) = logits_of(&gpu, &ctx, &qb, &cache, indexer::Fp8LogitsKernel::TmaRing);
        let mut nans = 0;
        for i in 0..got.len() {
            let (a, b) = (got[i], want[i]);
            nans += usize::from(a.is_nan() && (i % stride) < n);
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "seed {seed} next_n {next_n} row {} j {}: tma {a:e} ({:#010x}) vs default {b:e} ({:#010x})",
                i / stride,
                i % stride,
                a.to_bits(),
                b.to_bits()
            );
        }
        assert!(
            nans > 0,
            "seed {seed} next_n {next_n}: the NaN-scale entries produced no NaN score"
        );

        // Every num_valid 0: nothing launched, nothing written.
        let nv0 = vec![0i32; 2 * next_n];
        let qb0 = QueryBatch::upload(&gpu, 2, next_n, &q, &w, &nv0).unwrap();
        let ctx0 = format!("seed {seed} num_valid all 0 next_n {next_n}");
        let (got0, _) = logits_of(&gpu, &ctx0, &qb0, &cache, indexer::Fp8LogitsKernel::TmaRing);
        assert!(
            got0.iter().all(|v| v.to_bits() == u32::MAX),
            "seed {seed} next_n {next_n}: num_valid all 0 but the TMA logits wrote scores"
        );
    }
}

#[test]
fn gpu_indexer_run_along_every_path_matches_the_default_run() {
    let Some(gpu) = gpu_for_test("gpu_indexer_run_along_every_path_matches_the_default_run") else {
        return;
    };
    let (seed, mut rng) = seeded("gpu_tma_run");
    println!("seed {seed}");
    // Whole call (logits + top-k) along every kernel path: the FP8 logits kernels are bit-identical and the
    // top-k paths deterministic, so the index and score outputs must agree exactly with the default run; the
    // default run's top-k is checked exact against the reference on its own scores.
    let lens = [20_000usize, 513, 7_777, 1];
    let cap = 20_000usize;
    let host = random_fp8_cache(&mut rng, lens.len(), cap);
    let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
    for next_n in [1usize, 2] {
        let rows = lens.len() * next_n;
        let q: Vec<u8> = (0..rows * NUM_HEADS * HEAD_DIM)
            .map(|_| reference::random_e4m3(&mut rng))
            .collect();
        let w: Vec<f32> = (0..rows * NUM_HEADS)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let nv: Vec<i32> = (0..rows)
            .map(|r| lens[r / next_n] as i32 - (r % next_n) as i32 * 3)
            .map(|n| n.max(0))
            .collect();
        let qb = QueryBatch::upload(&gpu, lens.len(), next_n, &q, &w, &nv).unwrap();
        for k in [512usize, 2048] {
            // Each call is labelled before it is enqueued and synchronized after it, so a device fault names
            // its case.
            let ctx = format!("seed {seed} next_n {next_n} k {k} (capacity {cap})");
            let synced = |what: &str| {
                gpu.synchronize()
                    .unwrap_or_else(|e| panic!("{ctx}: {what} failed on the device: {e:#}"))
            };
            let mut def = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
            println!("launch default run: {ctx}");
            indexer::run(&gpu, &qb, &cache, &mut def).unwrap();
            synced("default run");
            let (di, ds) = topk_result(&gpu, &def.topk);
            let def_scores = gpu.download(&def.scores).unwrap();
            let stride = def.score_stride;
            for r in 0..rows {
                let n = nv[r] as usize;
                if let Err(e) = reference::check_topk_exact(
                    &def_scores[r * stride..r * stride + n],
                    k,
                    &di[r * k..(r + 1) * k],
                ) {
                    panic!("seed {seed} next_n {next_n} k {k} row {r}: default run top-k: {e}");
                }
            }
            use indexer::{Fp8LogitsKernel as L, TopkPath as T};
            for (logits, topk) in [
                (L::CpAsyncRounds, T::Chain), // the session-5 default
                (L::CpAsyncRounds, T::Default),
                (L::TmaRing, T::Chain),
                (L::TmaRing, T::Pdl),
            ] {
                let paths = indexer::IndexerPaths { logits, topk };
                let mut alt = IndexerBuffers::new(&gpu, rows, cap, k).unwrap();
                println!("launch {paths:?} run: {ctx}");
                indexer::run_with(&gpu, paths, &qb, &cache, &mut alt).unwrap();
                synced(&format!("{paths:?} run"));
                let (ti, ts) = topk_result(&gpu, &alt.topk);
                for (r, &n) in nv.iter().enumerate() {
                    for i in r * k..(r + 1) * k {
                        assert!(
                            ti[i] == di[i] && ts[i].to_bits() == ds[i].to_bits(),
                            "seed {seed} next_n {next_n} k {k} row {r} (n {n}) rank {}: {paths:?} run ({}, {:e}) \
                             vs default run ({}, {:e})",
                            i - r * k,
                            ti[i],
                            ts[i],
                            di[i],
                            ds[i]
                        );
                    }
                }
            }
        }
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

#[test]
fn bench_config_races_the_session5_default_next_to_fused_at_the_issue_points() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/bench-configs/indexer.toml"
    ))
    .unwrap();
    let cfg = megamoe::bench::config::SweepConfig::from_toml_str(&text).unwrap();
    // The TMA ring is the default FP8 logits kernel since session 6; the previous default (cp.async rounds +
    // the three-launch top-k, "fused_rounds_chain") and the forced chain ("fused_chain") stay raced beside it.
    assert_eq!(
        indexer::Fp8LogitsKernel::default(),
        indexer::Fp8LogitsKernel::TmaRing
    );
    for v in ["fused", "fused_chain", "fused_pdl", "fused_rounds_chain"] {
        assert!(indexer::VARIANTS.contains(&v), "{v}");
    }
    let races = |axis: &str, value: u64, ctx_or_batch: (&str, u64), next_n: u64| {
        cfg.sweeps
            .iter()
            .filter(|s| s.kernel == "indexer")
            .any(|s| {
                let vars = s.variants_from(indexer::VARIANTS).unwrap();
                s.axis == axis
                    && s.values.contains(&value)
                    && s.param_u64(ctx_or_batch.0).unwrap_or(1) == ctx_or_batch.1
                    && s.param_u64("next_n").unwrap_or(1) == next_n
                    && (!s.has_param("format") || s.param_str("format").unwrap() == "fp8")
                    && vars.iter().any(|v| v == "fused")
                    && vars.iter().any(|v| v == "fused_rounds_chain")
            })
    };
    assert!(races("ctx", 1_048_576, ("batch", 1), 1), "1M ctx, batch 1");
    assert!(races("batch", 16, ("ctx", 1_048_576), 1), "batch 16 @ 1M");
    assert!(races("batch", 32, ("ctx", 1_048_576), 1), "batch 32 @ 1M");
    assert!(races("batch", 16, ("ctx", 65_536), 1), "batch 16 @ 64K");
    assert!(
        races("ctx", 1_048_576, ("batch", 16), 2),
        "next_n 2, batch 16 @ 1M"
    );
}
