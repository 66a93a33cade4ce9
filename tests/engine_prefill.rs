//! Chunked prefill (`engine::prefill`, docs/engine.md "Chunked prefill"): the host arithmetic it adds (row tables,
//! the window ring of window + 1023, chunk padding, the memory it takes) on the CPU; on the GPU the indexer's
//! key-sequence map, a chunk's candidate rows over a wrapping ring, the long chunks' FFN glue (the contiguous
//! grouping, the shared expert's SwiGLU rows), then whole chunked prefills against the CPU model and against the
//! GPU's own reference prefill (caches, logits, and the decode steps after it): chunks of 32 against token by token,
//! chunks of 256 (the long-chunk paths) against chunks of 64.
//!
//! Why the GPU comparisons are not bit-exact: at C <= 64 a chunk runs the same kernels as a decode step, at M = C
//! rows instead of one row per sequence. The kernels' per-row arithmetic does not read other rows, but their split
//! plans come from the launch's capacities: the dense linears' split-K (`ops::dense`, from M, N, K and the SM
//! count), the routed experts' K splits and the sparse attention's split over candidates (`SplitPlan::fp8`, from the
//! batch), so the f32 partial sums of a row can be added in another order at M = 32 than at M = 1 or 2. Above 64 rows
//! the dense linears sum on cuBLASLt's tensor cores and the routed experts in moe_gemm's prefill mainloop: other
//! orders again. A 1-ulp difference can then flip a BF16 / FP8 rounding, and, rarely, a near-tied router or indexer
//! choice, which grows through the later layers and positions. So the caches are compared by cosine (the issue's
//! 0.999 per-intermediate floor) with the exactly-equal entries counted and printed, and the logits against the CPU
//! model with the decode path's end-to-end floor (tests/engine_decode.rs: 0.98), printed beside the reference
//! prefill's. (The compressors are exact: `compressor::chunk` is n decode steps bit for bit, tests/compressor.rs.)

mod common;

use common::engine::{rig_weights, short_window_config, tokens};
use common::gpu;
use common::indexer::{random_queries, ref_score, seeded, wait, written_cache, LOGITS_TOL};
use megamoe::engine::cache::{LayerCacheLayout, LayerCaches};
use megamoe::engine::io::StepShape;
use megamoe::engine::plan::{LayerCachePlan, MemoryPlan, PlanRequest, PREFILL_CHUNK_MAX};
use megamoe::engine::prefill::{check_chunk, chunk_rows, chunks, PrefillState};
use megamoe::engine::run::Engine;
use megamoe::engine::step;
use megamoe::formats::kv;
use megamoe::gpu::{arena, DevBuf};
use megamoe::model::numerics::cosine;
use megamoe::model::sampler::SamplerConfig;
use megamoe::model::{CachePolicy, LayerKind, Model, ModelConfig, MoeSum, Weights};
use megamoe::ops::indexer::reference::{self, KeyFormat, HEAD_DIM};
use megamoe::ops::indexer::{self, KeyCacheGpu, QueryBatch};
use megamoe::ops::sampler::SamplerParams;

const H100_SMS: usize = 132;

// ---- CPU: the host arithmetic -----------------------------------------------------------------------------------

#[test]
fn chunks_cover_the_prompt_in_order() {
    assert_eq!(chunks(99, 32), vec![(0, 32), (32, 32), (64, 32), (96, 3)]);
    assert_eq!(chunks(64, 64), vec![(0, 64)]);
    assert_eq!(chunks(3, 1), vec![(0, 1), (1, 1), (2, 1)]);
    assert!(chunks(0, 8).is_empty());
    for (len, c) in [(1, 1), (5, 2), (100, 7), (4095, 64)] {
        let mut next = 0;
        for (start, n) in chunks(len, c) {
            assert_eq!(start, next);
            assert!((1..=c).contains(&n));
            next += n;
        }
        assert_eq!(next, len);
    }
}

#[test]
fn chunk_rows_pad_with_the_last_real_row() {
    let (ids, pos) = chunk_rows(&[7, 8, 9], 96, 5).unwrap();
    assert_eq!(ids, vec![7, 8, 9, 9, 9]);
    assert_eq!(pos, vec![96, 97, 98, 98, 98]);
    assert_eq!(chunk_rows(&[1, 2], 0, 2).unwrap(), (vec![1, 2], vec![0, 1]));
    assert!(chunk_rows(&[], 0, 4).is_err());
    assert!(chunk_rows(&[1, 2, 3], 0, 2).is_err());
}

#[test]
fn chunk_sizes_are_checked() {
    assert!(check_chunk(0).is_err());
    assert!(check_chunk(1).is_ok());
    assert!(check_chunk(PREFILL_CHUNK_MAX).is_ok());
    assert_eq!(PREFILL_CHUNK_MAX, 1024);
    assert!(check_chunk(256).is_ok());
    let e = check_chunk(PREFILL_CHUNK_MAX + 1).unwrap_err().to_string();
    assert!(e.contains("1..=1024"), "{e}");
}

/// The ring holds `min(context, window + 1023)` entries and the window stays `min(window_size, context)`; for every
/// chunk start and length up to the longest chunk (1024), the chunk's own entries (written before its attention)
/// never land in a slot that one of its queries reads for another position. Checked by simulation of the slots,
/// on contexts where the ring wraps (the short window's 1047-entry ring in a context of 2,500; Flash's 1151 in 4K).
/// Also: a ring one entry shorter fails the check for the longest chunk (the bound is tight).
#[test]
fn the_ring_holds_a_chunk_beside_the_window() {
    use std::collections::HashMap;
    // The first conflict of chunk (p0, c) in a ring of `ring` slots after `base`, window `window`: (query, read
    // position, overwriting position).
    let conflict = |ring: usize, window: usize, context: usize, p0: usize, c: usize| {
        let last = (p0 + c - 1).min(context - 1);
        let written: HashMap<usize, usize> = (p0..=last).map(|p| (p % ring, p)).collect();
        for q in p0..=last {
            let first = (q + 1).saturating_sub(window);
            for p in first..=q {
                if let Some(&wp) = written.get(&(p % ring)) {
                    if wp != p {
                        return Some((q, p, wp));
                    }
                }
            }
        }
        None
    };
    for (cfg, context) in [
        (short_window_config(), 128),
        (short_window_config(), 40),
        (short_window_config(), 2500),
        (ModelConfig::small(), 4096),
        (ModelConfig::flash(), 4096),
        (ModelConfig::flash(), 100),
    ] {
        let plan = LayerCachePlan::of(&cfg, 0, context);
        assert_eq!(plan.window, cfg.window_size.min(context));
        assert_eq!(
            plan.window_entries,
            (cfg.window_size + PREFILL_CHUNK_MAX - 1).min(context)
        );
        let lay = LayerCacheLayout { plan, batch: 2 };
        let ring = plan.window_entries;
        for c in [1, 2, 31, 32, 64, 65, 300, 512, PREFILL_CHUNK_MAX] {
            let step = if c > 64 { 61 } else { 7 };
            for p0 in (0..context.saturating_sub(c)).step_by(step) {
                let last = (p0 + c - 1).min(context - 1);
                // The layout's slots and candidate lists are the ring arithmetic simulated above.
                for q in [p0, (p0 + last) / 2, last] {
                    let cand = lay.window_candidates(1, q);
                    assert_eq!(cand.len(), (q + 1).min(plan.window));
                    let first = (q + 1).saturating_sub(plan.window);
                    for (i, &slot) in cand.iter().enumerate() {
                        assert_eq!(slot as usize, lay.window_base(1) + (first + i) % ring);
                    }
                    assert_eq!(lay.window_slot(1, q), lay.window_base(1) + q % ring);
                }
                if let Some((q, p, wp)) = conflict(ring, plan.window, context, p0, c) {
                    panic!(
                        "{} context {context}: chunk {p0}+{c}: query {q} reads position {p}, which the chunk's \
                         position {wp} overwrote",
                        cfg.name
                    );
                }
            }
        }
        // Tight: one slot fewer and the longest chunk overwrites a position its first query reads.
        if ring < context {
            let p0 = context - PREFILL_CHUNK_MAX - 1;
            assert!(
                conflict(ring - 1, plan.window, context, p0, PREFILL_CHUNK_MAX).is_some(),
                "{} context {context}: a ring of {} would do",
                cfg.name,
                ring - 1
            );
        }
    }
}

