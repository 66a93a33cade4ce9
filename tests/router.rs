//! The MoE router (src/ops/router, kernels/router.cu) against the CPU model's routing
//! (`model::reference::route_from_logits` through `ops::router::reference`): logits within their f32 summation
//! bound, selections exact (a reorder allowed only within the bound, counted and printed), weights within their
//! bound, and the whole masked grouping exactly the layout of the selection; a graph replay with new hidden
//! vectors; and the grouping fed straight into moe_gemm's masked decode launchers. Tolerances: tests/common/router.rs.

mod common;

use common::router::{self as fx, Case, DevCase, DevRun};
use half::bf16;
use megamoe::engine::ffn::slot_capacity;
use megamoe::engine::ExpertMap;
use megamoe::model::reference::{route_from_logits, RouteSelection, Routing};
use megamoe::ops::moe_gemm::reference::Grouping;
use megamoe::ops::moe_gemm::{
    self as mg, DeviceActivations, DeviceExpertWeights, DeviceGrouping, GemmConfig, L1Output,
    RoutedBatch,
};
use megamoe::ops::router::{
    gather_nvfp4_rows, reference, route, route_counts_into, Nvfp4RowBufs, RouterShape, MAX_EXPERTS,
    MAX_TOKENS, TOPK,
};
use rand::Rng;

/// DSV4-Flash and -Pro: (experts, hidden, route scale).
const SHAPES: [(usize, usize, f32); 2] = [(256, 4096, 1.5), (384, 7168, 2.5)];

// ---- host-side rules ----------------------------------------------------------------------------------------

#[test]
fn shape_rules_refuse_what_the_kernels_cannot_take() {
    let ok = RouterShape::identity(64, 384, 7168, 64);
    ok.check().unwrap();
    for (bad, what) in [
        (RouterShape { tokens: 0, ..ok }, "tokens"),
        (
            RouterShape {
                tokens: MAX_TOKENS + 1,
                ..ok
            },
            "tokens",
        ),
        (RouterShape { experts: 5, ..ok }, "experts"),
        (
            RouterShape {
                experts: MAX_EXPERTS + 1,
                ..ok
            },
            "experts",
        ),
        (
            RouterShape {
                dim: 4096 + 8,
                ..ok
            },
            "D",
        ),
        (RouterShape { capacity: 0, ..ok }, "capacity"),
        (RouterShape { slots: 0, ..ok }, "slots"),
        (
            RouterShape {
                slots: MAX_EXPERTS + 1,
                ..ok
            },
            "slots",
        ),
    ] {
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains(what), "{bad:?}: {e}");
    }
    assert_eq!(ok.rows_total(), 384 * 64);
}

/// The oracle's order: descending biased score, the lower expert index first on equal values (-0 == +0, NaN
/// last); the hash rule keeps the table order; the weights renormalize over the chosen scores only.
#[test]
fn cpu_oracle_breaks_ties_by_the_lower_expert_index() {
    let logits = [1.0f32, 2.0, 2.0, 0.5, 2.0, f32::NAN, 3.0, 2.0];
    let bias = [0.0f32; 8];
    let r = route_from_logits(&logits, RouteSelection::Biased(&bias), 6, 1.5);
    assert_eq!(r.experts, vec![6, 1, 2, 4, 7, 0]);
    let sum: f32 = r.weights.iter().sum();
    assert!((sum - 1.5).abs() < 1e-6, "{sum}");
    let h = route_from_logits(&logits, RouteSelection::Hash(&[7, 3, 0, 1, 2, 4]), 6, 2.5);
    assert_eq!(h.experts, vec![7, 3, 0, 1, 2, 4]);
    // A bias that makes a low score win: selection only, the weight still comes from the unbiased score.
    let mut b2 = [0.0f32; 8];
    b2[3] = 10.0;
    let r2 = route_from_logits(&logits, RouteSelection::Biased(&b2), 6, 1.0);
    assert_eq!(r2.experts[0], 3);
    assert!(r2.weights[0] < r2.weights[1]);
}

