//! The FFN half of a decode layer (docs/engine.md steps 12-16, `engine::ffn::FfnHalf`) against the CPU model,
//! teacher-forced: the CPU's `residual_mid` of every batch slot goes into `x_mid`, the GPU runs
//! `DecodeState::ffn_half`, and its `x`, f, routing and MoE output are compared with the `LayerTrace`.
//!
//! Where the GPU differs from `Model::moe` by design (moe_gemm's routed experts read NVFP4 activations, f and h,
//! with a per-row global scale where the model quantizes both to FP8 1x128, and keep g, u and each expert's output
//! in f32 where the model rounds them to BF16), the MoE output is checked twice: against a CPU simulation of the
//! GPU's formats ([`moe_like_gpu`]: the model's own expert weights and math with NVFP4 f and h), which the GPU must
//! match to cosine 0.999, and against the model itself with the bound the formats permit ([`MOE_ORACLE_COS`],
//! measured by the CPU test `nvfp4_activations_bound_the_moe_parity`).

mod common;

use common::engine::{
    advance_cpu, flash_layers_config, flash_layers_rig, small_rig, tokens, CpuPrefix,
    FLASH_PARITY_CONTEXT, FLASH_PARITY_OFFSETS,
};
use megamoe::engine::ffn::slot_capacity;
use megamoe::engine::io::{Residual, StepShape};
use megamoe::engine::plan::PlanRequest;
use megamoe::engine::step::DecodeState;
use megamoe::engine::{DeviceWeights, ExpertMap, MemoryPlan, WeightSource};
use megamoe::formats::{fp8, nvfp4};
use megamoe::gpu::arena;
use megamoe::gpu::Gpu;
use megamoe::model::numerics::{cosine, fp8_act_quant};
use megamoe::model::reference::Routing;
use megamoe::model::{CachePolicy, Model, ModelConfig, RoutedActivations, StepOutput, Weights};
use megamoe::ops::inputs::fresh_seed;
use megamoe::ops::moe_gemm::RoutedBatch;
use megamoe::ops::norm_quant::QuantView;
use megamoe::ops::router::reference::gather_rows;
use megamoe::ops::router::TOPK;
use std::time::Instant;

/// A sequence's share of the batch: the CPU model reaches position `offset` (a prefix of `offset` tokens, fed the
/// check's [`CpuPrefix`] way), then each of its next `steps` decode steps fills one batch slot.
#[derive(Clone, Copy, Debug)]
struct SequenceSteps {
    offset: usize,
    steps: usize,
}

impl SequenceSteps {
    const fn from(offset: usize, steps: usize) -> SequenceSteps {
        SequenceSteps { offset, steps }
    }
}

/// A batch of decode steps to compare: the sequences' steps in order, their prefixes fed the `prefix` way.
struct StepBatch<'a> {
    seqs: &'a [SequenceSteps],
    prefix: CpuPrefix,
}

impl StepBatch<'_> {
    /// The batch slots the sequences fill.
    fn slots(&self) -> usize {
        self.seqs.iter().map(|q| q.steps).sum()
    }
}

/// Batch slots: two sequences of 3 and 5 decode steps (positions 0..=2 and 0..=4, eight different tokens).
const SEQUENCES: [SequenceSteps; 2] = [SequenceSteps::from(0, 3), SequenceSteps::from(0, 5)];
const CONTEXT: usize = 16;
/// [`SEQUENCES`] from empty states.
const SMALL_BATCH: StepBatch = StepBatch {
    seqs: &SEQUENCES,
    prefix: CpuPrefix::DecodeSteps,
};
/// The Flash test's batch: 3 decode steps from each of `FLASH_PARITY_OFFSETS` (positions 20-22, 126-128, 148-150;
/// the FFN half does not read the position, but the residual streams it gets come from inside the first window,
/// around the first HCA emission and window wrap, and past them).
const FLASH_SEQUENCES: [SequenceSteps; 3] = [
    SequenceSteps::from(FLASH_PARITY_OFFSETS[0], 3),
    SequenceSteps::from(FLASH_PARITY_OFFSETS[1], 3),
    SequenceSteps::from(FLASH_PARITY_OFFSETS[2], 3),
];
/// [`FLASH_SEQUENCES`], their prefixes prefilled (`CpuPrefix::Prefill`: the cheaper way at Flash dims).
const FLASH_BATCH: StepBatch = StepBatch {
    seqs: &FLASH_SEQUENCES,
    prefix: CpuPrefix::Prefill,
};

