//! The sampler family (src/ops/sampler, kernels/sampler.cu) against the CPU model's sampler
//! (`model::sampler::Sampler::sample_at`, the exponential race at the sequence's step, stepped like `generate` by
//! `ops::sampler::reference::CpuSequence`): every sampled id, next id, status and step count equal, step after
//! step, for greedy and every option (per sequence in one batch, and alone at batch 1), the edge cases (equal,
//! -inf and NaN logits, top-k 1, top-p 1 and tiny, penalties over the prompt, stop tokens, the token budget), and
//! a captured graph (sampling + the next step's embedding) replayed on fresh logits.

mod common;

use common::head as fx;

use megamoe::gpu::arena::{download, Arena};
use megamoe::gpu::Gpu;
use megamoe::model::chat;
use megamoe::model::sampler::{ln_ieee, race_key, Sampler, SamplerConfig, StopSet};
use megamoe::ops::head::{embed_tokens, EmbedShape};
use megamoe::ops::sampler::reference::CpuSequence;
use megamoe::ops::sampler::{
    advance_positions, sample_step, state_bytes, workspace_bytes, SamplerParams, SamplerShape,
    SamplerState, SamplerWorkspace, ERR_BAD_PARAMS, ERR_NAN_LOGIT, STATUS_FAILED,
    STATUS_MAX_TOKENS, STATUS_RUNNING, STATUS_STOPPED,
};
use rand::Rng;

/// DSV4's vocabulary.
const VOCAB: usize = 129_280;

fn cfg(temperature: f32, top_k: usize, top_p: f32, penalty: f32, window: usize) -> SamplerConfig {
    SamplerConfig {
        temperature,
        top_p,
        top_k,
        repetition_penalty: penalty,
        penalty_window: window,
        seed: 0,
    }
}

/// Greedy and every option, one per sequence of a batch of 8.
fn option_sets() -> Vec<SamplerConfig> {
    vec![
        SamplerConfig::greedy(),
        cfg(0.6, 0, 1.0, 1.0, 0),
        cfg(1.3, 1, 1.0, 1.0, 0),
        cfg(0.8, 50, 1.0, 1.0, 0),
        cfg(0.7, 0, 0.9, 1.0, 0),
        cfg(1.0, 0, 1e-6, 1.0, 0),
        cfg(1.1, 300, 0.45, 1.0, 0),
        cfg(0.9, 40, 1.0, 1.3, 64),
    ]
}

// ---- CPU ------------------------------------------------------------------------------------------------------

/// The race draws from the distribution: over 40,000 steps each kept id's count is within 4.5 binomial standard
/// deviations of its probability (plain temperature at two values, top-k, top-p), and an id outside the kept set is
/// never drawn. The seed is fixed, so the test is deterministic; 4.5 sigma over ~30 counts leaves a chance below
/// 1e-4 that a correct race fails it.
#[test]
fn race_draws_follow_the_distribution() {
    let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0, 3.0, -30.0, 1.0];
    let n = 40_000u64;
    for c in [
        cfg(1.0, 0, 1.0, 1.0, 0),
        cfg(0.6, 0, 1.0, 1.0, 0),
        cfg(1.3, 3, 1.0, 1.0, 0),
        cfg(0.9, 0, 0.8, 1.0, 0),
    ] {
        let s = Sampler::new(c.clone()).unwrap();
        let d = s.distribution(&logits, &[]).unwrap();
        let mut hits = [0u64; 8];
        for step in 0..n {
            hits[s.sample_at(&logits, &[], step).unwrap() as usize] += 1;
        }
        for &(id, p) in &d {
            let p = p as f64;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            let dev = (hits[id as usize] as f64 - n as f64 * p).abs();
            assert!(
                dev <= 4.5 * sd + 1.0,
                "{c:?}: id {id} p {p:.5} drawn {}",
                hits[id as usize]
            );
        }
        for (id, &h) in hits.iter().enumerate() {
            if !d.iter().any(|x| x.0 == id as u32) {
                assert_eq!(h, 0, "{c:?}: id {id} is outside the kept set");
            }
        }
        // `sample` is `sample_at` at its own step count.
        let mut seq = Sampler::new(c.clone()).unwrap();
        for step in 0..16 {
            assert_eq!(
                seq.sample(&logits, &[]).unwrap(),
                s.sample_at(&logits, &[], step).unwrap()
            );
        }
    }
}