/// A chunk's row tables point every row at its sequence; the decode batch's are the identity; a chunk's candidate
/// rows are, row by row, the decode batch's candidates of that sequence at that position.
#[test]
fn chunk_row_tables_and_candidates_are_the_sequences() {
    let cfg = short_window_config();
    let context = 128;
    for l in 0..cfg.n_layers {
        let plan = LayerCachePlan::of(&cfg, l, context);
        let lay = LayerCacheLayout { plan, batch: 3 };
        let id = lay.row_tables(&[0, 1, 2]).unwrap();
        for b in 0..3 {
            assert_eq!(id.window_base[b] as usize, lay.window_base(b));
            assert_eq!(id.compressed_base[b] as usize, lay.compressed_base(b));
            assert_eq!(id.compressed_capacity[b] as usize, plan.compressed_entries);
            assert_eq!(id.key_base[b] as usize, lay.key_slot(b, 0));
            assert_eq!(id.key_capacity[b] as usize, plan.index_keys);
            assert_eq!(id.key_seq[b] as usize, b);
        }
        let ch = lay.row_tables(&[2; 5]).unwrap();
        for r in 0..5 {
            assert_eq!(ch.window_base[r] as usize, lay.window_base(2));
            assert_eq!(ch.compressed_base[r] as usize, lay.compressed_base(2));
            assert_eq!(ch.key_base[r] as usize, lay.key_slot(2, 0));
            assert_eq!(ch.key_seq[r], 2);
        }
        assert!(lay.row_tables(&[3]).is_err());
        assert!(lay.row_tables(&[]).is_err());

        // A chunk of sequence 2 at positions 80..=111 plus two padding rows.
        let stride = megamoe::engine::attn::candidate_stride(&plan, cfg.index_topk);
        let positions: Vec<i32> = (80..112).chain([111, 111]).collect();
        let selected: Vec<Vec<usize>> = positions
            .iter()
            .map(|&p| {
                let n = lay.compressed_after(p as usize);
                match plan.kind {
                    LayerKind::SlidingWindow => vec![],
                    LayerKind::Hca { .. } => (0..n).collect(),
                    LayerKind::Csa { .. } => {
                        (0..n).rev().step_by(3).take(cfg.index_topk).rev().collect()
                    }
                }
            })
            .collect();
        let seqs = vec![2; positions.len()];
        let (rows, lens) = lay
            .row_candidate_rows(&seqs, &positions, &selected, stride)
            .unwrap();
        for (r, (&p, sel)) in positions.iter().zip(&selected).enumerate() {
            let want = lay.candidates(2, p as usize, sel);
            assert_eq!(lens[r] as usize, want.len(), "layer {l} row {r}");
            assert_eq!(
                &rows[r * stride..][..want.len()],
                &want[..],
                "layer {l} row {r}"
            );
            assert!(rows[r * stride + want.len()..(r + 1) * stride]
                .iter()
                .all(|&c| c == -1));
            assert_eq!(
                want.len(),
                (p as usize + 1).min(plan.window) + sel.len(),
                "layer {l} row {r}: the window, not the ring, bounds the candidates"
            );
        }
    }
}

/// The decode step's arena plus the chunked prefill's (its arena and its FFN's grouping buffers, which `FfnHalf::new`
/// allocates outside the arena: at 1024 rows the contiguous grouping's 6,144 rows) fit the memory plan's workspace
/// budget (Flash and Pro, a 4K prompt at batch 1 and a short one at batch 64). The masked grouping at 1024 rows
/// would hold `slots x 1024` rows: printed beside it, the reason for the contiguous one.
#[test]
fn prefill_arena_fits_the_plan_budget() {
    use megamoe::engine::ffn::GroupingSizes;
    for cfg in [ModelConfig::flash(), ModelConfig::pro()] {
        for (batch, context, prompt) in [(1, 8192, 4096), (64, 4096, 16), (1, 4096, 2)] {
            let req = PlanRequest::new(batch, context, prompt, 1 << 50);
            let plan = MemoryPlan::new(&cfg, &req).unwrap();
            let decode =
                step::workspace_bytes(&cfg, &StepShape { batch, context }, H100_SMS).unwrap();
            let rows = PREFILL_CHUNK_MAX.min(prompt - 1);
            let (pre, grouping) = if rows > 1 {
                let g = GroupingSizes::of(&cfg, rows, &plan.map, H100_SMS);
                assert_eq!(g.contiguous, rows > 64);
                (
                    PrefillState::layout(&cfg, rows, batch, context, H100_SMS)
                        .unwrap()
                        .bytes(),
                    g.bytes(&cfg),
                )
            } else {
                (0, 0)
            };
            println!(
                "{} batch {batch} context {context} prompt {prompt}: decode arena {:.3} GB + prefill arena \
                 {:.3} GB + prefill grouping {:.3} GB ({rows} rows), budget {:.3} GB",
                cfg.name,
                decode as f64 / 1e9,
                pre as f64 / 1e9,
                grouping as f64 / 1e9,
                plan.workspace_bytes as f64 / 1e9
            );
            assert!(decode + pre + grouping <= plan.workspace_bytes);
        }
        // The masked grouping at the longest chunk, for comparison (not built: above 64 rows the contiguous one).
        let map = MemoryPlan::new(&cfg, &PlanRequest::new(1, 8192, 4096, 1 << 50))
            .unwrap()
            .map;
        let contiguous = GroupingSizes::of(&cfg, PREFILL_CHUNK_MAX, &map, H100_SMS);
        let masked = GroupingSizes {
            contiguous: false,
            rows: map.slots * contiguous.capacity,
            ..contiguous
        };
        println!(
            "{}: {PREFILL_CHUNK_MAX} rows on {} slots: contiguous grouping {:.3} GB ({} rows), masked {:.3} GB ({} \
             rows, one split)",
            cfg.name,
            map.slots,
            contiguous.bytes(&cfg) as f64 / 1e9,
            contiguous.rows,
            masked.bytes(&cfg) as f64 / 1e9,
            masked.rows
        );
        assert!(masked.bytes(&cfg) > 20 * contiguous.bytes(&cfg));
    }
}

