//! The attention half of a decode layer (docs/engine.md, "The decode step", steps 1-11): `x_in` -> hc_pre +
//! attn_norm -> q/kv projections -> window ring entry, compressors, indexer top-k -> sparse attention -> output
//! projection -> hc_post -> `x_out`.

use crate::engine::step::{LayerIo, StepShape};
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::{Gpu, Stream};
use crate::model::ModelConfig;
use anyhow::{bail, Result};

/// The attention half's per-layer weights (views into the dense pool, plus what the launchers need uploaded) and
/// its workspaces (carved once from the step's arena, shared by every layer).
pub struct AttnHalf {}

impl AttnHalf {
    /// The carves of [`AttnHalf::new`] for `shape` (the largest any layer of `cfg` needs).
    pub fn layout(
        _cfg: &ModelConfig,
        _shape: &StepShape,
        _sm_count: usize,
    ) -> Result<WorkspaceLayout> {
        Ok(WorkspaceLayout::new())
    }

    pub fn new(
        _gpu: &Gpu,
        _weights: &DeviceWeights,
        _shape: &StepShape,
        _arena: &mut Arena,
    ) -> Result<AttnHalf> {
        Ok(AttnHalf {})
    }

    /// Steps 1-11 of layer `layer`: reads `io.x_in`, writes `io.x_out`, updates the layer's caches.
    pub fn run(
        &mut self,
        _gpu: &Gpu,
        _stream: &Stream,
        _weights: &DeviceWeights,
        layer: usize,
        _io: &LayerIo,
    ) -> Result<()> {
        bail!("the attention half of layer {layer} is not composed yet")
    }
}