/// f (BF16, mhc_pre + ffn_norm) against the CPU's `ffn_input`: the GPU's mHC mixes are f32 split-K sums where the
/// model's are f32 dots in another order, so `u` and then f may differ by one BF16 ulp (2^-8 relative) in a small
/// fraction of elements: 1 - cos ~ (fraction x 2^-16) / 2, far below 1e-4 even if every element flipped once.
const F_COS: f64 = 0.9999;
/// The criterion for every compared intermediate.
const COS: f64 = 0.999;
/// The GPU's MoE output against the model's: 0.999 is out of reach with NVFP4 activations. NVFP4 (e2m1 codes,
/// e4m3 scale per 16, per-row global scale) alone takes f to cosine ~0.995 with its BF16 values (FP8 1x128:
/// ~0.9996), i.e. ~10% relative error, and the routed experts see it twice (f, then h); the shared expert (FP8, as
/// the model) dilutes it. The CPU test `nvfp4_activations_bound_the_moe_parity` runs the model's expert math in the
/// GPU's formats over every layer of the small model (48 token layers per seed): the smallest per-token cosine
/// with the model's `moe_out` was 0.9950-0.9965 per seed over 26 seeds (typical tokens 0.996-0.998), and it
/// asserts it stays above this bound; after hc_post the residual kept 0.99932-0.99963 (smallest per seed), above
/// the 0.999.
const MOE_ORACLE_COS: f64 = 0.99;
/// The residual after hc_post against the model's: the issue's [`COS`] where the formats alone keep it (the small
/// model: 0.99932-0.99963, `nvfp4_activations_bound_the_moe_parity`); where they do not (the Flash geometry's
/// d = 4096: one seed's hash layer 0 had the GPU-format simulation at 0.99867 against the model while the GPU matched
/// the simulation to 1.000000), the GPU may sit as far again from the model as the formats do: 1 - cos up to twice
/// the formats' `fmt` on the same rows.
fn residual_bound(fmt: f64) -> f64 {
    COS.min(1.0 - 2.0 * (1.0 - fmt))
}

/// A biased layer's expert set may differ from the CPU's only where the CPU's 6th and 7th largest `score + bias`
/// are closer than this: the GPU's scores follow from its f (cosine >= F_COS with the CPU's, so logit errors
/// ~ ||w|| ||df|| ~ 1e-3 for unit-RMS f and gate rows of RMS 1/sqrt(D)) and an f32 logit sum in another order
/// (~1e-6); d sqrt(softplus(x)) / dx < 0.6, so the GPU's score differences stay well inside 1e-2.
const NEAR_TIE: f32 = 1e-2;
/// Routing weights (`s_e / sum * route_scale`, ~0.25 each) of equal expert sets: the same score error over a sum of
/// six, ~1e-3 at most.
const WEIGHT_TOL: f32 = 2e-3;

/// One batch slot: the token a CPU decode step embedded and its layer traces.
struct Slot {
    token: u32,
    out: StepOutput,
}

/// The CPU model's decode steps that feed the batch, sequence after sequence ([`StepBatch`]; sequence s's tokens
/// come from `seed ^ (0x5EC0 + s)`).
fn cpu_slots(m: &Model, seed: u64, batch: &StepBatch) -> Vec<Slot> {
    let vocab = m.config().vocab_size;
    let mut slots = Vec::new();
    for (s, q) in batch.seqs.iter().enumerate() {
        let mut st = m.new_state();
        let toks = tokens(seed ^ (0x5EC0 + s as u64), q.offset + q.steps, vocab);
        advance_cpu(m, &mut st, &toks[..q.offset], batch.prefix);
        for &t in &toks[q.offset..] {
            let out = m.decode_step(&mut st, t).unwrap();
            slots.push(Slot { token: t, out });
        }
    }
    slots
}