/// The memory plan counts the longer rings: each layer's window ring is `window + 1023` entries of 584 bytes
/// (Flash: 1151 a layer, 28.9 MB a sequence over 43 layers), cut to the context.
#[test]
fn the_plan_counts_rings_of_window_plus_1023() {
    let cfg = ModelConfig::flash();
    let plan = MemoryPlan::new(&cfg, &PlanRequest::new(1, 8192, 4096, 1 << 50)).unwrap();
    let ring: usize = plan
        .cache_layers
        .iter()
        .map(|l| l.window_entries * kv::ENTRY_BYTES)
        .sum();
    assert_eq!(ring, 43 * (128 + PREFILL_CHUNK_MAX - 1) * 584);
    println!(
        "Flash: window rings {:.2} MB of the {:.2} MB a sequence holds at context 8192",
        ring as f64 / 1e6,
        plan.cache_bytes_per_sequence() as f64 / 1e6
    );
    let without: usize = plan
        .cache_layers
        .iter()
        .map(|l| l.bytes(plan.request.index_keys) - l.window_entries * kv::ENTRY_BYTES)
        .sum();
    assert_eq!(plan.cache_bytes_per_sequence(), ring + without);
    // A context shorter than the ring holds the context.
    assert_eq!(LayerCachePlan::of(&cfg, 0, 300).window_entries, 300);
}

// ---- GPU: the indexer's key-sequence map ------------------------------------------------------------------------

/// `indexer::logits_mapped` with every query row mapped to one sequence of a 3-sequence cache, each row with its
/// own visible count (0, inside the first tile, tile edges, across tiles): each row's scores equal (bit for bit)
/// the identity launch's scores of the same query placed in that sequence's row, match the f64 reference within
/// the FP8 logits tolerance ([`LOGITS_TOL`]), and nothing past a row's count is written. FP8 (the TMA path) and
/// MXFP4 keys. The cache's slots past each sequence's keys hold NaN, so a row that read past its count or another
/// sequence's keys would show.
#[test]
#[ignore = "needs an H100/H200"]
fn indexer_key_map_scores_one_sequences_keys_per_row() {
    let gpu = gpu("engine_prefill_key_map");
    let (_seed, mut rng) = seeded("engine_prefill_key_map");
    let s = &gpu.stream;
    let (cap, seq) = (300, 1usize);
    let lens = [cap, 257, 40];
    let nv: Vec<i32> = vec![0, 1, 63, 64, 65, 128, 200, 257];
    let rows = nv.len();
    for format in [KeyFormat::Fp8, KeyFormat::Mxfp4] {
        let label = format!("key map {}", format.name());
        let mut host = written_cache(&mut rng, format, &lens, cap);
        common::indexer::poison_cache_tails(&mut host, &lens);
        let cache = KeyCacheGpu::upload(&gpu, &host).unwrap();
        let (q, w) = random_queries(&mut rng, rows);
        let qb = QueryBatch::upload(&gpu, rows, 1, &q, &w, &nv).unwrap();
        let key_seq = gpu.upload(&vec![seq as i32; rows]).unwrap();
        let stride = cap.next_multiple_of(4) + 4;
        let out = gpu.poisoned::<f32>(rows * stride, common::POISON).unwrap();
        indexer::logits_mapped(&gpu, s, &qb, &cache, Some(&key_seq), &out, stride).unwrap();
        wait(&gpu, &label);
        let got = gpu.download(&out).unwrap();
        let q_f64 = common::indexer::decode_q(&q);
        let mut worst = 0f64;
        for (r, &n) in nv.iter().enumerate() {
            let n = n as usize;
            // One by one: the same query as sequence `seq`'s row of an identity launch (the other rows see none).
            let mut q1 = vec![0u8; host.batch * 64 * HEAD_DIM];
            let mut w1 = vec![0f32; host.batch * 64];
            q1[seq * 64 * HEAD_DIM..][..64 * HEAD_DIM]
                .copy_from_slice(&q[r * 64 * HEAD_DIM..][..64 * HEAD_DIM]);
            w1[seq * 64..][..64].copy_from_slice(&w[r * 64..][..64]);
            let mut nv1 = vec![0i32; host.batch];
            nv1[seq] = n as i32;
            let qb1 = QueryBatch::upload(&gpu, host.batch, 1, &q1, &w1, &nv1).unwrap();
            let (one, stride1) = common::indexer::logits_poisoned(&gpu, &label, &qb1, &cache);
            assert_eq!(stride1, stride);
            let row = &got[r * stride..][..stride];
            let want = &one[seq * stride..][..stride];
            for j in 0..stride {
                if j >= n {
                    assert_eq!(
                        row[j].to_bits(),
                        u32::MAX,
                        "{label} row {r} (nv {n}) j {j}: written"
                    );
                    continue;
                }
                assert_eq!(
                    row[j].to_bits(),
                    want[j].to_bits(),
                    "{label} row {r} j {j}: mapped {} vs one by one {}",
                    row[j],
                    want[j]
                );
                let (refv, mag) = ref_score(&q_f64, &w, &host, r, host.slot(seq, j));
                let err = (row[j] as f64 - refv).abs();
                assert!(
                    row[j].is_finite() && err <= LOGITS_TOL * mag + 1e-30,
                    "{label} row {r} j {j}: gpu {} ref {refv} err {err:e} (mag {mag:e})",
                    row[j]
                );
                if mag > 0.0 {
                    worst = worst.max(err / mag);
                }
            }
        }
        println!(
            "{label}: {rows} rows of sequence {seq} (visible {nv:?}) equal the one-by-one launches bit for bit; \
             max |gpu - ref| / mag = {worst:.3e} (tol {LOGITS_TOL:e})"
        );
    }
}

// ---- GPU: a chunk's candidate rows ------------------------------------------------------------------------------

/// Rows of the candidate test's chunks (above the decode kernels' 64) and its context (the ring wraps).
const CAND_ROWS: usize = 300;
const CAND_CONTEXT: usize = 2000;

