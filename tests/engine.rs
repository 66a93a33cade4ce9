//! The engine's plumbing: the memory plan (CPU), the device MXFP4 -> NVFP4 converter against
//! `formats::mxfp4::to_nvfp4`, and the device weights against `model::weights::Weights` (GPU).

mod common;

use common::{gpu, seeded};
use megamoe::engine::plan::{
    is_routed_expert, ExpertMap, IndexKeyFormat, LayerCachePlan, MemoryPlan, PlanRequest,
    ALLOC_GRANULE,
};
use megamoe::engine::{resolve_model, DeviceWeights, WeightSource};
use megamoe::formats::{indexer_key, kv, mxfp4, nvfp4};
use megamoe::gpu::arena;
use megamoe::model::checkpoint::{write_checkpoint, Checkpoint};
use megamoe::model::{CachePolicy, LayerKind, ModelConfig, Weights};
use megamoe::ops::weights::convert::mxfp4_to_nvfp4_host;

const GIB: usize = 1 << 30;
/// The usable memory of one H200 the issue plans for.
const H200_FREE: usize = 139 * GIB;

fn request(batch: usize, context: usize, free: usize) -> PlanRequest {
    PlanRequest::new(batch, context, context.min(4096), free)
}

/// Cache bytes of one sequence of `ctx` tokens, restated from the formats and `CompressorState` (kv + score rows).
fn cache_bytes_by_hand(cfg: &ModelConfig, ctx: usize, key_bytes: usize) -> usize {
    (0..cfg.n_layers)
        .map(|l| {
            // The ring: the window plus room for a prefill chunk's entries (plan::LayerCachePlan::window_entries).
            let window = (cfg.window_size + megamoe::engine::plan::PREFILL_CHUNK_MAX - 1).min(ctx)
                * kv::ENTRY_BYTES;
            window
                + match cfg.layer_kind(l) {
                    LayerKind::SlidingWindow => 0,
                    LayerKind::Csa { ratio } => {
                        (ctx / ratio) * (kv::ENTRY_BYTES + key_bytes)
                            + 4 * 2 * (2 * ratio) * (2 * cfg.head_dim)
                            + 4 * 2 * (2 * ratio) * (2 * cfg.index_head_dim)
                    }
                    LayerKind::Hca { ratio } => {
                        (ctx / ratio) * kv::ENTRY_BYTES + 4 * 2 * ratio * cfg.head_dim
                    }
                }
        })
        .sum()
}

#[test]
fn flash_plan_on_one_h200_maps_experts_onto_the_slots_that_fit() {
    let cfg = ModelConfig::flash();
    for (batch, ctx) in [(1usize, 4096usize), (64, 4096)] {
        let plan = MemoryPlan::new(&cfg, &request(batch, ctx, H200_FREE)).unwrap();
        println!("{plan}\n");
        // moe_gemm layout of one Flash expert: L1 4096 x 4096 and L2 4096 x 2048, e2m1 + e4m3/16 + f32/row.
        assert_eq!(plan.experts.l1.bytes(), 4096 * 4096 * 9 / 16 + 4096 * 4);
        assert_eq!(plan.experts.l2.bytes(), 4096 * 2048 * 9 / 16 + 4096 * 4);
        // ~156 GB for all 256 x 43 experts: they cannot all be resident.
        let full = plan.full_expert_bytes() as f64 / 1e9;
        assert!((156.0..156.5).contains(&full), "{full}");
        assert!(plan.map.slots < 256 && plan.map.slots >= cfg.n_activated_experts);
        assert!(plan.total_bytes() <= H200_FREE);
        // maximal: one more slot per layer does not fit
        assert!(
            plan.fixed_bytes() + plan.expert_layer_bytes(plan.map.slots + 1) * cfg.n_layers
                > H200_FREE
        );
        assert_eq!(
            plan.cache_bytes(),
            batch * cache_bytes_by_hand(&cfg, ctx, indexer_key::FP8_ENTRY_BYTES)
        );
        // bytes read per token: top-6 full experts of every layer, whatever the mapping
        assert_eq!(
            plan.routed_bytes_per_token(),
            6 * plan.experts.bytes_per_expert() * 43
        );
        let text = plan.to_string();
        assert!(
            text.contains(&format!("e mod {}", plan.map.slots)),
            "{text}"
        );
    }
    // the dense pool holds every manifest tensor except the routed experts, each once, aligned
    let plan = MemoryPlan::new(&cfg, &request(1, 4096, H200_FREE)).unwrap();
    let manifest = megamoe::model::weights::tensor_manifest(&cfg);
    let dense: Vec<_> = manifest
        .iter()
        .filter(|s| !is_routed_expert(&s.name))
        .collect();
    assert_eq!(dense.len(), plan.dense.len());
    let mut end = 0;
    for (s, t) in dense.iter().zip(&plan.dense) {
        assert_eq!(s.name, t.spec.name);
        assert!(t.offset >= end && t.offset % 256 == 0);
        end = t.offset + t.bytes();
    }
    assert!(plan.dense_bytes >= end && plan.dense_bytes < end + 256);
}