/// `Model::moe_as` in the formats `routed` with logical expert `e` reading the weights of logical expert
/// `e % slots` (the [`ExpertMap`] rule, slot `s` holding logical expert `s`; `slots == E` is the model itself).
#[allow(clippy::too_many_arguments)]
fn moe_mapped(
    m: &Model,
    layer: usize,
    f: &[f32],
    experts: &[usize],
    weights: &[f32],
    slots: usize,
    routed: RoutedActivations,
) -> Vec<f32> {
    let routing = Routing {
        scores: Vec::new(),
        experts: experts.iter().map(|&e| e % slots).collect(),
        weights: weights.to_vec(),
    };
    m.moe_as(layer, f, &routing, routed).unwrap()
}

/// The model's MoE (FP8 activations, the checkpoint's formats) with the expert map.
fn moe_cpu(
    m: &Model,
    layer: usize,
    f: &[f32],
    experts: &[usize],
    weights: &[f32],
    slots: usize,
) -> Vec<f32> {
    moe_mapped(m, layer, f, experts, weights, slots, RoutedActivations::Fp8)
}

/// One row through NVFP4 with a per-row global scale (`formats::nvfp4`, the rule of norm_quant's quantizer and of
/// moe_gemm's L1 finish) and back.
fn nvfp4_round_trip(x: &[f32]) -> Vec<f32> {
    nvfp4::dequantize_rows(&nvfp4::quantize_rows(x, 1, x.len()).unwrap())
}

/// The model's MoE in the GPU's formats (`RoutedActivations::Nvfp4`: NVFP4 f and h, f32 g, u and w2 outputs;
/// the shared expert as the model) with the expert map. The weights are the model's (the synthetic MXFP4
/// experts convert to NVFP4 exactly: `DeviceWeights::inexact_blocks` is 0).
fn moe_like_gpu(
    m: &Model,
    layer: usize,
    f: &[f32],
    experts: &[usize],
    weights: &[f32],
    slots: usize,
) -> Vec<f32> {
    moe_mapped(
        m,
        layer,
        f,
        experts,
        weights,
        slots,
        RoutedActivations::Nvfp4,
    )
}

/// The CPU's 6th minus 7th largest `score + bias` (a biased layer's selection margin).
fn selection_margin(r: &Routing, bias: &[f32]) -> f32 {
    let mut v: Vec<f32> = r.scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    v.sort_by(|a, b| b.total_cmp(a));
    v[TOPK - 1] - v[TOPK]
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The smallest cosine and largest absolute error over rows, printed and held against `bound`.
#[derive(Default)]
struct Tally {
    min_cos: f64,
    max_abs: f32,
    rows: usize,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            min_cos: 1.0,
            ..Default::default()
        }
    }
    fn add(&mut self, got: &[f32], want: &[f32]) {
        self.min_cos = self.min_cos.min(cosine(got, want));
        self.max_abs = self.max_abs.max(max_abs(got, want));
        self.rows += 1;
    }
    fn check(&self, label: &str, what: &str, bound: f64) {
        println!(
            "{label}: {what:<24} min cosine {:.6} max abs {:.3e} over {} rows (bound {bound})",
            self.min_cos, self.max_abs, self.rows
        );
        assert!(
            self.rows == 0 || self.min_cos >= bound,
            "{label}: {what}: cosine {:.6} < {bound}",
            self.min_cos
        );
    }
}

// ---- CPU ----------------------------------------------------------------------------------------------------

