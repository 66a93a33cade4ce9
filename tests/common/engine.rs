//! The engine's test rig: a small model's weights on the device, its CPU twin, and a decode state.

use megamoe::engine::io::StepShape;
use megamoe::engine::plan::PlanRequest;
use megamoe::engine::step::DecodeState;
use megamoe::engine::{free_device_bytes, DeviceWeights, MemoryPlan, WeightSource};
use megamoe::gpu::Gpu;
use megamoe::model::weights::element_bits;
use megamoe::model::{CachePolicy, DecodeState as CpuState, Model, ModelConfig, Weights};
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

/// Flash (`ModelConfig::flash`) cut to its first 6 layers: two sliding-window (0, 1), two CSA (m = 4: 2, 4) and two
/// HCA (m = 128: 3, 5) layers with the real dims, heads, indexer (top-k 512), 256 routed experts, 128-token window;
/// layers 0-2 hash-routed, 3-5 biased (`num_hash_layers` 3 < 6 layers), the one MTP layer's ratio unchanged. Validated
/// as the model validates a config.
pub fn flash_layers_config() -> ModelConfig {
    let cfg = ModelConfig {
        name: "flash-6-layers".into(),
        n_layers: 6,
        compress_ratios: vec![0, 0, 4, 128, 4, 128],
        ..ModelConfig::flash()
    };
    cfg.validate().unwrap();
    assert!(cfg.num_hash_layers < cfg.n_layers);
    cfg
}

/// Where the Flash parity tests' sequences start (tests/engine_attn.rs runs 4 steps from each: positions 20-23,
/// 126-129, 148-151; tests/engine_ffn.rs 3), so that each layer kind does what it does at the real geometry:
/// * 20-23: inside the first window (no ring wrap), no HCA entry yet, a CSA entry emitted at 23 (5 -> 6 entries);
/// * 126-129: the first HCA entry is emitted at 127 (with the 32nd CSA entry) and attended from then on, and the
///   128-token window slides past position 0 at 128 (the ring holds min(context, window + 1023) entries for
///   chunked prefill, so it does not wrap here: tests/engine_prefill.rs's candidate test wraps a ring);
/// * 148-151: CSA sees 37-38 compressed entries (one emitted at 151) next to a full window, HCA its one entry.
///
/// The indexer's top-k (512) is not selective below 2048 tokens at m = 4, so every CSA row here attends to all its
/// visible entries; a selection beyond k (and its near ties) is covered by the short-window test
/// (`attention_half_matches_the_cpu_model`).
pub const FLASH_PARITY_OFFSETS: [usize; 3] = [20, 126, 148];
/// Room for the last position (151) and one HCA entry more than the runs emit (so "nothing written past the emitted
/// entries" is checked on a slot that exists).
pub const FLASH_PARITY_CONTEXT: usize = 256;

/// How the CPU model reaches a sequence's first compared position from an empty state.
#[derive(Clone, Copy, Debug)]
pub enum CpuPrefix {
    /// One `decode_step` per token (the small tests: cheap, and the state every later step continues).
    DecodeSteps,
    /// `Model::prefill` (no traces): at Flash dims, parallel over tokens and without the per-token LM head (129280
    /// rows regenerated per token under `CachePolicy::DenseOnly`). Its state equals the decode steps' up to rounding
    /// (cosine >= 0.9999, tests/model_reference.rs); the compared steps continue from it with `decode_step`, and the
    /// GPU caches are seeded from the same state, so both sides start equal.
    Prefill,
}

/// Feeds `toks` (the sequence's first tokens) to the CPU model's empty state `st` the `how` way.
pub fn advance_cpu(m: &Model, st: &mut CpuState, toks: &[u32], how: CpuPrefix) {
    if toks.is_empty() {
        return;
    }
    match how {
        CpuPrefix::DecodeSteps => {
            for &t in toks {
                m.decode_step(st, t).unwrap();
            }
        }
        CpuPrefix::Prefill => {
            m.prefill(st, toks, false).unwrap();
        }
    }
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

/// [`rig`] of [`flash_layers_config`]: the CPU model caches its dense weights only (`CachePolicy::DenseOnly`, ~3.5 GB
/// of f32; Flash's routed experts, 6 x 256 x 25M values, cannot be cached and are regenerated on every use), and the
/// device plan gets the GPU's real free memory (all 256 experts of the 6 layers fit in ~21 GB).
///
/// CPU cost, measured on 2 cores (opt-level 2): the first decode step 14 s (it dequantizes and caches the dense
/// weights), then 5.7 s a decode step (~11 core-seconds: 36 regenerated experts ~5.4, the 129280-row LM head ~6),
/// `Model::prefill` ~3.5 s a token (~7 core-seconds: no head); so ~0.7 s a decode step and ~0.45 s a prefilled token
/// on 16 cores, if the row-chunked matvecs scale.
pub fn flash_layers_rig(
    gpu: &Gpu,
    label: &str,
    batch: usize,
    context: usize,
) -> (u64, DeviceWeights, Model, DecodeState) {
    let free = free_device_bytes(gpu).unwrap();
    let (seed, w, m) = rig_weights_with(
        gpu,
        label,
        flash_layers_config(),
        StepShape { batch, context },
        CachePolicy::DenseOnly,
        free,
    );
    let state = DecodeState::new(gpu, &w, StepShape { batch, context }).unwrap();
    (seed, w, m, state)
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

/// The device memory the small rigs plan with: every small model fits in it whatever the GPU.
const SMALL_RIG_FREE_BYTES: usize = 8 << 30;

/// [`rig`] without the decode state (for an `Engine`, which builds its own): the CPU model caches every weight, the
/// plan assumes [`SMALL_RIG_FREE_BYTES`].
pub fn rig_weights(
    gpu: &Gpu,
    label: &str,
    cfg: ModelConfig,
    batch: usize,
    context: usize,
) -> (u64, DeviceWeights, Model) {
    rig_weights_with(
        gpu,
        label,
        cfg,
        StepShape { batch, context },
        CachePolicy::All,
        SMALL_RIG_FREE_BYTES,
    )
}

/// [`rig_weights`] with the CPU model's cache `policy` and the `free_bytes` the memory plan may fill (a 16-token
/// prompt allowance, FP8 indexer keys).
pub fn rig_weights_with(
    gpu: &Gpu,
    label: &str,
    cfg: ModelConfig,
    shape: StepShape,
    policy: CachePolicy,
    free_bytes: usize,
) -> (u64, DeviceWeights, Model) {
    let seed = fresh_seed(label, "MEGAMOE_SEED");
    let req = PlanRequest::new(shape.batch, shape.context, 16, free_bytes);
    let plan = MemoryPlan::new(&cfg, &req).unwrap();
    let w = DeviceWeights::load(gpu, &plan, &WeightSource::Synthetic { seed }).unwrap();
    let m = Model::new(Weights::synthetic(cfg, seed, policy).unwrap()).unwrap();
    (seed, w, m)
}