/// The oracle's grouping by physical slot (`reference::grouping_by_slot`, the layout `router_select_group_slots`
/// must write): 16 logical experts on 11 slots (e % 11, the engine's map), so experts e and e + 11 share slot e;
/// a token that picks both gets two rows of that slot, in pair order; with the identity map the layout is the
/// plain per-expert grouping.
#[test]
fn cpu_oracle_groups_pairs_by_physical_slot() {
    let slot_of: Vec<usize> = ExpertMap::all(16, 11)
        .table()
        .into_iter()
        .map(|s| s as usize)
        .collect();
    let routing = |experts: Vec<usize>| Routing {
        scores: vec![],
        experts,
        weights: vec![],
    };
    // Token 0: slots [0, 0, 3, 5, 3, 2]; token 1: slots [0, 1, 2, 3, 4, 5].
    let rs = [
        routing(vec![0, 11, 3, 5, 14, 2]),
        routing(vec![11, 1, 2, 3, 4, 5]),
    ];
    let cap = 4;
    let rb = reference::grouping_by_slot(&rs, &slot_of, 11, cap).unwrap();
    let counts = match &rb.grouping {
        Grouping::Masked { counts, .. } => counts.clone(),
        _ => unreachable!(),
    };
    assert_eq!(counts, vec![3, 1, 2, 3, 1, 2, 0, 0, 0, 0, 0]);
    let row = |s: usize, r: usize| (s * cap + r) as i32;
    assert_eq!(
        rb.token_rows,
        vec![
            row(0, 0),
            row(0, 1),
            row(3, 0),
            row(5, 0),
            row(3, 1),
            row(2, 0),
            row(0, 2),
            row(1, 0),
            row(2, 1),
            row(3, 2),
            row(4, 0),
            row(5, 1),
        ]
    );
    assert_eq!(&rb.row_token[0..cap], &[0, 0, 1, -1]);
    assert_eq!(&rb.row_token[3 * cap..4 * cap], &[0, 0, 1, -1]);
    assert_eq!(rb.row_token.len(), 11 * cap);
    // A slot over its capacity is an error of the oracle (the GPU drops instead; tested on the GPU).
    assert!(reference::grouping_by_slot(&rs, &slot_of, 11, 2).is_err());
    // The identity map gives the plain grouping.
    let id: Vec<usize> = (0..16).collect();
    let a = reference::grouping_by_slot(&rs, &id, 16, cap).unwrap();
    let b = reference::grouping(&rs, 16, cap).unwrap();
    assert_eq!(a.token_rows, b.token_rows);
    assert_eq!(a.row_token, b.row_token);
    assert_eq!(a.grouping, b.grouping);
}

/// The bound's slope claim (tests/common/router.rs): |d sqrt(softplus(x)) / dx| <= 0.5 and the relative slope
/// <= 0.5, on a dense grid of the f32 range that matters.
#[test]
fn score_slope_is_at_most_one_half() {
    let s = |x: f64| (x.exp().ln_1p()).sqrt();
    let mut x = -60.0f64;
    while x < 60.0 {
        let h = 1e-4;
        let d = (s(x + h) - s(x - h)) / (2.0 * h);
        assert!(d <= 0.5 + 1e-6, "slope {d} at {x}");
        assert!(d / s(x) <= 0.5 + 1e-6, "relative slope {} at {x}", d / s(x));
        x += 0.01;
    }
}

// ---- GPU ----------------------------------------------------------------------------------------------------

/// Fresh random tokens at the Flash and Pro shapes, T in {1, 2, 7, 64}, capacity T (nothing dropped).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routes_random_tokens_at_flash_and_pro_shapes() {
    let (gpu, mut rng) = fx::gpu_test("gpu_routes_random_tokens_at_flash_and_pro_shapes");
    let mut reordered = 0;
    let mut tokens_seen = 0;
    for (e, d, scale) in SHAPES {
        for t in [1, 2, 7, 64] {
            let c = Case::random(&mut rng, t, e, d, scale);
            let seen = fx::route_and_check(&gpu, &format!("E {e} D {d} T {t}"), &c, t);
            println!(
                "E {e} D {d} T {t}: {} tokens reordered within the bound, worst logit diff {:.3} of its bound",
                seen.reordered_tokens, seen.worst_logit_ratio
            );
            reordered += seen.reordered_tokens;
            tokens_seen += t;
        }
    }
    println!("{reordered} of {tokens_seen} tokens selected in another order within the bound");
}