/// What the NVFP4 activations of the routed experts permit: over every layer and batch slot of the small model,
/// the CPU model's MoE output against [`moe_like_gpu`] (its own expert math in the GPU's formats), and the
/// residual after hc_post. Prints the numbers behind [`MOE_ORACLE_COS`] and asserts the simulation stays above
/// it (and the residual above the 0.999), with the activation-only effect of each format for scale.
#[test]
fn nvfp4_activations_bound_the_moe_parity() {
    let seed = fresh_seed("engine_ffn_nvfp4_bound", "MEGAMOE_SEED");
    let m = Model::new(Weights::synthetic(ModelConfig::small(), seed, CachePolicy::All).unwrap())
        .unwrap();
    let cfg = m.config().clone();
    let slots = cpu_slots(&m, seed, &SMALL_BATCH);
    let (mut worst_moe, mut worst_res) = (1f64, 1f64);
    for l in 0..cfg.n_layers {
        let (mut moe, mut res, mut f_nv, mut f_fp8) =
            (Tally::new(), Tally::new(), Tally::new(), Tally::new());
        for s in &slots {
            let tr = &s.out.layers[l];
            let f = &tr.ffn_input;
            // The model's own MoE, recomputed: the helper is `Model::moe` (bit for bit).
            let cpu = moe_cpu(
                &m,
                l,
                f,
                &tr.routing.experts,
                &tr.routing.weights,
                cfg.n_routed_experts,
            );
            assert_eq!(cpu, tr.moe_out, "layer {l}: moe_cpu is not Model::moe");
            let sim = moe_like_gpu(
                &m,
                l,
                f,
                &tr.routing.experts,
                &tr.routing.weights,
                cfg.n_routed_experts,
            );
            moe.add(&sim, &tr.moe_out);
            res.add(
                &m.hc_post(&sim, &tr.residual_mid, &tr.ffn_hc),
                &tr.residual_out,
            );
            f_nv.add(&nvfp4_round_trip(f), f);
            f_fp8.add(&fp8_act_quant(f).unwrap(), f);
        }
        let label = format!("layer {l}");
        f_fp8.check(&label, "f: FP8 1x128 vs BF16", 0.0);
        f_nv.check(&label, "f: NVFP4 vs BF16", 0.0);
        moe.check(&label, "moe_out: sim vs model", MOE_ORACLE_COS);
        res.check(&label, "residual: sim vs model", COS);
        worst_moe = worst_moe.min(moe.min_cos);
        worst_res = worst_res.min(res.min_cos);
    }
    println!("over all layers: moe_out {worst_moe:.6}, residual {worst_res:.6}");
}

/// The gather's CPU twin on moe_gemm's masked layout: every row a pair owns (`row_token[r] = t`) holds token t's
/// row, every other row is left as it was.
#[test]
fn gather_rows_fills_the_rows_each_pair_owns() {
    let (t, slots, cap, len) = (5usize, 4usize, 12usize, 3usize);
    // Picks by logical expert e of 7 on 4 slots (e % 4): every token puts two rows on some slot.
    let picks: Vec<usize> = [
        [0, 1, 5, 2, 3, 6],
        [6, 5, 4, 3, 2, 1],
        [0, 1, 2, 3, 4, 6],
        [2, 6, 1, 0, 3, 4],
        [3, 2, 1, 0, 6, 5],
    ]
    .iter()
    .flatten()
    .map(|&e| e % slots)
    .collect();
    let rb = RoutedBatch::from_choices(t, slots, TOPK, picks, Some(cap)).unwrap();
    let src: Vec<i32> = (0..(t * len) as i32).map(|v| 100 + v).collect();
    let mut dst = vec![-7i32; slots * cap * len];
    gather_rows(&src, len, &rb.token_rows, &mut dst);
    for (r, &tok) in rb.row_token.iter().enumerate() {
        let row = &dst[r * len..(r + 1) * len];
        if tok >= 0 {
            let tok = tok as usize;
            assert_eq!(row, &src[tok * len..(tok + 1) * len], "row {r}");
        } else {
            assert!(
                row.iter().all(|&v| v == -7),
                "row {r} owned by no pair was written"
            );
        }
    }
    // A pair without a row (-1) writes nothing.
    let mut none = vec![-7i32; slots * cap * len];
    gather_rows(&src, len, &vec![-1; t * TOPK], &mut none);
    assert!(none.iter().all(|&v| v == -7));
}

