//! The engine's test rig: a small model's weights on the device, its CPU twin, and a decode state.

use megamoe::engine::io::StepShape;
use megamoe::engine::plan::PlanRequest;
use megamoe::engine::step::DecodeState;
use megamoe::engine::{DeviceWeights, MemoryPlan, WeightSource};
use megamoe::gpu::Gpu;
use megamoe::model::weights::element_bits;
use megamoe::model::{CachePolicy, Model, ModelConfig, Weights};
use megamoe::ops::inputs::fresh_seed;

/// The small geometry with its window and HCA ratio cut down (24 tokens, m = 8) so that ring wrap, HCA
/// emissions and CSA top-k selection all happen within the 40 steps a CPU test can afford.
pub fn short_window_config() -> ModelConfig {
    ModelConfig {
        name: "short-window".into(),
        window_size: 24,
        compress_ratios: vec![0, 0, 4, 8, 4, 8],
        ..ModelConfig::small()
    }
}

/// `n` token ids below `vocab` from `seed`.
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (element_bits(seed, i) % vocab as u64) as u32)
        .collect()
}

/// [`rig`] of the small geometry.
pub fn small_rig(
    gpu: &Gpu,
    label: &str,
    batch: usize,
    context: usize,
) -> (u64, DeviceWeights, Model, DecodeState) {
    rig(gpu, label, ModelConfig::small(), batch, context)
}

/// Synthetic weights of `cfg` (a fresh seed, replayed with MEGAMOE_SEED) on the device and on the CPU, and a
/// decode state of `batch` sequences of `context` tokens.
pub fn rig(
    gpu: &Gpu,
    label: &str,
    cfg: ModelConfig,
    batch: usize,
    context: usize,
) -> (u64, DeviceWeights, Model, DecodeState) {
    let (seed, w, m) = rig_weights(gpu, label, cfg, batch, context);
    let state = DecodeState::new(gpu, &w, StepShape { batch, context }).unwrap();
    (seed, w, m, state)
}

/// [`rig`] without the decode state (for an `Engine`, which builds its own).
pub fn rig_weights(
    gpu: &Gpu,
    label: &str,
    cfg: ModelConfig,
    batch: usize,
    context: usize,
) -> (u64, DeviceWeights, Model) {
    let seed = fresh_seed(label, "MEGAMOE_SEED");
    let req = PlanRequest::new(batch, context, 16, 8 << 30);
    let plan = MemoryPlan::new(&cfg, &req).unwrap();
    let w = DeviceWeights::load(gpu, &plan, &WeightSource::Synthetic { seed }).unwrap();
    let m = Model::new(Weights::synthetic(cfg, seed, CachePolicy::All).unwrap()).unwrap();
    (seed, w, m)
}
