//! The expert-parallel decode step (`dist::step::EpStep`, docs/multi-gpu.md) on one GPU.
//!
//! 1. World of one rank: the EP step (the FFN half split at the combine: f32 L2 finish `moe_gemm::finish::launch_finish_l2_partial`,
//!    the all-gather being the partial itself, `ops::ep::combine` adding the shared expert and rounding once) gives
//!    the single-GPU engine's logits bit for bit, every step. Why exact: the f32 finish does moe_gemm's L2 epilogue's
//!    fp32 operations in its order (kernels/ep_combine.cu), so the partial is the value that epilogue rounds; the
//!    combine at W = 1 computes `bf16(p_0 + shared)`, the epilogue's `bf16(y + addend)`. Nothing else changes.
//! 2. Several ranks emulated on one GPU (the dispatch and combine logic, without NCCL): per layer, rank r's FFN half
//!    with a slot table that keeps only its own experts (on the full weights: expert e stays in slot e) writes its
//!    partial; the W partials combined on the device equal the CPU twin `engine::ep::combine_partials` of the same
//!    partials bit for bit, and the single-GPU MoE output up to the reassociation of the routed sum: the same
//!    f32 terms summed per rank then across ranks, so an element may differ by one BF16 ulp where its f32 sum sits
//!    at a rounding boundary (docs/multi-gpu.md, "Against the single-GPU result"); the count is printed; asserted:
//!    each element within one BF16 ulp (plus 2^-12 of its rank sums' magnitude, room for cancellation inside a
//!    rank's sum), and at most 2% of the elements differing at all.
//! 3. The EP step captured into a CUDA graph (`EpStep::capture_decode_step`, what `megamoe decode --ranks N` replays)
//!    gives the eager EP steps' logits and tokens bit for bit: a replay launches the same kernels on the same buffers.

mod common;

use common::engine::{rig_weights, short_window_config, tokens};
use common::gpu;
use half::bf16;
use megamoe::dist::comm::Communicator;
use megamoe::dist::step::EpStep;
use megamoe::engine::ep::{combine_partials, ExpertPartition};
use megamoe::engine::io::{Residual, StepShape};
use megamoe::engine::step::DecodeState;
use megamoe::engine::DeviceWeights;
use megamoe::gpu::{DeviceBuf, Gpu};
use megamoe::model::numerics::cosine;
use megamoe::model::sampler::SamplerConfig;
use megamoe::ops::sampler::SamplerParams;

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Admits `prompts`, runs all but their last token as prompt steps, then `steps` decode steps; the logits and the
/// sampled ids of every decode step. `ep`: through the EP step, else the engine's own step.
fn run(
    gpu: &Gpu,
    w: &DeviceWeights,
    state: &mut DecodeState,
    mut ep: Option<&mut EpStep>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<(Vec<f32>, Vec<i32>)> {
    let s = gpu.stream.clone();
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), steps + 1).unwrap();
    for (slot, p) in prompts.iter().enumerate() {
        state.ws.sampler.admit(&s, slot, &params, p).unwrap();
    }
    state.set_positions(&s, &vec![0; prompts.len()]).unwrap();
    let len = prompts[0].len();
    for i in 0..len {
        let ids: Vec<u32> = prompts.iter().map(|p| p[i]).collect();
        state.set_tokens(&s, &ids).unwrap();
        if i + 1 < len {
            match ep.as_deref_mut() {
                Some(ep) => ep.prompt_step(state, gpu, &s, w).unwrap(),
                None => state.prompt_step(gpu, &s, w).unwrap(),
            }
        }
    }
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        match ep.as_deref_mut() {
            Some(ep) => ep.decode_step(state, gpu, &s, w).unwrap(),
            None => state.decode_step(gpu, &s, w).unwrap(),
        }
        let logits = state.read_logits(&s).unwrap();
        let sampled = megamoe::gpu::arena::download(&s, &state.ws.sampler.sampled).unwrap();
        out.push((logits, sampled));
    }
    assert_eq!(state.read_error(&s).unwrap(), 0, "step error bits");
    out
}