/// The Flash rig's configuration is valid and its memory plan keeps all 256 experts of its 6 layers resident with
/// 70 GB free (an H100 has ~79 GB free after its context), for the larger of the two Flash tests' batches: what
/// `ffn_half_matches_the_model_at_flash_shapes` asserts on the device, checked here without one.
#[test]
fn flash_layers_plan_keeps_every_expert_resident() {
    let cfg = flash_layers_config();
    let req = PlanRequest::new(
        FLASH_BATCH.slots(),
        FLASH_PARITY_CONTEXT,
        16,
        70_000_000_000,
    );
    let plan = MemoryPlan::new(&cfg, &req).unwrap();
    println!(
        "{}: {}, experts {:.1} GB, everything {:.1} GB",
        cfg.name,
        plan.map,
        plan.expert_bytes() as f64 / 1e9,
        plan.total_bytes() as f64 / 1e9
    );
    assert!(plan.map.is_identity(), "{}", plan.map);
}

// ---- GPU ----------------------------------------------------------------------------------------------------

/// The small model with `slots` physical expert slots per layer (`None`: every expert resident), its CPU twin and a
/// decode state of the batch.
fn rig_with_slots(
    gpu: &Gpu,
    label: &str,
    slots: usize,
) -> (u64, DeviceWeights, Model, DecodeState) {
    let cfg = ModelConfig::small();
    let batch = SMALL_BATCH.slots();
    let seed = fresh_seed(label, "MEGAMOE_SEED");
    let mut plan = MemoryPlan::new(&cfg, &PlanRequest::new(batch, CONTEXT, 16, 8 << 30)).unwrap();
    plan.map.slots = slots;
    let w = DeviceWeights::load(gpu, &plan, &WeightSource::Synthetic { seed }).unwrap();
    let m = Model::new(Weights::synthetic(cfg, seed, CachePolicy::All).unwrap()).unwrap();
    let state = DecodeState::new(
        gpu,
        &w,
        StepShape {
            batch,
            context: CONTEXT,
        },
    )
    .unwrap();
    (seed, w, m, state)
}