/// Hash layers: experts from the token's tid2eid row in table order, weights from the scores; an id outside the
/// vocabulary routes nowhere (its 6 pairs counted as dropped).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_hash_layers_route_by_token_id() {
    let (gpu, mut rng) = fx::gpu_test("gpu_hash_layers_route_by_token_id");
    for (e, d, scale) in SHAPES {
        for t in [1, 7, 64] {
            let c = Case::random(&mut rng, t, e, d, scale).with_hash(&mut rng, 1000);
            let seen = fx::route_and_check(&gpu, &format!("hash E {e} D {d} T {t}"), &c, t);
            assert_eq!(seen.reordered_tokens, 0);
        }
        // Token 1 of 3 has an id outside the vocabulary.
        let mut c = Case::random(&mut rng, 3, e, d, scale).with_hash(&mut rng, 50);
        c.hash.as_mut().unwrap().0[1] = 50;
        let got = fx::run(&gpu, &c, 3);
        assert_eq!(got.dropped, TOPK as i32, "hash E {e}: dropped pairs");
        assert_eq!(&got.experts[TOPK..2 * TOPK], &[-1; TOPK]);
        assert_eq!(&got.token_rows[TOPK..2 * TOPK], &[-1; TOPK]);
        assert_eq!(&got.weights[TOPK..2 * TOPK], &[0.0; TOPK]);
        assert!(
            !got.row_token.contains(&1),
            "the invalid token owns no slot"
        );
        assert_eq!(got.counts.iter().sum::<i32>(), 2 * TOPK as i32);
    }
}

/// Exact ties: identical gate rows and biases give bit-identical biased scores on both sides, so the order is
/// decided only by the tie rule (the lower expert index first), and must match exactly: 9 copies of one row at
/// scattered indices with a large bias (the top 6 are the 6 lowest of them), and 4 clear winners above 5 copies
/// (the tie straddles the 6th / 7th place).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_exact_ties_go_to_the_lower_expert_index() {
    let (gpu, mut rng) = fx::gpu_test("gpu_exact_ties_go_to_the_lower_expert_index");
    for (e, d, scale) in SHAPES {
        for (winners, copies) in [(0usize, 9usize), (4, 5)] {
            let mut c = Case::random(&mut rng, 7, e, d, scale);
            let mut idx = rand::seq::index::sample(&mut rng, e, winners + copies).into_vec();
            let (win, tied) = idx.split_at_mut(winners);
            let src = tied[0];
            for &i in tied.iter() {
                let row: Vec<bf16> = c.gate[src * d..(src + 1) * d].to_vec();
                c.gate[i * d..(i + 1) * d].copy_from_slice(&row);
                c.bias[i] = 10.0;
            }
            for &i in win.iter() {
                c.bias[i] = 20.0;
            }
            let want = fx::cpu_routing(&c);
            let mut tied_sorted = tied.to_vec();
            tied_sorted.sort();
            for r in &want.routings {
                let mut w = win.to_vec();
                w.sort_by(|&a, &b| {
                    (r.scores[b] + c.bias[b])
                        .partial_cmp(&(r.scores[a] + c.bias[a]))
                        .unwrap()
                        .then(a.cmp(&b))
                });
                w.extend(&tied_sorted[..TOPK - winners]);
                assert_eq!(r.experts, w, "the oracle's tie order");
            }
            let got = fx::run(&gpu, &c, 7);
            let seen = fx::check(
                &format!("ties E {e} winners {winners} copies {copies}"),
                &c,
                &got,
                &want,
                7,
            );
            assert_eq!(seen.reordered_tokens, 0, "exact ties must resolve exactly");
        }
    }
}