/// `attn_candidates` with a chunk's row tables (every row sequence 1 of 2) against the host twin
/// `row_candidate_rows`, for every layer kind: chunks of [`CAND_ROWS`] rows at random starts in a context of
/// [`CAND_CONTEXT`] (the 1047-entry ring of the short-window geometry, window 24 + 1023; every other chunk starts
/// fewer than its length before the ring's end, so the ring wraps inside it), the last rows padded with copies, random top-k rows in score order (-1 padded): rows and lengths equal
/// exactly, each row's window the last 24 positions in their ring slots.
#[test]
#[ignore = "needs an H100/H200"]
fn chunk_candidate_rows_match_the_host_twin() {
    use megamoe::engine::attn::{build_candidates, candidate_stride, Compressed};
    use megamoe::engine::cache::RowTables;
    use rand::seq::SliceRandom;
    use rand::Rng;
    let label = "engine_prefill_candidates";
    let gpu = gpu(label);
    let cfg = short_window_config();
    let (_, _w, _m, state) = common::engine::rig(&gpu, label, cfg.clone(), 2, CAND_CONTEXT);
    let mut rng = common::seeded(label, "MEGAMOE_SEED");
    let s = gpu.stream.clone();
    let rows = CAND_ROWS;
    let seqs = vec![1usize; rows];
    for (l, lc) in state.caches.layers.iter().enumerate() {
        let lay = lc.layout;
        let stride = candidate_stride(&lay.plan, cfg.index_topk);
        let k = cfg.index_topk.min(lay.plan.index_keys.max(1));
        let tables = RowTables::upload(&gpu, &lay, &seqs).unwrap();
        for trial in 0..16 {
            let real = rng.random_range(1..=rows);
            let ring = lay.plan.window_entries;
            let p0 = if trial % 2 == 0 && real > 1 && ring + 1 < CAND_CONTEXT - real {
                ring - rng.random_range(1..real)
            } else {
                rng.random_range(0..CAND_CONTEXT - real)
            };
            let positions: Vec<i32> = (0..rows).map(|i| (p0 + i.min(real - 1)) as i32).collect();
            let mut top = vec![-1i32; rows * k];
            let mut selected: Vec<Vec<usize>> = vec![vec![]; rows];
            for (r, &p) in positions.iter().enumerate() {
                let visible = lay.compressed_after(p as usize);
                let mut sel: Vec<usize> = (0..visible).collect();
                match lay.plan.kind {
                    LayerKind::SlidingWindow => sel.clear(),
                    LayerKind::Hca { .. } => {}
                    LayerKind::Csa { .. } => {
                        sel.shuffle(&mut rng);
                        sel.truncate(k);
                        for (i, &j) in sel.iter().enumerate() {
                            top[r * k + i] = j as i32;
                        }
                        sel.sort_unstable();
                    }
                }
                selected[r] = sel;
            }
            let (want, want_len) = lay
                .row_candidate_rows(&seqs, &positions, &selected, stride)
                .unwrap();
            let dpos = gpu.upload(&positions).unwrap();
            let top_buf = gpu.upload(&top).unwrap();
            let dtop = DevBuf::of(&top_buf);
            let cand = gpu.poisoned::<i32>(rows * stride, common::POISON).unwrap();
            let lens = gpu.poisoned::<i32>(rows, common::POISON).unwrap();
            let compressed = match lay.plan.kind {
                LayerKind::SlidingWindow => Compressed::None,
                LayerKind::Csa { .. } => Compressed::TopK { idx: &dtop, k },
                LayerKind::Hca { .. } => Compressed::AllVisible,
            };
            build_candidates(
                &gpu, &s, &dpos, lc, &tables, compressed, &cand, &lens, stride,
            )
            .unwrap();
            s.synchronize().unwrap();
            let what = format!("layer {l} trial {trial} chunk {p0}+{real}");
            assert_eq!(gpu.download(&lens).unwrap(), want_len, "{what}: lengths");
            assert_eq!(gpu.download(&cand).unwrap(), want, "{what}: rows");
        }
        println!(
            "layer {l} ({:?}): 16 random chunks of sequence 1, candidate rows of stride {stride} equal to the host \
             twin (ring {}, window {})",
            lay.plan.kind, lay.plan.window_entries, lay.plan.window
        );
    }
}

// ---- GPU: a whole chunked prefill -------------------------------------------------------------------------------

/// Prompt of 105 tokens, C = 32: the first 104 go in chunks 32, 32, 32, 8 (the last padded with 24 copies of its
/// last row, position 103, where CSA (m = 4) and HCA (m = 8) both emit: a padding row that updated a compressor
/// would emit again or corrupt the state); the ring (window 24 + 1023, cut to the context of 128) does not wrap (the
/// candidate test and the ring simulation cover the wrap); the first decode step runs position 104.
const PROMPT: usize = 105;
const CHUNK: usize = 32;
const CONTEXT: usize = 128;
const BATCH: usize = 2;
/// Decode steps compared after the prefill (teacher-forced with the token-by-token engine's tokens).
const DECODE_STEPS: usize = 8;

fn argmax(v: &[f32]) -> usize {
    megamoe::engine::parity::argmax(v)
}

/// Host copies of one layer's caches (pool, compressor state, index keys and their state).
struct CacheCopy {
    pool: Vec<u8>,
    state: Vec<f32>,
    key_codes: Vec<u8>,
    key_scales: Vec<u8>,
    key_state: Vec<f32>,
}

fn copy_caches(gpu: &megamoe::gpu::Gpu, lc: &LayerCaches) -> CacheCopy {
    let (key_codes, key_scales, key_state) = match &lc.index {
        Some(ic) => (
            gpu.download(&ic.keys.codes).unwrap(),
            gpu.download(&ic.keys.scales).unwrap(),
            gpu.download(&ic.state).unwrap(),
        ),
        None => (vec![], vec![], vec![]),
    };
    CacheCopy {
        pool: gpu.download(&lc.pool).unwrap(),
        state: gpu.download(&lc.state).unwrap(),
        key_codes,
        key_scales,
        key_state,
    }
}

/// Decoded f32 values of `slots` of a pool and how many of them are byte-identical between two pools.
fn entries(a: &[u8], b: &[u8], slots: &[usize]) -> (Vec<f32>, Vec<f32>, usize) {
    let (mut va, mut vb, mut same) = (Vec::new(), Vec::new(), 0);
    for &s in slots {
        let (ea, eb) = (
            &a[s * kv::ENTRY_BYTES..][..kv::ENTRY_BYTES],
            &b[s * kv::ENTRY_BYTES..][..kv::ENTRY_BYTES],
        );
        same += usize::from(ea == eb);
        va.extend(kv::decode_entry(ea).unwrap());
        vb.extend(kv::decode_entry(eb).unwrap());
    }
    (va, vb, same)
}

/// Cosine over the entries finite in both, and whether the non-finite ones (the compressor scores' -inf of rows
/// not yet filled) sit at the same places with the same values.
/// cos(CPU', CPU) of one layer's caches after a prefill, over all sequences: the window entries of the last
/// `window_size` positions up to `last`, the compressed entries, the indexer keys (1 where a layer has none).
#[derive(Clone, Copy)]
struct CacheFloor {
    window: f64,
    compressed: f64,
    index_keys: f64,
}

/// The per-layer [`CacheFloor`]s of the CPU model's prefill states `cpu` and the floor model's `floor` (one per
/// sequence): how far a legitimate change of summation order (the MoE summed in BF16) moves each cache.
fn cpu_cache_floors(
    cfg: &ModelConfig,
    cpu: &[megamoe::model::DecodeState],
    floor: &[megamoe::model::DecodeState],
    last: usize,
) -> Vec<CacheFloor> {
    let w = cfg.window_size;
    (0..cfg.n_layers)
        .map(|l| {
            let cos_of = |pick: &dyn Fn(&megamoe::model::LayerCache) -> Vec<f32>| {
                let a: Vec<f32> = cpu.iter().flat_map(|s| pick(&s.layers[l])).collect();
                let b: Vec<f32> = floor.iter().flat_map(|s| pick(&s.layers[l])).collect();
                if a.is_empty() {
                    1.0
                } else {
                    cosine(&a, &b)
                }
            };
            CacheFloor {
                window: cos_of(&|c| {
                    (last + 1 - w..=last)
                        .flat_map(|p| c.window[p % w].clone())
                        .collect()
                }),
                compressed: cos_of(&|c| c.compressed.concat()),
                index_keys: cos_of(&|c| c.index_keys.concat()),
            }
        })
        .collect()
}