/// `--expert-slots`: a cap below what fits holds the slot count there and frees the rest of the memory; a cap above
/// it changes nothing; a cap below the experts a token reads, or above every routed expert, is refused.
#[test]
fn an_expert_slot_cap_lowers_the_slots_and_only_within_range() {
    let cfg = ModelConfig::flash();
    let free = MemoryPlan::new(&cfg, &request(1, 4096, H200_FREE)).unwrap();
    let capped = |n| {
        MemoryPlan::new(
            &cfg,
            &PlanRequest {
                max_expert_slots: Some(n),
                ..request(1, 4096, H200_FREE)
            },
        )
    };
    let eight = capped(8).unwrap();
    assert_eq!(eight.map.slots, 8);
    assert!(eight.expert_bytes() < free.expert_bytes() / 10);
    assert_eq!(capped(255).unwrap().map.slots, free.map.slots);
    assert!(capped(cfg.n_activated_experts - 1).is_err());
    assert!(capped(cfg.n_routed_experts + 1).is_err());
}

#[test]
fn pro_and_small_plans() {
    let pro = ModelConfig::pro();
    let plan = MemoryPlan::new(&pro, &request(1, 4096, H200_FREE)).unwrap();
    println!("{plan}\n");
    assert_eq!(
        plan.experts.bytes_per_expert(),
        6144 * 7168 * 9 / 16 + 6144 * 4 + 7168 * 3072 * 9 / 16 + 7168 * 4
    );
    assert!(plan.map.slots >= 6 && plan.map.slots < 384);
    assert!(plan.total_bytes() <= H200_FREE);

    let small = ModelConfig::small();
    let plan = MemoryPlan::new(&small, &request(4, 1024, 8 * GIB)).unwrap();
    assert!(plan.map.is_identity());
    assert_eq!(plan.map.slots, 16);
    assert_eq!(plan.map.table(), (0..16).collect::<Vec<i32>>());
    assert!(plan.map.to_string().contains("identity"));
    // each of the four expert buffers of a layer (L1 / L2 tiled codes + scales, their global scales) is one
    // granule-rounded allocation: 16 experts of [2I, D] and [D, I] NVFP4 (9/16 byte per value with the e4m3
    // scales per 16) and one f32 global scale per row
    let (d, i) = (small.dim, small.moe_inter_dim);
    let granules = |b: usize| b.div_ceil(ALLOC_GRANULE) * ALLOC_GRANULE;
    assert_eq!(
        plan.expert_layer_bytes(16),
        granules(16 * 2 * i * d * 9 / 16)
            + granules(16 * 2 * i * 4)
            + granules(16 * d * i * 9 / 16)
            + granules(16 * d * 4)
    );
    assert_eq!(
        plan.cache_bytes(),
        4 * cache_bytes_by_hand(&small, 1024, indexer_key::FP8_ENTRY_BYTES)
    );
    let mx = MemoryPlan::new(
        &small,
        &PlanRequest {
            index_keys: IndexKeyFormat::Mxfp4,
            ..request(4, 1024, 8 * GIB)
        },
    )
    .unwrap();
    assert_eq!(
        mx.cache_bytes(),
        4 * cache_bytes_by_hand(&small, 1024, indexer_key::MXFP4_ENTRY_BYTES)
    );
    // a short context: the window ring holds only the context
    let l = LayerCachePlan::of(&small, 0, 10);
    assert_eq!((l.window_entries, l.compressed_entries), (10, 0));
}

