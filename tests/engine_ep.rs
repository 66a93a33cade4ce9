//! Expert parallelism's host rules (CPU; docs/multi-gpu.md): the partition of the routed experts over W ranks,
//! the pairs each rank computes (score and hash layers), the deterministic combine, and W simulated ranks on the
//! CPU oracle's expert math against the single-rank `Model::moe`. The NCCL transport itself needs several GPUs and
//! is not tested here.

use megamoe::engine::ep::{
    combine_partials, dispatch_pairs, simulate_moe, CombineBytes, ExpertPartition, Pair,
};
use megamoe::engine::plan::{ExpertMap, MemoryPlan, PlanRequest};
use megamoe::model::numerics::{bf16_round, cosine};
use megamoe::model::reference::Routing;
use megamoe::model::{CachePolicy, Model, ModelConfig, Weights};
use megamoe::ops::inputs::fresh_seed;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const WORLDS: [usize; 4] = [1, 2, 4, 8];

fn configs() -> Vec<ModelConfig> {
    vec![
        ModelConfig::flash(),
        ModelConfig::pro(),
        ModelConfig::small(),
    ]
}

fn small_model(seed: u64) -> Model {
    Model::new(Weights::synthetic(ModelConfig::small(), seed, CachePolicy::All).unwrap()).unwrap()
}

/// `tokens` FFN inputs as the model's are (BF16 values, RMS ~1) and token ids, from `rng`.
fn inputs(rng: &mut ChaCha8Rng, cfg: &ModelConfig, tokens: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let f = (0..tokens)
        .map(|_| {
            (0..cfg.dim)
                .map(|_| bf16_round(rng.random_range(-1.7f32..1.7)))
                .collect()
        })
        .collect();
    let ids = (0..tokens)
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    (f, ids)
}

fn all_pairs(routing: &[Routing]) -> Vec<Pair> {
    routing
        .iter()
        .enumerate()
        .flat_map(|(token, r)| (0..r.experts.len()).map(move |pick| Pair { token, pick }))
        .collect()
}

/// The ranks' dispatch lists partition all pairs: each pair on exactly the rank that owns its expert.
fn assert_dispatch_partitions(label: &str, routing: &[Routing], p: &ExpertPartition) {
    let mut seen: Vec<Pair> = Vec::new();
    for rank in 0..p.world() {
        let pairs = dispatch_pairs(routing, p, rank).unwrap();
        assert!(
            pairs.windows(2).all(|w| w[0] < w[1]),
            "{label}: rank {rank}: not in (token, pick) order"
        );
        for q in &pairs {
            let e = routing[q.token].experts[q.pick];
            assert_eq!(
                p.owner(e),
                rank,
                "{label}: rank {rank} got pair {q:?} of expert {e}"
            );
            assert!(p.local_slot(rank, e).is_some());
        }
        seen.extend(pairs);
    }
    seen.sort();
    assert_eq!(
        seen,
        all_pairs(routing),
        "{label}: pairs not covered exactly once over {} ranks",
        p.world()
    );
}

#[test]
fn partition_covers_every_expert_exactly_once() {
    for cfg in configs() {
        let e_total = cfg.n_routed_experts;
        for w in WORLDS {
            let p = ExpertPartition::new(e_total, w).unwrap();
            let mut owned = vec![0usize; e_total];
            for rank in 0..w {
                let mut local: Vec<usize> = p
                    .experts_of(rank)
                    .map(|e| {
                        owned[e] += 1;
                        assert_eq!(p.owner(e), rank);
                        p.local_slot(rank, e).unwrap()
                    })
                    .collect();
                local.sort();
                assert_eq!(
                    local,
                    (0..e_total / w).collect::<Vec<_>>(),
                    "{} W={w} rank {rank}",
                    cfg.name
                );
                // The router's table: owned experts onto 0..E/W once each, the rest -1.
                let table = p.map_of(rank, e_total / w).unwrap().table();
                let mut slots: Vec<i32> = table.iter().copied().filter(|&s| s >= 0).collect();
                slots.sort();
                assert_eq!(slots, (0..(e_total / w) as i32).collect::<Vec<_>>());
                assert_eq!(
                    table.iter().filter(|&&s| s < 0).count(),
                    e_total - e_total / w
                );
            }
            assert!(
                owned.iter().all(|&n| n == 1),
                "{} W={w}: an expert owned {owned:?} times",
                cfg.name
            );
        }
    }
}

