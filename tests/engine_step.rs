//! The decode step's host side: the KV pool layout against the CPU model's candidate sets and compressor
//! emissions, the step workspace sizing (CPU); the device state and the embedding against `Model::embed` (GPU).

mod common;

use common::gpu;
use megamoe::engine::cache::LayerCacheLayout;
use megamoe::engine::plan::{LayerCachePlan, PlanRequest};
use megamoe::engine::step::{self, DecodeState, StepShape, STREAMS};
use megamoe::engine::{DeviceWeights, MemoryPlan, WeightSource};
use megamoe::model::weights::element_bits;
use megamoe::model::{CachePolicy, LayerKind, Model, ModelConfig, Weights};
use megamoe::ops::inputs::fresh_seed;
use megamoe::ops::sampler::{SamplerState, SamplerWorkspace};
use std::collections::HashSet;

/// The small structure with a 16-token window and HCA m = 16, so ring wrap and compressed emissions of both
/// kinds happen within 40 tokens.
fn compact_config() -> ModelConfig {
    ModelConfig {
        name: "compact".into(),
        window_size: 16,
        compress_ratios: vec![0, 0, 4, 16, 4, 16],
        ..ModelConfig::small()
    }
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (element_bits(seed, i) % vocab as u64) as u32)
        .collect()
}

fn layouts(cfg: &ModelConfig, batch: usize, context: usize) -> Vec<LayerCacheLayout> {
    (0..cfg.n_layers)
        .map(|l| LayerCacheLayout {
            plan: LayerCachePlan::of(cfg, l, context),
            batch,
        })
        .collect()
}

/// Every pool entry belongs to exactly one (sequence, window slot) or (sequence, compressed entry), and the
/// per-sequence bases are what the launchers' slot rules need.
#[test]
fn pool_layout_partitions_the_entries() {
    for cfg in [ModelConfig::small(), compact_config(), ModelConfig::flash()] {
        for (batch, context) in [(1, 1), (3, 200), (2, 4096)] {
            for lay in layouts(&cfg, batch, context) {
                let p = lay.plan;
                let mut seen = vec![0u8; lay.n_entries()];
                for b in 0..batch {
                    for pos in 0..p.window_entries {
                        seen[lay.window_slot(b, pos)] += 1;
                        // The ring wraps with period window_entries.
                        assert_eq!(
                            lay.window_slot(b, pos + p.window_entries),
                            lay.window_slot(b, pos)
                        );
                    }
                    for j in 0..p.compressed_entries {
                        seen[lay.compressed_slot(b, j)] += 1;
                    }
                    assert_eq!(lay.window_base(b), lay.window_slot(b, 0));
                    for j in 0..p.index_keys {
                        assert_eq!(lay.key_slot(b, j), b * p.index_keys + j);
                    }
                }
                assert!(
                    seen.iter().all(|&c| c == 1),
                    "{} batch {batch} ctx {context} layer {:?}: entries not partitioned",
                    cfg.name,
                    p.kind
                );
                // The last position of the context has a slot for every compressed entry it emitted.
                lay.check_position(context - 1).unwrap();
                if p.compressed_entries > 0 {
                    let r = lay.ratio();
                    assert!(lay
                        .check_position((p.compressed_entries + 1) * r - 1)
                        .is_err());
                }
            }
        }
    }
}