#[test]
fn expert_mapping_rule() {
    let m = ExpertMap::all(256, 221);
    assert!(!m.is_identity());
    for e in 0..256 {
        assert_eq!(m.physical(e), Some(e % 221));
    }
    assert_eq!(m.physical(221), Some(0));
    assert_eq!(m.physical(255), Some(34));
    let t = m.table();
    assert_eq!(t.len(), 256);
    assert!(t.iter().all(|&s| (0..221).contains(&s)));
    let text = m.to_string();
    assert!(
        text.contains("256 logical experts per layer on 221 physical slots")
            && text.contains("e mod 221")
            && text.contains("221..=255")
            && text.contains("0..=34"),
        "{text}"
    );
    // more than twice as many logical experts as slots: every slot is shared
    let m = ExpertMap::all(16, 5);
    assert!(m.to_string().contains("slots 0..=4"), "{m}");
}

#[test]
fn requests_that_cannot_run_fail_with_their_numbers() {
    let cfg = ModelConfig::flash();
    // 64 sequences of 1M tokens: the caches alone exceed the device
    let req = request(64, 1 << 20, H200_FREE);
    let err = MemoryPlan::new(&cfg, &req).unwrap_err().to_string();
    println!("{err}");
    let caches = 64 * cache_bytes_by_hand(&cfg, 1 << 20, indexer_key::FP8_ENTRY_BYTES);
    assert!(
        err.contains("batch 64 x context 1048576 does not fit"),
        "{err}"
    );
    assert!(
        err.contains(&format!("the caches need {:.2} GB", caches as f64 / 1e9)),
        "{err}"
    );
    assert!(
        err.contains(&format!("{:.2} GB are free", H200_FREE as f64 / 1e9)),
        "{err}"
    );
    // just below the least that fits (top-6 slots per layer) fails, at it succeeds with 6 slots
    let ok = MemoryPlan::new(&cfg, &request(1, 4096, H200_FREE)).unwrap();
    let least = ok.fixed_bytes() + ok.expert_layer_bytes(6) * 43;
    assert!(MemoryPlan::new(&cfg, &request(1, 4096, least - 1)).is_err());
    assert_eq!(
        MemoryPlan::new(&cfg, &request(1, 4096, least))
            .unwrap()
            .map
            .slots,
        6
    );
    // a prompt longer than the context
    let err = MemoryPlan::new(
        &cfg,
        &PlanRequest {
            prompt_len: 5000,
            ..request(1, 4096, H200_FREE)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("prompt (5000 tokens) is longer than the context (4096 tokens)"),
        "{err}"
    );
    // an unknown model name, and the known ones
    let err = resolve_model("flsh").unwrap_err().to_string();
    assert!(err.contains("unknown model \"flsh\""), "{err}");
    assert_eq!(resolve_model("pro").unwrap(), ModelConfig::pro());
    assert!(resolve_model("/nonexistent/config.json").is_err());
}

/// The engine's expert rows (`[w1; w3]` for L1, `w2` for L2, converted to NVFP4) hold exactly the values the CPU
/// model multiplies: the NVFP4 dequantization equals `Weights::dequant_rows` of each part bit for bit, and the
/// synthetic weights convert without an inexact block (their scales span one binade).
#[test]
fn expert_rows_in_the_moe_gemm_layout_are_the_model_weights() {
    let cfg = ModelConfig::small();
    let w = Weights::synthetic(cfg.clone(), 3, CachePolicy::Nothing).unwrap();
    let i = cfg.moe_inter_dim;
    for (layer, e) in [(0usize, 0usize), (3, 5), (5, 15)] {
        for (l1, parts) in [(true, vec!["w1", "w3"]), (false, vec!["w2"])] {
            let (q, report) = megamoe::engine::weights::expert_nvfp4(&w, layer, e, l1).unwrap();
            assert!(report.is_lossless());
            assert_eq!(
                (q.rows, q.cols),
                if l1 { (2 * i, cfg.dim) } else { (cfg.dim, i) }
            );
            let got = nvfp4::dequantize_rows(&q);
            let mut want = Vec::new();
            for p in parts {
                let name = format!("layers.{layer}.ffn.experts.{e}.{p}.weight");
                let rows = w.spec(&name).unwrap().shape[0];
                want.extend(w.dequant_rows(&name, 0, rows).unwrap().data);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&got) == bits(&want),
                "layer {layer} expert {e} l1 {l1}"
            );
        }
    }
}