/// Near ties: biases that pull every expert's biased score of token 0 to within ~1e-6 of one value, so the
/// 6th / 7th margin is below the summation bound; the GPU must stay within the bound (reorders counted).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_near_ties_stay_within_the_summation_bound() {
    let (gpu, mut rng) = fx::gpu_test("gpu_near_ties_stay_within_the_summation_bound");
    let mut reordered = 0;
    let mut tokens = 0;
    for (e, d, scale) in SHAPES {
        for t in [1, 7] {
            for _ in 0..4 {
                let mut c = Case::random(&mut rng, t, e, d, scale);
                let scores = fx::cpu_routing(&c).routings[0].scores.clone();
                for (b, s) in c.bias.iter_mut().zip(&scores) {
                    *b = 1.0 - s + rng.random_range(-1e-6..1e-6);
                }
                let seen = fx::route_and_check(&gpu, &format!("near ties E {e} T {t}"), &c, t);
                reordered += seen.reordered_tokens;
                tokens += t;
            }
        }
    }
    println!(
        "near ties: {reordered} of {tokens} tokens selected in another order within the bound"
    );
}

/// The grouping by physical slot (`router_select_group_slots`) with the engine's map e % slots, 16 experts on 11
/// slots (D 512) and Flash's 256 on 226 (D 4096), biased and hash selection, T in {1, 7, 64}: the selection and
/// weights against the CPU model as without a map, the grouping exactly the oracle's `grouping_by_slot` of the
/// GPU's selection (capacity 2T: two logical experts per slot at most, nothing dropped). The same case through the
/// slots kernel with the identity table (slots = E) writes bit for bit what the identity kernel writes.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_slot_map_groups_by_physical_slot() {
    let (gpu, mut rng) = fx::gpu_test("gpu_slot_map_groups_by_physical_slot");
    for (e, slots, d, scale) in [(16usize, 11usize, 512usize, 1.5f32), (256, 226, 4096, 1.5)] {
        for t in [1usize, 7, 64] {
            for hash in [false, true] {
                let mut c = Case::random(&mut rng, t, e, d, scale);
                if hash {
                    c = c.with_hash(&mut rng, 1000);
                }
                let label = format!("E {e} on {slots} slots, T {t}, hash {hash}");
                let mapped = c.clone().with_slots(slots);
                let seen = fx::route_and_check(&gpu, &label, &mapped, 2 * t);
                if hash {
                    assert_eq!(seen.reordered_tokens, 0, "{label}");
                }
                let plain = fx::run(&gpu, &c, t);
                let identity = fx::run(&gpu, &c.clone().with_slots(e), t);
                assert_same_routing(&format!("{label}: identity table"), &plain, &identity);
            }
        }
    }
}

/// A table value outside `0..slots` routes its pairs nowhere: hash routing (so the pairs are known), expert x of
/// token 0's row mapped to slot `slots`; every pair of x gets no row and is counted in `dropped`, the others keep
/// the oracle's grouping of the selection without them (x's pairs moved to a scratch slot and cut away).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_slot_outside_the_slots_drops_its_pairs() {
    let (gpu, mut rng) = fx::gpu_test("gpu_slot_outside_the_slots_drops_its_pairs");
    let (e, slots, d, t) = (16usize, 11usize, 512usize, 7usize);
    let mut c = Case::random(&mut rng, t, e, d, 1.5)
        .with_hash(&mut rng, 100)
        .with_slots(slots);
    let (ids, table, _) = c.hash.clone().unwrap();
    let x = table[ids[0] as usize * TOPK] as usize;
    c.slot_map.as_mut().unwrap().0[x] = slots as i32;
    let got = fx::run(&gpu, &c, 2 * t);
    let want = fx::cpu_routing(&c);
    // The oracle with x on an extra slot `slots`, then that slot's rows removed.
    let mut slot_of: Vec<usize> = c
        .slot_map
        .as_ref()
        .unwrap()
        .0
        .iter()
        .map(|&s| s as usize)
        .collect();
    slot_of[x] = slots;
    let rb = reference::grouping_by_slot(&want.routings, &slot_of, slots + 1, 2 * t).unwrap();
    let cap = 2 * t;
    let mut dropped = 0;
    for p in 0..t * TOPK {
        assert_eq!(
            got.experts[p],
            want.routings[p / TOPK].experts[p % TOPK] as i32,
            "experts[{p}]"
        );
        let want_row = if want.routings[p / TOPK].experts[p % TOPK] == x {
            dropped += 1;
            -1
        } else {
            rb.token_rows[p]
        };
        assert_eq!(got.token_rows[p], want_row, "token_rows[{p}]");
    }
    assert!(dropped >= 1);
    assert_eq!(got.dropped, dropped, "dropped");
    assert_eq!(got.counts.len(), slots);
    assert_eq!(
        &got.row_token[..],
        &rb.row_token[..slots * cap],
        "row_token"
    );
    let n: i32 = got.counts.iter().sum();
    assert_eq!(n, (t * TOPK) as i32 - dropped, "counts");
}

