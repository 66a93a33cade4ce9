//! Measurement hooks of the sampler family: one [`sample_step`] of a batch of B sequences over a DSV4 vocabulary,
//! every sequence with the options of the variant, captured once and replayed back to back (the decode step's
//! form; each replay samples again from the same logits and appends to the penalty history). The sweep adapter is
//! `bench::kernels::sampler`.

use anyhow::{anyhow, bail, Result};

use super::{
    sample_step, state_bytes, workspace_bytes, SamplerParams, SamplerShape, SamplerState,
    SamplerWorkspace,
};
use crate::gpu::arena::Arena;
use crate::gpu::timing::TimingPlan;
use crate::gpu::Gpu;
use crate::model::sampler::SamplerConfig;
use crate::ops::inputs;

/// Variants of the sampler sweep: the option sets every sequence of the batch uses.
pub const VARIANTS: &[&str] = &["greedy", "temperature", "top_k50", "top_p0.9", "penalty"];

/// The options of `variant` (temperature 0.6 unless greedy; `penalty`: 1.1 over a 256-token window, top-k 50).
pub fn variant_config(variant: &str) -> Result<SamplerConfig> {
    let t = SamplerConfig {
        temperature: 0.6,
        ..Default::default()
    };
    Ok(match variant {
        "greedy" => SamplerConfig::greedy(),
        "temperature" => t,
        "top_k50" => SamplerConfig { top_k: 50, ..t },
        "top_p0.9" => SamplerConfig { top_p: 0.9, ..t },
        "penalty" => SamplerConfig {
            top_k: 50,
            repetition_penalty: 1.1,
            penalty_window: 256,
            ..t
        },
        v => bail!("sampler: unknown variant `{v}` (one of {VARIANTS:?})"),
    })
}

/// One measured point: per-repetition device times and the bytes one call reads (the logits once) plus the
/// state it touches.
pub struct Measured {
    pub samples_us: Vec<f64>,
    pub bytes: u64,
}

/// Bytes one step reads at least: the logits (f32) and the seen-token counts (u16) of every slot, once.
pub fn step_bytes(s: &SamplerShape) -> u64 {
    (s.batch * s.vocab * (4 + 2)) as u64
}

/// Time one sampling step of `batch` sequences over `vocab` seeded logits with the options of `variant`.
pub fn measure(
    gpu: &Gpu,
    plan: TimingPlan,
    variant: &str,
    batch: usize,
    vocab: usize,
    seed: u64,
) -> Result<Measured> {
    let config = variant_config(variant)?;
    let shape = SamplerShape {
        batch,
        vocab,
        ring_cap: 256,
    };
    shape.check()?;
    let logits = gpu.upload(&inputs::uniform(batch * vocab, 8.0, seed))?;
    let mut arena = Arena::new(gpu, state_bytes(&shape) + workspace_bytes(&shape))?;
    let state = SamplerState::carve(&mut arena, &shape)?;
    let ws = SamplerWorkspace::carve(&mut arena, &shape)?;
    let stream = gpu.stream.clone();
    state.clear(&stream)?;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 2017) % vocab as u32).collect();
    for b in 0..batch {
        let c = SamplerConfig {
            seed: seed ^ b as u64,
            ..config.clone()
        };
        let p = SamplerParams::from_config(&c, i32::MAX as usize)?;
        state.admit(&stream, b, &p, &prompt)?;
    }
    sample_step(gpu, &stream, &logits, &state, &ws)?;
    let g = gpu.capture(|| sample_step(gpu, &stream, &logits, &state, &ws))?;
    g.launch()
        .map_err(|e| anyhow!("sampler graph launch: {e:?}"))?;
    let bytes = step_bytes(&shape);
    Ok(Measured {
        samples_us: gpu.time_graph_us(&g, plan, 20)?,
        bytes,
    })
}