// ------------------------------------------------------------------------------------------------ GPU

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_mxfp4_to_nvfp4_equals_the_cpu_converter() {
    let g = gpu("gpu_mxfp4_to_nvfp4_equals_the_cpu_converter");
    let mut rng = seeded("gpu_mxfp4_to_nvfp4", "MEGAMOE_SEED");
    // one row, an odd row count, more halves than a warp has lanes, rows with every span
    for (rows, cols, span) in [
        (1usize, 32usize, 17i32),
        (7, 64, 26),
        (129, 2048, 17),
        (300, 4096, 26),
    ] {
        let m = common::random_mxfp4(&mut rng, rows, cols, span);
        let (want, report) = mxfp4::to_nvfp4(&m);
        let (got, inexact) = mxfp4_to_nvfp4_host(&g, &m).unwrap();
        let what = format!("{rows} x {cols}, span {span}");
        common::assert_bit_identical(&what, "codes", &want.data, &got.data);
        common::assert_bit_identical(&what, "scales", &want.scales, &got.scales);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        common::assert_bit_identical(
            &what,
            "global scales",
            &bits(&want.global_scale),
            &bits(&got.global_scale),
        );
        assert_eq!(
            inexact as usize,
            report.inexact_blocks.len(),
            "{what}: inexact count"
        );
        if span > 17 && cols >= 1024 {
            // 128 blocks a row over 27 binades: a gap above 17 in every row is all but certain
            assert!(inexact > 0, "{what}: the case should hold inexact blocks");
        }
    }
}

/// Download the device weights and compare every dense tensor with `cpu.raw` and every resident expert slot with
/// `engine::weights::expected_expert` (logical expert = slot).
fn assert_device_weights_equal(
    label: &str,
    g: &megamoe::gpu::Gpu,
    dw: &DeviceWeights,
    cpu: &Weights,
) {
    let pool = g.download(dw.pool()).unwrap();
    for t in &dw.plan.dense {
        let want = cpu.raw(&t.spec.name).unwrap();
        assert!(
            pool[t.offset..t.offset + t.bytes()] == want[..],
            "{label}: dense tensor {} differs",
            t.spec.name
        );
        let view = dw.bytes(&t.spec.name).unwrap();
        assert_eq!(arena::download(&g.stream, &view).unwrap(), want);
    }
    // Every FP8 dense weight's f32 block scales (the dense tensor-core route's), bit for bit the host conversion of
    // its checkpoint scale codes.
    let mut fp8 = 0;
    for t in &dw.plan.dense {
        let Some(prefix) = t.spec.name.strip_suffix(".weight") else {
            continue;
        };
        if t.spec.dtype != megamoe::model::weights::StoredDtype::F8E4M3 {
            assert!(dw.scales_f32(&t.spec.name).is_none(), "{}", t.spec.name);
            continue;
        }
        let (n, k) = (t.spec.shape[0], t.spec.shape[1]);
        let codes = cpu.raw(&format!("{prefix}.scale")).unwrap();
        let want = megamoe::ops::dense::prefill::weight_scales_f32(&codes, n, k).unwrap();
        let got = arena::download(&g.stream, &dw.scales_f32(&t.spec.name).unwrap()).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "{label}: {} f32 block scales",
            t.spec.name
        );
        fp8 += 1;
    }
    assert!(fp8 > 0, "{label}: no FP8 dense weight");
    let mut inexact = 0;
    for (layer, le) in dw.experts.iter().enumerate() {
        for (l1, w) in [(true, &le.l1), (false, &le.l2)] {
            let tiled = g.download(&w.tiled).unwrap();
            let global = g.download(&w.global).unwrap();
            let per = tiled.len() / w.experts;
            for slot in 0..w.experts {
                let (t, gs, n) =
                    megamoe::engine::weights::expected_expert(cpu, layer, slot, l1).unwrap();
                inexact += n;
                assert!(
                    tiled[slot * per..(slot + 1) * per] == t[..],
                    "{label}: layer {layer} slot {slot} L{} tiled bytes differ",
                    if l1 { 1 } else { 2 }
                );
                let got: Vec<u32> = global[slot * w.n..(slot + 1) * w.n]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                let want: Vec<u32> = gs.iter().map(|x| x.to_bits()).collect();
                assert_eq!(
                    got, want,
                    "{label}: layer {layer} slot {slot} global scales"
                );
            }
        }
    }
    assert_eq!(
        dw.inexact_blocks as usize, inexact,
        "{label}: inexact count"
    );
}