/// The draw's logarithm (IEEE ops and fmas only, the GPU's twin) is within 4 f32 ulps of ln over the inputs the race
/// gives it (U in [2^-24, 1), -ln U in [2^-24, 17]) and beyond; the race key is finite at both ends of the bits.
#[test]
fn race_logarithm_is_accurate_and_keys_finite() {
    let mut x = 1e-30f32;
    while x < 1e30 {
        for y in [x, x * 1.000_001, 1.0 - x.min(0.5), 1.0 + x.min(0.5)] {
            let want = (y as f64).ln();
            let got = ln_ieee(y) as f64;
            let ulp = (want.abs().max(f32::MIN_POSITIVE as f64) as f32).to_bits();
            let ulp = (f32::from_bits(ulp + 1) - f32::from_bits(ulp)) as f64;
            assert!(
                (got - want).abs() <= 4.0 * ulp.max(f32::EPSILON as f64 * 1e-7),
                "ln {y}: {got} vs {want}"
            );
        }
        x *= 1.37;
    }
    assert_eq!(ln_ieee(1.0), 0.0);
    for bits in [0u64, u64::MAX, 1 << 41, (1u64 << 63) - 1] {
        let k = race_key(1.5, 0.7, bits);
        assert!(
            k.is_finite() && (1.5f32 / 0.7 - 3.0..1.5f32 / 0.7 + 17.0).contains(&k),
            "{bits:#x}: {k}"
        );
    }
}

/// The CPU twin picks what `Sampler::sample_with_uniform` picks, stops on a stop-set member without appending
/// it, and stops at the budget before sampling.
#[test]
fn cpu_sequence_steps_like_generate() {
    let mut logits = vec![0.0f32; 16];
    logits[3] = 5.0;
    let stop = {
        let mut s = StopSet::new();
        s.insert(9, "stop");
        s
    };
    let mut seq = CpuSequence::new(SamplerConfig::greedy(), 2, &[1, 2]).unwrap();
    assert_eq!(seq.step(&logits, &stop), (3, 3));
    assert_eq!(seq.history, vec![1, 2, 3]);
    logits[9] = 9.0;
    assert_eq!(seq.step(&logits, &stop), (9, -1));
    assert_eq!(seq.status, STATUS_STOPPED);
    assert_eq!(seq.step(&logits, &stop), (-1, -1));
    let mut seq = CpuSequence::new(SamplerConfig::greedy(), 1, &[1]).unwrap();
    logits[9] = 0.0;
    assert_eq!(seq.step(&logits, &stop), (3, 3));
    assert_eq!(seq.step(&logits, &stop), (-1, -1));
    assert_eq!(seq.status, STATUS_MAX_TOKENS);
    // With a temperature, step n draws `sample_at` step n (the count of generated tokens).
    let c = cfg(1.0, 0, 1.0, 1.0, 0);
    let s = Sampler::new(c.clone()).unwrap();
    let mut seq = CpuSequence::new(c, 8, &[1]).unwrap();
    for step in 0..8 {
        let want = s.sample_at(&logits, &seq.history, step).unwrap() as i32;
        let (sampled, _) = seq.step(&logits, &StopSet::new());
        assert_eq!(sampled, want, "step {step}");
    }
}

// ---- GPU ------------------------------------------------------------------------------------------------------

/// A device sampler state for `configs.len()` sequences, each with its CPU twin.
struct Run {
    shape: SamplerShape,
    _arena: Arena,
    state: SamplerState,
    ws: SamplerWorkspace,
    cpu: Vec<CpuSequence>,
    stop: StopSet,
}