/// Teacher-forces every layer's FFN half with the CPU's `residual_mid` of each slot (the decode steps of `steps`:
/// [`cpu_slots`]) and checks it (module docs). `slots` is the plan's physical slot count: logical expert e reads the weights of slot `e % slots`, which holds
/// logical expert `e % slots`, so the CPU oracle is the model with expert e's weights replaced by expert
/// `e % slots`'s ([`moe_cpu`]); routing still chooses among all logical experts (the traces' routing).
fn check_ffn_half(
    gpu: &Gpu,
    label: &str,
    w: &DeviceWeights,
    m: &Model,
    state: &mut DecodeState,
    seed: u64,
    steps: &StepBatch,
) {
    let cfg = m.config().clone();
    let map: ExpertMap = w.plan.map;
    assert_eq!(state.ffn.map, map);
    assert_eq!(
        w.inexact_blocks, 0,
        "the synthetic experts convert to NVFP4 exactly"
    );
    let (b, d) = (state.shape.batch, cfg.dim);
    let t0 = Instant::now();
    let slots = cpu_slots(m, seed, steps);
    assert_eq!(slots.len(), b);
    println!(
        "{label}: CPU decode of {:?} ({:?} prefixes): {:.1} s",
        steps.seqs,
        steps.prefix,
        t0.elapsed().as_secs_f64()
    );
    let s = &gpu.stream;
    let positions: Vec<i32> = slots.iter().map(|x| x.out.position as i32).collect();
    state.set_positions(s, &positions).unwrap();
    state
        .set_tokens(s, &slots.iter().map(|x| x.token).collect::<Vec<_>>())
        .unwrap();
    println!(
        "{label}: {map}; batch {b} at positions {positions:?}, capacity {} rows per slot",
        slot_capacity(b, &map)
    );
    let mut flips_total = 0;
    for l in 0..cfg.n_layers {
        let label = format!(
            "{label} layer {l} ({})",
            if cfg.is_hash_layer(l) {
                "hash"
            } else {
                "biased"
            }
        );
        let trace = |i: usize| &slots[i].out.layers[l];
        let x_mid: Vec<f32> = (0..b).flat_map(|i| trace(i).residual_mid.clone()).collect();
        state.load_residual(s, Residual::Mid, &x_mid).unwrap();
        state
            .load_residual(s, Residual::Layer, &vec![f32::NAN; x_mid.len()])
            .unwrap();
        state.ffn.poison(gpu).unwrap();
        state.ffn_half(gpu, s, w, l).unwrap();
        gpu.synchronize().unwrap();

        // Step 12: f and its two quantized forms.
        let ffn = &state.ffn;
        let f: Vec<f32> = arena::download(s, &ffn.f)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        common::assert_all_written(&format!("{label}: f"), &f);
        let mut t_f = Tally::new();
        for i in 0..b {
            t_f.add(&f[i * d..(i + 1) * d], &trace(i).ffn_input);
        }
        t_f.check(&label, "f vs ffn_input", F_COS);
        let QuantView::Fp8 { data, scales } = ffn.f_fp8.q else {
            unreachable!()
        };
        let got_fp8 = fp8::Fp8Act::from_parts(
            b,
            d,
            arena::download(s, &data).unwrap(),
            arena::download(s, &scales).unwrap(),
        )
        .unwrap();
        let deq = fp8::dequantize_act_1x128(&got_fp8);
        for i in 0..b {
            let want = fp8_act_quant(&f[i * d..(i + 1) * d]).unwrap();
            assert_eq!(
                &deq[i * d..(i + 1) * d],
                &want[..],
                "{label}: FP8 f of slot {i} is not fp8_act_quant(f)"
            );
        }
        let QuantView::Nvfp4 {
            data,
            scales,
            global_scale,
        } = ffn.f_nvfp4.q
        else {
            unreachable!()
        };
        let want_nv = nvfp4::quantize_rows(&f, b, d).unwrap();
        assert_eq!(
            arena::download(s, &data).unwrap(),
            want_nv.data,
            "{label}: NVFP4 f codes"
        );
        assert_eq!(
            arena::download(s, &scales).unwrap(),
            want_nv.scales,
            "{label}: NVFP4 f scales"
        );
        let gs = arena::download(s, &global_scale).unwrap();
        assert_eq!(
            gs.iter().map(|g| g.to_bits()).collect::<Vec<_>>(),
            want_nv
                .global_scale
                .iter()
                .map(|g| g.to_bits())
                .collect::<Vec<_>>(),
            "{label}: NVFP4 f global scales"
        );

        // Step 13: routing against the CPU's, the grouping against the picks.
        let experts = gpu.download(&ffn.route.topk_experts).unwrap();
        let weights = gpu.download(&ffn.route.topk_weights).unwrap();
        let counts = gpu.download(&ffn.grouping.group).unwrap();
        assert_eq!(
            gpu.download(&ffn.route.dropped).unwrap()[0],
            0,
            "{label}: dropped pairs"
        );
        let mut want_counts = vec![0i32; map.slots];
        for &e in &experts {
            assert!((0..map.logical as i32).contains(&e), "{label}: expert {e}");
            want_counts[map.physical(e as usize).expect("one GPU owns every expert")] += 1;
        }
        assert_eq!(
            counts, want_counts,
            "{label}: rows per slot (expert e on slot e % {})",
            map.slots
        );
        let bias = (!cfg.is_hash_layer(l)).then(|| {
            m.weights
                .vector(&format!("layers.{l}.ffn.gate.bias"))
                .unwrap()
        });
        let (mut flips, mut w_err) = (Vec::new(), 0f32);
        let mut same_set = vec![true; b];
        for i in 0..b {
            let r = &trace(i).routing;
            let got: Vec<usize> = experts[i * TOPK..(i + 1) * TOPK]
                .iter()
                .map(|&e| e as usize)
                .collect();
            let got_w = &weights[i * TOPK..(i + 1) * TOPK];
            match &bias {
                None => assert_eq!(
                    got, r.experts,
                    "{label}: slot {i}: the tid2eid row of token {}",
                    slots[i].token
                ),
                Some(bias) => {
                    let (mut a, mut c) = (got.clone(), r.experts.clone());
                    a.sort_unstable();
                    c.sort_unstable();
                    if a != c {
                        let margin = selection_margin(r, bias);
                        assert!(
                            margin < NEAR_TIE,
                            "{label}: slot {i}: experts {got:?} vs the CPU's {:?} with a 6th/7th margin {margin:.3e}",
                            r.experts
                        );
                        flips.push((i, margin));
                        same_set[i] = false;
                        continue;
                    }
                }
            }
            for (j, &e) in got.iter().enumerate() {
                let k = r.experts.iter().position(|&x| x == e).unwrap();
                w_err = w_err.max((got_w[j] - r.weights[k]).abs());
            }
        }
        println!(
            "{label}: routing: {} of {b} expert sets equal, max weight error {w_err:.2e} (tolerance {WEIGHT_TOL}); \
             near-tie flips (margin < {NEAR_TIE}): {flips:?}",
            same_set.iter().filter(|&&x| x).count()
        );
        assert!(
            w_err <= WEIGHT_TOL,
            "{label}: routing weights differ by {w_err}"
        );
        flips_total += flips.len();

        // Steps 14-15: the MoE output against the GPU-format simulation (the GPU's picks and weights, the CPU's f)
        // and against the model (expert sets equal).
        let moe: Vec<f32> = gpu
            .download(&ffn.moe_out)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect();
        common::assert_all_written(&format!("{label}: moe_out"), &moe);
        let x = state.read_residual(s, Residual::Layer).unwrap();
        common::assert_all_written(&format!("{label}: x"), &x);
        let (mut t_sim, mut t_moe) = (Tally::new(), Tally::new());
        let (mut t_res_sim, mut t_res) = (Tally::new(), Tally::new());
        // The formats' own distance from the model on the same rows: hc_post(sim) against residual_out.
        let mut t_res_fmt = Tally::new();
        for i in 0..b {
            let tr = trace(i);
            let got_e: Vec<usize> = experts[i * TOPK..(i + 1) * TOPK]
                .iter()
                .map(|&e| e as usize)
                .collect();
            let got_w = &weights[i * TOPK..(i + 1) * TOPK];
            let row = &moe[i * d..(i + 1) * d];
            let sim = moe_like_gpu(m, l, &tr.ffn_input, &got_e, got_w, map.slots);
            t_sim.add(row, &sim);
            let x_row = &x[i * 4 * d..(i + 1) * 4 * d];
            t_res_sim.add(x_row, &m.hc_post(&sim, &tr.residual_mid, &tr.ffn_hc));
            if same_set[i] {
                let want = moe_cpu(
                    m,
                    l,
                    &tr.ffn_input,
                    &tr.routing.experts,
                    &tr.routing.weights,
                    map.slots,
                );
                if map.is_identity() {
                    assert_eq!(want, tr.moe_out);
                }
                t_moe.add(row, &want);
                // Step 16: the residual against hc_post of the oracle's MoE output (the trace's residual_out
                // when every expert is resident).
                let res = m.hc_post(&want, &tr.residual_mid, &tr.ffn_hc);
                t_res.add(x_row, &res);
                t_res_fmt.add(&m.hc_post(&sim, &tr.residual_mid, &tr.ffn_hc), &res);
            }
        }
        t_sim.check(&label, "moe_out vs GPU-format sim", COS);
        t_moe.check(&label, "moe_out vs model", MOE_ORACLE_COS);
        t_res_sim.check(&label, "x vs hc_post(sim)", COS);
        t_res_fmt.check(&label, "formats vs residual_out", 0.0);
        t_res.check(
            &label,
            "x vs residual_out",
            residual_bound(t_res_fmt.min_cos),
        );
    }
    println!(
        "{label}: {flips_total} near-tie expert-set flips over {} biased token layers",
        {
            let biased = (0..cfg.n_layers).filter(|&l| !cfg.is_hash_layer(l)).count();
            biased * b
        }
    );
    println!(
        "{label}: {:.1} s in all (CPU decode, GPU, CPU oracles)",
        t0.elapsed().as_secs_f64()
    );
}