/// Part 3 of the module docs: eager EP steps against the first eager step then graph replays, on two states of the
/// same weights and prompts; every step's logits and sampled ids bit for bit.
#[test]
#[ignore = "needs an H100/H200"]
fn ep_graph_replays_equal_the_eager_ep_steps() {
    let gpu = gpu("dist_ep_graph");
    let cfg = short_window_config();
    let (batch, context, prompt_len, steps) = (2, 48, 5, 8);
    let (seed, w, _m) = rig_weights(&gpu, "dist_ep_graph", cfg.clone(), batch, context);
    let shape = StepShape { batch, context };
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| tokens(seed ^ (0x61 + b as u64), prompt_len, cfg.vocab_size))
        .collect();
    let mut eager_state = DecodeState::new(&gpu, &w, shape).unwrap();
    let mut eager_ep = EpStep::new(&gpu, &mut eager_state, Communicator::single()).unwrap();
    let want = run(
        &gpu,
        &w,
        &mut eager_state,
        Some(&mut eager_ep),
        &prompts,
        steps,
    );
    drop((eager_ep, eager_state));

    // The same prefill, then step 0 eager and steps 1.. as replays of one captured step.
    let s = gpu.stream.clone();
    let mut state = DecodeState::new(&gpu, &w, shape).unwrap();
    state.ffn.poison(&gpu).unwrap();
    let mut ep = EpStep::new(&gpu, &mut state, Communicator::single()).unwrap();
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), steps + 1).unwrap();
    for (slot, p) in prompts.iter().enumerate() {
        state.ws.sampler.admit(&s, slot, &params, p).unwrap();
    }
    state.set_positions(&s, &vec![0; batch]).unwrap();
    for i in 0..prompt_len {
        let ids: Vec<u32> = prompts.iter().map(|p| p[i]).collect();
        state.set_tokens(&s, &ids).unwrap();
        if i + 1 < prompt_len {
            ep.prompt_step(&mut state, &gpu, &s, &w).unwrap();
        }
    }
    let mut graph = None;
    for (step, (wl, wt)) in want.iter().enumerate() {
        if step == 1 {
            graph = Some(ep.capture_decode_step(&mut state, &gpu, &s, &w).unwrap());
        }
        match &graph {
            None => ep.decode_step(&mut state, &gpu, &s, &w).unwrap(),
            Some(g) => g.launch().unwrap(),
        }
        let gl = state.read_logits(&s).unwrap();
        let gt = megamoe::gpu::arena::download(&s, &state.ws.sampler.sampled).unwrap();
        let differ = common::differing_bits(&gl, wl);
        println!(
            "step {step} ({}): tokens {gt:?} eager {wt:?}; logits differing {differ} of {}",
            if step == 0 { "eager" } else { "graph" },
            gl.len()
        );
        assert!(
            differ == 0 && &gt == wt,
            "step {step}: the graph replay's logits or tokens differ from the eager EP step's"
        );
    }
    assert_eq!(state.read_error(&s).unwrap(), 0, "step error bits");
}

#[test]
#[ignore = "needs an H100/H200"]
fn ep_decode_at_world_one_equals_the_single_gpu_engine_bit_for_bit() {
    let gpu = gpu("dist_ep_world_one");
    let cfg = short_window_config();
    let (batch, context, prompt_len, steps) = (2, 48, 6, 8);
    let (seed, w, _m) = rig_weights(&gpu, "dist_ep_world_one", cfg.clone(), batch, context);
    let shape = StepShape { batch, context };
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| tokens(seed ^ (0x27 + b as u64), prompt_len, cfg.vocab_size))
        .collect();
    let mut single = DecodeState::new(&gpu, &w, shape).unwrap();
    let want = run(&gpu, &w, &mut single, None, &prompts, steps);
    drop(single);

    let mut state = DecodeState::new(&gpu, &w, shape).unwrap();
    state.ffn.poison(&gpu).unwrap();
    let mut ep = EpStep::new(&gpu, &mut state, Communicator::single()).unwrap();
    assert_eq!(ep.partition.world(), 1);
    let got = run(&gpu, &w, &mut state, Some(&mut ep), &prompts, steps);
    let mut bad = 0;
    for (step, ((gl, gt), (wl, wt))) in got.iter().zip(&want).enumerate() {
        let differ = common::differing_bits(gl, wl);
        println!(
            "step {step}: tokens EP {gt:?} single {wt:?}; logits differing {differ} of {}, cosine {:.9}, max abs {:e}",
            gl.len(),
            cosine(gl, wl),
            max_abs(gl, wl)
        );
        assert!(
            gl.iter().all(|v| v.is_finite()),
            "step {step}: non-finite logits"
        );
        bad += differ + usize::from(gt != wt);
    }
    assert_eq!(
        bad, 0,
        "the EP step at world 1 must give the single-GPU step's logits and tokens bit for bit"
    );
}