/// The GPU, the small geometry and its synthetic CPU weights of `seed`.
fn small_synthetic(test: &str, seed: u64) -> (megamoe::gpu::Gpu, ModelConfig, Weights) {
    let cfg = ModelConfig::small();
    let cpu = Weights::synthetic(cfg.clone(), seed, CachePolicy::Nothing).unwrap();
    (gpu(test), cfg, cpu)
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_synthetic_small_weights_equal_the_cpu_weights() {
    let seed = 7;
    let (g, cfg, cpu) = small_synthetic("gpu_synthetic_small_weights_equal_the_cpu_weights", seed);
    let mut plan = MemoryPlan::new(&cfg, &request(2, 512, 8 * GIB)).unwrap();
    let dw = DeviceWeights::load(&g, &plan, &WeightSource::Synthetic { seed }).unwrap();
    assert_eq!(dw.experts[0].l1.experts, 16);
    assert_device_weights_equal("small, all experts", &g, &dw, &cpu);
    // fewer physical slots than logical experts: slot s still holds logical expert s
    plan.map.slots = 11;
    let dw = DeviceWeights::load(&g, &plan, &WeightSource::Synthetic { seed }).unwrap();
    assert_eq!(dw.experts[5].l2.experts, 11);
    assert_device_weights_equal("small, 11 slots", &g, &dw, &cpu);
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_checkpoint_load_equals_the_synthetic_fill() {
    let seed = 11;
    let (g, cfg, cpu) = small_synthetic("gpu_checkpoint_load_equals_the_synthetic_fill", seed);
    let dir = std::env::temp_dir().join(format!("megamoe-engine-ckpt-{}", std::process::id()));
    write_checkpoint(&cpu, &dir, 3).unwrap();
    let ck = Checkpoint::open(&dir, &cfg).unwrap();
    let plan = MemoryPlan::new(&cfg, &request(1, 256, 8 * GIB)).unwrap();
    let from_ck = DeviceWeights::load(&g, &plan, &WeightSource::Checkpoint(&ck)).unwrap();
    let synth = DeviceWeights::load(&g, &plan, &WeightSource::Synthetic { seed }).unwrap();
    assert!(g.download(from_ck.pool()).unwrap() == g.download(synth.pool()).unwrap());
    for (a, b) in from_ck.experts.iter().zip(&synth.experts) {
        for (x, y) in [(&a.l1, &b.l1), (&a.l2, &b.l2)] {
            assert!(g.download(&x.tiled).unwrap() == g.download(&y.tiled).unwrap());
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(
                bits(g.download(&x.global).unwrap()),
                bits(g.download(&y.global).unwrap())
            );
        }
    }
    assert_eq!(from_ck.inexact_blocks, synth.inexact_blocks);
    assert_device_weights_equal("checkpoint", &g, &from_ck, &cpu);
    std::fs::remove_dir_all(&dir).ok();
}