/// The CPU model decoding 40 tokens of the compact structure: at every layer and position the compressed
/// entries emitted so far follow `compressed_after`, and the trace's candidate set maps through `candidates`
/// onto distinct pool entries, window ones in the sequence's ring block (the ring slot of the position) and
/// compressed ones in its compressed block.
#[test]
fn candidates_follow_the_cpu_model() {
    let cfg = compact_config();
    let seed = fresh_seed("engine_step_candidates", "MEGAMOE_SEED");
    let m = Model::new(Weights::synthetic(cfg.clone(), seed, CachePolicy::All).unwrap()).unwrap();
    let mut st = m.new_state();
    let (batch, context, b) = (3, 64, 2);
    let lays = layouts(&cfg, batch, context);
    let mut emitted = vec![0usize; cfg.n_layers];
    for (pos, &t) in tokens(seed, 40, cfg.vocab_size).iter().enumerate() {
        let out = m.decode_step(&mut st, t).unwrap();
        for tr in &out.layers {
            let lay = &lays[tr.layer];
            emitted[tr.layer] += tr.new_compressed.is_some() as usize;
            assert_eq!(
                emitted[tr.layer],
                lay.compressed_after(pos),
                "layer {} pos {pos}: compressed entries emitted",
                tr.layer
            );
            if matches!(lay.plan.kind, LayerKind::Csa { .. }) {
                assert_eq!(tr.new_index_key.is_some(), tr.new_compressed.is_some());
            }
            let c = &tr.candidates;
            let wc = lay.window_candidates(b, pos);
            let want: Vec<i32> = c
                .window_positions
                .iter()
                .map(|&p| lay.window_slot(b, p) as i32)
                .collect();
            assert_eq!(wc, want, "layer {} pos {pos}: window candidates", tr.layer);
            let all = lay.candidates(b, pos, &c.compressed);
            assert_eq!(all.len(), c.window_positions.len() + c.compressed.len());
            let distinct: HashSet<i32> = all.iter().copied().collect();
            assert_eq!(distinct.len(), all.len(), "candidates must be distinct");
            let per = lay.per_seq() as i32;
            let (lo, win_end) = (
                b as i32 * per,
                (b as i32) * per + lay.plan.window_entries as i32,
            );
            for (i, &e) in all.iter().enumerate() {
                if i < wc.len() {
                    assert!((lo..win_end).contains(&e));
                } else {
                    assert!((win_end..lo + per).contains(&e));
                }
            }
        }
    }
}

#[test]
fn step_workspace_holds_its_parts() {
    for cfg in [ModelConfig::small(), ModelConfig::flash()] {
        for batch in [1, 4, 64] {
            let shape = StepShape {
                batch,
                context: 4096,
            };
            shape.check(&cfg).unwrap();
            let s = shape.sampler(&cfg);
            let parts = SamplerState::layout(&s).bytes()
                + SamplerWorkspace::layout(&s).bytes()
                + 4
                + 4 * batch * cfg.vocab_size;
            let bytes = step::workspace_bytes(&cfg, &shape);
            assert!(bytes >= parts, "{bytes} < {parts}");
            assert_eq!(shape.residual_elems(&cfg), batch * STREAMS * cfg.dim);
        }
    }
    let cfg = ModelConfig::small();
    assert!(StepShape {
        batch: 0,
        context: 16
    }
    .check(&cfg)
    .is_err());
}

/// The device state of the small geometry: positions beyond the caches are refused before any copy, and the
/// embedding writes `Model::embed` of each sequence's token into all four streams, bit for bit (a row gather).
#[test]
#[ignore = "needs an H100/H200"]
fn embedding_matches_the_cpu_model() {
    let gpu = gpu("engine_step_embed");
    let cfg = ModelConfig::small();
    let seed = fresh_seed("engine_step_embed", "MEGAMOE_SEED");
    let (batch, context) = (3, 256);
    let req = PlanRequest::new(batch, context, 16, 8 << 30);
    let plan = MemoryPlan::new(&cfg, &req).unwrap();
    let w = DeviceWeights::load(&gpu, &plan, &WeightSource::Synthetic { seed }).unwrap();
    let m = Model::new(Weights::synthetic(cfg.clone(), seed, CachePolicy::All).unwrap()).unwrap();
    let state = DecodeState::new(&gpu, &w, StepShape { batch, context }).unwrap();
    let s = &gpu.stream;
    assert!(state.set_positions(s, &[0, context as i32, 1]).is_err());
    state.set_positions(s, &[0, 5, -1]).unwrap();
    let ids = tokens(seed, batch, cfg.vocab_size);
    state.set_tokens(s, &ids).unwrap();
    state
        .load_residual(s, &vec![f32::NAN; batch * STREAMS * cfg.dim])
        .unwrap();
    state.embed(&gpu, s, &w).unwrap();
    let x = state.read_residual(s).unwrap();
    assert_eq!(state.read_error(s).unwrap(), 0);
    for (b, &t) in ids.iter().enumerate() {
        // Model::embed: the row repeated over the 4 streams, [4, D].
        let e = m.embed(t).unwrap();
        let row = &x[b * STREAMS * cfg.dim..][..STREAMS * cfg.dim];
        for (i, (&g, &c)) in row.iter().zip(&e).enumerate() {
            assert_eq!(g.to_bits(), c.to_bits(), "seq {b} value {i}");
        }
    }
}