/// Every output of two routing calls bit for bit (logits included).
fn assert_same_routing(label: &str, a: &fx::GpuRouting, b: &fx::GpuRouting) {
    common::assert_bit_identical(label, "logits", &a.logits, &b.logits);
    assert_eq!(a.experts, b.experts, "{label}: experts");
    common::assert_bit_identical(label, "weights", &a.weights, &b.weights);
    assert_eq!(a.token_rows, b.token_rows, "{label}: token_rows");
    assert_eq!(a.counts, b.counts, "{label}: counts");
    assert_eq!(a.row_token, b.row_token, "{label}: row_token");
    common::assert_bit_identical(label, "row_weight", &a.row_weight, &b.row_weight);
    assert_eq!(a.dropped, b.dropped, "{label}: dropped");
}

/// The routing captured once in a CUDA graph, without a slot map and with one (Pro's 384 experts on 331 slots,
/// e % 331, capacity 2T); new hidden vectors written on the device between replays and the outputs poisoned,
/// every replay checked against the CPU.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_routing_replays_as_a_graph_with_new_hidden_vectors() {
    let (gpu, mut rng) = fx::gpu_test("gpu_routing_replays_as_a_graph_with_new_hidden_vectors");
    let (e, d, scale) = SHAPES[1];
    let t = 7;
    for slots in [None, Some(331)] {
        let c = Case::random(&mut rng, t, e, d, scale);
        let (c, cap) = match slots {
            None => (c, t),
            Some(s) => (c.with_slots(s), 2 * t),
        };
        replay_routing_graph(&gpu, &mut rng, c, cap, &format!("slots {slots:?}"));
    }
}

fn replay_routing_graph(
    gpu: &megamoe::gpu::Gpu,
    rng: &mut impl Rng,
    mut c: Case,
    cap: usize,
    label: &str,
) {
    let (t, e, d, scale) = (c.tokens, c.experts, c.dim, c.route_scale);
    let mut dc = DevCase::upload(gpu, &c);
    let mut run = DevRun::new(gpu, &c.shape(cap));
    // One plain call first: the kernels are resolved (and their attributes set) outside the capture.
    route(gpu, &gpu.stream, &dc.inputs(false), &run.ws, &mut run.out).unwrap();
    gpu.synchronize().unwrap();
    let graph = {
        let inputs = dc.inputs(false);
        let (ws, out) = (&run.ws, &mut run.out);
        gpu.capture(|| route(gpu, &gpu.stream, &inputs, ws, out))
            .unwrap()
    };
    for replay in 0..4 {
        let fresh = Case::random(rng, t, e, d, scale);
        c.x = fresh.x;
        gpu.write(&gpu.stream, &mut dc.x, &c.x).unwrap();
        run.poison_outputs(gpu);
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let got = run.download(gpu);
        let want = fx::cpu_routing(&c);
        fx::check(
            &format!("{label}: graph replay {replay}"),
            &c,
            &got,
            &want,
            cap,
        );
    }
}