impl Run {
    fn new(
        gpu: &Gpu,
        configs: &[SamplerConfig],
        max_new: usize,
        prompts: &[Vec<u32>],
        vocab: usize,
    ) -> Run {
        let shape = SamplerShape {
            batch: configs.len(),
            vocab,
            ring_cap: 256,
        };
        let mut arena = Arena::new(gpu, state_bytes(&shape) + workspace_bytes(&shape)).unwrap();
        // Poison everything first: the state's clear / admit and the kernel must write what they use.
        arena.poison(&gpu.stream, common::POISON).unwrap();
        let mut state = SamplerState::carve(&mut arena, &shape).unwrap();
        let ws = SamplerWorkspace::carve(&mut arena, &shape).unwrap();
        state.clear(&gpu.stream).unwrap();
        let stop = StopSet::dsv4_chat(chat::EOS_ID, None);
        state.set_stop_ids(&gpu.stream, &stop.ids()).unwrap();
        let mut cpu = Vec::new();
        for (b, c) in configs.iter().enumerate() {
            let p = SamplerParams::from_config(c, max_new).unwrap();
            state.admit(&gpu.stream, b, &p, &prompts[b]).unwrap();
            cpu.push(CpuSequence::new(c.clone(), max_new, &prompts[b]).unwrap());
        }
        Run {
            shape,
            _arena: arena,
            state,
            ws,
            cpu,
            stop,
        }
    }

    /// One step on `logits` `[B, V]` on both sides; asserts every device output equals the CPU's.
    fn step(&mut self, gpu: &Gpu, logits: &[f32], label: &str) {
        let v = self.shape.vocab;
        let dev = gpu.upload(logits).unwrap();
        poison_step_outputs(gpu, &self.state);
        sample_step(gpu, &gpu.stream, &dev, &self.state, &self.ws).unwrap();
        self.compare(gpu, logits, v, label);
    }

    fn compare(&mut self, gpu: &Gpu, logits: &[f32], v: usize, label: &str) {
        let s = &gpu.stream;
        let sampled = download(s, &self.state.sampled).unwrap();
        let next = download(s, &self.state.next).unwrap();
        let status = download(s, &self.state.status).unwrap();
        let steps = download(s, &self.state.steps).unwrap();
        for (b, seq) in self.cpu.iter_mut().enumerate() {
            let want = seq.step(&logits[b * v..(b + 1) * v], &self.stop);
            let what = format!("{label}: sequence {b} ({:?})", seq.sampler.config);
            assert_eq!((sampled[b], next[b]), want, "{what}: (sampled, next)");
            assert_eq!(status[b], seq.status, "{what}: status");
            assert_eq!(steps[b] as usize, seq.generated.len(), "{what}: steps");
        }
    }
}

/// Poisons the per-step outputs before a launch: the kernel must write them for every slot.
fn poison_step_outputs(gpu: &Gpu, st: &SamplerState) {
    megamoe::gpu::arena::fill(&gpu.stream, &st.sampled, common::POISON).unwrap();
    megamoe::gpu::arena::fill(&gpu.stream, &st.next, common::POISON).unwrap();
}

/// Logits like a model's: uniform in [-8, 8) with a few dominant ids (so top-p sets are small and large).
fn random_logits(rng: &mut impl Rng, b: usize, v: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..b * v).map(|_| rng.random_range(-8.0f32..8.0)).collect();
    for row in 0..b {
        for _ in 0..4 {
            let i = rng.random_range(0..v);
            l[row * v + i] = rng.random_range(10.0f32..16.0);
        }
    }
    l
}

/// A prompt holding each row's current top ids (so the penalty changes the choice) and random ids.
fn prompt_from(rng: &mut impl Rng, logits: &[f32], v: usize) -> Vec<u32> {
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|&a, &b| logits[b].partial_cmp(&logits[a]).unwrap().then(a.cmp(&b)));
    let mut p: Vec<u32> = order[..6].iter().map(|&i| i as u32).collect();
    p.extend((0..40).map(|_| rng.random_range(2..v as u32)));
    p
}

/// `steps` steps of `run`: the first on `first`, the others on fresh [`random_logits`].
fn steps_on_fresh_logits(
    gpu: &Gpu,
    rng: &mut impl Rng,
    run: &mut Run,
    first: Vec<f32>,
    steps: usize,
    label: &str,
) {
    let mut l = first;
    for step in 0..steps {
        if step > 0 {
            l = random_logits(rng, run.shape.batch, run.shape.vocab);
        }
        run.step(gpu, &l, &format!("{label} step {step}"));
    }
}