/// Every layer of the small model (layers 0-2 hash-routed, 3-5 biased top-6), all 16 experts resident.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_ffn_half_matches_the_model_on_every_layer() {
    let label = "gpu_ffn_half_matches_the_model_on_every_layer";
    let gpu = common::gpu(label);
    let (seed, w, m, mut state) = small_rig(&gpu, label, SMALL_BATCH.slots(), CONTEXT);
    assert_hash_and_biased_layers(m.config());
    assert!(w.plan.map.is_identity());
    check_ffn_half(&gpu, label, &w, &m, &mut state, seed, &SMALL_BATCH);
}

/// The model has both hash-routed and biased layers (both routing paths are compared).
fn assert_hash_and_biased_layers(cfg: &ModelConfig) {
    assert!(
        (0..cfg.n_layers).any(|l| cfg.is_hash_layer(l))
            && (0..cfg.n_layers).any(|l| !cfg.is_hash_layer(l)),
        "the model must have both hash and biased layers"
    );
}

/// Every layer of the Flash geometry cut to 6 layers (`common::engine::flash_layers_config`: dim 4096, 256 routed
/// experts of inter 2048, layers 0-2 hash-routed, 3-5 biased), all 256 experts resident, with the small test's
/// tolerances. The GPU-format simulation ([`moe_like_gpu`]) runs at Flash dims (it reads the model's own weights,
/// regenerated on use), so the 0.999 against it holds as at the small geometry; [`MOE_ORACLE_COS`] was measured on
/// the small model only (NVFP4's relative error per element does not depend on the dims, so it is expected to hold;
/// if "moe_out vs model" fails here while "vs GPU-format sim" passes, the bound, not the GPU, is what to revisit).
/// CPU cost (`common::engine::flash_layers_rig`): 294 prefilled tokens (~2000 core-seconds), 9 decode steps (~100)
/// and two MoE recomputations per slot and layer (the simulation and the model's, 6 regenerated experts each: ~100),
/// about 2.5 minutes on 16 cores.
#[test]
#[ignore = "needs an H100/H200"]
fn ffn_half_matches_the_model_at_flash_shapes() {
    let label = "ffn_half_matches_the_model_at_flash_shapes";
    let gpu = common::gpu(label);
    let (seed, w, m, mut state) =
        flash_layers_rig(&gpu, label, FLASH_BATCH.slots(), FLASH_PARITY_CONTEXT);
    assert_hash_and_biased_layers(m.config());
    assert!(
        w.plan.map.is_identity(),
        "all 256 experts of the 6 layers must be resident (~21 GB): {}",
        w.plan.map
    );
    check_ffn_half(&gpu, label, &w, &m, &mut state, seed, &FLASH_BATCH);
}

/// The expert map with fewer slots than experts: 16 logical experts on 11 slots (experts 11..=15 read slots 0..=4,
/// two picks of a token may share a slot) and on 6 (up to three logical experts per slot). Routing still picks
/// among all 16; the GPU must compute what the CPU computes with expert e's weights replaced by slot e % slots's,
/// which the weight loader fills with logical expert e % slots.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_ffn_half_reads_expert_e_from_slot_e_mod_slots() {
    let label = "gpu_ffn_half_reads_expert_e_from_slot_e_mod_slots";
    let gpu = common::gpu(label);
    for slots in [11, 6] {
        let (seed, w, m, mut state) = rig_with_slots(&gpu, label, slots);
        assert!(!w.plan.map.is_identity());
        check_ffn_half(
            &gpu,
            &format!("{label} ({slots} slots)"),
            &w,
            &m,
            &mut state,
            seed,
            &SMALL_BATCH,
        );
    }
}