/// The router's grouping straight into moe_gemm's masked decode path (E 16, D 512, I 512, T 7): the L1 mainloop
/// and finish read its counts and per-slot weights, the L2 combine its token_rows. A second run with the host
/// layout of the same selection (`RoutedBatch::from_choices`, uploaded) and the same weights must give
/// bit-identical L1 and L2 outputs, so the two layouts agree element for element.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_grouping_feeds_moe_gemm_masked_decode() {
    let (gpu, mut rng) = fx::gpu_test("gpu_grouping_feeds_moe_gemm_masked_decode");
    let (e, d, i_dim, t) = (16usize, 512usize, 512usize, 7usize);
    let cap = t;
    let c = Case::random(&mut rng, t, e, d, 1.5);
    let dc = DevCase::upload(&gpu, &c);
    let mut run = DevRun::new(&gpu, &c.shape(cap));
    route(&gpu, &gpu.stream, &dc.inputs(false), &run.ws, &mut run.out).unwrap();
    gpu.synchronize().unwrap();
    let got = run.download(&gpu);
    let want = fx::cpu_routing(&c);
    fx::check("moe feed", &c, &got, &want, cap);

    let w13 = common::moe::quantized_weights(&mut rng, e, 2 * i_dim, d);
    let w2 = common::moe::quantized_weights(&mut rng, e, d, i_dim);
    let (d13, d2) = (
        DeviceExpertWeights::upload(&gpu, &w13).unwrap(),
        DeviceExpertWeights::upload(&gpu, &w2).unwrap(),
    );
    let rows = e * cap;
    // The activation rows gathered by a slot -> token table (zeros for empty slots).
    let gather = |row_token: &[i32]| -> Vec<bf16> {
        let mut a = vec![bf16::ZERO; rows * d];
        for (r, &tok) in row_token.iter().enumerate() {
            if tok >= 0 {
                let tok = tok as usize;
                a[r * d..(r + 1) * d].copy_from_slice(&c.x[tok * d..(tok + 1) * d]);
            }
        }
        a
    };
    let sm = gpu.info.sm_count as usize;
    let cfg1 = GemmConfig::choose(sm, 1.0, t * TOPK, 2 * i_dim, d);
    let cfg2 = GemmConfig::choose(sm, 1.0, t * TOPK, d, i_dim);
    // One masked decode step: L1 mainloop + finish (routing weights per slot), L2 mainloop + combine.
    let step = |grp: &DeviceGrouping,
                a_host: &[bf16],
                routing: &cudarc::driver::CudaSlice<f32>,
                token_rows: &cudarc::driver::CudaSlice<i32>|
     -> (Vec<u8>, Vec<u8>, Vec<f32>, Vec<bf16>) {
        let a = gpu.upload(a_host).unwrap();
        let act = DeviceActivations::Bf16 {
            rows,
            k: d,
            data: &a,
        };
        let ws1 = common::moe::Ws::new(&gpu, cfg1.splits, rows, 2 * i_dim);
        mg::launch_partial(&gpu, &gpu.stream, &d13, &act, grp, &cfg1, &ws1).unwrap();
        let mut l1 = L1Output::new(&gpu, rows, i_dim, false).unwrap();
        mg::launch_finish_l1(&gpu, &gpu.stream, &ws1, grp, &d13, &act, routing, &mut l1).unwrap();
        let ws2 = common::moe::Ws::new(&gpu, cfg2.splits, rows, d);
        let a2 = l1.as_activations();
        mg::launch_partial(&gpu, &gpu.stream, &d2, &a2, grp, &cfg2, &ws2).unwrap();
        let mut y = gpu.poisoned::<bf16>(t * d, 0xFF).unwrap();
        mg::launch_finish_l2(
            &gpu,
            &gpu.stream,
            &ws2,
            grp,
            &d2,
            &a2,
            token_rows,
            TOPK,
            None,
            &mut y,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        (
            gpu.download(&l1.codes).unwrap(),
            gpu.download(&l1.scales).unwrap(),
            gpu.download(&l1.global).unwrap(),
            gpu.download(&y).unwrap(),
        )
    };

    // The router's own device buffers: counts as the grouping, row_weight as routing, token_rows as the table.
    let out = std::mem::replace(
        &mut run.out,
        megamoe::ops::router::RouterOutputs::alloc(&gpu, &c.shape(cap), 0).unwrap(),
    );
    let grp = DeviceGrouping {
        capacity: cap,
        experts: e,
        rows_total: rows,
        group: out.counts,
    };
    let from_router = step(
        &grp,
        &gather(&got.row_token),
        &out.row_weight,
        &out.token_rows,
    );

    // The host layout of the same selection and the same weights.
    let choices: Vec<usize> = got.experts.iter().map(|&x| x as usize).collect();
    let rb = RoutedBatch::from_choices(t, e, TOPK, choices, Some(cap)).unwrap();
    let hgrp = DeviceGrouping::upload(&gpu, &rb.grouping).unwrap();
    let mut w_rows = vec![0f32; rows];
    for p in 0..t * TOPK {
        w_rows[rb.token_rows[p] as usize] = got.weights[p];
    }
    let from_host = step(
        &hgrp,
        &gather(&rb.row_token),
        &gpu.upload(&w_rows).unwrap(),
        &gpu.upload(&rb.token_rows).unwrap(),
    );
    common::assert_bit_identical("moe feed", "L1 codes", &from_host.0, &from_router.0);
    common::assert_bit_identical("moe feed", "L1 scales", &from_host.1, &from_router.1);
    common::assert_bit_identical("moe feed", "L1 global", &from_host.2, &from_router.2);
    common::assert_bit_identical("moe feed", "L2 y", &from_host.3, &from_router.3);
    let y: Vec<f32> = from_router.3.iter().map(|v| v.to_f32()).collect();
    common::assert_all_written("moe feed L2 y", &y);
    assert!(
        y.iter().any(|&v| v != 0.0),
        "moe feed: L2 output is all zero"
    );
}