fn seeded_configs(rng: &mut impl Rng, configs: Vec<SamplerConfig>) -> Vec<SamplerConfig> {
    configs
        .into_iter()
        .map(|c| SamplerConfig {
            seed: rng.random(),
            ..c
        })
        .collect()
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_batch_of_mixed_options_matches_cpu_step_by_step() {
    let gpu = common::gpu("gpu_batch_of_mixed_options_matches_cpu_step_by_step");
    let mut rng = common::seeded(
        "gpu_batch_of_mixed_options_matches_cpu_step_by_step",
        "SAMPLER_SEED",
    );
    let configs = seeded_configs(&mut rng, option_sets());
    let b = configs.len();
    let first = random_logits(&mut rng, b, VOCAB);
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|i| prompt_from(&mut rng, &first[i * VOCAB..(i + 1) * VOCAB], VOCAB))
        .collect();
    let mut run = Run::new(&gpu, &configs, 64, &prompts, VOCAB);
    steps_on_fresh_logits(&gpu, &mut rng, &mut run, first, 12, "batch 8");
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_each_option_alone_at_batch_1() {
    let gpu = common::gpu("gpu_each_option_alone_at_batch_1");
    let mut rng = common::seeded("gpu_each_option_alone_at_batch_1", "SAMPLER_SEED");
    for c in seeded_configs(&mut rng, option_sets()) {
        let first = random_logits(&mut rng, 1, VOCAB);
        let prompt = prompt_from(&mut rng, &first, VOCAB);
        let mut run = Run::new(&gpu, std::slice::from_ref(&c), 64, &[prompt], VOCAB);
        steps_on_fresh_logits(
            &gpu,
            &mut rng,
            &mut run,
            first,
            6,
            &format!("batch 1 {c:?}"),
        );
    }
}

/// Many draws over flat-ish logits (large top-p sets, the draw's boundaries everywhere): small vocabularies so
/// a few hundred steps stay quick.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_many_draws_small_vocab() {
    let gpu = common::gpu("gpu_many_draws_small_vocab");
    let mut rng = common::seeded("gpu_many_draws_small_vocab", "SAMPLER_SEED");
    for v in [3usize, 100, 4099] {
        let configs = seeded_configs(&mut rng, option_sets());
        let b = configs.len();
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|_| (0..20).map(|_| rng.random_range(2..v as u32)).collect())
            .collect();
        let mut run = Run::new(&gpu, &configs, 1000, &prompts, v);
        // No stop ids in these vocabularies except EOS = 1: keep it unlikely.
        for step in 0..100 {
            let mut l: Vec<f32> = (0..b * v).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            for row in 0..b {
                l[row * v + 1] = -30.0;
            }
            run.step(&gpu, &l, &format!("V={v} step {step}"));
        }
    }
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_edge_cases_match_cpu() {
    let gpu = common::gpu("gpu_edge_cases_match_cpu");
    let mut rng = common::seeded("gpu_edge_cases_match_cpu", "SAMPLER_SEED");
    let v = VOCAB;
    let configs = seeded_configs(&mut rng, option_sets());
    let b = configs.len();
    let prompts: Vec<Vec<u32>> = (0..b).map(|i| vec![5, 6, 7, 5 + i as u32]).collect();
    let mut run = Run::new(&gpu, &configs, 64, &prompts, v);
    // All equal: greedy takes id 0 (the lower id wins), the others draw over ties in id order. EOS (id 1) and
    // User are masked out so nothing stops.
    let mut l = vec![0.25f32; b * v];
    for row in 0..b {
        l[row * v + chat::EOS_ID as usize] = f32::NEG_INFINITY;
        l[row * v + chat::USER_ID as usize] = f32::NEG_INFINITY;
    }
    run.step(&gpu, &l, "all equal");
    // -inf everywhere but a handful of ids (and -0.0 / +0.0 ties among them).
    let mut l = vec![f32::NEG_INFINITY; b * v];
    for row in 0..b {
        for (j, x) in [
            (10usize, -0.0f32),
            (11, 0.0),
            (5000, 1.5),
            (v - 1, 1.5),
            (77, -3.0),
        ] {
            l[row * v + j] = x;
        }
    }
    run.step(&gpu, &l, "mostly -inf");
    // Every logit -inf: the CPU's probabilities are NaN and it returns the last candidate; greedy id 0.
    let l = vec![f32::NEG_INFINITY; b * v];
    run.step(&gpu, &l, "all -inf");
    // Penalties on the prompt's ids: ids 5, 6, 7 lead by a little, so a penalty of 1.3 reorders them.
    let mut l = random_logits(&mut rng, b, v);
    for row in 0..b {
        for (j, x) in [(5usize, 20.0f32), (6, 19.9), (7, 19.8), (8, 17.0)] {
            l[row * v + j] = x;
        }
    }
    run.step(&gpu, &l, "penalized prompt ids");
    // A stop token on top: every sequence whose choice is it stops (greedy surely).
    let mut l = random_logits(&mut rng, b, v);
    for row in 0..b {
        l[row * v + chat::USER_ID as usize] = 40.0;
    }
    run.step(&gpu, &l, "User token on top");
    let l = random_logits(&mut rng, b, v);
    run.step(&gpu, &l, "after the stop");
}