fn state_cosine(a: &[f32], b: &[f32]) -> (f64, bool) {
    let mut same_mask = true;
    let (mut fa, mut fb) = (Vec::new(), Vec::new());
    for (&x, &y) in a.iter().zip(b) {
        if x.is_finite() && y.is_finite() {
            fa.push(x);
            fb.push(y);
        } else if x.to_bits() != y.to_bits() {
            same_mask = false;
        }
    }
    (
        if fa.is_empty() { 1.0 } else { cosine(&fa, &fb) },
        same_mask,
    )
}

/// The largest difference over the cells finite in both.
fn finite_max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A chunked prefill (C = 32) of 2 sequences of 105 tokens against the CPU model and against the GPU's
/// token-by-token prefill (C = 1) on the same weights ([`compare_prefills`] for what is checked).
#[test]
#[ignore = "needs an H100/H200"]
fn chunked_prefill_matches_the_cpu_model_and_token_by_token() {
    compare_prefills(
        "engine_prefill_chunked",
        Prefills {
            prompt: PROMPT,
            chunk: CHUNK,
            reference_chunk: 1,
            context: CONTEXT,
            deep_cache_cos: 0.999,
        },
    );
}

/// Chunks above the decode kernels' 64 rows: 2 sequences of 300 tokens, the first 299 in chunks of 256 and 43 (the
/// last padded with 213 copies of its last row, position 298), against the CPU model and against the GPU's own
/// chunked prefill at C = 64 (chunks 64 x 4 + 43, the decode kernels' paths) on the same weights
/// ([`compare_prefills`]). At 256 rows the chunk takes the new paths: the FP8 / BF16 linears on cuBLASLt's tensor
/// cores, the shared expert's SwiGLU half and wo_a as GEMV pieces of 64 rows, the routed experts through the
/// contiguous grouping (`ffn_contiguous_grouping`) and moe_gemm's prefill (wgmma) mainloop with one K split. Those
/// change only the order of f32 sums against the C = 64 run (the tensor cores' block sums, the mainloop's K order;
/// the NVFP4 activations' pre-pass to BF16 is exact), so the tolerances are those of the C = 32 test (a 1-ulp
/// difference may flip a BF16 / FP8 rounding or a near-tied router / indexer choice; module docs) but one: the caches
/// of layers after the first are held to cosine >= 0.99, not 0.999. Layer 0's entries come from identical inputs and
/// hold 0.999 (measured 0.99999 on an H100). Every later layer's input went through a routed MoE whose L1 output h is
/// re-rounded to NVFP4: the 256-row chunk sums L1 in another order than the 64-row one, a 1-ulp f32 change flips an
/// e2m1 code (a step of 1/3 to 1/2 of the value) in a few elements of h, and the flips reach the next layer's
/// entries; the first H100 run measured layer 1's window entries at 0.9985 with equal end-to-end quality (logits
/// against the CPU 0.9865 / 0.9809 chunked, 0.9865 / 0.9803 for C = 64). A misplaced or missing entry instead gives
/// a per-entry cosine near 0, so every entry's own cosine must also reach 0.9. The drift grows with depth (a second
/// H100 run: layer 5's window entries at 0.9846, the logits at 0.983 chunked vs 0.985 for C = 64 against the CPU), as
/// it does between the CPU model and CPU' (the MoE summed in BF16), so a deeper layer's floor is the lower of 0.99
/// and 1 - [`DEEP_DRIFT_RATIO`] (1 - cos(CPU', CPU)) of the same layer and cache kind, measured in the run
/// (`cpu_cache_floors`). The logits hold the decode path's 0.98 or, below it, twice the reference prefill's distance.
#[test]
#[ignore = "needs an H100/H200"]
fn long_chunks_match_the_cpu_model_and_64_row_chunks() {
    compare_prefills(
        "engine_prefill_long_chunks",
        Prefills {
            prompt: 300,
            chunk: 256,
            reference_chunk: 64,
            context: 320,
            deep_cache_cos: 0.99,
        },
    );
}

/// How much farther a deeper layer's caches may drift between the two GPU prefills than between CPU' and the CPU
/// model (1 - cosine, same layer and cache kind). The two GPU paths differ in the order of every dense linear's sums
/// (cuBLASLt's tensor cores against the GEMV), the routed experts' L1 and L2 sum orders and thus the NVFP4
/// re-rounding of h, where CPU' differs in the MoE's sum only; two H100 runs of the long-chunk test measured the
/// ratio at 2.0-2.5 over layers 1-5 and every cache kind (index keys 2.3, the window entries 2.3). A misplaced or
/// stale entry is caught by the per-entry cosine of 0.9, not by this bound.
const DEEP_DRIFT_RATIO: f64 = 3.0;

/// What [`compare_prefills`] runs: prompts of `prompt` tokens, the tested engine in chunks of `chunk`, the
/// reference engine in chunks of `reference_chunk` (1: token by token), caches of `context` tokens.
struct Prefills {
    prompt: usize,
    chunk: usize,
    reference_chunk: usize,
    context: usize,
    /// The cache cosine floor of the layers after the first (layer 0: 0.999).
    deep_cache_cos: f64,
}