/// A capacity below the largest count: three experts every token prefers (bias +10) keep their first
/// `capacity` tokens in token order; the later pairs get no row (token_rows -1), the counts stop at the capacity
/// and `dropped` counts the rest. Expected: the full layout (capacity T) with each expert's slots cut at the
/// capacity and renumbered.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_capacity_below_the_largest_count_drops_the_latest_tokens() {
    let (gpu, mut rng) =
        fx::gpu_test("gpu_capacity_below_the_largest_count_drops_the_latest_tokens");
    let (e, d, scale) = SHAPES[0];
    let (t, cap) = (64usize, 16usize);
    let mut c = Case::random(&mut rng, t, e, d, scale);
    for &hot in &[3usize, 100, 255] {
        c.bias[hot] = 10.0;
    }
    let full = fx::run(&gpu, &c, t);
    let want = fx::cpu_routing(&c);
    fx::check("capacity T", &c, &full, &want, t);
    let got = fx::run(&gpu, &c, cap);
    assert_eq!(
        got.experts, full.experts,
        "selection does not depend on capacity"
    );
    let mut dropped = 0;
    for p in 0..t * TOPK {
        let r = full.token_rows[p] as usize;
        let (ex, rank) = (r / t, r % t);
        let want_row = if rank < cap {
            (ex * cap + rank) as i32
        } else {
            dropped += 1;
            -1
        };
        assert_eq!(got.token_rows[p], want_row, "token_rows[{p}]");
    }
    for ex in 0..e {
        assert_eq!(
            got.counts[ex],
            full.counts[ex].min(cap as i32),
            "counts[{ex}]"
        );
        for r in 0..cap {
            let (gs, fs) = (ex * cap + r, ex * t + r);
            assert_eq!(
                got.row_token[gs], full.row_token[fs],
                "row_token slot ({ex}, {r})"
            );
            assert_eq!(
                got.row_weight[gs].to_bits(),
                full.row_weight[fs].to_bits(),
                "row_weight slot ({ex}, {r})"
            );
        }
    }
    assert_eq!(got.dropped, dropped);
    assert_eq!(
        dropped,
        3 * (t - cap) as i32,
        "the three hot experts each drop T - capacity pairs"
    );
}