#[test]
#[ignore = "needs an H100/H200"]
fn gpu_budget_nan_and_bad_params() {
    let gpu = common::gpu("gpu_budget_nan_and_bad_params");
    let mut rng = common::seeded("gpu_budget_nan_and_bad_params", "SAMPLER_SEED");
    let v = 1000;
    let configs = seeded_configs(&mut rng, option_sets()[..3].to_vec());
    let prompts = vec![vec![2u32, 3]; 3];
    // Budget 2: two steps sample, the third ends MAX_TOKENS without sampling.
    let mut run = Run::new(&gpu, &configs, 2, &prompts, v);
    for step in 0..3 {
        let mut l = random_logits(&mut rng, 3, v);
        for row in 0..3 {
            l[row * v + 1] = -100.0;
        }
        run.step(&gpu, &l, &format!("budget step {step}"));
    }
    let status = download(&gpu.stream, &run.state.status).unwrap();
    assert!(status.iter().all(|&s| s == STATUS_MAX_TOKENS), "{status:?}");
    // A NaN logit fails that sequence only and sets the error bit.
    let mut run = Run::new(&gpu, &configs, 8, &prompts, v);
    let mut l = random_logits(&mut rng, 3, v);
    l[v + 17] = f32::NAN;
    for row in 0..3 {
        l[row * v + 1] = -100.0;
    }
    run.step(&gpu, &l, "NaN in row 1");
    let status = download(&gpu.stream, &run.state.status).unwrap();
    assert_eq!(status, vec![STATUS_RUNNING, STATUS_FAILED, STATUS_RUNNING]);
    assert_eq!(
        download(&gpu.stream, &run.state.error).unwrap()[0],
        ERR_NAN_LOGIT
    );
    // Parameters the kernel cannot honour (a window above the ring, written behind admit's check).
    let bad = SamplerParams {
        penalty_window: 1000,
        ..SamplerParams::from_config(&configs[0], 8).unwrap()
    };
    megamoe::gpu::arena::upload(&gpu.stream, &run.state.params.sub(0, 8), &bad.to_words()).unwrap();
    let dev = gpu.upload(&random_logits(&mut rng, 3, v)).unwrap();
    sample_step(&gpu, &gpu.stream, &dev, &run.state, &run.ws).unwrap();
    assert_eq!(
        download(&gpu.stream, &run.state.status).unwrap()[0],
        STATUS_FAILED
    );
    assert_eq!(
        download(&gpu.stream, &run.state.error).unwrap()[0],
        ERR_NAN_LOGIT | ERR_BAD_PARAMS
    );
    assert!(run
        .state
        .admit(&gpu.stream, 0, &bad, &[1, 2])
        .unwrap_err()
        .to_string()
        .contains("ring capacity"));
}