#[test]
fn world_of_one_is_the_identity() {
    let seed = fresh_seed("world_of_one_is_the_identity", "MEGAMOE_SEED");
    let model = small_model(seed);
    let cfg = model.config().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (f, ids) = inputs(&mut rng, &cfg, 8);
    for cfg in configs() {
        let p = ExpertPartition::new(cfg.n_routed_experts, 1).unwrap();
        let map = ExpertMap::all(cfg.n_routed_experts, cfg.n_routed_experts);
        assert_eq!(p.map_of(0, map.slots).unwrap(), map, "{}", cfg.name);
        assert!((0..cfg.n_routed_experts).all(|e| p.owner(e) == 0 && p.local_slot(0, e) == Some(e)));
    }
    let p = ExpertPartition::new(cfg.n_routed_experts, 1).unwrap();
    for layer in [0, cfg.n_layers - 1] {
        let routing: Vec<Routing> = f
            .iter()
            .zip(&ids)
            .map(|(x, &t)| model.route(layer, x, t).unwrap())
            .collect();
        assert_eq!(
            dispatch_pairs(&routing, &p, 0).unwrap(),
            all_pairs(&routing)
        );
    }
}

#[test]
fn hash_and_score_layers_dispatch_to_the_owners() {
    let seed = fresh_seed(
        "hash_and_score_layers_dispatch_to_the_owners",
        "MEGAMOE_SEED",
    );
    let model = small_model(seed);
    let cfg = model.config().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (f, ids) = inputs(&mut rng, &cfg, 64);
    assert!(cfg.num_hash_layers >= 1 && cfg.n_layers > cfg.num_hash_layers);
    for layer in [
        0,
        cfg.num_hash_layers - 1,
        cfg.num_hash_layers,
        cfg.n_layers - 1,
    ] {
        let routing: Vec<Routing> = f
            .iter()
            .zip(&ids)
            .map(|(x, &t)| model.route(layer, x, t).unwrap())
            .collect();
        if cfg.is_hash_layer(layer) {
            // The picks are the token's tid2eid row, in table order, whatever the logits.
            for (r, &t) in routing.iter().zip(&ids) {
                let row = model
                    .weights
                    .i64_row(
                        &format!("layers.{layer}.ffn.gate.tid2eid"),
                        t as usize,
                        cfg.n_routed_experts,
                    )
                    .unwrap();
                assert_eq!(r.experts, row, "layer {layer} token {t}");
            }
        }
        for w in WORLDS {
            let p = ExpertPartition::new(cfg.n_routed_experts, w).unwrap();
            assert_dispatch_partitions(&format!("layer {layer} W={w}"), &routing, &p);
        }
    }
}