/// A chunked prefill (C = `p.chunk`) of 2 sequences against the CPU model and against a reference prefill of the
/// GPU (C = `p.reference_chunk`; 1 = token by token) on the same weights: (a) the first sampled step's logits
/// (position `prompt - 1`) against `Model::prefill`'s, cosine >= 0.98 (the decode path's end-to-end floor,
/// tests/engine_decode.rs; the reference prefill's cosine is printed beside it) and an argmax that is the CPU's, the
/// reference prefill's, or within 2% of the CPU's logit range of the CPU's best; (b) every cache after the prefill
/// against the reference engine's: window entries of the last 24 positions, compressed entries, index keys,
/// compressor states, cosine >= 0.999 per layer and kind (module docs: the split plans differ with M), nothing
/// written past the emitted entries, the same non-finite state cells; (c) 8 decode steps after it, both fed the
/// reference engine's tokens: logits cosine >= 0.995, or (where the prefills themselves end further apart, as the
/// long chunks do: 0.980-0.984 at the prompt's last position on an H100, 0.985 at the first step after it) no more
/// than twice as far apart as the prefills' own last logits; and in at least 7 of 8 steps per sequence the same
/// argmax, or a chunked choice within 2% of the reference's logit range of its best (as in (a)).
/// The tested engine's chunk state is poisoned (0xFF) before it runs. Above 64 rows it must take the contiguous
/// grouping and (with at least 6 rows per expert slot) moe_gemm's prefill mainloop, checked before the run.
fn compare_prefills(label: &str, p: Prefills) {
    let (prompt_len, chunk, context) = (p.prompt, p.chunk, p.context);
    let gpu = gpu(label);
    let cfg = short_window_config();
    let (seed, w, cpu) = rig_weights(&gpu, label, cfg.clone(), BATCH, context);
    let mut floor =
        Model::new(Weights::synthetic(cfg.clone(), seed, CachePolicy::All).unwrap()).unwrap();
    floor.moe_sum = MoeSum::Bf16Accumulator;
    let shape = StepShape {
        batch: BATCH,
        context,
    };
    let prompts: Vec<Vec<u32>> = (0..BATCH)
        .map(|b| tokens(seed ^ (0x1F + b as u64), prompt_len, cfg.vocab_size))
        .collect();
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), DECODE_STEPS + 2).unwrap();
    let s = gpu.stream.clone();

    let mut chunked = Engine::new(&gpu, &w, shape).unwrap();
    chunked.set_prefill_chunk(chunk).unwrap();
    assert_eq!(chunked.prepare_prefill(&gpu, prompt_len).unwrap(), chunk);
    chunked
        .prefill_state
        .as_mut()
        .unwrap()
        .poison(&gpu)
        .unwrap();
    {
        let ffn = &chunked.prefill_state.as_ref().unwrap().ffn;
        let prefill_mainloop = megamoe::ops::moe_gemm::prefill::routes_here(
            &w.experts[0].l1,
            &ffn.grouping,
            &ffn.l1_config,
        );
        println!(
            "C = {chunk}: contiguous grouping {}, moe_gemm prefill mainloop {prefill_mainloop} ({} rows on {} slots)",
            ffn.contiguous.is_some(),
            ffn.grouping.rows_total,
            ffn.grouping.experts
        );
        assert_eq!(ffn.contiguous.is_some(), chunk > 64);
        assert_eq!(
            prefill_mainloop,
            chunk > 64 && chunk >= ffn.grouping.experts,
            "C = {chunk}: the routed experts' mainloop"
        );
    }
    let mut single = Engine::new(&gpu, &w, shape).unwrap();
    single.set_prefill_chunk(p.reference_chunk).unwrap();
    for e in [&chunked, &single] {
        arena::fill(&s, &e.state.ws.logits, 0xFF).unwrap();
    }
    let t_chunked = chunked.prefill(&gpu, &prompts, &params, &[]).unwrap();
    let t_single = single.prefill(&gpu, &prompts, &params, &[]).unwrap();
    println!(
        "prefill of {prompt_len} tokens x {BATCH} sequences: chunked (C = {chunk}) {:.3} s, reference (C = {}) {:.3} s \
         (cold, eager chunks; small model)",
        t_chunked.ttft_s, p.reference_chunk, t_single.ttft_s
    );
    for e in [&chunked, &single] {
        assert_eq!(
            e.state.read_error(&s).unwrap(),
            0,
            "decode state error bits"
        );
    }
    assert_eq!(
        chunked
            .prefill_state
            .as_ref()
            .unwrap()
            .read_error(&s)
            .unwrap(),
        0
    );

    // (a) logits at position prompt - 1 against the CPU model.
    let vocab = cfg.vocab_size;
    let g_chunk = chunked.state.read_logits(&s).unwrap();
    let g_single = single.state.read_logits(&s).unwrap();
    let (mut cpu_states, mut floor_states) = (Vec::new(), Vec::new());
    let mut prefill_cos = [0f64; BATCH];
    for b in 0..BATCH {
        let (mut cs, mut fs) = (cpu.new_state(), floor.new_state());
        let c = cpu.prefill(&mut cs, &prompts[b], false).unwrap().logits;
        let f = floor.prefill(&mut fs, &prompts[b], false).unwrap().logits;
        cpu_states.push(cs);
        floor_states.push(fs);
        let gc = &g_chunk[b * vocab..][..vocab];
        let gs = &g_single[b * vocab..][..vocab];
        assert!(
            gc.iter().all(|v| v.is_finite()),
            "seq {b}: non-finite logits"
        );
        let (cos_c, cos_s, cos_f) = (cosine(gc, &c), cosine(gs, &c), cosine(&f, &c));
        prefill_cos[b] = cosine(gc, gs);
        let top = argmax(&c);
        let (lo, hi) = c
            .iter()
            .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
        // The CPU's logit of the chunked prefill's choice, below the CPU's best, as a fraction of its logit range.
        let (gc_top, gs_top) = (argmax(gc), argmax(gs));
        let shortfall = (c[top] - c[gc_top]) / (hi - lo);
        println!(
            "seq {b}: cos(chunked, CPU) {cos_c:.6}  cos(reference, CPU) {cos_s:.6}  cos(CPU', CPU) {cos_f:.6}  \
             cos(chunked, reference) {:.6}  argmax chunked {gc_top} reference {gs_top} CPU {top} (the \
             chunked choice's CPU logit is {shortfall:.4} of the CPU's range below its best)",
            cosine(gc, gs),
        );
        // The decode path's end-to-end floor, or (a prompt whose reference prefill is itself near it) within twice
        // the reference prefill's distance from the CPU: both are faithful implementations, one no worse than the
        // other beyond their spread (an H100 run: chunked 0.976, reference 0.984, CPU' 0.989 on one sequence).
        let bound = 0.98f64.min(1.0 - 2.0 * (1.0 - cos_s));
        assert!(
            cos_c >= bound,
            "seq {b}: logits cosine {cos_c:.6} below {bound:.6}"
        );
        // Top-1: the decode path itself picks the CPU's argmax in 41 of 48 free-running steps on the small geometry
        // (results/h100/parity.csv), so exact agreement is not the bar; the chunked choice must be the CPU's or the
        // reference prefill's, or a near-best token under the CPU.
        assert!(
            gc_top == top || gc_top == gs_top || shortfall <= 0.02,
            "seq {b}: chunked argmax {gc_top} (CPU {top}, reference {gs_top}, shortfall {shortfall:.4})"
        );
    }

    // (b) the caches against the reference engine's.
    let last = prompt_len - 1;
    let cpu_floors = cpu_cache_floors(&cfg, &cpu_states, &floor_states, last);
    println!(
        "layer kind        what              cosine     max|d|     same entries  (floor: cos(CPU', CPU) of the kind)"
    );
    // Every layer is printed before any failure is reported.
    let failures = std::cell::RefCell::new(Vec::<String>::new());
    for (l, cf) in cpu_floors.iter().enumerate() {
        let (a, b) = (
            &chunked.state.caches.layers[l],
            &single.state.caches.layers[l],
        );
        let lay = a.layout;
        let (ca, cb) = (copy_caches(&gpu, a), copy_caches(&gpu, b));
        let kind = lay.plan.kind;
        // A layer past the first may drift from the reference engine three times as far as CPU' from CPU (module
        // docs).
        let floor_of = |cpu_cos: f64| {
            if l == 0 {
                0.999
            } else {
                p.deep_cache_cos
                    .min(1.0 - DEEP_DRIFT_RATIO * (1.0 - cpu_cos))
            }
        };
        // Cosine over all the entries (>= floor) and each entry's own (>= 0.9: a misplaced entry gives ~0).
        let check = |what: &str,
                     va: &[f32],
                     vb: &[f32],
                     same: String,
                     entries: usize,
                     cpu_cos: f64| {
            let floor = floor_of(cpu_cos);
            let cos = cosine(va, vb);
            let per = va.len() / entries.max(1);
            let min_entry = va
                .chunks(per.max(1))
                .zip(vb.chunks(per.max(1)))
                .map(|(x, y)| cosine(x, y))
                .fold(1.0f64, f64::min);
            println!(
                "{l:>5} {:<11} {what:<17} {cos:.6}  {:.3e}  {same}  (worst entry {min_entry:.4}; floor {floor:.6}, \
                 CPU {cpu_cos:.6})",
                format!("{kind:?}"),
                max_abs(va, vb)
            );
            if !(va.iter().chain(vb).all(|v| v.is_finite()) && cos >= floor && min_entry >= 0.9) {
                failures.borrow_mut().push(format!(
                    "layer {l} {what}: cosine {cos:.6} (floor {floor}), worst entry {min_entry:.4} (floor 0.9)"
                ));
            }
        };
        let win: Vec<usize> = (0..BATCH)
            .flat_map(|b| (last + 1 - lay.plan.window..=last).map(move |p| lay.window_slot(b, p)))
            .collect();
        let (va, vb, same) = entries(&ca.pool, &cb.pool, &win);
        check(
            "window entries",
            &va,
            &vb,
            format!("{same}/{}", win.len()),
            win.len(),
            cf.window,
        );
        if lay.ratio() > 0 {
            let n = lay.compressed_after(last);
            let comp: Vec<usize> = (0..BATCH)
                .flat_map(|b| (0..n).map(move |j| lay.compressed_slot(b, j)))
                .collect();
            let (va, vb, same) = entries(&ca.pool, &cb.pool, &comp);
            check(
                "compressed",
                &va,
                &vb,
                format!("{same}/{}", comp.len()),
                comp.len(),
                cf.compressed,
            );
            for b in 0..BATCH {
                for j in n..lay.plan.compressed_entries {
                    let s = lay.compressed_slot(b, j) * kv::ENTRY_BYTES;
                    assert!(
                        ca.pool[s..s + kv::ENTRY_BYTES].iter().all(|&x| x == 0),
                        "layer {l} seq {b}: compressed entry {j} written past the {n} emitted"
                    );
                }
            }
            let (cos, mask) = state_cosine(&ca.state, &cb.state);
            // The state's floor is that of the entries it emits.
            let floor = floor_of(cf.compressed);
            println!(
                "{l:>5} {:<11} compressor state  {cos:.6}  {:.3e}  -inf cells equal: {mask}",
                format!("{kind:?}"),
                finite_max_abs(&ca.state, &cb.state)
            );
            if !(cos >= floor && mask) {
                failures.borrow_mut().push(format!(
                    "layer {l}: compressor state cosine {cos:.6} (floor {floor}), -inf cells equal {mask}"
                ));
            }
        }
        if let Some(ic) = &a.index {
            assert_eq!(ic.keys.format, KeyFormat::Fp8);
            let n = lay.compressed_after(last);
            let key = |codes: &[u8], scales: &[u8], slot: usize| -> Vec<f32> {
                let sc = f32::from_le_bytes(scales[slot * 4..slot * 4 + 4].try_into().unwrap());
                (0..HEAD_DIM)
                    .map(|d| reference::fp8_value(&codes[slot * HEAD_DIM..], sc, d) as f32)
                    .collect()
            };
            let (mut va, mut vb, mut same) = (Vec::new(), Vec::new(), 0);
            for b in 0..BATCH {
                for j in 0..n {
                    let slot = lay.key_slot(b, j);
                    let (ka, kb) = (
                        key(&ca.key_codes, &ca.key_scales, slot),
                        key(&cb.key_codes, &cb.key_scales, slot),
                    );
                    same += usize::from(ka == kb);
                    va.extend(ka);
                    vb.extend(kb);
                }
                for j in n..lay.plan.index_keys {
                    let slot = lay.key_slot(b, j);
                    assert!(
                        ca.key_codes[slot * HEAD_DIM..][..HEAD_DIM]
                            .iter()
                            .all(|&x| x == 0),
                        "layer {l} seq {b}: index key {j} written past the {n} emitted"
                    );
                }
            }
            check(
                "index keys",
                &va,
                &vb,
                format!("{same}/{}", BATCH * n),
                BATCH * n,
                cf.index_keys,
            );
            let (cos, mask) = state_cosine(&ca.key_state, &cb.key_state);
            let floor = floor_of(cf.index_keys);
            println!(
                "{l:>5} {:<11} index comp state  {cos:.6}  {:.3e}  -inf cells equal: {mask}",
                format!("{kind:?}"),
                finite_max_abs(&ca.key_state, &cb.key_state)
            );
            if !(cos >= floor && mask) {
                failures.borrow_mut().push(format!(
                    "layer {l}: indexer compressor state cosine {cos:.6} (floor {floor}), -inf cells equal {mask}"
                ));
            }
        }
    }
    let failures = failures.into_inner();
    assert!(failures.is_empty(), "caches: {}", failures.join("; "));

    // (c) decode steps after the prefill, both fed the reference engine's tokens.
    let mut agree = [0usize; BATCH];
    for step in 0..DECODE_STEPS {
        let ids: Vec<u32> = single
            .sampled(&gpu)
            .unwrap()
            .iter()
            .map(|&t| {
                assert!(t >= 0, "step {step}: a sequence stopped");
                t as u32
            })
            .collect();
        for e in [&mut chunked, &mut single] {
            e.state.set_tokens(&s, &ids).unwrap();
            arena::fill(&s, &e.state.ws.logits, 0xFF).unwrap();
            e.decode_step(&gpu).unwrap();
        }
        let (gc, gs) = (
            chunked.state.read_logits(&s).unwrap(),
            single.state.read_logits(&s).unwrap(),
        );
        for b in 0..BATCH {
            let (x, y) = (&gc[b * vocab..][..vocab], &gs[b * vocab..][..vocab]);
            let cos = cosine(x, y);
            let (tx, ty) = (argmax(x), argmax(y));
            let (lo, hi) = y
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let shortfall = (y[ty] - y[tx]) / (hi - lo);
            agree[b] += usize::from(tx == ty || shortfall <= 0.02);
            println!(
                "decode step {step} seq {b}: cos(chunked, reference) {cos:.6} argmax {tx} / {ty} (shortfall \
                 {shortfall:.4})"
            );
            let bound = 0.995f64.min(1.0 - 2.0 * (1.0 - prefill_cos[b]));
            assert!(
                cos >= bound,
                "decode step {step} seq {b}: logits cosine {cos:.6} below {bound:.6}"
            );
        }
    }
    for (b, &a) in agree.iter().enumerate() {
        assert!(
            a + 1 >= DECODE_STEPS,
            "seq {b}: the argmax agreed (or was near-best) in {a}/{DECODE_STEPS} decode steps"
        );
    }
}