/// One graph = sampling step + the embedding of its `next` ids (the decode loop's tail and head). Each replay
/// samples from fresh logits written into the same buffer; the streams it embeds are the CPU's choices' rows.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_graph_sampling_feeds_the_next_embedding() {
    let gpu = common::gpu("gpu_graph_sampling_feeds_the_next_embedding");
    let mut rng = common::seeded(
        "gpu_graph_sampling_feeds_the_next_embedding",
        "SAMPLER_SEED",
    );
    let configs = seeded_configs(&mut rng, option_sets());
    let b = configs.len();
    let d = 256;
    let prompts: Vec<Vec<u32>> = (0..b).map(|_| vec![2, 3, 4]).collect();
    let mut run = Run::new(&gpu, &configs, 64, &prompts, VOCAB);
    let table = fx::random_table(&mut rng, VOCAB, d);
    let dt = gpu.upload(&table).unwrap();
    let (x, err) = fx::embed_outputs(&gpu, b, d);
    let eshape = EmbedShape {
        tokens: b,
        vocab: VOCAB,
        dim: d,
    };
    let mut logits = gpu.upload(&vec![0f32; b * VOCAB]).unwrap();
    let stream = gpu.stream.clone();
    let (state, ws) = (run.state, run.ws);
    let work = || {
        sample_step(&gpu, &stream, &logits, &state, &ws)?;
        embed_tokens(&gpu, &stream, &state.next, &dt, &eshape, &x, &err)
    };
    // Kernels resolved outside the capture (on a throwaway state copy: the run's state stays untouched).
    {
        let mut scratch = Arena::new(&gpu, state_bytes(&run.shape)).unwrap();
        let tmp = SamplerState::carve(&mut scratch, &run.shape).unwrap();
        tmp.clear(&stream).unwrap();
        sample_step(&gpu, &stream, &logits, &tmp, &ws).unwrap();
        embed_tokens(&gpu, &stream, &tmp.next, &dt, &eshape, &x, &err).unwrap();
        gpu.synchronize().unwrap();
    }
    let graph = gpu.capture(work).unwrap();
    for replay in 0..6 {
        let mut l = random_logits(&mut rng, b, VOCAB);
        if replay == 3 {
            l[chat::EOS_ID as usize] = 50.0; // sequence 0 (greedy) stops: its row becomes empty
        }
        gpu.write(&stream, &mut logits, &l).unwrap();
        graph.launch().unwrap();
        gpu.synchronize().unwrap();
        let label = format!("graph replay {replay}");
        run.compare(&gpu, &l, VOCAB, &label);
        let next = download(&stream, &run.state.next).unwrap();
        fx::assert_rows_are_table_rows(&label, &next, &table, d, &gpu.download(&x).unwrap());
    }
    assert_eq!(download(&stream, &run.state.error).unwrap()[0], 0);
    assert_eq!(gpu.download(&err).unwrap()[0], 0);
}

/// The end of a decode step: a running slot (position >= 0, next >= 0) moves one position on, a slot whose `next`
/// is -1 (stopped, or never admitted) becomes idle (-1), an idle slot stays idle whatever `next` holds.
#[test]
#[ignore = "needs an H100/H200"]
fn gpu_advance_positions_moves_running_slots_and_idles_the_rest() {
    let gpu = common::gpu("sampler_advance_positions");
    // 300 slots: more than one 128-thread block.
    let b = 300;
    let shape = SamplerShape {
        batch: b,
        vocab: 64,
        ring_cap: 8,
    };
    let mut arena = Arena::new(&gpu, state_bytes(&shape)).unwrap();
    let state = SamplerState::carve(&mut arena, &shape).unwrap();
    let positions: Vec<i32> = (0..b as i32)
        .map(|i| if i % 5 == 4 { -1 } else { 7 * i })
        .collect();
    let next: Vec<i32> = (0..b as i32)
        .map(|i| if i % 3 == 2 { -1 } else { i % 64 })
        .collect();
    megamoe::gpu::arena::upload(&gpu.stream, &state.next, &next).unwrap();
    let pos_dev = gpu.upload(&positions).unwrap();
    advance_positions(&gpu, &gpu.stream, &state, &pos_dev).unwrap();
    let got = gpu.download(&pos_dev).unwrap();
    for i in 0..b {
        let want = if positions[i] >= 0 && next[i] >= 0 {
            positions[i] + 1
        } else {
            -1
        };
        assert_eq!(
            got[i], want,
            "slot {i}: position {} next {}",
            positions[i], next[i]
        );
    }
}
