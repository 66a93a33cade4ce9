//! Decoding on several GPUs by expert parallelism (issue #27; docs/multi-gpu.md): one process (rank) per GPU, the
//! routed experts split in contiguous blocks, everything else replicated, one collective per layer (the combine).
//! The engine stays NCCL-free; this layer drives its halves.
//!
//! * [`comm`]: the rank's communicator (none in a world of one, which never loads NCCL) and the combine's transport
//!   (all-gather of the f32 partials, then `ops::ep::combine`'s rank-ordered sum).
//! * [`step`]: the expert-parallel decode step over the engine's `DecodeState` ([`step::EpStep`]).
//! * [`launch`]: the parent of a multi-rank run (GPU count check, NCCL id, the ranks' environment, spawning and
//!   waiting), and the environment a rank reads ([`launch::RankEnv`]).
//! * [`run_rank`]: one rank's decode run (`megamoe decode --ranks N`).

pub mod comm;
pub mod launch;
pub mod step;

use std::time::Instant;

use anyhow::{ensure, Context, Result};

use crate::dist::comm::Communicator;
use crate::dist::launch::RankEnv;
use crate::dist::step::EpStep;
use crate::engine::ep::ExpertPartition;
use crate::engine::io::StepShape;
use crate::engine::plan::{resolve_model, PlanRequest};
use crate::engine::step::DecodeState;
use crate::engine::{free_device_bytes, DeviceWeights, MemoryPlan, WeightSource};
use crate::gpu::{arena, Gpu};
use crate::model::sampler::SamplerConfig;
use crate::ops::sampler::SamplerParams;

/// What one rank of `megamoe decode --ranks N` runs: synthetic weights of `model` (every rank the same seed, so the
/// replicated tensors agree), `batch` random prompts of `prompt_len` tokens (the same ids on every rank), then
/// `max_new_tokens` greedy decode steps.
#[derive(Clone, Debug)]
pub struct EpDecodeRun {
    pub model: String,
    pub batch: usize,
    pub context: usize,
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    pub seed: u64,
}

/// What a rank's run measured.
#[derive(Clone, Debug)]
pub struct EpDecodeReport {
    /// The model's name and the expert slots this rank holds.
    pub model: String,
    pub slots: usize,
    /// Milliseconds per decode step (each step synchronized), in step order.
    pub step_ms: Vec<f64>,
    /// The greedy tokens of every sequence, `[steps][batch]`.
    pub tokens: Vec<Vec<i32>>,
}

/// One rank's decode run (the CLI prints rank 0's report): opens the rank's GPU, joins the world, plans with the rank's
/// expert slots (`E / W`, or fewer when they do not fit), loads the replicated dense weights and the rank's expert
/// block, prefills token by token and decodes greedily through [`EpStep`] (the first step eager, then one captured
/// graph replayed a step).
pub fn run_rank(env: &RankEnv, run: &EpDecodeRun) -> Result<EpDecodeReport> {
    let cfg = resolve_model(&run.model)?;
    let partition = ExpertPartition::new(cfg.n_routed_experts, env.world)?;
    ensure!(
        run.prompt_len >= 1 && run.prompt_len + run.max_new_tokens < run.context,
        "a prompt of {} tokens plus {} new tokens does not fit a context of {}",
        run.prompt_len,
        run.max_new_tokens,
        run.context
    );
    let gpu = Gpu::open(env.device)
        .with_context(|| format!("rank {} of {}: opening its GPU", env.rank, env.world))?;
    let comm = Communicator::new(&gpu, env.rank, env.world, env.nccl_id.as_ref())?;
    let free = free_device_bytes(&gpu)?;
    let req = PlanRequest::new(run.batch, run.context, run.prompt_len, free);
    let mut plan = MemoryPlan::new(&cfg, &req).with_context(|| {
        format!(
            "planning {} at batch {}, context {} on {}",
            cfg.name, run.batch, run.context, gpu.info.name
        )
    })?;
    // The plan sized the slots for all E experts; a rank keeps only its own block (the memory left over stays free).
    plan.map = partition.map_of(env.rank, plan.map.slots.min(partition.experts_per_rank()))?;
    let weights = DeviceWeights::load(&gpu, &plan, &WeightSource::Synthetic { seed: run.seed })?;
    let shape = StepShape {
        batch: run.batch,
        context: run.context,
    };
    let mut state = DecodeState::new(&gpu, &weights, shape)?;
    let mut ep = EpStep::new(&gpu, &mut state, comm)?;
    let s = gpu.stream.clone();
    let params = SamplerParams::from_config(&SamplerConfig::greedy(), run.max_new_tokens + 1)?;
    let prompts =
        crate::engine::run::synthetic_prompts(run.seed, run.batch, run.prompt_len, cfg.vocab_size);
    for (slot, p) in prompts.iter().enumerate() {
        state.ws.sampler.admit(&s, slot, &params, p)?;
    }
    state.set_positions(&s, &vec![0; run.batch])?;
    for i in 0..run.prompt_len {
        let ids: Vec<u32> = prompts.iter().map(|p| p[i]).collect();
        state.set_tokens(&s, &ids)?;
        if i + 1 < run.prompt_len {
            ep.prompt_step(&mut state, &gpu, &s, &weights)?;
        }
    }
    let mut report = EpDecodeReport {
        model: plan.config.name.clone(),
        slots: plan.map.slots,
        step_ms: Vec::with_capacity(run.max_new_tokens),
        tokens: Vec::with_capacity(run.max_new_tokens),
    };
    // The first step eager (it builds every lazy plan), then one captured graph replayed a step.
    let mut graph = None;
    for step in 0..run.max_new_tokens {
        if step == 1 {
            graph = Some(ep.capture_decode_step(&mut state, &gpu, &s, &weights)?);
        }
        let t0 = Instant::now();
        match &graph {
            None => ep.decode_step(&mut state, &gpu, &s, &weights)?,
            Some(g) => g
                .launch()
                .map_err(|e| anyhow::anyhow!("rank {}: step graph launch: {e:?}", env.rank))?,
        }
        gpu.synchronize()?;
        report.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        report
            .tokens
            .push(arena::download(&s, &state.ws.sampler.sampled)?);
    }
    let err = state.read_error(&s)?;
    ensure!(
        err == 0,
        "rank {}: the step's error bits {err:#x}",
        env.rank
    );
    Ok(report)
}
