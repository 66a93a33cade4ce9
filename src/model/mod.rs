//! The DeepSeek-V4 model on the CPU: geometry ([`config`]), weights (synthetic and checkpoint,
//! [`weights`], [`checkpoint`]), the reference forward pass with per-layer traces ([`reference`]), and
//! decoding: tokenizer, chat prompt, sampler and stop set ([`tokenizer`], [`chat`], [`sampler`]).

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
pub use reference::{DecodeState, LayerTrace, Model, PrefillOutput, StepOutput};
pub use weights::{CachePolicy, Weights};