#[test]
fn simulated_ranks_equal_the_single_rank_moe() {
    for run in 0..3 {
        let label = format!("simulated_ranks_equal_the_single_rank_moe run {run}");
        let seed = fresh_seed(&label, "MEGAMOE_SEED");
        let model = small_model(seed);
        let cfg = model.config().clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (f, ids) = inputs(&mut rng, &cfg, 5);
        let d = cfg.dim;
        for layer in [0, cfg.num_hash_layers, cfg.n_layers - 1] {
            let routing: Vec<Routing> = f
                .iter()
                .zip(&ids)
                .map(|(x, &t)| model.route(layer, x, t).unwrap())
                .collect();
            let single: Vec<f32> = f
                .iter()
                .zip(&routing)
                .flat_map(|(x, r)| model.moe(layer, x, r).unwrap())
                .collect();
            // Per element, the sum of the terms' magnitudes (the f32 reassociation bound's scale).
            let mut abs_sum = vec![0f32; single.len()];
            for (t, (x, r)) in f.iter().zip(&routing).enumerate() {
                let (f_r, f_q) = (model.routed_input(x).unwrap(), model.moe_input(x).unwrap());
                let mut terms: Vec<Vec<f32>> = (0..r.experts.len())
                    .map(|j| model.routed_partial(layer, &f_r, r, &[j]).unwrap())
                    .collect();
                terms.push(model.shared_expert_out(layer, &f_q).unwrap());
                for term in terms {
                    for (a, v) in abs_sum[t * d..(t + 1) * d].iter_mut().zip(term) {
                        *a += v.abs();
                    }
                }
            }
            for w in [1, 2, 4] {
                let p = ExpertPartition::new(cfg.n_routed_experts, w).unwrap();
                let ep = simulate_moe(&model, layer, &f, &routing, &p).unwrap();
                assert_eq!(ep.len(), single.len());
                if w == 1 {
                    let same = ep
                        .iter()
                        .zip(&single)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{label}: layer {layer}: one rank is not Model::moe bit for bit"
                    );
                    continue;
                }
                // Bound (simulate_moe's docs): two recursive f32 sums of the same 7 terms differ by at most
                // 2 * 6 * 2^-24 * sum |terms|; the one BF16 rounding adds at most one BF16 ulp of the larger value.
                let mut differ = 0;
                let mut worst = 0f32;
                for i in 0..single.len() {
                    let (a, b) = (ep[i], single[i]);
                    let diff = (a - b).abs();
                    let big = a.abs().max(b.abs());
                    let bf16_ulp = if big > 0.0 {
                        2f32.powi(big.log2().floor() as i32 - 7)
                    } else {
                        0.0
                    };
                    let bound = 12.0 * f32::EPSILON / 2.0 * abs_sum[i] + bf16_ulp;
                    assert!(
                        diff <= bound,
                        "{label}: layer {layer} W={w} element {i}: {a} vs single-rank {b} (bound {bound})"
                    );
                    if diff > 0.0 {
                        differ += 1;
                        worst = worst.max(diff / bf16_ulp.max(f32::MIN_POSITIVE));
                    }
                }
                let cos = cosine(&ep, &single);
                println!(
                    "layer {layer} W={w}: {differ} of {} elements differ from the single rank (at most {worst:.0} \
                     BF16 ulp), cosine {cos:.9}",
                    single.len()
                );
                assert!(cos >= 0.99999, "{label}: layer {layer} W={w}: cosine {cos}");
            }
        }
    }
}

#[test]
fn bad_partitions_fail_with_their_numbers() {
    let msg = |r: anyhow::Result<ExpertPartition>| format!("{:#}", r.unwrap_err());
    assert!(msg(ExpertPartition::new(256, 0)).contains("world size 0"));
    assert!(msg(ExpertPartition::new(16, 32)).contains("32 ranks for 16 routed experts"));
    assert!(msg(ExpertPartition::new(384, 5))
        .contains("384 routed experts do not split evenly over 5 ranks"));
    let p = ExpertPartition::new(16, 4).unwrap();
    assert!(format!("{:#}", p.map_of(4, 4).unwrap_err()).contains("rank 4 outside a world of 4"));
    assert!(format!("{:#}", dispatch_pairs(&[], &p, 7).unwrap_err())
        .contains("rank 7 outside a world of 4"));
    let stray = Routing {
        experts: vec![3, 16],
        ..Default::default()
    };
    assert!(
        format!("{:#}", dispatch_pairs(&[stray], &p, 0).unwrap_err()).contains("expert 16 outside")
    );
    assert!(combine_partials(&[], &[0.0]).is_err());
}

