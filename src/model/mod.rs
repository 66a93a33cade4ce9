//! The DeepSeek-V4 model on the CPU: geometry ([`config`]), weights (synthetic and checkpoint,
//! [`weights`], [`checkpoint`]), the reference forward pass with per-layer traces ([`reference`]), and
//! decoding: tokenizer, chat prompt, sampler and stop set ([`tokenizer`], [`chat`], [`sampler`]).
//!
//! Typical use:
//! ```no_run
//! use megamoe::model::{CachePolicy, Model, ModelConfig, Weights};
//! use megamoe::model::sampler::{generate, ModelSession, Sampler, SamplerConfig, StopSet};
//! let model = Model::new(Weights::synthetic(ModelConfig::small(), 42, CachePolicy::All)?)?;
//! let mut state = model.new_state();
//! let pre = model.prefill(&mut state, &[0, 5, 6, 7], true)?; // traces[t][layer]
//! let step = model.decode_step(&mut state, 9)?;              // step.layers[l]: every intermediate
//! let mut session = ModelSession::new(&model);
//! let mut sampler = Sampler::new(SamplerConfig::greedy())?;
//! let out = generate(&mut session, &[0, 5, 6], &mut sampler, &StopSet::dsv4_chat(1, None), 16)?;
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! Synthetic weights, the recipe a GPU fill must reproduce byte for byte (see [`weights`]):
//! `key = splitmix64(seed ^ fnv1a64(name))`, `bits(i) = splitmix64(key + i * 0x9E3779B97F4A7C15)`
//! (wrapping u64) for element `i` of the stored tensor (an I8 expert byte is one element);
//! * FP8 weight byte: `fp8_code(bits >> 56)` (NaN codes 0x7F/0xFF -> 0x7E/0xFE);
//! * FP4 expert byte: `bits >> 56` (two e2m1 nibbles, low nibble = lower K index);
//! * UE8M0 scale byte: `127 + exp_base - (bits & 1)`, `exp_base` fixed per tensor by the manifest;
//! * BF16 / F32: `offset + amp * u`, `u = ((bits >> 40) + 0.5) / 2^23 - 1`, rounded RNE to BF16;
//!   mHC base vectors add `diag` on the Sinkhorn-logit diagonal; `tid2eid[r][c] = (bits(r*k) mod E +
//!   c * (E / k)) mod E`.
//!
//! The amplitudes (manifest, [`weights::tensor_manifest`]) give unit-RMS linear outputs for unit-RMS
//! inputs, so the residual stays bounded over layers and steps (test
//! `slow_residual_rms_stays_bounded_over_256_steps`).
//!
//! Not implemented: the MTP layer (optional for decode; its tensors are ignored when a checkpoint has
//! them) and the tool-call/DSML prompt parts (their tokens are in the tokenizer; see [`tokenizer`]).

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod numerics;
pub mod reference;
pub mod sampler;
pub mod tokenizer;
pub mod weights;

/// The scalar codecs the model uses (from `crate::formats`).
pub(crate) mod codecs {
    pub use crate::formats::{e2m1, e4m3, ue8m0};
}

pub use config::{LayerKind, ModelConfig};
pub use reference::{
    AttentionFormats, DecodeState, LayerCache, LayerTrace, Model, MoeSum, PrefillOutput,
    RoutedActivations, StepOutput,
};
pub use weights::{CachePolicy, Weights};
