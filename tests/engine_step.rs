//! The decode step's host side: the KV pool layout against the CPU model's candidate sets and compressor
//! emissions, the step workspace sizing (CPU); the device state and the embedding against `Model::embed` (GPU).

mod common;

use common::engine::{short_window_config, small_rig, tokens};
use common::gpu;
use megamoe::engine::cache::LayerCacheLayout;
use megamoe::engine::io::{Residual, StepShape, STREAMS};
use megamoe::engine::plan::LayerCachePlan;
use megamoe::engine::step;
use megamoe::gpu::timing::capture_on;
use megamoe::model::numerics::cosine;
use megamoe::model::{CachePolicy, LayerKind, Model, ModelConfig, Weights};
use megamoe::ops::dense;
use megamoe::ops::inputs::fresh_seed;
use megamoe::ops::mhc::MhcWorkspace;
use megamoe::ops::sampler::{SamplerState, SamplerWorkspace};
use std::collections::HashSet;

/// SMs of an H100 SXM (the dense split plan depends on the count).
const H100_SMS: usize = 132;

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
    for cfg in [
        ModelConfig::small(),
        short_window_config(),
        ModelConfig::flash(),
    ] {
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

/// The CPU model decoding 40 tokens of the short-window geometry: at every layer and position the compressed
/// entries emitted so far follow `compressed_after`, and the trace's candidate set maps through `candidates`
/// onto distinct pool entries, window ones in the sequence's ring block (the ring slot of the position) and
/// compressed ones in its compressed block.
#[test]
fn candidates_follow_the_cpu_model() {
    let cfg = short_window_config();
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

/// The batch's candidate rows: each active row is its sequence's list followed by -1, an idle slot is empty, and
/// a list longer than the stride is refused.
#[test]
fn candidate_rows_pack_each_sequence() {
    let cfg = short_window_config();
    let lay = layouts(&cfg, 3, 64)[3]; // HCA, m = 8
    let sel: Vec<Vec<usize>> = vec![vec![], vec![0, 1], vec![0]];
    let positions = [5, 40, -1];
    let stride = cfg.window_size + 4;
    let (rows, lengths) = lay.candidate_rows(&positions, &sel, stride).unwrap();
    assert_eq!(lengths, vec![6, 24 + 2, 0]);
    for b in 0..3 {
        let row = &rows[b * stride..][..stride];
        let n = lengths[b] as usize;
        if positions[b] >= 0 {
            assert_eq!(
                &row[..n],
                lay.candidates(b, positions[b] as usize, &sel[b]).as_slice()
            );
        }
        assert!(row[n..].iter().all(|&e| e == -1));
    }
    assert!(lay.candidate_rows(&positions, &sel, 17).is_err());
    assert!(lay
        .candidate_rows(&positions[..2], &sel[..2], stride)
        .is_err());
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
                + MhcWorkspace::workspace_bytes(batch, cfg.dim)
                + dense::workspace_layout(&[step::lm_head_shape(&cfg, &shape)], H100_SMS)
                    .unwrap()
                    .bytes()
                + 4
                + 4 * batch * cfg.vocab_size;
            let bytes = step::workspace_bytes(&cfg, &shape, H100_SMS).unwrap();
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
    let (batch, context) = (3, 256);
    let (seed, w, m, state) = small_rig(&gpu, "engine_step_embed", batch, context);
    let cfg = ModelConfig::small();
    let s = &gpu.stream;
    assert!(state.set_positions(s, &[0, context as i32, 1]).is_err());
    state.set_positions(s, &[0, 5, -1]).unwrap();
    let ids = tokens(seed, batch, cfg.vocab_size);
    state.set_tokens(s, &ids).unwrap();
    state
        .load_residual(
            s,
            Residual::Layer,
            &vec![f32::NAN; batch * STREAMS * cfg.dim],
        )
        .unwrap();
    state.embed(&gpu, s, &w).unwrap();
    let x = state.read_residual(s, Residual::Layer).unwrap();
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

/// Residuals `[B, 4, D]` the CPU model produced: sequence b's `residual_out` of the last layer after `b + 2`
/// decode steps of its own tokens (real mHC streams, not random values).
fn cpu_residuals(m: &Model, seed: u64, batch: usize) -> Vec<f32> {
    let vocab = m.config().vocab_size;
    (0..batch)
        .flat_map(|b| {
            let mut st = m.new_state();
            let toks = tokens(seed ^ (b as u64 + 1), b + 2, vocab);
            let out = toks
                .iter()
                .map(|&t| m.decode_step(&mut st, t).unwrap())
                .last()
                .unwrap();
            out.layers.last().unwrap().residual_out.clone()
        })
        .collect()
}

/// Cosine of each sequence's GPU logits against `Model::head` of the same residual (BF16 values, as the state
/// stores them). 0.999: the final norm sums in f32 trees where the CPU uses f64, so `u` may differ by 1 BF16 ulp
/// in a few channels; the LM head sums 512 products in f32.
fn assert_head_matches(m: &Model, x: &[f32], logits: &[f32], batch: usize, what: &str) {
    let cfg = m.config();
    let row = STREAMS * cfg.dim;
    for b in 0..batch {
        let xb: Vec<f32> = x[b * row..][..row]
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let want = m.head(&xb).unwrap();
        let got = &logits[b * cfg.vocab_size..][..cfg.vocab_size];
        let c = cosine(got, &want);
        assert!(c >= 0.999, "{what}: sequence {b}: logits cosine {c}");
    }
}

/// The head (hc_head + final norm, LM head) on residuals from the CPU model's trace.
#[test]
#[ignore = "needs an H100/H200"]
fn head_matches_the_cpu_model() {
    let gpu = gpu("engine_step_head");
    let batch = 3;
    let (seed, w, m, mut state) = small_rig(&gpu, "engine_step_head", batch, 256);
    let x = cpu_residuals(&m, seed, batch);
    let s = gpu.stream.clone();
    state.load_residual(&s, Residual::Layer, &x).unwrap();
    state.head(&gpu, &s, &w).unwrap();
    let logits = state.read_logits(&s).unwrap();
    assert_head_matches(&m, &x, &logits, batch, "head");
}

/// The composable part of a step (embedding, then the head) captured once in a CUDA graph and replayed with new
/// token ids written between replays: each replay's logits are those of `Model::head(Model::embed(token))`.
#[test]
#[ignore = "needs an H100/H200"]
fn embed_and_head_replay_in_a_graph() {
    let gpu = gpu("engine_step_graph");
    let batch = 2;
    let (seed, w, m, mut state) = small_rig(&gpu, "engine_step_graph", batch, 256);
    let stream = gpu.new_stream().unwrap();
    let vocab = m.config().vocab_size;
    state.set_tokens(&stream, &[0, 1]).unwrap();
    // One eager run first: kernels are resolved (modules loaded, attributes set) outside the capture.
    state.embed(&gpu, &stream, &w).unwrap();
    state.head(&gpu, &stream, &w).unwrap();
    let graph = capture_on(&stream, || {
        state.embed(&gpu, &stream, &w)?;
        state.head(&gpu, &stream, &w)
    })
    .unwrap();
    for rep in 0..4u64 {
        let ids = tokens(seed ^ (rep + 7), batch, vocab);
        state.set_tokens(&stream, &ids).unwrap();
        graph.launch().unwrap();
        stream.synchronize().unwrap();
        let logits = state.read_logits(&stream).unwrap();
        let x: Vec<f32> = ids.iter().flat_map(|&t| m.embed(t).unwrap()).collect();
        assert_head_matches(&m, &x, &logits, batch, &format!("replay {rep}"));
        assert_eq!(state.read_error(&stream).unwrap(), 0);
    }
}

/// Linked halves (each half leaves its hc_post to the next half's hc_pre: `prompt_step` / `decode_step`) against
/// unlinked ones (`*_step_with` the plain FFN half: every half writes its own output) on two states of the same
/// weights and prompts, prompt steps then greedy decode steps: every step's logits and sampled ids, and the final
/// residual, equal bit for bit. Why exact: the linked boundary is `mhc_post` + the staged mix bit for bit
/// (tests/mhc.rs `gpu_linked_boundary_equals_post_then_boundary_bitwise`) and nothing else changes. Batch 3 (the
/// PDL pair's path) and 12 (two plain launches: above `MHC_PDL_MAX_TOKENS`).
#[test]
#[ignore = "needs an H100/H200"]
fn linked_halves_equal_unlinked_halves_bitwise() {
    use megamoe::engine::step::DecodeState;
    use megamoe::model::sampler::SamplerConfig;
    use megamoe::ops::sampler::SamplerParams;
    let gpu = gpu("engine_step_linked");
    for batch in [3usize, 12] {
        let (context, prompt_len, steps) = (64, 5, 6);
        let (seed, w, m, _) = small_rig(&gpu, "engine_step_linked", batch, context);
        let vocab = m.config().vocab_size;
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|b| tokens(seed ^ (0x3A + b as u64), prompt_len, vocab))
            .collect();
        let run = |linked: bool| {
            let s = gpu.stream.clone();
            let mut st = DecodeState::new(&gpu, &w, StepShape { batch, context }).unwrap();
            let params = SamplerParams::from_config(&SamplerConfig::greedy(), steps + 1).unwrap();
            for (slot, p) in prompts.iter().enumerate() {
                st.ws.sampler.admit(&s, slot, &params, p).unwrap();
            }
            st.set_positions(&s, &vec![0; batch]).unwrap();
            let mut plain_ffn =
                |st: &mut DecodeState, layer: usize| st.ffn_half(&gpu, &s, &w, layer);
            for i in 0..prompt_len {
                let ids: Vec<u32> = prompts.iter().map(|p| p[i]).collect();
                st.set_tokens(&s, &ids).unwrap();
                if i + 1 < prompt_len {
                    if linked {
                        st.prompt_step(&gpu, &s, &w).unwrap();
                    } else {
                        st.prompt_step_with(&gpu, &s, &w, &mut plain_ffn).unwrap();
                    }
                }
            }
            let mut out = Vec::new();
            for _ in 0..steps {
                if linked {
                    st.decode_step(&gpu, &s, &w).unwrap();
                } else {
                    st.decode_step_with(&gpu, &s, &w, &mut plain_ffn).unwrap();
                }
                let logits = st.read_logits(&s).unwrap();
                let sampled = megamoe::gpu::arena::download(&s, &st.ws.sampler.sampled).unwrap();
                out.push((logits, sampled));
            }
            assert_eq!(st.read_error(&s).unwrap(), 0, "step error bits");
            (out, st.read_residual(&s, Residual::Layer).unwrap())
        };
        let (want, want_x) = run(false);
        let (got, got_x) = run(true);
        for (step, ((gl, gt), (wl, wt))) in got.iter().zip(&want).enumerate() {
            assert!(
                gl.iter().all(|v| v.is_finite()),
                "batch {batch} step {step}: non-finite logits"
            );
            let differ = common::differing_bits(gl, wl);
            assert_eq!(
                (differ, gt),
                (0, wt),
                "batch {batch} step {step}: linked logits differ in {differ} of {} (cosine {:.9}); tokens",
                gl.len(),
                cosine(gl, wl)
            );
        }
        let differ = common::differing_bits(&got_x, &want_x);
        assert_eq!(
            differ, 0,
            "batch {batch}: the final residual differs in {differ} values"
        );
        println!("batch {batch}: {steps} linked decode steps bit-identical to unlinked ones");
    }
}

/// The step's arena (every workspace the step and both halves carve) fits the memory plan's workspace budget, so
/// a decode state built after the experts filled the rest of the device does not run out: Flash and Pro at the
/// batch and context corners of the sweeps.
#[test]
fn step_arena_fits_the_plan_budget() {
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        for (batch, context) in [(1, 4096), (1, 1 << 20), (64, 4096)] {
            let req = megamoe::engine::plan::PlanRequest::new(batch, context, 16, 1 << 50);
            let plan = megamoe::engine::MemoryPlan::new(&cfg, &req).unwrap();
            let arena =
                step::workspace_bytes(&cfg, &StepShape { batch, context }, H100_SMS).unwrap();
            println!(
                "{} batch {batch} context {context}: arena {:.3} GB, budget {:.3} GB",
                cfg.name,
                arena as f64 / 1e9,
                plan.workspace_bytes as f64 / 1e9
            );
            assert!(
                arena <= plan.workspace_bytes,
                "{} batch {batch} context {context}: the step's arena ({arena} B) exceeds the plan's workspace \
                 budget ({} B)",
                cfg.name,
                plan.workspace_bytes
            );
        }
    }
}