#[test]
#[ignore = "needs an H100/H200"]
fn ranks_emulated_on_one_gpu_combine_like_the_cpu_twin_and_the_single_gpu_ffn() {
    let gpu = gpu("dist_ep_ranks");
    let cfg = short_window_config();
    // 12 tokens: above moe_gemm's RowWarps limit (8), so the single-GPU half's L2 epilogue is the Cols2 kernel here
    // (the world-1 decode test above runs RowWarps at batch 2): the f32 finish must match both.
    let (batch, context) = (12, 32);
    let (seed, w, _m) = rig_weights(&gpu, "dist_ep_ranks", cfg.clone(), batch, context);
    assert_eq!(
        w.plan.map.slots, cfg.n_routed_experts,
        "the small rig holds every expert in its own slot"
    );
    let shape = StepShape { batch, context };
    let s = gpu.stream.clone();
    let mut state = DecodeState::new(&gpu, &w, shape).unwrap();
    let ids = tokens(seed ^ 0x51, batch, cfg.vocab_size);
    state.set_tokens(&s, &ids).unwrap();
    state.set_positions(&s, &vec![5; batch]).unwrap();
    // A residual of the magnitude a layer sees: 0.5 x hash values in [-1, 1).
    let n = shape.residual_elems(&cfg);
    let x: Vec<f32> = tokens(seed ^ 0x52, n, 1 << 16)
        .iter()
        .map(|&t| (t as f32 / 32768.0 - 1.0) * 0.5)
        .collect();
    let elems = batch * cfg.dim;
    let mut ep = EpStep::new(&gpu, &mut state, Communicator::single()).unwrap();
    let (mut total, mut off_by_ulp) = (0usize, 0usize);
    for layer in 0..cfg.n_layers {
        // The single-GPU FFN half.
        state.load_residual(&s, Residual::Mid, &x).unwrap();
        state.ffn.poison(&gpu).unwrap();
        state.ffn_half(&gpu, &s, &w, layer).unwrap();
        let want_x = state.read_residual(&s, Residual::Layer).unwrap();
        let want_moe: Vec<bf16> = gpu.download(&state.ffn.moe_out).unwrap();
        let shared: Vec<f32> = if state.ffn.has_shared_expert(layer) {
            megamoe::gpu::arena::download(&s, &state.ffn.shared_out)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect()
        } else {
            vec![0.0; elems]
        };

        // World 1 through the EP half: the same bits, and the partial is what the fused epilogue rounds.
        state.ffn.poison(&gpu).unwrap();
        ep.ffn_half(&mut state, &gpu, &s, &w, layer).unwrap();
        let got_x = state.read_residual(&s, Residual::Layer).unwrap();
        let got_moe: Vec<bf16> = gpu.download(&state.ffn.moe_out).unwrap();
        let p0 = gpu.download(&ep.combine.partial).unwrap();
        let differ_x = common::differing_bits(&got_x, &want_x);
        let differ_moe = got_moe
            .iter()
            .zip(&want_moe)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let twin: Vec<bf16> = combine_partials(std::slice::from_ref(&p0), &shared)
            .unwrap()
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let differ_twin = twin
            .iter()
            .zip(&want_moe)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        println!(
            "layer {layer}, W = 1: x differs in {differ_x}, moe_out in {differ_moe}, CPU combine of the partial \
             in {differ_twin} of {elems}"
        );
        assert_eq!(
            (differ_x, differ_moe, differ_twin),
            (0, 0, 0),
            "layer {layer}: world 1"
        );

        // W = 2 and 4 ranks emulated: rank r keeps its own experts (in their own slots: the full weights), every
        // other expert -1.
        for world in [2usize, 4] {
            let part = ExpertPartition::new(cfg.n_routed_experts, world).unwrap();
            let mut partials = Vec::with_capacity(world);
            for rank in 0..world {
                let table: Vec<i32> = (0..cfg.n_routed_experts)
                    .map(|e| if part.owner(e) == rank { e as i32 } else { -1 })
                    .collect();
                state.ffn.set_slot_table(&gpu, &table).unwrap();
                state.load_residual(&s, Residual::Mid, &x).unwrap();
                state.ffn.poison(&gpu).unwrap();
                let io_partial = gpu.poisoned::<f32>(elems, 0xFF).unwrap();
                {
                    let io = megamoe::engine::io::LayerIo {
                        x_in: &state.x_mid,
                        x_out: &state.x,
                        positions: &state.positions,
                        tokens: state.ws.sampler.next,
                        caches: &state.caches.layers[layer],
                        rows: &state.caches.layers[layer].rows,
                        chunk_rows: None,
                        marks: None,
                        prior_post: None,
                        defer_post: false,
                    };
                    state
                        .ffn
                        .run_to_partial(&gpu, &s, &w, layer, &io, &io_partial)
                        .unwrap();
                }
                let p = gpu.download(&io_partial).unwrap();
                assert!(
                    p.iter().all(|v| v.is_finite()),
                    "layer {layer} rank {rank}: unwritten partial"
                );
                partials.push(p);
            }
            let all = gpu.upload(&partials.concat()).unwrap();
            let d_shared = gpu.upload(&want_shared_bf16(&shared)).unwrap();
            let out = gpu.poisoned::<bf16>(elems, 0xFF).unwrap();
            let sh = state
                .ffn
                .has_shared_expert(layer)
                .then_some(&d_shared as &dyn DeviceBuf<bf16>);
            megamoe::ops::ep::combine(&gpu, &s, &all, world, elems, sh, &out).unwrap();
            let got: Vec<bf16> = gpu.download(&out).unwrap();
            let twin: Vec<bf16> = combine_partials(&partials, &shared)
                .unwrap()
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let differ_twin = got
                .iter()
                .zip(&twin)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            // Against the single-GPU MoE output: equal, or one BF16 ulp apart.
            let mut ulp = 0;
            for (i, (a, b)) in got.iter().zip(&want_moe).enumerate() {
                if a.to_bits() == b.to_bits() {
                    continue;
                }
                let (fa, fb) = (a.to_f32(), b.to_f32());
                let one_ulp = fa.abs().max(fb.abs()) * 2f32.powi(-7);
                // The reassociation moves the f32 sum by at most 12 u sum|terms| (u = 2^-24); the terms are not
                // visible here, only the rank sums, so the slack is 2^-12 (sum_r |p_r| + |shared|): room for
                // cancellation inside a rank's sum by up to 2^8.
                let scale: f32 = partials.iter().map(|p| p[i].abs()).sum::<f32>() + shared[i].abs();
                assert!(
                    (fa - fb).abs() <= one_ulp + scale * 2f32.powi(-12),
                    "layer {layer}, W = {world}, element {i}: {fa} vs the single GPU's {fb}, more than one BF16 ulp"
                );
                ulp += 1;
            }
            println!(
                "layer {layer}, W = {world}: device combine vs CPU twin differ in {differ_twin}; vs the single-GPU \
                 moe_out {ulp} of {elems} elements one BF16 ulp apart"
            );
            assert_eq!(
                differ_twin, 0,
                "layer {layer}, W = {world}: combine vs its CPU twin"
            );
            total += elems;
            off_by_ulp += ulp;
        }
        // Back to world 1's table for the next layer's EP run.
        state.ffn.set_slot_table(&gpu, &w.plan.map.table()).unwrap();
    }
    println!("emulated ranks: {off_by_ulp} of {total} elements one BF16 ulp from the single GPU");
    assert!(
        off_by_ulp * 50 <= total,
        "{off_by_ulp} of {total} elements differ from the single GPU (more than 2%)"
    );
}

fn want_shared_bf16(shared: &[f32]) -> Vec<bf16> {
    shared.iter().map(|&v| bf16::from_f32(v)).collect()
}