// ---- GPU: the FFN glue of long chunks ---------------------------------------------------------------------------

/// `ffn_swiglu_fp8_rows` (a long chunk's shared expert between its two tensor-core GEMMs) against the host rule, on
/// 300 rows x 512 of random BF16 g and u in [-12, 12] with the model's clamp (L = 10 on the small geometry: about
/// 8% of g and 17% of u are clamped): h = bf16(silu(min(g, L)) * clamp(u, -L, L)), FP8 1x128 (formats::fp8). The kernel's
/// sigmoid uses the device expf (<= 2 ulp) where the host uses its own exp, so a BF16 h may differ by an ulp where
/// the product sits near a rounding edge: the blocks' scales and the codes must be equal in at least 99% of places,
/// and every code that differs must decode within one e4m3 step (2^-3 relative, plus half the block's smallest
/// step) of the host's. Unwritten codes (0xFF poison) would fail the count.
#[test]
#[ignore = "needs an H100/H200"]
fn swiglu_rows_match_the_host_rule() {
    use megamoe::engine::ffn::swiglu_fp8_rows;
    use megamoe::formats::{e4m3, fp8, ue8m0};
    use megamoe::model::numerics::{bf16_round, silu};
    use rand::Rng;
    let label = "engine_prefill_swiglu_rows";
    let gpu = gpu(label);
    let mut rng = common::seeded(label, "MEGAMOE_SEED");
    let (rows, inter) = (300usize, 512usize);
    let lim = ModelConfig::small().swiglu_limit;
    let draw = |rng: &mut rand_chacha::ChaCha8Rng| -> Vec<half::bf16> {
        (0..rows * inter)
            .map(|_| half::bf16::from_f32(rng.random_range(-12.0f32..12.0)))
            .collect()
    };
    let (g, u) = (draw(&mut rng), draw(&mut rng));
    let (dg, du) = (gpu.upload(&g).unwrap(), gpu.upload(&u).unwrap());
    let codes = gpu.poisoned::<u8>(rows * inter, common::POISON).unwrap();
    let scales = gpu
        .poisoned::<u8>(rows * inter / 128, common::POISON)
        .unwrap();
    swiglu_fp8_rows(
        &gpu,
        &gpu.stream,
        &DevBuf::of(&dg),
        &DevBuf::of(&du),
        rows,
        inter,
        lim,
        &DevBuf::of(&codes),
        &DevBuf::of(&scales),
    )
    .unwrap();
    gpu.synchronize().unwrap();
    let (gc, gs) = (
        gpu.download(&codes).unwrap(),
        gpu.download(&scales).unwrap(),
    );
    let (mut code_diff, mut scale_diff) = (0usize, 0usize);
    for r in 0..rows {
        for blk in 0..inter / 128 {
            let at = r * inter + blk * 128;
            let h: Vec<f32> = (0..128)
                .map(|i| {
                    let (mut gv, mut uv) = (g[at + i].to_f32(), u[at + i].to_f32());
                    if lim > 0.0 {
                        gv = gv.min(lim);
                        uv = uv.clamp(-lim, lim);
                    }
                    bf16_round(silu(gv) * uv)
                })
                .collect();
            let mut want = vec![0u8; 128];
            let sc = fp8::quantize_block(&h, &mut want);
            let got_sc = gs[r * inter / 128 + blk];
            scale_diff += usize::from(got_sc != sc);
            let (s_want, s_got) = (ue8m0::decode(sc), ue8m0::decode(got_sc));
            for i in 0..128 {
                if gc[at + i] == want[i] && got_sc == sc {
                    continue;
                }
                code_diff += 1;
                let (a, b) = (
                    e4m3::decode(gc[at + i]) * s_got,
                    e4m3::decode(want[i]) * s_want,
                );
                assert!(
                    a.is_finite() && (a - b).abs() <= 0.125 * b.abs() + s_want * 2f32.powi(-10),
                    "row {r} element {}: gpu {a} host {b} (h {})",
                    blk * 128 + i,
                    h[i]
                );
            }
        }
    }
    let (n, nb) = (rows * inter, rows * inter / 128);
    println!(
        "swiglu rows {rows} x {inter} (L = {lim}): codes differing {code_diff}/{n}, scales differing {scale_diff}/{nb}"
    );
    assert!(code_diff * 100 <= n && scale_diff * 100 <= nb);
}

