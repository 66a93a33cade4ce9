//! The FFN half of a decode layer (docs/engine.md, "The decode step", steps 12-16): `x_in` -> hc_pre + ffn_norm
//! -> router (logical -> physical expert slots) -> routed experts (moe_gemm L1, L2) + shared expert -> hc_post ->
//! `x_out`.

use crate::engine::step::{LayerIo, StepShape};
use crate::engine::weights::DeviceWeights;
use crate::gpu::arena::{Arena, WorkspaceLayout};
use crate::gpu::{Gpu, Stream};
use crate::model::ModelConfig;
use anyhow::{bail, Result};

/// The FFN half's per-layer weights (views into the dense pool and the resident experts, plus what the launchers
/// need uploaded) and its workspaces (carved once from the step's arena, shared by every layer).
pub struct FfnHalf {}

impl FfnHalf {
    /// The carves of [`FfnHalf::new`] for `shape`.
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
    ) -> Result<FfnHalf> {
        Ok(FfnHalf {})
    }

    /// Steps 12-16 of layer `layer`: reads `io.x_in`, writes `io.x_out`.
    pub fn run(
        &mut self,
        _gpu: &Gpu,
        _stream: &Stream,
        _weights: &DeviceWeights,
        layer: usize,
        _io: &LayerIo,
    ) -> Result<()> {
        bail!("the FFN half of layer {layer} is not composed yet")
    }
}