/// The numbers docs/multi-gpu.md quotes: per-rank memory of Flash on 2 GPUs and Pro on 8 (batch 1 and 64 at 4K),
/// and the combine's bytes per layer and per step for each transport.
#[test]
fn print_rank_memory_and_combine_bytes() {
    let gb = |b: usize| b as f64 / 1e9;
    for (cfg, w) in [(ModelConfig::flash(), 2), (ModelConfig::pro(), 8)] {
        let p = ExpertPartition::new(cfg.n_routed_experts, w).unwrap();
        for batch in [1, 64] {
            let plan =
                MemoryPlan::new(&cfg, &PlanRequest::new(batch, 4096, 512, usize::MAX / 4)).unwrap();
            let experts = plan.expert_layer_bytes(p.experts_per_rank()) * cfg.n_layers;
            let total = plan.fixed_bytes() + experts;
            println!(
                "{} on {w} ranks, batch {batch} x 4K: reserve {:.2} + dense {:.2} + KV {:.2} + workspace {:.2} + \
                 experts {:.2} ({} per layer x {} layers) = {:.2} GB per rank",
                cfg.name,
                gb(plan.reserve_bytes),
                gb(plan.dense_bytes),
                gb(plan.cache_bytes()),
                gb(plan.workspace_bytes),
                gb(experts),
                p.experts_per_rank(),
                cfg.n_layers,
                gb(total)
            );
            if cfg.name == "flash" {
                assert!(total < 149_250_000_000, "Flash on 2 H200s must fit");
            }
            let c = CombineBytes::of(batch, cfg.dim, cfg.n_activated_experts, w);
            let kb = |b: usize| b as f64 / 1e3;
            println!(
                "  combine per layer (KB): all-gather f32 {:.1}, scatter-sum-gather {:.1}, all-reduce f32 {:.1}, \
                 all-to-all {:.1}; per step x {} layers (MB): {:.2} / {:.2} / {:.2} / {:.2}",
                kb(c.all_gather_f32),
                kb(c.scatter_sum_gather),
                kb(c.all_reduce_f32),
                kb(c.all_to_all),
                cfg.n_layers,
                kb(c.all_gather_f32 * cfg.n_layers) / 1e3,
                kb(c.scatter_sum_gather * cfg.n_layers) / 1e3,
                kb(c.all_reduce_f32 * cfg.n_layers) / 1e3,
                kb(c.all_to_all * cfg.n_layers) / 1e3,
            );
        }
    }
}

/// Why contiguous blocks and not `e mod W` (docs/multi-gpu.md): the synthetic Flash tid2eid rows put a token's six
/// hash picks at a stride of E / 6 = 42, an even number, so `e mod 2` would send all six to one rank; blocks of 128
/// split them at most 4 : 2.
#[test]
fn blocks_spread_a_tokens_hash_picks_over_the_ranks() {
    let cfg = ModelConfig::flash();
    let w = Weights::synthetic(cfg.clone(), 1, CachePolicy::Nothing).unwrap();
    let p = ExpertPartition::new(cfg.n_routed_experts, 2).unwrap();
    let (mut worst_blocks, mut worst_mod) = (0, 0);
    for token in (0..cfg.vocab_size).step_by(97) {
        let row = w
            .i64_row("layers.0.ffn.gate.tid2eid", token, cfg.n_routed_experts)
            .unwrap();
        let on_rank0 =
            |owner: &dyn Fn(usize) -> usize| row.iter().filter(|&&e| owner(e) == 0).count();
        let blocks = on_rank0(&|e| p.owner(e));
        let modulo = on_rank0(&|e| e % 2);
        worst_blocks = worst_blocks.max(blocks.max(6 - blocks));
        worst_mod = worst_mod.max(modulo.max(6 - modulo));
    }
    println!("Flash layer 0 on 2 ranks: most hash picks of one token on one rank: blocks {worst_blocks}, e mod 2 {worst_mod}");
    assert!(worst_blocks <= 4);
}