/// `ffn_contiguous_grouping` on the router's own output against its host twin, exactly: 300 tokens of 16 experts on 11
/// slots (the slot map puts up to 2 picks of a token on one slot), biased and hash selections (hash rows repeat no
/// expert, but the map folds two onto a slot), capacity `ffn::slot_capacity`: offsets, every pair's row and every
/// row's weight equal the twin's (`contiguous_grouping_host` of the downloaded masked grouping), and the offsets end
/// at the pairs that got a row. Outputs are poisoned before.
#[test]
#[ignore = "needs an H100/H200"]
fn contiguous_grouping_matches_its_host_twin() {
    use common::router::{Case, DevCase, DevRun};
    use megamoe::engine::ffn::{
        contiguous_grouping, contiguous_grouping_host, slot_capacity, ContiguousRows,
    };
    use megamoe::engine::plan::ExpertMap;
    use megamoe::ops::moe_gemm::DeviceGrouping;
    use megamoe::ops::router::{route_counts_into, TOPK};
    let label = "engine_prefill_contiguous_grouping";
    let gpu = gpu(label);
    let mut rng = common::seeded(label, "MEGAMOE_SEED");
    let (tokens, experts, slots) = (300usize, 16usize, 11usize);
    for hash in [false, true] {
        let mut case = Case::random(&mut rng, tokens, experts, 256, 1.5).with_slots(slots);
        if hash {
            case = case.with_hash(&mut rng, 1000);
        }
        let map = ExpertMap::all(experts, slots);
        let cap = slot_capacity(tokens, &map);
        let shape = case.shape(cap);
        let dc = DevCase::upload(&gpu, &case);
        let mut r = DevRun::new(&gpu, &shape);
        let pairs = tokens * TOPK;
        let c = ContiguousRows {
            masked_counts: gpu.poisoned::<i32>(slots, common::POISON).unwrap(),
            token_rows: gpu.poisoned::<i32>(pairs, common::POISON).unwrap(),
            row_weight: gpu.poisoned::<f32>(pairs, common::POISON).unwrap(),
        };
        let grp = DeviceGrouping {
            capacity: 0,
            experts: slots,
            rows_total: pairs,
            group: gpu.poisoned::<i32>(slots + 1, common::POISON).unwrap(),
        };
        route_counts_into(
            &gpu,
            &gpu.stream,
            &dc.inputs(hash),
            &r.ws,
            &mut r.out,
            &c.masked_counts,
        )
        .unwrap();
        contiguous_grouping(&gpu, &gpu.stream, &r.out, &c, &grp).unwrap();
        gpu.synchronize().unwrap();
        let counts = gpu.download(&c.masked_counts).unwrap();
        let masked_rows = gpu.download(&r.out.token_rows).unwrap();
        let masked_weight = gpu.download(&r.out.row_weight).unwrap();
        let (offsets, rows, weight) =
            contiguous_grouping_host(&counts, cap, &masked_rows, &masked_weight);
        assert_eq!(
            gpu.download(&grp.group).unwrap(),
            offsets,
            "hash {hash}: offsets"
        );
        assert_eq!(
            gpu.download(&c.token_rows).unwrap(),
            rows,
            "hash {hash}: rows"
        );
        let got_w = gpu.download(&c.row_weight).unwrap();
        assert_eq!(
            got_w.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
            weight.iter().map(|w| w.to_bits()).collect::<Vec<_>>(),
            "hash {hash}: weights"
        );
        let owned = masked_rows.iter().filter(|&&r| r >= 0).count();
        assert_eq!(offsets[slots] as usize, owned, "hash {hash}");
        println!(
            "contiguous grouping (hash {hash}): {tokens} tokens x {TOPK} on {slots} slots, {owned} rows, offsets {:?}",
            &offsets
        );
    }
}