/// The engine's path from the router to moe_gemm's A operand. `route_counts_into` writes the per-slot counts into a
/// buffer of the caller's (the moe_gemm grouping's), equal to what `route` writes, and leaves `out.counts` as it
/// was; `gather_nvfp4_rows` copies each token's NVFP4 row (random bytes and global scales: the gather is a copy) to
/// every row the router gave its picks and leaves the other rows as they were: bit for bit the CPU twin
/// `reference::gather_rows` on the router's own token_rows. Flash's 256 experts on 226 slots (D 4096, T 7,
/// capacity 2T: picks e and e + 226 share a slot) and the small model's 16 on 16 (D 512, T 8).
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_counts_into_and_the_nvfp4_gather_feed_the_grouped_rows() {
    let (gpu, mut rng) = fx::gpu_test("gpu_counts_into_and_the_nvfp4_gather_feed_the_grouped_rows");
    let poison = common::POISON;
    for (e, d, slots, t) in [(256usize, 4096usize, 226usize, 7usize), (16, 512, 16, 8)] {
        let label = format!("E {e} on {slots} slots, D {d}, T {t}");
        let c = Case::random(&mut rng, t, e, d, 1.5).with_slots(slots);
        let cap = slot_capacity(t, &ExpertMap::all(e, slots));
        let want = fx::run(&gpu, &c, cap);
        assert_eq!(want.dropped, 0, "{label}: the capacity drops nothing");
        let dc = DevCase::upload(&gpu, &c);
        let mut run = DevRun::new(&gpu, &c.shape(cap));
        let counts = gpu.poisoned::<i32>(slots, poison).unwrap();
        route_counts_into(
            &gpu,
            &gpu.stream,
            &dc.inputs(false),
            &run.ws,
            &mut run.out,
            &counts,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        let got = run.download(&gpu);
        assert_eq!(
            gpu.download(&counts).unwrap(),
            want.counts,
            "{label}: counts"
        );
        assert!(
            got.counts.iter().all(|&v| v == -1),
            "{label}: out.counts was written"
        );
        assert_eq!(got.token_rows, want.token_rows, "{label}: token_rows");
        assert_eq!(got.experts, want.experts, "{label}: experts");

        let rows = slots * cap;
        let codes: Vec<u8> = (0..t * d / 2).map(|_| rng.random()).collect();
        let scales: Vec<u8> = (0..t * d / 16).map(|_| rng.random()).collect();
        let global: Vec<f32> = (0..t).map(|_| rng.random_range(0.5f32..2.0)).collect();
        let (dc_codes, dc_scales, dc_global) = (
            gpu.upload(&codes).unwrap(),
            gpu.upload(&scales).unwrap(),
            gpu.upload(&global).unwrap(),
        );
        let (r_codes, r_scales, r_global) = (
            gpu.poisoned::<u8>(rows * d / 2, poison).unwrap(),
            gpu.poisoned::<u8>(rows * d / 16, poison).unwrap(),
            gpu.poisoned::<f32>(rows, poison).unwrap(),
        );
        gather_nvfp4_rows(
            &gpu,
            &gpu.stream,
            &Nvfp4RowBufs {
                rows: t,
                dim: d,
                codes: &dc_codes,
                scales: &dc_scales,
                global: &dc_global,
            },
            &run.out.token_rows,
            &Nvfp4RowBufs {
                rows,
                dim: d,
                codes: &r_codes,
                scales: &r_scales,
                global: &r_global,
            },
        )
        .unwrap();
        gpu.synchronize().unwrap();
        let mut w_codes = vec![poison; rows * d / 2];
        let mut w_scales = vec![poison; rows * d / 16];
        let mut w_global = vec![u32::from_ne_bytes([poison; 4]); rows];
        let gbits: Vec<u32> = global.iter().map(|g| g.to_bits()).collect();
        reference::gather_rows(&codes, d / 2, &got.token_rows, &mut w_codes);
        reference::gather_rows(&scales, d / 16, &got.token_rows, &mut w_scales);
        reference::gather_rows(&gbits, 1, &got.token_rows, &mut w_global);
        common::assert_bit_identical(&label, "codes", &w_codes, &gpu.download(&r_codes).unwrap());
        common::assert_bit_identical(
            &label,
            "scales",
            &w_scales,
            &gpu.download(&r_scales).unwrap(),
        );
        let g: Vec<u32> = gpu
            .download(&r_global)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        common::assert_bit_identical(&label, "global scales", &w_global, &g);
        let owned = w_global
            .iter()
            .filter(|&&v| v != u32::from_ne_bytes([poison; 4]))
            .count();
        assert_eq!(owned, t * TOPK, "{label}: every pick owns one gathered row");
    }
}
